// The expert-major path: routes grouped by expert on the device, then one block per (expert,
// 16 output rows, up to 32 routes) running tensor-core MMAs (mma.sync m16n8k16, fp32
// accumulate) with the weights dequantized in registers. Each expert is read once per call
// however many tokens chose it.
//
// Operand layout. The weights are the MMA's A operand (16 rows x 16 k per MMA), the tokens its
// B operand (16 k x 8 tokens). The four lanes of a quad (lane % 4 = c) each own a contiguous run
// of V input columns per chunk of 4V columns, V = 16 bytes of weights (32 NVFP4, 16 FP8 or
// 8 BF16 values), so every lane loads 16 contiguous bytes of a row straight from the natural
// K-major layout, and 16 or 32 contiguous activations. Within a run the MMA's k order is
// permuted (k_of below) so that decoding is a few bit operations; A and B use the same
// permutation, which leaves the dot products unchanged. Columns past the last full chunk go
// through the same code with V = 4 (one MMA step, 2 to 8 byte loads).
//
// Numbers. NVFP4 codes become fp16 by moving bits (E2M1 x 2^-14 is exact as fp16, subnormals
// included), then one fp16 multiply by the block scale x 2^7 (exact: at most 6 significant
// bits, normal for every normal E4M3 scale); the 2^7 and the global scale are applied to the
// fp32 result. FP8 converts exactly to fp16 (cvt.e4m3x2); block-128 scales multiply each
// chunk's fp32 partial, per-channel and per-tensor scales the result. BF16 multiplies bf16.
// Activations are rounded to fp16 (bf16 for BF16 weights) after a power-of-two range scale.
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/moe_kernels.cuh"
#include "moeinfer/format.h"
#include "moeinfer/layer.h"

namespace moeinfer::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;                             // split-K: warp w takes chunks w, w+4, ...
constexpr int kRows = 16;                             // output rows per block (one MMA M)
constexpr int kTile = 8;                              // routes per MMA (N)
constexpr int kMaxTiles = kExpertMajorGroup / kTile;  // token tiles per block
constexpr int kGroupThreads = 1024;

enum class Fmt { kNvfp4, kFp8, kBf16 };

// Values per lane-run in the main loop: 16 bytes of weights.
template <Fmt F>
constexpr int kMainRun = F == Fmt::kNvfp4 ? 32 : (F == Fmt::kFp8 ? 16 : 8);

// Position within a lane's run of the value in half h (0 low, 1 high) of the A/B register for
// MMA step s, register slot j (0: k columns 2c, 2c+1 of the step; 1: 2c+8, 2c+9).
template <Fmt F, int V>
__device__ __forceinline__ constexpr int k_of(int s, int j, int h) {
  if constexpr (F == Fmt::kNvfp4 && V == 32) {
    // Word q = s / 2 holds values 8q..8q+7; its pair p = (s % 2) * 2 + j is (8q + p, 8q + p + 4).
    return 8 * (s / 2) + (s % 2) * 2 + j + 4 * h;
  } else if constexpr (F == Fmt::kNvfp4) {
    return j + 2 * h;  // V == 4: pairs (0, 2) and (1, 3)
  } else {
    return 4 * s + 2 * j + h;  // FP8 and BF16: consecutive pairs
  }
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Two E4M3 codes (low byte first) as an fp16 pair.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_codes) {
  uint32_t r;
  const uint16_t v = static_cast<uint16_t>(two_codes);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
}

// The E2M1 codes in bits 0-3 and 16-19 of t as an fp16 pair, times 2^-14: magnitude bits to the
// fp16 exponent/mantissa boundary, sign to bit 15.
__device__ __forceinline__ uint32_t e2m1x2_to_f16x2(uint32_t t) {
  return ((t << 9) & 0x0E000E00u) | ((t << 12) & 0x80008000u);
}

template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Bytes of weights in a run of V values.
template <Fmt F, int V>
constexpr int kRunBytes = F == Fmt::kNvfp4 ? V / 2 : (F == Fmt::kFp8 ? V : 2 * V);

