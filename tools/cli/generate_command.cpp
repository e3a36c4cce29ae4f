// `cumulus generate`: run a real model with one or more decode methods on the same prompt
// (prefilled one after another; on the CPU then decoded in turn, a token of each at a time),
// print each method's text, then speed and the attention summary side by side.
//
// `cumulus generate --bench`: the speed of the model runtime at given context lengths, the
// way llama.cpp's llama-bench measures it (tools/reference/bench_vs_llamacpp.sh runs both):
// for each context N, prefill N prompt tokens (prefill tokens/s), then decode
// --bench-decode tokens at depth N (decode tokens/s), with a per-op profile of the decode
// steps and the decode's achieved read bandwidth (weights + K/V per token) against the
// machine's read bandwidth measured in the same run. Table on stdout, JSON with --json.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "cli.h"
#include "limits.h"
#include "paths.h"
#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/eval/membw.h"
#include "cumulus/kernels/simd.h"
#include "cumulus/eval/method_spec.h"
#include "cumulus/eval/progress.h"
#include "cumulus/eval/tasks.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_identity.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/runner.h"
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
  int threads = default_threads();
  int page_size = 16;
  std::string kv_dtype = "f16";
  float temperature = 0.0f, top_p = 1.0f;
  uint64_t seed = 0;
  bool eval = false;
  bool quiet = false;
  bool prompt_given = false;  // --prompt was on the command line (an empty one is refused)
  std::string weights = "compact";
  std::string device = "cpu";  // --device: cpu or cuda (device.cpp)
  double device_kv_gib = 0;     // --device-kv-gib: the GPU's KV pool, the rest in host memory
  std::string kv_save, kv_load;  // KV snapshot written after the prefill / loaded instead of it
  // --bench
  bool bench = false;
  std::vector<int> bench_contexts{512, 2048, 8192};
  int bench_decode = 32;
  int repetitions = 1;
  std::string json;
};

// --kv-save / --kv-load: the snapshot to load (opened and checked before the model loads),
// the model file's identity, and whether the snapshot is still to be written.
struct KvSnapshotUse {
  std::unique_ptr<KvSnapshot> load;
  uint64_t model_id = 0;
  bool save_pending = false;
};

struct RunResult {
  std::string method;
  int prompt_len = 0, generated = 0;
  double prefill_s = 0, index_s = 0, decode_s = 0;  // index_s: the decode method's index build
  bool loaded = false;  // prefill_s is the time of --kv-load (no prefill ran)
  bool shared = false;  // prefill_s is the time of copying the first run's prompt (Session::prefill_from)
  AttentionSummary summary;
  PrefillStats prefill_stats;
};

// The session options both generation and --bench take from the command line.
SessionOptions session_options(const GenerateOptions& o, const std::string& method,
                               const std::map<std::string, std::string>& params) {
  SessionOptions so;
  so.method = method;
  so.params = params;
  so.n_threads = o.threads;
  so.kv.page_size = o.page_size;
  so.kv.dtype = dtype_from_name(o.kv_dtype);
  so.prefill_method = o.prefill;
  so.prefill_params = prefill_param_map(o.prefill_params);
  so.device_kv_gib = o.device_kv_gib;
  return so;
}

// One method's run: its runner after the prefill and the index build, and what it has
// generated so far.
struct LiveRun {
  std::unique_ptr<ModelRunner> runner;
  const std::vector<float>* logits = nullptr;  // the next token's
  Sampler sampler;
  RunResult r;
  std::string text;
  bool done = false;
};

// The prompt's prefill, with a progress line on stderr when it is a terminal: a dense
// prefill on the CPU goes in pieces of whole prefill chunks, so the session computes the same
// chunks as in one call (a sparse prefill method chooses its chunks from the whole prompt:
// one call, no progress).
const std::vector<float>& prefill_with_progress(ModelRunner& s, const std::vector<int32_t>& prompt,
                                                const GenerateOptions& o) {
  const int kPiece = 4 * SessionOptions{}.prefill_chunk;
  if (o.quiet || o.prefill != kDenseMethod || s.session() == nullptr || !::isatty(::fileno(stderr)) ||
      static_cast<int>(prompt.size()) <= kPiece)
    return s.prefill(prompt);
  Progress progress(stderr);
  progress.plan(static_cast<int64_t>(prompt.size()), 0);
  progress.label("prefill");
  const std::vector<float>* logits = nullptr;
  for (size_t at = 0; at < prompt.size(); at += kPiece) {
    const size_t n = std::min(prompt.size() - at, static_cast<size_t>(kPiece));
    logits = &s.prefill(std::span<const int32_t>(prompt).subspan(at, n));
    progress.prefilled(static_cast<int64_t>(n));
  }
  return *logits;
}

