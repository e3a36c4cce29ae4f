// JSON, Markdown and SVG reports of `cumulus eval` (report.h).
#include "cumulus/eval/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "cumulus/eval/svg.h"
#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

using nlohmann::json;

json number(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }  // NaN -> null

json numbers(const std::vector<double>& v) {
  json a = json::array();
  for (double x : v) a.push_back(number(x));
  return a;
}

json run_json(const RunStats& r) {
  json j{{"label", r.spec.label},
         {"name", r.name},
         {"curve", r.spec.curve},
         {"method", r.spec.method},
         {"params", r.spec.params},
         {"resolved_params", r.resolved},
         {"target", number(r.target)},
         {"steps", r.steps},
         {"head_steps", r.head_steps},
         {"tokens_mean", r.tokens_mean},
         {"token_fraction", r.token_fraction},
         {"kv_fraction", r.kv_fraction},
         {"mass_true_mean", number(r.mass_true_mean)},
         {"mass_true_min", number(r.mass_true_min)},
         {"reached", number(r.reached)},
         {"claimed_mean", number(r.claimed_mean)},
         {"out_err_mean", r.out_err_mean},
         {"bypass_fraction", r.bypass_fraction},
         {"seconds", r.seconds},
         {"per_layer",
          {{"mass_true_mean", numbers(r.layer_mass_true)},
           {"claimed_mean", numbers(r.layer_claimed)},
           {"reached", numbers(r.layer_reached)}}}};
  if (!r.kl.empty()) {
    j["kl"] = {{"mean", r.kl_summary.mean},     {"median", r.kl_summary.median}, {"p95", r.kl_summary.p95},
               {"max", r.kl_summary.max},       {"per_step", numbers(r.kl)}};
    j["nll_per_step"] = numbers(r.nll);
    j["ppl"] = number(r.ppl);
  }
  if (!std::isnan(r.match_target))
    j["matched"] = {{"target_tokens", r.match_target},
                    {"param", r.match_param},
                    {"budget", r.match_budget},
                    {"budget_runs", r.match_runs}};
  if (r.steps > 0 && r.kl.empty()) {
    j["answer"] = r.answer;
    j["correct"] = r.correct;
  }
  return j;
}

json runs_json(const std::vector<RunStats>& runs) {
  json a = json::array();
  for (const auto& r : runs) a.push_back(run_json(r));
  return a;
}

std::string pct(double v, int decimals = 1) {
  return std::isnan(v) ? std::string("-") : fmt::format("{:.{}f}", 100 * v, decimals);
}
std::string fixed(double v, int decimals) {
  return std::isnan(v) ? std::string("-") : fmt::format("{:.{}f}", v, decimals);
}
std::string sci(double v) { return std::isnan(v) ? std::string("-") : fmt::format("{:.3g}", v); }

std::string md_header(const EvalReport& r) {
  const EvalOptions& o = r.options;
  std::string s = fmt::format("## cumulus eval {}\n\n", o.task);
  s += fmt::format("- model: `{}` ({} layers, {} query / {} KV heads, head_dim {}, context {}; weights {})\n", r.model,
                   r.n_layers, r.n_heads, r.n_kv_heads, r.head_dim, r.model_context, r.weights);
  s += fmt::format("- text: `{}`; prefill: {}{}\n", r.text, o.prefill_method,
                   o.prefill_params.empty() ? std::string() : " (" + params_text(o.prefill_params) + ")");
  if (r.continuation.steps > 0)
    s += fmt::format("- context {} tokens: prompt {} tokens prefilled, then {} teacher-forced tokens decoded "
                     "(prefill {:.1f} s)\n",
                     r.continuation.context, r.continuation.prompt_tokens, r.continuation.steps,
                     r.continuation.prefill_s);
  if (!std::isnan(r.continuation.reference_prefill_s)) {
    const PrefillStats& ps = r.continuation.prefill_stats;
    s += fmt::format("- {} prefill computed {:.1f}% of the causal blocks (query-aware / vertical-slash / dense heads "
                     "{} / {} / {}); dense prefill took {:.1f} s; every KL is against all-dense (the first row)\n",
                     o.prefill_method, 100 * ps.block_share(), ps.heads_query_aware, ps.heads_vertical_slash,
                     ps.heads_dense, r.continuation.reference_prefill_s);
  }
  if (!r.niah.empty())
    s += fmt::format("- niah: lengths {}, depths {}, {} needle(s) per cell, template {}, seed {}, answer <= {} tokens\n",
                     fmt::join(o.lengths, "/"), fmt::join(o.depths, "/"), o.needles, r.niah_template, o.seed,
                     o.answer_tokens);
  s += fmt::format("- machine: {} ({} logical CPUs, {} threads), load average {:.2f} at the start; {}; total {:.1f} s\n",
                   r.machine.cpu, r.machine.logical_cpus, o.threads, r.machine.load_average, r.machine.date, r.total_s);
  s += fmt::format("- runtime: {}\n\n", r.device.empty() ? o.device : r.device);
  return s;
}

