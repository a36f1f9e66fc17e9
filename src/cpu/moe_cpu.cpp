// The fast CPU backend: float arithmetic, SIMD dot products, threads over output rows, and
// expert-major order: each distinct expert's weights are decoded once per call and applied to
// every token that chose it, so a batch reads each expert once (the decode regime's floor).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <numeric>
#include <vector>

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics trip -W(maybe-)uninitialized on their own placeholder operands once
// inlined (GCC bug 105593, fixed in GCC 13); the warnings are off for the header's code alone.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "core/parallel.h"
#include "cpu/moe_cpu.h"
#include "moeinfer/ep.h"
#include "moeinfer/reference.h"

namespace moeinfer {

namespace {

// a . b over n floats. Built twice, for AVX2+FMA and for the x86-64 baseline, and chosen at
// load time, so one binary runs everywhere and uses wide vectors where they exist.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2,fma", "default")))
#endif
float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

float sigmoidf(float v) { return 1.0f / (1.0f + std::exp(-v)); }

#if defined(__x86_64__)
// The SIMD paths below need AVX2, FMA and F16C, which the dispatchers check at run time.
#define MOEINFER_AVX2 __attribute__((target("avx2,fma,f16c")))

bool has_avx2_fma_f16c() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
}

struct Floats16 {
  __m256 first, second;  // values 0-7, 8-15
};

// NVFP4 with AVX2, 16 values (8 bytes, one block scale) per step: the nibbles are split and
// interleaved (element 2i is the low nibble of byte i), one byte shuffle looks up the upper byte
// of 2 * E2M1 as an fp16 (whose lower byte is 0 for all 16 codes), and F16C converts 8 of them
// per instruction (one fewer instruction per 16 values than sign-extending integers and
// converting those: 1.07x at one token, tools/probe_cpu_row_dots). The values are then times half
// the block scale (exact: at most 6 significant bits) times the global scale, the one rounding,
// as in QuantMatrix::dequantize_row.
// The 16 codes at `bytes` as 2 * E2M1 in float vectors.
MOEINFER_AVX2 inline Floats16 nvfp4_twice_avx2(const uint8_t* bytes) {
  // The upper byte of 2 * E2M1 as fp16, by code: 0, 1, 2, 3, 4, 6, 8, 12, then the same negated.
  const __m128i twice_fp16_high = _mm_setr_epi8(0x00, 0x3C, 0x40, 0x42, 0x44, 0x46, 0x48, 0x4A, char(0x80), char(0xBC),
                                                char(0xC0), char(0xC2), char(0xC4), char(0xC6), char(0xC8), char(0xCA));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i low = _mm_and_si128(packed, nibble);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
  const __m128i upper = _mm_shuffle_epi8(twice_fp16_high, _mm_unpacklo_epi8(low, high));
  const __m128i zero = _mm_setzero_si128();
  return {_mm256_cvtph_ps(_mm_unpacklo_epi8(zero, upper)), _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, upper))};
}

// Half of every E4M3 value (exact), by code: an NVFP4 block scale for 2 * E2M1 integers.
const float* e4m3_halves() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = e4m3_to_float(static_cast<uint8_t>(c)) * 0.5f;
    return t;
  }();
  return table.data();
}

// Group g of row r decoded: the integers times half the block scale (exact) times the global
// scale, the one rounding.
MOEINFER_AVX2 inline Floats16 nvfp4_group_avx2(const QuantMatrix& m, int64_t r, int64_t g) {
  const int64_t groups = m.cols / kNvfp4Group;
  const __m256 global = _mm256_set1_ps(m.global_scale);
  const __m256 half_block = _mm256_set1_ps(e4m3_halves()[m.block_scales[static_cast<size_t>(r * groups + g)]]);
  const Floats16 twice = nvfp4_twice_avx2(m.data.data() + (r * m.cols + g * kNvfp4Group) / 2);
  return {_mm256_mul_ps(_mm256_mul_ps(twice.first, half_block), global),
          _mm256_mul_ps(_mm256_mul_ps(twice.second, half_block), global)};
}

MOEINFER_AVX2 void decode_nvfp4_row_avx2(const QuantMatrix& m, int64_t r, float* out) {
  for (int64_t g = 0; g < m.cols / kNvfp4Group; ++g) {
    const Floats16 v = nvfp4_group_avx2(m, r, g);
    _mm256_storeu_ps(out + g * kNvfp4Group, v.first);
    _mm256_storeu_ps(out + g * kNvfp4Group + 8, v.second);
  }
}

// FP8 E4M3 with AVX2 and F16C, 16 values per step: a code's magnitude bits moved into an fp16's
// exponent and mantissa and its sign to bit 15 make the code's value times 2^-8 exactly (E4M3's
// subnormals land on fp16's); the NaN codes become an fp16 NaN; one conversion per 8 values
// gives the floats. In 16-bit lanes, b + (b & 0x80) carries the sign from bit 7 to bit 8 and
// leaves the magnitude in bits 0-6, so one shift by 7 places both (3 operations, not 5); the NaN
// codes (0x7F, 0xFF) are those with b | 0x80 == 0xFF, blended to an fp16 NaN in one operation.
MOEINFER_AVX2 inline Floats16 fp8_16_avx2(const uint8_t* codes) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i sign_bit = _mm256_set1_epi16(0x80);
  const __m256i placed = _mm256_slli_epi16(_mm256_add_epi16(b, _mm256_and_si256(b, sign_bit)), 7);
  const __m256i is_nan = _mm256_cmpeq_epi16(_mm256_or_si256(b, sign_bit), _mm256_set1_epi16(0xFF));
  const __m256i half = _mm256_blendv_epi8(placed, _mm256_set1_epi16(0x7E00), is_nan);
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(half)), _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1))};
}

MOEINFER_AVX2 void decode_fp8_row_avx2(const QuantMatrix& m, int64_t r, float* out) {
  const uint8_t* codes = m.data.data() + r * m.cols;
  for (int64_t c0 = 0, c1 = 0; c0 < m.cols; c0 = c1) {
    const float scale = m.fp8_span_scale(r, c0, &c1);
    // (value x 2^-8) x 2^8 is exact; the scale is the one rounding, as in dequantize_row.
    const __m256 up = _mm256_set1_ps(0x1p8f), scale8 = _mm256_set1_ps(scale);
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
      const Floats16 v = fp8_16_avx2(codes + c);
      _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(v.first, up), scale8));
      _mm256_storeu_ps(out + c + 8, _mm256_mul_ps(_mm256_mul_ps(v.second, up), scale8));
    }
    for (; c < c1; ++c) out[c] = e4m3_to_float(codes[c]) * scale;
  }
}

// BF16, 8 values: the bits moved to a float's upper half (exact).
MOEINFER_AVX2 inline __m256 bf16_octet_avx2(const uint8_t* bytes) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

