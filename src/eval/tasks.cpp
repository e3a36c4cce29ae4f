// The evaluation tasks (tasks.h): one prefill per prompt, every method continued from it
// with Session::restart_decode, dense first as the reference, statistics from eval mode.
#include "cumulus/eval/tasks.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <set>

#include "core/check.h"
#include "cumulus/core/file.h"
#include "cumulus/eval/niah.h"
#include "cumulus/eval/progress.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_identity.h"
#include "cumulus/model/sampler.h"
#include "cumulus/model/runner.h"
#include "cumulus/model/session.h"
#include "cumulus/model/text.h"

namespace cumulus {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// True mass may miss P by float32 rounding of the dense pass that measures it.
constexpr double kReachTolerance = 1e-6;

// Every registered decode method, dense first.
std::vector<std::string> all_decode_methods() {
  std::vector<std::string> out{kDenseMethod};
  for (const auto& m : Registry::builtin().list())
    if (method_kind_decodes(m.kind) && m.name != kDenseMethod) out.push_back(m.name);
  return out;
}

// kl, ppl, niah: the selected methods (default: all) with dense first; dense is the
// reference of every comparison, so no other method may take its label.
std::vector<MethodSpec> eval_specs_with_dense(const EvalOptions& o) {
  std::vector<MethodSpec> specs =
      method_specs_parse(o.methods.empty() ? all_decode_methods() : o.methods, o.params, o.sweeps);
  for (const auto& s : specs)
    CUMULUS_CHECK(s.label != kDenseMethod || s.method == kDenseMethod,
                  "--method dense={}: the label 'dense' is the dense reference's; give this run another label",
                  s.method);
  auto it = std::find_if(specs.begin(), specs.end(), [](const MethodSpec& s) { return s.method == kDenseMethod; });
  if (it == specs.end()) {
    specs.insert(specs.begin(), MethodSpec{"dense", "dense", "dense", {}});
  } else {
    std::rotate(specs.begin(), it, it + 1);
  }
  return specs;
}

// The variants of Tactic's Table 1 (our version), by label.
struct MassVariant {
  const char* entry;
  const char* name;
  std::map<std::string, std::string> fixed;  // what defines the variant (wins over --param)
  bool sets_budget = false;  // the fixed-budget rows are matched to this variant's mean tokens
};

std::vector<MassVariant> mass_variants() {
  return {
      {"optimal=oracle_topp", "Optimal", {}},
      {"cluster_optimal=tactic", "Cluster Optimal", {{"mode", "cluster_optimal"}}},
      {"tactic", "Tactic", {{"mode", "fit"}}, true},
      {"psa_mean=psa", "PSA (mean)", {{"criticality", "mean"}, {"stop", "estimate"}}},
      {"psa_bound=psa", "PSA (bound)", {{"criticality", "bound"}, {"stop", "estimate"}}},
      // The certificate is a sum of Quest bounds over unvisited pages: visiting pages in
      // bound order shrinks it fastest.
      {"psa_certified=psa", "PSA (certified)", {{"criticality", "bound"}, {"stop", "certified"}}},
  };
}

// The fixed-budget rows of mass, each given the budget-setting variant's mean tokens.
struct MassMatched {
  const char* entry;
  const char* name;
};

std::vector<MassMatched> mass_matched() { return {{"lfps", "LFPS @ Tactic budget"}, {"quest", "Quest @ Tactic budget"}}; }

// mass: dense, the variants, then the fixed-budget rows.
std::vector<std::string> mass_entries() {
  std::vector<std::string> entries{"dense"};
  for (const auto& v : mass_variants()) entries.push_back(v.entry);
  for (const auto& m : mass_matched()) entries.push_back(m.entry);
  return entries;
}

// matched: the adaptive methods (--method, default tactic) and the fixed-budget baselines
// given their budget.
struct MatchedSpecs {
  std::vector<MethodSpec> all, adaptive, baselines;
};

MatchedSpecs matched_specs(const EvalOptions& o) {
  std::vector<std::string> entries = o.methods.empty() ? std::vector<std::string>{"tactic"} : o.methods;
  // An adaptive method sets its own budget; a fixed-budget one (or dense) would only be
  // matched against itself. Checked on --method alone, before the baselines join.
  for (const auto& s : method_specs_parse(entries))
    CUMULUS_CHECK(!Registry::builtin().find(s.method).target_param.empty(),
                  "matched --method {}: {} is not an adaptive method (it targets no mass); give one with a target "
                  "(tactic, psa, sketch_topp, oracle_topp), and fixed-budget methods as --baselines",
                  s.label, s.method);
  for (const auto& b : o.baselines) {
    budget_param(b);  // throws for a method without a budget
    entries.push_back(b);
  }
  MatchedSpecs m;
  m.all = method_specs_parse(entries, o.params, o.sweeps);
  std::set<std::string> baseline_set(o.baselines.begin(), o.baselines.end());
  for (auto& s : m.all) (baseline_set.count(s.curve) ? m.baselines : m.adaptive).push_back(s);
  for (const auto& s : m.baselines)
    CUMULUS_CHECK(s.label == s.curve, "--sweep may not vary the baseline {} (its budget is matched)", s.curve);
  CUMULUS_CHECK(!m.adaptive.empty(), "matched needs an adaptive method (--method, default tactic)");
  return m;
}

// Accumulates the per-head statistics of decode steps (Session::last_step after each).
struct StepAccumulator {
  double target = kNaN;
  int64_t head_steps = 0, set_steps = 0, reached = 0, claimed_n = 0, bypass = 0;
  double tokens = 0, fraction = 0, mass = 0, mass_min = INFINITY, claimed = 0, err = 0;
  // Per layer: [n_layers] sums of true mass, claims, head-steps reaching the target.
  struct Layer {
    double mass = 0, claimed = 0;
    int64_t set_steps = 0, claimed_n = 0, reached = 0;
  };
  std::vector<Layer> layers;

