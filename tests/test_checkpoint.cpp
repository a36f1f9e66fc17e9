// Checkpoints: every family in every layout loads, and runs exactly as the layer it was written
// from; config.json rules; damaged files and checkpoints give named errors.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <ostream>

#include "checkpoint_writer.h"
#include "hf_mirror.h"
#include <nlohmann/json.hpp>

#include "moeinfer/checkpoint.h"
#include "moeinfer/presets.h"
#include "moeinfer/reference.h"
#include "moeinfer/safetensors.h"
#include "test_util.h"

namespace moeinfer {
namespace {

namespace fs = std::filesystem;
using testing::Layout;
using testing::take;

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("moeinfer_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

using testing::FamilyCase;
using testing::families;

struct LoadCase {
  FamilyCase family;
  Layout layout;
  int shards;
};

void PrintTo(const LoadCase& c, std::ostream* os) { *os << c.family.name << " " << testing::layout_name(c.layout); }

std::vector<LoadCase> load_cases() {
  std::vector<LoadCase> cases;
  for (const FamilyCase& f : families()) {
    const bool fused = f.family == Family::kGptOss || f.family == Family::kLlama4;
    cases.push_back({f, Layout::kBf16, 1});
    if (fused) continue;  // fused 3D expert tensors are BF16 only
    for (Layout l : {Layout::kModelOptNvfp4, Layout::kModelOptNvfp4Hf, Layout::kCompressedNvfp4, Layout::kDeepseekFp8}) {
      cases.push_back({f, l, l == Layout::kCompressedNvfp4 ? 3 : 1});
    }
  }
  return cases;
}

class LoadCheckpoint : public ::testing::TestWithParam<LoadCase> {};

TEST_P(LoadCheckpoint, RunsExactlyAsTheLayerItWasWrittenFrom) {
  const LoadCase& c = GetParam();
  const LayerDesc desc = family_layer(c.family.family, c.family.shape);
  const Layer original = take(make_synthetic_layer(desc, testing::layout_spec(c.layout), 21));
  const std::string dir = temp_dir(std::string(c.family.name) + "_" + testing::layout_name(c.layout));
  ASSERT_OK(testing::write_test_checkpoint(dir, original, {c.family.model_type, c.layout, c.shards}));

  const Checkpoint ckpt = take(Checkpoint::open(dir));
  EXPECT_EQ(ckpt.config().family, c.family.family);
  EXPECT_EQ(ckpt.config().moe_layers.back(), 1);
  const Layer loaded = take(ckpt.load_layer(1));
  const LayerDesc& d = loaded.desc;
  EXPECT_EQ(d.hidden, desc.hidden);
  EXPECT_EQ(d.intermediate, desc.intermediate);
  EXPECT_EQ(d.num_experts, desc.num_experts);
  EXPECT_EQ(d.num_zero_experts, desc.num_zero_experts);
  EXPECT_EQ(d.top_k, desc.top_k);
  EXPECT_EQ(d.shared_intermediate, desc.shared_intermediate);
  EXPECT_EQ(d.shared_gate, desc.shared_gate);
  EXPECT_EQ(d.routing.renormalize, desc.routing.renormalize);
  EXPECT_EQ(d.routing.scaling, desc.routing.scaling);
  EXPECT_EQ(d.routing.n_group, desc.routing.n_group);
  EXPECT_EQ(d.routing.correction_bias, desc.routing.correction_bias);
  EXPECT_EQ(loaded.expert_spec.format, testing::layout_spec(c.layout).format);

  // The same weights: equal dequantized values (compressed-tensors stores 1/global, whose
  // reciprocal may differ from the original global scale by an ulp).
  const double weight_tol = c.layout == Layout::kCompressedNvfp4 ? 1e-6 : 0.0;
  for (int e : {0, desc.num_experts - 1}) {
    const ExpertWeights* a = take(original.expert(e));
    const ExpertWeights* b = take(loaded.expert(e));
    EXPECT_LE(testing::rel_l2(b->gate.dequantize(), a->gate.dequantize()), weight_tol) << "expert " << e;
    EXPECT_LE(testing::rel_l2(b->down.dequantize(), a->down.dequantize()), weight_tol) << "expert " << e;
    EXPECT_EQ(b->up_bias, a->up_bias);
  }

  // And the same layer: the loaded layer through the reference against the original through
  // the independent mirror.
  const int64_t n = 7;
  const std::vector<float> x = make_tokens(n, desc.hidden, 5);
  std::vector<float> expected(x.size()), got(x.size(), std::nanf(""));
  ASSERT_OK(testing::hf_mirror_forward(original, x, n, expected));
  ASSERT_OK(moe_forward_reference(loaded, x, n, got));
  EXPECT_LE(testing::rel_l2(got, expected), 1e-6);
}

std::string load_case_name(const ::testing::TestParamInfo<LoadCase>& info) {
  return std::string(info.param.family.name) + "_" + testing::layout_name(info.param.layout);
}

INSTANTIATE_TEST_SUITE_P(Families, LoadCheckpoint, ::testing::ValuesIn(load_cases()), load_case_name);

// ---- config.json ------------------------------------------------------------------------------

TEST(ModelConfig, MoeLayersFollowTheFamilysFields) {
  const ModelConfig ds = take(parse_model_config(R"({"model_type": "deepseek_v3", "hidden_size": 64,
      "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 6,
      "first_k_dense_replace": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 1})"));
  EXPECT_EQ(ds.moe_layers, (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(ds.desc.shared_intermediate, 32);
  EXPECT_EQ(ds.desc.routing.scaling, 2.5);  // DeepseekV3Config's default

  const ModelConfig qwen = take(parse_model_config(R"({"model_type": "qwen2_moe", "hidden_size": 64,
      "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 8,
      "decoder_sparse_step": 2, "mlp_only_layers": [3], "shared_expert_intermediate_size": 64})"));
  EXPECT_EQ(qwen.moe_layers, (std::vector<int>{1, 5, 7}));  // (l + 1) % 2 == 0, minus layer 3
  EXPECT_FALSE(qwen.desc.routing.renormalize);              // Qwen2MoeConfig's default

  const ModelConfig llama = take(parse_model_config(R"({"model_type": "llama4", "text_config": {
      "model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 32, "intermediate_size_mlp": 128,
      "num_local_experts": 4, "num_experts_per_tok": 1, "num_hidden_layers": 6, "interleave_moe_layer_step": 2}})"));
  EXPECT_EQ(llama.moe_layers, (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(llama.layer_prefix, "language_model.model.layers.");
  EXPECT_EQ(llama.desc.shared_intermediate, 32);

  const ModelConfig flat = take(parse_model_config(R"({"model_type": "llama4_text", "hidden_size": 64,
      "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 1, "num_hidden_layers": 4,
      "moe_layers": [0, 2]})"));
  EXPECT_EQ(flat.moe_layers, (std::vector<int>{0, 2}));
  EXPECT_EQ(flat.layer_prefix, "model.layers.");

  const ModelConfig q3 = take(parse_model_config(R"({"model_type": "qwen3_moe", "hidden_size": 64,
      "moe_intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2})"));
  EXPECT_EQ(q3.desc.num_experts, 8);  // num_local_experts accepted for every family
}

TEST(ModelConfig, NamedRefusals) {
  const auto error = [](const char* text) { return parse_model_config(text).status().message(); };
  EXPECT_EQ(error(R"({"model_type": "llama", "hidden_size": 8})"),
            "model_type 'llama' is not a supported MoE family (supported: qwen2_moe, qwen3_moe, qwen3_next, olmoe, "
            "mixtral, deepseek_v3, kimi_k2, glm4_moe, minimax_m2, longcat_flash, gpt_oss, llama4)");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
                      "num_hidden_layers": 2})"),
            "config.json: missing intermediate_size");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64, "num_experts_per_tok": 2,
                      "num_hidden_layers": 2})"),
            "config.json: missing num_experts / n_routed_experts / num_local_experts");
  EXPECT_EQ(error(R"({"model_type": "deepseek_v3", "hidden_size": 64, "moe_intermediate_size": 32,
                      "n_routed_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 2, "scoring_func": "softmax"})"),
            "config.json: scoring_func 'softmax' (only 'sigmoid' is supported)");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 8,
                      "num_experts_per_tok": 12, "num_hidden_layers": 2})"),
            "config.json: top_k (12) > num_experts (8)");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 8,
                      "num_experts_per_tok": 2, "num_hidden_layers": 2, "quantization_config": {"quant_method": "awq"}})"),
            "quantization method 'awq' (supported: modelopt NVFP4, compressed-tensors nvfp4-pack-quantized, fp8 block-128)");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 8,
                      "num_experts_per_tok": 2, "num_hidden_layers": 2, "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}})"),
            "ModelOpt quant_algo 'FP8' (only NVFP4 is supported)");
  EXPECT_EQ(error("{not json"), "config.json is not valid JSON");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": "big"})"), "config.json: hidden_size is not an integer");
  // Fields of the wrong type or out of int range are refused by name (a non-string model_type
  // once threw out of the parser; a count past 2^31 was truncated to a small valid one).
  EXPECT_EQ(error(R"({"model_type": 16, "hidden_size": 64})"), "config.json: model_type is not a string");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 8,
                      "num_experts_per_tok": 2, "num_hidden_layers": 2, "quantization_config": {"quant_method": 8}})"),
            "config.json: quant_method is not a string");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 8,
                      "num_experts_per_tok": 2, "num_hidden_layers": 2, "quantization_config": {"quant_method": "modelopt",
                      "quant_algo": ["NVFP4"]}})"),
            "config.json: quant_algo is not a string");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64,
                      "num_local_experts": 4294967304, "num_experts_per_tok": 2, "num_hidden_layers": 2})"),
            "config.json: num_local_experts 4294967304 is out of range");
  EXPECT_EQ(error(R"({"model_type": "mixtral", "hidden_size": 18446744073709551615})"),
            "config.json: hidden_size 18446744073709551615 is out of range");
  EXPECT_EQ(error(R"({"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
                      "num_experts_per_tok": 2, "num_hidden_layers": 2, "mlp_only_layers": [99999999999]})"),
            "config.json: mlp_only_layers 99999999999 is out of range");
  const char* mixtral = R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 8,
                            "num_experts_per_tok": 2, "num_hidden_layers": 2})";
  EXPECT_EQ(parse_model_config(mixtral, R"({"quantization": [1]})").status().message(),
            "hf_quant_config.json: 'quantization' is not an object");
}

