// Selection (DESIGN.md section 2) on small cases whose answers were worked out by hand; the
// expected numbers come from the arithmetic in the comments, not from the code under test.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moeinfer/reference.h"
#include "test_util.h"

namespace moeinfer {
namespace {

struct Selection {
  std::vector<int> ids;
  std::vector<double> weights;
};

Selection select(const LayerDesc& d, const std::vector<double>& logits, const std::vector<float>& bias = {}) {
  Selection s;
  s.ids.resize(static_cast<size_t>(d.top_k));
  s.weights.resize(static_cast<size_t>(d.top_k));
  const Status st = moe_select_reference(d, logits, bias, s.ids, s.weights);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return s;
}

LayerDesc desc(Family f, int experts, int top_k, bool norm = true, double scaling = 1.0, int n_group = 1,
               int topk_group = 1, int zero = 0) {
  LayerDesc d = family_layer(f, {.hidden = 16, .intermediate = 16, .num_experts = experts, .top_k = top_k,
                                 .num_zero_experts = zero, .norm_topk_prob = norm,
                                 .routed_scaling_factor = scaling, .n_group = n_group, .topk_group = topk_group});
  EXPECT_TRUE(validate(d).ok()) << validate(d).to_string();
  return d;
}

double logit_of(double p) { return std::log(p / (1.0 - p)); }

TEST(Routing, SoftmaxTopKRenormalised) {
  // logits ln(1, 2, 4, 1): softmax = (1, 2, 4, 1) / 8; top-2 = experts 2 and 1.
  const std::vector<double> logits = {0.0, std::log(2.0), std::log(4.0), 0.0};
  const Selection mixtral = select(desc(Family::kMixtral, 4, 2), logits);
  EXPECT_EQ(mixtral.ids, (std::vector<int>{2, 1}));
  EXPECT_NEAR(mixtral.weights[0], 2.0 / 3.0, 1e-15);  // (4/8) / (6/8)
  EXPECT_NEAR(mixtral.weights[1], 1.0 / 3.0, 1e-15);

  const Selection qwen2 = select(desc(Family::kQwen2Moe, 4, 2, /*norm=*/false), logits);
  EXPECT_EQ(qwen2.ids, (std::vector<int>{2, 1}));
  EXPECT_NEAR(qwen2.weights[0], 0.5, 1e-15);
  EXPECT_NEAR(qwen2.weights[1], 0.25, 1e-15);
}

TEST(Routing, TiesGoToTheLowestIndex) {
  const Selection s = select(desc(Family::kQwen3Moe, 5, 3), {1.0, 3.0, 3.0, 0.0, 3.0});
  EXPECT_EQ(s.ids, (std::vector<int>{1, 2, 4}));
  const Selection all_equal = select(desc(Family::kQwen3Moe, 6, 2), std::vector<double>(6, 0.5));
  EXPECT_EQ(all_equal.ids, (std::vector<int>{0, 1}));
  EXPECT_NEAR(all_equal.weights[0], 0.5, 1e-15);
}

TEST(Routing, GroupLimitedDropsTheBestExpertOfALosingGroup) {
  // 8 experts in 4 groups of 2, keep 2 groups, top-2, sigmoid scores, no bias.
  // Scores: g0 = (0.9, 0.05) sums 0.95; g1 = (0.7, 0.5) sums 1.2; g2 = (0.5, 0.5) sums 1.0;
  // g3 = (0.1, 0.1) sums 0.2. Kept: g1 and g2. Expert 0 has the best score but its group loses.
  // Chosen: 2 (0.7) then 3 (0.5, before 4 and 5 by index). Weights (0.7, 0.5) / 1.2 * 2.5.
  std::vector<double> logits;
  for (double p : {0.9, 0.05, 0.7, 0.5, 0.5, 0.5, 0.1, 0.1}) logits.push_back(logit_of(p));
  const LayerDesc d = desc(Family::kDeepseekV3, 8, 2, true, 2.5, 4, 2);
  const Selection s = select(d, logits, std::vector<float>(8, 0.0f));
  EXPECT_EQ(s.ids, (std::vector<int>{2, 3}));
  EXPECT_NEAR(s.weights[0], 0.7 / 1.2 * 2.5, 1e-12);
  EXPECT_NEAR(s.weights[1], 0.5 / 1.2 * 2.5, 1e-12);
}

TEST(Routing, CorrectionBiasChoosesButDoesNotWeigh) {
  // Sigmoid scores 0.6, 0.5, 0.4, 0.3; bias +0.25 on expert 3 makes its key 0.55, which
  // beats expert 1 (0.5). Weights are the unbiased scores (0.6, 0.3), renormalised:
  // (2/3, 1/3); DeepSeek's +1e-20 is invisible at this precision.
  std::vector<double> logits;
  for (double p : {0.6, 0.5, 0.4, 0.3}) logits.push_back(logit_of(p));
  const Selection s = select(desc(Family::kDeepseekV3, 4, 2), logits, {0.0f, 0.0f, 0.0f, 0.25f});
  EXPECT_EQ(s.ids[0], 0);
  EXPECT_EQ(s.ids[1], 3);
  EXPECT_NEAR(s.weights[0], 2.0 / 3.0, 1e-12);
  EXPECT_NEAR(s.weights[1], 1.0 / 3.0, 1e-12);
}

TEST(Routing, MaskedGroupsAreMinusInfinityNotZero) {
  // 8 experts, 2 groups of 4, keep 1 group, top-2. All scores 0.5 (logit 0); the bias sets
  // the keys: g0 = (0.3, -0.2, -0.4, -0.5), top-2 sum 0.1; g1 = (-0.1, -0.3, -0.6, -0.7),
  // top-2 sum -0.4. g0 is kept and has one positive key. Filling g1 with 0.0 (old
  // transformers) would pick expert 4 (0.0 > -0.2) second; with -inf the second pick is
  // expert 1 of the kept group, as transformers 5.17 does.
  const std::vector<float> bias = {-0.2f, -0.7f, -0.9f, -1.0f, -0.6f, -0.8f, -1.1f, -1.2f};
  const Selection s = select(desc(Family::kDeepseekV3, 8, 2, true, 1.0, 2, 1), std::vector<double>(8, 0.0), bias);
  EXPECT_EQ(s.ids, (std::vector<int>{0, 1}));
  EXPECT_NEAR(s.weights[0], 0.5, 1e-15);  // unbiased scores 0.5 and 0.5, renormalised
  EXPECT_NEAR(s.weights[1], 0.5, 1e-15);
}

TEST(Routing, ZeroExpertsAreChosenLikeAnyOther) {
  // LongCat: 4 experts + 2 zero experts, softmax over all 6, top-2, scaling 2, no renorm.
  // logits ln(1, 1, 1, 1, 4, 2): scores (1, 1, 1, 1, 4, 2) / 10; ids 4 and 5 are zero experts.
  std::vector<double> logits = {0, 0, 0, 0, std::log(4.0), std::log(2.0)};
  const Selection s = select(desc(Family::kLongcatFlash, 4, 2, false, 2.0, 1, 1, 2), logits, std::vector<float>(6, 0.0f));
  EXPECT_EQ(s.ids, (std::vector<int>{4, 5}));
  EXPECT_NEAR(s.weights[0], 0.8, 1e-15);
  EXPECT_NEAR(s.weights[1], 0.4, 1e-15);
}

TEST(Routing, GptOssSoftmaxOverTheChosenLogits) {
  // top-2 of raw logits (1, 3, 2, 0) = experts 1, 2; weights softmax(3, 2) = (e, 1) / (e + 1).
  const Selection s = select(desc(Family::kGptOss, 4, 2), {1.0, 3.0, 2.0, 0.0});
  EXPECT_EQ(s.ids, (std::vector<int>{1, 2}));
  const double e = std::exp(1.0);
  EXPECT_NEAR(s.weights[0], e / (e + 1.0), 1e-15);
  EXPECT_NEAR(s.weights[1], 1.0 / (e + 1.0), 1e-15);
}

TEST(Routing, Llama4SigmoidOfTheTopLogit) {
  const Selection s = select(desc(Family::kLlama4, 3, 1), {0.5, -1.0, 2.0});
  EXPECT_EQ(s.ids, (std::vector<int>{2}));
  EXPECT_NEAR(s.weights[0], 1.0 / (1.0 + std::exp(-2.0)), 1e-15);
}

TEST(Routing, MinimaxRenormalisesUnbiasedSigmoid) {
  // Scores 0.2, 0.8, 0.6; bias +0.5 on expert 0 makes its key 0.7: chosen 1 (0.8), 0 (0.7).
  // Weights (0.8, 0.2) / 1.0, no scaling.
  std::vector<double> logits;
  for (double p : {0.2, 0.8, 0.6}) logits.push_back(logit_of(p));
  const Selection s = select(desc(Family::kMinimaxM2, 3, 2), logits, {0.5f, 0.0f, 0.0f});
  EXPECT_EQ(s.ids, (std::vector<int>{1, 0}));
  EXPECT_NEAR(s.weights[0], 0.8, 1e-12);
  EXPECT_NEAR(s.weights[1], 0.2, 1e-12);
}

TEST(Routing, RefusesMismatchedInputs) {
  const LayerDesc d = desc(Family::kDeepseekV3, 4, 2);
  std::vector<int> ids(2);
  std::vector<double> w(2);
  EXPECT_EQ(moe_select_reference(d, std::vector<double>(3), std::vector<float>(4), ids, w).message(),
            "3 router logits for 4 router outputs");
  EXPECT_EQ(moe_select_reference(d, std::vector<double>(4), std::vector<float>(2), ids, w).message(),
            "e_score_correction_bias has 2 values, the router has 4 outputs");
}

}  // namespace
}  // namespace moeinfer
