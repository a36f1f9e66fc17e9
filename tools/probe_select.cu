// Where a one-token selection by one warp spends its time: the library's own route_token_warp and
// group_one_token (src/cuda/route_select.cuh), the code the selecting gate_up runs in every block at
// qwen3-30b-a3b N = 1 and the route kernels run per token (not part of the library). PERF.md puts
// that selection at 3-4 us in whichever kernel runs it (v3.26, v3.46); this splits it.
//
// One warp per launch, in three timed steps (clock64, SM cycles; lane 0's, after each step's
// results are consumed):
//   loads   the token's logits (kPerLane per lane), written to L2 by a kernel just before, as the
//           router writes them;
//   select  route_token_warp on the same logits (so its loads hit L1: what is left is its
//           scores, group limit and top-k rounds);
//   group   group_one_token (the routes' table indices, their items).
// A fourth figure, cold, is route_token_warp alone from an L2-resident start, to check that loads
// + select adds up to it. Each figure is the median of 101 launches. Rows vary k on one router
// (the slope over k is the cost of a top-k round), the logits per lane, and the routers of the
// three presets (softmax over 128 or 512, DeepSeek-V3's sigmoid with correction bias and groups).
// Every launch's choices are checked against the reference's (moe_select_reference) on the same
// logits; the output ends with the count that differed, and the probe fails where any did.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/route_select.cuh"
#include "moeinfer/layer.h"
#include "moeinfer/reference.h"
#include "probe_common.cuh"

namespace {

using moeinfer::Family;
using moeinfer::LayerDesc;
using moeinfer::cuda::DevLayer;
using moeinfer::cuda::DevWorkspace;
using moeinfer::cuda::kWarp;

constexpr int kMaxOutputs = 512;
constexpr int kSteps = 4;  // loads, select, group, cold

// Writes the logits from their source, so that they sit in L2 and in no SM's L1, as after the
// router.
__global__ void write_logits(const float* source, float* logits, int outputs) {
  for (int i = threadIdx.x; i < outputs; i += blockDim.x) logits[i] = source[i];
}

template <int kPerLane>
__global__ void __launch_bounds__(kWarp) select_steps(DevLayer L, DevWorkspace ws, bool cold, long long* cycles,
                                                    int* chosen) {
  __shared__ float keys[kMaxOutputs];
  __shared__ int ids[kWarp];
  const int lane = threadIdx.x;
  long long t[4];
  t[0] = clock64();
  if (!cold) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + kWarp * i;
      if (e < L.router_outputs) s += ws.logits[e];
    }
    s = __shfl_xor_sync(0xFFFFFFFFu, s, 1);  // the loads' values in use before the clock
    if (s == 1.2345e30f) chosen[kWarp] = 0;  // never true; keeps the loads
  }
  t[1] = clock64();
  moeinfer::cuda::route_token_warp<kPerLane>(L, 0, ws, keys, ids, false);
  __syncwarp();
  const int first = ids[0];  // the choices in use before the clock
  t[2] = clock64();
  const int4 mine = moeinfer::cuda::group_one_token(L, ws, ids, false);
  const unsigned kept = __ballot_sync(0xFFFFFFFFu, mine.x >= 0);
  t[3] = clock64();
  if (lane < L.top_k) chosen[lane] = ids[lane];
  if (lane == 0) {
    chosen[kWarp + 1] = static_cast<int>(kept) + first;
    if (cold) {
      cycles[3] = t[2] - t[1];
    } else {
      cycles[0] = t[1] - t[0];
      cycles[1] = t[2] - t[1];
      cycles[2] = t[3] - t[2];
    }
  }
}

struct Router {
  const char* name;
  LayerDesc desc;
  int per_lane;
};

template <int kPerLane>
void launch(const DevLayer& L, const DevWorkspace& ws, bool cold, long long* cycles, int* chosen) {
  select_steps<kPerLane><<<1, kWarp>>>(L, ws, cold, cycles, chosen);
}

}  // namespace

