// CUDA-only tests: graph capture and replay, and the device-level API's refusals. Built when
// the CUDA backend is; skipped, with the reason, on a machine without a usable GPU.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <tuple>

#include "cuda/moe_kernels.cuh"
#include "cuda/nvfp4_scale_fold.h"

#include "moeinfer/backend.h"
#include "moeinfer/bench.h"
#include "moeinfer/cuda.h"
#include "moeinfer/ep.h"
#include "moeinfer/presets.h"
#include "moeinfer/reference.h"
#include "cuda_route_select.h"
#include "cuda_smem_poison.h"
#include "ep_cases.h"
#include "test_util.h"

namespace moeinfer {
namespace {

using testing::take;

template <class T>
struct DeviceArray {
  explicit DeviceArray(size_t n) : size(n) { EXPECT_EQ(cudaMalloc(&ptr, n * sizeof(T)), cudaSuccess); }
  ~DeviceArray() { cudaFree(ptr); }
  void put(const std::vector<T>& v) { ASSERT_EQ(cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<T> get() const {
    std::vector<T> v(size);
    EXPECT_EQ(cudaMemcpy(v.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  void poison() { ASSERT_EQ(cudaMemset(ptr, 0xFF, size * sizeof(T)), cudaSuccess); }  // 0xFFFFFFFF is a NaN
  T* ptr = nullptr;
  size_t size;
};

// One call's inputs: n tokens of H from `seed` (make_tokens), the reference's output for them
// (`reference` says whether it ran), and device buffers of n x H: x holding the tokens, out.
struct CallInputs {
  CallInputs(const Layer& layer, int64_t n, uint64_t seed)
      : tokens(make_tokens(n, layer.desc.hidden, seed)), expected(tokens.size()), x(tokens.size()), out(tokens.size()) {
    reference = moe_forward_reference(layer, tokens, n, expected);
    x.put(tokens);
  }
  std::vector<float> tokens, expected;
  DeviceArray<float> x, out;
  Status reference;
};

// One replay of `exec` and one eager call of `moe` on the input already in x, each into a
// poisoned `out`: the two must agree bit for bit. Returns the replay's output.
std::vector<float> replay_matching_eager(cudaGraphExec_t exec, cudaStream_t stream, const CudaMoe& moe,
                                         const DeviceArray<float>& x, DeviceArray<float>& out, int64_t n, uint64_t seed) {
  out.poison();
  EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> replayed = out.get();
  out.poison();
  EXPECT_TRUE(moe.forward(x.ptr, n, out.ptr, stream).ok());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<float> eager = out.get();
  EXPECT_EQ(std::memcmp(replayed.data(), eager.data(), eager.size() * sizeof(float)), 0) << "seed " << seed;
  return replayed;
}

// A stream with a CUDA graph captured on it, all three released when the test ends.
struct CapturedGraph {
  CapturedGraph() = default;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

// Creates g's stream (with `stream_flags`) and captures on it what `record(stream)` enqueues.
template <class Record>
void capture(CapturedGraph& g, unsigned stream_flags, Record record) {
  ASSERT_EQ(cudaStreamCreateWithFlags(&g.stream, stream_flags), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  record(g.stream);
  ASSERT_EQ(cudaStreamEndCapture(g.stream, &g.graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&g.exec, g.graph, 0), cudaSuccess);
}

// For each seed, new tokens in x, one replay of g matching an eager call (replay_matching_eager)
// and the reference within 1e-2.
void expect_replays_match(const CapturedGraph& g, const CudaMoe& moe, const Layer& layer, DeviceArray<float>& x,
                          DeviceArray<float>& out, int64_t n, uint64_t first_seed, uint64_t last_seed) {
  for (uint64_t seed = first_seed; seed <= last_seed; ++seed) {
    const std::vector<float> tokens = make_tokens(n, layer.desc.hidden, seed);
    x.put(tokens);
    const std::vector<float> replayed = replay_matching_eager(g.exec, g.stream, moe, x, out, n, seed);
    std::vector<float> expected(tokens.size());
    ASSERT_OK(moe_forward_reference(layer, tokens, n, expected));
    EXPECT_LE(testing::rel_l2(replayed, expected), 1e-2) << "seed " << seed;
  }
}

// Options that force the tensor-core router on or off, the rest left to the defaults.
CudaMoeOptions router_options(bool mma) {
  CudaMoeOptions options;
  options.router_mma = mma;
  return options;
}

// Block scale code b of `m` made negative (b % 3 == 1, its codes' signs flipped: the values stay)
// or zero (b % 7 == 5, 0x00 or 0x80, over the codes it had: those blocks' values become zero).
void sign_and_zero_scales(QuantMatrix& m) {
  for (size_t b = 0; b < m.block_scales.size(); ++b) {
    uint8_t& s = m.block_scales[b];
    if (b % 7 == 5) {
      s = b % 2 == 0 ? 0x00 : 0x80;
    } else if (b % 3 == 1) {
      s = static_cast<uint8_t>(s | 0x80u);
      for (size_t i = 0; i < 8; ++i) m.data[8 * b + i] ^= 0x88u;
    }
  }
}

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const BackendAvailability& b : backend_availability()) {
      if (b.kind == BackendKind::kCuda && !b.available) GTEST_SKIP() << "no usable GPU: " << b.reason;
    }
  }
};

// n = 8: the route kernel is one block; n = 24: three blocks as one cluster (route_warps_clustered).
TEST_F(Cuda, GraphReplayWithNewInputsEqualsEager) {
  const LayerDesc d = family_layer(Family::kQwen3Next, {.hidden = 128, .intermediate = 64, .num_experts = 32, .top_k = 4,
                                                        .shared_intermediate = 64});
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 3));
  for (const int64_t n : {8, 24}) {
    SCOPED_TRACE(fmt::format("n {}", n));
    const int64_t h = d.hidden;
    std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, n));
    DeviceArray<float> x(n * h), out(n * h);

    // Capture once, for the padded N.
    x.put(make_tokens(n, h, 100));
    CapturedGraph g;
    ASSERT_NO_FATAL_FAILURE(
        capture(g, cudaStreamDefault, [&](cudaStream_t s) { ASSERT_OK(moe->forward(x.ptr, n, out.ptr, s)); }));

    std::set<std::vector<int>> routings;
    for (uint64_t seed = 1; seed <= 4; ++seed) {
      // New tokens, and so new routing; batch 1 is 5 real tokens padded with zeros to n.
      std::vector<float> tokens = make_tokens(n, h, seed);
      const int64_t real = seed == 1 ? 5 : n;
      std::fill(tokens.begin() + real * h, tokens.end(), 0.0f);
      x.put(tokens);
      const std::vector<float> replayed = replay_matching_eager(g.exec, g.stream, *moe, x, out, n, seed);

      const std::vector<float> real_tokens(tokens.begin(), tokens.begin() + real * h);
      std::vector<float> expected(real_tokens.size());
      ASSERT_OK(moe_forward_reference(layer, real_tokens, real, expected));
      const std::vector<float> got(replayed.begin(), replayed.begin() + real * h);
      EXPECT_LE(testing::rel_l2(got, expected), 1e-2) << "seed " << seed;
      routings.insert(take(moe_route_reference(layer, real_tokens, real)).ids);
    }
    EXPECT_EQ(routings.size(), 4u) << "the replays should have routed differently";
  }
}

TEST_F(Cuda, ForwardRefusesCallsOutsideItsPlan) {
  const LayerDesc d = family_layer(Family::kMixtral, {.hidden = 64, .intermediate = 32, .num_experts = 4, .top_k = 2});
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kBF16}, 1));
  std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, 4));
  DeviceArray<float> x(8 * 64), out(8 * 64);
  EXPECT_EQ(moe->forward(x.ptr, 5, out.ptr, nullptr).message(), "5 tokens: this CudaMoe was planned for 1 to 4");
  EXPECT_EQ(moe->forward(x.ptr, 0, out.ptr, nullptr).message(), "0 tokens: this CudaMoe was planned for 1 to 4");
  EXPECT_EQ(moe->forward(nullptr, 1, out.ptr, nullptr).message(), "forward: null input or output pointer");
  const Status misaligned = moe->forward(x.ptr + 1, 1, out.ptr, nullptr);
  EXPECT_EQ(misaligned.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(misaligned.message().find("is not 16-byte aligned; hidden size 64 is read 16 bytes at a time"), std::string::npos)
      << misaligned.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // nothing was launched
}

// The expert-major GEMMs with one token tile per item run as split-K kernels (16 rows per block,
// 4 warps splitting K) or staged ones (64 rows per block, a warp per 16 rows over the whole K,
// activations staged in shared memory). Both, forced, must match the reference, and each other
// to well within it: only the order of the fp32 sums differs. Two shapes:
// - ragged: row groups that 64 does not divide (gate_up 176 rows, down 272, a shared expert of
//   144, so some warps run past the rows and must store nothing), K tails for every format, and
//   K % 32 == 16 everywhere (NVFP4 rows 8 bytes off 16-byte alignment);
// - aligned, as in the real models: K = 384 and 256 (whole 128-column chunks, NVFP4 rows
//   16-byte aligned, no tails), 64-row groups;
// - long down: K = 2048 for the routed experts' down, 1920 for the shared expert's, so NVFP4
//   scale codes are staged in shared memory too, sized for the longer;
// - sliced (K past 3008, activations staged 1024 columns at a time): gate_up at K = 3088 (K % 32
//   == 16, its tail the only columns of the last slice) and at K = 4096 (whole slices); down at
//   K = 3200 for the routed experts (the last slice one NVFP4 chunk) and 2112 for the shared
//   expert (fewer slices than the launch is sized for, its tail again a slice of its own);
// - two-tile slices: gate_up at K = 1152, which stages whole but whose two-tile gate_up stages
//   512 columns at a time: two whole slices and a last one of one NVFP4 chunk.
// Calls keep one token tile per item below N = 16. From it (8 routes per expert on average), where
// the down stages whole, they run two (N = 24: some items fill one tile, the shared expert's 24
// routes make a full item and a partial one; N = 32: 16 routes per expert on average), gate_up
// staged in slices (at K = 3088 and 4096 too); where the down stages in slices N = 16 keeps one,
// and with the staged kernels forbidden, N = 24 and 32 run 4 token tiles, split-K.
// The staged calls run three times: down blocks of one pass of 64 rows, of two and of four passes
// over one staging (except the sliced and scale-copying kernels, which make one; gate_up always
// one). The ragged shape's 272 down rows leave the last two- and four-pass blocks a partial first
// pass (16 rows) and no other; at 384 rows the last four-pass block makes two of its four passes.
// NVFP4 layers run the staged kernels whose K loops load two chunks ahead (all but the
// scale-copying and the sliced ones), FP8 and BF16 layers those one ahead.
TEST_F(Cuda, ExpertMajorStagedAndSplitKernelsAgree) {
  const LayerDesc ragged = family_layer(Family::kDeepseekV3, {.hidden = 272, .intermediate = 176, .num_experts = 8,
                                                              .top_k = 4, .shared_intermediate = 144,
                                                              .routed_scaling_factor = 2.5});
  const LayerDesc aligned = family_layer(Family::kQwen3Next, {.hidden = 384, .intermediate = 256, .num_experts = 8,
                                                              .top_k = 4, .shared_intermediate = 128});
  const LayerDesc long_down = family_layer(Family::kQwen3Next, {.hidden = 128, .intermediate = 2048, .num_experts = 8,
                                                                .top_k = 4, .shared_intermediate = 1920});
  const LayerDesc sliced_gate_up = family_layer(Family::kDeepseekV3, {.hidden = 3088, .intermediate = 128, .num_experts = 8,
                                                                      .top_k = 4, .shared_intermediate = 64,
                                                                      .routed_scaling_factor = 2.5});
  const LayerDesc sliced_aligned = family_layer(Family::kQwen3Next, {.hidden = 4096, .intermediate = 64, .num_experts = 8,
                                                                     .top_k = 4, .shared_intermediate = 64});
  const LayerDesc sliced_down = family_layer(Family::kQwen3Next, {.hidden = 128, .intermediate = 3200, .num_experts = 8,
                                                                  .top_k = 4, .shared_intermediate = 2112});
  const LayerDesc two_tile_slices = family_layer(Family::kQwen3Next, {.hidden = 1152, .intermediate = 128,
                                                                      .num_experts = 8, .top_k = 4,
                                                                      .shared_intermediate = 64});
  ASSERT_TRUE(cuda::expert_major_stages_scales(2048, 1));
  int checked = 0;
  for (const LayerDesc& d : {ragged, aligned, long_down, sliced_gate_up, sliced_aligned, sliced_down, two_tile_slices}) {
    const bool gate_up_sliced = !cuda::expert_major_staged_fits(static_cast<int>(d.hidden));
    const bool down_sliced = !cuda::expert_major_staged_fits(static_cast<int>(d.intermediate));
    for (const QuantSpec spec : {QuantSpec{WeightFormat::kNVFP4}, QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128},
                                 QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerChannel}, QuantSpec{WeightFormat::kBF16}}) {
      const Layer layer = take(make_synthetic_layer(d, spec, 11));
      for (const int64_t n : {1, 3, 8, 16, 24, 32}) {
        const int group = !down_sliced && n >= 16 ? 16 : n <= 16 ? 8 : cuda::kExpertMajorGroup;
        ASSERT_EQ(cuda::expert_major_group(static_cast<int>(n), d.top_k, d.num_experts, !down_sliced), group);
        const int64_t h = d.hidden;
        CallInputs in(layer, n, static_cast<uint64_t>(n) + 7);
        ASSERT_OK(in.reference);
        const std::vector<float>& expected = in.expected;
        DeviceArray<float>& x = in.x;
        DeviceArray<float>& out = in.out;
        // The long down in tiles (the default here) and row-major, where its staged down copies
        // the NVFP4 scale codes into shared memory (tiles bring them in one load per chunk).
        for (const bool tiles : {true, false}) {
          if (!tiles && (d.hidden != long_down.hidden || d.intermediate != long_down.intermediate)) continue;
          std::vector<float> split;
          // passes 0: split-K; else down's passes and the NVFP4 loops' chunks ahead, both forced.
          for (const auto& [passes, ahead] : {std::pair{0, 0}, std::pair{1, 1}, std::pair{1, 2}, std::pair{2, 1},
                                             std::pair{2, 2}, std::pair{4, 1}, std::pair{4, 2}}) {
            const bool staged = passes > 0;
            std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(
                layer, n,
                CudaMoeOptions{.path = PathKind::kExpertMajor, .rank = 0, .ranks = 1, .staged = staged,
                               .staged_passes = staged ? std::optional<int>(passes) : std::nullopt,
                               .staged_ahead = staged ? std::optional<int>(ahead) : std::nullopt, .weight_tiles = tiles}));
            out.poison();
            // Shared memory too: the staged kernels leave the columns past an item's routes
            // unwritten, and no output may depend on them.
            ASSERT_EQ(testing::poison_shared_memory(nullptr), cudaSuccess);
            ASSERT_OK(moe->forward(x.ptr, n, out.ptr, nullptr));
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            const std::vector<float> got = out.get();
            const std::string what = fmt::format("H {}, {}, n {}, {}, {}", h, quant_spec_name(spec), n,
                                                 staged ? fmt::format("staged, {} pass(es), {} ahead", passes, ahead) : "split K",
                                                 tiles ? "tiles" : "row-major");
            // The kernels the test means to compare ran: staged where it says so, and sliced exactly
            // where a staged call's K is past 3008.
            const std::string config = moe->call_config(n);
            if (staged && group != cuda::kExpertMajorGroup) {
              EXPECT_EQ(config.rfind(fmt::format("{} routes/item, gate_up staged", group), 0), 0u) << what << ": " << config;
              EXPECT_NE(config.find(", down staged"), std::string::npos) << what << ": " << config;
            }
            EXPECT_EQ(config.find("gate_up staged+slices") != std::string::npos,
                      staged && (group == 16 || (group == 8 && gate_up_sliced)))
                << what << ": " << config;
            EXPECT_EQ(config.find("down staged+slices") != std::string::npos, staged && group == 8 && down_sliced)
                << what << ": " << config;
            // The forced passes wherever a staged down can make them.
            const bool scale_copy = group == 8 && spec.format == WeightFormat::kNVFP4 && !down_sliced && !tiles &&
                                    cuda::expert_major_stages_scales(static_cast<int>(d.intermediate), 1);
            EXPECT_EQ(config.find("gate_up staged x"), std::string::npos) << what << ": " << config;
            if (staged && group != cuda::kExpertMajorGroup && passes > 1) {
              EXPECT_EQ(config.find(fmt::format("down staged x{}", passes)) != std::string::npos,
                        !(group == 8 && down_sliced) && !scale_copy)
                  << what << ": " << config;
            } else {
              EXPECT_EQ(config.find(" x"), std::string::npos) << what << ": " << config;
            }
            // Two ahead wherever the staged kernel has that variant (staged_two_ahead), forced.
            EXPECT_EQ(config.find("gate_up staged (2 ahead)") != std::string::npos,
                      staged && ahead == 2 && group == 8 && !gate_up_sliced)
                << what << ": " << config;
            const bool down_two = staged && ahead == 2 && group != cuda::kExpertMajorGroup && !(group == 8 && down_sliced) &&
                                  !scale_copy;
            EXPECT_EQ(config.find(fmt::format("down staged{} (2 ahead)", passes > 1 ? fmt::format(" x{}", passes) : "")) !=
                          std::string::npos,
                      down_two)
                << what << ": " << config;
            ASSERT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); })) << what;
            // bf16 activations and operands: the path's tolerance in the backend-ops tests.
            EXPECT_LE(testing::rel_l2(got, expected), 1e-2) << what;
            if (staged) {
              EXPECT_LE(testing::rel_l2(got, split), 2e-3) << what;
            } else {
              split = got;
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 8 * 4 * 6 * 7);  // (shapes + the long down row-major) x formats x N x kernels
}

// One eager call of `moe` with its outputs and the GPU's shared memory poisoned first; `got` its
// outputs, all of them finite.
void poisoned_forward(const CudaMoe& moe, DeviceArray<float>& x, DeviceArray<float>& out, int64_t n,
                      std::vector<float>& got) {
  out.poison();
  ASSERT_EQ(testing::poison_shared_memory(nullptr), cudaSuccess);
  ASSERT_OK(moe.forward(x.ptr, n, out.ptr, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  got = out.get();
  ASSERT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); }));
}

// The call captured in a graph (a fork and join to another stream too) and replayed with other
// tokens, bit for bit against eager calls and within 1e-2 of the reference.
void expect_captured_replays_match(const CudaMoe& moe, const Layer& layer, DeviceArray<float>& x,
                                   DeviceArray<float>& out, int64_t n) {
  CapturedGraph g;
  ASSERT_NO_FATAL_FAILURE(
      capture(g, cudaStreamNonBlocking, [&](cudaStream_t s) { ASSERT_OK(moe.forward(x.ptr, n, out.ptr, s)); }));
  expect_replays_match(g, moe, layer, x, out, n, 1, 2);
}

// How many of g's edges let a kernel start before the one it follows has finished (a programmatic
// dependent launch, captured).
size_t programmatic_edges(const CapturedGraph& g) {
  size_t count = 0;
  EXPECT_EQ(cudaGraphGetEdges(g.graph, nullptr, nullptr, nullptr, &count), cudaSuccess);
  std::vector<cudaGraphNode_t> from(count), to(count);
  std::vector<cudaGraphEdgeData> data(count);
  EXPECT_EQ(cudaGraphGetEdges(g.graph, from.data(), to.data(), data.data(), &count), cudaSuccess);
  return static_cast<size_t>(std::count_if(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(count),
                                           [](const cudaGraphEdgeData& e) { return e.type == cudaGraphDependencyTypeProgrammatic; }));
}

