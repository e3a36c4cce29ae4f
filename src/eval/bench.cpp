// The decode benchmark behind `cumulus bench` (include/cumulus/eval/bench.h): builds the
// synthetic workload, measures the machine's read bandwidth with the same thread pool,
// then runs every method once in eval mode (accuracy) and repeatedly without it (time),
// measuring the bandwidth again right before and after each method's timing passes.
#include "cumulus/eval/bench.h"
#include "cumulus/eval/method_spec.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/check.h"
#include "cumulus/kernels/simd.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/method.h"
#include "cumulus/methods/registry.h"

namespace cumulus {

namespace {

using Clock = std::chrono::steady_clock;


double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// The methods to run: the listed ones (or every decode method), with dense first so that
// every speedup has its reference in the same run.
std::vector<std::string> bench_method_names(const BenchOptions& o) {
  std::vector<std::string> names = o.methods;
  if (names.empty())
    for (const auto& m : Registry::builtin().list())
      if (m.make_decode) names.push_back(m.name);
  auto it = std::find(names.begin(), names.end(), "dense");
  if (it != names.end()) names.erase(it);
  names.insert(names.begin(), "dense");
  return names;
}

void log_line(std::FILE* log, const std::string& s) {
  if (log == nullptr) return;
  fmt::print(log, "{}\n", s);
  std::fflush(log);
}

std::string params_commas(const std::map<std::string, std::string>& p) {
  std::string s;
  for (const auto& [k, v] : p) s += (s.empty() ? "" : ",") + k + "=" + v;
  return s;
}

}  // namespace

void BenchOptions::validate() const {
  const Shape workload_shape = shape_preset(shape);
  CUMULUS_CHECK(context >= 4096 && context <= 131072, "context={} must be in [4096, 131072]", context);
  CUMULUS_CHECK(threads >= 1 && threads <= 256, "threads={} must be in [1, 256]", threads);
  CUMULUS_CHECK(steps >= 1 && steps <= 1024, "steps={} must be in [1, 1024]", steps);
  CUMULUS_CHECK(warmup >= 0 && warmup <= 100, "warmup={} must be in [0, 100]", warmup);
  CUMULUS_CHECK(repeats >= 1 && repeats <= 1000, "repeats={} must be in [1, 1000]", repeats);
  CUMULUS_CHECK(std::isfinite(concentration) && concentration > 0 && concentration <= 16,
                "concentration={} must be in (0, 16]", concentration);
  CUMULUS_CHECK(membw_bytes >= (size_t{64} << 20), "membw_bytes={} must be >= 64 MiB", membw_bytes);
  const Registry& reg = Registry::builtin();
  for (size_t i = 0; i < methods.size(); ++i) {
    const MethodInfo& m = reg.find(methods[i]);  // throws listing the known names
    CUMULUS_CHECK(m.make_decode != nullptr, "method '{}' is a {} method, not a decode method", m.name,
                  method_kind_name(m.kind));
    for (size_t j = 0; j < i; ++j) CUMULUS_CHECK(methods[j] != methods[i], "method '{}' listed twice", methods[i]);
  }
  const std::vector<std::string> names = bench_method_names(*this);
  for (const auto& [method, kv] : params) {
    CUMULUS_CHECK(std::find(names.begin(), names.end(), method) != names.end(),
                  "--param for method '{}', which is not benchmarked (methods: {})", method, fmt::join(names, ","));
    // Unknown key, bad value, broken relation: Error naming method, key and value.
    reg.check(method, kv, &workload_shape);
  }
}

double load_average() {
  std::ifstream f("/proc/loadavg");
  double l = -1;
  if (!(f >> l)) l = -1;
  return l;
}

BenchMachine bench_machine() {
  BenchMachine m;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) m.cpu = line.substr(line.find_first_not_of(" \t", colon + 1));
      break;
    }
  }
  if (m.cpu.empty()) m.cpu = "unknown";
  m.logical_cpus = static_cast<int>(std::thread::hardware_concurrency());
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  m.date = buf;
  m.load_average = load_average();
  m.simd = cpu::simd_target_line();
#if defined(__VERSION__)
  m.compiler = __VERSION__;
#endif
  return m;
}