MOEINFER_AVX2 inline float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// acc[j] += w * (x + j * stride)[0..8) for j < M.
template <int M>
MOEINFER_AVX2 inline void fma_tokens(__m256 (&acc)[M], __m256 w, const float* x, int64_t stride) {
  for (int j = 0; j < M; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + j * stride), acc[j]);
}

// The row_dots_*_avx2<M> below: out[j] = row r of m . (x + j * stride), j < M <= kCpuTokenTile,
// every weight decoded once, in registers, and used by all M tokens (no row buffer). Each format
// has a function of its own, with its accumulators local to it: in one function with a switch
// over the formats, GCC kept them on the stack, which put a store and a reload on every
// accumulator's chain of FMAs (BF16 at one token ran at half the speed of four).

// acc + group g of a row's NVFP4 codes (2 * E2M1) . the token x there, times half the block scale.
MOEINFER_AVX2 inline __m256 nvfp4_one_token_avx2(const uint8_t* codes, float half_block, const float* x, int64_t g,
                                                 __m256 acc) {
  const Floats16 twice = nvfp4_twice_avx2(codes + g * kNvfp4Group / 2);
  const __m256 low = _mm256_mul_ps(twice.first, _mm256_loadu_ps(x + g * kNvfp4Group));
  const __m256 part = _mm256_fmadd_ps(twice.second, _mm256_loadu_ps(x + g * kNvfp4Group + 8), low);
  return _mm256_fmadd_ps(part, _mm256_set1_ps(half_block), acc);
}

// NVFP4. The global scale is applied once at the end. 2 * E2M1 times half the block scale is
// exact (at most 6 significant bits), so every product is a weight of the reference row (before
// the global scale) times a token value.
template <int M>
MOEINFER_AVX2 void row_dots_nvfp4_avx2(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, float* out) {
  const int64_t groups = m.cols / kNvfp4Group;
  const float* halves = e4m3_halves();
  const uint8_t* block = m.block_scales.data() + r * groups;
  const uint8_t* codes = m.data.data() + r * m.cols / 2;
  if constexpr (M == 1) {
    // One token: the 2 * E2M1 values times the token, and that sum times the scale (3 operations
    // per 16 weights). Even and odd groups go to two accumulators, so that neither chain of FMAs
    // sets the pace.
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      even = nvfp4_one_token_avx2(codes, halves[block[g]], x, g, even);
      odd = nvfp4_one_token_avx2(codes, halves[block[g + 1]], x, g + 1, odd);
    }
    if (g < groups) even = nvfp4_one_token_avx2(codes, halves[block[g]], x, g, even);
    out[0] = sum8(_mm256_mul_ps(_mm256_add_ps(even, odd), _mm256_set1_ps(m.global_scale)));
  } else {
    // Several tokens: the 16 weights scaled once (2 multiplies), then 2 FMAs per token. Up to
    // 4 tokens the second half of each group goes to a second accumulator, so that each
    // accumulator waits on one FMA per group, not two.
    constexpr int kSplit = M <= 4 ? 2 : 1;
    __m256 acc[kSplit][M];
    for (int i = 0; i < kSplit; ++i) {
      for (int j = 0; j < M; ++j) acc[i][j] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; ++g) {
      const Floats16 twice = nvfp4_twice_avx2(codes + g * kNvfp4Group / 2);
      const __m256 scale = _mm256_set1_ps(halves[block[g]]);
      const __m256 w0 = _mm256_mul_ps(twice.first, scale), w1 = _mm256_mul_ps(twice.second, scale);
      for (int j = 0; j < M; ++j) {
        const float* xj = x + j * stride + g * kNvfp4Group;
        acc[0][j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xj), acc[0][j]);
        acc[kSplit - 1][j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xj + 8), acc[kSplit - 1][j]);
      }
    }
    for (int j = 0; j < M; ++j) {
      const __m256 sum = kSplit == 2 ? _mm256_add_ps(acc[0][j], acc[kSplit - 1][j]) : acc[0][j];
      out[j] = sum8(_mm256_mul_ps(sum, _mm256_set1_ps(m.global_scale)));
    }
  }
}

// tail[j] + the FP8 codes [c, c1) of a span, one at a time, . token j there (a span's last
// columns past the vector steps).
template <int M>
inline void fp8_tail_dots(const uint8_t* codes, float scale, const float* x, int64_t stride, int64_t c, int64_t c1,
                          float (&tail)[M]) {
  for (; c < c1; ++c) {
    const float w = e4m3_to_float(codes[c]) * scale;
    for (int j = 0; j < M; ++j) tail[j] += w * x[j * stride + c];
  }
}

// FP8: each span's values x 2^-8 times the tokens, then that sum times 2^8 and the span's scale.
template <int M>
MOEINFER_AVX2 void row_dots_fp8_avx2(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, float* out) {
  const uint8_t* codes = m.data.data() + r * m.cols;
  __m256 acc[M];
  float tail[M];
  for (int j = 0; j < M; ++j) acc[j] = _mm256_setzero_ps(), tail[j] = 0.0f;
  for (int64_t c0 = 0, c1 = 0; c0 < m.cols; c0 = c1) {
    const float scale = m.fp8_span_scale(r, c0, &c1);
    __m256 span[M];
    for (int j = 0; j < M; ++j) span[j] = _mm256_setzero_ps();
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
      const Floats16 v = fp8_16_avx2(codes + c);
      fma_tokens<M>(span, v.first, x + c, stride);
      fma_tokens<M>(span, v.second, x + c + 8, stride);
    }
    const __m256 scale8 = _mm256_set1_ps(scale), up = _mm256_set1_ps(0x1p8f);
    for (int j = 0; j < M; ++j) acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(span[j], up), scale8, acc[j]);
    fp8_tail_dots<M>(codes, scale, x, stride, c, c1, tail);
  }
  for (int j = 0; j < M; ++j) out[j] = sum8(acc[j]) + tail[j];
}

// BF16: 8 values per step; up to 3 tokens, odd and even steps go to two accumulators (one FMA
// per step on each accumulator's chain would otherwise set the pace: at 3 tokens, 24-25 G
// multiply-adds per second on one core with one, 33-36 with two; docs/PERF.md, CPU backend v6).
template <int M>
MOEINFER_AVX2 void row_dots_bf16_avx2(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, float* out) {
  const uint8_t* bytes = m.data.data() + r * m.cols * 2;
  constexpr int kSplit = M <= 3 ? 2 : 1;
  __m256 acc[kSplit][M];
  float tail[M];
  for (int j = 0; j < M; ++j) {
    for (int i = 0; i < kSplit; ++i) acc[i][j] = _mm256_setzero_ps();
    tail[j] = 0.0f;
  }
  int64_t c = 0;
  for (; c + 8 * kSplit <= m.cols; c += 8 * kSplit) {
    for (int i = 0; i < kSplit; ++i) {
      fma_tokens<M>(acc[i], bf16_octet_avx2(bytes + 2 * (c + 8 * i)), x + c + 8 * i, stride);
    }
  }
  for (; c + 8 <= m.cols; c += 8) fma_tokens<M>(acc[0], bf16_octet_avx2(bytes + 2 * c), x + c, stride);
  for (; c < m.cols; ++c) {
    uint16_t code;
    std::memcpy(&code, bytes + 2 * c, 2);
    const float w = bf16_to_float(code);
    for (int j = 0; j < M; ++j) tail[j] += w * x[j * stride + c];
  }
  for (int j = 0; j < M; ++j) {
    const __m256 sum = kSplit == 2 ? _mm256_add_ps(acc[0][j], acc[kSplit - 1][j]) : acc[0][j];
    out[j] = sum8(sum) + tail[j];
  }
}

