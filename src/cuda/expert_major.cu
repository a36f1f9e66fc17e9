// The expert-major path: routes grouped by expert on the device into work items of up to 8 or 32
// routes, then tensor-core MMAs (mma.sync m16n8k16, fp32 accumulate) with the weights
// dequantized in registers. Each expert is read once per work item however many of its routes
// the item holds. Two kernel shapes, chosen per GEMM by expert_major_staged (moe_kernels.cuh):
// - split-K: one block per (item, 16 output rows), its 4 warps splitting K, their sums meeting
//   in shared memory; the activations read from L2 by every block. A down of one token tile
//   takes 32 rows per block where H allows (moe_expert_down_pairs);
// - staged (items of 8 routes): one block per (item, 64 output rows), each warp on its own 16
//   rows over the whole K; the item's activations copied once per block into shared memory, so
//   L2 carries a quarter of the activation traffic and each warp streams 4x longer.
// A call of one token may also select its experts in the gate_up kernel (no route kernel before
// it: moe_expert_gate_up_select), and one of up to 16 tokens blend in the down kernel (no blend
// kernel after it: one block per 16 rows of H runs every item, moe_expert_down_blend, or past
// 16 items moe_expert_down_blend_rolled), where ExpertMajorLaunch says so.
//
// Operand layout. The weights are the MMA's A operand (16 rows x 16 k per MMA), the tokens its
// B operand (16 k x 8 tokens). The four lanes of a quad (lane % 4 = c) each own a contiguous run
// of V input columns per chunk of 4V columns, V = 16 bytes of weights (32 NVFP4, 16 FP8 or
// 8 BF16 values), so every lane loads 16 contiguous bytes of a row and 16 or 32 contiguous
// activations. The MMA's k order is the lane's run taken a column pair at a time: step s, slot j
// of A holds the weights of the run's columns 2(2s + j) and 2(2s + j) + 1, and B the activations'
// natural bf16 word 2s + j, which leaves the dot products unchanged. NVFP4 codes are kept on the
// device in pair order (nvfp4_pair_order.h), so such a column pair decodes with one mask after at
// most a shift or a multiply. Columns past the last full chunk go through the same code with
// V = 4 (one MMA step; an NVFP4 lane loads the word holding its 4 values). A chunk is 64 bytes of
// each of the warp's 16 rows in every format; where the matrix is stored in weight tiles
// (weight_tiles.h) those 16 x 64 bytes are one 1 KB run, and each of the warp's load instructions
// reads 512 contiguous bytes rather than 8 rows x 64 bytes.
//
// Numbers: bf16 operands, fp32 accumulation. NVFP4 codes become bf16 by moving bits (E2M1 x
// 2^-126, E2M1's subnormal 0.5 landing on bf16's), then one bf16 multiply by the block scale
// x 2^119 (exact: at most 6 significant bits); the 2^-7 left over and the global scale are
// applied to the fp32 result. FP8 converts exactly (E4M3 values are bf16 values); block-128
// scales multiply each chunk's fp32 partial, per-channel and per-tensor scales the result.
// Activations (x, and the gate/up activation handed to down) are rounded to bf16, as the
// reference models compute them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/mma.cuh"
#include "cuda/moe_kernels.cuh"
#include "cuda/nvfp4_pair_order.h"
#include "cuda/route_select.cuh"
#include "moeinfer/format.h"
#include "moeinfer/layer.h"

namespace moeinfer::cuda {

namespace {

constexpr int kWarps = 4;                             // split-K: warp w takes chunks w, w+4, ...
constexpr int kRows = 16;                             // output rows per block (one MMA M)
constexpr int kTile = 8;                              // routes per MMA (N)
constexpr int kMaxTiles = kExpertMajorGroup / kTile;  // token tiles per block
constexpr int kDownBlendWarps = kExpertMajorDownBlendWarps;  // moe_expert_down_blend's most warps

// How the weights are read: FP8 under block-128 scales scales each chunk's sum on its own.
enum class Fmt { kNvfp4, kFp8, kFp8Block, kBf16 };

__host__ __device__ constexpr bool is_fp8(Fmt f) { return f == Fmt::kFp8 || f == Fmt::kFp8Block; }

// Values per lane-run in the main loop: 16 bytes of weights.
template <Fmt F>
constexpr int kMainRun = F == Fmt::kNvfp4 ? 32 : (is_fp8(F) ? 16 : 8);

// Two E4M3 codes (low byte first) as floats, exactly.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t two_codes) {
  uint32_t h;
  const uint16_t v = static_cast<uint16_t>(two_codes);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
  float lo, hi;
  asm("{ .reg .b16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u; }" : "=f"(lo), "=f"(hi) : "r"(h));
  return make_float2(lo, hi);
}

// NVFP4 block scales, two at a time, as the bf16 pair (s0 x 2^119, s1 x 2^119), exactly, from the
// f16 pair of two nonnegative E4M3 codes (the upload folds signs into the E2M1 codes and zeroes the
// codes of zero scales: nvfp4_scale_fold.h). An f16's bits shifted right by 3 are the bf16 bits of
// its value x 2^-112 (the exponent field keeps its value, the bias goes from 15 to 127; an f16 made
// from E4M3 has its low 7 mantissa bits zero, so the high half's shift leaves the low half's top bits
// clear). Adding 231 to each exponent field then gives s x 2^119: at most 23 + 231 = 254, with no
// carry out of a half. A zero scale becomes 2^104, over zero codes only.
__device__ __forceinline__ uint32_t scale_pair(uint32_t f16x2) { return (f16x2 >> 3) + 0x73807380u; }

// The f16 pair of the two E4M3 codes in the low half of a word, and in its high half (the
// conversion reads either half in place).
__device__ __forceinline__ uint32_t e4m3x2_low_to_f16x2(uint32_t word) {
  uint32_t h;
  asm("{ .reg .b16 l, u; mov.b32 {l, u}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(h) : "r"(word));
  return h;
}
__device__ __forceinline__ uint32_t e4m3x2_high_to_f16x2(uint32_t word) {
  uint32_t h;
  asm("{ .reg .b16 l, u; mov.b32 {l, u}, %1; cvt.rn.f16x2.e4m3x2 %0, u; }" : "=r"(h) : "r"(word));
  return h;
}

// Two E4M3 codes as a bf16 pair (exact: E4M3 values are bf16 values).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two_codes) {
  const float2 f = e4m3x2_to_float2(two_codes);
  return pack_bf16(f.x, f.y);
}

// Bytes of `cols` consecutive weights of a row.
template <Fmt F>
__device__ __forceinline__ unsigned weight_bytes(unsigned cols) {
  return F == Fmt::kNvfp4 ? cols / 2 : (is_fp8(F) ? cols : 2 * cols);
}

// Bytes of weights a lane loads for a run of V values: an NVFP4 tail run (V = 4) loads the whole
// word holding its two pairs.
template <Fmt F, int V>
constexpr int kRunBytes = F == Fmt::kNvfp4 ? (V == 4 ? 4 : V / 2) : (is_fp8(F) ? V : 2 * V);

// A weight load on the read-only path that allocates no L1 line (ld.global.nc.L1::no_allocate):
// weights are read once per call, and L1 is left to the scale codes and activations.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 load_stream(const uint2* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned load_stream(const unsigned* p) {
  unsigned v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// `kBytes` bytes at p into words: 16-byte loads where kAligned16 says p is 16-byte aligned, else
// 8-byte loads (NVFP4 rows of K % 32 == 16 columns start 8 bytes off every other row). Weights
// stream (read once per call); activations are cached, by ordinary loads: a down launched during
// its gate_up (expert_major_early_down) reads gate_up's activations after griddepcontrol.wait,
// and a read-only load (ld.global.nc, __ldg) may be moved above it, which the GPU tests caught.
template <int kBytes, bool kStream, bool kAligned16>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t* w) {
  if constexpr (kBytes >= 16 && kAligned16) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4* q = reinterpret_cast<const uint4*>(p) + i;
      const uint4 v = kStream ? load_stream(q) : *q;
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (kBytes >= 8) {
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) {
      const uint2* q = reinterpret_cast<const uint2*>(p) + i;
      const uint2 v = kStream ? load_stream(q) : *q;
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else {
    static_assert(kBytes == 4);
    const unsigned* q = reinterpret_cast<const unsigned*>(p);
    w[0] = kStream ? load_stream(q) : *q;
  }
}

// Where one lane reads, each pointer at column 0: its rows gid and gid + 8 of each matrix with
// their NVFP4 scale codes, the FP8 block-128 scales of the tile's 128-row block, and the
// activations of its B column in every token tile. The B columns past the item's routes read its
// first route's activations: those MMA columns are computed and dropped, so no load depends on
// the route count. Computed once per block, so the K loop only adds column offsets.
template <int kMats, int kTiles>
struct LaneRows {
  const uint8_t* w[kMats][2];  // row-major: the row's start; tiled: its row in the panel's first tile
  unsigned chunk_stride;       // bytes from a row's 64-byte chunk of K to its next: 64, or kTileBytes in tiles
  const uint8_t* scale_codes[kMats][2];
  const float* block_scales[kMats];
  const uint16_t* b[kTiles];
  const uint8_t* staged;  // staged kernels: this lane's token row of the block's activations in shared memory
  int staged_tile;        // staged kernels: bytes from one token tile's rows to the next's
  // Staged kernels with staged NVFP4 scales: this lane's rows gid and gid + 8 of each matrix's copy.
  const uint8_t* staged_scales[kMats][2];
  // NVFP4 in tiles (the kTiled loops): this lane's 16 bytes of row gid in its panel's first tile
  // (row gid + 8's lie 512 bytes on), and its 4 bytes of the panel's first scale tile.
  const uint8_t* tile_w[kMats];
  const uint8_t* tile_scales[kMats];
  // Staged kernels, NVFP4 main loop: where this lane's 16-byte units 4c, 4c + 1 (staged_lo) and
  // 4c + 2, 4c + 3 (staged_hi) of a chunk's staged activations lie for the chunk at column 0, in
  // bytes from the start of the block's dynamic shared memory (load_staged_unit).
  uint32_t staged_lo;
  uint32_t staged_hi;
};

// ---- Staged activations (the staged kernels, one token tile): the block's 8 token columns are
// copied once into shared memory, where its 4 warps, each on its own 16 rows, read them.

// Where the 16-byte unit q (columns 8q .. 8q + 7) of a staged row lies: unit q ^ (2 x bit 3 of q).
// With the row stride of expert_major_staged_row_bytes, the 8 lanes of a shared-memory phase (2 token rows x 4 lanes of a
// quad) reading unit 4c + i of a chunk (NVFP4; 2c + i for FP8) hit 8 different bank groups.
__device__ __forceinline__ unsigned staged_unit(unsigned q) { return q ^ ((q >> 2) & 2u); }

// This lane's V activations from column k of its staged row (k % 8 == 0 for V >= 8, else k % 4 == 0).
template <int V>
__device__ __forceinline__ void load_staged_b(const uint8_t* row, unsigned k, uint32_t (&w)[V / 2]) {
  if constexpr (V >= 8) {
#pragma unroll
    for (int i = 0; i < V / 8; ++i) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * staged_unit(k / 8 + i));
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else {
    static_assert(V == 4);
    const uint2 v = *reinterpret_cast<const uint2*>(row + 16 * staged_unit(k / 8) + 2 * (k % 8));
    w[0] = v.x, w[1] = v.y;
  }
}

// The registers of one chunk that are loaded ahead of its MMAs: both rows' weight runs of each
// matrix, the NVFP4 scale codes (kTiled: row gid's two and row gid + 8's in one word,
// scale_codes[mi][0]; else each row's two in the low half of its own), the FP8 block-128 scale,
// and token tile 0's activations.
template <Fmt F, int V, int kMats, bool kTiled = false>
struct Chunk {
  uint32_t raw[kMats][2][4];
  uint32_t scale_codes[kMats][2];
  float block_scale[kMats];
  uint32_t b0[V / 2];
};

// The staged kernels' dynamic shared memory (each kernel's `staged`, by a name the helpers below
// can address it through with 32-bit offsets).
extern __shared__ __align__(16) uint8_t staged_smem[];

// Unit u (0..3) of this lane's 32 activations of the NVFP4 chunk at column k0 of a staged row
// (k0 % 128 == 0), token tile `tile`: unit k0 / 8 + 4c + u. k0 / 8 is a multiple of 16, so
// staged_unit's swizzle (bit 1 flipped where bit 3 is set) depends on 4c + u alone, and the lane's
// unit offsets are fixed once per block (LaneRows::staged_lo, staged_hi): the loop adds the column,
// not the swizzle.
template <int kMats, int kTiles>
__device__ __forceinline__ void load_staged_unit(const LaneRows<kMats, kTiles>& rows, int tile, unsigned k0, int u,
                                                 uint32_t (&w)[4]) {
  const unsigned at = (u < 2 ? rows.staged_lo : rows.staged_hi) + tile * rows.staged_tile + 2 * k0 + 16 * (u % 2);
  const uint4 v = *reinterpret_cast<const uint4*>(staged_smem + at);
  w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
}

// This lane's V activations of one B column from column k (16-byte aligned for V >= 8: H and I
// are multiples of 16).
template <int V>
__device__ __forceinline__ void load_b(const uint16_t* row, unsigned k, uint32_t (&w)[V / 2]) {
  load_words<2 * V, false, true>(reinterpret_cast<const uint8_t*>(row + k), w);
}

// This lane's NVFP4 scale codes of the chunk at k0 from the block's staged copy (K % 128 == 0, so
// V = 32: the run's two codes are one aligned half word).
template <int kMats, int kTiles>
__device__ __forceinline__ void load_staged_scales(const LaneRows<kMats, kTiles>& rows, unsigned k0,
                                                   uint32_t (&codes)[kMats][2]) {
  const unsigned at = (k0 + threadIdx.x % 4 * 32) / 16;
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) codes[mi][r] = *reinterpret_cast<const unsigned short*>(rows.staged_scales[mi][r] + at);
  }
}

