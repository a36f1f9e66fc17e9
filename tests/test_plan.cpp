// plan(): which CUDA path runs a layer, why, and the named refusals.
#include <gtest/gtest.h>

#include "moeinfer/plan.h"
#include "test_util.h"

namespace moeinfer {
namespace {

using testing::take;

LayerDesc qwen3next(int64_t hidden = 2048, int64_t inter = 512) {
  return family_layer(Family::kQwen3Next, {.hidden = hidden, .intermediate = inter, .num_experts = 512, .top_k = 10,
                                           .shared_intermediate = 512});
}

TEST(Plan, ExpertMajorForAlignedShapes) {
  const Plan p = take(plan_cuda(qwen3next(), {WeightFormat::kNVFP4}, 8, DeviceDesc{9, 0}));
  EXPECT_EQ(p.path, PathKind::kExpertMajor);
  EXPECT_EQ(p.path_for(1), kExpertMajorCrossover > 1 ? PathKind::kTokenMajor : PathKind::kExpertMajor);
  EXPECT_EQ(p.path_for(8), kExpertMajorCrossover > 8 ? PathKind::kTokenMajor : PathKind::kExpertMajor);
  EXPECT_EQ(p.max_tokens, 8);
  EXPECT_NE(p.explain().find("expert-major"), std::string::npos) << p.explain();
  EXPECT_NE(p.explain().find("top-10 routes"), std::string::npos) << p.explain();
}

TEST(Plan, TokenMajorWhenExpertMajorCannot) {
  // 520 = 8 x 65: a multiple of 8 (token-major) but not of 16 (expert-major). BF16 has no
  // group of 16 to respect.
  const Plan p = take(plan_cuda(qwen3next(2048, 520), {WeightFormat::kBF16}, 8, DeviceDesc{9, 0}));
  EXPECT_EQ(p.path, PathKind::kTokenMajor);
  EXPECT_EQ(p.path_for(1), PathKind::kTokenMajor);
  EXPECT_NE(p.explain().find("expert-major refused: moe_intermediate_size 520 is not a multiple of 16"),
            std::string::npos)
      << p.explain();
  EXPECT_NE(p.explain().find("80 routes"), std::string::npos) << p.explain();
}

TEST(Plan, PerRowWhenNeitherCan) {
  const Plan p = take(plan_cuda(qwen3next(100, 36), {WeightFormat::kBF16}, 4, DeviceDesc{}));
  EXPECT_EQ(p.path, PathKind::kPerRow);
  EXPECT_NE(p.explain().find("hidden_size 100 is not a multiple of 8"), std::string::npos) << p.explain();
}

TEST(Plan, ForcedPathsAndNamedRefusals) {
  const Plan forced = take(plan_cuda(qwen3next(), {WeightFormat::kFP8}, 4, DeviceDesc{}, PathKind::kPerRow));
  EXPECT_EQ(forced.path, PathKind::kPerRow);
  EXPECT_NE(forced.explain().find("forced"), std::string::npos);

  const Result<Plan> refused = plan_cuda(qwen3next(100, 36), {WeightFormat::kBF16}, 4, DeviceDesc{}, PathKind::kTokenMajor);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(refused.status().message(),
            "path token-major cannot run this layer: hidden_size 100 is not a multiple of 8 (token-major loads 8 "
            "weights at a time)");
  EXPECT_EQ(plan_cuda(qwen3next(2048, 520), {WeightFormat::kBF16}, 4, DeviceDesc{}, PathKind::kExpertMajor).status().message(),
            "path expert-major cannot run this layer: moe_intermediate_size 520 is not a multiple of 16 (expert-major "
            "runs 16 x 16 MMA tiles)");

  EXPECT_EQ(plan_cuda(qwen3next(), {WeightFormat::kNVFP4}, 4, DeviceDesc{8, 0}).status().message(),
            "the CUDA paths are built for sm_90a (Hopper); this device is sm_80");
  EXPECT_EQ(plan_cuda(qwen3next(), {WeightFormat::kNVFP4}, 0, DeviceDesc{}).status().message(),
            "max_tokens must be positive (got 0)");
  LayerDesc wide = qwen3next();
  wide.num_experts = 5000;
  EXPECT_EQ(plan_cuda(wide, {WeightFormat::kNVFP4}, 1, DeviceDesc{}).status().message(),
            "router of 5000 outputs: the CUDA router holds at most 4096");
  EXPECT_EQ(plan_cuda(qwen3next(100), {WeightFormat::kNVFP4}, 1, DeviceDesc{}).status().message(),
            "hidden_size 100 is not a multiple of the NVFP4 group 16");
}

TEST(Plan, ParsesPathNames) {
  EXPECT_EQ(take(parse_path("per-row")), PathKind::kPerRow);
  EXPECT_EQ(take(parse_path("token-major")), PathKind::kTokenMajor);
  EXPECT_EQ(take(parse_path("expert-major")), PathKind::kExpertMajor);
  EXPECT_EQ(parse_path("grouped").status().message(),
            "unknown path 'grouped' (expected expert-major, token-major or per-row)");
}

}  // namespace
}  // namespace moeinfer

#include "moeinfer/ep.h"

namespace moeinfer {
namespace {

TEST(ExpertSlice, ContiguousAndAsEvenAsPossible) {
  // 10 experts over 3 ranks: 4, 3, 3.
  EXPECT_EQ(expert_slice(10, 0, 3).begin, 0);
  EXPECT_EQ(expert_slice(10, 0, 3).end, 4);
  EXPECT_EQ(expert_slice(10, 1, 3).begin, 4);
  EXPECT_EQ(expert_slice(10, 1, 3).end, 7);
  EXPECT_EQ(expert_slice(10, 2, 3).begin, 7);
  EXPECT_EQ(expert_slice(10, 2, 3).end, 10);
  // More ranks than experts: the last rank owns nothing.
  EXPECT_EQ(expert_slice(2, 2, 3).begin, expert_slice(2, 2, 3).end);
  EXPECT_TRUE(expert_slice(2, 1, 3).owns(1));
  EXPECT_FALSE(expert_slice(2, 1, 3).owns(0));
  // One rank owns everything; a bad rank owns nothing.
  EXPECT_EQ(expert_slice(7, 0, 1).end, 7);
  EXPECT_EQ(expert_slice(7, 3, 2).end, 0);
}

}  // namespace
}  // namespace moeinfer
