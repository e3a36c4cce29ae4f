// `cumulus trace`: runs a real model (CPU, dense attention) on a long real text and records
// the K/V cache and the decode queries of chosen layers into one compact file, so the GPU
// benchmark (bench/cuda_decode_bench.cu) can replay real attention on the device. The
// queries are the ones each layer's decode method receives (after RoPE), recorded through
// SessionOptions::on_decode_query.
//
// File format (little-endian; docs/cuda.md):
//   "CUMTRACE" | uint32 version = 1 | uint32 header_bytes | header (JSON, UTF-8)
//   then for every recorded layer, in the header's order:
//     K [n_tokens][n_kv_heads][head_dim] f16, V likewise, Q [steps][n_q_heads][head_dim] f32
// n_tokens = prompt_tokens + steps. Decode step j's query sits at position
// prompt_tokens + j and attends tokens [0, prompt_tokens + j + 1). K and V are the stored
// (f16) cache values, so the file holds exactly what the attention kernels read.
//
// `cumulus trace --profile FILE` measures a trace's attention on the CPU instead, per layer
// (attention_profile, include/cumulus/eval/synthetic.h): the per-head top-p share, the GQA
// group's union share and its inflation over the per-head set, and how alike the heads of
// a group are (logit correlation, top-p Jaccard), and what a page level over the page key
// bounds could skip or keep. `--profile-synthetic SHAPE` prints the
// same figures for the synthetic workload (docs/workload.md), so the two can be compared.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "cli.h"
#include "paths.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/eval/trace.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/session.h"
#include "cumulus/model/text.h"
#include "cumulus/model/tokenizer.h"

