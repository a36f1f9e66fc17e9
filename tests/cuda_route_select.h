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

// cuda::softmax_quotient(x, d, RN(1 / d)) and cuda::divide_scores (on x beside 0.5, or beside
// a subnormal that takes its plain division) against IEEE division's x / d on `pairs`
// pseudo-random pairs: x in [0, 1] over every exponent down to the subnormals (with 0, 1, values
// just under 1 and NaN among them), d in [1, 4096) (with its powers of two). `differ` gets how
// many of the two forms' floats differ bit for bit (two NaNs agree); `product_differs`, as a
// control that the comparison sees a last-bit difference, how many differ for the plain product
// RN(x RN(1 / d)). Waits for the kernel.
cudaError_t count_quotient_mismatches(long long pairs, unsigned long long& differ,
                                      unsigned long long& product_differs);

}  // namespace moeinfer::testing
