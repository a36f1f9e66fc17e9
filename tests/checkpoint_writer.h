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

// One small layer of each family, as the checkpoint tests write them.
struct FamilyCase {
  const char* name;
  const char* model_type;
  Family family;
  FamilyShape shape;
};

inline std::vector<FamilyCase> families() {
  return {
      {"qwen3_next", "qwen3_next", Family::kQwen3Next, {.hidden = 64, .intermediate = 32, .num_experts = 8, .top_k = 3, .shared_intermediate = 48}},
      {"qwen3_moe", "qwen3_moe", Family::kQwen3Moe, {.hidden = 48, .intermediate = 32, .num_experts = 8, .top_k = 2}},
      {"qwen2_moe", "qwen2_moe", Family::kQwen2Moe, {.hidden = 32, .intermediate = 16, .num_experts = 6, .top_k = 2, .shared_intermediate = 64, .norm_topk_prob = false}},
      {"olmoe", "olmoe", Family::kOlmoe, {.hidden = 32, .intermediate = 32, .num_experts = 8, .top_k = 4, .norm_topk_prob = false}},
      {"mixtral", "mixtral", Family::kMixtral, {.hidden = 48, .intermediate = 64, .num_experts = 4, .top_k = 2}},
      {"deepseek_v3", "deepseek_v3", Family::kDeepseekV3, {.hidden = 64, .intermediate = 32, .num_experts = 16, .top_k = 4, .shared_intermediate = 32, .routed_scaling_factor = 2.5, .n_group = 4, .topk_group = 2}},
      {"kimi_k2", "kimi_k2", Family::kDeepseekV3, {.hidden = 32, .intermediate = 16, .num_experts = 12, .top_k = 4, .shared_intermediate = 16, .routed_scaling_factor = 2.827}},
      {"glm4_moe", "glm4_moe", Family::kGlm4Moe, {.hidden = 48, .intermediate = 16, .num_experts = 10, .top_k = 4, .shared_intermediate = 16, .routed_scaling_factor = 2.5}},
      {"minimax_m2", "minimax_m2", Family::kMinimaxM2, {.hidden = 32, .intermediate = 32, .num_experts = 8, .top_k = 3}},
      {"longcat_flash", "longcat_flash", Family::kLongcatFlash, {.hidden = 64, .intermediate = 16, .num_experts = 8, .top_k = 4, .num_zero_experts = 4, .norm_topk_prob = false, .routed_scaling_factor = 6.0}},
      {"gpt_oss", "gpt_oss", Family::kGptOss, {.hidden = 32, .intermediate = 48, .num_experts = 6, .top_k = 2}},
      {"llama4", "llama4", Family::kLlama4, {.hidden = 32, .intermediate = 16, .num_experts = 4, .top_k = 1, .shared_intermediate = 16}},
  };
}

// The model has two decoder layers; layer 1 is the MoE layer holding `layer`'s weights (layer 0
// is dense where the family can say so, and otherwise also MoE, with no tensors written).
Status write_test_checkpoint(const std::string& dir, const Layer& layer, const CheckpointSpec& spec);

}  // namespace moeinfer::testing
