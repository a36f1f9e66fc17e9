#include "checkpoint_writer.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moeinfer/safetensors.h"

namespace moeinfer::testing {

namespace {

using json = nlohmann::json;

std::vector<uint8_t> float_bytes(float v) {
  std::vector<uint8_t> b(4);
  std::memcpy(b.data(), &v, 4);
  return b;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t x = bf16_from_float(v[i]);
    std::memcpy(&b[2 * i], &x, 2);
  }
  return b;
}

// One Linear module in the layout's tensors.
void add_linear(std::vector<TensorData>& out, const std::string& m, const QuantMatrix& q, Layout layout) {
  const int64_t o = q.rows, i = q.cols;
  switch (q.spec.format) {
    case WeightFormat::kBF16:
      out.push_back({m + ".weight", Dtype::kBF16, {o, i}, q.data});
      return;
    case WeightFormat::kNVFP4:
      if (layout == Layout::kCompressedNvfp4) {
        out.push_back({m + ".weight_packed", Dtype::kU8, {o, i / 2}, q.data});
        out.push_back({m + ".weight_scale", Dtype::kF8E4M3, {o, i / 16}, q.block_scales});
        out.push_back({m + ".weight_global_scale", Dtype::kF32, {1}, float_bytes(1.0f / q.global_scale)});
        out.push_back({m + ".input_global_scale", Dtype::kF32, {1}, float_bytes(1.0f)});
      } else {
        out.push_back({m + ".weight", Dtype::kU8, {o, i / 2}, q.data});
        out.push_back({m + ".weight_scale", Dtype::kF8E4M3, {o, i / 16}, q.block_scales});
        out.push_back({m + ".weight_scale_2", Dtype::kF32, {}, float_bytes(q.global_scale)});
        out.push_back({m + ".input_scale", Dtype::kF32, {}, float_bytes(1.0f)});
      }
      return;
    case WeightFormat::kFP8: {
      out.push_back({m + ".weight", Dtype::kF8E4M3, {o, i}, q.data});
      std::vector<uint8_t> s(q.scales.size() * 4);
      std::memcpy(s.data(), q.scales.data(), s.size());
      out.push_back({m + ".weight_scale_inv", Dtype::kF32, {(o + 127) / 128, (i + 127) / 128}, s});
      return;
    }
  }
}

void add_expert(std::vector<TensorData>& out, const std::string& prefix, const ExpertWeights& w, const char* gate,
                const char* up, const char* down, Layout layout) {
  add_linear(out, prefix + gate, w.gate, layout);
  add_linear(out, prefix + up, w.up, layout);
  add_linear(out, prefix + down, w.down, layout);
}

// gpt-oss / Llama-4: gate_up_proj [E, H, 2I] (input-major), down_proj [E, I, H].
Status add_fused(std::vector<TensorData>& out, const std::string& prefix, const Layer& layer, bool interleave) {
  const LayerDesc& d = layer.desc;
  const int64_t e_count = d.num_experts, h = d.hidden, inter = d.intermediate;
  std::vector<float> gu(static_cast<size_t>(e_count * h * 2 * inter)), dn(static_cast<size_t>(e_count * inter * h));
  std::vector<float> gub, db;
  for (int e = 0; e < e_count; ++e) {
    Result<const ExpertWeights*> w = layer.expert(e);
    if (!w.ok()) return w.status();
    const std::vector<float> g = (*w)->gate.dequantize(), u = (*w)->up.dequantize(), dw = (*w)->down.dequantize();
    for (int64_t i = 0; i < inter; ++i) {
      const int64_t gc = interleave ? 2 * i : i, uc = interleave ? 2 * i + 1 : inter + i;
      for (int64_t c = 0; c < h; ++c) {
        gu[static_cast<size_t>((e * h + c) * 2 * inter + gc)] = g[static_cast<size_t>(i * h + c)];
        gu[static_cast<size_t>((e * h + c) * 2 * inter + uc)] = u[static_cast<size_t>(i * h + c)];
        dn[static_cast<size_t>((e * inter + i) * h + c)] = dw[static_cast<size_t>(c * inter + i)];
      }
    }
    if (d.expert_bias) {
      std::vector<float> b(static_cast<size_t>(2 * inter));
      for (int64_t i = 0; i < inter; ++i) {
        b[static_cast<size_t>(interleave ? 2 * i : i)] = (*w)->gate_bias[static_cast<size_t>(i)];
        b[static_cast<size_t>(interleave ? 2 * i + 1 : inter + i)] = (*w)->up_bias[static_cast<size_t>(i)];
      }
      gub.insert(gub.end(), b.begin(), b.end());
      db.insert(db.end(), (*w)->down_bias.begin(), (*w)->down_bias.end());
    }
  }
  out.push_back({prefix + "gate_up_proj", Dtype::kBF16, {e_count, h, 2 * inter}, bf16_bytes(gu)});
  out.push_back({prefix + "down_proj", Dtype::kBF16, {e_count, inter, h}, bf16_bytes(dn)});
  if (d.expert_bias) {
    out.push_back({prefix + "gate_up_proj_bias", Dtype::kBF16, {e_count, 2 * inter}, bf16_bytes(gub)});
    out.push_back({prefix + "down_proj_bias", Dtype::kBF16, {e_count, h}, bf16_bytes(db)});
  }
  return {};
}

json family_config(const LayerDesc& d, const std::string& model_type) {
  json c = {{"model_type", model_type}, {"hidden_size", d.hidden}, {"num_hidden_layers", 2}, {"hidden_act", "silu"}};
  const Family f = d.family;
  if (f == Family::kQwen2Moe || f == Family::kQwen3Moe || f == Family::kQwen3Next) {
    c["moe_intermediate_size"] = d.intermediate;
    c["num_experts"] = d.num_experts;
    c["num_local_experts"] = d.num_experts;  // real Qwen3-MoE configs carry both
    c["num_experts_per_tok"] = d.top_k;
    c["norm_topk_prob"] = d.routing.renormalize;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = {0};
    if (f != Family::kQwen3Moe) c["shared_expert_intermediate_size"] = d.shared_intermediate;
  } else if (f == Family::kOlmoe) {
    c["intermediate_size"] = d.intermediate;
    c["num_experts"] = d.num_experts;
    c["num_experts_per_tok"] = d.top_k;
    c["norm_topk_prob"] = d.routing.renormalize;
  } else if (f == Family::kMixtral || f == Family::kMinimaxM2) {
    c["intermediate_size"] = d.intermediate;
    c["num_local_experts"] = d.num_experts;
    c["num_experts_per_tok"] = d.top_k;
    if (f == Family::kMinimaxM2) {
      c["scoring_func"] = "sigmoid";
      c["use_routing_bias"] = true;
    }
  } else if (f == Family::kDeepseekV3 || f == Family::kGlm4Moe) {
    c["moe_intermediate_size"] = d.intermediate;
    c["n_routed_experts"] = d.num_experts;
    c["num_experts_per_tok"] = d.top_k;
    c["n_shared_experts"] = d.shared_intermediate / d.intermediate;
    c["first_k_dense_replace"] = 1;
    c["n_group"] = d.routing.n_group;
    c["topk_group"] = d.routing.topk_group;
    c["routed_scaling_factor"] = d.routing.scaling;
    c["norm_topk_prob"] = d.routing.renormalize;
    c["scoring_func"] = "sigmoid";
    c["topk_method"] = "noaux_tc";
  } else if (f == Family::kLongcatFlash) {
    c.erase("num_hidden_layers");
    c["num_layers"] = 2;
    c["expert_ffn_hidden_size"] = d.intermediate;
    c["n_routed_experts"] = d.num_experts;
    c["moe_topk"] = d.top_k;
    c["zero_expert_num"] = d.num_zero_experts;
    c["routed_scaling_factor"] = d.routing.scaling;
  } else if (f == Family::kGptOss) {
    c.erase("hidden_act");
    c["intermediate_size"] = d.intermediate;
    c["num_local_experts"] = d.num_experts;
    c["num_experts_per_tok"] = d.top_k;
    c["swiglu_limit"] = d.swiglu_limit;
  } else if (f == Family::kLlama4) {
    json text = {{"model_type", "llama4_text"}, {"hidden_size", d.hidden}, {"num_hidden_layers", 2},
                 {"intermediate_size", d.intermediate}, {"intermediate_size_mlp", 4 * d.intermediate},
                 {"num_local_experts", d.num_experts}, {"num_experts_per_tok", d.top_k},
                 {"interleave_moe_layer_step", 2}, {"hidden_act", "silu"}};
    return {{"model_type", "llama4"}, {"text_config", text}};
  }
  return c;
}

}  // namespace

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kBf16: return "bf16";
    case Layout::kModelOptNvfp4: return "modelopt_nvfp4";
    case Layout::kModelOptNvfp4Hf: return "modelopt_nvfp4_hfquant";
    case Layout::kCompressedNvfp4: return "compressed_nvfp4";
    case Layout::kDeepseekFp8: return "deepseek_fp8";
  }
  return "?";
}

