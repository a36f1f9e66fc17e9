// Presets: real shapes, valid in every format, deterministic, and routing that is not degenerate.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <set>

#include "moeinfer/presets.h"
#include "moeinfer/reference.h"
#include "test_util.h"

namespace moeinfer {
namespace {

using testing::take;

TEST(Presets, CoverTheDesignShapes) {
  // DESIGN.md section 4: (hidden, intermediate, experts, top-k, shared).
  struct Row { const char* name; int64_t h, i; int e, k; int64_t shared; };
  const Row rows[] = {
      {"qwen3-next-80b-a3b", 2048, 512, 512, 10, 512}, {"qwen3-30b-a3b", 2048, 768, 128, 8, 0},
      {"qwen3-235b-a22b", 4096, 1536, 128, 8, 0},      {"deepseek-v3", 7168, 2048, 256, 8, 2048},
      {"kimi-k2", 7168, 2048, 384, 8, 2048},           {"glm-4.5", 5120, 1536, 160, 8, 1536},
      {"gpt-oss-120b", 2880, 2880, 128, 4, 0},         {"mixtral-8x7b", 4096, 14336, 8, 2, 0},
      {"longcat-flash", 6144, 2048, 512, 12, 0},       {"qwen1.5-moe-a2.7b", 2048, 1408, 60, 4, 5632},
  };
  for (const Row& r : rows) {
    const Preset* p = take(find_preset(r.name));
    const LayerDesc d = family_layer(p->family, p->shape);
    EXPECT_EQ(d.hidden, r.h) << r.name;
    EXPECT_EQ(d.intermediate, r.i) << r.name;
    EXPECT_EQ(d.num_experts, r.e) << r.name;
    EXPECT_EQ(d.top_k, r.k) << r.name;
    EXPECT_EQ(d.shared_intermediate, r.shared) << r.name;
  }
  EXPECT_EQ(take(find_preset("longcat-flash"))->shape.num_zero_experts, 256);
  EXPECT_EQ(take(find_preset("deepseek-v3"))->shape.n_group, 8);
  EXPECT_EQ(take(find_preset("deepseek-v3"))->shape.topk_group, 4);
  EXPECT_EQ(find_preset("gpt-5").status().message().rfind("no preset named 'gpt-5'", 0), 0u);
}

TEST(Presets, EveryPresetIsValidInEveryFormat) {
  for (const Preset& p : presets()) {
    for (const char* f : {"bf16", "fp8", "fp8-channel", "fp8-tensor", "nvfp4"}) {
      const Status s = validate(family_layer(p.family, p.shape), take(parse_quant_spec(f)));
      EXPECT_TRUE(s.ok()) << p.name << " " << f << ": " << s.to_string();
    }
  }
}

TEST(Presets, ExpertsDependOnlyOnSeedAndIndex) {
  const LayerDesc d = family_layer(Family::kQwen3Moe, {.hidden = 64, .intermediate = 32, .num_experts = 8, .top_k = 2});
  const Layer a = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 5));
  const Layer b = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 5));
  const Layer c = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 6));
  // Different generation order, same expert.
  ASSERT_TRUE(b.expert(2).ok());
  const ExpertWeights* a5 = take(a.expert(5));
  const ExpertWeights* b5 = take(b.expert(5));
  EXPECT_EQ(a5->gate.data, b5->gate.data);
  EXPECT_EQ(a5->down.block_scales, b5->down.block_scales);
  EXPECT_NE(a5->gate.data, take(c.expert(5))->gate.data);
  EXPECT_NE(a5->gate.data, take(a.expert(4))->gate.data);
  EXPECT_EQ(a.loaded_experts(), 2);
}

