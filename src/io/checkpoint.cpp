// Checkpoint directories: shards, tensor lookup, and one MoE layer's tensors in whichever layout
// the family and the quantizer used.
#include "moeinfer/checkpoint.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

namespace moeinfer {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

Result<std::string> read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(StatusCode::kIoError, fmt::format("{}: cannot read", path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The tensor names of one MoE layer, per family (DESIGN.md section 4).
struct LayerNames {
  std::string router;           // module: router.weight (+ router.bias for gpt-oss)
  std::string correction_bias;  // tensor, or ""
  std::string experts;          // module prefix of expert e: experts + "{e}." + proj
  std::string gate, up, down;   // projection module names
  bool fused = false;           // [E, H, 2I] / [E, I, H] tensors (gpt-oss, Llama-4)
  bool interleaved = false;     // gpt-oss: gate = even columns, up = odd
  std::string shared;           // shared expert module prefix, or ""
  std::string shared_gate;      // tensor, or ""
};

LayerNames layer_names(const ModelConfig& c, int layer) {
  const std::string p = fmt::format("{}{}.", c.layer_prefix, layer);
  LayerNames n;
  n.gate = "gate_proj";
  n.up = "up_proj";
  n.down = "down_proj";
  switch (c.family) {
    case Family::kQwen2Moe:
    case Family::kQwen3Moe:
    case Family::kQwen3Next:
    case Family::kOlmoe:
      n.router = p + "mlp.gate";
      n.experts = p + "mlp.experts.";
      if (c.desc.has_shared()) {
        n.shared = p + "mlp.shared_expert.";
        n.shared_gate = p + "mlp.shared_expert_gate.weight";
      }
      break;
    case Family::kDeepseekV3:
    case Family::kGlm4Moe:
      n.router = p + "mlp.gate";
      n.correction_bias = p + "mlp.gate.e_score_correction_bias";
      n.experts = p + "mlp.experts.";
      if (c.desc.has_shared()) n.shared = p + "mlp.shared_experts.";
      break;
    case Family::kMixtral:
    case Family::kMinimaxM2:
      n.router = p + "block_sparse_moe.gate";
      if (c.desc.routing.correction_bias) n.correction_bias = p + "block_sparse_moe.e_score_correction_bias";
      n.experts = p + "block_sparse_moe.experts.";
      n.gate = "w1";
      n.up = "w3";
      n.down = "w2";
      break;
    case Family::kLongcatFlash:
      n.router = p + "mlp.router.classifier";
      n.correction_bias = p + "mlp.router.e_score_correction_bias";
      n.experts = p + "mlp.experts.";
      break;
    case Family::kGptOss:
      n.router = p + "mlp.router";
      n.experts = p + "mlp.experts.";
      n.fused = true;
      n.interleaved = true;
      break;
    case Family::kLlama4:
      n.router = p + "feed_forward.router";
      n.experts = p + "feed_forward.experts.";
      n.fused = true;
      n.shared = p + "feed_forward.shared_expert.";
      break;
  }
  return n;
}

}  // namespace

struct Checkpoint::State {
  std::string dir;
  ModelConfig config;
  std::map<std::string, std::string, std::less<>> shard_of;  // tensor -> file name
  mutable std::mutex mutex;
  mutable std::map<std::string, std::shared_ptr<SafetensorsFile>> open_files;

  Result<std::shared_ptr<SafetensorsFile>> file(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = open_files.find(name);
    if (it != open_files.end()) return it->second;
    Result<SafetensorsFile> f = SafetensorsFile::open((fs::path(dir) / name).string());
    if (!f.ok()) return f.status();
    auto shared = std::make_shared<SafetensorsFile>(std::move(f).value());
    open_files.emplace(name, shared);
    return shared;
  }

  Result<TensorView> tensor(std::string_view name) const {
    const auto it = shard_of.find(name);
    if (it == shard_of.end()) return not_found(fmt::format("{}: no tensor named '{}' in the checkpoint", dir, name));
    Result<std::shared_ptr<SafetensorsFile>> f = file(it->second);
    if (!f.ok()) return f.status();
    return (*f)->get(name);
  }
  bool has(std::string_view name) const { return shard_of.find(name) != shard_of.end(); }

  // ModelOpt writes '*' wildcards; compressed-tensors writes "re:<regex>" (Python re.match,
  // anchored at the start only), which glob_of() turns into a wildcard.
  bool excluded(std::string_view module) const {
    for (const std::string& p : config.quant_excluded) {
      if (wildcard_match(p.rfind("re:", 0) == 0 ? glob_of(p.substr(3)) : p, module)) return true;
    }
    return false;
  }

  // The regexes quantizers write are '.*' runs, escaped dots and an optional '$': translate those.
  // Any other regex syntax yields a pattern that matches nothing (it excludes nothing).
  static std::string glob_of(const std::string& re) {
    std::string g;
    bool anchored_end = false;
    for (size_t i = (re.rfind('^', 0) == 0 ? 1 : 0); i < re.size(); ++i) {
      const char c = re[i];
      if (c == '.' && i + 1 < re.size() && re[i + 1] == '*') {
        g += '*';
        ++i;
      } else if (c == '\\' && i + 1 < re.size()) {
        g += re[++i];
      } else if (c == '$' && i + 1 == re.size()) {
        anchored_end = true;
      } else if (std::string_view("[](){}+?|^$").find(c) != std::string_view::npos) {
        return std::string(1, '\0');  // unsupported syntax
      } else {
        g += c;  // '.' outside '.*' is taken literally: stricter than the regex, never looser
      }
    }
    return anchored_end ? g : g + '*';
  }

  // Reads module `m` (its .weight and companions) as a [rows, cols] matrix in whatever format
  // the tensors are stored in.
  Result<QuantMatrix> matrix(const std::string& m, int64_t rows, int64_t cols) const;
  Result<QuantSpec> format_of(const std::string& m) const;
  // Routed expert e of a layer, per-expert or fused layout.
  Result<ExpertWeights> expert(const LayerNames& n, int e) const;
  Result<ExpertWeights> fused_expert(const LayerNames& n, int e) const;
  Result<ExpertWeights> projections(const std::string& prefix, const LayerNames& n, int64_t inter) const;
};

namespace {

Status shape_error(const TensorView& t, const std::vector<int64_t>& want) {
  return invalid_argument(fmt::format("{}: shape {} {}, but config.json implies [{}]", t.name, t.shape_string(),
                                      dtype_name(t.dtype), fmt::join(want, ", ")));
}

Status expect_shape(const TensorView& t, const std::vector<int64_t>& want) {
  if (t.shape != want) return shape_error(t, want);
  return {};
}

// A one-element tensor ([], [1]) as a float.
Result<float> scalar(const TensorView& t) {
  if (t.numel() != 1 || (t.dtype != Dtype::kF32 && t.dtype != Dtype::kBF16 && t.dtype != Dtype::kF16)) {
    return invalid_argument(fmt::format("{}: expected one float, found {} {}", t.name, t.shape_string(), dtype_name(t.dtype)));
  }
  return t.to_floats()[0];
}

Result<std::vector<float>> float_vector(const TensorView& t, int64_t size) {
  if (t.dtype != Dtype::kF32 && t.dtype != Dtype::kBF16 && t.dtype != Dtype::kF16) {
    return invalid_argument(fmt::format("{}: dtype {} (expected F32, BF16 or F16)", t.name, dtype_name(t.dtype)));
  }
  // Accept [size] and [1, size] (a Linear with one output stores [1, H]).
  if (t.numel() != size || (t.shape.size() != 1 && !(t.shape.size() == 2 && t.shape[0] == 1))) {
    return shape_error(t, {size});
  }
  return t.to_floats();
}

}  // namespace

Result<QuantSpec> Checkpoint::State::format_of(const std::string& m) const {
  if (has(m + ".weight_packed")) return QuantSpec{WeightFormat::kNVFP4};
  Result<TensorView> w = tensor(m + ".weight");
  if (!w.ok()) return w.status();
  switch (w->dtype) {
    case Dtype::kBF16:
    case Dtype::kF16:
    case Dtype::kF32:
      return QuantSpec{WeightFormat::kBF16};
    case Dtype::kU8:
      return QuantSpec{WeightFormat::kNVFP4};
    case Dtype::kF8E4M3: {
      if (has(m + ".weight_scale_inv")) return QuantSpec{WeightFormat::kFP8, Fp8Scaling::kBlock128};
      Result<TensorView> s = tensor(m + ".weight_scale");
      if (!s.ok()) return invalid_argument(fmt::format("{}.weight is F8_E4M3 but has no weight_scale_inv or weight_scale", m));
      return QuantSpec{WeightFormat::kFP8, s->numel() == 1 ? Fp8Scaling::kPerTensor : Fp8Scaling::kPerChannel};
    }
    default:
      return unsupported(fmt::format("{}.weight: dtype {} is not a weight format moeinfer reads", m, dtype_name(w->dtype)));
  }
}

Result<QuantMatrix> Checkpoint::State::matrix(const std::string& m, int64_t rows, int64_t cols) const {
  Result<QuantSpec> spec = format_of(m);
  if (!spec.ok()) return spec.status();
  if (spec->format != WeightFormat::kBF16 && (config.quant == QuantMethod::kNone || excluded(m))) {
    return invalid_argument(fmt::format("{} is stored as {}, but {}", m, quant_spec_name(*spec),
                                        config.quant == QuantMethod::kNone ? "config.json declares no quantization"
                                                                           : "the quantization config excludes it"));
  }
  QuantMatrix q;
  q.spec = *spec;
  q.rows = rows;
  q.cols = cols;
  const auto bytes_of = [](const TensorView& t) { return std::vector<uint8_t>(t.bytes.begin(), t.bytes.end()); };
  if (spec->format == WeightFormat::kBF16) {
    Result<TensorView> w = tensor(m + ".weight");
    if (!w.ok()) return w.status();
    MOEINFER_RETURN_IF_ERROR(expect_shape(*w, {rows, cols}));
    if (w->dtype == Dtype::kBF16) {
      q.data = bytes_of(*w);
    } else {  // F16 / F32 checkpoints are stored as bf16 (rounded to nearest even)
      Result<QuantMatrix> r = QuantMatrix::quantize(w->to_floats(), rows, cols, QuantSpec{WeightFormat::kBF16});
      if (!r.ok()) return r.status();
      q = std::move(r).value();
    }
  } else if (spec->format == WeightFormat::kNVFP4) {
    const bool ct = has(m + ".weight_packed");  // compressed-tensors names
    Result<TensorView> w = tensor(m + (ct ? ".weight_packed" : ".weight"));
    Result<TensorView> s = tensor(m + ".weight_scale");
    Result<TensorView> g = tensor(m + (ct ? ".weight_global_scale" : ".weight_scale_2"));
    for (const Result<TensorView>* r : {&w, &s, &g}) {
      if (!r->ok()) return r->status();
    }
    if (cols % kNvfp4Group != 0) {
      return invalid_argument(fmt::format("{}: in_features {} is not a multiple of the NVFP4 group 16", m, cols));
    }
    if (w->dtype != Dtype::kU8) return invalid_argument(fmt::format("{}: packed NVFP4 weight must be U8, found {}", w->name, dtype_name(w->dtype)));
    if (s->dtype != Dtype::kF8E4M3) return invalid_argument(fmt::format("{}: NVFP4 block scales must be F8_E4M3, found {}", s->name, dtype_name(s->dtype)));
    MOEINFER_RETURN_IF_ERROR(expect_shape(*w, {rows, cols / 2}));
    MOEINFER_RETURN_IF_ERROR(expect_shape(*s, {rows, cols / kNvfp4Group}));
    Result<float> global = scalar(*g);
    if (!global.ok()) return global.status();
    // compressed-tensors stores the reciprocal of the global scale: divide by it.
    q.global_scale = ct ? 1.0f / *global : *global;
    q.data = bytes_of(*w);
    q.block_scales = bytes_of(*s);
  } else {
    Result<TensorView> w = tensor(m + ".weight");
    if (!w.ok()) return w.status();
    MOEINFER_RETURN_IF_ERROR(expect_shape(*w, {rows, cols}));
    const bool block = spec->fp8_scaling == Fp8Scaling::kBlock128;
    Result<TensorView> s = tensor(m + (block ? ".weight_scale_inv" : ".weight_scale"));
    if (!s.ok()) return s.status();
    if (block) {
      MOEINFER_RETURN_IF_ERROR(expect_shape(*s, {(rows + 127) / 128, (cols + 127) / 128}));
    } else if (spec->fp8_scaling == Fp8Scaling::kPerChannel && s->numel() != rows) {
      return shape_error(*s, {rows, 1});
    }
    if (s->dtype != Dtype::kF32 && s->dtype != Dtype::kBF16) {
      return invalid_argument(fmt::format("{}: FP8 scales must be F32 or BF16, found {}", s->name, dtype_name(s->dtype)));
    }
    q.data = bytes_of(*w);
    q.scales = s->to_floats();
  }
  MOEINFER_RETURN_IF_ERROR(q.check(m));
  return q;
}

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  auto state = std::make_shared<State>();
  state->dir = dir;
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return not_found(fmt::format("{}: not a directory", dir));
  Result<std::string> config_text = read_text(root / "config.json");
  if (!config_text.ok()) return not_found(fmt::format("{}: no readable config.json", dir));
  std::string quant_text;
  if (fs::exists(root / "hf_quant_config.json")) {
    Result<std::string> t = read_text(root / "hf_quant_config.json");
    if (!t.ok()) return t.status();
    quant_text = *t;
  }
  Result<ModelConfig> config = parse_model_config(*config_text, quant_text);
  if (!config.ok()) return config.status().with_context(dir);
  state->config = std::move(config).value();

  const fs::path index = root / "model.safetensors.index.json";
  if (fs::exists(index)) {
    Result<std::string> t = read_text(index);
    if (!t.ok()) return t.status();
    const json j = json::parse(*t, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return Status(StatusCode::kCorruptData, fmt::format("{}: not a valid index (no weight_map object)", index.string()));
    }
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) return Status(StatusCode::kCorruptData, fmt::format("{}: weight_map['{}'] is not a file name", index.string(), name));
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f == "..") {
        return Status(StatusCode::kCorruptData, fmt::format("{}: shard '{}' is not a file in the checkpoint directory", index.string(), f));
      }
      state->shard_of.emplace(name, f);
    }
  } else {
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      if (entry.path().extension() == ".safetensors") files.push_back(entry.path().filename().string());
    }
    if (files.empty()) return not_found(fmt::format("{}: no *.safetensors file and no model.safetensors.index.json", dir));
    std::sort(files.begin(), files.end());
    for (const std::string& f : files) {
      Result<std::shared_ptr<SafetensorsFile>> file = state->file(f);
      if (!file.ok()) return file.status();
      for (const std::string& name : (*file)->names()) state->shard_of.emplace(name, f);
    }
  }
  Checkpoint c;
  c.state_ = std::move(state);
  return c;
}