QuantSpec layout_spec(Layout l) {
  switch (l) {
    case Layout::kBf16: return {WeightFormat::kBF16};
    case Layout::kDeepseekFp8: return {WeightFormat::kFP8, Fp8Scaling::kBlock128};
    default: return {WeightFormat::kNVFP4};
  }
}

Status write_test_checkpoint(const std::string& dir, const Layer& layer, const CheckpointSpec& spec) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const LayerDesc& d = layer.desc;
  const Family f = d.family;
  const bool llama4 = f == Family::kLlama4;
  const std::string p = std::string(llama4 ? "language_model.model.layers." : "model.layers.") + "1.";

  std::vector<TensorData> t;
  std::string router, experts, shared, gate = "gate_proj", up = "up_proj", down = "down_proj";
  switch (f) {
    case Family::kMixtral:
    case Family::kMinimaxM2:
      router = p + "block_sparse_moe.gate";
      experts = p + "block_sparse_moe.experts.";
      gate = "w1";
      up = "w3";
      down = "w2";
      if (d.routing.correction_bias) {
        t.push_back(tensor_from_floats(p + "block_sparse_moe.e_score_correction_bias", {d.router_outputs()}, layer.correction_bias));
      }
      break;
    case Family::kLongcatFlash:
      router = p + "mlp.router.classifier";
      experts = p + "mlp.experts.";
      t.push_back(tensor_from_floats(p + "mlp.router.e_score_correction_bias", {d.router_outputs()}, layer.correction_bias));
      break;
    case Family::kGptOss:
      router = p + "mlp.router";
      experts = p + "mlp.experts.";
      t.push_back(tensor_from_floats(p + "mlp.router.bias", {d.router_outputs()}, layer.router_bias, Dtype::kBF16));
      break;
    case Family::kLlama4:
      router = p + "feed_forward.router";
      experts = p + "feed_forward.experts.";
      shared = p + "feed_forward.shared_expert.";
      break;
    case Family::kDeepseekV3:
    case Family::kGlm4Moe:
      router = p + "mlp.gate";
      experts = p + "mlp.experts.";
      shared = d.has_shared() ? p + "mlp.shared_experts." : "";
      t.push_back(tensor_from_floats(p + "mlp.gate.e_score_correction_bias", {d.router_outputs()}, layer.correction_bias));
      break;
    default:  // Qwen families, OLMoE
      router = p + "mlp.gate";
      experts = p + "mlp.experts.";
      if (d.has_shared()) {
        shared = p + "mlp.shared_expert.";
        t.push_back(tensor_from_floats(p + "mlp.shared_expert_gate.weight", {1, d.hidden}, layer.shared_gate, Dtype::kBF16));
      }
  }
  add_linear(t, router, layer.router, spec.layout);
  if (f == Family::kGptOss || f == Family::kLlama4) {
    MOEINFER_RETURN_IF_ERROR(add_fused(t, experts, layer, f == Family::kGptOss));
  } else {
    for (int e = 0; e < d.num_experts; ++e) {
      Result<const ExpertWeights*> w = layer.expert(e);
      if (!w.ok()) return w.status();
      add_expert(t, fmt::format("{}{}.", experts, e), **w, gate.c_str(), up.c_str(), down.c_str(), spec.layout);
    }
  }
  if (!shared.empty()) add_expert(t, shared, *layer.shared, "gate_proj", "up_proj", "down_proj", spec.layout);

  json config = family_config(d, spec.model_type);
  // The router stays BF16 in quantized checkpoints; the config says so through its exclusions.
  const std::string router_pattern = "*" + router.substr(router.find(".layers.1.") + 10);
  switch (spec.layout) {
    case Layout::kModelOptNvfp4:
      config["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"group_size", 16},
                                       {"exclude_modules", {"lm_head", router_pattern}}};
      break;
    case Layout::kModelOptNvfp4Hf: {
      const json hq = {{"producer", {{"name", "modelopt"}}},
                       {"quantization", {{"quant_algo", "NVFP4"}, {"group_size", 16}, {"exclude_modules", {"lm_head", router_pattern}}}}};
      std::ofstream(fs::path(dir) / "hf_quant_config.json") << hq.dump(2);
      break;
    }
    case Layout::kCompressedNvfp4:
      config["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"format", "nvfp4-pack-quantized"},
                                       {"ignore", {"lm_head", "re:.*mlp.gate$", router_pattern}}};
      break;
    case Layout::kDeepseekFp8:
      config["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}},
                                       {"activation_scheme", "dynamic"}};
      break;
    case Layout::kBf16:
      break;
  }
  std::ofstream(fs::path(dir) / "config.json") << config.dump(2);

  if (spec.shards <= 1) return write_safetensors((fs::path(dir) / "model.safetensors").string(), t);
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  for (int s = 0; s < spec.shards; ++s) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, spec.shards);
    std::vector<TensorData> part;
    for (size_t i = static_cast<size_t>(s); i < t.size(); i += static_cast<size_t>(spec.shards)) {
      part.push_back(t[i]);
      index["weight_map"][t[i].name] = name;
    }
    MOEINFER_RETURN_IF_ERROR(write_safetensors((fs::path(dir) / name).string(), part));
  }
  std::ofstream(fs::path(dir) / "model.safetensors.index.json") << index.dump(2);
  return {};
}

}  // namespace moeinfer::testing
