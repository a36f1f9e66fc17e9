// Test helpers of cuda_smem_poison.h.
#include "cuda_smem_poison.h"

namespace moeinfer::testing {
namespace {

__global__ void fill_shared_memory(int bytes) {
  extern __shared__ uint4 smem[];
  for (int i = static_cast<int>(threadIdx.x); i < bytes / 16; i += static_cast<int>(blockDim.x)) {
    smem[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
  }
}

__global__ void copy_shared_memory(uint32_t* out, int words) {
  extern __shared__ uint32_t smem_words[];
  for (int i = static_cast<int>(threadIdx.x); i < words; i += static_cast<int>(blockDim.x)) out[i] = smem_words[i];
}

}  // namespace

cudaError_t poison_shared_memory(cudaStream_t stream) {
  int device = 0, sms = 0, bytes = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(fill_shared_memory, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  fill_shared_memory<<<4 * sms, 1024, bytes, stream>>>(bytes);
  return cudaGetLastError();
}

cudaError_t read_unwritten_shared_memory(uint32_t* out, int words) {
  uint32_t* dev = nullptr;
  const size_t bytes = static_cast<size_t>(words) * sizeof(uint32_t);
  cudaError_t err = cudaMalloc(&dev, bytes);
  if (err != cudaSuccess) return err;
  copy_shared_memory<<<1, 256, bytes>>>(dev, words);
  err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpy(out, dev, bytes, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  return err;
}

}  // namespace moeinfer::testing
