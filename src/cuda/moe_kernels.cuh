// Device-side view of a layer and the launchers of the CUDA paths' kernels. Internal. Plain
// C++ apart from cudaStream_t/cudaError_t, so host code compiled by g++ includes it too.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/weight_tiles.h"
#include "moeinfer/layer.h"

namespace moeinfer::cuda {

// One quantized matrix [rows, cols], K-major, as uploaded: QuantMatrix's byte layout, except that
// NVFP4 codes are rewritten into pair order after the upload, and expert matrices may be stored
// in tiles of 16 rows x 64 bytes (weight_tiles.h; `tiled`).
struct DevMatrix {
  const uint8_t* data = nullptr;          // NVFP4: words of 8 codes in pair order (nvfp4_pair_order.h)
  const float* scales = nullptr;          // FP8 dequant scales
  const uint8_t* block_scales = nullptr;  // NVFP4 E4M3 scales, one per 16 inputs
  const float* bias = nullptr;            // [rows] or null
  float global_scale = 1.0f;              // NVFP4
  int32_t rows = 0;
  int32_t cols = 0;
  int32_t scale_cols = 0;                 // FP8 block-128: columns of the scale grid
  uint8_t format = 0;                     // WeightFormat
  uint8_t fp8_scaling = 0;                // Fp8Scaling
  bool tiled = false;                     // `data` in tiles, NVFP4 block scales in scale tiles (weight_tiles.h)
};

struct DevExpert {
  DevMatrix gate;  // [I, H]
  DevMatrix up;    // [I, H]
  DevMatrix down;  // [H, I]
};

// Everything a kernel needs to know about the layer, passed by value (kernel parameter space).
struct DevLayer {
  int32_t hidden = 0;
  int32_t num_experts = 0;     // E; experts[E] is the shared expert when has_shared
  int32_t router_outputs = 0;  // E + Z
  int32_t top_k = 0;
  int32_t act_stride = 0;      // max(I, shared I): row stride of the activation scratch
  uint8_t score = 0;           // ScoreFunc
  uint8_t weight = 0;          // WeightFunc
  uint8_t activation = 0;      // Activation
  bool correction_bias = false;
  bool renormalize = false;
  bool weight_on_input = false;
  bool has_shared = false;
  bool shared_gate = false;
  int32_t n_group = 1;
  int32_t topk_group = 1;
  // Expert parallelism: this rank runs the routed experts [owned_begin, owned_end) only, and
  // adds the zero experts (and, through has_shared, the shared expert) where adds_once.
  int32_t owned_begin = 0;
  int32_t owned_end = 0;
  bool adds_once = true;
  float renorm_epsilon = 0.0f;
  float scaling = 1.0f;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  int32_t sm_count = 0;  // of the device: sizes the choice of expert-major kernels
  int32_t blend_resident = 0;  // blocks of the loads-first blend an SM holds (blend_loads_first)
  int32_t route_token_blocks = 8;  // calls of up to this many tokens may select on a block each (route_token_blocks_max)
  int8_t staged = -1;    // staged expert-major kernels: 1 forced, 0 forbidden, -1 chosen per call
  int8_t staged_passes = 0;  // 64-row passes per staged down block: 1, 2 or 4 forced, 0 chosen per call
  int8_t staged_ahead = 0;   // chunks ahead of their MMAs that staged NVFP4 loops load: 1 or 2 forced, 0 chosen
  int8_t mixed_tiles = -1;   // hot experts' items at two token tiles (expert_major_mixed): 1 forced, 0 forbidden, -1 chosen
  int8_t shared_apart = -1;  // the shared expert beside the router (expert_major_shared_apart): 1 forced, 0 forbidden, -1 chosen
  int8_t early_gate_up = -1;  // gate_up launched during routing (expert_major_early_gate_up): 1 forced, 0 forbidden, -1 chosen
  int8_t early_down = -1;    // the down launched during gate_up (expert_major_early_down): 1 forced, 0 forbidden, -1 chosen
  int8_t item_release = -1;  // the staged down started per item (expert_major_item_release): 0 forbidden, else where it can run
  // Bytes of one routed expert's weights and of the shared expert's (0 without one), for the rules
  // that weigh a second stream's fixed cost against the bytes it moves sooner or reads fewer times.
  int64_t routed_expert_bytes = 0;
  int64_t shared_expert_bytes = 0;
  bool nvfp4 = false;    // some expert (routed or shared) is NVFP4: staged blocks make room for its scales
  bool weight_tiles = false;  // some expert matrix is stored in tiles (weight_tiles.h)
  int8_t down_path = -1;      // weight_path of every expert's down where all agree, else -1 (kPathAny)
  int8_t gate_up_path = -1;   // weight_path of every expert's gate and up where all agree, else -1 (kPathAny)
  int8_t router_mma = -1;  // router logits on the tensor cores (moe_router_mma): 1 forced, 0 forbidden, -1 chosen
  int32_t router_mma_tokens = 0;  // calls of up to this many tokens may run moe_router_mma (0: none may)
  DevMatrix router;                          // [E + Z, H], bias = router bias
  const float* correction_bias_values = nullptr;  // [E + Z]
  const float* shared_gate_values = nullptr;      // [H]
  // The shared gate vector as three bf16 rows (hi, mid, lo: g = hi + mid + lo to fp32's
  // precision), the rows moe_router_mma computes its logit from; null without a shared gate.
  const uint16_t* shared_gate_bf16x3 = nullptr;   // [3, H]
  const DevExpert* experts = nullptr;             // [E + has_shared], device memory
};

// The selection's fields of L from the layer's description: outputs, top-k, the score and weight
// functions and the routing rules' knobs (CudaMoe::create, and the selection kernels' tests).
inline void set_routing(const LayerDesc& d, DevLayer& L) {
  L.num_experts = d.num_experts;
  L.router_outputs = d.router_outputs();
  L.top_k = d.top_k;
  L.score = static_cast<uint8_t>(d.routing.score);
  L.weight = static_cast<uint8_t>(d.routing.weight);
  L.correction_bias = d.routing.correction_bias;
  L.renormalize = d.routing.renormalize;
  L.weight_on_input = d.routing.weight_on_input;
  L.n_group = d.routing.n_group;
  L.topk_group = d.routing.topk_group;
  L.renorm_epsilon = static_cast<float>(d.routing.renorm_epsilon);
  L.scaling = static_cast<float>(d.routing.scaling);
}

#ifdef __CUDACC__
// Bytes per row of a matrix's codes.
__device__ __forceinline__ int64_t weight_row_bytes(const DevMatrix& m) {
  const int64_t cols = m.cols;
  if (m.format == static_cast<uint8_t>(WeightFormat::kNVFP4)) return cols / 2;
  return m.format == static_cast<uint8_t>(WeightFormat::kFP8) ? cols : 2 * cols;
}

// Where byte b of row r of a matrix's codes lies, in either layout. Loads of up to 16 bytes from
// a 16-byte aligned b stay within one tile's row.
__device__ __forceinline__ int64_t weight_offset(const DevMatrix& m, int64_t r, int64_t b) {
  const int64_t row_bytes = weight_row_bytes(m);
  return m.tiled ? tiled_offset(r, b, row_bytes) : r * row_bytes + b;
}

// Where NVFP4 block scale j (columns 16j .. 16j + 15) of row r lies, in either layout. Scales
// j and j + 1 of an even j are adjacent in both.
__device__ __forceinline__ int64_t block_scale_offset(const DevMatrix& m, int64_t r, int64_t j) {
  const int64_t per_row = m.cols / 16;
  return m.tiled ? tiled_scale_offset(r, j, per_row) : r * per_row + j;
}

__device__ __forceinline__ bool owns_expert(const DevLayer& L, int e) { return e >= L.owned_begin && e < L.owned_end; }

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + __expf(-v)); }

// The gated activation of DESIGN.md section 1 on one (gate, up) pair.
__device__ __forceinline__ float activate(const DevLayer& L, float g, float u) {
  if (L.activation == static_cast<uint8_t>(Activation::kGptOssClamped)) {
    g = fminf(g, L.swiglu_limit);
    u = fminf(fmaxf(u, -L.swiglu_limit), L.swiglu_limit);
    return (u + 1.0f) * g * sigmoidf(L.swiglu_alpha * g);
  }
  return g * sigmoidf(g) * u;
}
#endif

// Whether every weight run of the main loop over an NVFP4 matrix starts 16-byte aligned (and its
// scale codes 2-byte aligned): the expert-major K loop's aligned16.
__host__ __device__ __forceinline__ bool nvfp4_aligned16(const DevMatrix& m) {
  return (m.cols / 2) % 16 == 0 && reinterpret_cast<uintptr_t>(m.data) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(m.block_scales) % 2 == 0;
}

