// GPU decode benchmark (docs/cuda.md): our dense paged decode kernel and the registry's GPU
// decode methods (default sketch_topp, tactic, psa, quest, oracle_topp; each built as the
// model runtime builds it: cuda::registry_with_gpu, MethodInfo::gpu or its SelectPolicy) on
// the synthetic workload (docs/workload.md) in
// the llama3-8b shape (32 query heads, 8 kv heads, head_dim 128, f16) at several contexts and
// batch sizes, and on real K/V/Q traces recorded by `cumulus trace`. PyTorch's
// scaled_dot_product_attention runs in tools/device/torch_sdpa_bench.py on the same GPU in
// the same device run; tools/device/summary.py joins the two JSON files.
//
// Method: every timed region is a CUDA graph replay between two events, preceded (outside
// the events) by a 256 MiB memset that evicts the 60 MB L2, so K/V come from HBM as they
// would in a model whose other layers pass through the cache; warm-up replays first, then
// the median of --iters replays. The reference bandwidth is a device-to-device copy of 1 GiB
// measured the same way in the same run, counting bytes read plus bytes written. A sparse
// step is timed whole (select + attend) and in its two parts (select alone, attend alone
// over the lists of the last select). sketch_topp's rows also give its byte floor: the
// sketch of every token plus the K/V rows of its union, over the copy bandwidth (the
// fastest the step could run). Accuracy per query head comes from one untimed step:
// the true softmax mass of the attended union (exp(lse_sparse - lse_dense)), the claim, the
// share of tokens attended and ||o - o_dense|| / ||o_dense||. Batch b decodes synthetic query
// step b of sequence copies that each live in their own memory. A method's target parameter
// (MethodInfo::target_param) is --p; a fixed-budget method's budget (budget_param) is the mean
// budget of the --match-budget method in the same run (before it: n / 20, at least 16).
// The fused pipelines attend with their default plan, the policy methods with the fastest
// dense plan. Variants the library does not run (work stealing, the CTA timeline, tactic's
// forced paths) are dev/cuda's programs.
//
// Usage: cuda_decode_bench [--contexts 8192,32768,131072] [--batches 1,16] [--iters 30]
//          [--warmup 5] [--p 0.9] [--concentration 1.0] [--seed 1] [--methods LIST]
//          [--param LABEL.KEY=VALUE]... [--match-budget LABEL] [--dense-plans LIST]
//          [--trace FILE]... [--json PATH]
// --methods: comma-separated registry names, or LABEL=NAME for a method under another label
// (as `cumulus eval`), whose parameters --param sets: e.g. --methods sketch_topp,sk0=sketch_topp
// --param sk0.gpu_dense_mib=0. The label names the method in the table and the JSON.
// --dense-plans: our dense kernel's plans to time, comma-separated specs KIND WARPS [/cN]
// [/mN] [/lN] [/nN] [/pN] [/k0]: KIND simt or tc (tensor cores), WARPS 2, 4 or 8 per CTA, /c
// CTAs per SM (0 = occupancy limit), /m max_chunk, /n min_chunk (0 = the plan's default),
// /p L2 prefetch size (0, 128, 256; the
// default 256), /k0 the general kernel for dense ranges too (/k1, the default: the kernel
// with one page lookup per block, AttentionPlanOptions::contiguous_dense), /l the index
// lists' max_chunk (it leaves the dense time alone; the sparse methods attend with the
// fastest dense plan, so give /l to one spec, or to all); e.g. tc4/c1/p0.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/eval/trace.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/method.h"
#include "cumulus/methods/registry.h"
#include "cumulus/kv/kv_cache.h"
#include "model/cuda/decode_methods.h"

using namespace cumulus;
using json = nlohmann::json;

namespace {

struct Options {
  std::vector<int> contexts{8192, 32768, 131072};
  std::vector<int> batches{1, 16};
  std::vector<std::string> methods{"sketch_topp", "tactic", "psa", "quest", "oracle_topp"};
  std::vector<std::string> traces, params;
  std::vector<std::string> dense_plans{"simt8", "tc4", "tc8", "tc8/p0"};
  std::string match_budget = "tactic";
  int iters = 30, warmup = 5;
  double p = 0.9, concentration = 1.0;
  uint64_t seed = 1;
  std::string json_path = "cuda_decode_bench.json";
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) out.push_back(x);
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      CUMULUS_CHECK(i + 1 < argc, "option {} needs a value", a);
      return argv[++i];
    };
    auto ints = [&](const std::string& v) {
      std::vector<int> r;
      for (const auto& x : split(v)) r.push_back(std::stoi(x));
      return r;
    };
    if (a == "--contexts") o.contexts = ints(next());
    else if (a == "--batches") o.batches = ints(next());
    else if (a == "--methods") o.methods = split(next());
    else if (a == "--param") o.params.push_back(next());
    else if (a == "--trace") o.traces.push_back(next());
    else if (a == "--dense-plans") o.dense_plans = split(next());
    else if (a == "--match-budget") o.match_budget = next();
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--p") o.p = std::stod(next());
    else if (a == "--concentration") o.concentration = std::stod(next());
    else if (a == "--seed") o.seed = std::stoull(next());
    else if (a == "--json") o.json_path = next();
    else CUMULUS_FAIL("unknown option '{}'", a);
  }
  CUMULUS_CHECK(o.iters >= 1 && o.warmup >= 0, "--iters={} must be >= 1 and --warmup={} >= 0", o.iters, o.warmup);
  return o;
}

