// The selection of DESIGN.md section 2 for one token by one warp, and the work items of its
// routes: shared by the route kernels (moe_kernels.cu) and the gate_up kernel of one-token calls
// that selects for itself (expert_major.cu).
#pragma once

#ifdef __CUDACC__
#include <climits>
#include <cstdint>

#include "cuda/moe_kernels.cuh"
#include "moeinfer/layer.h"

namespace moeinfer::cuda {

inline constexpr int kWarp = 32;

// Programmatic dependent launch (expert_major_early_gate_up, expert_major_early_down). A kernel
// lets the one after it launch (once every block of its grid has, or has exited): the route
// kernels and the routers as they start, a gate_up block once it has waited (where the down
// starts per item, expert_major_item_release: once it has read what a block that stores nothing
// reads, so that nothing of gate_up reads the call's scratch after the down, which does not wait
// for gate_up's grid then, has ended). A block waits until the kernel before it has finished and
// its writes are visible: a gate_up as it starts, a down after its first weights (the split-K
// loop of mma_rows, or the staged kernels' copy of the activations, item_sums). Both do nothing
// in a kernel launched the ordinary way, or followed by one.
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_for_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Per-item release (expert_major_item_release). A gate_up warp, after its stores of `tiles` 16-row
// tiles of activations for work item `item`: each lane's fence orders its stores before the warp's
// count, which lane 0 adds. Called by whole warps.
__device__ __forceinline__ void publish_item_tiles(const DevWorkspace& ws, int item, int tiles) {
  __threadfence();
  __syncwarp();
  if (threadIdx.x % kWarp == 0 && tiles > 0) atomicAdd(ws.item_tiles_done + item, tiles);
}
// Acquires *counter until it reaches `target`. A value that never arrives (a bug, never a valid
// call) stops the kernel with a trap after 2 s rather than hanging the stream.
__device__ __forceinline__ void acquire_at_least(const int32_t* counter, int target) {
  const auto seen = [&] {
    int32_t v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    return v;
  };
  if (seen() >= target) return;
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (seen() < target) {
    __nanosleep(128);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > 2000000000ull) __trap();
  }
}

// A down thread, before it reads work item `item`'s activations: acquires the item's count until
// it reaches `tiles`.
__device__ __forceinline__ void wait_item_tiles(const DevWorkspace& ws, int item, int tiles) {
  acquire_at_least(ws.item_tiles_done + item, tiles);
}

// The items of a one-token call published early (DevWorkspace::items_published, where the fused down
// is launched during a gate_up that selects). The selecting warp of gate_up's block (0, 0), once it
// has written the choices, weights, items and route list: each lane's fence orders its stores before
// the flag, which lane 0 raises. Called by the whole warp.
__device__ __forceinline__ void flag_items_published(const DevWorkspace& ws) {
  __threadfence();
  __syncwarp();
  if (threadIdx.x % kWarp == 0) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ws.items_published), "r"(1) : "memory");
  }
}
// A down block, before it reads the items: thread 0 acquires the flag, then the block meets.
__device__ __forceinline__ void wait_items_published(const DevWorkspace& ws) {
  if (threadIdx.x == 0) acquire_at_least(ws.items_published, 1);
  __syncthreads();
}
// A down block at its end, all its threads past their reads of the items: the last block of the
// grid to get here lowers the flag and zeroes the count, so that both are zero between calls.
__device__ __forceinline__ void done_with_published_items(const DevWorkspace& ws) {
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(ws.items_published + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    ws.items_published[0] = 0;
    ws.items_published[1] = 0;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// ---- the selection ------------------------------------------------------------------------

struct ArgMax {
  float value;
  int index;
};

// Larger value wins; equal values go to the lower index (the tie rule of every backend).
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    ArgMax other{__shfl_xor_sync(0xFFFFFFFFu, a.value, o), __shfl_xor_sync(0xFFFFFFFFu, a.index, o)};
    a = better(a, other);
  }
  return a;
}

// Order bits of a float: for non-NaN a > b exactly when order_bits(a) > order_bits(b) as
// unsigned integers. kTakenBits lies below every float's (-inf is 0x007FFFFF).
__device__ __forceinline__ uint32_t order_bits(float f) {
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);  // -0 ties with +0, as floats do
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
constexpr uint32_t kTakenBits = 0;