TEST(ModelConfig, Wildcards) {
  EXPECT_TRUE(wildcard_match("*mlp.gate", "model.layers.3.mlp.gate"));
  EXPECT_FALSE(wildcard_match("*mlp.gate", "model.layers.3.mlp.gate_proj"));
  EXPECT_TRUE(wildcard_match("model.layers.*.mlp.*", "model.layers.3.mlp.experts.1.up_proj"));
  EXPECT_TRUE(wildcard_match("lm_head", "lm_head"));
  EXPECT_FALSE(wildcard_match("lm_head", "lm_head2"));
}

// ---- damaged checkpoints ----------------------------------------------------------------------

class DamagedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const LayerDesc d = family_layer(Family::kDeepseekV3, families()[5].shape);
    layer_ = std::make_unique<Layer>(take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 3)));
    dir_ = temp_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_OK(testing::write_test_checkpoint(dir_, *layer_, {"deepseek_v3", Layout::kModelOptNvfp4, 1}));
  }
  // Rewrites model.safetensors with `edit` applied to its tensors.
  void rewrite(const std::function<void(std::vector<TensorData>&)>& edit) {
    const SafetensorsFile f = take(SafetensorsFile::open(dir_ + "/model.safetensors"));
    std::vector<TensorData> t;
    for (const std::string& name : f.names()) {
      const TensorView v = take(f.get(name));
      t.push_back({name, v.dtype, v.shape, std::vector<uint8_t>(v.bytes.begin(), v.bytes.end())});
    }
    edit(t);
    ASSERT_OK(write_safetensors(dir_ + "/model.safetensors", t));
  }
  std::unique_ptr<Layer> layer_;
  std::string dir_;
};

