#include "moeinfer/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace moeinfer {

int64_t ExpertWeights::bytes() const {
  const auto floats = static_cast<int64_t>(gate_bias.size() + up_bias.size() + down_bias.size());
  return gate.bytes() + up.bytes() + down.bytes() + floats * 4;
}

namespace {

Status check_shape(const QuantMatrix& m, int64_t rows, int64_t cols, std::string_view name) {
  if (m.rows != rows || m.cols != cols) {
    return invalid_argument(
        fmt::format("{}: shape [{}, {}], the layer needs [{}, {}]", name, m.rows, m.cols, rows, cols));
  }
  return m.check(name);
}

Status check_vector(const std::vector<float>& v, int64_t size, bool wanted, std::string_view name) {
  if (!wanted) {
    if (!v.empty()) {
      return invalid_argument(fmt::format("{} is present but the layer description has none", name));
    }
    return {};
  }
  if (static_cast<int64_t>(v.size()) != size) {
    return invalid_argument(fmt::format("{}: {} values, the layer needs {}", name, v.size(), size));
  }
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      return Status(StatusCode::kCorruptData, fmt::format("{}[{}] is not finite ({})", name, i, v[i]));
    }
  }
  return {};
}

}  // namespace

Status check_expert(const ExpertWeights& w, const LayerDesc& desc, int64_t intermediate,
                    bool with_bias, std::string_view name) {
  const bool bias = with_bias;
  MOEINFER_RETURN_IF_ERROR(check_shape(w.gate, intermediate, desc.hidden, fmt::format("{} gate_proj", name)));
  MOEINFER_RETURN_IF_ERROR(check_shape(w.up, intermediate, desc.hidden, fmt::format("{} up_proj", name)));
  MOEINFER_RETURN_IF_ERROR(check_shape(w.down, desc.hidden, intermediate, fmt::format("{} down_proj", name)));
  MOEINFER_RETURN_IF_ERROR(check_vector(w.gate_bias, intermediate, bias, fmt::format("{} gate_proj bias", name)));
  MOEINFER_RETURN_IF_ERROR(check_vector(w.up_bias, intermediate, bias, fmt::format("{} up_proj bias", name)));
  MOEINFER_RETURN_IF_ERROR(check_vector(w.down_bias, desc.hidden, bias, fmt::format("{} down_proj bias", name)));
  return {};
}

struct Layer::Cache {
  std::mutex mutex;
  std::vector<std::unique_ptr<ExpertWeights>> experts;
};

namespace {
std::atomic<uint64_t> next_layer_id{1};

// Whether this is the first thread of the parallel region it runs in (or of none).
bool first_thread() {
#ifdef _OPENMP
  return omp_get_thread_num() == 0;
#else
  return true;
#endif
}
}  // namespace

Layer::Layer(LayerDesc d, ExpertLoader loader)
    : desc(d), id_(next_layer_id.fetch_add(1)), loader_(std::move(loader)), cache_(std::make_unique<Cache>()) {
  cache_->experts.resize(static_cast<size_t>(std::max(d.num_experts, 0)));
}
Layer::Layer(Layer&&) noexcept = default;
Layer& Layer::operator=(Layer&&) noexcept = default;
Layer::~Layer() = default;

Result<const ExpertWeights*> Layer::expert(int e) const {
  if (e < 0 || e >= desc.num_experts) {
    return invalid_argument(fmt::format("expert id {} out of range [0, {})", e, desc.num_experts));
  }
  auto& slot = cache_->experts[static_cast<size_t>(e)];
  {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    if (slot) return static_cast<const ExpertWeights*>(slot.get());
  }
  if (!loader_) return internal_error(fmt::format("layer has no loader for expert {}", e));
  // Loaded outside the lock, so that threads load different experts at once (load_experts); two
  // threads after the same expert both load it, and the first to finish keeps its copy.
  Result<ExpertWeights> loaded = loader_(e);
  if (!loaded.ok()) return loaded.status().with_context(fmt::format("expert {}", e));
  MOEINFER_RETURN_IF_ERROR(check_expert(*loaded, desc, desc.intermediate, desc.expert_bias, fmt::format("expert {}", e)));
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (!slot) slot = std::make_unique<ExpertWeights>(std::move(loaded).value());
  return static_cast<const ExpertWeights*>(slot.get());
}

Status Layer::load_experts(std::span<const int> ids, const ProgressFn& progress) const {
  std::vector<int> unique(ids.begin(), ids.end());
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  const auto count = static_cast<int64_t>(unique.size());
  // One expert per thread. Inside an expert only the matrix loops were split over the threads:
  // DeepSeek-V3's 256 NVFP4 experts took 63-71 s to make and upload on the H200 machine's 16
  // cores that way, 27.5 s this way (docs/PERF.md, v3.24). The loops inside an expert then run on
  // its thread (nested parallel regions are off by default).
  std::vector<Status> failed(unique.size());
  std::atomic<int64_t> done{0};
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
  for (int64_t i = 0; i < count; ++i) {
    Result<const ExpertWeights*> w = expert(unique[static_cast<size_t>(i)]);
    if (!w.ok()) failed[static_cast<size_t>(i)] = w.status();
    const int64_t now = done.fetch_add(1) + 1;
    if (progress && first_thread()) progress(now, count);  // the callback runs on one thread
  }
  for (const Status& s : failed) {
    if (!s.ok()) return s;  // the first failure in expert order, whichever thread met it first
  }
  if (progress && count > 0) progress(count, count);
  return {};
}

int Layer::loaded_experts() const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  return static_cast<int>(std::count_if(cache_->experts.begin(), cache_->experts.end(),
                                        [](const auto& p) { return p != nullptr; }));
}

Status Layer::check() const {
  MOEINFER_RETURN_IF_ERROR(validate(desc, expert_spec));
  MOEINFER_RETURN_IF_ERROR(check_shape(router, desc.router_outputs(), desc.hidden, "router"));
  MOEINFER_RETURN_IF_ERROR(
      check_vector(router_bias, desc.router_outputs(), desc.routing.router_bias, "router bias"));
  MOEINFER_RETURN_IF_ERROR(check_vector(correction_bias, desc.router_outputs(),
                                        desc.routing.correction_bias, "e_score_correction_bias"));
  if (shared.has_value() != desc.has_shared()) {
    return invalid_argument(desc.has_shared() ? "the layer has a shared expert but no weights for it"
                                              : "shared expert weights given but the layer has none");
  }
  if (shared) {
    MOEINFER_RETURN_IF_ERROR(check_expert(*shared, desc, desc.shared_intermediate, false, "shared expert"));
  }
  MOEINFER_RETURN_IF_ERROR(check_vector(shared_gate, desc.hidden, desc.shared_gate, "shared_expert_gate"));
  return {};
}

int64_t Layer::routed_expert_bytes() const {
  const int64_t matrices = 2 * quantized_bytes(expert_spec, desc.intermediate, desc.hidden) +
                           quantized_bytes(expert_spec, desc.hidden, desc.intermediate);
  const int64_t biases = desc.expert_bias ? (2 * desc.intermediate + desc.hidden) * 4 : 0;
  return matrices + biases;
}

int64_t Layer::resident_bytes() const {
  int64_t total = router.bytes();
  total += static_cast<int64_t>(router_bias.size() + correction_bias.size() + shared_gate.size()) * 4;
  if (shared) total += shared->bytes();
  return total;
}

}  // namespace moeinfer
