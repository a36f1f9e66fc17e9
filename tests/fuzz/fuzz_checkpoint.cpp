// libFuzzer target for the checkpoint loader: an input is config.json, a NUL byte,
// hf_quant_config.json (may be empty), a NUL byte, and the bytes of model.safetensors. They are
// written into a directory of this process, opened as a checkpoint, and its first MoE layer is
// loaded whole (router, shared expert, every routed expert) and run by the reference on one
// token. Any input must load or be refused with a Status: never crash, hang, overflow or read out
// of bounds. Build and run with scripts/fuzz (seeds: tiny checkpoints of three layouts).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "moeinfer/checkpoint.h"
#include "moeinfer/reference.h"

namespace {

void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeinfer;
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("moeinfer-fuzz-checkpoint-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t first = all.find('\0');
  if (first == std::string_view::npos) return 0;
  const size_t second = all.find('\0', first + 1);
  if (second == std::string_view::npos) return 0;
  write_file(dir / "config.json", all.substr(0, first));
  const std::string_view quant = all.substr(first + 1, second - first - 1);
  if (quant.empty()) {
    std::filesystem::remove(dir / "hf_quant_config.json");
  } else {
    write_file(dir / "hf_quant_config.json", quant);
  }
  write_file(dir / "model.safetensors", all.substr(second + 1));

  Result<Checkpoint> ckpt = Checkpoint::open(dir.string());
  if (!ckpt.ok()) return 0;
  const LayerDesc& d = ckpt->config().desc;
  if (d.hidden > 4096 || d.num_experts > 256) return 0;  // keep each run small
  // The first MoE layer that loads (the seeds' layer 0 may have no tensors).
  Result<Layer> layer = invalid_argument("no MoE layer loads");
  for (int l : ckpt->config().moe_layers) {
    layer = ckpt->load_layer(l);
    if (layer.ok()) break;
  }
  if (!layer.ok()) return 0;
  for (int e = 0; e < d.num_experts; ++e) {
    if (!layer->expert(e).ok()) return 0;
  }
  std::vector<float> x(static_cast<size_t>(d.hidden), 0.25f), out(static_cast<size_t>(d.hidden));
  (void)moe_forward_reference(*layer, x, 1, out);
  return 0;
}
