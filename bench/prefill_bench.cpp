// Prefill benchmark: the prefill attention kernels on their own and FlexPrefill on
// a real model, printed as tables and written as JSON.
//
//   kernel  one layer of SmolLM2-135M's attention shape (9 query heads over 3 kv heads,
//           head_dim 64) and of llama3-8b's (32 over 8, head_dim 128), f16 cache, holding the
//           synthetic prompt of bench/prefill_workload.h, prefilled as one chunk of n tokens:
//           dense flash kernel, block-sparse kernel over a causal-diagonal band, and
//           flexprefill (selection + block-sparse kernel, defaults), in GFLOP/s (4 flops per
//           query head, key and dimension: q.k and p.v), next to the sgemm GFLOP/s OpenBLAS
//           reaches on the same threads in the same run (1024^3 per thread) as the machine's
//           compute roof; block share and speedup against dense from the same run.
//   model   SmolLM2 prefill of the first n tokens of a Gutenberg book (n = 2K, 4K, 8K): dense
//           in the session's default 256-token chunks, dense in one chunk, flexprefill with
//           its defaults and with min_budget 0; wall time, tok/s, time inside the attention
//           kernel and in FlexPrefill's selection, share of the causal blocks computed, heads
//           per pattern. Same run, same threads, speedups as ratios; the configs run
//           interleaved --reps times and each reports its best wall time and best process CPU
//           time (the latter is less disturbed by other processes on a shared machine).
//   kl      accuracy: prefill the book's first kl_tokens tokens with flexprefill, then
//           decode densely, teacher-forced with the all-dense greedy continuation; KL(dense ||
//           flexprefill) of the next-token distributions at each of the first kl_steps steps
//           (step 0 = the prompt's own last logits). The dense reference prefills in one chunk
//           like flexprefill, so the gamma = 1 control row reads exactly 0.
//
// usage: prefill_bench [--model GGUF] [--text FILE] [--threads 2] [--lengths 2048,4096,8192]
//                      [--reps 1] [--kl-tokens 8160] [--kl-steps 32] [--only kernel,model,kl]
//                      [--json FILE]
#include <cblas.h>
#include <time.h>
#include <hwy/targets.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cumulus/kernels/simd.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/file.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/bench.h"
#include "cumulus/kernels/prefill.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/session.h"
#include "cumulus/model/text.h"
#include "cumulus/model/tokenizer.h"
#include "cumulus/kernels/flexprefill_select.h"
#include "prefill_workload.h"

extern "C" void openblas_set_num_threads(int num_threads);

using namespace cumulus;
using Clock = std::chrono::steady_clock;
using ParamMap = std::map<std::string, std::string>;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// CPU seconds of this process (all threads): less sensitive than wall time to other
// processes on a shared machine (the pool's idle workers sleep, they do not spin).
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoi(item));
  return out;
}

// GFLOP/s of single-threaded 1024^3 sgemms, one per thread of the pool, all at once.
double sgemm_gflops(ThreadPool& pool) {
  const int n = 1024;
  const int t = pool.n_threads();
  std::vector<std::vector<float>> a(t, std::vector<float>(n * n, 0.5f)), b = a, c = a;
  openblas_set_num_threads(1);
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    pool.parallel_for(t, [&](int64_t i, int) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a[i].data(), n, b[i].data(), n, 0.0f,
                  c[i].data(), n);
    });
    best = std::max(best, 2.0 * n * n * n * t / seconds_since(t0) / 1e9);
  }
  return best;
}

// One layer of an attention shape in a real f16 KvCache holding the synthetic prompt of
// bench/prefill_workload.h (n tokens): queries [n][n_q][dim] float32.
struct KernelCase {
  std::string name;
  bench::PromptShape ps;
  Shape shape;
  KvCache kv;
  std::vector<float> q, out;
  std::vector<PagedHeadView> views;
  int n;