// An NVFP4 scale code. A staged warp reads its rows' codes through L1 at normal priority: the
// row's next chunks read the same 32-byte sector. A split-K warp reads a few chunks per row and
// marks them evict-first: normal priority there measured 0.98x at qwen3-next N = 4-8
// (docs/PERF.md, v3.10).
template <bool kCached, typename T>
__device__ __forceinline__ T load_scale(const T* p) {
  return kCached ? __ldg(p) : __ldcs(p);
}

// The chunk of 4V columns from k0: lane c's run starts at k0 + cV. With kStaged the activations
// are read from shared memory at MMA time instead, and with kSmemScales the NVFP4 scale codes too.
// kScales false leaves staged scale codes out (they are read once they have arrived). kTiled
// (NVFP4 main loop over a tiled matrix): both rows' runs from one pointer, and the four scale codes
// in one load (tiled_scale_offset's order: row gid's two, then row gid + 8's).
// kB false (split-K): token tile 0's activations are left for load_chunk_b.
template <Fmt F, int V, int kMats, int kTiles, bool kAligned16, bool kStaged, bool kSmemScales = false,
          bool kScales = true, bool kTiled = false, bool kB = true>
__device__ __forceinline__ void load_chunk(const LaneRows<kMats, kTiles>& rows, unsigned k0, Chunk<F, V, kMats, kTiled>& ch) {
  const unsigned c = threadIdx.x % 4;
  if constexpr (kTiled) {
    static_assert(F == Fmt::kNvfp4 && V == kMainRun<F> && kAligned16 && !kSmemScales);
    const unsigned chunk = k0 / (4 * V);
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi) {
      const uint8_t* w = rows.tile_w[mi] + chunk * kTileBytes;
      load_words<16, true, true>(w, ch.raw[mi][0]);
      load_words<16, true, true>(w + kTileBytes / 2, ch.raw[mi][1]);
      ch.scale_codes[mi][0] =
          load_scale<kStaged>(reinterpret_cast<const uint32_t*>(rows.tile_scales[mi] + chunk * kScaleTileBytes));
    }
    if constexpr (!kStaged && kB) load_b<V>(rows.b[0], k0 + c * V, ch.b0);
    return;
  }
  const unsigned k = k0 + c * V;
  // An NVFP4 tail run is half a word of codes: lanes 2i and 2i + 1 both load word i.
  const unsigned k_weights = F == Fmt::kNvfp4 && V == 4 ? k0 + 8 * (c / 2) : k;
  // A main-loop chunk is 64 bytes of each row, wherever the layout puts them (a tiled matrix has
  // no tail: its K is whole chunks); lane c's run is bytes 16c .. 16c + 15 of them.
  const unsigned at = V == kMainRun<F> ? weight_bytes<F>(k0) / kTileRowBytes * rows.chunk_stride + 16 * c
                                       : weight_bytes<F>(k_weights);
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      load_words<kRunBytes<F, V>, true, kAligned16>(rows.w[mi][r] + at, ch.raw[mi][r]);
      if constexpr (F == Fmt::kNvfp4 && !kSmemScales) {
        const uint8_t* s = rows.scale_codes[mi][r] + k_weights / 16;
        if constexpr (V == 32 && kAligned16) {  // K % 32 == 0: the run's two codes are one aligned half word
          ch.scale_codes[mi][r] = load_scale<kStaged>(reinterpret_cast<const unsigned short*>(s));
        } else if constexpr (V == 32) {
          ch.scale_codes[mi][r] =
              static_cast<uint32_t>(load_scale<kStaged>(s)) | static_cast<uint32_t>(load_scale<kStaged>(s + 1)) << 8;
        } else {
          ch.scale_codes[mi][r] = load_scale<kStaged>(s);
        }
      }
    }
    // A 16-row tile and a chunk of at most 64 columns lie in one 128 x 128 block.
    if constexpr (F == Fmt::kFp8Block) ch.block_scale[mi] = __ldg(rows.block_scales[mi] + k0 / 128);
  }
  if constexpr (kSmemScales && kScales) load_staged_scales(rows, k0, ch.scale_codes);
  if constexpr (!kStaged && kB) load_b<V>(rows.b[0], k, ch.b0);
}

// The token tile 0 activations of a split-K chunk at k0 that load_chunk<..., kB = false> left out.
template <Fmt F, int V, int kMats, int kTiles, bool kTiled>
__device__ __forceinline__ void load_chunk_b(const LaneRows<kMats, kTiles>& rows, unsigned k0, Chunk<F, V, kMats, kTiled>& ch) {
  load_b<V>(rows.b[0], k0 + threadIdx.x % 4 * V, ch.b0);
}

// The A register of MMA step s, slot j, for one row's run: the weights of the run's columns
// 2(2s + j) and 2(2s + j) + 1, which B's natural word 2s + j multiplies. `scale` holds the NVFP4
// block scales (x 2^119) as bf16 pairs (s, s).
template <Fmt F, int V>
__device__ __forceinline__ uint32_t decode(const uint32_t (&raw)[4], const uint32_t (&scale)[2], int s, int j) {
  if constexpr (F == Fmt::kNvfp4 && V == 32) {
    const int q = s / 2;  // word q holds the run's values 8q .. 8q + 7: pairs 4q .. 4q + 3
    return mul_bf16x2(pair_order_bf16x2(raw[q], (s % 2) * 2 + j), scale[q / 2]);
  } else if constexpr (F == Fmt::kNvfp4) {
    const int c = threadIdx.x % 4;  // lane c's 4 values are pairs 2 (c % 2) and 2 (c % 2) + 1 of its word
    return mul_bf16x2(pair_order_bf16x2(raw[0], 2 * (c % 2) + j), scale[0]);
  } else if constexpr (is_fp8(F)) {
    return e4m3x2_to_bf16x2(raw[s] >> (16 * j));
  } else {
    return raw[2 * s + j];
  }
}

// The MMAs of one chunk of 4V input columns starting at k0, for kMats matrices sharing the B
// operand (gate and up, or down alone), every token tile of the item. The products accumulate
// straight into acc, except under FP8 block-128 scales, where each chunk's sum is scaled first.
template <Fmt F, int V, int kMats, int kTiles, bool kStaged, bool kTiled>
__device__ __forceinline__ void mma_chunk(const Chunk<F, V, kMats, kTiled>& ch, const LaneRows<kMats, kTiles>& rows, unsigned k0,
                                          int tiles, float (&acc)[kTiles][kMats][4]) {
  constexpr int kSteps = V / 4;
  const unsigned c = threadIdx.x % 4;
  uint32_t scale[kMats][2][2] = {};
  if constexpr (F == Fmt::kNvfp4) {
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // kTiled: row gid's two codes in the low half of one word, row gid + 8's in its high half.
        const uint32_t pair = scale_pair(kTiled && r == 1 ? e4m3x2_high_to_f16x2(ch.scale_codes[mi][0])
                                                          : e4m3x2_low_to_f16x2(ch.scale_codes[mi][kTiled ? 0 : r]));
        scale[mi][r][0] = __byte_perm(pair, 0, 0x1010);  // low half in both halves
        scale[mi][r][1] = __byte_perm(pair, 0, 0x3232);  // high half in both halves
      }
    }
  }
  if constexpr (kStaged && V == 32) {
    // Step by step: each unit of activations is read just before its two steps, which both
    // matrices take in turn (each accumulator still sums its steps in order). Each step's A is
    // decoded once and multiplies every token tile before the next step's is decoded, so that no
    // decoded A waits in registers for a later tile.
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      uint32_t b[kTiles][4];
#pragma unroll
      for (int tile = 0; tile < kTiles; ++tile) {
        if (tile == 0 || tile < tiles) load_staged_unit(rows, tile, k0, u, b[tile]);
      }
#pragma unroll
      for (int s = 2 * u; s < 2 * u + 2; ++s) {
#pragma unroll
        for (int mi = 0; mi < kMats; ++mi) {
          const uint32_t a[4] = {decode<F, V>(ch.raw[mi][0], scale[mi][0], s, 0),
                                 decode<F, V>(ch.raw[mi][1], scale[mi][1], s, 0),
                                 decode<F, V>(ch.raw[mi][0], scale[mi][0], s, 1),
                                 decode<F, V>(ch.raw[mi][1], scale[mi][1], s, 1)};
#pragma unroll
          for (int tile = 0; tile < kTiles; ++tile) {
            if (tile == 0 || tile < tiles) mma_bf16_16816(acc[tile][mi], a, b[tile][2 * (s % 2)], b[tile][2 * (s % 2) + 1]);
          }
        }
      }
    }
  } else {
#pragma unroll
    for (int tile = 0; tile < kTiles; ++tile) {
      if (tile > 0 && tile >= tiles) break;  // an item has at least one route
      uint32_t w[V / 2];
      if constexpr (kStaged) {
        load_staged_b<V>(rows.staged + tile * rows.staged_tile, k0 + c * V, w);
      } else if (tile == 0) {
#pragma unroll
        for (int i = 0; i < V / 2; ++i) w[i] = ch.b0[i];
      } else {
        load_b<V>(rows.b[tile], k0 + c * V, w);
      }
#pragma unroll
      for (int mi = 0; mi < kMats; ++mi) {
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        float(&d)[4] = F == Fmt::kFp8Block ? part : acc[tile][mi];
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          const uint32_t a[4] = {decode<F, V>(ch.raw[mi][0], scale[mi][0], s, 0), decode<F, V>(ch.raw[mi][1], scale[mi][1], s, 0),
                                 decode<F, V>(ch.raw[mi][0], scale[mi][0], s, 1), decode<F, V>(ch.raw[mi][1], scale[mi][1], s, 1)};
          mma_bf16_16816(d, a, w[2 * s], w[2 * s + 1]);
        }
        if constexpr (F == Fmt::kFp8Block) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[tile][mi][i] += ch.block_scale[mi] * part[i];
        }
      }
    }
  }
}

