// Format codecs and quantizers: every code, the rounding rule at every tie, pack/unpack.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>

#include "cpu/moe_cpu.h"
#include "cuda/nvfp4_pair_order.h"
#include "moeinfer/format.h"
#include "moeinfer/presets.h"
#include "test_util.h"

namespace moeinfer {
namespace {

using testing::take;

TEST(Bf16, EveryCodeRoundTrips) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const auto code = static_cast<uint16_t>(c);
    const float v = bf16_to_float(code);
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(v)))) << c;
    } else {
      EXPECT_EQ(bf16_from_float(v), code) << c;
    }
  }
}

TEST(Bf16, RoundsToNearestEven) {
  // bf16 keeps 7 mantissa bits: near 1 the step is 2^-7.
  EXPECT_EQ(bf16_to_float(bf16_from_float(1.0f + 0x1p-8f)), 1.0f);                  // tie, 1.0 is even
  EXPECT_EQ(bf16_to_float(bf16_from_float(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);    // tie, up to even
  EXPECT_EQ(bf16_to_float(bf16_from_float(1.0f + 0x1p-8f + 0x1p-20f)), 1.0f + 0x1p-7f);  // past the tie
  EXPECT_EQ(bf16_to_float(bf16_from_float(-2.5f)), -2.5f);
  EXPECT_TRUE(std::isinf(bf16_to_float(bf16_from_float(std::numeric_limits<float>::max()))));
}

TEST(E4M3, KnownValues) {
  // Values from the OCP FP8 spec (E4M3: bias 7, 3 mantissa bits, no infinity).
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(e4m3_to_float(0x01), 0x1p-9f);            // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x07), 7 * 0x1p-9f);        // largest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), 0x1p-6f);            // smallest normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x3C), 1.5f);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);             // largest finite
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

TEST(E4M3, EveryCodeRoundTrips) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float v = e4m3_to_float(code);
    if (std::isnan(v)) {
      ++nans;
      EXPECT_TRUE(std::isnan(e4m3_to_float(e4m3_from_float(v))));
      continue;
    }
    EXPECT_EQ(e4m3_from_float(v), code) << "code " << c << " value " << v;
  }
  EXPECT_EQ(nans, 2);  // only 0x7F and 0xFF
}

TEST(E4M3, TiesGoToTheEvenCodeBetweenEveryPair) {
  // Positive finite codes 0x00..0x7E are ordered by value; test every gap.
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = e4m3_to_float(static_cast<uint8_t>(c));
    const float hi = e4m3_to_float(static_cast<uint8_t>(c + 1));
    ASSERT_LT(lo, hi);
    const float mid = 0.5f * (lo + hi);  // exact: fp32 has many more bits than E4M3
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(e4m3_from_float(mid), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(e4m3_from_float(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(e4m3_from_float(std::nextafter(mid, 1000.0f)), c + 1);
    EXPECT_EQ(e4m3_from_float(-mid), 0x80 | even);
  }
}

TEST(E4M3, SaturatesAndKeepsNaN) {
  EXPECT_EQ(e4m3_from_float(449.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(1e30f), 0x7E);
  EXPECT_EQ(e4m3_from_float(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(e4m3_from_float(std::nanf("")), 0x7F);
  EXPECT_EQ(e4m3_from_float(0x1p-11f), 0x00);  // below half the smallest subnormal
}

TEST(E2M1, EveryCode) {
  // DESIGN.md section 3: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3.
  const float magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_float(static_cast<uint8_t>(c));
    EXPECT_EQ(std::fabs(v), magnitudes[c & 7]) << c;
    EXPECT_EQ(std::signbit(v), (c & 8) != 0) << c;
    EXPECT_EQ(e2m1_from_float(v), c) << c;
  }
}

TEST(E2M1, TiesGoToTheEvenCode) {
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(0.25f)), 0.0f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(0.26f)), 0.5f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(0.75f)), 1.0f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(1.25f)), 1.0f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(1.75f)), 2.0f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(2.5f)), 2.0f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(3.5f)), 4.0f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(5.0f)), 4.0f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(5.01f)), 6.0f);
  EXPECT_EQ(e2m1_to_float(e2m1_from_float(-100.0f)), -6.0f);
  EXPECT_EQ(e2m1_from_float(std::nanf("")), 0);
}

