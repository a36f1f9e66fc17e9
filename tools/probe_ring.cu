// A probe, not part of the library: how fast a shared-memory ring fed by bulk copies delivers
// weight bytes to the warps that consume them, against the register loads the expert GEMMs use
// today. It answers the question PERF.md's gap section leaves open for a grouped GEMM at N >= 128
// (v3.26: a ring of bulk copies inside the split-K gate_up delivered 2.6 TB/s where the kernels'
// register loads reach 3.2): is that the ring's own limit, or the work around it?
//
// Every kernel streams the same 256 MB (more than L2 holds) once, one contiguous share per block,
// with one wave of blocks (the SMs times the blocks per SM), and does no decode and no MMAs:
// - `ring`: warp kConsumers of each block is the producer. Its lane 0 fills a ring of `stages`
//   slots of `stage` bytes with cp.async.bulk copies (`copies` per slot), each slot behind a
//   "full" mbarrier (the copies' bytes) and an "empty" one (one arrival per consumer warp). Each
//   consumer warp reads its 1/kConsumers of every slot from shared memory (16 bytes per lane per
//   load) and arrives on the slot's empty barrier.
// - `regs`: the same warps (producer included, as a consumer) each stream their own share of the
//   block's range, 1 KB per warp per chunk (16 bytes per lane, ld.global.nc.L1::no_allocate),
//   `ahead` chunks in registers ahead of their use, as the staged kernels load NVFP4 tiles.
// - `work`: FMAs per KB a warp consumes, in four independent chains seeded from the bytes, standing
//   in for the decode and MMAs (about 130 instructions per KB of NVFP4 in the staged gate_up).
// Each configuration's time is the median of 9 launches (CUDA events). GB/s are the 256 MB over
// that time; `stream` is a plain read of the same buffer by every thread, 64 bytes in flight each.
//
// Build and run (H200): scripts/gpu-probe-ring
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.cuh"

namespace {

using probe::fma_work, probe::load_stream, probe::median_ms, probe::stream_kernel;

constexpr int kWarp = 32;
constexpr int64_t kTotalBytes = int64_t{256} << 20;
constexpr int kMaxStages = 16;

struct Params {
  const uint8_t* data;
  int64_t per_block;  // bytes each block streams, a multiple of the stage and of 1 KB x warps
  int stage;          // ring: bytes per slot
  int stages;         // ring: slots
  int copies;         // ring: bulk copies per slot
  int work;           // FMAs per KB consumed
  float* sink;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (done == 0) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  }
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src),
               "r"(bytes), "r"(bar)
               : "memory");
}

template <int kConsumers>
__global__ void __launch_bounds__((kConsumers + 1) * kWarp) ring_kernel(Params p) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[kMaxStages], empty[kMaxStages];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const uint8_t* src = p.data + blockIdx.x * p.per_block;
  const int slots = static_cast<int>(p.per_block / p.stage);
  if (warp == kConsumers) {
    if (lane != 0) return;
    const uint32_t piece = p.stage / p.copies;
    for (int i = 0; i < slots; ++i) {
      const int s = i % p.stages;
      if (i >= p.stages) mbar_wait(smem_addr(&empty[s]), (i / p.stages - 1) & 1);
      const uint32_t bar = smem_addr(&full[s]);
      mbar_expect(bar, p.stage);
      for (int c = 0; c < p.copies; ++c) {
        bulk_copy(smem_addr(ring + s * p.stage + c * piece), src + static_cast<int64_t>(i) * p.stage + c * piece, piece, bar);
      }
    }
    return;
  }
  const int share = p.stage / kConsumers;  // bytes per consumer warp per slot, a multiple of 512
  const int fmas = p.work * share / 1024;
  float acc[4] = {0, 0, 0, 0};
  for (int i = 0; i < slots; ++i) {
    const int s = i % p.stages;
    mbar_wait(smem_addr(&full[s]), (i / p.stages) & 1);
    uint32_t x = 0;
    const uint8_t* mine = ring + s * p.stage + warp * share;
    for (int b = 16 * lane; b < share; b += 16 * kWarp) {
      const uint4 v = *reinterpret_cast<const uint4*>(mine + b);
      x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_addr(&empty[s]));
    fma_work(x, fmas, acc);
  }
  const float total = acc[0] + acc[1] + acc[2] + acc[3];
  if (total == 12345.0f) p.sink[blockIdx.x] = total;  // never true; keeps the reads
}