// The staged K loop of mma_rows where the activations are staged in slices (the layer's K past
// expert_major_staged_fits, or the two-tile gate_up): they go through two shared-memory buffers a
// slice (expert_major_slice_cols(kTiles) columns) at a time. `stage(s)` copies slice s into buffer
// s % 2 and commits it; slice s + 1 is copied while the warps run slice s, and entering slice s
// waits for its copy and for every warp to have left slice s - 1, whose buffer then takes slice
// s + 1. Every warp of the block runs the same K
// (one item), so every warp reaches every barrier.
template <Fmt F, int kMats, int kTiles, bool kAligned16, bool kTiled, typename Stage>
__device__ void mma_rows_sliced(const LaneRows<kMats, kTiles>& rows, int K, int tiles, const Stage& stage,
                                float (&acc)[kTiles][kMats][4]) {
  constexpr int V = kMainRun<F>;
  constexpr unsigned kChunk = 4 * V;
  constexpr int kSliceCols = expert_major_slice_cols(kTiles);
  constexpr int kSliceChunks = kSliceCols / kChunk;
  static_assert(kSliceChunks % 2 == 0);  // a slice starts at an even chunk, the loop's step
  const int chunks = K / kChunk;
  const int slices = (K + kSliceCols - 1) / kSliceCols;
  const auto enter_slice = [&](int slice) {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (slice + 1 < slices) stage(slice + 1);
  };
  Chunk<F, V, kMats, kTiled> even, odd;
  if (chunks > 0) load_chunk<F, V, kMats, kTiles, kAligned16, true, false, true, kTiled>(rows, 0, even);
  stage(0);  // waits for the activations first (item_sums): the first weights before, the copies after
  if (slices > 1) {
    stage(1);
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  } else {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
  }
  __syncthreads();
  // `at` is `rows` with the staged activations of the slice that starts at column base.
  LaneRows<kMats, kTiles> at = rows;
  const auto point_at = [&](int slice) {
    const int buffer = slice % 2 * expert_major_slice_bytes(kTiles);
    at.staged = rows.staged + buffer, at.staged_lo = rows.staged_lo + buffer, at.staged_hi = rows.staged_hi + buffer;
  };
  for (int slice = 0; slice * kSliceChunks < chunks; ++slice) {
    if (slice > 0) enter_slice(slice);
    point_at(slice);
    const unsigned base = slice * kSliceCols;
    const int end = chunks < (slice + 1) * kSliceChunks ? chunks : (slice + 1) * kSliceChunks;
    for (int i = slice * kSliceChunks; i < end; i += 2) {
      if (i + 1 < chunks) load_chunk<F, V, kMats, kTiles, kAligned16, true, false, true, kTiled>(rows, (i + 1) * kChunk, odd);
      mma_chunk<F, V, kMats, kTiles, true>(even, at, i * kChunk - base, tiles, acc);
      if (i + 1 >= chunks) break;
      if (i + 2 < chunks) load_chunk<F, V, kMats, kTiles, kAligned16, true, false, true, kTiled>(rows, (i + 2) * kChunk, even);
      mma_chunk<F, V, kMats, kTiles, true>(odd, at, (i + 1) * kChunk - base, tiles, acc);
    }
  }
  // The tail lies in one slice, which may be the first of a new one.
  const unsigned tail0 = chunks * kChunk;
  const int tail_steps = (K - static_cast<int>(tail0)) / 16;
  if (tail_steps == 0) return;
  const int slice = static_cast<int>(tail0 / kSliceCols);
  if (tail0 > 0 && tail0 % kSliceCols == 0) enter_slice(slice);
  point_at(slice);
  for (int s = 0; s < tail_steps; ++s) {
    Chunk<F, 4, kMats> tail;
    load_chunk<F, 4, kMats, kTiles, kAligned16, true>(rows, tail0 + 16 * s, tail);
    mma_chunk<F, 4, kMats, kTiles, true>(tail, at, tail0 + 16 * s - slice * kSliceCols, tiles, acc);
  }
}

// This warp's K loop. kSplit: the block's 4 warps share one row tile, warp w taking full chunks
// w, w+4, ... and tail steps w, w+4, ...; otherwise (the staged kernels) the warp runs every
// chunk and tail step of its own rows. Chunks go through kAhead + 1 buffers in turn, each loaded
// kAhead chunks ahead of its MMAs (kAhead + 1 chunks of loads in flight per warp).
// Staged kernels: `stage` starts the copies of the block's activations (and with kSmemScales its
// NVFP4 scale codes) after the first kAhead chunks' weights are requested, and the loop waits for
// them there, unless `stage` returns false (a later row pass over activations already staged).
// kSliced: the staged loop of mma_rows_sliced instead (one chunk ahead). kTiled: an NVFP4 matrix
// in tiles, read by load_chunk's kTiled loads.
template <Fmt F, int kMats, int kTiles, bool kAligned16, bool kSplit, bool kSmemScales, bool kSliced, int kAhead,
          bool kTiled = false, int kSplitWays = 0, typename Stage>
__device__ void mma_rows(const LaneRows<kMats, kTiles>& rows, int K, int tiles, const Stage& stage,
                         float (&acc)[kTiles][kMats][4]) {
  static_assert(!kSmemScales || (F == Fmt::kNvfp4 && !kSplit && kAligned16 && kAhead == 1));
  static_assert(!kSliced || (!kSplit && !kSmemScales && kAhead == 1));
  static_assert(kAhead == 1 || kAhead == 2);
  if constexpr (kSliced) {
    mma_rows_sliced<F, kMats, kTiles, kAligned16, kTiled>(rows, K, tiles, stage, acc);
    return;
  }
  constexpr bool kStaged = !kSplit;
  constexpr int V = kMainRun<F>;
  // Split-K: the block's kWarps warps split K, warp w taking way w; with kSplitWays > 0, warp w
  // takes way w % kSplitWays (moe_expert_down_blend runs several items per block, kSplitWays
  // warps each).
  constexpr int kWays = !kSplit ? 1 : kSplitWays == 0 ? kWarps : kSplitWays;
  constexpr unsigned kStride = kWays * 4 * V;  // columns between a warp's chunks
  const int warp = static_cast<int>(threadIdx.x / kWarp);
  const int way = !kSplit ? 0 : kSplitWays == 0 ? warp : warp % kSplitWays;
  const int chunks = K / (4 * V);
  const int mine = chunks > way ? (chunks - way + kWays - 1) / kWays : 0;
  const unsigned first = way * 4 * V;
  // Named buffers, each loop step a fixed rotation of them (an array indexed in an unrolled loop
  // compiled to other code and registers at one chunk ahead).
  Chunk<F, V, kMats, kTiled> b0, b1, b2;
  // A warp's first weights load before it waits for the kernel before (a down launched during its
  // gate_up: expert_major_early_down); the activations after: split-K, their registers; staged,
  // the block's copy into shared memory.
  if (mine > 0) load_chunk<F, V, kMats, kTiles, kAligned16, kStaged, kSmemScales, false, kTiled, !kSplit>(rows, first, b0);
  if constexpr (kAhead == 2) {
    if (mine > 1) {
      load_chunk<F, V, kMats, kTiles, kAligned16, kStaged, kSmemScales, false, kTiled, !kSplit>(rows, first + kStride, b1);
    }
  }
  if constexpr (kSplit) {
    wait_for_prior_grid();
    if (mine > 0) load_chunk_b(rows, first, b0);
    if constexpr (kAhead == 2) {
      if (mine > 1) load_chunk_b(rows, first + kStride, b1);
    }
  }
  if constexpr (kStaged) {
    if (stage()) {  // waits for the activations first (item_sums)
      asm volatile("cp.async.wait_all;" ::: "memory");
      __syncthreads();
    }
  }
  if constexpr (kSmemScales) {
    if (mine > 0) load_staged_scales(rows, first, b0.scale_codes);
  }
  if constexpr (kAhead == 1) {
    for (int i = 0; i < mine; i += 2) {
      if (i + 1 < mine) {
        load_chunk<F, V, kMats, kTiles, kAligned16, kStaged, kSmemScales, true, kTiled>(rows, first + (i + 1) * kStride, b1);
      }
      mma_chunk<F, V, kMats, kTiles, kStaged>(b0, rows, first + i * kStride, tiles, acc);
      if (i + 1 >= mine) break;
      if (i + 2 < mine) {
        load_chunk<F, V, kMats, kTiles, kAligned16, kStaged, kSmemScales, true, kTiled>(rows, first + (i + 2) * kStride, b0);
      }
      mma_chunk<F, V, kMats, kTiles, kStaged>(b1, rows, first + (i + 1) * kStride, tiles, acc);
    }
  } else {
    // Chunk j: its MMAs from `ch` after the loads of chunk j + kAhead into `next`; false past the last.
    const auto step = [&](int j, const Chunk<F, V, kMats, kTiled>& ch, Chunk<F, V, kMats, kTiled>& next) {
      if (j >= mine) return false;
      if (j + kAhead < mine) {
        load_chunk<F, V, kMats, kTiles, kAligned16, kStaged, kSmemScales, true, kTiled>(rows, first + (j + kAhead) * kStride,
                                                                                        next);
      }
      mma_chunk<F, V, kMats, kTiles, kStaged>(ch, rows, first + j * kStride, tiles, acc);
      return true;
    };
    for (int i = 0; step(i, b0, b2) && step(i + 1, b1, b0) && step(i + 2, b2, b1); i += 3) {
    }
  }
  if constexpr (kTiled) return;  // a matrix in tiles is whole chunks (tiles_fit): no tail
  const unsigned tail0 = chunks * 4 * V;
  const int tail_steps = (K - static_cast<int>(tail0)) / 16;
  for (int s = way; s < tail_steps; s += kWays) {
    Chunk<F, 4, kMats> tail;
    load_chunk<F, 4, kMats, kTiles, kAligned16, kStaged>(rows, tail0 + 16 * s, tail);
    mma_chunk<F, 4, kMats, kTiles, kStaged>(tail, rows, tail0 + 16 * s, tiles, acc);
  }
}

// What turns the MMA sum of row r into the true dot product (scales not applied in the loop).
__device__ __forceinline__ float output_multiplier(const DevMatrix& m, int row) {
  switch (m.format) {
    case static_cast<uint8_t>(WeightFormat::kNVFP4): return 128.0f * m.global_scale;
    case static_cast<uint8_t>(WeightFormat::kFP8):
      if (m.fp8_scaling == static_cast<uint8_t>(Fp8Scaling::kPerChannel)) return m.scales[row];
      if (m.fp8_scaling == static_cast<uint8_t>(Fp8Scaling::kPerTensor)) return m.scales[0];
      return 1.0f;
    default: return 1.0f;
  }
}

__device__ __forceinline__ int route_token(const DevLayer& L, int n, int route) {
  const int routed = n * L.top_k;
  return route < routed ? route / L.top_k : route - routed;
}

// The outputs of one token tile of 16 rows from the MMA sums (sum[4 mi + i]: accumulator i of
// matrix mi). Accumulator i holds row row0 + gid + 8 (i / 2), token slot tile * 8 + 2c + i % 2.
// kGateUp: gate and up -> activation (bf16); otherwise down -> expert_out (fp32), kMats row tiles
// of 16 (matrix mi: rows from row0 + 16 mi, the row-pair split-K down).
// kLaneRoutes (split-K): lane 4j's `lane_route` is the route of the tile's token column j
// (split_routes), so that no route is read again from ws.route_list; otherwise (staged) they are.
template <bool kGateUp, int kMats, bool kLaneRoutes>
__device__ __forceinline__ void store_tile(const DevLayer& L, int n, const DevWorkspace& ws, const DevExpert& ex, int4 item,
                                           int row0, int tile, const float* sum, int lane_route = 0) {
  const int lane = threadIdx.x % kWarp, gid = lane / 4, c = lane % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = row0 + gid + 8 * (i / 2), column = 2 * c + i % 2, slot = tile * kTile + column;
    const int from_lane = kLaneRoutes ? __shfl_sync(0xFFFFFFFFu, lane_route, 4 * column) : 0;
    if (slot >= item.z) continue;
    const int route = kLaneRoutes ? from_lane : ws.route_list[item.y + slot];
    if constexpr (kGateUp) {
      const float in_scale = (L.weight_on_input && route < n * L.top_k) ? ws.weights[route] : 1.0f;
      float g = sum[i] * output_multiplier(ex.gate, row) * in_scale;
      float u = sum[4 + i] * output_multiplier(ex.up, row) * in_scale;
      if (ex.gate.bias != nullptr) g += ex.gate.bias[row];
      if (ex.up.bias != nullptr) u += ex.up.bias[row];
      ws.act_bf16[static_cast<int64_t>(route) * L.act_stride + row] =
          __bfloat16_as_ushort(__float2bfloat16_rn(activate(L, g, u)));
    } else {
#pragma unroll
      for (int mi = 0; mi < kMats; ++mi) {
        const int mrow = row + kRows * mi;
        float y = sum[4 * mi + i] * output_multiplier(ex.down, mrow);
        if (ex.down.bias != nullptr) y += ex.down.bias[mrow];
        ws.expert_out[static_cast<int64_t>(route) * L.hidden + mrow] = y;
      }
    }
  }
}

