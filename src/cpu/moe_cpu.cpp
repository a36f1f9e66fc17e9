// The fast CPU backend: float arithmetic, SIMD dot products, threads over output rows, and
// expert-major order: each distinct expert's weights are decoded once per call and applied to
// every token that chose it, so a batch reads each expert once (the decode regime's floor).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
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
// NVFP4 row decode with AVX2, 16 values (8 bytes, one block scale) per step: the nibbles are
// split and interleaved (element 2i is the low nibble of byte i), one byte shuffle looks up
// 2 * E2M1 as a signed integer, and the integers become floats times half the block scale
// (exact: at most 6 significant bits) times the global scale, the one rounding, as in
// QuantMatrix::dequantize_row. Only the sign of a zero can differ (-0 decodes as +0).
__attribute__((target("avx2,fma"))) void decode_nvfp4_row_avx2(const QuantMatrix& m, int64_t r, float* out) {
  const int64_t groups = m.cols / kNvfp4Group;
  const uint8_t* bytes = m.data.data() + r * m.cols / 2;
  const __m128i twice_e2m1 = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m256 global = _mm256_set1_ps(m.global_scale);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 half_block =
        _mm256_set1_ps(e4m3_to_float(m.block_scales[static_cast<size_t>(r * groups + g)]) * 0.5f);
    const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + g * kNvfp4Group / 2));
    const __m128i low = _mm_and_si128(packed, nibble);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    const __m128i twice = _mm_shuffle_epi8(twice_e2m1, _mm_unpacklo_epi8(low, high));
    const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(twice));
    const __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(twice, 8)));
    _mm256_storeu_ps(out + g * kNvfp4Group, _mm256_mul_ps(_mm256_mul_ps(first, half_block), global));
    _mm256_storeu_ps(out + g * kNvfp4Group + 8, _mm256_mul_ps(_mm256_mul_ps(second, half_block), global));
  }
}

// FP8 E4M3 row decode with AVX2, 8 values per step: a code's sign, exponent and mantissa bits
// moved into a float's (E4M3 x 2^-120, subnormals included) times 2^120 is the code's value
// exactly; the NaN codes stay NaN; then the scale, the one rounding, as in dequantize_row.
__attribute__((target("avx2,fma"))) void decode_fp8_row_avx2(const QuantMatrix& m, int64_t r, float* out) {
  const uint8_t* codes = m.data.data() + r * m.cols;
  const __m256i sign = _mm256_set1_epi32(0x80), magnitude = _mm256_set1_epi32(0x7F);
  const __m256 rebias = _mm256_set1_ps(0x1p120f), nan = _mm256_set1_ps(std::nanf(""));
  // One scale per 128 columns (block), per row (channel) or for all (tensor).
  const int64_t span = m.spec.fp8_scaling == Fp8Scaling::kBlock128 ? kFp8Block : m.cols;
  for (int64_t c0 = 0; c0 < m.cols; c0 += span) {
    int64_t s = 0;
    if (m.spec.fp8_scaling == Fp8Scaling::kBlock128) s = (r / kFp8Block) * m.fp8_scale_cols() + c0 / kFp8Block;
    else if (m.spec.fp8_scaling == Fp8Scaling::kPerChannel) s = r;
    const float scale = m.scales[static_cast<size_t>(s)];
    const __m256 scale8 = _mm256_set1_ps(scale);
    const int64_t c1 = std::min(m.cols, c0 + span);
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c)));
      const __m256i m7 = _mm256_and_si256(b, magnitude);
      const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, sign), 24), _mm256_slli_epi32(m7, 20));
      __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(bits), rebias);
      v = _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m7, magnitude)));
      _mm256_storeu_ps(out + c, _mm256_mul_ps(v, scale8));
    }
    for (; c < c1; ++c) out[c] = e4m3_to_float(codes[c]) * scale;
  }
}
#endif

}  // namespace

void cpu_decode_row(const QuantMatrix& m, int64_t r, float* out) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && m.spec.format == WeightFormat::kNVFP4) {
    decode_nvfp4_row_avx2(m, r, out);
    return;
  }
  if (avx2 && m.spec.format == WeightFormat::kFP8) {
    decode_fp8_row_avx2(m, r, out);
    return;
  }
#endif
  m.dequantize_row(r, out);
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

