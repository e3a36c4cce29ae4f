// SVG line plots and heatmaps for the evaluation reports (svg.h).
#include "cumulus/eval/svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

namespace cumulus {
namespace {

// Tableau 10: distinguishable, and readable for the common colour-vision deficiencies.
constexpr std::array<const char*, 10> kColors = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                                 "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#7f7f7f"};
constexpr const char* kFont = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\"";

constexpr double kWidth = 720, kHeight = 440;
constexpr double kLeft = 72, kRight = 210, kTop = 44, kBottom = 64;  // margins; legend on the right

struct Axis {
  bool log = false;
  double lo = 0, hi = 1;  // domain (log10 units on a log axis)
  std::vector<double> ticks;  // in data units
  int decimals = 0;           // linear axis labels
};

Axis axis_linear(double lo, double hi) {
  Axis a;
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  a.lo = std::floor(lo / step) * step;
  a.hi = std::ceil(hi / step) * step;
  for (double t = a.lo; t <= a.hi + step * 1e-9; t += step) a.ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  a.decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  return a;
}

// Log axis: bounds on the 1-2-5 sequence around the data; ticks at 1, 2, 5 x 10^k when
// the axis spans at most three decades, else at the decades.
Axis axis_log(double lo, double hi) {
  Axis a;
  a.log = true;
  auto seq = [](int e, int i) { return std::array<double, 3>{1, 2, 5}[i] * std::pow(10.0, e); };
  const int e_lo = static_cast<int>(std::floor(std::log10(lo))), e_hi = static_cast<int>(std::ceil(std::log10(hi)));
  double b_lo = std::pow(10.0, e_lo), b_hi = std::pow(10.0, e_hi);
  for (int i = 2; i >= 0; --i)
    if (seq(e_lo, i) <= lo * (1 + 1e-9)) {
      b_lo = seq(e_lo, i);
      break;
    }
  for (int i = 2; i >= 0; --i)  // 10^e_hi >= hi always; try 5, 2, 1 x 10^(e_hi - 1)
    if (seq(e_hi - 1, i) >= hi * (1 - 1e-9)) b_hi = seq(e_hi - 1, i);
  if (b_hi <= b_lo) b_hi = b_lo * 10;
  a.lo = std::log10(b_lo);
  a.hi = std::log10(b_hi);
  const bool fine = a.hi - a.lo <= 3;
  for (int e = e_lo; e <= e_hi; ++e)
    for (int i = 0; i < (fine ? 3 : 1); ++i) {
      const double t = seq(e, i);
      if (t >= b_lo * (1 - 1e-9) && t <= b_hi * (1 + 1e-9)) a.ticks.push_back(t);
    }
  return a;
}

double axis_pos(const Axis& a, double v) {
  const double x = a.log ? std::log10(v) : v;
  return (x - a.lo) / (a.hi - a.lo);
}

std::string tick_label(const Axis& a, double v) {
  if (!a.log) return fmt::format("{:.{}f}", v, a.decimals);
  if (v >= 1e-3 && v < 1e4) return fmt::format("{:g}", v);
  return fmt::format("1e{}", static_cast<int>(std::lround(std::log10(v))));
}

std::string header(double w, double h, const std::string& title) {
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\">\n"
      "<title>{2}</title>\n"
      "<rect x=\"0\" y=\"0\" width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{3}\" y=\"26\" {4} font-size=\"16\" font-weight=\"bold\" text-anchor=\"middle\">{2}</text>\n",
      w, h, xml_escape(title), w / 2, kFont);
}

