// bench.json read back, the plot's geometry, and bench.png's pixels.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <tuple>

#include "bench/plot.h"
#include "moeinfer/bench.h"
#include "test_util.h"

#ifdef MOEINFER_TEST_CAIRO
#include <cairo.h>
#endif

namespace moeinfer {
namespace {

using testing::take;

BenchRow make_row(const std::string& preset, const std::string& format, const std::string& routing, int64_t tokens,
                  double fraction) {
  BenchRow r;
  r.preset = preset;
  r.format = format;
  r.routing = routing;
  r.tokens = tokens;
  r.fraction = fraction;
  r.bound = "memory";
  return r;
}

// Two presets x (nvfp4, bf16) x (independent, correlated) x N = 1..256. Each series is a straight
// rise from `base` by 0.04 per doubling, the four series 0.2 apart, so no two markers touch.
BenchResult four_series(const std::vector<std::string>& presets = {"alpha", "beta"}) {
  BenchResult result;
  result.device = "Test GPU";
  result.read_gbps = 4400;
  result.peak_gflops = 790000;
  double base = 0.05;
  for (const char* format : {"nvfp4", "bf16"}) {
    for (const char* routing : {"independent", "correlated"}) {
      for (const std::string& preset : presets) {
        for (int e = 0; e <= 8; ++e) {
          result.rows.push_back(make_row(preset, format, routing, int64_t{1} << e, base + 0.04 * e));
        }
      }
      base += 0.2;
    }
  }
  return result;
}

// Every point sits where its N and its fraction put it: equal steps per doubling of N, its
// fraction read back off the y axis, inside the axes, and the floor's line at 1.0.
TEST(BenchPlot, PointsLandWhereTheirValuesSay) {
  const BenchResult result = four_series();
  const BenchPlot plot = take(bench_plot(result));
  ASSERT_EQ(plot.panels.size(), 2u);
  EXPECT_EQ(plot.width, static_cast<int>(2 * kPlotCellWidth));
  EXPECT_EQ(plot.height, static_cast<int>(kPlotTitleHeight + kPlotCellHeight));
  ASSERT_EQ(plot.title.size(), 2u);
  EXPECT_EQ(plot.title[0], "moeinfer bench on Test GPU");
  EXPECT_EQ(plot.title[1], "read bandwidth 4400 GB/s, compute peak 790 TFLOP/s");
  for (const PlotPanel& panel : plot.panels) {
    EXPECT_TRUE(panel.title == "alpha" || panel.title == "beta") << panel.title;
    EXPECT_DOUBLE_EQ(panel.y_max, 1.05);
    const PlotRect& a = panel.area;
    EXPECT_NEAR(a.bottom() - panel.one_y, a.height / 1.05, 1e-9);
    ASSERT_EQ(panel.series.size(), 4u);
    for (const PlotSeries& s : panel.series) {
      ASSERT_EQ(s.points.size(), 9u) << s.label;
      EXPECT_EQ(s.dashed, s.label.ends_with("correlated")) << s.label;
      const double step = s.points[1].x - s.points[0].x;
      EXPECT_GT(step, 0.0);
      for (size_t i = 0; i < s.points.size(); ++i) {
        const PlotPoint& p = s.points[i];
        EXPECT_EQ(p.tokens, int64_t{1} << i);
        EXPECT_TRUE(a.contains(p.x, p.y)) << s.label << " N=" << p.tokens;
        EXPECT_NEAR(p.x - s.points[0].x, step * static_cast<double>(i), 1e-9);
        EXPECT_NEAR((a.bottom() - p.y) / a.height * panel.y_max, p.value, 1e-12);
      }
      // 5% of the span spare at each end.
      EXPECT_NEAR(s.points[0].x - a.left, 0.05 * a.width / 1.1, 1e-9);
      EXPECT_NEAR(a.right() - s.points[8].x, 0.05 * a.width / 1.1, 1e-9);
    }
    // Ticks: N at every power of two, the fraction every 0.2 from 0 to 1.
    ASSERT_EQ(panel.x_ticks.size(), 9u);
    EXPECT_EQ(panel.x_ticks[0].label, "1");
    EXPECT_EQ(panel.x_ticks[8].label, "256");
    EXPECT_DOUBLE_EQ(panel.x_ticks[3].at, panel.series[0].points[3].x);
    ASSERT_EQ(panel.y_ticks.size(), 6u);
    EXPECT_EQ(panel.y_ticks[0].label, "0.0");
    EXPECT_EQ(panel.y_ticks[5].label, "1.0");
    EXPECT_DOUBLE_EQ(panel.y_ticks[0].at, a.bottom());
    EXPECT_NEAR(panel.y_ticks[5].at, panel.one_y, 1e-9);
  }
  // One colour per (format, routing), the same in both panels.
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(plot.panels[0].series[i].label, plot.panels[1].series[i].label);
    EXPECT_EQ(plot.panels[0].series[i].color, plot.panels[1].series[i].color);
    for (size_t j = 0; j < i; ++j) EXPECT_NE(plot.panels[0].series[i].color, plot.panels[0].series[j].color);
  }
}

// The binding floor: a compute-bound row plots its compute fraction, and is marked.
TEST(BenchPlot, ComputeBoundRowsPlotTheirComputeFraction) {
  BenchResult result = four_series({"alpha"});
  result.rows[3].compute_fraction = 0.9;
  result.rows[3].bound = "compute";
  result.rows[4].compute_fraction = 0.01;  // below its byte fraction: the byte floor binds
  const BenchPlot plot = take(bench_plot(result));
  const PlotSeries& s = plot.panels[0].series[0];
  EXPECT_DOUBLE_EQ(s.points[3].value, 0.9);
  EXPECT_TRUE(s.points[3].compute);
  EXPECT_DOUBLE_EQ(s.points[4].value, result.rows[4].fraction);
  EXPECT_FALSE(s.points[4].compute);
}

// A row past its floor raises the axis so that it shows; NaN rows (none timed) are left out; one N
// alone sits in the middle; no rows at all is an error that says so.
TEST(BenchPlot, AxesFitWhatThereIs) {
  BenchResult result;
  result.device = "CPU (2 threads)";
  result.read_gbps = 6.4;
  result.rows = {make_row("q", "bf16", "independent", 1, 0.30), make_row("q", "bf16", "independent", 2, 1.14),
                 make_row("q", "bf16", "independent", 4, NAN)};
  BenchPlot plot = take(bench_plot(result));
  EXPECT_EQ(plot.title[1], "read bandwidth 6 GB/s");
  const PlotPanel& panel = plot.panels[0];
  EXPECT_DOUBLE_EQ(panel.y_max, 1.2);
  ASSERT_EQ(panel.series[0].points.size(), 2u);
  EXPECT_TRUE(panel.area.contains(panel.series[0].points[1].x, panel.series[0].points[1].y));
  EXPECT_EQ(panel.y_ticks.back().label, "1.2");

  result.rows = {make_row("q", "bf16", "independent", 16, 0.5)};
  plot = take(bench_plot(result));
  const PlotPoint& only = plot.panels[0].series[0].points[0];
  EXPECT_NEAR(only.x, plot.panels[0].area.left + plot.panels[0].area.width / 2, 1e-9);
  EXPECT_EQ(plot.panels[0].x_ticks.size(), 3u);  // 8, 16, 32

  result.rows.clear();
  const Status empty = bench_plot(result).status();
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(empty.message().find("no rows to plot"), std::string::npos) << empty.message();
}

// Four presets: three panels a row, the fourth starting the second row.
TEST(BenchPlot, PanelsWrapAfterThree) {
  const BenchPlot plot = take(bench_plot(four_series({"a", "b", "c", "d"})));
  ASSERT_EQ(plot.panels.size(), 4u);
  EXPECT_EQ(plot.width, static_cast<int>(3 * kPlotCellWidth));
  EXPECT_EQ(plot.height, static_cast<int>(kPlotTitleHeight + 2 * kPlotCellHeight));
  EXPECT_DOUBLE_EQ(plot.panels[2].cell.left, 2 * kPlotCellWidth);
  EXPECT_DOUBLE_EQ(plot.panels[3].cell.left, 0.0);
  EXPECT_DOUBLE_EQ(plot.panels[3].cell.top, kPlotTitleHeight + kPlotCellHeight);
  for (const PlotPanel& p : plot.panels) {
    EXPECT_TRUE(p.cell.contains(p.area.left, p.area.top));
    EXPECT_TRUE(p.cell.contains(p.area.right(), p.area.bottom()));
  }
}

// The legend covers no marker when some place is free, wherever the lines run: rising, falling,
// and a CPU run whose six lines leave every corner a marker (the edge's middle is free).
TEST(BenchPlot, LegendLeavesThePointsVisible) {
  const auto rows_of = [](const std::vector<std::tuple<const char*, const char*, int64_t, double>>& points) {
    BenchResult result;
    result.device = "d";
    for (const auto& [format, routing, tokens, value] : points) {
      result.rows.push_back(make_row("p", format, routing, tokens, value));
    }
    return result;
  };
  std::vector<std::pair<std::string, BenchResult>> cases;
  for (const bool rising : {true, false}) {
    std::vector<std::tuple<const char*, const char*, int64_t, double>> points;
    for (int e = 0; e <= 8; ++e) {
      const double v = rising ? 0.1 * e : 0.9 - 0.1 * e;
      points.emplace_back("nvfp4", "independent", int64_t{1} << e, v);
      points.emplace_back("nvfp4", "correlated", int64_t{1} << e, v + 0.05);
    }
    cases.emplace_back(rising ? "rising" : "falling", rows_of(points));
  }
  cases.emplace_back("cpu", rows_of({{"nvfp4", "independent", 1, 0.38}, {"nvfp4", "independent", 4, 0.36},
                                     {"nvfp4", "correlated", 1, 0.37}, {"nvfp4", "correlated", 4, 0.29},
                                     {"fp8-block", "independent", 1, 0.51}, {"fp8-block", "independent", 4, 0.49},
                                     {"fp8-block", "correlated", 1, 0.51}, {"fp8-block", "correlated", 4, 0.42},
                                     {"bf16", "independent", 1, 0.86}, {"bf16", "independent", 4, 0.98},
                                     {"bf16", "correlated", 1, 1.05}, {"bf16", "correlated", 4, 0.95}}));
  for (const auto& [name, result] : cases) {
    const PlotPanel panel = take(bench_plot(result)).panels[0];
    EXPECT_TRUE(panel.area.contains(panel.legend.left, panel.legend.top)) << name;
    EXPECT_TRUE(panel.area.contains(panel.legend.right(), panel.legend.bottom())) << name;
    for (const PlotSeries& s : panel.series) {
      for (const PlotPoint& p : s.points) {
        EXPECT_FALSE(panel.legend.contains(p.x, p.y)) << name << " " << s.label << " N=" << p.tokens;
      }
    }
  }
}

// json() read back gives the same result, field for field.
TEST(BenchJson, RoundTrips) {
  BenchResult result = four_series({"alpha"});
  result.peak_how = "bf16 tensor cores";
  BenchRow& r = result.rows[5];
  r.backend = "cuda", r.path = "expert-major", r.config = "8 routes/item", r.plan = "router, \"quoted\"";
  r.time_us = 24.5639998, r.distinct_experts = 10.25, r.bytes = 21586052.5, r.gbps = 878.76, r.floor_us = 4.891;
  r.flops = 71307264, r.compute_us = 0.09, r.compute_fraction = 0.0037, r.bound = "compute";
  r.ranks = 2, r.rank_bytes = 1.5e7, r.allreduce_us = 3.25;
  const BenchResult back = take(parse_bench_json(result.json()));
  EXPECT_EQ(back.json(), result.json());
  EXPECT_EQ(back.device, "Test GPU");
  EXPECT_EQ(back.peak_how, "bf16 tensor cores");
  ASSERT_EQ(back.rows.size(), result.rows.size());
  EXPECT_EQ(back.rows[5].plan, r.plan);
  EXPECT_EQ(back.rows[5].time_us, r.time_us);
  EXPECT_EQ(back.rows[5].ranks, 2);
  EXPECT_EQ(back.rows[5].tokens, r.tokens);
}

// JSON from before the compute floor (no peak, no compute columns) still reads; what cannot be
// read is refused with the row and the field named.
TEST(BenchJson, OldFilesReadAndBadOnesNameTheProblem) {
  const BenchResult old = take(parse_bench_json(
      R"({"device": "NVIDIA H200", "read_gbps": 4425.0, "rows": [
          {"preset": "qwen3-30b-a3b", "format": "nvfp4", "routing": "independent", "tokens": 8, "fraction": 0.41,
           "time_us": 76.1, "path": "expert-major"}]})"));
  EXPECT_EQ(old.peak_gflops, 0.0);
  ASSERT_EQ(old.rows.size(), 1u);
  EXPECT_EQ(old.rows[0].tokens, 8);
  EXPECT_EQ(old.rows[0].compute_fraction, 0.0);
  EXPECT_EQ(old.rows[0].bound, "");
  EXPECT_EQ(take(bench_plot(old)).panels[0].series[0].points[0].value, 0.41);