namespace cumulus::cli {
namespace {

struct TraceOptions {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string text = "../shared/data/text/pg1342_pride_and_prejudice.txt";
  std::string out = "trace.bin";
  std::vector<int> layers{3, 15, 27};
  int prompt_tokens = 8000;
  int steps = 16;
  int threads = default_threads();
  // --profile / --profile-synthetic
  std::string profile, profile_synthetic;
  double p = 0.9;
  int context = 8192;
  double head_correlation = 0.8, concentration = 1.0;
  uint64_t seed = 1;
};

void profile_header() {
  fmt::print(
      "{:>6} {:>7} {:>6} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>7} {:>7} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} "
      "{:>9}\n",
      "layer", "tokens", "steps", "topp%", "p50%", "union%", "inflation", "corr", "jaccard", "sink", "recent", "pgskip%",
      "keep8mass", "keep8p%", "keep4mass", "keep4p%", "b1k8mass", "b1k8p%", "b1k4mass", "b1k4p%");
}

void profile_row(const std::string& label, int n, int steps, const AttentionProfile& a) {
  fmt::print(
      "{:>6} {:>7} {:>6} {:8.2f} {:8.2f} {:8.2f} {:9.2f} {:8.3f} {:8.3f} {:7.3f} {:7.3f} {:8.2f} {:9.4f} {:9.2f} {:9.4f} "
      "{:9.2f} {:9.4f} {:9.2f} {:9.4f} {:9.2f}\n",
      label, n, steps, 100 * a.topp_fraction, 100 * a.topp_fraction_p50, 100 * a.union_fraction, a.union_inflation,
      a.group_logit_corr, a.group_jaccard, a.sink_mass, a.recent_mass, 100 * a.page_admissible, a.page_keep_mass[0],
      100 * a.page_keep_reach[0], a.page_keep_mass[1], 100 * a.page_keep_reach[1], a.bit1_keep_mass[0],
      100 * a.bit1_keep_reach[0], a.bit1_keep_mass[1], 100 * a.bit1_keep_reach[1]);
}

void profile_legend() {
  fmt::print(
      "pgskip%: pages an admissible page filter over the page key bounds could skip, knowing each head's exact total "
      "(the skipped pages' bound mass within 1 - p of it for every head of the group); keep8, keep4: keeping 1/8 or "
      "1/4 of the pages by bound (and every page with a sink or recent token), the heads' mean exact mass in them and "
      "the share of head-steps where it reaches p; b1k8, b1k4: the same for 1/8 or 1/4 of the tokens by a 1-bit key "
      "sketch (each channel its mean plus or minus its mean absolute deviation)\n");
}

// Real attention of every layer in a trace (each step attends its own prefix).
void run_profile(const TraceOptions& o) {
  const TraceFile t = trace_read(o.profile);
  ThreadPool pool(o.threads);
  std::vector<int> attended(t.steps);
  for (int j = 0; j < t.steps; ++j) attended[j] = t.attended(j);
  fmt::print("trace {}: {} query heads, {} kv heads (group {}), head_dim {}, {} + {} tokens, p = {}\n", o.profile,
             t.n_q_heads, t.n_kv_heads, t.group(), t.head_dim, t.prompt_tokens, t.steps, o.p);
  profile_header();
  AttentionProfile mean;
  for (size_t i = 0; i < t.layers.size(); ++i) {
    const KvCache kv = t.cache(static_cast<int>(i));
    const AttentionProfile a = attention_profile(kv, 0, t.q[i].data(), t.steps, attended.data(), 4, 64, o.p, pool);
    profile_row(std::to_string(t.layers[i]), t.n_tokens, t.steps, a);
    const double w = 1.0 / t.layers.size();
    mean.topp_fraction += w * a.topp_fraction;
    mean.topp_fraction_p50 += w * a.topp_fraction_p50;
    mean.union_fraction += w * a.union_fraction;
    mean.group_logit_corr += w * a.group_logit_corr;
    mean.group_jaccard += w * a.group_jaccard;
    mean.sink_mass += w * a.sink_mass;
    mean.recent_mass += w * a.recent_mass;
    mean.page_admissible += w * a.page_admissible;
    for (int b = 0; b < 2; ++b) {
      mean.page_keep_mass[b] += w * a.page_keep_mass[b];
      mean.page_keep_reach[b] += w * a.page_keep_reach[b];
      mean.bit1_keep_mass[b] += w * a.bit1_keep_mass[b];
      mean.bit1_keep_reach[b] += w * a.bit1_keep_reach[b];
    }
  }
  mean.union_inflation = mean.topp_fraction > 0 ? mean.union_fraction / mean.topp_fraction : 0.0;
  profile_row("mean", t.n_tokens, t.steps, mean);
  profile_legend();
}

// The synthetic workload's attention with the same figures.
void run_profile_synthetic(const TraceOptions& o) {
  SyntheticOptions so;
  so.shape = shape_preset(o.profile_synthetic);
  so.n_tokens = o.context;
  so.n_steps = o.steps;
  so.seed = o.seed;
  so.head_correlation = o.head_correlation;
  so.concentration = o.concentration;
  ThreadPool pool(o.threads);
  KvCache kv(so.shape, KvCacheOptions{16, DType::f16, so.n_tokens});
  const SyntheticWorkload w = synthetic_generate(so, kv, pool);
  fmt::print("synthetic {}: {} tokens, {} steps, head_correlation {}, concentration {}, seed {}, p = {}\n",
             o.profile_synthetic, so.n_tokens, so.n_steps, so.head_correlation, so.concentration, so.seed, o.p);
  profile_header();
  profile_row("0", so.n_tokens, so.n_steps, attention_profile(kv, w, 0, o.p, pool));
  profile_legend();
}

void run_trace(const TraceOptions& o) {
  CUMULUS_CHECK(o.prompt_tokens >= 1, "--prompt-tokens={} must be >= 1", o.prompt_tokens);
  CUMULUS_CHECK(o.steps >= 1 && o.steps <= 4096, "--steps={} must be in [1, 4096]", o.steps);
  CUMULUS_CHECK(!o.layers.empty(), "--layers must name at least one layer");
  // Paths and the model's header before the model is loaded.
  paths_check_distinct({{"--model", o.model}, {"--text", o.text}, {"--out", o.out, true}});
  file_check_input(o.text, "--text");
  file_check_output(o.out, "--out");
  {
    const ModelConfig h = model_config_load(o.model);
    CUMULUS_CHECK(h.format == ModelFormat::gguf, "--model {}: cumulus trace reads GGUF models", o.model);
    for (int l : o.layers)
      CUMULUS_CHECK(l >= 0 && l < h.n_layers, "--layers: layer {} out of range [0, {})", l, h.n_layers);
    CUMULUS_CHECK(o.prompt_tokens + o.steps <= h.context_length,
                  "--prompt-tokens {} + --steps {} exceed the model's context of {} tokens", o.prompt_tokens, o.steps,
                  h.context_length);
  }
  ModelWeights w = model_weights_load(o.model);
  const ModelConfig& c = w.config;
  auto tok = tokenizer_from_gguf(GgufFile::open(o.model));
  std::vector<int32_t> prompt = tok->encode_prefix(text_strip_gutenberg(text_read_file(o.text)),
                                                  tok->add_bos_default(), static_cast<size_t>(o.prompt_tokens));
  CUMULUS_CHECK(static_cast<int>(prompt.size()) >= o.prompt_tokens,
                "--text {} has {} tokens, fewer than --prompt-tokens {}", o.text, prompt.size(), o.prompt_tokens);
  prompt.resize(o.prompt_tokens);

  const int qd = c.n_heads * c.head_dim;
  std::vector<int> slot(c.n_layers, -1);
  for (size_t i = 0; i < o.layers.size(); ++i) slot[o.layers[i]] = static_cast<int>(i);
  // queries[i]: [steps][n_heads][head_dim] of recorded layer i
  std::vector<std::vector<float>> queries(o.layers.size(), std::vector<float>(static_cast<size_t>(o.steps) * qd));
  SessionOptions so;
  so.n_threads = o.threads;
  so.kv.dtype = DType::f16;
  so.kv_window = false;  // a recorded layer is recorded whole, a local one too
  so.max_tokens = o.prompt_tokens + o.steps;
  so.on_decode_query = [&](int layer, int position, const float* q) {
    const int step = position - o.prompt_tokens;
    if (slot[layer] < 0 || step < 0 || step >= o.steps) return;
    std::copy_n(q, qd, queries[slot[layer]].data() + static_cast<size_t>(step) * qd);
  };
  Session s(w, so);
  fmt::print(stderr, "trace: prefill of {} tokens on {} threads...\n", o.prompt_tokens, o.threads);
  const std::vector<float>* logits = &s.prefill(prompt);
  for (int j = 0; j < o.steps; ++j) {  // greedy decode
    const auto it = std::max_element(logits->begin(), logits->end());
    logits = &s.decode(static_cast<int32_t>(it - logits->begin()));
  }
  const int n = o.prompt_tokens + o.steps;
  CUMULUS_CHECK(s.kv().n_tokens(o.layers[0]) == n, "cache holds {} tokens, expected {}", s.kv().n_tokens(o.layers[0]),
                n);

  nlohmann::json h;
  h["model"] = o.model;
  h["text"] = o.text;
  h["layers"] = o.layers;
  h["n_model_layers"] = c.n_layers;
  h["n_q_heads"] = c.n_heads;
  h["n_kv_heads"] = c.n_kv_heads;
  h["head_dim"] = c.head_dim;
  h["prompt_tokens"] = o.prompt_tokens;
  h["steps"] = o.steps;
  h["n_tokens"] = n;
  h["kv_dtype"] = "f16";
  h["q_dtype"] = "f32";
  h["attend"] = "step j attends tokens [0, prompt_tokens + j + 1)";
  const std::string header = h.dump();
  // The whole trace is assembled in memory and written atomically (file_write_atomic).
  std::string bytes;
  auto put = [&](const void* src, size_t len) { bytes.append(static_cast<const char*>(src), len); };
  const uint32_t version = 1, hb = static_cast<uint32_t>(header.size());
  put("CUMTRACE", 8);
  put(&version, 4);
  put(&hb, 4);
  put(header.data(), hb);
  std::vector<float> row(c.head_dim);
  std::vector<uint16_t> half(static_cast<size_t>(n) * c.n_kv_heads * c.head_dim);
  for (size_t i = 0; i < o.layers.size(); ++i) {
    for (int which = 0; which < 2; ++which) {
      for (int t = 0; t < n; ++t)
        for (int kh = 0; kh < c.n_kv_heads; ++kh) {
          if (which == 0)
            s.kv().key_f32(o.layers[i], kh, t, row.data());
          else
            s.kv().value_f32(o.layers[i], kh, t, row.data());
          uint16_t* dst = half.data() + (static_cast<size_t>(t) * c.n_kv_heads + kh) * c.head_dim;
          for (int j = 0; j < c.head_dim; ++j) dst[j] = f32_to_f16(row[j]);
        }
      put(half.data(), half.size() * 2);
    }
    put(queries[i].data(), queries[i].size() * 4);
  }
  file_write_atomic(o.out, bytes, "--out");
  fmt::print("trace: {} layers x ({} tokens K/V f16 + {} queries), {} kv heads, {} query heads, head_dim {} -> {}\n",
             o.layers.size(), n, o.steps, c.n_kv_heads, c.n_heads, c.head_dim, o.out);
}

}  // namespace

void add_trace_command(CLI::App& app) {
  auto o = std::make_shared<TraceOptions>();
  auto* cmd = app.add_subcommand("trace", "Record real K/V and decode queries of chosen layers into a trace file");
  cmd->add_option("--model", o->model, "GGUF model")->capture_default_str();
  cmd->add_option("--text", o->text, "long text for the prompt (Gutenberg header/footer stripped)")
      ->capture_default_str();
  cmd->add_option("--prompt-tokens", o->prompt_tokens, "prompt length in tokens")->capture_default_str();
  cmd->add_option("--steps", o->steps, "greedy decode steps recorded")->capture_default_str();
  list_option(cmd, "--layers", &o->layers, "layers to record, comma-separated");
  cmd->add_option("--threads", o->threads, "threads (default: this machine's CPUs)")
      ->check(threads_range())
      ->capture_default_str();
  cmd->add_option("--out", o->out, "output file")->capture_default_str();
  cmd->add_option("--profile", o->profile, "instead of recording: measure the attention of this trace file (CPU)");
  cmd->add_option("--profile-synthetic", o->profile_synthetic,
                  "instead of recording: the same figures for the synthetic workload of this shape");
  cmd->add_option("--p", o->p, "top-p mass of the profile's sets")->capture_default_str();
  cmd->add_option("--context", o->context, "--profile-synthetic: tokens")->capture_default_str();
  cmd->add_option("--head-correlation", o->head_correlation, "--profile-synthetic: SyntheticOptions::head_correlation")
      ->capture_default_str();
  cmd->add_option("--concentration", o->concentration, "--profile-synthetic: SyntheticOptions::concentration")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "--profile-synthetic: seed")->check(seed_check())->capture_default_str();
  cmd->callback([o] {
    CUMULUS_CHECK(o->profile.empty() || o->profile_synthetic.empty(),
                  "--profile and --profile-synthetic are exclusive");
    CUMULUS_CHECK(o->p > 0 && o->p <= 1, "--p={} must be in (0, 1]", o->p);
    if (!o->profile.empty()) return run_profile(*o);
    if (!o->profile_synthetic.empty()) return run_profile_synthetic(*o);
    run_trace(*o);
  });
}

}  // namespace cumulus::cli
