// `cumulus generate`: run a real model with one or more decode methods on the same prompt,
// stream the text, then print speed and the attention summary side by side.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"
#include "cumulus/core/error.h"
#include "cumulus/eval/method_spec.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/sampler.h"
#include "cumulus/model/session.h"
#include "cumulus/model/text.h"
#include "cumulus/model/tokenizer.h"

namespace cumulus::cli {
namespace {

struct GenerateOptions {
  std::string model, tokenizer, prompt, prompt_file;
  std::vector<std::string> methods{"dense"};
  std::vector<std::string> params;
  std::string prefill = "dense";              // prefill method (dense or flexprefill)
  std::vector<std::string> prefill_params;    // its key=value parameters
  int max_tokens = 64;
  int prompt_tokens = 0;  // truncate the prompt to its first N tokens (0 = all)
  int threads = 2;
  int page_size = 16;
  std::string kv_dtype = "f16";
  float temperature = 0.0f, top_p = 1.0f;
  uint64_t seed = 0;
  bool eval = false;
  bool quiet = false;
};

struct RunResult {
  std::string method;
  int prompt_len = 0, generated = 0;
  double prefill_s = 0, decode_s = 0;
  AttentionSummary summary;
  PrefillStats prefill_stats;
};

// "--prefill-param key=value" (repeatable) for the prefill method; the registry checks them.
std::map<std::string, std::string> prefill_param_map(const std::vector<std::string>& params) {
  std::map<std::string, std::string> out;
  for (const auto& p : params) {
    const size_t eq = p.find('=');
    CUMULUS_CHECK(eq != std::string::npos && eq > 0, "--prefill-param '{}' must be key=value", p);
    out[p.substr(0, eq)] = p.substr(eq + 1);
  }
  return out;
}

// "--param key=value" applies to every selected method that declares `key`;
// "--param method.key=value" to that method only (eval/method_spec.h, shared with eval).
std::map<std::string, std::map<std::string, std::string>> split_params(const std::vector<std::string>& params,
                                                                       const std::vector<std::string>& methods) {
  std::map<std::string, std::map<std::string, std::string>> out;
  for (const auto& s : method_specs_parse(methods, params)) out[s.method] = s.params;
  return out;
}

RunResult run_one(const ModelWeights& w, const Tokenizer& tok, const std::vector<int32_t>& prompt,
                  const std::string& method, const std::map<std::string, std::string>& params,
                  const GenerateOptions& o) {
  SessionOptions so;
  so.method = method;
  so.params = params;
  so.n_threads = o.threads;
  so.kv.page_size = o.page_size;
  so.kv.dtype = dtype_from_name(o.kv_dtype);
  so.eval = o.eval;
  so.prefill_method = o.prefill;
  so.prefill_params = prefill_param_map(o.prefill_params);
  Session s(w, so);
  CUMULUS_CHECK(static_cast<int64_t>(prompt.size()) + o.max_tokens <= s.capacity(),
                "prompt of {} tokens + --max-tokens {} exceeds the model's context of {} tokens", prompt.size(),
                o.max_tokens, s.capacity());
  Sampler sampler({.temperature = o.temperature, .top_p = o.top_p, .seed = o.seed});
  RunResult r{method, static_cast<int>(prompt.size()), 0, 0, 0, {}, {}};

  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  const std::vector<float>* logits = &s.prefill(prompt);
  r.prefill_s = std::chrono::duration<double>(clock::now() - t0).count();

  if (!o.quiet) fmt::print("\n--- {} ---\n", method);
  auto t1 = clock::now();
  for (int i = 0; i < o.max_tokens; ++i) {
    const int32_t next = sampler.sample(*logits);
    if (next == tok.eos_id()) break;
    if (!o.quiet) {
      fmt::print("{}", tok.decode_piece(next));
      std::fflush(stdout);
    }
    ++r.generated;
    if (i + 1 < o.max_tokens) logits = &s.decode(next);
  }
  r.decode_s = std::chrono::duration<double>(clock::now() - t1).count();
  if (!o.quiet) fmt::print("\n");
  r.summary = s.summary();
  r.prefill_stats = s.prefill_method().stats();
  return r;
}

void run_generate(const GenerateOptions& o) {
  CUMULUS_CHECK(o.prompt.empty() || o.prompt_file.empty(), "give --prompt or --prompt-file, not both");
  CUMULUS_CHECK(o.max_tokens >= 1, "--max-tokens={} must be >= 1", o.max_tokens);
  CUMULUS_CHECK(o.prompt_tokens >= 0, "--prompt-tokens={} must be >= 0", o.prompt_tokens);

  ModelWeights w = model_weights_load(o.model);
  std::unique_ptr<Tokenizer> tok;
  if (w.config.format == ModelFormat::gguf) {
    tok = tokenizer_from_gguf(GgufFile::open(o.model));
  } else {
    tok = tokenizer_from_llama2c(o.tokenizer.empty() ? tokenizer_find_llama2c(o.model, w.config.vocab_size)
                                                     : o.tokenizer,
                                 w.config.vocab_size);
  }
  std::string text = o.prompt_file.empty() ? o.prompt : text_strip_gutenberg(text_read_file(o.prompt_file));
  std::vector<int32_t> prompt = tok->encode(text, tok->add_bos_default());
  if (prompt.empty() && tok->bos_id() >= 0) prompt.push_back(tok->bos_id());
  CUMULUS_CHECK(!prompt.empty(), "the prompt is empty and the tokenizer has no BOS token");
  if (o.prompt_tokens > 0 && static_cast<int>(prompt.size()) > o.prompt_tokens) prompt.resize(o.prompt_tokens);
  CUMULUS_CHECK(static_cast<int>(prompt.size()) < w.config.context_length,
                "prompt of {} tokens does not fit the model's context of {} tokens (use --prompt-tokens)",
                prompt.size(), w.config.context_length);

  const auto params = split_params(o.params, o.methods);
  std::vector<RunResult> results;
  for (const auto& m : o.methods) {
    auto it = params.find(m);
    results.push_back(run_one(w, *tok, prompt, m, it == params.end() ? std::map<std::string, std::string>{} : it->second, o));
  }

  fmt::print("\n{:<14} {:>7} {:>9} {:>10} {:>7} {:>10} {:>10} {:>9} {:>9}\n", "method", "prompt", "prefill", "tok/s",
             "gen", "tok/s", "kv read", "tokens", "claimed");
  for (const auto& r : results) {
    const auto& s = r.summary;
    fmt::print("{:<14} {:>7} {:>8.2f}s {:>10.1f} {:>7} {:>10.1f} {:>9.1f}% {:>9.0f} {:>9}\n", r.method, r.prompt_len,
               r.prefill_s, r.prompt_len / r.prefill_s, r.generated,
               r.generated > 1 ? (r.generated - 1) / r.decode_s : 0.0, 100 * s.mean_kv_fraction(), s.mean_tokens(),
               s.claimed_count ? fmt::format("{:.3f}", s.mean_claimed()) : "-");
    if (s.true_count) fmt::print("{:<14} true mass {:.3f} (eval mode)\n", "", s.mean_true());
    const PrefillStats& ps = r.prefill_stats;
    if (o.prefill != "dense")
      fmt::print("{:<14} prefill {}: {:.1f}% of causal blocks, heads query-aware/vertical-slash/dense {}/{}/{}\n", "",
                 o.prefill, 100 * ps.block_share(), ps.heads_query_aware, ps.heads_vertical_slash, ps.heads_dense);
  }
  fmt::print("kv read: mean share of the dense K/V bytes read per decode step; tokens: mean tokens attended per "
             "head-step; claimed: mean mass the method claims (- = makes no claim)\n");
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  auto* cmd = app.add_subcommand("generate", "Generate text with a real model under one or more attention methods");
  cmd->add_option("--model", o->model, "GGUF or llama2.c .bin model")->required();
  cmd->add_option("--tokenizer", o->tokenizer, "llama2.c tok*.bin (default: found beside the model)");
  cmd->add_option("--prompt", o->prompt, "prompt text");
  cmd->add_option("--prompt-file", o->prompt_file, "prompt file (Gutenberg header/footer stripped)");
  cmd->add_option("--prompt-tokens", o->prompt_tokens, "keep only the first N prompt tokens (0 = all)");
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to generate")->capture_default_str();
  cmd->add_option("--method", o->methods, "decode method(s), comma-separated, run one after another")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--param", o->params, "key=value or method.key=value (repeatable)");
  cmd->add_option("--prefill", o->prefill, "prefill method: dense or flexprefill")->capture_default_str();
  cmd->add_option("--prefill-param", o->prefill_params, "key=value for the prefill method (repeatable)");
  cmd->add_option("--threads", o->threads, "threads")->capture_default_str();
  cmd->add_option("--page-size", o->page_size, "KV cache page size")->capture_default_str();
  cmd->add_option("--kv-dtype", o->kv_dtype, "KV storage: f16, bf16, f32")->capture_default_str();
  cmd->add_option("--temperature", o->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", o->top_p, "nucleus sampling")->capture_default_str();
  cmd->add_option("--seed", o->seed, "sampling seed")->capture_default_str();
  cmd->add_flag("--eval", o->eval, "also measure the true mass of every attended set (slower)");
  cmd->add_flag("--quiet", o->quiet, "do not print the generated text");
  cmd->callback([o] { run_generate(*o); });
}

}  // namespace cumulus::cli
