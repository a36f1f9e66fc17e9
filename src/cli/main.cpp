// moeinfer: the command-line tool. It only binds the library: parse, call, print.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "moeinfer/backend.h"
#include "moeinfer/bench.h"
#include "moeinfer/checkpoint.h"
#include "moeinfer/cuda.h"
#include "moeinfer/ep.h"
#include "moeinfer/safetensors.h"
#include "moeinfer/presets.h"
#include "moeinfer/reference.h"

namespace {

using namespace moeinfer;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Progress on stderr once the work has taken longer than half a second, so quick runs stay clean.
// On a terminal, one bar redrawn in place with the stage it is at. Into a log (stderr not a
// terminal), nothing, or with `log_lines` one line per step finished and otherwise at most one
// every 5 s, each with the time since the start, so that a long stage (a large layer's generation
// and upload) shows in the log.
class ProgressBar {
 public:
  explicit ProgressBar(std::string label, bool log_lines = false)
      : label_(std::move(label)), tty_(isatty(STDERR_FILENO) != 0), log_lines_(log_lines) {}
  ~ProgressBar() {
    if (drawn_) std::fputs("\n", stderr);
  }
  void update(int64_t done, int64_t total, const std::string& stage = {}) {
    const double elapsed = seconds_since(start_);
    if (elapsed < 0.5 || total <= 0) return;
    if (!tty_) {
      if (!log_lines_ || (done == logged_done_ && elapsed < logged_at_ + 5.0)) return;
      fmt::print(stderr, "{} {}/{} {:.1f}s{}{}\n", label_, done, total, elapsed, stage.empty() ? "" : ": ", stage);
      std::fflush(stderr);
      logged_done_ = done, logged_at_ = elapsed;
      return;
    }
    constexpr int kWidth = 30;
    const auto filled = static_cast<int>(kWidth * done / total);
    std::string line = fmt::format("\r{} [{}{}] {}/{} {:.1f}s {}", label_, std::string(static_cast<size_t>(filled), '#'),
                                   std::string(static_cast<size_t>(kWidth - filled), ' '), done, total, elapsed, stage);
    const size_t width = line.size();
    line.resize(std::max(width, drawn_width_), ' ');  // clears a longer stage drawn before
    drawn_width_ = width;
    std::fputs(line.c_str(), stderr);
    std::fflush(stderr);
    drawn_ = true;
  }

 private:
  std::string label_;
  bool tty_, log_lines_;
  bool drawn_ = false;
  size_t drawn_width_ = 0;
  int64_t logged_done_ = -1;
  double logged_at_ = 0.0;
  Clock::time_point start_ = Clock::now();
};

std::string human_bytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1 << 20));
  return fmt::format("{:.1f} KiB", static_cast<double>(bytes) / 1024);
}

// A one-line error and a non-zero exit.
int fail(const Status& status) {
  fmt::print(stderr, "moeinfer: error: {}\n", status.to_string());
  return 1;
}

// hidden_states [N, H] from a safetensors file, as floats.
Result<std::vector<float>> read_hidden_states(const std::string& path, int64_t hidden, int64_t* n) {
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  if (!file.ok()) return file.status();
  Result<TensorView> t = file->get("hidden_states");
  if (!t.ok()) return t.status();
  if (t->dtype != Dtype::kF32 && t->dtype != Dtype::kBF16 && t->dtype != Dtype::kF16) {
    return invalid_argument(fmt::format("{}: hidden_states is {}; expected F32, BF16 or F16", path, dtype_name(t->dtype)));
  }
  if (t->shape.size() != 2 || t->shape[1] != hidden || t->shape[0] < 1) {
    return invalid_argument(fmt::format("{}: hidden_states has shape {}; the layer needs [N, {}] with N >= 1", path,
                                        t->shape_string(), hidden));
  }
  *n = t->shape[0];
  return t->to_floats();
}

