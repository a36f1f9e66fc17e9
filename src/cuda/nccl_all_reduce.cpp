// CudaAllReduce over NCCL (built when CMake finds NCCL beside the CUDA toolkit): one
// communicator over the job's ranks, its unique id sent from rank 0 through MPI.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstring>

#include "moeinfer/cuda.h"
#include "moeinfer/ep.h"

namespace moeinfer {

bool cuda_has_nccl() { return true; }

namespace {

Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return {};
  return Status(StatusCode::kInternal, fmt::format("{}: {}", what, ncclGetErrorString(r)));
}

}  // namespace

struct CudaAllReduce::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int ranks = 1;
  ~Impl() {
    if (comm != nullptr) ncclCommDestroy(comm);
  }
};

CudaAllReduce::CudaAllReduce(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaAllReduce::~CudaAllReduce() = default;
int CudaAllReduce::rank() const { return impl_->rank; }
int CudaAllReduce::ranks() const { return impl_->ranks; }

Result<std::unique_ptr<CudaAllReduce>> CudaAllReduce::create() {
  auto impl = std::make_unique<Impl>();
  impl->rank = ep_rank();
  impl->ranks = ep_size();
  // Rank 0 makes the id; a failure there travels with it, so no rank waits for a communicator
  // that cannot come.
  struct Message {
    int32_t ok = 0;
    ncclUniqueId id{};
  } message;
  ncclResult_t made = ncclSuccess;
  if (impl->rank == 0) {
    made = ncclGetUniqueId(&message.id);
    message.ok = made == ncclSuccess ? 1 : 0;
  }
  MOEINFER_RETURN_IF_ERROR(ep_broadcast(&message, sizeof(message)));
  if (made != ncclSuccess) return nccl_status(made, "ncclGetUniqueId");
  if (message.ok == 0) return Status(StatusCode::kInternal, "rank 0 could not make the NCCL unique id");
  MOEINFER_RETURN_IF_ERROR(
      nccl_status(ncclCommInitRank(&impl->comm, impl->ranks, message.id, impl->rank), "ncclCommInitRank"));
  return std::unique_ptr<CudaAllReduce>(new CudaAllReduce(std::move(impl)));
}

Status CudaAllReduce::sum(float* data, int64_t count, void* stream) const {
  if (data == nullptr || count < 0) return invalid_argument("CudaAllReduce::sum: null data or negative count");
  return nccl_status(ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat, ncclSum, impl_->comm,
                                   static_cast<cudaStream_t>(stream)),
                     "ncclAllReduce of the partial outputs");
}

}  // namespace moeinfer
