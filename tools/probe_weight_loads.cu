// A probe, not part of the library: how fast the staged expert GEMMs' weight loads alone can run
// on this GPU, and what limits them. It reads NVFP4-sized expert weights (codes and scale codes)
// the way the staged kernels do (src/cuda/expert_major.cu), with no decode and no MMAs, and
// varies one thing at a time:
// - layout: `rows` is the checkpoint's row-major layout, as the kernels read it today (one 16-byte
//   load instruction covers 8 rows x 64 bytes); `tiled` stores each warp's 16 rows x 128 columns
//   chunk as 1 KB in a row (one instruction covers 512 contiguous bytes);
// - chunks in flight per warp (loaded ahead in registers): 1, 2 or 4;
// - blocks per SM (dynamic shared memory taken only to cap residency);
// - work per chunk: independent FMAs standing in for the decode and MMAs (about 300 instructions
//   per gate_up chunk in the real kernel).
// Each configuration's time is the median of 9 launches (CUDA events); the bytes read are far
// larger than L2, so each launch reads from DRAM. It prints GB/s and the fraction of a plain
// streaming read of a contiguous buffer of the same size. That streaming kernel keeps fewer bytes
// in flight than `moeinfer bench`'s (3.4-3.6 TB/s against 4.5 on an H200), so compare the GB/s
// with the bench's read bandwidth rather than trust the fraction.
//
// Build and run (H200): scripts/gpu-probe-loads
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/weight_tiles.h"  // the tile layout the kernels read (kTileBytes, kScaleTileBytes)
#include "probe_common.cuh"

namespace {

using probe::load_stream, probe::median_ms;

constexpr int kWarp = 32;
constexpr int kWarps = 4;        // per block, each on its own 16 rows
constexpr int kChunkCols = 128;  // a chunk: 16 rows x 128 columns of NVFP4 = 1 KB per matrix

struct Shape {
  const char* name;
  int k;            // input columns
  int rows;         // rows per matrix (gate_up: I, down: H)
  int mats;         // 2 for gate_up (gate and up share a warp), 1 for down
  int passes;       // 64-row groups one block walks through, one after another
  int experts;      // experts in the buffer
  int touched;      // experts read per launch
};

struct Params {
  const uint8_t* codes;
  const uint8_t* scales;
  const int* experts;
  int k, rows, passes, row_groups, work;
  int64_t expert_code_bytes, expert_scale_bytes;
  float* sink;
};

template <int kMats>
struct Chunk {
  uint4 w[kMats][2];
  uint32_t s[kMats];
};

// Step s of a warp: pass s / chunks, chunk s % chunks of its 16 rows.
template <int kMats, bool kTiled>
__device__ __forceinline__ void load_step(const Params& p, const uint8_t* codes, const uint8_t* scales, int row_base, int s,
                                          Chunk<kMats>& ch) {
  const int lane = threadIdx.x % kWarp, gid = lane / 4, c = lane % 4;
  const int chunks = p.k / kChunkCols;
  const int row0 = row_base + (s / chunks) * 64;
  const int k0 = (s % chunks) * kChunkCols;
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi) {
    const int64_t first_row = static_cast<int64_t>(mi) * p.rows + row0;
    if constexpr (kTiled) {
      // Panel of 16 rows: chunk after chunk, one tile each (rows gid and gid + 8 of a chunk are
      // the lane's 16 bytes in its first and second half); scale codes one scale tile per chunk.
      using moeinfer::cuda::kScaleTileBytes, moeinfer::cuda::kTileBytes;
      const uint8_t* panel = codes + first_row * (p.k / 2) + static_cast<int64_t>(k0 / kChunkCols) * kTileBytes;
      ch.w[mi][0] = load_stream(panel + 16 * lane);
      ch.w[mi][1] = load_stream(panel + kTileBytes / 2 + 16 * lane);
      ch.s[mi] = __ldg(reinterpret_cast<const uint32_t*>(scales + first_row * (p.k / 16) + (k0 / kChunkCols) * kScaleTileBytes) +
                       lane);
    } else {
      uint32_t codes_here = 0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = first_row + gid + 8 * r;
        ch.w[mi][r] = load_stream(codes + row * (p.k / 2) + k0 / 2 + 16 * c);
        codes_here |= static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(scales + row * (p.k / 16) + (k0 + 32 * c) / 16)))
                      << (16 * r);
      }
      ch.s[mi] = codes_here;
    }
  }
}

