// GPU sparse methods tested by what they promise and against their CPU counterparts
// (src/methods) on the synthetic workload (docs/workload.md): at P = 1 (threshold 1) tactic
// and psa attend everything and equal dense attention; at P = 0.9 every method's output is
// exactly sparse attention over its own lists (checked with the float64 reference), its
// lists hold what the CPU method selects (Jaccard per kv head), and its claims agree with
// the CPU's; tactic keeps the tail appended after prefill; the methods defined over the
// selection ops (quest, oracle_topp, oracle_topk, streaming, and a policy of several marks)
// select what the CPU selects; lfps's tables, bypasses, lists and outputs follow the CPU's
// over several steps; and the ops' misuse is refused before any launch. Each also at head_dim 256 in Gemma 3 270M's attention shape
// (4 query heads, 1 kv head).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <numeric>
#include <random>

#include "cuda_test_util.h"
#include "cumulus/core/error.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/registry.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "methods/tactic/tactic_gpu_paths.h"
#include "methods/lfps/lfps_tables.h"

using namespace cumulus;
using namespace cumulus::cuda_test;

namespace {

struct Workload {
  KvCache kv;
  SyntheticWorkload w;
};

// The presets of eval/synthetic.h, and Gemma 3 270M's attention (4 query heads, 1 kv head,
// head_dim 256), which has no preset there.
Shape test_shape(std::string_view name) {
  if (name == "gemma3-270m") return Shape{.n_layers = 1, .n_q_heads = 4, .n_kv_heads = 1, .head_dim = 256};
  return shape_preset(name);
}

Workload make_workload(int n_tokens, const char* shape, uint64_t seed, ThreadPool& pool, double sink_mass = 0.2,
                       double concentration = 1.0, int n_steps = 4) {
  SyntheticOptions o;
  o.shape = test_shape(shape);
  o.n_tokens = n_tokens;
  o.n_steps = n_steps;
  o.seed = seed;
  o.sink_mass = sink_mass;
  o.concentration = concentration;
  KvCache kv(o.shape, KvCacheOptions{16, DType::f16, n_tokens + 16});
  SyntheticWorkload w = synthetic_generate(o, kv, pool);
  return {std::move(kv), std::move(w)};
}

struct GpuRun {
  std::vector<float> out, lse, mass;
  std::vector<std::vector<int32_t>> lists;  // [n_seqs * n_kv]
  cuda::SparseStepStats stats;
};

// Batch of n_seqs copies of the cache, sequence s decoding query step s.
GpuRun run_method(cuda::SparseDecoder& m, const cuda::DeviceKvView& kv, const Workload& wl, int n_seqs,
                  cuda::DeviceBuffer& qd, const std::vector<float>& lse_dense) {
  const Shape& sh = wl.w.options.shape;
  const size_t nq = static_cast<size_t>(n_seqs) * sh.n_q_heads;
  cuda::DeviceBuffer out(nq * sh.head_dim * sizeof(float)), lse(nq * sizeof(float)), mass(nq * sizeof(float));
  cuda::DeviceBuffer ref = cuda::to_device(lse_dense);
  m.select(qd.as<float>());
  m.attend(qd.as<float>(), out.as<float>(), lse.as<float>(), ref.as<float>(), mass.as<float>());
  m.check();
  GpuRun r;
  r.out = cuda::to_host<float>(out, nq * sh.head_dim);
  r.lse = cuda::to_host<float>(lse, nq);
  r.mass = cuda::to_host<float>(mass, nq);
  r.lists = download_lists(m.list_idx(), m.list_len(), n_seqs * sh.n_kv_heads, m.list_stride());
  r.stats = m.stats();
  return r;
}

// Dense reference (float64) for each sequence's query: out and lse.
void dense_ref(const Workload& wl, const std::vector<float>& q, int n_seqs, std::vector<float>& out,
               std::vector<float>& lse) {
  const Shape& sh = wl.w.options.shape;
  std::vector<PagedHeadView> views;
  for (int h = 0; h < sh.n_kv_heads; ++h) views.push_back(wl.kv.view(0, h));
  out.resize(static_cast<size_t>(n_seqs) * sh.n_q_heads * sh.head_dim);
  lse.resize(static_cast<size_t>(n_seqs) * sh.n_q_heads);
  for (int s = 0; s < n_seqs; ++s) {
    DecodeAttnArgs a;
    a.kv = views.data();
    a.n_kv_heads = sh.n_kv_heads;
    a.group = sh.group();
    a.scale = attention_scale(sh.head_dim);
    a.q = q.data() + static_cast<size_t>(s) * sh.n_q_heads * sh.head_dim;
    a.out = out.data() + static_cast<size_t>(s) * sh.n_q_heads * sh.head_dim;
    a.lse = lse.data() + static_cast<size_t>(s) * sh.n_q_heads;
    ref::attention_decode_dense(a);
  }
}

// What most tests start from: the workload's cache replicated for n_seqs sequences on the
// device, each sequence's query (host and device), and the float64 dense reference.
// (ReplicatedBatch's members, cuda_test_util.h, plus the reference; not derived from it, as
// the tests unpack it with structured bindings.)
struct GpuSetup {
  cuda::DeviceKvCache dev;
  std::vector<float> q;
  cuda::DeviceBuffer qd;
  std::vector<float> dout, dlse;
  GpuSetup(const Workload& wl, int n_seqs)
      : dev(cuda::DeviceKvCache::upload_replicated(views_of(wl.kv), n_seqs)),
        q(batch_queries(wl.w, n_seqs)),
        qd(cuda::to_device(q)) {
    dense_ref(wl, q, n_seqs, dout, dlse);
  }
};

// The GPU output equals float64 sparse attention over the GPU's own lists, and the lists
// are sorted, unique and in range.
void expect_consistent(const GpuRun& g, const Workload& wl, const std::vector<float>& q, int n_seqs,
                       const std::string& what) {
  const Shape& sh = wl.w.options.shape;
  const std::vector<PagedHeadView> views = views_of(wl.kv);
  for (int s = 0; s < n_seqs; ++s)
    expect_attends_lists(g.lists, g.out, g.lse, views, sh, q.data() + static_cast<size_t>(s) * sh.n_q_heads * sh.head_dim,
                         s, what);
}

struct CpuRun {
  std::vector<std::vector<int32_t>> lists;  // [n_seqs * n_kv]
  std::vector<double> claimed;              // [n_seqs * n_q]
};

CpuRun run_cpu(const std::string& name, const std::map<std::string, std::string>& params, const Workload& wl,
               const std::vector<float>& q, int n_seqs, ThreadPool& pool) {
  const Shape& sh = wl.w.options.shape;
  CpuRun r;
  for (int s = 0; s < n_seqs; ++s) {
    auto m = Registry::builtin().make(name, sh, params);
    DecodeContext ctx{&pool, false};
    m->on_prefill(0, wl.kv, ctx);
    AttnOutput out;
    m->decode(0, q.data() + static_cast<size_t>(s) * sh.n_q_heads * sh.head_dim, wl.kv, ctx, out);
    for (auto& l : out.selection.tokens) r.lists.push_back(l);
    for (const auto& st : out.stats) r.claimed.push_back(st.mass_claimed);
  }
  return r;
}

double mean_jaccard(const GpuRun& g, const CpuRun& c) {
  double s = 0;
  for (size_t i = 0; i < c.lists.size(); ++i) s += jaccard(g.lists[i], c.lists[i]);
  return s / c.lists.size();
}

}  // namespace