std::string shorten(const std::string& s, size_t n) { return s.size() <= n ? s : s.substr(0, n - 1) + "~"; }

}  // namespace

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string svg_line_plot(const std::vector<PlotSeries>& series, const LinePlotOptions& o) {
  // Visible points per series (log axes drop coordinates <= 0).
  auto visible = [&](const std::pair<double, double>& p) {
    return std::isfinite(p.first) && std::isfinite(p.second) && (!o.log_x || p.first > 0) && (!o.log_y || p.second > 0);
  };
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  for (const auto& s : series)
    for (const auto& p : s.points)
      if (visible(p)) {
        x_lo = std::min(x_lo, p.first), x_hi = std::max(x_hi, p.first);
        y_lo = std::min(y_lo, p.second), y_hi = std::max(y_hi, p.second);
      }
  if (!std::isfinite(x_lo)) x_lo = o.log_x ? 0.1 : 0, x_hi = 1, y_lo = o.log_y ? 0.1 : 0, y_hi = 1;
  if (o.diagonal) {
    const double lo = std::min(x_lo, y_lo), hi = std::max(x_hi, y_hi);
    x_lo = y_lo = lo;
    x_hi = y_hi = hi;
  }
  const Axis ax = o.log_x ? axis_log(x_lo, x_hi) : axis_linear(x_lo, x_hi);
  const Axis ay = o.log_y ? axis_log(y_lo, y_hi) : axis_linear(y_lo, y_hi);
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + pw * axis_pos(ax, x); };
  auto py = [&](double y) { return kTop + ph * (1 - axis_pos(ay, y)); };

  std::string svg = header(kWidth, kHeight, o.title);
  // Grid, ticks and labels.
  svg += "<g stroke=\"#dddddd\" stroke-width=\"1\">\n";
  for (double t : ax.ticks) svg += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\"/>\n", px(t), kTop, kTop + ph);
  for (double t : ay.ticks) svg += fmt::format("<line x1=\"{1}\" y1=\"{0:.1f}\" x2=\"{2}\" y2=\"{0:.1f}\"/>\n", py(t), kLeft, kLeft + pw);
  svg += "</g>\n";
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333333\"/>\n", kLeft,
                     kTop, pw, ph);
  svg += fmt::format("<g {} font-size=\"12\" fill=\"#333333\">\n", kFont);
  for (double t : ax.ticks)
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", px(t), kTop + ph + 18,
                       tick_label(ax, t));
  for (double t : ay.ticks)
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", kLeft - 6, py(t) + 4,
                       tick_label(ay, t));
  svg += "</g>\n";
  svg += fmt::format("<text x=\"{}\" y=\"{}\" {} font-size=\"13\" text-anchor=\"middle\">{}</text>\n", kLeft + pw / 2,
                     kTop + ph + 40, kFont, xml_escape(o.x_label));
  svg += fmt::format(
      "<text x=\"18\" y=\"{0}\" {1} font-size=\"13\" text-anchor=\"middle\" transform=\"rotate(-90 18 {0})\">{2}</text>\n",
      kTop + ph / 2, kFont, xml_escape(o.y_label));
  if (!o.note.empty())
    svg += fmt::format("<text x=\"{}\" y=\"{}\" {} font-size=\"11\" fill=\"#555555\">{}</text>\n", kLeft,
                       kHeight - 8, kFont, xml_escape(o.note));
  if (o.diagonal) {
    const double lo = std::max(ax.log ? std::pow(10.0, ax.lo) : ax.lo, ay.log ? std::pow(10.0, ay.lo) : ay.lo);
    const double hi = std::min(ax.log ? std::pow(10.0, ax.hi) : ax.hi, ay.log ? std::pow(10.0, ay.hi) : ay.hi);
    svg += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#888888\" stroke-dasharray=\"5 4\"/>\n",
        px(lo), py(lo), px(hi), py(hi));
  }
  // Series: a line through the visible points, a marker on each; legend on the right.
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    const std::string color = s.color.empty() ? kColors[i % kColors.size()] : s.color;
    const char* dash = s.color.empty() && i >= kColors.size() ? " stroke-dasharray=\"6 3\"" : "";
    std::string pts;
    for (const auto& p : s.points)
      if (visible(p)) pts += fmt::format("{:.1f},{:.1f} ", px(p.first), py(p.second));
    svg += fmt::format("<g class=\"series\"><title>{}</title>\n", xml_escape(s.name));
    if (!pts.empty())
      svg += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{}/>\n", pts, color,
                         dash);
    for (const auto& p : s.points)
      if (visible(p))
        svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\"/>\n", px(p.first), py(p.second),
                           color);
    svg += "</g>\n";
    const double ly = kTop + 10 + 20 * static_cast<double>(i);
    svg += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"{4}/>\n",
                       kLeft + pw + 14, ly, kLeft + pw + 38, color, dash);
    svg += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3.5\" fill=\"{}\"/>\n", kLeft + pw + 26, ly, color);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" {} font-size=\"12\">{}</text>\n", kLeft + pw + 44, ly + 4, kFont,
                       xml_escape(shorten(s.name, 24)));
  }
  svg += "</svg>\n";
  return svg;
}