  KernelCase(std::string label, const bench::PromptShape& p, int n_tokens, ThreadPool& pool)
      : name(std::move(label)),
        ps(p),
        shape{1, p.n_kv * p.group, p.n_kv, p.head_dim},
        kv(shape, KvCacheOptions{16, DType::f16, n_tokens}),
        n(n_tokens) {
    const int nq = p.n_kv * p.group, d = p.head_dim;
    std::vector<float> k(static_cast<size_t>(n) * p.n_kv * d), v(k.size());
    q.resize(static_cast<size_t>(n) * nq * d);
    pool.parallel_for(n, [&](int64_t t, int) {
      for (int h = 0; h < p.n_kv; ++h)
        for (int j = 0; j < d; ++j) {
          const size_t i = (static_cast<size_t>(t) * p.n_kv + h) * d + j;
          k[i] = bench::prompt_key(p, h, static_cast<int>(t), j);
          v[i] = bench::prompt_value(p, h, static_cast<int>(t), j);
        }
      for (int qh = 0; qh < nq; ++qh)
        for (int j = 0; j < d; ++j)
          q[(static_cast<size_t>(t) * nq + qh) * d + j] = bench::prompt_query(p, qh, static_cast<int>(t), j);
    });
    kv.append(0, k.data(), v.data(), n);
    out.resize(q.size());
    for (int h = 0; h < p.n_kv; ++h) views.push_back(kv.view(0, h));
  }
  PrefillAttnArgs args() {
    PrefillAttnArgs a;
    a.kv = views.data();
    a.n_kv_heads = ps.n_kv;
    a.group = ps.group;
    a.scale = 1.0f / std::sqrt(static_cast<float>(ps.head_dim));
    a.pos = 0;
    a.n_q = n;
    a.q = q.data();
    a.out = out.data();
    return a;
  }
};

// Query-key pairs a layout computes (causal inside diagonal blocks), all heads.
int64_t layout_pairs(const BlockSparseLayout& L, int n) {
  int64_t pairs = 0;
  for (int h = 0; h < L.n_q_heads; ++h)
    for (int r = 0; r < L.n_q_blocks; ++r)
      for (int32_t c : L.list(h, r)) {
        const int q0 = r * L.block_size, q1 = std::min(n, q0 + L.block_size);
        for (int i = q0; i < q1; ++i) pairs += std::max(0, std::min(i + 1, (c + 1) * L.block_size) - c * L.block_size);
      }
  return pairs;
}

// Every query head lists the first block and the `band` blocks ending at the diagonal.
BlockSparseLayout band_layout(int n, int n_q_heads, int block, int band, int64_t* pairs) {
  BlockSparseLayout L = block_sparse_layout_causal(0, n, n_q_heads, block);
  L.blocks.clear();
  L.offsets.assign(1, 0);
  *pairs = 0;
  for (int h = 0; h < n_q_heads; ++h)
    for (int r = 0; r < L.n_q_blocks; ++r) {
      for (int c = 0; c <= r; ++c)
        if (c == 0 || c > r - band) {
          L.blocks.push_back(c);
          // query-key pairs of this block (causal inside the diagonal block)
          const int q0 = r * block, q1 = std::min(n, q0 + block);
          for (int i = q0; i < q1; ++i) *pairs += std::min(i + 1, (c + 1) * block) - c * block;
        }
      L.offsets.push_back(static_cast<int32_t>(L.blocks.size()));
    }
  return L;
}

