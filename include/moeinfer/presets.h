// Presets: layers of real models' shapes (DESIGN.md section 4) filled with seeded synthetic
// weights, and synthetic layers of any description for tests.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "moeinfer/format.h"
#include "moeinfer/layer.h"
#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer {

struct Preset {
  std::string_view name;   // "qwen3-next-80b-a3b"
  std::string_view model;  // "Qwen3-Next-80B-A3B"
  Family family;
  FamilyShape shape;
};

std::span<const Preset> presets();
Result<const Preset*> find_preset(std::string_view name);

// Synthetic weights: normal with std 1/sqrt(fan_in), so that every activation stays O(1) and
// router logits spread like a trained router's; biases small; quantized as `spec` asks. The
// router stays BF16 (as in real quantized checkpoints). Expert e depends only on (seed, e),
// so experts are generated when first used and every run of the same seed agrees.
Result<Layer> make_synthetic_layer(const LayerDesc& desc, QuantSpec spec, uint64_t seed);
Result<Layer> make_preset_layer(std::string_view name, QuantSpec spec, uint64_t seed);

// n tokens of H values, standard normal, rounded to bf16 (what a model's activations are).
std::vector<float> make_tokens(int64_t n, int64_t hidden, uint64_t seed);

}  // namespace moeinfer
