// The fast CPU backend (internal; reached through make_backend(BackendKind::kCpu)).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moeinfer/backend.h"
#include "moeinfer/format.h"

namespace moeinfer {

// Expert parallelism for the CPU backend: this rank of `ranks` computes only its expert slice
// (rank 0 also the shared and zero experts), then `reduce` sums the partial outputs in place.
struct CpuEpConfig {
  int rank = 0;
  int ranks = 1;
  std::function<Status(std::span<float>)> reduce;
};

std::unique_ptr<Backend> make_cpu_backend(CpuEpConfig ep = {});

// The CPU backend runs a call's experts in batches of about this many routes (the last expert
// of a batch may take it past), all of a batch's experts on one team of threads: it bounds the
// inputs, activations and outputs held at once, about routes x (2 H + intermediate) floats.
inline constexpr int64_t kCpuRoutesPerBatch = 1024;

// Row r of m as floats, the values of QuantMatrix::dequantize_row (the sign of a zero aside),
// decoded with AVX2 where the CPU has it.
void cpu_decode_row(const QuantMatrix& m, int64_t r, float* out);

// The most tokens that cpu_row_dots applies one register decode of a row to: 8 accumulators of
// 8 floats, the two halves of a decoded NVFP4 group and a temporary fill AVX2's 16 registers.
inline constexpr int kCpuTokenTile = 8;

// out[j] = row r of m . (x + j * stride) for j < tokens. With AVX2 each weight is decoded into
// registers once per tile of up to kCpuTokenTile tokens; without it, once into `row` (scratch),
// which is then dotted with each token.
void cpu_row_dots(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, int64_t tokens, float* out,
                  std::vector<float>& row);

// The inner loops cpu_row_dots can run, each needing more of the CPU than the one before:
// rows decoded to floats, then dotted (any CPU); AVX2 with FMA and F16C (weights decoded in
// registers); AVX-512 F, BW, VL and VBMI (NVFP4 and FP8 decoded 16 values to a register; BF16 as
// with AVX2).
enum class CpuLoops { kPortable, kAvx2, kAvx512 };

// The fastest loops this host runs: what cpu_row_dots uses.
CpuLoops cpu_host_loops();

// cpu_row_dots on the given loops, or on the host's fastest where it lacks them (tests and probes
// compare the loops).
void cpu_row_dots(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, int64_t tokens, float* out,
                  std::vector<float>& row, CpuLoops loops);

// Past this many bytes of a tile's token values, cpu_row_pair_dots runs two rows in one pass over
// them: on AVX-512, K = 7168 (DeepSeek-V3's hidden), NVFP4 1.6-1.7x at 4-8 tokens, FP8 1.1-1.5x,
// both about 1.0x at 2; at K = 2048 NVFP4 1.25x at 8 tokens, but 0.68-0.85x at 1-4 (a scratch
// loop), whose values stay in L1 (docs/PERF.md, CPU backend v6).
inline constexpr int64_t kCpuPairFromBytes = 48 * 1024;

// cpu_row_dots of rows r and r + 1 (out0 and out1 each hold `tokens` dots), but where the loops
// are AVX-512, the format NVFP4 or FP8 and a tile's values pass pair_from_bytes, both rows in one
// pass over them (their values then come from L2 once per two rows; the sums in another order).
void cpu_row_pair_dots(const QuantMatrix& m, int64_t r, const float* x, int64_t stride, int64_t tokens, float* out0,
                       float* out1, std::vector<float>& row, CpuLoops loops = cpu_host_loops(),
                       int64_t pair_from_bytes = kCpuPairFromBytes);

// What the backend's calls run on this host, for the benchmark's rows: the inner loops the CPU
// allows (cpu_host_loops: AVX2 with FMA and F16C, NVFP4 and FP8 on AVX-512 where it has that, or
// the portable ones) and the OpenMP threads.
std::string cpu_backend_config();

// The host's float multiply-add throughput on the backend's threads (omp_get_max_threads()):
// independent chains of multiply-adds on the widest loops the host runs (cpu_host_loops: 16-wide
// AVX-512 FMA, 8-wide AVX2 FMA, or the baseline's multiply and add), the fastest of 5 timed passes
// after an untimed one. The benchmark's compute floor.
struct CpuPeak {
  double multiply_adds_per_second = 0;
  int threads = 1;
  CpuLoops loops = CpuLoops::kPortable;  // what the chains ran on
};
CpuPeak cpu_multiply_add_peak();

}  // namespace moeinfer
