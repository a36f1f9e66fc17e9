// The benchmark's CUDA instruments: read bandwidth, and forward time over graph replays.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "cuda/moe_kernels.cuh"
#include "moeinfer/cuda.h"

namespace moeinfer {

namespace {

Status check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return {};
  return Status(StatusCode::kInternal, fmt::format("{}: {}", what, cudaGetErrorString(err)));
}

// Frees what it holds on every path out of a function.
struct Cleanup {
  std::vector<void*> device;
  std::vector<cudaGraphExec_t> execs;
  std::vector<cudaGraph_t> graphs;
  std::vector<cudaEvent_t> events;
  cudaStream_t stream = nullptr;
  ~Cleanup() {
    for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
    for (cudaGraph_t g : graphs) cudaGraphDestroy(g);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (void* p : device) cudaFree(p);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

Result<std::string> cuda_device_name() {
  int device = 0;
  MOEINFER_RETURN_IF_ERROR(check(cudaGetDevice(&device), "cudaGetDevice"));
  cudaDeviceProp prop{};
  MOEINFER_RETURN_IF_ERROR(check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"));
  return std::string(prop.name);
}

Result<double> cuda_read_bandwidth(int64_t bytes) {
  Cleanup c;
  MOEINFER_RETURN_IF_ERROR(check(cudaStreamCreate(&c.stream), "cudaStreamCreate"));
  void* data = nullptr;
  void* sink = nullptr;
  MOEINFER_RETURN_IF_ERROR(check(cudaMalloc(&data, static_cast<size_t>(bytes)), "cudaMalloc (bandwidth buffer)"));
  c.device.push_back(data);
  // Several blocks per SM keep enough loads in flight to saturate HBM.
  int sms = 0;
  MOEINFER_RETURN_IF_ERROR(check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SM count"));
  const int blocks = sms * 8;
  MOEINFER_RETURN_IF_ERROR(check(cudaMalloc(&sink, static_cast<size_t>(blocks) * sizeof(float)), "cudaMalloc (sink)"));
  c.device.push_back(sink);
  MOEINFER_RETURN_IF_ERROR(check(cudaMemsetAsync(data, 0, static_cast<size_t>(bytes), c.stream), "cudaMemset"));
  cudaEvent_t start, stop;
  MOEINFER_RETURN_IF_ERROR(check(cudaEventCreate(&start), "cudaEventCreate"));
  c.events.push_back(start);
  MOEINFER_RETURN_IF_ERROR(check(cudaEventCreate(&stop), "cudaEventCreate"));
  c.events.push_back(stop);
  const int64_t count = bytes / 16;
  std::vector<double> gbps;
  for (int i = 0; i < 7; ++i) {
    MOEINFER_RETURN_IF_ERROR(check(cudaEventRecord(start, c.stream), "cudaEventRecord"));
    MOEINFER_RETURN_IF_ERROR(check(cuda::launch_stream_read(static_cast<const float4*>(data), count,
                                                            static_cast<float*>(sink), blocks, c.stream),
                                   "stream_read"));
    MOEINFER_RETURN_IF_ERROR(check(cudaEventRecord(stop, c.stream), "cudaEventRecord"));
    MOEINFER_RETURN_IF_ERROR(check(cudaEventSynchronize(stop), "cudaEventSynchronize"));
    float ms = 0;
    MOEINFER_RETURN_IF_ERROR(check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"));
    if (i > 0) gbps.push_back(static_cast<double>(count * 16) / (ms * 1e-3) / 1e9);  // first pass warms up
  }
  return median(gbps);
}

namespace {

// Captures one graph of whatever `enqueue` puts on c.stream.
Status capture(Cleanup& c, const std::function<Status()>& enqueue) {
  cudaGraph_t graph;
  MOEINFER_RETURN_IF_ERROR(check(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeThreadLocal), "begin capture"));
  const Status st = enqueue();
  const cudaError_t end = cudaStreamEndCapture(c.stream, &graph);
  MOEINFER_RETURN_IF_ERROR(st);
  MOEINFER_RETURN_IF_ERROR(check(end, "end capture"));
  c.graphs.push_back(graph);
  cudaGraphExec_t exec;
  MOEINFER_RETURN_IF_ERROR(check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate"));
  c.execs.push_back(exec);
  return {};
}

// A warm-up round, then `reps` timed rounds replaying every graph of c once: the median round's
// microseconds per graph.
Result<double> time_rounds(Cleanup& c, int reps) {
  cudaEvent_t start, stop;
  MOEINFER_RETURN_IF_ERROR(check(cudaEventCreate(&start), "cudaEventCreate"));
  c.events.push_back(start);
  MOEINFER_RETURN_IF_ERROR(check(cudaEventCreate(&stop), "cudaEventCreate"));
  c.events.push_back(stop);
  std::vector<double> per_call_us;
  for (int r = -1; r < reps; ++r) {
    MOEINFER_RETURN_IF_ERROR(check(cudaEventRecord(start, c.stream), "cudaEventRecord"));
    for (cudaGraphExec_t e : c.execs) MOEINFER_RETURN_IF_ERROR(check(cudaGraphLaunch(e, c.stream), "cudaGraphLaunch"));
    MOEINFER_RETURN_IF_ERROR(check(cudaEventRecord(stop, c.stream), "cudaEventRecord"));
    MOEINFER_RETURN_IF_ERROR(check(cudaEventSynchronize(stop), "cudaEventSynchronize"));
    float ms = 0;
    MOEINFER_RETURN_IF_ERROR(check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"));
    if (r >= 0) per_call_us.push_back(static_cast<double>(ms) * 1e3 / static_cast<double>(c.execs.size()));
  }
  return median(per_call_us);
}

}  // namespace

Result<double> cuda_time_forward(const CudaMoe& moe, const std::vector<std::vector<float>>& batches, int64_t n,
                                 int reps, const CudaAllReduce* reduce) {
  if (batches.empty() || reps < 1) return invalid_argument("cuda_time_forward: no batches or no repetitions");
  const int64_t h = moe.desc().hidden;
  Cleanup c;
  MOEINFER_RETURN_IF_ERROR(check(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  void* out = nullptr;
  MOEINFER_RETURN_IF_ERROR(check(cudaMalloc(&out, static_cast<size_t>(n * h) * sizeof(float)), "cudaMalloc (output)"));
  c.device.push_back(out);
  // One input buffer and one captured graph per batch: a replay reads its own tokens, so the
  // timed work is exactly the layer's (and, under expert parallelism, the sum over the ranks).
  for (const std::vector<float>& b : batches) {
    if (static_cast<int64_t>(b.size()) != n * h) return invalid_argument("cuda_time_forward: batch of the wrong size");
    void* x = nullptr;
    MOEINFER_RETURN_IF_ERROR(check(cudaMalloc(&x, b.size() * sizeof(float)), "cudaMalloc (input)"));
    c.device.push_back(x);
    MOEINFER_RETURN_IF_ERROR(check(cudaMemcpy(x, b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice), "copy input"));
    const Status captured = capture(c, [&]() -> Status {
      MOEINFER_RETURN_IF_ERROR(moe.forward(static_cast<const float*>(x), n, static_cast<float*>(out), c.stream));
      return reduce != nullptr ? reduce->sum(static_cast<float*>(out), n * h, c.stream) : Status{};
    });
    MOEINFER_RETURN_IF_ERROR(captured);
  }
  return time_rounds(c, reps);
}

Result<double> cuda_time_all_reduce(const CudaAllReduce& reduce, int64_t count, int reps) {
  if (count < 1 || reps < 1) return invalid_argument("cuda_time_all_reduce: nothing to sum or no repetitions");
  Cleanup c;
  MOEINFER_RETURN_IF_ERROR(check(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  void* data = nullptr;
  MOEINFER_RETURN_IF_ERROR(check(cudaMalloc(&data, static_cast<size_t>(count) * sizeof(float)), "cudaMalloc (sum)"));
  c.device.push_back(data);
  MOEINFER_RETURN_IF_ERROR(check(cudaMemset(data, 0, static_cast<size_t>(count) * sizeof(float)), "cudaMemset"));
  MOEINFER_RETURN_IF_ERROR(capture(c, [&] { return reduce.sum(static_cast<float*>(data), count, c.stream); }));
  return time_rounds(c, reps);
}

}  // namespace moeinfer