BenchWorkload bench_workload(const BenchOptions& o, ThreadPool& pool, BenchReport& rep) {
  const auto t_gen = Clock::now();
  const Shape s = shape_preset(o.shape);
  KvCacheOptions kvo;
  kvo.dtype = o.dtype;
  kvo.max_tokens = o.context;
  KvCache kv(s, kvo);
  SyntheticOptions so;
  so.shape = s;
  so.n_tokens = o.context;
  // The first kPromptQueryRows queries stand for the prompt's last positions (methods that
  // learn from the prompt's own attention get them in on_prefill); the rest are decoded.
  so.n_steps = kPromptQueryRows + o.steps;
  so.seed = o.seed;
  so.concentration = o.concentration;
  SyntheticWorkload w = synthetic_generate(so, kv, pool);
  rep.generate_s = seconds_since(t_gen);
  rep.n_sinks = so.n_sinks;
  rep.recent_window = so.recent_window;
  rep.profile = attention_profile(kv, w, 0, 0.9, pool);
  return {std::move(kv), std::move(w)};
}

BenchReport bench_run(const BenchOptions& o, std::FILE* log) {
  const auto t_start = Clock::now();
  o.validate();
  BenchReport rep;
  rep.options = o;
  rep.shape = shape_preset(o.shape);
  rep.machine = bench_machine();
  const Shape& s = rep.shape;
  ThreadPool pool(o.threads);

  // Bandwidth first, while the workload does not yet hold memory; the probe stays for the
  // per-method references below.
  MemBwProbe probe(pool, o.membw_bytes);
  rep.membw = probe.measure();
  log_line(log, fmt::format("read bandwidth: {:.1f} GB/s ({} threads, {} MiB buffer)", rep.membw.gbps_median,
                            rep.membw.threads, rep.membw.bytes >> 20));

  const BenchWorkload bw = bench_workload(o, pool, rep);
  const KvCache& kv = bw.kv;
  const SyntheticWorkload& w = bw.w;
  log_line(log, fmt::format("workload: {} tokens x {} steps in {:.1f} s", o.context, o.steps, rep.generate_s));

  rep.llc_bytes = llc_bytes();
  rep.evict_bytes = o.evict_bytes;
  if (rep.evict_bytes == BenchOptions::kEvictAuto)
    rep.evict_bytes = std::clamp<size_t>(2 * rep.llc_bytes, size_t{64} << 20, size_t{1} << 30);
  std::unique_ptr<CacheEvictor> evictor;
  if (rep.evict_bytes > 0) evictor = std::make_unique<CacheEvictor>(rep.evict_bytes, pool);

  const int n_q = s.n_q_heads;
  const int d = s.head_dim;
  rep.dense_bytes_per_step = static_cast<double>(o.context) * s.n_kv_heads * kv.bytes_per_token_head();

  // ||o_dense|| per (step, query head), the denominator of the relative error.
  std::vector<double> dense_norm(static_cast<size_t>(o.steps) * n_q);
  {
    auto dense = Registry::builtin().make("dense", s);
    AttentionWorkspace attention;
    DecodeContext ctx{.pool = &pool, .eval = false, .attention = &attention};
    AttnOutput out;
    for (int step = 0; step < o.steps; ++step) {
      decode_step(*dense, 0, w.query(0, kPromptQueryRows + step), kv, ctx, out);
      for (int h = 0; h < n_q; ++h) {
        double n2 = 0;
        for (int i = 0; i < d; ++i) n2 += static_cast<double>(out.out[h * d + i]) * out.out[h * d + i];
        dense_norm[static_cast<size_t>(step) * n_q + h] = std::sqrt(n2);
      }
    }
  }

  const Registry& reg = Registry::builtin();
  for (const std::string& name : bench_method_names(o)) {
    BenchMethodResult r;
    r.method = name;
    const auto pit = o.params.find(name);
    const std::map<std::string, std::string> overrides = pit == o.params.end() ? std::map<std::string, std::string>{}
                                                                               : pit->second;
    r.params = reg.parse(name, overrides).values();
    auto method = reg.make(name, s, overrides);

    AttentionWorkspace attention;
    DecodeContext ctx{.pool = &pool, .eval = false, .attention = &attention};
    DecodeContext prefill_ctx{.pool = &pool, .eval = false, .prompt_q = w.query(0, 0), .prompt_q_rows = kPromptQueryRows};
    const auto t_pre = Clock::now();
    method->on_prefill(0, kv, prefill_ctx);
    r.prefill_ms = seconds_since(t_pre) * 1e3;

    // Accuracy pass.
    AttnOutput out;
    DecodeContext eval_ctx{.pool = &pool, .eval = true, .attention = &attention};
    double tokens = 0, bytes = 0, mass = 0, claimed = 0, err = 0;
    int n_mass = 0, n_bypass = 0, n_reached = 0;
    const double target = method_target(name, r.params);
    r.mass_true_min = std::numeric_limits<double>::infinity();
    r.rel_err_max = 0;
    bool claims = true;
    for (int step = 0; step < o.steps; ++step) {
      decode_step(*method, 0, w.query(0, kPromptQueryRows + step), kv, eval_ctx, out);
      for (int h = 0; h < n_q; ++h) {
        const StepStats& st = out.stats[h];
        const double rel = st.out_err / std::max(dense_norm[static_cast<size_t>(step) * n_q + h], 1e-30);
        tokens += st.tokens_attended;
        bytes += st.bytes_read;
        err += rel;
        if (st.bypass || std::isnan(st.mass_true)) {
          ++n_bypass;  // no attended set whose mass could be checked
        } else {
          mass += st.mass_true;
          ++n_mass;
          n_reached += st.mass_true >= target ? 1 : 0;
          r.mass_true_min = std::min(r.mass_true_min, st.mass_true);
        }
        r.rel_err_max = std::max(r.rel_err_max, rel);
        if (!st.bypass) {
          if (std::isnan(st.mass_claimed)) claims = false;
          claimed += st.mass_claimed;
        }
      }
    }
    const double head_steps = static_cast<double>(o.steps) * n_q;
    r.tokens_attended = tokens / head_steps;
    r.token_fraction = r.tokens_attended / o.context;
    r.bytes_per_step = bytes / o.steps;
    r.bytes_fraction = r.bytes_per_step / rep.dense_bytes_per_step;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    r.bypass_fraction = n_bypass / head_steps;
    r.mass_true = n_mass > 0 ? mass / n_mass : nan;
    r.reached_p = std::isnan(target) || n_mass == 0 ? nan : static_cast<double>(n_reached) / n_mass;
    if (n_mass == 0) r.mass_true_min = nan;
    r.mass_claimed = claims && n_mass > 0 ? claimed / (head_steps - n_bypass) : nan;
    r.rel_err = err / head_steps;

    // Timing passes: each step timed on its own, after the caches were swept; the read
    // bandwidth measured right before and right after them is this method's reference.
    const double bw_before = probe.measure(0, 3).gbps_median;
    for (int pass = 0; pass < o.warmup + o.repeats; ++pass) {
      double total = 0;
      for (int step = 0; step < o.steps; ++step) {
        if (evictor) evictor->run();
        const auto t0 = Clock::now();
        decode_step(*method, 0, w.query(0, kPromptQueryRows + step), kv, ctx, out);
        total += seconds_since(t0);
      }
      if (pass >= o.warmup) r.ms.push_back(total * 1e3 / o.steps);
    }
    r.ms_median = median(r.ms);
    r.ms_min = *std::min_element(r.ms.begin(), r.ms.end());
    r.gbps = r.bytes_per_step / (r.ms_median * 1e-3) * 1e-9;
    r.bw_ref_gbps = std::max(bw_before, probe.measure(0, 3).gbps_median);
    r.bw_fraction = r.gbps / r.bw_ref_gbps;
    rep.methods.push_back(std::move(r));
    log_line(log, fmt::format("{}: prefill {:.1f} ms, {:.3f} ms/step ({:.1f} s since start)", name,
                              rep.methods.back().prefill_ms, rep.methods.back().ms_median, seconds_since(t_start)));
  }
  const double dense_ms = rep.methods.front().ms_median;
  for (auto& r : rep.methods) r.speedup = dense_ms / r.ms_median;
  rep.total_s = seconds_since(t_start);
  return rep;
}

