// The weights of one MoE layer. Routed experts are produced on demand by an ExpertLoader
// (a preset generates expert e from its seed, a checkpoint reads it) and cached, so a layer of
// DeepSeek-V3's size costs memory only for the experts a run touches.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "moeinfer/format.h"
#include "moeinfer/layer.h"
#include "moeinfer/status.h"

namespace moeinfer {

struct ExpertWeights {
  QuantMatrix gate;  // [I, H]
  QuantMatrix up;    // [I, H]
  QuantMatrix down;  // [H, I]
  // Only when LayerDesc::expert_bias: [I], [I], [H].
  std::vector<float> gate_bias;
  std::vector<float> up_bias;
  std::vector<float> down_bias;

  int64_t bytes() const;
};

// Checks an expert's shapes against the layer. Routed experts carry biases iff
// desc.expert_bias; no family has a biased shared expert. `name` is "expert 3" or
// "shared expert".
Status check_expert(const ExpertWeights& w, const LayerDesc& desc, int64_t intermediate,
                    bool with_bias, std::string_view name);

using ExpertLoader = std::function<Result<ExpertWeights>(int expert)>;
// Called after each expert is loaded: (done, total).
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

class Layer {
 public:
  Layer(LayerDesc desc, ExpertLoader loader);
  Layer(Layer&&) noexcept;
  Layer& operator=(Layer&&) noexcept;
  ~Layer();

  LayerDesc desc;
  QuantSpec expert_spec;                // the format the routed experts are stored in
  QuantMatrix router;                   // [E + Z, H]
  std::vector<float> router_bias;       // [E + Z], iff desc.routing.router_bias
  std::vector<float> correction_bias;   // [E + Z], iff desc.routing.correction_bias
  std::optional<ExpertWeights> shared;  // iff desc.has_shared()
  std::vector<float> shared_gate;       // [H], iff desc.shared_gate

  // Routed expert e (0 <= e < E), loaded and shape-checked on first use. Thread-safe.
  Result<const ExpertWeights*> expert(int e) const;
  // Loads the given experts now, one per thread, reporting progress (from one thread). Every
  // expert is tried; the first failure in expert order is returned.
  Status load_experts(std::span<const int> ids, const ProgressFn& progress = {}) const;
  int loaded_experts() const;

  // Unique per constructed Layer (kept across moves): lets a backend tell whether the layer it
  // uploaded is the one it is given.
  uint64_t id() const { return id_; }

  // Checks desc and every resident tensor (router, biases, shared expert) against it.
  Status check() const;

  // Bytes of one routed expert and of the non-expert parts, as stored.
  int64_t routed_expert_bytes() const;
  int64_t resident_bytes() const;

 private:
  struct Cache;
  uint64_t id_;
  ExpertLoader loader_;
  std::unique_ptr<Cache> cache_;
};

}  // namespace moeinfer