  const auto error = [](const char* text) {
    const Status st = parse_bench_json(text).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << text;
    return st.message();
  };
  EXPECT_NE(error("{\"device\": ").find("bench JSON does not parse"), std::string::npos);
  EXPECT_NE(error("[1, 2]").find("the top level is not an object"), std::string::npos);
  EXPECT_NE(error(R"({"read_gbps": 1, "rows": []})").find("bench JSON has no 'device'"), std::string::npos);
  EXPECT_NE(error(R"({"device": "d", "read_gbps": 1})").find("no 'rows' array"), std::string::npos);
  const std::string head = R"({"device": "d", "read_gbps": 1, "rows": [{"preset": "p", "format": "f", "routing": "r", )";
  EXPECT_NE(error((head + R"("tokens": 1, "fraction": 0.5}, {"preset": "p"}]})").c_str())
                .find("bench JSON row 1 has no 'format'"),
            std::string::npos);
  EXPECT_NE(error((head + R"("tokens": "8", "fraction": 0.5}]})").c_str())
                .find("bench JSON row 0: 'tokens' is string, not an integer"),
            std::string::npos);
  EXPECT_NE(error((head + R"("tokens": 8.5, "fraction": 0.5}]})").c_str()).find("'tokens' is number, not an integer"),
            std::string::npos);
  EXPECT_NE(error(R"({"device": "d", "read_gbps": "fast", "rows": []})").find("'read_gbps' is string, not a number"),
            std::string::npos);
  // Counts and measurements are never negative, integers fit their fields, and a row has at least
  // one token: such a file was not written by the bench, and would plot nothing where it claims rows.
  EXPECT_NE(error((head + R"("tokens": -5, "fraction": 0.5}]})").c_str()).find("row 0: 'tokens' is -5, a negative count"),
            std::string::npos);
  EXPECT_NE(error((head + R"("tokens": 0, "fraction": 0.5}]})").c_str()).find("row 0: 'tokens' is 0, not a token count"),
            std::string::npos);
  EXPECT_NE(error((head + R"("tokens": 18446744073709551615, "fraction": 0.5}]})").c_str())
                .find("'tokens' is 18446744073709551615, past the largest it can be (9223372036854775807)"),
            std::string::npos);
  EXPECT_NE(error((head + R"("tokens": 1, "fraction": 0.5, "ranks": 99999999999}]})").c_str())
                .find("'ranks' is 99999999999, past the largest it can be (2147483647)"),
            std::string::npos);
  EXPECT_NE(error((head + R"("tokens": 1, "fraction": -0.5}]})").c_str()).find("'fraction' is -0.5, a negative measurement"),
            std::string::npos);
  EXPECT_NE(error(R"({"device": "d", "read_gbps": -1, "rows": []})").find("bench JSON: 'read_gbps' is -1, a negative"),
            std::string::npos);
}