TEST_F(DamagedCheckpoint, MissingTensorIsNamed) {
  rewrite([](std::vector<TensorData>& t) {
    std::erase_if(t, [](const TensorData& x) { return x.name == "model.layers.1.mlp.experts.5.up_proj.weight_scale"; });
  });
  const Layer l = take(take(Checkpoint::open(dir_)).load_layer(1));
  const Result<const ExpertWeights*> e = l.expert(5);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("no tensor named 'model.layers.1.mlp.experts.5.up_proj.weight_scale'"), std::string::npos)
      << e.status().message();
}

TEST_F(DamagedCheckpoint, WrongShapeIsNamed) {
  rewrite([](std::vector<TensorData>& t) {
    for (TensorData& x : t) {
      if (x.name == "model.layers.1.mlp.gate.weight") x.shape = {8, 128};  // same bytes, wrong shape
    }
  });
  const Result<Layer> l = take(Checkpoint::open(dir_)).load_layer(1);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().message(), "model.layers.1.mlp.gate.weight: shape [8, 128] BF16, but config.json implies [16, 64]");
}

TEST_F(DamagedCheckpoint, DenseLayerAndMissingFiles) {
  const Checkpoint c = take(Checkpoint::open(dir_));
  EXPECT_EQ(c.load_layer(0).status().message(),
            "layer 0 is not an MoE layer (first_k_dense_replace 1, moe_layer_freq 1; MoE layers: 1 of them, the first is 1)");
  EXPECT_EQ(c.load_layer(7).status().message(), "layer 7 is outside [0, 2)");
  fs::remove(dir_ + "/config.json");
  EXPECT_NE(Checkpoint::open(dir_).status().message().find("no readable config.json"), std::string::npos);
  EXPECT_NE(Checkpoint::open(dir_ + "/nope").status().message().find("not a directory"), std::string::npos);
}

