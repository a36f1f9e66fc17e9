// libFuzzer target for the safetensors header parser: any byte string must parse or be refused
// with a Status, never crash, hang or read out of bounds. Build and run with scripts/fuzz.
#include <cstddef>
#include <cstdint>

#include "moeinfer/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeinfer;
  Result<SafetensorsFile> file = SafetensorsFile::parse(std::span<const uint8_t>(data, size), "fuzz");
  if (!file.ok()) return 0;
  for (const std::string& name : file->names()) {
    Result<TensorView> t = file->get(name);
    if (!t.ok()) __builtin_trap();  // a listed name must be readable
    if (t->numel() <= (1 << 16)) (void)t->to_floats();  // touches every byte of the tensor
  }
  return 0;
}