nlohmann::json run_kernels(ThreadPool& pool, const std::vector<int>& lengths) {
  nlohmann::json rows = nlohmann::json::array();
  PrefillWorkspace workspace;  // the kernels' scratch, allocated once, as a Session's prefill does
  const double roof = sgemm_gflops(pool);
  std::printf("== prefill kernels: one layer on the synthetic prompt (bench/prefill_workload.h), f16 cache; "
              "flexprefill = its selection (probe included) + the block-sparse kernel, defaults\n");
  std::printf("sgemm roof (OpenBLAS, 1024^3 per thread, %d threads): %.1f GFLOP/s\n", pool.n_threads(), roof);
  std::printf("%-24s %-8s %-22s %10s %10s %10s %8s %8s %8s\n", "shape", "tokens", "kernel", "ms", "pairs(M)",
              "GFLOP/s", "of sgemm", "share%", "x dense");
  const std::pair<std::string, bench::PromptShape> shapes[] = {{"smollm2 (9/3 heads, d64)", {3, 3, 64}},
                                                               {"llama3-8b (32/8, d128)", {8, 4, 128}}};
  for (const auto& [label, ps] : shapes)
    for (int n : lengths) {
      KernelCase kc(label, ps, n, pool);
      const int nq = ps.n_kv * ps.group, d = ps.head_dim;
      auto time_min = [&](auto&& fn) {
        fn();  // warm-up (also sizes the kernels' scratch)
        double best = 1e30;
        for (int r = 0; r < 3; ++r) {
          const auto t0 = Clock::now();
          fn();
          best = std::min(best, seconds_since(t0));
        }
        return best;
      };
      const int64_t dense_pairs = static_cast<int64_t>(n) * (n + 1) / 2 * nq;
      double dense_s = 0.0;
      auto report = [&](const std::string& name, double s, int64_t pairs, double share) {
        const double gflops = 4.0 * static_cast<double>(pairs) * d / s / 1e9;
        std::printf("%-24s %-8d %-22s %10.1f %10.2f %10.1f %7.0f%% %8.1f %8.2f\n", label.c_str(), n, name.c_str(),
                    s * 1e3, pairs / 1e6, gflops, 100.0 * gflops / roof, 100.0 * share, dense_s / s);
        rows.push_back({{"shape", label}, {"tokens", n}, {"kernel", name}, {"ms", s * 1e3}, {"query_key_pairs", pairs},
                        {"gflops", gflops}, {"sgemm_gflops", roof}, {"block_share", share},
                        {"speedup_vs_dense", dense_s / s}});
      };
      dense_s = time_min([&] { cpu::attention_prefill_dense(kc.args(), pool, &workspace); });
      report("dense", dense_s, dense_pairs, 1.0);
      const double causal_blocks = [&] {
        const double nb = (n + 127) / 128;
        return nb * (nb + 1) / 2 * nq;
      }();
      for (int band : {2, 8}) {
        int64_t pairs = 0;
        const BlockSparseLayout L = band_layout(n, nq, 128, band, &pairs);
        report("block-sparse band " + std::to_string(band),
               time_min([&] { cpu::attention_prefill_block_sparse(kc.args(), L, pool, &workspace); }), pairs,
               static_cast<double>(L.blocks.size()) / causal_blocks);
      }
      flexprefill::LayerSelection sel;
      const flexprefill::Config cfg;
      const flexprefill::Geometry g{0, n, cfg.block_size};
      const double sel_s = time_min([&] {
        sel = flexprefill::select_layer(cfg, g, kc.views.data(), ps.n_kv, ps.group, kc.q.data(), pool);
      });
      const double attn_s = time_min([&] { cpu::attention_prefill_block_sparse(kc.args(), sel.layout, pool, &workspace); });
      const double share = static_cast<double>(sel.layout.blocks.size()) / causal_blocks;
      const int64_t pairs = layout_pairs(sel.layout, n);
      report("flexprefill (total)", sel_s + attn_s, pairs, share);
      rows.back()["selection_ms"] = sel_s * 1e3;
      std::printf("%-24s %-8d %-22s %10.1f   (%.0f%% of flexprefill's total)\n", label.c_str(), n,
                  "  of which selection", sel_s * 1e3, 100.0 * sel_s / (sel_s + attn_s));
      std::fflush(stdout);
    }
  std::printf("\n");
  return {{"sgemm_gflops", roof}, {"rows", rows}};
}

struct Model {
  std::unique_ptr<ModelWeights> w;
  std::unique_ptr<Tokenizer> tok;
  std::vector<int32_t> ids;  // the whole book
};

struct Config {
  std::string label, method;
  ParamMap params;
  int chunk = 256;  // SessionOptions::prefill_chunk (0 = the prompt length)
};

