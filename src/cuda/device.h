// What the CUDA runtime can see, as plain C++ (no CUDA types), so CPU-only code can ask.
#pragma once

#include <string>

namespace moeinfer {

struct CudaProbe {
  bool compiled = false;  // this build has the CUDA backend sources
  int device_count = 0;
  std::string name;       // device 0
  int sm_major = 0;
  int sm_minor = 0;
  bool kernels_runnable = false;  // this build has kernel images for device 0
  std::string error;      // why device_count is 0, when it is
};

// Never fails: a machine without a driver or device reports device_count 0 with the reason.
CudaProbe probe_cuda();

}  // namespace moeinfer
