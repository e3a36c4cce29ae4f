// Small hand-written SVG plots for the evaluation reports: a line plot (one series per
// method; linear or log axes; optional y = x reference) and a heatmap with a value in each
// cell (NIAH accuracy, depth x length). Self-contained SVG 1.1 text: no scripts, no external
// fonts or styles, so any browser or viewer renders it.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace cumulus {

struct PlotSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), drawn in the given order
  std::string color;                              // "#rrggbb"; empty: the palette by position
};

struct LinePlotOptions {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;  // points with a coordinate <= 0 are left out on a log axis
  bool diagonal = false;              // dashed y = x line (achieved vs target)
  std::string note;                   // one line of small text under the plot
};

std::string svg_line_plot(const std::vector<PlotSeries>& series, const LinePlotOptions& o);

struct HeatmapOptions {
  std::string title, x_label, y_label;
  std::vector<std::string> x_ticks;         // [cols]
  std::vector<std::string> y_ticks;         // [rows], drawn top to bottom
  std::vector<std::vector<double>> values;  // [rows][cols] in [0, 1]; NaN = no data (grey)
  std::string note;
};

std::string svg_heatmap(const HeatmapOptions& o);

// &, <, >, " escaped for XML text and attributes.
std::string xml_escape(const std::string& s);

}  // namespace cumulus