const ModelConfig& Checkpoint::config() const { return state_->config; }
const std::string& Checkpoint::dir() const { return state_->dir; }
bool Checkpoint::has(std::string_view tensor) const { return state_->has(tensor); }
Result<TensorView> Checkpoint::tensor(std::string_view name) const { return state_->tensor(name); }

namespace {

Status check_moe_layer(const ModelConfig& c, int layer) {
  if (layer < 0 || layer >= c.num_layers) {
    return invalid_argument(fmt::format("layer {} is outside [0, {})", layer, c.num_layers));
  }
  if (std::find(c.moe_layers.begin(), c.moe_layers.end(), layer) == c.moe_layers.end()) {
    const std::string list =
        c.moe_layers.empty() ? "none" : fmt::format("{} of them, the first is {}", c.moe_layers.size(), c.moe_layers.front());
    return invalid_argument(fmt::format("layer {} is not an MoE layer ({}; MoE layers: {})", layer, c.moe_rule, list));
  }
  return {};
}

// Rows [r0, r0 + rows) of a row-major float matrix with `cols` columns, as one expert's slice of a
// 3D tensor: the bytes of [e] in [E, rows, cols].
Result<std::vector<float>> slice3d(const TensorView& t, int e, int64_t experts, int64_t rows, int64_t cols) {
  if (t.dtype != Dtype::kBF16 && t.dtype != Dtype::kF16 && t.dtype != Dtype::kF32) {
    return unsupported(fmt::format("{}: fused expert tensors stored as {} (only BF16, F16 or F32)", t.name, dtype_name(t.dtype)));
  }
  if (t.shape != std::vector<int64_t>{experts, rows, cols}) return shape_error(t, {experts, rows, cols});
  const auto per = static_cast<size_t>(rows * cols * dtype_size(t.dtype));
  TensorView one{t.name, t.dtype, {rows, cols}, t.bytes.subspan(static_cast<size_t>(e) * per, per)};
  return one.to_floats();
}

}  // namespace