// Whether an NVFP4 matrix runs the kTiled loop: in tiles (whole chunks, no tail), its runs 16-byte
// and its scale tiles 4-byte aligned.
__host__ __device__ __forceinline__ bool nvfp4_tiled(const DevMatrix& m) {
  return m.tiled && nvfp4_aligned16(m) && reinterpret_cast<uintptr_t>(m.block_scales) % 4 == 0;
}

// The expert-major K loop a matrix takes (run_item's kPath in expert_major.cu): chosen per item
// by default (kPathAny), or fixed by a caller that runs several items (the four-pass staged down,
// the fused down of many items: DevLayer::down_path), so that its loop holds one format's code.
enum : int { kPathAny = -1, kPathNvfp4Tiled, kPathNvfp4Aligned, kPathNvfp4, kPathFp8Block, kPathFp8, kPathBf16 };

__host__ __device__ __forceinline__ int weight_path(const DevMatrix& m) {
  const WeightFormat format = static_cast<WeightFormat>(m.format);
  if (format == WeightFormat::kNVFP4) {
    return nvfp4_tiled(m) ? kPathNvfp4Tiled : (nvfp4_aligned16(m) ? kPathNvfp4Aligned : kPathNvfp4);
  }
  if (format == WeightFormat::kFP8) {
    return m.fp8_scaling == static_cast<uint8_t>(Fp8Scaling::kBlock128) ? kPathFp8Block : kPathFp8;
  }
  return kPathBf16;
}

// The K loop that every owned expert takes for the matrices path_of(expert) stands for
// (weight_path of its down, say, or kPathAny where the expert's own matrices differ), or kPathAny
// where the experts differ or none is owned. Another rank's experts (no rows) are skipped. The
// upload's DevLayer::down_path and gate_up_path.
template <typename PathOf>
int common_path(const DevExpert* experts, size_t count, PathOf path_of) {
  int path = kPathAny;
  bool seen = false;
  for (size_t i = 0; i < count; ++i) {
    if (experts[i].gate.rows == 0) continue;
    const int p = path_of(experts[i]);
    if (seen && p != path) return kPathAny;
    path = p, seen = true;
  }
  return path;
}

// Scratch for one call of up to max_tokens tokens. Routes are numbered token-major:
// route t * k + j is slot j of token t; route n * k + t is token t's shared expert.
struct DevWorkspace {
  float* logits = nullptr;       // [max_tokens, E + Z] router logits (router bias included)
  int32_t* ids = nullptr;        // [max_tokens * k]
  float* weights = nullptr;      // [max_tokens * k]
  float* shared_gate = nullptr;  // [max_tokens]
  float* act = nullptr;          // [routes, act_stride]
  float* expert_out = nullptr;   // [routes, H]
  // Expert-major only: the tensor cores' bf16 operands (bf16 keeps fp32's range, so nothing
  // needs scaling), and the routes grouped by expert.
  uint16_t* x_bf16 = nullptr;    // [max_tokens, H], written by the route kernel
  uint16_t* act_bf16 = nullptr;  // [routes, act_stride]
  int32_t* route_list = nullptr; // [routes] route indices grouped by expert
  int4* items = nullptr;         // [max_items] {expert, first index in route_list, routes, 0}
  int32_t* num_items = nullptr;  // [1]
  // Set per call where the call mixes token tiles (ExpertMajorLaunch::mixed), else null: the hot
  // experts' items of up to 16 routes, in ws.items past the one-tile items, and their count.
  int4* hot_items = nullptr;
  int32_t* hot_num_items = nullptr;
  // Set per call where the shared expert runs apart (ExpertMajorLaunch::shared_apart): the route
  // kernel groups the routed experts' routes only, and a fused down and blend adds the shared
  // expert's outputs from expert_out, where its own chain wrote them.
  bool shared_apart = false;
  int32_t* route_blocks_done = nullptr;  // [1] zero between calls: the route kernel's finish line
  // moe_router_mma: each block's fp32 sums over its slice of K, [slices, n, padded rows], and per
  // (row group, token group) the count of slices done, zero between calls.
  float* router_partials = nullptr;
  int32_t* router_slices_done = nullptr;
  // [item capacity] per one-tile work item, the 16-row x 8-route tiles of activations its gate_up
  // warps have stored; zeroed where the route kernel writes the items. Counted, and waited on by
  // the staged down, only where item_release is set (per launch: ExpertMajorLaunch::item_release).
  int32_t* item_tiles_done = nullptr;
  bool item_release = false;
  // [2] a flag and a count of its readers, both zero between calls. Set per call only where the
  // fused down is launched during a gate_up that selects (ExpertMajorLaunch::early_down where
  // expert_major_published_down), else null: gate_up's block (0, 0) raises the flag once it has
  // written the call's items, the down's blocks wait for it before they read them, and the last of
  // them lowers it (flag_items_published, wait_items_published, done_with_published_items).
  int32_t* items_published = nullptr;
};

// Routes per expert-major work item, at most: 4 token tiles of 8 MMA columns.
inline constexpr int kExpertMajorGroup = 32;

// Work items the expert-major grid is sized for when items hold up to `group` routes of one
// expert: at most one per `group` routes plus one per expert, and at most one per route.
inline int expert_major_max_items(int routes, int experts, int group = 8) {
  const int bound = routes / group + 1 + (experts < routes ? experts : routes);
  return bound < routes ? bound : routes;
}

// A call that mixes token tiles (ExpertMajorLaunch::mixed) keeps an expert of up to 8 routes in
// one one-tile item, at most one per expert, and splits a hot expert (9 routes or more) into items
// of up to 16 routes, ceil(c / 16) <= c / 8 of them: the hot items lie in ws.items from
// expert_major_hot_offset, at most expert_major_hot_max_items of them.
inline int expert_major_hot_offset(int routes, int experts) { return experts < routes ? experts : routes; }
inline int expert_major_hot_max_items(int routes) { return routes / 8; }
// The workspace's items for calls of up to `routes` routes: every group's, and a mixed call's.
inline int expert_major_item_capacity(int routes, int experts) {
  return expert_major_max_items(routes, experts) + expert_major_hot_max_items(routes) + 1;
}

// The staged expert-major kernels (one or two token tiles per item): 64 output rows per block, 4
// warps of 16 each over the whole K, the item's 8 or 16 token columns copied once into shared
// memory: the whole K where it fits kExpertMajorStagedMaxBytes (per 8 columns), else in slices of
// kExpertMajorSliceCols / tiles columns through two buffers (the next slice copied while the warps
// run this one). The two-tile gate_up always runs in slices of 512 columns: its 2 x 16.6 KB let 4
// blocks share an SM where the whole K = 2048 (66 KB) let 3, and 4 at its 125 registers measured
// 1.05x per call at qwen3-30b N = 256 (docs/PERF.md v3.27).
inline constexpr int kExpertMajorStagedRows = 64;
inline constexpr int kExpertMajorStagedMaxBytes = 48 * 1024;  // shared memory without opting in
inline constexpr int kExpertMajorSliceCols = 1024;            // a multiple of every format's chunk (128, 64, 32)

// Bytes between two token rows of the staged activations: K bf16 rounded up to 128 bytes, plus
// 16, so that rows t and t + 1 start in different shared-memory bank groups.
__host__ __device__ constexpr int expert_major_staged_row_bytes(int K) { return (K * 2 + 127) / 128 * 128 + 16; }

// Whether a staged block's 8 token columns of K bf16 activations fit kExpertMajorStagedMaxBytes
// whole; past that the staged kernels copy them a slice at a time.
__host__ __device__ constexpr bool expert_major_staged_fits(int K) {
  return 8 * expert_major_staged_row_bytes(K) <= kExpertMajorStagedMaxBytes;
}
// The columns of one slice at `tiles` token tiles: kExpertMajorSliceCols / tiles, so that a buffer
// of 8 x tiles token rows holds about the same bytes.
__host__ __device__ constexpr int expert_major_slice_cols(int tiles) { return kExpertMajorSliceCols / tiles; }
// One buffer of a sliced staged block of `tiles` token tiles.
__host__ __device__ constexpr int expert_major_slice_bytes(int tiles) {
  return 8 * tiles * expert_major_staged_row_bytes(expert_major_slice_cols(tiles));
}
inline constexpr int kExpertMajorSliceBytes = expert_major_slice_bytes(1);

