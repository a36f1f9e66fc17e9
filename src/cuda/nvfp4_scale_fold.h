// NVFP4 block scales as the CUDA expert-major decode needs them: nonnegative, and zero only over
// zero codes. Host-only, so that it is tested without a GPU.
//
// The decode turns two E4M3 scale codes into the bf16 pair (s x 2^119, s x 2^119) by moving bits
// (expert_major.cu, scale_pair): that holds for nonnegative scales, and makes a zero scale 2^104,
// which must then multiply zero codes only. E4M3 and E2M1 are sign-magnitude, so a block's sign can
// move from its scale to its 16 codes, and a block of scale zero dequantizes to zero whatever its
// codes: both rewrites leave every dequantized value as it was (up to the sign of a zero).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "moeinfer/format.h"

namespace moeinfer::cuda {

// Whether block scale code `s` needs the fold: negative, or zero of either sign.
constexpr bool nvfp4_scale_needs_fold(uint8_t s) { return (s & 0x80u) != 0 || (s & 0x7Fu) == 0; }

// For a matrix's NVFP4 codes in checkpoint order (two per byte, row-major, rows a multiple of
// kNvfp4Group codes long) and its row-major block scales, one per kNvfp4Group codes: where some
// block needs the fold, fills `codes` and `scales` with folded copies (negative blocks: the codes'
// sign bits flipped and the scale's cleared; zero blocks: zero codes and scale) and returns true;
// else leaves them empty and returns false, so that a checkpoint of positive scales costs one pass
// over its scales.
inline bool fold_nvfp4_scale_signs(const std::vector<uint8_t>& in_codes, const std::vector<uint8_t>& in_scales,
                                   std::vector<uint8_t>* codes, std::vector<uint8_t>* scales) {
  codes->clear();
  scales->clear();
  bool any = false;
  for (const uint8_t s : in_scales) any = any || nvfp4_scale_needs_fold(s);
  if (!any) return false;
  *codes = in_codes;
  *scales = in_scales;
  constexpr size_t kBytes = kNvfp4Group / 2;  // a block's codes, two per byte
  for (size_t b = 0; b < scales->size(); ++b) {
    uint8_t& s = (*scales)[b];
    if (!nvfp4_scale_needs_fold(s)) continue;
    uint8_t* block = codes->data() + b * kBytes;
    const bool zero = (s & 0x7Fu) == 0;
    for (size_t i = 0; i < kBytes; ++i) block[i] = zero ? 0 : static_cast<uint8_t>(block[i] ^ 0x88u);
    s = static_cast<uint8_t>(s & 0x7Fu);
  }
  return true;
}

}  // namespace moeinfer::cuda
