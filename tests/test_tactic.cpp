// tactic keeps its promises (Tactic, section 4, Table 1): on peaked synthetic caches the true
// mass it achieves is within 0.05 of P on a stated share of head-steps; with true scores
// in cluster order (mode=cluster_optimal) it reaches P on every head-step and never beats
// the optimal set's size; at P = 1 both modes equal dense; tokens appended after prefill
// are attended densely until recluster_interval of them have been clustered; runs repeat
// exactly; bad parameters name the value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <random>
#include <set>

#include "cumulus/core/error.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/registry.h"
#include "methods/tactic/tactic_fit.h"

using namespace cumulus;

#ifdef CUMULUS_SANITIZED
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

namespace {

struct Fixture {
  Shape shape;
  KvCache kv;
  std::vector<float> q;  // [n_q_heads][head_dim]
  std::vector<float> centres;
  std::mt19937 rng;
};

// Keys around n_centres random centres (what clustering exploits), values random, and a
// query per head that prefers one centre: a peaked but not degenerate softmax.
void append_tokens(Fixture& f, int n_tokens, int n_centres) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int d = f.shape.head_dim;
  std::vector<float> k(static_cast<size_t>(f.shape.n_kv_heads) * d), v(k.size());
  for (int t = 0; t < n_tokens; ++t) {
    for (int h = 0; h < f.shape.n_kv_heads; ++h) {
      const int c = static_cast<int>(f.rng() % n_centres);
      for (int j = 0; j < d; ++j) {
        k[h * d + j] = 0.8f * f.centres[c * d + j] + 0.6f * nd(f.rng);
        v[h * d + j] = nd(f.rng);
      }
    }
    f.kv.append(0, k.data(), v.data(), 1);
  }
}

Fixture make_fixture(Shape shape, int n_tokens, uint32_t seed, float q_gain = 3.0f, int n_centres = 32) {
  Fixture f{shape, KvCache(shape), {}, {}, std::mt19937(seed)};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int d = shape.head_dim;
  f.centres.resize(static_cast<size_t>(n_centres) * d);
  for (auto& c : f.centres) c = nd(f.rng);
  append_tokens(f, n_tokens, n_centres);
  f.q.resize(static_cast<size_t>(shape.n_q_heads) * d);
  for (int h = 0; h < shape.n_q_heads; ++h)
    for (int j = 0; j < d; ++j)
      f.q[h * d + j] = q_gain * (f.centres[(h % n_centres) * d + j] + 0.5f * nd(f.rng)) / std::sqrt(2.0f);
  return f;
}

// A heavy-tailed rather than cliff-like softmax, closer to Tactic's Figure 7: keys around
// 64 centres (unit variance per dimension), each query a random direction of norm
// sigma * sqrt(head_dim), so q.k / sqrt(d) has standard deviation about sigma over the
// cache and the weights are roughly log-normal. sigma = 3 puts about half the mass on 0.2%
// of the tokens and 90% on 3-5%, the sparsity Table 1 reports for Llama-3.1.
Fixture make_lognormal_fixture(Shape shape, int n_tokens, uint32_t seed, float sigma) {
  Fixture f{shape, KvCache(shape), {}, {}, std::mt19937(seed)};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int d = shape.head_dim, n_centres = 64;
  f.centres.resize(static_cast<size_t>(n_centres) * d);
  for (auto& c : f.centres) c = nd(f.rng);
  append_tokens(f, n_tokens, n_centres);
  f.q.resize(static_cast<size_t>(shape.n_q_heads) * d);
  for (auto& x : f.q) x = sigma * nd(f.rng);
  return f;
}