// Whether a staged GEMM of `mats` matrices (2: gate_up, 1: down) over K inputs copies its NVFP4
// scale codes into shared memory with the activations, once per block, instead of loading 8 bytes
// per row every chunk: for down at K >= 2048 (whole 8-byte copies need K % 128 == 0) where the
// activations are staged whole. Measured on the H200: DeepSeek-V3's down (K = 2048) gained, calls
// 1.07-1.13x at N = 4-256; staging them for every GEMM (qwen3's gate_ups too, 51 KB blocks) lost
// 8-15% there (docs/PERF.md, v3.9).
__host__ __device__ constexpr bool expert_major_stages_scales(int K, int mats) {
  return mats == 1 && K >= 2048 && K % 128 == 0 && expert_major_staged_fits(K);
}
// Bytes between two rows of staged scale codes: K / 16, padded to an odd number of 8-byte units
// so that the 8 rows one load reads start in 8 different bank pairs.
__host__ __device__ constexpr int expert_major_staged_scale_stride(int K) { return K / 16 + (K / 128 % 2 == 0 ? 8 : 0); }

// Dynamic shared memory of a staged block for a GEMM over K inputs (the layer's: hidden for
// gate_up, act_stride for down; an expert's own K is at most that) with `tiles` token tiles: the
// activations, whole or (`sliced`: ExpertMajorLaunch's gate_up_sliced / down_sliced; or past
// expert_major_staged_fits) as two slice buffers, then, where the layer has NVFP4 experts and
// expert_major_stages_scales says so (one token tile only), the scale codes.
__host__ __device__ constexpr int expert_major_staged_smem(int K, int mats, bool nvfp4, int tiles = 1,
                                                           bool sliced = false) {
  if (sliced || !expert_major_staged_fits(K)) return 2 * expert_major_slice_bytes(tiles);
  return 8 * tiles * expert_major_staged_row_bytes(K) +
         (nvfp4 && tiles == 1 && expert_major_stages_scales(K, mats)
              ? mats * kExpertMajorStagedRows * expert_major_staged_scale_stride(K)
              : 0);
}
// The most any staged block asks for: activations within kExpertMajorStagedMaxBytes (K <= 3008),
// one matrix's scales; with two token tiles, twice the activations. Two slice buffers take less.
inline constexpr int kExpertMajorStagedMaxSmem =
    kExpertMajorStagedMaxBytes + kExpertMajorStagedRows * expert_major_staged_scale_stride(3008);
inline constexpr int kExpertMajorStaged2MaxSmem = 2 * kExpertMajorStagedMaxBytes;
static_assert(2 * kExpertMajorSliceBytes <= kExpertMajorStagedMaxBytes);

// Whether one GEMM (`rows` outputs) of an expert-major call runs the staged kernel: never past
// two token tiles per item (group 16, which expert_major_group picks only where the down stages
// its activations whole); else as `mode` forces (1 on, 0 off), or by default (-1) once its grid
// holds 8 blocks per SM and the call 32 work items. Below that the split-K kernel's 4x more blocks
// keep more loads in flight: on the H200, both GEMMs staged at 4 blocks per SM (qwen3 N = 8, about
// 1.2 waves of resident blocks) ran 0.93-0.95x, down alone at 9 per SM (N = 4) 1.06-1.07x
// (docs/PERF.md, v3.7). By default also only where the activations of K columns are staged whole:
// staged in slices (K past kExpertMajorStagedMaxBytes, DeepSeek-V3's gate_up) they ran
// 0.77-0.97x against split-K at every N they were chosen for (N = 4-256, docs/PERF.md v3.11), so
// at one token tile they run only when forced; at two the split-K kernel would take 4.
inline bool expert_major_staged(int mode, int group, int rows, int K, int max_items, int sm_count) {
  if (group != 8 && group != 16) return false;
  if (mode >= 0) return mode == 1;
  if (group == 8 && !expert_major_staged_fits(K)) return false;
  const int64_t blocks = static_cast<int64_t>((rows + kExpertMajorStagedRows - 1) / kExpertMajorStagedRows) * max_items;
  return max_items >= 32 && blocks >= int64_t{8} * sm_count;
}

// The 64-row passes a staged down block makes over the activations it stages once (1, 2 or 4),
// where its kernel neither stages in slices nor copies scale codes, for `rows` outputs of items of
// `tiles` token tiles: `forced` where it is 1, 2 or 4, else 4 in a layer with NVFP4 experts where
// the four-pass grid (by the launch's max_items) still holds kExpertMajorFourPassBlocksPerSm blocks
// per SM (at two tiles kExpertMajorTwoTileFourPassBlocksPerSm), else 2 where the two-pass grid
// holds kExpertMajorTwoPassBlocksPerSm. Each pass past the first reads its 64 rows'
// weights against activations already in shared memory: a one-pass block copies 8 or 16 token
// rows of K bf16 from L2 for 64 x K weights (at two tiles and NVFP4, as many bytes as the
// weights), and the path between L2 and the SMs, not DRAM, has bounded these kernels
// (docs/PERF.md, "Where the gap comes from"). The two-pass kernels take the registers of the
// one-pass ones (71 / 115 against 70 / 114 at one / two token tiles); the four-pass ones choose
// the expert's K loop once per block, outside the passes, and take 64 / 114. gate_up makes one
// pass: its activations are half its weight bytes at most, and forced to two or four passes
// (128 / 123 registers at one tile, 168 at two) it ran 0.75-1.00x at qwen3 N = 16-256
// (docs/PERF.md v3.13).
//
// Measured on the H200, both routings: two passes against one (docs/PERF.md v3.12) 1.01-1.05x
// wherever the two-pass grid held 28 blocks per SM or more (qwen3-30b N = 128-256, qwen3-next
// N = 32-256), 0.97-1.03x below it (qwen3-30b N = 16-64, qwen3-next N = 4-16), where the same
// grid gained in one routing and lost in the other. 28 is four waves of the 7 one-tile blocks an
// SM holds at 71 registers. Four against two (v3.13), NVFP4: 0.99-1.02x at qwen3-next N = 32-256,
// whose four-pass grids hold 21-52 blocks per SM (ten of those twelve rows 1.01-1.02x); 0.99-1.01x
// at qwen3-30b N = 128-256 (16). FP8 (block-128) lost at the same grids: qwen3-next N = 32-256
// 0.94-0.97x, DeepSeek-V3 N = 16-64 0.96-0.98x. Its weights are twice NVFP4's bytes for the same
// staging, so a fourth of the stagings saves half as much against them, for half the blocks.
//
// The thresholds count one-tile blocks, 7 of which an SM holds; it holds 4 two-tile blocks. At two
// tiles (v3.31), forced four passes against the one pass the one-tile threshold chose ran
// 1.02-1.04x at qwen3-30b N = 128 (a four-pass grid of 1544 blocks, 11.7 per SM), and 1.00x against
// two passes at N = 256. Eight passes per block (the same loop over more rows) measured 0.96-1.03x
// against four where 20 eight-pass blocks per SM would have chosen them (qwen3-next N = 128-256,
// DeepSeek-V3 N = 32-256): within these rows' noise, so not kept.
inline constexpr int kExpertMajorTwoPassBlocksPerSm = 28;
inline constexpr int kExpertMajorFourPassBlocksPerSm = 20;
inline constexpr int kExpertMajorTwoTileFourPassBlocksPerSm = 8;
inline int expert_major_staged_passes(int forced, int rows, int max_items, int sm_count, bool nvfp4, int tiles) {
  if (forced == 1 || forced == 2 || forced == 4) return forced;
  const auto blocks_per_sm_at_least = [&](int passes, int per_sm) {
    const int64_t rows_per_block = int64_t{passes} * kExpertMajorStagedRows;
    return (rows + rows_per_block - 1) / rows_per_block * max_items >= int64_t{per_sm} * sm_count;
  };
  const int four_from = tiles == 2 ? kExpertMajorTwoTileFourPassBlocksPerSm : kExpertMajorFourPassBlocksPerSm;
  if (nvfp4 && blocks_per_sm_at_least(4, four_from)) return 4;
  return blocks_per_sm_at_least(2, kExpertMajorTwoPassBlocksPerSm) ? 2 : 1;
}

