// `cumulus bench --device cuda` (eval/cuda_bench.h): the CPU benchmark's (bench.cpp beside
// this folder) workload and table on the GPU. The synthetic workload (eval/synthetic.h, the same seeds and defaults as the CPU
// run) is uploaded to a DeviceKvCache of one sequence; each decode method runs as the model
// runtime runs it (src/model/cuda/decode_methods.h: the registry's names and parameters, the
// GPU decoders of methods/cuda_methods.h and kernels/cuda_decoder.h; dense is attention_decode).
//   accuracy pass: select + attend with the dense log-sum-exp as reference, so the kernel
//     returns each query head's true mass over what it read; ||o - o_dense|| / ||o_dense||
//     against our dense output; tokens and claims from SparseDecoder::stats();
//   timing passes: each step (select + attend of every head of one layer) between CUDA
//     events, after a memset of twice the L2 that flushes it, median over repeats;
//   K/V bytes read: the lists' rows plus the selection's own reads
//     (SparseDecoder::select_bytes_per_token), as the CPU methods count them;
//   ref: the device-to-device copy bandwidth (read + write) measured in the same run.
// The table and JSON are the CPU run's (eval/bench.h; BenchReport::device set).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "cumulus/core/error.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/bench.h"
#include "cumulus/eval/cuda_bench.h"
#include "cumulus/eval/method_spec.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/cuda_runner.h"
#include "model/cuda/decode_methods.h"

namespace cumulus {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.size() % 2 ? x[x.size() / 2] : 0.5 * (x[x.size() / 2 - 1] + x[x.size() / 2]);
}

void log_line(std::FILE* log, const std::string& s) {
  if (log != nullptr) {
    fmt::print(log, "{}\n", s);
    std::fflush(log);
  }
}

// The methods of a --device cuda run: the listed ones, or every method with a GPU pipeline;
// dense first.
std::vector<std::string> method_names(const BenchOptions& o) {
  std::vector<std::string> names{kDenseMethod};
  std::vector<std::string> listed = o.methods;
  if (listed.empty()) {
    const Registry gpu = cuda::registry_with_gpu(Registry::builtin());
    for (const MethodInfo& m : gpu.list())
      if (m.make_decode != nullptr && cuda::model::cuda_decode_method_supported(gpu, m.name))
        listed.push_back(m.name);
  }
  for (const std::string& m : listed)
    if (std::find(names.begin(), names.end(), m) == names.end()) names.push_back(m);
  return names;
}

}  // namespace

