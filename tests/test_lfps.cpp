// lfps keeps its promises (LFPS (Learn from the Past), Algorithm 1, Eq. 4-10, Appendix B): the sink bypass fires
// when the sink token holds more than epsilon of the true mass and not when it holds
// little, and then outputs the mean value vector; the vertical and slash tables each sum to
// 0.5 / (1 - r) after prefill and after every one of 1,000 decode steps (Eq. 15); the
// first `sinks` tokens are always attended and the top-k never exceeds the budget; with
// budget = n (and the bypass off) it equals dense; missing prompt queries and bad
// parameters name the value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "cumulus/core/error.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/registry.h"
#include "methods/lfps/lfps_tables.h"

using namespace cumulus;

namespace {

struct Fixture {
  Shape shape;
  KvCache kv;
  std::vector<float> q;         // [n_q_heads][head_dim], the decode query
  std::vector<float> prompt_q;  // [rows][n_q_heads][head_dim]
  int rows = 0;
  std::vector<float> centres;
  std::mt19937 rng;
};

void append_tokens(Fixture& f, int n_tokens) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int d = f.shape.head_dim, n_centres = static_cast<int>(f.centres.size()) / d;
  std::vector<float> k(static_cast<size_t>(f.shape.n_kv_heads) * d), v(k.size());
  for (int t = 0; t < n_tokens; ++t) {
    for (int h = 0; h < f.shape.n_kv_heads; ++h) {
      const int c = static_cast<int>(f.rng() % n_centres);
      for (int j = 0; j < d; ++j) {
        k[h * d + j] = 0.8f * f.centres[c * d + j] + 0.6f * nd(f.rng);
        v[h * d + j] = nd(f.rng) + 0.1f;
      }
    }
    f.kv.append(0, k.data(), v.data(), 1);
  }
}

// Keys around 16 centres; each head's decode query and its prompt queries are noisy
// copies of one random direction, so the past attention predicts the present.
Fixture make_fixture(Shape shape, int n_tokens, uint32_t seed, float q_gain = 2.0f, int rows = 32) {
  Fixture f{shape, KvCache(shape), {}, {}, rows, {}, std::mt19937(seed)};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int d = shape.head_dim;
  f.centres.resize(static_cast<size_t>(16) * d);
  for (auto& c : f.centres) c = nd(f.rng);
  append_tokens(f, n_tokens);
  std::vector<float> base(static_cast<size_t>(shape.n_q_heads) * d);
  for (auto& x : base) x = q_gain * nd(f.rng);
  f.q.resize(base.size());
  for (size_t i = 0; i < base.size(); ++i) f.q[i] = base[i] + 0.2f * nd(f.rng);
  f.prompt_q.resize(static_cast<size_t>(rows) * base.size());
  for (int r = 0; r < rows; ++r)
    for (size_t i = 0; i < base.size(); ++i) f.prompt_q[r * base.size() + i] = base[i] + 0.2f * nd(f.rng);
  return f;
}

std::unique_ptr<DecodeMethod> prefilled(const Fixture& f, const std::map<std::string, std::string>& params,
                                        ThreadPool& pool) {
  auto m = Registry::builtin().make("lfps", f.shape, params);
  DecodeContext ctx{&pool, false};
  ctx.prompt_q = f.prompt_q.data();
  ctx.prompt_q_rows = f.rows;
  m->on_prefill(0, f.kv, ctx);
  return m;
}