TEST(CudaMethods, TacticAndPsaAtFullMassEqualDense) {
  CUMULUS_REQUIRE_GPU();
  ThreadPool pool(2);
  for (const char* shape : {"smollm2-135m", "gemma3-270m"}) {
    SCOPED_TRACE(shape);
    const Workload wl = make_workload(3000, shape, 7, pool);
    const int n_seqs = 2;
    GpuSetup setup(wl, n_seqs);
    auto& [dev, q, qd, dout, dlse] = setup;
    const Shape& sh = wl.w.options.shape;
    std::vector<std::unique_ptr<cuda::SparseDecoder>> ms;
    cuda::TacticGpuOptions to;
    to.p = 1.0;
    ms.push_back(cuda::make_tactic_gpu(dev.view(), sh.group(), to));
    cuda::PsaGpuOptions po;
    po.threshold = 1.0;
    ms.push_back(cuda::make_psa_gpu(dev.view(), sh.group(), po));
    for (auto& m : ms) {
      m->prefill();
      const GpuRun g = run_method(*m, dev.view(), wl, n_seqs, qd, dlse);
      for (const auto& l : g.lists) EXPECT_EQ(static_cast<int>(l.size()), 3000) << m->name();
      EXPECT_LT(norm_err(g.out.data(), dout.data(), dout.size()), 5e-5) << m->name();
      for (float c : g.stats.claimed) EXPECT_NEAR(c, 1.0f, 1e-6) << m->name();
      for (float x : g.mass) EXPECT_NEAR(x, 1.0f, 1e-4) << m->name();
    }
  }
}

