// Writes tiny Hugging Face checkpoints for tests: the real tensor names and config fields of each
// family, in each quantized layout, from a synthetic Layer. It restates DESIGN.md section 4
// independently of the loader, so that a naming or layout mistake in one shows up against the
// other.
#pragma once

#include <string>

#include "moeinfer/layer.h"
#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer::testing {

enum class Layout {
  kBf16,               // plain BF16 (fused 3D tensors for gpt-oss and Llama-4)
  kModelOptNvfp4,      // quantization_config in config.json
  kModelOptNvfp4Hf,    // hf_quant_config.json instead
  kCompressedNvfp4,    // compressed-tensors nvfp4-pack-quantized
  kDeepseekFp8,        // fp8 block-128, weight_scale_inv
};
const char* layout_name(Layout l);
QuantSpec layout_spec(Layout l);

struct CheckpointSpec {
  std::string model_type;  // e.g. "kimi_k2" for a DeepSeek-V3-architecture config
  Layout layout = Layout::kBf16;
  int shards = 1;          // > 1 writes model.safetensors.index.json
};

// The model has two decoder layers; layer 1 is the MoE layer holding `layer`'s weights (layer 0
// is dense where the family can say so, and otherwise also MoE, with no tensors written).
Status write_test_checkpoint(const std::string& dir, const Layer& layer, const CheckpointSpec& spec);

}  // namespace moeinfer::testing
