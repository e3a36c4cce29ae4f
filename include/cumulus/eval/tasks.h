// The evaluation harness (docs/architecture.md "Evaluation"): tasks that judge
// decode methods on a real model and real text against dense attention, the way the papers
// do. Every task prefills once per prompt and runs each method from that prefill
// (Session::restart_decode); dense always runs first and is the reference. Sessions run in
// eval mode, so every head-step's true mass and ||o - o_dense|| are known.
//
//   kl       Tactic 5.2.2: prompt = the first C - T tokens of a text, then T teacher-forced
//            tokens one at a time; per step KL(dense || method) of the next-token
//            distributions. C is the cache length at the last step (default: the model's
//            context), so prompt + continuation fit the context exactly.
//   ppl      the same run; perplexity of the T continuation tokens under each method.
//   mass     Tactic, Table 1: per target P, Optimal (oracle_topp), Cluster Optimal
//            (tactic mode=cluster_optimal), Tactic, PSA mean / bound / certified, and LFPS
//            and Quest at Tactic's mean budget: tokens per head-step, true mass, share of
//            head-steps reaching P.
//   matched  Tactic 5.2.3: each adaptive method's mean tokens per head-step becomes the
//            budget of the fixed-budget baselines (quest, streaming, oracle_topk, lfps);
//            every metric side by side (and NIAH per cell when asked).
//   niah     needle-in-a-haystack (niah.h): lengths x depths x needles prompts, one prefill
//            each, a greedy answer per method; exact retrieval.
//
// Every decoded token goes through the decode method: the prompt's last token is not
// prefilled but decoded, so the first answer token (niah) and the first continuation
// distribution (kl, ppl) already depend on the method.
//
// Mean tokens per head-step counts what each query head's output was computed over, i.e.
// its GQA group's union (StepStats::tokens_attended). Budget matching is on that quantity:
// a baseline's budget parameter is calibrated (secant steps on budget -> mean tokens) until
// its own mean tokens per head-step is closest to the target; the achieved value is reported.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/eval/bench.h"
#include "cumulus/eval/method_spec.h"
#include "cumulus/eval/metrics.h"
#include "cumulus/kv/kv_snapshot.h"
#include "cumulus/methods/prefill.h"
#include "cumulus/model/model_load.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/runner.h"
#include "cumulus/model/tokenizer.h"

