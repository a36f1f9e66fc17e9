#include "moeinfer/format.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/parallel.h"

namespace moeinfer {

const char* format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kBF16: return "bf16";
    case WeightFormat::kFP8: return "fp8";
    case WeightFormat::kNVFP4: return "nvfp4";
  }
  return "?";
}

const char* fp8_scaling_name(Fp8Scaling scaling) {
  switch (scaling) {
    case Fp8Scaling::kBlock128: return "block";
    case Fp8Scaling::kPerChannel: return "channel";
    case Fp8Scaling::kPerTensor: return "tensor";
  }
  return "?";
}

std::string quant_spec_name(QuantSpec spec) {
  if (spec.format != WeightFormat::kFP8) return format_name(spec.format);
  return fmt::format("fp8-{}", fp8_scaling_name(spec.fp8_scaling));
}

Result<QuantSpec> parse_quant_spec(std::string_view name) {
  if (name == "bf16") return QuantSpec{WeightFormat::kBF16};
  if (name == "nvfp4") return QuantSpec{WeightFormat::kNVFP4};
  if (name == "fp8" || name == "fp8-block") return QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128};
  if (name == "fp8-channel") return QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerChannel};
  if (name == "fp8-tensor") return QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerTensor};
  return invalid_argument(fmt::format(
      "unknown weight format '{}' (expected nvfp4, fp8, fp8-block, fp8-channel, fp8-tensor or bf16)",
      name));
}

// ---- scalar codecs -------------------------------------------------------------------------

uint16_t bf16_from_float(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040);  // keep it quiet
  // Round to nearest even on the 16 dropped bits; a carry into the exponent is correct
  // (it rounds up to the next binade, or to infinity as IEEE rounding does).
  uint32_t lsb = (bits >> 16) & 1u;
  bits += 0x7FFFu + lsb;
  return static_cast<uint16_t>(bits >> 16);
}

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

namespace {

float e4m3_decode(uint8_t code) {
  const bool negative = code & 0x80;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // m/8 * 2^-6
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  }
  return negative ? -magnitude : magnitude;
}

// All 256 values, decoded once: the reference and the quantizers decode billions of codes.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = e4m3_decode(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

}  // namespace

float e4m3_to_float(uint8_t code) { return e4m3_table()[code]; }

namespace {

// e4m3_from_float, inlined into the quantizers' loops.
inline uint8_t e4m3_code(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  // The cases, as masks of all ones from integer comparisons of the magnitude's bits (which order
  // as the magnitudes do): below the smallest normal 2^-6, from 448 up (infinity too), NaN. The
  // quantizers call this once per weight: every case is computed and one selected by the masks,
  // so that their loops vectorize on any x86-64 (float comparisons feeding selects did not: GCC
  // found "control flow in loop" without SSE4.1's blends).
  constexpr uint32_t kMinNormal = std::bit_cast<uint32_t>(0x1p-6f), kMaxBits = std::bit_cast<uint32_t>(kE4M3Max);
  const uint32_t small = 0u - static_cast<uint32_t>(magnitude < kMinNormal);
  const uint32_t large = 0u - static_cast<uint32_t>(magnitude >= kMaxBits);
  const uint32_t nan = 0u - static_cast<uint32_t>(magnitude > 0x7F800000u);
  // Subnormal range: the value is m * 2^-9, m = a * 512 (exact) rounded to nearest with ties to
  // even, which adding 2^23 does in the default rounding mode: the sum's low mantissa bits are m.
  // Rounding m up to 8 lands exactly on the smallest normal, whose code (e=1, m=0) is 8 as well.
  // Magnitudes past 2^-6 are clamped to it first, so that the sum stays in range.
  const float clamped = std::bit_cast<float>((magnitude & small) | (kMinNormal & ~small));
  const uint32_t subnormal = std::bit_cast<uint32_t>(clamped * 512.0f + 0x1p23f) - 0x4B000000u;
  // Normal range: the float's 23 mantissa bits rounded to E4M3's 3, to nearest with ties to even
  // (bit 20 is the last one kept); a carry out of the mantissa raises the exponent by itself.
  // Below 448 the code stays at or under 0x7E (448 itself).
  const uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u);
  const uint32_t normal = ((rounded >> 23) - (127 - 7)) << 3 | ((rounded >> 20) & 7u);
  // From 448 up it saturates (E4M3 (fn) has no infinity); NaN is 0x7F whatever its sign.
  uint32_t code = (subnormal & small) | (normal & ~small);
  code = (0x7Eu & large) | (code & ~large);
  return static_cast<uint8_t>((0x7Fu & nan) | ((sign | code) & ~nan));
}

}  // namespace

