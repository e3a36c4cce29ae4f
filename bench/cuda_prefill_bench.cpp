// GPU prefill benchmark (docs/cuda.md "Prefill"): one layer of the llama3-8b shape
// (32 query heads, 8 kv heads, head_dim 128, f16; --shape picks another, e.g. gemma3-270m:
// 4 query heads, 1 kv head, head_dim 256) prefilled from position 0 at each context:
//   dense        our causal flash-style tensor-core kernel
//   flexprefill  the probe on the device (lse of the last block by the dense kernel, the
//                column/diagonal projection, block means), the download of its results, the
//                block selection on the host (flexprefill::select_head per query head on a
//                thread pool), the layout upload, then our block-sparse kernel
// on a synthetic prompt with the structure FlexPrefill exploits (below). Each timed region is
// bracketed by device events (kernels) or a host clock after a device synchronize (host
// parts); median of --iters after --warmup. Before its time counts, dense is checked against
// a float64 host computation on sampled rows; flexprefill's output is compared with dense
// (err = ||o - o_dense|| / ||o_dense|| over all rows). TFLOP/s counts 4 * head_dim flops per
// attended (query, key) pair of the causal triangle (dense) or of the listed blocks (sparse;
// masked entries of diagonal tiles counted as computed: the kernel computes them).
// PyTorch's SDPA on the same device: tools/device/torch_prefill_bench.py.
//
// Synthetic prompt: bench/prefill_workload.h (sinks and heavy tokens as vertical lines, a
// RoPE-like recency prior as slashes, query-dependent content noise), the same as the CPU
// benchmark's flexprefill rows. Block shares on real models differ (docs/methods.md).
//
// usage: cuda_prefill_bench [--contexts 32768,131072] [--iters 5] [--warmup 1] [--json FILE]
//          [--gamma 0.9] [--tau 0.1] [--block 128] [--min-budget 1024] [--threads 0]
//          [--shape llama3-8b | gemma3-270m | Q_HEADS,KV_HEADS,HEAD_DIM]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/core/file.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_prefill.h"
#include "cumulus/kernels/flexprefill_select.h"
#include "prefill_workload.h"

using namespace cumulus;
using Clock = std::chrono::steady_clock;

namespace {

// One layer's attention shape; head_dim 64, 128 or 256 (the kernels' instantiations).
struct BenchShape {
  std::string name;
  int hq, hkv, dim;
};

BenchShape parse_shape(const std::string& s) {
  if (s == "llama3-8b") return {s, 32, 8, 128};
  if (s == "gemma3-270m") return {s, 4, 1, 256};
  BenchShape b{s, 0, 0, 0};
  if (std::sscanf(s.c_str(), "%d,%d,%d", &b.hq, &b.hkv, &b.dim) != 3 || b.hq < 1 || b.hkv < 1 || b.hq % b.hkv != 0) {
    std::fprintf(stderr,
                 "--shape %s: want llama3-8b, gemma3-270m or Q_HEADS,KV_HEADS,HEAD_DIM (Q_HEADS a multiple of "
                 "KV_HEADS)\n",
                 s.c_str());
    std::exit(2);
  }
  return b;
}

template <class Fn>
void parallel(int64_t n, int threads, Fn&& fn) {
  std::vector<std::thread> ts;
  for (int w = 0; w < threads; ++w)
    ts.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += threads) fn(i);
    });
  for (auto& t : ts) t.join();
}

struct Prompt {
  int n;
  std::vector<uint16_t> q, k, v;  // head-major f16
};