// Each of the block's warps streams its own 1/warps of the block's range in 1 KB chunks, kAhead
// chunks in registers ahead of their use.
template <int kAhead>
__global__ void regs_kernel(Params p) {
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t mine = p.per_block / warps;
  const uint8_t* src = p.data + blockIdx.x * p.per_block + warp * mine + 16 * lane;
  const int chunks = static_cast<int>(mine / 1024);
  uint4 ahead[kAhead][2];
#pragma unroll
  for (int j = 0; j < kAhead; ++j) {
    ahead[j][0] = load_stream(src + 1024 * j);
    ahead[j][1] = load_stream(src + 1024 * j + 512);
  }
  float acc[4] = {0, 0, 0, 0};
  for (int i = 0; i < chunks; i += kAhead) {
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      if (i + j >= chunks) break;
      const uint32_t x = ahead[j][0].x ^ ahead[j][0].y ^ ahead[j][0].z ^ ahead[j][0].w ^ ahead[j][1].x ^ ahead[j][1].y ^
                         ahead[j][1].z ^ ahead[j][1].w;
      if (i + j + kAhead < chunks) {
        ahead[j][0] = load_stream(src + 1024 * (i + j + kAhead));
        ahead[j][1] = load_stream(src + 1024 * (i + j + kAhead) + 512);
      }
      fma_work(x, p.work, acc);
    }
  }
  const float total = acc[0] + acc[1] + acc[2] + acc[3];
  if (total == 12345.0f) p.sink[blockIdx.x] = total;
}

double gbs(int64_t bytes, float ms) { return bytes / (ms * 1e-3) / 1e9; }

// Bytes per block: the buffer over the grid, rounded down to whole units of `unit` bytes.
int64_t share_of(int grid, int64_t unit) { return kTotalBytes / grid / unit * unit; }

template <int kConsumers>
void ring(const Params& base, int sms, int per_sm, int stage, int stages, int copies, int work, double stream) {
  const int smem = stage * stages;
  if (stages > kMaxStages || smem * per_sm > 220 * 1024 || stage % (512 * kConsumers) != 0) return;
  auto kernel = ring_kernel<kConsumers>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int resident = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, (kConsumers + 1) * kWarp, smem));
  if (resident < per_sm) return;
  Params p = base;
  const int grid = sms * per_sm;
  p.per_block = share_of(grid, stage);
  p.stage = stage, p.stages = stages, p.copies = copies, p.work = work;
  const float ms = median_ms([&] { kernel<<<grid, (kConsumers + 1) * kWarp, smem>>>(p); });
  const double rate = gbs(p.per_block * grid, ms);
  std::printf("ring  consumers %2d  blocks/SM %d  stage %2d KB x %2d (%3d KB/SM)  copies %d  work %3d  %7.1f us  %5.0f GB/s  %5.1f%%\n",
              kConsumers, per_sm, stage / 1024, stages, smem * per_sm / 1024, copies, work, ms * 1e3, rate, 100 * rate / stream);
}

template <int kAhead>
void regs(const Params& base, int sms, int per_sm, int warps, int work, double stream) {
  auto kernel = regs_kernel<kAhead>;
  int resident = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, warps * kWarp, 0));
  if (resident < per_sm) return;
  Params p = base;
  const int grid = sms * per_sm;
  p.per_block = share_of(grid, int64_t{1024} * warps);
  p.work = work;
  const float ms = median_ms([&] { kernel<<<grid, warps * kWarp>>>(p); });
  const double rate = gbs(p.per_block * grid, ms);
  std::printf("regs  warps     %2d  blocks/SM %d  ahead %d (%3d KB/SM in flight)           work %3d  %7.1f us  %5.0f GB/s  %5.1f%%\n",
              warps, per_sm, kAhead, kAhead * warps * per_sm, work, ms * 1e3, rate, 100 * rate / stream);
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint8_t* data = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&data, kTotalBytes));
  CHECK(cudaMemset(data, 0x3C, kTotalBytes));
  CHECK(cudaMalloc(&sink, 1 << 20));
  const float stream_ms =
      median_ms([&] { stream_kernel<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(data), kTotalBytes / 16, sink); });
  const double stream = gbs(kTotalBytes, stream_ms);
  std::printf("stream: %d MB in %.1f us, %.0f GB/s (the %% column's reference)\n", static_cast<int>(kTotalBytes >> 20),
              stream_ms * 1e3, stream);
  Params base{};
  base.data = data;
  base.sink = sink;
  for (const int work : {0, 128}) {
    for (const int per_sm : {1, 2, 3, 4}) {
      for (const int warps : {4, 8, 16}) {
        regs<1>(base, sms, per_sm, warps, work, stream);
        regs<2>(base, sms, per_sm, warps, work, stream);
        regs<4>(base, sms, per_sm, warps, work, stream);
      }
    }
    for (const int per_sm : {1, 2}) {
      for (const int stage : {4096, 8192, 16384, 32768}) {
        for (const int stages : {2, 4, 8, 16}) {
          for (const int copies : {1, 4}) {
            if (copies > 1 && stage / copies < 2048) continue;
            ring<4>(base, sms, per_sm, stage, stages, copies, work, stream);
            ring<8>(base, sms, per_sm, stage, stages, copies, work, stream);
            ring<16>(base, sms, per_sm, stage, stages, copies, work, stream);
          }
        }
      }
    }
  }
  CHECK(cudaFree(data));
  CHECK(cudaFree(sink));
  return 0;
}