BenchReport bench_run_cuda(const BenchOptions& o, std::FILE* log) {
  const auto t_start = Clock::now();
  o.validate();
  CUMULUS_CHECK(cuda::device_available(), "--device cuda: no CUDA device is available (no GPU, or no driver that this "
                                          "build's CUDA runtime can use)");
  CUMULUS_CHECK(o.dtype == DType::f16 || o.dtype == DType::bf16,
                "--device cuda: --dtype {} is not supported on the GPU (f16, bf16)", dtype_name(o.dtype));
  BenchReport rep;
  rep.options = o;
  rep.shape = shape_preset(o.shape);
  rep.machine = bench_machine();
  rep.device = cuda_device_summary();
  const Shape& s = rep.shape;
  const Registry reg = cuda::registry_with_gpu(Registry::builtin());
  const std::vector<std::string> names = method_names(o);
  auto overrides_of = [&](const std::string& name) {
    const auto it = o.params.find(name);
    return it == o.params.end() ? std::map<std::string, std::string>{} : it->second;
  };
  for (const std::string& name : names) cuda::model::cuda_decode_method_check(reg, name, overrides_of(name), s);

  rep.membw.gbps_median = cuda_copy_gbps();
  log_line(log, fmt::format("{}: copy bandwidth {:.0f} GB/s", rep.device, rep.membw.gbps_median));

  ThreadPool pool(o.threads);
  const BenchWorkload bw = bench_workload(o, pool, rep);  // the CPU run's workload and queries
  const KvCache& kv = bw.kv;
  const SyntheticWorkload& w = bw.w;
  log_line(log, fmt::format("workload: {} tokens x {} steps in {:.1f} s", o.context, o.steps, rep.generate_s));

  std::vector<PagedHeadView> heads;
  for (int h = 0; h < s.n_kv_heads; ++h) heads.push_back(kv.view(0, h));
  const cuda::DeviceKvCache dev = cuda::DeviceKvCache::upload({heads});
  const cuda::DeviceKvView view = dev.view();
  const int n_q = s.n_q_heads, d = s.head_dim, group = s.group();
  const size_t q_step = static_cast<size_t>(n_q) * d;
  std::vector<float> q_host;
  for (int step = 0; step < o.steps; ++step) {
    const float* q = w.query(0, kPromptQueryRows + step);
    q_host.insert(q_host.end(), q, q + q_step);
  }
  const cuda::DeviceBuffer q = cuda::to_device(q_host);
  // The prompt's last queries for a method that learns from them (lfps), as the CPU run's.
  const cuda::DeviceBuffer prompt_q = cuda::to_device(
      std::vector<float>(w.query(0, 0), w.query(0, 0) + static_cast<size_t>(kPromptQueryRows) * s.n_q_heads * s.head_dim));
  const float* qd = q.as<float>();
  cuda::Stream stream;
  void* st = stream.handle();
  const cuda::DeviceInfo di = cuda::device_info();
  rep.evict_bytes = std::max<size_t>(2 * di.l2_bytes, size_t{64} << 20);
  cuda::DeviceBuffer flush(rep.evict_bytes);
  const double token_head_bytes = static_cast<double>(kv.bytes_per_token_head());  // K and V rows
  rep.dense_bytes_per_step = static_cast<double>(o.context) * s.n_kv_heads * token_head_bytes;

  // Dense: outputs and log-sum-exps of every step, the references of the accuracy pass.
  cuda::AttentionPlan plan(view, group);
  cuda::DeviceBuffer out_d(o.steps * q_step * sizeof(float)), lse_d(static_cast<size_t>(o.steps) * n_q * sizeof(float));
  cuda::DeviceBuffer out(q_step * sizeof(float)), lse(n_q * sizeof(float)), mass(n_q * sizeof(float));
  auto dense_step = [&](int step, float* o_ptr, float* l_ptr) {
    cuda::DeviceDecodeArgs a;
    a.kv = view;
    a.group = group;
    a.scale = attention_scale(d);
    a.q = qd + step * q_step;
    a.out = o_ptr;
    a.lse = l_ptr;
    cuda::attention_decode(a, plan, st);
  };
  for (int step = 0; step < o.steps; ++step)
    dense_step(step, out_d.as<float>() + step * q_step, lse_d.as<float>() + static_cast<size_t>(step) * n_q);
  plan.check(st);
  const std::vector<float> dense_out = cuda::to_host<float>(out_d, o.steps * q_step);

  const double nan = std::numeric_limits<double>::quiet_NaN();
  cuda::EventTimer timer;
  for (const std::string& name : names) {
    BenchMethodResult r;
    r.method = name;
    const std::map<std::string, std::string> overrides = overrides_of(name);
    r.params = reg.parse(name, overrides).values();
    std::unique_ptr<cuda::SparseDecoder> dec = cuda::model::make_cuda_decoder(reg, name, overrides, view, s, 0);
    const auto t_pre = Clock::now();
    if (dec) {
      dec->prefill(st, cuda::DevicePromptQueries{prompt_q.as<float>(), kPromptQueryRows});
      stream.synchronize();
    }
    r.prefill_ms = std::chrono::duration<double>(Clock::now() - t_pre).count() * 1e3;

    // Accuracy pass.
    const double target = method_target(name, r.params);
    double tokens = 0, bytes = 0, mass_sum = 0, claimed = 0, err = 0;
    int n_reached = 0, n_mass = 0, n_bypass = 0;
    bool claims = true;
    r.mass_true_min = std::numeric_limits<double>::infinity();
    for (int step = 0; step < o.steps; ++step) {
      const float* q_s = qd + step * q_step;
      std::vector<int> kv_tokens(s.n_kv_heads, o.context);
      std::vector<float> claim(n_q, 1.0f), m(n_q, 1.0f);
      std::vector<uint8_t> bypass(n_q, 0);
      if (dec) {
        dec->select(q_s, st);
        dec->attend(q_s, out.as<float>(), lse.as<float>(), lse_d.as<float>() + static_cast<size_t>(step) * n_q,
                    mass.as<float>(), st);
        dec->check(st);
        const cuda::SparseStepStats ss = dec->stats(st);
        kv_tokens = ss.tokens;
        claim = ss.claimed;
        if (!ss.bypass.empty()) bypass = ss.bypass;
        m = cuda::to_host<float>(mass, n_q);
      } else {
        dense_step(step, out.as<float>(), lse.as<float>());
      }
      stream.synchronize();  // the copies below run on another stream
      const std::vector<float> o_host = cuda::to_host<float>(out, q_step);
      double step_tokens = 0;
      for (int h = 0; h < s.n_kv_heads; ++h) step_tokens += kv_tokens[h];
      const bool selects = dec && o.context > dec->select_min_tokens();
      bytes += step_tokens * token_head_bytes + (selects ? dec->select_bytes_per_token() * o.context * s.n_kv_heads : 0.0);
      for (int qh = 0; qh < n_q; ++qh) {
        tokens += bypass[qh] ? 0 : kv_tokens[qh / group];  // a bypassed head (lfps) attended no set
        double e2 = 0, n2 = 0;
        for (int i = 0; i < d; ++i) {
          const double ref = dense_out[step * q_step + static_cast<size_t>(qh) * d + i];
          const double diff = o_host[static_cast<size_t>(qh) * d + i] - ref;
          e2 += diff * diff;
          n2 += ref * ref;
        }
        const double rel = std::sqrt(e2) / std::max(std::sqrt(n2), 1e-30);
        err += rel;
        r.rel_err_max = std::max(r.rel_err_max, rel);
        if (bypass[qh]) {
          ++n_bypass;  // no attended set whose mass could be checked
          continue;
        }
        mass_sum += m[qh];
        ++n_mass;
        r.mass_true_min = std::min(r.mass_true_min, static_cast<double>(m[qh]));
        n_reached += m[qh] >= target ? 1 : 0;
        if (std::isnan(claim[qh])) claims = false;
        claimed += claim[qh];
      }
    }
    const double head_steps = static_cast<double>(o.steps) * n_q;
    r.tokens_attended = tokens / head_steps;
    r.token_fraction = r.tokens_attended / o.context;
    r.bytes_per_step = bytes / o.steps;
    r.bytes_fraction = r.bytes_per_step / rep.dense_bytes_per_step;
    r.bypass_fraction = n_bypass / head_steps;
    r.mass_true = n_mass > 0 ? mass_sum / n_mass : nan;
    r.reached_p = std::isnan(target) || n_mass == 0 ? nan : static_cast<double>(n_reached) / n_mass;
    if (n_mass == 0) r.mass_true_min = nan;
    r.mass_claimed = claims && n_mass > 0 ? claimed / n_mass : nan;
    r.rel_err = err / head_steps;

    // Timing passes.
    for (int pass = 0; pass < o.warmup + o.repeats; ++pass) {
      double total = 0;
      for (int step = 0; step < o.steps; ++step) {
        cuda::memset_async(flush.data(), (pass + step) & 0xff, flush.size(), st);
        const float* q_s = qd + step * q_step;
        timer.start(st);
        if (dec) {
          dec->select(q_s, st);
          dec->attend(q_s, out.as<float>(), lse.as<float>(), nullptr, nullptr, st);
        } else {
          dense_step(step, out.as<float>(), lse.as<float>());
        }
        timer.stop(st);
        total += timer.elapsed_ms();
      }
      if (pass >= o.warmup) r.ms.push_back(total / o.steps);
    }
    if (dec) dec->check(st);
    r.ms_median = median(r.ms);
    r.ms_min = *std::min_element(r.ms.begin(), r.ms.end());
    r.gbps = r.bytes_per_step / (r.ms_median * 1e-3) * 1e-9;
    r.bw_ref_gbps = rep.membw.gbps_median;
    r.bw_fraction = r.gbps / r.bw_ref_gbps;
    log_line(log, fmt::format("{}: index {:.1f} ms, {:.4f} ms/step", name, r.prefill_ms, r.ms_median));
    rep.methods.push_back(std::move(r));
  }
  const double dense_ms = rep.methods.front().ms_median;
  for (auto& r : rep.methods) r.speedup = dense_ms / r.ms_median;
  rep.total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  return rep;
}

}  // namespace cumulus