// The GPU method against the CPU one: the paper's algorithm, and with the sinks and recent
// tokens moved to the dense tail (the parameters of docs/methods.md).
TEST(CudaMethods, TacticMatchesCpuMethod) {
  CUMULUS_REQUIRE_GPU();
  ThreadPool pool(2);
  struct Cfg {
    const char* shape;
    int sinks, recent;
  };
  for (const Cfg& cfg : {Cfg{"smollm2-135m", 0, 0}, Cfg{"llama3-8b", 0, 0}, Cfg{"smollm2-135m", 4, 0},
                         Cfg{"llama3-8b", 4, 64}, Cfg{"gemma3-270m", 0, 0}, Cfg{"gemma3-270m", 4, 0}}) {
    const char* shape = cfg.shape;
    const std::string what = fmt::format("{} sinks {} recent {}", shape, cfg.sinks, cfg.recent);
    const Workload wl = make_workload(4096, shape, 11, pool);
    const int n_seqs = 3;
    GpuSetup setup(wl, n_seqs);
    auto& [dev, q, qd, dout, dlse] = setup;
    const Shape& sh = wl.w.options.shape;
    cuda::TacticGpuOptions to;
    to.sinks = cfg.sinks;
    to.recent = cfg.recent;
    auto m = cuda::make_tactic_gpu(dev.view(), sh.group(), to);
    m->prefill();
    const GpuRun g = run_method(*m, dev.view(), wl, n_seqs, qd, dlse);
    expect_consistent(g, wl, q, n_seqs, "tactic " + what);
    const CpuRun c = run_cpu(
        "tactic", {{"sinks", std::to_string(cfg.sinks)}, {"recent", std::to_string(cfg.recent)}}, wl, q, n_seqs, pool);
    // The sinks and the recent tokens are in every list.
    for (const auto& l : g.lists) {
      const auto in = [&](int32_t t) { return std::binary_search(l.begin(), l.end(), t); };
      for (int t = 0; t < cfg.sinks; ++t) EXPECT_TRUE(in(t)) << what << ": sink " << t << " not attended";
      for (int t = 4096 - cfg.recent; t < 4096; ++t) EXPECT_TRUE(in(t)) << what << ": recent " << t << " not attended";
    }
    const double jac = mean_jaccard(g, c);
    double dclaim = 0;
    for (size_t i = 0; i < c.claimed.size(); ++i) dclaim += std::fabs(g.stats.claimed[i] - c.claimed[i]);
    dclaim /= c.claimed.size();
    // Same clustering up to float32 near-ties; f16 centroids may swap clusters of close
    // score: the sets agree closely, not exactly.
    EXPECT_GT(jac, 0.8) << what;
    EXPECT_LT(dclaim, 0.03) << what;
    RecordProperty(fmt::format("tactic_jaccard_{}_s{}_r{}", shape, cfg.sinks, cfg.recent), std::to_string(jac));
    std::printf("tactic %s: mean Jaccard GPU vs CPU %.4f, mean |claim diff| %.4f\n", what.c_str(), jac, dclaim);
    for (float x : g.stats.claimed) EXPECT_TRUE(x > 0 && x <= 1.0f + 1e-6f);
  }
}