TEST(Nvfp4, DecodesAHandPackedMatrix) {
  // One row of 32: byte 0 = 0x2F holds element 0 in its low nibble (0xF = -6) and element 1
  // in its high nibble (0x2 = 1.0). Block 0 scale 0x38 = 1.0, block 1 scale 0x40 = 2.0.
  QuantMatrix m;
  m.spec = {WeightFormat::kNVFP4};
  m.rows = 1;
  m.cols = 32;
  m.data.assign(16, 0);
  m.data[0] = 0x2F;
  m.data[8] = 0x71;  // elements 16 (0.5) and 17 (6)
  m.block_scales = {0x38, 0x40};
  m.global_scale = 0.5f;
  ASSERT_OK(m.check("m"));
  const std::vector<float> w = m.dequantize();
  EXPECT_EQ(w[0], -3.0f);   // -6 * 1.0 * 0.5
  EXPECT_EQ(w[1], 0.5f);    // 1 * 1.0 * 0.5
  EXPECT_EQ(w[16], 0.5f);   // 0.5 * 2.0 * 0.5
  EXPECT_EQ(w[17], 6.0f);   // 6 * 2.0 * 0.5
  EXPECT_EQ(w[2], 0.0f);
}

// The CPU backend's row decoder (AVX2 for NVFP4 where the CPU has it) gives the values of the
// format's own decoder on every code, every block scale and ragged widths.
TEST(Nvfp4, CpuRowDecoderMatchesDequantizeRow) {
  for (int64_t cols : {16, 32, 48, 272, 2048}) {
    const int64_t rows = 5;
    std::vector<float> values = make_tokens(rows, cols, static_cast<uint64_t>(cols));
    for (size_t i = 0; i < values.size(); i += 7) values[i] *= 1e3f;   // block scales across the E4M3 range
    for (size_t i = 3; i < values.size(); i += 11) values[i] = 0.0f;  // zeros of both signs
    for (size_t i = 5; i < values.size(); i += 13) values[i] = -0.0f;
    const QuantMatrix m = take(QuantMatrix::quantize(values, rows, cols, {WeightFormat::kNVFP4}));
    std::vector<float> expected(static_cast<size_t>(cols)), got(static_cast<size_t>(cols), std::nanf(""));
    for (int64_t r = 0; r < rows; ++r) {
      m.dequantize_row(r, expected.data());
      cpu_decode_row(m, r, got.data());
      for (int64_t c = 0; c < cols; ++c) {
        ASSERT_EQ(got[static_cast<size_t>(c)], expected[static_cast<size_t>(c)]) << "row " << r << " col " << c;
      }
    }
  }
  // Every code pair, under one scale: bytes 0..255 in one row of 512.
  QuantMatrix m;
  m.spec = {WeightFormat::kNVFP4};
  m.rows = 1;
  m.cols = 512;
  for (int b = 0; b < 256; ++b) m.data.push_back(static_cast<uint8_t>(b));
  m.block_scales.assign(32, 0x3A);  // 1.25
  m.global_scale = 0.375f;
  ASSERT_OK(m.check("m"));
  std::vector<float> expected(512), got(512);
  m.dequantize_row(0, expected.data());
  cpu_decode_row(m, 0, got.data());
  for (int c = 0; c < 512; ++c) ASSERT_EQ(got[static_cast<size_t>(c)], expected[static_cast<size_t>(c)]) << "col " << c;
}