nlohmann::json run_model(const Model& m, int threads, const std::vector<int>& lengths, int reps) {
  const std::vector<Config> configs = {{"dense (one chunk)", "dense", {}, 0},
                                       {"dense (256-token chunks)", "dense", {}, 256},
                                       {"flexprefill", "flexprefill", {}, 256},
                                       {"flexprefill min_budget=0", "flexprefill", {{"min_budget", "0"}}, 256}};
  nlohmann::json rows = nlohmann::json::array();
  std::printf("== SmolLM2-135M prefill, %d threads, best of %d interleaved runs (FlexPrefill defaults: gamma 0.9, "
              "tau 0.1, block 128, min_budget 1024)\n",
              threads, reps);
  std::printf("%-6s %-25s %8s %8s %7s %7s %7s %6s %7s %7s %7s %11s %5s\n", "tokens", "config", "wall s", "cpu s",
              "tok/s", "attn s", "attn %", "sel s", "blocks", "wall x", "cpu x", "QA/VS/dense", "load");
  for (int n : lengths) {
    if (n > static_cast<int>(m.ids.size()) || n > m.w->config.context_length) {
      std::printf("%-6d skipped: the book has %zu tokens, the context %d\n", n, m.ids.size(), m.w->config.context_length);
      continue;
    }
    const std::vector<int32_t> prompt(m.ids.begin(), m.ids.begin() + n);
    struct Best {
      double wall = 1e30, cpu = 1e30, load = 0;
      PrefillStats st;
    };
    std::vector<Best> best(configs.size());
    for (int rep = 0; rep < reps; ++rep) {
      for (size_t ci = 0; ci < configs.size(); ++ci) {
        const Config& c = configs[ci];
        SessionOptions o;
        o.prefill_method = c.method;
        o.prefill_params = c.params;
        o.n_threads = threads;
        o.prefill_chunk = c.chunk > 0 ? c.chunk : n;
        o.max_tokens = n + 1;
        Session s(*m.w, o);
        const double load = load_average();
        const double c0 = cpu_seconds();
        const auto t0 = Clock::now();
        s.prefill(prompt);
        const double wall = seconds_since(t0), cpu = cpu_seconds() - c0;
        Best& b = best[ci];
        if (wall < b.wall) b.wall = wall, b.st = s.prefill_method().stats(), b.load = load;
        b.cpu = std::min(b.cpu, cpu);
      }
    }
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const Config& c = configs[ci];
      const Best& b = best[ci];
      const PrefillStats& st = b.st;
      const double wall_x = best[0].wall / b.wall, cpu_x = best[0].cpu / b.cpu;
      const std::string heads = std::to_string(st.heads_query_aware) + "/" + std::to_string(st.heads_vertical_slash) +
                                "/" + std::to_string(st.heads_dense);
      std::printf("%-6d %-25s %8.2f %8.2f %7.1f %7.2f %6.0f%% %6.2f %6.1f%% %6.2fx %6.2fx %11s %5.2f\n", n,
                  c.label.c_str(), b.wall, b.cpu, n / b.wall, st.attention_seconds,
                  100.0 * st.attention_seconds / b.wall, st.select_seconds, 100.0 * st.block_share(), wall_x, cpu_x,
                  heads.c_str(), b.load);
      std::fflush(stdout);
      rows.push_back({{"tokens", n},
                      {"config", c.label},
                      {"method", c.method},
                      {"params", c.params},
                      {"prefill_chunk", c.chunk > 0 ? c.chunk : n},
                      {"reps", reps},
                      {"wall_s", b.wall},
                      {"cpu_s", b.cpu},
                      {"tok_per_s", n / b.wall},
                      {"attention_s", st.attention_seconds},
                      {"select_s", st.select_seconds},
                      {"block_share", st.block_share()},
                      {"blocks_computed", st.blocks_computed},
                      {"blocks_causal", st.blocks_causal},
                      {"heads_query_aware", st.heads_query_aware},
                      {"heads_vertical_slash", st.heads_vertical_slash},
                      {"heads_dense", st.heads_dense},
                      {"wall_speedup_vs_dense_one_chunk", wall_x},
                      {"cpu_speedup_vs_dense_one_chunk", cpu_x},
                      {"load_average", b.load}});
    }
  }
  std::printf("wall/cpu s: best prefill wall time / process CPU time; attn: time inside the prefill attention kernel "
              "(of the best-wall run) and its share of the wall time; sel: FlexPrefill's probe and block selection; "
              "blocks: share of the causal (query head, query block, key block) triples computed; wall x / cpu x: "
              "speedup over dense in one chunk; QA/VS/dense: (layer, head) patterns; load: load average before the run\n\n");
  return rows;
}