int main() {
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, SM clock %.0f MHz (cycles -> ns at that clock)\n", prop.name, clock_khz / 1e3);

  // The presets' routers (their shapes beyond routing do not matter here), qwen3-30b-a3b's at k = 1-8.
  const auto qwen3 = [](int k) {
    return moeinfer::family_layer(Family::kQwen3Moe,
                                  {.hidden = 2048, .intermediate = 768, .num_experts = 128, .top_k = k});
  };
  const std::vector<Router> routers = {
      {"qwen3-30b-a3b k=1", qwen3(1), 4},
      {"qwen3-30b-a3b k=2", qwen3(2), 4},
      {"qwen3-30b-a3b k=4", qwen3(4), 4},
      {"qwen3-30b-a3b", qwen3(8), 4},
      {"qwen3-30b-a3b, 8 per lane", qwen3(8), 8},
      {"deepseek-v3",
       moeinfer::family_layer(Family::kDeepseekV3, {.hidden = 7168, .intermediate = 2048, .num_experts = 256, .top_k = 8,
                                                    .shared_intermediate = 2048, .routed_scaling_factor = 2.5,
                                                    .n_group = 8, .topk_group = 4}),
       8},
      {"qwen3-next-80b-a3b",
       moeinfer::family_layer(Family::kQwen3Next, {.hidden = 2048, .intermediate = 512, .num_experts = 512, .top_k = 10,
                                                   .shared_intermediate = 512}),
       16},
  };
  float* source = nullptr;
  float* logits = nullptr;
  float* bias = nullptr;
  long long* cycles = nullptr;
  int* chosen = nullptr;
  CHECK(cudaMalloc(&source, kMaxOutputs * sizeof(float)));
  CHECK(cudaMalloc(&logits, kMaxOutputs * sizeof(float)));
  CHECK(cudaMalloc(&bias, kMaxOutputs * sizeof(float)));
  CHECK(cudaMalloc(&cycles, kSteps * sizeof(long long)));
  CHECK(cudaMalloc(&chosen, (kWarp + 2) * sizeof(int)));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<float> small(-0.05f, 0.05f);
  std::printf("%-28s %8s %8s %8s %8s   %s\n", "router", "loads", "select", "group", "cold", "(cycles; ns)");
  int mismatches = 0;
  for (const Router& r : routers) {
    const LayerDesc& d = r.desc;
    const int outputs = static_cast<int>(d.router_outputs());
    std::vector<float> host_logits(outputs), host_bias(d.routing.correction_bias ? outputs : 0);
    for (float& v : host_logits) v = normal(rng);
    for (float& v : host_bias) v = small(rng);
    // The reference's choice (moe_select_reference), which every launch must match.
    std::vector<int> want(d.top_k);
    std::vector<double> weights(d.top_k);
    const std::vector<double> logits_d(host_logits.begin(), host_logits.end());
    if (!moeinfer::moe_select_reference(d, logits_d, host_bias, want, weights).ok()) {
      std::fprintf(stderr, "%s: the reference refused the selection\n", r.name);
      return 1;
    }
    std::sort(want.begin(), want.end());
    CHECK(cudaMemcpy(source, host_logits.data(), outputs * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(bias, host_bias.data(), host_bias.size() * sizeof(float), cudaMemcpyHostToDevice));
    DevLayer L;
    moeinfer::cuda::set_routing(d, L);
    L.correction_bias_values = d.routing.correction_bias ? bias : nullptr;
    L.owned_begin = 0;
    L.owned_end = d.num_experts;
    DevWorkspace ws;
    ws.logits = logits;
    std::vector<std::vector<long long>> samples(kSteps);
    for (int rep = 0; rep < 102; ++rep) {
      for (const bool cold : {false, true}) {
        write_logits<<<1, 256>>>(source, logits, outputs);
        switch (r.per_lane) {
          case 4: launch<4>(L, ws, cold, cycles, chosen); break;
          case 8: launch<8>(L, ws, cold, cycles, chosen); break;
          default: launch<16>(L, ws, cold, cycles, chosen); break;
        }
        CHECK(cudaGetLastError());
        long long c[kSteps];
        CHECK(cudaMemcpy(c, cycles, sizeof(c), cudaMemcpyDeviceToHost));
        if (rep == 0) continue;  // warm-up
        if (cold) {
          samples[3].push_back(c[3]);
        } else {
          for (int s = 0; s < 3; ++s) samples[s].push_back(c[s]);
        }
        std::vector<int> ids(d.top_k);
        CHECK(cudaMemcpy(ids.data(), chosen, d.top_k * sizeof(int), cudaMemcpyDeviceToHost));
        std::sort(ids.begin(), ids.end());
        mismatches += ids != want ? 1 : 0;
      }
    }
    std::printf("%-28s", r.name);
    double ns[kSteps];
    for (int s = 0; s < kSteps; ++s) {
      std::sort(samples[s].begin(), samples[s].end());
      const long long median = samples[s][samples[s].size() / 2];
      ns[s] = median * 1e6 / clock_khz;
      std::printf(" %8lld", median);
    }
    std::printf("   %.0f / %.0f / %.0f / %.0f ns\n", ns[0], ns[1], ns[2], ns[3]);
  }
  CHECK(cudaFree(source));
  CHECK(cudaFree(logits));
  CHECK(cudaFree(bias));
  CHECK(cudaFree(cycles));
  CHECK(cudaFree(chosen));
  std::printf("choices checked against moe_select_reference: %d mismatches\n", mismatches);
  return mismatches == 0 ? 0 : 1;
}