// Likewise for FP8: every code (NaN included) under every scaling, on ragged widths.
TEST(Fp8, CpuRowDecoderMatchesDequantizeRow) {
  for (Fp8Scaling scaling : {Fp8Scaling::kBlock128, Fp8Scaling::kPerChannel, Fp8Scaling::kPerTensor}) {
    for (int64_t cols : {5, 16, 130, 300}) {
      const int64_t rows = 3;
      const QuantMatrix base = take(QuantMatrix::quantize(make_tokens(rows, cols, static_cast<uint64_t>(cols)), rows, cols,
                                                           {WeightFormat::kFP8, scaling}));
      QuantMatrix m = base;
      for (size_t i = 0; i < m.data.size(); ++i) m.data[i] = static_cast<uint8_t>(i * 37 + 11);  // every code
      std::vector<float> expected(static_cast<size_t>(cols)), got(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        m.dequantize_row(r, expected.data());
        cpu_decode_row(m, r, got.data());
        for (int64_t c = 0; c < cols; ++c) {
          const float e = expected[static_cast<size_t>(c)], g = got[static_cast<size_t>(c)];
          if (std::isnan(e)) {
            ASSERT_TRUE(std::isnan(g)) << "row " << r << " col " << c;
          } else {
            ASSERT_EQ(g, e) << fp8_scaling_name(scaling) << " cols " << cols << " row " << r << " col " << c;
          }
        }
      }
    }
  }
}

// The tests of cpu_row_dots and cpu_row_pair_dots, once per inner loop (CpuLoops): each skips,
// naming what the CPU lacks, where it does not run the loops the test is for.
class CpuRowDots : public ::testing::TestWithParam<CpuLoops> {
 protected:
  void SetUp() override {
    if (GetParam() > cpu_host_loops()) {
      GTEST_SKIP() << "this CPU lacks what these loops need (AVX2 + FMA + F16C, or AVX-512 F, BW, VL and VBMI)";
    }
  }
};

// Every weight format and FP8 scaling.
std::vector<QuantSpec> every_spec() {
  return {{WeightFormat::kNVFP4},
          {WeightFormat::kFP8, Fp8Scaling::kBlock128},
          {WeightFormat::kFP8, Fp8Scaling::kPerChannel},
          {WeightFormat::kFP8, Fp8Scaling::kPerTensor},
          {WeightFormat::kBF16}};
}

// A decoded row . token j of x, in double, and the sum of the terms' magnitudes (the tolerance's
// scale).
std::pair<double, double> reference_dot(const std::vector<float>& row, const std::vector<float>& x, int64_t stride,
                                        int64_t j) {
  double sum = 0.0, magnitude = 0.0;
  for (size_t c = 0; c < row.size(); ++c) {
    const double term = static_cast<double>(row[c]) * x[static_cast<size_t>(j * stride) + c];
    sum += term;
    magnitude += std::fabs(term);
  }
  return {sum, magnitude};
}

// cpu_row_dots (weights decoded in registers once per tile of up to 8 tokens, else a decoded row
// and one dot per token) against the format's own decoder and a double-precision dot, for every
// format, ragged widths, 1 to 19 tokens and 37 (every tile size, whole and ragged tilings), and
// outputs poisoned first, on each of the inner loops (CpuLoops) that this CPU runs; the others
// skip, naming what the CPU lacks. The tolerance is fp32 summation over `cols` terms in another
// order: 1e-5 of the sum of |w x|.
TEST_P(CpuRowDots, MatchDequantizedRowsForEveryFormatAndTokenCount) {
  const CpuLoops loops = GetParam();
  for (const QuantSpec& spec : every_spec()) {
    for (int64_t cols : {16, 48, 272, 2048, 5, 130, 301}) {
      if (spec.format == WeightFormat::kNVFP4 && cols % 16 != 0) continue;
      const int64_t rows = 3, stride = cols + 3;
      std::vector<float> values = make_tokens(rows, cols, static_cast<uint64_t>(cols) + 1);
      for (size_t i = 0; i < values.size(); i += 7) values[i] *= 50.0f;  // scales across a range
      QuantMatrix m = take(QuantMatrix::quantize(values, rows, cols, spec));
      if (spec.format == WeightFormat::kNVFP4) m.global_scale = 0.375f;
      const std::vector<float> x = make_tokens(37, stride, 99);
      std::vector<float> row(static_cast<size_t>(cols)), scratch;
      for (int64_t tokens : {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 37}) {
        for (int64_t r = 0; r < rows; ++r) {
          m.dequantize_row(r, row.data());
          std::vector<float> got(static_cast<size_t>(tokens), std::nanf(""));
          cpu_row_dots(m, r, x.data(), stride, tokens, got.data(), scratch, loops);
          for (int64_t j = 0; j < tokens; ++j) {
            const auto [expected, magnitude] = reference_dot(row, x, stride, j);
            EXPECT_NEAR(got[static_cast<size_t>(j)], expected, 1e-5 * magnitude + 1e-30)
                << format_name(spec.format) << " cols " << cols << " tokens " << tokens << " row " << r << " token " << j;
          }
        }
      }
    }
  }
}

