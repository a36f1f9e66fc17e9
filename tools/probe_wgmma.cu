// A probe, not part of the library: would warpgroup MMAs (wgmma: A from registers, B from shared
// memory through a matrix descriptor) run the staged expert GEMMs' inner loop faster than the
// mma.sync they use today? PERF.md's gap section (item 3) names wgmma as what a kernel for
// N >= 128 needs, because it takes the MMAs and the activation loads off the issue path, while the
// decode stays. This probe measures that claim before anyone writes the kernel.
//
// Every variant runs the same loop over the same bytes: one warpgroup per block (4 warps, 64
// weight rows), one wave of blocks, each streaming its share of 256 MB of NVFP4 tiles as the
// staged kernels do (per warp and chunk: 16 rows x 128 columns, 1 KB, 16 bytes per lane per row
// half, ld.global.nc.L1::no_allocate, two chunks ahead in registers; one 4-byte scale word per
// lane), and decoding them exactly as expert_major.cu does (pair order, nvfp4_pair_order.h, then a
// bf16x2 multiply by the scale). The activations, N tokens x 512 columns in shared memory, are
// reused cyclically (the staged kernels stage them once per item):
// - `decode`: the decode alone (its A registers XORed into a sink): the bound without any MMA.
// - `mma`: the staged kernels' loop: per 2 MMA steps and token tile one 16-byte ld.shared of B,
//   per step and tile one mma.sync.m16n8k16.
// - `wgmma`: per chunk the 8 steps' A decoded, then 8 wgmma.mma_async.m64nNk16 over all N tokens
//   (B in the K-major canonical layout without swizzle), one commit, and a wait before the next
//   chunk's decode overwrites the A registers.
// - `wgmma2`: the same with two sets of A registers, so that a chunk's MMAs run while the next
//   chunk is decoded into the other set; the wait comes after that decode.
// Before timing, each N runs once on one block with exact inputs (E2M1 weights times 1, small
// integer activations: every sum is exact in fp32), and both MMA variants' accumulators are
// compared with a host reference element by element; a variant that disagrees is reported and not
// timed (so a wrong layout in this probe shows up as that, not as a speed).
//
// Build and run (H200): scripts/gpu-probe-wgmma. `probe-wgmma --emulate` runs the exact check on
// the host instead, against an emulation of the kernel's arithmetic: the probe's bookkeeping
// checked without a GPU.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/mma.cuh"
#include "cuda/nvfp4_pair_order.h"
#include "probe_common.cuh"