AttnOutput run(const std::string& method, const Fixture& f, const std::map<std::string, std::string>& params,
               int threads = 2) {
  auto m = Registry::builtin().make(method, f.shape, params);
  ThreadPool pool(threads);
  DecodeContext ctx{&pool, true};
  m->on_prefill(0, f.kv, ctx);
  AttnOutput out;
  decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
  return out;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST(Tactic, RegisteredWithThePapersDefaults) {
  const MethodInfo& m = Registry::builtin().find("tactic");
  std::map<std::string, std::string> defaults;
  for (const auto& p : m.params) defaults[p.name] = p.default_value;
  EXPECT_EQ(defaults["cluster_size"], "16");
  EXPECT_EQ(defaults["max_iter"], "10");
  EXPECT_EQ(defaults["p1"], "0.1");
  EXPECT_EQ(defaults["p2"], "0.6");
  EXPECT_EQ(defaults["recluster_interval"], "2048");
  EXPECT_EQ(defaults["mode"], "fit");
}

TEST(Tactic, AchievedMassNearTargetOnMostHeadSteps) {
  // MHA (group 1), so each head's attended set is its own choice and its true mass is what
  // Algorithm 1 aimed at; 4096-token heavy-tailed caches (sigma 2.5 and 3), 6 caches x 8
  // heads = 48 head-steps per target, 240 in all. Stated promise: |true - P| <= 0.05 on at
  // least 40% of head-steps at every target and on at least 55% of all 240, and the mean
  // achieved mass within 0.05 of P at every target. Measured when written:
  // 25, 21, 29, 37, 45 of 48 for P = 0.5..0.9 (157/240), mean true mass 0.474, 0.574,
  // 0.688, 0.795, 0.912, with 2.3-3.3x the optimal set's tokens (Table 1 of the paper:
  // 2.2-2.6x, and its achieved mass overshoots low targets: 66% at P = 50%).
  const Shape s{1, 8, 8, 64};
  // Under the sanitizers (10-50x slower) two caches per target: the same checks on 16
  // head-steps per target; the release build runs all six.
  const uint32_t kSeeds = kSanitized ? 2 : 6;
  int close_all = 0, total_all = 0;
  for (double p : {0.5, 0.6, 0.7, 0.8, 0.9}) {
    int close = 0, total = 0, success = 0;
    double mean_true = 0;
    long tokens = 0, tokens_opt = 0;
    for (uint32_t seed = 1; seed <= kSeeds; ++seed) {
      Fixture f = make_lognormal_fixture(s, 4096, 1000 + seed, seed % 2 ? 2.5f : 3.0f);
      AttnOutput out = run("tactic", f, {{"p", std::to_string(p)}});
      AttnOutput opt = run("oracle_topp", f, {{"p", std::to_string(p)}});
      for (int qh = 0; qh < s.n_q_heads; ++qh) {
        ++total;
        mean_true += out.stats[qh].mass_true;
        if (std::abs(out.stats[qh].mass_true - p) <= 0.05) ++close;
        if (out.stats[qh].mass_true >= p) ++success;
        tokens += out.stats[qh].tokens_attended;
        tokens_opt += opt.stats[qh].tokens_attended;
      }
    }
    mean_true /= total;
    close_all += close;
    total_all += total;
    std::printf("tactic P=%.1f: |true-P|<=0.05 on %d/%d head-steps, true>=P on %d, mean true %.3f, tokens %ld "
                "(optimal %ld)\n",
                p, close, total, success, mean_true, tokens / total, tokens_opt / total);
    EXPECT_GE(close, 0.4 * total) << "P=" << p;
    EXPECT_NEAR(mean_true, p, 0.05) << "P=" << p;
    EXPECT_LT(tokens, 4096L * total / 2) << "not sparse at P=" << p;
  }
  EXPECT_GE(close_all, 0.55 * total_all);
}

TEST(Tactic, ClusterOptimalReachesPAndNeverBeatsOptimal) {
  for (const Shape& s : {Shape{1, 8, 8, 64}, Shape{1, 8, 2, 64}, Shape{1, 9, 3, 32}}) {
    Fixture f = make_fixture(s, 3001, 77);
    for (double p : {0.5, 0.8, 0.95}) {
      AttnOutput out = run("tactic", f, {{"p", std::to_string(p)}, {"mode", "cluster_optimal"}});
      AttnOutput opt = run("oracle_topp", f, {{"p", std::to_string(p)}});
      for (int qh = 0; qh < s.n_q_heads; ++qh) {
        EXPECT_GE(out.stats[qh].mass_claimed, p - 1e-9);
        EXPECT_GE(out.stats[qh].mass_true, p - 1e-4) << "head " << qh;
        EXPECT_GE(out.stats[qh].tokens_attended + 1, opt.stats[qh].tokens_attended) << "head " << qh;
      }
    }
  }
}

// sinks / recent (ours, off by default): those tokens are attended on every head-step and
// enter the estimate exactly, so with true scores (cluster_optimal) every head still
// reaches P; with every token a sink tactic is dense.
TEST(Tactic, SinksAndRecentAreAlwaysAttended) {
  for (const Shape& s : {Shape{1, 8, 2, 64}, Shape{1, 9, 3, 32}}) {
    Fixture f = make_fixture(s, 3001, 78);
    const int n = f.kv.n_tokens(0);
    const std::map<std::string, std::string> extra{{"sinks", "4"}, {"recent", "64"}};
    const AttnOutput dense = run("dense", f, {});
    for (const char* mode : {"fit", "cluster_optimal"}) {
      std::map<std::string, std::string> params{{"p", "0.5"}, {"mode", mode}};
      params.insert(extra.begin(), extra.end());
      const AttnOutput out = run("tactic", f, params);
      for (int h = 0; h < s.n_kv_heads; ++h) {
        const std::set<int32_t> sel(out.selection.tokens[h].begin(), out.selection.tokens[h].end());
        for (int t = 0; t < 4; ++t) EXPECT_TRUE(sel.count(t)) << mode << " kv head " << h << " sink " << t;
        for (int t = n - 64; t < n; ++t) EXPECT_TRUE(sel.count(t)) << mode << " kv head " << h << " recent " << t;
        EXPECT_LT(sel.size(), static_cast<size_t>(n) / 2) << mode;
      }
      for (int qh = 0; qh < s.n_q_heads; ++qh) {
        if (std::string(mode) == "cluster_optimal") {
          EXPECT_GE(out.stats[qh].mass_true, 0.5 - 1e-4) << "head " << qh;
        }
        EXPECT_GE(out.stats[qh].tokens_attended, 68);
      }
      // Every clustered token a sink: the list is empty, all n tokens are the dense tail.
      const AttnOutput all = run("tactic", f, {{"p", "0.5"}, {"mode", mode}, {"sinks", std::to_string(n)}});
      for (int h = 0; h < s.n_kv_heads; ++h) EXPECT_EQ(all.selection.tokens[h].size(), static_cast<size_t>(n)) << mode;
      EXPECT_LT(rel_err(all.out, dense.out), 1e-5) << mode;
    }
  }
}

TEST(Tactic, AtFullMassEqualsDense) {
  for (const Shape& s : {Shape{1, 4, 4, 32}, Shape{1, 8, 2, 64}, Shape{1, 9, 3, 64}}) {
    for (int n : {17, 300, 2000}) {
      Fixture f = make_fixture(s, n, 9);
      AttnOutput dense = run("dense", f, {});
      for (const char* mode : {"fit", "cluster_optimal"}) {
        AttnOutput out = run("tactic", f, {{"p", "1"}, {"mode", mode}});
        EXPECT_LT(rel_err(out.out, dense.out), 1e-5) << mode << " n=" << n;
        for (const auto& st : out.stats) EXPECT_EQ(st.tokens_attended, n);
      }
    }
  }
}

TEST(Tactic, TailIsDenseUntilReclustered) {
  const Shape s{1, 4, 2, 32};
  Fixture f = make_fixture(s, 1000, 5);
  auto m = Registry::builtin().make("tactic", s, {{"p", "0.3"}, {"recluster_interval", "256"}});
  ThreadPool pool(2);
  DecodeContext ctx{&pool, true};
  m->on_prefill(0, f.kv, ctx);
  AttnOutput out;
  for (int step = 1; step <= 300; ++step) {
    append_tokens(f, 1, 32);
    m->on_append(0, f.kv.n_tokens(0) - 1, f.kv);
    decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
    for (int h = 0; h < s.n_kv_heads; ++h) {
      const std::set<int32_t> sel(out.selection.tokens[h].begin(), out.selection.tokens[h].end());
      // Before step 256 every appended token is in the tail; at step 256 tokens
      // [1000, 1256) are clustered, and from then on only [1256, n) is guaranteed.
      const int tail_begin = step < 256 ? 1000 : 1256;
      for (int t = tail_begin; t < f.kv.n_tokens(0); ++t) ASSERT_TRUE(sel.count(t)) << "step " << step << " token " << t;
      if (step >= 256) {
        int kept = 0;
        for (int t = 1000; t < 1256; ++t) kept += static_cast<int>(sel.count(t));
        EXPECT_LT(kept, 256) << "step " << step << ": clustered tokens should compete, not all be kept";
      }
    }
    for (const auto& st : out.stats) EXPECT_GE(st.mass_true, st.tokens_attended > 0 ? 0.0 : 1.0);
  }
}

TEST(Tactic, RunsRepeatAndThreadsDoNotMatter) {
  Fixture f = make_fixture({1, 8, 2, 64}, 2500, 8);
  AttnOutput a = run("tactic", f, {}, 1), b = run("tactic", f, {}, 2);
  EXPECT_EQ(a.selection.tokens, b.selection.tokens);
  EXPECT_EQ(a.out, b.out);
  AttnOutput c = run("tactic", f, {{"seed", "5"}}, 2);
  EXPECT_GT(c.selection.total(), 0u);
}

TEST(Tactic, BadParametersNameTheValue) {
  const Shape s{1, 8, 2, 64};
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, wanted one mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const Registry& r = Registry::builtin();
  expect_error([&] { r.make("tactic", s, {{"p", "0"}}); }, "p=0");
  expect_error([&] { r.make("tactic", s, {{"p", "1.2"}}); }, "p=1.2");
  expect_error([&] { r.make("tactic", s, {{"cluster_size", "0"}}); }, "cluster_size=0");
  expect_error([&] { r.make("tactic", s, {{"max_iter", "0"}}); }, "max_iter=0");
  expect_error([&] { r.make("tactic", s, {{"recluster_interval", "-3"}}); }, "recluster_interval=-3");
  expect_error([&] { r.make("tactic", s, {{"mode", "optimal"}}); }, "mode='optimal'");
  expect_error([&] { r.make("tactic", s, {{"p1", "0.7"}, {"p2", "0.6"}}); }, "p1=0.7");
  Fixture f = make_fixture(s, 50, 1);
  auto m = r.make("tactic", s);
  ThreadPool pool(1);
  DecodeContext ctx{&pool, false};
  AttnOutput out;
  expect_error([&] { decode_step(*m, 0, f.q.data(), f.kv, ctx, out); }, "before on_prefill");
}

// A cut followed by appends (the same token count, other tokens) leaves the clusters
// describing tokens the cache no longer holds: decode says so instead of selecting from
// them; on_prefill again rebuilds them.
TEST(Tactic, DecodeAfterTheCacheLostTokensAsksForOnPrefill) {
  Fixture f = make_fixture({1, 8, 2, 64}, 600, 41);
  auto m = Registry::builtin().make("tactic", f.shape, {});
  ThreadPool pool(2);
  DecodeContext ctx{&pool, false};
  m->on_prefill(0, f.kv, ctx);
  AttnOutput out;
  decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
  f.kv.truncate(500);
  append_tokens(f, 100, 32);
  try {
    decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
    ADD_FAILURE() << "decode over a cut cache did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lost tokens since on_prefill"), std::string::npos) << e.what();
  }
  m->on_prefill(0, f.kv, ctx);
  EXPECT_NO_THROW(decode_step(*m, 0, f.q.data(), f.kv, ctx, out));
}

