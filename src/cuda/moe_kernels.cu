// Kernels of the CUDA paths: the router + selection kernel both paths share, the three
// token-major kernels, and the per-row fallback's expert kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cub/block/block_scan.cuh>

#include "cuda/mma.cuh"
#include "cuda/moe_kernels.cuh"
#include "cuda/nvfp4_pair_order.h"
#include "cuda/route_select.cuh"
#include "moeinfer/format.h"
#include "moeinfer/layer.h"
#include "moeinfer/plan.h"

namespace moeinfer::cuda {

namespace {

// ---- weight decoding -------------------------------------------------------------------------

__device__ __forceinline__ float e4m3_value(uint8_t code) {
  __nv_fp8_e4m3 v;
  v.__x = code;
  return static_cast<float>(v);
}

// E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; sign in bit 3.
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t m = code & 7u;
  const float mag = m < 4 ? 0.5f * static_cast<float>(m) : (m < 6 ? static_cast<float>(m - 2) : (m == 6 ? 4.0f : 6.0f));
  return (code & 8u) ? -mag : mag;
}

__device__ __forceinline__ float fp8_scale(const DevMatrix& m, int r, int c) {
  if (m.fp8_scaling == static_cast<uint8_t>(Fp8Scaling::kBlock128)) {
    return m.scales[(r / 128) * m.scale_cols + c / 128];
  }
  return m.fp8_scaling == static_cast<uint8_t>(Fp8Scaling::kPerChannel) ? m.scales[r] : m.scales[0];
}

// One weight, any position: the per-row path's load.
__device__ __forceinline__ float load_weight(const DevMatrix& m, int r, int c) {
  switch (m.format) {
    case static_cast<uint8_t>(WeightFormat::kBF16): {
      const uint16_t bits = *reinterpret_cast<const uint16_t*>(m.data + weight_offset(m, r, 2 * int64_t{c}));
      return __uint_as_float(static_cast<uint32_t>(bits) << 16);
    }
    case static_cast<uint8_t>(WeightFormat::kFP8):
      return e4m3_value(m.data[weight_offset(m, r, c)]) * fp8_scale(m, r, c);
    default: {  // NVFP4: words of 8 codes in pair order (cols % 8 == 0: rows are whole words)
      const int64_t i = static_cast<int64_t>(r) * m.cols + c;
      const uint32_t word = m.cols % 8 == 0
                                ? *reinterpret_cast<const uint32_t*>(m.data + weight_offset(m, r, c / 8 * 4))
                                : reinterpret_cast<const uint32_t*>(m.data)[i / 8];
      const uint32_t code = pair_order_code(word, static_cast<int>(m.cols % 8 == 0 ? c % 8 : i % 8));
      const float block = e4m3_value(m.block_scales[block_scale_offset(m, r, c / 16)]);
      return e2m1_value(code) * block * m.global_scale;
    }
  }
}

// Eight consecutive weights of row r from column c (c % 8 == 0, cols % 8 == 0): one 16-, 8- or
// 4-byte load, so a warp reads 512, 256 or 128 contiguous bytes per step.
__device__ __forceinline__ void load_weights8(const DevMatrix& m, int r, int c, float (&w)[8]) {
  switch (m.format) {
    case static_cast<uint8_t>(WeightFormat::kBF16): {
      const uint4 v = *reinterpret_cast<const uint4*>(m.data + weight_offset(m, r, 2 * int64_t{c}));
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        w[2 * j] = __uint_as_float(words[j] << 16);
        w[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
      }
      return;
    }
    case static_cast<uint8_t>(WeightFormat::kFP8): {
      const uint2 v = *reinterpret_cast<const uint2*>(m.data + weight_offset(m, r, c));
      const float s = fp8_scale(m, r, c);  // 8 columns never straddle a 128 block
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t word = j < 4 ? v.x : v.y;
        w[j] = e4m3_value(static_cast<uint8_t>(word >> (8 * (j % 4)))) * s;
      }
      return;
    }
    default: {
      const uint32_t v = *reinterpret_cast<const uint32_t*>(m.data + weight_offset(m, r, c / 2));
      const float s = e4m3_value(m.block_scales[block_scale_offset(m, r, c / 16)]) * m.global_scale;
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = e2m1_value(pair_order_code(v, j)) * s;  // element c + j
      return;
    }
  }
}

__device__ __forceinline__ float dot8(const float (&w)[8], const float* x) {
  const float4 a = *reinterpret_cast<const float4*>(x);
  const float4 b = *reinterpret_cast<const float4*>(x + 4);
  return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
}

// sum_c W[r, c] * x[c] * x_scale over one warp; every lane returns the total.
// Each lane reads 16 bytes of weights per step where the row allows it (32 NVFP4, 16 FP8 or
// 8 BF16 values): a warp then asks for 512 contiguous bytes at once, enough to keep HBM busy.
__device__ float warp_dot(const DevMatrix& m, int r, const float* x, float x_scale) {
  const int lane = threadIdx.x % kWarp;
  float acc = 0.0f;
  if (m.format == static_cast<uint8_t>(WeightFormat::kNVFP4) && m.cols % 32 == 0) {
    for (int c = lane * 32; c < m.cols; c += kWarp * 32) {
      const uint4 v = *reinterpret_cast<const uint4*>(m.data + weight_offset(m, r, c / 2));
      const uint8_t* bs = m.block_scales + block_scale_offset(m, r, c / 16);  // c / 16 even
      const float s0 = e4m3_value(bs[0]) * m.global_scale, s1 = e4m3_value(bs[1]) * m.global_scale;
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = e2m1_value(pair_order_code(words[q], j)) * (q < 2 ? s0 : s1);
        acc += dot8(w, x + c + 8 * q);
      }
    }
  } else if (m.format == static_cast<uint8_t>(WeightFormat::kFP8) && m.cols % 16 == 0) {
    for (int c = lane * 16; c < m.cols; c += kWarp * 16) {
      const uint4 v = *reinterpret_cast<const uint4*>(m.data + weight_offset(m, r, c));
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      float block = 0.0f;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        float w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = e4m3_value(static_cast<uint8_t>(words[2 * q + j / 4] >> (8 * (j % 4))));
        block += dot8(w, x + c + 8 * q);
      }
      acc += block * fp8_scale(m, r, c);  // 16 columns never straddle a 128 block
    }
  } else if (m.cols % 8 == 0) {
    for (int c = lane * 8; c < m.cols; c += kWarp * 8) {
      float w[8];
      load_weights8(m, r, c, w);
      acc += dot8(w, x + c);
    }
  } else {
    for (int c = lane; c < m.cols; c += kWarp) acc += load_weight(m, r, c) * x[c];
  }
  return warp_sum(acc) * x_scale;
}

// Route -> (token, expert, input scale); false for zero-computation experts, which have no
// expert work (the blend adds w * x for them), and for experts another rank owns.
__device__ __forceinline__ bool route_expert(const DevLayer& L, const DevWorkspace& ws, int n, int route, int* token,
                                             int* expert, float* in_scale) {
  const int routed = n * L.top_k;
  *in_scale = 1.0f;
  if (route < routed) {
    *token = route / L.top_k;
    *expert = ws.ids[route];
    if (!owns_expert(L, *expert)) return false;
    if (L.weight_on_input) *in_scale = ws.weights[route];
    return true;
  }
  *token = route - routed;
  *expert = L.num_experts;  // the shared expert's slot
  return true;
}

// ---- block reductions (blockDim.x a multiple of 32, at most 1024) ------------------------------