// The programmatic edge of the route kernel launched during the router (cuda::selection_by_warps),
// in a call whose gate_up does not select for itself.
size_t route_edges(const LayerDesc& d, const std::string& config) {
  cuda::DevLayer L;
  cuda::set_routing(d, L);
  return cuda::selection_by_warps(L) && config.find("(selects)") == std::string::npos ? 1 : 0;
}

// Small layers that the launch-option tests share: a ragged DeepSeek-V3 one (272 x 176: part 64-row
// blocks in both GEMMs; an ungated shared expert of 144 rows, routed scaling), an aligned
// Qwen3-Next one (a gated shared expert), and a Qwen3-MoE one whose down stages its K = 3200 in
// slices.
LayerDesc small_deepseek_v3() {
  return family_layer(Family::kDeepseekV3, {.hidden = 272, .intermediate = 176, .num_experts = 16, .top_k = 4,
                                            .shared_intermediate = 144, .routed_scaling_factor = 2.5});
}
LayerDesc small_qwen3_next() {
  return family_layer(Family::kQwen3Next,
                      {.hidden = 384, .intermediate = 256, .num_experts = 16, .top_k = 4, .shared_intermediate = 128});
}
LayerDesc long_down_layer() {
  return family_layer(Family::kQwen3Moe, {.hidden = 256, .intermediate = 3200, .num_experts = 8, .top_k = 2});
}

// One call of a test that turns a launch option on and off: the layer made with `options` for n
// tokens (into `moe`), its config (into `config`) naming `marker` exactly where `marked`, and its
// output (into `got`, from poisoned buffers) within 1e-2 of the reference's `expected`.
void option_forward(const Layer& layer, int64_t n, const CudaMoeOptions& options, const std::string& marker, bool marked,
                    const std::string& what, DeviceArray<float>& x, DeviceArray<float>& out,
                    const std::vector<float>& expected, std::unique_ptr<CudaMoe>& moe, std::string& config,
                    std::vector<float>& got) {
  moe = take(CudaMoe::create(layer, n, options));
  config = moe->call_config(n);
  EXPECT_EQ(config.find(marker) != std::string::npos, marked) << what << ": " << config;
  ASSERT_NO_FATAL_FAILURE(poisoned_forward(*moe, x, out, n, got)) << what;
  EXPECT_LE(testing::rel_l2(got, expected), 1e-2) << what;
}

// Mixed token tiles (cuda::expert_major_mixed): the experts with more than 8 routes in a call run
// as items of up to 16 routes in the two-tile staged kernels, on a second stream, the others at 8
// routes per item as before. Forced on, against forced off and the reference, on shapes whose
// experts average under 8 routes (one token tile per item otherwise): a ragged DeepSeek-V3 shape
// (272 rows: a partial 64-row block in both GEMMs) and an aligned Qwen3-Next one, in NVFP4, FP8
// (block-128) and BF16, at N = 9 (the shared expert's 9 routes make it hot), 17, 24 and 31, with
// tokens of both bench routings. The host's routing counts the routed experts past 8 routes, so
// the test knows such items ran (the shared expert is one in every case). Each mixed call also
// runs in a graph replay (the fork and join captured), bit for bit against the eager call.
TEST_F(Cuda, MixedTokenTilesMatchTheReference) {
  const LayerDesc ragged = small_deepseek_v3();
  const LayerDesc aligned = small_qwen3_next();
  int checked = 0, hot_routed = 0;
  for (const LayerDesc& d : {ragged, aligned}) {
    for (const QuantSpec spec : {QuantSpec{WeightFormat::kNVFP4}, QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128},
                                 QuantSpec{WeightFormat::kBF16}}) {
      const Layer layer = take(make_synthetic_layer(d, spec, 13));
      for (const int64_t n : {9, 17, 24, 31}) {
        ASSERT_EQ(cuda::expert_major_group(static_cast<int>(n), d.top_k, d.num_experts, true), 8);
        for (const TokenRouting routing : {TokenRouting::kIndependent, TokenRouting::kCorrelated}) {
          const int64_t h = d.hidden;
          const std::vector<float> tokens = make_bench_tokens(n, h, routing, static_cast<uint64_t>(n) + 31);
          std::vector<float> expected(tokens.size());
          ASSERT_OK(moe_forward_reference(layer, tokens, n, expected));
          std::vector<int> counts(static_cast<size_t>(d.num_experts), 0);
          for (const int id : take(moe_route_reference(layer, tokens, n)).ids) ++counts[static_cast<size_t>(id)];
          hot_routed += static_cast<int>(std::count_if(counts.begin(), counts.end(), [](int c) { return c > 8; }));
          DeviceArray<float> x(static_cast<size_t>(n * h)), out(static_cast<size_t>(n * h));
          x.put(tokens);
          std::vector<float> one_tile;
          for (const bool mixed : {false, true}) {
            const std::string what = fmt::format("{}, {}, n {}, {}, mixed {}", describe_shape(d), quant_spec_name(spec), n,
                                                 token_routing_name(routing), mixed ? "on" : "off");
            std::unique_ptr<CudaMoe> moe;
            std::string config;
            std::vector<float> got;
            ASSERT_NO_FATAL_FAILURE(option_forward(layer, n, {.path = PathKind::kExpertMajor, .mixed_tiles = mixed},
                                                   "experts past 8 routes at 16 routes/item", mixed, what, x, out,
                                                   expected, moe, config, got));
            EXPECT_EQ(config.rfind("8 routes/item", 0), 0u) << what << ": " << config;
            if (!mixed) {
              one_tile = got;
              continue;
            }
            // The same sums in another grouping: bf16 operands, fp32 sums over the same K order.
            EXPECT_LE(testing::rel_l2(got, one_tile), 2e-3) << what;
            ASSERT_NO_FATAL_FAILURE(expect_captured_replays_match(*moe, layer, x, out, n)) << what;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 3 * 4 * 2);  // shapes x formats x N x routings
  EXPECT_GT(hot_routed, 0) << "no routed expert passed 8 routes: only the shared expert's items ran at two tiles";
}

// The shared expert apart (cuda::expert_major_shared_apart): its gate_up and down in a chain of
// their own, forked before the router and joined before the blend or the fused down and blend,
// over its own items, route list and bf16 x. Forced on against forced off and the reference, on a
// ragged DeepSeek-V3 shape (ungated shared expert, routed scaling) and a Qwen3-Next one (gated), in
// NVFP4, FP8 (block-128) and BF16, at N = 1 (the one-warp grouping), 2 and 8 (the fused down and
// blend), 13 and 24 (mixed token tiles forced, the shared expert's items at 16 routes), 48 (two token
// tiles) and 130 (four). Each forced-on call also runs in a graph replay with other tokens.
TEST_F(Cuda, SharedExpertApartMatchesTheReference) {
  const LayerDesc ragged = small_deepseek_v3();
  const LayerDesc gated = small_qwen3_next();
  ASSERT_TRUE(ragged.has_shared() && !ragged.shared_gate && gated.has_shared() && gated.shared_gate);
  int checked = 0, fused = 0, mixed = 0;
  for (const LayerDesc& d : {ragged, gated}) {
    for (const QuantSpec spec : {QuantSpec{WeightFormat::kNVFP4}, QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128},
                                 QuantSpec{WeightFormat::kBF16}}) {
      const Layer layer = take(make_synthetic_layer(d, spec, 17));
      for (const int64_t n : {1, 2, 8, 13, 24, 48, 130}) {
        CallInputs in(layer, n, static_cast<uint64_t>(n) + 5);
        ASSERT_OK(in.reference);
        const std::vector<float>& expected = in.expected;
        DeviceArray<float>& x = in.x;
        DeviceArray<float>& out = in.out;
        std::vector<float> in_call;
        for (const bool apart : {false, true}) {
          CudaMoeOptions options;
          options.path = PathKind::kExpertMajor;
          options.shared_apart = apart;
          // Mixed token tiles forced where the call can mix (by default only from 8 MB per expert).
          if (n == 13 || n == 24) options.mixed_tiles = true;
          const std::string what =
              fmt::format("{}, {}, n {}, apart {}", describe_shape(d), quant_spec_name(spec), n, apart ? "on" : "off");
          std::unique_ptr<CudaMoe> moe;
          std::string config;
          std::vector<float> got;
          ASSERT_NO_FATAL_FAILURE(option_forward(layer, n, options, "shared expert beside the router", apart, what, x, out,
                                                 expected, moe, config, got));
          if (!apart) {
            in_call = got;
            continue;
          }
          // The same products in other kernels: bf16 operands, fp32 sums in another order.
          EXPECT_LE(testing::rel_l2(got, in_call), 2e-3) << what;
          fused += config.find("+ blend") != std::string::npos ? 1 : 0;
          mixed += config.find("experts past 8 routes") != std::string::npos ? 1 : 0;
          ASSERT_NO_FATAL_FAILURE(expect_captured_replays_match(*moe, layer, x, out, n)) << what;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 3 * 7);  // shapes x formats x N
  EXPECT_GT(fused, 0) << "no call ran the fused down and blend beside the shared expert's chain";
  EXPECT_GT(mixed, 0) << "no call mixed token tiles beside the shared expert's chain";
}

// The loop of the early-launch tests: for each shape, format (NVFP4, FP8 block-128, BF16), N and
// staging (forbidden, then forced), the call with the option `set(options, early)` off, then on;
// the config names `marker` exactly where it is on, and the output, from poisoned buffers, is within
// 1e-2 of the reference and, on, bit for bit the off call's (the same kernels and sums: only when a
// kernel starts differs). Each call is also captured, its graph holding `edges(config, early)`
// programmatic edges besides the route kernel's (route_edges); each early graph's replays with other
// tokens match. `seen(config)` for each
// early call. Returns the number of early calls checked.
template <class Set, class Edges, class Seen>
int early_launch_cases(std::initializer_list<LayerDesc> shapes, std::initializer_list<int64_t> ns, uint64_t seed,
                       const std::string& marker, Set set, Edges edges, Seen seen) {
  int checked = 0;
  for (const LayerDesc& d : shapes) {
    for (const QuantSpec spec : {QuantSpec{WeightFormat::kNVFP4}, QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128},
                                 QuantSpec{WeightFormat::kBF16}}) {
      const Layer layer = take(make_synthetic_layer(d, spec, seed));
      for (const int64_t n : ns) {
        CallInputs in(layer, n, static_cast<uint64_t>(n) + seed);
        EXPECT_TRUE(in.reference.ok()) << in.reference.message();
        const std::vector<float>& tokens = in.tokens;
        const std::vector<float>& expected = in.expected;
        DeviceArray<float>& x = in.x;
        DeviceArray<float>& out = in.out;
        for (const bool staging : {false, true}) {
          x.put(tokens);  // again: the replays below put other tokens there
          std::vector<float> after;
          for (const bool early : {false, true}) {
            CudaMoeOptions options;
            options.path = PathKind::kExpertMajor;
            options.staged = staging;
            options.shared_apart = false;
            options.mixed_tiles = false;
            set(options, early);
            const std::string what = fmt::format("{}, {}, n {}, staged {}, early {}", describe_shape(d),
                                                 quant_spec_name(spec), n, staging ? "on" : "off", early ? "on" : "off");
            std::unique_ptr<CudaMoe> moe;
            std::string config;
            std::vector<float> got;
            option_forward(layer, n, options, marker, early, what, x, out, expected, moe, config, got);
            if (::testing::Test::HasFatalFailure()) return checked;
            CapturedGraph g;
            capture(g, cudaStreamNonBlocking, [&](cudaStream_t s) { ASSERT_OK(moe->forward(x.ptr, n, out.ptr, s)); });
            if (::testing::Test::HasFatalFailure()) return checked;
            EXPECT_EQ(programmatic_edges(g), edges(config, early) + route_edges(d, config)) << what << ": " << config;
            if (!early) {
              after = got;
              continue;
            }
            EXPECT_EQ(got, after) << what;
            seen(config);
            expect_replays_match(g, *moe, layer, x, out, n, 1, 2);
            if (::testing::Test::HasFatalFailure()) return checked;
            ++checked;
          }
        }
      }
    }
  }
  return checked;
}

// The down launched during gate_up (cuda::expert_major_early_down): its blocks load their first
// weights before they wait for gate_up's grid. Through early_launch_cases (the gate_up launched
// the ordinary way), on a ragged DeepSeek-V3 shape (ungated shared expert, routed scaling, the
// split-K down of 16 rows), an aligned Qwen3-Next one (gated shared expert, the split-K down of
// row pairs), a Qwen3-MoE one (no shared expert) and one whose down stages in slices (I = 3200),
// at N = 2 and 8 (the fused down and blend), 24 (a down kernel, then the blend), 48 (two token
// tiles where the staged kernels run) and 130 (four). One programmatic edge where the down is
// early, none where not.
TEST_F(Cuda, EarlyDownMatchesTheReference) {
  const LayerDesc ragged = small_deepseek_v3();
  const LayerDesc gated = small_qwen3_next();
  const LayerDesc plain = family_layer(Family::kQwen3Moe, {.hidden = 256, .intermediate = 192, .num_experts = 32,
                                                           .top_k = 4});
  const LayerDesc long_down = long_down_layer();
  int fused = 0, split = 0, staged = 0, sliced = 0;
  const int checked = early_launch_cases(
      {ragged, gated, plain, long_down}, {2, 8, 24, 48, 130}, 19, "down launched during gate_up",
      [](CudaMoeOptions& options, bool early) {
        options.early_gate_up = false;
        options.early_down = early;
      },
      [](const std::string&, bool early) { return early ? 1u : 0u; },
      [&](const std::string& config) {
        const auto has = [&](const char* s) { return config.find(s) != std::string::npos ? 1 : 0; };
        fused += has("+ blend");
        split += has("down split-K;") | has("down split-K (row pairs)");
        staged += has("down staged");
        sliced += has("down staged+slices");
      });
  EXPECT_EQ(checked, 4 * 3 * 5 * 2);  // shapes x formats x N x staging
  EXPECT_GT(fused, 0) << "no early call ran the fused down and blend";
  EXPECT_GT(split, 0) << "no early call ran a split-K down kernel";
  EXPECT_GT(staged, 0) << "no early call ran a staged down";
  EXPECT_GT(sliced, 0) << "no early call ran a down staged in slices";
}

// The staged down's items started as their gate_up finishes (cuda::expert_major_item_release):
// each gate_up warp counts the tiles of activations it stored per item, and each down block, launched
// during gate_up, waits for its item's count instead of gate_up's grid. Forced off, then on (the
// down early in both), from poisoned buffers: within 1e-2 of the reference, and on, bit for bit the
// off call (the same kernels and sums: only when a down block starts differs), its graph's replays
// with other tokens matching too. Shapes: a ragged DeepSeek-V3 one (176 gate rows: 11 tiles, a part
// 64-row block), an aligned Qwen3-Next one (gated shared expert), one whose down stages in slices
// (I = 3200), with the staged kernels forced, at N = 24 and 48 (two token tiles); and three of
// H = 3072 (past the whole-K staging) by default, whose gate_up runs split-K before the staged down:
// 16 rows per block (I = 256, N = 48), two token tiles (I = 128, N = 64), 32 rows per block (I = 512,
// N = 48, NVFP4 only: the largest layer).
TEST_F(Cuda, ItemReleaseMatchesTheReference) {
  const LayerDesc ragged = small_deepseek_v3();
  const LayerDesc gated = small_qwen3_next();
  const LayerDesc long_down = long_down_layer();
  const LayerDesc split = family_layer(Family::kQwen3Moe, {.hidden = 3072, .intermediate = 256, .num_experts = 32,
                                                           .top_k = 4});
  const LayerDesc split_tiles = family_layer(Family::kQwen3Moe, {.hidden = 3072, .intermediate = 128, .num_experts = 32,
                                                                 .top_k = 8});
  const LayerDesc split_wide = family_layer(Family::kQwen3Moe, {.hidden = 3072, .intermediate = 512, .num_experts = 64,
                                                                .top_k = 4});
  const std::vector<QuantSpec> every = {QuantSpec{WeightFormat::kNVFP4}, QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128},
                                        QuantSpec{WeightFormat::kBF16}};
  struct Case {
    const LayerDesc* d;
    std::vector<int64_t> ns;
    std::optional<bool> staged;
    std::vector<QuantSpec> specs;
  };
  int checked = 0, sliced = 0, two_tiles = 0, split_gate_up = 0, wide_gate_up = 0;
  for (const Case& c : {Case{&ragged, {24, 48}, true, every}, Case{&gated, {24, 48}, true, every},
                        Case{&long_down, {24}, true, every}, Case{&split, {48}, std::nullopt, every},
                        Case{&split_tiles, {64}, std::nullopt, every},
                        Case{&split_wide, {48}, std::nullopt, {QuantSpec{WeightFormat::kNVFP4}}}}) {
    const LayerDesc& d = *c.d;
    for (const QuantSpec spec : c.specs) {
      const Layer layer = take(make_synthetic_layer(d, spec, 29));
      for (const int64_t n : c.ns) {
        CallInputs in(layer, n, static_cast<uint64_t>(n) + 29);
        ASSERT_OK(in.reference);
        const std::vector<float>& expected = in.expected;
        DeviceArray<float>& x = in.x;
        DeviceArray<float>& out = in.out;
        std::vector<float> off;
        for (const bool release : {false, true}) {
          CudaMoeOptions options;
          options.path = PathKind::kExpertMajor;
          options.staged = c.staged;
          options.shared_apart = false;
          options.mixed_tiles = false;
          options.early_gate_up = false;
          options.early_down = true;
          options.item_release = release;
          const std::string what = fmt::format("{}, {}, n {}, item release {}", describe_shape(d), quant_spec_name(spec),
                                               n, release ? "on" : "off");
          std::unique_ptr<CudaMoe> moe;
          std::string config;
          std::vector<float> got;
          ASSERT_NO_FATAL_FAILURE(option_forward(layer, n, options, "(each item once its gate_up is stored)", release,
                                                 what, x, out, expected, moe, config, got));
          ASSERT_NE(config.find("down staged"), std::string::npos) << what << ": " << config;
          if (!release) {
            off = got;
            continue;
          }
          EXPECT_EQ(got, off) << what;
          sliced += config.find("down staged+slices") != std::string::npos ? 1 : 0;
          two_tiles += config.find("16 routes/item") != std::string::npos ? 1 : 0;
          split_gate_up += config.find("gate_up split-K,") != std::string::npos ? 1 : 0;
          wide_gate_up += config.find("gate_up split-K (32 rows)") != std::string::npos ? 1 : 0;
          ASSERT_NO_FATAL_FAILURE(expect_captured_replays_match(*moe, layer, x, out, n)) << what;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * (2 + 2 + 1 + 1 + 1) + 1);  // formats x (shape, N)
  EXPECT_GT(sliced, 0) << "no call released the items of a down staged in slices";
  EXPECT_GT(two_tiles, 0) << "no call released items of two token tiles";
  EXPECT_EQ(split_gate_up, 2 * 3) << "calls that released items after a split-K gate_up of 16 rows";
  EXPECT_EQ(wide_gate_up, 1) << "calls that released items after the split-K gate_up of 32 rows";
}

// The gate_up launched during routing (cuda::expert_major_early_gate_up): its blocks wait for the
// route kernel (or the router, where gate_up selects) before they read anything. Through
// early_launch_cases (the down early wherever its rule allows), on shapes that reach each kernel
// before the gate_up: a Qwen3-MoE one (N = 1: the router, the gate_up selecting), a Qwen3-Next one
// of 256 experts (N = 1: the one-token route kernel), a ragged DeepSeek-V3 one (the route kernel
// of a warp per token) and one of 520 router outputs (the block-per-token route kernel, then the
// grouping kernel), at N = 1, 2, 8, 24 and 48. One programmatic edge for the gate_up where it is
// early, and one for the down where that is, besides the route kernel's where it has one.
TEST_F(Cuda, EarlyGateUpMatchesTheReference) {
  const LayerDesc plain = family_layer(Family::kQwen3Moe, {.hidden = 256, .intermediate = 192, .num_experts = 32,
                                                           .top_k = 4});
  const LayerDesc gated = family_layer(Family::kQwen3Next, {.hidden = 256, .intermediate = 128, .num_experts = 256,
                                                            .top_k = 8, .shared_intermediate = 128});
  const LayerDesc ragged = small_deepseek_v3();
  const LayerDesc wide_router = family_layer(Family::kQwen3Moe, {.hidden = 128, .intermediate = 64, .num_experts = 520,
                                                                 .top_k = 4});
  int selecting = 0, early_downs = 0;
  const auto early_down = [](const std::string& config) {
    return config.find("down launched during gate_up") != std::string::npos;
  };
  const int checked = early_launch_cases(
      {plain, gated, ragged, wide_router}, {1, 2, 8, 24, 48}, 23, "gate_up launched during routing",
      [](CudaMoeOptions& options, bool early) { options.early_gate_up = early; },
      [&](const std::string& config, bool early) { return (early ? 1u : 0u) + (early_down(config) ? 1u : 0u); },
      [&](const std::string& config) {
        selecting += config.find("(selects)") != std::string::npos ? 1 : 0;
        early_downs += early_down(config) ? 1 : 0;
      });
  EXPECT_EQ(checked, 4 * 3 * 5 * 2);  // shapes x formats x N x staging
  EXPECT_GT(selecting, 0) << "no early call ran the gate_up that selects";
  EXPECT_GT(early_downs, 0) << "no early call launched its down early too";
}

// The fused down and blend launched during a gate_up that selects (cuda::expert_major_published_down):
// its blocks wait for the flag that gate_up's block (0, 0) raises once it has written the call's
// items, read them, and load their first weights before they wait for gate_up's grid. Through early_launch_cases (the early down forced off, then on; the gate_up launched during
// routing, as by default at N = 1) at N = 1 on shapes whose gate_up selects: 4, 2 and 1 warps per item
// (top-4, top-8 and top-12 Qwen3-MoE), group-limited routing with a shared expert (a DeepSeek-V3
// shape of 4 groups keeping 2) and zero experts (LongCat, whose outputs add w x after the wait). With
// staging forced the gate_up does not select, and the down is the ordinary early one. Each early
// graph's replays with other tokens check that the flag is down again between calls.
TEST_F(Cuda, EarlySelectingDownMatchesTheReference) {
  const LayerDesc four_ways = family_layer(Family::kQwen3Moe, {.hidden = 256, .intermediate = 192, .num_experts = 32,
                                                               .top_k = 4});
  const LayerDesc two_ways = family_layer(Family::kQwen3Moe, {.hidden = 256, .intermediate = 128, .num_experts = 64,
                                                              .top_k = 8});
  const LayerDesc one_way = family_layer(Family::kQwen3Moe, {.hidden = 128, .intermediate = 64, .num_experts = 32,
                                                             .top_k = 12});
  const LayerDesc grouped = family_layer(Family::kDeepseekV3, {.hidden = 272, .intermediate = 176, .num_experts = 16,
                                                               .top_k = 4, .shared_intermediate = 144,
                                                               .routed_scaling_factor = 2.5, .n_group = 4,
                                                               .topk_group = 2});
  const LayerDesc zero_experts = family_layer(Family::kLongcatFlash, {.hidden = 128, .intermediate = 32, .num_experts = 64,
                                                                      .top_k = 6, .num_zero_experts = 8});
  const std::string early_gate_up = "gate_up launched during routing";
  int published = 0;
  std::set<int> ways;
  const int checked = early_launch_cases(
      {four_ways, two_ways, one_way, grouped, zero_experts}, {1}, 37, "down launched during gate_up",
      [](CudaMoeOptions& options, bool early) { options.early_down = early; },
      [&](const std::string& config, bool early) {
        return (config.find(early_gate_up) != std::string::npos ? 1u : 0u) + (early ? 1u : 0u);
      },
      [&](const std::string& config) {
        if (config.find("(selects)") == std::string::npos) return;
        ++published;
        for (const int w : {1, 2, 4}) {
          if (config.find(fmt::format("blend ({} warp", w)) != std::string::npos) ways.insert(w);
        }
      });
  EXPECT_EQ(checked, 5 * 3 * 2);  // shapes x formats x staging
  EXPECT_EQ(published, 5 * 3) << "early calls whose gate_up selected (every shape and format, staging off)";
  EXPECT_EQ(ways, (std::set<int>{1, 2, 4})) << "warps per item of the fused downs that read published items";
}

// What ExpertMajorStagedAndSplitKernelsAgree's shared-memory poison rests on: it is still there
// when the next kernel starts, so a kernel that reads shared memory it never wrote reads NaN.
TEST_F(Cuda, SharedMemoryPoisonReachesTheNextKernel) {
  constexpr int kWords = 8192;  // 32 KB
  ASSERT_EQ(testing::poison_shared_memory(nullptr), cudaSuccess);
  std::vector<uint32_t> words(kWords);
  ASSERT_EQ(testing::read_unwritten_shared_memory(words.data(), kWords), cudaSuccess);
  EXPECT_EQ(std::count(words.begin(), words.end(), 0xFFFFFFFFu), kWords)
      << "shared memory did not keep the poison to the next kernel: the staged kernels' check of unwritten columns "
         "tests nothing on this GPU";
}

// The router's logits on the tensor cores (x in three bf16 parts, fp32 sums) against the CUDA-core
// kernels (fp32 FMAs), forced each way: the same routes and weights to within the order of fp32
// sums, so the layer outputs agree to a few ulps; a lost slice of K or a missing part of x or of
// the shared gate moves the weights by far more. Shapes that reach every edge of the grid:
// - hidden 264 and 520: K slices of 256 columns with a last slice of one or two 8-column groups
//   (not whole 32-column steps); 128 and 1032 below 256;
// - router rows 125 (Qwen3-Next's shared gate as three rows from 128, in the second row group),
//   124 (its gate rows 124-126, the first group's last whole ones), 64 + 8 zero experts
//   (LongCat), 256 (two whole groups, DeepSeek-V3's grouped selection and correction bias), 40
//   with a router bias (gpt-oss);
// - Qwen3-Next's router itself (512 rows + the gate, hidden 2048);
// - N = 1, 7 (a token group part empty), 16, 17, 40, 64, 128: 8 tokens per block in every grid.
TEST_F(Cuda, RouterOnTensorCoresMatchesTheCudaCoreRouter) {
  const std::vector<std::pair<Family, FamilyShape>> shapes = {
      {Family::kQwen3Next, {.hidden = 264, .intermediate = 64, .num_experts = 125, .top_k = 6, .shared_intermediate = 64}},
      {Family::kQwen3Next, {.hidden = 520, .intermediate = 32, .num_experts = 124, .top_k = 4, .shared_intermediate = 32}},
      {Family::kLongcatFlash, {.hidden = 128, .intermediate = 32, .num_experts = 64, .top_k = 6, .num_zero_experts = 8}},
      {Family::kDeepseekV3, {.hidden = 1032, .intermediate = 32, .num_experts = 256, .top_k = 8, .shared_intermediate = 32,
                             .routed_scaling_factor = 2.5, .n_group = 8, .topk_group = 4}},
      {Family::kGptOss, {.hidden = 264, .intermediate = 32, .num_experts = 40, .top_k = 4}},
      {Family::kQwen3Next, {.hidden = 2048, .intermediate = 32, .num_experts = 512, .top_k = 2, .shared_intermediate = 32}},
  };
  int checked = 0;
  for (const auto& [family, shape] : shapes) {
    const LayerDesc d = family_layer(family, shape);
    const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kBF16}, 21));
    const int64_t h = d.hidden;
    for (const int64_t n : {1, 7, 16, 17, 40, 64, 128}) {
      const std::vector<float> tokens = make_tokens(n, h, static_cast<uint64_t>(n) + 3);
      std::vector<float> expected(tokens.size());
      ASSERT_OK(moe_forward_reference(layer, tokens, n, expected));
      DeviceArray<float> x(static_cast<size_t>(n * h)), out(static_cast<size_t>(n * h));
      x.put(tokens);
      std::vector<float> fma;
      for (const bool mma : {false, true}) {
        std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, n, router_options(mma)));
        const std::string what = fmt::format("{}, n {}, router {}", describe_shape(d), n, mma ? "mma" : "fma");
        const std::string config = moe->call_config(n);
        EXPECT_NE(config.find(mma ? "; router mma" : "; router fma"), std::string::npos) << what << ": " << config;
        if (mma) {
          EXPECT_NE(config.find("(8 tokens/block)"), std::string::npos) << what << ": " << config;
        }
        out.poison();
        ASSERT_OK(moe->forward(x.ptr, n, out.ptr, nullptr));
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = out.get();
        ASSERT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); })) << what;
        EXPECT_LE(testing::rel_l2(got, expected), 1e-2) << what;
        if (mma) {
          EXPECT_LE(testing::rel_l2(got, fma), 1e-5) << what;
        } else {
          fma = got;
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 6 * 7 * 2);
}

