// bench.png, drawn with cairo from the geometry in plot.h.
#include <cairo.h>
#include <fmt/format.h>

#include <memory>

#include "bench/plot.h"

namespace moeinfer {
namespace {

constexpr const char* kFont = "DejaVu Sans";

void set_rgb(cairo_t* cr, uint32_t rgb) {
  cairo_set_source_rgb(cr, ((rgb >> 16) & 0xff) / 255.0, ((rgb >> 8) & 0xff) / 255.0, (rgb & 0xff) / 255.0);
}

// `text` with its anchor at (x, y): align 0 left, 0.5 centred, 1 right; y is the baseline.
void text_at(cairo_t* cr, const std::string& text, double x, double y, double size, double align, bool bold = false) {
  cairo_select_font_face(cr, kFont, CAIRO_FONT_SLANT_NORMAL, bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
  cairo_text_extents_t e;
  cairo_text_extents(cr, text.c_str(), &e);
  cairo_move_to(cr, x - align * e.x_advance, y);
  cairo_show_text(cr, text.c_str());
}

// A series' pen: its colour, 2 pixels wide, dashed where its routing is not independent.
void series_pen(cairo_t* cr, const PlotSeries& s) {
  set_rgb(cr, kPlotPalette[s.color]);
  cairo_set_line_width(cr, 2.0);
  const double dash[] = {7.0, 4.0};
  cairo_set_dash(cr, dash, s.dashed ? 2 : 0, 0);
}

void line(cairo_t* cr, double x0, double y0, double x1, double y1) {
  cairo_move_to(cr, x0, y0);
  cairo_line_to(cr, x1, y1);
  cairo_stroke(cr);
}

// A circle for every point; a hollow square around it where the compute floor binds.
void marker(cairo_t* cr, const PlotPoint& p, uint32_t rgb) {
  set_rgb(cr, rgb);
  cairo_arc(cr, p.x, p.y, 4.0, 0, 6.283185307179586);
  cairo_fill(cr);
  if (p.compute) {
    cairo_set_line_width(cr, 1.5);
    cairo_rectangle(cr, p.x - 6.5, p.y - 6.5, 13, 13);
    cairo_stroke(cr);
  }
}

void draw_panel(cairo_t* cr, const PlotPanel& panel) {
  const PlotRect& a = panel.area;
  cairo_set_line_width(cr, 1.0);
  set_rgb(cr, 0xe6e6e6);  // the grid
  for (const PlotTick& t : panel.y_ticks) line(cr, a.left, t.at, a.right(), t.at);
  for (const PlotTick& t : panel.x_ticks) line(cr, t.at, a.top, t.at, a.bottom());
  set_rgb(cr, 0x808080);  // the floor itself
  line(cr, a.left, panel.one_y, a.right(), panel.one_y);
  set_rgb(cr, 0x000000);
  cairo_rectangle(cr, a.left, a.top, a.width, a.height);
  cairo_stroke(cr);
  for (const PlotTick& t : panel.y_ticks) {
    line(cr, a.left - 4, t.at, a.left, t.at);
    text_at(cr, t.label, a.left - 7, t.at + 4, 11, 1.0);
  }
  for (const PlotTick& t : panel.x_ticks) {
    line(cr, t.at, a.bottom(), t.at, a.bottom() + 4);
    text_at(cr, t.label, t.at, a.bottom() + 18, 11, 0.5);
  }
  text_at(cr, panel.title, a.left + a.width / 2, a.top - 12, 14, 0.5, /*bold=*/true);
  text_at(cr, "tokens per call (N)", a.left + a.width / 2, a.bottom() + 42, 12, 0.5);
  cairo_save(cr);
  cairo_translate(cr, panel.cell.left + 22, a.top + a.height / 2);
  cairo_rotate(cr, -1.5707963267948966);
  text_at(cr, "fraction of the binding floor (squares: compute)", 0, 0, 12, 0.5);
  cairo_restore(cr);

  cairo_save(cr);
  cairo_rectangle(cr, a.left, a.top, a.width, a.height);
  cairo_clip(cr);
  for (const PlotSeries& s : panel.series) {
    series_pen(cr, s);
    for (size_t i = 0; i < s.points.size(); ++i) {
      (i == 0 ? cairo_move_to : cairo_line_to)(cr, s.points[i].x, s.points[i].y);
    }
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
    for (const PlotPoint& p : s.points) marker(cr, p, kPlotPalette[s.color]);
  }
  cairo_restore(cr);

  // The legend over a white box that lets a fifth of what it covers show, should that be a point
  // (bench_plot puts it where it hides the least, which is not always nothing).
  const PlotRect& l = panel.legend;
  cairo_set_line_width(cr, 1.0);
  cairo_rectangle(cr, l.left, l.top, l.width, l.height);
  cairo_set_source_rgba(cr, 1.0, 1.0, 1.0, 0.8);
  cairo_fill_preserve(cr);
  set_rgb(cr, 0xcccccc);
  cairo_stroke(cr);
  for (size_t i = 0; i < panel.series.size(); ++i) {
    const PlotSeries& s = panel.series[i];
    const double y = l.top + 4 + kPlotLegendRow * (static_cast<double>(i) + 0.5);
    series_pen(cr, s);
    line(cr, l.left + 6, y, l.left + 36, y);
    cairo_set_dash(cr, nullptr, 0, 0);
    marker(cr, {0, 0, false, l.left + 21, y}, kPlotPalette[s.color]);
    set_rgb(cr, 0x000000);
    text_at(cr, s.label, l.left + 44, y + 4, 11, 0.0);
  }
}

}  // namespace

Status write_bench_png(const BenchResult& result, const std::string& path) {
  Result<BenchPlot> plot = bench_plot(result);
  if (!plot.ok()) return plot.status();
  const std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> surface(
      cairo_image_surface_create(CAIRO_FORMAT_RGB24, plot->width, plot->height), cairo_surface_destroy);
  const std::unique_ptr<cairo_t, decltype(&cairo_destroy)> context(cairo_create(surface.get()), cairo_destroy);
  cairo_t* cr = context.get();
  set_rgb(cr, 0xffffff);
  cairo_paint(cr);
  set_rgb(cr, 0x000000);
  for (size_t i = 0; i < plot->title.size(); ++i) {
    text_at(cr, plot->title[i], plot->width / 2.0, 24 + 20 * static_cast<double>(i), i == 0 ? 15 : 13, 0.5, i == 0);
  }
  for (const PlotPanel& panel : plot->panels) draw_panel(cr, panel);
  cairo_surface_flush(surface.get());
  if (const cairo_status_t st = cairo_status(cr); st != CAIRO_STATUS_SUCCESS) {
    return Status(StatusCode::kInternal, fmt::format("drawing {}: {}", path, cairo_status_to_string(st)));
  }
  if (const cairo_status_t st = cairo_surface_write_to_png(surface.get(), path.c_str()); st != CAIRO_STATUS_SUCCESS) {
    return Status(StatusCode::kIoError, fmt::format("cannot write {}: {}", path, cairo_status_to_string(st)));
  }
  return Status::ok_status();
}

}  // namespace moeinfer