namespace {

using moeinfer::cuda::mma_bf16_16816;
using moeinfer::cuda::mul_bf16x2;
using moeinfer::cuda::pair_order_bf16x2;
using probe::load_stream;
using probe::median_ms;
using probe::stream_kernel;

constexpr int kWarp = 32, kWarps = 4, kThreads = kWarps * kWarp;
constexpr int kChunkCols = 128;                        // a warp's chunk: 16 rows x 128 columns, 1 KB
constexpr int kSteps = kChunkCols / 16;                // MMA steps (k16) per chunk
constexpr int kSliceCols = 512;                        // the staged activations: 4 chunks' columns
constexpr int kSliceChunks = kSliceCols / kChunkCols;
constexpr int kBlockChunkBytes = kWarps * 1024;        // one chunk of all 4 warps
constexpr int kMmaRowBytes = kSliceCols * 2 + 64;      // mma layout: a token's row (+64: no bank conflicts)
constexpr int64_t kTotalBytes = int64_t{256} << 20;

enum class Mode { kDecode, kMma, kWgmma, kWgmma2 };
const char* mode_name(Mode m) {
  return m == Mode::kDecode ? "decode" : (m == Mode::kMma ? "mma" : (m == Mode::kWgmma ? "wgmma" : "wgmma2"));
}

struct Params {
  const uint8_t* weights;  // per block: chunks x kBlockChunkBytes; warp w's tile at w KB
  const uint32_t* scales;  // per block and chunk: one word per thread
  const uint8_t* b;        // the N tokens' activations in the mode's shared-memory layout
  int chunks;              // per block, a multiple of kSliceChunks
  float* out;              // per thread: the accumulators (N / 2 floats), or a sink
  uint64_t desc_strides;   // wgmma: B's descriptor fields past the start address (desc_strides())
};

// The bytes of N tokens' activations in a mode's shared-memory layout.
__host__ __device__ constexpr int b_bytes(Mode m, int n) { return m == Mode::kMma ? n * kMmaRowBytes : n * kSliceCols * 2; }

// The A register of step s, slot j (0: k 2c..2c+1 of the step, 1: k 2c+8..2c+9) from a row's
// 16-byte run, as expert_major.cu's decode<kNvfp4, 32>: pair (s % 2) * 2 + j of word s / 2.
__device__ __forceinline__ uint32_t decode(const uint4& run, uint32_t scale, int s, int j) {
  const uint32_t word = s / 2 == 0 ? run.x : (s / 2 == 1 ? run.y : (s / 2 == 2 ? run.z : run.w));
  return mul_bf16x2(pair_order_bf16x2(word, (s % 2) * 2 + j), scale);
}

// A scale word as a bf16 pair: 2^126 x 2^(bit 7 of the code - 1), so that code 0x80 gives 2^126
// (the weights' E2M1 values exactly: pair order decodes them x 2^-126). One logic operation, as
// the staged kernels' scale conversion is a few per chunk.
__device__ __forceinline__ uint32_t scale_pair(uint32_t code) { return (code & 0x00800080u) | 0x7E007E00u; }

// K-major canonical layout without swizzle (PTX ISA, wgmma shared-memory layouts):
// ((8,m),(8,2k)):((8,SBO),(1,LBO)) in bf16 elements for B's N x K: a core matrix is 8 tokens x 8 k
// values, 128 contiguous bytes; core matrices adjacent in k lie LBO = 128 bytes apart, those 8
// tokens apart SBO = 16 x kSliceCols bytes apart.
constexpr uint32_t kLbo = 128, kSbo = 16 * kSliceCols;
__host__ __device__ constexpr int wgmma_b_offset(int n, int k) {
  return (n % 8) * 16 + (n / 8) * static_cast<int>(kSbo) + (k % 8) * 2 + (k / 8) * static_cast<int>(kLbo);
}

// A descriptor's stride fields (no swizzle, base offset 0): the leading dimension byte offset in
// bits 16-29 and the stride dimension byte offset in bits 32-45, both in 16-byte units. `swapped`
// puts each value in the other's field: if the device's exact check fails with this probe's
// reading of the ISA and passes swapped, the probe says so and times that.
uint64_t desc_strides(bool swapped) {
  const uint64_t lbo = (swapped ? kSbo : kLbo) >> 4, sbo = (swapped ? kLbo : kSbo) >> 4;
  return lbo << 16 | sbo << 32;
}

// The descriptor of B at the slice's start; MMA step s's (k 16 s .. 16 s + 15) is this plus 16 s:
// its start address field counts 16 bytes, and shared memory (under 228 KB) keeps it within its
// 14 bits.
__device__ __forceinline__ uint64_t b_descriptor(uint32_t b_smem, uint64_t strides) {
  return static_cast<uint64_t>((b_smem & 0x3FFFFu) >> 4) | strides;
}

// d += A (64 x 16, this warp's 16 rows in a) x B (16 x N from the descriptor), the warpgroup together.
template <int kN>
__device__ __forceinline__ void wgmma_step(float (&d)[kN / 8][4], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (kN == 8) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, 1, 1, 1, 0;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else if constexpr (kN == 16) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1, "
        "0;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else if constexpr (kN == 24) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11}, "
        "{%12,%13,%14,%15}, %16, 1, 1, 1, 0;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else {
    static_assert(kN == 32);
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  }
}

struct Chunk {
  uint4 row_lo, row_hi;  // this lane's runs of rows g and g + 8
  uint32_t scale_code;
};

__device__ __forceinline__ Chunk load_chunk(const uint8_t* w, const uint32_t* scales, int i) {
  const uint8_t* tile = w + static_cast<int64_t>(i) * kBlockChunkBytes;
  return {load_stream(tile), load_stream(tile + 512), __ldg(scales + static_cast<int64_t>(i) * kThreads)};
}