// cpu_row_pair_dots (two rows at once) against dequantize_row and a double-precision dot, as
// above, with the pair kernels forced (pair_from_bytes 0: every tile) and by the rule (the default:
// none of these small rows), rows 0-1 and 1-2, and for FP8 in 128-row blocks rows 127-128 (two
// scale blocks); ragged widths (the 16- and one-column steps); outputs poisoned first. Same
// tolerance.
TEST_P(CpuRowDots, RowPairsMatchDequantizedRows) {
  const CpuLoops loops = GetParam();
  for (const QuantSpec& spec : every_spec()) {
    for (int64_t cols : {16, 48, 272, 301, 2048}) {
      if (spec.format == WeightFormat::kNVFP4 && cols % 16 != 0) continue;
      const int64_t rows = spec.format == WeightFormat::kFP8 ? 130 : 3, stride = cols + 3;
      const QuantMatrix m = take(QuantMatrix::quantize(make_tokens(rows, cols, static_cast<uint64_t>(cols) + 3), rows,
                                                       cols, spec));
      const std::vector<float> x = make_tokens(19, stride, 7);
      std::vector<float> row(static_cast<size_t>(cols)), scratch;
      for (int64_t pair_from_bytes : {int64_t{0}, kCpuPairFromBytes}) {
        for (int64_t tokens : {1, 2, 5, 8, 9, 19}) {
          for (int64_t r : {0, 1, 127}) {
            if (r + 1 >= rows) continue;
            std::vector<float> got0(static_cast<size_t>(tokens), std::nanf("")), got1 = got0;
            cpu_row_pair_dots(m, r, x.data(), stride, tokens, got0.data(), got1.data(), scratch, loops,
                              pair_from_bytes);
            for (int64_t i = 0; i < 2; ++i) {
              m.dequantize_row(r + i, row.data());
              const std::vector<float>& got = i == 0 ? got0 : got1;
              for (int64_t j = 0; j < tokens; ++j) {
                const auto [expected, magnitude] = reference_dot(row, x, stride, j);
                EXPECT_NEAR(got[static_cast<size_t>(j)], expected, 1e-5 * magnitude + 1e-30)
                    << format_name(spec.format) << " cols " << cols << " pair_from_bytes " << pair_from_bytes
                    << " tokens " << tokens << " row " << r + i << " token " << j;
              }
            }
          }
        }
      }
    }
  }
}