  void add(const std::vector<AttnOutput>& outs, int n_cached) {
    layers.resize(outs.size());
    for (size_t l = 0; l < outs.size(); ++l)
      for (const StepStats& st : outs[l].stats) {
        Layer& L = layers[l];
        ++head_steps;
        tokens += st.tokens_attended;
        fraction += static_cast<double>(st.tokens_attended) / n_cached;
        if (!std::isnan(st.out_err)) err += st.out_err;
        if (!std::isnan(st.mass_claimed)) claimed += st.mass_claimed, ++claimed_n, L.claimed += st.mass_claimed, ++L.claimed_n;
        if (st.bypass) ++bypass;
        if (st.bypass || std::isnan(st.mass_true)) continue;
        ++set_steps;
        ++L.set_steps;
        mass += st.mass_true;
        L.mass += st.mass_true;
        mass_min = std::min(mass_min, st.mass_true);
        if (!std::isnan(target) && st.mass_true >= target - kReachTolerance) ++reached, ++L.reached;
      }
  }

  void finish(RunStats& r, const AttentionSummary& summary) const {
    r.head_steps = head_steps;
    if (head_steps == 0) return;
    r.tokens_mean = tokens / head_steps;
    r.token_fraction = fraction / head_steps;
    r.kv_fraction = summary.mean_kv_fraction();
    r.out_err_mean = err / head_steps;
    r.bypass_fraction = static_cast<double>(bypass) / head_steps;
    if (set_steps > 0) {
      r.mass_true_mean = mass / set_steps;
      r.mass_true_min = mass_min;
      if (!std::isnan(target)) r.reached = static_cast<double>(reached) / set_steps;
    }
    if (claimed_n > 0) r.claimed_mean = claimed / claimed_n;
    for (const Layer& L : layers) {
      r.layer_mass_true.push_back(L.set_steps ? L.mass / L.set_steps : kNaN);
      r.layer_claimed.push_back(L.claimed_n ? L.claimed / L.claimed_n : kNaN);
      r.layer_reached.push_back(L.set_steps && !std::isnan(target) ? static_cast<double>(L.reached) / L.set_steps
                                                                    : kNaN);
    }
  }
};

class Evaluator {
 public:
  Evaluator(const LoadedModel& model, const EvalOptions& o, Progress& progress, RunnerFactory make)
      : m_(model), o_(o), progress_(progress), shape_(model.weights.config.shape()), make_(std::move(make)) {}

  EvalReport run();

 private:
  std::unique_ptr<ModelRunner> session_for(int capacity, const std::vector<MethodSpec>& specs);
  bool sparse_prefill() const { return o_.prefill_method != kDenseMethod && !reference_prefill_; }
  // Prefills `tokens` in pieces (bit-identical to one call: pieces are multiples of the
  // session's chunk) so the progress bar moves; returns seconds.
  double prefill(ModelRunner& s, std::span<const int32_t> tokens);
  RunStats start_run(ModelRunner& s, const MethodSpec& spec, const std::string& name) const;

  // Teacher-forced continuation: feed[i] decoded, labels[i] the token it should predict.
  RunStats run_continuation(ModelRunner& s, const MethodSpec& spec, const std::string& name);
  // Greedy NIAH answer starting with decoding `first` (the prompt's last token).
  RunStats run_answer(ModelRunner& s, const MethodSpec& spec, const std::string& name, int32_t first);
  // A fixed-budget baseline calibrated to `target_tokens` mean tokens per head-step.
  RunStats run_matched(const MethodSpec& base, double target_tokens, int max_budget, const std::string& name,
                       const std::function<RunStats(const MethodSpec&, const std::string&)>& run);