// One --dense-plans spec ("tc8/c2/m65536") as plan options.
cuda::AttentionPlanOptions plan_spec(const std::string& spec) {
  cuda::AttentionPlanOptions po;
  const std::vector<std::string> parts = [&] {
    std::vector<std::string> r;
    std::stringstream ss(spec);
    std::string x;
    while (std::getline(ss, x, '/')) r.push_back(x);
    return r;
  }();
  CUMULUS_CHECK(!parts.empty(), "--dense-plans: empty spec");
  const std::string& head = parts[0];
  size_t digits = head.find_first_of("0123456789");
  CUMULUS_CHECK(digits != std::string::npos && digits > 0, "--dense-plans: '{}' needs KIND WARPS (e.g. tc8)", spec);
  const std::string kind = head.substr(0, digits);
  CUMULUS_CHECK(kind == "simt" || kind == "tc", "--dense-plans: kind '{}' in '{}' must be simt or tc", kind, spec);
  po.tensor_cores = kind == "tc";
  po.warps = std::stoi(head.substr(digits));
  for (size_t i = 1; i < parts.size(); ++i) {
    CUMULUS_CHECK(parts[i].size() >= 2, "--dense-plans: bad field '{}' in '{}'", parts[i], spec);
    const int v = std::stoi(parts[i].substr(1));
    switch (parts[i][0]) {
      case 'c': po.ctas_per_sm = v; break;
      case 'm': po.max_chunk = v; break;
      case 'n': po.min_chunk = v; break;
      case 's':
        CUMULUS_CHECK(v == 0, "--dense-plans: '{}': work stealing is dev/cuda/attention_steal.cu, not the library", spec);
        break;
      case 'p': po.l2_prefetch = v; break;
      case 'k': po.contiguous_dense = v != 0; break;
      case 'l': po.max_chunk_lists = v; break;
      default: CUMULUS_FAIL("--dense-plans: field '{}' in '{}' must start with c, m, l, n, p or k", parts[i], spec);
    }
  }
  return po;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// Times graph replays: flush (untimed), events around one replay; returns microseconds.
struct Timer {
  cuda::Stream& stream;
  cuda::DeviceBuffer& flush;
  int warmup, iters;
  std::vector<double> run(const cuda::Graph& g) {
    cuda::EventTimer t;
    for (int i = 0; i < warmup; ++i) g.launch(stream.handle());
    std::vector<double> us;
    for (int i = 0; i < iters; ++i) {
      cuda::memset_async(flush.data(), i & 0xff, flush.size(), stream.handle());
      t.start(stream.handle());
      g.launch(stream.handle());
      t.stop(stream.handle());
      us.push_back(1e3 * t.elapsed_ms());
    }
    return us;
  }
};

double copy_bandwidth(cuda::Stream& stream, int iters, json& out) {
  const size_t bytes = size_t{1} << 30;
  cuda::DeviceBuffer a(bytes), b(bytes);
  cuda::memset_async(a.data(), 1, bytes, stream.handle());
  cuda::EventTimer t;
  std::vector<double> gbps;
  for (int i = 0; i < iters + 3; ++i) {
    t.start(stream.handle());
    cuda::memcpy_device_async(b.data(), a.data(), bytes, stream.handle());
    t.stop(stream.handle());
    const double ms = t.elapsed_ms();
    if (i >= 3) gbps.push_back(2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  out = {{"bytes", bytes}, {"counted", "read + write"}, {"gbps_samples", gbps}, {"gbps_median", median(gbps)}};
  return median(gbps);
}

struct Accuracy {
  double mass = 0, claimed = 0, tokens_frac = 0, rel_err = 0, max_err = 0;
  double ge_p = 0;  // share of query heads whose true mass reaches p
  int claimed_n = 0;
};

// Per-head accuracy of one sparse step against dense outputs.
Accuracy accuracy(const std::vector<float>& out, const std::vector<float>& dense_out, const std::vector<float>& mass,
                  const cuda::SparseStepStats& st, int n_q, int n_kv, int d, const std::vector<int>& n_tokens,
                  double p) {
  Accuracy a;
  const size_t heads = mass.size();
  for (size_t i = 0; i < heads; ++i) {
    a.mass += mass[i] / heads;
    a.ge_p += (mass[i] >= p ? 1.0 : 0.0) / heads;
    if (!std::isnan(st.claimed[i])) a.claimed += st.claimed[i], ++a.claimed_n;
    double num = 0, den = 0;
    for (int j = 0; j < d; ++j) {
      const double x = out[i * d + j], y = dense_out[i * d + j];
      num += (x - y) * (x - y);
      den += y * y;
    }
    const double e = std::sqrt(num / std::max(den, 1e-30));
    a.rel_err += e / heads;
    a.max_err = std::max(a.max_err, e);
  }
  if (a.claimed_n) a.claimed /= a.claimed_n;
  const size_t lists = st.tokens.size();
  for (size_t l = 0; l < lists; ++l) a.tokens_frac += static_cast<double>(st.tokens[l]) / n_tokens[l / n_kv] / lists;
  (void)n_q;
  return a;
}

struct Problem {
  cuda::DeviceKvCache* dev;
  int group;
  cuda::DeviceBuffer* q;
  size_t dense_bytes;
};

// Our dense kernel in several plans (SIMT and tensor cores, 4 and 8 warps per CTA). Every
// variant's output for sequence 0 is compared with the float64 reference (ref_out0:
// [n_q_heads][head_dim]) before its time counts: a variant whose normalised error exceeds
// 1e-4 is reported and not chosen.
json run_dense(const Problem& pb, const std::vector<std::string>& specs, cuda::Stream& st, Timer& timer,
               cuda::DeviceBuffer& out, cuda::DeviceBuffer& lse, double copy_gbps, const std::vector<float>& ref_out0,
               double& best_us, cuda::AttentionPlanOptions& best_opts) {
  json variants = json::array();
  best_us = 1e300;
  json best;
  const cuda::DeviceKvView kv = pb.dev->view();
  const size_t n_out = static_cast<size_t>(kv.n_seqs) * kv.n_kv_heads * pb.group * kv.head_dim;
  std::vector<float> reference;
  for (const std::string& spec : specs) {
    const cuda::AttentionPlanOptions po = plan_spec(spec);
    json v = {{"plan", spec}, {"warps", po.warps}, {"tensor_cores", po.tensor_cores}, {"ctas_per_sm", po.ctas_per_sm},
              {"max_chunk", po.max_chunk}, {"min_chunk", po.min_chunk}};
    try {
      cuda::AttentionPlan plan(kv, pb.group, po);
      v["warps_run"] = plan.warps();  // fewer than asked where the rings do not fit (head_dim 256)
      v["tensor_cores_run"] = plan.tensor_cores();  // false at head_dim 256
      cuda::DeviceDecodeArgs a;
      a.kv = kv;
      a.group = pb.group;
      a.scale = 1.0f / std::sqrt(static_cast<float>(kv.head_dim));
      a.q = pb.q->as<float>();
      a.out = out.as<float>();
      a.lse = lse.as<float>();
      cuda::attention_decode(a, plan, st.handle());
      plan.check(st.handle());
      const auto o = cuda::to_host<float>(out, n_out);
      double num = 0, den = 0;
      if (reference.empty()) reference = o;
      for (size_t i = 0; i < n_out; ++i) {
        num += (static_cast<double>(o[i]) - reference[i]) * (static_cast<double>(o[i]) - reference[i]);
        den += static_cast<double>(reference[i]) * reference[i];
      }
      const double err_simt = std::sqrt(num / std::max(den, 1e-30));
      num = den = 0;
      for (size_t i = 0; i < ref_out0.size(); ++i) {
        num += (static_cast<double>(o[i]) - ref_out0[i]) * (static_cast<double>(o[i]) - ref_out0[i]);
        den += static_cast<double>(ref_out0[i]) * ref_out0[i];
      }
      const double err = std::sqrt(num / std::max(den, 1e-30));
      cuda::Graph g = cuda::Graph::capture(st.handle(), [&] { cuda::attention_decode(a, plan, st.handle()); });
      const auto us = timer.run(g);
      plan.check(st.handle());
      const double med = median(us);
      const double gbps = pb.dense_bytes / (med * 1e-6) / 1e9;
      v.update({{"us_median", med}, {"us_samples", us}, {"gbps", gbps}, {"pct_copy", 100.0 * gbps / copy_gbps},
                {"err_vs_ref_seq0", err}, {"err_vs_simt", err_simt}, {"valid", err <= 1e-4}});
      if (err <= 1e-4 && med < best_us) best_us = med, best = v, best_opts = po;
    } catch (const std::exception& e) {
      v["error"] = e.what();
    }
    variants.push_back(v);
  }
  // Leave the outputs of the best valid plan in out/lse (the reference for accuracy).
  cuda::AttentionPlan plan(kv, pb.group, best_opts);
  cuda::DeviceDecodeArgs a;
  a.kv = kv;
  a.group = pb.group;
  a.scale = 1.0f / std::sqrt(static_cast<float>(kv.head_dim));
  a.q = pb.q->as<float>();
  a.out = out.as<float>();
  a.lse = lse.as<float>();
  cuda::attention_decode(a, plan, st.handle());
  plan.check(st.handle());
  return {{"best", best}, {"variants", variants}, {"bytes", pb.dense_bytes}};
}

// One --methods entry: its label, the registry method and the --param values given to it.
struct MethodSpec {
  std::string label, name;
  std::map<std::string, std::string> params;
};

MethodSpec method_spec(const std::string& spec, const std::vector<std::string>& params, const Registry& registry) {
  MethodSpec m;
  const size_t as = spec.find('=');
  m.label = spec.substr(0, as);
  m.name = as == std::string::npos ? spec : spec.substr(as + 1);
  CUMULUS_CHECK(!m.label.empty() && !m.name.empty(), "--methods: '{}' must be NAME or LABEL=NAME", spec);
  for (const std::string& p : params) {
    const size_t dot = p.find('.'), eq = p.find('=');
    CUMULUS_CHECK(dot != std::string::npos && eq != std::string::npos && dot < eq,
                  "--param: '{}' must be LABEL.KEY=VALUE", p);
    if (p.substr(0, dot) == m.label) m.params[p.substr(dot + 1, eq - dot - 1)] = p.substr(eq + 1);
  }
  const MethodInfo& info = registry.find(m.name);  // unknown: Error listing the known ones
  CUMULUS_CHECK(method_kind_decodes(info.kind) && info.name != kDenseMethod,
                "--methods: '{}' is not a sparse decode method (dense is the reference every run times)", m.name);
  CUMULUS_CHECK(info.gpu.make != nullptr || info.make_policy != nullptr,
                "--methods: '{}' does not run on the GPU (on cuda: {})", m.name,
                cuda::model::cuda_decode_method_names(registry));
  (void)registry.parse(m.name, m.params);  // bad keys and values before any work
  return m;
}

// The spec's parameters with the run's target (MethodInfo::target_param = p) and fixed
// budget (budget_param) where the spec does not set them.
std::map<std::string, std::string> method_params(const MethodSpec& spec, const MethodInfo& info, double p,
                                                 int fixed_budget) {
  std::map<std::string, std::string> params = spec.params;
  if (!info.target_param.empty()) params.emplace(info.target_param, fmt::format("{}", p));
  if (!info.budget_param.empty()) params.emplace(info.budget_param, std::to_string(fixed_budget));
  return params;
}

// Methods with a fused pipeline keep what prefill built (tactic's clusters, sketch_topp's
// sketch): on a trace they are prefilled once over the prompt and see the decoded tokens
// appended.
bool is_stateful(const MethodInfo& info) { return info.gpu.make != nullptr; }

std::unique_ptr<cuda::SparseDecoder> make_method(const Registry& registry, const MethodSpec& spec,
                                                 const cuda::DeviceKvView& kv, int group, int layer, double p,
                                                 int fixed_budget, const cuda::AttentionPlanOptions& po) {
  const MethodInfo& info = registry.find(spec.name);
  const Shape shape{1, kv.n_kv_heads * group, kv.n_kv_heads, kv.head_dim};
  const std::map<std::string, std::string> params = method_params(spec, info, p, fixed_budget);
  cuda::model::cuda_decode_method_check(registry, spec.name, params, shape);
  if (info.gpu.make != nullptr) return info.gpu.make(kv, shape, layer, registry.parse(spec.name, params));
  return cuda::model::make_policy_decoder(registry, spec.name, params, kv, shape, layer, po);
}

// One sparse method on one problem: prefill, accuracy step, timed select / attend / step.
json run_sparse(const Registry& registry, const MethodSpec& spec, const Problem& pb, cuda::Stream& st, Timer& timer,
                const std::vector<float>& dense_out, cuda::DeviceBuffer& dense_lse, double dense_us, double copy_gbps,
                int fixed_budget, double p, bool time_it, Accuracy* acc_out = nullptr,
                const cuda::AttentionPlanOptions& po = {}) {
  const cuda::DeviceKvView kv = pb.dev->view();
  const int n_q = kv.n_kv_heads * pb.group, d = kv.head_dim;
  auto m = make_method(registry, spec, kv, pb.group, 0, p, fixed_budget, po);
  const auto t0 = std::chrono::steady_clock::now();
  m->prefill(st.handle());
  st.synchronize();
  const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const size_t nq = static_cast<size_t>(kv.n_seqs) * n_q;
  cuda::DeviceBuffer out(nq * d * sizeof(float)), lse(nq * sizeof(float)), mass(nq * sizeof(float));
  m->select(pb.q->as<float>(), st.handle());
  m->attend(pb.q->as<float>(), out.as<float>(), lse.as<float>(), dense_lse.as<float>(), mass.as<float>(), st.handle());
  m->check(st.handle());
  const cuda::SparseStepStats ss = m->stats(st.handle());
  const Accuracy acc = accuracy(cuda::to_host<float>(out, nq * d), dense_out, cuda::to_host<float>(mass, nq), ss, n_q,
                                kv.n_kv_heads, d, pb.dev->n_tokens(), p);
  json phases = json::array();
  for (const auto& [phase, us] : cuda::sparse_decoder_phase_times(*m, st.handle())) phases.push_back({phase, us});
  if (acc_out != nullptr) *acc_out = acc;
  size_t attended = 0;
  for (int t : ss.tokens) attended += t;
  json r = {{"method", spec.label}, {"prefill_s", prefill_s}, {"true_mass", acc.mass}, {"tokens_frac", acc.tokens_frac},
            {"rel_err", acc.rel_err}, {"max_err", acc.max_err}, {"attended_tokens", attended},
            {"ge_p_share", acc.ge_p}};
  r["claimed"] = acc.claimed_n ? json(acc.claimed) : json(nullptr);
  if (!phases.empty()) r["select_phases_us"] = phases;  // one untimed step, mean over query heads
  double budget_mean = 0;
  for (int b : ss.budget) budget_mean += static_cast<double>(b) / ss.budget.size();
  r["budget_mean"] = budget_mean;
  if (!time_it) return r;
  cuda::Graph gs = cuda::Graph::capture(st.handle(), [&] { m->select(pb.q->as<float>(), st.handle()); });
  cuda::Graph ga = cuda::Graph::capture(st.handle(), [&] {
    m->attend(pb.q->as<float>(), out.as<float>(), lse.as<float>(), nullptr, nullptr, st.handle());
  });
  cuda::Graph gt = cuda::Graph::capture(st.handle(), [&] {
    m->select(pb.q->as<float>(), st.handle());
    m->attend(pb.q->as<float>(), out.as<float>(), lse.as<float>(), nullptr, nullptr, st.handle());
  });
  const auto us_sel = timer.run(gs), us_att = timer.run(ga), us_step = timer.run(gt);
  m->check(st.handle());
  const double step = median(us_step), sel = median(us_sel), att = median(us_att);
  const double att_bytes = static_cast<double>(attended) * d * 2 * 2;
  r["select_us"] = sel;
  r["attend_us"] = att;
  r["step_us"] = step;
  r["step_us_samples"] = us_step;
  r["select_share"] = sel / step;
  r["attend_gbps"] = att_bytes / (att * 1e-6) / 1e9;
  r["attend_pct_copy"] = 100.0 * att_bytes / (att * 1e-6) / 1e9 / copy_gbps;
  // None when no dense plan ran or none was valid (--dense-plans "": run_dense leaves 1e300).
  r["speedup_vs_our_dense"] = dense_us > 0 && dense_us < 1e300 ? json(dense_us / step) : json(nullptr);
  if (m->select_bytes_per_token() > 0) {
    // The step's byte floor: what the selection reads per token (sketch_topp: the sketch's
    // codes + f16 offset and step; tactic: the centroids) and the union's K/V rows, at the
    // copy bandwidth.
    double tokens = 0;
    for (int n : pb.dev->n_tokens()) tokens += n;
    const double sketch_bytes = tokens * kv.n_kv_heads * m->select_bytes_per_token();
    r["select_bytes"] = sketch_bytes;
    r["floor_bytes"] = sketch_bytes + att_bytes;
    r["floor_us"] = (sketch_bytes + att_bytes) / (copy_gbps * 1e9) * 1e6;
    r["floor_select_us"] = sketch_bytes / (copy_gbps * 1e9) * 1e6;
    r["floor_attend_us"] = att_bytes / (copy_gbps * 1e9) * 1e6;
  }
  return r;
}

// ---- traces (cumulus trace; include/cumulus/eval/trace.h) ----
json run_trace(const Registry& registry, const std::vector<MethodSpec>& specs, const std::string& path,
               const Options& o, cuda::Stream& st, Timer& timer, double copy_gbps) {
  const TraceFile t = trace_read(path);
  const int group = t.group();
  json layers = json::array();
  for (size_t li = 0; li < t.layers.size(); ++li) {
    const KvCache kv = t.cache(static_cast<int>(li));
    std::vector<PagedHeadView> views;
    for (int h = 0; h < t.n_kv_heads; ++h) views.push_back(kv.view(0, h));
    cuda::DeviceKvCache dev = cuda::DeviceKvCache::upload({views});
    json lj = {{"layer", t.layers[li]}};
    std::map<std::string, std::vector<Accuracy>> accs;
    std::map<std::string, double> step_us;
    double dense_us = 0;
    const size_t nq = t.n_q_heads;
    const int d = t.head_dim;
    cuda::DeviceBuffer q(nq * d * sizeof(float)), dout(nq * d * sizeof(float)), dlse(nq * sizeof(float));
    // tactic clusters the prompt once (the tokens decoded since form its dense tail, as on
    // the CPU) and sketch_topp sketches it once (the tokens decoded since are encoded by
    // each step with the prompt's normalisation); the other methods are stateless.
    std::map<std::string, std::unique_ptr<cuda::SparseDecoder>> tactics;
    const int fixed_budget = std::max(16, t.prompt_tokens / 20);
    for (const MethodSpec& spec : specs)
      if (is_stateful(registry.find(spec.name))) {
        dev.set_n_tokens({t.prompt_tokens});
        tactics[spec.label] = make_method(registry, spec, dev.view(), group, t.layers[li], o.p, fixed_budget, {});
        tactics[spec.label]->prefill(st.handle());
      }
    for (int j = 0; j < t.steps; ++j) {
      const int n_j = t.attended(j);
      q.upload(t.q[li].data() + static_cast<size_t>(j) * nq * d, nq * d * sizeof(float));
      dev.set_n_tokens({n_j});
      Problem pb{&dev, group, &q, static_cast<size_t>(n_j) * t.n_kv_heads * d * 4};
      cuda::AttentionPlan plan(dev.view(), group);
      cuda::DeviceDecodeArgs a;
      a.kv = dev.view();
      a.group = group;
      a.scale = 1.0f / std::sqrt(static_cast<float>(d));
      a.q = q.as<float>();
      a.out = dout.as<float>();
      a.lse = dlse.as<float>();
      cuda::attention_decode(a, plan, st.handle());
      plan.check(st.handle());
      const auto dense_out = cuda::to_host<float>(dout, nq * d);
      const bool last = j == t.steps - 1;
      if (last) {
        cuda::Graph g = cuda::Graph::capture(st.handle(), [&] { cuda::attention_decode(a, plan, st.handle()); });
        dense_us = median(timer.run(g));
        lj["dense_default_us"] = dense_us;
        lj["dense_default_warps"] = plan.warps();
        // The dense plans of --dense-plans on the last step too, each checked against the
        // float64 reference over the same n_j tokens; the fastest valid one is "dense".
        std::vector<PagedHeadView> vj = views;
        for (auto& v : vj) v.n_tokens = n_j;
        std::vector<float> ref_out(nq * d), ref_lse(nq);
        DecodeAttnArgs ra;
        ra.kv = vj.data();
        ra.n_kv_heads = t.n_kv_heads;
        ra.group = group;
        ra.scale = attention_scale(d);
        ra.q = t.q[li].data() + static_cast<size_t>(j) * nq * d;
        ra.out = ref_out.data();
        ra.lse = ref_lse.data();
        ref::attention_decode_dense(ra);
        cuda::DeviceBuffer pout(nq * d * sizeof(float)), plse(nq * sizeof(float));
        double best_us = 0;
        cuda::AttentionPlanOptions best_opts;
        lj["dense_plans"] = run_dense(pb, o.dense_plans, st, timer, pout, plse, copy_gbps, ref_out, best_us, best_opts);
        for (const auto& v : lj["dense_plans"]["variants"])
          if (v.contains("error"))
            fmt::print("  layer {:>2}: dense {:<10} error: {}\n", t.layers[li], v["plan"].get<std::string>(),
                       v["error"].get<std::string>());
          else
            fmt::print("  layer {:>2}: dense {:<10} {:8.1f} us  {:5.1f}% of copy  ran {} {} warps  err vs float64 {:.1e}{}\n",
                       t.layers[li], v["plan"].get<std::string>(), v["us_median"].get<double>(),
                       v["pct_copy"].get<double>(), v["tensor_cores_run"].get<bool>() ? "tensor cores" : "SIMT",
                       v["warps_run"].get<int>(), v["err_vs_ref_seq0"].get<double>(),
                       v["valid"].get<bool>() ? "" : "  INVALID");
        if (best_us < 1e300) dense_us = std::min(dense_us, best_us);
      }
      for (const MethodSpec& spec : specs) {
        const std::string& name = spec.label;
        Accuracy acc;
        if (tactics.count(name) != 0) {
          cuda::SparseDecoder* m = tactics[name].get();
          cuda::DeviceBuffer out(nq * d * sizeof(float)), lse(nq * sizeof(float)), mass(nq * sizeof(float));
          m->select(q.as<float>(), st.handle());
          m->attend(q.as<float>(), out.as<float>(), lse.as<float>(), dlse.as<float>(), mass.as<float>(), st.handle());
          m->check(st.handle());
          acc = accuracy(cuda::to_host<float>(out, nq * d), dense_out, cuda::to_host<float>(mass, nq),
                         m->stats(st.handle()), t.n_q_heads, t.n_kv_heads, d, dev.n_tokens(), o.p);
          if (last) {
            cuda::Graph g = cuda::Graph::capture(st.handle(), [&] {
              m->select(q.as<float>(), st.handle());
              m->attend(q.as<float>(), out.as<float>(), lse.as<float>(), nullptr, nullptr, st.handle());
            });
            step_us[name] = median(timer.run(g));
          }
        } else {
          const json r = run_sparse(registry, spec, pb, st, timer, dense_out, dlse, 1.0, copy_gbps,
                                    std::max(16, n_j / 20), o.p, last, &acc);
          if (last) step_us[name] = r["step_us"];
        }
        accs[name].push_back(acc);
      }
    }
    lj["dense_us"] = dense_us;
    for (const auto& [name, v] : accs) {
      Accuracy m;
      for (const auto& a : v) {
        m.mass += a.mass / v.size();
        m.tokens_frac += a.tokens_frac / v.size();
        m.rel_err += a.rel_err / v.size();
        m.max_err = std::max(m.max_err, a.max_err);
        m.claimed += a.claimed / v.size();
        m.ge_p += a.ge_p / v.size();
      }
      lj[name] = {{"true_mass", m.mass}, {"tokens_frac", m.tokens_frac}, {"rel_err", m.rel_err},
                  {"max_err", m.max_err}, {"claimed", m.claimed}, {"ge_p_share", m.ge_p}, {"step_us", step_us[name]},
                  {"speedup_vs_our_dense", dense_us / step_us[name]}};
    }
    layers.push_back(lj);
  }
  return {{"path", path}, {"header", json::parse(t.header)}, {"layers", layers}};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    // The dense plans, the methods and their parameters, checked before any work.
    for (const std::string& spec : o.dense_plans) (void)plan_spec(spec);
    const Registry registry = cuda::registry_with_gpu(Registry::builtin());
    std::vector<MethodSpec> specs;
    for (const std::string& m : o.methods) specs.push_back(method_spec(m, o.params, registry));
    for (const std::string& p : o.params)
      CUMULUS_CHECK(std::any_of(specs.begin(), specs.end(),
                                [&](const MethodSpec& s) { return p.rfind(s.label + ".", 0) == 0; }),
                    "--param: '{}' names no label of --methods", p);
    if (!cuda::device_available()) {
      fmt::print(stderr, "cuda_decode_bench: no CUDA device\n");
      return 1;
    }
    const cuda::DeviceInfo di = cuda::device_info();
    fmt::print("device: {} (sm_{}{}, {} SMs, {:.1f} GiB, L2 {} MiB), driver {}, runtime {}\n", di.name, di.cc_major,
               di.cc_minor, di.sm_count, di.memory_bytes / 1073741824.0, di.l2_bytes >> 20, di.driver_version,
               di.runtime_version);
    json report;
    report["device"] = {{"name", di.name}, {"sm_count", di.sm_count}, {"cc", fmt::format("{}.{}", di.cc_major, di.cc_minor)},
                        {"memory_bytes", di.memory_bytes}, {"l2_bytes", di.l2_bytes}};
    cuda::Stream st;
    json copy;
    const double copy_gbps = copy_bandwidth(st, 20, copy);
    report["copy"] = copy;
    fmt::print("device-to-device copy: {:.0f} GB/s (read + write, median of 20 x 1 GiB)\n", copy_gbps);
    cuda::DeviceBuffer flush(size_t{256} << 20);
    Timer timer{st, flush, o.warmup, o.iters};
    report["options"] = {{"iters", o.iters}, {"warmup", o.warmup}, {"p", o.p}, {"concentration", o.concentration},
                         {"seed", o.seed}, {"flush_bytes", flush.size()}};
    ThreadPool pool(0);
    json runs = json::array();
    const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
    for (int n : o.contexts) {
      SyntheticOptions so;
      so.shape = shape_preset("llama3-8b");
      so.n_tokens = n;
      so.n_steps = std::max(max_batch, 1);
      so.seed = o.seed;
      so.concentration = o.concentration;
      KvCache kv(so.shape, KvCacheOptions{16, DType::f16, n});
      const auto t0 = std::chrono::steady_clock::now();
      const SyntheticWorkload w = synthetic_generate(so, kv, pool);
      fmt::print("context {}: synthetic workload generated in {:.1f} s\n", n,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      std::vector<PagedHeadView> views;
      for (int h = 0; h < so.shape.n_kv_heads; ++h) views.push_back(kv.view(0, h));
      // Float64 reference of sequence 0 (query step 0) for checking every dense variant.
      std::vector<float> ref_out0(static_cast<size_t>(so.shape.n_q_heads) * so.shape.head_dim),
          ref_lse0(so.shape.n_q_heads);
      {
        DecodeAttnArgs a;
        a.kv = views.data();
        a.n_kv_heads = so.shape.n_kv_heads;
        a.group = so.shape.group();
        a.scale = attention_scale(so.shape.head_dim);
        a.q = w.query(0, 0);
        a.out = ref_out0.data();
        a.lse = ref_lse0.data();
        ref::attention_decode_dense(a);
      }
      for (int b : o.batches) {
        cuda::DeviceKvCache dev = cuda::DeviceKvCache::upload_replicated(views, b);
        std::vector<float> qh;
        for (int s = 0; s < b; ++s) {
          const float* qs = w.query(0, s);
          qh.insert(qh.end(), qs, qs + static_cast<size_t>(so.shape.n_q_heads) * so.shape.head_dim);
        }
        cuda::DeviceBuffer q = cuda::to_device(qh);
        const size_t nq = static_cast<size_t>(b) * so.shape.n_q_heads;
        cuda::DeviceBuffer out(nq * so.shape.head_dim * sizeof(float)), lse(nq * sizeof(float));
        Problem pb{&dev, so.shape.group(), &q,
                   static_cast<size_t>(b) * n * so.shape.n_kv_heads * so.shape.head_dim * 2 * 2};
        double dense_us = 0;
        cuda::AttentionPlanOptions best_opts;
        json run = {{"context", n}, {"batch", b}};
        run["dense"] = run_dense(pb, o.dense_plans, st, timer, out, lse, copy_gbps, ref_out0, dense_us, best_opts);
        for (const auto& v : run["dense"]["variants"]) {
          if (v.contains("error")) {
            fmt::print("  batch {:>2}: dense {:<16} error: {}\n", b, v["plan"].get<std::string>(),
                       v["error"].get<std::string>());
            continue;
          }
          fmt::print("  batch {:>2}: dense {:<16} {:8.1f} us  {:6.0f} GB/s  {:5.1f}% of copy  err vs float64 {:.1e}{}\n",
                     b, v["plan"].get<std::string>(), v["us_median"].get<double>(), v["gbps"].get<double>(), v["pct_copy"].get<double>(),
                     v["err_vs_ref_seq0"].get<double>(), v["valid"].get<bool>() ? "" : "  INVALID");
        }
        const auto dense_out = cuda::to_host<float>(out, nq * so.shape.head_dim);
        json methods = json::array();
        int fixed_budget = std::max(16, n / 20);
        for (const MethodSpec& spec : specs) {
          const std::string& name = spec.label;
          const MethodInfo& info = registry.find(spec.name);
          json r;
          try {
            // The policy methods attend with the plan that was fastest for dense here.
            r = run_sparse(registry, spec, pb, st, timer, dense_out, lse, dense_us, copy_gbps, fixed_budget, o.p, true,
                           nullptr, best_opts);
          } catch (const std::exception& e) {  // keep the other methods' results
            fmt::print("  batch {:>2}: {:<12} error: {}\n", b, name, e.what());
            methods.push_back({{"method", name}, {"error", e.what()}});
            continue;
          }
          if (name == o.match_budget) fixed_budget = std::max(16, static_cast<int>(r["budget_mean"].get<double>()));
          if (!info.budget_param.empty() && spec.params.count(info.budget_param) == 0) r["budget_tokens"] = fixed_budget;
          const std::string vs = r["speedup_vs_our_dense"].is_null()
                                     ? std::string("(no dense plan)")
                                     : fmt::format("x{:5.2f} vs dense", r["speedup_vs_our_dense"].get<double>());
          fmt::print("  batch {:>2}: {:<12} step {:8.1f} us (select {:7.1f}, attend {:7.1f})  {}  "
                     "mass {:.3f}  tokens {:5.2f}%  err {:.4f}\n",
                     b, name, r["step_us"].get<double>(), r["select_us"].get<double>(), r["attend_us"].get<double>(),
                     vs, r["true_mass"].get<double>(), 100 * r["tokens_frac"].get<double>(),
                     r["rel_err"].get<double>());
          if (r.contains("floor_us"))
            fmt::print("  batch {:>2}: {:<12} byte floor {:7.1f} us (select {:.1f} MB: {:.1f} us; union K/V {:.1f} MB: "
                       "{:.1f} us) at the copy bandwidth; claimed {:.3f}; true mass >= p on {:.1f}% of heads\n",
                       b, name, r["floor_us"].get<double>(), r["select_bytes"].get<double>() / 1e6,
                       r["floor_select_us"].get<double>(),
                       (r["floor_bytes"].get<double>() - r["select_bytes"].get<double>()) / 1e6,
                       r["floor_attend_us"].get<double>(), r["claimed"].is_null() ? 0.0 : r["claimed"].get<double>(),
                       100 * r["ge_p_share"].get<double>());
          if (r.contains("select_phases_us")) {
            std::string line;
            for (const auto& ph : r["select_phases_us"])
              line += fmt::format(" {} {:.1f}", ph[0].get<std::string>(), ph[1].get<double>());
            fmt::print("  batch {:>2}: {:<12} select phases (us, one untimed step):{}\n", b, name, line);
          }
          methods.push_back(r);
        }
        run["methods"] = methods;
        runs.push_back(run);
        json partial = report;  // written after every run: a later failure keeps the earlier results
        partial["runs"] = runs;
        cumulus::file_write_atomic(o.json_path, partial.dump(1), "--json");
      }
    }
    report["runs"] = runs;
    json traces = json::array();
    for (const auto& path : o.traces) {
      fmt::print("trace {}\n", path);
      try {
        traces.push_back(run_trace(registry, specs, path, o, st, timer, copy_gbps));
      } catch (const std::exception& e) {
        fmt::print("  error: {}\n", e.what());
        traces.push_back({{"path", path}, {"error", e.what()}, {"layers", json::array()}, {"header", json::object()}});
        continue;
      }
      for (const auto& l : traces.back()["layers"])
        for (const auto& name : o.methods)
          if (l.contains(name))
            fmt::print("  layer {:>2} {:<12} mass {:.3f} (>= p {:5.1f}%) tokens {:5.1f}% err {:.4f} step {:6.1f} us "
                       "(dense {:6.1f} us)\n",
                       l["layer"].get<int>(), name, l[name]["true_mass"].get<double>(),
                       100 * l[name]["ge_p_share"].get<double>(), 100 * l[name]["tokens_frac"].get<double>(),
                       l[name]["rel_err"].get<double>(), l[name]["step_us"].get<double>(), l["dense_us"].get<double>());
    }
    report["traces"] = traces;
    cumulus::file_write_atomic(o.json_path, report.dump(1), "--json");
    fmt::print("wrote {}\n", o.json_path);
  } catch (const Error& e) {  // bad input: what, which value
    fmt::print(stderr, "cuda_decode_bench: error: {}\n", e.message());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "cuda_decode_bench: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
