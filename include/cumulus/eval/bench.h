// `cumulus bench`: every decode method on one synthetic workload (eval/synthetic.h), its
// accuracy against dense attention and its speed against the machine's read bandwidth,
// measured in the same run (docs/workload.md, docs/architecture.md "Performance rules").
//
// Per method: one untimed pass with ctx.eval = true gives tokens attended, K/V bytes read,
// true and claimed mass and ||o - o_dense|| / ||o_dense|| per (step, query head); then
// `warmup` untimed and `repeats` timed passes with ctx.eval = false over the same steps
// give the time per decode step (one step = every head of one layer), median over repeats.
// Each timed step starts from cold caches (an untimed sweep over a buffer twice the LLC),
// as in a model where the other layers' K/V pass through the LLC between two visits.
// Dense is always timed so that speedups are ratios from the same run. The workload's first
// 16 queries stand for the prompt's last positions and reach on_prefill as prompt_q.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/core/shape.h"
#include "cumulus/eval/membw.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/kv/kv_cache.h"

namespace cumulus {

// The workload's first queries stand for the prompt's last positions (methods that learn
// from the prompt's own attention get them in on_prefill); the decoded steps follow.
inline constexpr int kPromptQueryRows = 16;

struct BenchOptions {
  std::string shape = "llama3-8b";   // shape_preset name
  int context = 32768;               // tokens cached, [4096, 131072]
  std::vector<std::string> methods;  // empty: every decode method of Registry::builtin()
  // method -> key -> value, checked against the registry's spec; only for listed methods.
  std::map<std::string, std::map<std::string, std::string>> params;
  DType dtype = DType::f16;
  int threads = 2;     // [1, 256], the same for the methods and the bandwidth probe
  int steps = 8;       // decode queries, [1, 1024]
  int warmup = 1;      // untimed passes over the steps, [0, 100]
  int repeats = 3;     // timed passes over the steps, [1, 1000]
  uint64_t seed = 1;
  double concentration = 1.0;             // SyntheticOptions::concentration
  size_t membw_bytes = size_t{1} << 30;   // bandwidth probe buffer
  // Before every timed step, stream over this many bytes to push the K/V out of the
  // caches (0: no eviction, warm caches). Default: 2 x the LLC, in [64 MiB, 1 GiB].
  size_t evict_bytes = kEvictAuto;
  static constexpr size_t kEvictAuto = ~size_t{0};

  // Throws Error naming the first bad value (including unknown methods or parameters).
  void validate() const;
};

struct BenchMethodResult {
  std::string method;
  std::map<std::string, std::string> params;  // resolved, defaults filled in
  double prefill_ms = 0;        // on_prefill (index build), once
  double tokens_attended = 0;   // mean over (step, query head)
  double token_fraction = 0;    // tokens_attended / context
  double bytes_per_step = 0;    // K/V bytes read per step (all heads), mean over steps
  double bytes_fraction = 0;    // bytes_per_step / dense bytes per step
  // Mean over (step, query head) of the attended set's true mass; heads that bypass
  // attention (StepStats::bypass) have no set and are left out (bypass_fraction says how many).
  double mass_true = 0;
  double mass_true_min = 0;
  double bypass_fraction = 0;   // share of (step, query head) with StepStats::bypass
  double mass_claimed = 0;      // mean claim; NaN for methods that make none
  // Share of (step, query head) whose true mass reaches the method's target P (its
  // registry entry's target_param); NaN for methods that target none.
  double reached_p = 0;
  double rel_err = 0;           // mean over (step, query head) of ||o - o_dense|| / ||o_dense||
  double rel_err_max = 0;
  std::vector<double> ms;       // [repeats] mean ms per step of each timed pass
  double ms_median = 0, ms_min = 0;
  double gbps = 0;              // bytes_per_step / ms_median
  // Read bandwidth measured just before and just after this method's timing passes (the
  // larger of the two): on a virtual machine the bandwidth can change by 1.7x within one
  // run, so each method is compared with the bandwidth of its own moment.
  double bw_ref_gbps = 0;
  double bw_fraction = 0;       // gbps / bw_ref_gbps
  double speedup = 0;           // dense ms_median / ms_median
};

struct BenchMachine {
  std::string cpu;       // "model name" from /proc/cpuinfo
  int logical_cpus = 0;  // std::thread::hardware_concurrency
  std::string date;      // UTC, ISO 8601
  std::string compiler;
  std::string simd;      // the CPU kernels' SIMD target in use (kernels/simd.h simd_target_line)
  double load_average = -1;  // 1-minute load from /proc/loadavg at the start (-1: unknown)
};

struct BenchReport {
  BenchOptions options;
  // --device cuda (eval/cuda_bench.h): the GPU's name, and membw.gbps_median is its
  // device-to-device copy bandwidth (read + write); empty: the CPU run described above.
  std::string device;
  Shape shape;
  BenchMachine machine;
  MemBwResult membw;
  AttentionProfile profile;  // of the workload's queries (top-p 0.9)
  int n_sinks = 0, recent_window = 0;
  double dense_bytes_per_step = 0;
  double generate_s = 0;     // seconds to build the workload
  size_t llc_bytes = 0;      // as sysfs reports it (0: unknown)
  size_t evict_bytes = 0;    // swept before each timed step (0: warm caches)
  double total_s = 0;        // the whole run
  std::vector<BenchMethodResult> methods;
};

BenchMachine bench_machine();

// The benchmark's KV cache (one layer, options.dtype) and synthetic workload of
// kPromptQueryRows + options.steps queries, with its report fields (generate_s, n_sinks,
// recent_window, profile) filled in: the CPU run and `bench --device cuda` share it.
struct BenchWorkload {
  KvCache kv;
  SyntheticWorkload w;
};
BenchWorkload bench_workload(const BenchOptions& options, ThreadPool& pool, BenchReport& report);

// The 1-minute load average from /proc/loadavg (-1: unknown). Benchmarks print it before
// and after their timings: other processes on the machine distort both.
double load_average();

// Runs the benchmark. Progress lines go to `log` when it is not null.
BenchReport bench_run(const BenchOptions& options, std::FILE* log = nullptr);

// Human-readable table (fmt) and machine-readable JSON of a report.
std::string bench_table(const BenchReport& report);
std::string bench_json(const BenchReport& report);

}  // namespace cumulus
