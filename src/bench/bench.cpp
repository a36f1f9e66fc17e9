// moeinfer bench: presets x formats x routings x N, each row against the bandwidth floor.
#include "moeinfer/bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <numeric>
#include <set>
#include <thread>

#include "moeinfer/backend.h"
#include "moeinfer/checkpoint.h"
#include "moeinfer/cuda.h"
#include "moeinfer/ep.h"
#include "moeinfer/presets.h"
#include "moeinfer/reference.h"
#include "cpu/moe_cpu.h"

namespace moeinfer {

double call_flops(const LayerDesc& d, int64_t tokens, double routes) {
  const double h = static_cast<double>(d.hidden), t = static_cast<double>(tokens);
  double multiply_adds = t * h * d.router_outputs() + routes * 3.0 * h * static_cast<double>(d.intermediate);
  if (d.has_shared()) {
    multiply_adds += t * 3.0 * h * static_cast<double>(d.shared_intermediate);
    if (d.shared_gate) multiply_adds += t * h;
  }
  return 2.0 * multiply_adds;
}

std::vector<float> make_bench_tokens(int64_t n, int64_t hidden, TokenRouting routing, uint64_t seed) {
  std::vector<float> x = make_tokens(n, hidden, seed);
  if (routing == TokenRouting::kIndependent) return x;
  // A batch of decode tokens talks about few things at once: each token is one of a few topic
  // directions (one per 8 tokens) plus noise. kTopicWeight was tuned so that top-8-of-256
  // routing of 17-token batches touches about 60 distinct experts, as one engine measured on
  // real text (59 of 136 routes; independent tokens touch about 107).
  constexpr float kTopicWeight = 0.9f;
  const int64_t topics = std::max<int64_t>(1, (n + 7) / 8);
  const std::vector<float> topic = make_tokens(topics, hidden, seed ^ 0x746F706963ull);
  const float noise = std::sqrt(1.0f - kTopicWeight * kTopicWeight);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t k = static_cast<int64_t>((static_cast<uint64_t>(t) * 0x9E3779B97F4A7C15ull + seed) % static_cast<uint64_t>(topics));
    for (int64_t i = 0; i < hidden; ++i) {
      float& v = x[static_cast<size_t>(t * hidden + i)];
      v = round_to_bf16(kTopicWeight * topic[static_cast<size_t>(k * hidden + i)] + noise * v);
    }
  }
  return x;
}

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Streaming read bandwidth of host memory: every thread sums its own slice of a buffer much
// larger than the caches.
double cpu_read_gbps() {
  const size_t count = size_t{1} << 28;  // 1 GiB of floats
  std::vector<float> buf(count, 1.0f);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<double> gbps;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> sums(threads);
    const auto start = Clock::now();
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        // Eight independent partial sums: the adds never wait on each other, so the loop runs
        // at memory speed rather than at add latency.
        const size_t b = count * t / threads / 8 * 8, e = count * (t + 1) / threads / 8 * 8;
        float acc[8] = {};
        for (size_t i = b; i < e; i += 8) {
          for (int j = 0; j < 8; ++j) acc[j] += buf[i + static_cast<size_t>(j)];
        }
        sums[t] = std::accumulate(acc, acc + 8, 0.0);
      });
    }
    for (std::thread& th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    volatile double observed = std::accumulate(sums.begin(), sums.end(), 0.0);  // the reads must happen
    (void)observed;
    gbps.push_back(static_cast<double>(count * 4) / s / 1e9);
  }
  return median(gbps);
}

}  // namespace

