// End-to-end decode speed of the GPU model runtime (benchmark): a llama3-8b-shaped
// model (32 layers, 32 query heads over 8 kv heads, head_dim 128, dim 4096, ffn 14336, vocab
// 128256, untied head) with random f16 weights made on the device, dense attention, the
// cache filled with random K/V to each context (no prefill: fill_random_context), then
// greedy decode steps of every sequence of a batch timed one by one (decode_batch: argmax on
// the device, each step waits for its ids). Against the floor: (weight bytes + K/V bytes of
// every sequence read per step) / the device-to-device copy bandwidth (read + write)
// measured in the same run. Every (context, batch) that fits the device's free memory;
// the others are listed with the memory they need. Prints a table, writes JSON.
// --methods runs the decode methods of the runtime the same way (each entry a registry name,
// with parameters as name:key=value:key=value), after their index build over the random
// cache (timed apart), with the share of the K/V they read and their tokens per head-step.
// Random keys and queries are not real attention: the sparse rows measure what the
// pipelines cost at the sparsity they find here, not what a real model gains.
// --prefill N (default 32768, 0: none) first times a prefill of N random tokens in one chunk
// and in chunks of 2048 (the tuned causal prefill kernel for attention, each chunk after
// the first over the keys cached before it; cuBLAS for the products) and compares the FLOP
// rate with cuBLAS's on the prefill's largest product shape in the same run.
//   cuda_model_bench [--contexts 8192,32768,131072] [--batches 1,4,16] [--steps 20]
//                    [--json PATH] [--layers N] [--methods dense,sketch_topp:gpu_dense_mib=0]
//                    [--prefill 32768] [--device-kv-gib G]
// --device-kv-gib: every layer's K/V in one pool with G GiB of device memory, the rest in
// pinned host memory (docs/cuda.md "Host tier"): contexts beyond the device's memory.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/cuda_runner.h"

using namespace cumulus;
using json = nlohmann::json;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> v;
  size_t b = 0;
  while (b <= s.size()) {
    size_t e = s.find(sep, b);
    if (e == std::string::npos) e = s.size();
    v.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return v;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  size_t b = 0;
  while (b < s.size()) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    v.push_back(std::stoi(s.substr(b, e - b)));
    b = e + 1;
  }
  return v;
}

