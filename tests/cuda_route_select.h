// Test helpers: the CUDA backend's one-warp selection (src/cuda/route_select.cuh) run directly on
// given logits, so that tests can compare it with the reference choice by choice.
#pragma once

#include <cuda_runtime.h>

#include "cuda/moe_kernels.cuh"

namespace moeinfer::testing {

// cuda::route_token_warp on n tokens' logits ([n, E + Z], host memory), one warp per token, with
// kPerLane = per_lane (1, 2, 4, 8 or 16; 32 * per_lane >= E + Z). `layer` carries the routing
// fields; its correction_bias_values are taken from `bias` ([E + Z] host floats, or null).
// Writes ids and weights ([n, top_k], host memory), which are poisoned on the device first.
cudaError_t select_with_warps(cuda::DevLayer layer, int per_lane, const float* logits, const float* bias, int n,
                              int* ids, float* weights);

}  // namespace moeinfer::testing