// How many chunks ahead of their MMAs the K loops over NVFP4 weights load in the staged kernels
// that have a two-ahead variant (all but the sliced and scale-copying kernels): `forced` (1 or 2),
// else two in layers with NVFP4 experts. Those variants are held to the blocks per SM of the
// one-ahead kernels and keep FP8 and BF16 loops one ahead, which there measured 0.93-0.96x against
// the one-ahead kernels (docs/PERF.md v3.14), so layers without NVFP4 experts run the one-ahead
// kernels. NVFP4, two against one: 1.01-1.06x at qwen3 N = 16-256.
inline int expert_major_staged_ahead(int forced, bool nvfp4) {
  if (forced == 1 || forced == 2) return forced;
  return nvfp4 ? 2 : 1;
}

// Whether the staged down of two token tiles per item (group 16) loads one chunk ahead where the
// two-ahead rule (expert_major_staged_ahead) would give it two: unless forced, where the call's
// routes average kTwoTileDownOneAheadFromRoutes or more per expert, so that most items fill both
// tiles. There the kernel's MMAs per byte of weights double, and one ahead (80 registers, 6 blocks
// per SM) hides the decode's chains behind 24 warps per SM where two ahead (112 registers, 4 per SM)
// has 16, with the same chunks in flight per SM. Measured on an H100, one ahead forced against two
// (docs/PERF.md v3.44): qwen3-30b at 12-16 routes per expert (N = 192-256) 1.01-1.03x; at 8-10
// (N = 128-160) 0.97-1.00x in the independent routing; DeepSeek-V3 N = 256 (9) 0.97-0.98x.
inline constexpr int kTwoTileDownOneAheadFromRoutes = 12;
inline bool expert_major_two_tile_down_one_ahead(int forced, int group, int routes, int experts) {
  return forced == 0 && group == 16 && routes >= kTwoTileDownOneAheadFromRoutes * experts;
}

// Whether an expert-major call may run two token tiles per item, which only the staged kernels
// hold: its down stages its activations (K = act_stride) whole (the two-tile down has no sliced
// variant), and `mode` does not forbid staging. The two-tile gate_up stages in slices at any K
// (DeepSeek-V3's K = 7168 too), decoding each weight once for both tiles.
inline bool expert_major_stageable(int mode, int act_stride) {
  return mode != 0 && expert_major_staged_fits(act_stride);
}

// Routes per work item for a call of n tokens of top-k over `experts` routed experts: one token
// tile (the kernel with the fewest registers, so the most warps per SM) wherever the experts
// average fewer than 8 routes, although an expert (the shared one above all) with more routes is
// then read once per 8; measured 1.4-1.5x faster at N = 32-64 than 4 tiles (docs/PERF.md,
// v3.4). Where the staged kernels can (expert_major_stageable), 8 to 16 routes on average run two
// token tiles per item in the staged kernels, so that an expert is read and decoded once for up to
// 16 routes (at one tile, qwen3-30b N = 256 read each expert about twice: 333 us against N = 128's
// 217, docs/PERF.md v3.8). From 8 on average two tiles measured 1.04-1.05x per call at qwen3-30b
// N = 128 (v3.27) and 1.13-1.22x at DeepSeek-V3 N = 256, its gate_up in slices of K = 7168 (v3.31);
// at 5 (qwen3-next N = 256) 0.91-0.94x (v3.27). Past 8 where they cannot, and past 16, 4 tiles.
inline int expert_major_group(int n, int top_k, int experts, bool stageable) {
  const int64_t routes = static_cast<int64_t>(n) * top_k;
  if (stageable && routes >= int64_t{8} * experts && routes <= int64_t{16} * experts) return 16;
  return routes <= int64_t{8} * experts ? 8 : kExpertMajorGroup;
}

// Whether a split-K down of one token tile runs over 32-row pairs (moe_expert_down_pairs): four
// warps per 32 rows instead of per 16, wherever H % 32 == 0. Measured on the H200 against 16 rows:
// 1.01-1.06x per call at N = 1-4 on the three bench presets, none slower (docs/PERF.md, v3.20).
inline bool expert_major_down_pairs(bool staged_down, int group, int hidden) {
  return !staged_down && group == 8 && hidden % 32 == 0;
}

// Whether a split-K gate_up of one token tile runs 32 rows per block, two warps splitting K over
// each 16 (moe_expert_gate_up_wide): half the blocks of 16 rows, each warp streaming twice the
// chunks, so that each block's prologue (item, table entry, routes) and epilogue carry twice the
// bytes. Where the 16-row grid holds at least 20 blocks per SM, so that the 32-row one is at least
// 2.5 waves of 4 per SM; the layer's rows whole 32-row tiles. From 8 per SM it measured 0.94x at
// DeepSeek-V3 N = 1 (1.09 waves) and 0.99x at the Qwen shapes' N = 4 (1.3-1.5 waves), 1.02-1.09x
// from 2.9 waves (docs/PERF.md, v3.22, call 5). From 20 per SM: qwen3 N = 8 1.04x, DeepSeek-V3
// N = 8, 16, 64 1.01x, 1.02x, 1.04x, 1.00x where it is not chosen (v3.23, call 1).
inline constexpr int kExpertMajorGateUpWideFromBlocksPerSm = 20;
inline bool expert_major_gate_up_wide(const DevLayer& L, bool staged_gate_up, bool selects, int group, int max_items) {
  const int64_t blocks = static_cast<int64_t>((L.act_stride + 15) / 16) * max_items;
  return !staged_gate_up && !selects && group == 8 && L.act_stride % 32 == 0 &&
         blocks >= int64_t{kExpertMajorGateUpWideFromBlocksPerSm} * L.sm_count;
}

// Whether a call's gate_up kernel selects the experts itself, each block from the router's logits,
// instead of a route kernel before it (moe_expert_gate_up_select): calls of one token whose gate_up
// is split-K at one token tile, whose selection fits one warp in 8 registers per lane (up to 256
// router outputs; past that the route kernel selects on a whole block, and at 16 per lane this
// kernel spilled), k and the groups within a warp, its routes too, whose activations are not
// weighted on input (store_tile would read the weights the same kernel publishes), and whose grid
// fits one wave of 4 blocks per SM. Past one wave every later wave selects again before its first
// weight load: DeepSeek-V3 (1152 blocks, 2.2 waves) ran 0.91x with it, qwen3-30b-a3b (384 blocks)
// 1.04x (docs/PERF.md, v3.21).
inline bool expert_major_gate_up_selects(const DevLayer& L, int n, bool staged_gate_up, int group) {
  const int routes = L.top_k + (L.has_shared ? 1 : 0);
  const int64_t blocks = static_cast<int64_t>((L.act_stride + 15) / 16) * routes;
  return n == 1 && !staged_gate_up && group == 8 && routes <= 32 && L.n_group <= 32 && L.router_outputs <= 8 * 32 &&
         !L.weight_on_input && blocks <= int64_t{4} * L.sm_count;
}

// moe_expert_down_blend: a call's down and blend in one kernel, one block per 16 rows of H, each
// running all of the call's items, `ways` warps splitting K for each (at most this many warps in
// all, and calls of at most this many tokens). Past 16 items, one warp per item in a rolled loop
// (moe_expert_down_blend_rolled), up to kExpertMajorDownBlendMaxItems items.
inline constexpr int kExpertMajorDownBlendWarps = 16;
inline constexpr int kExpertMajorDownBlendTokens = 16;
inline constexpr int kExpertMajorDownBlendMaxItems = 8 * kExpertMajorDownBlendWarps;

// The warps per item of a call's fused down and blend, or 0 where the call runs a down kernel,
// then the blend: calls of up to 16 tokens at one token tile whose H / 16 blocks, one per SM, fit
// one wave, and
// - whose items fit 16 warps and whose down is split-K (4, 2 or 1 warps per item: up to 4, 8 or
//   16 items; moe_expert_down_blend);
// - or, whatever down they would run otherwise, whose items fit kExpertMajorDownBlendMaxItems,
//   one warp each, where every expert's down takes the same K loop (DevLayer::down_path: the
//   rolled kernel holds one) and staging is not forced (moe_expert_down_blend_rolled).
inline int expert_major_down_blend_ways(const DevLayer& L, int n, bool staged_down, int group, int max_items) {
  if (n > kExpertMajorDownBlendTokens || group != 8 || max_items < 1 || L.hidden / 16 > L.sm_count) return 0;
  if (max_items > kExpertMajorDownBlendWarps) {
    return max_items <= kExpertMajorDownBlendMaxItems && L.down_path >= 0 && L.staged != 1 ? 1 : 0;
  }
  if (staged_down) return 0;
  for (const int ways : {4, 2}) {
    if (max_items * ways <= kExpertMajorDownBlendWarps) return ways;
  }
  return 1;
}