// The raw bytes of one lane-run (streaming loads: each weight byte is read once per call).
template <Fmt F, int V>
__device__ __forceinline__ void load_run(const DevMatrix& m, int row, int k, uint32_t (&raw)[4]) {
  const int64_t index = static_cast<int64_t>(row) * m.cols + k;
  constexpr int kBytes = kRunBytes<F, V>;
  const uint8_t* p = m.data + (F == Fmt::kNvfp4 ? index / 2 : (F == Fmt::kFp8 ? index : 2 * index));
  if constexpr (kBytes == 16) {
    if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
      raw[0] = v.x, raw[1] = v.y, raw[2] = v.z, raw[3] = v.w;
    } else {  // NVFP4 rows of K % 32 == 16 columns start 8 bytes off every other row
      const uint2 a = __ldcs(reinterpret_cast<const uint2*>(p));
      const uint2 b = __ldcs(reinterpret_cast<const uint2*>(p + 8));
      raw[0] = a.x, raw[1] = a.y, raw[2] = b.x, raw[3] = b.y;
    }
  } else if constexpr (kBytes == 8) {
    const uint2 a = __ldcs(reinterpret_cast<const uint2*>(p));
    raw[0] = a.x, raw[1] = a.y, raw[2] = 0u, raw[3] = 0u;
  } else if constexpr (kBytes == 4) {
    raw[0] = __ldcs(reinterpret_cast<const unsigned int*>(p)), raw[1] = raw[2] = raw[3] = 0u;
  } else {
    raw[0] = __ldcs(reinterpret_cast<const unsigned short*>(p)), raw[1] = raw[2] = raw[3] = 0u;
  }
}

// NVFP4 block scales of a run (1 or 2 blocks of 16) as fp16 pairs (s, s), times 2^7.
template <int V>
__device__ __forceinline__ void load_run_scales(const DevMatrix& m, int row, int k, uint32_t (&scale)[2]) {
  const uint8_t* p = m.block_scales + (static_cast<int64_t>(row) * m.cols + k) / 16;
  const uint32_t codes = V == 32 ? (static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8) : p[0];
  const uint32_t pair = mul_f16x2(e4m3x2_to_f16x2(codes), 0x58005800u);  // x (128, 128)
  scale[0] = __byte_perm(pair, 0, 0x1010);  // low half in both halves
  scale[1] = __byte_perm(pair, 0, 0x3232);  // high half in both halves
}

// The A register of MMA step s, slot j, for one row's run.
template <Fmt F, int V>
__device__ __forceinline__ uint32_t decode(const uint32_t (&raw)[4], const uint32_t (&scale)[2], int s, int j) {
  if constexpr (F == Fmt::kNvfp4 && V == 32) {
    const int q = s / 2, pair = (s % 2) * 2 + j;
    return mul_f16x2(e2m1x2_to_f16x2(raw[q] >> (4 * pair)), scale[q / 2]);
  } else if constexpr (F == Fmt::kNvfp4) {
    const uint32_t spread = (raw[0] & 0xFFu) | ((raw[0] & 0xFF00u) << 8);  // codes 0,1 | codes 2,3 at bit 16
    return mul_f16x2(e2m1x2_to_f16x2(spread >> (4 * j)), scale[0]);
  } else if constexpr (F == Fmt::kFp8) {
    return e4m3x2_to_f16x2(raw[s] >> (16 * j));
  } else {
    return raw[2 * s + j];
  }
}

// Where each lane's B column (token tile slot lane / 4) reads its activations from.
struct Columns {
  const float* row[kMaxTiles];  // null past the item's routes
  float scale[kMaxTiles];       // the power-of-two range scale of that row
};