// float64 share of the softmax mass of query head qh on token 0.
double sink_share(const Fixture& f, int qh) {
  const int d = f.shape.head_dim, kvh = qh / f.shape.group(), n = f.kv.n_tokens(0);
  std::vector<double> s(n);
  std::vector<float> key(d);
  for (int t = 0; t < n; ++t) {
    f.kv.key_f32(0, kvh, t, key.data());
    double dot = 0;
    for (int j = 0; j < d; ++j) dot += static_cast<double>(f.q[qh * d + j]) * key[j];
    s[t] = dot / std::sqrt(static_cast<double>(d));
  }
  const double mx = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (double x : s) sum += std::exp(x - mx);
  return std::exp(s[0] - mx) / sum;
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

TEST(Lfps, BypassFiresWhenTheSinkHoldsMoreThanEpsilon) {
  // Token 0's key is rebuilt along each kv head's query so that it takes a chosen share of
  // the mass: with a sink gain of 0 the sink is an ordinary token; with a large gain it
  // holds > 95% of the mass.
  const Shape s{1, 4, 4, 32};
  for (float sink_gain : {0.0f, 0.08f, 0.3f}) {
    Fixture f = make_fixture(s, 1200, 3, 1.0f);
    // Rebuild the cache with a chosen sink key: token 0 = gain * q (of the head's query).
    KvCache kv(s);
    const int d = s.head_dim;
    std::vector<float> k(static_cast<size_t>(s.n_kv_heads) * d), v(k.size());
    for (int t = 0; t < f.kv.n_tokens(0); ++t) {
      for (int h = 0; h < s.n_kv_heads; ++h) {
        f.kv.key_f32(0, h, t, k.data() + h * d);
        f.kv.value_f32(0, h, t, v.data() + h * d);
        if (t == 0 && sink_gain > 0)
          for (int j = 0; j < d; ++j) k[h * d + j] = sink_gain * f.q[h * d + j] * d;
      }
      kv.append(0, k.data(), v.data(), 1);
    }
    f.kv = std::move(kv);
    ThreadPool pool(2);
    auto m = prefilled(f, {}, pool);
    DecodeContext ctx{&pool, true};
    AttnOutput out;
    decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
    AttnOutput dense;
    decode_step(*Registry::builtin().make("dense", s), 0, f.q.data(), f.kv, ctx, dense);
    for (int qh = 0; qh < s.n_q_heads; ++qh) {
      const double share = sink_share(f, qh);
      const auto& tb = methods::lfps_tables(*m, 0, qh);
      SCOPED_TRACE(::testing::Message() << "sink_gain=" << sink_gain << " head " << qh << " true sink share "
                                        << share << " rho " << tb.rho);
      if (share > 0.95) {
        EXPECT_TRUE(out.stats[qh].bypass);
        EXPECT_EQ(out.stats[qh].tokens_attended, 0);
        // The output is the mean value vector of the prompt.
        std::vector<double> mean(d, 0.0);
        std::vector<float> val(d);
        for (int t = 0; t < f.kv.n_tokens(0); ++t) {
          f.kv.value_f32(0, qh, t, val.data());
          for (int j = 0; j < d; ++j) mean[j] += val[j];
        }
        for (int j = 0; j < d; ++j) EXPECT_NEAR(out.out[qh * d + j], mean[j] / f.kv.n_tokens(0), 1e-5);
        // out_err stays the distance to dense.
        double e2 = 0;
        for (int j = 0; j < d; ++j) e2 += std::pow(out.out[qh * d + j] - dense.out[qh * d + j], 2);
        EXPECT_NEAR(out.stats[qh].out_err, std::sqrt(e2), 1e-5);
        EXPECT_TRUE(std::isnan(out.stats[qh].mass_true)) << "a bypassed head attended no set";
      } else if (share < 0.5) {
        EXPECT_FALSE(out.stats[qh].bypass);
        EXPECT_GE(out.stats[qh].tokens_attended, 4);  // the sinks at least (flat tables: only them)
      }
      EXPECT_TRUE(std::isnan(out.stats[qh].mass_claimed));
      // The estimate (Eq. 6) tracks the true share on these Gaussian keys.
      EXPECT_NEAR(tb.rho, share, 0.15);
    }
  }
}

TEST(Lfps, TablesSumToHalfOverOneMinusROverAThousandSteps) {
  const Shape s{1, 4, 2, 32};
  Fixture f = make_fixture(s, 600, 17);
  const double r = 0.95, want = 0.5 / (1 - r);
  ThreadPool pool(2);
  auto m = prefilled(f, {{"budget", "24"}}, pool);
  auto check = [&](int step) {
    for (int qh = 0; qh < s.n_q_heads; ++qh) {
      const auto& tb = methods::lfps_tables(*m, 0, qh);
      const double sv = std::accumulate(tb.vertical.begin(), tb.vertical.end(), 0.0);
      const double ss = std::accumulate(tb.slash.begin(), tb.slash.end(), 0.0);
      ASSERT_NEAR(sv, want, 1e-12 * want) << "vertical, step " << step << " head " << qh;
      ASSERT_NEAR(ss, want, 1e-12 * want) << "slash, step " << step << " head " << qh;
      for (int i = 0; i < 4; ++i) ASSERT_EQ(tb.vertical[i], 0.0) << "sink entries stay out of the tables";
    }
  };
  check(0);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  DecodeContext ctx{&pool, false};
  AttnOutput out;
  int bypassed = 0;
  long attended = 0;
  for (int step = 1; step <= 1000; ++step) {
    append_tokens(f, 1);
    m->on_append(0, f.kv.n_tokens(0) - 1, f.kv);
    for (auto& x : f.q) x += 0.05f * nd(f.rng);  // the query drifts slowly
    decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
    for (int h = 0; h < s.n_kv_heads; ++h) {
      const auto& t = out.selection.tokens[h];
      bool any_active = false;
      for (int j = 0; j < s.group(); ++j) any_active |= !out.stats[h * s.group() + j].bypass;
      if (!any_active) continue;
      ASSERT_GE(t.size(), 4u);
      for (int i = 0; i < 4; ++i) ASSERT_EQ(t[i], i) << "the first four tokens are always attended";
      ASSERT_LE(t.size(), 4u + 24u * s.group()) << "top-k exceeds the budget";
    }
    for (const auto& st : out.stats) bypassed += st.bypass, attended += st.tokens_attended;
    check(step);
  }
  std::printf("lfps: %d of %d head-steps bypassed over 1000 steps, %.1f tokens attended per head-step\n", bypassed,
              1000 * s.n_q_heads, static_cast<double>(attended) / (1000 * s.n_q_heads));
  EXPECT_GT(attended, 1000L * s.n_q_heads * 8) << "the tables should yield candidates beyond the sinks";
}

// The kv heads run as pool tasks: 1, 2 and 3 threads give the same outputs, selections
// and tables, step after step.
TEST(Lfps, ThreadCountDoesNotChangeResults) {
  const Shape s{1, 8, 4, 32};
  std::vector<std::vector<float>> outs[3];
  std::vector<Selection> sels[3];
  std::vector<double> tables[3];
  for (int threads = 1; threads <= 3; ++threads) {
    Fixture f = make_fixture(s, 700, 23);
    ThreadPool pool(threads);
    auto m = prefilled(f, {{"budget", "40"}}, pool);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    DecodeContext ctx{&pool, false};
    AttnOutput out;
    for (int step = 0; step < 30; ++step) {
      append_tokens(f, 1);
      m->on_append(0, f.kv.n_tokens(0) - 1, f.kv);
      for (auto& x : f.q) x += 0.05f * nd(f.rng);
      decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
      outs[threads - 1].push_back(out.out);
      sels[threads - 1].push_back(out.selection);
    }
    for (int qh = 0; qh < s.n_q_heads; ++qh) {
      const auto& tb = methods::lfps_tables(*m, 0, qh);
      tables[threads - 1].insert(tables[threads - 1].end(), tb.vertical.begin(), tb.vertical.end());
      tables[threads - 1].insert(tables[threads - 1].end(), tb.slash.begin(), tb.slash.end());
    }
  }
  ASSERT_FALSE(tables[0].empty());
  for (int t = 1; t < 3; ++t) {
    EXPECT_EQ(outs[t], outs[0]) << t + 1 << " threads";
    for (size_t step = 0; step < sels[0].size(); ++step)
      EXPECT_EQ(sels[t][step].tokens, sels[0][step].tokens) << t + 1 << " threads, step " << step;
    EXPECT_EQ(tables[t], tables[0]) << t + 1 << " threads";
  }
}

TEST(Lfps, AtFullBudgetEqualsDense) {
  for (const Shape& s : {Shape{1, 4, 4, 32}, Shape{1, 8, 2, 64}, Shape{1, 9, 3, 64}}) {
    Fixture f = make_fixture(s, 333, 9);
    ThreadPool pool(2);
    auto m = prefilled(f, {{"budget", "333"}, {"epsilon", "1"}}, pool);
    DecodeContext ctx{&pool, true};
    AttnOutput out, dense;
    decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
    decode_step(*Registry::builtin().make("dense", s), 0, f.q.data(), f.kv, ctx, dense);
    EXPECT_LT(rel_err(out.out, dense.out), 1e-5);
    for (const auto& st : out.stats) EXPECT_EQ(st.tokens_attended, 333);
  }
}

TEST(Lfps, SelectsFromThePastsPatterns) {
  // With queries that repeat the prompt's, the candidates drawn from the tables should
  // recover most of the exact top-k (LFPS's Figure 2a reports ~85% overlap on real models).
  const Shape s{1, 4, 4, 32};
  Fixture f = make_fixture(s, 2000, 23, 2.5f);
  ThreadPool pool(2);
  auto m = prefilled(f, {{"budget", "40"}, {"epsilon", "1"}}, pool);
  DecodeContext ctx{&pool, true};
  AttnOutput out, opt;
  decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
  decode_step(*Registry::builtin().make("oracle_topk", s, {{"k", "44"}}), 0, f.q.data(), f.kv, ctx, opt);
  for (int qh = 0; qh < s.n_q_heads; ++qh) {
    const std::set<int32_t> got(out.selection.tokens[qh].begin(), out.selection.tokens[qh].end());
    int hit = 0;
    for (int32_t t : opt.selection.tokens[qh]) hit += static_cast<int>(got.count(t));
    EXPECT_GE(hit, 44 / 2) << "head " << qh;
    EXPECT_GT(out.stats[qh].mass_true, 0.5 * opt.stats[qh].mass_true) << "head " << qh;
  }
}

TEST(Lfps, BadInputNamesTheValue) {
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
  expect_error([&] { r.make("lfps", s, {{"a", "0"}}); }, "a=0");
  expect_error([&] { r.make("lfps", s, {{"r", "1"}}); }, "r=1");
  expect_error([&] { r.make("lfps", s, {{"r", "-0.1"}}); }, "r=-0.1");
  expect_error([&] { r.make("lfps", s, {{"epsilon", "1.5"}}); }, "epsilon=1.5");
  expect_error([&] { r.make("lfps", s, {{"s", "0"}}); }, "s=0");
  expect_error([&] { r.make("lfps", s, {{"budget", "-1"}}); }, "budget=-1");
  expect_error([&] { r.make("lfps", s, {{"budget_ratio", "0"}}); }, "budget_ratio=0");
  expect_error([&] { r.make("lfps", s, {{"sinks", "0"}}); }, "sinks=0");

  Fixture f = make_fixture(s, 100, 1);
  ThreadPool pool(1);
  auto m = r.make("lfps", s);
  DecodeContext ctx{&pool, false};
  AttnOutput out;
  expect_error([&] { decode_step(*m, 0, f.q.data(), f.kv, ctx, out); }, "before on_prefill");
  expect_error([&] { m->on_prefill(0, f.kv, ctx); }, "prompt_q");
  ctx.prompt_q = f.prompt_q.data();
  ctx.prompt_q_rows = 101;
  expect_error([&] { m->on_prefill(0, f.kv, ctx); }, "prompt_q_rows=101");
}

// As tactic: its tables are the prompt's; decode after a cut asks for on_prefill again.
TEST(Lfps, DecodeAfterTheCacheLostTokensAsksForOnPrefill) {
  Fixture f = make_fixture({1, 8, 2, 64}, 600, 43);
  ThreadPool pool(2);
  auto m = prefilled(f, {}, pool);
  DecodeContext ctx{&pool, false};
  AttnOutput out;
  decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
  f.kv.truncate(590);
  try {
    decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
    ADD_FAILURE() << "decode over a cut cache did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lost tokens since on_prefill"), std::string::npos) << e.what();
  }
}