// Grid: one wave (SMs x kMinBlocks blocks). Block: one warpgroup; warp w owns rows 16w .. 16w + 15
// of its block's 64, lane (g = lane / 4, c = lane % 4) rows g and g + 8 and run c of each chunk.
template <Mode kMode, int kN, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) probe_kernel(Params p) {
  extern __shared__ __align__(128) uint8_t b_smem[];
  constexpr int kTiles = kN / 8;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, c = lane % 4;
  if constexpr (kMode != Mode::kDecode) {
    for (int i = 16 * threadIdx.x; i < b_bytes(kMode, kN); i += 16 * kThreads) {
      *reinterpret_cast<uint4*>(b_smem + i) = *reinterpret_cast<const uint4*>(p.b + i);
    }
    // wgmma reads shared memory through the async proxy: the generic stores above must be made
    // visible to it before the barrier.
    if constexpr (kMode == Mode::kWgmma || kMode == Mode::kWgmma2) {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();
  }
  const uint8_t* w = p.weights + static_cast<int64_t>(blockIdx.x) * p.chunks * kBlockChunkBytes + warp * 1024 + 16 * lane;
  const uint32_t* scales = p.scales + static_cast<int64_t>(blockIdx.x) * p.chunks * kThreads + threadIdx.x;
  const uint32_t b_base = static_cast<uint32_t>(__cvta_generic_to_shared(b_smem));
  const uint64_t b_desc = b_descriptor(b_base, p.desc_strides);
  float acc[kTiles][4] = {};
  uint32_t sink = 0;
  uint32_t a_sets[kMode == Mode::kWgmma2 ? 2 : 1][kSteps][4];  // the wgmma modes' A registers
  Chunk ahead[2] = {load_chunk(w, scales, 0), load_chunk(w, scales, 1)};

  const auto run_chunk = [&](const Chunk& ch, int i) {
    const uint32_t scale = scale_pair(ch.scale_code);
    const int slice_step = i * kSteps;  // i: the chunk's place in the slice; its first MMA step there
    if constexpr (kMode == Mode::kDecode) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        sink ^= decode(ch.row_lo, scale, s, 0) ^ decode(ch.row_hi, scale, s, 0) ^ decode(ch.row_lo, scale, s, 1) ^
                decode(ch.row_hi, scale, s, 1);
      }
    } else if constexpr (kMode == Mode::kMma) {
#pragma unroll
      for (int u = 0; u < kSteps / 2; ++u) {
        uint4 b[kTiles];
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
          const uint32_t at = b_base + (8 * t + g) * kMmaRowBytes + (slice_step / 2 + u) * 64 + 16 * c;
          asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(b[t].x), "=r"(b[t].y), "=r"(b[t].z), "=r"(b[t].w)
                       : "r"(at));
        }
#pragma unroll
        for (int s = 2 * u; s < 2 * u + 2; ++s) {
          const uint32_t a[4] = {decode(ch.row_lo, scale, s, 0), decode(ch.row_hi, scale, s, 0),
                                 decode(ch.row_lo, scale, s, 1), decode(ch.row_hi, scale, s, 1)};
#pragma unroll
          for (int t = 0; t < kTiles; ++t) {
            mma_bf16_16816(acc[t], a, s % 2 == 0 ? b[t].x : b[t].z, s % 2 == 0 ? b[t].y : b[t].w);
          }
        }
      }
    } else {
      // wgmma2 decodes into the set the previous chunk's MMAs do not read, then waits for them.
      uint32_t(&a)[kSteps][4] = a_sets[kMode == Mode::kWgmma2 ? i % 2 : 0];
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        a[s][0] = decode(ch.row_lo, scale, s, 0), a[s][1] = decode(ch.row_hi, scale, s, 0);
        a[s][2] = decode(ch.row_lo, scale, s, 1), a[s][3] = decode(ch.row_hi, scale, s, 1);
      }
      if constexpr (kMode == Mode::kWgmma2) asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int s = 0; s < kSteps; ++s) wgmma_step<kN>(acc, a[s], b_desc + 16u * static_cast<uint32_t>(slice_step + s));
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      // wgmma waits at once; wgmma2 only at the slice's last chunk, so that no group is in flight
      // across the loop's back edge (ptxas serializes every wgmma of the loop otherwise).
      if (kMode == Mode::kWgmma || i == kSliceChunks - 1) asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
  };

  // Four chunks (one slice) per iteration, so that each chunk's place in the slice is a constant.
  for (int i = 0; i < p.chunks; i += kSliceChunks) {
#pragma unroll
    for (int j = 0; j < kSliceChunks; ++j) {
      const Chunk ch = ahead[j % 2];
      if (i + j + 2 < p.chunks) ahead[j % 2] = load_chunk(w, scales, i + j + 2);
      run_chunk(ch, j);
    }
  }
  float* out = p.out + (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * (kN / 2);
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[4 * t + e] = acc[t][e] + static_cast<float>(sink & 1u);
  }
}