__device__ ArgMax block_argmax(ArgMax a) {
  __shared__ float values[kWarp];
  __shared__ int indices[kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  a = warp_argmax(a);
  if (lane == 0) {
    values[warp] = a.value;
    indices[warp] = a.index;
  }
  __syncthreads();
  ArgMax r{-INFINITY, INT_MAX};
  if (lane < warps) r = {values[lane], indices[lane]};
  r = warp_argmax(r);
  __syncthreads();  // the arrays are reused by the next call
  return r;
}

__device__ float block_sum(float v) {
  __shared__ float partial[kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float r = lane < warps ? partial[lane] : 0.0f;
  r = warp_sum(r);
  __syncthreads();
  return r;
}

// ---- router + selection ------------------------------------------------------------------------

constexpr int kRouteThreads = 256;

// The tokens of a router block (kTokens from t0 = kTokens blockIdx.y, fewer in the last); the
// row of blocks (blockIdx.y) also writes their bf16 copy of x for the expert-major path.
template <int kTokens = kRouterTokens>
__device__ __forceinline__ int router_block_tokens(const DevLayer& L, const float* x, int n, const DevWorkspace& ws) {
  const int t0 = blockIdx.y * kTokens;
  const int tokens = n - t0 < kTokens ? n - t0 : kTokens;
  const int64_t H = L.hidden;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < tokens * H; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    ws.x_bf16[t0 * H + i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[t0 * H + i]));
  }
  return tokens;
}

// Grid: (ceil((E + Z + shared gate) / 2), ceil(n / kTokens)). Block: 8 warps on 2 router rows
// (the shared expert's gate vector is one more row), 4 warps splitting each row's columns, for
// kTokens tokens at once (router_logits_tokens: 8, or 1 where the grid would be small): the
// router is read once per kTokens tokens, by many blocks with few loads each, so the reads are in
// flight together rather than one after another. The blocks also write expert-major's bf16 copy
// of x.
constexpr int kRouterWarps = 8;
constexpr int kRouterParts = kRouterWarps / kRouterRows;
template <int kTokens>
__global__ void __launch_bounds__(kRouterWarps * kWarp) moe_router_logits(DevLayer L, const float* x, int n,
                                                                          DevWorkspace ws) {
  __shared__ float partial[kRouterWarps][kTokens];
  allow_dependent_launch();  // a gate_up that selects (expert_major_early_gate_up)
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int t0 = blockIdx.y * kTokens;
  const int tokens = router_block_tokens<kTokens>(L, x, n, ws);
  const int64_t H = L.hidden;

  const int part = warp / kRouterRows;
  const int e = blockIdx.x * kRouterRows + warp % kRouterRows;
  const bool gate_row = e == L.router_outputs && L.shared_gate;
  const float* xt = x + t0 * H;
  float acc[kTokens] = {};
  if (gate_row) {
#pragma unroll 4
    for (int c = part * kWarp + lane; c < L.hidden; c += kRouterParts * kWarp) {
      const float w = L.shared_gate_values[c];
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if (j < tokens) acc[j] += w * xt[j * H + c];
      }
    }
  } else if (e < L.router_outputs && L.router.cols % 8 == 0) {
#pragma unroll 4
    for (int c = (part * kWarp + lane) * 8; c < L.hidden; c += kRouterParts * kWarp * 8) {
      float w[8];
      load_weights8(L.router, e, c, w);
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if (j < tokens) acc[j] += dot8(w, xt + j * H + c);
      }
    }
  } else if (e < L.router_outputs) {
    for (int c = part * kWarp + lane; c < L.hidden; c += kRouterParts * kWarp) {
      const float w = load_weight(L.router, e, c);
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if (j < tokens) acc[j] += w * xt[j * H + c];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kTokens; ++j) {
    const float dot = warp_sum(acc[j]);
    if (lane == 0) partial[warp][j] = dot;
  }
  __syncthreads();
  // Lane j of the first warp on each row adds the row's parts for token j.
  if (part != 0 || lane >= tokens || (e >= L.router_outputs && !gate_row)) return;
  float dot = 0.0f;
#pragma unroll
  for (int p = 0; p < kRouterParts; ++p) dot += partial[p * kRouterRows + warp][lane];
  if (gate_row) {
    ws.shared_gate[t0 + lane] = sigmoidf(dot);
  } else {
    const float bias = L.router.bias != nullptr ? L.router.bias[e] : 0.0f;
    ws.logits[static_cast<int64_t>(t0 + lane) * L.router_outputs + e] = dot + bias;
  }
}

// Grid: (ceil((E + Z + shared gate) / 16), ceil(n / 8)). Block: 8 warps, warp w on router rows
// 16 bx + 2w and 16 bx + 2w + 1 over all columns, for 8 tokens. For grids that fill the GPU
// (router_logits_wide): moe_router_logits reads the 8 tokens' fp32 x (8 x 4H bytes) once per 2
// rows, so at qwen3-next N = 64 L2 carried about 130 MB of x for 2 MB of router (the 32.8 us
// of v3.4's profile); here the block's 8 warps share each x read through L1, 16 rows at a time.
// Rows of any width that is a multiple of 8; the blocks also write expert-major's bf16 copy of x.
__global__ void __launch_bounds__(kRouterWarps * kWarp) moe_router_logits_wide(DevLayer L, const float* x, int n,
                                                                               DevWorkspace ws) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  allow_dependent_launch();
  const int t0 = blockIdx.y * kRouterTokens;
  const int tokens = router_block_tokens(L, x, n, ws);
  const int64_t H = L.hidden;

  constexpr int kRowsPerWarp = kRouterWideRows / kRouterWarps;
  const int e0 = blockIdx.x * kRouterWideRows + warp * kRowsPerWarp;
  const float* xt = x + t0 * H;
  float acc[kRowsPerWarp][kRouterTokens] = {};
#pragma unroll 2
  for (int c = lane * 8; c < L.hidden; c += kWarp * 8) {
    float w[kRowsPerWarp][8];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int e = e0 + r;
      if (e < L.router_outputs) {
        load_weights8(L.router, e, c, w[r]);
      } else if (e == L.router_outputs && L.shared_gate) {
        const float4 a = *reinterpret_cast<const float4*>(L.shared_gate_values + c);
        const float4 b = *reinterpret_cast<const float4*>(L.shared_gate_values + c + 4);
        w[r][0] = a.x, w[r][1] = a.y, w[r][2] = a.z, w[r][3] = a.w, w[r][4] = b.x, w[r][5] = b.y, w[r][6] = b.z, w[r][7] = b.w;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[r][i] = 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kRouterTokens; ++j) {
      if (j >= tokens) break;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) acc[r][j] += dot8(w[r], xt + j * H + c);
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int e = e0 + r;
    const bool gate_row = e == L.router_outputs && L.shared_gate;
    float mine = 0.0f;  // lane j keeps token j's total
#pragma unroll
    for (int j = 0; j < kRouterTokens; ++j) {
      const float dot = warp_sum(acc[r][j]);
      if (lane == j) mine = dot;
    }
    if (lane >= tokens || (e >= L.router_outputs && !gate_row)) continue;
    if (gate_row) {
      ws.shared_gate[t0 + lane] = sigmoidf(mine);
    } else {
      const float bias = L.router.bias != nullptr ? L.router.bias[e] : 0.0f;
      ws.logits[static_cast<int64_t>(t0 + lane) * L.router_outputs + e] = mine + bias;
    }
  }
}