// Each code's value through the dots themselves: token j one-hot at column c + j, so that out[j]
// is that column's weight alone, which must be dequantize_row's value exactly (one rounding in
// both). NVFP4: every byte (code pair) under block scales across E4M3's range; FP8: every code
// but the NaNs under each scaling, on ragged widths (the 32-, 16- and 1-column steps); then a
// NaN code, which must make every token's sum NaN. 1, 2, 3 and 8 tokens per call.
TEST_P(CpuRowDots, EveryCodeGivesDequantizeRowsValue) {
  const CpuLoops loops = GetParam();
  std::vector<QuantMatrix> matrices;
  QuantMatrix nvfp4;
  nvfp4.spec = {WeightFormat::kNVFP4};
  nvfp4.rows = 1;
  nvfp4.cols = 512;
  for (int b = 0; b < 256; ++b) nvfp4.data.push_back(static_cast<uint8_t>(b));
  for (int g = 0; g < 32; ++g) nvfp4.block_scales.push_back(static_cast<uint8_t>(g * 4 + 1));  // 2^-9 .. 416
  nvfp4.global_scale = 0.375f;
  ASSERT_OK(nvfp4.check("nvfp4"));
  matrices.push_back(nvfp4);
  for (Fp8Scaling scaling : {Fp8Scaling::kBlock128, Fp8Scaling::kPerChannel, Fp8Scaling::kPerTensor}) {
    for (int64_t cols : {301, 48, 5}) {
      QuantMatrix m = take(QuantMatrix::quantize(make_tokens(2, cols, static_cast<uint64_t>(cols)), 2, cols,
                                                  {WeightFormat::kFP8, scaling}));
      int code = 0;
      for (uint8_t& b : m.data) {
        while ((code & 0x7F) == 0x7F) code = (code + 1) % 256;  // the NaN codes: below
        b = static_cast<uint8_t>(code);
        code = (code + 1) % 256;
      }
      matrices.push_back(m);
    }
  }
  std::vector<float> scratch;
  for (const QuantMatrix& m : matrices) {
    const auto cols = static_cast<size_t>(m.cols);
    std::vector<float> expected(cols);
    for (int64_t tokens : {1, 2, 3, 8}) {
      for (int64_t r = 0; r < m.rows; ++r) {
        m.dequantize_row(r, expected.data());
        for (int64_t c = 0; c < m.cols; c += tokens) {
          const int64_t here = std::min<int64_t>(tokens, m.cols - c);
          std::vector<float> x(static_cast<size_t>(here) * cols, 0.0f), got(static_cast<size_t>(here), std::nanf(""));
          for (int64_t j = 0; j < here; ++j) x[static_cast<size_t>(j) * cols + static_cast<size_t>(c + j)] = 1.0f;
          cpu_row_dots(m, r, x.data(), m.cols, here, got.data(), scratch, loops);
          for (int64_t j = 0; j < here; ++j) {
            ASSERT_EQ(got[static_cast<size_t>(j)], expected[static_cast<size_t>(c + j)])
                << format_name(m.spec.format) << " cols " << m.cols << " row " << r << " col " << c + j << " tokens "
                << tokens;
          }
        }
      }
    }
  }
  // A NaN code in each kind of step: 32 columns (col 2), 16 (col 40 of 48), one (col 300 of 301).
  for (const QuantMatrix& m : matrices) {
    if (m.spec.format != WeightFormat::kFP8) continue;
    for (int64_t col : {2, 40, 300}) {
      if (col >= m.cols || (col == 40 && m.cols != 48)) continue;
      QuantMatrix nan_row = m;
      nan_row.data[static_cast<size_t>(col)] = 0xFF;
      for (int64_t tokens : {1, 2, 3, 8}) {
        const std::vector<float> x(static_cast<size_t>(tokens * m.cols), 0.5f);
        std::vector<float> got(static_cast<size_t>(tokens), 0.0f);
        cpu_row_dots(nan_row, 0, x.data(), m.cols, tokens, got.data(), scratch, loops);
        for (int64_t j = 0; j < tokens; ++j) {
          EXPECT_TRUE(std::isnan(got[static_cast<size_t>(j)]))
              << fp8_scaling_name(m.spec.fp8_scaling) << " cols " << m.cols << " NaN at " << col << " tokens " << tokens;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Loops, CpuRowDots,
                         ::testing::Values(CpuLoops::kPortable, CpuLoops::kAvx2, CpuLoops::kAvx512),
                         [](const ::testing::TestParamInfo<CpuLoops>& p) {
                           return std::string(p.param == CpuLoops::kPortable ? "portable"
                                              : p.param == CpuLoops::kAvx2   ? "avx2"
                                                                                : "avx512");
                         });

TEST(Nvfp4, PacksElementZeroInTheLowNibble) {
  std::vector<float> row(16, 0.0f);
  row[0] = 6.0f;
  row[1] = 0.5f;
  const QuantMatrix m = take(QuantMatrix::quantize(row, 1, 16, {WeightFormat::kNVFP4}));
  // amax 6 -> block scale 448 (0x7E) and global 6 / (6 * 448): element codes 7 (6.0) and 1 (0.5).
  EXPECT_EQ(m.block_scales[0], 0x7E);
  EXPECT_EQ(m.data[0], 0x17);
  const std::vector<float> back = m.dequantize();
  EXPECT_NEAR(back[0], 6.0f, 1e-6f);
  EXPECT_NEAR(back[1], 0.5f, 1e-6f);
}

TEST(Nvfp4, AllZeroBlocks) {
  std::vector<float> values(2 * 32, 0.0f);
  for (int i = 16; i < 32; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i - 20);
  const QuantMatrix m = take(QuantMatrix::quantize(values, 2, 32, {WeightFormat::kNVFP4}));
  EXPECT_EQ(m.block_scales[0], 0x00);  // row 0, block 0: all zero
  EXPECT_EQ(m.block_scales[2], 0x00);  // row 1 is all zero
  EXPECT_EQ(m.block_scales[3], 0x00);
  const std::vector<float> back = m.dequantize();
  for (int i = 0; i < 16; ++i) EXPECT_EQ(back[static_cast<size_t>(i)], 0.0f);
  for (int i = 32; i < 64; ++i) EXPECT_EQ(back[static_cast<size_t>(i)], 0.0f);

  const QuantMatrix zeros = take(QuantMatrix::quantize(std::vector<float>(64, 0.0f), 2, 32, {WeightFormat::kNVFP4}));
  EXPECT_EQ(zeros.global_scale, 1.0f);
  for (float v : zeros.dequantize()) EXPECT_EQ(v, 0.0f);
}

std::vector<float> wavy(int64_t rows, int64_t cols) {
  // Deterministic values spanning several binades, with sign changes and a few exact zeros.
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) {
    v[static_cast<size_t>(i)] = (i % 37 == 0) ? 0.0f : std::sin(0.37f * static_cast<float>(i)) * std::exp(std::cos(0.011f * static_cast<float>(i)) * 3.0f);
  }
  return v;
}

TEST(Nvfp4, RoundTripWithinHalfAStep) {
  const int64_t rows = 9, cols = 80;
  const std::vector<float> v = wavy(rows, cols);
  const QuantMatrix m = take(QuantMatrix::quantize(v, rows, cols, {WeightFormat::kNVFP4}));
  ASSERT_OK(m.check("m"));
  const std::vector<float> back = m.dequantize();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      const float step = e4m3_to_float(m.block_scales[static_cast<size_t>(r * (cols / 16) + c / 16)]) * m.global_scale;
      // The E2M1 grid's widest gap is 2 (between 4 and 6), so rounding is off by at most
      // one step unit; the block's largest value may saturate at 6 when the E4M3 block scale
      // rounded down, by at most 6 * 2^-4 units. Both stay under 1 unit.
      EXPECT_LE(std::fabs(back[i] - v[i]), step * 1.0f + 1e-7f) << r << "," << c;
    }
  }
}

TEST(Fp8, RoundTripEveryScalingOnRaggedShapes) {
  // 200 x 300: neither is a multiple of 128, so the last block row and column are partial.
  const int64_t rows = 200, cols = 300;
  const std::vector<float> v = wavy(rows, cols);
  for (Fp8Scaling scaling : {Fp8Scaling::kBlock128, Fp8Scaling::kPerChannel, Fp8Scaling::kPerTensor}) {
    const QuantMatrix m = take(QuantMatrix::quantize(v, rows, cols, {WeightFormat::kFP8, scaling}));
    ASSERT_OK(m.check("m"));
    const size_t expect_scales = scaling == Fp8Scaling::kBlock128 ? 2 * 3 : scaling == Fp8Scaling::kPerChannel ? 200 : 1;
    EXPECT_EQ(m.scales.size(), expect_scales);
    const std::vector<float> back = m.dequantize();
    for (size_t i = 0; i < v.size(); ++i) {
      // 3 mantissa bits: relative error <= 2^-4 for normals; below 2^-6 (subnormals)
      // the absolute error is at most half the subnormal step 2^-9, times the scale.
      const int64_t r = static_cast<int64_t>(i) / cols, c = static_cast<int64_t>(i) % cols;
      const float scale = scaling == Fp8Scaling::kBlock128 ? m.scales[static_cast<size_t>((r / 128) * 3 + c / 128)]
                          : scaling == Fp8Scaling::kPerChannel ? m.scales[static_cast<size_t>(r)]
                                                               : m.scales[0];
      const float bound = std::max(std::fabs(v[i]) * 0x1p-4f, 0x1p-10f * scale) * 1.0001f;
      EXPECT_LE(std::fabs(back[i] - v[i]), bound) << quant_spec_name(m.spec) << " element " << i;
    }
  }
}

TEST(Bf16Matrix, ExactForRepresentableValues) {
  std::vector<float> v = wavy(3, 7);
  for (float& x : v) x = round_to_bf16(x);
  const QuantMatrix m = take(QuantMatrix::quantize(v, 3, 7, {WeightFormat::kBF16}));
  EXPECT_EQ(m.dequantize(), v);
  EXPECT_EQ(m.bytes(), 3 * 7 * 2);
}

TEST(QuantMatrix, RefusesBadInputWithANamedError) {
  const Result<QuantMatrix> ragged = QuantMatrix::quantize(std::vector<float>(100), 1, 100, {WeightFormat::kNVFP4});
  ASSERT_FALSE(ragged.ok());
  EXPECT_EQ(ragged.status().message(), "in_features 100 is not a multiple of the NVFP4 group 16");
  const Result<QuantMatrix> short_input = QuantMatrix::quantize(std::vector<float>(10), 2, 16, {WeightFormat::kBF16});
  ASSERT_FALSE(short_input.ok());
  EXPECT_EQ(short_input.status().message(), "quantize: 10 values given for a [2, 16] matrix");

  QuantMatrix m = take(QuantMatrix::quantize(wavy(4, 32), 4, 32, {WeightFormat::kFP8, Fp8Scaling::kPerChannel}));
  m.scales[2] = std::nanf("");
  EXPECT_EQ(m.check("w").message(), "w: FP8 scale 2 is not finite (nan)");
  m.scales.pop_back();
  EXPECT_EQ(m.check("w").message(), "w: scales holds 3 entries, a [4, 32] fp8-channel matrix needs 4");

  QuantMatrix n = take(QuantMatrix::quantize(wavy(4, 32), 4, 32, {WeightFormat::kNVFP4}));
  n.block_scales[5] = 0x7F;
  EXPECT_EQ(n.check("w").message(), "w: NVFP4 block scale 5 is NaN");
}

TEST(QuantSpec, ParsesNames) {
  EXPECT_EQ(take(parse_quant_spec("nvfp4")).format, WeightFormat::kNVFP4);
  EXPECT_EQ(take(parse_quant_spec("fp8")), (QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128}));
  EXPECT_EQ(take(parse_quant_spec("fp8-tensor")), (QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerTensor}));
  EXPECT_EQ(quant_spec_name({WeightFormat::kFP8, Fp8Scaling::kPerChannel}), "fp8-channel");
  EXPECT_FALSE(parse_quant_spec("int4").ok());
}

