#include "moeinfer/layer.h"

#include <fmt/format.h>

#include <cmath>

namespace moeinfer {

const char* family_name(Family family) {
  switch (family) {
    case Family::kQwen2Moe: return "qwen2_moe";
    case Family::kQwen3Moe: return "qwen3_moe";
    case Family::kQwen3Next: return "qwen3_next";
    case Family::kOlmoe: return "olmoe";
    case Family::kMixtral: return "mixtral";
    case Family::kDeepseekV3: return "deepseek_v3";
    case Family::kGlm4Moe: return "glm4_moe";
    case Family::kMinimaxM2: return "minimax_m2";
    case Family::kLongcatFlash: return "longcat_flash";
    case Family::kGptOss: return "gpt_oss";
    case Family::kLlama4: return "llama4";
  }
  return "?";
}

const char* score_func_name(ScoreFunc f) {
  switch (f) {
    case ScoreFunc::kSoftmax: return "softmax";
    case ScoreFunc::kSigmoid: return "sigmoid";
    case ScoreFunc::kLogits: return "logits";
  }
  return "?";
}

const char* weight_func_name(WeightFunc f) {
  switch (f) {
    case WeightFunc::kScore: return "score";
    case WeightFunc::kSoftmaxOfSelected: return "softmax_of_selected";
    case WeightFunc::kSigmoidOfSelected: return "sigmoid_of_selected";
  }
  return "?";
}

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kSiluGated: return "silu-gated";
    case Activation::kGptOssClamped: return "gpt-oss clamped swiglu";
  }
  return "?";
}

LayerDesc family_layer(Family family, const FamilyShape& shape) {
  LayerDesc d;
  d.family = family;
  d.hidden = shape.hidden;
  d.intermediate = shape.intermediate;
  d.num_experts = shape.num_experts;
  d.num_zero_experts = shape.num_zero_experts;
  d.top_k = shape.top_k;
  d.shared_intermediate = shape.shared_intermediate;
  RoutingDesc& r = d.routing;
  switch (family) {
    case Family::kQwen2Moe:
    case Family::kQwen3Moe:
    case Family::kQwen3Next:
    case Family::kOlmoe:
      r.score = ScoreFunc::kSoftmax;
      r.renormalize = shape.norm_topk_prob;  // no epsilon in these blocks
      d.shared_gate = d.has_shared();        // Qwen's shared expert is always sigmoid-gated
      break;
    case Family::kMixtral:
      r.score = ScoreFunc::kSoftmax;
      r.renormalize = true;
      break;
    case Family::kDeepseekV3:
    case Family::kGlm4Moe:
      r.score = ScoreFunc::kSigmoid;
      r.correction_bias = true;
      r.n_group = shape.n_group;
      r.topk_group = shape.topk_group;
      r.renormalize = shape.norm_topk_prob;
      r.renorm_epsilon = 1e-20;
      r.scaling = shape.routed_scaling_factor;
      break;
    case Family::kMinimaxM2:
      r.score = ScoreFunc::kSigmoid;
      r.correction_bias = true;
      r.renormalize = true;
      break;
    case Family::kLongcatFlash:
      r.score = ScoreFunc::kSoftmax;
      r.correction_bias = true;
      r.scaling = shape.routed_scaling_factor;
      break;
    case Family::kGptOss:
      r.score = ScoreFunc::kLogits;
      r.weight = WeightFunc::kSoftmaxOfSelected;
      r.router_bias = true;
      d.activation = Activation::kGptOssClamped;
      d.expert_bias = true;
      break;
    case Family::kLlama4:
      r.score = ScoreFunc::kLogits;
      r.weight = WeightFunc::kSigmoidOfSelected;
      r.weight_on_input = true;
      break;
  }
  return d;
}

namespace {

// Bounds that keep every size product far inside int64 and every allocation sane.
constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr int kMaxExperts = 1 << 16;

Status check_nvfp4_multiple(const char* field, int64_t value) {
  if (value % kNvfp4Group != 0) {
    return invalid_argument(
        fmt::format("{} {} is not a multiple of the NVFP4 group {}", field, value, kNvfp4Group));
  }
  return {};
}

}  // namespace