// The tensor-core router (forced) in a CUDA graph: its per-(row group, token group) counters must
// be back at zero after each call, or a replay's last block would not add the slices up. Each
// replay, with new tokens, matches an eager call bit for bit and the reference. Forced, it runs
// up to 512 tokens.
TEST_F(Cuda, RouterOnTensorCoresReplaysInAGraph) {
  const LayerDesc d = family_layer(Family::kQwen3Next, {.hidden = 512, .intermediate = 64, .num_experts = 130, .top_k = 8,
                                                        .shared_intermediate = 64});
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 5));
  const int64_t n = 24, h = d.hidden;
  std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, n, router_options(true)));
  EXPECT_NE(moe->call_config(n).find("; router mma"), std::string::npos) << moe->call_config(n);
  DeviceArray<float> x(static_cast<size_t>(n * h)), out(static_cast<size_t>(n * h));
  x.put(make_tokens(n, h, 50));
  {
    CapturedGraph g;
    ASSERT_NO_FATAL_FAILURE(
        capture(g, cudaStreamDefault, [&](cudaStream_t s) { ASSERT_OK(moe->forward(x.ptr, n, out.ptr, s)); }));
    expect_replays_match(g, *moe, layer, x, out, n, 51, 54);
  }

  std::unique_ptr<CudaMoe> big = take(CudaMoe::create(layer, 520, router_options(true)));
  EXPECT_NE(big->call_config(1).find("; router mma"), std::string::npos) << big->call_config(1);
  EXPECT_NE(big->call_config(512).find("; router mma"), std::string::npos) << big->call_config(512);
  EXPECT_NE(big->call_config(513).find("; router fma"), std::string::npos) << big->call_config(513);
}

// The selection's tie rule (equal keys go to the lower expert index), on routers whose rows repeat
// every 7 (or 5) rows, so that each logit value is shared by dozens of experts and the top k is
// decided by index alone among them. One token past 128 experts runs the whole-block selection
// (each warp's own top k, then warp 0's merge of the 8 lists: 512 experts put the lowest indices
// of one value in several warps' lists), else, and at 2 and 9 tokens, one warp per token.
// Group-limited routing (DeepSeek's 8 groups, 4 kept) ties whole groups too. Top-32 of 160 with a
// shared expert is 33 routes per token: one token's grouping then takes the block-wide count. The
// reference breaks ties the same way, so one wrong choice (a whole expert's share of the output)
// would land far past the tolerance. DeepSeek's correction biases repeat with its rows, so that
// its keys tie as well as its scores.
TEST_F(Cuda, SelectionBreaksTiesByTheLowerIndex) {
  const std::vector<std::pair<Family, FamilyShape>> shapes = {
      {Family::kQwen3Next, {.hidden = 64, .intermediate = 32, .num_experts = 512, .top_k = 10, .shared_intermediate = 32}},
      {Family::kQwen3Moe, {.hidden = 64, .intermediate = 32, .num_experts = 128, .top_k = 8}},
      {Family::kDeepseekV3, {.hidden = 64, .intermediate = 32, .num_experts = 256, .top_k = 8, .shared_intermediate = 32,
                             .routed_scaling_factor = 2.5, .n_group = 8, .topk_group = 4}},
      {Family::kQwen3Next, {.hidden = 64, .intermediate = 32, .num_experts = 160, .top_k = 32, .shared_intermediate = 32}},
  };
  int checked = 0;
  for (const auto& [family, shape] : shapes) {
    const LayerDesc d = family_layer(family, shape);
    Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 17));
    const int period = family == Family::kDeepseekV3 ? 5 : 7;
    std::vector<float> router = layer.router.dequantize();
    const int64_t h = d.hidden;
    for (int64_t r = period; r < layer.router.rows; ++r) {
      std::copy_n(router.begin() + (r % period) * h, h, router.begin() + r * h);
    }
    layer.router = take(QuantMatrix::quantize(router, layer.router.rows, h, layer.router.spec));
    for (size_t e = period; e < layer.correction_bias.size(); ++e) layer.correction_bias[e] = layer.correction_bias[e % period];
    // 2-8 tokens past 128 outputs, or up to 16 where the device runs clusters of 16: a block per
    // token, as one cluster (selection_block_per_token); else up to 64 tokens a warp per token, the
    // blocks as one cluster (route_warps_clustered); 65: neither.
    for (const int64_t n : {1, 2, 8, 9, 16, 40, 64, 65}) {
      const std::vector<float> tokens = make_tokens(n, h, static_cast<uint64_t>(n) + 60);
      std::vector<float> expected(tokens.size());
      ASSERT_OK(moe_forward_reference(layer, tokens, n, expected));
      DeviceArray<float> x(static_cast<size_t>(n * h)), out(static_cast<size_t>(n * h));
      x.put(tokens);
      std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, n));
      out.poison();
      ASSERT_OK(moe->forward(x.ptr, n, out.ptr, nullptr));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = out.get();
      const std::string what = fmt::format("{}, n {}", describe_shape(d), n);
      ASSERT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); })) << what;
      EXPECT_LE(testing::rel_l2(got, expected), 1e-2) << what;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4 * 8);
}

// Hopper runs clusters of up to 16 blocks (past the portable 8) when a kernel allows them: the
// route kernel of a block per token then takes calls of up to 16 tokens.
TEST_F(Cuda, RouteKernelOfABlockPerTokenTakesSixteenTokensOnHopper) {
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  for (const int outputs : {256, 512}) {
    cuda::DevLayer L;
    L.num_experts = outputs, L.router_outputs = outputs, L.top_k = 8, L.n_group = 1, L.has_shared = true;
    int tokens = 0;
    ASSERT_EQ(cuda::route_token_blocks_max(L, &tokens), cudaSuccess);
    EXPECT_EQ(tokens, prop.major == 9 ? 16 : tokens) << outputs << " outputs";
    EXPECT_TRUE(tokens == 8 || tokens == 16) << tokens;
  }
  cuda::DevLayer narrow;  // one warp per token: no cluster of token blocks
  narrow.num_experts = 128, narrow.router_outputs = 128, narrow.top_k = 8, narrow.n_group = 1;
  int tokens = 0;
  ASSERT_EQ(cuda::route_token_blocks_max(narrow, &tokens), cudaSuccess);
  EXPECT_EQ(tokens, 8);
}

// The one-warp selection (cuda::route_token_warp) against the reference's, choice by choice. The
// logits lie on a grid of 1/8 steps (and the correction biases are whole numbers), so fp32 and
// double order the keys alike and equal logits tie exactly in both; the weights then agree to
// fp32's rounding. Each shape's tokens:
// - spread: 65 values over all outputs, so equal keys often straddle the k-th place;
// - plateaus of 20 and 70 equal best keys (the lowest indices win), and a flat row with three
//   keys above it;
// - distinct logits in a random order.
// Shapes: each family's routing (softmax, sigmoid with correction bias with and without groups,
// zero experts, gpt-oss's logits, Llama-4's), 1 to 16 outputs per lane, full and part-full lanes,
// k up to 32.
TEST_F(Cuda, WarpSelectionMatchesTheReferenceChoiceByChoice) {
  struct Case {
    Family family;
    FamilyShape shape;
    int per_lane;
  };
  const std::vector<Case> cases = {
      {Family::kQwen3Next, {.num_experts = 512, .top_k = 10}, 16},
      {Family::kQwen3Moe, {.num_experts = 128, .top_k = 8}, 4},
      {Family::kDeepseekV3, {.num_experts = 256, .top_k = 8, .routed_scaling_factor = 2.5, .n_group = 8, .topk_group = 4}, 8},
      {Family::kQwen3Moe, {.num_experts = 100, .top_k = 6}, 4},
      {Family::kQwen3Next, {.num_experts = 160, .top_k = 32}, 8},
      {Family::kLongcatFlash, {.num_experts = 64, .top_k = 6, .num_zero_experts = 32, .routed_scaling_factor = 6.0}, 4},
      {Family::kGptOss, {.num_experts = 32, .top_k = 4}, 1},
      {Family::kLlama4, {.num_experts = 16, .top_k = 1}, 1},
      {Family::kMinimaxM2, {.num_experts = 64, .top_k = 8}, 2},
  };
  int checked = 0;
  for (const Case& c : cases) {
    FamilyShape shape = c.shape;
    shape.hidden = 64;
    shape.intermediate = 32;
    const LayerDesc d = family_layer(c.family, shape);
    const int outputs = d.router_outputs(), k = d.top_k;
    std::mt19937 rng(static_cast<uint32_t>(outputs * 131 + k));
    std::uniform_int_distribution<int> step(-32, 32);
    std::vector<float> bias;
    if (d.routing.correction_bias) {
      std::uniform_int_distribution<int> whole(0, 2);
      for (int e = 0; e < outputs; ++e) bias.push_back(static_cast<float>(whole(rng)));
    }
    std::vector<float> logits;
    int n = 0;
    const auto add_token = [&](const std::function<float(int)>& logit) {
      for (int e = 0; e < outputs; ++e) logits.push_back(logit(e));
      ++n;
    };
    for (int r = 0; r < 3; ++r) add_token([&](int) { return static_cast<float>(step(rng)) / 8.0f; });
    const auto shuffled = [&] {  // 0 .. E + Z - 1 in a random order
      std::vector<int> order(static_cast<size_t>(outputs));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      return order;
    };
    for (const int plateau : {20, 70}) {
      const std::vector<int> order = shuffled();
      std::vector<float> row(static_cast<size_t>(outputs));
      for (int i = 0; i < outputs; ++i) {  // the rest under the plateau's 5
        row[static_cast<size_t>(order[static_cast<size_t>(i)])] =
            i < plateau ? 5.0f : static_cast<float>(step(rng) - 40) / 8.0f;
      }
      add_token([&](int e) { return row[static_cast<size_t>(e)]; });
    }
    add_token([&](int e) { return e == 3 || e == outputs / 2 || e == outputs - 1 ? 1.0f : 0.0f; });
    const std::vector<int> order = shuffled();
    add_token([&](int e) { return static_cast<float>(order[static_cast<size_t>(e)] - outputs / 2) / 64.0f; });

    cuda::DevLayer L;
    cuda::set_routing(d, L);
    DeviceArray<float> d_logits(logits.size()), d_bias(std::max<size_t>(bias.size(), 1)), d_weights(static_cast<size_t>(n * k));
    DeviceArray<int> d_ids(d_weights.size);
    d_logits.put(logits);
    if (!bias.empty()) d_bias.put(bias), L.correction_bias_values = d_bias.ptr;
    d_ids.poison();
    d_weights.poison();
    cuda::DevWorkspace ws;
    ws.logits = d_logits.ptr;
    ws.ids = d_ids.ptr;
    ws.weights = d_weights.ptr;
    ASSERT_EQ(testing::select_with_warps(L, c.per_lane, n, ws), cudaSuccess);
    const std::vector<int> ids = d_ids.get();
    const std::vector<float> weights = d_weights.get();
    for (int t = 0; t < n; ++t) {
      const std::vector<double> row(logits.begin() + t * outputs, logits.begin() + (t + 1) * outputs);
      std::vector<int> want_ids(static_cast<size_t>(k));
      std::vector<double> want_weights(static_cast<size_t>(k));
      ASSERT_OK(moe_select_reference(d, row, bias, want_ids, want_weights));
      const std::string what = fmt::format("{}, token {}", describe_shape(d), t);
      for (int j = 0; j < k; ++j) {
        const size_t at = static_cast<size_t>(t * k + j);
        const double want = want_weights[static_cast<size_t>(j)];
        ASSERT_EQ(ids[at], want_ids[static_cast<size_t>(j)]) << what << ", choice " << j;
        EXPECT_NEAR(weights[at], want, 2e-6 * std::max(1.0, std::abs(want))) << what << ", choice " << j;
      }
    }
    checked += n;
  }
  EXPECT_EQ(checked, 9 * 7);
}

