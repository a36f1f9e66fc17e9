// Invalid layer descriptions are refused with a message that names the problem.
#include <gtest/gtest.h>

#include "moeinfer/layer.h"
#include "test_util.h"

namespace moeinfer {
namespace {

LayerDesc good() {
  return family_layer(Family::kDeepseekV3, {.hidden = 256, .intermediate = 128, .num_experts = 16, .top_k = 4,
                                            .shared_intermediate = 128, .routed_scaling_factor = 2.5,
                                            .n_group = 4, .topk_group = 2});
}

std::string error_of(const LayerDesc& d, QuantSpec spec = {WeightFormat::kBF16}) {
  const Status s = validate(d, spec);
  return s.ok() ? "ok" : s.message();
}

TEST(Validate, AcceptsAGoodDescription) { EXPECT_EQ(error_of(good(), {WeightFormat::kNVFP4}), "ok"); }

TEST(Validate, TopKLargerThanExperts) {
  LayerDesc d = family_layer(Family::kMixtral, {.hidden = 64, .intermediate = 64, .num_experts = 8, .top_k = 12});
  EXPECT_EQ(error_of(d), "top_k (12) > num_experts (8)");
  d.num_zero_experts = 2;
  EXPECT_EQ(error_of(d), "top_k (12) > num_experts + zero experts (8 + 2 = 10)");
  d.top_k = 0;
  EXPECT_EQ(error_of(d), "top_k must be positive (got 0)");
}

TEST(Validate, Nvfp4NeedsMultiplesOf16) {
  LayerDesc d = good();
  d.hidden = 100;
  EXPECT_EQ(error_of(d, {WeightFormat::kNVFP4}), "hidden_size 100 is not a multiple of the NVFP4 group 16");
  EXPECT_EQ(error_of(d, {WeightFormat::kFP8}), "ok");  // FP8 blocks may be partial
  d = good();
  d.intermediate = 72;
  EXPECT_EQ(error_of(d, {WeightFormat::kNVFP4}), "moe_intermediate_size 72 is not a multiple of the NVFP4 group 16");
  d = good();
  d.shared_intermediate = 40;
  EXPECT_EQ(error_of(d, {WeightFormat::kNVFP4}),
            "shared_expert_intermediate_size 40 is not a multiple of the NVFP4 group 16");
}

TEST(Validate, Shapes) {
  LayerDesc d = good();
  d.hidden = 0;
  EXPECT_EQ(error_of(d), "hidden_size must be in [1, 1048576] (got 0)");
  d = good();
  d.intermediate = -3;
  EXPECT_EQ(error_of(d), "moe_intermediate_size must be in [1, 1048576] (got -3)");
  d = good();
  d.num_experts = 0;
  EXPECT_EQ(error_of(d), "num_experts must be in [1, 65536] (got 0)");
  d = good();
  d.num_zero_experts = -1;
  EXPECT_EQ(error_of(d), "zero_expert_num must be in [0, 65536] (got -1)");
  d = good();
  d.shared_intermediate = 0;
  d.shared_gate = true;
  EXPECT_EQ(error_of(d), "shared_gate is set but there is no shared expert (shared_intermediate 0)");
}

TEST(Validate, GroupLimitedRouting) {
  LayerDesc d = good();
  d.routing.topk_group = 5;
  EXPECT_EQ(error_of(d), "topk_group (5) must be in [1, n_group (4)]");
  d = good();
  d.num_experts = 18;
  EXPECT_EQ(error_of(d), "num_experts (18) is not a multiple of n_group (4)");
  d = good();
  d.num_experts = 4;
  d.top_k = 1;
  EXPECT_EQ(error_of(d),
            "group-limited routing scores a group by its 2 best experts, but num_experts (4) / n_group (4) = 1");
  d = good();
  d.top_k = 9;  // 2 groups of 4 experts leave 8 candidates
  EXPECT_EQ(error_of(d), "top_k (9) > topk_group (2) x experts per group (4) = 8");
  d = good();
  d.num_zero_experts = 4;
  const Status s = validate(d);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_EQ(s.message(), "group-limited routing (n_group 4) with zero experts (4)");
}

TEST(Validate, RoutingCombinations) {
  LayerDesc d = good();
  d.routing.scaling = 0.0;
  EXPECT_EQ(error_of(d), "routed_scaling_factor must be positive and finite (got 0)");
  d = good();
  d.routing.renorm_epsilon = -1.0;
  EXPECT_EQ(error_of(d), "renormalisation epsilon must be >= 0 (got -1)");
  d = good();
  d.routing.score = ScoreFunc::kLogits;
  EXPECT_EQ(error_of(d), "score function 'logits' needs weights 'softmax_of_selected' or 'sigmoid_of_selected'");
  d = good();
  d.routing.weight = WeightFunc::kSoftmaxOfSelected;
  EXPECT_EQ(validate(d).code(), StatusCode::kUnsupported);
  EXPECT_EQ(error_of(d), "weights 'softmax_of_selected' with score function 'sigmoid': no model routes this way");
}

TEST(Validate, GptOssLimit) {
  LayerDesc d = family_layer(Family::kGptOss, {.hidden = 64, .intermediate = 64, .num_experts = 8, .top_k = 2});
  EXPECT_EQ(error_of(d), "ok");
  d.swiglu_limit = 0.0f;
  EXPECT_EQ(error_of(d), "swiglu_limit must be positive (got 0)");
}

TEST(FamilyLayer, EncodesEachFamilysRouting) {
  const FamilyShape s{.hidden = 64, .intermediate = 32, .num_experts = 8, .top_k = 2, .shared_intermediate = 32,
                      .norm_topk_prob = false, .routed_scaling_factor = 2.0};
  const LayerDesc qwen2 = family_layer(Family::kQwen2Moe, s);
  EXPECT_EQ(qwen2.routing.score, ScoreFunc::kSoftmax);
  EXPECT_FALSE(qwen2.routing.renormalize);
  EXPECT_TRUE(qwen2.shared_gate);
  const LayerDesc mixtral = family_layer(Family::kMixtral, s);
  EXPECT_TRUE(mixtral.routing.renormalize);  // Mixtral always renormalises
  const LayerDesc ds = family_layer(Family::kDeepseekV3, s);
  EXPECT_EQ(ds.routing.score, ScoreFunc::kSigmoid);
  EXPECT_TRUE(ds.routing.correction_bias);
  EXPECT_EQ(ds.routing.renorm_epsilon, 1e-20);
  EXPECT_EQ(ds.routing.scaling, 2.0);
  EXPECT_FALSE(ds.shared_gate);
  const LayerDesc minimax = family_layer(Family::kMinimaxM2, s);
  EXPECT_TRUE(minimax.routing.renormalize);
  EXPECT_EQ(minimax.routing.scaling, 1.0);
  const LayerDesc longcat = family_layer(Family::kLongcatFlash, s);
  EXPECT_FALSE(longcat.routing.renormalize);
  EXPECT_EQ(longcat.routing.scaling, 2.0);
  const LayerDesc gptoss = family_layer(Family::kGptOss, s);
  EXPECT_EQ(gptoss.routing.weight, WeightFunc::kSoftmaxOfSelected);
  EXPECT_TRUE(gptoss.routing.router_bias);
  EXPECT_TRUE(gptoss.expert_bias);
  EXPECT_EQ(gptoss.activation, Activation::kGptOssClamped);
  const LayerDesc llama4 = family_layer(Family::kLlama4, s);
  EXPECT_TRUE(llama4.routing.weight_on_input);
  EXPECT_EQ(llama4.routing.weight, WeightFunc::kSigmoidOfSelected);
}

}  // namespace
}  // namespace moeinfer