// ---- host ---------------------------------------------------------------------------------------

float e2m1(uint32_t code) {
  static const float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (code & 8u) ? -kMagnitude[code & 7u] : kMagnitude[code & 7u];
}

uint16_t bf16_bits(float v) {  // exact for the small integers used here
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<uint16_t>(bits >> 16);
}

// The activation column that MMA step s (of a chunk), lane c, slot j, element e multiplies, within
// the chunk: the staged kernels' run order (lane c's run is columns 32c .. 32c + 31, and step s
// slot j takes its columns 4s + 2j + e).
int chunk_column(int s, int c, int j, int e) { return 32 * c + 4 * s + 2 * j + e; }

// Activations x[n][col] (n < N, col < kSliceCols) in a mode's shared-memory layout.
std::vector<uint8_t> b_layout(Mode m, int n_tokens, const std::vector<float>& x) {
  std::vector<uint8_t> out(static_cast<size_t>(b_bytes(m, n_tokens)), 0);
  const auto put = [&](int offset, float v) {
    const uint16_t b = bf16_bits(v);
    std::memcpy(out.data() + offset, &b, 2);
  };
  for (int n = 0; n < n_tokens; ++n) {
    for (int chunk = 0; chunk < kSliceChunks; ++chunk) {
      for (int s = 0; s < kSteps; ++s) {
        for (int c = 0; c < 4; ++c) {
          for (int j = 0; j < 2; ++j) {
            for (int e = 0; e < 2; ++e) {
              const float v = x[static_cast<size_t>(n * kSliceCols + chunk * kChunkCols + chunk_column(s, c, j, e))];
              const int step = chunk * kSteps + s;
              if (m == Mode::kMma) {  // unit of 2 steps: words b0(s even), b1(s even), b0(s odd), b1(s odd)
                const int word = (s % 2) * 2 + j;
                put(n * kMmaRowBytes + (step / 2) * 64 + 16 * c + 4 * word + 2 * e, v);
              } else {  // the fragment's k within the step: 2c + 8j + e
                put(wgmma_b_offset(n, 16 * step + 2 * c + 8 * j + e), v);
              }
            }
          }
        }
      }
    }
  }
  return out;
}

struct Device {
  int sms = 0;
  uint8_t* weights = nullptr;
  uint32_t* scales = nullptr;
  uint8_t* b = nullptr;
  float* out = nullptr;
};

template <Mode kMode, int kN, int kMinBlocks>
bool launch(const Device& dev, int grid, int chunks, bool swapped, float* ms) {
  auto kernel = probe_kernel<kMode, kN, kMinBlocks>;
  const int smem = kMode == Mode::kDecode ? 0 : b_bytes(kMode, kN);
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int resident = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, smem));
  if (resident < kMinBlocks && grid > 1) return false;
  const Params p{dev.weights, dev.scales, dev.b, chunks, dev.out, desc_strides(swapped)};
  if (ms == nullptr) {
    kernel<<<grid, kThreads, smem>>>(p);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  } else {
    *ms = median_ms([&] { kernel<<<grid, kThreads, smem>>>(p); });
  }
  return true;
}

// The exact check's inputs: one block's 4 chunks (one slice) of random E2M1 codes, stored in pair
// order, scale codes that decode to 2^126 (the codes' values exactly), and activations that are
// integers from -4 to 4 (every product and sum exact in fp32).
struct CheckCase {
  std::vector<uint32_t> natural;  // the codes in checkpoint order, word by word as the tiles hold them
  std::vector<uint8_t> tiles;     // the same in pair order: what the kernel reads
  std::vector<float> x;           // [n][kSliceCols]
  std::vector<uint8_t> b;         // x in the mode's shared-memory layout
};

