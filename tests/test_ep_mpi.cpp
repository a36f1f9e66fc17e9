// Expert parallelism, run under mpirun (-np 1, 2 and 3 in CTest): every rank's result must equal
// the single-process result, with uneven slices, ranks whose experts get no route, and the shared
// and zero experts added exactly once. On CPUs the ranks sum over MPI; on GPUs (one per rank,
// skipped loudly where the host has fewer) over NCCL.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include "cpu/moe_cpu.h"
#include "moeinfer/bench.h"
#include "moeinfer/cuda.h"
#include "moeinfer/ep.h"
#include "moeinfer/presets.h"
#include "ep_cases.h"
#include "test_util.h"

namespace moeinfer {
namespace {

using testing::take;

using testing::EpCase;
using testing::ep_cases;

// A case's layer description, tokens, and the single-process CPU output every rank must return.
struct EpFixture {
  LayerDesc d;
  std::vector<float> x;
  std::vector<float> expected;
};

EpFixture make_ep_fixture(const EpCase& c) {
  EpFixture f{family_layer(c.family, c.shape), {}, {}};
  f.x = make_tokens(c.tokens, f.d.hidden, 17);
  const Layer whole = take(make_synthetic_layer(f.d, {WeightFormat::kNVFP4}, 5));
  f.expected.assign(f.x.size(), std::nanf(""));
  const Status s = make_cpu_backend()->forward(whole, f.x, c.tokens, f.expected, nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return f;
}

class ExpertParallel : public ::testing::TestWithParam<EpCase> {};

TEST_P(ExpertParallel, EveryRankGetsTheSingleProcessResult) {
  const EpCase& c = GetParam();
  const auto [d, x, expected] = make_ep_fixture(c);

  // This rank's layer: only the experts of its slice may be loaded by the EP forward.
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 5));
  std::unique_ptr<Backend> ep = take(make_cpu_ep_backend());
  std::vector<float> got(x.size(), std::nanf(""));
  ASSERT_OK(ep->forward(layer, x, c.tokens, got, nullptr));
  const ExpertSlice slice = expert_slice(d.num_experts, ep_rank(), ep_size());
  EXPECT_LE(layer.loaded_experts(), slice.end - slice.begin) << "rank " << ep_rank() << " loaded another rank's expert";

  // Float sums in another order: a few ulps. A shared expert added twice, or a lost route,
  // is a whole term (>= 1e-2 relative).
  EXPECT_LE(testing::rel_l2(got, expected), 1e-5) << "rank " << ep_rank() << " of " << ep_size();
}

INSTANTIATE_TEST_SUITE_P(Cases, ExpertParallel, ::testing::ValuesIn(ep_cases()),
                         [](const ::testing::TestParamInfo<EpCase>& i) { return std::string(i.param.name); });

// Why this job cannot run expert parallelism on GPUs (empty when it can): no usable CUDA
// backend, no NCCL, or fewer GPUs than ranks on some host. Every rank gets the same answer, so
// no rank waits in a collective that another skipped.
std::string gpu_ep_unavailable() {
  std::string why;
  for (const BackendAvailability& b : backend_availability()) {
    if (b.kind == BackendKind::kCuda && !b.available) why = "no usable GPU: " + b.reason;
  }
  if (why.empty() && !cuda_has_nccl()) why = "this build has no NCCL";
  if (why.empty() && ep_local_rank() >= cuda_device_count()) {
    why = fmt::format("local rank {} but {} GPUs on its host", ep_local_rank(), cuda_device_count());
  }
  const double everyone = ep_min(why.empty() ? 1.0 : 0.0);
  if (everyone == 1.0) return {};
  return why.empty() ? "another rank cannot use a GPU" : why;
}

// The same cases on GPUs, one per rank, summed by NCCL: every path's result on every rank must
// be the single-process result.
class CudaExpertParallel : public ::testing::TestWithParam<EpCase> {
 protected:
  void SetUp() override {
    const std::string why = gpu_ep_unavailable();
    if (!why.empty()) GTEST_SKIP() << "expert parallelism on GPUs not tested here: " << why;
  }
};

TEST_P(CudaExpertParallel, EveryRankGetsTheSingleProcessResult) {
  const EpCase& c = GetParam();
  const auto [d, x, expected] = make_ep_fixture(c);
  // Expert-major rounds its tensor-core operands to bf16 (the backend-ops bound, 1e-2); the
  // other paths keep fp32 activations.
  for (const auto& [path, tolerance] : {std::pair{PathKind::kExpertMajor, 1e-2}, std::pair{PathKind::kTokenMajor, 1e-4},
                                        std::pair{PathKind::kPerRow, 1e-4}}) {
    const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 5));
    std::unique_ptr<Backend> ep = take(make_cuda_ep_backend(path));
    std::vector<float> got(x.size(), std::nanf(""));
    ASSERT_OK(ep->forward(layer, x, c.tokens, got, nullptr));
    const ExpertSlice slice = expert_slice(d.num_experts, ep_rank(), ep_size());
    EXPECT_EQ(layer.loaded_experts(), slice.end - slice.begin) << "rank " << ep_rank() << " uploads its slice alone";
    EXPECT_LE(testing::rel_l2(got, expected), tolerance)
        << path_name(path) << " on rank " << ep_rank() << " of " << ep_size();
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaExpertParallel, ::testing::ValuesIn(ep_cases()),
                         [](const ::testing::TestParamInfo<EpCase>& i) { return std::string(i.param.name); });

