// config.json -> ModelConfig: which family, the MoE layer's shape and routing, which layers are
// MoE, and how the weights are quantized. Unknown families and unsupported settings are named
// refusals.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <nlohmann/json.hpp>
#include <optional>

#include "moeinfer/checkpoint.h"

namespace moeinfer {

namespace {

using json = nlohmann::json;

struct FamilyName {
  const char* model_type;
  Family family;
};
constexpr FamilyName kFamilies[] = {
    {"qwen2_moe", Family::kQwen2Moe},     {"qwen3_moe", Family::kQwen3Moe},   {"qwen3_next", Family::kQwen3Next},
    {"olmoe", Family::kOlmoe},            {"mixtral", Family::kMixtral},      {"deepseek_v3", Family::kDeepseekV3},
    {"kimi_k2", Family::kDeepseekV3},     {"glm4_moe", Family::kGlm4Moe},     {"minimax_m2", Family::kMinimaxM2},
    {"longcat_flash", Family::kLongcatFlash}, {"gpt_oss", Family::kGptOss}, {"llama4", Family::kLlama4},
    {"llama4_text", Family::kLlama4},
};

Status config_error(const std::string& message) { return invalid_argument("config.json: " + message); }

// An integer value of field `name` within int range, else a named error.
Result<int64_t> config_int(const json& v, std::string_view name) {
  if (!v.is_number_integer()) return config_error(fmt::format("{} is not an integer", name));
  const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(INT_MAX)
                                               : v.get<int64_t>() >= INT_MIN && v.get<int64_t>() <= INT_MAX;
  if (!in_range) return config_error(fmt::format("{} {} is out of range", name, v.dump()));
  return v.get<int64_t>();
}

// Field `name` of object `j`: `fallback` where absent or null, else it must be a string.
Result<std::string> config_string(const json& j, const char* name, const std::string& fallback) {
  if (!j.contains(name) || j[name].is_null()) return fallback;
  if (!j[name].is_string()) return config_error(fmt::format("{} is not a string", name));
  return j[name].get<std::string>();
}

// Field access with named errors.
class Fields {
 public:
  explicit Fields(const json& j) : j_(j) {}
  bool has(const char* name) const { return j_.contains(name) && !j_[name].is_null(); }
  // Every integer of a config (sizes, counts, layer indices) fits an int: larger ones are refused
  // by name here, not truncated where they are narrowed.
  Result<int64_t> integer(const char* name) const {
    if (!has(name)) return config_error(fmt::format("missing {}", name));
    return config_int(j_[name], name);
  }
  Result<int64_t> integer(const char* name, int64_t fallback) const { return has(name) ? integer(name) : fallback; }
  // The first of several names that is present (families spell some fields differently).
  Result<int64_t> first_integer(std::initializer_list<const char*> names) const {
    for (const char* n : names) {
      if (has(n)) return integer(n);
    }
    std::string all;
    for (const char* n : names) all += fmt::format("{}{}", all.empty() ? "" : " / ", n);
    return config_error(fmt::format("missing {}", all));
  }
  Result<double> number(const char* name, double fallback) const {
    if (!has(name)) return fallback;
    if (!j_[name].is_number()) return config_error(fmt::format("{} is not a number", name));
    return j_[name].get<double>();
  }
  Result<bool> boolean(const char* name, bool fallback) const {
    if (!has(name)) return fallback;
    if (!j_[name].is_boolean()) return config_error(fmt::format("{} is not a boolean", name));
    return j_[name].get<bool>();
  }
  std::optional<std::string> string(const char* name) const {
    if (!has(name) || !j_[name].is_string()) return std::nullopt;
    return j_[name].get<std::string>();
  }
  // A string field that may be absent (fallback) but, when present, must be a string.
  Result<std::string> string_or(const char* name, const std::string& fallback) const {
    return config_string(j_, name, fallback);
  }
  const json& raw(const char* name) const { return j_[name]; }