Prompt make_prompt(const BenchShape& sh, int n, int threads) {
  const int hq = sh.hq, hkv = sh.hkv, dim = sh.dim;
  const bench::PromptShape shape{hkv, hq / hkv, dim};
  Prompt p;
  p.n = n;
  p.q.resize(static_cast<size_t>(hq) * n * dim);
  p.k.resize(static_cast<size_t>(hkv) * n * dim);
  p.v.resize(p.k.size());
  parallel(static_cast<int64_t>(hkv) * n, threads, [&](int64_t row) {
    const int h = static_cast<int>(row / n), t = static_cast<int>(row % n);
    for (int j = 0; j < dim; ++j) {
      p.k[static_cast<size_t>(row) * dim + j] = f32_to_f16(bench::prompt_key(shape, h, t, j));
      p.v[static_cast<size_t>(row) * dim + j] = f32_to_f16(bench::prompt_value(shape, h, t, j));
    }
  });
  parallel(static_cast<int64_t>(hq) * n, threads, [&](int64_t row) {
    const int qh = static_cast<int>(row / n), t = static_cast<int>(row % n);
    for (int j = 0; j < dim; ++j) p.q[static_cast<size_t>(row) * dim + j] = f32_to_f16(bench::prompt_query(shape, qh, t, j));
  });
  return p;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// float64 attention of row i of query head qh over keys [0, i].
void reference_row(const BenchShape& sh, const Prompt& p, int qh, int i, std::vector<double>& out) {
  const int hq = sh.hq, hkv = sh.hkv, dim = sh.dim;
  const int h = qh / (hq / hkv);
  const uint16_t* q = &p.q[(static_cast<size_t>(qh) * p.n + i) * dim];
  std::vector<double> s(static_cast<size_t>(i) + 1);
  double m = -INFINITY;
  for (int j = 0; j <= i; ++j) {
    const uint16_t* k = &p.k[(static_cast<size_t>(h) * p.n + j) * dim];
    double d = 0;
    for (int x = 0; x < dim; ++x) d += static_cast<double>(f16_to_f32(q[x])) * f16_to_f32(k[x]);
    s[j] = d / std::sqrt(static_cast<double>(dim));
    m = std::max(m, s[j]);
  }
  out.assign(dim, 0.0);
  double l = 0;
  for (int j = 0; j <= i; ++j) {
    const double w = std::exp(s[j] - m);
    l += w;
    const uint16_t* v = &p.v[(static_cast<size_t>(h) * p.n + j) * dim];
    for (int x = 0; x < dim; ++x) out[x] += w * f16_to_f32(v[x]);
  }
  for (double& x : out) x /= l;
}

double rel_err(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int threads) {
  std::vector<double> num(threads, 0.0), den(threads, 0.0);
  const int64_t n = static_cast<int64_t>(a.size());
  parallel(threads, threads, [&](int64_t w) {
    for (int64_t i = w * (n / threads); i < (w == threads - 1 ? n : (w + 1) * (n / threads)); ++i) {
      const double x = f16_to_f32(a[i]), y = f16_to_f32(b[i]);
      num[w] += (x - y) * (x - y);
      den[w] += y * y;
    }
  });
  double nn = 0, dd = 0;
  for (int w = 0; w < threads; ++w) nn += num[w], dd += den[w];
  return std::sqrt(nn / dd);
}

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t j = s.find(',', i);
    out.push_back(std::stoi(s.substr(i, j == std::string::npos ? std::string::npos : j - i)));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> contexts{32768, 131072};
  int iters = 5, warmup = 1, threads = 0;
  std::string json_path = "cuda_prefill_bench.json";
  flexprefill::Config cfg;
  BenchShape shape = parse_shape("llama3-8b");
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--contexts") contexts = parse_ints(next());
    else if (a == "--iters") iters = std::stoi(next());
    else if (a == "--warmup") warmup = std::stoi(next());
    else if (a == "--json") json_path = next();
    else if (a == "--gamma") cfg.gamma = std::stod(next());
    else if (a == "--tau") cfg.tau = std::stod(next());
    else if (a == "--block") cfg.block_size = std::stoi(next());
    else if (a == "--min-budget") cfg.min_budget = std::stoi(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--shape") shape = parse_shape(next());
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  if (!cuda::device_available()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const int hq = shape.hq, hkv = shape.hkv, dim = shape.dim;
  const cuda::DeviceInfo dev = cuda::device_info();
  std::printf("%s (cc %d.%d, %d SMs), %d host threads; %s shape %d/%d heads, d %d, f16\n", dev.name.c_str(),
              dev.cc_major, dev.cc_minor, dev.sm_count, threads, shape.name.c_str(), hq, hkv, dim);
  ThreadPool pool(threads);
  nlohmann::json report;
  report["device"] = dev.name;
  report["shape"] = {{"name", shape.name}, {"n_q_heads", hq}, {"n_kv_heads", hkv}, {"head_dim", dim}, {"dtype", "f16"}};
  report["config"] = {{"gamma", cfg.gamma}, {"tau", cfg.tau}, {"block_size", cfg.block_size},
                      {"min_budget", cfg.min_budget}, {"max_budget", cfg.max_budget}};
  report["iters"] = iters;
  report["runs"] = nlohmann::json::array();
  std::printf("\n%7s %-12s %10s %9s %8s %8s %8s %8s %7s %8s\n", "ctx", "method", "ms", "TFLOP/s", "probe", "select",
              "xfer", "attn", "share%", "err");
  cuda::Stream stream;
  for (const int n : contexts) {
    const auto tg = Clock::now();
    const Prompt pr = make_prompt(shape, n, threads);
    const double gen_s = std::chrono::duration<double>(Clock::now() - tg).count();
    cuda::DeviceBuffer dq = cuda::to_device(pr.q), dk = cuda::to_device(pr.k), dv = cuda::to_device(pr.v);
    cuda::DeviceBuffer dout(pr.q.size() * 2);
    cuda::DevicePrefillArgs a;
    a.q = dq.data();
    a.k = dk.data();
    a.v = dv.data();
    a.out = dout.data();
    a.n = n;
    a.n_q_heads = hq;
    a.n_kv_heads = hkv;
    a.head_dim = dim;
    a.scale = 1.0f / std::sqrt(static_cast<float>(dim));
    const double causal_pairs = static_cast<double>(n) * (n + 1) / 2.0 * hq;
    const double dense_flops = 4.0 * dim * causal_pairs;

    // Dense: check sampled rows against float64, then time.
    dout.fill_bytes(0xff);
    cuda::attention_prefill_dense(a, stream.handle());
    stream.synchronize();
    const std::vector<uint16_t> o_dense = cuda::to_host<uint16_t>(dout, pr.q.size());
    double max_row_err = 0.0;
    {
      const int rows[] = {0, 1, 63, 64, n / 3, n / 2 + 17, n - 2, n - 1};
      std::vector<double> ref;
      for (int qh : {0, hq * 13 / 32, hq - 1})  // 0, 13, 31 at 32 heads
        for (int i : rows) {
          reference_row(shape, pr, qh, i, ref);
          double num = 0, den = 0;
          for (int x = 0; x < dim; ++x) {
            const double g = f16_to_f32(o_dense[(static_cast<size_t>(qh) * n + i) * dim + x]);
            num += (g - ref[x]) * (g - ref[x]);
            den += ref[x] * ref[x];
          }
          max_row_err = std::max(max_row_err, std::sqrt(num / den));
        }
    }
    const bool dense_ok = max_row_err < 5e-3;
    std::vector<double> t_dense;
    cuda::EventTimer ev;
    for (int it = 0; it < warmup + iters; ++it) {
      ev.start(stream.handle());
      cuda::attention_prefill_dense(a, stream.handle());
      ev.stop(stream.handle());
      if (it >= warmup) t_dense.push_back(ev.elapsed_ms());
    }
    const double dense_ms = median(t_dense);
    std::printf("%7d %-12s %10.2f %9.1f %8s %8s %8s %8.2f %7.1f %8.1e%s\n", n, "dense", dense_ms,
                dense_flops / dense_ms * 1e-9, "", "", "", dense_ms, 100.0, max_row_err,
                dense_ok ? "" : "  CHECK FAILED");

    // FlexPrefill.
    cuda::FlexPrefillProbe probe(n, hq, hkv, dim, cfg.block_size);
    std::vector<double> t_probe, t_down, t_select, t_upload, t_attn, t_total;
    BlockSparseLayout lay;
    std::vector<flexprefill::HeadSelection> heads;
    for (int it = 0; it < warmup + iters; ++it) {
      stream.synchronize();
      const auto t0 = Clock::now();
      ev.start(stream.handle());
      probe.run(a, stream.handle());
      ev.stop(stream.handle());
      const double probe_ms = ev.elapsed_ms();
      const auto t1 = Clock::now();
      probe.download(stream.handle());
      const auto t2 = Clock::now();
      lay = cuda::flexprefill_select(cfg, probe, pool, &heads);
      const auto t3 = Clock::now();
      const cuda::DeviceBlockLayout dl = cuda::DeviceBlockLayout::upload(lay, n);
      const auto t4 = Clock::now();
      ev.start(stream.handle());
      cuda::attention_prefill_block_sparse(a, dl, stream.handle());
      ev.stop(stream.handle());
      const double attn_ms = ev.elapsed_ms();
      const auto t5 = Clock::now();
      auto ms = [](Clock::time_point x, Clock::time_point y) { return std::chrono::duration<double, std::milli>(y - x).count(); };
      if (it >= warmup) {
        t_probe.push_back(probe_ms);
        t_down.push_back(ms(t1, t2));
        t_select.push_back(ms(t2, t3));
        t_upload.push_back(ms(t3, t4));
        t_attn.push_back(attn_ms);
        t_total.push_back(ms(t0, t5));
      }
    }
    dout.fill_bytes(0xff);
    {
      const cuda::DeviceBlockLayout dl = cuda::DeviceBlockLayout::upload(lay, n);
      cuda::attention_prefill_block_sparse(a, dl, stream.handle());
      stream.synchronize();
    }
    const std::vector<uint16_t> o_flex = cuda::to_host<uint16_t>(dout, pr.q.size());
    const double err = rel_err(o_flex, o_dense, threads);
    // Computed (head, query block, key block) triples over causal ones; pairs in listed blocks.
    const int B = cfg.block_size, nqb = (n + B - 1) / B;
    double sparse_pairs = 0;
    for (int qh = 0; qh < hq; ++qh)
      for (int r = 0; r < nqb; ++r)
        for (int32_t c : lay.list(qh, r)) {
          const double rows = std::min(n, (r + 1) * B) - r * B;
          const double cols = std::min(n, (c + 1) * B) - c * B;
          sparse_pairs += c < r ? rows * cols : rows * (rows + 1) / 2;
        }
    const double causal_blocks = static_cast<double>(nqb) * (nqb + 1) / 2.0 * hq;
    const double share = static_cast<double>(lay.blocks.size()) / causal_blocks;
    int n_qa = 0, n_vs = 0, n_dense = 0;
    for (const auto& h : heads) {
      n_qa += h.pattern == flexprefill::Pattern::query_aware;
      n_vs += h.pattern == flexprefill::Pattern::vertical_slash;
      n_dense += h.pattern == flexprefill::Pattern::dense;
    }
    const double total_ms = median(t_total);
    std::printf("%7d %-12s %10.2f %9.1f %8.2f %8.2f %8.2f %8.2f %7.1f %8.1e   x%.2f vs dense; heads qa/vs/dense %d/%d/%d\n",
                n, "flexprefill", total_ms, 4.0 * dim * sparse_pairs / median(t_attn) * 1e-9, median(t_probe),
                median(t_select), median(t_down) + median(t_upload), median(t_attn), 100.0 * share, err,
                dense_ms / total_ms, n_qa, n_vs, n_dense);
    report["runs"].push_back({{"context", n},
                              {"generate_s", gen_s},
                              {"dense", {{"ms", dense_ms}, {"samples_ms", t_dense}, {"tflops", dense_flops / dense_ms * 1e-9},
                                         {"max_row_err_vs_f64", max_row_err}, {"checked", dense_ok}}},
                              {"flexprefill",
                               {{"ms_total", total_ms},
                                {"samples_total_ms", t_total},
                                {"ms_probe_gpu", median(t_probe)},
                                {"ms_download", median(t_down)},
                                {"ms_select_host", median(t_select)},
                                {"ms_upload", median(t_upload)},
                                {"ms_attention", median(t_attn)},
                                {"attention_tflops_effective", 4.0 * dim * sparse_pairs / median(t_attn) * 1e-9},
                                {"block_share", share},
                                {"pair_share", sparse_pairs / causal_pairs},
                                {"err_vs_dense", err},
                                {"heads_query_aware", n_qa},
                                {"heads_vertical_slash", n_vs},
                                {"heads_dense", n_dense},
                                {"speedup_vs_dense", dense_ms / total_ms},
                                {"attention_speedup_vs_dense", dense_ms / median(t_attn)}}}});
    std::fflush(stdout);
  }
  cumulus::file_write_atomic(json_path, report.dump(2) + "\n", "--json");
  std::printf("\nJSON: %s\n", json_path.c_str());
  return 0;
}