// The selections divide each softmax exponential by the sum as three instructions from the sum's
// reciprocal (cuda::softmax_quotient), which must give IEEE division's float every time, or a
// choice between two near-equal scores could differ from the division's. 2^26 pairs over the
// quotients' whole range; the plain product by the reciprocal, which is not always the division's,
// must show up as differing on some of them, or the comparison could not see a last-bit error.
TEST_F(Cuda, SoftmaxQuotientIsIeeeDivision) {
  unsigned long long differ = 0, product_differs = 0;
  ASSERT_EQ(testing::count_quotient_mismatches(1ll << 26, differ, product_differs), cudaSuccess);
  EXPECT_EQ(differ, 0u);
  EXPECT_GT(product_differs, (1ull << 26) / 100);
}

// The blend's variants (cuda::blend_loads_first, blend_aligned) add the same terms in the same
// order, so their outputs agree bit for bit: one output per thread with all loads first within a
// wave (N = 7: both outputs below; N = 1 blends in the down kernel, moe_expert_down_blend, whose
// order is fixed too), past it (N = 256 at H = 384: 512 blocks) four per thread
// where x and out are 16-byte aligned, else the loop. An output one float past an aligned
// buffer's start is not aligned.
// Zero experts (LongCat) and a gated shared expert (Qwen3-Next) take the blend's other terms.
TEST_F(Cuda, BlendVariantsAgreeBitForBit) {
  const std::vector<std::pair<Family, FamilyShape>> shapes = {
      {Family::kQwen3Next, {.hidden = 384, .intermediate = 64, .num_experts = 32, .top_k = 4, .shared_intermediate = 64}},
      {Family::kLongcatFlash, {.hidden = 384, .intermediate = 32, .num_experts = 16, .top_k = 6, .num_zero_experts = 8}},
  };
  int checked = 0;
  for (const auto& [family, shape] : shapes) {
    const LayerDesc d = family_layer(family, shape);
    const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 23));
    const int64_t h = d.hidden;
    std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, 256));
    for (const int64_t n : {1, 7, 256}) {
      const std::vector<float> tokens = make_tokens(n, h, static_cast<uint64_t>(n) + 70);
      DeviceArray<float> x(static_cast<size_t>(n * h)), out(static_cast<size_t>(n * h + 4));
      x.put(tokens);
      const std::string what = fmt::format("{}, n {}", describe_shape(d), n);
      ASSERT_TRUE(cuda::blend_aligned(static_cast<int>(h), x.ptr, out.ptr)) << what;
      ASSERT_FALSE(cuda::blend_aligned(static_cast<int>(h), x.ptr, out.ptr + 1)) << what;
      std::vector<std::vector<float>> got;
      for (const int offset : {0, 1}) {
        out.poison();
        ASSERT_OK(moe->forward(x.ptr, n, out.ptr + offset, nullptr));
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> all = out.get();
        got.emplace_back(all.begin() + offset, all.begin() + offset + n * h);
        ASSERT_TRUE(std::all_of(got.back().begin(), got.back().end(), [](float v) { return std::isfinite(v); })) << what;
      }
      EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float)), 0) << what;
      std::vector<float> expected(tokens.size());
      ASSERT_OK(moe_forward_reference(layer, tokens, n, expected));
      EXPECT_LE(testing::rel_l2(got[0], expected), 1e-2) << what;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 3);
}

// Three expert-major calls of `layer` on `tokens`, each into a poisoned output: two with the
// staged kernels as `staged` says (nullopt: chosen), then one with them forced on. `got` gets the
// three outputs, `config` the first call's kernels. A failed call or a non-finite output fails
// the test fatally: call it under ASSERT_NO_FATAL_FAILURE.
void run_twice_then_staged(const Layer& layer, const std::vector<float>& tokens, int64_t n, std::optional<bool> staged,
                           bool tiles, const std::string& what, std::vector<std::vector<float>>& got, std::string& config) {
  DeviceArray<float> x(tokens.size()), out(tokens.size());
  x.put(tokens);
  for (const bool forced : {false, false, true}) {
    std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(
        layer, n,
        CudaMoeOptions{.path = PathKind::kExpertMajor, .rank = 0, .ranks = 1,
                       .staged = forced ? std::optional<bool>(true) : staged, .weight_tiles = tiles}));
    out.poison();
    ASSERT_OK(moe->forward(x.ptr, n, out.ptr, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got.push_back(out.get());
    if (got.size() == 1) config = moe->call_config(n);
    ASSERT_TRUE(std::all_of(got.back().begin(), got.back().end(), [](float v) { return std::isfinite(v); }))
        << what << ", staged forced " << forced;
  }
}

// run_twice_then_staged on every shape, format and n given, in weight tiles and (NVFP4) row-major
// too, the layer made from `seed`, the tokens from n + token_seed. Each call must match the
// reference within 1e-2, itself bit for bit on its second run, and the call forced staged within
// bf16 rounding (2e-3); `check(config, what)` tests the kernels its config names. `checked` counts
// the calls. A failed call fails the test fatally: call it under ASSERT_NO_FATAL_FAILURE.
template <class Check>
void expect_every_format_matches(const std::vector<std::pair<Family, FamilyShape>>& shapes,
                                 const std::vector<QuantSpec>& specs, std::initializer_list<int64_t> tokens_per_call,
                                 uint64_t seed, uint64_t token_seed, std::optional<bool> staged, const Check& check,
                                 int& checked) {
  for (const auto& [family, shape] : shapes) {
    const LayerDesc d = family_layer(family, shape);
    for (const QuantSpec& spec : specs) {
      const Layer layer = take(make_synthetic_layer(d, spec, seed));
      for (const bool tiles : {true, false}) {
        if (!tiles && spec.format != WeightFormat::kNVFP4) continue;
        for (const int64_t n : tokens_per_call) {
          const std::vector<float> tokens = make_tokens(n, d.hidden, static_cast<uint64_t>(n) + token_seed);
          std::vector<float> expected(tokens.size());
          ASSERT_OK(moe_forward_reference(layer, tokens, n, expected));
          std::vector<std::vector<float>> got;
          std::string config;
          const std::string call = fmt::format("{}, {}, {}, n {}", describe_shape(d), quant_spec_name(spec),
                                               tiles ? "tiles" : "row-major", n);
          ASSERT_NO_FATAL_FAILURE(run_twice_then_staged(layer, tokens, n, staged, tiles, call, got, config));
          const std::string what = call + ": " + config;
          check(config, what);
          EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float)), 0) << what;
          EXPECT_LE(testing::rel_l2(got[0], expected), 1e-2) << what;
          EXPECT_LE(testing::rel_l2(got[0], got[2]), 2e-3) << what;
          ++checked;
        }
      }
    }
  }
}

// The fused down and blend of more items than 16 warps (moe_expert_down_blend_rolled: 2-6 items per
// warp here, up to 16 tokens) on every K loop it has: NVFP4 in tiles, row-major and 16-byte aligned, and row-major with
// 8-byte aligned rows (K = 176: a 48-column tail); FP8 block-128, per-channel and per-tensor; BF16.
// With a shared expert and its gate, zero experts, and plain top-8. Each call matches the reference,
// the same call forced staged (no fused down) within bf16 rounding, and itself bit for bit on a
// second run.
TEST_F(Cuda, FusedDownOfManyItemsMatchesOnEveryKLoop) {
  const std::vector<std::pair<Family, FamilyShape>> shapes = {
      {Family::kQwen3Moe, {.hidden = 128, .intermediate = 256, .num_experts = 64, .top_k = 8}},
      {Family::kQwen3Moe, {.hidden = 64, .intermediate = 176, .num_experts = 64, .top_k = 8}},
      {Family::kQwen3Next, {.hidden = 128, .intermediate = 128, .num_experts = 64, .top_k = 8, .shared_intermediate = 128}},
      {Family::kLongcatFlash, {.hidden = 128, .intermediate = 128, .num_experts = 48, .top_k = 8, .num_zero_experts = 16,
                               .norm_topk_prob = false, .routed_scaling_factor = 6.0}},
  };
  const std::vector<QuantSpec> specs = {QuantSpec{WeightFormat::kNVFP4}, QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128},
                                        QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerChannel},
                                        QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerTensor}, QuantSpec{WeightFormat::kBF16}};
  // 24 or more routes on at least 48 experts: past 16 items, one warp each in 2-6 rounds.
  const auto rolled_fused_down = [](const std::string& config, const std::string& what) {
    const std::string fused = "split-K + blend (1 warp/item, ";
    const size_t at = config.find(fused);
    ASSERT_NE(at, std::string::npos) << what;
    EXPECT_GE(std::stoi(config.substr(at + fused.size())), 2) << what;
  };
  int rolled = 0;
  ASSERT_NO_FATAL_FAILURE(
      expect_every_format_matches(shapes, specs, {3, 8, 16}, 31, 40, std::nullopt, rolled_fused_down, rolled));
  EXPECT_EQ(rolled, 4 * 6 * 3);
}

// The split-K gate_up of 32 rows per block (moe_expert_gate_up_wide, where the 16-row grid holds 20
// blocks per SM: here with staging forbidden, so that the GEMMs are split-K) on every format and
// layout: NVFP4 tiled and row-major, FP8 block and per-channel, BF16; K = 256 and K = 272 (a
// 16-column tail that the two ways split); a shared expert of 496 rows, whose last 32-row block
// has rows for its first 16 only. Each call matches the reference, the same call forced staged
// within bf16 rounding, and itself bit for bit on a second run.
TEST_F(Cuda, WideGateUpMatchesOnEveryFormat) {
  const std::vector<std::pair<Family, FamilyShape>> shapes = {
      {Family::kQwen3Next, {.hidden = 256, .intermediate = 512, .num_experts = 128, .top_k = 8, .shared_intermediate = 496}},
      {Family::kQwen3Moe, {.hidden = 272, .intermediate = 512, .num_experts = 256, .top_k = 8}},
  };
  const std::vector<QuantSpec> specs = {QuantSpec{WeightFormat::kNVFP4}, QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128},
                                        QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerChannel}, QuantSpec{WeightFormat::kBF16}};
  const auto wide_gate_up = [](const std::string& config, const std::string& what) {
    EXPECT_NE(config.find("gate_up split-K (32 rows)"), std::string::npos) << what;
  };
  int wide = 0;
  ASSERT_NO_FATAL_FAILURE(expect_every_format_matches(shapes, specs, {16, 32}, 37, 50, false, wide_gate_up, wide));
  EXPECT_EQ(wide, 2 * 5 * 2);
}

// NVFP4 block scales are signed E4M3: negative ones (their codes' signs flipped, so the values stay)
// and zero ones over nonzero codes (those blocks' values become zero) in every expert matrix and
// the shared expert's. The upload folds both (cuda/nvfp4_scale_fold.h) so that the expert-major
// decode, which turns scale codes into bf16 by moving bits, sees nonnegative scales over their own
// codes; every path must match the reference of the same layer. Without the fold, a negative scale
// decodes far out of range.
TEST_F(Cuda, Nvfp4NegativeAndZeroScalesMatchTheReference) {
  const LayerDesc d = family_layer(Family::kQwen3Next, {.hidden = 256, .intermediate = 128, .num_experts = 16, .top_k = 4,
                                                        .shared_intermediate = 128});
  const Layer base = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 29));
  const Layer* src = &base;
  Layer layer(d, [src](int e) -> Result<ExpertWeights> {
    Result<const ExpertWeights*> w = src->expert(e);
    if (!w.ok()) return w.status();
    ExpertWeights copy = **w;
    for (QuantMatrix* m : {&copy.gate, &copy.up, &copy.down}) sign_and_zero_scales(*m);
    return copy;
  });
  layer.expert_spec = base.expert_spec;
  layer.router = base.router;
  layer.router_bias = base.router_bias;
  layer.correction_bias = base.correction_bias;
  layer.shared = base.shared;
  for (QuantMatrix* m : {&layer.shared->gate, &layer.shared->up, &layer.shared->down}) sign_and_zero_scales(*m);
  layer.shared_gate = base.shared_gate;
  int checked = 0;
  for (const std::optional<PathKind> path : {std::optional<PathKind>{}, std::optional<PathKind>{PathKind::kTokenMajor}}) {
    for (const int64_t n : {1, 8, 64}) {
      const std::vector<float> tokens = make_tokens(n, d.hidden, static_cast<uint64_t>(n) + 90);
      std::vector<float> expected(tokens.size());
      ASSERT_OK(moe_forward_reference(layer, tokens, n, expected));
      DeviceArray<float> x(tokens.size()), out(tokens.size());
      x.put(tokens);
      std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, n, path));
      out.poison();
      ASSERT_OK(moe->forward(x.ptr, n, out.ptr, nullptr));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = out.get();
      const std::string what = fmt::format("{}, n {}", moe->call_config(n), n);
      ASSERT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); })) << what;
      EXPECT_LE(testing::rel_l2(got, expected), 1e-2) << what;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 3);
}

TEST_F(Cuda, ForcedTokenMajorOnARaggedShapeIsANamedRefusal) {
  const LayerDesc d = family_layer(Family::kMixtral, {.hidden = 100, .intermediate = 36, .num_experts = 4, .top_k = 2});
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kBF16}, 1));
  std::unique_ptr<Backend> backend = take(make_backend(BackendKind::kCuda, BackendOptions{PathKind::kTokenMajor}));
  const std::vector<float> x = make_tokens(1, 100, 1);
  std::vector<float> out(100);
  const Status s = backend->forward(layer, x, 1, out, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_EQ(s.message(), "path token-major cannot run this layer: hidden_size 100 is not a multiple of 8 (token-major "
                         "loads 8 weights at a time)");
}

// Weight tiles move bytes, never values: every path must give, bit for bit, what it gives on the
// checkpoint's row-major layout, in every format, for each GEMM whether or not its matrix is whole
// tiles. Shapes:
// - qwen3-next-like, hidden 384, intermediate 256, shared 128: every matrix tiles;
// - DeepSeek-V3-like (grouped selection, shared expert), intermediate 96: gate and up tile (96
//   rows of 384 columns), down only in BF16 (rows of 96 columns: 48 bytes in NVFP4, 96 in FP8,
//   192 in BF16);
// - hidden 1024, intermediate 512: the staged kernels' two-ahead loop and the split-K kernels over
//   several tiles per row, at N up to 40 (two token tiles where they run);
// - the ragged shape (hidden 272, intermediate 176): nothing tiles (136- and 88-byte NVFP4 rows,
//   272 and 176 FP8 ones, 544 and 352 BF16 ones), and "on" must leave it row-major.
// Paths: expert-major by default, forced staged and forced split-K, token-major and per-row (the
// latter two read tiles only where forced on).
TEST_F(Cuda, WeightTilesChangeNoBit) {
  const LayerDesc qwen = family_layer(Family::kQwen3Next, {.hidden = 384, .intermediate = 256, .num_experts = 8,
                                                           .top_k = 4, .shared_intermediate = 128});
  const LayerDesc deepseek = family_layer(Family::kDeepseekV3, {.hidden = 384, .intermediate = 96, .num_experts = 16,
                                                                .top_k = 4, .shared_intermediate = 96,
                                                                .routed_scaling_factor = 2.5});
  const LayerDesc wide = family_layer(Family::kQwen3Next, {.hidden = 1024, .intermediate = 512, .num_experts = 8,
                                                           .top_k = 4, .shared_intermediate = 512});
  const LayerDesc ragged = family_layer(Family::kDeepseekV3, {.hidden = 272, .intermediate = 176, .num_experts = 8,
                                                              .top_k = 4, .shared_intermediate = 144,
                                                              .routed_scaling_factor = 2.5});
  struct Forced {
    std::optional<PathKind> path;
    std::optional<bool> staged;
    const char* name;
  };
  const Forced forced[] = {{std::nullopt, std::nullopt, "default"},
                           {PathKind::kExpertMajor, true, "expert-major staged"},
                           {PathKind::kExpertMajor, false, "expert-major split-K"},
                           {PathKind::kTokenMajor, std::nullopt, "token-major"},
                           {PathKind::kPerRow, std::nullopt, "per-row"}};
  int compared = 0, tiled_runs = 0;
  for (const LayerDesc& d : {qwen, deepseek, wide, ragged}) {
    for (const QuantSpec spec : {QuantSpec{WeightFormat::kNVFP4}, QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128},
                                 QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerChannel}, QuantSpec{WeightFormat::kBF16}}) {
      const Layer layer = take(make_synthetic_layer(d, spec, 5));
      // The matrices each layout should hold in tiles: gate and up together, down on its own.
      const auto row_bytes = [&](int64_t cols) {
        return spec.format == WeightFormat::kNVFP4 ? cols / 2 : (spec.format == WeightFormat::kFP8 ? cols : 2 * cols);
      };
      const auto fits = [&](int64_t rows, int64_t cols) { return rows % 16 == 0 && row_bytes(cols) % 64 == 0; };
      const auto tiled_in = [&](int64_t inter) {
        return 2 * int{fits(inter, d.hidden)} + int{fits(d.hidden, inter)};
      };
      const int all = 3 * (d.num_experts + 1);
      const int tiled = d.num_experts * tiled_in(d.intermediate) + tiled_in(d.shared_intermediate);
      const std::string layout = tiled == 0     ? std::string("; row-major weights;")
                                 : tiled == all ? std::string("; weight tiles;")
                                                : fmt::format("; weight tiles ({} of {} matrices);", tiled, all);
      for (const int64_t n : {1, 5, 24, 40}) {
        const int64_t h = d.hidden;
        DeviceArray<float> x(static_cast<size_t>(n * h)), out(static_cast<size_t>(n * h));
        x.put(make_tokens(n, h, static_cast<uint64_t>(n) + 3));
        for (const Forced& f : forced) {
          std::vector<float> row_major;
          for (const bool tiles : {false, true}) {
            const CudaMoeOptions options{.path = f.path, .rank = 0, .ranks = 1, .staged = f.staged, .weight_tiles = tiles};
            const std::string what = fmt::format("H {}, I {}, {}, n {}, {}, tiles {}", h, d.intermediate,
                                                 quant_spec_name(spec), n, f.name, tiles);
            const std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, n, options));
            const std::string config = moe->call_config(n);
            EXPECT_NE(config.find(tiles ? layout : std::string("; row-major weights;")), std::string::npos)
                << what << ": " << config;
            out.poison();
            ASSERT_OK(moe->forward(x.ptr, n, out.ptr, nullptr));
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            const std::vector<float> got = out.get();
            ASSERT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); })) << what;
            if (!tiles) {
              row_major = got;
              continue;
            }
            EXPECT_EQ(std::memcmp(got.data(), row_major.data(), got.size() * sizeof(float)), 0) << what;
            ++compared;
            tiled_runs += tiled > 0;
          }
        }
      }
    }
  }
  EXPECT_EQ(compared, 4 * 4 * 4 * 5);  // shapes x formats x N x paths
  EXPECT_GT(tiled_runs, compared / 2);
}