  void task_continuation(EvalReport& rep);
  void task_mass(EvalReport& rep);
  void task_matched(EvalReport& rep);
  void task_niah(EvalReport& rep);
  // Every (length, depth, trial) prompt: prefill once, then `fill` runs the methods through
  // `answer`. runs_per_cell only sizes the progress plan.
  using AnswerFn = std::function<RunStats(const MethodSpec&, const std::string&)>;
  void niah_grid(EvalReport& rep, const std::vector<MethodSpec>& specs, int runs_per_cell,
                 const std::function<void(NiahCell&, const AnswerFn&)>& fill);

  void continuation_setup(EvalReport& rep, const std::vector<MethodSpec>& specs);
  // KV snapshots are the CPU Session's (EvalOptions::validate refuses them elsewhere).
  Session& cpu_session() {
    Session* s = session_->session();
    CUMULUS_CHECK(s != nullptr, "--kv-save/--kv-load need the CPU runtime, not {}", session_->device());
    return *s;
  }

  const LoadedModel& m_;
  const EvalOptions& o_;
  Progress& progress_;
  Shape shape_;
  RunnerFactory make_;  // the runtime: the CPU Session unless eval_run was given another
  std::string device_;  // the runtime's device() (EvalReport::device)
  // Continuation state (kl, ppl, mass, matched).
  std::unique_ptr<ModelRunner> session_;
  std::vector<int32_t> feed_, labels_;
  std::vector<std::vector<double>> dense_log_probs_;  // [steps][vocab]
  bool reference_prefill_ = false;  // set while the all-dense reference of a sparse prefill runs
};

std::unique_ptr<ModelRunner> Evaluator::session_for(int capacity, const std::vector<MethodSpec>& specs) {
  SessionOptions so = eval_session_options(o_, shape_, capacity, specs);
  if (reference_prefill_) {
    so.prefill_method = "dense";
    so.prefill_params.clear();
  }
  std::unique_ptr<ModelRunner> r = make_ ? make_(m_.weights, so) : model_runner_cpu(m_.weights, so);
  device_ = r->device();
  return r;
}

double Evaluator::prefill(ModelRunner& s, std::span<const int32_t> tokens) {
  const auto t0 = Clock::now();
  constexpr size_t kPiece = 512;  // a multiple of the default prefill chunk (256)
  size_t i = 0;
  // A sparse prefill method (flexprefill) chooses its blocks from the whole prompt: one call.
  if (sparse_prefill()) {
    s.prefill(tokens);
    progress_.prefilled(static_cast<int64_t>(tokens.size()));
    return seconds_since(t0);
  }
  // Session keeps the prompt queries of the last prefill call only: the last piece must
  // hold all of them, so it is kept whole (>= kPiece tokens unless the prompt is shorter).
  while (tokens.size() - i >= 2 * kPiece) {
    s.prefill(tokens.subspan(i, kPiece));
    i += kPiece;
    progress_.prefilled(kPiece);
  }
  s.prefill(tokens.subspan(i));
  progress_.prefilled(static_cast<int64_t>(tokens.size() - i));
  return seconds_since(t0);
}

RunStats Evaluator::start_run(ModelRunner& s, const MethodSpec& spec, const std::string& name) const {
  RunStats r;
  r.spec = spec;
  r.name = name.empty() ? spec.label : name;
  r.resolved = Registry::builtin().parse(spec.method, spec.params).values();
  r.target = method_target(spec.method, r.resolved);
  s.restart_decode(spec.method, spec.params);
  return r;
}

RunStats Evaluator::run_continuation(ModelRunner& s, const MethodSpec& spec, const std::string& name) {
  progress_.label(fmt::format("{}: {}", o_.task, name.empty() ? spec.label : name));
  const auto t0 = Clock::now();
  RunStats r = start_run(s, spec, name);
  StepAccumulator acc;
  acc.target = r.target;
  // The first run of a continuation is dense: the reference of every KL.
  const bool is_reference = dense_log_probs_.empty();
  CUMULUS_CHECK(!is_reference || spec.method == kDenseMethod, "the first run must be dense, not {}", spec.method);
  for (size_t i = 0; i < feed_.size(); ++i) {
    const std::vector<float>& logits = s.decode(feed_[i]);
    acc.add(s.last_step(), s.position());
    if (is_reference) dense_log_probs_.push_back(log_softmax(logits));
    r.kl.push_back(kl_divergence(std::span<const double>(dense_log_probs_[i]), logits));
    r.nll.push_back(negative_log_likelihood(logits, labels_[i]));
    progress_.decoded(1);
  }
  r.steps = static_cast<int>(feed_.size());
  r.kl_summary = summarize(r.kl);
  r.ppl = perplexity(r.nll);
  acc.finish(r, s.summary());
  r.seconds = seconds_since(t0);
  return r;
}

RunStats Evaluator::run_answer(ModelRunner& s, const MethodSpec& spec, const std::string& name, int32_t first) {
  progress_.label(fmt::format("{}: {}", o_.task, name.empty() ? spec.label : name));
  const auto t0 = Clock::now();
  RunStats r = start_run(s, spec, name);
  StepAccumulator acc;
  acc.target = r.target;
  const Tokenizer& tok = *m_.tokenizer;
  Sampler greedy({});
  const std::vector<float>* logits = &s.decode(first);
  acc.add(s.last_step(), s.position());
  progress_.decoded(1);
  int steps = 1;
  for (int i = 0; i < o_.answer_tokens; ++i) {
    const int32_t next = greedy.sample(*logits);
    if (next == tok.eos_id() || tok.token_type(next) == TokenType::control) break;
    r.answer += tok.decode_piece(next);
    // Stop once a run of digits has ended: the answer is complete.
    const size_t d = r.answer.find_first_of("0123456789");
    if (d != std::string::npos && r.answer.find_first_not_of("0123456789", d) != std::string::npos) break;
    if (i + 1 == o_.answer_tokens) break;
    logits = &s.decode(next);
    acc.add(s.last_step(), s.position());
    progress_.decoded(1);
    ++steps;
  }
  r.steps = steps;
  acc.finish(r, s.summary());
  r.seconds = seconds_since(t0);
  return r;
}

RunStats Evaluator::run_matched(const MethodSpec& base, double target_tokens, int max_budget,
                                const std::string& name,
                                const std::function<RunStats(const MethodSpec&, const std::string&)>& run) {
  const std::string key = budget_param(base.method);
  const auto resolved = Registry::builtin().parse(base.method, base.params).values();
  // A method that attends tokens besides its budget (streaming's sinks besides its window)
  // is given the budget less them.
  const std::string& extra = Registry::builtin().find(base.method).budget_extra_param;
  const int offset = extra.empty() ? 0 : std::stoi(resolved.at(extra));
  auto clamp_budget = [&](double b) {
    return static_cast<int>(std::clamp<double>(std::round(b), 1.0, std::max(1, max_budget - offset)));
  };
  std::vector<std::pair<int, double>> tried;  // (budget, mean tokens)
  RunStats best;
  double best_gap = INFINITY;
  int budget = clamp_budget(target_tokens - offset);
  for (int it = 0; it < std::max(1, o_.match_iters); ++it) {
    MethodSpec spec = base;
    spec.params[key] = std::to_string(budget);
    RunStats r = run(spec, name);
    const double gap = std::abs(r.tokens_mean - target_tokens);
    tried.emplace_back(budget, r.tokens_mean);
    if (gap < best_gap) best_gap = gap, best = std::move(r);
    if (best_gap <= 0.005 * target_tokens) break;
    // Secant through the last two (budget, tokens) points; proportional from one point.
    const auto [b2, m2] = tried.back();
    double next = m2 > 0 ? b2 * target_tokens / m2 : 2.0 * b2;
    if (tried.size() >= 2) {
      const auto [b1, m1] = tried[tried.size() - 2];
      if (m2 != m1) next = b2 + (target_tokens - m2) * (b2 - b1) / (m2 - m1);
    }
    budget = clamp_budget(next);
    if (std::any_of(tried.begin(), tried.end(), [&](const auto& t) { return t.first == budget; })) break;
  }
  best.match_target = target_tokens;
  best.match_param = key;
  best.match_budget = std::stoi(best.resolved.at(key));
  best.match_runs = static_cast<int>(tried.size());
  return best;
}

void Evaluator::continuation_setup(EvalReport& rep, const std::vector<MethodSpec>& specs) {
  const int ctx = o_.context > 0 ? o_.context : m_.weights.config.context_length;
  CUMULUS_CHECK(ctx <= m_.weights.config.context_length, "context={} exceeds the model's context of {} tokens", ctx,
                m_.weights.config.context_length);
  CUMULUS_CHECK(ctx - o_.steps >= 16, "context={} leaves {} prompt tokens before the {} steps: need >= 16", ctx,
                ctx - o_.steps, o_.steps);
  // Text x[0, ctx]: prefill x[0, ctx - T), decode x[ctx - T + i] predicting x[ctx - T + i + 1].
  const std::vector<int32_t> x = eval_text_tokens(*m_.tokenizer, o_.text, ctx + 1);
  const int prompt = ctx - o_.steps;
  feed_.assign(x.begin() + prompt, x.begin() + ctx);
  labels_.assign(x.begin() + prompt + 1, x.begin() + ctx + 1);
  session_ = session_for(ctx, specs);
  rep.continuation.context = ctx;
  rep.continuation.prompt_tokens = prompt;
  rep.continuation.steps = o_.steps;
  if (!o_.kv_load.empty()) {
    // The snapshot replaces the prefill: it must hold exactly this prompt.
    const auto t0 = Clock::now();
    const KvSnapshot snap = KvSnapshot::open(o_.kv_load);
    const std::span<const int32_t> have = snap.tokens();
    CUMULUS_CHECK(static_cast<int>(have.size()) == prompt,
                  "--kv-load '{}': the snapshot holds a prompt of {} tokens; context {} - steps {} needs {}", o_.kv_load,
                  have.size(), ctx, o_.steps, prompt);
    const auto diff = std::mismatch(have.begin(), have.end(), x.begin()).first;
    CUMULUS_CHECK(diff == have.end(),
                  "--kv-load '{}': prompt token {} is {} in the snapshot but {} in the text '{}': another text",
                  o_.kv_load, diff - have.begin(), *diff, x[diff - have.begin()], o_.text);
    cpu_session().kv_load(snap, model_identity(m_.path));
    progress_.prefilled(prompt);
    rep.continuation.prefill_s = seconds_since(t0);
    return;
  }
  progress_.label(fmt::format("{}: prefill of {} tokens", o_.task, prompt));
  rep.continuation.prefill_s = prefill(*session_, std::span<const int32_t>(x).first(prompt));
  if (!o_.kv_save.empty()) cpu_session().kv_save(o_.kv_save, model_identity(m_.path));
}

void Evaluator::task_continuation(EvalReport& rep) {
  const std::vector<MethodSpec> specs = eval_specs_with_dense(o_);
  const int ctx = o_.context > 0 ? o_.context : m_.weights.config.context_length;
  const bool sparse = sparse_prefill();
  progress_.plan((ctx - o_.steps) * (sparse ? 2 : 1), static_cast<int64_t>(specs.size() + sparse) * o_.steps);
  if (sparse) {
    // The reference of every KL is all-dense: dense prefill, then dense decode.
    reference_prefill_ = true;
    continuation_setup(rep, specs.front().method == kDenseMethod ? std::vector<MethodSpec>{specs.front()} : specs);
    rep.continuation.runs.push_back(run_continuation(*session_, specs.front(), "dense prefill + dense"));
    rep.continuation.reference_prefill_s = rep.continuation.prefill_s;
    reference_prefill_ = false;
  }
  continuation_setup(rep, specs);
  if (sparse) rep.continuation.prefill_stats = session_->prefill_stats();
  for (const auto& s : specs)
    rep.continuation.runs.push_back(
        run_continuation(*session_, s, sparse ? fmt::format("{} prefill + {}", o_.prefill_method, s.label) : ""));
}

void Evaluator::task_mass(EvalReport& rep) {
  const std::vector<MassVariant> variants = mass_variants();
  const std::vector<std::string> entries = mass_entries();
  std::vector<MethodSpec> specs = method_specs_parse(entries, o_.params, {});
  const int ctx = o_.context > 0 ? o_.context : m_.weights.config.context_length;
  const int runs_per_target = static_cast<int>(variants.size()) + 2 * std::max(1, o_.match_iters);
  progress_.plan(ctx - o_.steps, (1 + static_cast<int64_t>(o_.targets.size()) * runs_per_target) * o_.steps);
  continuation_setup(rep, specs);
  rep.continuation.runs.push_back(run_continuation(*session_, specs[0], "Dense"));
  auto run = [&](const MethodSpec& s, const std::string& name) { return run_continuation(*session_, s, name); };
  for (double p : o_.targets) {
    const std::string ptext = fmt::format("{}", p);
    double tactic_tokens = kNaN;
    for (size_t i = 0; i < variants.size(); ++i) {
      MethodSpec s = specs[i + 1];
      for (const auto& [k, v] : variants[i].fixed) s.params[k] = v;
      s.params[Registry::builtin().find(s.method).target_param] = ptext;
      s.label += " p=" + ptext;
      RunStats r = run(s, variants[i].name);
      if (variants[i].sets_budget) tactic_tokens = r.tokens_mean;
      rep.mass.push_back({p, std::move(r)});
    }
    const std::vector<MassMatched> matched = mass_matched();
    for (size_t i = 0; i < matched.size(); ++i) {
      MethodSpec s = specs[variants.size() + 1 + i];
      s.label += " @ tactic p=" + ptext;
      rep.mass.push_back({p, run_matched(s, tactic_tokens, ctx, matched[i].name, run)});
    }
  }
}

void Evaluator::task_matched(EvalReport& rep) {
  const MatchedSpecs m = matched_specs(o_);
  const std::vector<MethodSpec>& all = m.all;
  const std::vector<MethodSpec>& adaptive = m.adaptive;
  const std::vector<MethodSpec>& baselines = m.baselines;
  std::vector<MethodSpec> session_specs = all;
  const MethodSpec dense{"dense", "dense", "dense", {}};
  const int runs = 1 + static_cast<int>(adaptive.size()) *
                           (1 + static_cast<int>(baselines.size()) * std::max(1, o_.match_iters));
  const int ctx = o_.context > 0 ? o_.context : m_.weights.config.context_length;
  progress_.plan(ctx - o_.steps, static_cast<int64_t>(runs) * o_.steps);
  continuation_setup(rep, session_specs);
  rep.continuation.runs.push_back(run_continuation(*session_, dense, ""));
  auto run = [&](const MethodSpec& s, const std::string& name) { return run_continuation(*session_, s, name); };
  for (const auto& a : adaptive) {
    MatchedGroup g;
    g.adaptive = run(a, "");
    for (const auto& b : baselines)
      g.baselines.push_back(run_matched(b, g.adaptive.tokens_mean, ctx, b.label + " @ " + a.label, run));
    rep.matched.push_back(std::move(g));
  }
  session_.reset();
  if (!o_.matched_niah) return;

  // The NIAH grid, matched per cell: each adaptive run's mean tokens in that cell is the
  // budget its baselines get there.
  std::vector<MethodSpec> cell_specs{dense};
  cell_specs.insert(cell_specs.end(), all.begin(), all.end());
  niah_grid(rep, cell_specs, runs, [&](NiahCell& cell, const AnswerFn& answer) {
    cell.runs.push_back(answer(dense, ""));
    for (const auto& a : adaptive) {
      cell.runs.push_back(answer(a, ""));
      const double target = cell.runs.back().tokens_mean;
      for (const auto& b : baselines)
        cell.runs.push_back(run_matched(b, target, cell.length, b.label + " @ " + a.label, answer));
    }
  });
}

void Evaluator::niah_grid(EvalReport& rep, const std::vector<MethodSpec>& specs, int runs_per_cell,
                          const std::function<void(NiahCell&, const AnswerFn&)>& fill) {
  int64_t pf = 0;
  for (int len : o_.lengths) pf += static_cast<int64_t>(len) * o_.depths.size() * o_.needles;
  progress_.plan(pf, static_cast<int64_t>(runs_per_cell) * o_.answer_tokens * o_.depths.size() *
                         o_.lengths.size() * o_.needles);
  const int max_len = *std::max_element(o_.lengths.begin(), o_.lengths.end());
  const std::vector<int32_t> hay = eval_text_tokens(*m_.tokenizer, o_.text, max_len);
  const NiahTemplate style = niah_template_parse(o_.niah_template, *m_.tokenizer);
  rep.niah_template = std::string(niah_template_name(style));
  for (int len : o_.lengths)
    for (double depth : o_.depths)
      for (int trial = 0; trial < o_.needles; ++trial) {
        const NiahPrompt p =
            niah_prompt_build(*m_.tokenizer, hay, {len, depth, o_.answer_tokens, style, o_.seed, trial});
        auto s = session_for(len, specs);
        NiahCell cell;
        cell.length = len;
        cell.depth = depth;
        cell.depth_achieved = p.depth;
        cell.trial = trial;
        cell.number = p.number;
        cell.prompt_tokens = static_cast<int>(p.tokens.size());
        progress_.label(fmt::format("niah: prefill {} tokens, depth {}", p.tokens.size(), depth));
        // The prompt's last token is decoded, so the whole answer depends on the method.
        cell.prefill_s = prefill(*s, std::span<const int32_t>(p.tokens).first(p.tokens.size() - 1));
        const AnswerFn answer = [&](const MethodSpec& spec, const std::string& name) {
          RunStats r = run_answer(*s, spec, name, p.tokens.back());
          r.correct = niah_answer_correct(r.answer, p.number);
          return r;
        };
        fill(cell, answer);
        rep.niah.push_back(std::move(cell));
      }
}

void Evaluator::task_niah(EvalReport& rep) {
  const std::vector<MethodSpec> specs = eval_specs_with_dense(o_);
  niah_grid(rep, specs, static_cast<int>(specs.size()), [&](NiahCell& cell, const AnswerFn& answer) {
    for (const auto& spec : specs) cell.runs.push_back(answer(spec, ""));
  });
}

EvalReport Evaluator::run() {
  EvalReport rep;
  rep.options = o_;
  rep.model = m_.path;
  rep.weights = m_.storage;
  rep.text = o_.text;
  const ModelConfig& c = m_.weights.config;
  rep.n_layers = c.n_layers;
  rep.n_heads = c.n_heads;
  rep.n_kv_heads = c.n_kv_heads;
  rep.head_dim = c.head_dim;
  rep.model_context = c.context_length;
  rep.machine = bench_machine();
  const auto t0 = Clock::now();
  if (o_.task == "kl" || o_.task == "ppl") {
    task_continuation(rep);
  } else if (o_.task == "mass") {
    task_mass(rep);
  } else if (o_.task == "matched") {
    task_matched(rep);
  } else {
    task_niah(rep);
  }
  rep.total_s = seconds_since(t0);
  rep.device = device_;
  return rep;
}

}  // namespace

