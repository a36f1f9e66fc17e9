// Backend-ops: every layer variant x weight format x token count, run on every backend and
// compared with the CPU reference (STYLE.md, after llama.cpp's test-backend-ops).
//
// Filter with gtest, e.g. --gtest_filter='*deepseek*nvfp4*'. Case names read
// <variant>_<format>_n<N>. Backends that this build or machine lacks are skipped with the
// reason printed; the Hugging Face mirror (tests/hf_mirror.h) always runs, so the reference
// itself is checked against an independent evaluation on every case.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "cpu/moe_cpu.h"
#include "hf_mirror.h"
#include "moeinfer/backend.h"
#include "moeinfer/plan.h"
#include "moeinfer/presets.h"
#include "moeinfer/reference.h"
#include "test_util.h"
#include "test_main.h"

namespace moeinfer {
namespace {

struct Variant {
  std::string name;
  Family family;
  FamilyShape shape;
  bool identical_tokens = false;  // every token the same: all of them on the same experts
  std::vector<std::string> formats = {"bf16", "fp8-block", "fp8-channel", "fp8-tensor", "nvfp4"};
  std::string router_format = "bf16";  // the router is re-quantized to this
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
      // Not a multiple of 8 anywhere: token-major refuses it, per-row runs it. No NVFP4 (16).
      {"ragged", Family::kQwen2Moe, {.hidden = 100, .intermediate = 36, .num_experts = 6, .top_k = 2, .shared_intermediate = 20}, false,
       {"bf16", "fp8-block", "fp8-channel"}},
      // Expert-major's loop structure: several full chunks per warp (384 = 3 NVFP4 chunks of 128,
      // 6 FP8 chunks of 64, 12 BF16 chunks of 32) ...
      {"chunks", Family::kQwen3Next, {.hidden = 384, .intermediate = 256, .num_experts = 16, .top_k = 4, .shared_intermediate = 128}},
      // ... and ragged tails: 272 = 2 x 128 + 16 and 176 = 128 + 48 (16-column tail steps; NVFP4
      // rows of 136 bytes, so every other row is only 8-byte aligned), 8 experts of top-4 so
      // that N >= 64 puts more than 32 routes (one work item) on an expert.
      {"tails", Family::kDeepseekV3, {.hidden = 272, .intermediate = 176, .num_experts = 8, .top_k = 4, .shared_intermediate = 144, .routed_scaling_factor = 2.5}},
      // Router widths of the real models, for the CUDA route kernels (one warp per token, 8 and
      // 16 logits per lane) ...
      {"deepseek256", Family::kDeepseekV3, {.hidden = 64, .intermediate = 32, .num_experts = 256, .top_k = 8, .shared_intermediate = 32, .routed_scaling_factor = 2.5, .n_group = 8, .topk_group = 4}, false,
       {"bf16", "nvfp4"}},
      {"qwen512", Family::kQwen3Next, {.hidden = 64, .intermediate = 32, .num_experts = 512, .top_k = 10, .shared_intermediate = 32}, false,
       {"bf16", "nvfp4"}},
      {"longcat768", Family::kLongcatFlash, {.hidden = 64, .intermediate = 32, .num_experts = 512, .top_k = 12, .num_zero_experts = 256, .norm_topk_prob = false, .routed_scaling_factor = 6.0}, false,
       {"bf16", "nvfp4"}},
      // ... and past them (768 and 1040 logits): one block per token, then a separate grouping
      // kernel.
      {"experts1040", Family::kQwen3Moe, {.hidden = 32, .intermediate = 16, .num_experts = 1040, .top_k = 3}, false,
       {"bf16", "nvfp4"}},
      // Quantized routers (the router kernel decodes any format).
      {"nvfp4router", Family::kQwen3Next, {.hidden = 64, .intermediate = 32, .num_experts = 16, .top_k = 4, .shared_intermediate = 32}, false,
       {"nvfp4"}, "nvfp4"},
      {"fp8router", Family::kDeepseekV3, {.hidden = 160, .intermediate = 32, .num_experts = 16, .top_k = 4, .routed_scaling_factor = 2.5, .n_group = 4, .topk_group = 2}, false,
       {"bf16"}, "fp8-block"},
  };
}

// The token counts of the CUDA issue: decode sizes, odd sizes, and every power of two to 128;
// 37 runs the CUDA router's wide kernel (router_logits_wide: longcat768 and experts1040 on an
// H200) with a partial block of tokens.
const std::vector<int64_t> kTokens = {1, 2, 3, 4, 7, 8, 16, 19, 32, 37, 64, 128};

struct Case {
  Variant variant;
  std::string format;
  int64_t n;
};

// gtest prints this instead of the bytes of a Case.
void PrintTo(const Case& c, std::ostream* os) { *os << c.variant.name << " " << c.format << " n=" << c.n; }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const Variant& v : variants()) {
    for (const std::string& f : v.formats) {
      for (int64_t n : kTokens) cases.push_back({v, f, n});
    }
  }
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string f = info.param.format;
  for (char& c : f) c = c == '-' ? '_' : c;
  return info.param.variant.name + "_" + f + "_n" + std::to_string(info.param.n);
}

