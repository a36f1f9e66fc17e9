// How NVFP4 codes are laid out on the device ("pair order"), and the bit operations that read
// them. Internal; plain C++ (host and device), so the host tests check it without a GPU.
//
// Each 32-bit word of codes holds 8 values; in the checkpoint layout value v is nibble v (bits
// 4v..4v+3: mantissa m, exponent e0 and e1, sign). The upload moves every word's bits so that
// pair p (values 2p and 2p + 1) becomes a bf16 pair in few operations: a pair's magnitude bits
// (m, e0, e1) must land at bits 6-8 (value 2p) and 22-24 (value 2p + 1), the boundary of bf16's
// exponent and mantissa, its signs at bits 15 and 31 (the pattern P). The bf16 then equals the
// E2M1 value x 2^-126 (E2M1's subnormal 0.5 lands on bf16's subnormal). Pair 0 is stored at P
// (one mask), pairs 1 and 2 at P rotated by 10 and 13 bits (a rotate and a mask), and pair 3 in
// the 8 bits left over, {0, 1, 3, 4} + 16h, which a mask, a multiply by 2^2 + 2^7 + 2^12 and a
// mask carry onto P (the three moved copies never overlap, so no carry). 8 operations per word.
// No layout does better with these operations: no four rotations of P tile a word (nor any
// number of words through funnel shifts), so one pair at least needs more than a move and a mask.
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
  if (pair == 3) return (b == 0 ? 4 : (b == 1 ? 0 : (b == 2 ? 1 : 3))) + 16 * high;
  const int target = (b == 3 ? 15 : 6 + b) + 16 * high;  // its place in the decoded bf16 pair
  const int rotation = pair == 0 ? 0 : (pair == 1 ? 10 : 13);
  return (target - rotation + 32) % 32;
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
  constexpr uint32_t kBf16Bits = 0x81C081C0u;  // P: signs, lowest exponent bits, top mantissa bit
  if constexpr (kPair == 0) {
    return stored & kBf16Bits;
  } else if constexpr (kPair == 1 || kPair == 2) {
    constexpr int kRotation = kPair == 1 ? 10 : 13;  // one funnel shift on the GPU
    return ((stored << kRotation) | (stored >> (32 - kRotation))) & kBf16Bits;
  } else {
    static_assert(kPair == 3);
    return ((stored & 0x001B001Bu) * 0x1084u) & kBf16Bits;  // 0x1084 = 2^2 + 2^7 + 2^12
  }
}

// The same for pair p (0..3, any value) known only at run time; the switch folds away where p
// is a constant.
MOEINFER_HOST_DEVICE constexpr uint32_t pair_order_bf16x2(uint32_t stored, int p) {
  switch (p) {
    case 0: return pair_order_bf16x2<0>(stored);
    case 1: return pair_order_bf16x2<1>(stored);
    case 2: return pair_order_bf16x2<2>(stored);
    default: return pair_order_bf16x2<3>(stored);
  }
}

}  // namespace moeinfer::cuda