// Algorithm 1's estimates past the exactly scored head, w_i = max(0, a / (i + 1) + b), are
// summed in closed form (tactic_fit.h): against adding them one by one in float64, for
// curves of every sign (decreasing to zero and below, increasing from below zero, all
// positive, none), the sums agree to 1e-9 of the total and the budget is the same position
// unless the target lies within that rounding of a prefix.
TEST(TacticFit, ClosedFormSumsEqualTheEstimatesAddedOneByOne) {
  std::mt19937 rng(4);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> h;
  tactic_harmonic(h, 40000);
  int checked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int L = 1 + static_cast<int>(rng() % 40000);
    const int n0 = static_cast<int>(rng() % static_cast<unsigned>(L));
    // a: the scale of the head's weights; b: where the curve crosses zero, if it does.
    const double a = u(rng) * 50.0;
    const double b = u(rng) * std::abs(a) / (1.0 + (rng() % static_cast<unsigned>(L)));
    const TacticFit fit(a, b, n0, L, h.data());
    std::vector<double> prefix(static_cast<size_t>(L - n0) + 1, 0.0);
    for (int i = n0; i < L; ++i) prefix[i - n0 + 1] = prefix[i - n0] + std::max(0.0, a / (i + 1) + b);
    const double total = prefix.back();
    const double tol = 1e-9 * std::max(total, 1e-300);
    SCOPED_TRACE(::testing::Message() << "L=" << L << " n0=" << n0 << " a=" << a << " b=" << b);
    for (int m : {n0, n0 + (L - n0) / 3, L}) ASSERT_NEAR(fit.sum(m), prefix[m - n0], tol);
    ASSERT_GE(fit.s, n0);
    ASSERT_LE(fit.e, L);
    if (total <= 0) continue;
    for (double p : {0.1, 0.5, 0.9, 0.999}) {
      const double known = 0.25 * total;
      const double target = known + p * total;
      const int k = fit.first_reaching(known, target);
      int want = n0;
      while (want < L && known + prefix[want - n0] < target) ++want;
      // They differ only where the target lies within rounding of the prefix between them.
      ASSERT_LE(std::abs(k - want), 1);
      if (k != want) {
        ASSERT_NEAR(known + prefix[std::min(k, want) - n0], target, tol);
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 800);
}