// The benchmark's expert-parallel bookkeeping, on `backend` over this job's ranks: every rank
// gets the same rows; the largest per-rank bytes lie between an even share and the whole (each
// rank reads its slice of the distinct experts, all read the router, so the ranks' bytes sum to
// at least the total); the all-reduce is timed apart.
BenchResult ep_bench_rows(BackendKind backend, WeightFormat format, std::vector<int64_t> tokens, int reps) {
  BenchConfig cfg;
  cfg.presets = {"qwen3-30b-a3b"};
  cfg.formats = {{format}};
  cfg.tokens = tokens;
  cfg.routings = {TokenRouting::kIndependent};
  cfg.backend = backend;
  cfg.reps = reps;
  cfg.ep = ep_size();
  BenchResult result = take(run_bench(cfg));
  EXPECT_EQ(result.rows.size(), tokens.size());
  for (const BenchRow& r : result.rows) {
    EXPECT_EQ(r.ranks, ep_size());
    EXPECT_EQ(ep_max(r.time_us), ep_min(r.time_us)) << "ranks disagree on N=" << r.tokens;
    EXPECT_EQ(ep_max(r.rank_bytes), ep_min(r.rank_bytes));
    EXPECT_LE(r.rank_bytes, r.bytes);
    EXPECT_GE(r.rank_bytes * ep_size(), r.bytes);
    // qwen3-30b-a3b has no identity experts: every route has weights. A rank's compute floor
    // is its share of the FLOPs at its own peak, so the slowest rank's is at most the whole
    // call's at the slowest rank's peak.
    const Preset* p = take(find_preset("qwen3-30b-a3b"));
    const LayerDesc d = family_layer(p->family, p->shape);
    EXPECT_EQ(r.flops, call_flops(d, r.tokens, static_cast<double>(r.tokens * d.top_k)));
    EXPECT_EQ(ep_max(r.compute_us), ep_min(r.compute_us));
    EXPECT_GT(r.compute_us, 0.0);
    EXPECT_LE(r.compute_us, r.flops / (result.peak_gflops * 1e3) * (1 + 1e-9));
    if (ep_size() > 1) {
      EXPECT_LT(r.rank_bytes, r.bytes) << "a rank read every expert";
    }
  }
  return result;
}

TEST(ExpertParallelBench, RowsAgreeAcrossRanksAndSplitTheBytes) {
  const BenchResult result = ep_bench_rows(BackendKind::kCpu, WeightFormat::kBF16, {1, 3}, 2);
  for (const BenchRow& r : result.rows) {
    if (ep_size() > 1) {
      EXPECT_GT(r.allreduce_us, 0.0);
      EXPECT_LT(r.allreduce_us, r.time_us);
    }
  }
}

// The same on GPUs, where the all-reduce is timed alone over graph replays and the floor is the
// largest rank's bytes over one GPU's bandwidth.
TEST(CudaExpertParallelBench, RowsAgreeAcrossRanksAndSplitTheBytes) {
  const std::string why = gpu_ep_unavailable();
  if (!why.empty()) GTEST_SKIP() << "expert parallelism on GPUs not tested here: " << why;
  const BenchResult result = ep_bench_rows(BackendKind::kCuda, WeightFormat::kNVFP4, {1, 16}, 3);
  for (const BenchRow& r : result.rows) {
    EXPECT_GT(r.allreduce_us, 0.0);  // NCCL runs a kernel even for one rank
    EXPECT_LT(r.allreduce_us, r.time_us);
    EXPECT_NEAR(r.floor_us, r.rank_bytes / (result.read_gbps * 1e3), 1e-9 * r.floor_us);
  }
}

}  // namespace
}  // namespace moeinfer

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!moeinfer::ep_init(&argc, &argv).ok()) return 1;
  if (moeinfer::ep_rank() != 0) {  // one report, from rank 0; the others still fail the run
    delete ::testing::UnitTest::GetInstance()->listeners().Release(
        ::testing::UnitTest::GetInstance()->listeners().default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  int worst = rc;
  moeinfer::ep_finalize();
  return worst;
}