// Grid: (router_mma_row_groups, ceil(n / 8), router_mma_slices(H)); block: 8 warps, warp w on
// rows 128 bx + 16 w .. + 15 for the block's 8 tokens (kRouterMmaTokens, one MMA N) over columns
// 256 bz .. + 255 (moe_kernels.cuh says why and how the parts add up). Operand order as in
// expert_major.cu: in each 32-column step, lane quad q owns columns 8q .. 8q + 7, the first four
// for the step's first MMA and the last four for its second, in A (the weights) and B (x) alike,
// which leaves the dot products unchanged. Blocks with blockIdx.x = 0 also write expert-major's
// bf16 copy of x (the parts "hi").
__global__ void __launch_bounds__(kRouterWarps * kWarp) moe_router_mma(DevLayer L, const float* x, int n, DevWorkspace ws) {
  allow_dependent_launch();
  static_assert(kRouterMmaTokens == 8 && kRouterWarps * kWarp == 256);
  constexpr int kSteps = kRouterMmaCols / 32;
  constexpr int kParts = 3;
  __shared__ uint4 xs[kSteps][kParts][kWarp];  // B fragments, one uint4 per lane
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int g = lane / 4, q = lane % 4;
  const int64_t H = L.hidden;
  const int R = L.router_outputs;
  const int gate_row = L.shared_gate ? router_mma_gate_row(R) : INT_MAX;
  const int rows = L.shared_gate ? gate_row + kParts : R;
  const int t0 = blockIdx.y * kRouterMmaTokens;
  const int c0 = blockIdx.z * kRouterMmaCols;
  const int row0 = blockIdx.x * kRouterMmaRows + warp * 16;

  // The lane's weights, all loads issued before x is staged: rows row0 + g and row0 + g + 8,
  // columns c0 + 32 s + 8 q .. + 7; zero past the rows and past H.
  uint4 w[kSteps][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    const uint16_t* row = nullptr;
    if (r < R) {
      row = reinterpret_cast<const uint16_t*>(L.router.data) + r * H;
    } else if (r >= gate_row && r < rows) {
      row = L.shared_gate_bf16x3 + (r - gate_row) * H;
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int64_t c = c0 + 32 * s + 8 * q;
      w[s][h] = row != nullptr && c < H ? __ldg(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0, 0, 0, 0);
    }
  }

  // x of the block's tokens over the slice, each value as three bf16 parts, in B fragment order:
  // 8 columns (group cg of 32) of token tt go to step cg / 4, lane tt * 4 + cg % 4. Thread u takes
  // token u / 32, group u % 32.
  const int cg = threadIdx.x % 32, tt = threadIdx.x / 32;
  const int64_t c = c0 + 8 * cg;
  float4 v[2] = {make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
  if (t0 + tt < n && c < H) {
    v[0] = *reinterpret_cast<const float4*>(x + (t0 + tt) * H + c);
    v[1] = *reinterpret_cast<const float4*>(x + (t0 + tt) * H + c + 4);
  }
  const float e[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  uint32_t parts[kParts][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float lo = e[2 * j], hi = e[2 * j + 1];
#pragma unroll
    for (int p = 0; p < kParts; ++p) {  // what is left after each part is exact in fp32
      parts[p][j] = pack_bf16(lo, hi);
      lo -= __uint_as_float(parts[p][j] << 16);
      hi -= __uint_as_float(parts[p][j] & 0xFFFF0000u);
    }
  }
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
    xs[cg / 4][p][tt * 4 + cg % 4] = make_uint4(parts[p][0], parts[p][1], parts[p][2], parts[p][3]);
  }
  if (blockIdx.x == 0 && t0 + tt < n && c < H) {
    *reinterpret_cast<uint4*>(ws.x_bf16 + (t0 + tt) * H + c) = make_uint4(parts[0][0], parts[0][1], parts[0][2], parts[0][3]);
  }
  __syncthreads();

  // One accumulator per part, so that three chains of MMAs run side by side; their sums are added
  // small first.
  float acc[kParts][4] = {};
  if (row0 < rows) {
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const uint32_t first[4] = {w[s][0].x, w[s][1].x, w[s][0].y, w[s][1].y};
      const uint32_t second[4] = {w[s][0].z, w[s][1].z, w[s][0].w, w[s][1].w};
#pragma unroll
      for (int p = 0; p < kParts; ++p) {
        const uint4 b = xs[s][p][lane];
        mma_bf16_16816(acc[p], first, b.x, b.y);
        mma_bf16_16816(acc[p], second, b.z, b.w);
      }
    }
  }
  // This slice's sums: acc[.][j] is row row0 + g + 8 (j / 2), token t0 + 2 q + j % 2.
  const int64_t padded = static_cast<int64_t>(gridDim.x) * kRouterMmaRows;
  float* slice = ws.router_partials + static_cast<int64_t>(blockIdx.z) * n * padded;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t t = t0 + 2 * q + j % 2;
    float sum = 0.0f;
#pragma unroll
    for (int p = kParts - 1; p >= 0; --p) sum += acc[p][j];
    if (t < n) slice[t * padded + row0 + g + 8 * (j / 2)] = sum;
  }

  // The last block of this (row group, token group) to finish adds the slices up, in slice order.
  __threadfence();  // this thread's sums, visible before the block counts itself done
  __syncthreads();
  int32_t* done = ws.router_slices_done + blockIdx.y * gridDim.x + blockIdx.x;
  const bool mine = threadIdx.x == 0 && atomicAdd(done, 1) == static_cast<int>(gridDim.z) - 1;
  if (!__syncthreads_or(mine)) return;
  __threadfence();
  const int tokens = min(kRouterMmaTokens, n - t0);
  const int slices = static_cast<int>(gridDim.z);
  const int64_t slice_stride = n * padded;
  // Router rows: item i is row 128 bx + i % 128, token t0 + i / 128; 4 items per thread (8 tokens x
  // 128 rows over 256 threads), all their slices' loads in flight together.
  constexpr int kItems = kRouterMmaTokens * kRouterMmaRows / (kRouterWarps * kWarp);
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRouterMmaRows;
  int64_t at[kItems];
  float sum[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    at[k] = i / kRouterMmaRows < tokens && first_row + i % kRouterMmaRows < R
                ? (t0 + i / kRouterMmaRows) * padded + first_row + i % kRouterMmaRows
                : -1;
    sum[k] = 0.0f;
  }
