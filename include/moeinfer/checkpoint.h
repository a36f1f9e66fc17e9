// Hugging Face checkpoints: config.json (+ hf_quant_config.json) and safetensors shards.
// A checkpoint names its MoE layers; load_layer() returns one of them as a Layer whose routed
// experts are read from the mapped files on first use.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moeinfer/format.h"
#include "moeinfer/layer.h"
#include "moeinfer/safetensors.h"
#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer {

// How the checkpoint says its weights are quantized.
enum class QuantMethod : uint8_t {
  kNone,                  // plain BF16 (or F16/F32, stored as BF16)
  kModelOptNvfp4,         // quant_method "modelopt", quant_algo "NVFP4"
  kCompressedTensorsNvfp4,  // format "nvfp4-pack-quantized"
  kDeepseekFp8,           // quant_method "fp8", weight_block_size [128, 128] (DeepSeek)
};
const char* quant_method_name(QuantMethod m);

struct ModelConfig {
  Family family = Family::kQwen3Moe;
  std::string model_type;      // as config.json spells it
  int num_layers = 0;
  std::vector<int> moe_layers;  // indices of the MoE layers, ascending
  std::string moe_rule;         // which field decided moe_layers, for inspect
  LayerDesc desc;               // the MoE layer's description
  std::string layer_prefix;     // "model.layers." or "language_model.model.layers."
  QuantMethod quant = QuantMethod::kNone;
  std::vector<std::string> quant_excluded;  // module patterns left unquantized ('*' wildcards)
};

// Parses config.json text (and hf_quant_config.json text, may be empty). Pure: no file access.
Result<ModelConfig> parse_model_config(std::string_view config_json, std::string_view hf_quant_config_json = {});

// '*' matches any run of characters (fnmatch without the other metacharacters).
bool wildcard_match(std::string_view pattern, std::string_view text);

class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::string& dir);

  const ModelConfig& config() const;
  const std::string& dir() const;
  bool has(std::string_view tensor) const;
  Result<TensorView> tensor(std::string_view name) const;

  // MoE layer `layer` as a Layer: router, biases and shared expert loaded now, routed experts on
  // first use (the Layer keeps the files mapped).
  Result<Layer> load_layer(int layer) const;

  // One line per part of the layer: its tensor name pattern and format ("router: ... bf16").
  Result<std::vector<std::string>> describe_layer(int layer) const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace moeinfer