std::vector<MethodSpec> eval_task_specs(const EvalOptions& o) {
  if (o.task == "mass") return method_specs_parse(mass_entries(), o.params, {});
  if (o.task == "matched") return matched_specs(o).all;
  return eval_specs_with_dense(o);
}

SessionOptions eval_session_options(const EvalOptions& o, const Shape& shape, int capacity,
                                    const std::vector<MethodSpec>& specs) {
  SessionOptions so;
  so.method = "dense";
  so.prefill_method = o.prefill_method;
  so.prefill_params = o.prefill_params;
  so.kv.page_size = o.page_size;
  so.kv.dtype = o.kv_dtype;
  so.n_threads = o.threads;
  so.eval = true;
  so.max_tokens = capacity;
  so.device_kv_gib = o.device_kv_gib;
  // restart_decode needs the prompt queries of every method that learns from them (lfps);
  // a snapshot keeps enough for later runs' methods too.
  if (!o.kv_save.empty()) so.keep_prompt_queries = kKvSnapshotPromptQueries;
  for (const auto& s : specs)
    so.keep_prompt_queries =
        std::max(so.keep_prompt_queries, Registry::builtin().make(s.method, shape, s.params)->prompt_queries());
  return so;
}

int eval_capacity(const EvalOptions& o, const ModelConfig& model) {
  if (o.task == "niah" || (o.task == "matched" && o.matched_niah)) {
    const int niah = *std::max_element(o.lengths.begin(), o.lengths.end());
    if (o.task == "niah") return niah;
    return std::max(niah, o.context > 0 ? o.context : model.context_length);
  }
  return o.context > 0 ? o.context : model.context_length;
}

