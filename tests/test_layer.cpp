// The whole layer on tiny hand-built weights: diagonal experts with power-of-two output scales
// make every route visible in the output (a wrong expert changes the result by a factor of
// two or more), and the expected values are computed here from DESIGN.md's formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moeinfer/reference.h"
#include "test_util.h"

namespace moeinfer {
namespace {

using testing::bf16_matrix;
using testing::diagonal;
using testing::sigmoid;
using testing::silu;

constexpr int64_t kH = 4;

// Expert with gate = g*I, up = u*I, down = d*I (H = I = 4).
ExpertWeights diag_expert(float g, float u, float d) {
  ExpertWeights w;
  w.gate = bf16_matrix(diagonal(kH, g), kH, kH);
  w.up = bf16_matrix(diagonal(kH, u), kH, kH);
  w.down = bf16_matrix(diagonal(kH, d), kH, kH);
  return w;
}

// Router whose row e is (r_e, 0, 0, 0): logit_e = r_e * x_0.
QuantMatrix first_column_router(const std::vector<float>& r) {
  std::vector<float> m(r.size() * kH, 0.0f);
  for (size_t e = 0; e < r.size(); ++e) m[e * kH] = r[e];
  return bf16_matrix(m, static_cast<int64_t>(r.size()), kH);
}

Layer make_layer(const LayerDesc& d, std::vector<ExpertWeights> experts, const std::vector<float>& router_rows) {
  Layer layer(d, [experts](int e) -> Result<ExpertWeights> { return experts[static_cast<size_t>(e)]; });
  layer.expert_spec = {WeightFormat::kBF16};
  layer.router = first_column_router(router_rows);
  if (d.routing.correction_bias) layer.correction_bias.assign(static_cast<size_t>(d.router_outputs()), 0.0f);
  if (d.routing.router_bias) layer.router_bias.assign(static_cast<size_t>(d.router_outputs()), 0.0f);
  return layer;
}

std::vector<float> forward(const Layer& layer, const std::vector<float>& x) {
  std::vector<float> out(x.size(), std::nanf(""));
  const Status s = moe_forward_reference(layer, x, static_cast<int64_t>(x.size()) / kH, out);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return out;
}

FamilyShape tiny(int experts, int top_k) {
  return {.hidden = kH, .intermediate = kH, .num_experts = experts, .top_k = top_k};
}

TEST(Layer, DiagonalExpertsRevealEveryRoute) {
  // Mixtral routing, expert e scales its output by 2^e. Router logits = (0, 1, 2, 3) * x_0.
  const LayerDesc d = family_layer(Family::kMixtral, tiny(4, 2));
  std::vector<ExpertWeights> experts;
  for (int e = 0; e < 4; ++e) experts.push_back(diag_expert(1.0f, 1.0f, std::ldexp(1.0f, e)));
  const Layer layer = make_layer(d, experts, {0.0f, 1.0f, 2.0f, 3.0f});

  // Token 0 (x_0 = 1) picks experts 3 and 2; token 1 (x_0 = -1) picks experts 0 and 1.
  const std::vector<float> x = {1.0f, -2.0f, 0.5f, 3.0f, -1.0f, 0.25f, 2.0f, -0.5f};
  const std::vector<float> out = forward(layer, x);
  const double e = std::exp(1.0);
  // Token 0: weights e^3 / (e^3 + e^2) = e / (e + 1) on expert 3, 1 / (e + 1) on expert 2.
  const double scale0 = (e / (e + 1.0)) * 8.0 + (1.0 / (e + 1.0)) * 4.0;
  // Token 1: logits (0, -1, -2, -3): weights 1 / (1 + 1/e) on expert 0, (1/e) / (1 + 1/e) on 1.
  const double scale1 = (1.0 / (1.0 + 1.0 / e)) * 1.0 + ((1.0 / e) / (1.0 + 1.0 / e)) * 2.0;
  for (int64_t i = 0; i < kH; ++i) {
    EXPECT_NEAR(out[static_cast<size_t>(i)], scale0 * silu(x[static_cast<size_t>(i)]) * x[static_cast<size_t>(i)], 1e-6) << i;
    EXPECT_NEAR(out[static_cast<size_t>(kH + i)], scale1 * silu(x[static_cast<size_t>(kH + i)]) * x[static_cast<size_t>(kH + i)], 1e-6) << i;
  }
}

TEST(Layer, SharedExpertThroughItsSigmoidGate) {
  // Qwen2-MoE routing (no renormalisation) plus a gated shared expert (identity diagonals).
  FamilyShape s = tiny(2, 1);
  s.shared_intermediate = kH;
  s.norm_topk_prob = false;
  const LayerDesc d = family_layer(Family::kQwen2Moe, s);
  ASSERT_TRUE(d.shared_gate);
  Layer layer = make_layer(d, {diag_expert(1, 1, 1), diag_expert(1, 1, 2)}, {0.0f, 1.0f});
  layer.shared = diag_expert(1, 1, 1);
  layer.shared_gate = {0.5f, 0.0f, 0.0f, 0.0f};

  const std::vector<float> x = {1.0f, -2.0f, 0.5f, 3.0f};
  const std::vector<float> out = forward(layer, x);
  // Logits (0, 1): softmax weight of expert 1 = e / (1 + e); shared gate sigmoid(0.5 * x_0).
  const double w = std::exp(1.0) / (1.0 + std::exp(1.0));
  const double gate = sigmoid(0.5);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(out[i], (w * 2.0 + gate) * silu(x[i]) * x[i], 1e-6) << i;
  }
}

TEST(Layer, GptOssClampAtItsLimits) {
  // One routed expert per token; gate = I, up = -I, down = I, with biases. Expert 0 is a decoy
  // (down = 100 I); the router bias (0, 1) sends every token to expert 1 with weight 1.
  const LayerDesc d = family_layer(Family::kGptOss, tiny(2, 1));
  ExpertWeights decoy = diag_expert(1, -1, 100);
  ExpertWeights chosen = diag_expert(1, -1, 1);
  for (ExpertWeights* w : {&decoy, &chosen}) {
    w->gate_bias = {0.0f, 0.0f, 0.0f, 0.5f};
    w->up_bias = {0.0f, 0.0f, 0.0f, 0.0f};
    w->down_bias = {0.25f, 0.0f, 0.0f, 0.0f};
  }
  Layer layer = make_layer(d, {decoy, chosen}, {0.0f, 0.0f});
  layer.router_bias = {0.0f, 1.0f};

  // x_0 = 10: g = 10 -> 7, u = -10 -> -7.   x_1 = 7: g and u exactly at the limits.
  // x_2 = -7.5: g stays -7.5 (clamped above only), u = 7.5 -> 7.   x_3 = 2: g = 2.5, u = -2.
  const std::vector<float> x = {10.0f, 7.0f, -7.5f, 2.0f};
  const std::vector<float> out = forward(layer, x);
  const auto act = [](double g, double u) { return (u + 1.0) * g * sigmoid(1.702 * g); };
  EXPECT_NEAR(out[0], act(7.0, -7.0) + 0.25, 1e-5);
  EXPECT_NEAR(out[1], act(7.0, -7.0), 1e-5);
  EXPECT_NEAR(out[2], act(-7.5, 7.0), 1e-5);
  EXPECT_NEAR(out[3], act(2.5, -2.0), 1e-5);
}

TEST(Layer, Llama4WeightScalesTheExpertInput) {
  // Top-1 of logits (-1, 2) * x_0 with x_0 = 1: expert 1, s = sigmoid(2) applied to the input.
  // The expert is nonlinear, so scaling its input differs from scaling its output.
  FamilyShape shape = tiny(2, 1);
  shape.shared_intermediate = kH;
  const LayerDesc d = family_layer(Family::kLlama4, shape);
  Layer layer = make_layer(d, {diag_expert(1, 1, 1), diag_expert(1, 1, 4)}, {-1.0f, 2.0f});
  layer.shared = diag_expert(1, 1, 1);

  const std::vector<float> x = {1.0f, -2.0f, 0.5f, 3.0f};
  const std::vector<float> out = forward(layer, x);
  const double s = sigmoid(2.0);
  for (size_t i = 0; i < 4; ++i) {
    const double xs = s * x[i];
    EXPECT_NEAR(out[i], 4.0 * silu(xs) * xs + silu(x[i]) * x[i], 1e-6) << i;
  }
}

TEST(Layer, ZeroExpertsAddTheirWeightTimesTheInput) {
  // LongCat: 2 experts + 2 zero experts, top-2, scaling 2. Logits (0, 0, 2, 1) * x_0 pick the
  // two zero experts: out = 2 * (s_2 + s_3) * x with s = softmax(0, 0, 2, 1).
  FamilyShape shape = tiny(2, 2);
  shape.num_zero_experts = 2;
  shape.routed_scaling_factor = 2.0;
  shape.norm_topk_prob = false;
  const LayerDesc d = family_layer(Family::kLongcatFlash, shape);
  const Layer layer = make_layer(d, {diag_expert(1, 1, 64), diag_expert(1, 1, 64)}, {0.0f, 0.0f, 2.0f, 1.0f});

  const std::vector<float> x = {1.0f, -2.0f, 0.5f, 3.0f};
  const std::vector<float> out = forward(layer, x);
  const double e = std::exp(1.0);
  const double denom = 2.0 + e * e + e;
  const double scale = 2.0 * (e * e + e) / denom;
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(out[i], scale * x[i], 1e-6) << i;
  EXPECT_EQ(layer.loaded_experts(), 0);  // no real expert was needed
}

TEST(Layer, RefusesBadInputsByName) {
  const LayerDesc d = family_layer(Family::kMixtral, tiny(2, 1));
  Layer layer = make_layer(d, {diag_expert(1, 1, 1), diag_expert(1, 1, 1)}, {0.0f, 1.0f});
  std::vector<float> out(4);
  std::vector<float> x = {1.0f, std::nanf(""), 0.0f, 0.0f};
  EXPECT_EQ(moe_forward_reference(layer, x, 1, out).message(), "input token 0, element 1 is not finite (nan)");
  x[1] = 0.0f;
  std::vector<float> out2(8);
  EXPECT_EQ(moe_forward_reference(layer, x, 2, out2).message(),
            "input holds 4 values, 2 tokens of hidden size 4 need 8");
  std::vector<float> small_out(3);
  EXPECT_EQ(moe_forward_reference(layer, x, 1, small_out).message(),
            "output holds 3 values, 1 tokens of hidden size 4 need 4");

  // An expert whose loader returns the wrong shape is named.
  Layer bad(d, [](int) -> Result<ExpertWeights> {
    ExpertWeights w = diag_expert(1, 1, 1);
    w.gate = bf16_matrix(std::vector<float>(12, 0.0f), 3, 4);
    return w;
  });
  bad.expert_spec = {WeightFormat::kBF16};
  bad.router = first_column_router({0.0f, 1.0f});
  EXPECT_EQ(moe_forward_reference(bad, x, 1, out).message(),
            "expert 1 gate_proj: shape [3, 4], the layer needs [4, 4]");

  // A router of the wrong shape is refused before anything runs.
  layer.router = first_column_router({0.0f, 1.0f, 2.0f});
  EXPECT_EQ(moe_forward_reference(layer, x, 1, out).message(), "router: shape [3, 4], the layer needs [2, 4]");
  // So is a missing shared expert, and a bias the family does not have.
  layer.router = first_column_router({0.0f, 1.0f});
  layer.router_bias = {0.0f, 0.0f};
  EXPECT_EQ(moe_forward_reference(layer, x, 1, out).message(),
            "router bias is present but the layer description has none");
}

}  // namespace
}  // namespace moeinfer