// The AVX-512 paths below (CpuLoops::kAvx512) need F, BW, VL and VBMI besides AVX2's; the
// dispatchers check them at run time.
#define MOEINFER_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")))

bool has_avx512_vbmi() {
  static const bool has = has_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vbmi");
  return has;
}

// NVFP4 with AVX-512, 16 values (one block) per step in one register: the block's 8 bytes
// broadcast to every 64-bit lane, one multishift moves code 2q (the low nibble of byte q) into
// 32-bit lane 2q's low bits and code 2q + 1 (its high nibble) into lane 2q + 1's, and one permute
// reads each lane's 2 * E2M1 from a 16-float table (it looks at the low 4 bits of the index
// alone): 3 instructions per 16 values against AVX2's 9 before its multiplies.
// The 16 codes of the block at `bytes` as 2 * E2M1 floats, in order.
MOEINFER_AVX512 inline __m512 nvfp4_twice_avx512(const uint8_t* bytes) {
  // 64-bit lane q: byte 0 from bit 8q (code 2q in the low nibble), byte 4 from bit 8q + 4.
  const __m512i nibble_at = _mm512_set_epi64(0x0000003C00000038, 0x0000003400000030, 0x0000002C00000028,
                                             0x0000002400000020, 0x0000001C00000018, 0x0000001400000010,
                                             0x0000000C00000008, 0x0000000400000000);
  const __m512 twice = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, -0.0f, -1, -2, -3, -4, -6, -8, -12);
  uint64_t block;
  std::memcpy(&block, bytes, sizeof block);
  return _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(nibble_at, _mm512_set1_epi64(static_cast<int64_t>(block))),
                               twice);
}

// acc[j] + block g of a row's NVFP4 codes . token j there, times half the block scale: for one
// token the values times the token, then that times the scale; for several the values times the
// scale once, then one multiply-add per token.
template <int M>
MOEINFER_AVX512 inline void nvfp4_block_avx512(const uint8_t* codes, float half_block, const float* x, int64_t stride,
                                               int64_t g, __m512 (&acc)[M]) {
  const __m512 twice = nvfp4_twice_avx512(codes + g * kNvfp4Group / 2);
  if constexpr (M == 1) {
    acc[0] = _mm512_fmadd_ps(_mm512_mul_ps(twice, _mm512_loadu_ps(x + g * kNvfp4Group)), _mm512_set1_ps(half_block),
                             acc[0]);
  } else {
    const __m512 w = _mm512_mul_ps(twice, _mm512_set1_ps(half_block));
    for (int j = 0; j < M; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + j * stride + g * kNvfp4Group), acc[j]);
  }
}

// As row_dots_nvfp4_avx2, one block per step (nvfp4_block_avx512); up to 3 tokens, even and odd
// blocks go to two accumulators, so that neither chain of multiply-adds sets the pace (at 3 tokens
// 1.03-1.23x at K = 768-4096 in tools/probe_cpu_row_dots; 4 tokens on two per token 0.94-1.09x, and
// one token on four gained nothing per call, where its rows are bound by DRAM: docs/PERF.md CPU v7).
template <int M>
MOEINFER_AVX512 void row_dots_nvfp4_avx512(const QuantMatrix& m, int64_t r, const float* x, int64_t stride,
                                           float* out) {
  const int64_t groups = m.cols / kNvfp4Group;
  const float* halves = e4m3_halves();
  const uint8_t* block = m.block_scales.data() + r * groups;
  const uint8_t* codes = m.data.data() + r * m.cols / 2;
  constexpr int kSplit = M <= 3 ? 2 : 1;
  __m512 acc[kSplit][M];
  for (int i = 0; i < kSplit; ++i) {
    for (int j = 0; j < M; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  int64_t g = 0;
  for (; g + kSplit <= groups; g += kSplit) {
    for (int i = 0; i < kSplit; ++i) nvfp4_block_avx512<M>(codes, halves[block[g + i]], x, stride, g + i, acc[i]);
  }
  if (g < groups) nvfp4_block_avx512<M>(codes, halves[block[g]], x, stride, g, acc[0]);
  const __m512 global = _mm512_set1_ps(m.global_scale);
  for (int j = 0; j < M; ++j) {
    const __m512 sum = kSplit == 2 ? _mm512_add_ps(acc[0][j], acc[kSplit - 1][j]) : acc[0][j];
    out[j] = _mm512_reduce_add_ps(_mm512_mul_ps(sum, global));
  }
}

// Rows r and r + 1 at once, as row_dots_nvfp4_avx512 does one: each token's 16 values loaded once
// for both rows' multiply-adds, so that where the tile's values pass L1 they come from L2 once per
// two rows (cpu_row_pair_dots).
template <int M>
MOEINFER_AVX512 void row_pair_dots_nvfp4_avx512(const QuantMatrix& m, int64_t r, const float* x, int64_t stride,
                                                float* out0, float* out1) {
  const int64_t groups = m.cols / kNvfp4Group;
  const float* halves = e4m3_halves();
  const uint8_t* block0 = m.block_scales.data() + r * groups;
  const uint8_t* block1 = block0 + groups;
  const uint8_t* codes0 = m.data.data() + r * m.cols / 2;
  const uint8_t* codes1 = codes0 + m.cols / 2;
  __m512 acc0[M], acc1[M];
  for (int j = 0; j < M; ++j) acc0[j] = _mm512_setzero_ps(), acc1[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 w0 = _mm512_mul_ps(nvfp4_twice_avx512(codes0 + g * kNvfp4Group / 2), _mm512_set1_ps(halves[block0[g]]));
    const __m512 w1 = _mm512_mul_ps(nvfp4_twice_avx512(codes1 + g * kNvfp4Group / 2), _mm512_set1_ps(halves[block1[g]]));
    for (int j = 0; j < M; ++j) {
      const __m512 v = _mm512_loadu_ps(x + j * stride + g * kNvfp4Group);
      acc0[j] = _mm512_fmadd_ps(w0, v, acc0[j]);
      acc1[j] = _mm512_fmadd_ps(w1, v, acc1[j]);
    }
  }
  const __m512 global = _mm512_set1_ps(m.global_scale);
  for (int j = 0; j < M; ++j) {
    out0[j] = _mm512_reduce_add_ps(_mm512_mul_ps(acc0[j], global));
    out1[j] = _mm512_reduce_add_ps(_mm512_mul_ps(acc1[j], global));
  }
}

template <int M>
MOEINFER_AVX2 void row_dots_avx2(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, float* out) {
  static_assert(M >= 1 && M <= kCpuTokenTile);
  switch (m.spec.format) {
    case WeightFormat::kNVFP4: row_dots_nvfp4_avx2<M>(m, r, x, stride, out); return;
    case WeightFormat::kFP8: row_dots_fp8_avx2<M>(m, r, x, stride, out); return;
    case WeightFormat::kBF16: row_dots_bf16_avx2<M>(m, r, x, stride, out); return;
  }
}

// FP8 E4M3 with AVX-512, as fp8_16_avx2 (each code's value times 2^-8 as an fp16, NaN codes to
// an fp16 NaN) but 32 codes per step, the NaN codes picked by a mask: 10 instructions per 32
// values against 20. The 32 codes in `bytes` as those fp16s.
MOEINFER_AVX512 inline __m512i fp8_halves_avx512(__m256i bytes) {
  const __m512i b = _mm512_cvtepu8_epi16(bytes);
  const __m512i sign_bit = _mm512_set1_epi16(0x80);
  const __m512i placed = _mm512_slli_epi16(_mm512_add_epi16(b, _mm512_and_si512(b, sign_bit)), 7);
  const __mmask32 is_nan = _mm512_cmpeq_epi16_mask(_mm512_or_si512(b, sign_bit), _mm512_set1_epi16(0xFF));
  return _mm512_mask_mov_epi16(placed, is_nan, _mm512_set1_epi16(0x7E00));
}

// The 16 codes at `codes` as floats times 2^-8 (the upper 16 fp16s, from zero bytes, unused).
MOEINFER_AVX512 inline __m512 fp8_16_avx512(const uint8_t* codes) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  return _mm512_cvtph_ps(_mm512_castsi512_si256(fp8_halves_avx512(_mm256_zextsi128_si256(bytes))));
}

// low[j] + codes c .. c + 15 . token j there, high[j] + codes c + 16 .. c + 31 . token j there.
template <int M>
MOEINFER_AVX512 inline void fp8_32_tokens_avx512(const uint8_t* codes, const float* x, int64_t stride, int64_t c,
                                                 __m512 (&low)[M], __m512 (&high)[M]) {
  const __m512i halves = fp8_halves_avx512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c)));
  const __m512 first = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
  const __m512 second = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
  for (int j = 0; j < M; ++j) {
    low[j] = _mm512_fmadd_ps(first, _mm512_loadu_ps(x + j * stride + c), low[j]);
    high[j] = _mm512_fmadd_ps(second, _mm512_loadu_ps(x + j * stride + c + 16), high[j]);
  }
}