TEST_F(DamagedCheckpoint, QuantizedTensorThatTheConfigExcludes) {
  // The exclusion list says the router is BF16; store it as NVFP4 and the loader must object.
  rewrite([&](std::vector<TensorData>& t) {
    std::erase_if(t, [](const TensorData& x) { return x.name == "model.layers.1.mlp.gate.weight"; });
    const QuantMatrix q = take(QuantMatrix::quantize(layer_->router.dequantize(), 16, 64, {WeightFormat::kNVFP4}));
    const std::string m = "model.layers.1.mlp.gate";
    t.push_back({m + ".weight", Dtype::kU8, {16, 32}, q.data});
    t.push_back({m + ".weight_scale", Dtype::kF8E4M3, {16, 4}, q.block_scales});
    std::vector<uint8_t> g(4);
    std::memcpy(g.data(), &q.global_scale, 4);
    t.push_back({m + ".weight_scale_2", Dtype::kF32, {}, g});
  });
  EXPECT_EQ(take(Checkpoint::open(dir_)).load_layer(1).status().message(),
            "model.layers.1.mlp.gate is stored as nvfp4, but the quantization config excludes it");
}

TEST(CheckpointExclusions, CompressedTensorsRegexIgnoreList) {
  // compressed-tensors lists modules to leave unquantized as "re:" regexes. Quantize the router
  // anyway and the loader must see that the regex excludes it.
  const LayerDesc d = family_layer(Family::kQwen3Moe, families()[1].shape);
  const Layer layer = take(make_synthetic_layer(d, {WeightFormat::kNVFP4}, 4));
  const std::string dir = temp_dir("ct_regex");
  ASSERT_OK(testing::write_test_checkpoint(dir, layer, {"qwen3_moe", Layout::kCompressedNvfp4, 1}));
  const auto set_ignore = [&](const char* pattern) {
    std::ifstream in(dir + "/config.json");
    nlohmann::json c = nlohmann::json::parse(in);
    c["quantization_config"]["ignore"] = {"lm_head", pattern};
    std::ofstream(dir + "/config.json") << c.dump();
  };
  // Store the router in the compressed-tensors NVFP4 layout.
  const SafetensorsFile f = take(SafetensorsFile::open(dir + "/model.safetensors"));
  std::vector<TensorData> t;
  for (const std::string& name : f.names()) {
    if (name == "model.layers.1.mlp.gate.weight") continue;
    const TensorView v = take(f.get(name));
    t.push_back({name, v.dtype, v.shape, std::vector<uint8_t>(v.bytes.begin(), v.bytes.end())});
  }
  const QuantMatrix q = take(QuantMatrix::quantize(layer.router.dequantize(), 8, 48, {WeightFormat::kNVFP4}));
  const float inv = 1.0f / q.global_scale;
  std::vector<uint8_t> g(4);
  std::memcpy(g.data(), &inv, 4);
  t.push_back({"model.layers.1.mlp.gate.weight_packed", Dtype::kU8, {8, 24}, q.data});
  t.push_back({"model.layers.1.mlp.gate.weight_scale", Dtype::kF8E4M3, {8, 3}, q.block_scales});
  t.push_back({"model.layers.1.mlp.gate.weight_global_scale", Dtype::kF32, {1}, g});
  ASSERT_OK(write_safetensors(dir + "/model.safetensors", t));

  set_ignore("re:.*mlp\\.gate$");
  EXPECT_EQ(take(Checkpoint::open(dir)).load_layer(1).status().message(),
            "model.layers.1.mlp.gate is stored as nvfp4, but the quantization config excludes it");
  set_ignore("re:.*self_attn.*");  // does not cover the router: the quantized router loads
  EXPECT_TRUE(take(Checkpoint::open(dir)).load_layer(1).ok());
  set_ignore("re:model[.]layers.*");  // regex syntax we do not translate excludes nothing
  EXPECT_TRUE(take(Checkpoint::open(dir)).load_layer(1).ok());
}

