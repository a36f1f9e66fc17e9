#include "moeinfer/presets.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numbers>

#include "core/parallel.h"

namespace moeinfer {

namespace {

// (name, model, family, {hidden, intermediate, experts, top_k, zero experts, shared,
//  norm_topk_prob, routed_scaling_factor, n_group, topk_group}), from the models' config.json.
constexpr std::array kPresets = {
    Preset{"qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B", Family::kQwen3Next,
           {2048, 512, 512, 10, 0, 512, true, 1.0, 1, 1}},
    Preset{"qwen3-30b-a3b", "Qwen3-30B-A3B", Family::kQwen3Moe, {2048, 768, 128, 8, 0, 0, true, 1.0, 1, 1}},
    Preset{"qwen3-235b-a22b", "Qwen3-235B-A22B", Family::kQwen3Moe,
           {4096, 1536, 128, 8, 0, 0, true, 1.0, 1, 1}},
    Preset{"deepseek-v3", "DeepSeek-V3", Family::kDeepseekV3, {7168, 2048, 256, 8, 0, 2048, true, 2.5, 8, 4}},
    Preset{"kimi-k2", "Kimi-K2", Family::kDeepseekV3, {7168, 2048, 384, 8, 0, 2048, true, 2.827, 1, 1}},
    Preset{"glm-4.5", "GLM-4.5", Family::kGlm4Moe, {5120, 1536, 160, 8, 0, 1536, true, 2.5, 1, 1}},
    Preset{"gpt-oss-120b", "gpt-oss-120b", Family::kGptOss, {2880, 2880, 128, 4, 0, 0, false, 1.0, 1, 1}},
    Preset{"mixtral-8x7b", "Mixtral-8x7B", Family::kMixtral, {4096, 14336, 8, 2, 0, 0, true, 1.0, 1, 1}},
    Preset{"longcat-flash", "LongCat-Flash", Family::kLongcatFlash,
           {6144, 2048, 512, 12, 256, 0, false, 6.0, 1, 1}},
    Preset{"qwen1.5-moe-a2.7b", "Qwen1.5-MoE-A2.7B", Family::kQwen2Moe,
           {2048, 1408, 60, 4, 0, 5632, false, 1.0, 1, 1}},
    Preset{"olmoe-1b-7b", "OLMoE-1B-7B", Family::kOlmoe, {2048, 1024, 64, 8, 0, 0, false, 1.0, 1, 1}},
    Preset{"minimax-m2", "MiniMax-M2", Family::kMinimaxM2, {3072, 1536, 256, 8, 0, 0, true, 1.0, 1, 1}},
    Preset{"llama4-scout", "Llama-4-Scout-17B-16E", Family::kLlama4,
           {5120, 8192, 16, 1, 0, 8192, false, 1.0, 1, 1}},
};

// splitmix64: mixes a 64-bit value into a well-spread one (used to derive stream seeds).
uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ln(u) for u in (0, 1] (u >= 2^-24), from IEEE basic operations alone: u = m 2^e with m in
// [sqrt(1/2), sqrt(2)), and ln(m) = 2 atanh(t), t = (m - 1) / (m + 1), |t| <= 0.1716, by its series
// to t^9 (the next term is under 4e-10 of ln(m)). Integer operations pick the range, not branches,
// so that a loop over it vectorizes.
float log_unit(float u) {
  const uint32_t bits = std::bit_cast<uint32_t>(u);
  uint32_t mantissa = (bits & 0x7FFFFFu) | 0x3F800000u;  // m in [1, 2)
  const uint32_t high = mantissa > std::bit_cast<uint32_t>(std::numbers::sqrt2_v<float>) ? 1u : 0u;
  mantissa -= high << 23;  // m / 2 where m > sqrt(2)
  const float e = static_cast<float>(static_cast<int>((bits >> 23) + high) - 127);
  const float m = std::bit_cast<float>(mantissa);
  const float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
  const float atanh =
      t * (1.0f + t2 * (1.0f / 3 + t2 * (1.0f / 5 + t2 * (1.0f / 7 + t2 * (1.0f / 9)))));
  return e * std::numbers::ln2_v<float> + 2.0f * atanh;
}

// (cos, sin) of the angle 2 pi v, v in (0, 1], from IEEE basic operations alone: the quarter turn
// q = floor(4v) and theta = (4v - q) pi / 2 in [0, pi / 2), where Taylor series to theta^13 (sin)
// and theta^14 (cos) are within 6e-8 and 7e-9; then turned by q quarter turns, (cos, sin) ->
// (-sin, cos) each, by swapping and sign bits.
void cos_sin_turn(float v, float& c, float& s) {
  const float x = 4.0f * v;
  const int q = static_cast<int>(x);  // x > 0: truncation is floor
  const float theta = (x - static_cast<float>(q)) * (std::numbers::pi_v<float> / 2), t2 = theta * theta;
  const float sin =
      theta * (1.0f - t2 * (1.0f / 6) * (1.0f - t2 * (1.0f / 20) * (1.0f - t2 * (1.0f / 42) *
              (1.0f - t2 * (1.0f / 72) * (1.0f - t2 * (1.0f / 110) * (1.0f - t2 * (1.0f / 156)))))));
  const float cos =
      1.0f - t2 * (1.0f / 2) * (1.0f - t2 * (1.0f / 12) * (1.0f - t2 * (1.0f / 30) * (1.0f - t2 * (1.0f / 56) *
             (1.0f - t2 * (1.0f / 90) * (1.0f - t2 * (1.0f / 132) * (1.0f - t2 * (1.0f / 182)))))));
  const uint32_t odd = 0u - static_cast<uint32_t>(q & 1);  // all ones for q = 1, 3: swapped
  const uint32_t sin_bits = std::bit_cast<uint32_t>(sin), cos_bits = std::bit_cast<uint32_t>(cos);
  const uint32_t first = (cos_bits & ~odd) | (sin_bits & odd), second = (sin_bits & ~odd) | (cos_bits & odd);
  c = std::bit_cast<float>(first ^ static_cast<uint32_t>((q + 1) & 2) << 30);  // negative for q = 1, 2
  s = std::bit_cast<float>(second ^ static_cast<uint32_t>(q & 2) << 30);       // negative for q = 2, 3
}

// xoshiro256**: a small, fast generator whose output is the same on every platform. Its normals
// are too (Box-Muller through log_unit and cos_sin_turn, where libm's logf, cosf and sinf differ
// between implementations). One stream per (seed, tensor, expert, row) keeps generation
// independent of thread count and of which experts are generated.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t& s : state_) s = seed = mix64(seed);
  }
  uint64_t next() {
    const uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }
  // Uniform in (0, 1]: 24 random bits, never 0 (the log below needs that).
  float uniform() { return static_cast<float>((next() >> 40) + 1) * 0x1.0p-24f; }
  // Fills out[0..count) with standard normals (Box-Muller, two per pair of uniforms): a batch of
  // uniforms drawn in turn, then turned into normals in a loop the compiler vectorizes.
  void normals(float* out, int64_t count) {
    constexpr int64_t kBatch = 256;  // pairs
    float u[2 * kBatch];
    for (int64_t at = 0; at < count; at += 2 * kBatch) {
      const int64_t pairs = std::min(kBatch, (count - at + 1) / 2);
      for (int64_t i = 0; i < 2 * pairs; ++i) u[i] = uniform();
      float pair[2 * kBatch];
      for (int64_t p = 0; p < pairs; ++p) {
        const float radius = std::sqrt(-2.0f * log_unit(u[2 * p]));
        float c, s;
        cos_sin_turn(u[2 * p + 1], c, s);
        pair[2 * p] = radius * c;
        pair[2 * p + 1] = radius * s;
      }
      std::copy_n(pair, std::min(2 * pairs, count - at), out + at);
    }
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t state_[4];
};

enum class Tensor : uint64_t {
  kRouter = 1, kRouterBias, kCorrectionBias, kSharedGate, kGate, kUp, kDown, kGateBias, kUpBias,
  kDownBias, kTokens,
};

uint64_t stream_seed(uint64_t seed, Tensor tensor, int64_t expert, int64_t row) {
  return mix64(mix64(mix64(seed ^ 0x6D6F65696E666572ull) + static_cast<uint64_t>(tensor)) +
               static_cast<uint64_t>(expert + 1)) + static_cast<uint64_t>(row);
}

// rows x cols normals of standard deviation `std`, one stream per row.
std::vector<float> normal_matrix(uint64_t seed, Tensor tensor, int64_t expert, int64_t rows,
                                 int64_t cols, float std) {
  std::vector<float> values(static_cast<size_t>(rows * cols));
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    Rng rng(stream_seed(seed, tensor, expert, r));
    float* row = values.data() + r * cols;
    rng.normals(row, cols);
    for (int64_t c = 0; c < cols; ++c) row[c] = row[c] * std;
  }
  return values;
}

