// One CPU core's speed at cpu_row_dots, the CPU backend's inner loop, per weight format and
// tokens per decode: the rows of 48 matrices of 1536 x 2048 (qwen3-30b's gate_up shape; more
// bytes than any L3 here, so the weights come from DRAM as in a layer call) dotted with M
// distinct tokens. --cols K keeps the weights' count and gives the matrices K columns
// (DeepSeek-V3's 7168, say). --pairs dots the rows two at a time (cpu_row_pair_dots, as the
// backend does). Prints the best of 5 passes as weight GB/s and multiply-adds per
// second.
//
//   build/tools/probe_cpu_row_dots [bf16|fp8|nvfp4 ...] [--tokens 1,2,4,8] [--loops avx2|avx512] [--cols K] [--pairs]
// --loops picks the inner loops (moeinfer::CpuLoops; default: the host's fastest).
// Run it with OMP_NUM_THREADS=1 beside nothing else; `moeinfer bench --backend cpu` is the
// measure of a whole call.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "cpu/moe_cpu.h"

namespace {

using moeinfer::QuantMatrix;
using moeinfer::QuantSpec;
using moeinfer::WeightFormat;

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  for (size_t p = 0; p < s.size();) {
    const size_t q = std::min(s.find(',', p), s.size());
    out.push_back(std::atoi(s.substr(p, q - p).c_str()));
    p = q + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> formats;
  std::vector<int> tokens = {1, 2, 4, 8};
  moeinfer::CpuLoops loops = moeinfer::cpu_host_loops();
  int64_t cols = 2048;
  bool pairs = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokens" && i + 1 < argc) {
      tokens = parse_list(argv[++i]);
    } else if (a == "--loops" && i + 1 < argc && (std::string(argv[i + 1]) == "avx2" || std::string(argv[i + 1]) == "avx512")) {
      loops = std::string(argv[++i]) == "avx2" ? moeinfer::CpuLoops::kAvx2 : moeinfer::CpuLoops::kAvx512;
      if (loops > moeinfer::cpu_host_loops()) {
        fmt::print(stderr, "--loops {}: this CPU does not run them\n", argv[i]);
        return 2;
      }
    } else if (a == "--cols" && i + 1 < argc) {
      cols = std::atoll(argv[++i]);
      if (cols < 128 || cols % 128 != 0 || cols > 65536) {
        fmt::print(stderr, "--cols: {} is not a multiple of 128 from 128 to 65536\n", argv[i]);
        return 2;
      }
    } else if (a == "--pairs") {
      pairs = true;
    } else if (a == "bf16" || a == "fp8" || a == "nvfp4") {
      formats.push_back(a);
    } else {
      fmt::print(stderr, "usage: probe_cpu_row_dots [bf16|fp8|nvfp4 ...] [--tokens 1,2,4,8] [--loops avx2|avx512] [--cols K] [--pairs]\n");
      return 2;
    }
  }
  if (formats.empty()) formats = {"bf16", "fp8", "nvfp4"};
  for (int m : tokens) {
    if (m < 1 || m > 64) {
      fmt::print(stderr, "--tokens: {} is not a token count from 1 to 64\n", m);
      return 2;
    }
  }
  const int64_t rows = 1536 * 2048 / cols;
  constexpr int kMatrices = 48;
  std::vector<float> values(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
  for (const std::string& f : formats) {
    QuantSpec spec{WeightFormat::kBF16};
    if (f == "fp8") spec = {WeightFormat::kFP8, moeinfer::Fp8Scaling::kBlock128};
    if (f == "nvfp4") spec = {WeightFormat::kNVFP4};
    std::vector<QuantMatrix> matrices;
    size_t bytes = 0;
    for (int i = 0; i < kMatrices; ++i) {
      matrices.push_back(QuantMatrix::quantize(values, rows, cols, spec).value());
      bytes += matrices.back().data.size() + matrices.back().block_scales.size();
    }
    for (int m : tokens) {
      // x from a 64-byte boundary, as the CPU backend holds its jobs' inputs (CacheLineAllocator).
      std::vector<float> storage(static_cast<size_t>(m * cols + 16)), out(static_cast<size_t>(2 * m)), row;
      const size_t skip = (16 - reinterpret_cast<uintptr_t>(storage.data()) / sizeof(float) % 16) % 16;
      const std::span<float> x(storage.data() + skip, static_cast<size_t>(m * cols));
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 97) / 97.0f - 0.5f;
      double best = 1e30, sink = 0.0;
      for (int pass = 0; pass < 5; ++pass) {
        const auto start = std::chrono::steady_clock::now();
        for (const QuantMatrix& w : matrices) {
          for (int64_t r = 0; r < rows; r += pairs ? 2 : 1) {
            if (pairs) {
              moeinfer::cpu_row_pair_dots(w, r, x.data(), cols, m, out.data(), out.data() + m, row, loops);
            } else {
              moeinfer::cpu_row_dots(w, r, x.data(), cols, m, out.data(), row, loops);
            }
            sink += out[0];
          }
        }
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      const double macs = static_cast<double>(rows * cols) * kMatrices * m;
      fmt::print("{:6} M={:<2} {:8.2f} ms  {:6.2f} GB/s of weights  {:6.2f} G multiply-adds/s  (sum {:.3g})\n", f, m,
                 best * 1e3, static_cast<double>(bytes) / best / 1e9, macs / best / 1e9, sink);
    }
  }
  return 0;
}
