// libFuzzer target for the config.json parser: any text (and any hf_quant_config.json text after
// the first NUL byte) must parse into a valid layer or be refused with a Status, never crash,
// hang, overflow or read out of bounds. Build and run with scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "moeinfer/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeinfer;
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t nul = all.find('\0');
  const std::string_view config = all.substr(0, nul), quant = nul == std::string_view::npos ? "" : all.substr(nul + 1);
  Result<ModelConfig> m = parse_model_config(config, quant);
  if (!m.ok()) return 0;
  if (!validate(m->desc).ok()) __builtin_trap();  // an accepted config describes a valid layer
  for (int l : m->moe_layers) {
    if (l < 0 || l >= m->num_layers) __builtin_trap();
  }
  return 0;
}
