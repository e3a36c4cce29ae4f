// Decode attention benchmark: achieved read bandwidth of the dense and sparse kernels
// against the machine's read bandwidth measured in the same run (a multi-threaded sum over
// a 1 GiB buffer with the same thread count). Decode attention is memory-bound, so the
// figure of merit is GB/s of K/V read as a share of that bandwidth.
//
// Pages are built here (one slab per kv head and K/V, carved into pages that the page
// table visits in address order, as the KV cache allocates them for one sequence, or in a
// shuffled order, as a cache that reuses pages would). Sparse lists are random tokens or
// whole random pages, 2K-8K per kv head. Every timed run starts from cold caches (twice
// the last-level cache read, not written, before it: CacheEvictor, as in `cumulus bench`).
// Each row gives the median run and the fastest, as a share of the read bandwidth
// measured (MemBwProbe) just before and just after that row, the larger of the two;
// the run's first and last measurements are printed too. Sparse rows also give the time of
// touching the same rows without computing (touch_rows), the access pattern's ceiling.
//
// usage: attention_bench [--threads 2] [--tokens 32768] [--reps 20] [--json FILE] [--quick]
#include <hwy/targets.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cumulus/kernels/simd.h"
#include "cumulus/core/buffer.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/file.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/bench.h"
#include "cumulus/eval/membw.h"
#include "cumulus/kernels/attention.h"
#include "kernels/cpu/prefetch.h"

using namespace cumulus;
using Clock = std::chrono::steady_clock;

namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Slab = std::unique_ptr<uint8_t, FreeDeleter>;

// As the KV cache allocates its page slabs (huge pages where large enough).
Slab alloc_slab(size_t bytes) { return Slab(static_cast<uint8_t*>(alloc_large(bytes))); }

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Timing {
  double median = 0, min = 0;  // seconds
};

// Median and fastest of fn over reps runs after warmup runs, the caches swept (read-only,
// by the library's CacheEvictor) before each, so every run reads its K/V from memory. The
// fastest run is what the kernel does when nothing else on the machine competes for
// memory; the median is the figure of record.
template <class Fn>
Timing time_runs(CacheEvictor& evictor, Fn&& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    evictor.run();
    const auto t0 = Clock::now();
    fn();
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  const size_t n = t.size();
  return {n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]), t.front()};
}

// One layer of a paged cache: [n_kv][n_pages] pages of [page_size][head_dim] in dtype.
struct BenchCache {
  std::vector<Slab> k_slabs, v_slabs;
  std::vector<std::vector<const void*>> k_ptrs, v_ptrs;
  std::vector<PagedHeadView> views;
};

BenchCache make_cache(int n_kv, int n_tokens, int head_dim, DType dt, int page_size, bool shuffle_pages,
                      std::mt19937& rng) {
  BenchCache c;
  const size_t row = static_cast<size_t>(head_dim) * dtype_size(dt);
  const int n_pages = (n_tokens + page_size - 1) / page_size;
  const size_t page_bytes = row * page_size;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> tmp(static_cast<size_t>(page_size) * head_dim);
  int shift = 0;
  while ((1 << shift) < page_size) ++shift;
  for (int h = 0; h < n_kv; ++h) {
    c.k_slabs.push_back(alloc_slab(page_bytes * n_pages));
    c.v_slabs.push_back(alloc_slab(page_bytes * n_pages));
    std::vector<int> order(n_pages);
    std::iota(order.begin(), order.end(), 0);
    if (shuffle_pages) std::shuffle(order.begin(), order.end(), rng);
    std::vector<const void*> kp(n_pages), vp(n_pages);
    for (int p = 0; p < n_pages; ++p) {
      uint8_t* k = c.k_slabs.back().get() + page_bytes * order[p];
      uint8_t* v = c.v_slabs.back().get() + page_bytes * order[p];
      for (auto& x : tmp) x = nd(rng);
      convert_from_f32(tmp.data(), k, dt, tmp.size());
      for (auto& x : tmp) x = nd(rng);
      convert_from_f32(tmp.data(), v, dt, tmp.size());
      kp[p] = k;
      vp[p] = v;
    }
    c.k_ptrs.push_back(std::move(kp));
    c.v_ptrs.push_back(std::move(vp));
  }
  for (int h = 0; h < n_kv; ++h) {
    PagedHeadView v;
    v.k_pages = c.k_ptrs[h].data();
    v.v_pages = c.v_ptrs[h].data();
    v.n_tokens = n_tokens;
    v.head_dim = head_dim;
    v.page_size = page_size;
    v.page_shift = shift;
    v.dtype = dt;
    c.views.push_back(v);
  }
  return c;
}

