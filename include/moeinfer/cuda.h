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
#include "moeinfer/ep.h"
#include "moeinfer/plan.h"
#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer {

struct CudaMoeOptions {
  std::optional<PathKind> path;  // force a path; nullopt lets plan() choose
  // Expert parallelism (DESIGN.md section 6): rank `rank` of `ranks` uploads and runs only its
  // slice of the routed experts (expert_slice in ep.h); rank 0 also the shared expert and the
  // zero experts. forward() then writes this rank's partial output; CudaAllReduce sums them.
  int rank = 0;
  int ranks = 1;
  // Expert-major GEMMs with one token tile per work item: true forces the staged kernels (64 rows
  // per block, the block's activations staged in shared memory, in slices of 1024 columns where
  // the whole 8 x K bf16 would pass 48 KB), false the split-K kernels (16 rows per block, 4 warps
  // splitting K); nullopt chooses per call by grid size, and never the sliced staging (slower
  // wherever it was measured, docs/PERF.md v3.11).
  std::optional<bool> staged = std::nullopt;
  // The staged expert-major down (neither sliced nor copying scale codes): the 64-row passes each
  // block makes over the activations it stages once, 1, 2 or 4 forced; nullopt chooses per call.
  std::optional<int> staged_passes = std::nullopt;
  // The staged expert-major kernels that have both (all but the sliced and scale-copying
  // kernels): how many chunks ahead of their MMAs their K loops over NVFP4 weights load, 1 or 2
  // forced; nullopt: two in layers with NVFP4 experts (but one for a down of two token tiles per
  // item where the call averages 12 or more routes per expert), else one.
  std::optional<int> staged_ahead = std::nullopt;
  // Expert-major calls of one token tile per item: true runs the experts with more than 8 routes in
  // the call (hot experts; the shared expert from 9 tokens) as items of up to 16 routes in the
  // two-tile staged kernels, on a second stream beside the others' kernels, wherever the call has
  // more than 8 tokens; false never; nullopt where the routed experts average 2 routes or more and
  // each expert's weights take 8 MB or more (cuda::expert_major_mixed). true is refused at create
  // where the staged kernels are forbidden or the layer's down cannot stage its activations whole.
  std::optional<bool> mixed_tiles = std::nullopt;
  // Expert-major calls in a layer with a shared expert: true runs the shared expert's gate_up and
  // down in a chain of their own on another stream, forked before the router and joined before the
  // blend, so that its weights are read while the router and the selection run; false in the
  // call's own kernels, after the selection; nullopt apart in calls of up to 8 tokens whose shared
  // expert's weights take 8 MB or more, unless the gate_up kernel selects for itself
  // (cuda::expert_major_shared_apart). true is refused at create for a layer
  // without a shared expert.
  std::optional<bool> shared_apart = std::nullopt;
  // Expert-major calls on one stream: true launches the gate_up while the route kernel (or the
  // router, where gate_up selects) still runs (programmatic dependent launch), its blocks waiting
  // for that kernel's end before they read anything (cuda::expert_major_early_gate_up); nullopt
  // does so in calls of one token only; false launches it after that kernel ends.
  std::optional<bool> early_gate_up = std::nullopt;
  // Expert-major calls on one stream: true or nullopt launches the down while gate_up's last blocks
  // still run (programmatic dependent launch), its blocks loading their first weights before they
  // wait for gate_up's activations (cuda::expert_major_early_down); where gate_up selects (one
  // token), only the fused down and blend, whose blocks first wait for the items that gate_up's
  // block (0, 0) publishes (cuda::expert_major_published_down). false launches it after gate_up ends.
  std::optional<bool> early_down = std::nullopt;
  // Expert-major calls whose down is staged and launched during gate_up: true or nullopt lets each
  // down block start on its work item as soon as that item's gate_up blocks have stored its
  // activations (a count per item, cuda::expert_major_item_release), not when gate_up's whole grid
  // ends; false makes every down block wait for the grid.
  std::optional<bool> item_release = std::nullopt;
  // The router's logits on the tensor cores (x split into three bf16 parts, fp32 sums): true
  // forces them for calls of up to 512 tokens (larger ones run the CUDA-core kernels), false
  // forbids them; nullopt runs them from 16 tokens where their grid holds 3/8 of a block per SM.
  // They need a BF16 router whose rows are a multiple of 8 columns: forcing them on another is
  // refused at create.
  std::optional<bool> router_mma = std::nullopt;
  // Expert weights in tiles of 16 rows x 64 bytes (1 KB each, one chunk of the expert-major K
  // loop for one warp), NVFP4 block scales with them (128 bytes per tile), rather than the
  // checkpoint's row-major layout, wherever a matrix is whole tiles (rows a multiple of 16, rows of
  // a multiple of 64 bytes): nullopt tiles them where every call runs expert-major, true wherever
  // they fit (the token-major and per-row kernels read tiles too, more slowly), false never. The
  // arithmetic is the same either way: only where the bytes lie changes. call_config says which
  // layout the experts have.
  std::optional<bool> weight_tiles = std::nullopt;
};