// Prefill of n random tokens in one chunk, batch 1, dense attention: seconds, tokens/s and
// TFLOP/s (2 flops per weight per token for the layer products, 2 n^2 d per query head for
// causal attention, QK^T and PV; the head's one row left out) against cuBLAS's TFLOP/s on
// the gate/up product's shape with n rows, measured right after.
json prefill_bench(ModelConfig c, int n, int chunk) {
  SessionOptions o;
  o.max_tokens = n + 1;
  o.prefill_chunk = chunk;
  c.context_length = n + 1;
  try {
    cuda_runner_check(c, o, 1);
  } catch (const Error& e) {
    fmt::print("prefill {} in chunks of {}: does not fit: {}\n", n, chunk, e.what());
    return {{"tokens", n}, {"chunk", chunk}, {"skipped", e.what()}};
  }
  std::vector<int32_t> toks(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) toks[i] = (i * 7919) % c.vocab_size;
  double s = 0;
  {
    auto r = model_runner_cuda_random(c, o, 4321, 1);
    const auto t0 = std::chrono::steady_clock::now();
    r->prefill(toks);
    s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double d = c.head_dim, dim = c.dim, qd = c.n_heads * d, kvd = c.n_kv_heads * d;
  const double layer_weights = qd * dim + 2 * kvd * dim + dim * qd + 3.0 * c.hidden_dim * dim;
  const double linear = 2.0 * n * layer_weights * c.n_layers;
  const double attention = 2.0 * static_cast<double>(n) * n * d * c.n_heads * c.n_layers;
  const double tflops = (linear + attention) / s / 1e12;
  const double blas = cuda_gemm_tflops(c.hidden_dim, c.dim, n);
  fmt::print("prefill {} tokens in chunks of {}: {:.3f} s, {:.0f} tokens/s, {:.1f} TFLOP/s ({:.2f} PFLOP: products "
             "{:.2f}, attention {:.2f}); cuBLAS {}x{} f16 GEMM with {} rows: {:.1f} TFLOP/s; prefill at {:.1f}% of it\n",
             n, chunk, s, n / s, tflops, (linear + attention) / 1e15, linear / 1e15, attention / 1e15, c.hidden_dim, c.dim,
             n, blas, 100 * tflops / blas);
  return {{"tokens", n},          {"chunk", chunk},        {"seconds", s},          {"tokens_per_s", n / s},
          {"tflops", tflops},     {"flops_products", linear}, {"flops_attention", attention},
          {"cublas_tflops", blas}, {"fraction_of_cublas", tflops / blas}};
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<int> contexts{8192, 32768, 131072}, batches{1, 4, 16};
  int steps = 20, layers = 32, prefill_n = 32768;
  double device_kv_gib = 0;
  std::string json_path;
  std::vector<std::string> methods{"dense"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      CUMULUS_CHECK(i + 1 < argc, "{} needs a value", a);
      return argv[++i];
    };
    if (a == "--contexts") contexts = parse_list(next());
    else if (a == "--batches") batches = parse_list(next());
    else if (a == "--steps") steps = std::stoi(next());
    else if (a == "--layers") layers = std::stoi(next());
    else if (a == "--json") json_path = next();
    else if (a == "--methods") methods = split(next(), ',');
    else if (a == "--prefill") prefill_n = std::stoi(next());
    else if (a == "--device-kv-gib") device_kv_gib = std::stod(next());
    else CUMULUS_FAIL("unknown argument '{}' (--contexts, --batches, --steps, --layers, --json, --methods, --prefill, --device-kv-gib)",
                      a);
  }
  CUMULUS_CHECK(steps >= 1 && layers >= 1, "--steps={} and --layers={} must be >= 1", steps, layers);
  CUMULUS_CHECK(prefill_n >= 0, "--prefill={} must be >= 0", prefill_n);
  if (!cuda::device_available()) {
    std::fprintf(stderr, "cuda_model_bench: no CUDA device\n");
    return 1;
  }
  ModelConfig c;
  c.architecture = "llama";
  c.n_layers = layers;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.rope_dim = 128;
  c.dim = 4096;
  c.hidden_dim = 14336;
  c.vocab_size = 128256;
  c.rope_theta = 500000.0f;
  c.tied_output = false;
  const std::string dev = cuda_device_summary();
  const double bw = cuda_copy_gbps();
  fmt::print("device: {}\nllama3-8b shape, {} layers, random f16 weights, kv f16\n", dev, layers);
  fmt::print("device-to-device copy: {:.0f} GB/s (read + write, median of 20 x 1 GiB)\n\n", bw);
  json prefill_prev = json::array();
  if (prefill_n > 0)
    for (int chunk : {prefill_n, 2048}) prefill_prev.push_back(prefill_bench(c, prefill_n, chunk));
  fmt::print("\n");
  fmt::print("{:<16} {:>8} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8} {:>8}\n", "method", "context",
             "batch", "ms/step", "tok/s", "GB/step", "floor ms", "floor t/s", "of floor", "kv read", "index s",
             "vs dense");
  json report = {{"device", dev}, {"copy_gbps", bw}, {"layers", layers}, {"steps", steps},
                 {"device_kv_gib", device_kv_gib}, {"runs", json::array()}};
  if (device_kv_gib > 0)
    fmt::print("K/V in one pool: {} GiB on the device, the rest in pinned host memory (the floor below counts every "
               "byte at the device's copy bandwidth)\n\n",
               device_kv_gib);
  if (!prefill_prev.empty()) report["prefill"] = prefill_prev;
  for (int batch : batches)
  for (int ctx : contexts) {
    double dense_ms = 0;
    for (const std::string& entry : methods) {
    SessionOptions o;
    o.max_tokens = ctx + steps + 4;
    o.device_kv_gib = device_kv_gib;
    const std::vector<std::string> parts = split(entry, ':');
    o.method = parts[0];
    for (size_t i = 1; i < parts.size(); ++i) {
      const size_t eq = parts[i].find('=');
      CUMULUS_CHECK(eq != std::string::npos && eq > 0, "--methods entry '{}': '{}' is not key=value", entry, parts[i]);
      o.params[parts[i].substr(0, eq)] = parts[i].substr(eq + 1);
    }
    c.context_length = o.max_tokens;
    try {
      cuda_runner_check(c, o, batch);
    } catch (const Error& e) {
      fmt::print("{:<16} {:>8} {:>6}  not run: {}\n", entry, ctx, batch, e.what());
      report["runs"].push_back({{"method", entry}, {"context", ctx}, {"batch", batch}, {"skipped", e.what()}});
      continue;
    }
    auto r = model_runner_cuda_random(c, o, 1234, batch);
    r->fill_random_context(ctx, 99);
    const auto ti = std::chrono::steady_clock::now();
    r->build_indexes();
    const double index_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - ti).count();
    std::vector<int32_t> toks(batch, 1);
    for (int i = 0; i < 3; ++i) toks = r->decode_batch(toks);  // warm-up (the first captures the graph)
    std::vector<double> ms;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      toks = r->decode_batch(toks);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    const double step = median(ms);
    if (o.method == cumulus::kDenseMethod && o.params.empty()) dense_ms = step;
    // Bytes a step reads: every weight matrix and the classifier once, and every sequence's
    // K/V at the mean depth, times the share the method read (dense: 1).
    const AttentionSummary sum = r->summary();
    const double kv_share = sum.mean_kv_fraction();
    const double depth = ctx + 3 + 0.5 * (steps + 1);
    const double bytes = static_cast<double>(r->decode_weight_bytes()) +
                         kv_share * static_cast<double>(batch) * depth * r->kv_bytes_per_token();
    const double floor_ms = bytes / (bw * 1e9) * 1e3;
    fmt::print("{:<16} {:>8} {:>6} {:>10.3f} {:>10.1f} {:>10.2f} {:>10.3f} {:>10.1f} {:>7.1f}% {:>7.1f}% {:>8.3f} {:>8}\n",
               entry, ctx, batch, step, 1e3 * batch / step, bytes / 1e9, floor_ms, 1e3 * batch / floor_ms,
               100 * floor_ms / step, 100 * kv_share, index_s,
               dense_ms > 0 ? fmt::format("{:.2f}x", dense_ms / step) : "-");
    report["runs"].push_back({{"method", entry},
                              {"context", ctx},
                              {"batch", batch},
                              {"ms_per_step_median", step},
                              {"ms_samples", ms},
                              {"tokens_per_s", 1e3 * batch / step},
                              {"bytes_per_step", bytes},
                              {"weight_bytes", r->decode_weight_bytes()},
                              {"kv_bytes_per_token", r->kv_bytes_per_token()},
                              {"floor_ms", floor_ms},
                              {"pct_of_floor", 100 * floor_ms / step},
                              {"kv_fraction", kv_share},
                              {"tokens_per_head_step", sum.mean_tokens()},
                              {"mean_claimed", sum.claimed_count ? sum.mean_claimed() : -1.0},
                              {"index_s", index_s},
                              {"vs_dense", dense_ms > 0 ? dense_ms / step : 0.0}});
    }
  }
  fmt::print("\nms/step: median of {} greedy decode steps of the whole batch (wall clock, each waits for its ids); "
             "tok/s: batch / step; floor: (weight bytes + the K/V bytes read: every sequence's at the mean depth times "
             "kv read, the method's mean share) / copy bandwidth; index s: the method's index build (tactic's "
             "k-means, sketch_topp's sketch) over the random cache; vs dense: the dense row's ms over this row's\n",
             steps);
  if (!json_path.empty()) std::ofstream(json_path) << report.dump(2) << "\n";
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