// One chunk of 4V input columns starting at k0, for kMats matrices sharing the B operand
// (gate and up, or down alone), every token tile of the item.
template <Fmt F, int V, int kMats>
__device__ __forceinline__ void mma_chunk(const DevMatrix* const (&m)[kMats], int row0, int k0, int tiles,
                                          const Columns& cols, float (&acc)[kMaxTiles][kMats][4]) {
  constexpr int kSteps = V / 4;
  constexpr bool kBf16 = F == Fmt::kBf16;
  const int lane = threadIdx.x % kWarp, gid = lane / 4, c = lane % 4;
  const int k = k0 + c * V;  // this lane's run

  uint32_t raw[kMats][2][4];
  uint32_t scale[kMats][2][2] = {};
  float block_scale[kMats];
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // rows gid and gid + 8 of the tile
      load_run<F, V>(*m[mi], row0 + gid + 8 * r, k, raw[mi][r]);
      if constexpr (F == Fmt::kNvfp4) load_run_scales<V>(*m[mi], row0 + gid + 8 * r, k, scale[mi][r]);
    }
    block_scale[mi] = 1.0f;
    if constexpr (F == Fmt::kFp8) {
      // A 16-row tile and a chunk of at most 64 columns lie in one 128 x 128 block.
      if (m[mi]->fp8_scaling == static_cast<uint8_t>(Fp8Scaling::kBlock128)) {
        block_scale[mi] = m[mi]->scales[(row0 / 128) * m[mi]->scale_cols + k0 / 128];
      }
    }
  }

#pragma unroll
  for (int tile = 0; tile < kMaxTiles; ++tile) {
    if (tile >= tiles) break;
    // B: this lane's V activations, range-scaled, rounded to fp16/bf16 pairs in k_of order.
    float v[V];
    if (cols.row[tile] != nullptr) {
      const float4* src = reinterpret_cast<const float4*>(cols.row[tile] + k);
#pragma unroll
      for (int i = 0; i < V / 4; ++i) {
        const float4 f = __ldg(src + i);
        v[4 * i] = f.x * cols.scale[tile], v[4 * i + 1] = f.y * cols.scale[tile];
        v[4 * i + 2] = f.z * cols.scale[tile], v[4 * i + 3] = f.w * cols.scale[tile];
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = 0.0f;
    }
    uint32_t b[kSteps][2];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float lo = v[k_of<F, V>(s, j, 0)], hi = v[k_of<F, V>(s, j, 1)];
        b[s][j] = kBf16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
      }
    }
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi) {
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint32_t a[4] = {decode<F, V>(raw[mi][0], scale[mi][0], s, 0), decode<F, V>(raw[mi][1], scale[mi][1], s, 0),
                               decode<F, V>(raw[mi][0], scale[mi][0], s, 1), decode<F, V>(raw[mi][1], scale[mi][1], s, 1)};
        mma_16816<kBf16>(part, a, b[s][0], b[s][1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[tile][mi][i] += block_scale[mi] * part[i];
    }
  }
}

// This warp's share of the K loop: full chunks w, w+4, ..., then the 16-column tail steps.
template <Fmt F, int kMats>
__device__ void mma_rows(const DevMatrix* const (&m)[kMats], int row0, int tiles, const Columns& cols,
                         float (&acc)[kMaxTiles][kMats][4]) {
  constexpr int V = kMainRun<F>;
  const int warp = threadIdx.x / kWarp;
  const int K = m[0]->cols;
  const int chunks = K / (4 * V);
  for (int ch = warp; ch < chunks; ch += kWarps) mma_chunk<F, V, kMats>(m, row0, ch * 4 * V, tiles, cols, acc);
  const int tail0 = chunks * 4 * V;
  const int tail_steps = (K - tail0) / 16;
  for (int s = warp; s < tail_steps; s += kWarps) mma_chunk<F, 4, kMats>(m, row0, tail0 + 16 * s, tiles, cols, acc);
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

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + __expf(-v)); }

__device__ __forceinline__ float activation(const DevLayer& L, float g, float u) {
  if (L.activation == static_cast<uint8_t>(Activation::kGptOssClamped)) {
    g = fminf(g, L.swiglu_limit);
    u = fminf(fmaxf(u, -L.swiglu_limit), L.swiglu_limit);
    return (u + 1.0f) * g * sigmoid(L.swiglu_alpha * g);
  }
  return g * sigmoid(g) * u;
}