// As row_dots_fp8_avx2, 32 values per step. Each span's sums go to four accumulators per token at
// one token (two steps in turn, each with two halves), two at two tokens, one past that, so that
// no chain of multiply-adds sets the pace.
template <int M>
MOEINFER_AVX512 void row_dots_fp8_avx512(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, float* out) {
  constexpr int kChains = M == 1 ? 4 : M == 2 ? 2 : 1;
  const uint8_t* codes = m.data.data() + r * m.cols;
  __m512 acc[M];
  float tail[M];
  for (int j = 0; j < M; ++j) acc[j] = _mm512_setzero_ps(), tail[j] = 0.0f;
  for (int64_t c0 = 0, c1 = 0; c0 < m.cols; c0 = c1) {
    const float scale = m.fp8_span_scale(r, c0, &c1);
    __m512 span[kChains][M];
    for (int i = 0; i < kChains; ++i) {
      for (int j = 0; j < M; ++j) span[i][j] = _mm512_setzero_ps();
    }
    int64_t c = c0;
    if constexpr (kChains == 4) {
      for (; c + 64 <= c1; c += 64) {
        fp8_32_tokens_avx512<M>(codes, x, stride, c, span[0], span[1]);
        fp8_32_tokens_avx512<M>(codes, x, stride, c + 32, span[2], span[3]);
      }
    }
    for (; c + 32 <= c1; c += 32) fp8_32_tokens_avx512<M>(codes, x, stride, c, span[0], span[kChains - 1]);
    for (; c + 16 <= c1; c += 16) {
      const __m512 v = fp8_16_avx512(codes + c);
      for (int j = 0; j < M; ++j) span[0][j] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + j * stride + c), span[0][j]);
    }
    const __m512 scale16 = _mm512_set1_ps(scale), up = _mm512_set1_ps(0x1p8f);
    for (int j = 0; j < M; ++j) {
      __m512 sum = span[0][j];
      for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, span[i][j]);
      acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(sum, up), scale16, acc[j]);
    }
    fp8_tail_dots<M>(codes, scale, x, stride, c, c1, tail);
  }
  for (int j = 0; j < M; ++j) out[j] = _mm512_reduce_add_ps(acc[j]) + tail[j];
}

// Rows r and r + 1 at once, as row_pair_dots_nvfp4_avx512 does for NVFP4: each token's 16 values
// loaded once for both rows; each row's span scale its own (rows r and r + 1 can sit in two
// 128-row scale blocks, or have their own per-channel scales), the spans' columns the same.
template <int M>
MOEINFER_AVX512 void row_pair_dots_fp8_avx512(const QuantMatrix& m, int64_t r, const float* x, int64_t stride,
                                              float* out0, float* out1) {
  const uint8_t* codes0 = m.data.data() + r * m.cols;
  const uint8_t* codes1 = codes0 + m.cols;
  __m512 acc0[M], acc1[M];
  float tail0[M], tail1[M];
  for (int j = 0; j < M; ++j) {
    acc0[j] = _mm512_setzero_ps(), acc1[j] = _mm512_setzero_ps();
    tail0[j] = 0.0f, tail1[j] = 0.0f;
  }
  for (int64_t c0 = 0, c1 = 0; c0 < m.cols; c0 = c1) {
    const float scale0 = m.fp8_span_scale(r, c0, &c1);
    const float scale1 = m.fp8_span_scale(r + 1, c0, &c1);
    __m512 span0[M], span1[M];
    for (int j = 0; j < M; ++j) span0[j] = _mm512_setzero_ps(), span1[j] = _mm512_setzero_ps();
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
      const __m512 v0 = fp8_16_avx512(codes0 + c), v1 = fp8_16_avx512(codes1 + c);
      for (int j = 0; j < M; ++j) {
        const __m512 xv = _mm512_loadu_ps(x + j * stride + c);
        span0[j] = _mm512_fmadd_ps(v0, xv, span0[j]);
        span1[j] = _mm512_fmadd_ps(v1, xv, span1[j]);
      }
    }
    const __m512 up = _mm512_set1_ps(0x1p8f), s0 = _mm512_set1_ps(scale0), s1 = _mm512_set1_ps(scale1);
    for (int j = 0; j < M; ++j) {
      acc0[j] = _mm512_fmadd_ps(_mm512_mul_ps(span0[j], up), s0, acc0[j]);
      acc1[j] = _mm512_fmadd_ps(_mm512_mul_ps(span1[j], up), s1, acc1[j]);
    }
    fp8_tail_dots<M>(codes0, scale0, x, stride, c, c1, tail0);
    fp8_tail_dots<M>(codes1, scale1, x, stride, c, c1, tail1);
  }
  for (int j = 0; j < M; ++j) {
    out0[j] = _mm512_reduce_add_ps(acc0[j]) + tail0[j];
    out1[j] = _mm512_reduce_add_ps(acc1[j]) + tail1[j];
  }
}