// ---- damaged safetensors ----------------------------------------------------------------------

std::vector<uint8_t> file_image(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i)));
  for (char c : header) out.push_back(static_cast<uint8_t>(c));
  for (uint8_t b : data) out.push_back(b);
  return out;
}

std::string parse_error(const std::vector<uint8_t>& image) {
  const Result<SafetensorsFile> f = SafetensorsFile::parse(image, "f");
  return f.ok() ? "ok" : f.status().message();
}

TEST(Safetensors, DamagedFilesAreNamed) {
  const std::vector<uint8_t> data(16, 0);
  EXPECT_EQ(parse_error({1, 2, 3}), "f: truncated: 3 bytes, but a safetensors file starts with an 8-byte header length");
  std::vector<uint8_t> past = file_image("{}", data);
  past[0] = 200;
  EXPECT_EQ(parse_error(past), "f: header length 200 runs past the end of the file (26 bytes)");
  EXPECT_EQ(parse_error(file_image("{\"a\": ", data)), "f: header is not valid JSON");
  EXPECT_EQ(parse_error(file_image("[1, 2]", data)), "f: header JSON is not an object");
  EXPECT_EQ(parse_error(file_image("{\"\xff\": 1}", data)), "f: header is not valid UTF-8 (byte 2 of the header)");
  EXPECT_EQ(parse_error(file_image(R"({"a": {"b": {"c": {"d": {"e": 1}}}}})", data)), "f: header JSON nests deeper than 4 levels");
  EXPECT_EQ(parse_error(file_image(R"({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}})", data)),
            "f: tensor 'w': unknown dtype 'F4'");
  EXPECT_EQ(parse_error(file_image(R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}})", data)),
            "f: tensor 'w': shape [2, 3] of F32 needs 24 bytes, but data_offsets span 16");
  EXPECT_EQ(parse_error(file_image(R"({"w": {"dtype": "U8", "shape": [8], "data_offsets": [12, 20]}})", data)),
            "f: tensor 'w': data_offsets [12, 20] fall outside the data section (16 bytes)");
  EXPECT_EQ(parse_error(file_image(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                                       "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})", data)),
            "f: tensors 'a' and 'b' overlap (bytes [0, 8) and [4, 12))");
  EXPECT_EQ(parse_error(file_image(R"({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}})", data)),
            "f: tensor 'w': shape holds a value that is not a non-negative integer");
  EXPECT_EQ(parse_error(file_image(R"({"w": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 1]}})", data)),
            "f: tensor 'w': shape is too large");
  EXPECT_EQ(parse_error(file_image(R"({"__metadata__": {"format": "pt"}, "w": {"dtype": "U8", "shape": [2, 8], "data_offsets": [0, 16]}})", data)),
            "ok");
}