Status validate(const LayerDesc& d) {
  if (d.hidden <= 0 || d.hidden > kMaxDim) {
    return invalid_argument(fmt::format("hidden_size must be in [1, {}] (got {})", kMaxDim, d.hidden));
  }
  if (d.intermediate <= 0 || d.intermediate > kMaxDim) {
    return invalid_argument(
        fmt::format("moe_intermediate_size must be in [1, {}] (got {})", kMaxDim, d.intermediate));
  }
  if (d.num_experts <= 0 || d.num_experts > kMaxExperts) {
    return invalid_argument(
        fmt::format("num_experts must be in [1, {}] (got {})", kMaxExperts, d.num_experts));
  }
  if (d.num_zero_experts < 0 || d.num_zero_experts > kMaxExperts) {
    return invalid_argument(fmt::format("zero_expert_num must be in [0, {}] (got {})", kMaxExperts,
                                        d.num_zero_experts));
  }
  if (d.top_k <= 0) return invalid_argument(fmt::format("top_k must be positive (got {})", d.top_k));
  if (d.top_k > d.router_outputs()) {
    if (d.num_zero_experts == 0) {
      return invalid_argument(fmt::format("top_k ({}) > num_experts ({})", d.top_k, d.num_experts));
    }
    return invalid_argument(fmt::format("top_k ({}) > num_experts + zero experts ({} + {} = {})",
                                        d.top_k, d.num_experts, d.num_zero_experts,
                                        d.router_outputs()));
  }
  if (d.shared_intermediate < 0 || d.shared_intermediate > kMaxDim) {
    return invalid_argument(fmt::format("shared_expert_intermediate_size must be in [0, {}] (got {})",
                                        kMaxDim, d.shared_intermediate));
  }
  if (d.shared_gate && !d.has_shared()) {
    return invalid_argument("shared_gate is set but there is no shared expert (shared_intermediate 0)");
  }

  const RoutingDesc& r = d.routing;
  if (r.score == ScoreFunc::kLogits && r.weight == WeightFunc::kScore) {
    return invalid_argument(
        "score function 'logits' needs weights 'softmax_of_selected' or 'sigmoid_of_selected'");
  }
  if (r.score != ScoreFunc::kLogits && r.weight != WeightFunc::kScore) {
    return unsupported(fmt::format("weights '{}' with score function '{}': no model routes this way",
                                   weight_func_name(r.weight), score_func_name(r.score)));
  }
  if (r.n_group < 1) return invalid_argument(fmt::format("n_group must be positive (got {})", r.n_group));
  if (r.topk_group < 1 || r.topk_group > r.n_group) {
    return invalid_argument(
        fmt::format("topk_group ({}) must be in [1, n_group ({})]", r.topk_group, r.n_group));
  }
  if (r.n_group > 1) {
    if (d.num_zero_experts > 0) {
      return unsupported(fmt::format("group-limited routing (n_group {}) with zero experts ({})",
                                     r.n_group, d.num_zero_experts));
    }
    if (d.num_experts % r.n_group != 0) {
      return invalid_argument(
          fmt::format("num_experts ({}) is not a multiple of n_group ({})", d.num_experts, r.n_group));
    }
    const int group_size = d.num_experts / r.n_group;
    if (group_size < 2) {
      return invalid_argument(fmt::format(
          "group-limited routing scores a group by its 2 best experts, but num_experts ({}) / "
          "n_group ({}) = {}",
          d.num_experts, r.n_group, group_size));
    }
    if (d.top_k > r.topk_group * group_size) {
      return invalid_argument(fmt::format("top_k ({}) > topk_group ({}) x experts per group ({}) = {}",
                                          d.top_k, r.topk_group, group_size,
                                          r.topk_group * group_size));
    }
  }
  if (!std::isfinite(r.renorm_epsilon) || r.renorm_epsilon < 0) {
    return invalid_argument(fmt::format("renormalisation epsilon must be >= 0 (got {})", r.renorm_epsilon));
  }
  if (!std::isfinite(r.scaling) || r.scaling <= 0) {
    return invalid_argument(
        fmt::format("routed_scaling_factor must be positive and finite (got {})", r.scaling));
  }
  if (d.activation == Activation::kGptOssClamped) {
    if (!std::isfinite(d.swiglu_limit) || d.swiglu_limit <= 0) {
      return invalid_argument(fmt::format("swiglu_limit must be positive (got {})", d.swiglu_limit));
    }
    if (!std::isfinite(d.swiglu_alpha)) {
      return invalid_argument(fmt::format("swiglu alpha must be finite (got {})", d.swiglu_alpha));
    }
  }
  return {};
}

Status validate(const LayerDesc& d, QuantSpec spec) {
  MOEINFER_RETURN_IF_ERROR(validate(d));
  if (spec.format == WeightFormat::kNVFP4) {
    // Every expert matrix is quantized along its input: H for gate/up, I for down.
    MOEINFER_RETURN_IF_ERROR(check_nvfp4_multiple("hidden_size", d.hidden));
    MOEINFER_RETURN_IF_ERROR(check_nvfp4_multiple("moe_intermediate_size", d.intermediate));
    if (d.has_shared()) {
      MOEINFER_RETURN_IF_ERROR(
          check_nvfp4_multiple("shared_expert_intermediate_size", d.shared_intermediate));
    }
  }
  return {};
}

std::string describe_shape(const LayerDesc& d) {
  std::string s = fmt::format("hidden {}, intermediate {}, experts {}", d.hidden, d.intermediate,
                              d.num_experts);
  if (d.num_zero_experts > 0) s += fmt::format(" + {} zero", d.num_zero_experts);
  s += fmt::format(" (top-{})", d.top_k);
  if (d.has_shared()) {
    s += fmt::format(", shared {}{}", d.shared_intermediate, d.shared_gate ? " (sigmoid-gated)" : "");
  } else {
    s += ", no shared expert";
  }
  s += fmt::format(", {}{}", activation_name(d.activation), d.expert_bias ? " with biases" : "");
  return s;
}

std::string describe_routing(const LayerDesc& d) {
  const RoutingDesc& r = d.routing;
  std::string s = fmt::format("{} over {}", score_func_name(r.score), d.router_outputs());
  if (r.router_bias) s += " (router bias)";
  if (r.correction_bias) s += ", choose by score + correction bias";
  if (r.n_group > 1) s += fmt::format(", best {} of {} groups", r.topk_group, r.n_group);
  s += fmt::format(", top-{}", d.top_k);
  if (r.weight != WeightFunc::kScore) s += fmt::format(", weights {}", weight_func_name(r.weight));
  if (r.renormalize) s += r.renorm_epsilon > 0 ? fmt::format(", renormalised (+{:g})", r.renorm_epsilon)
                                               : ", renormalised";
  if (r.scaling != 1.0) s += fmt::format(", x{:g}", r.scaling);
  if (r.weight_on_input) s += ", weight scales the expert input";
  return s;
}

}  // namespace moeinfer