CheckCase make_case(Mode m, int n_tokens) {
  CheckCase cc;
  std::mt19937 rng(7 + n_tokens);
  cc.natural.resize(static_cast<size_t>(kSliceChunks) * kBlockChunkBytes / 4);
  for (uint32_t& word : cc.natural) word = static_cast<uint32_t>(rng());
  cc.tiles.resize(cc.natural.size() * 4);
  for (size_t i = 0; i < cc.natural.size(); ++i) {
    const uint32_t stored = moeinfer::cuda::to_pair_order(cc.natural[i]);
    std::memcpy(cc.tiles.data() + 4 * i, &stored, 4);
  }
  cc.x.resize(static_cast<size_t>(n_tokens) * kSliceCols);
  for (float& v : cc.x) v = static_cast<float>(static_cast<int>(rng() % 9) - 4);
  cc.b = b_layout(m, n_tokens, cc.x);
  return cc;
}

// What each thread's accumulators must hold: thread t's element i is D[row][n] of its warp's rows
// (the m16n8 accumulator layout per 8 tokens), summed from the checkpoint-order codes: warp w's
// tile of chunk ch holds row g + 8h's run c (columns 32c .. 32c + 31 of the chunk) at byte
// 512h + 16 (4g + c), natural word q of a run holding its columns 8q .. 8q + 7 in nibble order.
std::vector<double> expected_sums(const CheckCase& cc, int n_tokens) {
  std::vector<double> want(static_cast<size_t>(kThreads) * (n_tokens / 2));
  for (int t = 0; t < kThreads; ++t) {
    const int warp = t / kWarp, lane = t % kWarp, g = lane / 4, c = lane % 4;
    for (int i = 0; i < n_tokens / 2; ++i) {
      const int tile = i / 4, e = i % 4, half = e / 2, n = 8 * tile + 2 * c + e % 2;
      double sum = 0.0;
      for (int ch = 0; ch < kSliceChunks; ++ch) {
        for (int run = 0; run < 4; ++run) {
          for (int v = 0; v < 32; ++v) {
            const size_t word =
                (static_cast<size_t>(ch) * kBlockChunkBytes + warp * 1024 + half * 512 + 16 * (4 * g + run)) / 4 + v / 8;
            const float weight = e2m1(cc.natural[word] >> (4 * (v % 8)) & 15u);
            sum += static_cast<double>(weight) * cc.x[static_cast<size_t>(n * kSliceCols + ch * kChunkCols + 32 * run + v)];
          }
        }
      }
      want[static_cast<size_t>(t) * (n_tokens / 2) + i] = sum;
    }
  }
  return want;
}