// The parameters a run was given; with none given, its target or budget at the default
// (the value its row depends on), "-" for a method with neither (dense).
std::string params_cell(const RunStats& r) {
  if (!std::isnan(r.match_target))
    return fmt::format("{}={} (matched to {:.0f})", r.match_param, r.match_budget, r.match_target);
  if (!r.spec.params.empty()) return params_text(r.spec.params);
  if (const MethodInfo* m = Registry::builtin().find_if_known(r.spec.method))
    for (const std::string* key : {&m->target_param, &m->budget_param})
      if (!key->empty() && r.resolved.count(*key)) return fmt::format("{}={} (default)", *key, r.resolved.at(*key));
  return "-";
}

std::string md_continuation_table(const std::vector<RunStats>& runs) {
  const double dense_ppl = runs.empty() ? kNaN : runs.front().ppl;
  std::string s = "| method | params | KV read % | tokens/head-step | true mass | reached P | KL mean | KL median | KL p95 "
                  "| ppl | ppl / dense |\n";
  s += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : runs)
    s += fmt::format("| {} | {} | {} | {:.0f} | {} | {} | {} | {} | {} | {} | {} |\n", r.name, params_cell(r),
                     pct(r.kv_fraction), r.tokens_mean, fixed(r.mass_true_mean, 4), pct(r.reached),
                     sci(r.kl_summary.mean), sci(r.kl_summary.median), sci(r.kl_summary.p95), fixed(r.ppl, 3),
                     fixed(r.ppl / dense_ppl, 4));
  return s;
}

constexpr const char* kContinuationNotes =
    "KV read %: K/V bytes read (scoring included) per layer-step, as a share of dense; tokens/head-step: tokens "
    "each query head's output was computed over (its GQA group's union); true mass: mean softmax mass of that "
    "set (bypassed LFPS heads excluded); reached P: share of head-steps whose true mass >= P; KL: "
    "KL(dense || method) of the next-token distributions, nats, over the teacher-forced steps; ppl: perplexity "
    "of the continuation tokens.\n\n";

