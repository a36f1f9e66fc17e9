#include "hf_mirror.h"

#include <cmath>
#include <limits>
#include <vector>

namespace moeinfer::testing {

namespace {

using Matrix = std::vector<double>;  // row-major
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

Matrix dense(const QuantMatrix& m) {
  const std::vector<float> f = m.dequantize();
  return Matrix(f.begin(), f.end());
}

// y[t, o] = sum_i x[t, i] * w[o, i] + b[o]   (F.linear)
Matrix linear(const Matrix& x, int64_t n, const Matrix& w, int64_t out_features, int64_t in_features,
              const std::vector<float>& b) {
  Matrix y(static_cast<size_t>(n * out_features), 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < out_features; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < in_features; ++i) acc += x[static_cast<size_t>(t * in_features + i)] * w[static_cast<size_t>(o * in_features + i)];
      y[static_cast<size_t>(t * out_features + o)] = acc + (b.empty() ? 0.0 : b[static_cast<size_t>(o)]);
    }
  }
  return y;
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// torch.softmax over one row.
void softmax_in_place(std::vector<double>& v) {
  double mx = kNegInf, sum = 0.0;
  for (double x : v) mx = std::max(mx, x);
  for (double& x : v) sum += (x = std::exp(x - mx));
  for (double& x : v) x /= sum;
}

// torch.topk on one row: k times, the first maximum among those not yet taken.
std::vector<int> topk(std::vector<double> row, int k) {
  std::vector<int> idx;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int i = 0; i < static_cast<int>(row.size()); ++i) {
      if (best < 0 || row[static_cast<size_t>(i)] > row[static_cast<size_t>(best)]) best = i;
    }
    idx.push_back(best);
    row[static_cast<size_t>(best)] = kNegInf;
  }
  return idx;
}

// An expert over a batch of its tokens: down(act(gate(x), up(x))).
Matrix expert_mlp(const LayerDesc& d, const ExpertWeights& w, const Matrix& x, int64_t n, int64_t inter) {
  const Matrix g = linear(x, n, dense(w.gate), inter, d.hidden, w.gate_bias);
  const Matrix u = linear(x, n, dense(w.up), inter, d.hidden, w.up_bias);
  Matrix a(g.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (d.activation == Activation::kGptOssClamped) {
      const double gc = std::min(g[i], static_cast<double>(d.swiglu_limit));
      const double uc = std::max(std::min(u[i], static_cast<double>(d.swiglu_limit)), -static_cast<double>(d.swiglu_limit));
      a[i] = (uc + 1.0) * (gc * sigmoid(gc * d.swiglu_alpha));
    } else {
      a[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
    }
  }
  return linear(a, n, dense(w.down), d.hidden, inter, w.down_bias);
}

}  // namespace