uint8_t e4m3_from_float(float value) { return e4m3_code(value); }

float e2m1_to_float(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float magnitude = kMagnitude[code & 0x7];
  return (code & 0x8) ? -magnitude : magnitude;
}

uint8_t e2m1_from_float(float value) {
  const float a = std::fabs(value);
  // Decision points are the midpoints between neighbouring magnitudes; at a midpoint the even
  // code (mantissa bit 0) wins, so even codes own both of their boundaries. The code is the
  // number of decision points at or below a (no branches: random weights mispredict them, and
  // the quantizer's loop over a block vectorizes). NaN passes no point and takes no sign: 0.
  const int code = int{a > 0.25f} + int{a >= 0.75f} + int{a > 1.25f} + int{a >= 1.75f} + int{a > 2.5f} +
                   int{a >= 3.5f} + int{a > 5.0f};
  const int sign = std::signbit(value) && !std::isnan(value) ? 0x8 : 0;
  return static_cast<uint8_t>(code | sign);
}

// ---- quantized matrix ----------------------------------------------------------------------

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The largest magnitude, NaNs passed over. Eight running maxima, so that the loop is not one
// chain of dependent max operations (the result is the same in any order).
float max_abs(const float* values, int64_t count) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] = std::max(lanes[j], std::fabs(values[i + j]));
  }
  for (; i < count; ++i) lanes[0] = std::max(lanes[0], std::fabs(values[i]));
  float m = 0.0f;
  for (const float lane : lanes) m = std::max(m, lane);
  return m;
}

}  // namespace

int64_t QuantMatrix::fp8_scale_rows() const {
  switch (spec.fp8_scaling) {
    case Fp8Scaling::kBlock128: return ceil_div(rows, kFp8Block);
    case Fp8Scaling::kPerChannel: return rows;
    case Fp8Scaling::kPerTensor: return 1;
  }
  return 0;
}

int64_t QuantMatrix::fp8_scale_cols() const {
  return spec.fp8_scaling == Fp8Scaling::kBlock128 ? ceil_div(cols, kFp8Block) : 1;
}

float QuantMatrix::fp8_span_scale(int64_t r, int64_t c0, int64_t* c1) const {
  const int64_t span = spec.fp8_scaling == Fp8Scaling::kBlock128 ? kFp8Block : cols;
  *c1 = std::min(cols, c0 + span);
  int64_t s = 0;
  if (spec.fp8_scaling == Fp8Scaling::kBlock128) s = (r / kFp8Block) * fp8_scale_cols() + c0 / kFp8Block;
  else if (spec.fp8_scaling == Fp8Scaling::kPerChannel) s = r;
  return scales[static_cast<size_t>(s)];
}

int64_t quantized_bytes(QuantSpec spec, int64_t rows, int64_t cols) {
  switch (spec.format) {
    case WeightFormat::kBF16: return rows * cols * 2;
    case WeightFormat::kNVFP4: return rows * cols / 2 + rows * (cols / kNvfp4Group) + 4;
    case WeightFormat::kFP8: {
      QuantMatrix shape;
      shape.spec = spec;
      shape.rows = rows;
      shape.cols = cols;
      return rows * cols + shape.fp8_scale_rows() * shape.fp8_scale_cols() * 4;
    }
  }
  return 0;
}

int64_t QuantMatrix::bytes() const { return quantized_bytes(spec, rows, cols); }