// load_experts loads on several threads at once: the same experts as one at a time, each once,
// the first failure in expert order whichever thread met it, and progress that ends at the count.
TEST(Presets, ExpertsLoadedTogetherEqualExpertsLoadedOneByOne) {
  const LayerDesc d = family_layer(Family::kQwen3Moe, {.hidden = 64, .intermediate = 32, .num_experts = 16, .top_k = 2});
  for (const char* f : {"nvfp4", "fp8", "bf16"}) {
    const QuantSpec spec = take(parse_quant_spec(f));
    const Layer together = take(make_synthetic_layer(d, spec, 9));
    const Layer alone = take(make_synthetic_layer(d, spec, 9));
    const std::vector<int> ids = {7, 3, 15, 3, 0, 7, 12, 1, 9, 4};  // repeats and any order: 8 experts
    int64_t last_done = -1, last_total = -1;
    ASSERT_TRUE(together.load_experts(ids, [&](int64_t done, int64_t total) { last_done = done, last_total = total; }).ok());
    EXPECT_EQ(last_done, 8) << f;
    EXPECT_EQ(last_total, 8) << f;
    EXPECT_EQ(together.loaded_experts(), 8) << f;
    for (int e : ids) {
      const ExpertWeights* a = take(together.expert(e));
      const ExpertWeights* b = take(alone.expert(e));
      for (const auto m : {&ExpertWeights::gate, &ExpertWeights::up, &ExpertWeights::down}) {
        EXPECT_EQ((a->*m).data, (b->*m).data) << f << " expert " << e;
        EXPECT_EQ((a->*m).block_scales, (b->*m).block_scales) << f << " expert " << e;
        EXPECT_EQ((a->*m).scales, (b->*m).scales) << f << " expert " << e;
      }
    }
    EXPECT_EQ(together.loaded_experts(), 8) << f << ": loading again reused the cache";
  }
  const Layer source = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 9));
  ASSERT_TRUE(source.load_experts(std::vector<int>{2, 8}).ok());
  std::atomic<int> calls{0};
  const Layer failing(d, [&](int e) -> Result<ExpertWeights> {
    ++calls;
    if (e == 11 || e == 5) return invalid_argument(fmt::format("no weights for {}", e));
    return *take(source.expert(e));
  });
  const std::vector<int> ids = {11, 2, 5, 8};
  const Status s = failing.load_experts(ids);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.to_string().find("expert 5: no weights for 5"), std::string::npos) << s.to_string();
  EXPECT_EQ(calls.load(), 4);  // every expert was tried
}

TEST(Presets, TokensAreBf16Normals) {
  const std::vector<float> x = make_tokens(16, 256, 3);
  double sum = 0.0, sq = 0.0;
  for (float v : x) {
    EXPECT_EQ(v, round_to_bf16(v));
    sum += v;
    sq += static_cast<double>(v) * v;
  }
  const double mean = sum / static_cast<double>(x.size());
  EXPECT_NEAR(mean, 0.0, 0.1);                                         // 4096 samples: sd of mean 0.016
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(x.size()) - mean * mean), 1.0, 0.1);
  EXPECT_NE(make_tokens(1, 256, 3), make_tokens(1, 256, 4));
}

// The synthetic normals' shape, beyond mean and spread: the share within 1, 2 and 3 standard
// deviations, and as many on each side (Box-Muller through the generator's own ln, cos and sin).
TEST(Presets, TokensFollowTheNormalLaw) {
  const std::vector<float> x = make_tokens(64, 4096, 11);  // 262144 samples
  const double n = static_cast<double>(x.size());
  int64_t within[3] = {0, 0, 0}, positive = 0;
  for (float v : x) {
    for (int k = 0; k < 3; ++k) within[k] += std::fabs(v) < static_cast<float>(k + 1) ? 1 : 0;
    positive += v > 0.0f ? 1 : 0;
  }
  // Binomial sd of each share here: 0.0009 or less; bf16 rounding moves it by up to 0.001.
  EXPECT_NEAR(static_cast<double>(within[0]) / n, 0.682689, 0.005);
  EXPECT_NEAR(static_cast<double>(within[1]) / n, 0.954500, 0.003);
  EXPECT_NEAR(static_cast<double>(within[2]) / n, 0.997300, 0.001);
  EXPECT_NEAR(static_cast<double>(positive) / n, 0.5, 0.005);
}

TEST(Presets, RoutingIsNotDegenerate) {
  // 64 tokens through each preset's router: independent routing would touch about
  // E (1 - (1 - k/E)^64) distinct experts. Ask for at least half of that, and weights that
  // are finite, positive and not all equal.
  const int64_t n = 64;
  for (const Preset& p : presets()) {
    const LayerDesc d = family_layer(p.family, p.shape);
    // Only the router is needed: a one-expert-wide shared expert keeps this quick.
    LayerDesc router_only = d;
    router_only.shared_intermediate = d.has_shared() ? 16 : 0;
    const Layer layer = take(make_synthetic_layer(router_only, {WeightFormat::kBF16}, 1));
    const std::vector<float> x = make_tokens(n, d.hidden, 2);
    const Routes routes = take(moe_route_reference(layer, x, n));
    std::set<int> distinct(routes.ids.begin(), routes.ids.end());
    const double e = d.router_outputs();
    const double independent = e * (1.0 - std::pow(1.0 - d.top_k / e, static_cast<double>(n)));
    EXPECT_GE(static_cast<double>(distinct.size()), 0.5 * independent) << p.name;
    double lo = 1e300, hi = -1e300;
    for (double w : routes.weights) {
      EXPECT_TRUE(std::isfinite(w) && w > 0) << p.name;
      lo = std::min(lo, w);
      hi = std::max(hi, w);
    }
    EXPECT_GT(hi, lo * 1.01) << p.name;
    if (d.num_zero_experts > 0) {
      const auto zero_routes = std::count_if(routes.ids.begin(), routes.ids.end(), [&](int id) { return id >= d.num_experts; });
      EXPECT_GT(zero_routes, 0) << p.name << ": no zero expert was ever chosen";
    }
  }
}

}  // namespace
}  // namespace moeinfer