TEST(Safetensors, TruncatedFileOnDisk) {
  const std::string dir = temp_dir("truncated");
  const std::vector<float> v(64, 1.0f);
  ASSERT_OK(write_safetensors(dir + "/a.safetensors", {tensor_from_floats("x", {8, 8}, v)}));
  fs::resize_file(dir + "/a.safetensors", fs::file_size(dir + "/a.safetensors") - 10);
  const Result<SafetensorsFile> f = SafetensorsFile::open(dir + "/a.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kCorruptData);
  EXPECT_NE(f.status().message().find("fall outside the data section"), std::string::npos) << f.status().message();
  std::ofstream(dir + "/b.safetensors") << "abc";
  EXPECT_NE(SafetensorsFile::open(dir + "/b.safetensors").status().message().find("truncated: 3 bytes"), std::string::npos);
}

TEST(Safetensors, RoundTripsEveryDtype) {
  const std::string dir = temp_dir("roundtrip");
  const std::vector<float> v = {1.5f, -2.0f, 0.25f, 448.0f};
  std::vector<TensorData> t = {tensor_from_floats("f32", {2, 2}, v), tensor_from_floats("bf16", {4}, v, Dtype::kBF16)};
  t.push_back({"f8", Dtype::kF8E4M3, {4}, {e4m3_from_float(1.5f), e4m3_from_float(-2.0f), e4m3_from_float(0.25f), 0x7E}});
  t.push_back({"f16", Dtype::kF16, {4}, {0x00, 0x3E, 0x00, 0xC0, 0x00, 0x34, 0x00, 0x5F}});  // 1.5, -2, 0.25, 448
  t.push_back({"u8", Dtype::kU8, {1}, {7}});
  t.push_back({"i64", Dtype::kI64, {1}, {9, 0, 0, 0, 0, 0, 0, 0}});
  ASSERT_OK(write_safetensors(dir + "/x.safetensors", t));
  const SafetensorsFile f = take(SafetensorsFile::open(dir + "/x.safetensors"));
  for (const char* name : {"f32", "bf16", "f8", "f16"}) EXPECT_EQ(take(f.get(name)).to_floats(), v) << name;
  EXPECT_EQ(take(f.get("u8")).to_floats(), std::vector<float>{7.0f});
  EXPECT_EQ(take(f.get("i64")).to_floats(), std::vector<float>{9.0f});
  EXPECT_EQ(take(f.get("f32")).shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(f.get("nope").status().message(), dir + "/x.safetensors: no tensor named 'nope'");
}

}  // namespace
}  // namespace moeinfer