Result<QuantMatrix> QuantMatrix::quantize(std::span<const float> values, int64_t rows,
                                          int64_t cols, QuantSpec spec) {
  if (rows <= 0 || cols <= 0) {
    return invalid_argument(fmt::format("cannot quantize a [{}, {}] matrix", rows, cols));
  }
  if (static_cast<int64_t>(values.size()) != rows * cols) {
    return invalid_argument(fmt::format("quantize: {} values given for a [{}, {}] matrix",
                                        values.size(), rows, cols));
  }
  if (spec.format == WeightFormat::kNVFP4 && cols % kNvfp4Group != 0) {
    return invalid_argument(fmt::format("in_features {} is not a multiple of the NVFP4 group {}",
                                        cols, kNvfp4Group));
  }
  QuantMatrix m;
  m.spec = spec;
  m.rows = rows;
  m.cols = cols;
  const float* src = values.data();

  switch (spec.format) {
    case WeightFormat::kBF16: {
      m.data.resize(static_cast<size_t>(rows * cols) * 2);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMinElements)
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t bits = bf16_from_float(src[r * cols + c]);
          std::memcpy(&m.data[static_cast<size_t>(r * cols + c) * 2], &bits, 2);
        }
      }
      break;
    }
    case WeightFormat::kFP8: {
      m.data.resize(static_cast<size_t>(rows * cols));
      const int64_t srows = m.fp8_scale_rows();
      const int64_t scols = m.fp8_scale_cols();
      const int64_t block_rows = spec.fp8_scaling == Fp8Scaling::kBlock128 ? kFp8Block
                                 : spec.fp8_scaling == Fp8Scaling::kPerChannel ? 1
                                                                               : rows;
      const int64_t block_cols = spec.fp8_scaling == Fp8Scaling::kBlock128 ? kFp8Block : cols;
      m.scales.resize(static_cast<size_t>(srows * scols));
#pragma omp parallel for schedule(dynamic) if (rows * cols >= kParallelMinElements)
      for (int64_t sr = 0; sr < srows; ++sr) {
        for (int64_t sc = 0; sc < scols; ++sc) {
          const int64_t r0 = sr * block_rows, r1 = std::min(rows, r0 + block_rows);
          const int64_t c0 = sc * block_cols, c1 = std::min(cols, c0 + block_cols);
          float amax = 0.0f;
          for (int64_t r = r0; r < r1; ++r) amax = std::max(amax, max_abs(src + r * cols + c0, c1 - c0));
          // The block's largest magnitude maps to E4M3's largest finite value. An all-zero
          // block keeps scale 1 so that no consumer ever divides by a zero scale.
          const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
          m.scales[static_cast<size_t>(sr * scols + sc)] = scale;
          for (int64_t r = r0; r < r1; ++r) {
            const float* in = src + r * cols;
            uint8_t* out = m.data.data() + r * cols;
            for (int64_t c = c0; c < c1; ++c) out[c] = e4m3_code(in[c] / scale);
          }
        }
      }
      break;
    }
    case WeightFormat::kNVFP4: {
      // Global scale: the tensor's largest magnitude maps to the largest product of an E2M1
      // value and an E4M3 block scale (6 * 448), as ModelOpt's weight_scale_2 does.
      const float amax = max_abs(src, rows * cols);
      m.global_scale = amax > 0.0f ? amax / (kE2M1Max * kE4M3Max) : 1.0f;
      const int64_t groups = cols / kNvfp4Group;
      m.data.resize(static_cast<size_t>(rows * cols / 2));
      m.block_scales.resize(static_cast<size_t>(rows * groups));
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMinElements)
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          const float* block = src + r * cols + g * kNvfp4Group;
          const uint8_t scale_code = e4m3_from_float(max_abs(block, kNvfp4Group) / kE2M1Max / m.global_scale);
          m.block_scales[static_cast<size_t>(r * groups + g)] = scale_code;
          const float step = e4m3_to_float(scale_code) * m.global_scale;
          // The block's 16 codes, then 8 bytes of them, element 2i in the low half of byte i.
          uint8_t codes[kNvfp4Group];
          for (int64_t i = 0; i < kNvfp4Group; ++i) codes[i] = e2m1_from_float(block[i] / step);
          if (!(step > 0.0f)) std::fill_n(codes, kNvfp4Group, uint8_t{0});
          uint8_t* bytes = m.data.data() + (r * cols + g * kNvfp4Group) / 2;
          for (int64_t i = 0; i < kNvfp4Group / 2; ++i) {
            bytes[i] = static_cast<uint8_t>(codes[2 * i] | codes[2 * i + 1] << 4);
          }
        }
      }
      break;
    }
  }
  return m;
}

