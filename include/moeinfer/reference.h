// The CPU reference backend: the whole layer, every variant, accumulated in double.
// It is the oracle every other path is tested against, so it favours being checkable against
// DESIGN.md line by line over being fast.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moeinfer/layer.h"
#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer {

// The k experts chosen for each token and their weights, token-major: [n, k].
struct Routes {
  int top_k = 0;
  std::vector<int> ids;
  std::vector<double> weights;
};

// Selection for one token from its E + Z router logits (router bias already added).
// correction_bias is empty or [E + Z]. Ties go to the lowest index. Writes k ids and weights.
Status moe_select_reference(const LayerDesc& desc, std::span<const double> logits,
                            std::span<const float> correction_bias, std::span<int> ids,
                            std::span<double> weights);

// The checks every CPU path makes on its input: n >= 1, x holds n * H values, all finite.
Status moe_check_input(const LayerDesc& desc, std::span<const float> x, int64_t n);

// Router logits for n tokens: [n, E + Z], router bias included.
Status moe_router_reference(const Layer& layer, std::span<const float> x, int64_t n,
                            std::vector<double>* logits);

// Routing for n tokens (router + selection).
Result<Routes> moe_route_reference(const Layer& layer, std::span<const float> x, int64_t n);

// The layer for n tokens: x [n, H] -> out [n, H]. Inputs must be finite.
Status moe_forward_reference(const Layer& layer, std::span<const float> x, int64_t n,
                             std::span<float> out);

}  // namespace moeinfer