std::string md_niah(const EvalReport& r) {
  std::string s;
  const std::vector<std::string> names = niah_run_names(r);
  // Per method: accuracy per length, overall, and on the cells dense gets right.
  std::set<int> lens_set;
  for (const auto& c : r.niah) lens_set.insert(c.length);
  const std::vector<int> lens(lens_set.begin(), lens_set.end());
  s += "| method |";
  for (int l : lens) s += fmt::format(" {} |", l);
  s += " all | where dense retrieves | tokens/head-step | KV read % |\n|---|";
  for (size_t i = 0; i < lens.size() + 4; ++i) s += "---:|";
  s += "\n";
  for (const auto& name : names) {
    std::map<int, std::pair<int, int>> per_len;  // length -> (correct, cells)
    int ok = 0, n = 0, ok_dense = 0, n_dense = 0;
    double tokens = 0, kv = 0;
    for (const auto& c : r.niah) {
      const bool dense_ok = !c.runs.empty() && c.runs.front().correct;
      for (const auto& run : c.runs) {
        if (run.name != name) continue;
        per_len[c.length].first += run.correct;
        ++per_len[c.length].second;
        ok += run.correct;
        ++n;
        if (dense_ok) ok_dense += run.correct, ++n_dense;
        tokens += run.tokens_mean;
        kv += run.kv_fraction;
      }
    }
    s += fmt::format("| {} |", name);
    for (int l : lens) {
      const auto it = per_len.find(l);
      s += it == per_len.end() ? " - |" : fmt::format(" {}/{} |", it->second.first, it->second.second);
    }
    s += fmt::format(" {}/{} | {} | {:.0f} | {} |\n", ok, n,
                     n_dense ? fmt::format("{}/{}", ok_dense, n_dense) : std::string("-"), n ? tokens / n : 0.0,
                     pct(n ? kv / n : kNaN));
  }
  s += "\nCells: correct answers / prompts. \"where dense retrieves\": only the prompts dense answers correctly. "
       "tokens/head-step and KV read %: means over the answer's decode steps.\n\n";
  // Dense answers (to see what the model does).
  s += "<details><summary>answers per prompt</summary>\n\n| length | depth | number | ";
  for (const auto& name : names) s += name + " | ";
  s += "\n|---:|---:|---|";
  for (size_t i = 0; i < names.size(); ++i) s += "---|";
  s += "\n";
  for (const auto& c : r.niah) {
    s += fmt::format("| {} | {:.2f} | {} | ", c.length, c.depth_achieved, c.number);
    for (const auto& name : names) {
      std::string cell = "-";
      for (const auto& run : c.runs)
        if (run.name == name) {
          std::string a = run.answer;
          std::replace(a.begin(), a.end(), '\n', ' ');
          std::replace(a.begin(), a.end(), '|', '/');
          cell = fmt::format("{} `{}`", run.correct ? "ok" : "no", a);
        }
      s += cell + " | ";
    }
    s += "\n";
  }
  s += "\n</details>\n\n";
  return s;
}

std::string file_safe(const std::string& s) {
  std::string out;
  for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ? c : '_';
  return out;
}

// Continuation runs of a report, each with the curve it belongs to.
std::vector<std::pair<std::string, const RunStats*>> curve_runs(const EvalReport& r) {
  std::vector<std::pair<std::string, const RunStats*>> out;
  if (r.options.task == "mass") {
    for (const auto& m : r.mass) out.emplace_back(m.run.name, &m.run);
  } else if (r.options.task == "matched") {
    for (const auto& g : r.matched) {
      out.emplace_back(g.adaptive.spec.curve, &g.adaptive);
      for (const auto& b : g.baselines) out.emplace_back(b.spec.curve + " (matched)", &b);
    }
  } else {
    for (const auto& run : r.continuation.runs) out.emplace_back(run.spec.curve, &run);
  }
  return out;
}

// The `eval mass` variants' own colours, by the start of their names (tasks.cpp's labels,
// lower case); the other variants take their method's.
const std::vector<std::pair<std::string, std::string>>& variant_colors() {
  static const std::vector<std::pair<std::string, std::string>> colors = {
      {"optimal", "#4e79a7"}, {"cluster optimal", "#9c755f"}, {"psa (bound)", "#edc948"}, {"psa (certified)", "#000000"}};
  return colors;
}

// One colour per method across every plot: the registry's (MethodInfo::color) for a curve
// named after a method (mass variants and matched baselines by the method they run), the
// `eval mass` variants' own (variant_colors); "" for names it does not know.
std::string method_color(const std::string& curve) {
  std::string n = curve;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const auto& [prefix, color] : variant_colors())
    if (n.rfind(prefix, 0) == 0) return color;
  const MethodInfo* best = nullptr;  // the longest registered name the curve starts with
  for (const MethodInfo& m : Registry::builtin().list())
    if (!m.color.empty() && n.rfind(m.name, 0) == 0 && (best == nullptr || m.name.size() > best->name.size()))
      best = &m;
  return best != nullptr ? best->color : "";
}