Result<ExpertWeights> Checkpoint::State::projections(const std::string& prefix, const LayerNames& n, int64_t inter) const {
  const int64_t h = config.desc.hidden;
  ExpertWeights w;
  Result<QuantMatrix> gate = matrix(prefix + n.gate, inter, h);
  if (!gate.ok()) return gate.status();
  Result<QuantMatrix> up = matrix(prefix + n.up, inter, h);
  if (!up.ok()) return up.status();
  Result<QuantMatrix> down = matrix(prefix + n.down, h, inter);
  if (!down.ok()) return down.status();
  w.gate = std::move(gate).value();
  w.up = std::move(up).value();
  w.down = std::move(down).value();
  return w;
}

Result<ExpertWeights> Checkpoint::State::fused_expert(const LayerNames& n, int e) const {
  const LayerDesc& d = config.desc;
  const int64_t h = d.hidden, inter = d.intermediate, experts = d.num_experts;
  if (has(n.experts + "gate_up_proj_blocks")) {
    return unsupported(fmt::format("{}gate_up_proj_blocks: MXFP4 expert weights are not supported (dequantize to BF16)", n.experts));
  }
  Result<TensorView> gu = tensor(n.experts + "gate_up_proj");
  if (!gu.ok()) return gu.status();
  Result<TensorView> dn = tensor(n.experts + "down_proj");
  if (!dn.ok()) return dn.status();
  Result<std::vector<float>> gate_up = slice3d(*gu, e, experts, h, 2 * inter);  // [H, 2I], input-major
  if (!gate_up.ok()) return gate_up.status();
  Result<std::vector<float>> down_t = slice3d(*dn, e, experts, inter, h);       // [I, H]
  if (!down_t.ok()) return down_t.status();
  // gate/up column of intermediate row i: gpt-oss interleaves (2i, 2i+1), Llama-4 halves (i, I+i).
  const auto gate_col = [&](int64_t i) { return n.interleaved ? 2 * i : i; };
  const auto up_col = [&](int64_t i) { return n.interleaved ? 2 * i + 1 : inter + i; };
  std::vector<float> g(static_cast<size_t>(inter * h)), u(g.size()), dw(static_cast<size_t>(h * inter));
  for (int64_t i = 0; i < inter; ++i) {
    for (int64_t c = 0; c < h; ++c) {
      g[static_cast<size_t>(i * h + c)] = (*gate_up)[static_cast<size_t>(c * 2 * inter + gate_col(i))];
      u[static_cast<size_t>(i * h + c)] = (*gate_up)[static_cast<size_t>(c * 2 * inter + up_col(i))];
      dw[static_cast<size_t>(c * inter + i)] = (*down_t)[static_cast<size_t>(i * h + c)];
    }
  }
  const QuantSpec bf16{WeightFormat::kBF16};
  ExpertWeights w;
  Result<QuantMatrix> gm = QuantMatrix::quantize(g, inter, h, bf16);
  Result<QuantMatrix> um = QuantMatrix::quantize(u, inter, h, bf16);
  Result<QuantMatrix> dm = QuantMatrix::quantize(dw, h, inter, bf16);
  for (const Result<QuantMatrix>* r : {&gm, &um, &dm}) {
    if (!r->ok()) return r->status();
  }
  w.gate = std::move(gm).value();
  w.up = std::move(um).value();
  w.down = std::move(dm).value();
  if (d.expert_bias) {
    Result<TensorView> gub = tensor(n.experts + "gate_up_proj_bias");
    if (!gub.ok()) return gub.status();
    Result<TensorView> db = tensor(n.experts + "down_proj_bias");
    if (!db.ok()) return db.status();
    Result<std::vector<float>> gb = slice3d(*gub, e, experts, 1, 2 * inter);
    if (!gb.ok()) {
      // Biases are [E, 2I] and [E, H]: view them as [E, 1, n].
      TensorView v = *gub;
      if (v.shape.size() == 2) v.shape = {v.shape[0], 1, v.shape[1]};
      gb = slice3d(v, e, experts, 1, 2 * inter);
      if (!gb.ok()) return gb.status();
    }
    TensorView dv = *db;
    if (dv.shape.size() == 2) dv.shape = {dv.shape[0], 1, dv.shape[1]};
    Result<std::vector<float>> dbias = slice3d(dv, e, experts, 1, h);
    if (!dbias.ok()) return dbias.status();
    for (int64_t i = 0; i < inter; ++i) {
      w.gate_bias.push_back((*gb)[static_cast<size_t>(gate_col(i))]);
      w.up_bias.push_back((*gb)[static_cast<size_t>(up_col(i))]);
    }
    w.down_bias = std::move(dbias).value();
  }
  return w;
}

