// The bench plot's geometry: panels, axes, ticks, every point's pixel, and where each legend goes.
#include "bench/plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

namespace moeinfer {
namespace {

// Margins of the axes' box inside a panel's cell: the panel title above, tick labels and the
// rotated axis label to the left, tick labels and the axis label below.
constexpr double kAreaLeft = 80, kAreaRight = 20, kAreaTop = 40, kAreaBottom = 60;
constexpr double kLegendInset = 8, kLegendCharWidth = 6.6, kLegendSample = 44;

// The smallest step from 1, 2, 2.5, 5 x 10^k that puts at most 7 ticks over [0, top].
double tick_step(double top) {
  for (double scale = 0.1;; scale *= 10) {
    for (double m : {1.0, 2.0, 2.5, 5.0}) {
      if (top / (m * scale) <= 7.0) return m * scale;
    }
  }
}

std::string tick_label(double v, double step) {
  if (step >= 1.0) return fmt::format("{:.0f}", v);
  return fmt::format("{:.{}f}", v, std::fmod(step * 10.0, 1.0) > 1e-9 ? 2 : 1);
}

// How much of the plot a legend at `box` would hide: markers inside it, and points sampled
// along each line segment inside it.
int legend_cost(const PlotRect& box, const std::vector<PlotSeries>& series) {
  int cost = 0;
  for (const PlotSeries& s : series) {
    for (size_t i = 0; i < s.points.size(); ++i) {
      const PlotPoint& p = s.points[i];
      cost += box.contains(p.x, p.y) ? 10 : 0;
      if (i == 0) continue;
      const PlotPoint& q = s.points[i - 1];
      for (int t = 1; t < 20; ++t) {
        const double f = t / 20.0;
        cost += box.contains(q.x + f * (p.x - q.x), q.y + f * (p.y - q.y)) ? 1 : 0;
      }
    }
  }
  return cost;
}

}  // namespace

Result<BenchPlot> bench_plot(const BenchResult& result) {
  // Presets, and (format, routing) pairs, in the order the rows first name them; a pair keeps
  // one colour in every panel.
  std::vector<std::string> presets;
  std::vector<std::pair<std::string, std::string>> keys;
  for (const BenchRow& r : result.rows) {
    if (std::find(presets.begin(), presets.end(), r.preset) == presets.end()) presets.push_back(r.preset);
    const std::pair<std::string, std::string> key{r.format, r.routing};
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
  }
  if (presets.empty()) return invalid_argument("the bench result has no rows to plot");

  BenchPlot plot;
  const int columns = std::min(static_cast<int>(presets.size()), kPlotColumns);
  const int rows = (static_cast<int>(presets.size()) + kPlotColumns - 1) / kPlotColumns;
  plot.width = static_cast<int>(columns * kPlotCellWidth);
  plot.height = static_cast<int>(kPlotTitleHeight + rows * kPlotCellHeight);
  plot.title.push_back(fmt::format("moeinfer bench on {}", result.device));
  std::string second = fmt::format("read bandwidth {:.0f} GB/s", result.read_gbps);
  if (result.peak_gflops > 0.0) {
    second += result.peak_gflops >= 1e4 ? fmt::format(", compute peak {:.0f} TFLOP/s", result.peak_gflops / 1e3)
                                        : fmt::format(", compute peak {:.1f} GFLOP/s", result.peak_gflops);
  }
  plot.title.push_back(second);

  for (size_t p = 0; p < presets.size(); ++p) {
    PlotPanel panel;
    panel.title = presets[p];
    panel.cell = {static_cast<double>(p % kPlotColumns) * kPlotCellWidth,
                  kPlotTitleHeight + static_cast<double>(p / kPlotColumns) * kPlotCellHeight, kPlotCellWidth,
                  kPlotCellHeight};
    panel.area = {panel.cell.left + kAreaLeft, panel.cell.top + kAreaTop, kPlotCellWidth - kAreaLeft - kAreaRight,
                  kPlotCellHeight - kAreaTop - kAreaBottom};

    // The preset's points by (format, routing), each series by N. A fraction that is not a finite
    // number (a row that did not time) has no place on the axes and is left out.
    std::map<size_t, PlotSeries> by_key;
    double lo = INFINITY, hi = -INFINITY, top = 0.0;
    for (const BenchRow& r : result.rows) {
      if (r.preset != presets[p]) continue;
      const double value = std::max(r.fraction, r.compute_fraction);
      if (!std::isfinite(value) || value < 0.0 || r.tokens < 1) continue;
      const size_t k = static_cast<size_t>(
          std::find(keys.begin(), keys.end(), std::pair{r.format, r.routing}) - keys.begin());
      PlotSeries& s = by_key[k];
      s.label = r.format + ", " + r.routing;
      s.color = static_cast<int>(k % std::size(kPlotPalette));
      s.dashed = r.routing != token_routing_name(TokenRouting::kIndependent);
      s.points.push_back({r.tokens, value, r.bound == "compute"});
      lo = std::min(lo, std::log2(static_cast<double>(r.tokens)));
      hi = std::max(hi, std::log2(static_cast<double>(r.tokens)));
      top = std::max(top, value);
    }
    if (by_key.empty()) lo = 0, hi = 0;

    // N on a log2 axis with 5% of the span to spare at each end (one doubling each way when the
    // panel has a single N); the fraction from 0 to 1.05, so that the floor shows, or past the
    // highest point where a row ran past it.
    if (hi == lo) lo -= 1, hi += 1;
    const double pad = 0.05 * (hi - lo);
    const double x0 = lo - pad, x_span = hi - lo + 2 * pad;
    panel.y_max = top <= 1.0 ? 1.05 : std::ceil((top + 0.05) * 10.0) / 10.0;
    const PlotRect& a = panel.area;
    const auto x_of = [&](double tokens) { return a.left + (std::log2(tokens) - x0) / x_span * a.width; };
    const auto y_of = [&](double value) { return a.bottom() - value / panel.y_max * a.height; };
    panel.one_y = y_of(1.0);

    const int first = static_cast<int>(std::ceil(x0)), last = static_cast<int>(std::floor(x0 + x_span));
    const int every = last - first + 1 > 10 ? 2 : 1;
    for (int e = first; e <= last; ++e) {
      if (e < 0 || e % every != 0) continue;
      const double n = std::ldexp(1.0, e);
      panel.x_ticks.push_back({x_of(n), fmt::format("{:.0f}", n)});
    }
    const double step = tick_step(panel.y_max);
    for (int i = 0; i * step <= panel.y_max + 1e-9; ++i) {
      panel.y_ticks.push_back({y_of(i * step), tick_label(i * step, step)});
    }

    for (auto& [k, s] : by_key) {
      std::stable_sort(s.points.begin(), s.points.end(),
                       [](const PlotPoint& l, const PlotPoint& r) { return l.tokens < r.tokens; });
      for (PlotPoint& pt : s.points) pt.x = x_of(static_cast<double>(pt.tokens)), pt.y = y_of(pt.value);
      panel.series.push_back(std::move(s));
    }

    // The legend: one row per series, where it hides the least of nine places (corners first,
    // then the edges' middles, then the centre; the first of equals).
    size_t longest = 0;
    for (const PlotSeries& s : panel.series) longest = std::max(longest, s.label.size());
    const double w = kLegendSample + kLegendCharWidth * static_cast<double>(longest) + 10;
    const double h = kPlotLegendRow * static_cast<double>(panel.series.size()) + 8;
    const double left = a.left + kLegendInset, right = a.right() - kLegendInset - w, centre = a.left + (a.width - w) / 2;
    const double upper = a.top + kLegendInset, lower = a.bottom() - kLegendInset - h, middle = a.top + (a.height - h) / 2;
    int best = -1;
    for (const auto& [x, y] : {std::pair{right, lower}, {left, upper}, {left, lower}, {right, upper}, {right, middle},
                               {left, middle}, {centre, upper}, {centre, lower}, {centre, middle}}) {
      const PlotRect box{x, y, w, h};
      const int cost = legend_cost(box, panel.series);
      if (best < 0 || cost < best) best = cost, panel.legend = box;
    }
    plot.panels.push_back(std::move(panel));
  }
  return plot;
}

}  // namespace moeinfer
