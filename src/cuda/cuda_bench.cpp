// The benchmark's CUDA instruments: read bandwidth, the bf16 tensor-core peak, and forward time
// over graph replays.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
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

// Runs `enqueue` (which puts work on c.stream) 1 + `rounds` times, each between a pair of events,
// and returns the milliseconds of each round past the first, which warms up.
Result<std::vector<double>> time_on_stream(Cleanup& c, int rounds, const std::function<Status()>& enqueue) {
  cudaEvent_t start, stop;
  MOEINFER_RETURN_IF_ERROR(check(cudaEventCreate(&start), "cudaEventCreate"));
  c.events.push_back(start);
  MOEINFER_RETURN_IF_ERROR(check(cudaEventCreate(&stop), "cudaEventCreate"));
  c.events.push_back(stop);
  std::vector<double> ms_each;
  for (int r = -1; r < rounds; ++r) {
    MOEINFER_RETURN_IF_ERROR(check(cudaEventRecord(start, c.stream), "cudaEventRecord"));
    MOEINFER_RETURN_IF_ERROR(enqueue());
    MOEINFER_RETURN_IF_ERROR(check(cudaEventRecord(stop, c.stream), "cudaEventRecord"));
    MOEINFER_RETURN_IF_ERROR(check(cudaEventSynchronize(stop), "cudaEventSynchronize"));
    float ms = 0;
    MOEINFER_RETURN_IF_ERROR(check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"));
    if (r >= 0) ms_each.push_back(static_cast<double>(ms));
  }
  return ms_each;
}

// cuBLAS, opened on first use rather than linked: loading it (and cublasLt, which it needs)
// costs every process that links moeinfer about 0.1 s and 220 MB before main, and only the
// bench's peak uses it.
struct CublasApi {
  void* library = nullptr;
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

// The library the build found (MOEINFER_CUBLAS_LIBRARY), else its soname on the loader's path.
Result<const CublasApi*> cublas_api() {
  static CublasApi api;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string soname = fmt::format("libcublas.so.{}", CUBLAS_VER_MAJOR);
    std::string tried;
    for (const char* name : {MOEINFER_CUBLAS_LIBRARY, soname.c_str()}) {
      if (*name == '\0') continue;  // the build found no cuBLAS
      api.library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (api.library != nullptr) break;
      const char* why = dlerror();
      tried += fmt::format("{}{} ({})", tried.empty() ? "" : ", ", name, why != nullptr ? why : "not found");
    }
    if (api.library == nullptr) {
      error = fmt::format("the bench's bf16 peak needs cuBLAS, which did not open: {}", tried);
      return;
    }
    const auto symbol = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(api.library, name));
      if (fn == nullptr && error.empty()) error = fmt::format("cuBLAS has no {}", name);
    };
    symbol(api.create, "cublasCreate_v2");
    symbol(api.destroy, "cublasDestroy_v2");
    symbol(api.set_stream, "cublasSetStream_v2");
    symbol(api.status_string, "cublasGetStatusString");
    symbol(api.gemm_ex, "cublasGemmEx");
  });
  if (!error.empty()) return internal_error(error);
  return &api;
}

Status check_cublas(const CublasApi& api, cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return {};
  return Status(StatusCode::kInternal, fmt::format("{}: {}", what, api.status_string(status)));
}

struct CublasHandle {
  const CublasApi* api = nullptr;
  cublasHandle_t handle = nullptr;
  ~CublasHandle() {
    if (handle != nullptr) api->destroy(handle);
  }
};

// Entry `index` of the peak's random matrix `seed`, as bf16 bits: a random sign, exponent 2^-1
// or 2^0 and 7 random mantissa bits: values in +-[0.5, 2) that toggle the multipliers as real
// data does (PyTorch's 8192^3 bf16 GEMM on an H200 ran 894 TFLOP/s on zeros, 788 on random data).
uint16_t peak_matrix_entry(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + index;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint16_t>((z & 0x8000u) | ((126u + ((z >> 7) & 1u)) << 7) | (z & 0x7Fu));
}

float bf16_value(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

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
  const int64_t count = bytes / 16;
  Result<std::vector<double>> ms_each = time_on_stream(c, 6, [&] {
    return check(cuda::launch_stream_read(static_cast<const float4*>(data), count, static_cast<float*>(sink), blocks,
                                          c.stream),
                 "stream_read");
  });
  if (!ms_each.ok()) return ms_each.status();
  std::vector<double> gbps;
  for (const double ms : *ms_each) gbps.push_back(static_cast<double>(count * 16) / (ms * 1e-3) / 1e9);
  return median(gbps);
}

