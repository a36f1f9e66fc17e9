// Backend-ops: every layer variant x weight format x token count, run on every backend and
// compared with the CPU reference (STYLE.md, after llama.cpp's test-backend-ops).
//
// Filter with gtest, e.g. --gtest_filter='*deepseek*nvfp4*'. Case names read
// <variant>_<format>_n<N>. Backends that this build or machine lacks are skipped with the
// reason printed; the Hugging Face mirror (tests/hf_mirror.h) always runs, so the reference
// itself is checked against an independent evaluation on every case.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "hf_mirror.h"
#include "moeinfer/backend.h"
#include "moeinfer/presets.h"
#include "moeinfer/reference.h"
#include "test_util.h"

namespace moeinfer {
namespace {

struct Variant {
  std::string name;
  Family family;
  FamilyShape shape;
  bool identical_tokens = false;  // every token the same: all of them on the same experts
};

// Small shapes with every routing variant of DESIGN.md section 2. Sizes are multiples of 16
// (NVFP4) but not of 128, so FP8 blocks are partial; experts outnumber routes at N = 1, so
// most experts receive no token.
std::vector<Variant> variants() {
  return {
      {"qwen3next", Family::kQwen3Next, {.hidden = 64, .intermediate = 48, .num_experts = 16, .top_k = 4, .shared_intermediate = 32}},
      {"qwen2moe", Family::kQwen2Moe, {.hidden = 48, .intermediate = 32, .num_experts = 12, .top_k = 3, .shared_intermediate = 64, .norm_topk_prob = false}},
      {"qwen3moe", Family::kQwen3Moe, {.hidden = 160, .intermediate = 144, .num_experts = 8, .top_k = 2}},
      {"olmoe", Family::kOlmoe, {.hidden = 32, .intermediate = 32, .num_experts = 16, .top_k = 8, .norm_topk_prob = false}},
      {"mixtral", Family::kMixtral, {.hidden = 48, .intermediate = 80, .num_experts = 8, .top_k = 2}},
      {"deepseek", Family::kDeepseekV3, {.hidden = 64, .intermediate = 32, .num_experts = 32, .top_k = 4, .shared_intermediate = 32, .routed_scaling_factor = 2.5, .n_group = 8, .topk_group = 3}},
      {"kimi", Family::kDeepseekV3, {.hidden = 64, .intermediate = 16, .num_experts = 24, .top_k = 6, .shared_intermediate = 16, .routed_scaling_factor = 2.827}},
      {"glm", Family::kGlm4Moe, {.hidden = 32, .intermediate = 48, .num_experts = 10, .top_k = 4, .shared_intermediate = 48, .routed_scaling_factor = 2.5}},
      {"minimax", Family::kMinimaxM2, {.hidden = 48, .intermediate = 32, .num_experts = 16, .top_k = 4}},
      {"longcat", Family::kLongcatFlash, {.hidden = 64, .intermediate = 32, .num_experts = 16, .top_k = 6, .num_zero_experts = 8, .norm_topk_prob = false, .routed_scaling_factor = 6.0}},
      {"gptoss", Family::kGptOss, {.hidden = 32, .intermediate = 48, .num_experts = 8, .top_k = 2}},
      {"llama4", Family::kLlama4, {.hidden = 64, .intermediate = 32, .num_experts = 8, .top_k = 1, .shared_intermediate = 32}},
      {"onexpert", Family::kLlama4, {.hidden = 32, .intermediate = 16, .num_experts = 4, .top_k = 1}, true},
      {"sametokens", Family::kDeepseekV3, {.hidden = 32, .intermediate = 16, .num_experts = 16, .top_k = 4, .routed_scaling_factor = 1.5, .n_group = 4, .topk_group = 2}, true},
  };
}

const std::vector<std::string> kFormats = {"bf16", "fp8-block", "fp8-channel", "fp8-tensor", "nvfp4"};
const std::vector<int64_t> kTokens = {1, 3, 19};

struct Case {
  Variant variant;
  std::string format;
  int64_t n;
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const Variant& v : variants()) {
    for (const std::string& f : kFormats) {
      for (int64_t n : kTokens) cases.push_back({v, f, n});
    }
  }
  cases.push_back({variants()[5], "nvfp4", 64});  // a larger batch on the grouped router
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string f = info.param.format;
  for (char& c : f) c = c == '-' ? '_' : c;
  return info.param.variant.name + "_" + f + "_n" + std::to_string(info.param.n);
}

class BackendOps : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    const LayerDesc desc = family_layer(c.variant.family, c.variant.shape);
    const QuantSpec spec = testing::take(parse_quant_spec(c.format));
    layer_ = std::make_unique<Layer>(testing::take(make_synthetic_layer(desc, spec, /*seed=*/7)));
    x_ = make_tokens(c.n, desc.hidden, /*seed=*/11 + static_cast<uint64_t>(c.n));
    if (c.variant.identical_tokens) {
      for (int64_t t = 1; t < c.n; ++t) {
        std::copy_n(x_.begin(), desc.hidden, x_.begin() + t * desc.hidden);
      }
    }
    expected_.assign(x_.size(), std::nanf(""));
    ASSERT_OK(moe_forward_reference(*layer_, x_, c.n, expected_));
    for (float v : expected_) ASSERT_TRUE(std::isfinite(v));
  }

  // Runs `forward` on poisoned output and checks every element was written, finite, and within
  // `tolerance` (relative L2) of the reference.
  template <class Forward>
  void check_against_reference(const std::string& who, double tolerance, Forward forward) {
    std::vector<float> out(x_.size(), std::nanf(""));  // poison
    ASSERT_OK(forward(out));
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_TRUE(std::isfinite(out[i])) << who << ": element " << i << " not written or not finite";
    }
    const double err = testing::rel_l2(out, expected_);
    EXPECT_LE(err, tolerance) << who << " disagrees with the reference";
  }

  std::unique_ptr<Layer> layer_;
  std::vector<float> x_;
  std::vector<float> expected_;
};

TEST_P(BackendOps, HfMirrorMatchesReference) {
  // Both evaluate in double from the same dequantized weights; only the summation order
  // differs, so they agree to ~1e-15 unless a route, weight or blend differs.
  check_against_reference("hf mirror", 1e-10, [&](std::span<float> out) {
    return testing::hf_mirror_forward(*layer_, x_, GetParam().n, out);
  });
}

TEST_P(BackendOps, EveryBackendMatchesReference) {
  std::string skipped;
  int ran = 0;
  for (const BackendAvailability& b : backend_availability()) {
    if (b.kind == BackendKind::kReference) continue;
    if (!b.available) {
      skipped += std::string(backend_name(b.kind)) + " (" + b.reason + "); ";
      continue;
    }
    std::unique_ptr<Backend> backend = testing::take(make_backend(b.kind));
    // Backends keep activations in bf16 between the projections: each rounding is off by at
    // most 2^-9 relative, a few of them in sequence, so 1e-2 relative L2 leaves ample room
    // while any wrong route (an expert's whole contribution) lands far above it.
    check_against_reference(backend_name(b.kind), 1e-2, [&](std::span<float> out) {
      return backend->forward(*layer_, x_, GetParam().n, out, nullptr);
    });
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no backend besides the reference is available: " << skipped;
}

INSTANTIATE_TEST_SUITE_P(Cases, BackendOps, ::testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace moeinfer