// The bucket ranking (one launch: clusters bucket-sorted by centroid score, list positions,
// exact rows) selects what the radix sort and positions kernels select: the same lists and
// budgets, claims within rounding; on the default workload, on one whose sinks dominate
// and whose other scores are narrow (an outlier that crowds the ranking's bins, so the CUB
// sort may take over), and with a dense tail after prefill. The marks by token range and by
// ranked cluster give exactly the same lists.
TEST(CudaMethods, TacticBucketRankingMatchesRadixSort) {
  CUMULUS_REQUIRE_GPU();
  ThreadPool pool(2);
  struct Cfg {
    const char* shape;
    int n, prefill;
    double sink_mass, concentration;
  };
  for (const Cfg& cfg : {Cfg{"llama3-8b", 4096, 4096, 0.2, 1.0}, Cfg{"smollm2-135m", 3000, 2500, 0.2, 1.0},
                         Cfg{"smollm2-135m", 4097, 4097, 0.9, 0.25}, Cfg{"llama3-8b", 255, 255, 0.2, 1.0},
                         Cfg{"gemma3-270m", 4096, 4000, 0.2, 1.0}}) {
    const Workload wl = make_workload(cfg.n, cfg.shape, 23, pool, cfg.sink_mass, cfg.concentration);
    const int n_seqs = 2;
    GpuSetup setup(wl, n_seqs);
    auto& [dev, q, qd, dout, dlse] = setup;
    const Shape& sh = wl.w.options.shape;
    std::vector<GpuRun> runs;  // bucket ranking with the marks by token range, radix sort, bucket with cluster marks
    for (int variant : {0, 1, 2}) {
      const bool bucket = variant != 1;
      cuda::TacticGpuPaths tb;
      tb.bucket_ranking = bucket;
      tb.token_marks = variant == 0;
      dev.set_n_tokens({cfg.prefill, cfg.prefill});
      auto m = cuda::make_tactic_gpu_paths(dev.view(), sh.group(), {}, tb);
      m->prefill();
      dev.set_n_tokens({cfg.n, cfg.n});
      runs.push_back(run_method(*m, dev.view(), wl, n_seqs, qd, dlse));
      // Twice: the step leaves its scratch (bitmaps, counters) ready for the next one.
      const GpuRun again = run_method(*m, dev.view(), wl, n_seqs, qd, dlse);
      EXPECT_EQ(again.lists, runs.back().lists) << cfg.shape << " variant " << variant << ": a second step differs";
    }
    const std::string what = fmt::format("{} n {} prefill {} sink_mass {} concentration {}", cfg.shape, cfg.n,
                                         cfg.prefill, cfg.sink_mass, cfg.concentration);
    expect_consistent(runs[0], wl, q, n_seqs, "bucket ranking " + what);
    double jac = 0;
    for (size_t i = 0; i < runs[0].lists.size(); ++i) jac += jaccard(runs[0].lists[i], runs[1].lists[i]);
    jac /= runs[0].lists.size();
    EXPECT_GT(jac, 0.999) << what;
    int same_budget = 0;
    for (size_t i = 0; i < runs[0].stats.budget.size(); ++i) {
      same_budget += runs[0].stats.budget[i] == runs[1].stats.budget[i];
      EXPECT_NEAR(runs[0].stats.claimed[i], runs[1].stats.claimed[i], 1e-5) << what << " head " << i;
    }
    EXPECT_GE(same_budget, static_cast<int>(runs[0].stats.budget.size()) - 1) << what;
    // The two ways of marking the same ranking give the same lists.
    EXPECT_EQ(runs[0].lists, runs[2].lists) << what << ": marks by token range and by cluster differ";
    std::printf("tactic bucket ranking vs radix sort, %s: Jaccard %.5f, equal budgets %d of %zu\n", what.c_str(), jac,
                same_budget, runs[0].stats.budget.size());
  }
}

// Tokens appended after prefill form the dense tail; with sinks and recent tokens it also
// holds the first and last clustered tokens, and those leave the ranked list (the budget
// counts list entries only).
TEST(CudaMethods, TacticAttendsTheTailAfterPrefill) {
  CUMULUS_REQUIRE_GPU();
  ThreadPool pool(2);
  const Workload wl = make_workload(4096, "smollm2-135m", 13, pool);
  const auto q = batch_queries(wl.w, 1);
  cuda::DeviceBuffer qd = cuda::to_device(q);
  std::vector<float> dout, dlse;
  dense_ref(wl, q, 1, dout, dlse);
  const Shape& sh = wl.w.options.shape;
  for (const auto& [sinks, recent] : {std::pair{0, 0}, std::pair{4, 32}}) {
    cuda::DeviceKvCache dev = cuda::DeviceKvCache::upload_replicated(views_of(wl.kv), 1);
    dev.set_n_tokens({3500});
    cuda::TacticGpuOptions to;
    to.sinks = sinks;
    to.recent = recent;
    auto m = cuda::make_tactic_gpu(dev.view(), sh.group(), to);
    m->prefill();
    dev.set_n_tokens({4096});
    const GpuRun g = run_method(*m, dev.view(), wl, 1, qd, dlse);
    const std::string what = fmt::format("tactic with tail, sinks {} recent {}", sinks, recent);
    for (size_t i = 0; i < g.lists.size(); ++i) {
      const auto& l = g.lists[i];
      const auto count = [&](int a, int b) { return std::count_if(l.begin(), l.end(), [&](int32_t t) { return t >= a && t < b; }); };
      EXPECT_EQ(count(3500, 4096), 596) << what;
      EXPECT_EQ(count(0, sinks), sinks) << what;
      EXPECT_EQ(count(3500 - recent, 3500), recent) << what;
    }
    // Each head's budget is at most its list's length, 3500 - sinks - recent entries.
    for (int k : g.stats.budget) EXPECT_LE(k, 3500 - sinks - recent) << what;
    expect_consistent(g, wl, q, 1, what);
  }
}

