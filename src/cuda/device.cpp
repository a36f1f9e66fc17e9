#include <cuda_runtime.h>

#include "cuda/device.h"
#include "cuda/moe_kernels.cuh"

namespace moeinfer {

CudaProbe probe_cuda() {
  CudaProbe probe;
  probe.compiled = true;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    probe.error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    return probe;
  }
  if (count == 0) {
    probe.error = "cudaGetDeviceCount returned 0";
    return probe;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    probe.error = "cudaGetDeviceProperties failed for device 0";
    return probe;
  }
  probe.device_count = count;
  probe.name = prop.name;
  probe.sm_major = prop.major;
  probe.sm_minor = prop.minor;
  probe.kernels_runnable = cuda::kernels_runnable();
  return probe;
}

}  // namespace moeinfer