// bench.png shows every point in its series' colour at the pixel the geometry gives it, and a
// hollow square around the compute-bound ones.
TEST(BenchPng, PixelsShowEveryPoint) {
  BenchResult result = four_series();
  for (const size_t i : {2, 29}) {
    result.rows[i].bound = "compute";
    result.rows[i].compute_fraction = result.rows[i].fraction;
  }
  const std::string path = (std::filesystem::temp_directory_path() / fmt::format("moeinfer_plot_{}.png", getpid())).string();
  const Status written = write_bench_png(result, path);
  if (written.code() == StatusCode::kUnavailable) GTEST_SKIP() << "SKIPPED (no PNG in this build): " << written.message();
  ASSERT_TRUE(written.ok()) << written.to_string();
#ifdef MOEINFER_TEST_CAIRO
  const std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> image(
      cairo_image_surface_create_from_png(path.c_str()), cairo_surface_destroy);
  std::filesystem::remove(path);
  ASSERT_EQ(cairo_surface_status(image.get()), CAIRO_STATUS_SUCCESS);
  const BenchPlot plot = take(bench_plot(result));
  ASSERT_EQ(cairo_image_surface_get_width(image.get()), plot.width);
  ASSERT_EQ(cairo_image_surface_get_height(image.get()), plot.height);
  const unsigned char* data = cairo_image_surface_get_data(image.get());
  const int stride = cairo_image_surface_get_stride(image.get());
  const auto pixel = [&](double x, double y) {  // 0xRRGGBB of the pixel holding (x, y)
    const auto* row = reinterpret_cast<const uint32_t*>(data + static_cast<int>(y) * stride);
    return row[static_cast<int>(x)] & 0xffffffu;
  };
  // Pixels between 5.5 and 8.5 from (x, y), outside the round marker, drawn mostly in `rgb`: a
  // distance of under 128 summed over the channels from it (white is 290-470 away from every
  // colour of the palette).
  const auto ring = [&](double x, double y, uint32_t rgb) {
    int n = 0;
    for (int dy = -9; dy <= 9; ++dy) {
      for (int dx = -9; dx <= 9; ++dx) {
        const double r = std::hypot(dx, dy);
        if (r < 5.5 || r > 8.5) continue;
        const uint32_t got = pixel(x + dx, y + dy);
        int distance = 0;
        for (int shift : {0, 8, 16}) distance += std::abs(static_cast<int>((got >> shift) & 0xff) - static_cast<int>((rgb >> shift) & 0xff));
        n += distance < 128 ? 1 : 0;
      }
    }
    return n;
  };
  int checked = 0;
  for (const PlotPanel& panel : plot.panels) {
    EXPECT_EQ(pixel(panel.cell.left + 2, panel.cell.top + 2), 0xffffffu);  // the background
    for (const PlotSeries& s : panel.series) {
      const uint32_t rgb = kPlotPalette[s.color];
      for (const PlotPoint& p : s.points) {
        if (panel.legend.contains(p.x, p.y)) continue;
        EXPECT_EQ(pixel(p.x, p.y), rgb) << panel.title << " " << s.label << " N=" << p.tokens;
        // The ring holds about 130 pixels. The line crosses it twice (about 12 of them); a
        // square's outline, 52 long and 1.5 wide, runs through it all around (about 50).
        const int around = ring(p.x, p.y, rgb);
        if (p.compute) {
          EXPECT_GE(around, 30) << panel.title << " " << s.label << " N=" << p.tokens;
        } else {
          EXPECT_LE(around, 20) << panel.title << " " << s.label << " N=" << p.tokens;
        }
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 60);
#else
  std::filesystem::remove(path);
  GTEST_SKIP() << "SKIPPED: the PNG was written, but this test binary was built without cairo to read it back";
#endif
}

// An unwritable path is an error naming it.
TEST(BenchPng, UnwritablePathIsNamed) {
  const Status st = write_bench_png(four_series({"a"}), "/nonexistent-dir/bench.png");
  if (st.code() == StatusCode::kUnavailable) GTEST_SKIP() << "SKIPPED (no PNG in this build): " << st.message();
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find("cannot write /nonexistent-dir/bench.png"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace moeinfer