// The access pattern's own ceiling for a sparse list: one 8-byte load from every 64-byte
// line of the K and V rows the list names, with the next rows prefetched into L2 32 tokens
// ahead as the kernel does, and no arithmetic. Same task split as the kernel (1024 list
// entries per task). How fast a machine fetches scattered rows depends on its TLB and
// page walks as much as on its bandwidth; a kernel near this time is bound by the pattern.
void touch_rows(const BenchCache& c, const Selection& sel, size_t row_bytes, ThreadPool& pool) {
  struct Task {
    int head, begin, end;
  };
  std::vector<Task> tasks;
  for (int h = 0; h < static_cast<int>(sel.tokens.size()); ++h)
    for (int b = 0; b < static_cast<int>(sel.tokens[h].size()); b += 1024)
      tasks.push_back({h, b, std::min<int>(static_cast<int>(sel.tokens[h].size()), b + 1024)});
  std::vector<uint64_t> sums(tasks.size());
  pool.parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t t, int) {
    const Task& task = tasks[static_cast<size_t>(t)];
    const PagedHeadView& v = c.views[static_cast<size_t>(task.head)];
    const std::vector<int32_t>& idx = sel.tokens[static_cast<size_t>(task.head)];
    constexpr int kAhead = 32;
    uint64_t s = 0;
    for (int i = task.begin; i < task.end; ++i) {
      if (i + kAhead < task.end) {
        const char* k = static_cast<const char*>(v.key(idx[i + kAhead]));
        const char* vv = static_cast<const char*>(v.value(idx[i + kAhead]));
        for (size_t off = 0; off < row_bytes; off += 64) {
          cpu::prefetch_l2(k + off);
          cpu::prefetch_l2(vv + off);
        }
      }
      const char* k = static_cast<const char*>(v.key(idx[i]));
      const char* vv = static_cast<const char*>(v.value(idx[i]));
      for (size_t off = 0; off < row_bytes; off += 64) {
        uint64_t a, b;
        std::memcpy(&a, k + off, sizeof a);
        std::memcpy(&b, vv + off, sizeof b);
        s += a ^ b;
      }
    }
    sums[static_cast<size_t>(t)] = s;
  });
  volatile uint64_t keep = 0;
  for (uint64_t x : sums) keep = keep + x;
}

struct Row {
  std::string kernel, dtype, layout;
  int n_q = 0, n_kv = 0, head_dim = 0, tokens = 0;
  double tokens_per_head = 0.0;
  double bytes = 0.0, ms = 0.0, gbs = 0.0, pct = 0.0;  // at the median
  double ms_min = 0.0, pct_min = 0.0;                  // at the fastest run
  double bw = 0.0;  // read bandwidth the shares are taken against (GB/s)
  double touch_ms = 0.0;  // sparse rows: median of touch_rows over the same list
};

}  // namespace

