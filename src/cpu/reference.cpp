// The CPU reference: DESIGN.md sections 1 and 2, one step at a time, in double.
#include "moeinfer/reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/parallel.h"

namespace moeinfer {

namespace {

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// Indices of the k largest keys, best first; equal keys go to the lower index.
std::vector<int> top_k_indices(std::span<const double> keys, int k) {
  std::vector<int> order(keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return keys[a] > keys[b]; });
  order.resize(static_cast<size_t>(k));
  return order;
}

std::vector<double> softmax(std::span<const double> v) {
  const double m = *std::max_element(v.begin(), v.end());
  std::vector<double> out(v.size());
  double sum = 0.0;
  for (size_t i = 0; i < v.size(); ++i) sum += out[i] = std::exp(v[i] - m);
  for (double& o : out) o /= sum;
  return out;
}

// out[r] = sum_c W[r, c] * in[c] (+ bias[r]), weights dequantized a row at a time. Rows are
// independent sums, so splitting them over threads changes no result.
void matvec(const QuantMatrix& w, std::span<const float> bias, std::span<const double> in,
            std::span<double> out) {
#pragma omp parallel for schedule(static) if (w.rows * w.cols >= kParallelMinElements)
  for (int64_t r = 0; r < w.rows; ++r) {
    thread_local std::vector<float> row;
    row.resize(static_cast<size_t>(w.cols));
    w.dequantize_row(r, row.data());
    double acc = bias.empty() ? 0.0 : bias[static_cast<size_t>(r)];
    for (int64_t c = 0; c < w.cols; ++c) acc += static_cast<double>(row[static_cast<size_t>(c)]) * in[static_cast<size_t>(c)];
    out[static_cast<size_t>(r)] = acc;
  }
}

double activate(const LayerDesc& d, double g, double u) {
  switch (d.activation) {
    case Activation::kSiluGated:
      return g * sigmoid(g) * u;
    case Activation::kGptOssClamped: {
      const double limit = d.swiglu_limit;
      g = std::min(g, limit);
      u = std::clamp(u, -limit, limit);
      return (u + 1.0) * g * sigmoid(static_cast<double>(d.swiglu_alpha) * g);
    }
  }
  return 0.0;
}

// expert(x) = down(act(gate x, up x)), biases where the expert has them.
std::vector<double> expert_forward(const LayerDesc& d, const ExpertWeights& w,
                                   std::span<const double> x) {
  const auto inter = static_cast<size_t>(w.gate.rows);
  std::vector<double> g(inter), u(inter), a(inter), y(static_cast<size_t>(d.hidden));
  matvec(w.gate, w.gate_bias, x, g);
  matvec(w.up, w.up_bias, x, u);
  for (size_t i = 0; i < inter; ++i) a[i] = activate(d, g[i], u[i]);
  matvec(w.down, w.down_bias, a, y);
  return y;
}

}  // namespace

Status moe_select_reference(const LayerDesc& d, std::span<const double> logits,
                            std::span<const float> correction_bias, std::span<int> ids,
                            std::span<double> weights) {
  const RoutingDesc& r = d.routing;
  const auto outputs = static_cast<size_t>(d.router_outputs());
  if (logits.size() != outputs) {
    return invalid_argument(fmt::format("{} router logits for {} router outputs", logits.size(), outputs));
  }
  if (ids.size() != static_cast<size_t>(d.top_k) || weights.size() != ids.size()) {
    return invalid_argument(fmt::format("selection output holds {} slots, top_k is {}", ids.size(), d.top_k));
  }
  if (r.correction_bias && correction_bias.size() != outputs) {
    return invalid_argument(fmt::format("e_score_correction_bias has {} values, the router has {} outputs",
                                        correction_bias.size(), outputs));
  }

  // 1. Scores.
  std::vector<double> s(logits.begin(), logits.end());
  if (r.score == ScoreFunc::kSoftmax) s = softmax(logits);
  if (r.score == ScoreFunc::kSigmoid) {
    for (double& v : s) v = sigmoid(v);
  }

  // 2. Selection keys: the score, plus the correction bias when the family has one.
  std::vector<double> key = s;
  if (r.correction_bias) {
    for (size_t i = 0; i < outputs; ++i) key[i] += correction_bias[i];
  }

  // 3. Group-limited selection: keep the topk_group groups whose two best keys sum highest;
  //    every expert of another group gets key -inf and so is never chosen.
  if (r.n_group > 1) {
    const size_t group_size = static_cast<size_t>(d.num_experts / r.n_group);
    std::vector<double> group_score(static_cast<size_t>(r.n_group));
    for (size_t g = 0; g < group_score.size(); ++g) {
      std::span<const double> members(key.data() + g * group_size, group_size);
      const std::vector<int> best = top_k_indices(members, 2);
      group_score[g] = members[static_cast<size_t>(best[0])] + members[static_cast<size_t>(best[1])];
    }
    const std::vector<int> kept = top_k_indices(group_score, r.topk_group);
    for (size_t g = 0; g < group_score.size(); ++g) {
      if (std::find(kept.begin(), kept.end(), static_cast<int>(g)) != kept.end()) continue;
      for (size_t i = g * group_size; i < (g + 1) * group_size; ++i) {
        key[i] = -std::numeric_limits<double>::infinity();
      }
    }
  }

  // 4. The k best keys.
  const std::vector<int> chosen = top_k_indices(key, d.top_k);

  // 5. Weights of the chosen experts.
  std::vector<double> w(chosen.size());
  for (size_t j = 0; j < chosen.size(); ++j) w[j] = s[static_cast<size_t>(chosen[j])];
  if (r.weight == WeightFunc::kSoftmaxOfSelected) w = softmax(w);
  if (r.weight == WeightFunc::kSigmoidOfSelected) {
    for (double& v : w) v = sigmoid(v);
  }
  if (r.renormalize) {
    const double sum = std::accumulate(w.begin(), w.end(), 0.0);
    for (double& v : w) v /= sum + r.renorm_epsilon;
  }
  for (double& v : w) v *= r.scaling;

  std::copy(chosen.begin(), chosen.end(), ids.begin());
  std::copy(w.begin(), w.end(), weights.begin());
  return {};
}