// Small biases as a checkpoint stores them: bf16 values.
std::vector<float> bias_vector(uint64_t seed, Tensor tensor, int64_t expert, int64_t size, float std) {
  std::vector<float> v = normal_matrix(seed, tensor, expert, 1, size, std);
  for (float& b : v) b = round_to_bf16(b);
  return v;
}

Result<QuantMatrix> random_matrix(uint64_t seed, Tensor tensor, int64_t expert, int64_t rows,
                                  int64_t cols, QuantSpec spec) {
  // std 1/sqrt(fan_in): a unit-variance input gives unit-variance outputs.
  const std::vector<float> values =
      normal_matrix(seed, tensor, expert, rows, cols, 1.0f / std::sqrt(static_cast<float>(cols)));
  return QuantMatrix::quantize(values, rows, cols, spec);
}

// expert == -1 is the shared expert.
Result<ExpertWeights> random_expert(const LayerDesc& d, QuantSpec spec, uint64_t seed, int expert,
                                    int64_t intermediate, bool with_bias) {
  ExpertWeights w;
  Result<QuantMatrix> gate = random_matrix(seed, Tensor::kGate, expert, intermediate, d.hidden, spec);
  if (!gate.ok()) return gate.status();
  Result<QuantMatrix> up = random_matrix(seed, Tensor::kUp, expert, intermediate, d.hidden, spec);
  if (!up.ok()) return up.status();
  Result<QuantMatrix> down = random_matrix(seed, Tensor::kDown, expert, d.hidden, intermediate, spec);
  if (!down.ok()) return down.status();
  w.gate = std::move(gate).value();
  w.up = std::move(up).value();
  w.down = std::move(down).value();
  if (with_bias) {
    w.gate_bias = bias_vector(seed, Tensor::kGateBias, expert, intermediate, 0.05f);
    w.up_bias = bias_vector(seed, Tensor::kUpBias, expert, intermediate, 0.05f);
    w.down_bias = bias_vector(seed, Tensor::kDownBias, expert, d.hidden, 0.05f);
  }
  return w;
}

}  // namespace