// Colours for curves no method owns: none that a registered method or a variant has.
const std::vector<std::string>& spare_colors() {
  static const std::vector<std::string> spare = [] {
    const std::vector<std::string> palette = {"#bab0ac", "#d37295", "#a0cbe8", "#8cd17d", "#b6992d",
                                              "#499894", "#86bcb6", "#fabfd2", "#ffbe7d", "#f1ce63"};
    std::set<std::string> taken;
    for (const auto& [prefix, color] : variant_colors()) taken.insert(color);
    for (const MethodInfo& m : Registry::builtin().list()) taken.insert(m.color);
    std::vector<std::string> out;
    for (const std::string& c : palette)
      if (taken.count(c) == 0) out.push_back(c);
    return out;
  }();
  return spare;
}

std::vector<PlotSeries> group_series(const std::vector<std::pair<std::string, const RunStats*>>& runs,
                                     double (*x)(const RunStats&), double (*y)(const RunStats&)) {
  std::vector<PlotSeries> out;
  for (const auto& [curve, run] : runs) {
    auto it = std::find_if(out.begin(), out.end(), [&](const PlotSeries& s) { return s.name == curve; });
    if (it == out.end()) {
      out.push_back({curve, {}, method_color(curve)});
      it = out.end() - 1;
    }
    it->points.emplace_back(x(*run), y(*run));
  }
  std::set<std::string> used;  // two curves of one method: the second takes a spare colour
  for (auto& s : out) {
    std::sort(s.points.begin(), s.points.end());
    if (!s.color.empty() && !used.insert(s.color).second) s.color.clear();
  }
  size_t next = 0;  // the rest, in order, from the colours no method owns (the plot dashes past them)
  for (auto& s : out)
    if (s.color.empty() && next < spare_colors().size()) s.color = spare_colors()[next++];
  return out;
}

}  // namespace

std::vector<std::string> niah_run_names(const EvalReport& report) {
  std::vector<std::string> names;
  for (const auto& c : report.niah)
    for (const auto& run : c.runs)
      if (std::find(names.begin(), names.end(), run.name) == names.end()) names.push_back(run.name);
  return names;
}

NiahGrid niah_grid(const EvalReport& report, const std::string& name) {
  NiahGrid g;
  std::set<int> lens;
  std::set<double> depths;
  for (const auto& c : report.niah) lens.insert(c.length), depths.insert(c.depth);
  g.lengths.assign(lens.begin(), lens.end());
  g.depths.assign(depths.begin(), depths.end());
  std::vector<std::vector<std::pair<int, int>>> counts(g.depths.size(), std::vector<std::pair<int, int>>(g.lengths.size()));
  for (const auto& c : report.niah) {
    const size_t di = std::lower_bound(g.depths.begin(), g.depths.end(), c.depth) - g.depths.begin();
    const size_t li = std::lower_bound(g.lengths.begin(), g.lengths.end(), c.length) - g.lengths.begin();
    for (const auto& run : c.runs)
      if (run.name == name) counts[di][li].first += run.correct, ++counts[di][li].second;
  }
  g.accuracy.assign(g.depths.size(), std::vector<double>(g.lengths.size(), kNaN));
  for (size_t d = 0; d < g.depths.size(); ++d)
    for (size_t l = 0; l < g.lengths.size(); ++l)
      if (counts[d][l].second > 0) g.accuracy[d][l] = static_cast<double>(counts[d][l].first) / counts[d][l].second;
  return g;
}