namespace cumulus {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct EvalOptions {
  std::string task = "kl";  // kl | ppl | mass | matched | niah
  // Methods as command-line text (method_spec.h). kl/ppl/niah: the compared methods
  // (default: every decode method at its defaults); matched: the adaptive method(s)
  // (default tactic); mass: ignored except for params, which reach its variants by label
  // (optimal, cluster_optimal, tactic, psa_mean, psa_bound, psa_certified, lfps, quest) or
  // by method name.
  std::vector<std::string> methods, params, sweeps;
  std::string text;  // text file (Gutenberg header/footer stripped): the long document / haystack
  std::string prefill_method = "dense";  // SessionOptions::prefill_method, shared by all methods
  std::map<std::string, std::string> prefill_params;
  int context = 0;  // kl/ppl/mass/matched: cache tokens at the last step; 0 = model context
  int steps = 32;   // teacher-forced continuation tokens T
  int threads = 2;
  int page_size = 16;
  DType kv_dtype = DType::f16;
  // niah
  std::vector<int> lengths{1024, 2048, 4096, 8192};  // prompt + answer tokens
  std::vector<double> depths{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
  int needles = 1;        // prompts (different numbers) per (length, depth) cell
  int answer_tokens = 16;
  std::string niah_template = "auto";  // auto | chat | plain
  uint64_t seed = 0;
  // mass
  std::vector<double> targets{0.5, 0.6, 0.7, 0.8, 0.9};
  // matched (and mass's LFPS/Quest rows)
  std::vector<std::string> baselines{"quest", "streaming", "oracle_topk", "lfps"};
  int match_iters = 3;       // budget runs per baseline at most (1: budget = target, no calibration)
  bool matched_niah = false;  // matched: also the NIAH grid, matched per cell
  // kl, ppl, mass, matched with the dense prefill: write the prompt's KV snapshot after the
  // prefill (kv_save), or load it instead of prefilling (kv_load; its tokens must be the
  // text's first context - steps tokens). kv/kv_snapshot.h.
  std::string kv_save, kv_load;
  // The runtime: cpu (the Session) or cuda (eval_run's RunnerFactory, from the CLI). The GPU
  // runs kl, ppl, matched and niah in eval mode (true mass on the device); not mass (its
  // variants have no GPU pipeline) nor KV snapshots.
  std::string device = "cpu";
  // cuda: every layer's K/V in one pool with this many GiB on the device and the rest in
  // pinned host memory (SessionOptions::device_kv_gib); 0: all on the device.
  double device_kv_gib = 0;

  // Error naming the first bad value, before any model is loaded: ranges, the prefill
  // method, and the methods, parameters and sweeps the task will run (dense is the
  // reference's label; matched takes adaptive methods only).
  void validate() const;
  // The checks that need the model's hyperparameters (its header, model_load_check):
  // context and NIAH lengths within the model's context, the methods' parameters against
  // its shape (method_specs_check).
  void validate(const ModelConfig& model) const;
};

// One method's decode steps from one prefill: a teacher-forced continuation or a greedy
// NIAH answer.
struct RunStats {
  MethodSpec spec;
  std::string name;                               // display name (mass: "Cluster Optimal")
  std::map<std::string, std::string> resolved;    // every parameter, defaults filled in
  double target = kNaN;  // the P it aims at (tactic/oracle_topp p, psa threshold), else NaN
  int steps = 0;
  std::vector<double> kl;   // [steps] KL(dense || method), nats (continuations)
  std::vector<double> nll;  // [steps] -log p(true next token), nats (continuations)
  Summary kl_summary;
  double ppl = kNaN;
  int64_t head_steps = 0;       // steps x layers x query heads
  double tokens_mean = 0;       // tokens attended per head-step (the group's union)
  double token_fraction = 0;    // tokens attended / cached tokens, mean per head-step
  double kv_fraction = 0;       // K/V bytes read / dense bytes, mean per layer-step
  double mass_true_mean = kNaN; // over head-steps with an attended set (not bypassed)
  double mass_true_min = kNaN;
  double reached = kNaN;        // share of those head-steps with true mass >= target
  double claimed_mean = kNaN;   // over head-steps with a claim
  double out_err_mean = 0;      // ||o - o_dense|| per head-step
  double bypass_fraction = 0;   // LFPS sink bypass
  // Per layer [n_layers] (NaN where undefined): mean true mass, mean claim, share reaching P.
  std::vector<double> layer_mass_true, layer_claimed, layer_reached;
  double seconds = 0;
  // Budget matching (matched, mass): the mean tokens per head-step aimed at, the budget
  // parameter and value used, how many budget runs it took.
  double match_target = kNaN;
  std::string match_param;
  int match_budget = 0, match_runs = 0;
  // niah only
  std::string answer;
  bool correct = false;
};

struct ContinuationReport {
  int prompt_tokens = 0, steps = 0, context = 0;
  double prefill_s = 0;
  // With a sparse prefill method (kl, ppl): the all-dense reference run first ("dense
  // prefill + dense"), its prefill time, and the sparse prefill's block statistics; every
  // KL is then against all-dense, so it includes what the sparse prefill costs.
  double reference_prefill_s = kNaN;
  PrefillStats prefill_stats;
  std::vector<RunStats> runs;  // dense first
};

// mass: one row per (target, variant).
struct MassRow {
  double target = 0;
  RunStats run;
};

// matched: per adaptive spec, the adaptive run and its matched baselines.
struct MatchedGroup {
  RunStats adaptive;
  std::vector<RunStats> baselines;
};

struct NiahCell {
  int length = 0;
  double depth = 0;           // requested
  double depth_achieved = 0;  // where the needle went
  int trial = 0;
  std::string number;
  int prompt_tokens = 0;
  double prefill_s = 0;
  std::vector<RunStats> runs;  // dense first (matched: adaptive, then its baselines)
};

struct EvalReport {
  EvalOptions options;
  std::string model;       // path
  std::string weights;     // storage of the weights: compact or f32
  std::string text;        // path
  int n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, model_context = 0;
  std::string niah_template;  // niah: the template used
  BenchMachine machine;       // cpu, date, load average at the start
  std::string device;         // the runtime's ModelRunner::device(): "cpu" or "cuda: <GPU>"
  double total_s = 0;
  ContinuationReport continuation;  // kl, ppl, mass, matched
  std::vector<MassRow> mass;
  std::vector<MatchedGroup> matched;
  std::vector<NiahCell> niah;       // niah (and matched with matched_niah)
};

// The methods options.task runs (kl/ppl/niah: dense first), and the runtime options of a
// prompt of `capacity` tokens that runs `specs` (eval mode, dense decode until
// restart_decode): the CLI checks each against --device before the model is loaded.
std::vector<MethodSpec> eval_task_specs(const EvalOptions& options);
SessionOptions eval_session_options(const EvalOptions& options, const Shape& shape, int capacity,
                                    const std::vector<MethodSpec>& specs);
// The largest context a task's runtime holds: the continuation's context, or the longest
// NIAH prompt.
int eval_capacity(const EvalOptions& options, const ModelConfig& model);

// The runtime of each prompt (options.device's): a ModelRunner of the weights with these
// options (SessionOptions::eval set).
using RunnerFactory = std::function<std::unique_ptr<ModelRunner>(const ModelWeights&, const SessionOptions&)>;
// Runs options.task. `progress`: stderr or nullptr; the bar draws only on a terminal.
// `make`: the runtime (empty: the CPU Session; device cuda needs one).
EvalReport eval_run(const LoadedModel& model, const EvalOptions& options, std::FILE* progress = nullptr,
                    const RunnerFactory& make = {});

// The first `n` tokens of a text file (Gutenberg header/footer stripped), tokenised with the
// tokenizer's BOS rule; equal to the first n tokens of the whole text. Throws Error when the
// text is shorter.
std::vector<int32_t> eval_text_tokens(const Tokenizer& tok, const std::string& path, int64_t n);

// The budget parameter of a fixed-budget method ("quest" -> "budget", "oracle_topk" -> "k",
// "lfps" -> "budget", "streaming" -> "window"); throws Error for a method without one.
std::string budget_param(const std::string& method);

}  // namespace cumulus