TEST(CudaMethods, PsaMatchesCpuMethod) {
  CUMULUS_REQUIRE_GPU();
  ThreadPool pool(2);
  for (const char* shape : {"llama3-8b", "gemma3-270m"}) {
    const Workload wl = make_workload(4096, shape, 17, pool);
    const int n_seqs = 2;
    GpuSetup setup(wl, n_seqs);
    auto& [dev, q, qd, dout, dlse] = setup;
    const Shape& sh = wl.w.options.shape;
    for (int mb : {1, 4})
      for (const char* crit : {"mean", "bound"}) {
        cuda::PsaGpuOptions po;
        po.threshold = 0.9;
        po.microbatch = mb;
        po.criticality = std::string(crit) == "mean" ? PsaCriticality::mean : PsaCriticality::bound;
        auto m = cuda::make_psa_gpu(dev.view(), sh.group(), po);
        const GpuRun g = run_method(*m, dev.view(), wl, n_seqs, qd, dlse);
        const std::string what = fmt::format("psa {} microbatch {} {}", shape, mb, crit);
        expect_consistent(g, wl, q, n_seqs, what);
        const CpuRun c = run_cpu("psa", {{"threshold", "0.9"}, {"microbatch", std::to_string(mb)}, {"criticality", crit}},
                                 wl, q, n_seqs, pool);
        const double jac = mean_jaccard(g, c);
        int close = 0;
        for (size_t i = 0; i < c.claimed.size(); ++i) close += std::fabs(g.stats.claimed[i] - c.claimed[i]) < 1e-3;
        EXPECT_GT(jac, 0.97) << what;
        EXPECT_GE(close, static_cast<int>(0.95 * c.claimed.size())) << what;
        std::printf("%s: mean Jaccard GPU vs CPU %.4f, claims within 1e-3: %d of %zu\n", what.c_str(), jac, close,
                    c.claimed.size());
      }
  }
}

TEST(CudaMethods, PolicyMethodsMatchCpuMethods) {
  CUMULUS_REQUIRE_GPU();
  ThreadPool pool(2);
  struct Case {
    std::string method;
    std::map<std::string, std::string> params;
    bool claims;  // the method claims the mass of each head's own set
  };
  const std::vector<Case> cases{{"quest", {{"budget", "256"}}, false},
                                {"oracle_topp", {{"p", "0.9"}}, true},
                                {"oracle_topk", {{"k", "300"}}, true},
                                {"streaming", {{"sinks", "4"}, {"window", "500"}}, false}};
  for (const char* shape : {"llama3-8b", "gemma3-270m"}) {
    SCOPED_TRACE(shape);
    const Workload wl = make_workload(4096, shape, 19, pool);
    const int n_seqs = 2;
    GpuSetup setup(wl, n_seqs);
    auto& [dev, q, qd, dout, dlse] = setup;
    const Shape& sh = wl.w.options.shape;
    for (const Case& k : cases) {
      SCOPED_TRACE(k.method);
      auto m = policy_gpu(k.method, k.params, dev.view(), sh.group());
      EXPECT_EQ(m->name(), k.method);
      const GpuRun g = run_method(*m, dev.view(), wl, n_seqs, qd, dlse);
      expect_consistent(g, wl, q, n_seqs, k.method);
      const CpuRun c = run_cpu(k.method, k.params, wl, q, n_seqs, pool);
      const double jac = mean_jaccard(g, c);
      std::printf("%s %s: mean Jaccard GPU vs CPU %.5f\n", shape, k.method.c_str(), jac);
      EXPECT_GT(jac, k.method == "streaming" ? 0.99999 : 0.99);
      for (size_t i = 0; i < c.claimed.size(); ++i) {
        if (!k.claims) {
          EXPECT_TRUE(std::isnan(g.stats.claimed[i]));
          continue;
        }
        EXPECT_NEAR(g.stats.claimed[i], c.claimed[i], 1e-4);
        if (k.method == "oracle_topp") {
          EXPECT_GE(g.stats.claimed[i], 0.9f - 1e-5f);
        }
        // The union's true mass is at least each head's own claim.
        EXPECT_GE(g.mass[i], g.stats.claimed[i] - 1e-4f);
      }
    }
  }
}

namespace {

// A policy of several marks in one step (not a registry method): the first 8 and last 40
// tokens, quest's top 2 pages, and each head's tokens up to 0.5 of its mass claimed; on
// layer 1 every token (mark_all).
class ManyMarks final : public SelectPolicy {
 public:
  void select(int layer, SelectOps& ops) const override {
    if (layer == 1) {
      ops.mark_all();
      return;
    }
    ops.mark_ends(8, 40);
    ops.score_pages_bound();
    ops.choose_topk(2);
    ops.mark_chosen(false);
    ops.score_tokens();
    ops.choose_top_mass(0.5);
    ops.mark_chosen(true);
  }
};

}  // namespace

