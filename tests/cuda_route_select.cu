// Test helpers of cuda_route_select.h.
#include "cuda_route_select.h"

#include <cstdint>

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

__device__ uint64_t mix(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ bool same_float(float a, float b) {
  return __float_as_uint(a) == __float_as_uint(b) || (isnan(a) && isnan(b));
}

__global__ void compare_quotients(long long pairs, unsigned long long* counts) {
  unsigned long long differ = 0, product_differs = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const uint64_t r = mix(static_cast<uint64_t>(i));
    const uint32_t mantissa = static_cast<uint32_t>(r) & 0x7FFFFFu;
    // x: exponent field 0 (subnormal) to 126, i.e. below 1; every 16th an edge case.
    float x = __uint_as_float((static_cast<uint32_t>((r >> 32) % 127) << 23) | mantissa);
    switch ((r >> 40) % 64) {
      case 0: x = 1.0f; break;
      case 1: x = 0.0f; break;
      case 2: x = __uint_as_float(0x3F800000u - 1u - static_cast<uint32_t>((r >> 48) % 4096)); break;
      case 3: x = __uint_as_float(0x7FC00000u); break;
      default: break;
    }
    // d: [1, 4096), every 8th a power of two.
    const uint32_t d_mantissa = (r >> 56) % 8 == 0 ? 0u : static_cast<uint32_t>(r >> 9) & 0x7FFFFFu;
    const float d = __uint_as_float(((127u + static_cast<uint32_t>((r >> 52) % 12)) << 23) | d_mantissa);
    const float inverse = __frcp_rn(d);
    const float want = x / d;
    // divide_scores on x beside a value in range, and beside a subnormal (its plain division).
    const float beside = (r >> 20) % 2 == 0 ? 0.5f : 0x1p-130f;
    float both[2] = {beside, x};
    cuda::divide_scores(both, d);
    differ += same_float(cuda::softmax_quotient(x, d, inverse), want) ? 0 : 1;
    differ += same_float(both[1], want) && same_float(both[0], beside / d) ? 0 : 1;
    product_differs += same_float(__fmul_rn(x, inverse), want) ? 0 : 1;
  }
  atomicAdd(counts, differ);
  atomicAdd(counts + 1, product_differs);
}

}  // namespace

cudaError_t count_quotient_mismatches(long long pairs, unsigned long long& differ,
                                      unsigned long long& product_differs) {
  unsigned long long* counts = nullptr;
  cudaError_t err = cudaMalloc(&counts, 2 * sizeof(unsigned long long));
  if (err != cudaSuccess) return err;
  unsigned long long host[2] = {~0ull, ~0ull};
  err = cudaMemset(counts, 0, 2 * sizeof(unsigned long long));
  if (err == cudaSuccess) {
    compare_quotients<<<1024, 256>>>(pairs, counts);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpy(host, counts, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(counts);
  differ = host[0];
  product_differs = host[1];
  return err;
}

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