template <int kMats>
__device__ __forceinline__ void consume(const Chunk<kMats>& ch, int work, float (&acc)[4]) {
  uint32_t x = 0;
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) x ^= ch.w[mi][r].x ^ ch.w[mi][r].y ^ ch.w[mi][r].z ^ ch.w[mi][r].w;
    x ^= ch.s[mi];
  }
  probe::fma_work(x, work, acc);  // four independent chains of work / 4 FMAs each
}

// Grid: touched experts x row groups. Block: 4 warps; warp w owns rows 16w .. 16w + 15 of each
// 64-row group of its block's passes, over the whole K, kAhead chunks loaded ahead.
template <int kMats, int kAhead, bool kTiled>
__global__ void __launch_bounds__(kWarps * kWarp) probe_kernel(Params p) {
  extern __shared__ uint8_t occupancy_only[];
  const int item = blockIdx.x / p.row_groups, group = blockIdx.x % p.row_groups;
  const int64_t e = p.experts[item];
  const uint8_t* codes = p.codes + e * p.expert_code_bytes;
  const uint8_t* scales = p.scales + e * p.expert_scale_bytes;
  const int row_base = group * p.passes * 64 + 16 * (threadIdx.x / kWarp);
  const int steps = p.passes * (p.k / kChunkCols);
  Chunk<kMats> ring[kAhead];
#pragma unroll
  for (int j = 0; j < kAhead; ++j) {
    if (j < steps) load_step<kMats, kTiled>(p, codes, scales, row_base, j, ring[j]);
  }
  float acc[4] = {0, 0, 0, 0};
  for (int s = 0; s < steps; s += kAhead) {
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      if (s + j >= steps) break;
      consume(ring[j], p.work, acc);
      if (s + j + kAhead < steps) load_step<kMats, kTiled>(p, codes, scales, row_base, s + j + kAhead, ring[j]);
    }
  }
  const float total = acc[0] + acc[1] + acc[2] + acc[3];
  if (total == 12345.0f) p.sink[blockIdx.x] = total + occupancy_only[0];  // never true; keeps the loads
}

__global__ void stream_kernel(const float4* data, int64_t count, float* sink) {
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = __ldcs(data + i);
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 12345.0f) sink[blockIdx.x] = acc;
}

template <int kMats, int kAhead, bool kTiled>
void run(const Shape& sh, const Params& base, int blocks_per_sm, int work, double stream_gbs, int sms) {
  auto kernel = probe_kernel<kMats, kAhead, kTiled>;
  const int smem = blocks_per_sm > 0 ? 228 * 1024 / blocks_per_sm - 1024 - 1024 : 0;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, std::max(smem, 0)));
  int resident = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kWarps * kWarp, std::max(smem, 0)));
  cudaFuncAttributes attr{};
  CHECK(cudaFuncGetAttributes(&attr, kernel));
  Params p = base;
  p.work = work;
  p.passes = sh.passes;
  p.row_groups = sh.rows / (64 * sh.passes);
  const int grid = sh.touched * p.row_groups;
  const float ms = median_ms([&] { kernel<<<grid, kWarps * kWarp, std::max(smem, 0)>>>(p); });
  const double bytes = static_cast<double>(sh.touched) * (base.expert_code_bytes + base.expert_scale_bytes);
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  std::printf("%-16s %-5s ahead %d  blocks/SM %2d (%3d regs)  work %3d  grid %5d (%5.1f/SM)  %8.1f us  %6.0f GB/s  %5.1f%%\n",
              sh.name, kTiled ? "tiled" : "rows", kAhead, resident, attr.numRegs, work, grid, double(grid) / sms, ms * 1e3, gbs,
              100.0 * gbs / stream_gbs);
}