// By default the experts are tiled where every call runs expert-major (the presets' shapes tile
// whole), and left row-major where the caller forces another path.
TEST_F(Cuda, WeightTilesByDefaultOnlyUnderExpertMajor) {
  const LayerDesc d = family_layer(Family::kQwen3Next, {.hidden = 256, .intermediate = 128, .num_experts = 8, .top_k = 2,
                                                        .shared_intermediate = 128});
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 2));
  const std::unique_ptr<CudaMoe> chosen = take(CudaMoe::create(layer, 4));
  EXPECT_EQ(chosen->plan().path, PathKind::kExpertMajor);
  EXPECT_NE(chosen->call_config(4).find("; weight tiles;"), std::string::npos) << chosen->call_config(4);
  for (const PathKind path : {PathKind::kTokenMajor, PathKind::kPerRow}) {
    const std::unique_ptr<CudaMoe> forced = take(CudaMoe::create(layer, 4, path));
    EXPECT_NE(forced->call_config(4).find("; row-major weights;"), std::string::npos) << forced->call_config(4);
  }
}

// create() reports two steps per expert of its slice: the loads (on all threads, so in any
// order, ending at S), then the uploads in order (S + 1 .. 2S), always out of 2S.
TEST_F(Cuda, CreateCountsLoadsThenUploads) {
  const LayerDesc d = family_layer(Family::kQwen3Next, {.hidden = 128, .intermediate = 64, .num_experts = 10, .top_k = 2,
                                                        .shared_intermediate = 64});
  for (const int ranks : {1, 3}) {
    const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 3));
    const ExpertSlice slice = expert_slice(d.num_experts, ranks - 1, ranks);
    const int64_t experts = slice.end - slice.begin;
    std::vector<std::pair<int64_t, int64_t>> calls;
    std::mutex lock;  // Layer::load_experts reports from one thread, but may not be the caller's
    take(CudaMoe::create(layer, 4, CudaMoeOptions{.path = std::nullopt, .rank = ranks - 1, .ranks = ranks}, [&](int64_t done, int64_t total) {
      const std::lock_guard<std::mutex> hold(lock);
      calls.emplace_back(done, total);
    }));
    const std::string what = fmt::format("rank {} of {}: {} experts", ranks - 1, ranks, experts);
    ASSERT_GE(calls.size(), static_cast<size_t>(experts + 1)) << what;
    const size_t loads = calls.size() - static_cast<size_t>(experts);
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(calls[i].second, 2 * experts) << what << ", call " << i;
      if (i < loads) {
        EXPECT_LE(calls[i].first, experts) << what << ", call " << i;
      } else {
        EXPECT_EQ(calls[i].first, experts + static_cast<int64_t>(i - loads) + 1) << what << ", call " << i;
      }
    }
    EXPECT_EQ(calls[loads - 1].first, experts) << what << ": the loads end at the slice's size";
  }
}

// The bench's compute peak: the cuBLAS GEMM checks its own product against the host before it
// times anything, so a result at all means it ran; an H200's dense bf16 peak is 989 TFLOP/s.
TEST_F(Cuda, Bf16PeakChecksItsProductAndStaysUnderTheSpec) {
  const double tflops = take(cuda_bf16_peak_tflops());
  EXPECT_GT(tflops, 10.0);
  EXPECT_LT(tflops, 2500.0) << "above any GPU's dense bf16 peak: the timing is wrong";
  EXPECT_EQ(cuda_bf16_peak_tflops(1000).status().message(),
            "cuda_bf16_peak_tflops: size 1000 is not a positive multiple of 256");
}

// ---- expert parallelism ---------------------------------------------------------------------

using testing::EpCase;
using testing::ep_cases;

class CudaEp : public Cuda {};

// Every rank of an expert-parallel layer on this one GPU, each uploading only its slice: the
// partial outputs must sum to the whole layer's output, on every path, with uneven slices,
// ranks that get no route or own no expert, and the shared and zero experts added once.
TEST_F(CudaEp, RankSlicesSumToTheWholeLayer) {
  int checked = 0;
  for (const EpCase& c : ep_cases()) {
    const LayerDesc d = family_layer(c.family, c.shape);
    const int64_t n = c.tokens, h = d.hidden;
    const std::vector<float> x = make_tokens(n, h, 23);
    const Layer whole = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 9));
    std::vector<float> expected(static_cast<size_t>(n * h));
    ASSERT_OK(moe_forward_reference(whole, x, n, expected));
    DeviceArray<float> dx(static_cast<size_t>(n * h)), dout(static_cast<size_t>(n * h));
    dx.put(x);
    for (PathKind path : {PathKind::kExpertMajor, PathKind::kTokenMajor, PathKind::kPerRow}) {
      std::unique_ptr<CudaMoe> one = take(CudaMoe::create(whole, n, CudaMoeOptions{.path = path}));
      dout.poison();
      ASSERT_OK(one->forward(dx.ptr, n, dout.ptr, nullptr));
      const std::vector<float> single = dout.get();
      for (int ranks : {2, 3, 4}) {
        std::vector<double> sum(static_cast<size_t>(n * h), 0.0);
        for (int rank = 0; rank < ranks; ++rank) {
          // A fresh layer per rank: what it loads is what that rank uploaded.
          const Layer mine = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 9));
          std::unique_ptr<CudaMoe> part =
              take(CudaMoe::create(mine, n, CudaMoeOptions{.path = path, .rank = rank, .ranks = ranks}));
          const ExpertSlice slice = expert_slice(d.num_experts, rank, ranks);
          EXPECT_EQ(mine.loaded_experts(), slice.end - slice.begin) << c.name << " rank " << rank << " of " << ranks;
          EXPECT_EQ(part->rank(), rank);
          dout.poison();
          ASSERT_OK(part->forward(dx.ptr, n, dout.ptr, nullptr));
          const std::vector<float> partial = dout.get();
          for (size_t i = 0; i < partial.size(); ++i) {
            ASSERT_TRUE(std::isfinite(partial[i])) << c.name << " rank " << rank << ": element " << i << " not written";
            sum[i] += partial[i];
          }
        }
        const std::vector<float> got(sum.begin(), sum.end());
        const std::string who = fmt::format("{} {} over {} ranks", c.name, path_name(path), ranks);
        // The same per-route outputs summed in another order: a few ulps. A lost route or a
        // shared expert added twice is a whole term, >= 1e-2 relative.
        EXPECT_LE(testing::rel_l2(got, single), 1e-5) << who << " against one rank";
        EXPECT_LE(testing::rel_l2(got, expected), 1e-2) << who << " against the reference";
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 7 * 3 * 3);
}

// The NCCL code path with the one rank this machine can give: the all-reduce is captured in the
// same CUDA graph as the layer, replays with new inputs, and the expert-parallel backend returns
// the layer's output.
TEST_F(CudaEp, OneRankAllReduceInAGraph) {
  if (!cuda_has_nccl()) GTEST_SKIP() << "this build has no NCCL: the GPU all-reduce is not tested";
  ASSERT_EQ(ep_size(), 1) << "run this binary without mpirun";
  std::unique_ptr<CudaAllReduce> reduce = take(CudaAllReduce::create());
  ASSERT_EQ(reduce->ranks(), 1);
  const LayerDesc d = family_layer(Family::kQwen3Next, {.hidden = 128, .intermediate = 64, .num_experts = 32, .top_k = 4,
                                                        .shared_intermediate = 64});
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 4));
  const int64_t n = 6, h = d.hidden;
  std::unique_ptr<CudaMoe> moe = take(CudaMoe::create(layer, n, CudaMoeOptions{.path = std::nullopt, .rank = 0, .ranks = 1}));
  DeviceArray<float> x(static_cast<size_t>(n * h)), out(static_cast<size_t>(n * h));
  x.put(make_tokens(n, h, 1));
  {
    CapturedGraph g;
    ASSERT_NO_FATAL_FAILURE(capture(g, cudaStreamNonBlocking, [&](cudaStream_t s) {
      ASSERT_OK(moe->forward(x.ptr, n, out.ptr, s));
      ASSERT_OK(reduce->sum(out.ptr, n * h, s));
    }));
    expect_replays_match(g, *moe, layer, x, out, n, 2, 4);
  }

  EpStats stats;
  std::unique_ptr<Backend> backend = take(make_cuda_ep_backend(std::nullopt, &stats));
  const std::vector<float> tokens = make_tokens(n, h, 7);
  std::vector<float> got(tokens.size(), std::nanf("")), expected(tokens.size());
  ForwardInfo info;
  ASSERT_OK(backend->forward(layer, tokens, n, got, &info));
  ASSERT_OK(moe_forward_reference(layer, tokens, n, expected));
  EXPECT_LE(testing::rel_l2(got, expected), 1e-2);
  EXPECT_EQ(stats.reduces, 1);
  EXPECT_GT(stats.reduce_seconds, 0.0);
  EXPECT_NE(info.detail.find("rank 0 of 1"), std::string::npos) << info.detail;
}

TEST_F(CudaEp, BadRankIsANamedError) {
  const LayerDesc d = family_layer(Family::kMixtral, {.hidden = 64, .intermediate = 32, .num_experts = 4, .top_k = 2});
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kBF16}, 1));
  EXPECT_EQ(CudaMoe::create(layer, 4, CudaMoeOptions{.path = std::nullopt, .rank = 2, .ranks = 2}).status().message(),
            "expert parallelism: rank 2 of 2 ranks");
  EXPECT_EQ(CudaMoe::create(layer, 4, CudaMoeOptions{.path = std::nullopt, .rank = 0, .ranks = 0}).status().message(),
            "expert parallelism: rank 0 of 0 ranks");
}

// The default choice between the expert-major kernels: staged only at one or two token tiles,
// and then once the grid holds 8 blocks per SM, the call 32 work items and the activations of K
// columns fit shared memory whole (48 KB); forcing overrides the last three conditions but not
// the first: past 48 KB it stages the activations in slices.
TEST(ExpertMajorSizing, StagedKernelsRunWhereTheyFillTheGpu) {
  // qwen3-30b on 132 SMs: gate_up's 768 rows make 12 row groups; 88 work items fill 1056 blocks.
  EXPECT_TRUE(cuda::expert_major_staged(-1, 8, 768, 2048, 88, 132));
  EXPECT_FALSE(cuda::expert_major_staged(-1, 8, 768, 2048, 87, 132));
  EXPECT_FALSE(cuda::expert_major_staged(-1, 32, 768, 2048, 1000, 132));  // 4 token tiles
  EXPECT_TRUE(cuda::expert_major_staged(-1, 16, 768, 2048, 257, 132));    // 2 token tiles
  EXPECT_FALSE(cuda::expert_major_staged(1, 32, 768, 2048, 1000, 132));
  // DeepSeek-V3 down at N = 1: 112 row groups x 11 items pass 1056 blocks, but not 32 items.
  EXPECT_FALSE(cuda::expert_major_staged(-1, 8, 7168, 2048, 11, 132));
  EXPECT_TRUE(cuda::expert_major_staged(-1, 8, 7168, 2048, 32, 132));
  // DeepSeek-V3 gate_up: 2048 rows make 32 row groups, so 33 items would fill the GPU, but K =
  // 7168 stages only in slices: split-K unless forced.
  EXPECT_FALSE(cuda::expert_major_staged(-1, 8, 2048, 7168, 1000, 132));
  EXPECT_TRUE(cuda::expert_major_staged(1, 8, 2048, 7168, 1, 132));
  // At two token tiles (DeepSeek-V3 N = 256: about 273 items) it runs staged in slices.
  EXPECT_TRUE(cuda::expert_major_staged(-1, 16, 2048, 7168, 273, 132));
  EXPECT_TRUE(cuda::expert_major_staged(-1, 8, 2048, 3008, 33, 132));  // the widest K staged whole
  EXPECT_FALSE(cuda::expert_major_staged(-1, 8, 2048, 3008, 32, 132));
  EXPECT_TRUE(cuda::expert_major_staged(1, 8, 768, 2048, 1, 132));
  EXPECT_FALSE(cuda::expert_major_staged(0, 8, 768, 2048, 1000, 132));
}

// What a staged block holds in shared memory: the whole K of 8 token columns where it fits
// 48 KB, else two buffers of 1024 columns; NVFP4 scale codes staged too only for down (one
// matrix) at K >= 2048, in whole 8-byte copies, and only beside whole-K activations.
TEST(ExpertMajorSizing, StagedBlocksHoldWholeKOrTwoSlices) {
  // The largest K that fits whole: 8 x (2 K rounded up to 128, + 16) <= 49152.
  EXPECT_EQ(8 * cuda::expert_major_staged_row_bytes(3008), 48256);
  EXPECT_TRUE(cuda::expert_major_staged_fits(3008));
  EXPECT_FALSE(cuda::expert_major_staged_fits(3072));
  EXPECT_EQ(cuda::kExpertMajorSliceBytes, 8 * (2048 + 16));
  EXPECT_EQ(cuda::expert_major_staged_smem(3072, 2, true), 2 * 8 * 2064);
  EXPECT_EQ(cuda::expert_major_staged_smem(7168, 1, true), 2 * 8 * 2064);  // no scale copy beside slices
  EXPECT_TRUE(cuda::expert_major_stages_scales(2048, 1));
  EXPECT_TRUE(cuda::expert_major_stages_scales(2944, 1));
  EXPECT_FALSE(cuda::expert_major_stages_scales(3072, 1));
  EXPECT_FALSE(cuda::expert_major_stages_scales(2048, 2));
  EXPECT_FALSE(cuda::expert_major_stages_scales(768, 1));
  EXPECT_FALSE(cuda::expert_major_stages_scales(2064, 1));
  EXPECT_EQ(cuda::expert_major_staged_scale_stride(2048), 136);  // 16 units of 8 bytes, padded to 17
  EXPECT_EQ(cuda::expert_major_staged_scale_stride(2944), 184);  // 23 already odd
  EXPECT_EQ(cuda::expert_major_staged_smem(2048, 1, true), 8 * 4112 + 64 * 136);
  EXPECT_EQ(cuda::expert_major_staged_smem(2048, 1, false), 8 * 4112);
  EXPECT_EQ(cuda::expert_major_staged_smem(2048, 2, true), 8 * 4112);
  // Two token tiles: twice the activations, no scale copy, within the two-tile opt-in.
  EXPECT_EQ(cuda::expert_major_staged_smem(2048, 1, true, 2), 16 * 4112);
  EXPECT_LE(cuda::expert_major_staged_smem(3008, 2, true, 2), cuda::kExpertMajorStaged2MaxSmem);
  EXPECT_LE(cuda::expert_major_staged_smem(2944, 1, true), cuda::kExpertMajorStagedMaxSmem);
}

// One token tile per item up to 8 routes per expert on average; where the down can run staged
// with its activations whole (the gate_up stages two tiles in slices at any K), two up to 16 (the
// staged kernels' second tile), else 4.
TEST(ExpertMajorSizing, StageableCallsRunTwoTokenTilesUpToSixteenRoutesPerExpert) {
  EXPECT_TRUE(cuda::expert_major_stageable(-1, 768));  // qwen3-30b
  EXPECT_TRUE(cuda::expert_major_stageable(1, 3008));
  EXPECT_TRUE(cuda::expert_major_stageable(-1, 2048));  // DeepSeek-V3: the down's K = 2048
  EXPECT_FALSE(cuda::expert_major_stageable(-1, 3072));
  EXPECT_FALSE(cuda::expert_major_stageable(0, 768));
  // DeepSeek-V3 (256 experts, top-8): N = 256 averages 8 routes per expert.
  EXPECT_EQ(cuda::expert_major_group(255, 8, 256, true), 8);
  EXPECT_EQ(cuda::expert_major_group(256, 8, 256, true), 16);
  // qwen3-30b (128 experts, top-8): N = 128 averages 8 routes per expert, N = 256 16.
  EXPECT_EQ(cuda::expert_major_group(127, 8, 128, true), 8);
  EXPECT_EQ(cuda::expert_major_group(128, 8, 128, true), 16);
  EXPECT_EQ(cuda::expert_major_group(129, 8, 128, true), 16);
  EXPECT_EQ(cuda::expert_major_group(256, 8, 128, true), 16);
  EXPECT_EQ(cuda::expert_major_group(257, 8, 128, true), cuda::kExpertMajorGroup);
  EXPECT_EQ(cuda::expert_major_group(128, 8, 128, false), 8);
  EXPECT_EQ(cuda::expert_major_group(129, 8, 128, false), cuda::kExpertMajorGroup);
}

// Which calls leave the selection to their gate_up kernel (no route kernel): one token, split-K
// gate_up at one token tile, a selection that fits one warp in 8 logits per lane.
TEST(ExpertMajorSizing, OneTokenCallsSelectInGateUpWhereOneWarpCan) {
  cuda::DevLayer L;  // qwen3-30b-a3b: 128 experts, top-8
  L.hidden = 2048, L.act_stride = 768, L.num_experts = 128, L.router_outputs = 128, L.top_k = 8, L.sm_count = 132;
  EXPECT_TRUE(cuda::expert_major_launch(L, 1).gate_up_selects);
  EXPECT_FALSE(cuda::expert_major_launch(L, 2).gate_up_selects);  // more than one token
  cuda::DevLayer staged = L;
  staged.staged = 1;  // gate_up forced staged
  EXPECT_FALSE(cuda::expert_major_launch(staged, 1).gate_up_selects);
  cuda::DevLayer on_input = L;
  on_input.weight_on_input = true;
  EXPECT_FALSE(cuda::expert_major_launch(on_input, 1).gate_up_selects);
  cuda::DevLayer ds = L;  // DeepSeek-V3: 256 experts in 8 groups, top-8, a shared expert
  ds.hidden = 7168, ds.act_stride = 2048, ds.num_experts = ds.router_outputs = 256, ds.has_shared = true;
  ds.n_group = 8, ds.topk_group = 4;
  EXPECT_FALSE(cuda::expert_major_launch(ds, 1).gate_up_selects);  // 128 x 9 blocks: 2.2 waves of 528
  cuda::DevLayer ds_narrow = ds;  // the same routing, I = 896: 56 x 9 = 504 blocks, one wave
  ds_narrow.act_stride = 896;
  EXPECT_TRUE(cuda::expert_major_launch(ds_narrow, 1).gate_up_selects);
  ds_narrow.act_stride = 944;  // 59 x 9 = 531 blocks
  EXPECT_FALSE(cuda::expert_major_launch(ds_narrow, 1).gate_up_selects);
  cuda::DevLayer next = ds;  // qwen3-next-80b-a3b: 512 experts, past 8 logits per lane
  next.num_experts = next.router_outputs = 512, next.n_group = 1, next.topk_group = 1, next.top_k = 10;
  EXPECT_FALSE(cuda::expert_major_launch(next, 1).gate_up_selects);
  cuda::DevLayer wide = L;  // 32 choices and a shared expert: 33 routes, past one warp
  wide.top_k = 32, wide.has_shared = true;
  EXPECT_FALSE(cuda::expert_major_launch(wide, 1).gate_up_selects);
}