// Grid: (row tiles of the widest matrix, max work items). Block: 4 warps splitting K; the
// partial sums meet in shared memory, and warp t finishes token tile t.
// kGateUp: gate and up of the item's routes -> activation (fp32) and its per-route maximum.
// Otherwise: down of the activations -> expert_out.
template <bool kGateUp>
__global__ void __launch_bounds__(kWarps * kWarp) moe_expert_major(DevLayer L, const float* x, int n, DevWorkspace ws) {
  constexpr int kMats = kGateUp ? 2 : 1;
  __shared__ float partial[kWarps][kMaxTiles][kMats * 4][kWarp];
  if (static_cast<int>(blockIdx.y) >= *ws.num_items) return;
  const int4 item = ws.items[blockIdx.y];  // {expert, first, count, -}
  const DevExpert& ex = L.experts[item.x];
  const DevMatrix* mats[kMats];
  if constexpr (kGateUp) {
    mats[0] = &ex.gate, mats[1] = &ex.up;
  } else {
    mats[0] = &ex.down;
  }
  const int row0 = blockIdx.x * kRows;
  if (row0 >= mats[0]->rows) return;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, gid = lane / 4, c = lane % 4;
  const int tiles = (item.z + kTile - 1) / kTile;

  Columns cols;
#pragma unroll
  for (int tile = 0; tile < kMaxTiles; ++tile) {
    const int slot = tile * kTile + gid;
    cols.row[tile] = nullptr;
    cols.scale[tile] = 0.0f;
    if (slot < item.z) {
      const int route = ws.route_list[item.y + slot];
      if constexpr (kGateUp) {
        const int t = route_token(L, n, route);
        cols.row[tile] = x + static_cast<int64_t>(t) * L.hidden;
        cols.scale[tile] = ws.x_scale[t];
      } else {
        cols.row[tile] = ws.act + static_cast<int64_t>(route) * L.act_stride;
        cols.scale[tile] = fp16_range_scale(ws.act_amax[route]);
      }
    }
  }

  float acc[kMaxTiles][kMats][4] = {};
  switch (mats[0]->format) {
    case static_cast<uint8_t>(WeightFormat::kNVFP4): mma_rows<Fmt::kNvfp4, kMats>(mats, row0, tiles, cols, acc); break;
    case static_cast<uint8_t>(WeightFormat::kFP8): mma_rows<Fmt::kFp8, kMats>(mats, row0, tiles, cols, acc); break;
    default: mma_rows<Fmt::kBf16, kMats>(mats, row0, tiles, cols, acc); break;
  }

#pragma unroll
  for (int tile = 0; tile < kMaxTiles; ++tile) {
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

  // Accumulator i holds row row0 + gid + 8 (i / 2), token slot tile * 8 + 2c + i % 2.
  int route[2];
  float in_scale[2], b_scale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int slot = tile * kTile + 2 * c + h;
    route[h] = slot < item.z ? ws.route_list[item.y + slot] : -1;
    in_scale[h] = 1.0f;
    b_scale[h] = 1.0f;
    if (route[h] >= 0) {
      if constexpr (kGateUp) {
        b_scale[h] = ws.x_scale[route_token(L, n, route[h])];
        if (L.weight_on_input && route[h] < n * L.top_k) in_scale[h] = ws.weights[route[h]];
      } else {
        b_scale[h] = fp16_range_scale(ws.act_amax[route[h]]);
      }
    }
  }
  float largest[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = row0 + gid + 8 * (i / 2), h = i % 2;
    if (route[h] < 0) continue;
    const float undo = in_scale[h] / b_scale[h];
    if constexpr (kGateUp) {
      float g = sum[i] * output_multiplier(ex.gate, row) * undo;
      float u = sum[4 + i] * output_multiplier(ex.up, row) * undo;
      if (ex.gate.bias != nullptr) g += ex.gate.bias[row];
      if (ex.up.bias != nullptr) u += ex.up.bias[row];
      const float a = activation(L, g, u);
      ws.act[static_cast<int64_t>(route[h]) * L.act_stride + row] = a;
      largest[h] = fmaxf(largest[h], fabsf(a));
    } else {
      float y = sum[i] * output_multiplier(ex.down, row) * undo;
      if (ex.down.bias != nullptr) y += ex.down.bias[row];
      ws.expert_out[static_cast<int64_t>(route[h]) * L.hidden + row] = y;
    }
  }
  if constexpr (kGateUp) {
    // Per route, the largest |activation| over this block's 16 rows, then over all blocks.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int o = 4; o < kWarp; o *= 2) largest[h] = fmaxf(largest[h], __shfl_xor_sync(0xFFFFFFFFu, largest[h], o));
      if (gid == 0 && route[h] >= 0) atomicMax(ws.act_amax + route[h], __float_as_uint(largest[h]));
    }
  }
}