template <int kMats>
void sweep(const Shape& sh, const Params& base, const std::vector<int>& bps, const std::vector<int>& works, double stream_gbs,
           int sms) {
  for (int work : works) {
    for (int b : bps) {
      run<kMats, 1, false>(sh, base, b, work, stream_gbs, sms);
      run<kMats, 2, false>(sh, base, b, work, stream_gbs, sms);
      run<kMats, 4, false>(sh, base, b, work, stream_gbs, sms);
      run<kMats, 2, true>(sh, base, b, work, stream_gbs, sms);
      run<kMats, 4, true>(sh, base, b, work, stream_gbs, sms);
    }
  }
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // qwen3-next-80b-a3b: 512 experts, hidden 2048, expert intermediate 512, top-10. Experts
  // touched at N tokens with independent routing: 512 (1 - (1 - 10/512)^N): N = 8 -> 75, N = 64 -> 365.
  const Shape shapes[] = {
      {"gate_up N=64", 2048, 512, 2, 1, 512, 365},
      {"gate_up N=8", 2048, 512, 2, 1, 512, 75},
      {"down x4 N=64", 512, 2048, 1, 4, 512, 365},
      {"down x1 N=64", 512, 2048, 1, 1, 512, 365},
  };
  float* sink = nullptr;
  CHECK(cudaMalloc(&sink, 1 << 20));
  std::mt19937 rng(7);
  for (const Shape& sh : shapes) {
    Params base{};
    base.k = sh.k;
    base.rows = sh.rows;
    base.expert_code_bytes = static_cast<int64_t>(sh.mats) * sh.rows * sh.k / 2;
    base.expert_scale_bytes = static_cast<int64_t>(sh.mats) * sh.rows * sh.k / 16;
    uint8_t *codes = nullptr, *scales = nullptr;
    CHECK(cudaMalloc(&codes, base.expert_code_bytes * sh.experts));
    CHECK(cudaMalloc(&scales, base.expert_scale_bytes * sh.experts));
    CHECK(cudaMemset(codes, 0x11, base.expert_code_bytes * sh.experts));
    CHECK(cudaMemset(scales, 0x38, base.expert_scale_bytes * sh.experts));
    std::vector<int> all(sh.experts);
    for (int i = 0; i < sh.experts; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int> chosen(all.begin(), all.begin() + sh.touched);
    std::sort(chosen.begin(), chosen.end());
    int* experts = nullptr;
    CHECK(cudaMalloc(&experts, sizeof(int) * chosen.size()));
    CHECK(cudaMemcpy(experts, chosen.data(), sizeof(int) * chosen.size(), cudaMemcpyHostToDevice));
    base.codes = codes;
    base.scales = scales;
    base.experts = experts;
    base.sink = sink;

    // The floor's reference: a contiguous read of the same number of bytes (all SMs, 4 blocks each).
    const int64_t bytes = static_cast<int64_t>(sh.touched) * (base.expert_code_bytes + base.expert_scale_bytes);
    const float ms = median_ms([&] { stream_kernel<<<sms * 4, 256>>>(reinterpret_cast<const float4*>(codes), bytes / 16, sink); });
    const double stream_gbs = bytes / (ms * 1e-3) / 1e9;
    std::printf("== %s: K %d, %d rows x %d, %d passes, %d of %d experts, %.1f MB; stream %.1f us, %.0f GB/s\n", sh.name, sh.k,
                sh.rows, sh.mats, sh.passes, sh.touched, sh.experts, bytes / 1e6, ms * 1e3, stream_gbs);
    if (sh.mats == 2) {
      sweep<2>(sh, base, {4, 8}, {0, 300}, stream_gbs, sms);
    } else {
      sweep<1>(sh, base, {8}, {0, 150}, stream_gbs, sms);
    }
    CHECK(cudaFree(codes));
    CHECK(cudaFree(scales));
    CHECK(cudaFree(experts));
  }
  return 0;
}
