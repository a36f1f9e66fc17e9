// The layers every expert-parallel test splits over ranks: uneven slices, ranks whose experts get
// no route or that own no expert, and the shared and zero experts, which must be added once.
#pragma once

#include <cstdint>
#include <vector>

#include "moeinfer/presets.h"

namespace moeinfer::testing {

struct EpCase {
  const char* name;
  Family family;
  FamilyShape shape;
  int64_t tokens;
};

inline std::vector<EpCase> ep_cases() {
  return {
      {"shared_gated", Family::kQwen3Next, {.hidden = 64, .intermediate = 32, .num_experts = 10, .top_k = 3, .shared_intermediate = 32}, 5},
      {"zero_experts", Family::kLongcatFlash, {.hidden = 32, .intermediate = 16, .num_experts = 7, .top_k = 4, .num_zero_experts = 4, .norm_topk_prob = false, .routed_scaling_factor = 6.0}, 6},
      // 40 tokens: more than the 32 routes an expert-major work item takes.
      {"groups", Family::kDeepseekV3, {.hidden = 32, .intermediate = 16, .num_experts = 16, .top_k = 4, .shared_intermediate = 16, .routed_scaling_factor = 2.5, .n_group = 4, .topk_group = 2}, 40},
      {"input_scaled", Family::kLlama4, {.hidden = 32, .intermediate = 16, .num_experts = 5, .top_k = 1, .shared_intermediate = 16}, 3},
      {"biases", Family::kGptOss, {.hidden = 32, .intermediate = 16, .num_experts = 6, .top_k = 2}, 4},
      // One token, one route: every rank but one has nothing to do.
      {"idle_ranks", Family::kMixtral, {.hidden = 32, .intermediate = 16, .num_experts = 16, .top_k = 1}, 1},
      // Fewer experts than ranks at 3 ranks: a rank owns none.
      {"empty_slice", Family::kMixtral, {.hidden = 32, .intermediate = 16, .num_experts = 2, .top_k = 2}, 3},
  };
}

}  // namespace moeinfer::testing