// The CUDA backend of the selection ops against the CPU backend, op for op: the same lists
// and claims for a policy of several marks, and for mark_all; misuse is refused when the
// decoder is made, before any launch.
TEST(CudaMethods, SelectOpsMatchTheCpuOpsAndRefuseMisuse) {
  CUMULUS_REQUIRE_GPU();
  ThreadPool pool(2);
  const Workload wl = make_workload(3000, "llama3-8b", 23, pool);
  const Shape& sh = wl.w.options.shape;
  const int n_seqs = 2;
  GpuSetup setup(wl, n_seqs);
  auto& [dev, q, qd, dout, dlse] = setup;
  const auto policy = std::make_shared<ManyMarks>();
  std::vector<PagedHeadView> views;
  for (int s = 0; s < n_seqs; ++s)
    for (const PagedHeadView& v : views_of(wl.kv)) views.push_back(v);
  auto host = cpu::make_select_ops();
  for (int layer : {0, 1}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    auto m = cuda::make_ops_gpu(dev.view(), sh.group(), "many_marks", policy_step(policy, layer));
    const GpuRun g = run_method(*m, dev.view(), wl, n_seqs, qd, dlse);
    expect_consistent(g, wl, q, n_seqs, "many_marks");
    host->begin({.kv = views.data(), .n_seqs = n_seqs, .n_kv_heads = sh.n_kv_heads, .group = sh.group(),
                 .q = q.data(), .pool = &pool});
    policy->select(layer, *host);
    std::vector<std::vector<int32_t>> lists(views.size());
    std::vector<double> claims(static_cast<size_t>(n_seqs) * sh.n_q_heads), bytes(views.size());
    host->finish(lists.data(), claims.data(), bytes.data());
    double jac = 0;
    for (size_t i = 0; i < lists.size(); ++i) jac += jaccard(g.lists[i], lists[i]);
    jac /= static_cast<double>(lists.size());
    std::printf("many_marks layer %d: mean Jaccard GPU vs CPU ops %.5f, %zu tokens in the first list\n", layer, jac,
                lists[0].size());
    EXPECT_GT(jac, 0.999);
    if (layer == 1) {
      EXPECT_EQ(lists[0].size(), static_cast<size_t>(wl.kv.n_tokens(0)));
    }
    for (size_t r = 0; r < claims.size(); ++r) {
      EXPECT_NEAR(g.stats.claimed[r], claims[r], 1e-4) << "row " << r;
      if (layer == 0) {
        EXPECT_GE(g.stats.claimed[r], 0.5f - 1e-5f);
      }
    }
  }
  // Misuse, caught by the sizing pass at construction.
  struct Bad {
    std::string what;
    std::function<void(SelectOps&)> step;
  };
  const std::vector<Bad> bad{
      {"choose_topk before any scores", [](SelectOps& o) { o.choose_topk(4); }},
      {"k=0", [](SelectOps& o) { o.score_tokens(), o.choose_topk(0); }},
      {"p=1.5", [](SelectOps& o) { o.score_tokens(), o.choose_top_mass(1.5); }},
      {"before a choice", [](SelectOps& o) { o.score_tokens(), o.mark_chosen(false); }},
      {"before a choice",
       [](SelectOps& o) { o.score_pages_bound(), o.choose_topk(2), o.score_tokens(), o.mark_chosen(false); }},
      {"a mass claim needs token scores",
       [](SelectOps& o) { o.score_pages_bound(), o.choose_topk(2), o.mark_chosen(true); }},
      {"tail=-1", [](SelectOps& o) { o.mark_ends(4, -1); }},
  };
  auto expect_error = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, wanted one mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    expect_error([&] { (void)cuda::make_ops_gpu(dev.view(), sh.group(), "bad", b.step); }, b.what);
  }
  cuda::DeviceKvView no_stats = dev.view();
  no_stats.kmin = nullptr;
  expect_error([&] { (void)cuda::make_ops_gpu(no_stats, sh.group(), "bad", [](SelectOps& o) { o.score_pages_bound(); }); },
               "needs kv.kmin and kv.kmax");
}