// The down and blend of a call of up to 16 tokens run as one kernel where H / 16 blocks fit one
// per SM: up to 16 items with as many warps per item as fit, up to 4 (moe_expert_down_blend, where
// the down would be split-K); up to 128 one warp each in a rolled loop, where every expert's down
// takes one K loop (moe_expert_down_blend_rolled, whatever down the call would run otherwise:
// qwen3-30b N = 8 stages its down), unless staging is forced; it then runs no staged down.
TEST(ExpertMajorSizing, FewTokenCallsBlendInTheDownWhereItsBlocksFitOneWave) {
  const auto fused = [](const cuda::DevLayer& L, int n) {
    const cuda::ExpertMajorLaunch c = cuda::expert_major_launch(L, n);
    return fmt::format("{} x{}", c.down_blend_ways, c.down_blend_rounds);
  };
  cuda::DevLayer L;  // qwen3-30b-a3b: 8 items at N = 1; downs in NVFP4 tiles, as uploaded
  L.hidden = 2048, L.act_stride = 768, L.num_experts = 128, L.router_outputs = 128, L.top_k = 8, L.sm_count = 132;
  L.down_path = cuda::kPathNvfp4Tiled;
  EXPECT_EQ(fused(L, 1), "2 x1");
  EXPECT_EQ(fused(L, 2), "1 x1");  // up to 16 items
  EXPECT_EQ(fused(L, 3), "1 x2");  // up to 24 items
  EXPECT_EQ(fused(L, 5), "1 x3");  // 40
  EXPECT_EQ(fused(L, 8), "1 x4");  // 64
  EXPECT_FALSE(cuda::expert_major_launch(L, 8).staged_down);
  EXPECT_EQ(fused(L, 16), "1 x8");  // 128
  EXPECT_EQ(fused(L, 17), "0 x1");  // past 16 tokens
  cuda::DevLayer mixed = L;  // the experts' down K loops not known to agree: one round only
  mixed.down_path = cuda::kPathAny;
  EXPECT_EQ(fused(mixed, 2), "1 x1");
  EXPECT_EQ(fused(mixed, 3), "0 x1");
  cuda::DevLayer top2 = L;  // top-2: 2 items per token
  top2.top_k = 2;
  EXPECT_EQ(fused(top2, 2), "4 x1");
  EXPECT_EQ(fused(top2, 8), "1 x1");
  EXPECT_EQ(fused(top2, 9), "1 x2");
  EXPECT_EQ(fused(top2, 16), "1 x2");
  EXPECT_EQ(fused(top2, 17), "0 x1");
  cuda::DevLayer next = L;  // qwen3-next-80b-a3b: top-10 and a shared expert, 11 items
  next.act_stride = 512, next.num_experts = next.router_outputs = 512, next.top_k = 10, next.has_shared = true;
  EXPECT_EQ(fused(next, 1), "1 x1");
  EXPECT_EQ(fused(next, 2), "1 x2");  // 22 items
  EXPECT_EQ(fused(next, 3), "1 x3");  // 33
  EXPECT_EQ(fused(next, 11), "1 x8");  // 121
  EXPECT_EQ(fused(next, 12), "0 x1");  // 132: past 128
  cuda::DevLayer few = L;  // top-2 and a shared expert: 3 items, 4 warps each
  few.top_k = 2, few.has_shared = true;
  EXPECT_EQ(fused(few, 1), "4 x1");
  cuda::DevLayer many = L;  // 17 items: past 16 warps
  many.top_k = 16, many.has_shared = true;
  EXPECT_EQ(fused(many, 1), "1 x2");
  EXPECT_EQ(fused(many, 8), "0 x1");  // 136
  many.has_shared = false;  // 16 items: one warp each; 128 at 8 tokens
  EXPECT_EQ(fused(many, 1), "1 x1");
  EXPECT_EQ(fused(many, 8), "1 x8");
  cuda::DevLayer wide = L;  // H = 2128: 133 blocks on 132 SMs
  wide.hidden = 2128;
  EXPECT_EQ(fused(wide, 1), "0 x1");
  EXPECT_EQ(fused(wide, 8), "0 x1");
  wide.hidden = 2112;  // 132 blocks
  EXPECT_EQ(fused(wide, 1), "2 x1");
  cuda::DevLayer staged = L;
  staged.staged = 1;  // forced staged
  EXPECT_EQ(fused(staged, 1), "0 x1");
  EXPECT_EQ(fused(staged, 8), "0 x1");
  staged.staged = 0;  // forbidden: the down would be split-K anyway
  EXPECT_EQ(fused(staged, 8), "1 x4");
}

// What each N launches on the real shapes (132 SMs, the H200's), as the bench reports it.
TEST(ExpertMajorSizing, CallsChooseTheirKernelsByShapeAndTokens) {
  cuda::DevLayer qwen;  // qwen3-30b-a3b: 128 experts, top-8, H 2048, I 768; downs in NVFP4 tiles
  qwen.hidden = 2048, qwen.act_stride = 768, qwen.num_experts = 128, qwen.top_k = 8, qwen.sm_count = 132;
  qwen.down_path = cuda::kPathNvfp4Tiled;
  qwen.routed_expert_bytes = 2654220;  // NVFP4
  const auto choice = [](const cuda::DevLayer& L, int n) {
    const cuda::ExpertMajorLaunch c = cuda::expert_major_launch(L, n);
    // s: split-K, S: staged, L: staged in slices; 2, 4: staged in blocks of two or four 64-row passes;
    // p: split-K over 32-row pairs, b: split-K and the blend in one kernel (down only)
    const auto kernel = [](bool staged, bool sliced, int passes, bool pairs = false, bool blends = false) {
      return sliced ? "L" : (staged ? (passes == 4 ? "4" : passes == 2 ? "2" : "S") : (blends ? "b" : pairs ? "p" : "s"));
    };
    const std::string gate_up = c.gate_up_wide ? "w" : kernel(c.staged_gate_up, c.gate_up_sliced, 1);
    // Mixed token tiles: "+", the hot items' grid and their two-tile kernels (gate_up in slices).
    const std::string hot = c.mixed ? fmt::format(" +{} L{}", c.hot_max_items, kernel(true, false, c.hot_down_passes)) : "";
    return fmt::format("{} {} {}{}{}", c.group, c.max_items, gate_up,
                       kernel(c.staged_down, c.down_sliced, c.down_passes, c.down_pairs, c.down_blend_ways > 0), hot);
  };
  // 8-16 items: too few for either; down and blend in one kernel (128 blocks of H, one per SM),
  // up to 128 items (16 tokens)
  EXPECT_EQ(choice(qwen, 1), "8 8 sb");
  EXPECT_EQ(choice(qwen, 2), "8 16 sb");
  EXPECT_EQ(choice(qwen, 4), "8 32 sb");  // gate_up: 48 x 32 blocks of 16 rows under 20 x 132
  EXPECT_EQ(choice(qwen, 8), "8 64 wb");  // gate_up: 12 x 64 staged blocks < 8 x 132
  EXPECT_EQ(choice(qwen, 16), "8 128 Sb");  // gate_up staged: 12 x 128 blocks
  EXPECT_EQ(choice(qwen, 17), "8 136 SS");
  cuda::DevLayer mixed = qwen;  // the experts' downs in different K loops: the down kernels past 16 items
  mixed.down_path = cuda::kPathAny;
  EXPECT_EQ(choice(mixed, 4), "8 32 sp");
  EXPECT_EQ(choice(mixed, 8), "8 64 wS");  // down: 32 x 64 blocks past 8 x 132
  // Down's two passes from 28 blocks per SM of the two-pass grid (3696): 16 x 193 = 3088 is under
  // it; four (NVFP4 only) from 20 per SM of the four-pass grid (2640): 8 x 257 = 2056 is under it
  // Mixed token tiles by default only from 8 MB per expert: here forced, or at 8 MB (the same
  // calls past 2 routes per expert, N = 32 here, and past the fused blend, N = 17). The hot items'
  // grid 1 per 8 routes (512 / 8 = 64), its down one pass (16 x 64 two-pass blocks).
  EXPECT_EQ(choice(qwen, 64), "8 193 SS");
  EXPECT_EQ(choice(qwen, 127), "8 256 S2");  // 16 x 256 = 4096
  cuda::DevLayer large = qwen;
  large.routed_expert_bytes = cuda::kExpertMajorMixedFromBytes;
  EXPECT_EQ(choice(large, 64), "8 193 SS +64 LS");
  EXPECT_EQ(choice(large, 127), "8 256 S2 +127 LS");
  EXPECT_EQ(choice(large, 31), "8 160 SS");  // 248 routes: under 2 per expert
  large.routed_expert_bytes -= 1;
  EXPECT_EQ(choice(large, 64), "8 193 SS");
  cuda::DevLayer mixed_on = qwen;
  mixed_on.mixed_tiles = 1;  // forced: in place of the fused blend too, but not at 8 tokens or under
  EXPECT_EQ(choice(mixed_on, 16), "8 128 SS +16 LS");
  EXPECT_EQ(choice(mixed_on, 8), "8 64 wb");
  EXPECT_EQ(choice(mixed_on, 128), "16 193 LS");  // two token tiles throughout
  // From 8 routes per expert: two token tiles, gate_up in slices; 16 x 193 = 3088, one pass
  EXPECT_EQ(choice(qwen, 128), "16 193 LS");
  EXPECT_EQ(choice(qwen, 256), "16 257 L2");  // 16 x 257 = 4112
  qwen.nvfp4 = true;  // at two tiles four passes from 8 blocks per SM (1056): 8 x 193 = 1544
  EXPECT_EQ(choice(qwen, 128), "16 193 L4");
  EXPECT_EQ(choice(qwen, 256), "16 257 L4");
  EXPECT_EQ(choice(qwen, 257), "32 193 ss");
  cuda::DevLayer forced_off = qwen;
  forced_off.staged = 0;
  EXPECT_EQ(choice(forced_off, 64), "8 193 wp");
  EXPECT_EQ(choice(forced_off, 256), "32 193 ss");
  const auto passes_forced = [](cuda::DevLayer L, int passes) {
    L.staged_passes = static_cast<int8_t>(passes);
    return L;
  };
  cuda::DevLayer forced_on = qwen;
  forced_on.staged = 1;
  EXPECT_EQ(choice(forced_on, 1), "8 8 SS");
  EXPECT_EQ(choice(passes_forced(forced_on, 2), 1), "8 8 S2");  // forced: however small the grid
  EXPECT_EQ(choice(passes_forced(forced_on, 4), 1), "8 8 S4");
  EXPECT_EQ(choice(passes_forced(qwen, 1), 256), "16 257 LS");
  EXPECT_EQ(choice(passes_forced(mixed_on, 2), 64), "8 193 S2 +64 L2");
  EXPECT_EQ(choice(passes_forced(qwen, 2), 256), "16 257 L2");
  EXPECT_EQ(choice(passes_forced(mixed_on, 4), 64), "8 193 S4 +64 L4");
  EXPECT_EQ(choice(passes_forced(qwen, 4), 256), "16 257 L4");
  EXPECT_EQ(choice(passes_forced(qwen, 2), 128), "16 193 L2");
  EXPECT_EQ(choice(passes_forced(qwen, 2), 1), "8 8 sb");  // forcing passes stages nothing
  // qwen3-next-80b-a3b: 512 experts + shared, top-10, H 2048, I 512.
  cuda::DevLayer next;
  next.hidden = 2048, next.act_stride = 512, next.num_experts = 512, next.top_k = 10, next.has_shared = true;
  next.sm_count = 132;
  next.routed_expert_bytes = next.shared_expert_bytes = 1769484;  // NVFP4: no mixed tiles by default
  EXPECT_EQ(choice(next, 16), "8 176 SS");  // 16 x 176 = 2816 two-pass blocks
  next.down_path = cuda::kPathNvfp4Tiled;  // the rolled fused down at N = 2-11: 22-121 items
  EXPECT_EQ(choice(next, 3), "8 33 sb");
  EXPECT_EQ(choice(next, 8), "8 88 wb");
  EXPECT_EQ(choice(next, 16), "8 176 SS");
  next.down_path = cuda::kPathAny;
  EXPECT_EQ(choice(next, 32), "8 352 S2");  // 16 x 352 = 5632
  EXPECT_EQ(choice(next, 256), "8 866 S2");
  next.mixed_tiles = 1;  // else from 103 tokens (1024 routed routes)
  EXPECT_EQ(choice(next, 256), "8 866 S2 +352 L2");
  EXPECT_EQ(choice(next, 103), "8 655 S2 +141 LS");  // 1133 routes: 141 hot items at most
  next.mixed_tiles = -1;
  next.nvfp4 = true;  // four passes: 8 x 352 = 2816 four-pass blocks
  EXPECT_EQ(choice(next, 16), "8 176 SS");
  EXPECT_EQ(choice(next, 32), "8 352 S4");
  EXPECT_EQ(choice(next, 256), "8 866 S4");
  next.mixed_tiles = 1;
  EXPECT_EQ(choice(next, 256), "8 866 S4 +352 L4");  // the hot down's four passes: 8 x 352 blocks
  EXPECT_EQ(choice(passes_forced(next, 2), 256), "8 866 S2 +352 L2");  // forced below the auto choice too
  next.mixed_tiles = -1;
  next.sm_count = 144;  // a larger GPU: 2816 is under 20 x 144, 5632 over 28 x 144
  EXPECT_EQ(choice(next, 32), "8 352 S2");
  // DeepSeek-V3: 256 experts + shared, top-8, H 7168, I 2048: at one token tile gate_up split-K
  // (K = 7168 would be staged in slices) unless forced; from 8 routes per expert (N = 256) two
  // tiles, gate_up staged in slices.
  cuda::DevLayer ds;
  ds.hidden = 7168, ds.act_stride = 2048, ds.num_experts = 256, ds.top_k = 8, ds.has_shared = true, ds.sm_count = 132;
  ds.routed_expert_bytes = ds.shared_expert_bytes = 24772620;  // NVFP4
  EXPECT_EQ(choice(ds, 1), "8 9 sp");   // down: 448 blocks of H, past one per SM: no fused blend
  EXPECT_EQ(choice(ds, 2), "8 18 sp");  // down: 112 x 18 blocks, but under 32 items
  // gate_up: 32 x 36 blocks, but K = 7168 only in slices; down: one pass at 56 x 36 two-pass
  // blocks, two at 56 x 72 (N = 8) and up, where it does not copy NVFP4 scale codes, which it does
  // only in a layer with NVFP4 experts (and so makes no four passes)
  EXPECT_EQ(choice(ds, 4), "8 36 wS");
  EXPECT_EQ(choice(ds, 8), "8 72 w2");
  EXPECT_EQ(choice(ds, 255), "8 544 w2 +286 L2");  // mixed from 64 tokens
  EXPECT_EQ(choice(ds, 63), "8 328 w2");
  // 2304 routes: 144 + 1 + 257 items of up to 16; down two passes at 56 x 402 blocks
  EXPECT_EQ(choice(ds, 256), "16 402 L2");
  ds.nvfp4 = true;
  EXPECT_EQ(choice(ds, 4), "8 36 wS");
  EXPECT_EQ(choice(ds, 255), "8 544 wS +286 L4");
  EXPECT_EQ(choice(ds, 256), "16 402 L4");  // four passes: 28 x 402 blocks
  EXPECT_EQ(choice(ds, 512), "16 546 L4");  // 16 routes per expert
  EXPECT_EQ(choice(ds, 513), "32 402 ss");
  cuda::DevLayer ds_forced = ds;
  ds_forced.staged = 1;
  EXPECT_EQ(choice(ds_forced, 1), "8 9 LS");
  ds_forced.staged_passes = 4;  // sliced and scale-copying kernels make one pass whatever is forced
  EXPECT_EQ(choice(ds_forced, 1), "8 9 LS");
  ds_forced.nvfp4 = false;
  EXPECT_EQ(choice(ds_forced, 1), "8 9 L4");
}

// Forcing the tensor-core router on a layer it cannot run is refused before anything is uploaded
// (so this needs no GPU): an FP8 router, and rows that are not whole 8-column loads.
TEST(RouterMma, ForcedOnWhereItCannotRunIsANamedRefusal) {
  const LayerDesc d = family_layer(Family::kQwen3Moe, {.hidden = 64, .intermediate = 32, .num_experts = 8, .top_k = 2});
  Layer fp8 = take(make_synthetic_layer(d, {WeightFormat::kBF16}, 1));
  fp8.router = take(QuantMatrix::quantize(fp8.router.dequantize(), fp8.router.rows, fp8.router.cols,
                                          QuantSpec{WeightFormat::kFP8, Fp8Scaling::kPerChannel}));
  const Status s = CudaMoe::create(fp8, 4, router_options(true)).status();
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_EQ(s.message(), "router on the tensor cores: it needs a BF16 router with hidden_size a multiple of 8; this "
                         "layer's router is fp8-channel with hidden_size 64");
  const LayerDesc ragged = family_layer(Family::kQwen3Moe, {.hidden = 100, .intermediate = 32, .num_experts = 8, .top_k = 2});
  const Layer bf16 = take(make_synthetic_layer(ragged, {WeightFormat::kBF16}, 1));
  EXPECT_EQ(CudaMoe::create(bf16, 4, router_options(true)).status().message(),
            "router on the tensor cores: it needs a BF16 router with hidden_size a multiple of 8; this layer's router "
            "is bf16 with hidden_size 100");
}

// Mixed token tiles forced on where the two-tile kernels cannot run are refused before anything
// is uploaded (so this needs no GPU): with the staged kernels forbidden, and where the down's
// activations (I = 3200 bf16 columns per route, 8 routes) pass what one staging holds.
TEST(MixedTiles, ForcedOnWhereItCannotRunIsANamedRefusal) {
  const LayerDesc d = family_layer(Family::kQwen3Moe, {.hidden = 64, .intermediate = 32, .num_experts = 8, .top_k = 2});
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kBF16}, 1));
  CudaMoeOptions forced;
  forced.mixed_tiles = true;
  CudaMoeOptions staged_off = forced;
  staged_off.staged = false;
  const Status off = CudaMoe::create(layer, 16, staged_off).status();
  EXPECT_EQ(off.code(), StatusCode::kUnsupported);
  EXPECT_EQ(off.message(),
            "mixed token tiles run the hot experts in the staged kernels, which this call forbids (staged off)");
  const LayerDesc long_down = family_layer(Family::kQwen3Moe, {.hidden = 64, .intermediate = 3200, .num_experts = 8,
                                                               .top_k = 2});
  const Layer wide = take(make_synthetic_layer(long_down, {WeightFormat::kBF16}, 1));
  EXPECT_EQ(CudaMoe::create(wide, 16, forced).status().message(),
            "mixed token tiles: the two-tile down stages its activations whole, 8 token rows of 6416 bytes (3200 bf16 "
            "columns, padded) = 51328 per token tile, past the 49152 that staging holds");
  // Forbidding them is no refusal (without a GPU, create stops at the device instead).
  forced.mixed_tiles = false;
  EXPECT_NE(CudaMoe::create(wide, 16, forced).status().message().rfind("mixed token tiles", 0), 0u);
}

