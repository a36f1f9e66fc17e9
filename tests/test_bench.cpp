// The benchmark's compute floor: the FLOPs it counts per call, and the rows it fills from them.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <string>

#include "cpu/moe_cpu.h"
#include "moeinfer/bench.h"
#include "moeinfer/presets.h"
#include "test_util.h"

namespace moeinfer {
namespace {

using testing::take;

LayerDesc preset_desc(const char* name) {
  const Preset* p = take(find_preset(name));
  return family_layer(p->family, p->shape);
}

// Per token, by hand from DESIGN.md's shapes (router H x E, shared gate H, each route 3 H I,
// shared expert 3 H I_shared; 2 FLOPs per multiply-add).
TEST(BenchFlops, CountEveryMultiplyAddOfTheLayer) {
  // 2 (2048 x 512 + 2048 + 10 x 3 x 2048 x 512 + 3 x 2048 x 512)
  EXPECT_EQ(call_flops(preset_desc("qwen3-next-80b-a3b"), 1, 10), 71307264.0);
  // 2 (2048 x 128 + 8 x 3 x 2048 x 768), no shared expert
  EXPECT_EQ(call_flops(preset_desc("qwen3-30b-a3b"), 1, 8), 76021760.0);
  EXPECT_EQ(call_flops(preset_desc("qwen3-30b-a3b"), 3, 24), 3 * 76021760.0);
  // 2 (7168 x 256 + 8 x 3 x 7168 x 2048 + 3 x 7168 x 2048), no shared gate
  EXPECT_EQ(call_flops(preset_desc("deepseek-v3"), 1, 8), 796393472.0);
  // LongCat-Flash: the router scores 512 + 256 identity experts; of 4 tokens' 48 routes, 30 to
  // experts with weights: 2 (4 x 6144 x 768 + 30 x 3 x 6144 x 2048).
  EXPECT_EQ(call_flops(preset_desc("longcat-flash"), 4, 30), 2302672896.0);
}

// A CPU bench row's compute floor is its FLOPs at the peak measured in the same run, and the
// outputs carry it.
TEST(Bench, CpuRowsCarryTheComputeFloor) {
  BenchConfig cfg;
  cfg.presets = {"qwen3-30b-a3b"};
  cfg.formats = {{WeightFormat::kNVFP4}};
  cfg.tokens = {1, 2};
  cfg.routings = {TokenRouting::kIndependent};
  cfg.backend = BackendKind::kCpu;
  cfg.inputs = 2;
  cfg.reps = 1;
  const BenchResult result = take(run_bench(cfg));
  EXPECT_GT(result.peak_gflops, 0.0);
  EXPECT_NE(result.peak_how.find("thread"), std::string::npos) << result.peak_how;
  ASSERT_EQ(result.rows.size(), 2u);
  const LayerDesc d = preset_desc("qwen3-30b-a3b");
  // Each row names the inner loop and the threads its calls ran on, as the peak's measurement
  // found them on this host.
  // (No std::regex: in the sanitizer build GCC 12 warns inside it, and warnings are errors.)
  const size_t word = result.peak_how.find(" thread");
  ASSERT_NE(word, std::string::npos) << result.peak_how;
  size_t digits = word;
  while (digits > 0 && std::isdigit(static_cast<unsigned char>(result.peak_how[digits - 1]))) --digits;
  ASSERT_LT(digits, word) << result.peak_how;
  const std::string threads = result.peak_how.substr(digits, word - digits) + " thread";
  const bool avx2 = result.peak_how.find("AVX2 FMA") != std::string::npos ||
                    result.peak_how.find("AVX-512 FMA") != std::string::npos;
  EXPECT_EQ(result.peak_how.find("AVX-512 FMA") != std::string::npos, cpu_host_loops() == CpuLoops::kAvx512)
      << result.peak_how;
  for (const BenchRow& r : result.rows) {
    EXPECT_NE(r.config.find(avx2 ? "AVX2 decode in registers" : "no AVX2"), std::string::npos) << r.config;
    EXPECT_EQ(r.config.find("(NVFP4, FP8 in AVX-512)") != std::string::npos, cpu_host_loops() == CpuLoops::kAvx512)
        << r.config;
    EXPECT_NE(r.config.find(threads), std::string::npos) << r.config << " against " << result.peak_how;
    EXPECT_EQ(r.flops, call_flops(d, r.tokens, static_cast<double>(r.tokens * d.top_k))) << "N=" << r.tokens;
    EXPECT_NEAR(r.compute_us, r.flops / (result.peak_gflops * 1e3), 1e-9 * r.compute_us);
    EXPECT_NEAR(r.compute_fraction * r.time_us, r.compute_us, 1e-9 * r.compute_us);
    EXPECT_EQ(r.bound, r.compute_us > r.floor_us ? "compute" : "memory");
  }
  const nlohmann::json j = nlohmann::json::parse(result.json());
  EXPECT_EQ(j["peak_gflops"].get<double>(), result.peak_gflops);
  EXPECT_EQ(j["rows"][1]["flops"].get<double>(), result.rows[1].flops);
  EXPECT_EQ(j["rows"][1]["bound"].get<std::string>(), result.rows[1].bound);
  EXPECT_NE(result.csv().find(",flops,compute_us,compute_fraction,bound,peak_gflops\n"), std::string::npos);
  EXPECT_NE(result.table().find("compute us"), std::string::npos);
}

// Where the peak could not be measured (a GPU bench without cuBLAS), the table says why and
// leaves the compute columns empty rather than dividing by zero.
TEST(Bench, TableWithoutAPeakSaysWhy) {
  BenchResult result;
  result.device = "GPU";
  result.read_gbps = 4400;
  result.peak_how = "not measured: cuBLAS did not open";
  BenchRow row;
  row.preset = "qwen3-30b-a3b";
  row.format = "nvfp4";
  row.routing = "independent";
  row.tokens = 1;
  row.path = "expert-major";
  row.time_us = 20.0;
  row.flops = 76021760.0;
  result.rows.push_back(row);
  const std::string table = result.table();
  EXPECT_NE(table.find("compute peak not measured: cuBLAS did not open\n"), std::string::npos) << table;
  EXPECT_NE(table.find("    0.08          -       -       -"), std::string::npos) << table;
  EXPECT_EQ(table.find("inf"), std::string::npos) << table;
  EXPECT_EQ(table.find("nan"), std::string::npos) << table;
  EXPECT_EQ(table.find("note:"), std::string::npos) << table;
}

// Rows past their byte floor (the bandwidth measured at the start came out low on a busy machine,
// or the bytes came from caches) are counted under the table, with the largest fraction, so that
// nobody reads 114% as a kernel beating memory.
TEST(Bench, TableNotesRowsPastTheirFloor) {
  BenchResult result;
  result.device = "CPU (2 threads)";
  result.read_gbps = 6.4;
  BenchRow row;
  row.preset = "qwen3-30b-a3b";
  row.format = "bf16";
  row.routing = "independent";
  row.path = "cpu";
  for (const auto& [tokens, fraction] : {std::pair{1, 0.30}, std::pair{2, 1.14}, std::pair{4, 1.07}}) {
    row.tokens = tokens;
    row.fraction = fraction;
    result.rows.push_back(row);
  }
  EXPECT_NE(result.table().find("note: 2 rows ran past the byte floor (up to 114% of it): the read bandwidth measured "
                                "at the start (6 GB/s) understates what those rows saw"),
            std::string::npos)
      << result.table();
  result.rows.pop_back();
  EXPECT_NE(result.table().find("note: 1 row ran past the byte floor (up to 114% of it)"), std::string::npos);
  EXPECT_NE(result.table().find("so its fraction overstates\n"), std::string::npos) << result.table();
  result.rows.pop_back();
  EXPECT_EQ(result.table().find("note:"), std::string::npos) << result.table();
}

}  // namespace
}  // namespace moeinfer