// Prefill (or --kv-load, or a copy of `from`'s prompt: the CPU prefills once for every
// method) and the method's index build over the prompt (tactic's k-means): timed here,
// where they happen, not inside the first decode step. keep_queries: the prompt queries
// this run keeps for the runs that copy it.
LiveRun start_run(const ModelWeights& w, const std::vector<int32_t>& prompt, const MethodSpec& spec,
                  const GenerateOptions& o, KvSnapshotUse& kvs, Session* from = nullptr, int keep_queries = 0) {
  SessionOptions so = session_options(o, spec.method, spec.params);
  so.eval = o.eval;
  so.keep_prompt_queries = keep_queries;
  if (kvs.save_pending) so.keep_prompt_queries = std::max(keep_queries, kKvSnapshotPromptQueries);
  LiveRun L{runner_make(o.device, w, so), nullptr, Sampler({.temperature = o.temperature, .top_p = o.top_p,
                                                           .seed = o.seed}),
            RunResult{spec.label, static_cast<int>(prompt.size()), 0, 0, 0, 0, kvs.load != nullptr, from != nullptr,
                      {}, {}},
            {}, false};
  ModelRunner& s = *L.runner;
  CUMULUS_CHECK(static_cast<int64_t>(prompt.size()) + o.max_tokens <= s.capacity(),
                "prompt of {} tokens + --max-tokens {} exceeds the model's context of {} tokens", prompt.size(),
                o.max_tokens, s.capacity());
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  // --kv-load / --kv-save run on the CPU only (generate_validate).
  L.logits = kvs.load ? &s.session()->kv_load(*kvs.load, kvs.model_id)
             : from   ? &s.session()->prefill_from(*from)
                      : &prefill_with_progress(s, prompt, o);
  L.r.prefill_s = std::chrono::duration<double>(clock::now() - t0).count();
  if (kvs.load)
    fmt::print(stderr, "kv-load: {} tokens from {} ({:.1f} MB) in {:.3f} s\n", prompt.size(), o.kv_load,
               kvs.load->file_bytes() / 1e6, L.r.prefill_s);
  if (kvs.save_pending) {
    const auto ts = clock::now();
    s.session()->kv_save(o.kv_save, kvs.model_id);
    kvs.save_pending = false;
    fmt::print(stderr, "kv-save: {} tokens to {} in {:.3f} s (prefill {:.3f} s)\n", prompt.size(), o.kv_save,
               std::chrono::duration<double>(clock::now() - ts).count(), L.r.prefill_s);
  }
  const auto tb = clock::now();
  s.build_indexes();
  L.r.index_s = std::chrono::duration<double>(clock::now() - tb).count();
  return L;
}

// Decodes every run's tokens in turn, one token of each run a round: the machine's memory
// bandwidth drifts over seconds (on the 2-vCPU VMs this project measures on, between about
// 36 and 60 GB/s), so runs decoded one after another can meet different machines, and
// their ratio says more about the drift than about the methods. A run's decode time is the
// sum of its own steps.
void decode_in_turn(std::vector<LiveRun>& runs, const Tokenizer& tok, int max_tokens, bool stream) {
  using clock = std::chrono::steady_clock;
  if (stream) fmt::print("\n--- {} ---\n", runs.front().r.method);
  for (int i = 0; i < max_tokens; ++i) {
    for (LiveRun& L : runs) {
      if (L.done) continue;
      const auto t = clock::now();
      const int32_t next = L.sampler.sample(*L.logits);
      if (next == tok.eos_id()) {
        L.done = true;
      } else {
        ++L.r.generated;
        if (i + 1 < max_tokens) L.logits = &L.runner->decode(next);
      }
      L.r.decode_s += std::chrono::duration<double>(clock::now() - t).count();
      if (!L.done) {
        L.text += tok.decode_piece(next);
        if (stream) {  // one method: its text as it comes (outside the timed step)
          fmt::print("{}", tok.decode_piece(next));
          std::fflush(stdout);
        }
      }
    }
  }
  if (stream) fmt::print("\n");
}

// The prefill method's line under a table row (a sparse prefill method: its block share and
// the heads' patterns); empty for dense.
std::string prefill_line(const GenerateOptions& o, const PrefillStats& ps) {
  if (o.prefill == kDenseMethod) return {};
  return fmt::format("{:<14} prefill {}: {:.1f}% of causal blocks, heads query-aware/vertical-slash/dense {}/{}/{}\n",
                     "", o.prefill, 100 * ps.block_share(), ps.heads_query_aware, ps.heads_vertical_slash,
                     ps.heads_dense);
}