// One case: its layer, tokens and the reference output, made once per test.
struct Fixture {
  std::unique_ptr<Layer> layer;
  std::vector<float> x;
  std::vector<float> expected;
};

// token_seed > 0 draws other tokens for the same case.
Fixture make_fixture(const Case& c, uint64_t token_seed = 0) {
  Fixture f;
  const LayerDesc desc = family_layer(c.variant.family, c.variant.shape);
  const QuantSpec spec = testing::take(parse_quant_spec(c.format));
  f.layer = std::make_unique<Layer>(testing::take(make_synthetic_layer(desc, spec, /*seed=*/7)));
  if (c.variant.router_format != "bf16") {
    const QuantMatrix& r = f.layer->router;
    f.layer->router = testing::take(
        QuantMatrix::quantize(r.dequantize(), r.rows, r.cols, testing::take(parse_quant_spec(c.variant.router_format))));
  }
  f.x = make_tokens(c.n, desc.hidden, /*seed=*/11 + static_cast<uint64_t>(c.n) + 1000 * token_seed);
  if (c.variant.identical_tokens) {
    for (int64_t t = 1; t < c.n; ++t) std::copy_n(f.x.begin(), desc.hidden, f.x.begin() + t * desc.hidden);
  }
  f.expected.assign(f.x.size(), std::nanf(""));
  const Status s = moe_forward_reference(*f.layer, f.x, c.n, f.expected);
  EXPECT_TRUE(s.ok()) << s.to_string();
  for (float v : f.expected) EXPECT_TRUE(std::isfinite(v));
  return f;
}

// Runs `forward` on a poisoned output and checks every element was written, finite, and
// within `tolerance` (relative L2) of the reference.
template <class Forward>
void check_against_reference(const Fixture& f, const std::string& who, double tolerance, Forward forward) {
  std::vector<float> out(f.x.size(), std::nanf(""));  // poison
  const Status s = forward(out);
  ASSERT_TRUE(s.ok()) << who << ": " << s.to_string();
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(std::isfinite(out[i])) << who << ": element " << i << " not written or not finite";
  }
  EXPECT_LE(testing::rel_l2(out, f.expected), tolerance) << who << " disagrees with the reference";
}

class HfMirror : public ::testing::TestWithParam<Case> {};

TEST_P(HfMirror, MatchesReference) {
  // Both evaluate in double from the same dequantized weights; only the summation order
  // differs, so they agree to ~1e-15 unless a route, weight or blend differs.
  const Fixture f = make_fixture(GetParam());
  check_against_reference(f, "hf mirror", 1e-10, [&](std::span<float> out) {
    return testing::hf_mirror_forward(*f.layer, f.x, GetParam().n, out);
  });
}

INSTANTIATE_TEST_SUITE_P(BackendOps, HfMirror, ::testing::ValuesIn(all_cases()), case_name);

class BackendCase : public ::testing::Test {
 public:
  BackendCase(BackendKind kind, std::optional<PathKind> path, Case c) : kind_(kind), path_(path), case_(std::move(c)) {}
  void TestBody() override {
    const Fixture f = make_fixture(case_);
    std::unique_ptr<Backend> backend = testing::take(make_backend(kind_, BackendOptions{path_}));
    // Tolerance for bf16 activations: a backend may round x, the gate/up outputs and the
    // activation to bf16 (2^-9 relative each, at most). Three roundings in sequence give about
    // sqrt(3) * 2^-9 ~ 3.4e-3 relative L2 (independent errors, averaged over K-term sums), so
    // 1e-2 leaves room, while one wrong route (a whole expert's contribution, O(1/k) of the
    // output) lands far above it. Token-major and per-row keep fp32 activations (~1e-6 here);
    // expert-major rounds x and the activation to bf16 for the tensor cores (~2e-3).
    check_against_reference(f, backend_name(kind_), 1e-2, [&](std::span<float> out) {
      return backend->forward(*f.layer, f.x, case_.n, out, nullptr);
    });
  }

 private:
  BackendKind kind_;
  std::optional<PathKind> path_;
  Case case_;
};