TEST(QuantMatrix, BytesCountCodesAndScales) {
  EXPECT_EQ(quantized_bytes({WeightFormat::kNVFP4}, 768, 2048), 768 * 1024 + 768 * 128 + 4);
  EXPECT_EQ(quantized_bytes({WeightFormat::kFP8, Fp8Scaling::kBlock128}, 200, 300), 200 * 300 + 6 * 4);
  EXPECT_EQ(quantized_bytes({WeightFormat::kBF16}, 3, 5), 30);
}

// The device's NVFP4 layout (src/cuda/nvfp4_pair_order.h): a permutation of each word's bits
// that the expert-major kernel decodes with one mask per pair.
TEST(Nvfp4PairOrder, MovesEveryBitToADistinctPlace) {
  uint32_t seen = 0;
  for (int i = 0; i < 32; ++i) {
    const uint32_t moved = cuda::to_pair_order(1u << i);
    ASSERT_EQ(moved & (moved - 1), 0u) << "bit " << i << " became " << moved;
    ASSERT_NE(moved, 0u) << i;
    EXPECT_EQ(seen & moved, 0u) << "bit " << i << " lands on another bit's place";
    seen |= moved;
  }
  EXPECT_EQ(seen, 0xFFFFFFFFu);
}

float bf16_bits_times_2_126(uint32_t bits16) {
  uint32_t f = bits16 << 16;
  float v;
  std::memcpy(&v, &f, 4);
  return v * 0x1p126f;
}

