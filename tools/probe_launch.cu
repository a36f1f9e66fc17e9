// What a chain of kernels costs under CUDA graph replay when the kernels themselves do almost
// nothing: the launch model behind PERF.md's N = 1 gap (not part of the library).
//
// Each graph holds K kernels in one stream's order (K = 1 .. 8); a round launches 8 such graphs
// back to back, as `moeinfer bench` replays its 8 inputs, and a graph's time is the round's over 8
// (the median of 21 rounds after a warm-up). Kernel k of a chain reads the word kernel k - 1
// wrote (every block's first thread; the first kernel reads the last one's from the replay
// before) and block 0 writes it plus one, so each kernel waits for its predecessor's store to
// reach L2 and its own load to come back, as the layer's kernels wait for the logits, the routes
// and the sums. The slope of time against K is the cost of one more kernel in the chain.
//
// Rows: grids of 1 block x 256 threads (the route kernel), one block per SM, and 8 blocks of 128
// per SM (a GEMM's wave); launched plainly, or with programmatic dependent launch (each kernel
// lets the next one launch at its start and waits with griddepcontrol.wait before its load).
// Stream launches without a graph are the last rows. At the end the chains' words are checked:
// after R replays of K kernels the last word must be R x K.
//
// A second table: how fast G blocks of 1024 threads read 2 MB that L2 already holds (a BF16
// router of 512 x 2048), each thread's 16-byte loads 8 at a time: the time per read and the rate
// per SM, for G = 1, 16 (one cluster), 66 and 132, each launch included (plain stream launches:
// compare the rows with each other). It says what a kernel on few SMs can pull.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "probe_common.cuh"

namespace {

__global__ void chain_kernel(unsigned* words, int k, int kernels, int pdl) {
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x != 0) return;
  const unsigned before = *reinterpret_cast<volatile unsigned*>(words + (k + kernels - 1) % kernels);
  if (blockIdx.x == 0) words[k] = before + 1;
}

struct Grid {
  const char* name;
  int blocks;
  int threads;
};

void enqueue_chain(cudaStream_t s, unsigned* words, int kernels, const Grid& g, bool pdl) {
  for (int k = 0; k < kernels; ++k) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(g.blocks);
    cfg.blockDim = dim3(g.threads);
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl && k > 0 ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&cfg, chain_kernel, words, k, kernels, pdl ? 1 : 0));
  }
}

constexpr int kGraphs = 8;
constexpr int kRounds = 21;

// Microseconds per chain: a round of kGraphs chains (graphs, or plain stream launches), median of
// kRounds after one warm-up round. Checks the chains' words afterwards.
float us_per_chain(cudaStream_t s, int kernels, const Grid& g, bool pdl, bool graph) {
  unsigned* words = nullptr;
  CHECK(cudaMalloc(&words, sizeof(unsigned) * kGraphs * kernels));
  CHECK(cudaMemset(words, 0, sizeof(unsigned) * kGraphs * kernels));
  std::vector<cudaGraphExec_t> execs;
  if (graph) {
    for (int i = 0; i < kGraphs; ++i) {
      cudaGraph_t gr;
      CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      enqueue_chain(s, words + i * kernels, kernels, g, pdl);
      CHECK(cudaStreamEndCapture(s, &gr));
      cudaGraphExec_t e;
      CHECK(cudaGraphInstantiate(&e, gr, 0));
      CHECK(cudaGraphDestroy(gr));
      execs.push_back(e);
    }
  }
  auto round = [&] {
    for (int i = 0; i < kGraphs; ++i) {
      if (graph) {
        CHECK(cudaGraphLaunch(execs[i], s));
      } else {
        enqueue_chain(s, words + i * kernels, kernels, g, pdl);
      }
    }
  };
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> us;
  for (int r = -1; r < kRounds; ++r) {
    CHECK(cudaEventRecord(a, s));
    round();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 0) us.push_back(ms * 1e3f / kGraphs);
  }
  std::vector<unsigned> host(static_cast<size_t>(kGraphs) * kernels);
  CHECK(cudaMemcpy(host.data(), words, host.size() * sizeof(unsigned), cudaMemcpyDeviceToHost));
  const unsigned want = static_cast<unsigned>((kRounds + 1) * kernels);
  for (int i = 0; i < kGraphs; ++i) {
    if (host[static_cast<size_t>(i) * kernels + kernels - 1] != want) {
      std::fprintf(stderr, "chain %d of %d kernels (%s, %s): last word %u, want %u\n", i, kernels, g.name,
                   pdl ? "pdl" : "plain", host[static_cast<size_t>(i) * kernels + kernels - 1], want);
      std::exit(1);
    }
  }
  for (cudaGraphExec_t e : execs) CHECK(cudaGraphExecDestroy(e));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaFree(words));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Reads `units` 16-byte units, each block a contiguous share, each thread 8 loads in flight.
__global__ void read_l2_kernel(const uint4* data, int units, unsigned* sink) {
  const int per_block = (units + gridDim.x - 1) / gridDim.x;
  const int begin = blockIdx.x * per_block, end = min(units, begin + per_block);
  uint32_t x = 0;
  for (int i = begin + threadIdx.x; i < end; i += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = i + j * blockDim.x < end ? __ldg(data + i + j * blockDim.x) : uint4{};
#pragma unroll
    for (int j = 0; j < 8; ++j) x ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (x == 0x12345678u) sink[blockIdx.x] = x;  // never true; keeps the reads
}

void few_sm_reads(int sms) {
  constexpr int kBytes = 2 << 20;
  uint4* data = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&data, kBytes));
  CHECK(cudaMemset(data, 1, kBytes));
  CHECK(cudaMalloc(&sink, sizeof(unsigned) * sms));
  std::printf("\n2 MB from L2 by G blocks of 1024 threads (median of 9 stream launches after a warm one; each time "
              "includes its launch)\n");
  std::printf("%6s %9s %12s\n", "G", "us", "GB/s per SM");
  for (const int g : {1, 16, sms / 2, sms}) {
    const float ms = probe::median_ms([&] { read_l2_kernel<<<g, 1024>>>(data, kBytes / 16, sink); });
    std::printf("%6d %9.2f %12.1f\n", g, ms * 1e3f, kBytes / (ms * 1e-3f) / 1e9f / static_cast<float>(g));
  }
  CHECK(cudaFree(data));
  CHECK(cudaFree(sink));
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device %s, %d SMs; us per chain of K kernels (graph: 8 graphs per round, as the bench)\n", prop.name, sms);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Grid grids[] = {{"1 x 256", 1, 256}, {"1/SM x 256", sms, 256}, {"8/SM x 128", 8 * sms, 128}};
  const int ks[] = {1, 2, 3, 4, 6, 8};
  std::printf("%-7s %-5s %-12s", "launch", "pdl", "grid");
  for (int k : ks) std::printf("   K=%d", k);
  std::printf("  us/kernel (K 1->8)\n");
  for (int graph = 1; graph >= 0; --graph) {
    for (int pdl = 0; pdl <= 1; ++pdl) {
      for (const Grid& g : grids) {
        std::printf("%-7s %-5s %-12s", graph ? "graph" : "stream", pdl ? "yes" : "no", g.name);
        float first = 0, last = 0;
        for (int k : ks) {
          const float us = us_per_chain(s, k, g, pdl != 0, graph != 0);
          if (k == ks[0]) first = us;
          last = us;
          std::printf(" %6.2f", us);
        }
        std::printf("  %6.2f\n", (last - first) / (ks[5] - ks[0]));
      }
    }
  }
  CHECK(cudaStreamDestroy(s));
  few_sm_reads(sms);
  return 0;
}
