// Built instead of the .cu files when the CUDA toolkit is absent: every CUDA entry point
// reports that this build has no CUDA.
#include "cuda/device.h"
#include "moeinfer/cuda.h"

namespace moeinfer {

CudaProbe probe_cuda() {
  CudaProbe probe;
  probe.error = "built without CUDA";
  return probe;
}

namespace {
Status no_cuda() { return unavailable("this build has no CUDA support (nvcc was not found when it was configured)"); }
}  // namespace

struct CudaMoe::Impl {
  LayerDesc desc;
  Plan plan;
};

CudaMoe::CudaMoe(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaMoe::~CudaMoe() = default;
Result<std::unique_ptr<CudaMoe>> CudaMoe::create(const Layer&, int64_t, std::optional<PathKind>, const ProgressFn&) {
  return no_cuda();
}
Result<std::unique_ptr<CudaMoe>> CudaMoe::create(const Layer&, int64_t, const CudaMoeOptions&, const ProgressFn&) {
  return no_cuda();
}
Status CudaMoe::forward(const float*, int64_t, float*, void*) const { return no_cuda(); }
const Plan& CudaMoe::plan() const { return impl_->plan; }
std::string CudaMoe::call_config(int64_t) const { return ""; }
const LayerDesc& CudaMoe::desc() const { return impl_->desc; }
uint64_t CudaMoe::layer_id() const { return 0; }
int CudaMoe::rank() const { return 0; }
int CudaMoe::ranks() const { return 1; }
int64_t CudaMoe::weight_bytes() const { return 0; }
int64_t CudaMoe::workspace_bytes() const { return 0; }

Result<std::unique_ptr<Backend>> make_cuda_backend(std::optional<PathKind>) { return no_cuda(); }
Result<std::unique_ptr<Backend>> make_cuda_ep_backend(std::optional<PathKind>, EpStats*) { return no_cuda(); }
int cuda_device_count() { return 0; }
Status cuda_use_rank_device() { return no_cuda(); }
Result<std::string> cuda_device_name() { return no_cuda(); }
Result<double> cuda_read_bandwidth(int64_t) { return no_cuda(); }
Result<double> cuda_bf16_peak_tflops(int) { return no_cuda(); }
Result<double> cuda_time_forward(const CudaMoe&, const std::vector<std::vector<float>>&, int64_t, int,
                                 const CudaAllReduce*) {
  return no_cuda();
}
Result<double> cuda_time_all_reduce(const CudaAllReduce&, int64_t, int) { return no_cuda(); }

}  // namespace moeinfer
