// The CUDA backend's device-level API: a layer uploaded once, forward on device pointers with an
// explicit stream. No CUDA types here: the stream is passed as void* (a cudaStream_t).
//
// forward() never synchronises with the host and never branches on device data, so it can be
// captured in a CUDA graph and replayed with new inputs (any n <= max_tokens, fixed at capture).
// In a build without CUDA every call returns an "unavailable" status.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moeinfer/backend.h"
#include "moeinfer/plan.h"
#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer {

class CudaMoe {
 public:
  // Uploads every routed expert (loading them from the layer's loader as needed), the router
  // and the shared expert to the current device, and plans scratch for max_tokens tokens.
  static Result<std::unique_ptr<CudaMoe>> create(const Layer& layer, int64_t max_tokens,
                                                 std::optional<PathKind> path = std::nullopt,
                                                 const ProgressFn& progress = {});
  ~CudaMoe();
  CudaMoe(const CudaMoe&) = delete;
  CudaMoe& operator=(const CudaMoe&) = delete;

  // x: device [n, H] fp32; out: device [n, H] fp32; stream: a cudaStream_t (nullptr = default).
  Status forward(const float* x, int64_t n, float* out, void* stream) const;

  const Plan& plan() const;
  const LayerDesc& desc() const;
  uint64_t layer_id() const;       // the Layer::id() it was made from
  int64_t weight_bytes() const;    // device bytes of the uploaded weights
  int64_t workspace_bytes() const;

 private:
  struct Impl;
  explicit CudaMoe(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- measurement (the benchmark's instruments) ----------------------------------------------

// Name of the current device, e.g. "NVIDIA H200".
Result<std::string> cuda_device_name();
// Streaming read bandwidth of the current device in GB/s: a reduction over `bytes` of device
// memory, the median of several timed passes.
Result<double> cuda_read_bandwidth(int64_t bytes = int64_t{4} << 30);
// Median microseconds per forward of `n` tokens, timed with CUDA events over CUDA-graph replays:
// one graph per token batch (each [n, H] floats, host memory), replayed in rotation so routing
// and experts change from call to call; `reps` rounds over all batches, the median round counts.
Result<double> cuda_time_forward(const CudaMoe& moe, const std::vector<std::vector<float>>& batches, int64_t n,
                                 int reps);

// The host-memory Backend over CudaMoe: uploads a layer on first use (again when a different
// layer or a larger N comes), copies x in and the result out.
Result<std::unique_ptr<Backend>> make_cuda_backend(std::optional<PathKind> path);

}  // namespace moeinfer
