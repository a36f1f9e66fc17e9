// CudaMoe: upload, workspace, and the launch sequence of each path. CudaBackend: the host-memory
// Backend on top of it.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "cuda/moe_kernels.cuh"
#include "cuda/nvfp4_scale_fold.h"
#include "moeinfer/cuda.h"
#include "moeinfer/ep.h"

namespace moeinfer {

namespace {

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return {};
  return Status(StatusCode::kInternal, fmt::format("{}: {} ({})", what, cudaGetErrorString(err), cudaGetErrorName(err)));
}

// A second stream (non-blocking) and its fork and join events (timing off), which CudaMoe::Impl
// destroys.
Status create_side_stream(cuda::SideStream& side) {
  MOEINFER_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  for (cudaEvent_t* e : {&side.fork, &side.join}) {
    MOEINFER_RETURN_IF_ERROR(cuda_status(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate"));
  }
  return {};
}

// Device memory in large chunks, handed out 256-byte aligned (every vector load stays aligned);
// freed all at once.
class DeviceArena {
 public:
  ~DeviceArena() {
    for (void* c : chunks_) cudaFree(c);
  }
  Result<void*> alloc(size_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    if (bytes > left_) {
      const size_t size = std::max(bytes, kChunk);
      void* p = nullptr;
      const cudaError_t err = cudaMalloc(&p, size);
      if (err != cudaSuccess) {
        return Status(StatusCode::kUnavailable,
                      fmt::format("cudaMalloc of {} bytes failed after {} bytes: {}", size, total_, cudaGetErrorString(err)));
      }
      chunks_.push_back(p);
      next_ = static_cast<char*>(p);
      left_ = size;
    }
    void* out = next_;
    next_ += bytes;
    left_ -= bytes;
    total_ += bytes;
    return out;
  }
  template <class T>
  Result<const T*> upload(const std::vector<T>& v) {
    if (v.empty()) return static_cast<const T*>(nullptr);
    Result<void*> p = alloc(v.size() * sizeof(T));
    if (!p.ok()) return p.status();
    MOEINFER_RETURN_IF_ERROR(cuda_status(cudaMemcpy(*p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload"));
    return static_cast<const T*>(*p);
  }
  int64_t total() const { return static_cast<int64_t>(total_); }

 private:
  static constexpr size_t kChunk = size_t{256} << 20;
  std::vector<void*> chunks_;
  char* next_ = nullptr;
  size_t left_ = 0;
  size_t total_ = 0;
};

// A device buffer the upload lays matrices out through (weight tiles): grown as needed, freed
// when create returns.
class UploadScratch {
 public:
  ~UploadScratch() {
    if (buffer_ != nullptr) cudaFree(buffer_);
  }
  Result<void*> get(size_t bytes) {
    if (bytes > size_) {
      if (buffer_ != nullptr) cudaFree(buffer_);
      buffer_ = nullptr;
      size_ = 0;
      MOEINFER_RETURN_IF_ERROR(cuda_status(cudaMalloc(&buffer_, bytes), "upload scratch"));
      size_ = bytes;
    }
    return buffer_;
  }

 private:
  void* buffer_ = nullptr;
  size_t size_ = 0;
};

// Bytes per row of a matrix's codes, or 0 where its rows are not whole bytes (NVFP4, odd columns).
int64_t code_row_bytes(const QuantMatrix& m) {
  switch (m.spec.format) {
    case WeightFormat::kNVFP4: return m.cols % 2 == 0 ? m.cols / 2 : 0;
    case WeightFormat::kFP8: return m.cols;
    default: return 2 * m.cols;
  }
}

// Whether a matrix can be stored in weight tiles (cuda/weight_tiles.h).
bool tiles_fit(const QuantMatrix& m) {
  const int64_t row_bytes = code_row_bytes(m);
  return cuda::tiles_fit(m.rows, row_bytes) && static_cast<int64_t>(m.data.size()) == m.rows * row_bytes;
}

// Uploads a matrix; with `tiles` (which tiles_fit allows) its codes are then laid out in tiles
// through that scratch buffer.
Result<cuda::DevMatrix> upload_matrix(DeviceArena& arena, const QuantMatrix& m, const std::vector<float>& bias,
                                      UploadScratch* tiles = nullptr) {
  cuda::DevMatrix d;
  d.rows = static_cast<int32_t>(m.rows);
  d.cols = static_cast<int32_t>(m.cols);
  d.format = static_cast<uint8_t>(m.spec.format);
  d.fp8_scaling = static_cast<uint8_t>(m.spec.fp8_scaling);
  d.global_scale = m.global_scale;
  d.scale_cols = m.spec.format == WeightFormat::kFP8 ? static_cast<int32_t>(m.fp8_scale_cols()) : 0;
  // NVFP4: block scales nonnegative, and zero ones over zero codes (cuda/nvfp4_scale_fold.h), in
  // copies where some block needs it; the caller's matrix is left as it is.
  std::vector<uint8_t> folded_codes, folded_scales;
  const bool folded = m.spec.format == WeightFormat::kNVFP4 &&
                      cuda::fold_nvfp4_scale_signs(m.data, m.block_scales, &folded_codes, &folded_scales);
  const std::vector<uint8_t>& codes = folded ? folded_codes : m.data;
  const std::vector<uint8_t>& block_scale_codes = folded ? folded_scales : m.block_scales;
  Result<const uint8_t*> data = arena.upload(codes);
  if (!data.ok()) return data.status();
  d.data = *data;
  if (m.spec.format == WeightFormat::kNVFP4) {
    // The device keeps NVFP4 codes in pair order; the arena's memory is ours to rewrite.
    MOEINFER_RETURN_IF_ERROR(cuda_status(
        cuda::launch_nvfp4_pair_order(const_cast<uint8_t*>(*data), static_cast<int64_t>(m.data.size()), nullptr),
        "NVFP4 pair order"));
  }
  if (tiles != nullptr) {
    const size_t bytes = m.data.size();
    Result<void*> row_major = tiles->get(bytes);
    if (!row_major.ok()) return row_major.status();
    MOEINFER_RETURN_IF_ERROR(cuda_status(cudaMemcpy(*row_major, *data, bytes, cudaMemcpyDeviceToDevice), "weight tiles"));
    MOEINFER_RETURN_IF_ERROR(cuda_status(cuda::launch_weight_tiles(static_cast<const uint8_t*>(*row_major),
                                                                   const_cast<uint8_t*>(*data), m.rows, code_row_bytes(m),
                                                                   nullptr),
                                         "weight tiles"));
    d.tiled = true;
  }
  Result<const float*> scales = arena.upload(m.scales);
  if (!scales.ok()) return scales.status();
  d.scales = *scales;
  // An NVFP4 matrix in tiles has its block scales in scale tiles (cuda/weight_tiles.h).
  const bool scale_tiles = d.tiled && m.spec.format == WeightFormat::kNVFP4;
  std::vector<uint8_t> tiled_scales;
  if (scale_tiles) {
    const int64_t per_row = m.cols / kNvfp4Group;
    tiled_scales.resize(m.block_scales.size());
    for (int64_t r = 0; r < m.rows; ++r) {
      for (int64_t j = 0; j < per_row; ++j) {
        tiled_scales[static_cast<size_t>(cuda::tiled_scale_offset(r, j, per_row))] =
            block_scale_codes[static_cast<size_t>(r * per_row + j)];
      }
    }
  }
  Result<const uint8_t*> block_scales = arena.upload(scale_tiles ? tiled_scales : block_scale_codes);
  if (!block_scales.ok()) return block_scales.status();
  d.block_scales = *block_scales;
  Result<const float*> b = arena.upload(bias);
  if (!b.ok()) return b.status();
  d.bias = *b;
  return d;
}

// Uploads an expert; with `tiles`, each of its matrices that fits is laid out in weight tiles, gate
// and up only together (the expert-major kernels read both through one layout).
Result<cuda::DevExpert> upload_expert(DeviceArena& arena, const ExpertWeights& w, UploadScratch* tiles) {
  cuda::DevExpert d;
  UploadScratch* gate_up_tiles = tiles != nullptr && tiles_fit(w.gate) && tiles_fit(w.up) ? tiles : nullptr;
  Result<cuda::DevMatrix> gate = upload_matrix(arena, w.gate, w.gate_bias, gate_up_tiles);
  if (!gate.ok()) return gate.status();
  Result<cuda::DevMatrix> up = upload_matrix(arena, w.up, w.up_bias, gate_up_tiles);
  if (!up.ok()) return up.status();
  Result<cuda::DevMatrix> down = upload_matrix(arena, w.down, w.down_bias, tiles != nullptr && tiles_fit(w.down) ? tiles : nullptr);
  if (!down.ok()) return down.status();
  d.gate = *gate;
  d.up = *up;
  d.down = *down;
  return d;
}

}  // namespace

struct CudaMoe::Impl {
  LayerDesc desc;
  Plan plan;
  uint64_t layer_id = 0;
  int rank = 0;
  int ranks = 1;
  DeviceArena weights;
  DeviceArena scratch;
  cuda::DevLayer dev;
  cuda::DevWorkspace ws;
  int expert_matrices = 0;  // uploaded here (routed and shared, 3 per expert)
  int tiled_matrices = 0;   // of those, stored in weight tiles
  cuda::SideStream side;    // the hot experts' chain of calls that mix token tiles
  cuda::SharedApart shared;  // the shared expert's chain of calls that run it apart
  ~Impl() {
    for (const cuda::SideStream* s : {&side, &shared.side}) {
      if (s->stream != nullptr) cudaStreamDestroy(s->stream);
      for (cudaEvent_t e : {s->fork, s->join}) {
        if (e != nullptr) cudaEventDestroy(e);
      }
    }
  }
};

CudaMoe::CudaMoe(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaMoe::~CudaMoe() = default;
std::string CudaMoe::call_config(int64_t n) const {
  const cuda::DevLayer& L = impl_->dev;
  // The router's kernel: on the tensor cores or the CUDA cores (FMA), with its tokens or rows per block.
  const cuda::RouterLaunch r = cuda::router_launch(L, static_cast<int>(n));
  const std::string per_block = fmt::format("{} token{}/block", r.tokens, r.tokens > 1 ? "s" : "");
  const std::string router = r.kernel == cuda::RouterKernel::kMma       ? fmt::format("router mma ({})", per_block)
                             : r.kernel == cuda::RouterKernel::kFmaWide ? std::string("router fma (16 rows/block)")
                                                                        : fmt::format("router fma ({})", per_block);
  // The experts' layout: the upload's, the same for every call.
  const int tiled = impl_->tiled_matrices, all = impl_->expert_matrices;
  const std::string layout = tiled == 0     ? std::string("row-major weights")
                             : tiled == all ? std::string("weight tiles")
                                            : fmt::format("weight tiles ({} of {} matrices)", tiled, all);
  const PathKind path = impl_->plan.path_for(n);
  if (path != PathKind::kExpertMajor) return fmt::format("{}; {}; {}", path_name(path), layout, router);
  const cuda::ExpertMajorLaunch call = cuda::expert_major_launch(L, static_cast<int>(n));
  // "(2 ahead)": the staged kernel's NVFP4 loop loads two chunks ahead of its MMAs.
  const auto staged = [](bool sliced, int passes, int ahead) {
    const std::string kernel =
        sliced ? std::string("staged+slices") : passes > 1 ? fmt::format("staged x{}", passes) : std::string("staged");
    return ahead == 2 ? kernel + " (2 ahead)" : kernel;
  };
  // "R routes/item, gate_up G, down D" of a launch: the call's, or its shared expert's chain's.
  const auto kernels = [&](const cuda::ExpertMajorLaunch& c) {
    const std::string gate_up = c.staged_gate_up   ? staged(c.gate_up_sliced, 1, c.gate_up_ahead)
                                : c.gate_up_selects ? std::string("split-K (selects)")
                                : c.gate_up_wide    ? std::string("split-K (32 rows)")
                                                    : std::string("split-K");
    std::string down = "split-K";
    if (c.staged_down) {
      down = c.down_copies_scales ? std::string("staged+scales") : staged(c.down_sliced, c.down_passes, c.down_ahead);
    } else if (c.down_blend_ways > 0) {
      down = fmt::format("split-K + blend ({} warp{}/item{})", c.down_blend_ways, c.down_blend_ways > 1 ? "s" : "",
                         c.down_blend_rounds > 1 ? fmt::format(", {} items/warp", c.down_blend_rounds) : "");
    } else if (c.down_pairs) {
      down = "split-K (row pairs)";
    }
    return fmt::format("{} routes/item, gate_up {}, down {}", c.group, gate_up, down);
  };
  // A mixed call's hot experts: the two-tile kernels over their items.
  const std::string hot =
      call.mixed ? fmt::format("; experts past 8 routes at 16 routes/item, gate_up staged+slices, down {}",
                               staged(false, call.hot_down_passes, call.hot_down_ahead))
                 : std::string();
  // The shared expert's own chain and its kernels.
  const std::string shared =
      call.shared_apart ? fmt::format("; shared expert beside the router ({})",
                                      kernels(cuda::expert_major_shared_launch(L, call, static_cast<int>(n))))
                        : std::string();
  const std::string early = fmt::format("{}{}{}", call.early_gate_up ? "; gate_up launched during routing" : "",
                                        call.early_down ? "; down launched during gate_up" : "",
                                        call.item_release ? " (each item once its gate_up is stored)" : "");
  return fmt::format("{}{}{}{}; {}; {}", kernels(call), early, hot, shared, layout, router);
}

const Plan& CudaMoe::plan() const { return impl_->plan; }
const LayerDesc& CudaMoe::desc() const { return impl_->desc; }
uint64_t CudaMoe::layer_id() const { return impl_->layer_id; }
int CudaMoe::rank() const { return impl_->rank; }
int CudaMoe::ranks() const { return impl_->ranks; }
int64_t CudaMoe::weight_bytes() const { return impl_->weights.total(); }
int64_t CudaMoe::workspace_bytes() const { return impl_->scratch.total(); }

Result<std::unique_ptr<CudaMoe>> CudaMoe::create(const Layer& layer, int64_t max_tokens, std::optional<PathKind> path,
                                                 const ProgressFn& progress) {
  return create(layer, max_tokens, CudaMoeOptions{.path = path}, progress);
}

Result<std::unique_ptr<CudaMoe>> CudaMoe::create(const Layer& layer, int64_t max_tokens, const CudaMoeOptions& options,
                                                 const ProgressFn& progress) {
  MOEINFER_RETURN_IF_ERROR(layer.check());
  const LayerDesc& d = layer.desc;
  if (options.staged_passes && *options.staged_passes != 1 && *options.staged_passes != 2 && *options.staged_passes != 4) {
    return invalid_argument(fmt::format("staged passes: {} (1, 2 or 4)", *options.staged_passes));
  }
  if (options.staged_ahead && *options.staged_ahead != 1 && *options.staged_ahead != 2) {
    return invalid_argument(fmt::format("staged chunks ahead: {} (1 or 2)", *options.staged_ahead));
  }
  if (options.mixed_tiles.value_or(false)) {  // the hot experts run the two-tile staged kernels
    if (!options.staged.value_or(true)) {
      return unsupported("mixed token tiles run the hot experts in the staged kernels, which this call forbids (staged off)");
    }
    const int64_t act = std::max(d.intermediate, d.shared_intermediate);
    if (!cuda::expert_major_staged_fits(static_cast<int>(act))) {
      const int row = cuda::expert_major_staged_row_bytes(static_cast<int>(act));
      return unsupported(fmt::format("mixed token tiles: the two-tile down stages its activations whole, 8 token rows of "
                                     "{} bytes ({} bf16 columns, padded) = {} per token tile, past the {} that staging "
                                     "holds",
                                     row, act, 8 * row, cuda::kExpertMajorStagedMaxBytes));
    }
  }
  if (options.shared_apart.value_or(false) && !d.has_shared()) {
    return unsupported("shared expert apart: this layer has no shared expert");
  }
  // The tensor-core router multiplies BF16 weights, 8 columns per load.
  const bool router_mma_fits = layer.router.spec.format == WeightFormat::kBF16 && d.hidden % 8 == 0;
  if (options.router_mma.value_or(false) && !router_mma_fits) {
    return unsupported(fmt::format("router on the tensor cores: it needs a BF16 router with hidden_size a multiple of 8; "
                                   "this layer's router is {} with hidden_size {}",
                                   quant_spec_name(layer.router.spec), d.hidden));
  }
  if (options.ranks < 1 || options.rank < 0 || options.rank >= options.ranks) {
    return invalid_argument(fmt::format("expert parallelism: rank {} of {} ranks", options.rank, options.ranks));
  }
  const std::optional<PathKind> path = options.path;
  const ExpertSlice slice = expert_slice(d.num_experts, options.rank, options.ranks);
  const bool adds_once = options.rank == 0;  // the shared and zero experts
  int device = 0;
  MOEINFER_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  cudaDeviceProp prop{};
  MOEINFER_RETURN_IF_ERROR(cuda_status(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"));
  if (!cuda::kernels_runnable()) {
    return unavailable(fmt::format("this build has no kernels for {} (sm_{}{}); it targets sm_90a", prop.name,
                                   prop.major, prop.minor));
  }
  MOEINFER_RETURN_IF_ERROR(cuda_status(cuda::prepare_expert_major_kernels(), "expert-major kernel attributes"));
  Result<Plan> plan = plan_cuda(d, layer.expert_spec, max_tokens, DeviceDesc{prop.major, prop.minor}, path);
  if (!plan.ok()) return plan.status();

  auto impl = std::make_unique<Impl>();
  impl->desc = d;
  impl->plan = *plan;
  impl->layer_id = layer.id();
  impl->rank = options.rank;
  impl->ranks = options.ranks;

  // Experts: table index e < E for routed experts, E for the shared expert. Another rank's
  // experts stay empty entries: no kernel reaches them (owned_begin/owned_end below).
  std::vector<cuda::DevExpert> table(static_cast<size_t>(d.num_experts));
  table.reserve(static_cast<size_t>(d.num_experts) + 1);
  // Weight tiles by default where every call runs expert-major, whose loads they are made for.
  const bool expert_major_only = impl->plan.path == PathKind::kExpertMajor && impl->plan.small_path == PathKind::kExpertMajor;
  UploadScratch tile_scratch;
  UploadScratch* tiles = options.weight_tiles.value_or(expert_major_only) ? &tile_scratch : nullptr;
  // The slice's experts generated or read on all threads first (Layer::load_experts), then
  // uploaded in order; the progress counts both, two steps per expert.
  const int64_t steps = 2 * int64_t{slice.end - slice.begin};
  {
    std::vector<int> ids(static_cast<size_t>(slice.end - slice.begin));
    std::iota(ids.begin(), ids.end(), slice.begin);
    const ProgressFn loaded = [&](int64_t done, int64_t) { progress(done, steps); };
    MOEINFER_RETURN_IF_ERROR(layer.load_experts(ids, progress ? loaded : ProgressFn{}));
  }
  for (int e = slice.begin; e < slice.end; ++e) {
    Result<const ExpertWeights*> w = layer.expert(e);
    if (!w.ok()) return w.status();
    Result<cuda::DevExpert> dev = upload_expert(impl->weights, **w, tiles);
    if (!dev.ok()) return dev.status();
    table[static_cast<size_t>(e)] = *dev;
    if (progress) progress(steps / 2 + e + 1 - slice.begin, steps);
  }
  if (layer.shared && adds_once) {
    Result<cuda::DevExpert> dev = upload_expert(impl->weights, *layer.shared, tiles);
    if (!dev.ok()) return dev.status();
    table.push_back(*dev);
  }
  for (const cuda::DevExpert& x : table) {
    if (x.gate.rows == 0) continue;  // another rank's expert
    impl->expert_matrices += 3;
    impl->tiled_matrices += int{x.gate.tiled} + int{x.up.tiled} + int{x.down.tiled};
  }
  Result<const cuda::DevExpert*> experts = impl->weights.upload(table);
  if (!experts.ok()) return experts.status();

  // Expert-major runs gate and up of an expert in one MMA loop, so they must share a format.
  std::string mixed;
  for (size_t e = 0; e < table.size() && mixed.empty(); ++e) {
    const cuda::DevMatrix& g = table[e].gate;
    const cuda::DevMatrix& u = table[e].up;
    if (g.format != u.format || (g.format == static_cast<uint8_t>(WeightFormat::kFP8) && g.fp8_scaling != u.fp8_scaling)) {
      mixed = fmt::format("{}: gate_proj and up_proj are stored in different formats",
                          e < static_cast<size_t>(d.num_experts) ? fmt::format("expert {}", e) : "the shared expert");
    }
  }
  Plan& planned = impl->plan;
  if (!mixed.empty() && (planned.path == PathKind::kExpertMajor || planned.small_path == PathKind::kExpertMajor)) {
    if (path) return unsupported("path expert-major cannot run this layer: " + mixed);
    Result<Plan> fallback = plan_cuda(d, layer.expert_spec, max_tokens, DeviceDesc{prop.major, prop.minor},
                                      PathKind::kTokenMajor);
    if (!fallback.ok()) {
      fallback = plan_cuda(d, layer.expert_spec, max_tokens, DeviceDesc{prop.major, prop.minor}, PathKind::kPerRow);
    }
    if (!fallback.ok()) return fallback.status();
    planned = *fallback;
    planned.reasons = {"expert-major refused: " + mixed, std::string(path_name(planned.path)) + " runs it instead"};
  }

  cuda::DevLayer& L = impl->dev;
  L.hidden = static_cast<int32_t>(d.hidden);
  cuda::set_routing(d, L);
  L.act_stride = static_cast<int32_t>(std::max(d.intermediate, d.shared_intermediate));
  L.activation = static_cast<uint8_t>(d.activation);
  // Ranks other than 0 neither run the shared expert nor compute its gate.
  L.has_shared = d.has_shared() && adds_once;
  L.shared_gate = d.shared_gate && adds_once;
  L.owned_begin = slice.begin;
  L.owned_end = slice.end;
  L.adds_once = adds_once;
  L.swiglu_alpha = d.swiglu_alpha;
  L.swiglu_limit = d.swiglu_limit;
  L.sm_count = prop.multiProcessorCount;
  MOEINFER_RETURN_IF_ERROR(cuda_status(cuda::blend_resident_per_sm(&L.blend_resident), "blend occupancy"));
  MOEINFER_RETURN_IF_ERROR(cuda_status(cuda::route_token_blocks_max(L, &L.route_token_blocks), "route cluster size"));
  L.staged = options.staged ? static_cast<int8_t>(*options.staged) : int8_t{-1};
  L.staged_passes = options.staged_passes ? static_cast<int8_t>(*options.staged_passes) : int8_t{0};
  L.staged_ahead = options.staged_ahead ? static_cast<int8_t>(*options.staged_ahead) : int8_t{0};
  L.mixed_tiles = options.mixed_tiles ? static_cast<int8_t>(*options.mixed_tiles) : int8_t{-1};
  L.shared_apart = options.shared_apart ? static_cast<int8_t>(*options.shared_apart) : int8_t{-1};
  L.early_gate_up = options.early_gate_up ? static_cast<int8_t>(*options.early_gate_up) : int8_t{-1};
  L.early_down = options.early_down ? static_cast<int8_t>(*options.early_down) : int8_t{-1};
  L.item_release = options.item_release ? static_cast<int8_t>(*options.item_release) : int8_t{-1};
  L.routed_expert_bytes = layer.routed_expert_bytes();
  L.shared_expert_bytes = layer.shared ? layer.shared->bytes() : 0;
  L.nvfp4 = std::any_of(table.begin(), table.end(), [](const cuda::DevExpert& x) {
    return x.gate.format == static_cast<uint8_t>(WeightFormat::kNVFP4) ||
           x.down.format == static_cast<uint8_t>(WeightFormat::kNVFP4);
  });
  L.weight_tiles = impl->tiled_matrices > 0;
  // The K loop every (owned) expert's down takes, and its gate and up, where they agree: a fused
  // down of many items runs one loop for all of them (expert_major_down_blend_ways), and the
  // split-K kernels run a build of one loop, whose fewer registers hold more blocks per SM.
  L.down_path = static_cast<int8_t>(
      cuda::common_path(table.data(), table.size(), [](const cuda::DevExpert& x) { return cuda::weight_path(x.down); }));
  L.gate_up_path = static_cast<int8_t>(cuda::common_path(table.data(), table.size(), [](const cuda::DevExpert& x) {
    const int gate = cuda::weight_path(x.gate);
    return gate == cuda::weight_path(x.up) ? gate : cuda::kPathAny;
  }));
  Result<cuda::DevMatrix> router = upload_matrix(impl->weights, layer.router, layer.router_bias);
  if (!router.ok()) return router.status();
  L.router = *router;
  Result<const float*> cb = impl->weights.upload(layer.correction_bias);
  if (!cb.ok()) return cb.status();
  L.correction_bias_values = *cb;
  Result<const float*> sg = impl->weights.upload(layer.shared_gate);
  if (!sg.ok()) return sg.status();
  L.shared_gate_values = *sg;
  if (d.shared_gate) {
    // The gate vector in three bf16 rows for the tensor-core router: each part what the ones
    // before it left of g, so that hi + mid + lo = g to fp32's precision.
    const size_t h = layer.shared_gate.size();  // = hidden (layer.check())
    std::vector<uint16_t> parts(3 * h);
    for (size_t c = 0; c < h; ++c) {
      float left = layer.shared_gate[c];
      for (size_t p = 0; p < 3; ++p) {
        parts[p * h + c] = bf16_from_float(left);
        left -= bf16_to_float(parts[p * h + c]);
      }
    }
    Result<const uint16_t*> split = impl->weights.upload(parts);
    if (!split.ok()) return split.status();
    L.shared_gate_bf16x3 = *split;
  }
  L.router_mma = options.router_mma ? static_cast<int8_t>(*options.router_mma) : int8_t{-1};
  L.router_mma_tokens = router_mma_fits ? static_cast<int32_t>(std::min<int64_t>(max_tokens, cuda::kRouterMmaMaxTokens)) : 0;
  L.experts = *experts;

  // Scratch for max_tokens, planned once: forward allocates nothing.
  const int64_t routes = max_tokens * d.top_k + (d.has_shared() ? max_tokens : 0);
  const auto alloc = [&](int64_t bytes) -> Result<void*> { return impl->scratch.alloc(static_cast<size_t>(bytes)); };
  Result<void*> logits = alloc(max_tokens * d.router_outputs() * 4);
  Result<void*> ids = alloc(max_tokens * d.top_k * 4);
  Result<void*> weights = alloc(max_tokens * d.top_k * 4);
  Result<void*> gate = alloc(max_tokens * 4);
  Result<void*> act = alloc(routes * L.act_stride * 4);
  Result<void*> yout = alloc(routes * d.hidden * 4);
  const int table_size = d.num_experts + (d.has_shared() ? 1 : 0);
  Result<void*> x_bf16 = alloc(max_tokens * d.hidden * 2);
  Result<void*> act_bf16 = alloc(routes * L.act_stride * 2);
  Result<void*> route_list = alloc(routes * 4);
  const int64_t items_bytes = int64_t{cuda::expert_major_item_capacity(static_cast<int>(routes), table_size)} * 16;
  Result<void*> items = alloc(items_bytes);
  Result<void*> num_items = alloc(8);  // the one-tile items' count, and a mixed call's hot items'
  const int64_t item_counts_bytes = items_bytes / 16 * 4;
  Result<void*> item_tiles_done = alloc(item_counts_bytes);
  Result<void*> blocks_done = alloc(12);  // the route kernel's finish line, then items_published's flag and count
  // The shared expert's own chain (cuda::expert_major_shared_apart): its items, count, route list
  // and bf16 x, where this rank runs it.
  const int64_t apart_tokens = L.has_shared ? max_tokens : 0;
  const int64_t apart_items_bytes = int64_t{cuda::shared_apart_max_items(static_cast<int>(apart_tokens))} * 16;
  Result<void*> apart_items = alloc(apart_items_bytes);
  Result<void*> apart_count = alloc(4);
  Result<void*> apart_routes = alloc(apart_tokens * 4);
  Result<void*> apart_x = alloc(apart_tokens * d.hidden * 2);
  // The tensor-core router's per-slice sums and its counters per (row group, token group).
  const int64_t router_groups = cuda::router_mma_row_groups(d.router_outputs(), d.shared_gate);
  const int64_t router_counters = router_groups * cuda::router_mma_token_groups(L.router_mma_tokens);
  Result<void*> router_partials =
      alloc(int64_t{cuda::router_mma_slices(static_cast<int>(d.hidden))} * L.router_mma_tokens * router_groups *
            cuda::kRouterMmaRows * 4);
  Result<void*> router_done = alloc(router_counters * 4);
  for (const Result<void*>* r : {&logits, &ids, &weights, &gate, &act, &yout, &x_bf16, &act_bf16, &route_list, &items,
                                 &num_items, &item_tiles_done, &blocks_done, &router_partials, &router_done,
                                 &apart_items, &apart_count, &apart_routes, &apart_x}) {
    if (!r->ok()) return r->status();
  }
  impl->ws.x_bf16 = static_cast<uint16_t*>(*x_bf16);
  impl->ws.act_bf16 = static_cast<uint16_t*>(*act_bf16);
  impl->ws.route_list = static_cast<int32_t*>(*route_list);
  impl->ws.items = static_cast<int4*>(*items);
  impl->ws.num_items = static_cast<int32_t*>(*num_items);
  impl->ws.item_tiles_done = static_cast<int32_t*>(*item_tiles_done);
  MOEINFER_RETURN_IF_ERROR(
      cuda_status(cudaMemset(*item_tiles_done, 0, static_cast<size_t>(item_counts_bytes)), "cudaMemset"));
  MOEINFER_RETURN_IF_ERROR(create_side_stream(impl->side));
  if (L.has_shared) {
    cuda::SharedApart& apart = impl->shared;
    apart.items = static_cast<int4*>(*apart_items);
    apart.num_items = static_cast<int32_t*>(*apart_count);
    apart.route_list = static_cast<int32_t*>(*apart_routes);
    apart.x_bf16 = static_cast<uint16_t*>(*apart_x);
    MOEINFER_RETURN_IF_ERROR(create_side_stream(apart.side));
    // Its GEMMs too read an item beside the count, also in slots past it.
    MOEINFER_RETURN_IF_ERROR(
        cuda_status(cudaMemset(*apart_items, 0, static_cast<size_t>(apart_items_bytes)), "cudaMemset"));
  }
  impl->ws.route_blocks_done = static_cast<int32_t*>(*blocks_done);
  impl->ws.items_published = impl->ws.route_blocks_done + 1;  // passed to the kernels per call (forward)
  MOEINFER_RETURN_IF_ERROR(cuda_status(cudaMemset(*blocks_done, 0, 12), "cudaMemset"));
  impl->ws.router_partials = static_cast<float*>(*router_partials);
  impl->ws.router_slices_done = static_cast<int32_t*>(*router_done);
  MOEINFER_RETURN_IF_ERROR(
      cuda_status(cudaMemset(*router_done, 0, static_cast<size_t>(router_counters) * 4), "cudaMemset"));
  // The GEMM kernels read their item beside the item count, also in slots past it.
  MOEINFER_RETURN_IF_ERROR(cuda_status(cudaMemset(*items, 0, static_cast<size_t>(items_bytes)), "cudaMemset"));
  impl->ws.logits = static_cast<float*>(*logits);
  impl->ws.ids = static_cast<int32_t*>(*ids);
  impl->ws.weights = static_cast<float*>(*weights);
  impl->ws.shared_gate = static_cast<float*>(*gate);
  impl->ws.act = static_cast<float*>(*act);
  impl->ws.expert_out = static_cast<float*>(*yout);
  MOEINFER_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "upload"));
  return std::unique_ptr<CudaMoe>(new CudaMoe(std::move(impl)));
}

Status CudaMoe::forward(const float* x, int64_t n, float* out, void* stream) const {
  if (n < 1 || n > impl_->plan.max_tokens) {
    return invalid_argument(fmt::format("{} tokens: this CudaMoe was planned for 1 to {}", n, impl_->plan.max_tokens));
  }
  if (x == nullptr || out == nullptr) return invalid_argument("forward: null input or output pointer");
  // Where H % 8 == 0 every path's router (and token-major's dot products) reads x 16 bytes at a
  // time; a pointer off that alignment would fault on the device.
  if (impl_->dev.hidden % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 != 0) {
    return invalid_argument(fmt::format("forward: x ({}) is not 16-byte aligned; hidden size {} is read 16 bytes at a time",
                                        static_cast<const void*>(x), impl_->dev.hidden));
  }
  const auto s = static_cast<cudaStream_t>(stream);
  const int tokens = static_cast<int>(n);
  const PathKind path = impl_->plan.path_for(n);
  // Expert-major: one decision (routes per item, grid, kernels) for the route kernel's grouping
  // and the GEMMs.
  const cuda::ExpertMajorLaunch call =
      path == PathKind::kExpertMajor ? cuda::expert_major_launch(impl_->dev, tokens) : cuda::ExpertMajorLaunch{};
  const int group = path == PathKind::kExpertMajor ? call.group : 0;
  cuda::DevWorkspace ws = impl_->ws;
  if (call.mixed) {
    ws.hot_items = ws.items + call.hot_offset;
    ws.hot_num_items = ws.num_items + 1;
  }
  ws.shared_apart = call.shared_apart;
  // Where the fused down starts during a gate_up that selects, gate_up flags the items it publishes
  // and the down waits for the flag; in any other call nothing would lower a flag raised.
  if (!(call.early_down && cuda::expert_major_published_down(call))) ws.items_published = nullptr;
  if (call.shared_apart) {  // forked before the router, so that its chain runs beside the router's
    MOEINFER_RETURN_IF_ERROR(cuda_status(
        cuda::launch_moe_shared_apart(impl_->dev, x, tokens, ws, call, impl_->shared, s), "shared expert apart"));
  }
  MOEINFER_RETURN_IF_ERROR(
      cuda_status(cuda::launch_moe_route(impl_->dev, x, tokens, ws, group, s, !call.gate_up_selects), "moe_route"));
  switch (path) {
    case PathKind::kTokenMajor:
      return cuda_status(cuda::launch_moe_token_major(impl_->dev, x, tokens, impl_->ws, out, s), "token-major");
    case PathKind::kPerRow:
      return cuda_status(cuda::launch_moe_per_row(impl_->dev, x, tokens, impl_->ws, out, s), "per-row");
    case PathKind::kExpertMajor:
      return cuda_status(
          cuda::launch_moe_expert_major(impl_->dev, x, tokens, ws, call, impl_->side, impl_->shared, out, s),
          "expert-major");
  }
  return internal_error("unknown path");
}

namespace {

// Under expert parallelism (reduce set), this rank's slice runs here and the partial outputs are
// summed over the ranks before the copy back.
class CudaBackend final : public Backend {
 public:
  CudaBackend(std::optional<PathKind> path, std::unique_ptr<CudaAllReduce> reduce, EpStats* stats)
      : path_(path), reduce_(std::move(reduce)), stats_(stats) {}
  ~CudaBackend() override {
    release();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    for (cudaEvent_t e : {reduce_start_, reduce_stop_}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  BackendKind kind() const override { return BackendKind::kCuda; }

  Status prepare(const Layer& layer, int64_t max_tokens, const ProgressFn& progress) override {
    if (moe_ && moe_->layer_id() == layer.id() && max_tokens <= moe_->plan().max_tokens) return {};
    release();
    if (stream_ == nullptr) {
      MOEINFER_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    }
    CudaMoeOptions options{.path = path_};
    if (reduce_) {
      options.rank = reduce_->rank();
      options.ranks = reduce_->ranks();
    }
    Result<std::unique_ptr<CudaMoe>> made = CudaMoe::create(layer, max_tokens, options, progress);
    if (!made.ok()) return made.status();
    moe_ = std::move(made).value();
    const size_t bytes = static_cast<size_t>(max_tokens * layer.desc.hidden) * sizeof(float);
    MOEINFER_RETURN_IF_ERROR(cuda_status(cudaMalloc(&x_, bytes), "cudaMalloc input"));
    return cuda_status(cudaMalloc(&out_, bytes), "cudaMalloc output");
  }

  Status forward(const Layer& layer, std::span<const float> x, int64_t n, std::span<float> out,
                 ForwardInfo* info) override {
    const int64_t h = layer.desc.hidden;
    if (n < 1) return invalid_argument(fmt::format("token count must be positive (got {})", n));
    if (static_cast<int64_t>(x.size()) != n * h || static_cast<int64_t>(out.size()) != n * h) {
      return invalid_argument(fmt::format("input/output hold {}/{} values, {} tokens of hidden size {} need {}",
                                          x.size(), out.size(), n, h, n * h));
    }
    if (!moe_ || moe_->layer_id() != layer.id() || n > moe_->plan().max_tokens) {
      MOEINFER_RETURN_IF_ERROR(prepare(layer, std::max<int64_t>(n, 64), {}));
    }
    const size_t bytes = x.size() * sizeof(float);
    MOEINFER_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyAsync(x_, x.data(), bytes, cudaMemcpyHostToDevice, stream_), "copy input"));
    MOEINFER_RETURN_IF_ERROR(moe_->forward(x_, n, out_, stream_));
    if (reduce_) MOEINFER_RETURN_IF_ERROR(sum_ranks(n * h));
    MOEINFER_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyAsync(out.data(), out_, bytes, cudaMemcpyDeviceToHost, stream_), "copy output"));
    MOEINFER_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream_), "forward"));
    if (reduce_ && stats_ != nullptr) {
      float ms = 0;
      MOEINFER_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&ms, reduce_start_, reduce_stop_), "all-reduce time"));
      stats_->reduce_seconds += static_cast<double>(ms) * 1e-3;
      ++stats_->reduces;
    }
    if (info != nullptr) {
      info->path = path_name(moe_->plan().path_for(n));
      info->detail = fmt::format("{:.1f} MiB of weights on the device", static_cast<double>(moe_->weight_bytes()) / (1 << 20));
      if (reduce_) info->detail += fmt::format(", rank {} of {}", reduce_->rank(), reduce_->ranks());
      info->plan = moe_->plan().explain();
    }
    return {};
  }

 private:
  void release() {
    moe_.reset();
    cudaFree(x_);
    cudaFree(out_);
    x_ = out_ = nullptr;
  }

  // The all-reduce of out_, between two events when it is timed.
  Status sum_ranks(int64_t count) {
    const bool timed = stats_ != nullptr;
    if (timed && reduce_start_ == nullptr) {
      MOEINFER_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&reduce_start_), "cudaEventCreate"));
      MOEINFER_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&reduce_stop_), "cudaEventCreate"));
    }
    if (timed) MOEINFER_RETURN_IF_ERROR(cuda_status(cudaEventRecord(reduce_start_, stream_), "cudaEventRecord"));
    MOEINFER_RETURN_IF_ERROR(reduce_->sum(out_, count, stream_));
    if (timed) MOEINFER_RETURN_IF_ERROR(cuda_status(cudaEventRecord(reduce_stop_, stream_), "cudaEventRecord"));
    return {};
  }

  std::optional<PathKind> path_;
  std::unique_ptr<CudaAllReduce> reduce_;
  EpStats* stats_ = nullptr;
  std::unique_ptr<CudaMoe> moe_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t reduce_start_ = nullptr;
  cudaEvent_t reduce_stop_ = nullptr;
  float* x_ = nullptr;
  float* out_ = nullptr;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cuda_backend(std::optional<PathKind> path) {
  return std::unique_ptr<Backend>(new CudaBackend(path, nullptr, nullptr));
}

Result<std::unique_ptr<Backend>> make_cuda_ep_backend(std::optional<PathKind> path, EpStats* stats) {
  MOEINFER_RETURN_IF_ERROR(cuda_use_rank_device());
  Result<std::unique_ptr<CudaAllReduce>> reduce = CudaAllReduce::create();
  if (!reduce.ok()) return reduce.status();
  return std::unique_ptr<Backend>(new CudaBackend(path, std::move(reduce).value(), stats));
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

Status cuda_use_rank_device() {
  const int count = cuda_device_count();
  const int local = ep_local_rank();
  if (local >= count) {
    return unavailable(fmt::format("rank {} is local rank {} of its host, which has {} GPU{}: expert parallelism on "
                                   "GPUs needs one GPU per rank",
                                   ep_rank(), local, count, count == 1 ? "" : "s"));
  }
  return cuda_status(cudaSetDevice(local), "cudaSetDevice");
}

}  // namespace moeinfer
