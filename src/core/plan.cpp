#include "moeinfer/plan.h"

#include <fmt/format.h>

namespace moeinfer {

const char* path_name(PathKind path) {
  switch (path) {
    case PathKind::kTokenMajor: return "token-major";
    case PathKind::kPerRow: return "per-row";
    case PathKind::kExpertMajor: return "expert-major";
  }
  return "?";
}

Result<PathKind> parse_path(std::string_view name) {
  for (PathKind p : {PathKind::kTokenMajor, PathKind::kPerRow, PathKind::kExpertMajor}) {
    if (name == path_name(p)) return p;
  }
  return invalid_argument(fmt::format("unknown path '{}' (expected expert-major, token-major or per-row)", name));
}

std::string Plan::explain() const {
  std::string s = crossover > 1 ? fmt::format("path {} below {} tokens, {} from {} to {} tokens ({})", path_name(small_path),
                                              crossover, path_name(path), crossover, max_tokens, config)
                                : fmt::format("path {} for up to {} tokens ({})", path_name(path), max_tokens, config);
  for (const std::string& r : reasons) s += "\n  - " + r;
  return s;
}

namespace {

// Why token-major cannot run this layer, or "" when it can.
std::string token_major_refusal(const LayerDesc& d) {
  const auto misaligned = [](const char* what, int64_t v) {
    return fmt::format("{} {} is not a multiple of {} (token-major loads {} weights at a time)", what, v,
                       kTokenMajorVector, kTokenMajorVector);
  };
  if (d.hidden % kTokenMajorVector != 0) return misaligned("hidden_size", d.hidden);
  if (d.intermediate % kTokenMajorVector != 0) return misaligned("moe_intermediate_size", d.intermediate);
  if (d.has_shared() && d.shared_intermediate % kTokenMajorVector != 0) {
    return misaligned("shared_expert_intermediate_size", d.shared_intermediate);
  }
  return "";
}

// Why expert-major cannot run this layer, or "" when it can.
std::string expert_major_refusal(const LayerDesc& d) {
  const auto misaligned = [](const char* what, int64_t v) {
    return fmt::format("{} {} is not a multiple of {} (expert-major runs 16 x 16 MMA tiles)", what, v,
                       kExpertMajorAlign);
  };
  if (d.hidden % kExpertMajorAlign != 0) return misaligned("hidden_size", d.hidden);
  if (d.intermediate % kExpertMajorAlign != 0) return misaligned("moe_intermediate_size", d.intermediate);
  if (d.has_shared() && d.shared_intermediate % kExpertMajorAlign != 0) {
    return misaligned("shared_expert_intermediate_size", d.shared_intermediate);
  }
  return "";
}

const char* path_config(PathKind path) {
  switch (path) {
    case PathKind::kTokenMajor: return "router 8 rows/block; gate_up, down: 1 row/warp, 16 B loads, fp32 act";
    case PathKind::kPerRow: return "router 8 rows/block; gate_up, down: 128 thr/route, scalar loads";
    case PathKind::kExpertMajor:
      return "router 8 rows/block; routes grouped by expert; gate_up, down: mma.sync m16n8k16 bf16, "
             "16 rows x 8 routes/block (32 past 8 routes/expert, 16 where both K <= 3008), 4-way split K, 16 B loads, "
             "NVFP4 in pair order; at 8 routes/item, 32+ items and 8+ 64-row blocks per SM: 64 rows/block, "
             "a warp per 16 rows over all K <= 3008, activations staged in shared memory (forced: in 1024-column slices past it)";
  }
  return "?";
}

}  // namespace

Result<Plan> plan_cuda(const LayerDesc& d, QuantSpec spec, int64_t max_tokens, const DeviceDesc& device,
                       std::optional<PathKind> forced) {
  MOEINFER_RETURN_IF_ERROR(validate(d, spec));
  if (max_tokens < 1) return invalid_argument(fmt::format("max_tokens must be positive (got {})", max_tokens));
  if (device.sm_major < 9) {
    return unsupported(fmt::format("the CUDA paths are built for sm_90a (Hopper); this device is sm_{}{}",
                                   device.sm_major, device.sm_minor));
  }
  // Every path shares the router kernel, which keeps the logits of one token in shared memory.
  if (d.router_outputs() > kCudaMaxRouterOutputs) {
    return unsupported(fmt::format("router of {} outputs: the CUDA router holds at most {}", d.router_outputs(),
                                   kCudaMaxRouterOutputs));
  }
  if (d.top_k > kCudaMaxTopK) {
    return unsupported(fmt::format("top_k {}: the CUDA router selects at most {}", d.top_k, kCudaMaxTopK));
  }
  if (d.routing.n_group > kCudaMaxGroups) {
    return unsupported(fmt::format("n_group {}: the CUDA router handles at most {}", d.routing.n_group, kCudaMaxGroups));
  }

  Plan p;
  p.max_tokens = max_tokens;
  const auto configure = [&](PathKind path) {
    p.path = p.small_path = path;
    p.crossover = 1;
    p.config = path_config(path);
  };
  const std::string token_major = token_major_refusal(d);
  const std::string expert_major = expert_major_refusal(d);
  if (forced) {
    const std::string& refusal = *forced == PathKind::kTokenMajor    ? token_major
                                 : *forced == PathKind::kExpertMajor ? expert_major
                                                                     : std::string();
    if (!refusal.empty()) return unsupported(fmt::format("path {} cannot run this layer: {}", path_name(*forced), refusal));
    configure(*forced);
    p.reasons.push_back(fmt::format("{} forced by the caller", path_name(*forced)));
    return p;
  }
  if (expert_major.empty()) {
    configure(PathKind::kExpertMajor);
    p.reasons.push_back(fmt::format("expert-major: each distinct expert's weights read once per call, "
                                    "up to {} tokens x top-{} routes sharing them on tensor cores",
                                    max_tokens, d.top_k));
    if (token_major.empty() && kExpertMajorCrossover > 1) {
      p.small_path = PathKind::kTokenMajor;
      p.crossover = kExpertMajorCrossover;
      p.reasons.push_back(fmt::format("token-major below {} tokens, where it measured faster", kExpertMajorCrossover));
    }
    return p;
  }
  p.reasons.push_back("expert-major refused: " + expert_major);
  if (token_major.empty()) {
    configure(PathKind::kTokenMajor);
    p.reasons.push_back(fmt::format("token-major: {} tokens x top-{} = {} routes, each expert row read by one warp",
                                    max_tokens, d.top_k, max_tokens * d.top_k));
    return p;
  }
  configure(PathKind::kPerRow);
  p.reasons.push_back("token-major refused: " + token_major);
  p.reasons.push_back("per-row runs any shape");
  return p;
}

}  // namespace moeinfer