std::string svg_heatmap(const HeatmapOptions& o) {
  const size_t rows = o.y_ticks.size(), cols = o.x_ticks.size();
  const double cw = std::clamp(480.0 / std::max<size_t>(cols, 1), 40.0, 90.0);
  const double ch = 26;
  const double left = 90, top = 48;
  const double w = left + cw * cols + 110, h = top + ch * rows + 70;
  std::string svg = header(w, h, o.title);
  // Colour: white-ish (0) to dark green (1) through yellow; NaN grey.
  auto color = [](double v) {
    constexpr std::array<std::array<double, 3>, 3> stops = {{{215, 48, 39}, {254, 224, 139}, {26, 152, 80}}};
    v = std::clamp(v, 0.0, 1.0) * 2;
    const int i = std::min(1, static_cast<int>(v));
    const double t = v - i;
    std::array<int, 3> c{};
    for (int k = 0; k < 3; ++k) c[k] = static_cast<int>(std::lround(stops[i][k] + t * (stops[i + 1][k] - stops[i][k])));
    return fmt::format("#{:02x}{:02x}{:02x}", c[0], c[1], c[2]);
  };
  svg += fmt::format("<g {} font-size=\"12\">\n", kFont);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) {
      const double v = r < o.values.size() && c < o.values[r].size() ? o.values[r][c] : NAN;
      const double x = left + cw * c, y = top + ch * r;
      svg += fmt::format("<rect class=\"cell\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
                         "stroke=\"white\"/>\n",
                         x, y, cw, ch, std::isnan(v) ? "#cccccc" : color(v));
      svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", x + cw / 2, y + ch / 2 + 4,
                         std::isnan(v) ? "-" : fmt::format("{:.0f}%", 100 * v));
    }
  for (size_t r = 0; r < rows; ++r)
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", left - 6, top + ch * r + ch / 2 + 4,
                       xml_escape(o.y_ticks[r]));
  for (size_t c = 0; c < cols; ++c)
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", left + cw * c + cw / 2,
                       top + ch * rows + 16, xml_escape(o.x_ticks[c]));
  svg += "</g>\n";
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" {} font-size=\"13\" text-anchor=\"middle\">{}</text>\n",
                     left + cw * cols / 2, top + ch * rows + 38, kFont, xml_escape(o.x_label));
  svg += fmt::format(
      "<text x=\"16\" y=\"{0:.1f}\" {1} font-size=\"13\" text-anchor=\"middle\" transform=\"rotate(-90 16 {0:.1f})\">{2}</text>\n",
      top + ch * rows / 2, kFont, xml_escape(o.y_label));
  // Colour scale.
  const double sx = left + cw * cols + 24;
  for (int k = 0; k <= 10; ++k)
    svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"{:.1f}\" fill=\"{}\"/>\n", sx,
                       top + (10 - k) * ch * rows / 11, ch * rows / 11 + 0.5, color(k / 10.0));
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" {} font-size=\"11\">100%</text>\n", sx + 18, top + 10, kFont);
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" {} font-size=\"11\">0%</text>\n", sx + 18, top + ch * rows, kFont);
  if (!o.note.empty())
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" {} font-size=\"11\" fill=\"#555555\">{}</text>\n", 8, h - 8, kFont,
                       xml_escape(o.note));
  svg += "</svg>\n";
  return svg;
}

}  // namespace cumulus