// One expert applied to m tokens: in [m, H] -> y [m, H]. Rows of each weight matrix are decoded
// once and used for all m tokens.
void expert_batch(const LayerDesc& d, const ExpertWeights& w, const std::vector<float>& in, int64_t m,
                  std::vector<float>& act, std::vector<float>& y) {
  const int64_t h = d.hidden, inter = w.gate.rows;
  act.assign(static_cast<size_t>(m * inter), 0.0f);
  y.assign(static_cast<size_t>(m * h), 0.0f);
#pragma omp parallel if (inter * h >= kParallelMinElements)
  {
    std::vector<float> g_row(static_cast<size_t>(h)), u_row(static_cast<size_t>(h));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < inter; ++i) {
      cpu_decode_row(w.gate, i, g_row.data());
      cpu_decode_row(w.up, i, u_row.data());
      const float gb = w.gate_bias.empty() ? 0.0f : w.gate_bias[static_cast<size_t>(i)];
      const float ub = w.up_bias.empty() ? 0.0f : w.up_bias[static_cast<size_t>(i)];
      for (int64_t j = 0; j < m; ++j) {
        const float* xj = in.data() + j * h;
        act[static_cast<size_t>(j * inter + i)] = activate(d, dot(g_row.data(), xj, h) + gb, dot(u_row.data(), xj, h) + ub);
      }
    }
    std::vector<float> d_row(static_cast<size_t>(inter));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < h; ++r) {
      cpu_decode_row(w.down, r, d_row.data());
      const float db = w.down_bias.empty() ? 0.0f : w.down_bias[static_cast<size_t>(r)];
      for (int64_t j = 0; j < m; ++j) {
        y[static_cast<size_t>(j * h + r)] = dot(d_row.data(), act.data() + j * inter, inter) + db;
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
    router_ = layer.router.dequantize();  // small; decoded once per layer
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

    // Router (float) and selection (the reference's rule: the same ties, the same masking).
    std::vector<int> ids(static_cast<size_t>(n * k));
    std::vector<double> weights(static_cast<size_t>(n * k));
    std::vector<double> logits(static_cast<size_t>(outputs));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < outputs; ++e) {
        logits[static_cast<size_t>(e)] = dot(router_.data() + e * h, x.data() + t * h, h) +
                                         (layer.router_bias.empty() ? 0.0f : layer.router_bias[static_cast<size_t>(e)]);
      }
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

    std::vector<float> in, act, y;
    int touched = 0;
    for (int e = 0; e < d.num_experts; ++e) {
      const auto& routes = by_expert[static_cast<size_t>(e)];
      if (routes.empty()) continue;
      ++touched;
      Result<const ExpertWeights*> w = layer.expert(e);
      if (!w.ok()) return w.status();
      const auto m = static_cast<int64_t>(routes.size());
      in.resize(static_cast<size_t>(m * h));
      for (int64_t j = 0; j < m; ++j) {
        // Llama-4 scales the expert's input by the weight and sums the output as is.
        const float s = d.routing.weight_on_input ? routes[static_cast<size_t>(j)].second : 1.0f;
        for (int64_t i = 0; i < h; ++i) {
          in[static_cast<size_t>(j * h + i)] = s * x[static_cast<size_t>(routes[static_cast<size_t>(j)].first * h + i)];
        }
      }
      expert_batch(d, **w, in, m, act, y);
      for (int64_t j = 0; j < m; ++j) {
        const float s = d.routing.weight_on_input ? 1.0f : routes[static_cast<size_t>(j)].second;
        float* o = out.data() + routes[static_cast<size_t>(j)].first * h;
        for (int64_t i = 0; i < h; ++i) o[i] += s * y[static_cast<size_t>(j * h + i)];
      }
    }
    if (layer.shared && adds_once) {
      in.assign(x.begin(), x.end());
      expert_batch(d, *layer.shared, in, n, act, y);
      for (int64_t t = 0; t < n; ++t) {
        const float gate =
            d.shared_gate ? sigmoidf(dot(layer.shared_gate.data(), x.data() + t * h, h)) : 1.0f;
        for (int64_t i = 0; i < h; ++i) out[static_cast<size_t>(t * h + i)] += gate * y[static_cast<size_t>(t * h + i)];
      }
    }
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
  std::vector<float> router_;
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
