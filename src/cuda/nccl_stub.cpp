// Built when there is no NCCL (or no CUDA): the sum over GPU ranks reports itself unavailable.
#include "moeinfer/cuda.h"

namespace moeinfer {

bool cuda_has_nccl() { return false; }

struct CudaAllReduce::Impl {};

CudaAllReduce::CudaAllReduce(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaAllReduce::~CudaAllReduce() = default;
int CudaAllReduce::rank() const { return 0; }
int CudaAllReduce::ranks() const { return 1; }

Result<std::unique_ptr<CudaAllReduce>> CudaAllReduce::create() {
  return unavailable("this build has no NCCL (expert parallelism on GPUs needs nccl.h and libnccl from the CUDA "
                     "toolkit or the nvidia-nccl package; reconfigure with -DNCCL_ROOT=...)");
}

Status CudaAllReduce::sum(float*, int64_t, void*) const { return unavailable("this build has no NCCL"); }

}  // namespace moeinfer