std::string eval_json(const EvalReport& r) {
  const EvalOptions& o = r.options;
  json j;
  j["task"] = o.task;
  j["model"] = {{"path", r.model},           {"n_layers", r.n_layers},   {"n_heads", r.n_heads},
                {"n_kv_heads", r.n_kv_heads}, {"head_dim", r.head_dim}, {"context_length", r.model_context},
                {"weights", r.weights}};
  j["options"] = {{"text", o.text},
                  {"methods", o.methods},
                  {"params", o.params},
                  {"sweeps", o.sweeps},
                  {"prefill_method", o.prefill_method},
                  {"prefill_params", o.prefill_params},
                  {"context", o.context},
                  {"steps", o.steps},
                  {"threads", o.threads},
                  {"page_size", o.page_size},
                  {"kv_dtype", std::string(dtype_name(o.kv_dtype))},
                  {"lengths", o.lengths},
                  {"depths", o.depths},
                  {"needles", o.needles},
                  {"answer_tokens", o.answer_tokens},
                  {"niah_template", r.niah_template.empty() ? o.niah_template : r.niah_template},
                  {"seed", o.seed},
                  {"targets", o.targets},
                  {"baselines", o.baselines},
                  {"match_iters", o.match_iters},
                  {"matched_niah", o.matched_niah},
                  {"kv_save", o.kv_save},
                  {"kv_load", o.kv_load},
                  {"device", o.device}};
  j["machine"] = {{"cpu", r.machine.cpu},
                  {"logical_cpus", r.machine.logical_cpus},
                  {"date", r.machine.date},
                  {"compiler", r.machine.compiler},
                  {"load_average", r.machine.load_average},
                  {"runtime", r.device}};
  j["total_s"] = r.total_s;
  if (r.continuation.steps > 0) {
    j["continuation"] = {{"context", r.continuation.context},
                         {"prompt_tokens", r.continuation.prompt_tokens},
                         {"steps", r.continuation.steps},
                         {"prefill_s", r.continuation.prefill_s},
                         {"runs", runs_json(r.continuation.runs)}};
    if (!std::isnan(r.continuation.reference_prefill_s)) {
      const PrefillStats& ps = r.continuation.prefill_stats;
      j["continuation"]["reference_prefill_s"] = r.continuation.reference_prefill_s;
      j["continuation"]["prefill_stats"] = {{"block_share", ps.block_share()},
                                            {"blocks_causal", ps.blocks_causal},
                                            {"blocks_computed", ps.blocks_computed},
                                            {"heads_query_aware", ps.heads_query_aware},
                                            {"heads_vertical_slash", ps.heads_vertical_slash},
                                            {"heads_dense", ps.heads_dense},
                                            {"select_s", ps.select_seconds},
                                            {"attention_s", ps.attention_seconds}};
    }
  }
  if (!r.mass.empty()) {
    json rows = json::array();
    for (const auto& m : r.mass) {
      json row = run_json(m.run);
      row["target"] = m.target;
      rows.push_back(row);
    }
    j["mass"] = rows;
  }
  if (!r.matched.empty()) {
    json groups = json::array();
    for (const auto& g : r.matched)
      groups.push_back({{"adaptive", run_json(g.adaptive)}, {"baselines", runs_json(g.baselines)}});
    j["matched"] = groups;
  }
  if (!r.niah.empty()) {
    json cells = json::array();
    for (const auto& c : r.niah) {
      cells.push_back({{"length", c.length},
                       {"depth", c.depth},
                       {"depth_achieved", c.depth_achieved},
                       {"trial", c.trial},
                       {"number", c.number},
                       {"prompt_tokens", c.prompt_tokens},
                       {"prefill_s", c.prefill_s},
                       {"runs", runs_json(c.runs)}});
    }
    j["niah"] = cells;
  }
  return j.dump(2) + "\n";
}