 private:
  const json& j_;
};

#define MOEINFER_ASSIGN(lhs, expr)           \
  do {                                       \
    auto assign_result_ = (expr);            \
    if (!assign_result_.ok()) return assign_result_.status(); \
    lhs = *assign_result_;                   \
  } while (0)

Status require_string(const Fields& f, const char* field, const std::string& want) {
  const std::optional<std::string> v = f.string(field);
  if (v && *v != want) {
    return unsupported(fmt::format("config.json: {} '{}' (only '{}' is supported)", field, *v, want));
  }
  return {};
}

Result<std::vector<int>> int_list(const Fields& f, const char* name) {
  std::vector<int> out;
  if (!f.has(name)) return out;
  if (!f.raw(name).is_array()) return config_error(fmt::format("{} is not a list", name));
  for (const json& v : f.raw(name)) {
    if (!v.is_number_integer()) return config_error(fmt::format("{} holds a non-integer", name));
    int64_t i = 0;
    MOEINFER_ASSIGN(i, config_int(v, name));
    out.push_back(static_cast<int>(i));
  }
  return out;
}

Status parse_quantization(const json& root, std::string_view hf_quant_text, ModelConfig* m) {
  json q;
  if (root.contains("quantization_config")) {
    q = root["quantization_config"];
  } else if (!hf_quant_text.empty()) {
    const json hq = json::parse(hf_quant_text.begin(), hf_quant_text.end(), nullptr, false);
    if (hq.is_discarded() || !hq.is_object()) return invalid_argument("hf_quant_config.json is not valid JSON");
    if (!hq.contains("quantization")) return invalid_argument("hf_quant_config.json has no 'quantization' entry");
    if (!hq["quantization"].is_object()) return invalid_argument("hf_quant_config.json: 'quantization' is not an object");
    q = hq["quantization"];
    q["quant_method"] = "modelopt";
  } else {
    return {};
  }
  if (!q.is_object()) return config_error("quantization_config is not an object");
  std::string method;
  MOEINFER_ASSIGN(method, config_string(q, "quant_method", ""));
  const auto patterns = [&](const char* key) -> Status {
    if (!q.contains(key)) return {};
    if (!q[key].is_array()) return config_error(fmt::format("quantization_config.{} is not a list", key));
    for (const json& p : q[key]) {
      if (p.is_string()) m->quant_excluded.push_back(p.get<std::string>());
    }
    return {};
  };
  if (method == "modelopt") {
    std::string algo;
    MOEINFER_ASSIGN(algo, config_string(q, "quant_algo", ""));
    if (algo != "NVFP4") {
      return unsupported(fmt::format("ModelOpt quant_algo '{}' (only NVFP4 is supported)", algo));
    }
    if (q.contains("group_size") && q["group_size"] != 16) {
      return unsupported(fmt::format("ModelOpt NVFP4 group_size {} (only 16)", q["group_size"].dump()));
    }
    m->quant = QuantMethod::kModelOptNvfp4;
    return patterns("exclude_modules");
  }
  if (method == "compressed-tensors") {
    std::string format;
    MOEINFER_ASSIGN(format, config_string(q, "format", ""));
    if (format != "nvfp4-pack-quantized") {
      return unsupported(fmt::format("compressed-tensors format '{}' (only nvfp4-pack-quantized is supported)", format));
    }
    m->quant = QuantMethod::kCompressedTensorsNvfp4;
    return patterns("ignore");
  }
  if (method == "fp8") {
    if (q.contains("weight_block_size") && q["weight_block_size"] != json::array({128, 128})) {
      return unsupported(fmt::format("fp8 weight_block_size {} (only [128, 128])", q["weight_block_size"].dump()));
    }
    if (q.contains("fmt") && q["fmt"] != "e4m3") {
      return unsupported(fmt::format("fp8 fmt {} (only e4m3)", q["fmt"].dump()));
    }
    m->quant = QuantMethod::kDeepseekFp8;
    return patterns("modules_to_not_convert");
  }
  return unsupported(fmt::format("quantization method '{}' (supported: modelopt NVFP4, compressed-tensors "
                                 "nvfp4-pack-quantized, fp8 block-128)",
                                 method));
}

}  // namespace

const char* quant_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::kNone: return "none (bf16)";
    case QuantMethod::kModelOptNvfp4: return "modelopt NVFP4";
    case QuantMethod::kCompressedTensorsNvfp4: return "compressed-tensors NVFP4";
    case QuantMethod::kDeepseekFp8: return "fp8 block-128";
  }
  return "?";
}