Status QuantMatrix::check(std::string_view name) const {
  if (rows <= 0 || cols <= 0) {
    return invalid_argument(fmt::format("{}: empty shape [{}, {}]", name, rows, cols));
  }
  const auto expect_size = [&](const char* what, size_t have, int64_t want) -> Status {
    if (static_cast<int64_t>(have) != want) {
      return invalid_argument(fmt::format("{}: {} holds {} entries, a [{}, {}] {} matrix needs {}",
                                          name, what, have, rows, cols, quant_spec_name(spec), want));
    }
    return {};
  };
  switch (spec.format) {
    case WeightFormat::kBF16:
      return expect_size("data", data.size(), rows * cols * 2);
    case WeightFormat::kFP8: {
      MOEINFER_RETURN_IF_ERROR(expect_size("data", data.size(), rows * cols));
      MOEINFER_RETURN_IF_ERROR(expect_size("scales", scales.size(), fp8_scale_rows() * fp8_scale_cols()));
      for (size_t i = 0; i < scales.size(); ++i) {
        if (!std::isfinite(scales[i])) {
          return Status(StatusCode::kCorruptData,
                        fmt::format("{}: FP8 scale {} is not finite ({})", name, i, scales[i]));
        }
      }
      return {};
    }
    case WeightFormat::kNVFP4: {
      if (cols % kNvfp4Group != 0) {
        return invalid_argument(fmt::format("{}: in_features {} is not a multiple of the NVFP4 group {}",
                                            name, cols, kNvfp4Group));
      }
      MOEINFER_RETURN_IF_ERROR(expect_size("data", data.size(), rows * cols / 2));
      MOEINFER_RETURN_IF_ERROR(expect_size("block scales", block_scales.size(), rows * cols / kNvfp4Group));
      if (!std::isfinite(global_scale)) {
        return Status(StatusCode::kCorruptData,
                      fmt::format("{}: NVFP4 global scale is not finite ({})", name, global_scale));
      }
      for (size_t i = 0; i < block_scales.size(); ++i) {
        if ((block_scales[i] & 0x7F) == 0x7F) {
          return Status(StatusCode::kCorruptData,
                        fmt::format("{}: NVFP4 block scale {} is NaN", name, i));
        }
      }
      return {};
    }
  }
  return internal_error("unknown weight format");
}

void QuantMatrix::dequantize_row(int64_t r, float* out) const {
  switch (spec.format) {
    case WeightFormat::kBF16:
      for (int64_t c = 0; c < cols; ++c) {
        uint16_t bits;
        std::memcpy(&bits, &data[static_cast<size_t>(r * cols + c) * 2], 2);
        out[c] = bf16_to_float(bits);
      }
      return;
    case WeightFormat::kFP8: {
      const uint8_t* codes = data.data() + r * cols;
      for (int64_t c0 = 0, c1 = 0; c0 < cols; c0 = c1) {
        const float scale = fp8_span_scale(r, c0, &c1);
        for (int64_t c = c0; c < c1; ++c) out[c] = e4m3_to_float(codes[c]) * scale;
      }
      return;
    }
    case WeightFormat::kNVFP4: {
      // Each byte holds two elements, 2i in the low nibble: a 256-entry table of value pairs
      // decodes both at once.
      static const std::array<std::array<float, 2>, 256> pairs = [] {
        std::array<std::array<float, 2>, 256> t{};
        for (int b = 0; b < 256; ++b) {
          t[static_cast<size_t>(b)] = {e2m1_to_float(static_cast<uint8_t>(b & 0xF)), e2m1_to_float(static_cast<uint8_t>(b >> 4))};
        }
        return t;
      }();
      const int64_t groups = cols / kNvfp4Group;
      const uint8_t* bytes = data.data() + r * cols / 2;
      for (int64_t g = 0; g < groups; ++g) {
        const float block_scale = e4m3_to_float(block_scales[static_cast<size_t>(r * groups + g)]);
        for (int64_t i = 0; i < kNvfp4Group / 2; ++i) {
          const std::array<float, 2>& v = pairs[bytes[g * kNvfp4Group / 2 + i]];
          // e2m1 * e4m3 is exact in fp32 (at most 2 + 4 significant bits); only the global
          // scale rounds, once.
          out[g * kNvfp4Group + 2 * i] = (v[0] * block_scale) * global_scale;
          out[g * kNvfp4Group + 2 * i + 1] = (v[1] * block_scale) * global_scale;
        }
      }
      return;
    }
  }
}

std::vector<float> QuantMatrix::dequantize() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) dequantize_row(r, out.data() + r * cols);
  return out;
}

}  // namespace moeinfer
