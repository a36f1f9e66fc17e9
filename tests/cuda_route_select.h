// Test helpers: the CUDA backend's one-warp selection (src/cuda/route_select.cuh) run directly on
// given logits, so that tests can compare it with the reference choice by choice.
#pragma once

#include <cuda_runtime.h>

#include "cuda/moe_kernels.cuh"

namespace moeinfer::testing {

// cuda::route_token_warp on n tokens, one warp per token, with kPerLane = per_lane (1, 2, 4, 8 or
// 16; 32 * per_lane >= E + Z): from ws.logits ([n, E + Z], device memory) into ws.ids and
// ws.weights ([n, top_k]). `layer` carries the routing fields (correction_bias_values on the
// device where it has any). Waits for the kernel.
cudaError_t select_with_warps(const cuda::DevLayer& layer, int per_lane, int n, const cuda::DevWorkspace& ws);

}  // namespace moeinfer::testing