std::string bench_table(const BenchReport& rep) {
  const BenchOptions& o = rep.options;
  const Shape& s = rep.shape;
  const AttentionProfile& p = rep.profile;
  std::string t;
  t += fmt::format("cumulus bench: {} ({} q heads, {} kv heads, head_dim {}), context {}, {} KV, {} steps x {} repeats "
                   "(+{} warm-up), {} threads\n",
                   o.shape, s.n_q_heads, s.n_kv_heads, s.head_dim, o.context, dtype_name(o.dtype), o.steps, o.repeats,
                   o.warmup, o.threads);
  if (!rep.device.empty()) {
    t += fmt::format("device:   {}, {}\n", rep.device, rep.machine.date);
    t += fmt::format("memory:   device-to-device copy {:.0f} GB/s (read + write, median of 20 x 1 GiB); {} MiB written "
                     "before each timed step to flush the L2\n",
                     rep.membw.gbps_median, rep.evict_bytes >> 20);
  } else {
    t += fmt::format("machine:  {} ({} logical CPUs), SIMD {}, load average {:.2f}, {}\n", rep.machine.cpu,
                     rep.machine.logical_cpus, rep.machine.simd, rep.machine.load_average, rep.machine.date);
    t += fmt::format("memory:   read bandwidth {:.1f} GB/s (best median of plain and prefetching sums, {} passes, {} MiB, {} threads); LLC {} MiB; {}\n",
                     rep.membw.gbps_median, rep.membw.gbps.size(), rep.membw.bytes >> 20, rep.membw.threads,
                     rep.llc_bytes >> 20,
                     rep.evict_bytes > 0 ? fmt::format("{} MiB swept before each timed step", rep.evict_bytes >> 20)
                                         : std::string("warm caches"));
  }
  t += fmt::format("workload: seed {}, concentration {}; {} sinks hold {:.1f}% of the mass, the last {} tokens "
                   "{:.1f}%; top-p {} needs {:.2f}% of tokens (p10 {:.2f}%, p50 {:.2f}%, p90 {:.2f}%)\n\n",
                   o.seed, o.concentration, rep.n_sinks, 100 * p.sink_mass, rep.recent_window, 100 * p.recent_mass,
                   p.topp, 100 * p.topp_fraction, 100 * p.topp_fraction_p10, 100 * p.topp_fraction_p50,
                   100 * p.topp_fraction_p90);
  t += fmt::format("{:<12} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6} {:>8} {:>10}\n",
                   "method", "tokens", "tokens%", "KV read%", "mass", "claimed", ">=P", "rel err", "max err", "ms/step",
                   "GB/s", "ref", "%bw", "speedup", "prefill ms");
  for (const auto& r : rep.methods) {
    const std::string claimed = std::isnan(r.mass_claimed) ? "-" : fmt::format("{:.4f}", r.mass_claimed);
    const std::string reached = std::isnan(r.reached_p) ? "-" : fmt::format("{:.1f}%", 100 * r.reached_p);
    t += fmt::format("{:<12} {:>8.0f} {:>8.2f} {:>8.2f} {:>9.4f} {:>9} {:>8} {:>9.2e} {:>9.2e} {:>9.3f} {:>7.1f} {:>7.1f} "
                     "{:>5.0f}% {:>7.2f}x {:>10.1f}\n",
                     r.method, r.tokens_attended, 100 * r.token_fraction, 100 * r.bytes_fraction, r.mass_true, claimed,
                     reached, r.rel_err, r.rel_err_max, r.ms_median, r.gbps, r.bw_ref_gbps, 100 * r.bw_fraction,
                     r.speedup, r.prefill_ms);
  }
  t += "\nparameters:\n";
  for (const auto& r : rep.methods)
    if (!r.params.empty()) t += fmt::format("  {:<12} {}\n", r.method, params_commas(r.params));
  t += "\nmass: true softmax mass of the attended set (mean over step x query head); claimed: the method's own\n"
       "claim (- = none); >=P: share of step x query head whose true mass reaches the method's target (- = none); rel err: ||o - o_dense|| / ||o_dense||; ms/step: median over repeats of one decode\n"
       "step (all heads of one layer), caches swept before each; GB/s: K/V bytes read / time; ref: ";
  t += rep.device.empty() ? "read\nbandwidth measured just before and just after the method's timing (the larger); %bw: GB/s / ref;\n"
                            "prefill ms: on_prefill (index build) once, not in ms/step.\n"
                          : "the\ndevice-to-device copy bandwidth; %bw: GB/s / ref; prefill ms: the GPU pipeline's index build "
                            "(prefill()) once,\nnot in ms/step; ms/step: select + attend between CUDA events.\n";
  t += fmt::format("total {:.1f} s (workload {:.1f} s)\n", rep.total_s, rep.generate_s);
  return t;
}