// "0-47" style ranges of a sorted list.
std::string ranges(const std::vector<int>& v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    out += fmt::format("{}{}", out.empty() ? "" : ", ", i == j ? fmt::format("{}", v[i]) : fmt::format("{}-{}", v[i], v[j]));
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

int inspect_command(const std::string& dir, int layer) {
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  if (!ckpt.ok()) return fail(ckpt.status());
  const ModelConfig& c = ckpt->config();
  const LayerDesc& d = c.desc;
  fmt::print("checkpoint {}\n", dir);
  fmt::print("  family        {} (model_type {})\n", family_name(c.family), c.model_type);
  fmt::print("  layers        {}; MoE layers: {} ({})\n", c.num_layers, ranges(c.moe_layers), c.moe_rule);
  fmt::print("  shape         {}\n", describe_shape(d));
  fmt::print("  routing       {}\n", describe_routing(d));
  fmt::print("  fields        hidden_size {}, moe intermediate {}, experts {}, zero experts {}, top_k {}, shared {}, "
             "norm_topk_prob {}, routed_scaling_factor {:g}, n_group {}, topk_group {}\n",
             d.hidden, d.intermediate, d.num_experts, d.num_zero_experts, d.top_k, d.shared_intermediate,
             d.routing.renormalize, d.routing.scaling, d.routing.n_group, d.routing.topk_group);
  fmt::print("  quantization  {}{}\n", quant_method_name(c.quant),
             c.quant_excluded.empty() ? "" : fmt::format(", excluded: {}", fmt::join(c.quant_excluded, ", ")));
  if (c.moe_layers.empty()) return 0;
  const int index = layer >= 0 ? layer : c.moe_layers.front();
  Result<std::vector<std::string>> parts = ckpt->describe_layer(index);
  if (!parts.ok()) return fail(parts.status());
  fmt::print("  layer {}:\n", index);
  for (const std::string& line : *parts) fmt::print("    {}\n", line);
  return 0;
}

// A comma-separated option's items. An empty item (`1,,2`, a trailing comma) is refused rather
// than skipped: it is more likely a value lost in a script than one meant to be left out.
Result<std::vector<std::string>> split_list(const char* option, const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t comma = s.find(',', start);
    out.push_back(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (out.back().empty()) return invalid_argument(fmt::format("{}: '{}' has an empty item", option, s));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

struct BenchOptions {
  std::string presets = "qwen3-next-80b-a3b,qwen3-30b-a3b,deepseek-v3";
  std::string formats = "nvfp4,fp8,bf16";
  std::string tokens = "1,2,4,8,16,32,64,128,256";
  std::string routing = "independent,correlated";
  std::string backend = "auto";
  std::string path;
  std::string staged = "auto";
  std::string staged_passes = "auto";
  std::string staged_ahead = "auto";
  std::string mixed_tiles = "auto";
  std::string shared_apart = "auto";
  std::string early_gate_up = "auto";
  std::string early_down = "auto";
  std::string item_release = "auto";
  std::string router_mma = "auto";
  std::string weight_tiles = "auto";
  std::string out = "bench-out";
  int inputs = 8;
  int reps = 20;
  uint64_t seed = 0;
  int ep = 0;  // ranks of expert parallelism; 0: none (main resolves the backend first)
  std::string checkpoint;  // a Hugging Face directory instead of presets
  int layer = -1;          // with --checkpoint: the MoE layer (default: the first one)
  bool presets_or_formats_given = false;
};

// A CUDA tuning option of the bench: "auto" leaves `setting` to the backend; "on" or "off" sets it,
// on the cuda backend only.
Status cuda_switch(const char* option, const std::string& value, BackendKind backend, std::optional<bool>& setting) {
  if (value == "auto") return {};
  if (value != "on" && value != "off") return invalid_argument(fmt::format("{}: '{}' is not auto, on or off", option, value));
  if (backend != BackendKind::kCuda) return invalid_argument(fmt::format("{} applies to the cuda backend", option));
  setting = value == "on";
  return {};
}

// The same for a count that takes one of `counts`.
Status cuda_count(const char* option, const std::string& value, std::initializer_list<int> counts, BackendKind backend,
                  std::optional<int>& setting) {
  if (value == "auto") return {};
  std::string allowed = "auto";  // "auto, 1, 2 or 4"
  std::optional<int> chosen;
  size_t listed = 0;
  for (const int c : counts) {
    allowed += fmt::format("{}{}", ++listed == counts.size() ? " or " : ", ", c);
    if (value == std::to_string(c)) chosen = c;
  }
  if (!chosen) return invalid_argument(fmt::format("{}: '{}' is not {}", option, value, allowed));
  if (backend != BackendKind::kCuda) return invalid_argument(fmt::format("{} applies to the cuda backend", option));
  setting = chosen;
  return {};
}

int bench_command(const BenchOptions& opt) {
  if (!opt.checkpoint.empty() && opt.presets_or_formats_given) {
    return fail(invalid_argument("--preset and --format apply to presets; a checkpoint's layer and format come from "
                                 "its files"));
  }
  if (opt.checkpoint.empty() && opt.layer >= 0) return fail(invalid_argument("--layer needs --checkpoint"));
  BenchConfig cfg;
  Result<std::vector<std::string>> presets = split_list("--preset", opt.presets);
  Result<std::vector<std::string>> formats = split_list("--format", opt.formats);
  Result<std::vector<std::string>> tokens = split_list("--tokens", opt.tokens);
  Result<std::vector<std::string>> routings = split_list("--routing", opt.routing);
  for (const Status& st : {presets.status(), formats.status(), tokens.status(), routings.status()}) {
    if (!st.ok()) return fail(st);
  }
  cfg.presets = *presets;
  for (const std::string& f : *formats) {
    Result<QuantSpec> spec = parse_quant_spec(f);
    if (!spec.ok()) return fail(spec.status());
    cfg.formats.push_back(*spec);
  }
  cfg.tokens.clear();
  for (const std::string& t : *tokens) {
    // Digits only: stoll alone would also take a sign and leading spaces.
    const bool digits = t.size() <= 5 && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
    const long long v = digits ? std::stoll(t) : 0;
    if (v < 1 || v > 65536) {
      return fail(invalid_argument(fmt::format("--tokens: '{}' is not a token count in [1, 65536]", t)));
    }
    cfg.tokens.push_back(v);
  }
  cfg.routings.clear();
  for (const std::string& r : *routings) {
    Result<TokenRouting> routing = parse_token_routing(r);
    if (!routing.ok()) return fail(routing.status());
    cfg.routings.push_back(*routing);
  }
  Result<BackendKind> kind = parse_backend(opt.backend);
  if (!kind.ok()) return fail(kind.status());
  if (*kind == BackendKind::kAuto) {
    Result<std::unique_ptr<Backend>> best = make_backend(BackendKind::kAuto);
    if (!best.ok()) return fail(best.status());
    *kind = (*best)->kind();
  }
  cfg.backend = *kind;
  if (!opt.path.empty()) {
    Result<PathKind> path = parse_path(opt.path);
    if (!path.ok()) return fail(path.status());
    cfg.path = *path;
  }
  for (const Status& st : {cuda_switch("--staged", opt.staged, cfg.backend, cfg.staged),
                           cuda_count("--staged-passes", opt.staged_passes, {1, 2, 4}, cfg.backend, cfg.staged_passes),
                           cuda_count("--staged-ahead", opt.staged_ahead, {1, 2}, cfg.backend, cfg.staged_ahead),
                           cuda_switch("--mixed-tiles", opt.mixed_tiles, cfg.backend, cfg.mixed_tiles),
                           cuda_switch("--shared-apart", opt.shared_apart, cfg.backend, cfg.shared_apart),
                           cuda_switch("--early-gate-up", opt.early_gate_up, cfg.backend, cfg.early_gate_up),
                           cuda_switch("--early-down", opt.early_down, cfg.backend, cfg.early_down),
                           cuda_switch("--item-release", opt.item_release, cfg.backend, cfg.item_release),
                           cuda_switch("--router-mma", opt.router_mma, cfg.backend, cfg.router_mma),
                           cuda_switch("--weight-tiles", opt.weight_tiles, cfg.backend, cfg.weight_tiles)}) {
    if (!st.ok()) return fail(st);
  }
  cfg.inputs = opt.inputs;
  cfg.reps = opt.reps;
  cfg.seed = opt.seed;
  cfg.ep = opt.ep;
  cfg.checkpoint = opt.checkpoint;
  cfg.layer = opt.layer;

  // --out before the run, which can take minutes, rather than after it. Every rank checks it (one
  // host, one answer), so that none leaves the others waiting in a collective.
  std::error_code ec;
  std::filesystem::create_directories(opt.out, ec);
  if (ec || !std::filesystem::is_directory(opt.out)) {
    return fail(Status(StatusCode::kIoError, fmt::format("--out {}: {}", opt.out,
                                                         ec ? "cannot create the directory: " + ec.message()
                                                            : std::string("not a directory"))));
  }

  // Under expert parallelism every rank measures; rank 0 alone reports and writes.
  const bool quiet = ep_rank() != 0;
  Result<BenchResult> result = [&] {
    if (quiet) return run_bench(cfg);
    ProgressBar bar("bench", /*log_lines=*/true);
    return run_bench(cfg, [&](int64_t done, int64_t total, const std::string& stage) { bar.update(done, total, stage); });
  }();
  if (!result.ok()) return fail(result.status());
  if (quiet) return 0;
  fmt::print("{}", result->table());
  for (const auto& [name, text] : {std::pair<std::string, std::string>{"bench.json", result->json()},
                                   std::pair<std::string, std::string>{"bench.csv", result->csv()}}) {
    const std::string file = (std::filesystem::path(opt.out) / name).string();
    std::ofstream f(file);
    f << text;
    if (!f) return fail(Status(StatusCode::kIoError, fmt::format("cannot write {}", file)));
  }
  const std::string png = (std::filesystem::path(opt.out) / "bench.png").string();
  const Status drawn = write_bench_png(*result, png);
  if (drawn.code() == StatusCode::kUnavailable) {  // a build without cairo: the numbers are written
    fmt::print("wrote {0}/bench.json and {0}/bench.csv; {1}\n", opt.out, drawn.message());
    return 0;
  }
  if (!drawn.ok()) return fail(drawn);
  fmt::print("wrote {0}/bench.json, {0}/bench.csv and {0}/bench.png\n", opt.out);
  return 0;
}

// bench.png from a bench.json written earlier, here or on another machine.
int plot_command(const std::string& json_path, const std::string& png_path) {
  std::ifstream f(json_path, std::ios::binary);
  if (!f) return fail(Status(StatusCode::kNotFound, fmt::format("cannot open {}", json_path)));
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) return fail(Status(StatusCode::kIoError, fmt::format("cannot read {}", json_path)));
  Result<BenchResult> result = parse_bench_json(text);
  if (!result.ok()) return fail(Status(result.status().code(), json_path + ": " + result.status().message()));
  const Status drawn = write_bench_png(*result, png_path);
  if (!drawn.ok()) return fail(drawn);
  fmt::print("wrote {} ({} rows)\n", png_path, result->rows.size());
  return 0;
}

struct RunOptions {
  std::string checkpoint;  // a Hugging Face directory instead of a preset
  int layer = -1;          // with --checkpoint: the MoE layer (default: the first one)
  std::string input;       // safetensors with hidden_states [N, H]
  std::string output;      // safetensors to write hidden_states [N, H] (F32) to
  bool format_given = false;
  std::string preset = "qwen3-next-80b-a3b";
  std::string format = "nvfp4";
  int64_t tokens = 4;
  uint64_t seed = 0;
  std::string backend = "auto";
  std::string path;
  int iters = 1;
  int ep = 0;  // ranks of expert parallelism; 0: none (main resolves the backend first)
  bool explain = false;
  bool check = false;
};

int run_command(const RunOptions& opt) {
  if (opt.tokens < 1) return fail(invalid_argument(fmt::format("--tokens must be at least 1 (got {})", opt.tokens)));
  if (opt.iters < 1) return fail(invalid_argument(fmt::format("--iters must be at least 1 (got {})", opt.iters)));
  Result<QuantSpec> spec = parse_quant_spec(opt.format);
  if (!spec.ok()) return fail(spec.status());
  Result<BackendKind> kind = parse_backend(opt.backend);
  if (!kind.ok()) return fail(kind.status());
  BackendOptions options;
  if (!opt.path.empty()) {
    Result<PathKind> path = parse_path(opt.path);
    if (!path.ok()) return fail(path.status());
    options.path = *path;
  }
  const bool ep = opt.ep > 0;
  // main resolved the backend of --ep (cpu or cuda) and refused the others before any rank started.
  if (ep && ep_size() != opt.ep) {
    return fail(internal_error(fmt::format("--ep {} but this job has {} MPI ranks", opt.ep, ep_size())));
  }
  const bool cuda_ep = ep && *kind == BackendKind::kCuda;
  Result<std::unique_ptr<Backend>> backend = !ep       ? make_backend(*kind, options)
                                             : cuda_ep ? make_cuda_ep_backend(options.path)
                                                       : make_cpu_ep_backend();
  if (!backend.ok()) return fail(backend.status());
  // Under expert parallelism every rank computes; rank 0 alone reports and writes.
  const bool quiet = ep_rank() != 0;

  const auto build_start = Clock::now();
  std::string source;
  std::optional<Layer> layer;
  if (!opt.checkpoint.empty()) {
    if (opt.format_given) {
      return fail(invalid_argument("--format applies to presets; a checkpoint's format comes from its files"));
    }
    Result<Checkpoint> ckpt = Checkpoint::open(opt.checkpoint);
    if (!ckpt.ok()) return fail(ckpt.status());
    const int index = opt.layer >= 0 ? opt.layer : (ckpt->config().moe_layers.empty() ? 0 : ckpt->config().moe_layers.front());
    Result<Layer> loaded = ckpt->load_layer(index);
    if (!loaded.ok()) return fail(loaded.status());
    layer.emplace(std::move(loaded).value());
    source = fmt::format("{} layer {} ({})", opt.checkpoint, index, ckpt->config().model_type);
  } else {
    if (opt.layer >= 0) return fail(invalid_argument("--layer needs --checkpoint"));
    Result<const Preset*> preset = find_preset(opt.preset);
    if (!preset.ok()) return fail(preset.status());
    Result<Layer> made = make_preset_layer(opt.preset, *spec, opt.seed);
    if (!made.ok()) return fail(made.status());
    layer.emplace(std::move(made).value());
    source = fmt::format("{} ({}, {})", (*preset)->name, (*preset)->model, family_name((*preset)->family));
  }
  const LayerDesc& d = layer->desc;

  int64_t n = opt.tokens;
  std::vector<float> x;
  if (!opt.input.empty()) {
    Result<std::vector<float>> read = read_hidden_states(opt.input, d.hidden, &n);
    if (!read.ok()) return fail(read.status());
    x = std::move(read).value();
  } else {
    x = make_tokens(n, d.hidden, opt.seed + 1);
  }

  // Generate (or later: load) the experts this batch routes to before timing, so the time
  // below is the layer's alone; a GPU backend uploads every expert.
  Result<Routes> routes = moe_route_reference(*layer, x, n);
  if (!routes.ok()) return fail(routes.status());
  std::vector<int> touched;
  for (int id : routes->ids) {
    if (id < d.num_experts) touched.push_back(id);
  }
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  const size_t touched_count = touched.size();
  if (ep) {  // each rank loads only the experts it owns
    const ExpertSlice slice = expert_slice(d.num_experts, ep_rank(), ep_size());
    std::erase_if(touched, [&](int e) { return !slice.owns(e); });
  }
  {
    ProgressBar bar("building experts");
    Status loaded = layer->load_experts(touched, [&](int64_t done, int64_t total) { bar.update(done, total); });
    if (!loaded.ok()) return fail(loaded);
  }
  {
    ProgressBar bar("preparing backend");
    Status prepared = (*backend)->prepare(*layer, n, [&](int64_t done, int64_t total) { bar.update(done, total); });
    if (!prepared.ok()) return fail(prepared);
  }
  const double build_seconds = seconds_since(build_start);

  std::vector<float> out(x.size());
  ForwardInfo info;
  std::vector<double> times;
  // One untimed call first, except on the reference, whose every call is the same slow loop.
  const int warmup = (*backend)->kind() == BackendKind::kReference ? 0 : 1;
  for (int i = 0; i < warmup + opt.iters; ++i) {
    std::fill(out.begin(), out.end(), std::nanf(""));  // poison: every element must be written
    const auto start = Clock::now();
    Status st = (*backend)->forward(*layer, x, n, out, &info);
    if (!st.ok()) return fail(st);
    if (i >= warmup) times.push_back(seconds_since(start));
  }
  std::sort(times.begin(), times.end());
  const double median_ms = times[times.size() / 2] * 1e3;

  double sum = 0.0, sum_sq = 0.0;
  for (float v : out) {
    if (!std::isfinite(v)) return fail(internal_error("the output holds a non-finite value"));
    sum += v;
    sum_sq += static_cast<double>(v) * v;
  }

  if (quiet) return 0;
  fmt::print("moeinfer run\n");
  fmt::print("  layer     {}\n", source);
  fmt::print("  shape     {}\n", describe_shape(d));
  fmt::print("  routing   {}\n", describe_routing(d));
  fmt::print("  format    {} experts ({} each), {} router\n", quant_spec_name(layer->expert_spec),
             human_bytes(layer->routed_expert_bytes()), quant_spec_name(layer->router.spec));
  fmt::print("  tokens    {}\n", opt.input.empty() ? fmt::format("{} (seed {})", n, opt.seed) : fmt::format("{} from {}", n, opt.input));
  fmt::print("  backend   {} (path: {}; {})\n", backend_name((*backend)->kind()), info.path, info.detail);
  if (cuda_ep) {
    fmt::print("  ep        {} rank{}, one GPU each, partial outputs summed with ncclAllReduce\n", opt.ep,
               opt.ep == 1 ? "" : "s");
  } else if (ep) {
    fmt::print("  ep        {} ranks (MPI), partial outputs summed with MPI_Allreduce\n", opt.ep);
  }
  fmt::print("  experts   {} of {} touched, built and prepared in {:.2f} s\n", touched_count, d.num_experts,
             build_seconds);
  fmt::print("  time      {:.3f} ms per call (median of {}, host to host)\n", median_ms, opt.iters);
  fmt::print("  output    [{}, {}] checksum sum={:.6e} l2={:.6e} out[0][0..3]=[{:.5f}, {:.5f}, {:.5f}, {:.5f}]\n",
             n, d.hidden, sum, std::sqrt(sum_sq), out[0], out[1], out[2], out[3]);
  if (!opt.output.empty()) {
    Status st = write_safetensors(opt.output, {tensor_from_floats("hidden_states", {n, d.hidden}, out)});
    if (!st.ok()) return fail(st);
    fmt::print("  wrote     {} (hidden_states [{}, {}] F32)\n", opt.output, n, d.hidden);
  }
  if (opt.explain) {
    fmt::print("  plan      {}\n", info.plan.empty() ? "(this backend does not plan)" : info.plan);
  }
  if (opt.check) {
    // The CUDA paths keep fp32 activations; 1e-2 relative L2 is the bound the GPU tests use for
    // bf16 activations, far below what one wrong route costs.
    constexpr double kTolerance = 1e-2;
    std::vector<float> expected(x.size());
    Status st = moe_forward_reference(*layer, x, n, expected);
    if (!st.ok()) return fail(st);
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < out.size(); ++i) {
      num += (static_cast<double>(out[i]) - expected[i]) * (static_cast<double>(out[i]) - expected[i]);
      den += static_cast<double>(expected[i]) * expected[i];
    }
    const double err = std::sqrt(num / std::max(den, 1e-300));
    fmt::print("  check     relative L2 error vs reference {:.3e} (tolerance {:.0e}): {}\n", err, kTolerance,
               err <= kTolerance ? "ok" : "FAILED");
    if (err > kTolerance) return 1;
  }
  return 0;
}

int presets_command() {
  fmt::print("{:<20} {:<24} {:<14} {:>6} {:>6} {:>9} {:>5} {:>7}  {}\n", "preset", "model", "family",
             "hidden", "inter", "experts", "top-k", "shared", "routing");
  for (const Preset& p : presets()) {
    const LayerDesc d = family_layer(p.family, p.shape);
    const std::string experts = d.num_zero_experts > 0 ? fmt::format("{}+{}z", d.num_experts, d.num_zero_experts)
                                                       : fmt::format("{}", d.num_experts);
    const std::string shared = d.has_shared() ? fmt::format("{}{}", d.shared_intermediate, d.shared_gate ? "g" : "")
                                              : "-";
    fmt::print("{:<20} {:<24} {:<14} {:>6} {:>6} {:>9} {:>5} {:>7}  {}\n", p.name, p.model, family_name(p.family),
               d.hidden, d.intermediate, experts, d.top_k, shared, describe_routing(d));
  }
  fmt::print("\nshared: width of the shared expert, g = sigmoid-gated; z = zero (identity) experts\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moeinfer: the Mixture-of-Experts layer of LLMs at inference time"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "moeinfer 0.1.0");

  RunOptions run;
  CLI::App* run_cmd = app.add_subcommand("run", "Run one MoE layer of a preset on synthetic tokens");
  run_cmd->add_option("--preset", run.preset, "Layer shape of a real model (see `moeinfer presets`)")
      ->capture_default_str();
  run_cmd->add_option("--checkpoint", run.checkpoint, "A Hugging Face model directory instead of a preset");
  run_cmd->add_option("--layer", run.layer, "With --checkpoint: the MoE layer (default: the first)");
  run_cmd->add_option("--input", run.input, "safetensors file holding hidden_states [N, H] (F32, BF16 or F16)");
  run_cmd->add_option("--output", run.output, "Write the output as hidden_states [N, H] F32 to this safetensors file");
  CLI::Option* format_opt = run_cmd->add_option("--format", run.format, "Expert weights of a preset: nvfp4, fp8 (block-128), fp8-channel, fp8-tensor, bf16")
      ->capture_default_str();
  run_cmd->add_option("--tokens", run.tokens, "Tokens per call (N)")->capture_default_str();
  run_cmd->add_option("--seed", run.seed, "Seed of the synthetic weights and tokens")->capture_default_str();
  run_cmd->add_option("--backend", run.backend, "reference, cpu, cuda or auto (the best available)")
      ->capture_default_str();
  run_cmd->add_option("--iters", run.iters, "Timed calls; the median is reported")->capture_default_str();
  run_cmd->add_option("--path", run.path, "Force a CUDA path: expert-major, token-major or per-row (default: plan() chooses)");
  run_cmd->add_flag("--explain", run.explain, "Print the plan: the path chosen and why");
  CLI::Option* run_ep_opt = run_cmd->add_option(
      "--ep", run.ep, "Expert parallelism over this many ranks (launched through mpirun): CPU processes, or one GPU each");
  run_cmd->add_flag("--check", run.check, "Also run the CPU reference and report the relative L2 error");

  app.add_subcommand("presets", "List the presets and their shapes");

  BenchOptions bench;
  CLI::App* bench_cmd = app.add_subcommand("bench", "Time layer calls against the memory-bandwidth and compute floors");
  CLI::Option* bench_preset_opt =
      bench_cmd->add_option("--preset", bench.presets, "Comma-separated presets")->capture_default_str();
  CLI::Option* bench_format_opt =
      bench_cmd->add_option("--format", bench.formats, "Comma-separated formats")->capture_default_str();
  bench_cmd->add_option("--checkpoint", bench.checkpoint,
                        "A Hugging Face model directory instead of presets (its files' format)");
  bench_cmd->add_option("--layer", bench.layer, "With --checkpoint: the MoE layer (default: the first)");
  bench_cmd->add_option("--tokens", bench.tokens, "Comma-separated token counts (N)")->capture_default_str();
  bench_cmd->add_option("--routing", bench.routing, "independent, correlated or both (comma-separated)")
      ->capture_default_str();
  bench_cmd->add_option("--backend", bench.backend, "cuda, cpu, reference or auto")->capture_default_str();
  bench_cmd->add_option("--path", bench.path, "Force a CUDA path: expert-major, token-major or per-row");
  bench_cmd->add_option("--staged", bench.staged,
                        "CUDA expert-major GEMMs at 8 routes per item: staged kernels chosen by grid size (auto), "
                        "forced on, or off")
      ->capture_default_str();
  bench_cmd->add_option("--staged-passes", bench.staged_passes,
                        "CUDA staged expert-major down: 64-row passes per block over one staging of the activations, "
                        "chosen per call (auto), or 1, 2 or 4 forced")
      ->capture_default_str();
  bench_cmd->add_option("--staged-ahead", bench.staged_ahead,
                        "CUDA staged expert-major kernels: chunks of NVFP4 weights each warp loads ahead of its MMAs, "
                        "two in layers with NVFP4 experts, one for a two-tile down from 12 routes per expert (auto), "
                        "or 1 or 2 forced")
      ->capture_default_str();
  bench_cmd->add_option("--mixed-tiles", bench.mixed_tiles,
                        "CUDA expert-major calls at 8 routes per item: experts past 8 routes run at 16 per item in "
                        "the two-tile staged kernels, on a second stream, where experts average 2 routes or more and "
                        "take 8 MB or more each (auto), or forced on (calls past 8 tokens) or off")
      ->capture_default_str();
  bench_cmd->add_option("--shared-apart", bench.shared_apart,
                        "CUDA expert-major calls with a shared expert: its gate_up and down on a second stream beside "
                        "the router and the selection, in calls of up to 8 tokens whose shared expert takes 8 MB or "
                        "more unless the gate_up kernel selects (auto), or forced on or off")
      ->capture_default_str();
  bench_cmd->add_option("--early-gate-up", bench.early_gate_up,
                        "CUDA expert-major calls on one stream: the gate_up launched while the route kernel (or the "
                        "router, where gate_up selects) runs, its blocks waiting for that kernel's end, in calls of "
                        "one token (auto) or in all (on), or after that kernel ends (off)")
      ->capture_default_str();
  bench_cmd->add_option("--early-down", bench.early_down,
                        "CUDA expert-major calls on one stream: the down launched while gate_up's last blocks run, "
                        "loading its first weights before it waits (auto and on; after a gate_up that selects, the "
                        "fused down only, reading the items gate_up publishes), or after gate_up ends (off)")
      ->capture_default_str();
  bench_cmd->add_option("--item-release", bench.item_release,
                        "CUDA expert-major calls whose staged down is launched during gate_up: each down block starts "
                        "once its item's gate_up blocks have stored their activations (auto and on), or once gate_up's "
                        "whole grid has ended (off)")
      ->capture_default_str();
  bench_cmd->add_option("--router-mma", bench.router_mma,
                        "CUDA router logits on the tensor cores (BF16 routers, up to 512 tokens): from 16 tokens where "
                        "their grid has 16 blocks or more (auto), or forced on or off")
      ->capture_default_str();
  bench_cmd->add_option("--weight-tiles", bench.weight_tiles,
                        "CUDA expert weights stored in tiles of 16 rows x 64 bytes where they fit: where every call "
                        "runs expert-major (auto), wherever they fit (on), or never (off: the checkpoint's row-major "
                        "layout)")
      ->capture_default_str();
  CLI::Option* bench_ep_opt = bench_cmd->add_option(
      "--ep", bench.ep, "Expert parallelism over this many ranks (launched through mpirun): CPU processes, or one GPU each");
  bench_cmd->add_option("--inputs", bench.inputs, "Rotating token batches per row (at least 8 keeps L2 honest)")
      ->capture_default_str();
  bench_cmd->add_option("--reps", bench.reps, "Timed rounds over all batches; the median is reported")->capture_default_str();
  bench_cmd->add_option("--seed", bench.seed, "Seed of weights and tokens")->capture_default_str();
  bench_cmd->add_option("--out", bench.out, "Directory for bench.json, bench.csv and bench.png")->capture_default_str();

  std::string plot_json, plot_png;
  CLI::App* plot_cmd = app.add_subcommand("plot", "Draw bench.png from a bench.json (the bench draws its own)");
  plot_cmd->add_option("json", plot_json, "bench.json written by `moeinfer bench`")->required();
  plot_cmd->add_option("png", plot_png, "The PNG to write")->required();

  std::string inspect_dir;
  int inspect_layer = -1;
  CLI::App* inspect_cmd = app.add_subcommand("inspect", "Describe a checkpoint's MoE layers, formats and sizes");
  inspect_cmd->add_option("--checkpoint", inspect_dir, "A Hugging Face model directory")->required();
  inspect_cmd->add_option("--layer", inspect_layer, "The MoE layer to detail (default: the first)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    fmt::print(stderr, "moeinfer: error: {} (see --help)\n", what);
    return 2;
  }

  run.format_given = format_opt->count() > 0;
  bench.presets_or_formats_given = bench_preset_opt->count() > 0 || bench_format_opt->count() > 0;
  const bool ep_given = (run_cmd->parsed() && run_ep_opt->count() > 0) || (bench_cmd->parsed() && bench_ep_opt->count() > 0);
  int& ep_ranks = run_cmd->parsed() ? run.ep : bench.ep;
  const bool in_mpi_job = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
  if (ep_given) {
    // Settled before any rank starts (and again in each rank): the backend, and whether this
    // host can run the ranks.
    if (ep_ranks < 1) return fail(invalid_argument(fmt::format("--ep must be at least 1 (got {})", ep_ranks)));
    std::string& backend = run_cmd->parsed() ? run.backend : bench.backend;
    Result<BackendKind> kind = parse_backend(backend);
    if (!kind.ok()) return fail(kind.status());
    const int gpus = cuda_device_count();  // opens no GPU context
    if (in_mpi_job && gpus >= ep_ranks && (*kind == BackendKind::kAuto || *kind == BackendKind::kCuda)) {
      // A rank makes its own GPU current before the CUDA backend's probe opens a context, so
      // that no rank holds memory on another rank's GPU.
      Status joined = ep_init(&argc, &argv);
      if (joined.ok()) joined = cuda_use_rank_device();
      if (!joined.ok()) return fail(joined);
    }
    Status cuda_usable;  // probed once, after this rank's GPU is current
    if (*kind == BackendKind::kAuto || *kind == BackendKind::kCuda) cuda_usable = make_backend(BackendKind::kCuda).status();
    if (*kind == BackendKind::kAuto) {  // GPUs when there is one per rank
      *kind = gpus >= ep_ranks && cuda_usable.ok() ? BackendKind::kCuda : BackendKind::kCpu;
      backend = backend_name(*kind);
    }
    if (*kind != BackendKind::kCpu && *kind != BackendKind::kCuda) {
      return fail(unsupported(fmt::format(
          "--ep runs on the cpu backend (MPI processes) or the cuda backend (one GPU per rank, NCCL), not '{}'",
          backend)));
    }
    if (*kind == BackendKind::kCuda) {
      if (gpus < ep_ranks) {
        return fail(unavailable(fmt::format("--ep {} on cuda needs one GPU per rank; this host has {}", ep_ranks, gpus)));
      }
      if (!cuda_usable.ok()) return fail(cuda_usable);
      if (!cuda_has_nccl()) return fail(CudaAllReduce::create().status());
    }
    // One CPU rank is the plain cpu backend; one GPU rank runs the NCCL path in this process.
    if (*kind == BackendKind::kCpu && ep_ranks == 1) ep_ranks = 0;
  }
  if (ep_ranks > 1 || (ep_ranks > 0 && in_mpi_job)) {
    if (!in_mpi_job) {
      // Not inside an MPI job yet: start one, each rank running this same command.
      if (!ep_built_with_mpi()) return fail(ep_init(&argc, &argv));
      // Not bound to a core each: a rank runs threads, and rank 0 measures the memory alone.
      std::vector<std::string> args = {"mpirun", "--oversubscribe", "--bind-to", "none", "-np", std::to_string(ep_ranks)};
      // The ranks share this host's cores: unless told otherwise, each gets its share.
      const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
      setenv("OMP_NUM_THREADS", std::to_string(std::max(1u, cores / static_cast<unsigned>(ep_ranks))).c_str(), 0);
      if (geteuid() == 0) {  // Open MPI refuses root in mpirun and in every rank unless told twice
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
      }
      std::error_code ec;
      args.push_back(std::filesystem::read_symlink("/proc/self/exe", ec).string());
      if (ec) args.back() = argv[0];
      for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
      std::vector<char*> cargs;
      for (std::string& a : args) cargs.push_back(a.data());
      cargs.push_back(nullptr);
      std::fflush(stdout);
      execvp("mpirun", cargs.data());
      return fail(unavailable(fmt::format("--ep needs mpirun (Open MPI) on the PATH: {}", std::strerror(errno))));
    }
    const Status st = ep_init(&argc, &argv);
    if (!st.ok()) return fail(st);
    const int rc = run_cmd->parsed() ? run_command(run) : bench_command(bench);
    ep_finalize();
    return rc;
  }
  if (run_cmd->parsed()) return run_command(run);
  if (inspect_cmd->parsed()) return inspect_command(inspect_dir, inspect_layer);
  if (plot_cmd->parsed()) return plot_command(plot_json, plot_png);
  if (bench_cmd->parsed()) return bench_command(bench);
  return presets_command();
}
