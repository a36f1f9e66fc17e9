// The description of one MoE layer (DESIGN.md sections 1 and 2): shapes, routing, activation,
// shared expert. It holds no weights; see weights.h for those.
//
// Per token x (hidden size H):
//   logits   = router(x) (+ router bias)                      [E + Z]
//   (ids, w) = select(logits)                                  k ids, k weights (RoutingDesc)
//   routed   = sum_j w_j * expert_{ids_j}(x)                   ids >= E are identity experts
//   out      = routed + gate * shared(x)                       gate = sigmoid(g . x) or 1
// with expert(x) = down(act(gate_proj x, up_proj x)).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "moeinfer/format.h"
#include "moeinfer/status.h"

namespace moeinfer {

// The model families whose MoE blocks we reproduce. Used to fill a LayerDesc with the
// family's routing rules and for display; the math itself reads only LayerDesc's fields.
enum class Family : uint8_t {
  kQwen2Moe,
  kQwen3Moe,
  kQwen3Next,
  kOlmoe,
  kMixtral,
  kDeepseekV3,  // also Kimi-K2, which uses the DeepSeek-V3 architecture
  kGlm4Moe,
  kMinimaxM2,
  kLongcatFlash,
  kGptOss,
  kLlama4,
};
const char* family_name(Family family);  // the Hugging Face model_type, e.g. "qwen3_next"

// How router logits become scores s (over all E + Z router outputs).
enum class ScoreFunc : uint8_t {
  kSoftmax,  // s = softmax(logits) over E + Z, fp32 or better
  kSigmoid,  // s = sigmoid(logits)
  kLogits,   // s = logits (gpt-oss, Llama-4: weights come from the chosen logits)
};

// How the k chosen experts get their weights.
enum class WeightFunc : uint8_t {
  kScore,              // w_j = s_{id_j}, the unbiased score
  kSoftmaxOfSelected,  // w = softmax over the k chosen logits (gpt-oss)
  kSigmoidOfSelected,  // w_j = sigmoid(logit_{id_j}) (Llama-4)
};

enum class Activation : uint8_t {
  kSiluGated,      // silu(g) * u
  kGptOssClamped,  // g = min(g, limit); u = clamp(u, -limit, limit); (u + 1) * g * sigmoid(alpha g)
};

const char* score_func_name(ScoreFunc f);
const char* weight_func_name(WeightFunc f);
const char* activation_name(Activation a);

struct RoutingDesc {
  ScoreFunc score = ScoreFunc::kSoftmax;
  WeightFunc weight = WeightFunc::kScore;
  bool router_bias = false;      // logits += router.bias (gpt-oss)
  bool correction_bias = false;  // experts are chosen by s + e_score_correction_bias
  // Group-limited selection (DeepSeek-V3): the E routed experts form n_group equal groups;
  // a group's score is the sum of its two best selection keys; only the topk_group best groups
  // stay candidates, the others' keys become -inf. n_group == 1 turns this off.
  int n_group = 1;
  int topk_group = 1;
  bool renormalize = false;     // w /= (sum(w) + renorm_epsilon)
  double renorm_epsilon = 0.0;  // 1e-20 for DeepSeek-V3, 0 elsewhere
  double scaling = 1.0;         // routed_scaling_factor, applied after renormalisation
  bool weight_on_input = false; // Llama-4: w scales the expert input, the output is summed as is
};

struct LayerDesc {
  Family family = Family::kQwen3Moe;
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I, per routed expert
  int num_experts = 0;       // E routed experts with weights
  int num_zero_experts = 0;  // Z identity experts (LongCat-Flash), router ids E .. E+Z-1
  int top_k = 0;
  RoutingDesc routing;
  Activation activation = Activation::kSiluGated;
  float swiglu_alpha = 1.702f;  // kGptOssClamped only
  float swiglu_limit = 7.0f;    // kGptOssClamped only
  bool expert_bias = false;     // biases on gate, up and down (gpt-oss)
  int64_t shared_intermediate = 0;  // 0: no shared expert
  bool shared_gate = false;         // out += sigmoid(g . x) * shared(x) (Qwen families)

  int router_outputs() const { return num_experts + num_zero_experts; }
  bool has_shared() const { return shared_intermediate > 0; }
};

// The shape and routing knobs that a family's config.json carries. family_layer() turns them
// into a LayerDesc with the family's fixed routing rules (DESIGN.md section 2 table).
struct FamilyShape {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int num_experts = 0;
  int top_k = 0;
  int num_zero_experts = 0;
  int64_t shared_intermediate = 0;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  int n_group = 1;
  int topk_group = 1;
};
LayerDesc family_layer(Family family, const FamilyShape& shape);

// Every rule that makes a description meaningful. Returns the first violation, named, e.g.
// "top_k (12) > num_experts (8)".
Status validate(const LayerDesc& desc);
// validate(desc), plus what the weight format needs, e.g.
// "hidden_size 100 is not a multiple of the NVFP4 group 16".
Status validate(const LayerDesc& desc, QuantSpec spec);

// One line: "hidden 2048, intermediate 512, experts 512 (top-10), shared 512 (gated)".
std::string describe_shape(const LayerDesc& desc);
// One line: "softmax, top-k, renormalised" etc.
std::string describe_routing(const LayerDesc& desc);

}  // namespace moeinfer