std::string eval_markdown(const EvalReport& r) {
  std::string s = md_header(r);
  const std::string& task = r.options.task;
  if (task == "kl" || task == "ppl") {
    s += md_continuation_table(r.continuation.runs);
    s += "\n" + std::string(kContinuationNotes);
  } else if (task == "mass") {
    s += "| P | method | budget | tokens/head-step | tokens % | true mass | reached P | KV read % | KL mean |\n";
    s += "|---:|---|---|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& m : r.mass) {
      const RunStats& run = m.run;
      s += fmt::format("| {} | {} | {} | {:.0f} | {} | {} | {} | {} | {} |\n", m.target, run.name,
                       std::isnan(run.match_target) ? std::string("-") : fmt::format("{}={}", run.match_param, run.match_budget),
                       run.tokens_mean, pct(run.token_fraction, 2), fixed(run.mass_true_mean, 4), pct(run.reached),
                       pct(run.kv_fraction), sci(run.kl_summary.mean));
    }
    if (!r.continuation.runs.empty())
      s += fmt::format("\nDense reference: {:.0f} tokens/head-step, perplexity {:.3f}.\n",
                       r.continuation.runs.front().tokens_mean, r.continuation.runs.front().ppl);
    s += "\nOptimal = oracle_topp (fewest tokens reaching P by true scores); Cluster Optimal = tactic "
         "mode=cluster_optimal (true scores in cluster order); PSA (mean/bound) = stop=estimate with that "
         "criticality; PSA (certified) = criticality=bound stop=certified; LFPS and Quest get the budget whose "
         "mean tokens/head-step is closest to Tactic's at the same P. tokens/head-step counts the GQA group's "
         "union; tokens % is of the cached tokens; reached P: share of head-steps with true mass >= P.\n\n";
  } else if (task == "matched") {
    for (const auto& g : r.matched) {
      s += fmt::format("### {} : {:.0f} tokens/head-step\n\n", g.adaptive.spec.label, g.adaptive.tokens_mean);
      std::vector<RunStats> runs{r.continuation.runs.front(), g.adaptive};
      runs.insert(runs.end(), g.baselines.begin(), g.baselines.end());
      for (auto& run : runs) run.name = run.spec.label;
      s += md_continuation_table(runs) + "\n";
    }
    s += kContinuationNotes;
  }
  if (!r.niah.empty()) s += md_niah(r);
  return s;
}

std::vector<std::pair<std::string, std::string>> eval_svgs(const EvalReport& r) {
  std::vector<std::pair<std::string, std::string>> out;
  const auto runs = curve_runs(r);
  if (!runs.empty()) {
    LinePlotOptions o;
    o.title = fmt::format("KL(dense || method) vs K/V read ({} tokens)", r.continuation.context);
    o.x_label = "share of dense K/V bytes read per decode step";
    o.y_label = "mean KL over the continuation (nats)";
    o.log_x = true;
    o.log_y = true;
    o.note = fmt::format("{}; {} steps. Points with KL = 0 (dense) are not drawn on the log scale.",
                         r.model.substr(r.model.find_last_of('/') + 1), r.continuation.steps);
    const auto series = group_series(
        runs, [](const RunStats& s) { return s.kv_fraction; }, [](const RunStats& s) { return s.kl_summary.mean; });
    out.emplace_back("kl_vs_kv.svg", svg_line_plot(series, o));
    std::vector<std::pair<std::string, const RunStats*>> with_target;
    for (const auto& cr : runs)
      if (!std::isnan(cr.second->target) && !std::isnan(cr.second->mass_true_mean)) with_target.push_back(cr);
    if (!with_target.empty()) {
      LinePlotOptions m;
      m.title = "True attention mass achieved vs target P";
      m.x_label = "target P";
      m.y_label = "mean true mass per head-step";
      m.diagonal = true;
      m.note = "dashed: achieved = target";
      out.emplace_back("mass_vs_target.svg",
                       svg_line_plot(group_series(
                                         with_target, [](const RunStats& s) { return s.target; },
                                         [](const RunStats& s) { return s.mass_true_mean; }),
                                     m));
    }
  }
  for (const auto& name : niah_run_names(r)) {
    const NiahGrid g = niah_grid(r, name);
    HeatmapOptions h;
    h.title = "NIAH retrieval: " + name;
    h.x_label = "prompt length (tokens)";
    h.y_label = "needle depth";
    for (int l : g.lengths) h.x_ticks.push_back(std::to_string(l));
    for (double d : g.depths) h.y_ticks.push_back(fmt::format("{:.0f}%", 100 * d));
    h.values = g.accuracy;
    h.note = fmt::format("{} needle(s) per cell, template {}; grey: not run", r.options.needles, r.niah_template);
    out.emplace_back("niah_" + file_safe(name) + ".svg", svg_heatmap(h));
  }
  return out;
}

}  // namespace cumulus