std::span<const Preset> presets() { return kPresets; }

Result<const Preset*> find_preset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (p.name == name) return &p;
  }
  std::string names;
  for (const Preset& p : kPresets) names += fmt::format("{}{}", names.empty() ? "" : ", ", p.name);
  return not_found(fmt::format("no preset named '{}' (presets: {})", name, names));
}

Result<Layer> make_synthetic_layer(const LayerDesc& desc, QuantSpec spec, uint64_t seed) {
  MOEINFER_RETURN_IF_ERROR(validate(desc, spec));
  Layer layer(desc, [desc, spec, seed](int e) {
    return random_expert(desc, spec, seed, e, desc.intermediate, desc.expert_bias);
  });
  layer.expert_spec = spec;

  Result<QuantMatrix> router = random_matrix(seed, Tensor::kRouter, 0, desc.router_outputs(),
                                             desc.hidden, QuantSpec{WeightFormat::kBF16});
  if (!router.ok()) return router.status();
  layer.router = std::move(router).value();
  const int64_t outputs = desc.router_outputs();
  if (desc.routing.router_bias) {
    layer.router_bias = bias_vector(seed, Tensor::kRouterBias, 0, outputs, 0.1f);
  }
  if (desc.routing.correction_bias) {
    // The bias shifts choices without swamping the scores: a tenth of the score spread
    // (sigmoid scores spread ~0.2; softmax scores are ~1/outputs each).
    const float spread = desc.routing.score == ScoreFunc::kSoftmax ? 1.0f / static_cast<float>(outputs) : 0.2f;
    layer.correction_bias = bias_vector(seed, Tensor::kCorrectionBias, 0, outputs, 0.1f * spread);
  }
  if (desc.has_shared()) {
    Result<ExpertWeights> shared = random_expert(desc, spec, seed, -1, desc.shared_intermediate, false);
    if (!shared.ok()) return shared.status();
    layer.shared = std::move(shared).value();
  }
  if (desc.shared_gate) {
    layer.shared_gate = bias_vector(seed, Tensor::kSharedGate, 0, desc.hidden,
                                    1.0f / std::sqrt(static_cast<float>(desc.hidden)));
  }
  MOEINFER_RETURN_IF_ERROR(layer.check());
  return layer;
}

Result<Layer> make_preset_layer(std::string_view name, QuantSpec spec, uint64_t seed) {
  Result<const Preset*> preset = find_preset(name);
  if (!preset.ok()) return preset.status();
  const LayerDesc desc = family_layer((*preset)->family, (*preset)->shape);
  Result<Layer> layer = make_synthetic_layer(desc, spec, seed);
  if (!layer.ok()) return layer.status().with_context(fmt::format("preset {}", name));
  return layer;
}

std::vector<float> make_tokens(int64_t n, int64_t hidden, uint64_t seed) {
  std::vector<float> x = normal_matrix(seed, Tensor::kTokens, 0, n, hidden, 1.0f);
  for (float& v : x) v = round_to_bf16(v);
  return x;
}

}  // namespace moeinfer