// Which calls run the shared expert apart, and the kernels of its own chain: the rules of
// expert_major_launch over its items alone.
TEST(ExpertMajorSizing, SharedExpertApartByShapeAndTokens) {
  // "-" where the call keeps the shared expert in its own kernels; else its chain's routes per
  // item, items, gate_up and down (s: split-K, w: split-K of 32 rows, p: split-K row pairs, S:
  // staged, L: staged in slices).
  const auto apart = [](const cuda::DevLayer& L, int n) -> std::string {
    const cuda::ExpertMajorLaunch c = cuda::expert_major_launch(L, n);
    if (!c.shared_apart) return "-";
    const cuda::ExpertMajorLaunch s = cuda::expert_major_shared_launch(L, c, n);
    EXPECT_FALSE(s.shared_apart || s.mixed || s.gate_up_selects || s.down_blend_ways > 0);
    const std::string gate_up = s.gate_up_wide ? "w" : s.gate_up_sliced ? "L" : s.staged_gate_up ? "S" : "s";
    const std::string down = s.down_sliced ? "L" : s.staged_down ? "S" : s.down_pairs ? "p" : "s";
    return fmt::format("{} {} {}{}", s.group, s.max_items, gate_up, down);
  };
  cuda::DevLayer ds;  // DeepSeek-V3: 256 experts + shared, top-8, H 7168, I 2048
  ds.hidden = 7168, ds.act_stride = 2048, ds.num_experts = 256, ds.top_k = 8, ds.has_shared = true;
  ds.router_outputs = 256, ds.sm_count = 132;
  ds.routed_expert_bytes = ds.shared_expert_bytes = 24772620;  // NVFP4
  // By default up to 8 tokens (one item) where the shared expert takes 8 MB or more
  EXPECT_EQ(apart(ds, 1), "8 1 sp");  // 128 gate_up blocks beside the router; the routed 1024
  EXPECT_EQ(apart(ds, 8), "8 1 sp");
  EXPECT_EQ(apart(ds, 9), "-");
  EXPECT_EQ(apart(ds, 256), "-");
  cuda::DevLayer forced = ds;
  forced.shared_apart = 1;
  EXPECT_EQ(apart(forced, 63), "8 8 sp");
  EXPECT_EQ(apart(forced, 64), "16 4 ss");  // the call mixes token tiles: 16 routes per item, as its hot items
  EXPECT_EQ(apart(forced, 256), "16 16 ss");  // two token tiles; 16 items are too few to stage
  forced.staged = 1;
  EXPECT_EQ(apart(forced, 256), "16 16 LS");
  cuda::DevLayer small_shared = ds;
  small_shared.shared_expert_bytes = cuda::kSharedApartFromBytes - 1;
  EXPECT_EQ(apart(small_shared, 1), "-");
  small_shared.shared_expert_bytes += 1;
  EXPECT_EQ(apart(small_shared, 1), "8 1 sp");
  cuda::DevLayer next;  // qwen3-next-80b-a3b: 512 experts + shared, top-10, H 2048, I 512
  next.hidden = 2048, next.act_stride = 512, next.num_experts = 512, next.top_k = 10, next.has_shared = true;
  next.router_outputs = 512, next.sm_count = 132;
  next.routed_expert_bytes = next.shared_expert_bytes = 1769484;  // NVFP4: under 8 MB
  next.down_path = cuda::kPathNvfp4Tiled;  // one K loop: the fused down and blend up to 16 tokens
  EXPECT_EQ(apart(next, 1), "-");
  next.shared_apart = 1;
  EXPECT_EQ(apart(next, 1), "8 1 sp");  // 512 router outputs: the gate_up cannot select
  EXPECT_TRUE(cuda::expert_major_launch(next, 8).down_blend_ways > 0);  // joined before the fused down
  EXPECT_EQ(apart(next, 8), "8 1 sp");
  EXPECT_EQ(apart(next, 256), "8 32 sp");  // not mixed (1.8 MB experts): 32 items, 256 blocks: split-K
  next.shared_apart = 0;
  EXPECT_EQ(apart(next, 1), "-");
  // A shared expert beside a one-token call whose gate_up selects (48 x 9 split-K blocks fit a
  // wave): by default the selection keeps it; forced, the route kernel selects again.
  cuda::DevLayer small;
  small.hidden = 2048, small.act_stride = 768, small.num_experts = 128, small.top_k = 8, small.has_shared = true;
  small.router_outputs = 128, small.sm_count = 132;
  small.shared_expert_bytes = cuda::kSharedApartFromBytes;
  EXPECT_TRUE(cuda::expert_major_launch(small, 1).gate_up_selects);
  EXPECT_EQ(apart(small, 1), "-");
  EXPECT_EQ(apart(small, 2), "8 1 sp");
  small.shared_apart = 1;
  EXPECT_FALSE(cuda::expert_major_launch(small, 1).gate_up_selects);
  EXPECT_EQ(apart(small, 1), "8 1 sp");
  // No shared expert (qwen3-30b-a3b, or another rank's slice): nothing apart, even forced.
  cuda::DevLayer qwen = small;
  qwen.has_shared = false;
  EXPECT_EQ(apart(qwen, 1), "-");
  EXPECT_EQ(apart(qwen, 64), "-");
}

// Which calls start the down's items as their gate_up finishes (expert_major_item_release): an early
// down that is staged; never where the mode forbids it.
TEST(ExpertMajorSizing, ItemReleaseWhereTheDownIsEarlyAndStaged) {
  const auto release = [](const cuda::DevLayer& L, int n) { return cuda::expert_major_launch(L, n).item_release; };
  cuda::DevLayer qwen;  // qwen3-30b-a3b: 128 experts, top-8, H 2048, I 768
  qwen.hidden = 2048, qwen.act_stride = 768, qwen.num_experts = 128, qwen.top_k = 8;
  qwen.router_outputs = 128, qwen.sm_count = 132;
  qwen.down_path = cuda::kPathNvfp4Tiled;
  EXPECT_FALSE(release(qwen, 1));  // the gate_up selects: no early down
  ASSERT_GT(cuda::expert_major_launch(qwen, 8).down_blend_ways, 0);
  EXPECT_FALSE(release(qwen, 8));  // the fused down and blend: every item in every block
  const cuda::ExpertMajorLaunch q64 = cuda::expert_major_launch(qwen, 64);
  ASSERT_TRUE(q64.staged_down && q64.early_down);
  EXPECT_TRUE(q64.item_release);
  EXPECT_TRUE(release(qwen, 256));  // two token tiles
  qwen.early_down = 0;
  EXPECT_FALSE(release(qwen, 64));  // no early down
  qwen.early_down = -1;
  qwen.item_release = 0;
  EXPECT_FALSE(release(qwen, 64));
  cuda::DevLayer ds;  // DeepSeek-V3: 256 experts + shared, top-8, H 7168, I 2048
  ds.hidden = 7168, ds.act_stride = 2048, ds.num_experts = 256, ds.top_k = 8, ds.has_shared = true;
  ds.router_outputs = 256, ds.sm_count = 132;
  ds.routed_expert_bytes = ds.shared_expert_bytes = 24772620;
  const cuda::ExpertMajorLaunch d4 = cuda::expert_major_launch(ds, 4);
  ASSERT_TRUE(d4.staged_down && d4.shared_apart);
  EXPECT_FALSE(d4.item_release);  // the shared expert apart: no early down
  const cuda::ExpertMajorLaunch d16 = cuda::expert_major_launch(ds, 16);
  ASSERT_TRUE(d16.staged_down && !d16.staged_gate_up);
  EXPECT_TRUE(d16.item_release);  // after a split-K gate_up
  const cuda::ExpertMajorLaunch d64 = cuda::expert_major_launch(ds, 64);
  ASSERT_TRUE(d64.mixed);
  EXPECT_FALSE(d64.item_release);  // two chains of launches: no early down
}

// Which calls launch their down during gate_up (expert_major_early_down): one stream, and after a
// gate_up that selects only the fused down of one round (expert_major_published_down); never where
// the mode forbids it.
TEST(ExpertMajorSizing, EarlyDownWhereTheKernelsAllowIt) {
  const auto early = [](const cuda::DevLayer& L, int n) { return cuda::expert_major_launch(L, n).early_down; };
  cuda::DevLayer qwen;  // qwen3-30b-a3b: 128 experts, top-8, H 2048, I 768
  qwen.hidden = 2048, qwen.act_stride = 768, qwen.num_experts = 128, qwen.top_k = 8;
  qwen.router_outputs = 128, qwen.sm_count = 132;
  qwen.down_path = cuda::kPathNvfp4Tiled;
  ASSERT_TRUE(cuda::expert_major_launch(qwen, 1).gate_up_selects);
  EXPECT_TRUE(early(qwen, 1));  // the fused down, reading the items its selecting gate_up publishes
  ASSERT_GT(cuda::expert_major_launch(qwen, 2).down_blend_ways, 0);
  EXPECT_TRUE(early(qwen, 2));  // the fused down and blend
  EXPECT_TRUE(early(qwen, 8));
  const cuda::ExpertMajorLaunch q16 = cuda::expert_major_launch(qwen, 16);
  ASSERT_TRUE(q16.staged_gate_up);
  EXPECT_TRUE(q16.early_down);  // staged gate_up
  EXPECT_TRUE(early(qwen, 256));  // two token tiles, the gate_up in slices
  cuda::DevLayer ds;  // DeepSeek-V3: 256 experts + shared, top-8, H 7168, I 2048
  ds.hidden = 7168, ds.act_stride = 2048, ds.num_experts = 256, ds.top_k = 8, ds.has_shared = true;
  ds.router_outputs = 256, ds.sm_count = 132;
  ds.routed_expert_bytes = ds.shared_expert_bytes = 24772620;
  ASSERT_TRUE(cuda::expert_major_launch(ds, 1).shared_apart);
  EXPECT_FALSE(early(ds, 1));  // a second stream joins before the blend
  ds.shared_apart = 0;
  const cuda::ExpertMajorLaunch d1 = cuda::expert_major_launch(ds, 1);
  ASSERT_TRUE(d1.down_pairs && !d1.staged_down);
  EXPECT_TRUE(d1.early_down);  // split-K row pairs
  ASSERT_TRUE(cuda::expert_major_launch(ds, 4).staged_down);
  EXPECT_TRUE(early(ds, 4));  // the staged down
  ASSERT_TRUE(cuda::expert_major_launch(ds, 64).mixed);
  EXPECT_FALSE(early(ds, 64));  // the hot experts' chain on a second stream
  ds.early_down = 0;
  EXPECT_FALSE(early(ds, 1));
  qwen.early_down = 1;  // forced: still only where the kernels allow it
  ASSERT_TRUE(cuda::expert_major_published_down(cuda::expert_major_launch(qwen, 1)));
  EXPECT_TRUE(early(qwen, 1));
  EXPECT_TRUE(early(qwen, 2));
  qwen.early_down = 0;
  EXPECT_FALSE(early(qwen, 1));
  cuda::DevLayer wide = qwen;  // top-20 of I = 256: 20 items, one warp each in two rounds (the rolled kernel)
  wide.top_k = 20, wide.act_stride = 256, wide.early_down = 1;
  const cuda::ExpertMajorLaunch w1 = cuda::expert_major_launch(wide, 1);
  ASSERT_TRUE(w1.gate_up_selects && w1.down_blend_ways == 1 && w1.down_blend_rounds == 2);
  EXPECT_FALSE(cuda::expert_major_published_down(w1));
  EXPECT_FALSE(w1.early_down);  // forced, but the rolled kernel reads no published items
}

// Which calls launch their gate_up during routing (expert_major_early_gate_up): by default calls of
// one token, forced every call; in both only on one stream (no shared expert apart, no mixed token
// tiles); never where the mode forbids it.
TEST(ExpertMajorSizing, EarlyGateUpOnOneStream) {
  const auto early = [](const cuda::DevLayer& L, int n) { return cuda::expert_major_launch(L, n).early_gate_up; };
  cuda::DevLayer qwen;  // qwen3-30b-a3b: 128 experts, top-8, H 2048, I 768
  qwen.hidden = 2048, qwen.act_stride = 768, qwen.num_experts = 128, qwen.top_k = 8;
  qwen.router_outputs = 128, qwen.sm_count = 132;
  ASSERT_TRUE(cuda::expert_major_launch(qwen, 1).gate_up_selects);
  EXPECT_TRUE(early(qwen, 1));  // after the router
  EXPECT_FALSE(early(qwen, 2));  // by default one-token calls only
  EXPECT_FALSE(early(qwen, 256));
  cuda::DevLayer ds;  // DeepSeek-V3: 256 experts + shared, top-8, H 7168, I 2048
  ds.hidden = 7168, ds.act_stride = 2048, ds.num_experts = 256, ds.top_k = 8, ds.has_shared = true;
  ds.router_outputs = 256, ds.sm_count = 132;
  ds.routed_expert_bytes = ds.shared_expert_bytes = 24772620;
  ASSERT_TRUE(cuda::expert_major_launch(ds, 1).shared_apart);
  EXPECT_FALSE(early(ds, 1));  // the shared expert's chain on a second stream
  ASSERT_TRUE(cuda::expert_major_launch(ds, 64).mixed);
  ds.early_gate_up = 1;  // forced: every call on one stream
  EXPECT_FALSE(early(ds, 64));  // the hot experts' chain on a second stream
  EXPECT_TRUE(early(ds, 16));
  EXPECT_FALSE(early(ds, 1));
  ds.shared_apart = 0;
  EXPECT_TRUE(early(ds, 1));
  ds.early_gate_up = 0;
  EXPECT_FALSE(early(ds, 1));
  EXPECT_FALSE(early(ds, 16));
  ds.early_gate_up = -1;
  EXPECT_TRUE(early(ds, 1));
  EXPECT_FALSE(early(ds, 2));
}

// The shared expert apart forced on in a layer without one is refused before anything is
// uploaded (so this needs no GPU); forbidding it is no refusal.
TEST(SharedApart, ForcedOnWithoutASharedExpertIsANamedRefusal) {
  const LayerDesc d = family_layer(Family::kQwen3Moe, {.hidden = 64, .intermediate = 32, .num_experts = 8, .top_k = 2});
  ASSERT_FALSE(d.has_shared());
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kBF16}, 1));
  CudaMoeOptions forced;
  forced.shared_apart = true;
  const Status st = CudaMoe::create(layer, 16, forced).status();
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_EQ(st.message(), "shared expert apart: this layer has no shared expert");
  forced.shared_apart = false;  // without a GPU, create stops at the device instead
  EXPECT_NE(CudaMoe::create(layer, 16, forced).status().message().rfind("shared expert apart", 0), 0u);
}

// Which staged GEMMs load their NVFP4 weights two chunks ahead: those whose kernel has the variant
// (gate_up and down neither sliced nor copying scale codes), in layers with NVFP4 experts unless
// forced, a down of two token tiles only below 12 routes per expert; forcing reaches no other kernel.
TEST(ExpertMajorSizing, TwoChunksAheadWhereTheKernelHasIt) {
  cuda::DevLayer qwen;  // qwen3-30b-a3b
  qwen.hidden = 2048, qwen.act_stride = 768, qwen.num_experts = 128, qwen.top_k = 8, qwen.sm_count = 132;
  const auto ahead = [](const cuda::DevLayer& L, int n) {
    const cuda::ExpertMajorLaunch c = cuda::expert_major_launch(L, n);
    return fmt::format("{}{}", c.gate_up_ahead, c.down_ahead);
  };
  EXPECT_EQ(ahead(qwen, 64), "11");  // FP8 / BF16 experts: one ahead
  qwen.nvfp4 = true;
  EXPECT_EQ(ahead(qwen, 1), "11");    // split-K both
  EXPECT_EQ(ahead(qwen, 8), "12");    // gate_up split-K, down staged
  EXPECT_EQ(ahead(qwen, 64), "22");
  // Two token tiles: gate_up in slices, one ahead; the down two ahead below 12 routes per expert
  // on average (N = 191: 1528 routes on 128 experts), one from there.
  EXPECT_EQ(ahead(qwen, 128), "12");
  EXPECT_EQ(ahead(qwen, 191), "12");
  EXPECT_EQ(ahead(qwen, 192), "11");
  EXPECT_EQ(ahead(qwen, 256), "11");
  cuda::DevLayer one = qwen;
  one.staged_ahead = 1;
  EXPECT_EQ(ahead(one, 64), "11");
  EXPECT_EQ(ahead(one, 128), "11");
  cuda::DevLayer two = qwen;
  two.nvfp4 = false, two.staged_ahead = 2;
  EXPECT_EQ(ahead(two, 64), "22");
  EXPECT_EQ(ahead(two, 256), "12");  // forced: two at any routes per expert
  // DeepSeek-V3: gate_up staged only in slices (forced), down copying NVFP4 scale codes: neither
  // kernel has the variant; without NVFP4 experts its down has it.
  cuda::DevLayer ds;
  ds.hidden = 7168, ds.act_stride = 2048, ds.num_experts = 256, ds.top_k = 8, ds.has_shared = true, ds.sm_count = 132;
  ds.nvfp4 = true, ds.staged = 1, ds.staged_ahead = 2;
  EXPECT_EQ(ahead(ds, 4), "11");
  ds.nvfp4 = false;
  EXPECT_EQ(ahead(ds, 4), "12");
}

// The K loop all of a layer's experts take (cuda::common_path, the upload's down_path and
// gate_up_path): one where every owned expert agrees, kPathAny where any differs or no expert is
// owned; another rank's experts (no rows) do not count. Matrices stand in by their fields alone
// (weight_path reads the pointers' alignment, never their bytes).
TEST(ExpertMajorSizing, CommonKLoopOfTheOwnedExperts) {
  const auto matrix = [](WeightFormat format, bool tiled = false) {
    cuda::DevMatrix m;
    m.data = reinterpret_cast<const uint8_t*>(uintptr_t{0x10000});
    m.block_scales = reinterpret_cast<const uint8_t*>(uintptr_t{0x20000});
    m.rows = 64, m.cols = 256, m.tiled = tiled;
    m.format = static_cast<uint8_t>(format);
    m.fp8_scaling = static_cast<uint8_t>(Fp8Scaling::kBlock128);
    return m;
  };
  const cuda::DevMatrix tiled = matrix(WeightFormat::kNVFP4, true), row_major = matrix(WeightFormat::kNVFP4);
  const cuda::DevMatrix fp8 = matrix(WeightFormat::kFP8), bf16 = matrix(WeightFormat::kBF16);
  ASSERT_EQ(cuda::weight_path(tiled), cuda::kPathNvfp4Tiled);
  ASSERT_EQ(cuda::weight_path(row_major), cuda::kPathNvfp4Aligned);
  ASSERT_EQ(cuda::weight_path(fp8), cuda::kPathFp8Block);
  ASSERT_EQ(cuda::weight_path(bf16), cuda::kPathBf16);
  const auto down = [](const cuda::DevExpert& x) { return cuda::weight_path(x.down); };
  const auto gate_up = [](const cuda::DevExpert& x) {
    const int gate = cuda::weight_path(x.gate);
    return gate == cuda::weight_path(x.up) ? gate : cuda::kPathAny;
  };
  std::vector<cuda::DevExpert> table(4, cuda::DevExpert{tiled, tiled, fp8});
  EXPECT_EQ(cuda::common_path(table.data(), table.size(), down), cuda::kPathFp8Block);
  EXPECT_EQ(cuda::common_path(table.data(), table.size(), gate_up), cuda::kPathNvfp4Tiled);
  table[2].down = bf16;  // one expert's down differs
  EXPECT_EQ(cuda::common_path(table.data(), table.size(), down), cuda::kPathAny);
  table[2].gate.rows = 0;  // ... but another rank owns it
  EXPECT_EQ(cuda::common_path(table.data(), table.size(), down), cuda::kPathFp8Block);
  table[3].up = row_major;  // gate and up of one expert differ: no common loop, even alone
  EXPECT_EQ(cuda::common_path(table.data(), table.size(), gate_up), cuda::kPathAny);
  EXPECT_EQ(cuda::common_path(table.data() + 3, 1, gate_up), cuda::kPathAny);
  EXPECT_EQ(cuda::common_path(table.data() + 2, 1, down), cuda::kPathAny);  // no owned expert
  EXPECT_EQ(cuda::common_path(table.data(), 0, down), cuda::kPathAny);
}

