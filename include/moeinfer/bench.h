// The benchmark (DESIGN.md section 7): time per layer call against the memory-bandwidth floor.
//
// Every row: median time per call (CUDA events over CUDA-graph replays, rotating `inputs`
// different token batches so routing and experts change between calls), distinct experts
// touched, bytes the call must read, GB/s, the floor (bytes / read bandwidth measured in the
// same run) and the fraction of it reached, with the path and config that ran. Beside it the
// compute floor (the call's FLOPs / the multiply-add peak measured in the same run: bf16 tensor
// cores on GPUs, float FMA on CPUs) and which of the two bounds the call.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moeinfer/backend.h"
#include "moeinfer/format.h"
#include "moeinfer/plan.h"
#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer {

enum class TokenRouting : uint8_t {
  kIndependent,  // tokens drawn independently: about E (1 - (1 - k/E)^N) distinct experts
  kCorrelated,   // tokens share topics within a batch, as real decode batches do
};
const char* token_routing_name(TokenRouting r);
Result<TokenRouting> parse_token_routing(std::string_view name);

// Token batches for the benchmark: n x hidden, bf16-valued. Correlated batches mix a few
// "topic" directions per batch with per-token noise, so tokens of a batch route alike.
std::vector<float> make_bench_tokens(int64_t n, int64_t hidden, TokenRouting routing, uint64_t seed);

// FLOPs (2 per multiply-add) of one call of `tokens` tokens with `routes` routes to experts that
// have weights (tokens x top_k, less those to LongCat-Flash's identity experts): the router's
// logits, the shared expert's gate, each route's gate, up and down projections, and the shared
// expert's. Activations, top-k and blending are left out (under 0.1% of any preset's).
double call_flops(const LayerDesc& desc, int64_t tokens, double routes);

struct BenchConfig {
  std::vector<std::string> presets;
  std::vector<QuantSpec> formats;
  std::vector<int64_t> tokens = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  std::vector<TokenRouting> routings = {TokenRouting::kIndependent, TokenRouting::kCorrelated};
  BackendKind backend = BackendKind::kCuda;
  std::optional<PathKind> path;
  // CUDA expert-major GEMMs at 8 routes per work item: force (true) or forbid (false) the staged
  // kernels (CudaMoeOptions::staged); nullopt chooses per call.
  std::optional<bool> staged;
  // 64-row passes per staged down block: 1, 2 or 4 forced (CudaMoeOptions::staged_passes).
  std::optional<int> staged_passes;
  // Chunks ahead of their MMAs that the staged kernels' NVFP4 loops load: 1 or 2 forced
  // (CudaMoeOptions::staged_ahead).
  std::optional<int> staged_ahead;
  // Hot experts at two token tiles beside the others at one, forced on or off
  // (CudaMoeOptions::mixed_tiles).
  std::optional<bool> mixed_tiles;
  // The shared expert in a chain of its own beside the router, forced on or off
  // (CudaMoeOptions::shared_apart).
  std::optional<bool> shared_apart;
  // The gate_up launched during routing, forced on or off (CudaMoeOptions::early_gate_up).
  std::optional<bool> early_gate_up;
  // The down launched during gate_up, forced on or off (CudaMoeOptions::early_down).
  std::optional<bool> early_down;
  // The staged down's items started as their gate_up finishes, forced on or off
  // (CudaMoeOptions::item_release).
  std::optional<bool> item_release;
  // The router's logits on the tensor cores, forced on or off (CudaMoeOptions::router_mma).
  std::optional<bool> router_mma;
  // Expert weights in tiles where they fit, forced on or off (CudaMoeOptions::weight_tiles).
  std::optional<bool> weight_tiles;
  int inputs = 8;   // rotating token batches
  int reps = 20;    // timed rounds over all inputs; the median round is reported
  uint64_t seed = 0;
  // A Hugging Face checkpoint's MoE layer instead of the presets, in the format its files hold
  // (`presets` and `formats` unused); `layer` -1 is the first MoE layer.
  std::string checkpoint;
  int layer = -1;
  // Expert parallelism: 0 for none; otherwise this process is one of `ep` ranks started by
  // mpirun (1: this process alone), every rank runs run_bench, and rank 0's result holds the
  // rows. cpu ranks sum over MPI; cuda ranks take one GPU each and sum over NCCL.
  int ep = 0;
};

struct BenchRow {
  std::string preset;          // or "<checkpoint directory name> layer <L>"
  std::string format;
  std::string routing;
  int64_t tokens = 0;
  std::string backend;
  std::string path;
  std::string config;          // what this row's calls launched (CudaMoe::call_config); empty on the CPU
  std::string plan;            // the plan's description of its path (CUDA)
  double time_us = 0;          // median per call
  double distinct_experts = 0; // mean over the rotating inputs
  double bytes = 0;            // mean bytes one call must read (experts touched, shared, router, activations)
  double gbps = 0;             // bytes / time
  double floor_us = 0;         // bytes / measured read bandwidth
  double fraction = 0;         // floor_us / time_us
  double flops = 0;            // call_flops over the mean routes of the rotating inputs
  double compute_us = 0;       // flops / measured multiply-add peak (0 where it was not measured)
  double compute_fraction = 0; // compute_us / time_us
  std::string bound;           // "memory" or "compute": the larger of floor_us and compute_us; empty
                               // where the peak was not measured
  // Expert parallelism (ranks 0 without it): ranks, the most bytes any one rank must read (its
  // slice of the distinct experts; rank 0 also the shared expert), and the all-reduce of the
  // partial outputs per call (the fastest rank's, i.e. the communication without waiting for
  // the others; on GPUs timed alone over graph replays). time_us is then the slowest rank's
  // call. On GPUs, whose ranks read their own memory in parallel, floor_us is rank_bytes over
  // the slowest GPU's read bandwidth; on CPUs, which share the host's, bytes over it.
  // compute_us is the largest over the ranks of a rank's FLOPs (the router's, its slice's
  // routes', and rank 0's shared expert) over that rank's own measured peak.
  int ranks = 0;
  double rank_bytes = 0;
  double allreduce_us = 0;
};

struct BenchResult {
  std::string device;
  double read_gbps = 0;  // measured streaming read bandwidth
  double peak_gflops = 0;  // measured multiply-add peak, GFLOP/s (per rank: the slowest rank's); 0: not measured
  std::string peak_how;    // what peak_gflops measured, e.g. "bf16 tensor cores, cuBLAS 8192x8192x8192
                           // GEMM", or "not measured: " and why
  std::vector<BenchRow> rows;

  std::string table() const;
  std::string json() const;
  std::string csv() const;
};

// A BenchResult back from its json(), for plotting a run made elsewhere (the GPU machine's). Fields
// added since a file was written take their defaults (JSON from before the compute floor has
// no peak and no compute columns). Errors name the field that is missing or of the wrong type.
Result<BenchResult> parse_bench_json(std::string_view text);

// bench.png: the fraction of the binding floor (the larger of the byte and compute floors)
// against N on a log2 axis, one panel per preset, one line per format and routing (dashed:
// correlated), hollow squares on compute-bound points. kUnavailable in a build without cairo.
Status write_bench_png(const BenchResult& result, const std::string& path);

using BenchProgress = std::function<void(int64_t done, int64_t total, const std::string& what)>;
Result<BenchResult> run_bench(const BenchConfig& config, const BenchProgress& progress = {});

}  // namespace moeinfer