// Tokenises a growing prefix of the text, never the whole book unless needed; the last
// tokens of a cut prefix may be split words, so a margin of them is dropped.
std::vector<int32_t> eval_text_tokens(const Tokenizer& tok, const std::string& path, int64_t n) {
  const std::string text = text_strip_gutenberg(text_read_file(path));
  constexpr int64_t kMargin = 16;
  size_t chars = static_cast<size_t>(std::max<int64_t>(4096, 6 * (n + kMargin)));
  while (true) {
    const bool whole = chars >= text.size();
    std::vector<int32_t> ids = tok.encode(std::string_view(text).substr(0, std::min(chars, text.size())),
                                          tok.add_bos_default());
    if (!whole && static_cast<int64_t>(ids.size()) < n + kMargin) {
      chars *= 2;
      continue;
    }
    CUMULUS_CHECK(static_cast<int64_t>(ids.size()) >= n, "text '{}' has {} tokens, the task needs {}", path,
                  ids.size(), n);
    ids.resize(n);
    return ids;
  }
}

std::string budget_param(const std::string& method) {
  const MethodInfo& m = Registry::builtin().find(method);  // unknown: the registry's error lists the names
  if (!m.budget_param.empty()) return m.budget_param;
  std::string fixed;
  for (const MethodInfo& f : Registry::builtin().list())
    if (!f.budget_param.empty()) fixed += (fixed.empty() ? "" : ", ") + f.name;
  CUMULUS_FAIL("method {} has no token budget to match (fixed-budget methods: {})", method, fixed);
}