// AVX-512 for NVFP4 and FP8, whose AVX2 loops are bound by their decode; AVX2 for BF16, whose one
// token already reads as fast as one core reads (tools/probe_cpu_row_dots).
template <int M>
MOEINFER_AVX512 void row_dots_avx512(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, float* out) {
  switch (m.spec.format) {
    case WeightFormat::kNVFP4: row_dots_nvfp4_avx512<M>(m, r, x, stride, out); return;
    case WeightFormat::kFP8: row_dots_fp8_avx512<M>(m, r, x, stride, out); return;
    case WeightFormat::kBF16: row_dots_bf16_avx2<M>(m, r, x, stride, out); return;
  }
}
#endif

}  // namespace

void cpu_decode_row(const QuantMatrix& m, int64_t r, float* out) {
#if defined(__x86_64__)
  if (has_avx2_fma_f16c() && m.spec.format == WeightFormat::kNVFP4) {
    decode_nvfp4_row_avx2(m, r, out);
    return;
  }
  if (has_avx2_fma_f16c() && m.spec.format == WeightFormat::kFP8) {
    decode_fp8_row_avx2(m, r, out);
    return;
  }
#endif
  m.dequantize_row(r, out);
}

CpuLoops cpu_host_loops() {
#if defined(__x86_64__)
  if (has_avx512_vbmi()) return CpuLoops::kAvx512;
  if (has_avx2_fma_f16c()) return CpuLoops::kAvx2;
#endif
  return CpuLoops::kPortable;
}

void cpu_row_dots(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, int64_t tokens, float* out,
                  std::vector<float>& row) {
  cpu_row_dots(m, r, x, stride, tokens, out, row, cpu_host_loops());
}

