// Test helpers of cuda_route_select.h.
#include "cuda_route_select.h"

#include "cuda/route_select.cuh"

namespace moeinfer::testing {
namespace {

constexpr int kWarpsPerBlock = 4;

template <int kPerLane>
__global__ void select_tokens(cuda::DevLayer L, int n, cuda::DevWorkspace ws) {
  extern __shared__ float keys[];  // per warp E + Z, for group-limited routing
  const int warp = static_cast<int>(threadIdx.x) / cuda::kWarp;
  const int t = static_cast<int>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= n) return;  // the whole warp
  cuda::route_token_warp<kPerLane>(L, t, ws, keys + warp * L.router_outputs);
}

}  // namespace

cudaError_t select_with_warps(const cuda::DevLayer& layer, int per_lane, int n, const cuda::DevWorkspace& ws) {
  const int blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const size_t smem = kWarpsPerBlock * sizeof(float) * static_cast<size_t>(layer.router_outputs);
  switch (per_lane) {
    case 1: select_tokens<1><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    case 2: select_tokens<2><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    case 4: select_tokens<4><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    case 8: select_tokens<8><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    case 16: select_tokens<16><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    default: return cudaErrorInvalidValue;
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? cudaDeviceSynchronize() : err;
}

}  // namespace moeinfer::testing