class CudaMoe {
 public:
  // Uploads the routed experts (loading them from the layer's loader as needed), the router
  // and the shared expert to the current device, and plans scratch for max_tokens tokens.
  // Under expert parallelism only this rank's experts are loaded and uploaded. `progress` counts
  // two steps per expert: 1 .. S as the S experts are loaded (on all threads, in any order), then
  // S + 1 .. 2S as they are uploaded.
  static Result<std::unique_ptr<CudaMoe>> create(const Layer& layer, int64_t max_tokens,
                                                 const CudaMoeOptions& options, const ProgressFn& progress = {});
  static Result<std::unique_ptr<CudaMoe>> create(const Layer& layer, int64_t max_tokens,
                                                 std::optional<PathKind> path = std::nullopt,
                                                 const ProgressFn& progress = {});
  ~CudaMoe();
  CudaMoe(const CudaMoe&) = delete;
  CudaMoe& operator=(const CudaMoe&) = delete;

  // x: device [n, H] fp32, 16-byte aligned where H % 8 == 0 (cudaMalloc's pointers are); out:
  // device [n, H] fp32; stream: a cudaStream_t (nullptr = default).
  Status forward(const float* x, int64_t n, float* out, void* stream) const;

  const Plan& plan() const;
  // The kernels a call of n tokens launches, one line: the path, and for expert-major the routes
  // per work item and each GEMM's kernel ("8 routes/item, gate_up split-K, down staged+scales";
  // "+scales": NVFP4 scale codes staged in shared memory too; "+slices": the activations staged
  // a slice at a time; "staged x2", "x4": each block makes 2 or 4 passes of 64 rows over one staging),
  // then the experts' layout ("weight tiles", "row-major weights", or "weight tiles (T of M
  // matrices)") and the router's kernel.
  std::string call_config(int64_t n) const;
  const LayerDesc& desc() const;
  int rank() const;   // CudaMoeOptions::rank
  int ranks() const;  // CudaMoeOptions::ranks
  uint64_t layer_id() const;       // the Layer::id() it was made from
  int64_t weight_bytes() const;    // device bytes of the uploaded weights
  int64_t workspace_bytes() const;

 private:
  struct Impl;
  explicit CudaMoe(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- expert parallelism over NCCL -------------------------------------------------------------

// GPUs this process can see (0 without a driver or device).
int cuda_device_count();

// This build sums over GPU ranks with NCCL (found beside the CUDA toolkit when configured).
bool cuda_has_nccl();

// Makes this rank's GPU current: local rank r of a host (ep_local_rank in ep.h) takes device r.
// A named error when the host has fewer GPUs than ranks. Call it before anything else touches
// the GPU.
Status cuda_use_rank_device();

// The sum of the ranks' partial outputs: one NCCL communicator over every rank of the job
// (ep_rank/ep_size; a single rank when no MPI job runs), on the current device. create() is
// collective: every rank calls it. In a build without NCCL it returns "unavailable".
class CudaAllReduce {
 public:
  static Result<std::unique_ptr<CudaAllReduce>> create();
  ~CudaAllReduce();
  CudaAllReduce(const CudaAllReduce&) = delete;
  CudaAllReduce& operator=(const CudaAllReduce&) = delete;

  // In place: data (device, `count` floats) becomes the sum over the ranks. Enqueued on `stream`
  // (a cudaStream_t) without host synchronisation, so it can be captured in a CUDA graph; every
  // rank must make the same calls in the same order.
  Status sum(float* data, int64_t count, void* stream) const;
  int rank() const;
  int ranks() const;

 private:
  struct Impl;
  explicit CudaAllReduce(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The host-memory Backend under expert parallelism: this rank's slice on its GPU
// (cuda_use_rank_device first), the partial outputs summed by CudaAllReduce; every rank returns
// the whole layer output. With `stats`, the all-reduce is timed into it (stats must outlive the
// backend).
Result<std::unique_ptr<Backend>> make_cuda_ep_backend(std::optional<PathKind> path, EpStats* stats = nullptr);

// ---- measurement (the benchmark's instruments) ----------------------------------------------

// Name of the current device, e.g. "NVIDIA H200".
Result<std::string> cuda_device_name();
// Streaming read bandwidth of the current device in GB/s: a reduction over `bytes` of device
// memory, the median of several timed passes.
Result<double> cuda_read_bandwidth(int64_t bytes = int64_t{4} << 30);
// The bf16 tensor-core peak of the current device in TFLOP/s: cuBLAS multiplying random bf16
// matrices of kCudaPeakGemmSize^3 with float accumulation, the median of several timed rounds.
// The product is checked against the host at a few entries first, so a GEMM that did not run
// cannot pass for a fast one.
inline constexpr int kCudaPeakGemmSize = 8192;
Result<double> cuda_bf16_peak_tflops(int size = kCudaPeakGemmSize);
// Median microseconds per forward of `n` tokens, timed with CUDA events over CUDA-graph replays:
// one graph per token batch (each [n, H] floats, host memory), replayed in rotation so routing
// and experts change from call to call; `reps` rounds over all batches, the median round counts.
// With `reduce`, each graph also sums the ranks' outputs (the expert-parallel call); every rank
// must then time the same batches.
Result<double> cuda_time_forward(const CudaMoe& moe, const std::vector<std::vector<float>>& batches, int64_t n,
                                 int reps, const CudaAllReduce* reduce = nullptr);
// Median microseconds of the all-reduce alone over `count` floats, timed like cuda_time_forward.
Result<double> cuda_time_all_reduce(const CudaAllReduce& reduce, int64_t count, int reps);

// The host-memory Backend over CudaMoe: uploads a layer on first use (again when a different
// layer or a larger N comes), copies x in and the result out.
Result<std::unique_ptr<Backend>> make_cuda_backend(std::optional<PathKind> path);

}  // namespace moeinfer