Status hf_mirror_forward(const Layer& layer, std::span<const float> xs, int64_t n, std::span<float> out) {
  const LayerDesc& d = layer.desc;
  const RoutingDesc& r = d.routing;
  const int64_t h = d.hidden;
  const int total = d.router_outputs();
  const Matrix x(xs.begin(), xs.end());

  // Router.
  const Matrix logits = linear(x, n, dense(layer.router), total, h, layer.router_bias);

  std::vector<std::vector<int>> topk_ids(static_cast<size_t>(n));
  std::vector<std::vector<double>> topk_w(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> row(logits.begin() + t * total, logits.begin() + (t + 1) * total);
    std::vector<double> scores = row;
    if (r.score == ScoreFunc::kSoftmax) {
      softmax_in_place(scores);
    } else if (r.score == ScoreFunc::kSigmoid) {
      for (double& v : scores) v = sigmoid(v);
    }
    std::vector<double> for_choice = scores;
    if (r.correction_bias) {
      for (int e = 0; e < total; ++e) for_choice[static_cast<size_t>(e)] += layer.correction_bias[static_cast<size_t>(e)];
    }
    if (r.n_group > 1) {
      // group_scores = for_choice.view(G, E/G).topk(2).sum(); group_idx = topk(group_scores,
      // topk_group); scores_for_choice.masked_fill(~score_mask, -inf)
      const int gs = d.num_experts / r.n_group;
      std::vector<double> group_scores(static_cast<size_t>(r.n_group));
      for (int g = 0; g < r.n_group; ++g) {
        std::vector<double> members(for_choice.begin() + g * gs, for_choice.begin() + (g + 1) * gs);
        const std::vector<int> two = topk(members, 2);
        group_scores[static_cast<size_t>(g)] = members[static_cast<size_t>(two[0])] + members[static_cast<size_t>(two[1])];
      }
      std::vector<bool> mask(static_cast<size_t>(total), false);
      for (int g : topk(group_scores, r.topk_group)) {
        for (int e = g * gs; e < (g + 1) * gs; ++e) mask[static_cast<size_t>(e)] = true;
      }
      for (int e = 0; e < total; ++e) {
        if (!mask[static_cast<size_t>(e)]) for_choice[static_cast<size_t>(e)] = kNegInf;
      }
    }
    const std::vector<int> ids = topk(for_choice, d.top_k);
    std::vector<double> w;
    for (int id : ids) w.push_back(scores[static_cast<size_t>(id)]);  // gather, unbiased
    if (r.weight == WeightFunc::kSoftmaxOfSelected) {
      softmax_in_place(w);
    } else if (r.weight == WeightFunc::kSigmoidOfSelected) {
      for (double& v : w) v = sigmoid(v);
    }
    if (r.renormalize) {
      double sum = 0.0;
      for (double v : w) sum += v;
      for (double& v : w) v = v / (sum + r.renorm_epsilon);
    }
    for (double& v : w) v *= r.scaling;
    topk_ids[static_cast<size_t>(t)] = ids;
    topk_w[static_cast<size_t>(t)] = w;
  }

  // final_hidden_states = zeros; for expert_idx in expert_hit: index_add_(...)
  Matrix final_states(static_cast<size_t>(n * h), 0.0);
  for (int e = 0; e < total; ++e) {
    std::vector<int64_t> tokens;
    std::vector<double> weights;
    for (int64_t t = 0; t < n; ++t) {
      for (int j = 0; j < d.top_k; ++j) {
        if (topk_ids[static_cast<size_t>(t)][static_cast<size_t>(j)] == e) {
          tokens.push_back(t);
          weights.push_back(topk_w[static_cast<size_t>(t)][static_cast<size_t>(j)]);
        }
      }
    }
    if (tokens.empty()) continue;
    const auto m = static_cast<int64_t>(tokens.size());
    Matrix current(static_cast<size_t>(m * h));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t c = 0; c < h; ++c) {
        double v = x[static_cast<size_t>(tokens[static_cast<size_t>(i)] * h + c)];
        if (r.weight_on_input) v *= weights[static_cast<size_t>(i)];
        current[static_cast<size_t>(i * h + c)] = v;
      }
    }
    Matrix y = current;  // zero-computation experts return their input
    if (e < d.num_experts) {
      Result<const ExpertWeights*> w = layer.expert(e);
      if (!w.ok()) return w.status();
      y = expert_mlp(d, **w, current, m, d.intermediate);
    }
    for (int64_t i = 0; i < m; ++i) {
      const double scale = r.weight_on_input ? 1.0 : weights[static_cast<size_t>(i)];
      for (int64_t c = 0; c < h; ++c) {
        final_states[static_cast<size_t>(tokens[static_cast<size_t>(i)] * h + c)] += scale * y[static_cast<size_t>(i * h + c)];
      }
    }
  }

  if (layer.shared) {
    const Matrix shared = expert_mlp(d, *layer.shared, x, n, d.shared_intermediate);
    for (int64_t t = 0; t < n; ++t) {
      double gate = 1.0;
      if (d.shared_gate) {
        std::vector<float> no_bias;
        const Matrix gx = linear(Matrix(x.begin() + t * h, x.begin() + (t + 1) * h), 1,
                                 Matrix(layer.shared_gate.begin(), layer.shared_gate.end()), 1, h, no_bias);
        gate = sigmoid(gx[0]);
      }
      for (int64_t c = 0; c < h; ++c) final_states[static_cast<size_t>(t * h + c)] += gate * shared[static_cast<size_t>(t * h + c)];
    }
  }
  for (size_t i = 0; i < final_states.size(); ++i) out[i] = static_cast<float>(final_states[i]);
  return {};
}

}  // namespace moeinfer::testing
