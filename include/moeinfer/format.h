// Weight formats (DESIGN.md section 3): scalar codecs, quantizers and the quantized matrix.
//
// Every matrix is stored [rows, cols] = [out_features, in_features], K-major: row r holds the
// in_features weights that produce output r, as in a PyTorch nn.Linear weight.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moeinfer/status.h"

namespace moeinfer {

enum class WeightFormat : uint8_t {
  kBF16,   // bfloat16, plain
  kFP8,    // FP8 E4M3 (the "fn" variant: no infinities, max 448) with fp32 dequant scales
  kNVFP4,  // E2M1 pairs + E4M3 scale per 16 inputs + fp32 global scale
};

// How an FP8 matrix is scaled: w = q * scale, one fp32 scale per ...
enum class Fp8Scaling : uint8_t {
  kBlock128,    // ... 128x128 block (DeepSeek `weight_scale_inv` [ceil(O/128), ceil(I/128)])
  kPerChannel,  // ... output row
  kPerTensor,   // ... matrix
};

struct QuantSpec {
  WeightFormat format = WeightFormat::kNVFP4;
  Fp8Scaling fp8_scaling = Fp8Scaling::kBlock128;  // meaningful for kFP8 only

  bool operator==(const QuantSpec&) const = default;
};

inline constexpr int64_t kNvfp4Group = 16;   // inputs sharing one E4M3 block scale
inline constexpr int64_t kFp8Block = 128;    // side of a DeepSeek FP8 scale block
inline constexpr float kE4M3Max = 448.0f;    // largest finite E4M3 value
inline constexpr float kE2M1Max = 6.0f;      // largest E2M1 value

const char* format_name(WeightFormat format);
const char* fp8_scaling_name(Fp8Scaling scaling);
// "bf16", "fp8" (block-128), "fp8-block", "fp8-channel", "fp8-tensor", "nvfp4".
std::string quant_spec_name(QuantSpec spec);
Result<QuantSpec> parse_quant_spec(std::string_view name);

// ---- scalar codecs -------------------------------------------------------------------------
// All encoders round to nearest, ties to even, and keep NaN a NaN (E2M1 has none: 0).
// BF16 overflows to infinity as IEEE rounding does; E4M3 and E2M1 have no infinity, so
// out-of-range values saturate to their largest finite magnitude (448 and 6).

uint16_t bf16_from_float(float value);
float bf16_to_float(uint16_t bits);
inline float round_to_bf16(float value) { return bf16_to_float(bf16_from_float(value)); }

// E4M3 (fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7F/0xFF are NaN;
// subnormals are m/8 * 2^-6.
uint8_t e4m3_from_float(float value);
float e4m3_to_float(uint8_t code);

// E2M1: a 4-bit code, sign in bit 3; magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}. NaN encodes as 0.
uint8_t e2m1_from_float(float value);
float e2m1_to_float(uint8_t code);

// ---- quantized matrix ----------------------------------------------------------------------

struct QuantMatrix {
  QuantSpec spec;
  int64_t rows = 0;
  int64_t cols = 0;
  // kBF16: rows*cols little-endian bf16 (2 bytes each).
  // kFP8: rows*cols E4M3 codes.
  // kNVFP4: rows*cols/2 bytes; element 2i of a row in the low nibble of byte i.
  std::vector<uint8_t> data;
  // kFP8: the fp32 dequant scales, row-major over the scale grid (see Fp8Scaling).
  std::vector<float> scales;
  // kNVFP4: rows*cols/16 E4M3 block scales, row-major.
  std::vector<uint8_t> block_scales;
  // kNVFP4: the fp32 per-tensor scale, multiplied in (ModelOpt `weight_scale_2`).
  float global_scale = 1.0f;

  // Quantizes a row-major float matrix. NVFP4 needs cols % 16 == 0.
  static Result<QuantMatrix> quantize(std::span<const float> values, int64_t rows, int64_t cols,
                                      QuantSpec spec);

  // Checks that the buffers agree with spec, rows and cols. `name` prefixes the message.
  Status check(std::string_view name) const;

  // The float value of every weight of row r, in order: out[c] for c < cols.
  // NVFP4: e2m1 * float(scale_e4m3) * global; FP8: q * scale; BF16: exact.
  void dequantize_row(int64_t r, float* out) const;
  std::vector<float> dequantize() const;

  // Bytes a kernel reads to use the whole matrix: codes plus every scale.
  int64_t bytes() const;

  // Shape of the FP8 scale grid for this matrix's scaling.
  int64_t fp8_scale_rows() const;
  int64_t fp8_scale_cols() const;
  // FP8: the scale of row r's columns from c0 on, and in *c1 the end of the columns it covers:
  // one scale per 128 columns (block), per row (channel) or for the whole row (tensor).
  float fp8_span_scale(int64_t r, int64_t c0, int64_t* c1) const;
};

// Bytes of a rows x cols matrix stored as `spec`, codes plus scales.
int64_t quantized_bytes(QuantSpec spec, int64_t rows, int64_t cols);

}  // namespace moeinfer