void EvalOptions::validate() const {
  static const std::set<std::string> kTasks{"kl", "ppl", "mass", "matched", "niah"};
  CUMULUS_CHECK(kTasks.count(task), "task '{}' must be one of kl, ppl, mass, matched, niah", task);
  CUMULUS_CHECK(!text.empty(), "task {} needs a text file (--text)", task);
  CUMULUS_CHECK(context >= 0, "context={} must be >= 0 (0: the model's context)", context);
  CUMULUS_CHECK(steps >= 1 && steps <= 4096, "steps={} must be in [1, 4096]", steps);
  CUMULUS_CHECK(threads >= 1 && threads <= 256, "threads={} must be in [1, 256]", threads);
  CUMULUS_CHECK(!lengths.empty() && !depths.empty(), "niah needs lengths and depths");
  for (int l : lengths) CUMULUS_CHECK(l >= 64, "length={} must be >= 64", l);
  for (double d : depths) CUMULUS_CHECK(d >= 0 && d <= 1, "depth={} must be in [0, 1]", d);
  CUMULUS_CHECK(needles >= 1 && needles <= 1000, "needles={} must be in [1, 1000]", needles);
  CUMULUS_CHECK(answer_tokens >= 1 && answer_tokens <= 256, "answer_tokens={} must be in [1, 256]", answer_tokens);
  CUMULUS_CHECK(!targets.empty(), "mass needs targets");
  for (double p : targets) CUMULUS_CHECK(p > 0 && p <= 1, "target={} must be in (0, 1]", p);
  CUMULUS_CHECK(match_iters >= 1 && match_iters <= 10, "match_iters={} must be in [1, 10]", match_iters);
  for (const auto& b : baselines) budget_param(b);
  CUMULUS_CHECK(task != "mass" || (methods.empty() && sweeps.empty()),
                "mass runs fixed variants (optimal, cluster_optimal, tactic, psa_mean, psa_bound, psa_certified, lfps, "
                "quest) at --targets: tune them with --param, not --method/--sweep");
  CUMULUS_CHECK(page_size >= 1 && page_size <= 256 && (page_size & (page_size - 1)) == 0,
                "page_size={} must be a power of two in [1, 256]", page_size);
  CUMULUS_CHECK(device_kv_gib >= 0 && std::isfinite(device_kv_gib), "device_kv_gib={} must be >= 0", device_kv_gib);
  CUMULUS_CHECK(device_kv_gib == 0 || device == "cuda", "device_kv_gib={} needs device cuda (not {})",
                device_kv_gib, device);
  prefill_spec_check(prefill_method, prefill_params);
  CUMULUS_CHECK(device == "cpu" || device == "cuda", "--device={} must be cpu or cuda", device);
  if (device != "cpu") {
    CUMULUS_CHECK(task != "mass",
                  "eval mass --device {}: mass runs variants with no GPU pipeline (tactic mode=cluster_optimal, psa "
                  "stop=certified, lfps): run it with --device cpu",
                  device);
    CUMULUS_CHECK(kv_save.empty() && kv_load.empty(), "eval --device {}: --kv-save/--kv-load are the CPU's only",
                  device);
  }
  if (!kv_save.empty() || !kv_load.empty()) {
    const char* opt = kv_save.empty() ? "--kv-load" : "--kv-save";
    CUMULUS_CHECK(kv_save.empty() || kv_load.empty(), "give --kv-save or --kv-load, not both");
    CUMULUS_CHECK(task != "niah" && !(task == "matched" && matched_niah),
                  "{}: niah prefills one prompt per cell; a snapshot holds one prompt (kl, ppl, mass, matched)", opt);
    CUMULUS_CHECK(prefill_method == kDenseMethod,
                  "{} with --prefill {}: a sparse prefill's evaluation prefills twice (all-dense reference, then "
                  "{}); a snapshot holds one prefill: use the dense prefill",
                  opt, prefill_method, prefill_method);
  }
  // The methods, parameters and sweeps each task will run, parsed now so that a typo fails
  // before the model is loaded.
  eval_task_specs(*this);
}