// The part of one split-K block after its MMAs: the 4 warps' partial sums meet in shared memory,
// warp t finishes token tile t.
template <bool kGateUp, int kTiles, int kMats>
__device__ __forceinline__ void finish_item(const DevLayer& L, int n, const DevWorkspace& ws, const DevExpert& ex,
                                            int4 item, int row0, int tiles, const float (&acc)[kTiles][kMats][4],
                                            const int* split_routes) {
  __shared__ float partial[kWarps][kTiles][kMats * 4][kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][tile][mi * 4 + i][lane] = acc[tile][mi][i];
    }
  }
  __syncthreads();
  if (warp >= tiles) return;
  const int tile = warp;
  float sum[kMats * 4];
#pragma unroll
  for (int v = 0; v < kMats * 4; ++v) {
    sum[v] = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum[v] += partial[w][tile][v][lane];
  }

  int lane_route = split_routes[0];
#pragma unroll
  for (int t = 1; t < kTiles; ++t) lane_route = tile == t ? split_routes[t] : lane_route;
  store_tile<kGateUp, kMats, true>(L, n, ws, ex, item, row0, tile, sum, lane_route);
}

// The block's activations are copied by `per_column` threads per token column (16 for one token
// tile, 8 for two), 16 bytes each per step.
constexpr int kStagersPerColumn = kWarps * kWarp / kTile;

// The activations this thread copies: token column t = threadIdx.x / per_column of the item,
// route_list[item.y + t]; none (nullptr) past the item's routes. Those columns' products are
// never stored (store_tile skips slots past item.z), and an MMA's output column depends on its
// own B column alone, so whatever their shared memory holds stays in them. Not copying them
// saves the path from L2 its duplicate reads: a warp copies two columns (one tile), and the
// copies of the first route by warps past the item's routes were reads of their own; at 1-2
// routes per item (the Qwen shapes up to N = 64-128) those are 3 of a block's 4 warps.
template <bool kGateUp>
__device__ __forceinline__ const uint16_t* staged_source(const DevLayer& L, int n, const DevWorkspace& ws, int4 item,
                                                         int per_column) {
  const int t = threadIdx.x / per_column;
  if (t >= item.z) return nullptr;
  const int route = ws.route_list[item.y + t];
  return kGateUp ? ws.x_bf16 + static_cast<int64_t>(route_token(L, n, route)) * L.hidden
                 : ws.act_bf16 + static_cast<int64_t>(route) * L.act_stride;
}

// Copies 16-byte units u0 .. u1 - 1 (columns 8 u0 .. 8 u1 - 1) of this thread's column from `src`
// into its row of `staged` (rows row_bytes apart), unit u at staged_unit(u - u0), with cp.async;
// nothing where `src` is null (a column past the item's routes).
__device__ __forceinline__ void stage_units(const uint16_t* src, unsigned u0, unsigned u1, uint8_t* staged, int row_bytes,
                                            int per_column) {
  if (src == nullptr) return;
  const int t = threadIdx.x / per_column;
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(staged + t * row_bytes));
  for (unsigned q = u0 + threadIdx.x % per_column; q < u1; q += per_column) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 16 * staged_unit(q - u0)), "l"(src + 8 * q)
                 : "memory");
  }
}

// Copies the NVFP4 scale codes of the block's rows (row0 .. row0 + 63, those the matrix has) into
// `dst` with cp.async, rows expert_major_staged_scale_stride(K) bytes apart (K % 128 == 0: whole
// 8-byte units). Each warp copies 32 / units-per-row rows at a time.
__device__ __forceinline__ void stage_scales(const DevMatrix& m, int row0, uint8_t* dst) {
  const int K = m.cols, units = K / 128, stride = expert_major_staged_scale_stride(K);
  const int rows = m.rows - row0 < kExpertMajorStagedRows ? m.rows - row0 : kExpertMajorStagedRows;
  const int lane = threadIdx.x % kWarp, per_warp = kWarp / units;  // units <= 23 (K <= 3008)
  if (lane >= per_warp * units) return;
  const int unit = lane % units;
  const uint8_t* src = m.block_scales + static_cast<int64_t>(row0) * (K / 16) + 8 * unit;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(dst)) + 8 * unit;
  for (int r = static_cast<int>(threadIdx.x / kWarp) * per_warp + lane / units; r < rows; r += kWarps * per_warp) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(base + r * stride), "l"(src + r * (K / 16)) : "memory");
  }
}

// The weight matrices an item's MMAs run over at once: gate and up, or the down's two 16-row
// panels (kPairs), else the down's one.
__host__ __device__ constexpr int item_mats(bool gate_up, bool pairs) { return gate_up || pairs ? 2 : 1; }

// The MMAs of one work item (its routes, 16 rows of its expert `ex` from row0) and their epilogue.
// kSplit: the block's 4 warps split K over the same rows, and their sums meet in shared memory
// (finish_item); `split_routes` holds this lane's token column's route per token tile
// (split_routes()).
// Otherwise each warp has its own rows (stored where `store`) and the activations are staged.
// kPairs (split-K down only): rows row0 .. row0 + 31, the down's two 16-row panels taking the
// places of gate_up's two matrices.
// kScaleCopy (staged down only): the block also copies its NVFP4 scale codes into shared memory
// where the expert's matrix allows it. A template parameter, so that the other kernels carry
// neither the second main loop nor its registers. kSliced (staged only): the activations are
// staged a slice at a time (the layer's K is past expert_major_staged_fits, or the two-tile
// gate_up). `copy` false (staged, neither kScaleCopy nor kSliced): the block's activations are in
// shared memory already. kPath:
// the K loop, weight_path's for the expert, where the caller fixed it (kPathAny: chosen here).
// kAhead: how many chunks ahead of their MMAs the K loop of an NVFP4 matrix loads (mma_rows; 1
// wherever kScaleCopy or kSliced; the staged kernels' choice, staged_two_ahead). FP8 and BF16
// matrices load one ahead: two measured 0.95-1.00x on the qwen3 shapes' FP8 (docs/PERF.md, v3.14).
// item_sums does the MMAs, adding to `acc` as mma_rows does (acc[tile][matrix][accumulator], zero
// before);
// run_item calls it and stores. kSplitWays (item_sums, split-K): 0, the block's 4 warps split K;
// else groups of kSplitWays warps, way warp % kSplitWays (moe_expert_down_blend, several items
// per block).
template <bool kGateUp, int kTiles, bool kSplit, bool kScaleCopy, bool kSliced, int kPath, int kAhead, bool kPairs,
          int kSplitWays = 0>