float bf16_value(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The kernel's arithmetic on the host, from the bytes it reads, under this probe's reading of the
// PTX ISA's fragment layouts (m16n8k16 A, B and D; wgmma's A per warp as m16n8k16's, D likewise
// per 8 tokens) and of the descriptor's K-major layout (wgmma_b_offset). It checks the probe's
// own bookkeeping (the B layouts, the run order, the expected sums) without a GPU; the device
// check tests the hardware's reading.
std::vector<float> emulate(Mode m, int n_tokens, const CheckCase& cc) {
  const int tiles = n_tokens / 8;
  std::vector<float> got(static_cast<size_t>(kThreads) * (n_tokens / 2), 0.0f);
  const auto b_value = [&](int offset) {
    uint16_t v;
    std::memcpy(&v, cc.b.data() + offset, 2);
    return bf16_value(v);
  };
  for (int warp = 0; warp < kWarps; ++warp) {
    for (int ch = 0; ch < kSliceChunks; ++ch) {
      for (int s = 0; s < kSteps; ++s) {
        const int step = ch * kSteps + s;
        std::vector<float> a(16 * 16), b(static_cast<size_t>(16) * n_tokens);  // A[row][k], B[k][n]
        for (int lane = 0; lane < kWarp; ++lane) {
          const int g = lane / 4, c = lane % 4;
          for (int half = 0; half < 2; ++half) {
            uint32_t word;
            std::memcpy(&word, cc.tiles.data() + ch * kBlockChunkBytes + warp * 1024 + half * 512 + 16 * lane + 4 * (s / 2), 4);
            for (int j = 0; j < 2; ++j) {
              uint32_t pair = 0;
              switch ((s % 2) * 2 + j) {
                case 0: pair = pair_order_bf16x2<0>(word); break;
                case 1: pair = pair_order_bf16x2<1>(word); break;
                case 2: pair = pair_order_bf16x2<2>(word); break;
                default: pair = pair_order_bf16x2<3>(word); break;
              }
              for (int e = 0; e < 2; ++e) {  // times the scale 2^126
                a[static_cast<size_t>((g + 8 * half) * 16 + 2 * c + 8 * j + e)] =
                    std::ldexp(bf16_value(pair >> (16 * e) & 0xFFFFu), 126);
              }
            }
          }
          for (int tile = 0; tile < tiles; ++tile) {
            const int n = 8 * tile + g;
            for (int j = 0; j < 2; ++j) {
              for (int e = 0; e < 2; ++e) {
                const int k = 2 * c + 8 * j + e;
                const int offset = m == Mode::kMma
                                       ? n * kMmaRowBytes + (step / 2) * 64 + 16 * c + 4 * ((s % 2) * 2 + j) + 2 * e
                                       : wgmma_b_offset(n, 16 * step + k);
                b[static_cast<size_t>(k) * n_tokens + n] = b_value(offset);
              }
            }
          }
        }
        for (int lane = 0; lane < kWarp; ++lane) {
          const int g = lane / 4, c = lane % 4;
          for (int i = 0; i < n_tokens / 2; ++i) {
            const int tile = i / 4, e = i % 4, row = g + 8 * (e / 2), n = 8 * tile + 2 * c + e % 2;
            float sum = 0.0f;
            for (int k = 0; k < 16; ++k) sum += a[static_cast<size_t>(row * 16 + k)] * b[static_cast<size_t>(k) * n_tokens + n];
            got[static_cast<size_t>(warp * kWarp + lane) * (n_tokens / 2) + i] += sum;
          }
        }
      }
    }
  }
  return got;
}

// Counts the accumulators that differ from the expected sums; prints the verdict.
bool compare(const char* what, Mode m, int n_tokens, const std::vector<float>& got, const std::vector<double>& want) {
  int bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double diff = std::fabs(got[i] - want[i]);
    if (!(diff == 0.0)) ++bad, worst = std::fmax(worst, std::isnan(diff) ? INFINITY : diff);
  }
  if (bad == 0) {
    std::printf("%s %-6s N=%2d: exact\n", what, mode_name(m), n_tokens);
  } else {
    std::printf("%s %-6s N=%2d: %d of %zu sums differ (largest difference %g)\n", what, mode_name(m), n_tokens, bad,
                want.size(), worst);
  }
  return bad == 0;
}

// One block over one slice with exact inputs on the GPU; the accumulators against the host's sums.
template <Mode kMode, int kN>
bool check(const Device& dev, bool swapped) {
  const CheckCase cc = make_case(kMode, kN);
  const std::vector<uint32_t> scales(static_cast<size_t>(kSliceChunks) * kThreads, 0x00800080u);
  CHECK(cudaMemcpy(dev.weights, cc.tiles.data(), cc.tiles.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dev.scales, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dev.b, cc.b.data(), cc.b.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dev.out, 0xFF, static_cast<size_t>(kThreads) * (kN / 2) * 4));  // NaN: poison
  launch<kMode, kN, 1>(dev, 1, kSliceChunks, swapped, nullptr);
  std::vector<float> got(static_cast<size_t>(kThreads) * (kN / 2));
  CHECK(cudaMemcpy(got.data(), dev.out, got.size() * 4, cudaMemcpyDeviceToHost));
  return compare(swapped ? "check (descriptor strides swapped)" : "check", kMode, kN, got, expected_sums(cc, kN));
}

// Whether a mode passed its exact check, and with which reading of the descriptor's strides.
struct Checked {
  bool ok = false;
  bool swapped = false;
};

template <Mode kMode, int kN>
Checked check_mode(const Device& dev) {
  if (check<kMode, kN>(dev, false)) return {true, false};
  if (kMode == Mode::kMma) return {};
  if (check<kMode, kN>(dev, true)) return {true, true};
  std::printf("  %s N=%d: wrong either way; not timed\n", mode_name(kMode), kN);
  return {};
}