// The items each warp of a fused down and blend runs in turn: one per 16 items at one warp per
// item (past 16 items: the rolled kernel), else 1.
inline int expert_major_down_blend_rounds(int ways, int max_items) {
  return ways == 1 ? (max_items + kExpertMajorDownBlendWarps - 1) / kExpertMajorDownBlendWarps : 1;
}

// Whether an expert-major call of one token tile per item (group 8) mixes token tiles: its hot
// experts (those with more than 8 routes in the call, the shared expert from N = 9) run as items of
// up to 16 routes in the two-tile staged kernels, the others as before, the two sets of items in
// two chains of launches on two streams (launch_moe_expert_major), so that a hot expert is read and
// decoded once per 16 routes instead of once per 8 and neither chain waits for the other's tail.
// Only where the two-tile kernels can run (expert_major_stageable: the down staged whole), and for
// calls of more than 8 tokens (no expert has more routes than tokens). `mode` forces it (1; then
// also in place of a fused down and blend) or forbids it (0); by default (-1) where the routed
// experts average kExpertMajorMixedFromRoutes routes or more, the call has no fused down and
// blend, and a routed expert's weights take kExpertMajorMixedFromBytes or more. Counted on the
// bench's routings (NVFP4, 8 inputs): qwen3-next N = 128 groups 374 items at 8 routes in the
// correlated routing and 338 mixed (28 hot experts and the shared one), N = 256 585 and 470;
// qwen3-30b N = 64 correlated 116 and 97; DeepSeek-V3 N = 128 correlated 254 and 210. Measured on
// an H100 against the same build with mixing off (docs/PERF.md v3.34): DeepSeek-V3 (24.8 MB per
// expert) N = 64-128 1.01-1.02x independent, 1.03-1.05x correlated; qwen3-next (1.8 MB) N = 128-256
// 0.99-1.01x; qwen3-30b (2.7 MB) N = 32-64 0.95-0.97x, correlated N = 64 1.01x. Fewer reads of a
// small expert save less than the second chain's launches and empty blocks cost.
inline constexpr int kExpertMajorMixedFromRoutes = 2;
inline constexpr int64_t kExpertMajorMixedFromBytes = int64_t{8} << 20;
inline bool expert_major_mixed(int mode, int n, int group, bool stageable, bool fused_down_blend, int routed,
                               int experts, int64_t expert_bytes) {
  if (group != 8 || !stageable || n <= 8) return false;
  if (mode >= 0) return mode == 1;
  return !fused_down_blend && routed >= kExpertMajorMixedFromRoutes * experts &&
         expert_bytes >= kExpertMajorMixedFromBytes;
}

// Whether an expert-major call runs its shared expert apart: its gate_up and down in a chain of
// their own on a second stream, forked before the router and joined before the blend (or the fused
// down and blend), over items, routes and a bf16 copy of x that the chain writes itself
// (launch_moe_shared_apart). Its bytes then move while the router and the selection run, which
// take 4-17 us per call however few bytes they move (docs/PERF.md, "Where the gap comes from"),
// and the routed experts' grids lose its items: DeepSeek-V3 N = 1's split-K gate_up 1152 blocks
// (2.2 waves of 4 per SM) become 1024 (1.9). Only with a shared expert (on this rank); `mode`
// forces it (1) or forbids it (0); by default (-1) for calls of up to 8 tokens (the shared expert
// one item) where the shared expert's weights take kSharedApartFromBytes or more and the gate_up
// does not select (`selects`: expert_major_gate_up_selects, which needs the route kernel gone, so
// forcing this turns it off). Measured on an H100 against the same build with it off
// (docs/PERF.md v3.34): DeepSeek-V3 (a 24.8 MB shared expert) N = 1-2 1.03-1.06x, N = 8 1.00-1.02x,
// N = 64-256 0.98-0.99x; qwen3-next (1.8 MB) 0.87x at N = 1, 0.95-0.98x at N = 8-128: where the
// shared expert's bytes take under a microsecond, the second chain only adds its launches.
inline constexpr int64_t kSharedApartFromBytes = int64_t{8} << 20;
inline bool expert_major_shared_apart(int mode, bool has_shared, bool selects, int n, int64_t shared_bytes) {
  if (!has_shared || mode == 0) return false;
  return mode == 1 || (!selects && n <= 8 && shared_bytes >= kSharedApartFromBytes);
}

// What an expert-major call of n tokens launches: routes per work item, the grid's items, and
// which GEMMs run staged, which of those stage their activations in slices (the layer's K past
// expert_major_staged_fits, and the two-tile gate_up), and whether the staged down copies its
// NVFP4 scale codes into shared memory (expert_major_stages_scales for the layer's K, where the
// layer has NVFP4 experts and no weight tiles), and
// the 64-row passes of the staged down's blocks (expert_major_staged_passes; 1 for the sliced and
// scale-copying kernels), and how many chunks ahead each staged GEMM's NVFP4 loop loads
// (expert_major_staged_ahead where the kernel has a two-ahead variant, but one for a two-tile down
// past expert_major_two_tile_down_one_ahead's routes per expert; else 1), and whether a
// split-K down runs over row pairs (expert_major_down_pairs), and whether the gate_up selects
// (expert_major_gate_up_selects), and the warps per item of a fused down and blend
// (expert_major_down_blend_ways; 0: none) with the items each warp runs in turn
// (expert_major_down_blend_rounds), and whether it mixes token tiles (expert_major_mixed) with
// the hot experts' launches (expert_major_hot_launch). The launcher and the bench's per-call
// config both read it.
struct ExpertMajorLaunch {
  int group = 8;
  int max_items = 0;
  bool staged_gate_up = false;
  bool staged_down = false;
  bool gate_up_sliced = false;  // staged with the activations in slices (K past the whole-K limit)
  bool down_sliced = false;
  bool down_copies_scales = false;
  int down_passes = 1;
  int gate_up_ahead = 1;
  int down_ahead = 1;
  bool down_pairs = false;  // split-K down of one token tile over 32-row pairs (moe_expert_down_pairs)
  bool gate_up_selects = false;  // no route kernel: the gate_up kernel selects (moe_expert_gate_up_select)
  int down_blend_ways = 0;  // > 0: down and blend in one kernel, this many warps per item (moe_expert_down_blend)
  int down_blend_rounds = 1;  // the fused down's items per warp, one after the other
  bool gate_up_wide = false;  // split-K gate_up of 32 rows per block (moe_expert_gate_up_wide)
  // Mixed token tiles: the hot experts' items in ws.items from hot_offset, at most hot_max_items,
  // and their two-tile down's passes and chunks ahead.
  bool mixed = false;
  int hot_offset = 0;
  int hot_max_items = 0;
  int hot_down_passes = 1;
  int hot_down_ahead = 1;
  // The shared expert in a chain of its own, beside the router (expert_major_shared_apart).
  bool shared_apart = false;
  // The gate_up launched while the kernel before it (route, or the router where gate_up selects)
  // runs (expert_major_early_gate_up).
  bool early_gate_up = false;
  // The down (or fused down and blend) launched while gate_up runs (expert_major_early_down).
  bool early_down = false;
  // That down staged, each block starting once its item's gate_up is stored (expert_major_item_release).
  bool item_release = false;
};

// The rest of a launch's GEMM kernels once its routes per item, grid and which GEMMs run staged
// are chosen (c.group, c.max_items, c.staged_gate_up, c.staged_down, c.down_blend_ways): slices,
// the down's scale copies and passes, chunks ahead, row pairs, and the 32-row split-K gate_up.
inline void expert_major_gemm_details(const DevLayer& L, ExpertMajorLaunch& c) {
  c.gate_up_sliced = c.staged_gate_up && (!expert_major_staged_fits(L.hidden) || c.group == 16);
  c.down_sliced = c.staged_down && !expert_major_staged_fits(L.act_stride);
  // Scale tiles already bring a warp's codes in one coalesced load per chunk.
  c.down_copies_scales = c.staged_down && c.group == 8 && L.nvfp4 && !L.weight_tiles &&
                         expert_major_stages_scales(L.act_stride, 1);
  if (c.staged_down && !c.down_sliced && !c.down_copies_scales) {
    c.down_passes =
        expert_major_staged_passes(L.staged_passes, L.hidden, c.max_items, L.sm_count, L.nvfp4, c.group / 8);  // tiles
  }
  const int ahead = expert_major_staged_ahead(L.staged_ahead, L.nvfp4);
  if (c.staged_gate_up && !c.gate_up_sliced) c.gate_up_ahead = ahead;
  if (c.staged_down && !c.down_sliced && !c.down_copies_scales) c.down_ahead = ahead;
  c.down_pairs = c.down_blend_ways == 0 && expert_major_down_pairs(c.staged_down, c.group, L.hidden);
  c.gate_up_wide = expert_major_gate_up_wide(L, c.staged_gate_up, c.gate_up_selects, c.group, c.max_items);
}