Result<ExpertWeights> Checkpoint::State::expert(const LayerNames& n, int e) const {
  if (n.fused) return fused_expert(n, e);
  return projections(fmt::format("{}{}.", n.experts, e), n, config.desc.intermediate);
}

Result<Layer> Checkpoint::load_layer(int layer) const {
  const ModelConfig& c = state_->config;
  MOEINFER_RETURN_IF_ERROR(check_moe_layer(c, layer));
  const LayerDesc& d = c.desc;
  const LayerNames n = layer_names(c, layer);
  std::shared_ptr<const State> state = state_;
  Layer out(d, [state, n](int e) { return state->expert(n, e); });

  if (n.fused) {
    out.expert_spec = QuantSpec{WeightFormat::kBF16};
  } else {
    Result<QuantSpec> spec = state_->format_of(fmt::format("{}0.{}", n.experts, n.gate));
    if (!spec.ok()) return spec.status();
    out.expert_spec = *spec;
  }
  Result<QuantMatrix> router = state_->matrix(n.router, d.router_outputs(), d.hidden);
  if (!router.ok()) return router.status();
  out.router = std::move(router).value();
  if (d.routing.router_bias) {
    Result<TensorView> b = tensor(n.router + ".bias");
    if (!b.ok()) return b.status();
    Result<std::vector<float>> v = float_vector(*b, d.router_outputs());
    if (!v.ok()) return v.status();
    out.router_bias = std::move(v).value();
  }
  if (d.routing.correction_bias) {
    Result<TensorView> b = tensor(n.correction_bias);
    if (!b.ok()) return b.status();
    Result<std::vector<float>> v = float_vector(*b, d.router_outputs());
    if (!v.ok()) return v.status();
    out.correction_bias = std::move(v).value();
  }
  if (d.has_shared()) {
    Result<ExpertWeights> shared = state_->projections(n.shared, n, d.shared_intermediate);
    if (!shared.ok()) return shared.status();
    out.shared = std::move(shared).value();
  }
  if (d.shared_gate) {
    Result<TensorView> g = tensor(n.shared_gate);
    if (!g.ok()) return g.status();
    Result<std::vector<float>> v = float_vector(*g, d.hidden);
    if (!v.ok()) return v.status();
    out.shared_gate = std::move(v).value();
  }
  MOEINFER_RETURN_IF_ERROR(out.check());
  return out;
}