std::vector<double> softmax(const std::vector<float>& logits) {
  const float m = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double l = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) l += (p[i] = std::exp(static_cast<double>(logits[i]) - m));
  for (double& x : p) x /= l;
  return p;
}

nlohmann::json run_kl(const Model& m, int threads, int n, int steps) {
  n = std::min({n, static_cast<int>(m.ids.size()), m.w->config.context_length - steps});
  const std::vector<int32_t> prompt(m.ids.begin(), m.ids.begin() + n);
  std::printf("== accuracy: prefill %d tokens, then dense decode teacher-forced with the dense greedy continuation; "
              "KL(dense || config) of the next-token distribution, %d steps\n",
              n, steps);
  auto session_options = [&](const std::string& method, const ParamMap& params) {
    SessionOptions o;
    o.prefill_method = method;
    o.prefill_params = params;
    o.n_threads = threads;
    o.prefill_chunk = n;  // one chunk, as flexprefill
    o.max_tokens = n + steps;
    return o;
  };
  // All-dense reference: distributions and the greedy continuation.
  std::vector<std::vector<double>> ref;
  std::vector<int32_t> cont;
  {
    Session s(*m.w, session_options("dense", {}));
    std::vector<float> logits = s.prefill(prompt);
    for (int i = 0; i < steps; ++i) {
      ref.push_back(softmax(logits));
      cont.push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
      if (i + 1 < steps) logits = s.decode(cont.back());
    }
  }
  std::string text = m.tok->decode(cont);
  for (char& ch : text)
    if (ch == '\n') ch = ' ';
  std::printf("dense continuation: \"%s\"\n", text.c_str());
  const std::vector<Config> configs = {{"flexprefill gamma=1 (control)", "flexprefill", {{"gamma", "1"}}},
                                       {"flexprefill", "flexprefill", {}},
                                       {"flexprefill min_budget=0", "flexprefill", {{"min_budget", "0"}}},
                                       {"flexprefill gamma=0.95", "flexprefill", {{"gamma", "0.95"}}}};
  std::printf("%-30s %10s %10s %10s %8s %7s %9s\n", "config", "mean KL", "median KL", "max KL", "top-1", "blocks",
              "prefill s");
  nlohmann::json rows = nlohmann::json::array();
  for (const Config& c : configs) {
    Session s(*m.w, session_options(c.method, c.params));
    const auto t0 = Clock::now();
    std::vector<float> logits = s.prefill(prompt);
    const double secs = seconds_since(t0);
    std::vector<double> kl;
    int agree = 0;
    for (int i = 0; i < steps; ++i) {
      const std::vector<double> p = softmax(logits);
      double d = 0.0;
      for (size_t v = 0; v < p.size(); ++v)
        if (ref[i][v] > 0) d += ref[i][v] * std::log(ref[i][v] / std::max(p[v], 1e-300));
      kl.push_back(std::max(0.0, d));
      agree += (std::max_element(logits.begin(), logits.end()) - logits.begin()) == cont[i];
      if (i + 1 < steps) logits = s.decode(cont[i]);
    }
    std::vector<double> sorted = kl;
    std::sort(sorted.begin(), sorted.end());
    double mean = 0.0;
    for (double x : kl) mean += x / steps;
    const double median = 0.5 * (sorted[(steps - 1) / 2] + sorted[steps / 2]);
    const PrefillStats& st = s.prefill_method().stats();
    std::printf("%-30s %10.2e %10.2e %10.2e %5d/%-2d %6.1f%% %9.2f\n", c.label.c_str(), mean, median, sorted.back(),
                agree, steps, 100.0 * st.block_share(), secs);
    std::fflush(stdout);
    rows.push_back({{"config", c.label},
                    {"params", c.params},
                    {"kl_per_step", kl},
                    {"kl_mean", mean},
                    {"kl_median", median},
                    {"kl_max", sorted.back()},
                    {"top1_agree", agree},
                    {"steps", steps},
                    {"block_share", st.block_share()},
                    {"heads_query_aware", st.heads_query_aware},
                    {"heads_vertical_slash", st.heads_vertical_slash},
                    {"prefill_s", secs}});
  }
  std::printf("\n");
  return {{"prompt_tokens", n}, {"steps", steps}, {"continuation", cont}, {"rows", rows}};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cumulus::cpu::simd_select_from_env();  // CUMULUS_SIMD caps the SIMD target (kernels/simd.h)
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string text_path = "../shared/data/text/pg1342_pride_and_prejudice.txt";
  std::string json_path = "prefill_bench.json";
  std::string only = "kernel,model,kl";
  std::vector<int> lengths = {2048, 4096, 8192};
  int threads = 2, kl_tokens = 8160, kl_steps = 32, reps = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "prefill_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") model_path = next();
    else if (a == "--text") text_path = next();
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--lengths") lengths = parse_ints(next());
    else if (a == "--kl-tokens") kl_tokens = std::stoi(next());
    else if (a == "--kl-steps") kl_steps = std::stoi(next());
    else if (a == "--only") only = next();
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--json") json_path = next();
    else {
      std::fprintf(stderr,
                   "usage: prefill_bench [--model GGUF] [--text FILE] [--threads N] [--lengths 2048,4096,8192] "
                   "[--reps N] [--kl-tokens N] [--kl-steps N] [--only kernel,model,kl] [--json FILE]\n");
      return 2;
    }
  }
  if (kl_steps < 1 || threads < 1 || reps < 1) {
    std::fprintf(stderr, "prefill_bench: --kl-steps, --threads and --reps must be >= 1\n");
    return 2;
  }
  const std::string cpu_name = bench_machine().cpu;
  const char* target = hwy::TargetName(hwy::SupportedAndGeneratedTargets().front());
  std::printf("machine: %s, %u hardware threads; SIMD target %s; %d threads; load average %.2f at start\n\n",
              cpu_name.c_str(), std::thread::hardware_concurrency(), target, threads, load_average());
  ThreadPool pool(threads);
  nlohmann::json out = {{"machine", cpu_name}, {"simd_target", target}, {"threads", threads},
                        {"load_average_start", load_average()}};
  try {
    if (only.find("kernel") != std::string::npos) out["kernel"] = run_kernels(pool, lengths);
    if (only.find("model") != std::string::npos || only.find("kl") != std::string::npos) {
      Model m;
      m.w = std::make_unique<ModelWeights>(model_weights_load(model_path));
      m.tok = tokenizer_from_gguf(GgufFile::open(model_path));
      m.ids = m.tok->encode(text_strip_gutenberg(text_read_file(text_path)), m.tok->add_bos_default());
      out["model"] = model_path;
      out["text"] = text_path;
      if (only.find("model") != std::string::npos) out["prefill"] = run_model(m, threads, lengths, reps);
      if (only.find("kl") != std::string::npos) out["kl"] = run_kl(m, threads, kl_tokens, kl_steps);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prefill_bench: %s\n", e.what());
    return 1;
  }
  out["load_average_end"] = load_average();
  cumulus::file_write_atomic(json_path, out.dump(2) + "\n", "--json");
  std::printf("load average %.2f at the end; JSON: %s\n", load_average(), json_path.c_str());
  return 0;
}