void EvalOptions::validate(const ModelConfig& model) const {
  // What the methods need of the model (quest's dense_layers within its layers).
  const Shape shape = model.shape();
  method_specs_check(eval_task_specs(*this), shape);
  prefill_spec_check(prefill_method, prefill_params, &shape);
  const int ctx = model.context_length;
  if (task == "niah" || (task == "matched" && matched_niah)) {
    for (int l : lengths) CUMULUS_CHECK(l <= ctx, "length={} exceeds the model's context of {} tokens", l, ctx);
  }
  if (task != "niah") {
    const int c = context > 0 ? context : ctx;
    CUMULUS_CHECK(c <= ctx, "context={} exceeds the model's context of {} tokens", c, ctx);
    CUMULUS_CHECK(c - steps >= 16, "context={} leaves {} prompt tokens before the {} steps: need >= 16", c, c - steps,
                  steps);
  }
}

EvalReport eval_run(const LoadedModel& model, const EvalOptions& options, std::FILE* progress_out,
                    const RunnerFactory& make) {
  options.validate();
  options.validate(model.weights.config);
  CUMULUS_CHECK(options.device == "cpu" || make,
                "eval --device {}: eval_run needs that device's runtime (RunnerFactory); the CLI passes it", options.device);
  Progress progress(progress_out);
  Evaluator e(model, options, progress, make);
  return e.run();
}

}  // namespace cumulus
