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

// Device memory that frees itself.
template <class T>
struct Buffer {
  T* ptr = nullptr;
  explicit Buffer(size_t count) { cudaMalloc(&ptr, count * sizeof(T) + 1); }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

}  // namespace

cudaError_t select_with_warps(cuda::DevLayer layer, int per_lane, const float* logits, const float* bias, int n,
                              int* ids, float* weights) {
  const size_t outputs = static_cast<size_t>(layer.router_outputs), routes = static_cast<size_t>(n) * layer.top_k;
  Buffer<float> d_logits(n * outputs), d_bias(outputs), d_weights(routes);
  Buffer<int> d_ids(routes);
  if (d_logits.ptr == nullptr || d_bias.ptr == nullptr || d_weights.ptr == nullptr || d_ids.ptr == nullptr) {
    return cudaErrorMemoryAllocation;
  }
  cudaError_t err = cudaMemcpy(d_logits.ptr, logits, n * outputs * sizeof(float), cudaMemcpyHostToDevice);
  if (err == cudaSuccess && bias != nullptr) err = cudaMemcpy(d_bias.ptr, bias, outputs * sizeof(float), cudaMemcpyHostToDevice);
  if (err == cudaSuccess) err = cudaMemset(d_ids.ptr, 0xFF, routes * sizeof(int));
  if (err == cudaSuccess) err = cudaMemset(d_weights.ptr, 0xFF, routes * sizeof(float));  // NaN
  if (err != cudaSuccess) return err;
  layer.correction_bias_values = bias != nullptr ? d_bias.ptr : nullptr;
  cuda::DevWorkspace ws;
  ws.logits = d_logits.ptr;
  ws.ids = d_ids.ptr;
  ws.weights = d_weights.ptr;
  const int blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const size_t smem = kWarpsPerBlock * sizeof(float) * outputs;
  switch (per_lane) {
    case 1: select_tokens<1><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    case 2: select_tokens<2><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    case 4: select_tokens<4><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    case 8: select_tokens<8><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    case 16: select_tokens<16><<<blocks, kWarpsPerBlock * cuda::kWarp, smem>>>(layer, n, ws); break;
    default: return cudaErrorInvalidValue;
  }
  err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(ids, d_ids.ptr, routes * sizeof(int), cudaMemcpyDeviceToHost);
  if (err == cudaSuccess) err = cudaMemcpy(weights, d_weights.ptr, routes * sizeof(float), cudaMemcpyDeviceToHost);
  return err;
}

}  // namespace moeinfer::testing