// The CPU backend runs a call's experts in batches of kCpuRoutesPerBatch routes, the shared
// expert with the last batch: calls past one batch (different tokens, and every token on the same
// experts, so that one expert's routes cross the limit) against the reference. The CPU backend
// keeps fp32 activations (about 1e-6 relative L2 from the reference here), so 1e-4 is the bound;
// a route or a batch's output added twice or not at all lands far above it.
TEST(BackendOpsCpu, CallsPastOneBatchMatchTheReference) {
  constexpr int64_t kN = 600;  // 2400 routes at top 4: three batches
  for (const Variant& v : variants()) {
    if (v.name != "qwen3next" && v.name != "deepseek" && v.name != "sametokens") continue;
    const LayerDesc desc = family_layer(v.family, v.shape);
    ASSERT_GT(kN * desc.top_k, 2 * kCpuRoutesPerBatch) << v.name;
    for (const std::string format : {"bf16", "nvfp4"}) {
      const Fixture f = make_fixture(Case{v, format, kN});
      std::unique_ptr<Backend> cpu = testing::take(make_backend(BackendKind::kCpu, BackendOptions{}));
      check_against_reference(f, v.name + " " + format, 1e-4, [&](std::span<float> out) {
        return cpu->forward(*f.layer, f.x, kN, out, nullptr);
      });
    }
  }
}

// The CPU backend keeps its buffers from call to call. One backend object runs calls of several
// layers, sizes and formats in turn, and the same case twice with other tokens; each output is
// poisoned and compared with the reference. A buffer element that a call did not rewrite would
// carry an earlier call's values into a later one.
TEST(BackendOpsCpu, OneBackendCallAfterCallMatchesTheReference) {
  struct Step {
    std::string variant, format;
    int64_t n;
    uint64_t token_seed;
  };
  const std::vector<Step> steps = {{"deepseek", "nvfp4", 600, 0}, {"qwen3next", "bf16", 3, 0},
                                   {"qwen3next", "bf16", 3, 1},   {"tails", "fp8-block", 64, 0},
                                   {"deepseek", "nvfp4", 5, 0},   {"deepseek", "nvfp4", 5, 1},
                                   {"qwen3next", "bf16", 600, 0}, {"deepseek", "nvfp4", 1, 0}};
  std::unique_ptr<Backend> cpu = testing::take(make_backend(BackendKind::kCpu, BackendOptions{}));
  const std::vector<Variant> all = variants();
  for (const Step& step : steps) {
    const auto v = std::find_if(all.begin(), all.end(), [&](const Variant& x) { return x.name == step.variant; });
    ASSERT_NE(v, all.end()) << step.variant;
    const Fixture f = make_fixture(Case{*v, step.format, step.n}, step.token_seed);
    check_against_reference(f, fmt::format("{} {} n={} tokens {}", step.variant, step.format, step.n, step.token_seed),
                            1e-4, [&](std::span<float> out) { return cpu->forward(*f.layer, f.x, step.n, out, nullptr); });
  }
}

// Absent backends get one loud skip with the reason, instead of a skip per case.
TEST(BackendOps, UnavailableBackends) {
  std::string missing;
  for (const BackendAvailability& b : backend_availability()) {
    if (!b.available) missing += std::string(backend_name(b.kind)) + ": " + b.reason + "; ";
  }
  if (!missing.empty()) GTEST_SKIP() << "backends not tested here: " << missing;
}

}  // namespace

// Registers BackendOps_<backend>.<case> for every backend this build and machine have, so the
// same test binary runs the GPU cases where a GPU is present.
// A CUDA backend is registered once per path, each forced, on the cases its plan accepts
// (plan refusals are tested in test_plan.cpp).
void register_backend_ops_tests() {
  for (const BackendAvailability& b : backend_availability()) {
    if (!b.available || b.kind == BackendKind::kReference) continue;
    std::vector<std::optional<PathKind>> paths = {std::nullopt};
    if (b.kind == BackendKind::kCuda) paths = {PathKind::kExpertMajor, PathKind::kTokenMajor, PathKind::kPerRow};
    for (const std::optional<PathKind>& path : paths) {
      std::string suite = std::string("BackendOps_") + backend_name(b.kind);
      if (path) suite += std::string("_") + path_name(*path);
      for (char& ch : suite) ch = ch == '-' ? '_' : ch;
      for (const Case& c : all_cases()) {
        if (path) {
          const LayerDesc desc = family_layer(c.variant.family, c.variant.shape);
          if (!plan_cuda(desc, testing::take(parse_quant_spec(c.format)), c.n, DeviceDesc{}, path).ok()) continue;
        }
        const std::string name = case_name(::testing::TestParamInfo<Case>(c, 0));
        ::testing::RegisterTest(suite.c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                                [kind = b.kind, path, c]() -> ::testing::Test* { return new BackendCase(kind, path, c); });
      }
    }
  }
}

}  // namespace moeinfer