bool wildcard_match(std::string_view pattern, std::string_view text) {
  // Iterative glob with backtracking to the last '*'.
  size_t p = 0, t = 0, star = std::string_view::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

Result<ModelConfig> parse_model_config(std::string_view config_text, std::string_view hf_quant_text) {
  const json root = json::parse(config_text.begin(), config_text.end(), nullptr, false);
  if (root.is_discarded()) return invalid_argument("config.json is not valid JSON");
  if (!root.is_object()) return invalid_argument("config.json is not a JSON object");

  // Multimodal configs (Llama-4) nest the language model under text_config.
  const bool nested = root.contains("text_config") && root["text_config"].is_object();
  const json& text = nested ? root["text_config"] : root;
  const Fields f(text);
  ModelConfig m;
  std::string outer_type;  // Llama-4 names its family outside text_config too
  MOEINFER_ASSIGN(outer_type, config_string(root, "model_type", ""));
  MOEINFER_ASSIGN(m.model_type, f.string_or("model_type", outer_type));
  const FamilyName* fam = nullptr;
  for (const FamilyName& n : kFamilies) {
    if (m.model_type == n.model_type) fam = &n;
  }
  if (fam == nullptr) {
    return unsupported(fmt::format("model_type '{}' is not a supported MoE family (supported: qwen2_moe, qwen3_moe, "
                                   "qwen3_next, olmoe, mixtral, deepseek_v3, kimi_k2, glm4_moe, minimax_m2, "
                                   "longcat_flash, gpt_oss, llama4)",
                                   m.model_type));
  }
  m.family = fam->family;
  const Family family = fam->family;
  const bool qwen = family == Family::kQwen2Moe || family == Family::kQwen3Moe || family == Family::kQwen3Next;

  FamilyShape s;
  MOEINFER_ASSIGN(s.hidden, f.integer("hidden_size"));
  switch (family) {
    case Family::kMixtral:
    case Family::kOlmoe:
    case Family::kMinimaxM2:
    case Family::kGptOss:
    case Family::kLlama4:
      MOEINFER_ASSIGN(s.intermediate, f.integer("intermediate_size"));
      break;
    case Family::kLongcatFlash:
      MOEINFER_ASSIGN(s.intermediate, f.integer("expert_ffn_hidden_size"));
      break;
    default:
      MOEINFER_ASSIGN(s.intermediate, f.integer("moe_intermediate_size"));
  }
  int64_t experts = 0, top_k = 0, layers = 0;
  MOEINFER_ASSIGN(experts, f.first_integer({"num_experts", "n_routed_experts", "num_local_experts"}));
  MOEINFER_ASSIGN(top_k, f.first_integer({"num_experts_per_tok", "moe_topk"}));
  MOEINFER_ASSIGN(layers, f.first_integer({"num_hidden_layers", "num_layers"}));
  if (experts <= 0) return config_error(fmt::format("the model has {} experts: no MoE layer", experts));
  if (layers <= 0 || layers > 100000) return config_error(fmt::format("num_hidden_layers {} is out of range", layers));
  s.num_experts = static_cast<int>(experts);
  s.top_k = static_cast<int>(top_k);
  m.num_layers = static_cast<int>(layers);

  // Per-family defaults are those of the transformers config classes.
  const bool norm_default = family == Family::kQwen3Next || family == Family::kDeepseekV3 || family == Family::kGlm4Moe;
  MOEINFER_ASSIGN(s.norm_topk_prob, f.boolean("norm_topk_prob", norm_default));
  if (family != Family::kGptOss) MOEINFER_RETURN_IF_ERROR(require_string(f, "hidden_act", "silu"));

  switch (family) {
    case Family::kQwen2Moe:
    case Family::kQwen3Next:
      MOEINFER_ASSIGN(s.shared_intermediate, f.integer("shared_expert_intermediate_size"));
      break;
    case Family::kDeepseekV3:
    case Family::kGlm4Moe: {
      MOEINFER_RETURN_IF_ERROR(require_string(f, "scoring_func", "sigmoid"));
      MOEINFER_RETURN_IF_ERROR(require_string(f, "topk_method", "noaux_tc"));
      int64_t n_shared = 0;
      MOEINFER_ASSIGN(n_shared, f.integer("n_shared_experts", 0));
      s.shared_intermediate = n_shared * s.intermediate;
      const bool ds = family == Family::kDeepseekV3;
      MOEINFER_ASSIGN(s.routed_scaling_factor, f.number("routed_scaling_factor", ds ? 2.5 : 1.0));
      int64_t g = 1, tg = 1;
      MOEINFER_ASSIGN(g, f.integer("n_group", ds ? 8 : 1));
      MOEINFER_ASSIGN(tg, f.integer("topk_group", ds ? 4 : 1));
      s.n_group = static_cast<int>(g);
      s.topk_group = static_cast<int>(tg);
      break;
    }
    case Family::kLongcatFlash: {
      if (!f.has("routed_scaling_factor")) return config_error("missing routed_scaling_factor");
      MOEINFER_ASSIGN(s.routed_scaling_factor, f.number("routed_scaling_factor", 1.0));
      int64_t z = 0;
      MOEINFER_ASSIGN(z, f.integer("zero_expert_num", 0));
      s.num_zero_experts = static_cast<int>(z);
      break;
    }
    case Family::kMinimaxM2:
      MOEINFER_RETURN_IF_ERROR(require_string(f, "scoring_func", "sigmoid"));
      break;
    case Family::kLlama4:
      s.shared_intermediate = s.intermediate;  // Llama-4 always adds a shared expert of the same width
      break;
    default:
      break;
  }

  m.desc = family_layer(family, s);
  if (family == Family::kMinimaxM2) {
    bool bias = true;
    MOEINFER_ASSIGN(bias, f.boolean("use_routing_bias", true));
    m.desc.routing.correction_bias = bias;
  }
  if (family == Family::kGptOss) {
    double limit = 7.0;
    MOEINFER_ASSIGN(limit, f.number("swiglu_limit", 7.0));
    m.desc.swiglu_limit = static_cast<float>(limit);
  }
  if (const Status st = validate(m.desc); !st.ok()) return Status(st.code(), "config.json: " + st.message());

  // Which layers are MoE.
  std::vector<int> moe;
  if (qwen) {
    std::vector<int> mlp_only;
    MOEINFER_ASSIGN(mlp_only, int_list(f, "mlp_only_layers"));
    int64_t step = 1;
    MOEINFER_ASSIGN(step, f.integer("decoder_sparse_step", 1));
    if (step < 1) return config_error(fmt::format("decoder_sparse_step {} must be positive", step));
    for (int l = 0; l < m.num_layers; ++l) {
      if (std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end() && (l + 1) % step == 0) moe.push_back(l);
    }
    m.moe_rule = fmt::format("decoder_sparse_step {}, mlp_only_layers [{}]", step, fmt::join(mlp_only, ", "));
  } else if (family == Family::kDeepseekV3 || family == Family::kGlm4Moe) {
    int64_t first = 0, freq = 1;
    MOEINFER_ASSIGN(first, f.integer("first_k_dense_replace", 0));
    MOEINFER_ASSIGN(freq, f.integer("moe_layer_freq", 1));
    if (freq < 1) return config_error(fmt::format("moe_layer_freq {} must be positive", freq));
    for (int l = 0; l < m.num_layers; ++l) {
      if (l >= first && l % freq == 0) moe.push_back(l);
    }
    m.moe_rule = fmt::format("first_k_dense_replace {}, moe_layer_freq {}", first, freq);
  } else if (family == Family::kLlama4) {
    if (f.has("moe_layers")) {
      MOEINFER_ASSIGN(moe, int_list(f, "moe_layers"));
      m.moe_rule = "moe_layers";
    } else {
      int64_t step = 1;
      MOEINFER_ASSIGN(step, f.integer("interleave_moe_layer_step", 1));
      if (step < 1) return config_error(fmt::format("interleave_moe_layer_step {} must be positive", step));
      for (int64_t l = step - 1; l < m.num_layers; l += step) moe.push_back(static_cast<int>(l));
      m.moe_rule = fmt::format("interleave_moe_layer_step {}", step);
    }
  } else {
    for (int l = 0; l < m.num_layers; ++l) moe.push_back(l);
    m.moe_rule = "every layer";
  }
  for (int l : moe) {
    if (l < 0 || l >= m.num_layers) return config_error(fmt::format("MoE layer {} is outside [0, {})", l, m.num_layers));
  }
  std::sort(moe.begin(), moe.end());
  m.moe_layers = moe;
  m.layer_prefix = (family == Family::kLlama4 && nested) ? "language_model.model.layers." : "model.layers.";
  MOEINFER_RETURN_IF_ERROR(parse_quantization(root, hf_quant_text, &m));
  return m;
}

}  // namespace moeinfer