// The expert (table index) a route runs on, or -1 for a zero-computation expert.
__device__ __forceinline__ int route_expert_index(const DevLayer& L, const DevWorkspace& ws, int n, int route) {
  const int routed = n * L.top_k;
  if (route >= routed) return L.num_experts;  // the shared expert
  const int id = ws.ids[route];
  return id < L.num_experts ? id : -1;
}

// Grid: 1 block. Counts routes per expert, scans the counts, writes the work items (up to 32
// routes of one expert each) and the routes grouped by expert. Order within an expert does not
// matter: each route's output column is computed on its own.
__global__ void __launch_bounds__(kGroupThreads) moe_group_routes(DevLayer L, int n, DevWorkspace ws) {
  using Scan = cub::BlockScan<int, kGroupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  extern __shared__ int counts[];  // [experts], then the write cursors
  const int experts = L.num_experts + (L.has_shared ? 1 : 0);
  int* cursor = counts + experts;
  const int routes = n * L.top_k + (L.has_shared ? n : 0);
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int r = threadIdx.x; r < routes; r += blockDim.x) {
    const int e = route_expert_index(L, ws, n, r);
    if (e >= 0) atomicAdd(counts + e, 1);
  }
  __syncthreads();

  // Thread i owns experts [i * per, (i + 1) * per).
  const int per = (experts + kGroupThreads - 1) / kGroupThreads;
  const int first = threadIdx.x * per;
  int my_routes = 0, my_items = 0;
  for (int e = first; e < first + per && e < experts; ++e) {
    my_routes += counts[e];
    my_items += (counts[e] + kExpertMajorGroup - 1) / kExpertMajorGroup;
  }
  int route_base = 0, item_base = 0;
  Scan(scan_storage).ExclusiveSum(my_routes, route_base);
  __syncthreads();
  Scan(scan_storage).ExclusiveSum(my_items, item_base);
  if (threadIdx.x == kGroupThreads - 1) *ws.num_items = item_base + my_items;
  for (int e = first; e < first + per && e < experts; ++e) {
    cursor[e] = route_base;
    for (int start = 0; start < counts[e]; start += kExpertMajorGroup) {
      const int count = counts[e] - start < kExpertMajorGroup ? counts[e] - start : kExpertMajorGroup;
      ws.items[item_base++] = make_int4(e, route_base + start, count, 0);
    }
    route_base += counts[e];
  }
  __syncthreads();
  for (int r = threadIdx.x; r < routes; r += blockDim.x) {
    const int e = route_expert_index(L, ws, n, r);
    if (e >= 0) ws.route_list[atomicAdd(cursor + e, 1)] = r;
  }
}

}  // namespace

cudaError_t launch_moe_expert_major(const DevLayer& L, const float* x, int n, const DevWorkspace& ws, float* out,
                                    cudaStream_t stream) {
  const int experts = L.num_experts + (L.has_shared ? 1 : 0);
  const int routes = n * L.top_k + (L.has_shared ? n : 0);
  const int max_items = expert_major_max_items(routes, experts);
  const size_t group_smem = 2 * static_cast<size_t>(experts) * sizeof(int);
  moe_group_routes<<<1, kGroupThreads, group_smem, stream>>>(L, n, ws);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 gate_up_grid((L.act_stride + kRows - 1) / kRows, max_items);
  moe_expert_major<true><<<gate_up_grid, kWarps * kWarp, 0, stream>>>(L, x, n, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 down_grid((L.hidden + kRows - 1) / kRows, max_items);
  moe_expert_major<false><<<down_grid, kWarps * kWarp, 0, stream>>>(L, x, n, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_moe_blend(L, x, n, ws, out, stream);
}

}  // namespace moeinfer::cuda
