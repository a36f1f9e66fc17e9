// Built instead of device.cu when the CUDA toolkit is absent.
#include "cuda/device.h"

namespace moeinfer {

CudaProbe probe_cuda() {
  CudaProbe probe;
  probe.error = "built without CUDA";
  return probe;
}

}  // namespace moeinfer