std::string bench_json(const BenchReport& rep) {
  using nlohmann::json;
  const BenchOptions& o = rep.options;
  const AttentionProfile& p = rep.profile;
  json j;
  if (!rep.device.empty()) j["device"] = {{"name", rep.device}, {"copy_bandwidth_gbps", rep.membw.gbps_median}};
  j["machine"] = {{"cpu", rep.machine.cpu},
                  {"logical_cpus", rep.machine.logical_cpus},
                  {"threads", o.threads},
                  {"date", rep.machine.date},
                  {"compiler", rep.machine.compiler},
                  {"simd", rep.machine.simd},
                  {"read_bandwidth_gbps", rep.membw.gbps_median},
                  {"read_bandwidth_gbps_max", rep.membw.gbps_max},
                  {"read_bandwidth_samples_gbps", rep.membw.gbps},
                  {"read_bandwidth_plain_samples_gbps", rep.membw.gbps_plain},
                  {"read_bandwidth_prefetch_samples_gbps", rep.membw.gbps_prefetch},
                  {"load_average", rep.machine.load_average},
                  {"read_bandwidth_buffer_bytes", rep.membw.bytes}};
  j["workload"] = {{"shape", o.shape},
                   {"n_q_heads", rep.shape.n_q_heads},
                   {"n_kv_heads", rep.shape.n_kv_heads},
                   {"head_dim", rep.shape.head_dim},
                   {"context", o.context},
                   {"dtype", std::string(dtype_name(o.dtype))},
                   {"steps", o.steps},
                   {"prompt_query_rows", kPromptQueryRows},
                   {"warmup", o.warmup},
                   {"repeats", o.repeats},
                   {"seed", o.seed},
                   {"concentration", o.concentration},
                   {"generate_s", rep.generate_s},
                   {"total_s", rep.total_s},
                   {"llc_bytes", rep.llc_bytes},
                   {"evict_bytes", rep.evict_bytes},
                   {"dense_bytes_per_step", rep.dense_bytes_per_step},
                   {"n_sinks", rep.n_sinks},
                   {"recent_window", rep.recent_window},
                   {"sink_mass", p.sink_mass},
                   {"recent_mass", p.recent_mass},
                   {"topp", p.topp},
                   {"topp_fraction_mean", p.topp_fraction},
                   {"topp_fraction_p10", p.topp_fraction_p10},
                   {"topp_fraction_p50", p.topp_fraction_p50},
                   {"topp_fraction_p90", p.topp_fraction_p90}};
  json methods = json::array();
  for (const auto& r : rep.methods) {
    // NaN (no claim) is written as null.
    methods.push_back({{"method", r.method},
                       {"params", r.params},
                       {"prefill_ms", r.prefill_ms},
                       {"tokens_attended", r.tokens_attended},
                       {"token_fraction", r.token_fraction},
                       {"bytes_per_step", r.bytes_per_step},
                       {"bytes_fraction", r.bytes_fraction},
                       {"mass_true", std::isnan(r.mass_true) ? json(nullptr) : json(r.mass_true)},
                       {"mass_true_min", std::isnan(r.mass_true_min) ? json(nullptr) : json(r.mass_true_min)},
                       {"bypass_fraction", r.bypass_fraction},
                       {"mass_claimed", std::isnan(r.mass_claimed) ? json(nullptr) : json(r.mass_claimed)},
                       {"reached_p", std::isnan(r.reached_p) ? json(nullptr) : json(r.reached_p)},
                       {"rel_err", r.rel_err},
                       {"rel_err_max", r.rel_err_max},
                       {"ms_per_step_median", r.ms_median},
                       {"ms_per_step_min", r.ms_min},
                       {"ms_per_step_samples", r.ms},
                       {"gbps", r.gbps},
                       {"read_bandwidth_gbps", r.bw_ref_gbps},
                       {"bandwidth_fraction", r.bw_fraction},
                       {"speedup_vs_dense", r.speedup}});
  }
  j["methods"] = methods;
  return j.dump(2) + "\n";
}

}  // namespace cumulus