int main(int argc, char** argv) {
  try {
    cumulus::cpu::simd_select_from_env();  // CUMULUS_SIMD caps the SIMD target (kernels/simd.h)
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  int threads = 2, n_tokens = 32768, reps = 20;
  bool quick = false;
  std::string json_path = "attention_bench.json";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "attention_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--threads") threads = std::stoi(next());
    else if (a == "--tokens") n_tokens = std::stoi(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--json") json_path = next();
    else if (a == "--quick") quick = true;
    else {
      std::fprintf(stderr, "usage: attention_bench [--threads N] [--tokens N] [--reps N] [--json FILE] [--quick]\n");
      return 2;
    }
  }
  if (quick) reps = 5;

  const BenchMachine machine = bench_machine();
  const char* target = hwy::TargetName(hwy::SupportedAndGeneratedTargets().front());
  ThreadPool pool(threads);
  std::printf("machine: %s, %d hardware threads; SIMD target %s; %d threads\n", machine.cpu.c_str(),
              machine.logical_cpus, target, threads);

  // Other processes on the machine distort both numbers; the load average says how much.
  MemBwProbe probe(pool, size_t{1} << 30);
  const int bw_repeats = quick ? 3 : 7;
  const MemBwResult bw_before = probe.measure(1, bw_repeats);
  const double bw = bw_before.gbps_median;
  std::printf("load average %.2f; read bandwidth (sum over 1 GiB, %d threads, median of %d): %.2f GB/s\n\n",
              machine.load_average, threads, bw_repeats, bw);
  // Twice the last-level cache, read before every timed run.
  CacheEvictor evictor(std::clamp<size_t>(2 * llc_bytes(), size_t{64} << 20, size_t{1} << 30), pool);

  std::mt19937 rng(2024);
  std::vector<Row> rows;
  const int n_q = 32, n_kv = 8, dim = 128, page_size = 16;  // llama3-8b attention shape
  std::vector<float> q(static_cast<size_t>(n_q) * dim);
  {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : q) x = nd(rng);
  }
  std::vector<float> out(q.size()), lse(n_q);
  DecodeAttnArgs args;
  args.n_kv_heads = n_kv;
  args.group = n_q / n_kv;
  args.scale = 1.0f / std::sqrt(static_cast<float>(dim));
  args.q = q.data();
  args.out = out.data();
  args.lse = lse.data();
  AttentionWorkspace workspace;  // the partials reused from run to run, as a Session does
  args.workspace = &workspace;

  // Each row's share is taken against the read bandwidth measured just before and just
  // after its timed runs, the larger of the two (so a share is never overstated): on a
  // virtual machine the bandwidth can change by 1.7x within a run (docs/lab/performance-log.md),
  // and one figure for the whole run would compare rows with the wrong one.
  auto add_row = [&](Row r, auto&& kernel, int warmup, int row_reps) {
    const double bw0 = probe.measure(0, 3).gbps_median;
    const Timing t = time_runs(evictor, kernel, warmup, row_reps);
    const double bw1 = probe.measure(0, 3).gbps_median;
    r.bw = std::max(bw0, bw1);
    r.ms = t.median * 1e3;
    r.gbs = r.bytes / t.median / 1e9;
    r.pct = 100.0 * r.gbs / r.bw;
    r.ms_min = t.min * 1e3;
    r.pct_min = 100.0 * r.bytes / t.min / 1e9 / r.bw;
    rows.push_back(r);
    std::printf("%-7s %-5s %-24s %6.0f tok/head  %8.3f ms/step  %7.2f GB/s  %5.1f%% of %5.1f GB/s  (fastest %5.1f%%)",
                r.kernel.c_str(), r.dtype.c_str(), r.layout.c_str(), r.tokens_per_head, r.ms, r.gbs, r.pct, r.bw,
                r.pct_min);
    if (r.touch_ms > 0) std::printf("  touch-only %.3f ms", r.touch_ms);
    std::printf("\n");
    std::fflush(stdout);
  };


  const std::vector<DType> dtypes = quick ? std::vector<DType>{DType::f16}
                                          : std::vector<DType>{DType::f16, DType::bf16, DType::f32};
  for (DType dt : dtypes) {
    for (bool shuffled : {false, true}) {
      if (shuffled && dt != DType::f16) continue;
      BenchCache c = make_cache(n_kv, n_tokens, dim, dt, page_size, shuffled, rng);
      args.kv = c.views.data();
      const double row_bytes = static_cast<double>(dim) * dtype_size(dt);

      Row r;
      r.kernel = "dense";
      r.dtype = std::string(dtype_name(dt));
      r.layout = shuffled ? "pages shuffled" : "pages in order";
      r.n_q = n_q;
      r.n_kv = n_kv;
      r.head_dim = dim;
      r.tokens = n_tokens;
      r.tokens_per_head = n_tokens;
      r.bytes = 2.0 * row_bytes * n_kv * n_tokens;
      add_row(r, [&] { cpu::attention_decode_dense(args, pool); }, 3, reps);

      if (dt != DType::f16) continue;
      // Sparse: per kv head, lists of n_sel tokens, either uniformly random tokens or
      // whole random pages (what page-level selectors such as Quest produce).
      for (int n_sel : {2048, 4096, 8192}) {
        if (n_sel > n_tokens) continue;
        for (bool whole_pages : {false, true}) {
          Selection sel;
          for (int h = 0; h < n_kv; ++h) {
            std::vector<int32_t> idx;
            if (whole_pages) {
              std::vector<int32_t> pages(n_tokens / page_size);
              std::iota(pages.begin(), pages.end(), 0);
              std::shuffle(pages.begin(), pages.end(), rng);
              pages.resize(n_sel / page_size);
              std::sort(pages.begin(), pages.end());
              for (int32_t p : pages)
                for (int i = 0; i < page_size; ++i) idx.push_back(p * page_size + i);
            } else {
              std::vector<int32_t> all(n_tokens);
              std::iota(all.begin(), all.end(), 0);
              std::shuffle(all.begin(), all.end(), rng);
              all.resize(n_sel);
              std::sort(all.begin(), all.end());
              idx = std::move(all);
            }
            sel.tokens.push_back(std::move(idx));
          }
          Row s = r;
          s.kernel = "sparse";
          s.layout =
              std::string(whole_pages ? "whole pages" : "random tokens") + (shuffled ? ", shuffled" : ", in order");
          s.tokens_per_head = n_sel;
          s.bytes = 2.0 * row_bytes * static_cast<double>(sel.total());
          const auto touch = [&] { touch_rows(c, sel, static_cast<size_t>(row_bytes), pool); };
          s.touch_ms = time_runs(evictor, touch, 3, reps * 4).median * 1e3;
          add_row(s, [&] { cpu::attention_decode_sparse(args, sel, pool); }, 3, reps * 4);
        }
      }
    }
  }

  // Bandwidth again after the kernels: a large change means the machine was not quiet.
  const double bw_after = probe.measure(1, bw_repeats).gbps_median;
  const double load_after = load_average();
  std::printf("\nread bandwidth measured again after the kernels: %.2f GB/s (load average %.2f)\n", bw_after,
              load_after);

  nlohmann::json j;
  j["machine"] = {{"cpu", machine.cpu}, {"hardware_threads", machine.logical_cpus}, {"simd_target", target}};
  j["threads"] = threads;
  j["read_bandwidth_gbs"] = bw;
  j["read_bandwidth_samples_gbs"] = bw_before.gbps;
  j["read_bandwidth_after_gbs"] = bw_after;
  j["load_average_before"] = machine.load_average;
  j["load_average_after"] = load_after;
  j["shape"] = {{"n_q_heads", n_q}, {"n_kv_heads", n_kv}, {"head_dim", dim}, {"page_size", page_size}};
  for (const Row& r : rows)
    j["rows"].push_back({{"kernel", r.kernel},
                         {"dtype", r.dtype},
                         {"layout", r.layout},
                         {"cache_tokens", r.tokens},
                         {"tokens_per_kv_head", r.tokens_per_head},
                         {"bytes", r.bytes},
                         {"ms_per_step", r.ms},
                         {"read_bandwidth_gbs", r.bw},
                         {"gbs", r.gbs},
                         {"pct_of_read_bw", r.pct},
                         {"ms_per_step_fastest", r.ms_min},
                         {"touch_only_ms", r.touch_ms > 0 ? nlohmann::json(r.touch_ms) : nlohmann::json(nullptr)},
                         {"pct_of_read_bw_fastest", r.pct_min}});
  cumulus::file_write_atomic(json_path, j.dump(2) + "\n", "--json");
  std::printf("\nwrote %s\n", json_path.c_str());
  return 0;
}