__device__ __forceinline__ void item_sums(const DevLayer& L, int n, const DevWorkspace& ws, const DevExpert& ex, int4 item,
                                          int row0, const int* split_routes, uint8_t* staged, bool copy,
                                          float (&acc)[kTiles][item_mats(kGateUp, kPairs)][4]) {
  static_assert(!kPairs || (!kGateUp && kSplit));
  constexpr int kMats = item_mats(kGateUp, kPairs);
  const DevMatrix* mats[kMats];
  if constexpr (kGateUp) {
    mats[0] = &ex.gate, mats[1] = &ex.up;
  } else {
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi) mats[mi] = &ex.down;
  }
  const int gid = threadIdx.x % kWarp / 4;
  const int tiles = (item.z + kTile - 1) / kTile;
  const int K = mats[0]->cols;

  LaneRows<kMats, kTiles> rows;
  const WeightFormat format = static_cast<WeightFormat>(mats[0]->format);
  const bool fp8_block = format == WeightFormat::kFP8 && mats[0]->fp8_scaling == static_cast<uint8_t>(Fp8Scaling::kBlock128);
  bool aligned16 = true;  // every weight run of the main loop starts 16-byte aligned
  // Staged kernels: the scale codes come from shared memory where the launch made room for them
  // (expert_major_staged_smem, for the layer's K), this expert's rows are whole 8-byte copies and
  // aligned; they lie past the activations.
  // (The launch runs the kScaleCopy kernel only where ExpertMajorLaunch::down_copies_scales.)
  static_assert(!kScaleCopy || (!kGateUp && !kSplit && !kSliced));
  static_assert(!kSliced || !kSplit);
  static_assert(kAhead == 1 || !(kScaleCopy || kSliced));
  bool smem_scales = kScaleCopy && format == WeightFormat::kNVFP4 && K % 128 == 0;
  bool tiled = format == WeightFormat::kNVFP4;  // every matrix in tiles and aligned: the kTiled loop
  uint8_t* scale_copy = kSplit ? nullptr : staged + 8 * expert_major_staged_row_bytes(K);
  const int group_row0 = row0 / kExpertMajorStagedRows * kExpertMajorStagedRows;
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi) {
    const DevMatrix& m = *mats[mi];
    const int64_t row_bytes = weight_row_bytes(m);
    aligned16 = aligned16 && row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(m.data) % 16 == 0 &&
                reinterpret_cast<uintptr_t>(m.block_scales) % 2 == 0;
    smem_scales = smem_scales && reinterpret_cast<uintptr_t>(m.block_scales) % 8 == 0 && !m.tiled;
    tiled = tiled && nvfp4_tiled(m);
    // row0 is a multiple of 16: in tiles, this warp's rows start the panel at row0 * row_bytes (the
    // tiled_offset of its row gid is that plus 64 gid), and the panel's scale tiles at row0 * K / 16.
    // kPairs: the second "matrix" is the down's next 16 rows.
    const int mat_row0 = kPairs ? row0 + kRows * mi : row0;
    const int64_t panel = static_cast<int64_t>(mat_row0) * row_bytes;
    rows.tile_w[mi] = m.data + panel + kTileRowBytes * gid + 16 * (threadIdx.x % 4);
    rows.tile_scales[mi] = m.block_scales + panel / 8 + 4 * (threadIdx.x % kWarp);  // NVFP4: K / 16 = row_bytes / 8
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = mat_row0 + gid + 8 * r;
      rows.w[mi][r] = m.data + (m.tiled ? panel + kTileRowBytes * (gid + 8 * r) : row * row_bytes);
      rows.scale_codes[mi][r] = format == WeightFormat::kNVFP4 ? m.block_scales + row * (m.cols / 16) : nullptr;
      rows.staged_scales[mi][r] =
          kSplit ? nullptr
                 : scale_copy + (mi * kExpertMajorStagedRows + row - group_row0) * expert_major_staged_scale_stride(K);
    }
    rows.block_scales[mi] = fp8_block ? m.scales + static_cast<int64_t>(mat_row0 / 128) * m.scale_cols : nullptr;
  }
  smem_scales = smem_scales && aligned16;
  rows.chunk_stride = mats[0]->tiled ? kTileBytes : kTileRowBytes;  // gate and up are tiled alike (the upload)
  const int staged_row_bytes = expert_major_staged_row_bytes(kSliced ? expert_major_slice_cols(kTiles) : K);
  rows.staged = kSplit ? nullptr : staged + gid * staged_row_bytes;
  if constexpr (!kSplit) {  // units 4c + i lie at 4c + (i ^ 2b), b = bit 3 of 4c (staged_unit)
    const uint32_t row = static_cast<uint32_t>(rows.staged - staged);
    const int c = threadIdx.x % 4, b = c / 2;
    rows.staged_lo = row + 16 * (4 * c + 2 * b);
    rows.staged_hi = row + 16 * (4 * c + 2 - 2 * b);
  }
  rows.staged_tile = kTile * staged_row_bytes;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    rows.b[tile] = nullptr;
    if constexpr (kSplit) {
      const int route = split_routes[tile];
      rows.b[tile] = kGateUp ? ws.x_bf16 + static_cast<int64_t>(route_token(L, n, route)) * L.hidden
                             : ws.act_bf16 + static_cast<int64_t>(route) * L.act_stride;
    }
  }
  const int per_column = kTiles == 1 ? kStagersPerColumn : kWarps * kWarp / (kTile * tiles);
  // Before a staged block copies its activations, after its first weights are requested: a down
  // whose items start as their gate_up finishes (ws.item_release) waits for its item's tiles, any
  // other kernel for the kernel before it (a no-op where that ended before this one started).
  const auto wait_inputs = [&] {
    if constexpr (!kGateUp) {
      if (ws.item_release) {
        wait_item_tiles(ws, blockIdx.y, (ex.gate.rows + kRows - 1) / kRows * tiles);
        return;
      }
    }
    wait_for_prior_grid();
  };
  const uint16_t* stage_src = nullptr;
  const auto stage = [&]([[maybe_unused]] int slice = 0) {
    if constexpr (kSliced) {
      constexpr unsigned kUnits = expert_major_slice_cols(kTiles) / 8;
      if (slice == 0) {
        wait_inputs();
        stage_src = staged_source<kGateUp>(L, n, ws, item, per_column);
      }
      const unsigned u0 = slice * kUnits, end = K / 8;
      stage_units(stage_src, u0, u0 + kUnits < end ? u0 + kUnits : end, staged + slice % 2 * expert_major_slice_bytes(kTiles),
                  staged_row_bytes, per_column);
      asm volatile("cp.async.commit_group;" ::: "memory");
    } else if constexpr (!kSplit) {
      if (!copy) return false;
      wait_inputs();
      stage_units(staged_source<kGateUp>(L, n, ws, item, per_column), 0, K / 8, staged, staged_row_bytes, per_column);
      if (smem_scales) {
#pragma unroll
        for (int mi = 0; mi < kMats; ++mi) {
          stage_scales(*mats[mi], group_row0, scale_copy + mi * kExpertMajorStagedRows * expert_major_staged_scale_stride(K));
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    return copy;
  };

  static_assert(kPath == kPathAny || (!kScaleCopy && !kSliced));
  if constexpr (kPath == kPathNvfp4Tiled) {
    mma_rows<Fmt::kNvfp4, kMats, kTiles, true, kSplit, false, false, kAhead, true, kSplitWays>(rows, K, tiles, stage, acc);
  } else if constexpr (kPath == kPathNvfp4Aligned) {
    mma_rows<Fmt::kNvfp4, kMats, kTiles, true, kSplit, false, false, kAhead, false, kSplitWays>(rows, K, tiles, stage, acc);
  } else if constexpr (kPath == kPathNvfp4) {
    mma_rows<Fmt::kNvfp4, kMats, kTiles, false, kSplit, false, false, kAhead, false, kSplitWays>(rows, K, tiles, stage, acc);
  } else if constexpr (kPath == kPathFp8Block) {
    mma_rows<Fmt::kFp8Block, kMats, kTiles, true, kSplit, false, false, 1, false, kSplitWays>(rows, K, tiles, stage, acc);
  } else if constexpr (kPath == kPathFp8) {
    mma_rows<Fmt::kFp8, kMats, kTiles, true, kSplit, false, false, 1, false, kSplitWays>(rows, K, tiles, stage, acc);
  } else if constexpr (kPath == kPathBf16) {
    mma_rows<Fmt::kBf16, kMats, kTiles, true, kSplit, false, false, 1, false, kSplitWays>(rows, K, tiles, stage, acc);
  } else switch (format) {
    case WeightFormat::kNVFP4:
      if constexpr (kScaleCopy) {
        if (smem_scales) {  // implies aligned16
          mma_rows<Fmt::kNvfp4, kMats, kTiles, true, kSplit, true, kSliced, 1, false, kSplitWays>(rows, K, tiles, stage, acc);
          break;
        }
      }
      if (tiled) {
        mma_rows<Fmt::kNvfp4, kMats, kTiles, true, kSplit, false, kSliced, kAhead, true, kSplitWays>(rows, K, tiles, stage, acc);
      } else if (aligned16) {
        mma_rows<Fmt::kNvfp4, kMats, kTiles, true, kSplit, false, kSliced, kAhead, false, kSplitWays>(rows, K, tiles, stage, acc);
      } else {
        mma_rows<Fmt::kNvfp4, kMats, kTiles, false, kSplit, false, kSliced, kAhead, false, kSplitWays>(rows, K, tiles, stage, acc);
      }
      break;
    case WeightFormat::kFP8:  // rows of K % 16 == 0 bytes: always aligned
      if (fp8_block) {
        mma_rows<Fmt::kFp8Block, kMats, kTiles, true, kSplit, false, kSliced, 1, false, kSplitWays>(rows, K, tiles, stage, acc);
      } else {
        mma_rows<Fmt::kFp8, kMats, kTiles, true, kSplit, false, kSliced, 1, false, kSplitWays>(rows, K, tiles, stage, acc);
      }
      break;
    default: mma_rows<Fmt::kBf16, kMats, kTiles, true, kSplit, false, kSliced, 1, false, kSplitWays>(rows, K, tiles, stage, acc); break;
  }
}

template <bool kGateUp, int kTiles, bool kSplit, bool kScaleCopy = false, bool kSliced = false, int kPath = kPathAny,
          int kAhead = 1, bool kPairs = false>
__device__ __forceinline__ void run_item(const DevLayer& L, int n, const DevWorkspace& ws, const DevExpert& ex, int4 item,
                                         int row0, const int* split_routes, bool store = true, uint8_t* staged = nullptr,
                                         bool copy = true) {
  constexpr int kMats = item_mats(kGateUp, kPairs);
  const int tiles = (item.z + kTile - 1) / kTile;
  float acc[kTiles][kMats][4] = {};
  item_sums<kGateUp, kTiles, kSplit, kScaleCopy, kSliced, kPath, kAhead, kPairs>(L, n, ws, ex, item, row0, split_routes,
                                                                                 staged, copy, acc);
  if constexpr (kSplit) {
    finish_item<kGateUp, kTiles, kMats>(L, n, ws, ex, item, row0, tiles, acc, split_routes);
  } else if (store) {
#pragma unroll
    for (int tile = 0; tile < kTiles; ++tile) {
      if (tile > 0 && tile >= tiles) break;
      float sum[kMats * 4];
#pragma unroll
      for (int mi = 0; mi < kMats; ++mi) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sum[4 * mi + i] = acc[tile][mi][i];
      }
      store_tile<kGateUp, kMats, false>(L, n, ws, ex, item, row0, tile, sum);
    }
  }
}

// This block's work item, ws.items[blockIdx.y], or false past the call's item count. The item's
// load goes out beside the count's, so the expert's table entry waits one round trip, not two:
// the test of item.x (no real item's is negative) keeps the load ahead of the branch, where the
// compiler would otherwise sink it. Slots past the count hold stale items (the buffer is zeroed
// at creation) and are not used.
__device__ __forceinline__ bool read_item(const DevWorkspace& ws, int4& item) {
  item = ws.items[blockIdx.y];
  return static_cast<int>(blockIdx.y) < *ws.num_items && item.x >= 0;
}

// The expert's table entry, copied whole into shared memory by the block's first 21 threads (8
// bytes each, one round trip) for every warp to read. Read field by field from global memory, the
// entry's loads followed the branches on its format and layout, one round trip each: at N = 1 the
// split-K blocks spent 26-38% of their warps' samples before their first weight load. Read whole,
// calls ran 1.01-1.04x faster (docs/PERF.md, v3.20). Every thread of the block must call it.
constexpr int kExpertWords = sizeof(DevExpert) / 8;
static_assert(sizeof(DevExpert) % 8 == 0 && alignof(DevExpert) == 8 && kExpertWords <= kWarp);

// Word `word` of the expert's table entry into `entry` (shared memory), where the entry has it.
template <typename Index>
__device__ __forceinline__ void copy_expert_word(const DevLayer& L, int expert, Index word, uint2* entry) {
  if (word < static_cast<Index>(kExpertWords)) entry[word] = __ldg(reinterpret_cast<const uint2*>(L.experts + expert) + word);
}

__device__ __forceinline__ const DevExpert& block_expert(const DevLayer& L, int expert) {
  __shared__ __align__(16) uint2 entry[kExpertWords];
  copy_expert_word(L, expert, threadIdx.x, entry);
  __syncthreads();
  return *reinterpret_cast<const DevExpert*>(entry);
}

// The route of this lane's token column (gid) in each token tile of a split-K item (columns past
// the item's routes take its first route's), loaded before block_expert's barrier so that the two
// round trips overlap.
template <int kTiles, bool kPastL1 = false>
__device__ __forceinline__ void split_routes(const DevWorkspace& ws, int4 item, int (&routes)[kTiles]) {
  const int gid = threadIdx.x % kWarp / 4;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    const int slot = tile * kTile + gid;
    const int32_t* at = ws.route_list + item.y + (slot < item.z ? slot : 0);
    routes[tile] = kPastL1 ? __ldcg(at) : *at;  // kPastL1: written by a kernel still running
  }
}

// Blocks per SM that the one-tile split-K kernels are held to: 4 (128 registers) with every K
// loop's code in them (kPathAny) or an NVFP4 loop's (which spill at 5: 96 registers), 5 with one
// FP8 or BF16 loop's (DevLayer::gate_up_path, down_path; 78-96 registers, no spills).
__host__ __device__ constexpr int split_blocks_per_sm(int path) {
  return path == kPathFp8Block || path == kPathFp8 || path == kPathBf16 ? 5 : 4;
}

// Calls f.template operator()<kPath>() for a K loop that all the layer's experts take (`path`, one
// of weight_path's values); false for kPathAny.
template <typename F>
bool with_path(int path, F&& f) {
  switch (path) {
    case kPathNvfp4Tiled: f.template operator()<kPathNvfp4Tiled>(); return true;
    case kPathNvfp4Aligned: f.template operator()<kPathNvfp4Aligned>(); return true;
    case kPathNvfp4: f.template operator()<kPathNvfp4>(); return true;
    case kPathFp8Block: f.template operator()<kPathFp8Block>(); return true;
    case kPathFp8: f.template operator()<kPathFp8>(); return true;
    case kPathBf16: f.template operator()<kPathBf16>(); return true;
    default: return false;
  }
}

// with_path, or where the experts' K loops differ, f.template operator()<kPathAny>() (the build
// with every loop).
template <typename F>
void with_path_or_any(int path, F&& f) {
  if (!with_path(path, f)) f.template operator()<kPathAny>();
}

// Grid: (16-row tiles of the widest intermediate, max work items). Block: 4 warps splitting K.
// Gate and up of the item's routes -> activation (bf16). One token tile: held to
// split_blocks_per_sm(kPath) blocks per SM; 4 (128 registers) for every loop's build, what it took
// unbound before its loop over NVFP4 tiles, which took 147 unbound.
template <int kTiles, int kPath = kPathAny>
__global__ void __launch_bounds__(kWarps * kWarp, kTiles == 1 ? split_blocks_per_sm(kPath) : 0)
    moe_expert_gate_up(DevLayer L, int n, DevWorkspace ws) {
  wait_for_prior_grid();  // the route kernel's items (expert_major_early_gate_up)
  if (!ws.item_release) allow_dependent_launch();  // the down (expert_major_early_down)
  int4 item;  // {expert, first, count, -}
  if (!read_item(ws, item)) return;
  int routes[kTiles];
  split_routes(ws, item, routes);
  const DevExpert& ex = block_expert(L, item.x);
  const int row0 = blockIdx.x * kRows;
  if (row0 >= ex.gate.rows) return;
  if (ws.item_release) allow_dependent_launch();  // after the reads of a block that stores nothing
  run_item<true, kTiles, true, false, false, kPath>(L, n, ws, ex, item, row0, routes);
  // Warp t stored token tile t (finish_item).
  if (ws.item_release && static_cast<int>(threadIdx.x / kWarp) < (item.z + kTile - 1) / kTile) {
    publish_item_tiles(ws, blockIdx.y, 1);
  }
}