// Whether a call whose gate_up selects (one token) can launch its down during gate_up: only the
// fused down and blend of one round (moe_expert_down_blend), which then reads the items that
// gate_up's block (0, 0) publishes (DevWorkspace::items_published) once they are flagged, in place
// of the route kernel's. Measured on an H100 against the down launched after gate_up (docs/PERF.md,
// v3.47): qwen3-30b-a3b N = 1 1.04-1.05x per call; the form that selected in the down itself had
// run 0.94x (v3.46).
inline bool expert_major_published_down(const ExpertMajorLaunch& c) {
  return c.gate_up_selects && c.down_blend_ways > 0 && c.down_blend_rounds == 1;
}

// Whether an expert-major call launches its down kernel (or its fused down and blend) while its
// gate_up still runs, by programmatic dependent launch: the gate_up blocks allow it as they start
// (griddepcontrol.launch_dependents), so the down's blocks take the SMs that gate_up's last blocks
// leave, read their items and table entries and load their first chunks of weights, and only then
// wait for gate_up's grid to finish (griddepcontrol.wait, in mma_rows) before they read its
// activations (split-K) or copy them into shared memory (staged). Only where gate_up does not
// select (its items and routes are then the route kernel's, read before the wait) or where the down
// reads the items that a selecting gate_up publishes (expert_major_published_down), and the call
// has no second stream (neither mixed token tiles nor the shared expert apart, whose join would meet
// a programmatic edge). `mode` forbids it (0) or allows it wherever it can run (1, also by default,
// -1). Measured on an H100 against off (docs/PERF.md v3.35, v3.36): 1.03-1.08x per call at the
// Qwen shapes' N = 1-8 (split-K or fused down and blend), 1.01-1.02x at DeepSeek-V3 N = 1-2 with
// its shared expert in the call; the staged down (N = 16-256) 1.002-1.007x.
inline bool expert_major_early_down(int mode, const ExpertMajorLaunch& c) {
  if (mode == 0 || c.mixed || c.shared_apart) return false;
  return !c.gate_up_selects || expert_major_published_down(c);
}

// Whether an early down (expert_major_early_down) that is staged starts each block on its work
// item once that item's gate_up warps have stored all its activations, instead of once gate_up's
// whole grid has ended: each gate_up warp that stores a 16-row tile of activations for one token
// tile publishes it (a fence, then a count per item: DevWorkspace::item_tiles_done), and a down
// block acquires its item's count until it reaches the item's tiles (gate rows / 16 x token
// tiles) before it copies the activations. So the down's first items run in the SMs that gate_up's
// last wave leaves, rather than only their first weights. The items are gate_up's, in the same
// order, and a down is launched only once every gate_up block is resident (it allows the launch
// as it starts), so none waits on a block that cannot run. `mode` forbids it (0), else it runs
// wherever the down is early and staged. Measured on an H100 against main (docs/PERF.md v3.43):
// qwen3-30b N = 64-256 1.02-1.04x per call, qwen3-next N = 16 1.03-1.04x, N = 64 1.01-1.02x,
// N = 128-256 0.99-1.00x (their gate_up runs many short waves: little tail to fill).
inline bool expert_major_item_release(int mode, const ExpertMajorLaunch& c) {
  return mode != 0 && c.early_down && c.staged_down;
}

// Whether an expert-major call launches its gate_up while the kernel before it still runs, by
// programmatic dependent launch: the route kernel (or the router, where gate_up selects) allows it
// as it starts, so the gate_up's grid is launched and its first blocks resident when that kernel
// ends; each gate_up block waits for it (griddepcontrol.wait) before it reads anything, then
// allows the down's launch (expert_major_early_down). What overlaps is the launch and the blocks'
// start, nothing of their loads: every gate_up block's first load is of the route kernel's items
// (or the router's logits). Only where the call has no second stream (as early_down). `mode`
// forbids it (0), allows it wherever it can run (1), or by default (-1) in calls of one token.
// Measured on an H100 against off, the down early in both (docs/PERF.md v3.36): 1.02x per call at
// the Qwen shapes' N = 1 (23.5 against 24.0 us at qwen3-next), 0.97-0.98x at N = 2 and 0.97-0.99x
// at N = 16-256; why it loses there was not measured.
inline bool expert_major_early_gate_up(int mode, int n, const ExpertMajorLaunch& c) {
  return (mode == 1 || (mode == -1 && n == 1)) && !c.mixed && !c.shared_apart;
}

inline ExpertMajorLaunch expert_major_launch(const DevLayer& L, int n) {
  ExpertMajorLaunch c;
  const bool stageable = expert_major_stageable(L.staged, L.act_stride);
  c.group = expert_major_group(n, L.top_k, L.num_experts, stageable);
  const int experts = L.num_experts + (L.has_shared ? 1 : 0);
  const int routes = n * L.top_k + (L.has_shared ? n : 0);
  c.max_items = expert_major_max_items(routes, experts, c.group);
  c.staged_gate_up = expert_major_staged(L.staged, c.group, L.act_stride, L.hidden, c.max_items, L.sm_count);
  // A fused down and blend runs in place of the down the call would otherwise run, staged or not.
  const bool down_stages = expert_major_staged(L.staged, c.group, L.hidden, L.act_stride, c.max_items, L.sm_count);
  c.down_blend_ways = expert_major_down_blend_ways(L, n, down_stages, c.group, c.max_items);
  c.mixed = expert_major_mixed(L.mixed_tiles, n, c.group, stageable, c.down_blend_ways > 0, n * L.top_k, L.num_experts,
                               L.routed_expert_bytes);
  if (c.mixed) c.down_blend_ways = 0;  // forced past a fused down and blend
  c.down_blend_rounds = expert_major_down_blend_rounds(c.down_blend_ways, c.max_items);
  c.staged_down = down_stages && c.down_blend_ways == 0;
  const bool selects = expert_major_gate_up_selects(L, n, c.staged_gate_up, c.group);
  c.shared_apart = expert_major_shared_apart(L.shared_apart, L.has_shared, selects, n, L.shared_expert_bytes);
  c.gate_up_selects = selects && !c.shared_apart;
  expert_major_gemm_details(L, c);
  if (c.down_ahead == 2 && expert_major_two_tile_down_one_ahead(L.staged_ahead, c.group, routes, experts)) c.down_ahead = 1;
  c.early_gate_up = expert_major_early_gate_up(L.early_gate_up, n, c);
  c.early_down = expert_major_early_down(L.early_down, c);
  c.item_release = expert_major_item_release(L.item_release, c);
  if (c.mixed) {
    c.hot_offset = expert_major_hot_offset(routes, experts);
    c.hot_max_items = expert_major_hot_max_items(routes);
    c.hot_down_passes = expert_major_staged_passes(L.staged_passes, L.hidden, c.hot_max_items, L.sm_count, L.nvfp4, 2);
    c.hot_down_ahead = expert_major_staged_ahead(L.staged_ahead, L.nvfp4);
  }
  return c;
}

// The shared expert's launches in a call that runs it apart: what the rules of expert_major_launch
// choose for a grid of its items alone (its n routes, at the call's routes per item, or 16 where
// the call mixes token tiles, as its hot items were), never a fused down and blend.
inline ExpertMajorLaunch expert_major_shared_launch(const DevLayer& L, const ExpertMajorLaunch& call, int n) {
  ExpertMajorLaunch s;
  s.group = call.mixed ? 16 : call.group;
  s.max_items = (n + s.group - 1) / s.group;
  s.staged_gate_up = expert_major_staged(L.staged, s.group, L.act_stride, L.hidden, s.max_items, L.sm_count);
  s.staged_down = expert_major_staged(L.staged, s.group, L.hidden, L.act_stride, s.max_items, L.sm_count);
  expert_major_gemm_details(L, s);
  return s;
}

// The hot experts' launches of a call that mixes token tiles: what a call of two token tiles per
// item runs (group 16: the gate_up staged in slices, the down staged whole), over its hot items.
inline ExpertMajorLaunch expert_major_hot_launch(const ExpertMajorLaunch& call) {
  ExpertMajorLaunch h;
  h.group = 16;
  h.max_items = call.hot_max_items;
  h.staged_gate_up = h.staged_down = h.gate_up_sliced = true;
  h.down_passes = call.hot_down_passes;
  h.down_ahead = call.hot_down_ahead;
  return h;
}