Status moe_check_input(const LayerDesc& desc, std::span<const float> x, int64_t n) {
  const int64_t h = desc.hidden;
  if (n <= 0) return invalid_argument(fmt::format("token count must be positive (got {})", n));
  if (static_cast<int64_t>(x.size()) != n * h) {
    return invalid_argument(fmt::format("input holds {} values, {} tokens of hidden size {} need {}",
                                        x.size(), n, h, n * h));
  }
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) {
      return invalid_argument(fmt::format("input token {}, element {} is not finite ({})",
                                          static_cast<int64_t>(i) / h, static_cast<int64_t>(i) % h, x[i]));
    }
  }
  return {};
}

Status moe_router_reference(const Layer& layer, std::span<const float> x, int64_t n,
                            std::vector<double>* logits) {
  MOEINFER_RETURN_IF_ERROR(moe_check_input(layer.desc, x, n));
  const LayerDesc& d = layer.desc;
  const auto h = static_cast<size_t>(d.hidden);
  const auto outputs = static_cast<size_t>(d.router_outputs());
  logits->assign(static_cast<size_t>(n) * outputs, 0.0);
  std::vector<double> xt(h);
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(x.begin() + static_cast<ptrdiff_t>(t * d.hidden), h, xt.begin());
    matvec(layer.router, layer.router_bias, xt,
           std::span<double>(logits->data() + static_cast<size_t>(t) * outputs, outputs));
  }
  return {};
}

Result<Routes> moe_route_reference(const Layer& layer, std::span<const float> x, int64_t n) {
  std::vector<double> logits;
  MOEINFER_RETURN_IF_ERROR(moe_router_reference(layer, x, n, &logits));
  const LayerDesc& d = layer.desc;
  const auto outputs = static_cast<size_t>(d.router_outputs());
  const auto k = static_cast<size_t>(d.top_k);
  Routes routes;
  routes.top_k = d.top_k;
  routes.ids.resize(static_cast<size_t>(n) * k);
  routes.weights.resize(static_cast<size_t>(n) * k);
  for (size_t t = 0; t < static_cast<size_t>(n); ++t) {
    MOEINFER_RETURN_IF_ERROR(moe_select_reference(
        d, std::span<const double>(logits.data() + t * outputs, outputs), layer.correction_bias,
        std::span<int>(routes.ids.data() + t * k, k), std::span<double>(routes.weights.data() + t * k, k)));
  }
  return routes;
}

Status moe_forward_reference(const Layer& layer, std::span<const float> x, int64_t n,
                             std::span<float> out) {
  MOEINFER_RETURN_IF_ERROR(layer.check());
  const LayerDesc& d = layer.desc;
  if (static_cast<int64_t>(out.size()) != n * d.hidden) {
    return invalid_argument(fmt::format("output holds {} values, {} tokens of hidden size {} need {}",
                                        out.size(), n, d.hidden, n * d.hidden));
  }
  Result<Routes> routes = moe_route_reference(layer, x, n);
  if (!routes.ok()) return routes.status();

  const auto h = static_cast<size_t>(d.hidden);
  const auto k = static_cast<size_t>(d.top_k);
  std::vector<double> xt(h), scaled(h), acc(h);
  for (size_t t = 0; t < static_cast<size_t>(n); ++t) {
    std::copy_n(x.begin() + static_cast<ptrdiff_t>(t * h), h, xt.begin());
    std::fill(acc.begin(), acc.end(), 0.0);

    // routed = sum_j w_j * expert_{id_j}(x); ids >= E are identity (zero-computation) experts.
    for (size_t j = 0; j < k; ++j) {
      const int id = routes->ids[t * k + j];
      const double w = routes->weights[t * k + j];
      if (id >= d.num_experts) {
        for (size_t i = 0; i < h; ++i) acc[i] += w * xt[i];
        continue;
      }
      Result<const ExpertWeights*> expert = layer.expert(id);
      if (!expert.ok()) return expert.status();
      if (d.routing.weight_on_input) {
        // Llama-4: the weight scales the expert's input; its output is summed unweighted.
        for (size_t i = 0; i < h; ++i) scaled[i] = w * xt[i];
        const std::vector<double> y = expert_forward(d, **expert, scaled);
        for (size_t i = 0; i < h; ++i) acc[i] += y[i];
      } else {
        const std::vector<double> y = expert_forward(d, **expert, xt);
        for (size_t i = 0; i < h; ++i) acc[i] += w * y[i];
      }
    }

    // out = routed + gate * shared(x), gate = sigmoid(g . x) when the shared expert is gated.
    if (layer.shared) {
      double gate = 1.0;
      if (d.shared_gate) {
        double dot = 0.0;
        for (size_t i = 0; i < h; ++i) dot += static_cast<double>(layer.shared_gate[i]) * xt[i];
        gate = sigmoid(dot);
      }
      const std::vector<double> y = expert_forward(d, *layer.shared, xt);
      for (size_t i = 0; i < h; ++i) acc[i] += gate * y[i];
    }

    for (size_t i = 0; i < h; ++i) out[t * h + i] = static_cast<float>(acc[i]);
  }
  return {};
}

}  // namespace moeinfer