// The chosen experts' weights from their scores, by the layer's weight function, then
// renormalised and scaled: lanes j < k of a warp hold choice j.
__device__ __forceinline__ float chosen_weight(const DevLayer& L, float w, bool mine) {
  if (L.weight == static_cast<uint8_t>(WeightFunc::kSoftmaxOfSelected)) {
    float m = mine ? w : -INFINITY;
    for (int o = kWarp / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    w = mine ? expf(w - m) : 0.0f;
    w /= warp_sum(w);
  } else if (L.weight == static_cast<uint8_t>(WeightFunc::kSigmoidOfSelected)) {
    w = 1.0f / (1.0f + expf(-w));
  }
  if (L.renormalize) w /= warp_sum(mine ? w : 0.0f) + L.renorm_epsilon;
  return w * L.scaling;
}

// x / d for a softmax's score, the same float as IEEE division's `x / d` in three dependent
// instructions instead of a reciprocal, its refinement and a branch to the slow path per call:
// r = RN(1 / d) (__frcp_rn) is computed once per token. Markstein's theorem: where r is 1 / d
// correctly rounded and q = RN(x r) lies within an ulp of x / d, the residual x - q d is exact
// and RN(q + (x - q d) r) = RN(x / d), as long as no step leaves the normal range. Here x is an
// exponential of a logit less the maximum (0 to 1, or NaN) and d the sum that includes that
// maximum's 1, so that only a tiny x could: there (needs_plain_division) the caller divides.
// 0 and NaN come out as the division's.
__device__ __forceinline__ bool needs_plain_division(float x) { return x > 0.0f && x < 0x1p-64f; }
__device__ __forceinline__ float quotient_from_reciprocal(float x, float d, float r) {
  const float q = __fmul_rn(x, r);
  return __fmaf_rn(__fmaf_rn(-q, d, x), r, q);
}
__device__ __forceinline__ float softmax_quotient(float x, float d, float r) {
  return needs_plain_division(x) ? x / d : quotient_from_reciprocal(x, d, r);
}
// The same over a thread's scores, x[i] / d for each: one branch per thread rather than one per
// score, so that the unrolled quotients are one block of straight-line code.
template <int kCount>
__device__ __forceinline__ void divide_scores(float (&x)[kCount], float d) {
  bool plain = false;
#pragma unroll
  for (int i = 0; i < kCount; ++i) plain |= needs_plain_division(x[i]);
  if (plain) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) x[i] /= d;
  } else {
    const float r = __frcp_rn(d);
#pragma unroll
    for (int i = 0; i < kCount; ++i) x[i] = quotient_from_reciprocal(x[i], d, r);
  }
}

// The score functions' formulas (DESIGN.md section 2), in fp32 as the reference blocks compute
// them; softmax's exponential only (the caller divides by the sum: softmax_quotient).
__device__ __forceinline__ float softmax_exponential(float logit, float max_logit) { return expf(logit - max_logit); }
__device__ __forceinline__ float sigmoid_score(float logit) { return 1.0f / (1.0f + expf(-logit)); }
// An expert's score from its logit by the layer's score function.
__device__ __forceinline__ float expert_score(const DevLayer& L, float logit, float max_logit) {
  if (L.score == static_cast<uint8_t>(ScoreFunc::kSoftmax)) return softmax_exponential(logit, max_logit);
  if (L.score == static_cast<uint8_t>(ScoreFunc::kSigmoid)) return sigmoid_score(logit);
  return logit;
}
// The same over a thread's logits in place, the function tested once for all of them, so that
// each function's scores are straight-line code. A slot past the router's outputs holds -inf and
// comes out 0 or -inf, which no choice reads (its key is -inf); its 0 adds nothing to the sum.
// Returns this thread's part of the softmax's sum, its exponentials added in slot order (0 for
// the other functions).
template <int kCount>
__device__ __forceinline__ float thread_scores(const DevLayer& L, float (&x)[kCount], float max_logit) {
  float sum = 0.0f;
  if (L.score == static_cast<uint8_t>(ScoreFunc::kSoftmax)) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      x[i] = softmax_exponential(x[i], max_logit);
      sum += x[i];
    }
  } else if (L.score == static_cast<uint8_t>(ScoreFunc::kSigmoid)) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) x[i] = sigmoid_score(x[i]);
  }
  return sum;
}