// The router's logits kernels take 8 tokens per block: moe_router_logits 2 router rows per block
// (4 warps on each), moe_router_logits_wide 16 (2 per warp, the block's 8 warps sharing each read
// of x through L1). The wide one moves an eighth of the x traffic through L2 but has an eighth of
// the blocks, so it runs once its grid holds 1.5 blocks per SM (and rows are whole 8-column
// loads). Measured on the H200 (132 SMs, docs/PERF.md v3.11), the wide kernel against the narrow:
// 132 blocks (qwen3-next N = 32) 0.97-0.98x, 128 (qwen3-30b N = 128) 0.98x, 64 (qwen3-30b
// N = 64) 0.92-0.93x; 256 (qwen3-30b N = 256) 1.03x, 264 (qwen3-next N = 64) 1.03-1.04x.
inline constexpr int kRouterTokens = 8;
inline constexpr int kRouterWideRows = 16;
inline bool router_logits_wide(int rows, int cols, int n, int sm_count) {
  const int64_t blocks = static_cast<int64_t>((rows + kRouterWideRows - 1) / kRouterWideRows) *
                         ((n + kRouterTokens - 1) / kRouterTokens);
  return cols % 8 == 0 && 2 * blocks >= int64_t{3} * sm_count;
}

// moe_router_logits' tokens per block: 8, or 1 for a call of one token (the 1-token build, without
// the 8-token build's guards) and where the 8-token grid would leave SMs idle. Every block reads
// its 2 rows' share of x (all of H for each of its tokens), so the x bytes through L2 do not depend
// on the tokens per block; the router's rows are read once per block instead of once per 8 tokens
// (0.5-1 MB, from L2 after the first). What changes is how many SMs pull those bytes and how long
// each block's chain is. Measured on the H200 against 8 per block (docs/PERF.md, v3.23, call 3):
// qwen3-30b (64 row pairs) 1.02-1.03x per call at N = 1, 2, 8 (1 per block: 64, 128, 512 blocks);
// qwen3-next (257 row pairs) 1.03-1.04x at N = 1, but 0.98-0.99x at N = 2 and 8 at 1-2 tokens per
// block (514 and 1028 blocks), so a grid that holds a block per SM keeps 8.
inline constexpr int kRouterRows = 2;
inline int router_logits_tokens(int rows, int n, int sm_count) {
  const int64_t row_blocks = (rows + kRouterRows - 1) / kRouterRows;
  return n <= 1 || row_blocks * ((n + kRouterTokens - 1) / kRouterTokens) < sm_count ? 1 : kRouterTokens;
}

// The router's logits on the tensor cores (moe_router_mma), where the router is BF16 and rows are
// whole 8-column loads: a block of 8 warps takes 128 router rows (16 per warp, one MMA M) for 8
// tokens (one MMA N) over one slice of 256 columns of K, so the grid is (row groups, token groups,
// slices). x is fp32 and the CUDA-core kernels keep it so; here each x
// value is split into three bf16 parts (x = hi + mid + lo to fp32's precision), each multiplied
// exactly by the bf16 weights and summed in fp32. The shared expert's gate vector (fp32) is split
// the same way at upload, into three rows from a multiple of 4 past the router's (so all three
// fall in one row group). Each block writes its slice's sums; the last block of a (row group,
// token group) adds the slices in slice order (deterministic), the bias, and the gate's sigmoid.
inline constexpr int kRouterMmaRows = 128;
inline constexpr int kRouterMmaCols = 256;
inline constexpr int kRouterMmaMaxTokens = 512;  // larger calls run the CUDA-core kernels
// Tokens per block at every grid. 16 or 32 where the grid still held a block per SM (the router's
// rows then read fewer times from L2, but each block's MMAs and its share of the slices' sum grow)
// measured 1.00-1.03x slower than 8 on an H100 (docs/PERF.md v3.41): qwen3-next N = 64-256 1.01-1.03x
// faster at 8, DeepSeek-V3 N = 64-256 1.00-1.01x.
inline constexpr int kRouterMmaTokens = 8;
// The token groups of a call of n tokens: the grid's y, and the counters of the slices' sums.
inline int64_t router_mma_token_groups(int64_t n) { return (n + kRouterMmaTokens - 1) / kRouterMmaTokens; }
__host__ __device__ constexpr int router_mma_gate_row(int outputs) { return (outputs + 3) / 4 * 4; }
inline int router_mma_row_groups(int outputs, bool shared_gate) {
  const int rows = shared_gate ? router_mma_gate_row(outputs) + 3 : outputs;
  return (rows + kRouterMmaRows - 1) / kRouterMmaRows;
}
inline int router_mma_slices(int hidden) { return (hidden + kRouterMmaCols - 1) / kRouterMmaCols; }
// Whether a call of n tokens runs moe_router_mma (where it can run at all: L.router_mma_tokens):
// forced, else from 16 tokens where its grid at 8 tokens per block has 16 blocks or more.
// Measured on the H200 against the CUDA-core kernels (docs/PERF.md v3.15): qwen3-30b (1 row group
// x 8 slices) 0.988x at N = 16 (16 blocks), 0.999x at 32 (32), 1.019x at 64 (64), 1.06x at
// 128-256; qwen3-next (5 x 8) 1.015x at N = 16 (80 blocks) to 1.11x at 256; forced at N = 1-8,
// 0.94-0.99x. Measured again on an H100 with v3.48's kernels (docs/PERF.md v3.50): forced on at
// qwen3-30b N = 16 1.010-1.021x and at 32 1.030-1.033x, where v3.15's rule (3/8 of a block per SM,
// 50 blocks on 132 SMs) had kept the CUDA-core kernels, at N = 4-8 0.95-0.99x, so still from 16;
// this rule against v3.15's in an A/B, qwen3-30b N = 16-48: 1.01-1.06x per call.
inline constexpr int kRouterMmaFromTokens = 16;
inline constexpr int kRouterMmaFromBlocks = 16;
inline bool router_uses_mma(const DevLayer& L, int n) {
  if (n > L.router_mma_tokens || L.router_mma == 0) return false;
  if (L.router_mma == 1) return true;
  const int64_t blocks = int64_t{router_mma_row_groups(L.router_outputs, L.shared_gate)} * router_mma_token_groups(n) *
                         router_mma_slices(L.hidden);
  return n >= kRouterMmaFromTokens && blocks >= kRouterMmaFromBlocks;
}

// The router's logits kernel for a call of n tokens, and its grid: on the tensor cores
// (moe_router_mma, kRouterMmaTokens per block), or on the CUDA cores, 16 rows per
// block (moe_router_logits_wide, 8 tokens) or 2 (moe_router_logits, 1 or 8 tokens). The launcher
// runs this choice and the bench's per-call config names it.
enum class RouterKernel { kMma, kFmaWide, kFma };
struct RouterLaunch {
  RouterKernel kernel = RouterKernel::kFma;
  int tokens = 1;  // tokens per block
  int grid[3] = {1, 1, 1};
};
inline RouterLaunch router_launch(const DevLayer& L, int n) {
  const int rows = L.router_outputs + (L.shared_gate ? 1 : 0);
  RouterLaunch r;
  if (router_uses_mma(L, n)) {
    const int groups = router_mma_row_groups(L.router_outputs, L.shared_gate), slices = router_mma_slices(L.hidden);
    r.kernel = RouterKernel::kMma;
    r.tokens = kRouterMmaTokens;
    r.grid[0] = groups, r.grid[2] = slices;
  } else if (router_logits_wide(rows, L.router.cols, n, L.sm_count)) {
    r.kernel = RouterKernel::kFmaWide;
    r.tokens = kRouterTokens;
    r.grid[0] = (rows + kRouterWideRows - 1) / kRouterWideRows;
  } else {
    r.tokens = router_logits_tokens(rows, n, L.sm_count);
    r.grid[0] = (rows + kRouterRows - 1) / kRouterRows;
  }
  r.grid[1] = (n + r.tokens - 1) / r.tokens;
  return r;
}

// Whether a layer's selection runs on the route kernels that select and group in one launch
// (launch_route_warps: the choices and groups one lane each, the logits at most 16 per lane of one
// warp); else on moe_route_kernel, then a grouping kernel. The first are launched while the router
// runs (a programmatic dependent launch), their blocks waiting for its logits.
inline bool selection_by_warps(const DevLayer& L) { return L.top_k <= 32 && L.n_group <= 32 && L.router_outputs <= 16 * 32; }