#pragma unroll 4
  for (int z = 0; z < slices; ++z) {
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      if (at[k] >= 0) sum[k] += __ldcg(ws.router_partials + z * slice_stride + at[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    if (at[k] < 0) continue;
    const int64_t t = at[k] / padded;
    const int r = static_cast<int>(at[k] % padded);
    const float bias = L.router.bias != nullptr ? L.router.bias[r] : 0.0f;
    ws.logits[t * R + r] = sum[k] + bias;
  }
  // The shared gate, where its three rows are in this group: thread tt < tokens for token t0 + tt.
  if (gate_row / kRouterMmaRows == static_cast<int>(blockIdx.x) && threadIdx.x < tokens) {
    const int64_t t = t0 + threadIdx.x;
    float part[kParts] = {};
    for (int z = 0; z < slices; ++z) {
#pragma unroll
      for (int p = 0; p < kParts; ++p) part[p] += __ldcg(ws.router_partials + z * slice_stride + t * padded + gate_row + p);
    }
    ws.shared_gate[t] = sigmoidf(part[2] + part[1] + part[0]);
  }
  if (threadIdx.x == 0) *done = 0;  // ready for the next call
}

constexpr int kHotFrom = 8;    // a mixed call's hot experts have more routes than this
constexpr int kHotGroup = 16;  // routes per hot item: two token tiles

// By a whole block of kThreads: counts routes per expert, scans the counts, writes the work
// items (up to `group` routes of one expert each) and the routes grouped by expert. Order
// within an expert does not matter: each route's output column is computed on its own.
// `counts` is shared memory for 2 x (E + shared) ints; `ids`, where not null, the routed
// experts' ids in shared memory (else they are read from ws.ids).
template <int kThreads, int kBatch = 8>
__device__ void group_routes(const DevLayer& L, int n, int group, const DevWorkspace& ws, int* counts,
                             const int* ids = nullptr) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int experts = L.num_experts + (L.has_shared ? 1 : 0);
  int* cursor = counts + experts;
  // The shared expert's routes (n k + t) only where its own chain does not run it.
  const int routes = n * L.top_k + (L.has_shared && !ws.shared_apart ? n : 0);
  // A thread's routes kBatch at a time, their ids' loads issued before any is used: a loop over
  // one route at a time waits an L2 round trip per route (11 in turn at qwen3-next N = 256). With
  // the ids in shared memory (`ids`), one at a time: eight there, in a build that also compiled the
  // one-token selection into moe_route_warps, ran 0.97-0.99x at qwen3 N = 2-8, and with both undone
  // 0.99-1.01x (docs/PERF.md v3.18).
  // use(expert, route) for each of this thread's routes that runs on an expert here.
  const int routed = n * L.top_k;
  const auto each_route = [&](auto use) {
    for (int r0 = threadIdx.x; r0 < routes; r0 += kBatch * kThreads) {
      int e[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int r = r0 + u * kThreads;
        e[u] = r < routed ? routed_id(ws, r, ids) : 0;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int r = r0 + u * kThreads;
        e[u] = r < routes ? table_index_of(L, routed, r, e[u]) : -1;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (e[u] >= 0) use(e[u], r0 + u * kThreads);
      }
    }
  };
  for (int e = threadIdx.x; e < experts; e += kThreads) counts[e] = 0;
  __syncthreads();
  each_route([&](int e, int) { atomicAdd(counts + e, 1); });
  __syncthreads();

  // Thread i owns experts [i * per, (i + 1) * per). A call that mixes token tiles (ws.hot_items
  // set, group 8) puts an expert of more than 8 routes in hot items of up to 16 instead.
  const bool mixed = ws.hot_items != nullptr;
  const auto hot = [&](int e) { return mixed && counts[e] > kHotFrom; };
  const int per = (experts + kThreads - 1) / kThreads;
  const int first = threadIdx.x * per;
  int my_routes = 0, my_items = 0, my_hot = 0;
  for (int e = first; e < first + per && e < experts; ++e) {
    my_routes += counts[e];
    if (hot(e)) {
      my_hot += (counts[e] + kHotGroup - 1) / kHotGroup;
    } else {
      my_items += (counts[e] + group - 1) / group;
    }
  }
  int route_base = 0, item_base = 0, hot_base = 0;
  Scan(scan_storage).ExclusiveSum(my_routes, route_base);
  __syncthreads();
  Scan(scan_storage).ExclusiveSum(my_items, item_base);
  if (threadIdx.x == kThreads - 1) *ws.num_items = item_base + my_items;
  if (mixed) {
    __syncthreads();
    Scan(scan_storage).ExclusiveSum(my_hot, hot_base);
    if (threadIdx.x == kThreads - 1) *ws.hot_num_items = hot_base + my_hot;
  }
  for (int e = first; e < first + per && e < experts; ++e) {
    cursor[e] = route_base;
    const bool is_hot = hot(e);
    const int size = is_hot ? kHotGroup : group;
    for (int start = 0; start < counts[e]; start += size) {
      const int count = counts[e] - start < size ? counts[e] - start : size;
      const int4 item = make_int4(e, route_base + start, count, 0);
      if (is_hot) {
        ws.hot_items[hot_base++] = item;
      } else {
        if (ws.item_tiles_done != nullptr) ws.item_tiles_done[item_base] = 0;  // expert_major_item_release
        ws.items[item_base++] = item;
      }
    }
    route_base += counts[e];
  }
  __syncthreads();
  each_route([&](int e, int r) { ws.route_list[atomicAdd(cursor + e, 1)] = r; });
}

// Grid: 1 block. The grouping alone, after the block-per-token route kernel.
constexpr int kGroupThreads = 1024;
__global__ void __launch_bounds__(kGroupThreads) moe_group_routes(DevLayer L, int n, int group, DevWorkspace ws) {
  extern __shared__ int counts[];
  allow_dependent_launch();  // the gate_up (expert_major_early_gate_up)
  group_routes<kGroupThreads>(L, n, group, ws, counts);
}

// The selection of DESIGN.md section 2 for token t by a whole block of kRouteWarps warps, so that
// each step's chain is an eighth of one warp's: thread i holds experts i, i + 256,
// ... (kPerThread of them). Max and sum go through shared memory (every thread adds the warps'
// parts in warp order, so all get the same values); each warp then finds its own experts' top k,
// sorted, and warp 0 merges the 8 lists, one head per lane. Equal keys go to the lower expert
// index at both steps (the tie rule of every backend). `smem` holds 2 (E + Z) floats: the scores,
// then the keys for group-limited routing. The choices go to ws and to `ids` (shared memory).
template <int kPerThread>
__device__ void route_one_token_block(const DevLayer& L, int t, const DevWorkspace& ws, float* smem, int* ids) {
  constexpr int kThreads = kRouteWarps * kWarp;
  __shared__ float parts[kRouteWarps];
  __shared__ uint32_t kept;
  __shared__ uint32_t list_bits[kRouteWarps][kWarp];
  __shared__ uint32_t list_ids[kRouteWarps][kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, outputs = L.router_outputs;
  float* scores = smem;
  float* keys = smem + outputs;
  const bool softmax = L.score == static_cast<uint8_t>(ScoreFunc::kSoftmax);
  // Adds (or takes the maximum of) one value per thread over the block.
  const auto block_reduce = [&](float v, bool max) {
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const float other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
      v = max ? fmaxf(v, other) : v + other;
    }
    if (lane == 0) parts[warp] = v;
    __syncthreads();
    v = parts[0];
    for (int w = 1; w < kRouteWarps; ++w) v = max ? fmaxf(v, parts[w]) : v + parts[w];
    __syncthreads();  // parts is read before it is written again
    return v;
  };

  float score[kPerThread];
  float max_logit = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + kThreads * i;
    score[i] = e < outputs ? ws.logits[static_cast<int64_t>(t) * outputs + e] : -INFINITY;
    max_logit = fmaxf(max_logit, score[i]);
  }
  if (softmax) max_logit = block_reduce(max_logit, true);
  const float sum = thread_scores(L, score, max_logit);
  if (softmax) divide_scores(score, block_reduce(sum, false));
  float key[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + kThreads * i;
    key[i] = e < outputs ? score[i] + (L.correction_bias ? L.correction_bias_values[e] : 0.0f) : -INFINITY;
    if (e < outputs) scores[e] = score[i], keys[e] = key[i];
  }
  __syncthreads();
  if (L.n_group > 1) {
    if (warp == 0) {
      const uint32_t mask = kept_groups(L, keys);
      if (lane == 0) kept = mask;
    }
    __syncthreads();
    const int group_size = L.num_experts / L.n_group;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int e = threadIdx.x + kThreads * i;
      if (e < L.num_experts && !((kept >> (e / group_size)) & 1u)) key[i] = -INFINITY;
    }
  }

  // This warp's top k of its experts (fewer where it holds fewer: the rest of its list is taken
  // entries, whose order bits lie below every key's), in order.
  uint32_t bits[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    bits[i] = threadIdx.x + kThreads * i < outputs ? order_bits(key[i]) : kTakenBits;
  }
  for (int j = 0; j < L.top_k; ++j) {
    uint32_t best = bits[0];
    int slot = 0;
#pragma unroll
    for (int i = 1; i < kPerThread; ++i) {
      if (bits[i] > best) best = bits[i], slot = i;
    }
    const uint32_t top = __reduce_max_sync(0xFFFFFFFFu, best);
    const uint32_t id = static_cast<uint32_t>(threadIdx.x + kThreads * slot);
    const uint32_t lowest = __reduce_min_sync(0xFFFFFFFFu, best == top ? id : ~0u);
    if (lane == j) list_bits[warp][j] = top, list_ids[warp][j] = lowest;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (threadIdx.x + kThreads * i == lowest) bits[i] = kTakenBits;
    }
  }
  __syncthreads();
  if (warp != 0) return;

  // Warp 0 merges: lane w < kRouteWarps holds the head of warp w's list.
  int head = 0, my_id = 0;
  for (int j = 0; j < L.top_k; ++j) {
    const bool live = lane < kRouteWarps;
    const uint32_t b = live ? list_bits[lane][head] : kTakenBits;
    const uint32_t id = live ? list_ids[lane][head] : ~0u;
    const uint32_t top = __reduce_max_sync(0xFFFFFFFFu, b);
    const uint32_t lowest = __reduce_min_sync(0xFFFFFFFFu, b == top ? id : ~0u);
    if (live && b == top && id == lowest) ++head;
    // Only NaN keys (from a NaN input) can leave nothing sensible; stay in range regardless.
    if (lane == j) my_id = lowest < static_cast<uint32_t>(outputs) ? static_cast<int>(lowest) : 0;
  }
  const bool mine = lane < L.top_k;
  const float w = chosen_weight(L, mine ? scores[my_id] : 0.0f, mine);
  if (mine) {
    ws.ids[t * L.top_k + lane] = my_id;
    ws.weights[t * L.top_k + lane] = w;
    ids[lane] = my_id;
  }
}