// Group-limited routing, by one warp over one token's keys in shared memory: a group scores the
// sum of its two best keys, and bit g of the result is set for the topk_group best groups. Lane g
// scores group g (n_group <= 32). Every lane returns the mask.
__device__ __forceinline__ uint32_t kept_groups(const DevLayer& L, const float* keys) {
  const int lane = threadIdx.x % kWarp, group_size = L.num_experts / L.n_group;
  ArgMax group{-INFINITY, INT_MAX};
  if (lane < L.n_group) {
    float first = -INFINITY, second = -INFINITY;
    for (int i = 0; i < group_size; ++i) {
      const float v = keys[lane * group_size + i];
      if (v > first) {
        second = first;
        first = v;
      } else if (v > second) {
        second = v;
      }
    }
    group = ArgMax{first + second, lane};
  }
  __syncwarp();
  uint32_t kept = 0;
  for (int j = 0; j < L.topk_group; ++j) {
    const ArgMax best = warp_argmax(group);
    if (best.index >= 0 && best.index < kWarp) kept |= 1u << best.index;
    if (lane == best.index) group.value = -INFINITY, group.index = INT_MAX;
  }
  return kept;
}

// The selection of DESIGN.md section 2 for token t by one warp, lane l holding experts
// l, l + 32, ... (kPerLane of them) in registers; `keys` is this warp's shared scratch of
// E + Z floats, used only for group-limited routing.
// `ids`, where not null, gets the token's choices too (shared memory, at (t - ids_from) * top_k);
// ws.ids and ws.weights get them where `publish`.
template <int kPerLane>
__device__ __forceinline__ void route_token_warp(const DevLayer& L, int t, const DevWorkspace& ws, float* keys,
                                                 int* ids = nullptr, bool publish = true, int ids_from = 0) {
  const int lane = threadIdx.x % kWarp, outputs = L.router_outputs;
  float score[kPerLane], key[kPerLane];
  float max_logit = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + kWarp * i;
    score[i] = e < outputs ? ws.logits[static_cast<int64_t>(t) * outputs + e] : -INFINITY;
    max_logit = fmaxf(max_logit, score[i]);
  }
  for (int o = kWarp / 2; o > 0; o /= 2) max_logit = fmaxf(max_logit, __shfl_xor_sync(0xFFFFFFFFu, max_logit, o));
  // Scores, in fp32 as the reference blocks compute them.
  const float sum = thread_scores(L, score, max_logit);
  if (L.score == static_cast<uint8_t>(ScoreFunc::kSoftmax)) divide_scores(score, warp_sum(sum));
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + kWarp * i;
    key[i] = e < outputs ? score[i] + (L.correction_bias ? L.correction_bias_values[e] : 0.0f) : -INFINITY;
  }

  // Group-limited selection: a group scores the sum of its two best keys; experts outside the
  // topk_group best groups get key -inf. Lane g scores group g (n_group <= 32 here).
  if (L.n_group > 1) {
    const int group_size = L.num_experts / L.n_group;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + kWarp * i;
      if (e < outputs) keys[e] = key[i];
    }
    __syncwarp();
    const uint32_t kept = kept_groups(L, keys);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + kWarp * i;
      if (e < L.num_experts && !((kept >> (e / group_size)) & 1u)) key[i] = -INFINITY;
    }
  }

  // Top-k: k rounds of a warp-wide maximum; lane j keeps choice j and its unbiased score. A key
  // travels as its order bits, so the maximum over the warp is one redux instruction; equal keys
  // go to the lower expert index (the tie rule of every backend): lower slot within a lane, then
  // the lowest index among the lanes holding the maximum.
  uint32_t bits[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) bits[i] = lane + kWarp * i < outputs ? order_bits(key[i]) : kTakenBits;
  int my_id = 0;
  float my_score = 0.0f;
  for (int j = 0; j < L.top_k; ++j) {
    // This lane's best: a tree whose left side always holds the lower slots, so a tie keeps
    // the lower slot.
    uint32_t best_bits[kPerLane];
    int best_slot[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) best_bits[i] = bits[i], best_slot[i] = i;
#pragma unroll
    for (int level = 1; level < kPerLane; level *= 2) {
#pragma unroll
      for (int i = 0; i + level < kPerLane; i += 2 * level) {
        const bool right = best_bits[i + level] > best_bits[i];
        best_bits[i] = right ? best_bits[i + level] : best_bits[i];
        best_slot[i] = right ? best_slot[i + level] : best_slot[i];
      }
    }
    const uint32_t top = __reduce_max_sync(0xFFFFFFFFu, best_bits[0]);
    const uint32_t lowest =
        __reduce_min_sync(0xFFFFFFFFu, best_bits[0] == top ? static_cast<uint32_t>(lane + kWarp * best_slot[0]) : ~0u);
    // Only NaN keys (from a NaN input) can leave nothing sensible; stay in range regardless.
    const int id = lowest < static_cast<uint32_t>(outputs) ? static_cast<int>(lowest) : 0;
    float score_here = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (lane + kWarp * i == id) score_here = score[i], bits[i] = kTakenBits;
    }
    const float chosen_score = __shfl_sync(0xFFFFFFFFu, score_here, id % kWarp);
    if (lane == j) my_id = id, my_score = chosen_score;
  }
  const bool mine = lane < L.top_k;
  const float w = chosen_weight(L, my_score, mine);
  if (mine) {
    if (publish) {
      ws.ids[t * L.top_k + lane] = my_id;
      ws.weights[t * L.top_k + lane] = w;
    }
    if (ids != nullptr) ids[(t - ids_from) * L.top_k + lane] = my_id;
  }
}