// The router's logits kernel and the blend's loop by their grids, on the real shapes (132 SMs,
// the H200's): the wide router from 1.5 blocks per SM, the loads-first blend within one wave.
TEST(ExpertMajorSizing, SelectionByWarpsWhereEachLaneHoldsAChoiceAndAtMostSixteenLogits) {
  cuda::DevLayer L;
  L.top_k = 10, L.n_group = 1, L.router_outputs = 512;  // qwen3-next
  EXPECT_TRUE(cuda::selection_by_warps(L));
  L.router_outputs = 513;
  EXPECT_FALSE(cuda::selection_by_warps(L));
  L.router_outputs = 256, L.top_k = 32, L.n_group = 32;
  EXPECT_TRUE(cuda::selection_by_warps(L));
  L.top_k = 33;
  EXPECT_FALSE(cuda::selection_by_warps(L));
  L.top_k = 8, L.n_group = 33;
  EXPECT_FALSE(cuda::selection_by_warps(L));
}

TEST(ExpertMajorSizing, UpToEightTokensSelectOnABlockEachPastOneHundredTwentyEightOutputs) {
  cuda::DevLayer L;
  L.top_k = 10, L.n_group = 1, L.router_outputs = 512;  // qwen3-next
  for (const int n : {1, 2, 8}) EXPECT_TRUE(cuda::selection_block_per_token(L, n)) << n;
  EXPECT_FALSE(cuda::selection_block_per_token(L, 9));
  L.route_token_blocks = 16;  // a device that runs clusters of 16 blocks
  EXPECT_TRUE(cuda::selection_block_per_token(L, 16));
  EXPECT_FALSE(cuda::selection_block_per_token(L, 17));
  L.route_token_blocks = 8;
  L.top_k = 8, L.n_group = 8, L.router_outputs = 256;  // DeepSeek-V3
  EXPECT_TRUE(cuda::selection_block_per_token(L, 8));
  L.router_outputs = 129;
  EXPECT_TRUE(cuda::selection_block_per_token(L, 2));
  L.top_k = 8, L.n_group = 1, L.router_outputs = 128;  // qwen3-30b: a warp per token
  EXPECT_FALSE(cuda::selection_block_per_token(L, 2));
  L.router_outputs = 520;  // past one warp: moe_route_kernel
  EXPECT_FALSE(cuda::selection_block_per_token(L, 2));
}

TEST(ExpertMajorSizing, RouteKernelOfTwoToEightBlocksIsOneCluster) {
  EXPECT_EQ(cuda::route_warps_blocks(1), 1);
  EXPECT_EQ(cuda::route_warps_blocks(9), 2);
  EXPECT_EQ(cuda::route_warps_blocks(64), 8);
  EXPECT_EQ(cuda::route_warps_blocks(65), 9);
  for (const int n : {1, 8, 65, 256}) EXPECT_FALSE(cuda::route_warps_clustered(n)) << n;
  for (const int n : {9, 16, 33, 64}) EXPECT_TRUE(cuda::route_warps_clustered(n)) << n;
}

TEST(ExpertMajorSizing, RouterAndBlendKernelsByGrid) {
  // Router rows: qwen3-next 512 experts and the shared expert's gate; qwen3-30b 128 experts.
  EXPECT_FALSE(cuda::router_logits_wide(513, 2048, 32, 132));   // 33 x 4 blocks
  EXPECT_TRUE(cuda::router_logits_wide(513, 2048, 64, 132));    // 33 x 8
  EXPECT_TRUE(cuda::router_logits_wide(513, 2048, 41, 132));    // 33 x 6, a partial token block
  EXPECT_FALSE(cuda::router_logits_wide(128, 2048, 128, 132));  // 8 x 16
  EXPECT_TRUE(cuda::router_logits_wide(128, 2048, 256, 132));   // 8 x 32
  EXPECT_FALSE(cuda::router_logits_wide(513, 2044, 256, 132));  // rows not whole 8-column loads
  // The narrow kernel's tokens per block: 1 for one token and where the 8-token grid is under one
  // block per SM (132), else 8.
  EXPECT_EQ(cuda::router_logits_tokens(128, 1, 132), 1);    // qwen3-30b: 64 row pairs
  EXPECT_EQ(cuda::router_logits_tokens(128, 2, 132), 1);    // 128 blocks at 1
  EXPECT_EQ(cuda::router_logits_tokens(128, 16, 132), 1);   // 1024 at 1, 128 at 8
  EXPECT_EQ(cuda::router_logits_tokens(128, 17, 132), 8);   // 192 at 8
  EXPECT_EQ(cuda::router_logits_tokens(513, 1, 132), 1);    // qwen3-next: 257 row pairs
  EXPECT_EQ(cuda::router_logits_tokens(513, 2, 132), 8);    // 257 at 8
  EXPECT_EQ(cuda::router_logits_tokens(513, 8, 132), 8);
  EXPECT_EQ(cuda::router_logits_tokens(256, 8, 132), 1);    // DeepSeek-V3: 128 row pairs
  EXPECT_EQ(cuda::router_logits_tokens(256, 9, 132), 8);    // 256 at 8
  EXPECT_EQ(cuda::router_logits_tokens(128, 16, 16), 8);    // 16 SMs: 128 blocks at 8
  // The tensor-core router: qwen3-next's 512 rows and the gate's 3 from row 512 are 5 groups of
  // 128, qwen3-30b's 1, DeepSeek-V3's 256 rows 2; K slices of 256 columns: 8, 8 and 28.
  EXPECT_EQ(cuda::router_mma_row_groups(512, true), 5);
  EXPECT_EQ(cuda::router_mma_row_groups(128, false), 1);
  EXPECT_EQ(cuda::router_mma_row_groups(126, true), 2);  // gate rows 128-130: the second group
  EXPECT_EQ(cuda::router_mma_row_groups(124, true), 1);  // gate rows 124-126
  EXPECT_EQ(cuda::router_mma_slices(7168), 28);
  EXPECT_EQ(cuda::router_mma_slices(2056), 9);
  // By default from 16 tokens where 8 tokens per block make a grid of 16 blocks or more.
  cuda::DevLayer qwen30;
  qwen30.hidden = 2048, qwen30.router_outputs = 128, qwen30.sm_count = 132, qwen30.router_mma_tokens = 512;
  EXPECT_FALSE(cuda::router_uses_mma(qwen30, 8));   // 1 x 1 x 8 blocks
  EXPECT_FALSE(cuda::router_uses_mma(qwen30, 15));  // 16 blocks, but under 16 tokens
  EXPECT_TRUE(cuda::router_uses_mma(qwen30, 16));   // 1 x 2 x 8
  EXPECT_TRUE(cuda::router_uses_mma(qwen30, 32));
  EXPECT_TRUE(cuda::router_uses_mma(qwen30, 256));
  cuda::DevLayer narrow = qwen30;  // one slice of K
  narrow.hidden = 256;
  EXPECT_FALSE(cuda::router_uses_mma(narrow, 120));  // 15 blocks
  EXPECT_TRUE(cuda::router_uses_mma(narrow, 121));   // 16
  EXPECT_FALSE(cuda::router_uses_mma(qwen30, 513));  // past the workspace it was given
  cuda::DevLayer next = qwen30;
  next.router_outputs = 512, next.shared_gate = true;
  EXPECT_FALSE(cuda::router_uses_mma(next, 15));  // 5 x 2 x 8 blocks, but under 16 tokens
  EXPECT_TRUE(cuda::router_uses_mma(next, 16));
  cuda::DevLayer ds = qwen30;
  ds.hidden = 7168, ds.router_outputs = 256;
  EXPECT_TRUE(cuda::router_uses_mma(ds, 16));  // 2 x 2 x 28
  ds.router_mma = 1;
  EXPECT_TRUE(cuda::router_uses_mma(ds, 1));
  ds.router_mma_tokens = 0;  // not a BF16 router
  EXPECT_FALSE(cuda::router_uses_mma(ds, 16));
  next.router_mma = 0;
  EXPECT_FALSE(cuda::router_uses_mma(next, 256));
  // The launch those rules give, as the launcher runs it and the bench names it.
  qwen30.router.cols = 2048;
  const auto launch = [](const cuda::DevLayer& L, int n) {
    const cuda::RouterLaunch r = cuda::router_launch(L, n);
    return std::tuple{r.kernel, r.tokens, r.grid[0], r.grid[1], r.grid[2]};
  };
  using K = cuda::RouterKernel;
  EXPECT_EQ(launch(qwen30, 1), std::tuple(K::kFma, 1, 64, 1, 1));      // 64 row pairs, 1 token per block
  EXPECT_EQ(launch(qwen30, 17), std::tuple(K::kMma, 8, 1, 3, 8));      // a partial token group
  cuda::DevLayer qwen30_fma = qwen30;
  qwen30_fma.router_mma = 0;
  EXPECT_EQ(launch(qwen30_fma, 17), std::tuple(K::kFma, 8, 64, 3, 1));  // 8 tokens per block, a partial one
  EXPECT_EQ(launch(qwen30, 64), std::tuple(K::kMma, 8, 1, 8, 8));      // 1 row group x 8 token groups x 8 slices
  EXPECT_EQ(launch(qwen30, 512), std::tuple(K::kMma, 8, 1, 64, 8));   // 8 tokens per block at every grid
  cuda::DevLayer next_launch = next;
  next_launch.router_mma = -1, next_launch.router.cols = 2048;
  EXPECT_EQ(launch(next_launch, 256), std::tuple(K::kMma, 8, 5, 32, 8));  // qwen3-next: 5 row groups
  EXPECT_EQ(launch(qwen30, 513), std::tuple(K::kFmaWide, 8, 8, 65, 1));  // 8 groups of 16 rows, past the MMA's 512
  // Blend grids of 8 blocks per token (H = 2048) at 3 resident blocks per SM.
  EXPECT_TRUE(cuda::blend_loads_first(8 * 49, 3, 132));
  EXPECT_FALSE(cuda::blend_loads_first(8 * 50, 3, 132));
  EXPECT_FALSE(cuda::blend_loads_first(8, 0, 132));  // no occupancy known: the loop
}

// The tile layout (cuda/weight_tiles.h) is a permutation of the matrix's bytes that keeps each
// 16-byte load whole, puts a tile's 16 rows x 64 bytes in one 1 KB run, and orders a panel's
// tiles along K. Host-only: runs without a GPU.
TEST(WeightTiles, OffsetsPermuteTheMatrixInWholeTiles) {
  for (const auto& [rows, row_bytes] : {std::pair<int64_t, int64_t>{16, 64}, {32, 192}, {48, 1024}, {96, 3584}}) {
    ASSERT_TRUE(cuda::tiles_fit(rows, row_bytes));
    std::vector<int> seen(static_cast<size_t>(rows * row_bytes), 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < row_bytes; ++b) {
        const int64_t at = cuda::tiled_offset(r, b, row_bytes);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, rows * row_bytes);
        ++seen[static_cast<size_t>(at)];
        // Within a 16-byte unit the bytes stay in order; a tile's rows are 64 bytes apart.
        if (b % 16 != 0) {
          ASSERT_EQ(at, cuda::tiled_offset(r, b - 1, row_bytes) + 1);
        }
        if (r % 16 != 0) {
          ASSERT_EQ(at, cuda::tiled_offset(r - 1, b, row_bytes) + 64);
        }
      }
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; })) << rows << " x " << row_bytes;
    // Tile t of panel p starts at (p x tiles per panel + t) KB.
    const int64_t per_panel = row_bytes / 64;
    EXPECT_EQ(cuda::tiled_offset(16, 0, row_bytes), per_panel * 1024);
    EXPECT_EQ(cuda::tiled_offset(15, row_bytes - 1, row_bytes), per_panel * 1024 - 1);
  }
  EXPECT_FALSE(cuda::tiles_fit(8, 64));    // half a tile's rows
  EXPECT_FALSE(cuda::tiles_fit(16, 96));   // a tile and a half along K
  EXPECT_FALSE(cuda::tiles_fit(0, 64));
}

// NVFP4 scales in scale tiles (cuda/weight_tiles.h) are a permutation of the matrix's scales that
// keeps each tile's 16 rows x 8 codes in one 128-byte run, in the weight tiles' order, with lane
// 4g + c's four codes (rows g and g + 8, groups 2c and 2c + 1) in its own 4-byte word. Host-only.
TEST(WeightTiles, ScaleTilesGiveEachLaneItsCodesInOneWord) {
  for (const auto& [rows, per_row] : {std::pair<int64_t, int64_t>{16, 8}, {32, 24}, {48, 128}, {96, 448}}) {
    std::vector<int> seen(static_cast<size_t>(rows * per_row), 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < per_row; ++j) {
        const int64_t at = cuda::tiled_scale_offset(r, j, per_row);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, rows * per_row);
        ++seen[static_cast<size_t>(at)];
        // The scale tile of (panel, chunk) lies where its weight tile does, at an eighth of the size.
        const int64_t tile = cuda::tiled_offset(r / 16 * 16, j / 8 * 64, per_row * 8) / cuda::kTileBytes;
        ASSERT_EQ(at / cuda::kScaleTileBytes, tile) << r << ", " << j;
        const int64_t g = r % 16 % 8, c = j % 8 / 2;
        ASSERT_EQ(at % cuda::kScaleTileBytes, 4 * (4 * g + c) + 2 * (r % 16 / 8) + j % 2) << r << ", " << j;
      }
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; })) << rows << " x " << per_row;
  }
}

// The upload's fold (cuda/nvfp4_scale_fold.h) leaves every dequantized value as it was, and every
// scale nonnegative with zero scales over zero codes; a matrix of positive scales is not copied.
TEST(Nvfp4ScaleFold, KeepsEveryValue) {
  const int64_t rows = 48, cols = 96;
  std::vector<float> values(static_cast<size_t>(rows * cols));
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (float& v : values) v = normal(rng);
  QuantMatrix m = take(QuantMatrix::quantize(values, rows, cols, {WeightFormat::kNVFP4}));
  std::vector<uint8_t> codes, scales;
  EXPECT_FALSE(cuda::fold_nvfp4_scale_signs(m.data, m.block_scales, &codes, &scales));
  EXPECT_TRUE(codes.empty() && scales.empty());

  sign_and_zero_scales(m);
  ASSERT_TRUE(cuda::fold_nvfp4_scale_signs(m.data, m.block_scales, &codes, &scales));
  QuantMatrix folded = m;
  folded.data = codes;
  folded.block_scales = scales;
  const std::vector<float> before = m.dequantize(), after = folded.dequantize();
  int zeros = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    ASSERT_EQ(before[i], after[i]) << "element " << i;  // -0 == +0
    zeros += after[i] == 0.0f;
  }
  EXPECT_GT(zeros, rows * cols / 7);  // the zero blocks, at least
  for (size_t b = 0; b < scales.size(); ++b) {
    EXPECT_EQ(scales[b] & 0x80u, 0u) << "block " << b;
    if (scales[b] == 0) {
      for (size_t i = 0; i < 8; ++i) EXPECT_EQ(codes[8 * b + i], 0u) << "block " << b;
    }
  }
  EXPECT_EQ(m.data[8 * 1], static_cast<uint8_t>(codes[8 * 1] ^ 0x88u));  // block 1: negative, flipped back
}

// The expert-major grid and its item buffer are sized on the host from (routes, experts) alone;
// the device may produce any grouping. Every routing must fit: count the items the device's
// grouping makes (one per `group` routes of an expert) for adversarial and random routings.
// Host-only: runs without a GPU.
TEST(ExpertMajorSizing, ItemsFitTheGridForAnyRouting) {
  std::mt19937 rng(5);
  int cases = 0;
  for (int experts : {1, 4, 8, 60, 128, 256, 512}) {
    for (int top_k : {1, 2, 4, 8, 10}) {
      if (top_k > experts) continue;
      for (bool shared : {false, true}) {
        for (int n : {1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, 64, 100, 128, 255, 256}) {
          for (int pattern = 0; pattern < 3; ++pattern) {  // identical tokens, random, round robin
            std::vector<int> counts(static_cast<size_t>(experts) + (shared ? 1 : 0), 0);
            std::vector<int> ids(static_cast<size_t>(experts));
            std::iota(ids.begin(), ids.end(), 0);
            for (int t = 0; t < n; ++t) {
              if (pattern == 1) std::shuffle(ids.begin(), ids.end(), rng);
              for (int j = 0; j < top_k; ++j) {
                const int e = pattern == 2 ? (t * top_k + j) % experts : ids[static_cast<size_t>(j)];
                ++counts[static_cast<size_t>(e)];
              }
            }
            if (shared) counts.back() = n;
            // A token picks distinct experts: what sizes the token tiles.
            for (const int c : counts) ASSERT_LE(c, n);
            const int routes = n * top_k + (shared ? n : 0);
            const int table = experts + (shared ? 1 : 0);
            for (const bool stageable : {false, true}) {
              const int group = cuda::expert_major_group(n, top_k, experts, stageable);
              // Two token tiles from 8 routes per expert on average up to 16 where staged; else one
              // up to 8, and 4 past it.
              const bool two = stageable && n * top_k >= 8 * experts && n * top_k <= 16 * experts;
              const int expected = two ? 16 : n * top_k <= 8 * experts ? 8 : cuda::kExpertMajorGroup;
              ASSERT_EQ(group, expected) << "n " << n;
              int items = 0;
              for (const int c : counts) items += (c + group - 1) / group;
              ASSERT_LE(items, cuda::expert_major_max_items(routes, table, group))
                  << experts << " experts, top-" << top_k << ", n " << n << ", pattern " << pattern;
              // The workspace is allocated for the smallest group, whose bound is the largest.
              ASSERT_LE(cuda::expert_major_max_items(routes, table, group), cuda::expert_major_max_items(routes, table));
              ASSERT_LE(cuda::expert_major_max_items(routes, table), cuda::expert_major_item_capacity(routes, table));
              // Mixed token tiles (any call at 8 routes per item may be forced to mix): experts of up
              // to 8 routes in one item each, the others in items of up to 16 from hot_offset.
              if (group == 8) {
                int one_tile = 0, hot = 0;
                for (const int c : counts) {
                  if (c > 8) {
                    hot += (c + 15) / 16;
                  } else {
                    one_tile += c > 0 ? 1 : 0;
                  }
                }
                const int offset = cuda::expert_major_hot_offset(routes, table);
                ASSERT_LE(one_tile, offset) << experts << " experts, top-" << top_k << ", n " << n;
                ASSERT_LE(hot, cuda::expert_major_hot_max_items(routes)) << experts << " experts, top-" << top_k << ", n " << n;
                ASSERT_LE(offset + cuda::expert_major_hot_max_items(routes), cuda::expert_major_item_capacity(routes, table));
              }
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 2000);
}

}  // namespace
}  // namespace moeinfer
