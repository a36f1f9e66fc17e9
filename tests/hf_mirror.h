// A second, independent evaluation of the layer, written the way the Hugging Face blocks are
// (dense dequantized weights, score masks and repeated argmax instead of sorting, an
// expert-major loop over the experts that were hit). It shares no code with the reference
// beyond the weight decoders, so a routing or accumulation bug in one shows up as a
// disagreement between the two.
#pragma once

#include <span>

#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer::testing {

Status hf_mirror_forward(const Layer& layer, std::span<const float> x, int64_t n, std::span<float> out);

}  // namespace moeinfer::testing