// The number of blocks in this block's cluster (1 where the grid was launched without clusters).
__device__ __forceinline__ unsigned cluster_blocks() {
  unsigned blocks;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(blocks));
  return blocks;
}
__device__ __forceinline__ void cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// The address of `p` (this block's shared memory) in the shared memory of the cluster's block
// `rank`, as a generic pointer.
template <class T>
__device__ __forceinline__ const T* cluster_block_address(const T* p, unsigned rank) {
  uint64_t out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
  return reinterpret_cast<const T*>(out);
}

// In a grid that is one cluster, once each block holds its tokens' choices in `block_ids`
// (`per_block` of them, token by token; the first block's tokens come first): block 0 copies all
// n top_k of them into `ids` (its own shared memory), and every block waits at a second cluster
// barrier until it has, so that their shared memory outlives its reads. True in block 0.
__device__ bool gather_cluster_choices(const DevLayer& L, int n, const int* block_ids, int per_block, int* ids) {
  cluster_arrive_release();
  cluster_wait();
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < n * L.top_k; i += blockDim.x) {
      ids[i] = cluster_block_address(block_ids, i / per_block)[i % per_block];
    }
  }
  cluster_arrive_release();
  cluster_wait();
  return blockIdx.x == 0;
}

// Grid: one block of kRouteWarps warps per token (selection_block_per_token: up to 8 or 16 tokens), past
// one token as one cluster. Each block selects its token (route_one_token_block); then (group > 0)
// a call of one token is grouped by warp 0 where its routes fit one warp, any other by block 0,
// which past one token gathers every block's choices first (gather_cluster_choices). Dynamic
// shared memory: the selection's 2 (E + Z) floats; then group_routes' 2 x experts ints, followed
// past one token by every token's choices.
template <int kPerLane>
__global__ void __launch_bounds__(kRouteWarps * kWarp, 1) moe_route_token_blocks(DevLayer L, int n, int group,
                                                                                DevWorkspace ws) {
  extern __shared__ float route_smem[];
  allow_dependent_launch();  // the gate_up (expert_major_early_gate_up)
  wait_for_prior_grid();     // the router's logits (launch_route_warps)
  __shared__ int block_ids[kWarp];
  constexpr int kPerThread = (kPerLane * kWarp + kRouteWarps * kWarp - 1) / (kRouteWarps * kWarp);
  route_one_token_block<kPerThread>(L, blockIdx.x, ws, route_smem, block_ids);
  if (group == 0) return;
  if (n == 1 && L.top_k + (L.has_shared ? 1 : 0) <= kWarp) {
    if (threadIdx.x < kWarp) group_one_token(L, ws, block_ids);
    return;
  }
  int* counts = reinterpret_cast<int*>(route_smem);
  if (n == 1) {
    __syncthreads();
    group_routes<kRouteWarps * kWarp, 1>(L, 1, group, ws, counts, block_ids);
    return;
  }
  int* ids = counts + 2 * (L.num_experts + (L.has_shared ? 1 : 0));
  if (gather_cluster_choices(L, n, block_ids, L.top_k, ids)) {
    group_routes<kRouteWarps * kWarp, 1>(L, n, group, ws, counts, ids);
  }
}

// Grid: ceil(n / 8) blocks of 8 warps, one token per warp; then (group > 0) one block groups the
// routes of all tokens. One launch, no block-wide barrier inside a token's selection. A grid of
// one block (n <= 8) groups at once, from its choices in shared memory: no fence, no counter, no L2
// round trip for the ids; one token, by its own warp (group_one_token). A grid of 2-8 blocks runs
// as one cluster (route_warps_clustered): block 0 gathers the others' choices from their shared
// memory after a cluster barrier. Larger grids: the last block to finish groups, reading the
// choices from L2.
// Dynamic shared memory: per warp E + Z keys while selecting (group-limited routing only); then
// group_routes' 2 (E + shared) counts, followed in a clustered grid by every token's choices.
template <int kPerLane>
__global__ void __launch_bounds__(kRouteWarps * kWarp, 1) moe_route_warps(DevLayer L, int n, int group, DevWorkspace ws) {
  extern __shared__ float route_smem[];
  allow_dependent_launch();  // the gate_up (expert_major_early_gate_up)
  wait_for_prior_grid();     // the router's logits (launch_route_warps)
  __shared__ bool last;
  __shared__ int block_ids[kRouteWarps * kWarp];  // this block's tokens' choices (top_k <= 32)
  const int warp = threadIdx.x / kWarp;
  const int t0 = blockIdx.x * kRouteWarps, t = t0 + warp;
  const bool one_block = gridDim.x == 1;
  const bool clustered = !one_block && cluster_blocks() == gridDim.x;  // the launcher's route_warps_clustered
  if (t < n) {
    route_token_warp<kPerLane>(L, t, ws, route_smem + warp * L.router_outputs, one_block || clustered ? block_ids : nullptr,
                               true, t0);
  }
  if (group == 0) return;
  if (n == 1 && L.top_k + (L.has_shared ? 1 : 0) <= kWarp) {  // one token: its warp groups its routes
    if (warp == 0) group_one_token(L, ws, block_ids);
    return;
  }
  if (one_block) {
    __syncthreads();
    group_routes<kRouteWarps * kWarp, 1>(L, n, group, ws, reinterpret_cast<int*>(route_smem), block_ids);
    return;
  }
  if (clustered) {  // block 0 groups, from every block's choices copied past its counts
    int* counts = reinterpret_cast<int*>(route_smem);
    int* ids = counts + 2 * (L.num_experts + (L.has_shared ? 1 : 0));
    if (gather_cluster_choices(L, n, block_ids, kRouteWarps * L.top_k, ids)) {
      group_routes<kRouteWarps * kWarp, 1>(L, n, group, ws, counts, ids);
    }
    return;
  }
  // Publish this block's choices, then count finished blocks; the last one sees them all.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ws.route_blocks_done, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  group_routes<kRouteWarps * kWarp>(L, n, group, ws, reinterpret_cast<int*>(route_smem));
  if (threadIdx.x == 0) *ws.route_blocks_done = 0;  // ready for the next call
}

