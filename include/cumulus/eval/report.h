// Reports of `cumulus eval` (tasks.h): JSON for machines (every per-step value), a Markdown
// summary for people and docs/results.md, and SVG plots: mean KL against the share of K/V
// read (one curve per method), true mass achieved against the target P (with y = x), and
// an NIAH accuracy heatmap (depth x length) per method.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "cumulus/eval/tasks.h"

namespace cumulus {

std::string eval_json(const EvalReport& report);
std::string eval_markdown(const EvalReport& report);
// (file name, SVG text) for each plot the report has data for.
std::vector<std::pair<std::string, std::string>> eval_svgs(const EvalReport& report);

// Accuracy over the cells and trials of one NIAH run name: [depth][length], NaN where no
// cell exists. `only_dense_correct`: only cells where dense answered correctly.
struct NiahGrid {
  std::vector<int> lengths;
  std::vector<double> depths;
  std::vector<std::vector<double>> accuracy;  // [depth][length]
};
NiahGrid niah_grid(const EvalReport& report, const std::string& name);
// Names of the NIAH runs in first-seen order (dense first).
std::vector<std::string> niah_run_names(const EvalReport& report);

}  // namespace cumulus