// Calls of up to 8 tokens whose logits take 8 or more per lane of one warp (router outputs past
// 128) select on a whole block per token (moe_route_token_blocks), the grid one cluster past one
// token; other calls on one warp per token (moe_route_warps). One token on a block rather than a
// warp, measured on the H200 (docs/PERF.md v3.18): 1.06-1.07x per call at qwen3-next's 512 outputs,
// 1.02-1.03x at DeepSeek-V3's 256, 0.98x at qwen3-30b's 128 (4 per lane, a variant build). 2-8
// tokens on a block each against a warp each, on an H100 (v3.42): 1.03-1.06x per call at
// qwen3-next, 1.01-1.02x at DeepSeek-V3.
// Up to 16 tokens where the device schedules a cluster of 16 blocks (L.route_token_blocks, from
// route_token_blocks_max: a size past the portable 8, which Hopper allows), else up to 8; 9-16
// tokens on a block each against a warp each, on an H100 (v3.43): 1.03-1.06x per call at qwen3-next,
// 1.01x at DeepSeek-V3.
inline constexpr int kBlockSelectFromPerLane = 8;
inline constexpr int kRouteClusterMaxBlocks = 8;   // the portable cluster size
inline constexpr int kRouteTokenBlocksMax = 16;    // Hopper's largest (non-portable) cluster
inline bool selection_block_per_token(const DevLayer& L, int n) {
  return selection_by_warps(L) && L.router_outputs > kBlockSelectFromPerLane / 2 * 32 && n <= L.route_token_blocks;
}

// The selection of one warp per token (moe_route_warps) runs ceil(n / 8) blocks of 8 warps. Past
// one block, each block's choices must reach the block that groups them. Up to a cluster's portable
// size (8 blocks, n <= 64) the grid is one thread-block cluster: after a cluster barrier block 0
// reads every block's choices from its shared memory. Larger grids count their finished blocks
// through a fence and a counter in global memory, and the last one reads the choices from L2.
inline constexpr int kRouteWarps = 8;
__host__ __device__ constexpr int route_warps_blocks(int n) { return (n + kRouteWarps - 1) / kRouteWarps; }
__host__ __device__ constexpr bool route_warps_clustered(int n) {
  return route_warps_blocks(n) > 1 && route_warps_blocks(n) <= kRouteClusterMaxBlocks;
}

// Router logits, then (`select`) the selection of every token; with group > 0 also the
// expert-major work items of up to `group` routes (ws.items, ws.route_list, ws.num_items). Without
// `select` the router alone: the caller's gate_up selects (ExpertMajorLaunch::gate_up_selects).
cudaError_t launch_moe_route(const DevLayer& layer, const float* x, int n, const DevWorkspace& ws, int group,
                             cudaStream_t stream, bool select = true);
cudaError_t launch_moe_token_major(const DevLayer& layer, const float* x, int n, const DevWorkspace& ws,
                                   float* out, cudaStream_t stream);
// A second stream and two events (timing off), for the hot experts' chain of a call that mixes
// token tiles.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
};
// The chain of a call that runs its shared expert apart (ExpertMajorLaunch::shared_apart): its
// stream and events, and the shared expert's own work items (one per `group` of its routes), route
// list (route n k + t for token t) and bf16 copy of x, all written at the head of the chain.
struct SharedApart {
  SideStream side;
  int4* items = nullptr;          // [shared_apart_max_items(max_tokens)]
  int32_t* num_items = nullptr;   // [1]
  int32_t* route_list = nullptr;  // [max_tokens]
  uint16_t* x_bf16 = nullptr;     // [max_tokens, H]
};
// The shared expert's items where it runs apart: at most one per 8 of a call's tokens.
inline int shared_apart_max_items(int max_tokens) { return (max_tokens + 7) / 8; }
// The shared expert's chain of an n-token call that runs it apart: on apart.side, from an event
// recorded on `stream` now (so before the router, where the caller launches this first), its
// items, route list and bf16 x, then its gate_up and down (expert_major_shared_launch), which write
// its routes' rows of ws.act_bf16 and ws.expert_out and nothing else; then apart.side.join, which
// launch_moe_expert_major waits for before the blend.
cudaError_t launch_moe_shared_apart(const DevLayer& layer, const float* x, int n, const DevWorkspace& ws,
                                    const ExpertMajorLaunch& call, const SharedApart& apart, cudaStream_t stream);
// Routes grouped by expert on the device, then per (expert, 16 rows, up to 32 routes) one block
// of tensor-core MMAs over the expert's weights, read once per call and dequantized in registers.
// `call` is expert_major_launch(layer, n), whose group the route kernel grouped by. Where it mixes
// token tiles, ws.hot_items is set (as for the route kernel), and the hot items' gate_up and down
// run on `side`, from an event recorded on `stream`, and `stream` waits for them before the blend:
// a fork and a join, which a graph capture of `stream` takes in. Where it runs the shared expert
// apart (ws.shared_apart set too), `stream` waits for apart.side.join before the blend or the
// fused down and blend.
cudaError_t launch_moe_expert_major(const DevLayer& layer, const float* x, int n, const DevWorkspace& ws,
                                    const ExpertMajorLaunch& call, const SideStream& side, const SharedApart& apart,
                                    float* out, cudaStream_t stream);
// Whether the blend issues all of a thread's loads first (moe_blend<true>, 78 registers): where
// its grid of `blocks` fits one wave of the `resident_per_sm` blocks an SM holds of it. Past that
// it runs at full occupancy instead. Measured on the H200, loads first against the loop (docs/PERF.md
// v3.11): 1.01-1.03x at qwen3 N = 1-16 (8-128 blocks), 1.00-1.01x at N = 32 (256); 0.99-1.00x at
// N = 64 (512 blocks, past 3 per SM x 132), 0.98-0.99x at N = 128-256.
inline bool blend_loads_first(int64_t blocks, int resident_per_sm, int sm_count) {
  return blocks <= static_cast<int64_t>(resident_per_sm) * sm_count;
}
// Whether the blend may run four outputs per thread (16-byte loads and stores): H % 4 == 0, and x
// and out 16-byte aligned (expert_out's rows then are too). It does where the one-per-thread
// loads-first grid would not fit one wave (blend_loads_first): there a quarter of the threads
// still issue all their loads first, instead of the loop's two round trips per route. Within one
// wave one per thread stays: four per thread everywhere was part of a build that lost 1-3% at
// qwen3 N = 1-8, where its effect was not measured apart (docs/PERF.md v3.18).
inline bool blend_aligned(int hidden, const float* x, const float* out) {
  const auto aligned = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return hidden % 4 == 0 && aligned(x) && aligned(out);
}
// The blocks of 256 threads of the loads-first blend that one SM of the current device holds.
cudaError_t blend_resident_per_sm(int* blocks);
// The most tokens of L's calls that select on a block each (selection_block_per_token):
// kRouteTokenBlocksMax where this device can run that many blocks of the route kernel as one
// cluster (it allows the kernel clusters past the portable size first), else kRouteClusterMaxBlocks.
cudaError_t route_token_blocks_max(const DevLayer& L, int* tokens);
cudaError_t launch_moe_blend(const DevLayer& layer, const float* x, int n, const DevWorkspace& ws, float* out,
                             cudaStream_t stream);
cudaError_t launch_moe_per_row(const DevLayer& layer, const float* x, int n, const DevWorkspace& ws,
                               float* out, cudaStream_t stream);
// Rewrites NVFP4 codes uploaded in checkpoint order into the device's pair order
// (nvfp4_pair_order.h), in place. `bytes` is a multiple of 4.
cudaError_t launch_nvfp4_pair_order(uint8_t* codes, int64_t bytes, cudaStream_t stream);
// Copies a matrix of `rows` rows of `row_bytes` bytes from row-major `src` into tiles at `dst`
// (weight_tiles.h; another buffer of the same size). Invalid value unless tiles_fit and both are
// 16-byte aligned.
cudaError_t launch_weight_tiles(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes, cudaStream_t stream);
// One streaming pass reading `count` float4 values; per-block partial sums go to `sink`
// ([blocks] floats) so the reads cannot be optimised away.
cudaError_t launch_stream_read(const float4* data, int64_t count, float* sink, int blocks, cudaStream_t stream);
// Lets the staged expert-major kernels use the shared memory they may need (past the 48 KB that
// needs no opt-in). Once per process, before the first launch; not a stream operation.
cudaError_t prepare_expert_major_kernels();
// A kernel image exists for the current device (false when the build targets another arch).
bool kernels_runnable();

}  // namespace moeinfer::cuda