Result<BenchResult> run_bench(const BenchConfig& cfg, const BenchProgress& progress) {
  if ((cfg.checkpoint.empty() && (cfg.presets.empty() || cfg.formats.empty())) || cfg.tokens.empty() ||
      cfg.routings.empty()) {
    return invalid_argument("bench: nothing to run (empty preset, format, token or routing list)");
  }
  if (cfg.inputs < 1 || cfg.reps < 1) return invalid_argument("bench: --inputs and --reps must be positive");
  for (int64_t n : cfg.tokens) {
    if (n < 1) return invalid_argument(fmt::format("bench: token count {} must be positive", n));
  }
  const bool cuda = cfg.backend == BackendKind::kCuda;
  if (cfg.backend != BackendKind::kCuda && cfg.backend != BackendKind::kReference && cfg.backend != BackendKind::kCpu) {
    return invalid_argument("bench: --backend must be cuda, cpu or reference");
  }
  if (cuda) {  // a machine without a usable GPU gets the reason, as `run` gives it
    for (const BackendAvailability& b : backend_availability()) {
      if (b.kind == BackendKind::kCuda && !b.available) return unavailable(fmt::format("backend 'cuda': {}", b.reason));
    }
  }
  if (cfg.ep < 0) return invalid_argument(fmt::format("bench: --ep must be at least 1 (got {})", cfg.ep));
  const bool ep = cfg.ep > 0;
  if (ep && cfg.backend != BackendKind::kCpu && cfg.backend != BackendKind::kCuda) {
    return unsupported(fmt::format("expert parallelism runs on the cpu (MPI) and cuda (NCCL) backends, not '{}'",
                                   backend_name(cfg.backend)));
  }
  if (ep && ep_size() != cfg.ep) {
    return internal_error(fmt::format("bench --ep {} but this job has {} MPI ranks", cfg.ep, ep_size()));
  }
  std::unique_ptr<Backend> host_backend;
  EpStats ep_stats;
  std::unique_ptr<CudaAllReduce> all_reduce;  // GPU expert parallelism
  if (cuda && ep) {
    MOEINFER_RETURN_IF_ERROR(cuda_use_rank_device());
    Result<std::unique_ptr<CudaAllReduce>> made = CudaAllReduce::create();
    if (!made.ok()) return made.status();
    all_reduce = std::move(made).value();
  }
  if (!cuda) {
    Result<std::unique_ptr<Backend>> b = ep ? make_cpu_ep_backend(&ep_stats) : make_backend(cfg.backend);
    if (!b.ok()) return b.status();
    host_backend = std::move(b).value();
  }
  // The config of a host backend's rows (a CUDA row's comes from its CudaMoe, per N).
  const std::string host_config = cfg.backend == BackendKind::kCpu         ? cpu_backend_config()
                                  : cfg.backend == BackendKind::kReference ? std::string("double accumulation")
                                                                           : std::string();
  // What to run: every preset in every format, or the checkpoint's layer in its own format.
  struct Source {
    std::string name;
    QuantSpec spec;
  };
  std::vector<Source> sources;
  std::optional<Checkpoint> checkpoint;
  int checkpoint_layer = cfg.layer;
  if (!cfg.checkpoint.empty()) {
    Result<Checkpoint> opened = Checkpoint::open(cfg.checkpoint);
    if (!opened.ok()) return opened.status();
    checkpoint.emplace(std::move(opened).value());
    const std::vector<int>& moe_layers = checkpoint->config().moe_layers;
    if (checkpoint_layer < 0) checkpoint_layer = moe_layers.empty() ? 0 : moe_layers.front();
    const std::string dir = std::filesystem::path(cfg.checkpoint).lexically_normal().filename().string();
    sources.push_back({fmt::format("{} layer {}", dir.empty() ? cfg.checkpoint : dir, checkpoint_layer), {}});
  } else {
    for (const std::string& p : cfg.presets) {
      Result<const Preset*> found = find_preset(p);
      if (!found.ok()) return found.status();
      for (const QuantSpec& spec : cfg.formats) sources.push_back({p, spec});
    }
  }

  BenchResult result;
  double rank_peak_gflops = 0.0;  // this rank's multiply-add peak
  if (cuda) {
    Result<std::string> name = cuda_device_name();
    if (!name.ok()) return name.status();
    result.device = *name;
    Result<double> bw = cuda_read_bandwidth();
    if (!bw.ok()) return bw.status();
    // Each rank reads its own GPU's memory: the slowest GPU bounds the call.
    result.read_gbps = ep_min(*bw);
    if (progress) progress(0, 1, "measuring the bf16 tensor-core peak");
    // Without cuBLAS (or where its GEMM fails) the rows still get their times and byte floors;
    // the header says why the compute columns are empty.
    Result<double> tflops = cuda_bf16_peak_tflops();
    rank_peak_gflops = tflops.ok() ? *tflops * 1e3 : 0.0;
    result.peak_how = tflops.ok() ? fmt::format("bf16 tensor cores, cuBLAS {0}x{0}x{0} GEMM", kCudaPeakGemmSize)
                                  : fmt::format("not measured: {}", tflops.status().message());
    if (ep) result.device += fmt::format(", {} rank{} (one GPU each, NCCL)", cfg.ep, cfg.ep == 1 ? "" : "s");
  } else {
    result.device = fmt::format("CPU ({} threads)", std::thread::hardware_concurrency());
    // Under expert parallelism the ranks share the host's memory: rank 0 measures it while the
    // others sleep.
    ep_sleeping_barrier();
    const double measured = ep_rank() == 0 ? cpu_read_gbps() : 0.0;
    ep_sleeping_barrier();
    result.read_gbps = ep_max(measured);
    // The ranks compute on the host's cores at once, so each measures its own share together.
    ep_barrier();
    const CpuPeak peak = cpu_multiply_add_peak();
    rank_peak_gflops = 2.0 * peak.multiply_adds_per_second / 1e9;
    const char* how = peak.loops == CpuLoops::kAvx512 ? "AVX-512 FMA"
                      : peak.loops == CpuLoops::kAvx2   ? "AVX2 FMA"
                                                        : "multiply and add";
    result.peak_how = fmt::format("float {}, {} thread{}{}", how, peak.threads, peak.threads == 1 ? "" : "s",
                                  ep ? " per rank" : "");
    if (ep) result.device += fmt::format(", {} MPI ranks", cfg.ep);
  }
  result.peak_gflops = ep_min(rank_peak_gflops);  // 0 where any rank could not measure it
  if (result.peak_gflops <= 0.0 && rank_peak_gflops > 0.0) {
    result.peak_how = "not measured: another rank could not measure its peak";
  }

  const int64_t max_n = *std::max_element(cfg.tokens.begin(), cfg.tokens.end());
  const int64_t total = static_cast<int64_t>(sources.size() * cfg.routings.size() * cfg.tokens.size());
  int64_t done = 0;
  for (const Source& source : sources) {
    if (progress) progress(done, total, source.name + ": loading weights");
    Result<Layer> layer = checkpoint ? checkpoint->load_layer(checkpoint_layer)
                                     : make_preset_layer(source.name, source.spec, cfg.seed);
    if (!layer.ok()) return layer.status();
    const LayerDesc& d = layer->desc;
    const std::string format = quant_spec_name(layer->expert_spec);
    const std::string label = fmt::format("{} {}", source.name, format);
    std::unique_ptr<CudaMoe> moe;
    std::string plan;  // the plan's description (CUDA)
    if (cuda) {
      const CudaMoeOptions options{.path = cfg.path,
                                   .rank = ep_rank(),
                                   .ranks = ep_size(),
                                   .staged = cfg.staged,
                                   .staged_passes = cfg.staged_passes,
                                   .staged_ahead = cfg.staged_ahead,
                                   .mixed_tiles = cfg.mixed_tiles,
                                   .shared_apart = cfg.shared_apart,
                                   .early_gate_up = cfg.early_gate_up,
                                   .early_down = cfg.early_down,
                                   .item_release = cfg.item_release,
                                   .router_mma = cfg.router_mma,
                                   .weight_tiles = cfg.weight_tiles};
      Result<std::unique_ptr<CudaMoe>> made = CudaMoe::create(*layer, max_n, options, [&](int64_t e, int64_t all) {
        if (!progress) return;
        const int64_t experts = all / 2;  // two steps per expert: loaded, then uploaded (CudaMoe::create)
        progress(done, total,
                 e <= experts ? fmt::format("{}: loading expert {}/{}", label, e, experts)
                              : fmt::format("{}: uploading expert {}/{}", label, e - experts, experts));
      });
      if (!made.ok()) return made.status();
      moe = std::move(made).value();
      plan = moe->plan().config;
    }
    const double fixed_bytes = static_cast<double>(layer->resident_bytes());
    const double shared = layer->shared ? static_cast<double>(layer->shared->bytes()) : 0.0;
    const ExpertSlice slice = expert_slice(d.num_experts, ep_rank(), ep_size());  // this rank's experts
    for (TokenRouting routing : cfg.routings) {
      for (int64_t n : cfg.tokens) {
        if (progress) progress(done, total, fmt::format("{} {} N={}", label, token_routing_name(routing), n));
        std::vector<std::vector<float>> batches;
        double distinct = 0.0, mine = 0.0;  // distinct experts: all, and in this rank's slice
        double routed = 0.0, mine_routed = 0.0;  // routes to experts with weights: all, and this rank's
        for (int i = 0; i < cfg.inputs; ++i) {
          batches.push_back(make_bench_tokens(n, d.hidden, routing, cfg.seed * 1000003 + static_cast<uint64_t>(n * 131 + i)));
          Result<Routes> routes = moe_route_reference(*layer, batches.back(), n);
          if (!routes.ok()) return routes.status();
          std::set<int> ids;
          for (int id : routes->ids) {
            if (id >= d.num_experts) continue;  // an identity expert
            ids.insert(id);
            routed += 1.0;
            if (slice.owns(id)) mine_routed += 1.0;
          }
          distinct += static_cast<double>(ids.size());
          std::vector<int> touched;  // on this rank
          for (int id : ids) {
            if (slice.owns(id)) touched.push_back(id);
          }
          mine += static_cast<double>(touched.size());
          if (!cuda) MOEINFER_RETURN_IF_ERROR(layer->load_experts(touched));  // generated before the clock runs
        }
        distinct /= cfg.inputs;
        mine /= cfg.inputs;
        routed /= cfg.inputs;
        mine_routed /= cfg.inputs;
        double time_us = 0.0, allreduce_us = 0.0;
        if (cuda) {
          Result<double> t = cuda_time_forward(*moe, batches, n, cfg.reps, all_reduce.get());
          if (!t.ok()) return t.status();
          time_us = ep_max(*t);  // a call lasts until its slowest rank is done
          if (all_reduce) {
            Result<double> r = cuda_time_all_reduce(*all_reduce, n * d.hidden, cfg.reps);
            if (!r.ok()) return r.status();
            allreduce_us = ep_min(*r);
          }
        } else {
          std::vector<float> out(static_cast<size_t>(n * d.hidden));
          std::vector<double> times, reduces;
          for (int r = 0; r < cfg.reps; ++r) {
            const std::vector<float>& x = batches[static_cast<size_t>(r % cfg.inputs)];
            ep_barrier();  // the ranks start each call together
            const double reduce_before = ep_stats.reduce_seconds;
            const auto start = Clock::now();
            MOEINFER_RETURN_IF_ERROR(host_backend->forward(*layer, x, n, out, nullptr));
            // A call lasts until its slowest rank returns.
            times.push_back(ep_max(std::chrono::duration<double, std::micro>(Clock::now() - start).count()));
            reduces.push_back(ep_min((ep_stats.reduce_seconds - reduce_before) * 1e6));
          }
          time_us = median(times);
          allreduce_us = median(reduces);
        }
        BenchRow row;
        row.preset = source.name;
        row.format = format;
        row.routing = token_routing_name(routing);
        row.tokens = n;
        row.backend = backend_name(cfg.backend);
        row.path = moe ? path_name(moe->plan().path_for(n)) : backend_name(cfg.backend);
        row.config = moe ? moe->call_config(n) : host_config;
        row.plan = plan;
        // "; <what> forced on|off" for each switch the run pinned.
        const auto forced = [&](const char* what, const std::optional<bool>& on) {
          if (on) row.config += fmt::format("; {} forced {}", what, *on ? "on" : "off");
        };
        forced("staged kernels", cfg.staged);
        if (cfg.staged_passes) row.config += fmt::format("; {} staged pass(es) forced", *cfg.staged_passes);
        if (cfg.staged_ahead) row.config += fmt::format("; {} chunk(s) ahead forced", *cfg.staged_ahead);
        forced("mixed tiles", cfg.mixed_tiles);
        forced("shared apart", cfg.shared_apart);
        forced("early gate_up", cfg.early_gate_up);
        forced("early down", cfg.early_down);
        forced("item release", cfg.item_release);
        forced("router mma", cfg.router_mma);
        forced("weight tiles", cfg.weight_tiles);
        row.time_us = time_us;
        row.distinct_experts = distinct;
        // The floor: every distinct routed expert once, the shared expert, the router, the
        // tokens read and the output written.
        row.bytes = distinct * static_cast<double>(layer->routed_expert_bytes()) + fixed_bytes +
                    2.0 * static_cast<double>(n * d.hidden) * 4.0;
        row.gbps = row.bytes / (time_us * 1e-6) / 1e9;
        row.ranks = ep ? ep_size() : 0;
        row.allreduce_us = allreduce_us;
        // This rank reads its share of the distinct experts, the router (every rank routes),
        // rank 0 also the shared expert, and the activations; the row keeps the largest.
        row.rank_bytes = ep_max(mine * static_cast<double>(layer->routed_expert_bytes()) + fixed_bytes -
                                (ep_rank() == 0 ? 0.0 : shared) + 2.0 * static_cast<double>(n * d.hidden) * 4.0);
        // CPU ranks share one host's memory; GPU ranks each read their own, in parallel.
        row.floor_us = (cuda && ep ? row.rank_bytes : row.bytes) / (result.read_gbps * 1e9) * 1e6;
        row.fraction = row.floor_us / time_us;
        // The compute floor: this rank's FLOPs (the shared expert's on rank 0 alone) at its own peak.
        row.flops = call_flops(d, n, routed);
        LayerDesc rank_desc = d;
        if (ep_rank() != 0) rank_desc.shared_intermediate = 0;
        const double rank_compute_us = call_flops(rank_desc, n, ep ? mine_routed : routed) / (rank_peak_gflops * 1e3);
        row.compute_us = ep_max(result.peak_gflops > 0.0 ? rank_compute_us : 0.0);
        row.compute_fraction = row.compute_us / time_us;
        if (result.peak_gflops > 0.0) row.bound = row.compute_us > row.floor_us ? "compute" : "memory";
        result.rows.push_back(row);
        ++done;
      }
    }
  }
  if (progress) progress(total, total, "done");
  return result;
}

}  // namespace moeinfer
