// `cumulus eval TASK`: judge decode methods on a real model and real text against dense
// attention (docs/results.md has the commands and results for SmolLM2). The tasks
// live in src/eval/tasks.cpp, the reports in src/eval/report.cpp; this file maps options.
//
// Output: the Markdown summary goes to stdout unless --markdown names a file; --json PATH
// writes the full report; --svg-dir DIR writes the plots. A progress bar with the time left
// draws on stderr when stderr is a terminal.
#include <fmt/format.h>

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <memory>

#include "core/check.h"
#include "cli.h"
#include "limits.h"
#include "paths.h"
#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/eval/report.h"
#include "cumulus/eval/tasks.h"
#include "cumulus/model/text.h"

namespace cumulus::cli {
namespace {

struct EvalArgs {
  EvalOptions o;
  std::string model, tokenizer, kv_dtype = "f16", weights = "compact";
  std::vector<std::string> prefill_params;
  std::string json, markdown, svg_dir;
};

// A --text of only whitespace once a Gutenberg header and footer are stripped ended after the
// model loaded, in "text has 1 tokens, the task needs 129". A regular file is read here
// (the task reads it again); a pipe (`--text <(cmd)`) can be read once only, so the task's
// own check stands for it.
void text_check_nonblank(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  const std::string text = text_strip_gutenberg(text_read_file(path));
  CUMULUS_CHECK(text.find_first_not_of(" \t\r\n\f\v") != std::string::npos,
                "--text '{}' holds no text: {} (once a Gutenberg header and footer, if any, are stripped)", path,
                text.empty() ? "it is empty" : fmt::format("only {} bytes of whitespace", text.size()));
}

void eval_command_run(EvalArgs& a) {
  // Everything is checked before the model is loaded: options, methods, the text, the
  // model and tokenizer files, and every output path (an hour's evaluation must not be lost
  // to a typo in --markdown).
  EvalOptions o = a.o;
  paths_check_distinct({{"--model", a.model}, {"--tokenizer", a.tokenizer}, {"--text", o.text},
                        {"--kv-load", o.kv_load}, {"--json", a.json, true}, {"--markdown", a.markdown, true},
                        {"--kv-save", o.kv_save, true}});
  o.kv_dtype = dtype_from_name(a.kv_dtype);
  o.prefill_params = prefill_param_map(a.prefill_params);
  const WeightStorage storage = weight_storage_from_name(a.weights);
  o.validate();
  file_check_input(o.text, "--text");
  text_check_nonblank(o.text);
  if (!a.markdown.empty()) file_check_output(a.markdown, "--markdown");
  if (!a.json.empty()) file_check_output(a.json, "--json");
  if (!a.svg_dir.empty()) dir_check_output(a.svg_dir, "--svg-dir");
  if (!o.kv_save.empty()) file_check_output(o.kv_save, "--kv-save");
  const ModelConfig config = model_load_check(a.model, a.tokenizer);
  o.validate(config);
  if (o.device != "cpu") {
    // Every method the task runs, with its parameters, must run on the device, and the
    // largest prompt must fit in its memory: checked before the model is loaded (a build
    // without CUDA fails in the first call that needs the device).
    if (o.methods.empty() && o.task != "matched") {
      o.methods = device_decode_methods(o.device, config);
      o.validate();
    }
    for (const MethodSpec& spec : eval_task_specs(o)) {
      SessionOptions so = eval_session_options(o, config.shape(), eval_capacity(o, config), {spec});
      so.method = spec.method;
      so.params = spec.params;
      device_check(o.device, config, so);
    }
  }
  if (!o.kv_load.empty()) {
    const KvSnapshot snap = model_snapshot_open(o.kv_load, a.model, o.page_size, o.kv_dtype);
    snapshot_weights_check(o.kv_load, snap.info().setup, a.model, a.weights);
    const int ctx = o.context > 0 ? o.context : config.context_length;
    CUMULUS_CHECK(snap.info().n_tokens == ctx - o.steps,
                  "--kv-load '{}': the snapshot holds a prompt of {} tokens; --context {} - --steps {} needs {}",
                  o.kv_load, snap.info().n_tokens, ctx, o.steps, ctx - o.steps);
  }

  if (o.device == "cpu") {
    // The weights and the K/V of the longest prompt and its steps (one session) must fit.
    const int64_t tokens = eval_capacity(o, config);
    memory_check("this evaluation", memory_weights_bytes(a.model, config, storage),
                 memory_kv_bytes(config, o.kv_dtype, tokens, 1), 0,
                 fmt::format("{} tokens in {}, --weights {}", tokens, a.kv_dtype, a.weights));
  }

  if (o.task != "matched")  // matched gives its baselines their budgets
    for (const MethodSpec& spec : eval_task_specs(o))
      if (const std::string warn = method_budget_warning(spec, eval_capacity(o, config)); !warn.empty())
        fmt::print(stderr, "{}\n", warn);

  const LoadedModel model = model_load(a.model, a.tokenizer, storage);
  const std::string device = o.device;
  const EvalReport rep = eval_run(model, o, stderr, [device](const ModelWeights& w, const SessionOptions& so) {
    return runner_make(device, w, so);
  });
  const std::string md = eval_markdown(rep);
  if (a.markdown.empty()) {
    fmt::print("{}", md);
  } else {
    file_write_atomic(a.markdown, md, "--markdown");
    fmt::print(stderr, "Markdown: {}\n", a.markdown);
  }
  if (!a.json.empty()) {
    file_write_atomic(a.json, eval_json(rep), "--json");
    fmt::print(stderr, "JSON: {}\n", a.json);
  }
  if (!a.svg_dir.empty()) {
    std::filesystem::create_directories(a.svg_dir);
    for (const auto& [name, svg] : eval_svgs(rep)) {
      const std::string path = (std::filesystem::path(a.svg_dir) / name).string();
      file_write_atomic(path, svg, "--svg-dir");
      fmt::print(stderr, "SVG: {}\n", path);
    }
  }
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  EvalOptions& o = a->o;
  auto* cmd = app.add_subcommand("eval", "Judge decode methods against dense attention on a real model: kl, ppl, "
                                         "mass, matched, niah");
  cmd->add_option("task", o.task, "kl | ppl | mass | matched | niah")
      ->required()
      ->check(CLI::IsMember({"kl", "ppl", "mass", "matched", "niah"}));
  cmd->add_option("--model", a->model, "GGUF or llama2.c .bin model")->required();
  cmd->add_option("--tokenizer", a->tokenizer, "llama2.c tok*.bin (default: found beside the model)");
  cmd->add_option("--weights", a->weights, "compact (keep Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K quantised) or f32 (dequantise all)")
      ->capture_default_str();
  cmd->add_option("--text", o.text, "text file: the long document (kl, ppl, mass, matched) or the haystack (niah); "
                                    "Gutenberg header/footer stripped")
      ->required();
  cmd->add_option("--method", o.methods,
                  "methods, comma-separated; 'label=method' runs a method under its own label (default: all; "
                  "matched: the adaptive method, default tactic; mass: fixed variants)");
  cmd->add_option("--param", o.params, "key=value or X.key=value, X a label or method (repeatable)");
  cmd->add_option("--sweep", o.sweeps, "X.key=v1,v2,...: one run per value, drawn as one curve (repeatable)");
  cmd->add_option("--prefill", o.prefill_method, "prefill attention shared by all methods")->capture_default_str();
  cmd->add_option("--prefill-param", a->prefill_params, "prefill method parameter key=value (repeatable)");
  cmd->add_option("--context", o.context,
                  "kl/ppl/mass/matched: tokens cached at the last step; the prompt is context - steps "
                  "(0: the model's context)")
      ->capture_default_str();
  cmd->add_option("--steps", o.steps, "teacher-forced continuation tokens")->capture_default_str();
  list_option(cmd, "--lengths", &o.lengths, "niah: prompt + answer lengths in tokens, comma-separated");
  list_option(cmd, "--depths", &o.depths, "niah: needle depths in [0, 1], comma-separated");
  cmd->add_option("--needles", o.needles, "niah: prompts (numbers) per (length, depth)")->capture_default_str();
  cmd->add_option("--answer-tokens", o.answer_tokens, "niah: greedy answer budget")->capture_default_str();
  cmd->add_option("--template", o.niah_template, "niah prompt: auto (chat when the vocabulary has ChatML), chat, plain")
      ->check(CLI::IsMember({"auto", "chat", "plain"}))
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "niah: seed of the numbers")->check(seed_check())->capture_default_str();
  list_option(cmd, "--targets", &o.targets, "mass: target P values, comma-separated");
  list_option(cmd, "--baselines", &o.baselines,
              "matched: fixed-budget methods given the adaptive method's budget, comma-separated");
  cmd->add_option("--match-iters", o.match_iters, "budget runs per matched baseline at most (1: budget = target)")
      ->capture_default_str();
  cmd->add_flag("--niah", o.matched_niah, "matched: also the NIAH grid (--lengths, --depths), matched per prompt");
  o.threads = default_threads();
  cmd->add_option("--threads", o.threads, "threads (default: this machine's CPUs)")
      ->check(threads_range())
      ->capture_default_str();
  cmd->add_option("--device", o.device,
                  "cpu or cuda (a CUDA build with a GPU): the runtime of every prompt; cuda runs kl, ppl, matched and "
                  "niah with its decode methods (default there: all of them), true mass measured on the device")
      ->capture_default_str();
  cmd->add_option("--device-kv-gib", o.device_kv_gib,
                  "--device cuda: keep every layer's K/V in one pool with this many GiB of device memory and the "
                  "rest in pinned host memory (docs/cuda.md \"Host tier\"; 0: all on the device)")
      ->capture_default_str();
  cmd->add_option("--page-size", o.page_size, "KV cache page size")->capture_default_str();
  cmd->add_option("--kv-dtype", a->kv_dtype, "KV storage: f16, bf16, f32")->capture_default_str();
  cmd->add_option("--kv-save", o.kv_save,
                  "kl/ppl/mass/matched: write the prompt's KV cache here after the prefill (docs/kv_snapshot.md)");
  cmd->add_option("--kv-load", o.kv_load,
                  "kl/ppl/mass/matched: load the prompt's KV cache from a --kv-save file instead of prefilling");
  cmd->add_option("--json", a->json, "write the full report (per-step values) as JSON");
  cmd->add_option("--markdown", a->markdown, "write the Markdown summary here instead of stdout");
  cmd->add_option("--svg-dir", a->svg_dir, "write the SVG plots into this folder");
  cmd->callback([a] { eval_command_run(*a); });
}

}  // namespace cumulus::cli