// Grid: (32-row tiles of the widest intermediate, max work items), one token tile, where
// ExpertMajorLaunch::gate_up_wide says so. Block: 4 warps, warps 2t and 2t + 1 splitting K over
// rows 32 bx + 16 t .. + 15 (item_sums' kSplitWays 2): half the blocks of moe_expert_gate_up<1>,
// each warp streaming twice the chunks. The two ways' sums meet in shared memory and way 0 adds
// them (way 0's, then way 1's) and stores. An expert whose rows end 16 into the block's 32 leaves
// the second pair without rows: it computes nothing and stores nothing, but reaches the barrier.
template <int kPath = kPathAny>
__global__ void __launch_bounds__(kWarps * kWarp, split_blocks_per_sm(kPath)) moe_expert_gate_up_wide(DevLayer L, int n,
                                                                                                   DevWorkspace ws) {
  __shared__ float partial[kWarps][8][kWarp];
  wait_for_prior_grid();
  if (!ws.item_release) allow_dependent_launch();
  int4 item;
  if (!read_item(ws, item)) return;
  int routes[1];
  split_routes(ws, item, routes);
  const DevExpert& ex = block_expert(L, item.x);
  const int block_row0 = blockIdx.x * 2 * kRows;
  if (block_row0 >= ex.gate.rows) return;
  if (ws.item_release) allow_dependent_launch();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int row0 = block_row0 + warp / 2 * kRows;
  const bool has_rows = row0 < ex.gate.rows;
  float acc[1][2][4] = {};
  if (has_rows) {
    item_sums<true, 1, true, false, false, kPath, 1, false, 2>(L, n, ws, ex, item, row0, routes, nullptr, true, acc);
  }
#pragma unroll
  for (int v = 0; v < 8; ++v) partial[warp][v][lane] = acc[0][v / 4][v % 4];
  __syncthreads();
  if (warp % 2 != 0 || !has_rows) return;
  float sum[8];
#pragma unroll
  for (int v = 0; v < 8; ++v) sum[v] = partial[warp][v][lane] + partial[warp + 1][v][lane];
  store_tile<true, 2, true>(L, n, ws, ex, item, row0, 0, sum, routes[0]);
  if (ws.item_release) publish_item_tiles(ws, blockIdx.y, 1);
}

// Grid: (16-row tiles of the widest intermediate, the call's routes), for a call of one token
// whose selection fits one warp (ExpertMajorLaunch::gate_up_selects): no route kernel runs. Warp 0
// of every block selects from the router's logits (route_token_warp; dynamic shared memory: E + Z
// floats for group-limited routing) and maps the routes to work items as group_one_token does;
// the block runs the blockIdx.y-th, as moe_expert_gate_up<1>. Block (0, 0) alone publishes the
// choices, weights, items and route list, which the kernels after it read; where the fused down is
// launched during this kernel (ws.items_published: expert_major_published_down), it allows that
// launch as it starts and flags the items once they are written.
template <int kPerLane>
__global__ void __launch_bounds__(kWarps * kWarp, 4) moe_expert_gate_up_select(DevLayer L, DevWorkspace ws) {
  extern __shared__ float select_keys[];
  __shared__ int ids[kWarp];
  __shared__ int4 chosen;  // this block's item, {-1, ...} past the call's items
  __shared__ int chosen_route;
  wait_for_prior_grid();  // the router's logits (expert_major_early_gate_up)
  if (ws.items_published != nullptr) allow_dependent_launch();
  if (threadIdx.x < kWarp) {
    const bool publish = blockIdx.x == 0 && blockIdx.y == 0;
    route_token_warp<kPerLane>(L, 0, ws, select_keys, ids, publish);
    const int4 mine = group_one_token(L, ws, ids, publish);  // top_k + shared <= 32 (gate_up_selects)
    if (publish && ws.items_published != nullptr) flag_items_published(ws);
    if (threadIdx.x == 0) chosen = make_int4(-1, 0, 0, 0);
    __syncwarp();
    if (mine.x >= 0 && mine.y == static_cast<int>(blockIdx.y)) chosen = mine, chosen_route = threadIdx.x;
  }
  __syncthreads();
  const int4 item = chosen;
  if (item.x < 0) return;
  int routes[1] = {chosen_route};
  const DevExpert& ex = block_expert(L, item.x);
  const int row0 = blockIdx.x * kRows;
  if (row0 >= ex.gate.rows) return;
  run_item<true, 1, true>(L, 1, ws, ex, item, row0, routes);
}

// Grid: (16-row tiles of H, max work items). Block: 4 warps splitting K. Down of the item's
// activations -> expert_out (fp32); the blend kernel sums them per token.
template <int kTiles>
__global__ void __launch_bounds__(kWarps * kWarp) moe_expert_down(DevLayer L, int n, DevWorkspace ws) {
  int4 item;
  if (!read_item(ws, item)) return;
  int routes[kTiles];
  split_routes(ws, item, routes);
  run_item<false, kTiles, true>(L, n, ws, block_expert(L, item.x), item, blockIdx.x * kRows, routes);
}

// Grid: (32-row pairs of H, max work items), one token tile. Block: 4 warps splitting K over two
// 16-row tiles at once (run_item's kPairs: the down's rows as gate_up's two matrices), so that
// half as many blocks carry twice the loads in flight each (127 registers, 4 blocks per SM;
// moe_expert_down<1>: 93, 5). Runs for every split-K down of one token tile where H % 32 == 0
// (ExpertMajorLaunch::down_pairs): on the H200 1.01-1.06x per call at N = 1-4, most where the
// one-tile grid took more than one wave (qwen3-30b N = 1: 1024 blocks -> 512; docs/PERF.md, v3.20).
template <int kPath = kPathAny>
__global__ void __launch_bounds__(kWarps * kWarp, split_blocks_per_sm(kPath)) moe_expert_down_pairs(DevLayer L, int n,
                                                                                                 DevWorkspace ws) {
  int4 item;
  if (!read_item(ws, item)) return;
  int routes[1];
  split_routes(ws, item, routes);
  run_item<false, 1, true, false, false, kPath, 1, true>(L, n, ws, block_expert(L, item.x), item, blockIdx.x * 2 * kRows,
                                                          routes);
}

// The blend's weight of a route of an n-token call: w; 1 where w scaled the input; the shared
// expert's gate for its token. kPastL1: the routed weights written by a kernel still running.
template <bool kPastL1 = false>
__device__ __forceinline__ float blend_weight(const DevLayer& L, int n, const DevWorkspace& ws, int route) {
  if (route < n * L.top_k) {
    if (L.weight_on_input) return 1.0f;
    return kPastL1 ? __ldcg(ws.weights + route) : ws.weights[route];
  }
  return L.shared_gate ? ws.shared_gate[route - n * L.top_k] : 1.0f;
}

// A fused down's per-warp sums of each token's 16 rows of H (moe_expert_down_blend and _rolled).
using BlendRowSums = float[kExpertMajorDownBlendTokens][kRows];

// Adds one warp's MMA sums of an item (acc: its way's, of the item's `columns` token columns) into
// the warp's row sums, each token column's times the blend's weight of its route. Accumulator i:
// row gid + 8 (i / 2), token column 2c + i % 2, whose route's token and weight lane 4 (2c + i % 2)
// holds (`token`: route_token of the route, taken once per item by the caller; `weight`). An item's
// routes are of different tokens, so no two lanes add to the same sum. The bias goes in once per
// item, by its way 0.
__device__ __forceinline__ void add_blended(const DevExpert& ex, int row0, bool way0, const float (&acc)[4], int token,
                                            float weight, int columns, BlendRowSums& row_sums) {
  const int lane = threadIdx.x % kWarp, gid = lane / 4, c = lane % 4;
  const float multiplier[2] = {output_multiplier(ex.down, row0 + gid), output_multiplier(ex.down, row0 + gid + 8)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int column = 2 * c + i % 2, row = gid + 8 * (i / 2);
    const int column_token = __shfl_sync(0xFFFFFFFFu, token, 4 * column);
    const float w = __shfl_sync(0xFFFFFFFFu, weight, 4 * column);
    if (column >= columns) continue;
    float v = acc[i] * multiplier[i / 2];
    if (way0 && ex.down.bias != nullptr) v += ex.down.bias[row0 + row];
    row_sums[column_token][row] += w * v;
  }
}

// The end of a fused down: the block's threads add its `warps` warps' row sums in warp order, the
// shared expert's outputs where its own chain computed them (ws.shared_apart), the zero experts'
// w x after them, and write each token's 16 outputs from row0. The order is fixed,
// so the output is the same on every run.
__device__ __forceinline__ void write_blended(const DevLayer& L, const float* x, int n, const DevWorkspace& ws,
                                              float* out, const BlendRowSums* row_sums, int warps, int row0) {
  for (int i = threadIdx.x; i < n * kRows; i += blockDim.x) {
    const int t = i / kRows, h = row0 + i % kRows;
    float sum = 0.0f;
    for (int w = 0; w < warps; ++w) sum += row_sums[w][t][i % kRows];
    if (ws.shared_apart) {  // the shared expert's down ran in its own chain (launch_moe_shared_apart)
      const int route = n * L.top_k + t;
      sum += blend_weight(L, n, ws, route) * ws.expert_out[static_cast<int64_t>(route) * L.hidden + h];
    }
    if (L.adds_once && L.router_outputs > L.num_experts) {  // zero experts: w x
      for (int j = t * L.top_k; j < (t + 1) * L.top_k; ++j) {
        if (ws.ids[j] >= L.num_experts) sum += ws.weights[j] * x[static_cast<int64_t>(t) * L.hidden + h];
      }
    }
    out[static_cast<int64_t>(t) * L.hidden + h] = sum;
  }
}