struct BenchRun {
  std::string method;
  int context = 0, decode_tokens = 0;
  double prefill_s = 0, index_s = 0, decode_s = 0;  // index_s: the decode method's index build
  DecodeProfile profile;  // per decode step (divided by steps)
  double decode_bytes = 0;  // bytes read per decode step: weights + mean K/V
  size_t kv_cache_bytes = 0;  // the KV cache's memory after the last decode step
  PrefillStats prefill_stats;  // the last repetition's prefill method
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Bytes a decode step reads from the weights: every layer matrix and the output head (the
// embedding lookup reads one row).
double decode_weight_bytes(const ModelWeights& w) {
  double b = static_cast<double>(w.output_weight().bytes());
  for (const LayerWeights& L : w.layers)
    b += static_cast<double>(L.wq.bytes() + L.wk.bytes() + L.wv.bytes() + L.wo.bytes() + L.w_gate.bytes() +
                             L.w_down.bytes() + L.w_up.bytes());
  return b;
}

// One (method, context) measurement: median over repetitions of fresh sessions.
BenchRun bench_one(const ModelWeights& w, const std::vector<int32_t>& source, const MethodSpec& spec, int context,
                   const GenerateOptions& o) {
  std::vector<int32_t> prompt(static_cast<size_t>(context));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = source[i % source.size()];
  std::vector<double> pre, idx, dec;
  std::vector<DecodeProfile> profs;
  double kv_bytes = 0;
  size_t kv_cache_bytes = 0;
  PrefillStats prefill_stats;
  for (int rep = 0; rep < o.repetitions; ++rep) {
    SessionOptions so = session_options(o, spec.method, spec.params);
    so.max_tokens = context + o.bench_decode;
    so.profile = true;
    Session s(w, so);
    Sampler greedy({});
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    const std::vector<float>* logits = &s.prefill(prompt);
    const auto tb = clock::now();
    s.build_indexes();
    const auto t1 = clock::now();
    for (int i = 0; i < o.bench_decode; ++i) logits = &s.decode(greedy.sample(*logits));
    const auto t2 = clock::now();
    pre.push_back(std::chrono::duration<double>(tb - t0).count());
    idx.push_back(std::chrono::duration<double>(t1 - tb).count());
    dec.push_back(std::chrono::duration<double>(t2 - t1).count());
    profs.push_back(s.profile());
    // K/V bytes per step at the mean depth: the tokens each layer reads (a sliding-window
    // layer its window; the others the method's share of every token).
    const double depth = context + 0.5 * (o.bench_decode + 1);
    double tokens = 0;
    for (int l = 0; l < w.config.n_layers; ++l)
      tokens += w.config.is_local(l) ? std::min<double>(depth, w.config.sliding_window)
                                     : depth * s.summary().mean_kv_fraction();
    kv_bytes = static_cast<double>(s.kv().bytes_per_token_head()) * w.config.n_kv_heads * tokens;
    kv_cache_bytes = s.kv().bytes_allocated();
    prefill_stats = s.prefill_method().stats();
  }
  BenchRun r;
  r.method = spec.label;
  r.context = context;
  r.decode_tokens = o.bench_decode;
  r.prefill_s = median(pre);
  r.index_s = median(idx);
  r.decode_s = median(dec);
  // The profile of the repetition whose decode time is the median (or the nearest).
  size_t best = 0;
  for (size_t i = 0; i < dec.size(); ++i)
    if (std::fabs(dec[i] - r.decode_s) < std::fabs(dec[best] - r.decode_s)) best = i;
  DecodeProfile p = profs[best];
  const double n = static_cast<double>(std::max<int64_t>(1, p.steps));
  for (double DecodeProfile::*f : {&DecodeProfile::qkv, &DecodeProfile::attention, &DecodeProfile::wo,
                                   &DecodeProfile::mlp, &DecodeProfile::head, &DecodeProfile::other})
    p.*f /= n;
  r.profile = p;
  r.decode_bytes = decode_weight_bytes(w) + kv_bytes;
  r.kv_cache_bytes = kv_cache_bytes;
  r.prefill_stats = prefill_stats;
  return r;
}

std::string profile_line(const DecodeProfile& p) {
  const double t = p.total();
  std::string s;
  for (const auto& [name, v] : std::vector<std::pair<const char*, double>>{{"qkv", p.qkv},
                                                                         {"attention", p.attention},
                                                                         {"wo", p.wo},
                                                                         {"mlp", p.mlp},
                                                                         {"head", p.head},
                                                                         {"other", p.other}})
    s += fmt::format("{}{} {:.3f} ms ({:.0f}%)", s.empty() ? "" : " | ", name, 1e3 * v, t > 0 ? 100 * v / t : 0.0);
  return s;
}

void run_bench(const ModelWeights& w, const std::vector<int32_t>& source, const std::vector<MethodSpec>& specs,
               const GenerateOptions& o) {
  CUMULUS_CHECK(!source.empty(), "--bench: the prompt is empty");

  ThreadPool pool(o.threads);
  const MemBwResult bw = membw_measure(pool, {.bytes = size_t{512} << 20, .warmup = 1, .repeats = 5});
  const double wbytes = decode_weight_bytes(w);
  fmt::print("model {}: {} layers, dim {}, weights {} ({:.1f} MB in memory, {:.1f} MB read per decode step)\n",
             o.model, w.config.n_layers, w.config.dim, o.weights, w.bytes() / 1e6, wbytes / 1e6);
  fmt::print("threads {}, kv {}, SIMD {}, machine read bandwidth {:.1f} GB/s (median, same threads)\n", o.threads,
             o.kv_dtype, cpu::simd_target_line(), bw.gbps_median);

  std::vector<BenchRun> runs;
  for (const auto& spec : specs) {
    for (int c : o.bench_contexts) {
      fmt::print(stderr, "bench: {} at context {} ...\n", spec.label, c);
      runs.push_back(bench_one(w, source, spec, c, o));
    }
  }

  fmt::print("\n{:<12} {:>8} {:>12} {:>9} {:>12} {:>10} {:>9} {:>8}\n", "method", "context", "prefill t/s",
             "index s", "decode t/s", "ms/token", "GB/s", "of bw");
  for (const BenchRun& r : runs) {
    const double per = r.decode_s / r.decode_tokens;
    const double gbps = r.decode_bytes / per / 1e9;
    fmt::print("{:<12} {:>8} {:>12.1f} {:>9.3f} {:>12.1f} {:>10.2f} {:>9.1f} {:>7.0f}%\n", r.method, r.context,
               r.context / r.prefill_s, r.index_s, r.decode_tokens / r.decode_s, 1e3 * per, gbps,
               100 * gbps / bw.gbps_median);
    fmt::print("{}", prefill_line(o, r.prefill_stats));
  }
  fmt::print("decode: {} tokens after prefilling `context` tokens (depth context..context+{}); index s: the decode "
             "method's index build after the prefill (tactic's k-means; 0 for dense); GB/s: weights + K/V read per "
             "decode step / time per step\n",
             o.bench_decode, o.bench_decode - 1);
  for (const BenchRun& r : runs)
    fmt::print("profile {} @{}: {} (sum {:.3f} ms); KV cache {:.1f} MB\n", r.method, r.context, profile_line(r.profile),
               1e3 * r.profile.total(), r.kv_cache_bytes / 1e6);

  if (!o.json.empty()) {
    nlohmann::json j;
    j["model"] = o.model;
    j["weights"] = o.weights;
    j["weights_bytes"] = w.bytes();
    j["decode_weight_bytes"] = wbytes;
    j["threads"] = o.threads;
    j["kv_dtype"] = o.kv_dtype;
    j["simd"] = cpu::simd_target_line();
    j["membw_gbps"] = bw.gbps_median;
    j["repetitions"] = o.repetitions;
    for (const BenchRun& r : runs) {
      const double per = r.decode_s / r.decode_tokens;
      const DecodeProfile& p = r.profile;
      j["runs"].push_back({{"method", r.method},
                           {"context", r.context},
                           {"prefill_s", r.prefill_s},
                           {"prefill_tok_s", r.context / r.prefill_s},
                           {"index_s", r.index_s},
                           {"decode_tokens", r.decode_tokens},
                           {"decode_s", r.decode_s},
                           {"decode_tok_s", r.decode_tokens / r.decode_s},
                           {"prefill_block_share", r.prefill_stats.block_share()},
                           {"decode_bytes_per_token", r.decode_bytes},
                           {"kv_cache_bytes", r.kv_cache_bytes},
                           {"decode_gbps", r.decode_bytes / per / 1e9},
                           {"profile_ms_per_token",
                            {{"qkv", 1e3 * p.qkv},
                             {"attention", 1e3 * p.attention},
                             {"wo", 1e3 * p.wo},
                             {"mlp", 1e3 * p.mlp},
                             {"head", 1e3 * p.head},
                             {"other", 1e3 * p.other}}}});
    }
    file_write_atomic(o.json, j.dump(2) + "\n", "--json");
  }
}

// --bench --device cuda: prefill, index build and decode tokens/s of the GPU runtime at each
// context, with the decode method's K/V share and tokens per head-step (no per-op profile;
// the GPU's bandwidth reference is bench/cuda_model_bench's). Each timed call waits for its
// logits, as generation does.
void run_bench_device(const ModelWeights& w, const std::vector<int32_t>& source, const std::vector<MethodSpec>& specs,
                      const GenerateOptions& o) {
  CUMULUS_CHECK(!source.empty(), "--bench: the prompt is empty");
  std::string device;
  struct Row {
    std::string method, base;
    int context;
    double prefill_s, index_s, decode_s;
    AttentionSummary summary;
    PrefillStats prefill_stats;  // the last run's
  };
  std::vector<Row> rows;
  for (const auto& spec : specs)
    for (int context : o.bench_contexts) {
      fmt::print(stderr, "bench: {} at context {} on {} ...\n", spec.label, context, o.device);
      std::vector<int32_t> prompt(static_cast<size_t>(context));
      for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = source[i % source.size()];
      std::vector<double> pre, idx, dec;
      AttentionSummary summary;
      PrefillStats prefill_stats;
      for (int rep = 0; rep < o.repetitions; ++rep) {
        SessionOptions so = session_options(o, spec.method, spec.params);
        so.max_tokens = context + o.bench_decode;
        const std::unique_ptr<ModelRunner> r = runner_make(o.device, w, so);
        device = r->device();
        Sampler greedy({});
        using clock = std::chrono::steady_clock;
        const auto t0 = clock::now();
        const std::vector<float>* logits = &r->prefill(prompt);
        const auto tb = clock::now();
        r->build_indexes();
        const auto t1 = clock::now();
        for (int i = 0; i < o.bench_decode; ++i) logits = &r->decode(greedy.sample(*logits));
        const auto t2 = clock::now();
        pre.push_back(std::chrono::duration<double>(tb - t0).count());
        idx.push_back(std::chrono::duration<double>(t1 - tb).count());
        dec.push_back(std::chrono::duration<double>(t2 - t1).count());
        summary = r->summary();
        prefill_stats = r->prefill_stats();
      }
      rows.push_back(
          {spec.label, spec.method, context, median(pre), median(idx), median(dec), summary, prefill_stats});
    }
  fmt::print("model {}: {} layers, dim {}, on {}\n", o.model, w.config.n_layers, w.config.dim, device);
  // Decode speed against the dense row of the same context, when the run has one.
  auto dense_s = [&](int context) {
    for (const Row& r : rows)
      if (r.base == kDenseMethod && r.context == context) return r.decode_s;
    return 0.0;
  };
  fmt::print("\n{:<14} {:>8} {:>12} {:>8} {:>12} {:>10} {:>9} {:>8} {:>9} {:>8}\n", "method", "context", "prefill t/s",
             "index", "decode t/s", "ms/token", "vs dense", "kv read", "tokens", "claimed");
  for (const Row& r : rows) {
    const double d = dense_s(r.context);
    const AttentionSummary& s = r.summary;
    fmt::print("{:<14} {:>8} {:>12.1f} {:>7.3f}s {:>12.1f} {:>10.3f} {:>9} {:>7.1f}% {:>9.0f} {:>8}\n", r.method,
               r.context, r.context / r.prefill_s, r.index_s, o.bench_decode / r.decode_s,
               1e3 * r.decode_s / o.bench_decode, d > 0 ? fmt::format("{:.2f}x", d / r.decode_s) : "-",
               100 * s.mean_kv_fraction(), s.mean_tokens(), s.claimed_count ? fmt::format("{:.3f}", s.mean_claimed()) : "-");
    fmt::print("{}", prefill_line(o, r.prefill_stats));
  }
  fmt::print("decode: {} tokens after prefilling `context` tokens and building the method's index (median of {} runs; "
             "the first decode captures the step as a CUDA graph); kv read: mean share of the dense K/V bytes read per "
             "decode step; tokens: mean tokens attended per head-step (the last run)\n",
             o.bench_decode, o.repetitions);
  if (!o.json.empty()) {
    nlohmann::json j;
    j["model"] = o.model;
    j["device"] = device;
    j["repetitions"] = o.repetitions;
    for (const Row& r : rows)
      j["runs"].push_back({{"method", r.method},
                           {"context", r.context},
                           {"prefill_s", r.prefill_s},
                           {"prefill_tok_s", r.context / r.prefill_s},
                           {"index_s", r.index_s},
                           {"kv_fraction", r.summary.mean_kv_fraction()},
                           {"tokens_per_head_step", r.summary.mean_tokens()},
                           {"mean_claimed", r.summary.claimed_count ? r.summary.mean_claimed() : -1.0},
                           {"decode_tokens", o.bench_decode},
                           {"decode_s", r.decode_s},
                           {"decode_tok_s", o.bench_decode / r.decode_s},
                           {"prefill_block_share", r.prefill_stats.block_share()}});
    file_write_atomic(o.json, j.dump(2) + "\n", "--json");
  }
}

// Every option, method, parameter and path, checked before the model is loaded; returns
// the methods to run, and opens and checks a --kv-load snapshot into kvs. The model's header
// gives its context, which bounds --bench-context and --max-tokens.
std::vector<MethodSpec> generate_validate(const GenerateOptions& o, KvSnapshotUse& kvs) {
  paths_check_distinct({{"--model", o.model}, {"--tokenizer", o.tokenizer}, {"--prompt-file", o.prompt_file},
                        {"--kv-load", o.kv_load}, {"--json", o.json, true}, {"--kv-save", o.kv_save, true}});
  CUMULUS_CHECK(o.prompt.empty() || o.prompt_file.empty(), "give --prompt or --prompt-file, not both");
  CUMULUS_CHECK(o.max_tokens >= 1, "--max-tokens={} must be >= 1", o.max_tokens);
  CUMULUS_CHECK(o.prompt_tokens >= 0, "--prompt-tokens={} must be >= 0", o.prompt_tokens);
  CUMULUS_CHECK(o.bench || o.json.empty(), "--json '{}' writes the --bench results: add --bench or drop --json",
                o.json);
  CUMULUS_CHECK(o.page_size >= 1 && o.page_size <= 256 && (o.page_size & (o.page_size - 1)) == 0,
                "--page-size={} must be a power of two in [1, 256]", o.page_size);
  CUMULUS_CHECK(o.temperature >= 0 && std::isfinite(o.temperature), "--temperature={} must be >= 0", o.temperature);
  CUMULUS_CHECK(o.device_kv_gib >= 0 && std::isfinite(o.device_kv_gib), "--device-kv-gib={} must be >= 0",
                o.device_kv_gib);
  CUMULUS_CHECK(o.top_p > 0 && o.top_p <= 1, "--top-p={} must be in (0, 1]", o.top_p);
  CUMULUS_CHECK(o.top_p == 1 || o.temperature > 0,
                "--top-p {} samples, but --temperature 0 decodes greedily: give --temperature > 0 or drop --top-p",
                o.top_p);
  CUMULUS_CHECK(!o.prompt_given || !o.prompt.empty(), "--prompt is empty: give a prompt, or none to start from BOS");
  if (o.bench) {
    CUMULUS_CHECK(o.bench_decode >= 1 && o.bench_decode <= 4096, "--bench-decode={} must be in [1, 4096]",
                  o.bench_decode);
    CUMULUS_CHECK(o.repetitions >= 1 && o.repetitions <= 100, "--repetitions={} must be in [1, 100]", o.repetitions);
    CUMULUS_CHECK(!o.bench_contexts.empty(), "--bench-context needs at least one length");
    for (int c : o.bench_contexts) CUMULUS_CHECK(c >= 1, "--bench-context {} must be >= 1", c);
  }
  dtype_from_name(o.kv_dtype);
  weight_storage_from_name(o.weights);
  prefill_spec_check(o.prefill, prefill_param_map(o.prefill_params));
  std::vector<MethodSpec> specs = method_specs_parse(o.methods, o.params);
  if (!o.prompt_file.empty()) file_check_input(o.prompt_file, "--prompt-file");
  if (!o.json.empty()) file_check_output(o.json, "--json");
  if (!o.kv_save.empty() || !o.kv_load.empty()) {
    CUMULUS_CHECK(o.kv_save.empty() || o.kv_load.empty(), "give --kv-save or --kv-load, not both");
    CUMULUS_CHECK(!o.bench, "--kv-save/--kv-load are not for --bench, which prefills its own contexts");
  }
  if (!o.kv_load.empty())
    CUMULUS_CHECK(o.prompt.empty() && o.prompt_file.empty() && o.prompt_tokens == 0,
                  "--kv-load '{}' gives the prompt (the snapshot's tokens): drop --prompt, --prompt-file and "
                  "--prompt-tokens",
                  o.kv_load);
  if (!o.kv_save.empty()) file_check_output(o.kv_save, "--kv-save");

  const ModelConfig c = model_load_check(o.model, o.tokenizer);
  const Shape shape = c.shape();
  method_specs_check(specs, shape);  // what the methods need of the model, before its weights
  prefill_spec_check(o.prefill, prefill_param_map(o.prefill_params), &shape);
  const int ctx = c.context_length;
  CUMULUS_CHECK(o.device_kv_gib == 0 || o.device == "cuda", "--device-kv-gib={} needs --device cuda (not {})",
                o.device_kv_gib, o.device);
  if (o.device != "cpu") {
    CUMULUS_CHECK(o.device == "cuda", "--device={} must be cpu or cuda", o.device);
    CUMULUS_CHECK(o.kv_save.empty() && o.kv_load.empty(), "--device cuda: --kv-save/--kv-load are not yet on cuda");
    // Every method of the run, and the memory of the model's whole context (--bench: of
    // each context), before loading.
    for (const MethodSpec& spec : specs) {
      SessionOptions so = session_options(o, spec.method, spec.params);
      so.eval = o.eval;
      if (!o.bench) device_check(o.device, c, so);
      for (int n : o.bench ? o.bench_contexts : std::vector<int>{}) {
        so.max_tokens = n + o.bench_decode;
        device_check(o.device, c, so);
      }
    }
  }
  if (o.bench) {
    for (int n : o.bench_contexts)
      CUMULUS_CHECK(static_cast<int64_t>(n) + o.bench_decode <= ctx,
                    "--bench-context {} + --bench-decode {} exceeds the context of model '{}' ({} tokens)", n,
                    o.bench_decode, o.model, ctx);
  } else {
    CUMULUS_CHECK(o.max_tokens < ctx,
                  "--max-tokens {} leaves no room for a prompt in the context of model '{}' ({} tokens)", o.max_tokens,
                  o.model, ctx);
  }
  if (!o.kv_load.empty()) {
    kvs.load = std::make_unique<KvSnapshot>(model_snapshot_open(o.kv_load, o.model, o.page_size,
                                                               dtype_from_name(o.kv_dtype)));
    snapshot_weights_check(o.kv_load, kvs.load->info().setup, o.model, o.weights);
    const int n = kvs.load->info().n_tokens;
    CUMULUS_CHECK(static_cast<int64_t>(n) + o.max_tokens <= ctx,
                  "--kv-load '{}': its prompt of {} tokens + --max-tokens {} exceeds the context of model '{}' ({} "
                  "tokens)",
                  o.kv_load, n, o.max_tokens, o.model, ctx);
  }
  if (o.device == "cpu") {
    // The weights, and the K/V of every run decoded in turn at its longest, must fit.
    const int64_t tokens = o.bench ? *std::max_element(o.bench_contexts.begin(), o.bench_contexts.end()) + o.bench_decode
                                   : std::min<int64_t>(ctx, (kvs.load ? kvs.load->info().n_tokens : 1) + o.max_tokens);
    const int sessions = o.bench ? 1 : static_cast<int>(specs.size());
    memory_check("this run", memory_weights_bytes(o.model, c, weight_storage_from_name(o.weights)),
                 memory_kv_bytes(c, dtype_from_name(o.kv_dtype), tokens, sessions),
                 kvs.load ? kvs.load->file_bytes() : 0,
                 fmt::format("{} tokens x {} method(s) in {}, --weights {}", tokens, sessions, o.kv_dtype, o.weights));
  }
  if (!o.kv_save.empty() || !o.kv_load.empty()) kvs.model_id = model_identity(o.model);
  kvs.save_pending = !o.kv_save.empty();
  return specs;
}

void run_generate(const GenerateOptions& o) {
  KvSnapshotUse kvs;
  const std::vector<MethodSpec> specs = generate_validate(o, kvs);
  const std::string text = o.prompt_file.empty() ? o.prompt : text_strip_gutenberg(text_read_file(o.prompt_file));
  CUMULUS_CHECK(o.prompt_file.empty() || !text.empty(),
                "--prompt-file '{}' holds no text (once a Gutenberg header and footer, if any, are stripped)",
                o.prompt_file);
  const LoadedModel model = model_load(o.model, o.tokenizer, weight_storage_from_name(o.weights));
  const ModelWeights& w = model.weights;
  const Tokenizer* tok = model.tokenizer.get();
  if (o.bench && o.prompt.empty() && o.prompt_file.empty()) {
    // No text given: random token ids, as llama-bench feeds.
    std::mt19937 rng(static_cast<uint32_t>(o.seed));
    std::uniform_int_distribution<int32_t> id(0, w.config.vocab_size - 1);
    std::vector<int32_t> prompt(1024);
    for (auto& t : prompt) t = id(rng);
    return o.device == "cpu" ? run_bench(w, prompt, specs, o) : run_bench_device(w, prompt, specs, o);
  }
  std::vector<int32_t> prompt = o.prompt_tokens > 0 ? tok->encode_prefix(text, tok->add_bos_default(),
                                                                            static_cast<size_t>(o.prompt_tokens))
                                                     : tok->encode(text, tok->add_bos_default());
  if (kvs.load) prompt.assign(kvs.load->tokens().begin(), kvs.load->tokens().end());
  if (prompt.empty() && tok->bos_id() >= 0) prompt.push_back(tok->bos_id());
  CUMULUS_CHECK(!prompt.empty(), "the prompt is empty and the tokenizer has no BOS token");
  if (o.prompt_tokens > 0 && static_cast<int>(prompt.size()) > o.prompt_tokens) prompt.resize(o.prompt_tokens);
  CUMULUS_CHECK(o.bench || static_cast<int>(prompt.size()) < w.config.context_length,
                "prompt of {} tokens does not fit the model's context of {} tokens (use --prompt-tokens)",
                prompt.size(), w.config.context_length);

  if (o.bench) return o.device == "cpu" ? run_bench(w, prompt, specs, o) : run_bench_device(w, prompt, specs, o);
  for (const MethodSpec& spec : specs)
    if (const std::string warn = method_budget_warning(spec, static_cast<int64_t>(prompt.size()) + o.max_tokens);
        !warn.empty())
      fmt::print(stderr, "{}\n", warn);
  // On the CPU every method decodes in turn with the others (decode_in_turn), so their runners
  // live together: memory is the sum of their KV caches. On the GPU, whose speed does not
  // drift that way, each runner holds its own copy of the weights and a KV cache for the
  // model's context, and generate_validate checks each against the free memory alone: one
  // method at a time there.
  const size_t together = o.device == "cpu" ? specs.size() : 1;
  // On the CPU the first run prefills and the others copy its prompt (Session::prefill_from,
  // bit for bit the same cache), keeping the prompt queries the methods after it need.
  int keep_queries = 0;
  if (together > 1)
    for (const MethodSpec& spec : specs)
      keep_queries = std::max(keep_queries, Registry::builtin().make(spec.method, w.config.shape(), spec.params)
                                                ->prompt_queries());
  std::vector<RunResult> results;
  for (size_t first = 0; first < specs.size(); first += together) {
    std::vector<LiveRun> runs;
    for (size_t i = first; i < std::min(specs.size(), first + together); ++i)
      runs.push_back(start_run(w, prompt, specs[i], o, kvs, runs.empty() ? nullptr : runs.front().runner->session(),
                               keep_queries));
    const bool stream = !o.quiet && specs.size() == 1;
    decode_in_turn(runs, *tok, o.max_tokens, stream);
    for (LiveRun& L : runs) {
      if (!o.quiet && !stream) fmt::print("\n--- {} ---\n{}\n", L.r.method, L.text);
      L.r.summary = L.runner->summary();
      L.r.prefill_stats = (L.r.shared ? runs.front().runner : L.runner)->prefill_stats();
      results.push_back(std::move(L.r));
    }
  }

  // Decode speed against the first dense run of this process, when there is one.
  auto decode_tps = [](const RunResult& r) { return r.generated > 1 ? (r.generated - 1) / r.decode_s : 0.0; };
  double dense_tps = 0;
  for (size_t i = 0; i < results.size() && dense_tps == 0; ++i)
    if (specs[i].method == kDenseMethod) dense_tps = decode_tps(results[i]);
  fmt::print("\n{:<14} {:>7} {:>9} {:>10} {:>8} {:>7} {:>10} {:>9} {:>10} {:>9} {:>9}\n", "method", "prompt", "prefill",
             "tok/s", "index", "gen", "tok/s", "vs dense", "kv read", "tokens", "claimed");
  for (const auto& r : results) {
    const auto& s = r.summary;
    const double tps = decode_tps(r);
    fmt::print("{:<14} {:>7} {:>8.2f}s {:>10} {:>7.2f}s {:>7} {:>10.1f} {:>9} {:>9.1f}% {:>9.0f} {:>9}\n", r.method,
               r.prompt_len, r.prefill_s,
               r.loaded   ? std::string("kv-load")
               : r.shared ? std::string("shared")
                          : fmt::format("{:.1f}", r.prompt_len / r.prefill_s),
               r.index_s,
               r.generated, tps,
               dense_tps > 0 && tps > 0 ? fmt::format("{:.2f}x", tps / dense_tps) : "-", 100 * s.mean_kv_fraction(),
               s.mean_tokens(), s.claimed_count ? fmt::format("{:.3f}", s.mean_claimed()) : "-");
    if (s.true_count) fmt::print("{:<14} true mass {:.3f} (eval mode)\n", "", s.mean_true());
    fmt::print("{}", prefill_line(o, r.prefill_stats));
  }
  if (kvs.load)
    fmt::print("prefill: the time --kv-load took to read the prompt's cache (no prefill ran; tok/s: kv-load)\n");
  else if (results.size() > 1 && results[1].shared)
    fmt::print("prefill: the first method prefills; the others copy its prompt's cache (tok/s: shared)\n");
  fmt::print("index: the decode method's index build over the prompt, after the prefill (tactic's k-means; 0 for "
             "dense); vs dense: decode tok/s over the dense run's in this process; kv read: mean share of the dense "
             "K/V bytes read per decode step; tokens: mean tokens attended per head-step; claimed: mean mass the "
             "method claims (- = makes no claim)\n");
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  auto* cmd = app.add_subcommand("generate", "Generate text with a real model under one or more attention methods");
  cmd->add_option("--model", o->model, "GGUF or llama2.c .bin model")->required();
  cmd->add_option("--tokenizer", o->tokenizer, "llama2.c tok*.bin (default: found beside the model; not with GGUF)");
  cmd->add_option("--prompt", o->prompt, "prompt text");
  cmd->add_option("--prompt-file", o->prompt_file, "prompt file (Gutenberg header/footer stripped)");
  cmd->add_option("--prompt-tokens", o->prompt_tokens, "keep only the first N prompt tokens (0 = all)");
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to generate")->capture_default_str();
  cmd->add_option("--method", o->methods,
                  "decode method(s), comma-separated: prefilled one after another, then (on the CPU) decoded in "
                  "turn, a token of each at a time; 'label=method' runs a method under its own label")
      ->capture_default_str();
  cmd->add_option("--param", o->params, "key=value or X.key=value, X a label or method (repeatable)");
  cmd->add_option("--prefill", o->prefill, "prefill method: dense or flexprefill")->capture_default_str();
  cmd->add_option("--prefill-param", o->prefill_params, "key=value for the prefill method (repeatable)");
  cmd->add_option("--threads", o->threads, "threads (default: this machine's CPUs)")
      ->check(threads_range())
      ->capture_default_str();
  cmd->add_option("--page-size", o->page_size, "KV cache page size")->capture_default_str();
  cmd->add_option("--kv-dtype", o->kv_dtype, "KV storage: f16, bf16, f32")->capture_default_str();
  cmd->add_option("--temperature", o->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", o->top_p, "nucleus sampling")->capture_default_str();
  cmd->add_option("--seed", o->seed, "sampling seed")->check(seed_check())->capture_default_str();
  cmd->add_option("--device", o->device, "cpu or cuda (a CUDA build with a GPU; decode methods dense, sketch_topp, tactic, psa, quest, oracle_topp, oracle_topk, streaming; "
                  "prefill dense or flexprefill; --bench too)")
      ->capture_default_str();
  cmd->add_option("--device-kv-gib", o->device_kv_gib,
                  "--device cuda: keep every layer's K/V in one pool with this many GiB of device memory and the "
                  "rest in pinned host memory (docs/cuda.md \"Host tier\"; 0: all on the device)")
      ->capture_default_str();
  cmd->add_flag("--eval", o->eval, "also measure the true mass of every attended set (slower)");
  cmd->add_flag("--quiet", o->quiet, "do not print the generated text");
  cmd->add_option("--weights", o->weights, "compact (keep Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K quantised) or f32 (dequantise all)")
      ->capture_default_str();
  cmd->add_option("--kv-save", o->kv_save,
                  "write the prompt's KV cache to this file after the prefill (docs/kv_snapshot.md)");
  cmd->add_option("--kv-load", o->kv_load,
                  "load the prompt and its KV cache from a --kv-save file instead of prefilling it");
  cmd->add_flag("--bench", o->bench,
                "benchmark: prefill each --bench-context tokens, then decode --bench-decode tokens; table, profile, JSON");
  list_option(cmd, "--bench-context", &o->bench_contexts, "--bench: context lengths, comma-separated");
  cmd->add_option("--bench-decode", o->bench_decode, "--bench: decode steps timed per context")->capture_default_str();
  cmd->add_option("--repetitions", o->repetitions, "--bench: runs per context (median)")->capture_default_str();
  cmd->add_option("--json", o->json, "--bench: also write the results as JSON to this file");
  cmd->callback([o, cmd] {
    for (const char* name : {"--bench-context", "--bench-decode", "--repetitions"})
      CUMULUS_CHECK(o->bench || cmd->count(name) == 0, "{} is a --bench option: add --bench or drop {}", name, name);
    o->prompt_given = cmd->count("--prompt") > 0;
    run_generate(*o);
  });
}

WeightStorage weight_storage_from_name(const std::string& name) {
  if (name == "compact") return WeightStorage::compact;
  if (name == "f32") return WeightStorage::f32;
  CUMULUS_FAIL("--weights={} must be compact or f32", name);
}

std::map<std::string, std::string> prefill_param_map(const std::vector<std::string>& params) {
  return key_values_parse(params, "--prefill-param");
}

}  // namespace cumulus::cli