// lfps against the CPU method over 8 decode steps, each appending one random key and value
// to both caches first, as a model does (the first 32 workload queries stand for the
// prompt's last queries, as in `cumulus bench`): after prefill the tables and sigma-hat^2
// equal the CPU's; at every step the bypass flags agree, the lists agree (mean Jaccard per
// kv head), a head outputs the CPU's output where its kv head's lists are equal (the
// prompt's mean value when bypassed), and the tables, over every cached position, follow
// the CPU's. With the default epsilon few heads of this workload bypass; epsilon at the
// median sink ratio of the first step makes many of them bypass.
TEST(CudaMethods, LfpsMatchesCpuMethod) {
  CUMULUS_REQUIRE_GPU();
  ThreadPool pool(2);
  constexpr int kPrompt = 32, kSteps = 8, kTokens = 4096;
  for (const char* shape : {"llama3-8b", "gemma3-270m"}) {
    SCOPED_TRACE(shape);
    const Shape sh = test_shape(shape);
    const int n_seqs = 2, d = sh.head_dim, nq = sh.n_q_heads, nkv = sh.n_kv_heads;
    auto fresh = [&] { return make_workload(kTokens, shape, 29, pool, 0.2, 1.0, kPrompt + kSteps + 1); };
    // The median sink ratio of the first step, from a CPU run with epsilon = 1 (no bypass).
    double median_rho = 0;
    {
      const Workload wl = fresh();
      auto m = Registry::builtin().make("lfps", sh, {{"epsilon", "1"}});
      DecodeContext ctx{.pool = &pool, .eval = false, .prompt_q = wl.w.query(0, 0), .prompt_q_rows = kPrompt};
      m->on_prefill(0, wl.kv, ctx);
      AttnOutput out;
      m->decode(0, wl.w.query(0, kPrompt), wl.kv, ctx, out);
      std::vector<double> rho;
      for (int j = 0; j < nq; ++j) rho.push_back(methods::lfps_tables(*m, 0, j).rho);
      std::sort(rho.begin(), rho.end());
      median_rho = rho[rho.size() / 2];
    }
    for (const double eps : {0.85, median_rho}) {
      const std::string what = fmt::format("lfps {} epsilon {:.4f}", shape, eps);
      SCOPED_TRACE(what);
      Workload wl = fresh();
      // The device cache: both sequences hold the workload's rows, appended on the device,
      // with room for the steps.
      cuda::DeviceKvCache dev = cuda::DeviceKvCache::create(n_seqs, nkv, d, DType::f16, 16, kTokens + kSteps);
      {
        std::vector<float> k0(static_cast<size_t>(n_seqs) * kTokens * nkv * d), v0(k0.size());
        for (int s = 0; s < n_seqs; ++s) {
          dev.reserve(s, kTokens + kSteps);
          for (int t = 0; t < kTokens; ++t)
            for (int h = 0; h < nkv; ++h) {
              const size_t o = ((static_cast<size_t>(s) * kTokens + t) * nkv + h) * d;
              wl.kv.key_f32(0, h, t, k0.data() + o);
              wl.kv.value_f32(0, h, t, v0.data() + o);
            }
        }
        const cuda::DeviceBuffer dk = cuda::to_device(k0), dv = cuda::to_device(v0);
        dev.append(dk.as<float>(), dv.as<float>(), kTokens);
      }
      // Prompt queries: the same for both sequences; decode step t of sequence s: query
      // kPrompt + t + s.
      std::vector<float> pq;
      for (int s = 0; s < n_seqs; ++s) pq.insert(pq.end(), wl.w.query(0, 0), wl.w.query(0, 0) + kPrompt * nq * d);
      cuda::DeviceBuffer pqd = cuda::to_device(pq);
      const std::map<std::string, std::string> params{{"epsilon", fmt::format("{:.17g}", eps)}};
      LfpsOptions o;
      o.epsilon = eps;
      auto g = cuda::make_lfps_gpu(dev.view(), sh.group(), o);
      EXPECT_EQ(g->prompt_queries(), 32);
      EXPECT_THROW(g->select(wl.w.query(0, 0)), Error);  // before prefill: no tables
      g->prefill(nullptr, cuda::DevicePromptQueries{pqd.as<float>(), kPrompt});
      std::vector<std::unique_ptr<DecodeMethod>> cpu;
      DecodeContext ctx{.pool = &pool, .eval = false, .prompt_q = wl.w.query(0, 0), .prompt_q_rows = kPrompt};
      for (int s = 0; s < n_seqs; ++s) {
        cpu.push_back(Registry::builtin().make("lfps", sh, params));
        cpu.back()->on_prefill(0, wl.kv, ctx);
      }
      // Tables: largest |GPU - CPU| over every cached position of every head, against the
      // largest entry (a CPU table not yet grown to the cache holds 0 there).
      auto table_diff = [&](double& diff, double& top) {
        diff = 0, top = 0;
        const int n = wl.kv.n_tokens(0);
        for (int s = 0; s < n_seqs; ++s)
          for (int j = 0; j < nq; ++j) {
            const cuda::LfpsTablesCopy gt = cuda::lfps_gpu_download(*g, s, j);
            const methods::LfpsTables& ct = methods::lfps_tables(*cpu[s], 0, j);
            ASSERT_EQ(gt.vertical.size(), static_cast<size_t>(n));
            for (int i = 0; i < n; ++i) {
              const double cv = i < static_cast<int>(ct.vertical.size()) ? ct.vertical[i] : 0.0;
              const double cs = i < static_cast<int>(ct.slash.size()) ? ct.slash[i] : 0.0;
              diff = std::max({diff, std::fabs(gt.vertical[i] - cv), std::fabs(gt.slash[i] - cs)});
              top = std::max({top, std::fabs(cv), std::fabs(cs)});
            }
            EXPECT_NEAR(gt.sigma_hat2, ct.sigma_hat2, 1e-4 * std::fabs(ct.sigma_hat2) + 1e-12);
          }
      };
      double diff, top;
      table_diff(diff, top);
      std::printf("%s: after prefill max |table GPU - CPU| %.3g of max %.3g\n", what.c_str(), diff, top);
      EXPECT_LE(diff, 1e-5 * top);
      std::mt19937 rng(41);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      int bypassed = 0, agree = 0, rows = 0, same_lists = 0, lists = 0, out_checked = 0;
      double jac = 0, out_diff = 0;
      for (int t = 0; t < kSteps; ++t) {
        // One new token, the same in both sequences and in the host cache.
        std::vector<float> kn(static_cast<size_t>(nkv) * d), vn(kn.size());
        for (auto& x : kn) x = normal(rng);
        for (auto& x : vn) x = normal(rng);
        wl.kv.append(0, kn.data(), vn.data(), 1);
        std::vector<float> kr, vr;
        for (int s = 0; s < n_seqs; ++s) kr.insert(kr.end(), kn.begin(), kn.end()), vr.insert(vr.end(), vn.begin(), vn.end());
        const cuda::DeviceBuffer dk = cuda::to_device(kr), dv = cuda::to_device(vr);
        dev.append(dk.as<float>(), dv.as<float>(), 1);
        std::vector<float> q;
        for (int s = 0; s < n_seqs; ++s) q.insert(q.end(), wl.w.query(0, kPrompt + t + s), wl.w.query(0, kPrompt + t + s) + nq * d);
        cuda::DeviceBuffer qd = cuda::to_device(q);
        const size_t rq = static_cast<size_t>(n_seqs) * nq;
        cuda::DeviceBuffer out(rq * d * sizeof(float)), lse(rq * sizeof(float));
        g->select(qd.as<float>());
        g->attend(qd.as<float>(), out.as<float>(), lse.as<float>());
        g->check();
        const std::vector<float> go = cuda::to_host<float>(out, rq * d);
        const auto gl = download_lists(g->list_idx(), g->list_len(), n_seqs * nkv, g->list_stride());
        const cuda::SparseStepStats st = g->stats();
        ASSERT_EQ(st.bypass.size(), rq);
        for (int s = 0; s < n_seqs; ++s) {
          AttnOutput co;
          cpu[s]->decode(0, q.data() + static_cast<size_t>(s) * nq * d, wl.kv, ctx, co);
          for (int h = 0; h < nkv; ++h) {
            const auto& a = gl[static_cast<size_t>(s) * nkv + h];
            const auto& b = co.selection.tokens[h];
            jac += jaccard(a, b);
            ++lists;
            const bool same = a == b;
            same_lists += same;
            for (int j = 0; j < sh.group(); ++j) {
              const int qh = h * sh.group() + j;
              const bool gb = st.bypass[static_cast<size_t>(s) * nq + qh] != 0;
              agree += gb == co.stats[qh].bypass;
              bypassed += co.stats[qh].bypass;
              ++rows;
              EXPECT_TRUE(std::isnan(st.claimed[static_cast<size_t>(s) * nq + qh]));
              if (!same || gb != co.stats[qh].bypass) continue;
              ++out_checked;
              for (int e = 0; e < d; ++e)
                out_diff = std::max(out_diff, static_cast<double>(std::fabs(go[(static_cast<size_t>(s) * nq + qh) * d + e] -
                                                                            co.out[static_cast<size_t>(qh) * d + e])));
            }
          }
        }
      }
      table_diff(diff, top);
      std::printf("%s: %d steps, bypassed %d of %d head-steps (GPU agrees on %d), lists equal %d of %d, mean Jaccard "
                  "%.5f, max |out GPU - CPU| %.3g over %d head-steps with equal lists, final max |table diff| %.3g "
                  "of %.3g\n",
                  what.c_str(), kSteps, bypassed, rows, agree, same_lists, lists, jac / lists, out_diff, out_checked,
                  diff, top);
      EXPECT_GE(agree, rows - rows / 100);
      EXPECT_GT(jac / lists, 0.995);
      EXPECT_GE(out_checked, rows / 2);
      EXPECT_LE(out_diff, 2e-3);
      EXPECT_LE(diff, 1e-3 * top);
      if (eps < 0.85) {  // some heads bypass, some do not
        EXPECT_GT(bypassed, 0);
        EXPECT_LT(bypassed, rows);
      }
    }
  }
}