Result<std::vector<std::string>> Checkpoint::describe_layer(int layer) const {
  const ModelConfig& c = state_->config;
  MOEINFER_RETURN_IF_ERROR(check_moe_layer(c, layer));
  const LayerNames n = layer_names(c, layer);
  std::vector<std::string> lines;
  const auto spec_of = [&](const std::string& m) -> std::string {
    Result<QuantSpec> s = state_->format_of(m);
    return s.ok() ? quant_spec_name(*s) : s.status().message();
  };
  lines.push_back(fmt::format("router          {}.weight: {}", n.router, spec_of(n.router)));
  if (n.fused) {
    lines.push_back(fmt::format("experts         {}{{gate_up_proj, down_proj}} (fused [E, ...]): bf16", n.experts));
  } else {
    lines.push_back(fmt::format("experts         {}{{0..{}}}.{{{}, {}, {}}}: {}", n.experts, c.desc.num_experts - 1, n.gate,
                                n.up, n.down, spec_of(fmt::format("{}0.{}", n.experts, n.gate))));
  }
  if (!n.shared.empty()) {
    lines.push_back(fmt::format("shared expert   {}{{{}, {}, {}}}: {}", n.shared, n.gate, n.up, n.down, spec_of(n.shared + n.gate)));
  }
  if (!n.shared_gate.empty()) lines.push_back(fmt::format("shared gate     {}", n.shared_gate));
  if (!n.correction_bias.empty()) lines.push_back(fmt::format("correction bias {}", n.correction_bias));
  // Bytes: every tensor under the layer's MoE module.
  const std::string block = n.experts.substr(0, n.experts.find(".experts.") + 1);
  int64_t bytes = 0, count = 0;
  for (const auto& [name, file] : state_->shard_of) {
    if (name.rfind(block, 0) != 0) continue;
    Result<TensorView> t = tensor(name);
    if (!t.ok()) return t.status();
    bytes += static_cast<int64_t>(t->bytes.size());
    ++count;
  }
  lines.push_back(fmt::format("bytes           {} in {} tensors ({:.2f} MiB)", bytes, count, static_cast<double>(bytes) / (1 << 20)));
  return lines;
}

}  // namespace moeinfer