// Grid: 16-row tiles of H. Block: the call's items (max_items) x kWays warps, at most 16, for a
// call of a few tokens (ExpertMajorLaunch::down_blend_ways): warps kWays g .. kWays g + kWays - 1
// split K of item g's down over the block's rows, and add each token column's sums, times the
// blend's weight of its route, into their own shared row sums of the column's token
// (add_blended). The block then adds the warps' sums and writes the tokens' outputs
// (write_blended): no expert_out, no blend kernel. NVFP4 loops load two chunks ahead (122-123
// registers, no spills). On the H200 against down and blend kernels: qwen3-30b-a3b N = 1 1.13x
// per call, N = 2 1.14-1.16x; qwen3-next-80b-a3b N = 1 1.19x; two ahead 1.01-1.02x more than one
// (docs/PERF.md, v3.21). More items: moe_expert_down_blend_rolled (a warp running two items in
// a loop whose K loop is chosen per item spilled 2 KB).
// kPublished: launched during a gate_up that selects (expert_major_published_down), whose block
// (0, 0) writes the items, routes and weights while this kernel's blocks start: they wait for its
// flag, read them past L1, and wait for gate_up's whole grid before they write.
template <int kWays, bool kPublished = false>
__global__ void __launch_bounds__(kDownBlendWarps * kWarp, 1)
    moe_expert_down_blend(DevLayer L, const float* x, int n, DevWorkspace ws, float* out) {
  constexpr int kGroups = kDownBlendWarps / kWays;
  __shared__ __align__(16) uint2 entries[kGroups][kExpertWords];
  __shared__ BlendRowSums row_sums[kDownBlendWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = warp / kWays, way = warp % kWays;
  const int in_group = threadIdx.x - g * kWays * kWarp;
  const int row0 = blockIdx.x * kRows;
  if constexpr (kPublished) wait_items_published(ws);
  // The item's load goes out beside the count's (read_item); slots past the count hold stale
  // items, not used.
  const int4 item = kPublished ? __ldcg(ws.items + g) : ws.items[g];
  const bool active = g < (kPublished ? __ldcg(ws.num_items) : *ws.num_items);
  // This lane's token column gid: its route (split_routes) and the route's blend weight, loaded
  // beside the expert's table entry; the weight is not needed until after the MMAs.
  int routes[1] = {0};
  if (active) split_routes<1, kPublished>(ws, item, routes);
  const float weight = active ? blend_weight<kPublished>(L, n, ws, routes[0]) : 0.0f;
  if (active) copy_expert_word(L, item.x, in_group, entries[g]);
  for (int i = lane; i < n * kRows; i += kWarp) row_sums[warp][i / kRows][i % kRows] = 0.0f;
  __syncthreads();
  if (active) {
    const DevExpert& ex = *reinterpret_cast<const DevExpert*>(entries[g]);
    float acc[1][1][4] = {};
    item_sums<false, 1, true, false, false, kPathAny, 2, false, kWays>(L, n, ws, ex, item, row0, routes, nullptr, true,
                                                                       acc);
    add_blended(ex, row0, way == 0, acc[0][0], route_token(L, n, routes[0]), weight, item.z, row_sums[warp]);
  }
  // Every thread past gate_up's grid before the zero experts' choices are read (write_blended),
  // also where no item of this block ran the wait (item_sums).
  if constexpr (kPublished) wait_for_prior_grid();
  __syncthreads();
  write_blended(L, x, n, ws, out, row_sums, blockDim.x / kWarp, row0);
  if constexpr (kPublished) done_with_published_items(ws);
}

// The fused down and blend past 16 items (ExpertMajorLaunch::down_blend_rounds > 1, up to
// kExpertMajorDownBlendMaxItems items). Grid: 16-row tiles of H; block: 16 warps, warp w running
// items w, w + 16, ... one after the other in a rolled loop, each over the whole K, on the one K
// loop every expert's down takes (kPath: DevLayer::down_path), so that the loop holds one
// format's code. First each warp copies the table entries, items and token columns' routes of all
// its items into shared memory, every load issued before the first is stored, so that no round
// waits on the item tables before its weight loads; the blend weights load at the top of each
// round and are read after its MMAs. Sums and outputs as moe_expert_down_blend's: each warp adds
// its items' sums in item order, the block the warps' in warp order. 80-128 registers, no spills.
// On the H200 against the down kernels and the blend (docs/PERF.md, v3.22): qwen3-30b-a3b
// N = 3-4 1.09-1.13x per call, N = 5-8 1.05-1.09x, N = 12-16 1.02-1.06x; qwen3-next-80b-a3b
// N = 2 1.08-1.09x, N = 3-8 1.05-1.12x; against two unrolled rounds at 17-32 items 1.00x.
template <int kPath>
__global__ void __launch_bounds__(kDownBlendWarps * kWarp, 1)
    moe_expert_down_blend_rolled(DevLayer L, const float* x, int n, DevWorkspace ws, int max_items, float* out) {
  constexpr int kMaxItems = kExpertMajorDownBlendMaxItems, kRoundsMax = kMaxItems / kDownBlendWarps;
  __shared__ __align__(16) uint2 entries[kMaxItems][kExpertWords];
  __shared__ int4 item_of[kMaxItems];
  __shared__ int routes_of[kMaxItems][kTile];
  __shared__ int tokens_of[kMaxItems][kTile];
  __shared__ BlendRowSums row_sums[kDownBlendWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, gid = lane / 4;
  const int row0 = blockIdx.x * kRows;
  // This warp's items (slots below max_items, which the workspace holds), loaded beside the count.
  int4 item[kRoundsMax];
#pragma unroll
  for (int r = 0; r < kRoundsMax; ++r) {
    const int slot = warp + r * kDownBlendWarps;
    item[r] = slot < max_items ? ws.items[slot] : make_int4(0, 0, 1, 0);
  }
  const int items = *ws.num_items;
  // Their table entries (lanes below kExpertWords, a word each) and routes (lanes below kTile, a
  // token column each; columns past an item's routes take its first route's, as split_routes).
#pragma unroll
  for (int r = 0; r < kRoundsMax; ++r) {
    const int slot = warp + r * kDownBlendWarps;
    if (slot >= items) break;
    copy_expert_word(L, item[r].x, lane, entries[slot]);
    if (lane < kTile) {
      const int route = ws.route_list[item[r].y + (lane < item[r].z ? lane : 0)];
      routes_of[slot][lane] = route;
      tokens_of[slot][lane] = route_token(L, n, route);
    }
    if (lane == 0) item_of[slot] = item[r];
  }
  for (int i = lane; i < n * kRows; i += kWarp) row_sums[warp][i / kRows][i % kRows] = 0.0f;
  __syncwarp();
#pragma unroll 1
  for (int slot = warp; slot < items; slot += kDownBlendWarps) {
    const int4 it = item_of[slot];
    int routes[1] = {routes_of[slot][gid]};
    const float weight = blend_weight(L, n, ws, routes[0]);
    const DevExpert& ex = *reinterpret_cast<const DevExpert*>(entries[slot]);
    float acc[1][1][4] = {};
    item_sums<false, 1, true, false, false, kPath, 2, false, 1>(L, n, ws, ex, it, row0, routes, nullptr, true, acc);
    add_blended(ex, row0, true, acc[0][0], tokens_of[slot][gid], weight, it.z, row_sums[warp]);
    __syncwarp();  // this item's adds before the next item's
  }
  __syncthreads();
  write_blended(L, x, n, ws, out, row_sums, kDownBlendWarps, row0);
}

// Whether a staged kernel has a variant whose K loop over an NVFP4 matrix loads two chunks ahead
// (run_item's kAhead), which the launch runs where ExpertMajorLaunch says so
// (expert_major_staged_ahead, which follows this). Not where the scale codes come from shared
// memory (kScaleCopy) or the activations in slices (kSliced).
__host__ __device__ constexpr bool staged_two_ahead(bool scale_copy, bool sliced) { return !(scale_copy || sliced); }

// The blocks per SM a staged kernel is held to (__launch_bounds__): at two chunks ahead, those its
// registers allowed at one (down 72 registers at one tile: 7; gate_up 122, and down at two tiles
// 79-112: 4), so that the deeper loads cost no warps; at one, no bound (0). (The two-tile gate_up
// runs in slices, one ahead.) The four-pass down was held to 8 (64 registers) until its loop over
// NVFP4 tiles (v3.17), which spills there.
__host__ __device__ constexpr int staged_min_blocks(bool gate_up, int tiles, [[maybe_unused]] int passes, int ahead) {
  if (ahead == 1) return 0;
  return gate_up || tiles == 2 ? 4 : 7;
}

// A staged down block's kPasses passes of 64 rows from this warp's row0 (group row + 16 w), each
// over the activations the first one staged, all on the K loop kPath. A warp past the rows
// computes a copy of the group's first rows in the first pass, storing nothing, so that it
// reaches the staging barrier, and skips the rest.
template <int kTiles, int kPasses, int kPath, int kAhead>
__device__ __forceinline__ void staged_down_passes(const DevLayer& L, int n, const DevWorkspace& ws, const DevExpert& ex,
                                                   int4 item, int rows, int row0, uint8_t* staged) {
  const int group_row0 = row0 / kExpertMajorStagedRows * kExpertMajorStagedRows;
  run_item<false, kTiles, false, false, false, kPath, kAhead>(L, n, ws, ex, item, row0 < rows ? row0 : group_row0,
                                                              nullptr, row0 < rows, staged);
#pragma unroll 1
  for (int pass = 1; pass < kPasses; ++pass) {
    const int pass_row0 = row0 + pass * kExpertMajorStagedRows;
    if (pass_row0 >= rows) break;
    run_item<false, kTiles, false, false, false, kPath, kAhead>(L, n, ws, ex, item, pass_row0, nullptr, true, staged,
                                                                false);
  }
}

// The staged kernels (kTiles token tiles, 1 or 2): grid (groups of kPasses x 64 output rows, max
// work items); block: 4 warps, warp w on rows 16w .. 16w + 15 of each 64-row pass over the whole
// K, the item's activations staged once per block in shared memory (kTile x
// expert_major_staged_row_bytes(K) bytes per token tile, or with kSliced two buffers of
// expert_major_slice_bytes(kTiles) that the slices take in turn) and read by both passes. Warps
// past the matrix's rows in the first pass compute a copy of the group's first rows and store
// nothing: every warp reaches every staging barrier; the later passes have none, and such warps
// skip them.
// kScaleCopy (one tile), kSliced (one pass only): see run_item. Down only past two passes. Two
// passes are two calls of run_item, each choosing its K loop (71 registers at one token tile,
// against 79 with the loop chosen once for the block); four choose it once per block (weight_path)
// and loop over the passes on it: around run_item's own choice a loop took twice the registers
// (150-255, spilling), ptxas keeping values of every format's loop live across the passes.
template <bool kGateUp, bool kScaleCopy = false, bool kSliced = false, int kTiles = 1, int kPasses = 1, int kAhead = 1>
__global__ void __launch_bounds__(kWarps * kWarp, staged_min_blocks(kGateUp, kTiles, kPasses, kAhead))
    moe_expert_staged(DevLayer L, int n, DevWorkspace ws) {
  if constexpr (kGateUp) {
    wait_for_prior_grid();
    if (!ws.item_release) allow_dependent_launch();
  }
  uint8_t* const staged = staged_smem;
  int4 item;
  if (!read_item(ws, item)) return;
  const DevExpert& ex = block_expert(L, item.x);
  const int rows = kGateUp ? ex.gate.rows : ex.down.rows;
  const int group_row0 = blockIdx.x * kPasses * kExpertMajorStagedRows;
  if (group_row0 >= rows) return;
  if (kGateUp && ws.item_release) allow_dependent_launch();
  const int row0 = group_row0 + static_cast<int>(threadIdx.x / kWarp) * kRows;  // this warp's rows in the first pass
  static_assert(kTiles == 1 || !kScaleCopy);
  static_assert(kPasses == 1 || (!kScaleCopy && !kSliced));
  static_assert(kPasses <= 2 || !kGateUp);
  static_assert(kAhead == 1 || (kAhead == 2 && staged_two_ahead(kScaleCopy, kSliced)));
  if constexpr (kPasses <= 2) {
    run_item<kGateUp, kTiles, false, kScaleCopy, kSliced, kPathAny, kAhead>(
        L, n, ws, ex, item, row0 < rows ? row0 : group_row0, nullptr, row0 < rows, staged);
    if constexpr (kPasses == 2) {
      if (row0 + kExpertMajorStagedRows < rows) {
        run_item<kGateUp, kTiles, false, false, false, kPathAny, kAhead>(L, n, ws, ex, item, row0 + kExpertMajorStagedRows,
                                                                         nullptr, true, staged, false);
      }
    }
    if (kGateUp && ws.item_release) {  // this warp's 16 rows of each pass, every token tile
      const int tiles = (item.z + kTile - 1) / kTile;
      const int passes = (row0 < rows ? 1 : 0) + (kPasses == 2 && row0 + kExpertMajorStagedRows < rows ? 1 : 0);
      publish_item_tiles(ws, blockIdx.y, passes * tiles);
    }
  } else {
    switch (weight_path(ex.down)) {
      case kPathNvfp4Tiled: staged_down_passes<kTiles, kPasses, kPathNvfp4Tiled, kAhead>(L, n, ws, ex, item, rows, row0, staged); break;
      case kPathNvfp4Aligned: staged_down_passes<kTiles, kPasses, kPathNvfp4Aligned, kAhead>(L, n, ws, ex, item, rows, row0, staged); break;
      case kPathNvfp4: staged_down_passes<kTiles, kPasses, kPathNvfp4, kAhead>(L, n, ws, ex, item, rows, row0, staged); break;
      case kPathFp8Block: staged_down_passes<kTiles, kPasses, kPathFp8Block, kAhead>(L, n, ws, ex, item, rows, row0, staged); break;
      case kPathFp8: staged_down_passes<kTiles, kPasses, kPathFp8, kAhead>(L, n, ws, ex, item, rows, row0, staged); break;
      default: staged_down_passes<kTiles, kPasses, kPathBf16, kAhead>(L, n, ws, ex, item, rows, row0, staged); break;
    }
  }
}

}  // namespace

namespace {

// kernel<<<grid, block, smem, stream>>>(args...), or where `early` (ExpertMajorLaunch::early_gate_up,
// early_down) as a programmatic dependent launch, which may start while the kernel before it in the
// stream still runs.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(bool early, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          const Args&... args) {
  if (!early) {
    kernel<<<grid, block, smem, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// A split-K GEMM, launched early where `early` (ExpertMajorLaunch::early_gate_up, early_down).
template <int kTiles>
cudaError_t launch_split(bool gate_up, bool pairs, bool early, const DevLayer& L, int n, const DevWorkspace& ws,
                         int max_items, cudaStream_t stream) {
  if (gate_up) {
    const dim3 grid((L.act_stride + kRows - 1) / kRows, max_items);
    if constexpr (kTiles != 1) {
      return launch_kernel(early, moe_expert_gate_up<kTiles>, grid, kWarps * kWarp, 0, stream, L, n, ws);
    }
    cudaError_t err = cudaSuccess;
    with_path_or_any(L.gate_up_path, [&]<int kPath>() {
      err = launch_kernel(early, moe_expert_gate_up<1, kPath>, grid, kWarps * kWarp, 0, stream, L, n, ws);
    });
    return err;
  } else if (kTiles == 1 && pairs) {
    const dim3 grid(L.hidden / (2 * kRows), max_items);
    cudaError_t err = cudaSuccess;
    with_path_or_any(L.down_path, [&]<int kPath>() {
      err = launch_kernel(early, moe_expert_down_pairs<kPath>, grid, kWarps * kWarp, 0, stream, L, n, ws);
    });
    return err;
  } else {
    return launch_kernel(early, moe_expert_down<kTiles>, dim3((L.hidden + kRows - 1) / kRows, max_items),
                         kWarps * kWarp, 0, stream, L, n, ws);
  }
}

// The staged down of kTiles token tiles whose blocks make `passes` (1, 2 or 4) passes of 64 rows
// over one staging (neither sliced nor copying scale codes), its NVFP4 loops kAhead chunks ahead;
// launched early where `early` (ExpertMajorLaunch::early_down).
template <int kTiles, int kAhead>
cudaError_t launch_staged_down(int passes, bool early, int rows, const DevLayer& L, int n, const DevWorkspace& ws,
                               int max_items, int smem, cudaStream_t stream) {
  const dim3 grid((rows + passes * kExpertMajorStagedRows - 1) / (passes * kExpertMajorStagedRows), max_items);
  const auto launch = [&](auto kernel) {
    return launch_kernel(early, kernel, grid, kWarps * kWarp, smem, stream, L, n, ws);
  };
  if (passes == 4) return launch(moe_expert_staged<false, false, false, kTiles, 4, kAhead>);
  if (passes == 2) return launch(moe_expert_staged<false, false, false, kTiles, 2, kAhead>);
  return launch(moe_expert_staged<false, false, false, kTiles, 1, kAhead>);
}

// One GEMM (gate_up or down) of a call: the staged kernel where `call` says so, else the split-K
// kernel for its token tiles.
cudaError_t launch_gemm(bool gate_up, const DevLayer& L, int n, const DevWorkspace& ws, const ExpertMajorLaunch& call,
                        cudaStream_t stream) {
  const int rows = gate_up ? L.act_stride : L.hidden, K = gate_up ? L.hidden : L.act_stride;
  const int max_items = call.max_items;
  const bool early = gate_up ? call.early_gate_up : call.early_down;
  if (gate_up ? call.staged_gate_up : call.staged_down) {
    const dim3 grid((rows + kExpertMajorStagedRows - 1) / kExpertMajorStagedRows, max_items);
    // Two token tiles (group 16) only where the down stages whole (expert_major_stageable).
    const int tiles = call.group / kTile;
    const bool sliced = gate_up ? call.gate_up_sliced : call.down_sliced;
    // Room for the down's scale codes only where it copies them.
    const int smem =
        expert_major_staged_smem(K, gate_up ? 2 : 1, gate_up ? L.nvfp4 : call.down_copies_scales, tiles, sliced);
    const auto launch = [&](auto kernel) {
      return launch_kernel(early, kernel, grid, kWarps * kWarp, smem, stream, L, n, ws);
    };
    const auto down = [&]<int kTiles>() {
      return call.down_ahead == 2
                 ? launch_staged_down<kTiles, 2>(call.down_passes, early, rows, L, n, ws, max_items, smem, stream)
                 : launch_staged_down<kTiles, 1>(call.down_passes, early, rows, L, n, ws, max_items, smem, stream);
    };
    if (!gate_up) {
      if (tiles == 2) return down.template operator()<2>();
      if (call.down_sliced) return launch(moe_expert_staged<false, false, true>);
      if (call.down_copies_scales) return launch(moe_expert_staged<false, true>);
      return down.template operator()<1>();
    }
    if (tiles == 2) return launch(moe_expert_staged<true, false, true, 2>);  // always in slices (gate_up_sliced)
    if (call.gate_up_sliced) return launch(moe_expert_staged<true, false, true>);
    if (call.gate_up_ahead == 2) return launch(moe_expert_staged<true, false, false, 1, 1, 2>);
    return launch(moe_expert_staged<true>);
  }
  if (gate_up && call.gate_up_selects) {
    const dim3 grid((L.act_stride + kRows - 1) / kRows, max_items);
    const size_t keys = L.n_group > 1 ? L.router_outputs * sizeof(float) : 0;  // <= 256 outputs
    return L.router_outputs <= 4 * kWarp
               ? launch_kernel(early, moe_expert_gate_up_select<4>, grid, kWarps * kWarp, keys, stream, L, ws)
               : launch_kernel(early, moe_expert_gate_up_select<8>, grid, kWarps * kWarp, keys, stream, L, ws);
  }
  if (gate_up && call.gate_up_wide) {  // act_stride % 32 == 0 (expert_major_gate_up_wide)
    const dim3 grid(L.act_stride / (2 * kRows), max_items);
    cudaError_t err = cudaSuccess;
    with_path_or_any(L.gate_up_path, [&]<int kPath>() {
      err = launch_kernel(early, moe_expert_gate_up_wide<kPath>, grid, kWarps * kWarp, 0, stream, L, n, ws);
    });
    return err;
  }
  return call.group == kTile ? launch_split<1>(gate_up, call.down_pairs, early, L, n, ws, max_items, stream)
                             : launch_split<kMaxTiles>(gate_up, false, early, L, n, ws, max_items, stream);
}

}  // namespace

cudaError_t prepare_expert_major_kernels() {
  // The scale-copying down and the two-tile kernels ask for more than the 48 KB that needs no
  // opt-in. No carveout preference (the driver's own choice): forcing shared memory over L1
  // measured 0.71-0.83x on the qwen3 shapes' staged calls (docs/PERF.md, v3.9).
  cudaError_t err = cudaFuncSetAttribute(moe_expert_staged<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kExpertMajorStagedMaxSmem);
  const auto two_tiles = [&](auto kernel) {
    if (err == cudaSuccess) err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kExpertMajorStaged2MaxSmem);
  };
  two_tiles(moe_expert_staged<false, false, false, 2>);
  two_tiles(moe_expert_staged<false, false, false, 2, 2>);
  two_tiles(moe_expert_staged<false, false, false, 2, 4>);
  two_tiles(moe_expert_staged<false, false, false, 2, 1, 2>);
  two_tiles(moe_expert_staged<false, false, false, 2, 2, 2>);
  two_tiles(moe_expert_staged<false, false, false, 2, 4, 2>);
  return err;
}

namespace {

// Grid: enough blocks of kSharedApartThreads for the n x H values of x. The head of a shared
// expert's own chain (launch_moe_shared_apart): x in bf16 for its gate_up, as the router writes
// ws.x_bf16 for the routed experts' (the same rounding), and, by block 0, its items of up to
// `group` routes and its route list.
constexpr int kSharedApartThreads = 256;
__global__ void __launch_bounds__(kSharedApartThreads) moe_shared_apart_inputs(DevLayer L, const float* x, int n,
                                                                                 int group, DevWorkspace ws) {
  const int64_t values = static_cast<int64_t>(n) * L.hidden;
  for (int64_t i = blockIdx.x * int64_t{kSharedApartThreads} + threadIdx.x; i < values;
       i += int64_t{gridDim.x} * kSharedApartThreads) {
    ws.x_bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
  }
  if (blockIdx.x != 0) return;
  const int routed = n * L.top_k;
  for (int t = threadIdx.x; t < n; t += kSharedApartThreads) ws.route_list[t] = routed + t;
  const int items = (n + group - 1) / group;
  for (int i = threadIdx.x; i < items; i += kSharedApartThreads) {
    ws.items[i] = make_int4(L.num_experts, i * group, n - i * group < group ? n - i * group : group, 0);
  }
  if (threadIdx.x == 0) *ws.num_items = items;
}

}  // namespace

cudaError_t launch_moe_shared_apart(const DevLayer& L, const float* x, int n, const DevWorkspace& ws,
                                    const ExpertMajorLaunch& call, const SharedApart& apart, cudaStream_t stream) {
  const ExpertMajorLaunch s = expert_major_shared_launch(L, call, n);
  DevWorkspace own = ws;
  own.items = apart.items;
  own.num_items = apart.num_items;
  own.route_list = apart.route_list;
  own.x_bf16 = apart.x_bf16;
  own.hot_items = nullptr;
  own.hot_num_items = nullptr;
  cudaError_t err = cudaEventRecord(apart.side.fork, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(apart.side.stream, apart.side.fork, 0);
  if (err != cudaSuccess) return err;
  const int64_t values = static_cast<int64_t>(n) * L.hidden;
  const int blocks = static_cast<int>(std::min<int64_t>((values + kSharedApartThreads - 1) / kSharedApartThreads,
                                                        int64_t{2} * L.sm_count));
  moe_shared_apart_inputs<<<blocks, kSharedApartThreads, 0, apart.side.stream>>>(L, x, n, s.group, own);
  err = cudaGetLastError();
  if (err == cudaSuccess) err = launch_gemm(true, L, n, own, s, apart.side.stream);
  if (err == cudaSuccess) err = launch_gemm(false, L, n, own, s, apart.side.stream);
  if (err == cudaSuccess) err = cudaEventRecord(apart.side.join, apart.side.stream);
  return err;
}

cudaError_t launch_moe_expert_major(const DevLayer& L, const float* x, int n, const DevWorkspace& ws,
                                    const ExpertMajorLaunch& call, const SideStream& side, const SharedApart& apart,
                                    float* out, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (call.mixed) {  // the hot items' chain first, so that its longer blocks start first
    DevWorkspace hot_ws = ws;
    hot_ws.items = ws.hot_items;
    hot_ws.num_items = ws.hot_num_items;
    const ExpertMajorLaunch hot = expert_major_hot_launch(call);
    err = cudaEventRecord(side.fork, stream);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(side.stream, side.fork, 0);
    if (err == cudaSuccess) err = launch_gemm(true, L, n, hot_ws, hot, side.stream);
    if (err == cudaSuccess) err = launch_gemm(false, L, n, hot_ws, hot, side.stream);
    if (err == cudaSuccess) err = cudaEventRecord(side.join, side.stream);
    if (err != cudaSuccess) return err;
  }
  // Where the down starts per item, gate_up counts each item's stored tiles and the down waits on them.
  DevWorkspace gemm_ws = ws;
  gemm_ws.item_release = call.item_release;
  err = launch_gemm(true, L, n, gemm_ws, call, stream);
  if (err != cudaSuccess) return err;
  // The shared expert's outputs, where its own chain computes them, before whatever adds them.
  const auto join_shared = [&] {
    return call.shared_apart ? cudaStreamWaitEvent(stream, apart.side.join, 0) : cudaSuccess;
  };
  if (call.down_blend_ways > 0) {
    err = join_shared();
    if (err != cudaSuccess) return err;
    const int warps = call.max_items * call.down_blend_ways;
    const dim3 block((warps < kDownBlendWarps ? warps : kDownBlendWarps) * kWarp);
    const int grid = L.hidden / kRows;  // expert-major: H % 16 == 0
    const bool early = call.early_down;
    if (call.down_blend_rounds > 1) {  // one K loop for every expert's down (L.down_path >= 0: the rule)
      const auto rolled = [&]<int kPath>() {
        err = launch_kernel(early, moe_expert_down_blend_rolled<kPath>, grid, block, 0, stream, L, x, n, ws,
                            call.max_items, out);
      };
      // Not chosen without one loop (expert_major_down_blend_ways).
      if (!with_path(L.down_path, rolled)) return cudaErrorInvalidValue;
      return err;
    }
    const auto fused = [&]<bool kPublished>() {
      const auto launch = [&](auto kernel) {
        return launch_kernel(early, kernel, grid, block, 0, stream, L, x, n, gemm_ws, out);
      };
      switch (call.down_blend_ways) {
        case 4: return launch(moe_expert_down_blend<4, kPublished>);
        case 2: return launch(moe_expert_down_blend<2, kPublished>);
        default: return launch(moe_expert_down_blend<1, kPublished>);
      }
    };
    return gemm_ws.items_published != nullptr ? fused.template operator()<true>() : fused.template operator()<false>();
  }
  err = launch_gemm(false, L, n, gemm_ws, call, stream);
  if (err == cudaSuccess && call.mixed) err = cudaStreamWaitEvent(stream, side.join, 0);
  if (err == cudaSuccess) err = join_shared();
  if (err != cudaSuccess) return err;
  return launch_moe_blend(L, x, n, ws, out, stream);
}

}  // namespace moeinfer::cuda
