// The bench's plot (bench.png): fraction of the binding floor against N, one panel per preset,
// one line per (format, routing). This header is the geometry, computed without any drawing
// library, so that tests can check where every point lands; plot_png_cairo.cpp draws it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moeinfer/bench.h"

namespace moeinfer {

struct PlotRect {
  double left = 0, top = 0, width = 0, height = 0;
  double right() const { return left + width; }
  double bottom() const { return top + height; }
  bool contains(double x, double y) const { return x >= left && x <= right() && y >= top && y <= bottom(); }
};

struct PlotPoint {
  int64_t tokens = 0;
  double value = 0;     // max(fraction, compute_fraction): the fraction of whichever floor binds
  bool compute = false; // the row's bound is "compute"
  double x = 0, y = 0;  // pixel centre
};

struct PlotSeries {
  std::string label;   // "nvfp4, independent"
  int color = 0;       // index into kPlotPalette: one per (format, routing) across all panels
  bool dashed = false; // any routing but independent
  std::vector<PlotPoint> points;  // by N
};

struct PlotTick {
  double at = 0;  // pixel: x for the N axis, y for the fraction axis
  std::string label;
};

struct PlotPanel {
  std::string title;  // the preset
  PlotRect cell;      // the panel with its labels
  PlotRect area;      // the axes' box
  std::vector<PlotTick> x_ticks, y_ticks;
  double y_max = 0;       // the fraction at the top of the box
  double one_y = 0;       // pixel row of fraction 1.0 (drawn as a reference line)
  PlotRect legend;        // the corner where the fewest points and lines fall
  std::vector<PlotSeries> series;
};

struct BenchPlot {
  int width = 0, height = 0;
  std::vector<std::string> title;  // lines above the panels
  std::vector<PlotPanel> panels;   // up to kPlotColumns per row, in the rows' order of presets
};

inline constexpr int kPlotColumns = 3;
inline constexpr double kPlotCellWidth = 560, kPlotCellHeight = 420, kPlotTitleHeight = 64;
inline constexpr double kPlotLegendRow = 18;  // legend height per series
// Matplotlib's "tab10" colours, as 0xRRGGBB.
inline constexpr uint32_t kPlotPalette[] = {0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728, 0x9467bd,
                                            0x8c564b, 0xe377c2, 0x7f7f7f, 0xbcbd22, 0x17becf};

// The plot of `result`'s rows, or an error when there is no row to plot.
Result<BenchPlot> bench_plot(const BenchResult& result);

}  // namespace moeinfer