template <int kPair>
void expect_pair_decodes(uint32_t others) {
  for (uint32_t lo = 0; lo < 16; ++lo) {
    for (uint32_t hi = 0; hi < 16; ++hi) {
      // Codes lo and hi at values 2p and 2p + 1, other values' codes from `others`.
      const uint32_t mask = 0xFFu << (8 * kPair);
      const uint32_t natural = (others & ~mask) | (lo << (8 * kPair)) | (hi << (8 * kPair + 4));
      const uint32_t stored = cuda::to_pair_order(natural);
      const uint32_t pair = cuda::pair_order_bf16x2<kPair>(stored);
      ASSERT_EQ(cuda::pair_order_bf16x2(stored, kPair), pair) << "pair " << kPair << " chosen at run time";
      const float got_lo = bf16_bits_times_2_126(pair & 0xFFFFu), got_hi = bf16_bits_times_2_126(pair >> 16);
      ASSERT_EQ(got_lo, e2m1_to_float(static_cast<uint8_t>(lo))) << "pair " << kPair << " codes " << lo << "," << hi;
      ASSERT_EQ(got_hi, e2m1_to_float(static_cast<uint8_t>(hi))) << "pair " << kPair << " codes " << lo << "," << hi;
      ASSERT_EQ(std::signbit(got_lo), (lo & 8u) != 0) << lo;
      ASSERT_EQ(std::signbit(got_hi), (hi & 8u) != 0) << hi;
      for (int v = 0; v < 8; ++v) {
        ASSERT_EQ(cuda::pair_order_code(stored, v), (natural >> (4 * v)) & 0xFu) << "value " << v << " of " << natural;
      }
    }
  }
}

TEST(Nvfp4PairOrder, EveryPairOfCodesDecodesToItsE2M1ValuesWhateverTheNeighbours) {
  std::mt19937 rng(7);
  for (const uint32_t others : {0u, 0xFFFFFFFFu, 0x88888888u, 0x77777777u, static_cast<uint32_t>(rng()),
                                static_cast<uint32_t>(rng())}) {
    expect_pair_decodes<0>(others);
    expect_pair_decodes<1>(others);
    expect_pair_decodes<2>(others);
    expect_pair_decodes<3>(others);
  }
}

}  // namespace
}  // namespace moeinfer