// Grid: one block per token. Block: 256 threads running the selection of DESIGN.md section 2
// on the token's logits in shared memory: scores, keys, group masking, k rounds of argmax,
// weights.
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(DevLayer L, DevWorkspace ws) {
  extern __shared__ float smem[];
  const int outputs = L.router_outputs;
  float* logits = smem;               // [E + Z]
  float* scores = smem + outputs;     // [E + Z]
  float* keys = smem + 2 * outputs;   // [E + Z]
  __shared__ float group_score[kCudaMaxGroups];
  __shared__ int group_kept[kCudaMaxGroups];
  __shared__ int chosen[kCudaMaxTopK];

  const int t = blockIdx.x;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;

  for (int e = threadIdx.x; e < outputs; e += blockDim.x) logits[e] = ws.logits[static_cast<int64_t>(t) * outputs + e];
  __syncthreads();

  // Scores, in fp32 as the reference blocks compute them.
  float max_logit = -INFINITY;
  if (L.score == static_cast<uint8_t>(ScoreFunc::kSoftmax)) {
    ArgMax m{-INFINITY, INT_MAX};
    for (int e = threadIdx.x; e < outputs; e += blockDim.x) m = better(m, ArgMax{logits[e], e});
    max_logit = block_argmax(m).value;
  }
  float local_sum = 0.0f;
  for (int e = threadIdx.x; e < outputs; e += blockDim.x) {
    const float s = expert_score(L, logits[e], max_logit);
    scores[e] = s;
    local_sum += s;
  }
  if (L.score == static_cast<uint8_t>(ScoreFunc::kSoftmax)) {
    const float sum = block_sum(local_sum), inverse = __frcp_rn(sum);
    for (int e = threadIdx.x; e < outputs; e += blockDim.x) scores[e] = softmax_quotient(scores[e], sum, inverse);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < outputs; e += blockDim.x) {
    keys[e] = scores[e] + (L.correction_bias ? L.correction_bias_values[e] : 0.0f);
  }
  __syncthreads();

  // Group-limited selection: a group scores the sum of its two best keys; experts outside the
  // topk_group best groups get key -inf.
  if (L.n_group > 1) {
    const int group_size = L.num_experts / L.n_group;
    for (int g = warp; g < L.n_group; g += warps) {
      ArgMax first{-INFINITY, INT_MAX};
      for (int i = lane; i < group_size; i += kWarp) first = better(first, ArgMax{keys[g * group_size + i], i});
      first = warp_argmax(first);
      ArgMax second{-INFINITY, INT_MAX};
      for (int i = lane; i < group_size; i += kWarp) {
        if (i != first.index) second = better(second, ArgMax{keys[g * group_size + i], i});
      }
      second = warp_argmax(second);
      if (lane == 0) {
        group_score[g] = first.value + second.value;
        group_kept[g] = 0;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int j = 0; j < L.topk_group; ++j) {
        int best = -1;
        for (int g = 0; g < L.n_group; ++g) {
          if (!group_kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
        }
        group_kept[best] = 1;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < L.num_experts; e += blockDim.x) {
      if (!group_kept[e / group_size]) keys[e] = -INFINITY;
    }
    __syncthreads();
  }

  // Top-k: k rounds of a block argmax; a chosen key becomes -inf.
  for (int j = 0; j < L.top_k; ++j) {
    ArgMax best{-INFINITY, INT_MAX};
    for (int e = threadIdx.x; e < outputs; e += blockDim.x) best = better(best, ArgMax{keys[e], e});
    best = block_argmax(best);
    if (threadIdx.x == 0) {
      // Only NaN keys (from a NaN input) leave no candidate; stay in range regardless.
      const int id = (best.index >= 0 && best.index < outputs) ? best.index : 0;
      chosen[j] = id;
      keys[id] = -INFINITY;
    }
    __syncthreads();
  }

  if (threadIdx.x == 0) {
    float w[kCudaMaxTopK];
    for (int j = 0; j < L.top_k; ++j) w[j] = scores[chosen[j]];  // unbiased
    if (L.weight == static_cast<uint8_t>(WeightFunc::kSoftmaxOfSelected)) {
      float m = -INFINITY, sum = 0.0f;
      for (int j = 0; j < L.top_k; ++j) m = fmaxf(m, w[j]);
      for (int j = 0; j < L.top_k; ++j) sum += (w[j] = expf(w[j] - m));
      for (int j = 0; j < L.top_k; ++j) w[j] /= sum;
    } else if (L.weight == static_cast<uint8_t>(WeightFunc::kSigmoidOfSelected)) {
      for (int j = 0; j < L.top_k; ++j) w[j] = 1.0f / (1.0f + expf(-w[j]));
    }
    if (L.renormalize) {
      float sum = 0.0f;
      for (int j = 0; j < L.top_k; ++j) sum += w[j];
      for (int j = 0; j < L.top_k; ++j) w[j] /= sum + L.renorm_epsilon;
    }
    for (int j = 0; j < L.top_k; ++j) {
      ws.ids[t * L.top_k + j] = chosen[j];
      ws.weights[t * L.top_k + j] = w[j] * L.scaling;
    }
  }
}

// ---- token-major -------------------------------------------------------------------------------

constexpr int kTmWarps = 4;         // warps per block
constexpr int kTmRowsPerWarp = 1;   // output rows each warp owns: many small blocks fill every SM
constexpr int kTmRowsPerBlock = kTmWarps * kTmRowsPerWarp;

// Grid: (ceil(max I / 4), routes). Block: 4 warps; warp w owns row 4 bx + w of the route's
// expert and computes both gate and up for it (the token's x stays in L1 across rows).
// The occupancy hint (4 blocks per SM) matters: without it ptxas held this kernel to 32
// registers and spilled.
__global__ void __launch_bounds__(kTmWarps * kWarp, 4) moe_gate_up_token_major(DevLayer L, const float* x, int n,
                                                                            DevWorkspace ws) {
  int t, e;
  float in_scale;
  const int route = blockIdx.y;
  if (!route_expert(L, ws, n, route, &t, &e, &in_scale)) return;
  const DevExpert& ex = L.experts[e];
  const float* xt = x + static_cast<int64_t>(t) * L.hidden;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int first = blockIdx.x * kTmRowsPerBlock + warp * kTmRowsPerWarp;
  for (int i = first; i < first + kTmRowsPerWarp && i < ex.gate.rows; ++i) {
    float g = warp_dot(ex.gate, i, xt, in_scale);
    float u = warp_dot(ex.up, i, xt, in_scale);
    if (lane == 0) {
      if (ex.gate.bias != nullptr) g += ex.gate.bias[i];
      if (ex.up.bias != nullptr) u += ex.up.bias[i];
      ws.act[static_cast<int64_t>(route) * L.act_stride + i] = activate(L, g, u);
    }
  }
}

// Grid: (ceil(H / 4), routes). Block: 4 warps, one output row of down each.
__global__ void __launch_bounds__(kTmWarps * kWarp, 4) moe_down_token_major(DevLayer L, int n, DevWorkspace ws) {
  int t, e;
  float in_scale;
  const int route = blockIdx.y;
  if (!route_expert(L, ws, n, route, &t, &e, &in_scale)) return;
  const DevExpert& ex = L.experts[e];
  const float* a = ws.act + static_cast<int64_t>(route) * L.act_stride;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int first = blockIdx.x * kTmRowsPerBlock + warp * kTmRowsPerWarp;
  for (int h = first; h < first + kTmRowsPerWarp && h < L.hidden; ++h) {
    const float y = warp_dot(ex.down, h, a, 1.0f);
    if (lane == 0) {
      ws.expert_out[static_cast<int64_t>(route) * L.hidden + h] = y + (ex.down.bias != nullptr ? ex.down.bias[h] : 0.0f);
    }
  }
}

// Grid: (ceil(H / (kWidth blockDim.x)), n). Block: kWidth consecutive output elements per thread:
// out = sum_j w_j * y_j (y_j = x for zero experts; w_j = 1 when it scaled the input) + gate * shared,
// over the experts this rank runs (all of them without expert parallelism), summed in route
// order either way. kLoadsFirst: every load is issued before any sum needs one (each y_j is read
// whatever expert j is: expert_out has a row per route, and unused rows hold stale values that are
// never added), so a thread waits about one L2 round trip instead of two per route, at 78
// registers against 32. Else the loop reads each route's id, then its y_j, at full occupancy.
// kWidth 4 (loads first only): 16-byte loads and stores, so a quarter of the threads keep all of
// their loads in flight where one element per thread would take more than a wave (N >= 50 at
// H = 2048 on the H200). launch_moe_blend picks (blend_loads_first, blend_aligned). Every variant
// adds the same terms in the same order: their outputs are equal bit for bit.
constexpr int kBlendRoutes = 16;  // routes whose loads are in flight at once

template <int kWidth>
struct BlendFloats {
  float v[kWidth];
};

template <int kWidth>
__device__ __forceinline__ BlendFloats<kWidth> load_blend(const float* p) {
  BlendFloats<kWidth> f;
  if constexpr (kWidth == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    f.v[0] = q.x, f.v[1] = q.y, f.v[2] = q.z, f.v[3] = q.w;
  } else {
    f.v[0] = *p;
  }
  return f;
}

template <bool kLoadsFirst, int kWidth = 1>
__global__ void moe_blend(DevLayer L, const float* x, int n, DevWorkspace ws, float* out) {
  static_assert(kWidth == 1 || (kWidth == 4 && kLoadsFirst));
  const int t = blockIdx.y;
  const int h = kWidth * (blockIdx.x * blockDim.x + threadIdx.x);
  if (h >= L.hidden) return;
  const int64_t H = L.hidden;
  BlendFloats<kWidth> acc = {};
  if constexpr (kLoadsFirst) {
    const BlendFloats<kWidth> xv = load_blend<kWidth>(x + t * H + h);
    BlendFloats<kWidth> shared = {};
    float gate = 1.0f;
    if (L.has_shared) {
      shared = load_blend<kWidth>(ws.expert_out + (static_cast<int64_t>(n) * L.top_k + t) * H + h);
      if (L.shared_gate) gate = ws.shared_gate[t];
    }
    for (int j0 = 0; j0 < L.top_k; j0 += kBlendRoutes) {
      int id[kBlendRoutes];
      float w[kBlendRoutes];
      BlendFloats<kWidth> y[kBlendRoutes];
#pragma unroll
      for (int u = 0; u < kBlendRoutes; ++u) {
        const int route = t * L.top_k + j0 + u;
        if (j0 + u < L.top_k) {
          id[u] = ws.ids[route], w[u] = ws.weights[route];
          y[u] = load_blend<kWidth>(ws.expert_out + route * H + h);
        }
      }
#pragma unroll
      for (int u = 0; u < kBlendRoutes; ++u) {
        if (j0 + u >= L.top_k) break;
#pragma unroll
        for (int c = 0; c < kWidth; ++c) {
          if (id[u] >= L.num_experts) {
            if (L.adds_once) acc.v[c] += w[u] * xv.v[c];
          } else if (owns_expert(L, id[u])) {
            acc.v[c] += (L.weight_on_input ? 1.0f : w[u]) * y[u].v[c];
          }
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kWidth; ++c) {
      if (L.has_shared) acc.v[c] += gate * shared.v[c];
    }
  } else {
    float& a = acc.v[0];
    for (int j = 0; j < L.top_k; ++j) {
      const int route = t * L.top_k + j;
      const int id = ws.ids[route];
      const float w = ws.weights[route];
      if (id >= L.num_experts) {
        if (L.adds_once) a += w * x[t * H + h];
      } else if (owns_expert(L, id)) {
        a += (L.weight_on_input ? 1.0f : w) * ws.expert_out[route * H + h];
      }
    }
    if (L.has_shared) {
      const float gate = L.shared_gate ? ws.shared_gate[t] : 1.0f;
      a += gate * ws.expert_out[(static_cast<int64_t>(n) * L.top_k + t) * H + h];
    }
  }
  if constexpr (kWidth == 4) {
    *reinterpret_cast<float4*>(out + t * H + h) = make_float4(acc.v[0], acc.v[1], acc.v[2], acc.v[3]);
  } else {
    out[t * H + h] = acc.v[0];
  }
}

// ---- per-row fallback --------------------------------------------------------------------------

constexpr int kPerRowThreads = 128;

// Grid: one block per route. Block: 128 threads, one intermediate row at a time each, scalar
// loads: no alignment or shape assumption at all.
__global__ void moe_gate_up_per_row(DevLayer L, const float* x, int n, DevWorkspace ws) {
  int t, e;
  float in_scale;
  const int route = blockIdx.x;
  if (!route_expert(L, ws, n, route, &t, &e, &in_scale)) return;
  const DevExpert& ex = L.experts[e];
  const float* xt = x + static_cast<int64_t>(t) * L.hidden;
  for (int i = threadIdx.x; i < ex.gate.rows; i += blockDim.x) {
    float g = 0.0f, u = 0.0f;
    for (int c = 0; c < L.hidden; ++c) {
      g += load_weight(ex.gate, i, c) * xt[c];
      u += load_weight(ex.up, i, c) * xt[c];
    }
    g = g * in_scale + (ex.gate.bias != nullptr ? ex.gate.bias[i] : 0.0f);
    u = u * in_scale + (ex.up.bias != nullptr ? ex.up.bias[i] : 0.0f);
    ws.act[static_cast<int64_t>(route) * L.act_stride + i] = activate(L, g, u);
  }
}

// Grid: one block per route. Block: 128 threads, one hidden row of down at a time each.
__global__ void moe_down_per_row(DevLayer L, int n, DevWorkspace ws) {
  int t, e;
  float in_scale;
  const int route = blockIdx.x;
  if (!route_expert(L, ws, n, route, &t, &e, &in_scale)) return;
  const DevExpert& ex = L.experts[e];
  const float* a = ws.act + static_cast<int64_t>(route) * L.act_stride;
  for (int h = threadIdx.x; h < L.hidden; h += blockDim.x) {
    float y = 0.0f;
    for (int i = 0; i < ex.down.cols; ++i) y += load_weight(ex.down, h, i) * a[i];
    ws.expert_out[static_cast<int64_t>(route) * L.hidden + h] = y + (ex.down.bias != nullptr ? ex.down.bias[h] : 0.0f);
  }
}

int route_count(const DevLayer& L, int n) { return n * L.top_k + (L.has_shared ? n : 0); }

}  // namespace

cudaError_t blend_resident_per_sm(int* blocks) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, moe_blend<true>, 256, 0);
}

namespace {

// moe_route_token_blocks' dynamic shared memory for n tokens (see the kernel).
size_t route_token_blocks_smem(const DevLayer& L, int n) {
  const size_t experts = static_cast<size_t>(L.num_experts) + (L.has_shared ? 1 : 0);
  return std::max(2 * static_cast<size_t>(L.router_outputs) * sizeof(float),
                  (2 * experts + (n > 1 ? static_cast<size_t>(n) * L.top_k : 0)) * sizeof(int));
}

template <int kPerLane>
cudaError_t route_token_blocks_max(const DevLayer& L, int* tokens) {
  const auto kernel = moe_route_token_blocks<kPerLane>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (err == cudaErrorNotSupported || err == cudaErrorInvalidValue) {  // no clusters past 8 here
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = kRouteTokenBlocksMax;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(kRouteTokenBlocksMax);
  config.blockDim = dim3(kRouteWarps * kWarp);
  config.dynamicSmemBytes = route_token_blocks_smem(L, kRouteTokenBlocksMax);
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
  if (err != cudaSuccess) {  // this size is not allowed here: stay at the portable one
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  if (clusters > 0) *tokens = kRouteTokenBlocksMax;
  return cudaSuccess;
}

}  // namespace

cudaError_t route_token_blocks_max(const DevLayer& L, int* tokens) {
  *tokens = kRouteClusterMaxBlocks;
  if (!selection_by_warps(L) || L.router_outputs <= kBlockSelectFromPerLane / 2 * kWarp) return cudaSuccess;
  return L.router_outputs <= 8 * kWarp ? route_token_blocks_max<8>(L, tokens) : route_token_blocks_max<16>(L, tokens);
}

cudaError_t launch_moe_blend(const DevLayer& L, const float* x, int n, const DevWorkspace& ws, float* out,
                             cudaStream_t stream) {
  const dim3 grid((L.hidden + 255) / 256, n);
  if (blend_loads_first(static_cast<int64_t>(grid.x) * grid.y, L.blend_resident, L.sm_count)) {
    moe_blend<true><<<grid, 256, 0, stream>>>(L, x, n, ws, out);
  } else if (blend_aligned(L.hidden, x, out)) {
    constexpr int kThreads = 128;
    const dim3 wide((L.hidden + 4 * kThreads - 1) / (4 * kThreads), n);
    moe_blend<true, 4><<<wide, kThreads, 0, stream>>>(L, x, n, ws, out);
  } else {
    moe_blend<false><<<grid, 256, 0, stream>>>(L, x, n, ws, out);
  }
  return cudaGetLastError();
}

namespace {

// Shared memory above the default 48 KB needs the kernel's consent first.
template <class Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// The route kernels of a block per token (selection_block_per_token) or a warp per token, launched
// while the router runs (a programmatic dependent launch: their blocks wait for its end and its
// logits before they read them); a grid of 2-8 blocks as one cluster.
template <int kPerLane>
cudaError_t launch_route_warps(const DevLayer& L, int n, int group, const DevWorkspace& ws,
                               cudaStream_t stream) {
  const size_t experts = static_cast<size_t>(L.num_experts) + (L.has_shared ? 1 : 0);
  const size_t keys = L.n_group > 1 ? kRouteWarps * static_cast<size_t>(L.router_outputs) * sizeof(float) : 0;
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kRouteWarps * kWarp);
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = 1;
  const auto as_cluster = [&] {
    attributes[1].id = cudaLaunchAttributeClusterDimension;
    attributes[1].val.clusterDim.x = config.gridDim.x;
    attributes[1].val.clusterDim.y = 1;
    attributes[1].val.clusterDim.z = 1;
    config.numAttrs = 2;
  };
  if constexpr (kPerLane >= kBlockSelectFromPerLane) {
    if (selection_block_per_token(L, n)) {
      config.gridDim = dim3(n);
      config.dynamicSmemBytes = route_token_blocks_smem(L, n);
      const cudaError_t err = allow_smem(moe_route_token_blocks<kPerLane>, config.dynamicSmemBytes);
      if (err != cudaSuccess) return err;
      if (n > 1) as_cluster();
      return cudaLaunchKernelEx(&config, moe_route_token_blocks<kPerLane>, L, n, group, ws);
    }
  }
  const bool clustered = route_warps_clustered(n);
  const size_t counts = (2 * experts + (clustered ? static_cast<size_t>(n) * L.top_k : 0)) * sizeof(int);
  config.gridDim = dim3(route_warps_blocks(n));
  config.dynamicSmemBytes = std::max(keys, counts);
  const cudaError_t err = allow_smem(moe_route_warps<kPerLane>, config.dynamicSmemBytes);
  if (err != cudaSuccess) return err;
  if (clustered) as_cluster();
  return cudaLaunchKernelEx(&config, moe_route_warps<kPerLane>, L, n, group, ws);
}

}  // namespace

cudaError_t launch_moe_route(const DevLayer& L, const float* x, int n, const DevWorkspace& ws, int group,
                             cudaStream_t stream, bool select) {
  const RouterLaunch r = router_launch(L, n);
  const dim3 grid(r.grid[0], r.grid[1], r.grid[2]);
  switch (r.kernel) {
    case RouterKernel::kMma:
      moe_router_mma<<<grid, kRouterWarps * kWarp, 0, stream>>>(L, x, n, ws);
      break;
    case RouterKernel::kFmaWide: moe_router_logits_wide<<<grid, kRouterWarps * kWarp, 0, stream>>>(L, x, n, ws); break;
    case RouterKernel::kFma:
      if (r.tokens == 1) {
        moe_router_logits<1><<<grid, kRouterWarps * kWarp, 0, stream>>>(L, x, n, ws);
      } else {
        moe_router_logits<kRouterTokens><<<grid, kRouterWarps * kWarp, 0, stream>>>(L, x, n, ws);
      }
      break;
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || !select) return err;
  if (selection_by_warps(L)) {
    if (L.router_outputs <= 4 * kWarp) return launch_route_warps<4>(L, n, group, ws, stream);
    if (L.router_outputs <= 8 * kWarp) return launch_route_warps<8>(L, n, group, ws, stream);
    return launch_route_warps<16>(L, n, group, ws, stream);
  }
  const size_t smem = 3 * static_cast<size_t>(L.router_outputs) * sizeof(float);
  err = allow_smem(moe_route_kernel, smem);
  if (err != cudaSuccess) return err;
  moe_route_kernel<<<n, kRouteThreads, smem, stream>>>(L, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess || group == 0) return err;
  const size_t group_smem = 2 * (static_cast<size_t>(L.num_experts) + (L.has_shared ? 1 : 0)) * sizeof(int);
  moe_group_routes<<<1, kGroupThreads, group_smem, stream>>>(L, n, group, ws);
  return cudaGetLastError();
}

cudaError_t launch_moe_token_major(const DevLayer& L, const float* x, int n, const DevWorkspace& ws, float* out,
                                   cudaStream_t stream) {
  const int routes = route_count(L, n);
  const dim3 gate_up_grid((L.act_stride + kTmRowsPerBlock - 1) / kTmRowsPerBlock, routes);
  moe_gate_up_token_major<<<gate_up_grid, kTmWarps * kWarp, 0, stream>>>(L, x, n, ws);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 down_grid((L.hidden + kTmRowsPerBlock - 1) / kTmRowsPerBlock, routes);
  moe_down_token_major<<<down_grid, kTmWarps * kWarp, 0, stream>>>(L, n, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_moe_blend(L, x, n, ws, out, stream);
}

cudaError_t launch_moe_per_row(const DevLayer& L, const float* x, int n, const DevWorkspace& ws, float* out,
                               cudaStream_t stream) {
  const int routes = route_count(L, n);
  moe_gate_up_per_row<<<routes, kPerRowThreads, 0, stream>>>(L, x, n, ws);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  moe_down_per_row<<<routes, kPerRowThreads, 0, stream>>>(L, n, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_moe_blend(L, x, n, ws, out, stream);
}

namespace {

__global__ void __launch_bounds__(256) nvfp4_pair_order_kernel(uint32_t* words, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    words[i] = to_pair_order(words[i]);
  }
}

}  // namespace

cudaError_t launch_nvfp4_pair_order(uint8_t* codes, int64_t bytes, cudaStream_t stream) {
  if (bytes % 4 != 0 || reinterpret_cast<uintptr_t>(codes) % 4 != 0) return cudaErrorInvalidValue;
  const int64_t words = bytes / 4;
  if (words == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((words + 255) / 256, 4096);
  nvfp4_pair_order_kernel<<<static_cast<int>(blocks), 256, 0, stream>>>(reinterpret_cast<uint32_t*>(codes), words);
  return cudaGetLastError();
}

namespace {

// Grid: strides over the matrix's 16-byte units, one per thread at a time. Reads row-major `src`,
// writes each unit to its place in the tiles (weight_tiles.h) of `dst`.
__global__ void __launch_bounds__(256) weight_tiles_kernel(const uint4* src, uint8_t* dst, int64_t units, int64_t row_bytes) {
  const int64_t per_row = row_bytes / 16;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    *reinterpret_cast<uint4*>(dst + tiled_offset(u / per_row, u % per_row * 16, row_bytes)) = src[u];
  }
}

}  // namespace

cudaError_t launch_weight_tiles(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes, cudaStream_t stream) {
  if (!tiles_fit(rows, row_bytes) || reinterpret_cast<uintptr_t>(src) % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t units = rows * row_bytes / 16;
  const int64_t blocks = std::min<int64_t>((units + 255) / 256, 4096);
  weight_tiles_kernel<<<static_cast<int>(blocks), 256, 0, stream>>>(reinterpret_cast<const uint4*>(src), dst, units, row_bytes);
  return cudaGetLastError();
}

namespace {

// Grid: `blocks` blocks of 256 threads striding over the buffer; 16-byte loads, fully coalesced.
__global__ void __launch_bounds__(256) stream_read_kernel(const float4* data, int64_t count, float* sink) {
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = __ldcs(data + i);  // streaming: each byte is read once
    acc += v.x + v.y + v.z + v.w;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) sink[blockIdx.x] = acc;
}

}  // namespace

cudaError_t launch_stream_read(const float4* data, int64_t count, float* sink, int blocks, cudaStream_t stream) {
  stream_read_kernel<<<blocks, 256, 0, stream>>>(data, count, sink);
  return cudaGetLastError();
}

bool kernels_runnable() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, moe_route_kernel) == cudaSuccess;
}

}  // namespace moeinfer::cuda