// route_table_index in two steps, so that a caller can issue several routes' loads before it maps
// any: the routed expert's id (routes < routed), then the table index from it.
__device__ __forceinline__ int routed_id(const DevWorkspace& ws, int route, const int* ids) {
  return ids != nullptr ? ids[route] : __ldcg(ws.ids + route);  // written by other blocks of this kernel: skip L1
}
__device__ __forceinline__ int table_index_of(const DevLayer& L, int routed, int route, int id) {
  if (route >= routed) return L.num_experts;  // the shared expert
  return owns_expert(L, id) ? id : -1;
}
// The expert (table index) a route runs on here, or -1 for a zero-computation expert and for an
// expert another rank owns. The routed experts' ids come from `ids` where the caller has them in
// shared memory, else from ws.ids.
__device__ __forceinline__ int route_table_index(const DevLayer& L, const DevWorkspace& ws, int n, int route,
                                                 const int* ids) {
  const int routed = n * L.top_k;
  return table_index_of(L, routed, route, route < routed ? routed_id(ws, route, ids) : 0);
}

// The grouping of one token's routes by the warp that selected them (its choices in `ids`,
// written by that warp): a token chooses an expert at most once, so each route on an expert run
// here is a work item of its own, in route order. No counting, scans or block barriers, which
// group_routes spends on any n. Written to ws.items, ws.route_list and ws.num_items where
// `publish`; either way lane r (route r) gets its item, {-1, ...} where the route has none.
__device__ __forceinline__ int4 group_one_token(const DevLayer& L, const DevWorkspace& ws, const int* ids,
                                                bool publish = true) {
  __syncwarp();  // the choices in `ids` were written by other lanes of this warp
  const int lane = threadIdx.x % kWarp;
  const int routes = L.top_k + (L.has_shared && !ws.shared_apart ? 1 : 0);  // <= 32 (moe_route_warps)
  const int e = lane < routes ? route_table_index(L, ws, 1, lane, ids) : -1;
  const uint32_t kept = __ballot_sync(0xFFFFFFFFu, e >= 0);
  const int slot = __popc(kept & ((1u << lane) - 1u));
  if (publish) {
    if (e >= 0) {
      ws.items[slot] = make_int4(e, slot, 1, 0);
      ws.route_list[slot] = lane;
      if (ws.item_tiles_done != nullptr) ws.item_tiles_done[slot] = 0;
    }
    if (lane == 0) *ws.num_items = __popc(kept);
  }
  return e >= 0 ? make_int4(e, slot, 1, 0) : make_int4(-1, 0, 0, 0);
}

}  // namespace moeinfer::cuda
#endif