namespace {

// Calls f(done, size) for each tile of at most kCpuTokenTile tokens that `tokens` splits into, as
// even as possible (9 tokens: 5 + 4); each tile decodes a row once into registers.
template <typename F>
void for_each_tile(int64_t tokens, F&& f) {
  const int64_t tiles = (tokens + kCpuTokenTile - 1) / kCpuTokenTile;
  for (int64_t t = 0, done = 0; t < tiles; ++t) {
    const int64_t size = (tokens - done + tiles - t - 1) / (tiles - t);
    f(done, size);
    done += size;
  }
}

// Calls f.template operator()<M>() with M = size, a tile's tokens (1 to kCpuTokenTile): the
// row loops are built for each.
template <typename F>
void with_tile_size(int64_t size, F&& f) {
  switch (size) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

#if defined(__x86_64__)
// One tile of M tokens on the loops asked for (AVX2 or AVX-512).
template <int M>
void row_dots_tile(CpuLoops loops, const QuantMatrix& m, int64_t r, const float* x, int64_t stride, float* out) {
  if (loops == CpuLoops::kAvx512) {
    row_dots_avx512<M>(m, r, x, stride, out);
  } else {
    row_dots_avx2<M>(m, r, x, stride, out);
  }
}
#endif

#if defined(__x86_64__)
// How far ahead of its rows a thread asks for their weights, and up to how many tokens per call
// (prefetch_rows_ahead).
constexpr int64_t kCpuPrefetchAhead = 2048, kCpuPrefetchMostTokens = 5;
#endif

// Asks the cache for the weight bytes kCpuPrefetchAhead past those of rows r .. r + n - 1 (those
// within the matrix), one request per 64-byte line, for NVFP4 and FP8 dotted with up to
// kCpuPrefetchMostTokens tokens. A thread's rows come one after the other, so these are the bytes
// it reads next. The hardware's own prefetch did not keep one core's stream of NVFP4 or FP8 rows
// fed (with this, qwen3-30b calls of 1-16 tokens ran 1.21-1.35x faster in NVFP4, 1.15-1.58x in
// FP8). BF16's it does: asking for BF16 rows as well made calls of 1-4 tokens 0.88-0.96x where
// they route independently. Past 5 tokens the rows are bound by their multiply-adds, and asking
// made them 0.87-0.96x on one core (docs/PERF.md, CPU v8).
void prefetch_rows_ahead(const QuantMatrix& m, int64_t r, int64_t n, int64_t tokens) {
#if defined(__x86_64__)
  if (m.spec.format == WeightFormat::kBF16 || tokens > kCpuPrefetchMostTokens) return;
  const auto size = static_cast<int64_t>(m.data.size());
  const int64_t row_bytes = m.spec.format == WeightFormat::kNVFP4 ? m.cols / 2 : m.cols;  // no division per row
  const int64_t end = std::min(size, (r + n) * row_bytes + kCpuPrefetchAhead);
  // In asm: GCC 12 removed a loop of _mm_prefetch here as dead code.
  for (int64_t at = std::min(size, r * row_bytes + kCpuPrefetchAhead); at < end; at += 64) {
    asm volatile("prefetcht0 %0" : : "m"(m.data[static_cast<size_t>(at)]));
  }
#else
  (void)m, (void)r, (void)n, (void)tokens;
#endif
}

// cpu_row_dots without the prefetch.
void row_dots_without_prefetch(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, int64_t tokens,
                               float* out, std::vector<float>& row, CpuLoops loops) {
  loops = std::min(loops, cpu_host_loops());
#if defined(__x86_64__)
  if (loops != CpuLoops::kPortable) {
    for_each_tile(tokens, [&](int64_t done, int64_t size) {
      with_tile_size(size, [&]<int M>() { row_dots_tile<M>(loops, m, r, x + done * stride, stride, out + done); });
    });
    return;
  }
#endif
  row.resize(static_cast<size_t>(m.cols));
  cpu_decode_row(m, r, row.data());
  for (int64_t j = 0; j < tokens; ++j) out[j] = dot(row.data(), x + j * stride, m.cols);
}

}  // namespace

void cpu_row_dots(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, int64_t tokens, float* out,
                  std::vector<float>& row, CpuLoops loops) {
  prefetch_rows_ahead(m, r, 1, tokens);
  row_dots_without_prefetch(m, r, x, stride, tokens, out, row, loops);
}

void cpu_row_pair_dots(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, int64_t tokens, float* out0,
                       float* out1, std::vector<float>& row, CpuLoops loops, int64_t pair_from_bytes) {
  prefetch_rows_ahead(m, r, 2, tokens);
  loops = std::min(loops, cpu_host_loops());
#if defined(__x86_64__)
  // No tile passes kCpuTokenTile tokens: where that many would not pass pair_from_bytes, the call
  // goes straight to cpu_row_dots (a row takes under 0.1 us at one token, so even two integer
  // divisions per pair showed: 0.95x).
  const int64_t most = std::min<int64_t>(tokens, kCpuTokenTile);
  const bool pairs_run = m.spec.format == WeightFormat::kNVFP4 || m.spec.format == WeightFormat::kFP8;
  if (loops == CpuLoops::kAvx512 && pairs_run && most * m.cols * static_cast<int64_t>(sizeof(float)) > pair_from_bytes) {
    // Tiles as cpu_row_dots makes them; a tile whose values pass pair_from_bytes runs both rows
    // in one pass over them, a smaller one each row on its own (two passes of the weights'
    // streams measured faster where the values stay in L1).
    for_each_tile(tokens, [&](int64_t done, int64_t size) {
      const float* xt = x + done * stride;
      float *o0 = out0 + done, *o1 = out1 + done;
      if (size * m.cols * static_cast<int64_t>(sizeof(float)) <= pair_from_bytes) {
        row_dots_without_prefetch(m, r, xt, stride, size, o0, row, loops);
        row_dots_without_prefetch(m, r + 1, xt, stride, size, o1, row, loops);
        return;
      }
      with_tile_size(size, [&]<int M>() {
        if (m.spec.format == WeightFormat::kNVFP4) {
          row_pair_dots_nvfp4_avx512<M>(m, r, xt, stride, o0, o1);
        } else {
          row_pair_dots_fp8_avx512<M>(m, r, xt, stride, o0, o1);
        }
      });
    });
    return;
  }
#endif
  row_dots_without_prefetch(m, r, x, stride, tokens, out0, row, loops);
  row_dots_without_prefetch(m, r + 1, x, stride, tokens, out1, row, loops);
}

namespace {

// The peak's loop: kPeakChains independent chains of 8-float multiply-adds, so that each step's
// operations wait only on their own chain and the loop runs at the units' throughput, not their
// latency (2 units x 4-5 cycles need at least 10 in flight). x -> 0.999 x + 0.001 stays near 1.
constexpr int kPeakChains = 12;
constexpr float kPeakScale = 0.999f, kPeakAdd = 0.001f;

#if defined(__x86_64__)
MOEINFER_AVX2 float peak_chains_avx2(int64_t steps) {
  __m256 acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
  const __m256 scale = _mm256_set1_ps(kPeakScale), add = _mm256_set1_ps(kPeakAdd);
  for (int64_t s = 0; s < steps; ++s) {
    for (__m256& a : acc) a = _mm256_fmadd_ps(a, scale, add);
  }
  for (int c = 1; c < kPeakChains; ++c) acc[0] = _mm256_add_ps(acc[0], acc[c]);
  return sum8(acc[0]);
}

// The same 16 wide, where the loops run on AVX-512: the same peak on a CPU that splits a 512-bit
// multiply-add over two 256-bit units (Zen 4), twice it on one with two 512-bit units (this
// machine: 548 against 267 GFLOP/s on 2 threads, docs/PERF.md, CPU backend v6).
MOEINFER_AVX512 float peak_chains_avx512(int64_t steps) {
  __m512 acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  const __m512 scale = _mm512_set1_ps(kPeakScale), add = _mm512_set1_ps(kPeakAdd);
  for (int64_t s = 0; s < steps; ++s) {
    for (__m512& a : acc) a = _mm512_fmadd_ps(a, scale, add);
  }
  for (int c = 1; c < kPeakChains; ++c) acc[0] = _mm512_add_ps(acc[0], acc[c]);
  return _mm512_reduce_add_ps(acc[0]);
}
#endif

// The same without AVX2: what the baseline build's vectors do (a multiply and an add).
float peak_chains_portable(int64_t steps) {
  std::array<std::array<float, 8>, kPeakChains> acc{};
  for (int c = 0; c < kPeakChains; ++c) acc[static_cast<size_t>(c)].fill(static_cast<float>(c));
  for (int64_t s = 0; s < steps; ++s) {
    for (std::array<float, 8>& a : acc) {
      for (float& v : a) v = v * kPeakScale + kPeakAdd;
    }
  }
  float sum = 0.0f;
  for (const std::array<float, 8>& a : acc) {
    for (float v : a) sum += v;
  }
  return sum;
}

// What the backend's loops run with on this host: cpu_host_loops() and the OpenMP threads.
struct HostLoops {
  CpuLoops loops = CpuLoops::kPortable;
  int threads = 1;
};

HostLoops host_loops() {
  HostLoops host;
  host.loops = cpu_host_loops();
#if defined(_OPENMP)
  host.threads = omp_get_max_threads();
#endif
  return host;
}

}  // namespace

std::string cpu_backend_config() {
  const HostLoops host = host_loops();
#if defined(__x86_64__)
  const std::string prefetch = fmt::format("; NVFP4 and FP8 weights prefetched {} KB ahead at up to {} tokens",
                                           kCpuPrefetchAhead / 1024, kCpuPrefetchMostTokens);
#else
  const std::string prefetch;
#endif
  return fmt::format("{}{}; {} thread{}",
                     host.loops != CpuLoops::kPortable
                         ? fmt::format("AVX2 decode in registers{}, up to {} tokens per decode",
                                       host.loops == CpuLoops::kAvx512 ? " (NVFP4, FP8 in AVX-512)" : "",
                                       kCpuTokenTile)
                         : std::string("rows decoded to floats, then dotted (no AVX2, FMA and F16C)"),
                     prefetch, host.threads, host.threads == 1 ? "" : "s");
}

CpuPeak cpu_multiply_add_peak() {
  CpuPeak peak;
  const HostLoops host = host_loops();
  peak.loops = host.loops;
  peak.threads = host.threads;
  const double lanes = peak.loops == CpuLoops::kAvx512 ? 16.0 : 8.0;
  constexpr int64_t kSteps = int64_t{1} << 22;  // about 8 ms per thread at 96 G multiply-adds/s
  double best = 0.0;
  for (int rep = -1; rep < 5; ++rep) {  // pass -1 starts the team and the clocks, untimed
    std::vector<float> sums(static_cast<size_t>(peak.threads));
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(peak.threads)
    {
#if defined(_OPENMP)
      const size_t t = static_cast<size_t>(omp_get_thread_num());
#else
      const size_t t = 0;
#endif
#if defined(__x86_64__)
      sums[t] = peak.loops == CpuLoops::kAvx512 ? peak_chains_avx512(kSteps)
                : peak.loops == CpuLoops::kAvx2   ? peak_chains_avx2(kSteps)
                                                  : peak_chains_portable(kSteps);
#else
      sums[t] = peak_chains_portable(kSteps);
#endif
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    volatile float observed = std::accumulate(sums.begin(), sums.end(), 0.0f);  // the loops must run
    (void)observed;
    // Other work on the cores can only slow the loop, so the fastest pass is the peak.
    const double multiply_adds = static_cast<double>(peak.threads) * static_cast<double>(kSteps) * kPeakChains * lanes;
    if (rep >= 0) best = std::max(best, multiply_adds / seconds);
  }
  peak.multiply_adds_per_second = best;
  return peak;
}

namespace {

float activate(const LayerDesc& d, float g, float u) {
  if (d.activation == Activation::kGptOssClamped) {
    g = std::min(g, d.swiglu_limit);
    u = std::clamp(u, -d.swiglu_limit, d.swiglu_limit);
    return (u + 1.0f) * g * sigmoidf(d.swiglu_alpha * g);
  }
  return g * sigmoidf(g) * u;
}

// Storage on 64-byte boundaries. A job's inputs and activations are read 16 floats at a time by
// the AVX-512 loops; from a cache line's start (and a row stride of a multiple of 16 floats, as
// every preset's), no such load straddles two lines, which cost those loops 1.3-1.4x at 4-8 tokens
// per decode (docs/PERF.md, CPU backend v6).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <typename U>
  explicit CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
};
using CacheLineFloats = std::vector<float, CacheLineAllocator<float>>;

// One expert's part of a call: its weights and its m routes' inputs, activations and outputs.
struct ExpertJob {
  const ExpertWeights* w = nullptr;
  int64_t m = 0;
  CacheLineFloats in, act;  // [m, H], [m, inter]
  std::vector<float> y;     // [m, H]
};

// Runs every job of a batch: y = down(activate(gate x, up x)) for each of its routes. All the
// batch's experts share one team of threads, each thread taking the same share of every expert's
// rows (contiguous, so each streams its part of every matrix in order, as one team per expert did),
// with one barrier between the gate_up rows and the down rows. A call so pays two barriers per
// batch, not two per expert plus a fork: on a machine whose cores other processes also use, each
// barrier can wait a scheduler time slice for a descheduled thread (PERF.md, CPU backend v4).
void run_jobs(const LayerDesc& d, std::span<ExpertJob> jobs) {
  const int64_t h = d.hidden;
  int64_t elements = 0, max_m = 0;
  for (ExpertJob& job : jobs) {
    const int64_t inter = job.w->gate.rows;
    // Every element is written below (the threads' rows cover all of them).
    job.act.resize(static_cast<size_t>(job.m * inter));
    job.y.resize(static_cast<size_t>(job.m * h));
    elements += 3 * inter * h;
    max_m = std::max(max_m, job.m);
  }
#pragma omp parallel if (elements >= kParallelMinElements)
  {
#if defined(_OPENMP)
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
#else
    const int64_t threads = 1, thread = 0;
#endif
    // Rows two at a time (cpu_row_pair_dots: one pass over the tokens' values where they pass L1),
    // the last of an odd share on its own.
    const auto pair = static_cast<size_t>(2 * max_m);
    std::vector<float> row, g(pair), u(pair), out(pair);
    for (ExpertJob& job : jobs) {
      const ExpertWeights& w = *job.w;
      const int64_t inter = w.gate.rows, m = job.m;
      const int64_t end = inter * (thread + 1) / threads;
      for (int64_t i0 = inter * thread / threads; i0 < end; i0 += 2) {
        const int64_t rows = std::min<int64_t>(2, end - i0);
        if (rows == 2) {
          cpu_row_pair_dots(w.gate, i0, job.in.data(), h, m, g.data(), g.data() + m, row);
          cpu_row_pair_dots(w.up, i0, job.in.data(), h, m, u.data(), u.data() + m, row);
        } else {
          cpu_row_dots(w.gate, i0, job.in.data(), h, m, g.data(), row);
          cpu_row_dots(w.up, i0, job.in.data(), h, m, u.data(), row);
        }
        for (int64_t i = i0; i < i0 + rows; ++i) {
          const float gb = w.gate_bias.empty() ? 0.0f : w.gate_bias[static_cast<size_t>(i)];
          const float ub = w.up_bias.empty() ? 0.0f : w.up_bias[static_cast<size_t>(i)];
          for (int64_t t = 0; t < m; ++t) {
            const auto at = static_cast<size_t>((i - i0) * m + t);
            job.act[static_cast<size_t>(t * inter + i)] = activate(d, g[at] + gb, u[at] + ub);
          }
        }
      }
    }
#pragma omp barrier
    for (ExpertJob& job : jobs) {
      const ExpertWeights& w = *job.w;
      const int64_t inter = w.gate.rows, m = job.m;
      const int64_t end = h * (thread + 1) / threads;
      for (int64_t r0 = h * thread / threads; r0 < end; r0 += 2) {
        const int64_t rows = std::min<int64_t>(2, end - r0);
        if (rows == 2) {
          cpu_row_pair_dots(w.down, r0, job.act.data(), inter, m, out.data(), out.data() + m, row);
        } else {
          cpu_row_dots(w.down, r0, job.act.data(), inter, m, out.data(), row);
        }
        for (int64_t r = r0; r < r0 + rows; ++r) {
          const float db = w.down_bias.empty() ? 0.0f : w.down_bias[static_cast<size_t>(r)];
          for (int64_t t = 0; t < m; ++t) {
            job.y[static_cast<size_t>(t * h + r)] = out[static_cast<size_t>((r - r0) * m + t)] + db;
          }
        }
      }
    }
  }
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(CpuEpConfig ep) : ep_(std::move(ep)) {}
  BackendKind kind() const override { return BackendKind::kCpu; }

  Status prepare(const Layer& layer, int64_t, const ProgressFn&) override {
    if (layer_id_ == layer.id()) return {};
    MOEINFER_RETURN_IF_ERROR(layer.check());
    layer_id_ = layer.id();
    return {};
  }

  Status forward(const Layer& layer, std::span<const float> x, int64_t n, std::span<float> out,
                 ForwardInfo* info) override {
    const LayerDesc& d = layer.desc;
    const int64_t h = d.hidden, outputs = d.router_outputs(), k = d.top_k;
    MOEINFER_RETURN_IF_ERROR(moe_check_input(d, x, n));
    if (static_cast<int64_t>(out.size()) != n * h) {
      return invalid_argument(fmt::format("output holds {} values, {} tokens of hidden size {} need {}", out.size(), n,
                                          h, n * h));
    }
    MOEINFER_RETURN_IF_ERROR(prepare(layer, n, {}));

    // Router (float): the router's rows over the threads, each row decoded once per tile of up to
    // kCpuTokenTile tokens, as the experts' rows are. Then the selection, token by token (the
    // reference's rule: the same ties, the same masking).
    std::vector<float> router_logits(static_cast<size_t>(n * outputs));
#pragma omp parallel if (outputs * h * n >= kParallelMinElements)
    {
      std::vector<float> row, dots(static_cast<size_t>(n));
#pragma omp for schedule(static)
      for (int64_t e = 0; e < outputs; ++e) {
        cpu_row_dots(layer.router, e, x.data(), h, n, dots.data(), row);
        const float bias = layer.router_bias.empty() ? 0.0f : layer.router_bias[static_cast<size_t>(e)];
        for (int64_t t = 0; t < n; ++t) router_logits[static_cast<size_t>(t * outputs + e)] = dots[static_cast<size_t>(t)] + bias;
      }
    }
    std::vector<int> ids(static_cast<size_t>(n * k));
    std::vector<double> weights(static_cast<size_t>(n * k));
    std::vector<double> logits(static_cast<size_t>(outputs));
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(router_logits.begin() + t * outputs, outputs, logits.begin());
      MOEINFER_RETURN_IF_ERROR(moe_select_reference(d, logits, layer.correction_bias,
                                                    std::span<int>(ids.data() + t * k, static_cast<size_t>(k)),
                                                    std::span<double>(weights.data() + t * k, static_cast<size_t>(k))));
    }

    // Group the routes by expert: (token, weight) lists. Under expert parallelism only this
    // rank's slice is computed here, and rank 0 alone adds the zero and shared experts.
    const ExpertSlice slice = expert_slice(d.num_experts, ep_.rank, ep_.ranks);
    const bool adds_once = ep_.rank == 0;
    std::vector<std::vector<std::pair<int64_t, float>>> by_expert(static_cast<size_t>(d.num_experts));
    std::fill(out.begin(), out.end(), 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int id = ids[static_cast<size_t>(t * k + j)];
        const auto w = static_cast<float>(weights[static_cast<size_t>(t * k + j)]);
        if (id >= d.num_experts) {  // zero-computation expert: w * x
          if (!adds_once) continue;
          for (int64_t i = 0; i < h; ++i) out[static_cast<size_t>(t * h + i)] += w * x[static_cast<size_t>(t * h + i)];
        } else if (slice.owns(id)) {
          by_expert[static_cast<size_t>(id)].emplace_back(t, w);
        }
      }
    }

    // The experts with routes here in id order, then the shared expert, in batches of jobs; the
    // outputs are added in that order, so the sum is the same whatever the threads did.
    constexpr int kSharedJob = -1;  // batch_ids entry of the shared expert
    int touched = 0;
    int64_t batch_routes = 0;
    std::vector<int> batch_ids;
    // The batch's jobs are the first `used` of jobs_, whose buffers are kept from call to call:
    // allocated afresh, they cost a page fault per 4 KB and a zero fill on every call.
    size_t used = 0;
    const auto next_job = [&]() -> ExpertJob& {
      if (used == jobs_.size()) jobs_.emplace_back();
      return jobs_[used++];
    };
    const auto run_batch = [&] {
      run_jobs(d, std::span<ExpertJob>(jobs_.data(), used));
      for (size_t b = 0; b < batch_ids.size(); ++b) {
        const ExpertJob& job = jobs_[b];
        for (int64_t j = 0; j < job.m; ++j) {
          int64_t token = j;
          float s = 1.0f;
          if (batch_ids[b] == kSharedJob) {
            s = d.shared_gate ? sigmoidf(dot(layer.shared_gate.data(), x.data() + j * h, h)) : 1.0f;
          } else {
            const auto& route = by_expert[static_cast<size_t>(batch_ids[b])][static_cast<size_t>(j)];
            token = route.first;
            s = d.routing.weight_on_input ? 1.0f : route.second;
          }
          float* o = out.data() + token * h;
          const float* y = job.y.data() + j * h;
          for (int64_t i = 0; i < h; ++i) o[i] += s * y[i];
        }
      }
      batch_ids.clear();
      used = 0;
      batch_routes = 0;
    };
    for (int e = 0; e < d.num_experts; ++e) {
      const auto& routes = by_expert[static_cast<size_t>(e)];
      if (routes.empty()) continue;
      ++touched;
      Result<const ExpertWeights*> w = layer.expert(e);
      if (!w.ok()) return w.status();
      ExpertJob& job = next_job();
      job.w = *w;
      job.m = static_cast<int64_t>(routes.size());
      job.in.resize(static_cast<size_t>(job.m * h));
      for (int64_t j = 0; j < job.m; ++j) {
        // Llama-4 scales the expert's input by the weight and sums the output as is.
        const float s = d.routing.weight_on_input ? routes[static_cast<size_t>(j)].second : 1.0f;
        const float* xt = x.data() + routes[static_cast<size_t>(j)].first * h;
        for (int64_t i = 0; i < h; ++i) job.in[static_cast<size_t>(j * h + i)] = s * xt[i];
      }
      batch_ids.push_back(e);
      batch_routes += job.m;
      if (batch_routes >= kCpuRoutesPerBatch) run_batch();
    }
    if (layer.shared && adds_once) {  // with the last routed batch, added after it
      ExpertJob& job = next_job();
      job.w = &*layer.shared;
      job.m = n;
      job.in.assign(x.begin(), x.end());
      batch_ids.push_back(kSharedJob);
    }
    if (used > 0) run_batch();
    if (ep_.ranks > 1) {
      MOEINFER_RETURN_IF_ERROR(ep_.reduce(out));
    }
    if (info != nullptr) {
      info->path = ep_.ranks > 1 ? fmt::format("expert-major, expert parallel over {} ranks", ep_.ranks) : "expert-major";
      info->detail = ep_.ranks > 1
                         ? fmt::format("float SIMD; rank {} owns experts [{}, {}) and computed {} of them", ep_.rank,
                                       slice.begin, slice.end, touched)
                         : fmt::format("float SIMD, {} distinct experts, each decoded once", touched);
    }
    return {};
  }

 private:
  CpuEpConfig ep_;
  uint64_t layer_id_ = 0;
  std::vector<ExpertJob> jobs_;  // one batch's, reused by the next batch and the next call
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(CpuEpConfig ep) { return std::make_unique<CpuBackend>(std::move(ep)); }

ExpertSlice expert_slice(int num_experts, int rank, int ranks) {
  if (ranks < 1 || rank < 0 || rank >= ranks) return {};
  const int base = num_experts / ranks, extra = num_experts % ranks;
  const int begin = rank * base + std::min(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

}  // namespace moeinfer