template <Mode kMode, int kN, int kMinBlocks>
void time_one(const Device& dev, double stream, Checked checked) {
  if (!checked.ok) return;
  const int grid = dev.sms * kMinBlocks;
  const int chunks = static_cast<int>(kTotalBytes / grid / kBlockChunkBytes) / kSliceChunks * kSliceChunks;
  float ms = 0;
  if (!launch<kMode, kN, kMinBlocks>(dev, grid, chunks, checked.swapped, &ms)) {
    std::printf("%-6s N=%2d blocks/SM %d: not resident\n", mode_name(kMode), kN, kMinBlocks);
    return;
  }
  const double bytes = static_cast<double>(grid) * chunks * (kBlockChunkBytes + kThreads * 4);
  const double rate = bytes / (ms * 1e-3) / 1e9;
  std::printf("%-6s N=%2d blocks/SM %d: %7.1f us  %5.0f GB/s  %5.1f%% of stream\n", mode_name(kMode), kN, kMinBlocks,
              ms * 1e3, rate, 100 * rate / stream);
}

template <int kN>
void probe_n(const Device& dev, double stream) {
  const Checked mma_ok = check_mode<Mode::kMma, kN>(dev), wgmma_ok = check_mode<Mode::kWgmma, kN>(dev),
                wgmma2_ok = check_mode<Mode::kWgmma2, kN>(dev);
  // Timing data: the same random tiles everywhere (the bytes' values do not change the work).
  CHECK(cudaMemset(dev.weights, 0x5A, kTotalBytes));
  CHECK(cudaMemset(dev.scales, 0x80, kTotalBytes / 8));
  time_one<Mode::kMma, kN, 2>(dev, stream, mma_ok);
  time_one<Mode::kMma, kN, 3>(dev, stream, mma_ok);
  time_one<Mode::kMma, kN, 4>(dev, stream, mma_ok);
  time_one<Mode::kWgmma, kN, 2>(dev, stream, wgmma_ok);
  time_one<Mode::kWgmma, kN, 3>(dev, stream, wgmma_ok);
  time_one<Mode::kWgmma, kN, 4>(dev, stream, wgmma_ok);
  time_one<Mode::kWgmma2, kN, 2>(dev, stream, wgmma2_ok);
  time_one<Mode::kWgmma2, kN, 3>(dev, stream, wgmma2_ok);
  time_one<Mode::kWgmma2, kN, 4>(dev, stream, wgmma2_ok);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--emulate") == 0) {  // no GPU needed
    bool ok = true;
    for (const Mode m : {Mode::kMma, Mode::kWgmma}) {
      for (const int n : {8, 16, 24, 32}) {
        const CheckCase cc = make_case(m, n);
        ok = compare("emulated", m, n, emulate(m, n, cc), expected_sums(cc, n)) && ok;
      }
    }
    return ok ? 0 : 1;
  }
  Device dev;
  CHECK(cudaDeviceGetAttribute(&dev.sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaMalloc(&dev.weights, kTotalBytes));
  CHECK(cudaMalloc(&dev.scales, kTotalBytes / 8));
  CHECK(cudaMalloc(&dev.b, b_bytes(Mode::kMma, 32)));
  CHECK(cudaMalloc(&dev.out, static_cast<size_t>(dev.sms) * 4 * kThreads * 16 * 4));
  CHECK(cudaMemset(dev.weights, 0x5A, kTotalBytes));
  const float stream_ms = median_ms(
      [&] { stream_kernel<<<dev.sms * 8, 256>>>(reinterpret_cast<const uint4*>(dev.weights), kTotalBytes / 16, dev.out); });
  const double stream = kTotalBytes / (stream_ms * 1e-3) / 1e9;
  std::printf("stream: 256 MB in %.1f us, %.0f GB/s (the %% column's reference)\n", stream_ms * 1e3, stream);
  time_one<Mode::kDecode, 8, 2>(dev, stream, {true, false});
  time_one<Mode::kDecode, 8, 3>(dev, stream, {true, false});
  time_one<Mode::kDecode, 8, 4>(dev, stream, {true, false});
  probe_n<8>(dev, stream);
  probe_n<16>(dev, stream);
  probe_n<24>(dev, stream);
  probe_n<32>(dev, stream);
  CHECK(cudaFree(dev.weights));
  CHECK(cudaFree(dev.scales));
  CHECK(cudaFree(dev.b));
  CHECK(cudaFree(dev.out));
  return 0;
}
