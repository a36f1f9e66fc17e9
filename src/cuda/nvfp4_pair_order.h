// How NVFP4 codes are laid out on the device ("pair order"), and the bit operations that read
// them. Internal; plain C++ (host and device), so the host tests check it without a GPU.
//
// Each 32-bit word of codes holds 8 values; in the checkpoint layout value v is nibble v (bits
// 4v..4v+3: mantissa m, exponent e0 and e1, sign). The upload moves every word's bits so that
// pair p (values 2p and 2p + 1) becomes a bf16 pair by one mask after at most one shift or
// multiply: the magnitude bits (m, e0, e1) land at bits 6-8 (value 2p) and 22-24 (value 2p + 1),
// the boundary of bf16's exponent and mantissa, the signs at bits 15 and 31. The bf16 then equals
// the E2M1 value x 2^-126 (E2M1's subnormal 0.5 lands on bf16's subnormal). Pairs 0 to 2 are one
// pattern shifted by 0, 3 and 6 bits; the 8 bits left over hold pair 3, gathered by a shift, a
// mask and a multiply by 2^0 + 2^5 + 2^11 that moves its bits by three distances at once (the
// moved copies never overlap, so no carry).
//
// Why: on Hopper the integer-logic pipe runs at half the rate of the FMA pipe, and the natural
// layout cost 4 logic operations per pair (and 2 byte permutes per MMA for the activations).
// Pair order costs 1 to 3 (2 on average) and leaves the activations in their natural order.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MOEINFER_HOST_DEVICE __host__ __device__
#else
#define MOEINFER_HOST_DEVICE
#endif

namespace moeinfer::cuda {

// Where bit b (0 m, 1 e0, 2 e1, 3 sign) of value v (0..7) is stored within its word.
MOEINFER_HOST_DEVICE constexpr int pair_order_bit(int v, int b) {
  const int pair = v / 2, high = v % 2;
  int bit = 0;
  if (pair == 3) {
    bit = b == 0 ? 13 : (b == 1 ? 14 : (b == 2 ? 10 : 11));
  } else {
    bit = (b == 3 ? 15 : 6 + b) - 3 * pair;
  }
  return bit + 16 * high;
}

// A word of 8 codes in checkpoint order -> pair order.
MOEINFER_HOST_DEVICE constexpr uint32_t to_pair_order(uint32_t natural) {
  uint32_t out = 0;
  for (int v = 0; v < 8; ++v) {
    for (int b = 0; b < 4; ++b) out |= ((natural >> (4 * v + b)) & 1u) << pair_order_bit(v, b);
  }
  return out;
}

// The 4-bit code of value v (0..7) of a pair-order word.
MOEINFER_HOST_DEVICE constexpr uint32_t pair_order_code(uint32_t stored, int v) {
  uint32_t code = 0;
  for (int b = 0; b < 4; ++b) code |= ((stored >> pair_order_bit(v, b)) & 1u) << b;
  return code;
}

// Values 2p and 2p + 1 of a pair-order word as a bf16 pair (low half first) equal to E2M1 x 2^-126.
template <int kPair>
MOEINFER_HOST_DEVICE constexpr uint32_t pair_order_bf16x2(uint32_t stored) {
  constexpr uint32_t kBf16Bits = 0x81C081C0u;  // signs, lowest exponent bits, top mantissa bit
  if constexpr (kPair == 0) {
    return stored & kBf16Bits;
  } else if constexpr (kPair == 1) {
    return (stored << 3) & kBf16Bits;
  } else if constexpr (kPair == 2) {
    return (stored << 6) & kBf16Bits;
  } else {
    static_assert(kPair == 3);
    return (((stored >> 7) & 0x00D800D8u) * 2081u) & kBf16Bits;  // 2081 = 2^0 + 2^5 + 2^11
  }
}

}  // namespace moeinfer::cuda