Result<double> cuda_bf16_peak_tflops(int size) {
  if (size < 256 || size % 256 != 0) {
    return invalid_argument(fmt::format("cuda_bf16_peak_tflops: size {} is not a positive multiple of 256", size));
  }
  Cleanup c;
  // A blocking stream: its GEMMs wait for the copies and the poison below, which go through the
  // legacy default stream (a pageable copy may return before its DMA lands).
  MOEINFER_RETURN_IF_ERROR(check(cudaStreamCreate(&c.stream), "cudaStreamCreate"));
  Result<const CublasApi*> api = cublas_api();
  if (!api.ok()) return api.status();
  const CublasApi& blas = **api;
  CublasHandle cublas{.api = &blas};
  MOEINFER_RETURN_IF_ERROR(check_cublas(blas, blas.create(&cublas.handle), "cublasCreate"));
  MOEINFER_RETURN_IF_ERROR(check_cublas(blas, blas.set_stream(cublas.handle, c.stream), "cublasSetStream"));
  const uint64_t count = static_cast<uint64_t>(size) * static_cast<uint64_t>(size);
  const size_t bytes = count * sizeof(uint16_t);
  // A is read as [size rows x size k] row-major (transposed, lda = size), B as [size columns x
  // size k] (lda = size), C = A B^T column-major: C(i, j) = sum_l A[i size + l] B[j size + l].
  std::array<void*, 3> m{};  // A, B, C
  for (void*& p : m) {
    MOEINFER_RETURN_IF_ERROR(check(cudaMalloc(&p, bytes), "cudaMalloc (peak GEMM)"));
    c.device.push_back(p);
  }
  std::vector<uint16_t> host(count);
  for (uint64_t seed : {1, 2}) {
    for (uint64_t i = 0; i < count; ++i) host[i] = peak_matrix_entry(seed, i);
    MOEINFER_RETURN_IF_ERROR(
        check(cudaMemcpy(m[seed - 1], host.data(), bytes, cudaMemcpyHostToDevice), "copy peak matrix"));
  }
  MOEINFER_RETURN_IF_ERROR(check(cudaMemset(m[2], 0xFF, bytes), "cudaMemset (poison)"));  // bf16 NaN
  MOEINFER_RETURN_IF_ERROR(check(cudaDeviceSynchronize(), "peak GEMM inputs"));
  const float alpha = 1.0f, beta = 0.0f;
  const auto gemm = [&] {
    const cublasStatus_t status =
        blas.gemm_ex(cublas.handle, CUBLAS_OP_T, CUBLAS_OP_N, size, size, size, &alpha, m[0], CUDA_R_16BF, size, m[1],
                     CUDA_R_16BF, size, &beta, m[2], CUDA_R_16BF, size, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    return check_cublas(blas, status, "cublasGemmEx (bf16 peak)");
  };
  MOEINFER_RETURN_IF_ERROR(gemm());
  MOEINFER_RETURN_IF_ERROR(check(cudaStreamSynchronize(c.stream), "peak GEMM"));
  // A few entries against the host. The float sums of products in +-[0.25, 4) err far less
  // than the bf16 output's rounding (2^-8 relative), which the tolerance allows.
  const int64_t last = size - 1;
  const std::array<std::pair<int64_t, int64_t>, 6> probes = {
      {{0, 0}, {last, last}, {1, last - 1}, {size / 2, size / 3}, {size / 3 + 7, size / 2 + 5}, {last, 0}}};
  for (const auto& [i, j] : probes) {
    uint16_t got_bits = 0;
    MOEINFER_RETURN_IF_ERROR(check(cudaMemcpy(&got_bits, static_cast<const uint16_t*>(m[2]) + i + j * size,
                                              sizeof(got_bits), cudaMemcpyDeviceToHost),
                                   "copy peak GEMM entry"));
    double exact = 0.0, magnitude = 0.0;
    for (int64_t l = 0; l < size; ++l) {
      const double p = static_cast<double>(bf16_value(peak_matrix_entry(1, static_cast<uint64_t>(i * size + l)))) *
                       static_cast<double>(bf16_value(peak_matrix_entry(2, static_cast<uint64_t>(j * size + l))));
      exact += p;
      magnitude += std::fabs(p);
    }
    const double got = bf16_value(got_bits);
    const double tolerance = std::ldexp(std::fabs(exact), -8) + std::ldexp(magnitude, -12);
    if (!(std::fabs(got - exact) <= tolerance)) {
      return internal_error(fmt::format(
          "the bf16 peak GEMM computed C({}, {}) = {} where the host sums {} (tolerance {})", i, j, got, exact, tolerance));
    }
  }
  constexpr int kGemmsPerRound = 4;
  Result<std::vector<double>> ms_each = time_on_stream(c, 5, [&]() -> Status {
    for (int g = 0; g < kGemmsPerRound; ++g) MOEINFER_RETURN_IF_ERROR(gemm());
    return {};
  });
  if (!ms_each.ok()) return ms_each.status();
  std::vector<double> tflops;
  const double flops = 2.0 * static_cast<double>(count) * size * kGemmsPerRound;
  for (const double ms : *ms_each) tflops.push_back(flops / (ms * 1e-3) / 1e12);
  return median(tflops);
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
  // The graphs' inputs were copied through the legacy stream, which c.stream (non-blocking) does
  // not wait for, and a pageable copy may return before its DMA lands.
  MOEINFER_RETURN_IF_ERROR(check(cudaDeviceSynchronize(), "inputs before the replays"));
  Result<std::vector<double>> ms_each = time_on_stream(c, reps, [&]() -> Status {
    for (cudaGraphExec_t e : c.execs) MOEINFER_RETURN_IF_ERROR(check(cudaGraphLaunch(e, c.stream), "cudaGraphLaunch"));
    return {};
  });
  if (!ms_each.ok()) return ms_each.status();
  std::vector<double> per_call_us;
  for (const double ms : *ms_each) per_call_us.push_back(ms * 1e3 / static_cast<double>(c.execs.size()));
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
