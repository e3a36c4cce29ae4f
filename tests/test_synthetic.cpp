// The synthetic workload keeps what docs/workload.md promises: same seed -> same cache and
// queries (any thread count), sinks and the recent band hold mass, the concentration knob
// moves the top-p token fraction monotonically, bad options throw Error naming the value.
// Nothing here is timed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/bench.h"
#include "cumulus/eval/membw.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/kv/kv_cache.h"
#include "kernel_check.h"

namespace cumulus {
namespace {

SyntheticOptions small_options(const char* shape = "smollm2-135m", int n_tokens = 4096) {
  SyntheticOptions o;
  o.shape = shape_preset(shape);
  o.n_tokens = n_tokens;
  o.n_steps = 4;
  o.seed = 7;
  return o;
}

// All stored K and V bytes of (layer, kv head), as floats.
std::vector<float> cache_dump(const KvCache& kv, int layer) {
  const Shape& s = kv.shape();
  std::vector<float> out, row(s.head_dim);
  for (int h = 0; h < s.n_kv_heads; ++h)
    for (int t = 0; t < kv.n_tokens(layer); ++t) {
      kv.key_f32(layer, h, t, row.data());
      out.insert(out.end(), row.begin(), row.end());
      kv.value_f32(layer, h, t, row.data());
      out.insert(out.end(), row.begin(), row.end());
    }
  return out;
}

TEST(Synthetic, ShapePresets) {
  const Shape l = shape_preset("llama3-8b");
  EXPECT_EQ(l.n_q_heads, 32);
  EXPECT_EQ(l.n_kv_heads, 8);
  EXPECT_EQ(l.head_dim, 128);
  const Shape s = shape_preset("smollm2-135m", 2);
  EXPECT_EQ(s.n_layers, 2);
  EXPECT_EQ(s.n_q_heads, 9);
  EXPECT_EQ(s.n_kv_heads, 3);
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_THROW(shape_preset("gpt2"), Error);
}

TEST(Synthetic, SameSeedSameCacheAndQueriesAnyThreads) {
  SyntheticOptions o = small_options();
  o.shape.n_layers = 2;
  ThreadPool p1(1), p2(2);
  KvCache a(o.shape), b(o.shape);
  const SyntheticWorkload wa = synthetic_generate(o, a, p1);
  const SyntheticWorkload wb = synthetic_generate(o, b, p2);
  ASSERT_EQ(wa.queries.size(), static_cast<size_t>(2) * o.n_steps * o.shape.n_q_heads * o.shape.head_dim);
  ASSERT_EQ(wa.queries.size(), wb.queries.size());
  EXPECT_EQ(std::memcmp(wa.queries.data(), wb.queries.data(), wa.queries.size() * sizeof(float)), 0);
  for (int l = 0; l < 2; ++l) {
    ASSERT_EQ(a.n_tokens(l), o.n_tokens);
    const std::vector<float> da = cache_dump(a, l), db = cache_dump(b, l);
    ASSERT_EQ(da.size(), db.size());
    EXPECT_EQ(std::memcmp(da.data(), db.data(), da.size() * sizeof(float)), 0) << "layer " << l;
  }
  // Not all zeros, and layers differ.
  double n2 = 0;
  for (float x : wa.queries) n2 += static_cast<double>(x) * x;
  EXPECT_GT(n2, 0.0);
  EXPECT_NE(cache_dump(a, 0), cache_dump(a, 1));

  // Another seed gives another workload.
  SyntheticOptions o2 = o;
  o2.seed = 8;
  KvCache c(o.shape);
  const SyntheticWorkload wc = synthetic_generate(o2, c, p2);
  EXPECT_NE(wa.queries, wc.queries);
}

TEST(Synthetic, SinksHoldMass) {
  for (const char* shape : {"smollm2-135m", "llama3-8b"}) {
    SyntheticOptions o = small_options(shape);
    ThreadPool pool(2);
    KvCache kv(o.shape);
    const SyntheticWorkload w = synthetic_generate(o, kv, pool);
    const AttentionProfile p = attention_profile(kv, w, 0, 0.9, pool);
    // 4 of 4096 tokens (0.1%) hold about sink_mass of the softmax mass.
    EXPECT_GT(p.sink_mass, 0.5 * o.sink_mass) << shape;
    EXPECT_LT(p.sink_mass, 1.5 * o.sink_mass) << shape;

    // Without the sink component they hold about their share of tokens.
    o.sink_mass = 0;
    KvCache kv0(o.shape);
    const SyntheticWorkload w0 = synthetic_generate(o, kv0, pool);
    EXPECT_LT(attention_profile(kv0, w0, 0, 0.9, pool).sink_mass, 0.02) << shape;
  }
}

TEST(Synthetic, RecentBandHoldsMass) {
  SyntheticOptions o = small_options();
  ThreadPool pool(2);
  KvCache kv(o.shape);
  const SyntheticWorkload w = synthetic_generate(o, kv, pool);
  const AttentionProfile p = attention_profile(kv, w, 0, 0.9, pool);
  // The last recent_window = 64 tokens are 1.6% of 4096 and hold several times that.
  const double token_share = static_cast<double>(o.recent_window) / o.n_tokens;
  EXPECT_GT(p.recent_mass, 2.0 * token_share);

  o.recent_mass = 0.3;
  KvCache kv_more(o.shape);
  const SyntheticWorkload w_more = synthetic_generate(o, kv_more, pool);
  EXPECT_GT(attention_profile(kv_more, w_more, 0, 0.9, pool).recent_mass, p.recent_mass + 0.05);
}

TEST(Synthetic, ConcentrationMovesTopPFractionMonotonically) {
  ThreadPool pool(2);
  for (const char* shape : {"smollm2-135m", "llama3-8b"}) {
    double prev = 1.1;
    for (double c : {0.25, 0.5, 1.0, 2.0, 4.0}) {
      SyntheticOptions o = small_options(shape);
      o.concentration = c;
      KvCache kv(o.shape);
      const SyntheticWorkload w = synthetic_generate(o, kv, pool);
      const AttentionProfile p = attention_profile(kv, w, 0, 0.9, pool);
      EXPECT_LT(p.topp_fraction, prev) << shape << " concentration=" << c;
      EXPECT_LE(p.topp_fraction_p10, p.topp_fraction_p50);
      EXPECT_LE(p.topp_fraction_p50, p.topp_fraction_p90);
      prev = p.topp_fraction;
    }
    // The range is wide: diffuse at 0.25, a small share of tokens at 4.
    EXPECT_LT(prev, 0.02) << shape;
  }
}

// The page level's figures on a cache worked by hand: one kv head, two query heads, four
// pages whose keys are all alike within a page (so the page bound is each token's score):
// page 0 holds e0, page 1 e1, pages 2 and 3 -(e0 + e1); head 0 asks 10 e0, head 1 9 e1. The
// expected masses come from the scores in closed form, not from the code.
TEST(Synthetic, PageLevelFiguresOnAHandWorkedCache) {
  constexpr int d = 8, page = 16;
  const Shape shape{1, 2, 1, d};
  KvCache kv(shape, KvCacheOptions{page, DType::f16, 64});
  std::vector<float> k(64 * d, 0.0f), v(64 * d, 0.5f);
  for (int t = 0; t < 64; ++t) {
    float* row = &k[static_cast<size_t>(t) * d];
    if (t < 16) row[0] = 1;
    else if (t < 32) row[1] = 1;
    else row[0] = row[1] = -1;
  }
  kv.append(0, k.data(), v.data(), 64);
  std::vector<float> q(2 * d, 0.0f);
  q[0] = 10;      // head 0
  q[d + 1] = 9;   // head 1
  ThreadPool pool(1);
  const AttentionProfile a = attention_profile(kv, 0, q.data(), 1, nullptr, 0, 0, 0.9, pool);
  const double s = 1 / std::sqrt(static_cast<double>(d));
  // Per head, the weight of one token of each page relative to the head's largest score.
  auto shares = [&](double own, double other, double neg) {  // scores of pages 0/1 (own, other), 2/3
    const double mx = own;
    const double w_own = std::exp(s * own - s * mx), w_other = std::exp(s * other - s * mx),
                 w_neg = std::exp(s * neg - s * mx);
    const double z = 16 * (w_own + w_other + 2 * w_neg);
    return std::vector<double>{16 * w_own / z, 16 * w_other / z, 16 * w_neg / z};
  };
  const std::vector<double> h0 = shares(10, 0, -10), h1 = shares(9, 0, -9);
  // Pages 2 and 3 (largest share h1[2] each) fit in 1 - p = 0.1; the next, page 1 (its
  // largest share head 1's h1[0]), does not.
  ASSERT_LT(2 * h1[2], 0.1);
  ASSERT_GT(h1[0], 0.1);
  EXPECT_DOUBLE_EQ(a.page_admissible, 0.5);
  // One page kept at either budget (1/8 and 1/4 of four, rounded up): page 0, whose largest
  // share (head 0's) beats page 1's (head 1's).
  ASSERT_GT(h0[0], h1[0]);
  for (int b = 0; b < 2; ++b) {
    EXPECT_NEAR(a.page_keep_mass[b], (h0[0] + h1[1 /* page 0 is head 1's "other" */]) / 2, 1e-6) << b;
    EXPECT_DOUBLE_EQ(a.page_keep_reach[b], 0.5) << b;  // head 0 reaches 0.9, head 1 does not
  }
  // The 1-bit sketch: channels 0 and 1 have mean -0.25 over the 64 keys; pages 0 and 1 lie
  // above it on both, pages 2 and 3 below. So both heads estimate pages 0 and 1 alike, and
  // the earlier tokens win the tie: 1/8 of 64 keeps tokens 0-7 (half of page 0), 1/4 all of
  // page 0.
  EXPECT_NEAR(a.bit1_keep_mass[0], (h0[0] + h1[1]) / 4, 1e-6);
  EXPECT_DOUBLE_EQ(a.bit1_keep_reach[0], 0.0);
  EXPECT_NEAR(a.bit1_keep_mass[1], (h0[0] + h1[1]) / 2, 1e-6);
  EXPECT_DOUBLE_EQ(a.bit1_keep_reach[1], 0.5);
}

TEST(Synthetic, QueriesHaveEveryDtype) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    SyntheticOptions o = small_options();
    ThreadPool pool(1);
    KvCacheOptions ko;
    ko.dtype = t;
    KvCache kv(o.shape, ko);
    const SyntheticWorkload w = synthetic_generate(o, kv, pool);
    const AttentionProfile p = attention_profile(kv, w, 0, 0.9, pool);
    EXPECT_GT(p.sink_mass, 0.1) << dtype_name(t);
    EXPECT_GT(p.topp_fraction, 0.0) << dtype_name(t);
  }
}

TEST(Synthetic, BadParametersThrow) {
  ThreadPool pool(1);
  auto expect_error = [&](SyntheticOptions o, const char* needle) {
    KvCache kv(shape_preset("smollm2-135m"));
    try {
      synthetic_generate(o, kv, pool);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  SyntheticOptions o = small_options();
  {
    auto b = o;
    b.concentration = 0;
    expect_error(b, "concentration=0");
  }
  {
    auto b = o;
    b.concentration = 100;
    expect_error(b, "concentration=100");
  }
  {
    auto b = o;
    b.n_tokens = 0;
    expect_error(b, "n_tokens=0");
  }
  {
    auto b = o;
    b.n_steps = 0;
    expect_error(b, "n_steps=0");
  }
  {
    auto b = o;
    b.sink_mass = 1.5;
    expect_error(b, "sink_mass=1.5");
  }
  {
    auto b = o;
    b.recent_window = 0;
    expect_error(b, "recent_window=0");
  }
  {
    auto b = o;
    b.head_correlation = -0.1;
    expect_error(b, "head_correlation=-0.1");
  }
  {
    auto b = o;
    b.relevant_clusters = 0;
    expect_error(b, "relevant_clusters=0");
  }
  {
    auto b = o;
    b.shape = shape_preset("llama3-8b");  // cache is smollm2
    expect_error(b, "differs from options.shape");
  }
  // A cache that already holds tokens.
  {
    KvCache kv(o.shape);
    synthetic_generate(o, kv, pool);
    EXPECT_THROW(synthetic_generate(o, kv, pool), Error);
  }
  // Profile and query accessors.
  KvCache kv(o.shape);
  const SyntheticWorkload w = synthetic_generate(o, kv, pool);
  EXPECT_THROW(attention_profile(kv, w, 0, 0.0, pool), Error);
  EXPECT_THROW(attention_profile(kv, w, 1, 0.9, pool), Error);
  EXPECT_THROW(w.query(0, o.n_steps), Error);
}

TEST(Bench, BadOptionsThrow) {
  auto expect_error = [](BenchOptions o, const char* needle) {
    try {
      o.validate();
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  BenchOptions o;
  EXPECT_NO_THROW(o.validate());
  {
    auto b = o;
    b.context = 1000;
    expect_error(b, "context=1000");
  }
  {
    auto b = o;
    b.shape = "llama9";
    expect_error(b, "shape='llama9'");
  }
  {
    auto b = o;
    b.methods = {"dense", "nope"};
    expect_error(b, "method='nope'");
  }
  {
    auto b = o;
    b.methods = {"oracle_topk"};
    b.params["oracle_topk"]["k"] = "0";
    expect_error(b, "k=0");
  }
  {
    auto b = o;
    b.methods = {"oracle_topk"};
    b.params["streaming"]["window"] = "10";
    expect_error(b, "streaming");
  }
  {
    auto b = o;
    b.threads = 0;
    expect_error(b, "threads=0");
  }
}

// A small run end to end: the report is complete and the accuracy numbers (not the times)
// keep the methods' promises.
TEST(Bench, SmallRunReportsEveryMethod) {
  BenchOptions o;
  o.shape = "smollm2-135m";
  o.context = 4096;
  o.methods = {"oracle_topp", "oracle_topk"};
  o.params["oracle_topk"]["k"] = "256";
  o.steps = 2;
  o.warmup = 0;
  o.repeats = 1;
  o.membw_bytes = size_t{64} << 20;
  o.evict_bytes = size_t{4} << 20;
  const BenchReport r = bench_run(o);
  ASSERT_EQ(r.methods.size(), 3u);
  EXPECT_EQ(r.methods[0].method, "dense");  // always first: the speedup reference
  EXPECT_NEAR(r.methods[0].mass_true, 1.0, 1e-5);
  EXPECT_NEAR(r.methods[0].bytes_fraction, 1.0, 1e-9);
  EXPECT_LT(r.methods[0].rel_err, 1e-5);
  EXPECT_EQ(r.methods[1].method, "oracle_topp");
  EXPECT_GE(r.methods[1].mass_true, 0.9 - 1e-4);
  EXPECT_EQ(r.methods[2].method, "oracle_topk");
  EXPECT_EQ(r.methods[2].params.at("k"), "256");
  EXPECT_GT(r.membw.gbps_median, 0.0);
  for (const auto& m : r.methods) {
    EXPECT_GT(m.ms_median, 0.0);
    EXPECT_GT(m.bw_ref_gbps, 0.0);  // each method's own reference, measured around its timing
    EXPECT_DOUBLE_EQ(m.bw_fraction, m.gbps / m.bw_ref_gbps);
  }
  const std::string table = bench_table(r);
  EXPECT_NE(table.find("oracle_topk"), std::string::npos);
  const std::string json = bench_json(r);
  EXPECT_NE(json.find("\"read_bandwidth_gbps\""), std::string::npos);
  EXPECT_NE(json.find("\"speedup_vs_dense\""), std::string::npos);
}

// The bandwidth probe keeps its buffer across measurements (the benchmarks measure before
// and after every row); each measurement returns the samples asked for, and bad sizes and
// counts are errors that name the value.
TEST(MemBw, ProbeMeasuresRepeatedlyAndRejectsBadInput) {
  using check::expect_error;
  ThreadPool pool(2);
  MemBwProbe probe(pool, size_t{64} << 20);
  for (int repeats : {1, 3}) {
    const MemBwResult r = probe.measure(0, repeats);
    EXPECT_EQ(r.bytes, size_t{64} << 20);
    EXPECT_EQ(r.threads, 2);
    EXPECT_EQ(r.gbps_plain.size(), static_cast<size_t>(repeats));
    EXPECT_EQ(r.gbps_prefetch.size(), static_cast<size_t>(repeats));
    EXPECT_GT(r.gbps_median, 0.0);
  }
  expect_error([&] { probe.measure(-1, 3); }, "warmup=-1");
  expect_error([&] { probe.measure(0, 0); }, "repeats=0");
  expect_error([&] { MemBwProbe small(pool, size_t{1} << 20); }, "bytes=1048576");
}

}  // namespace
}  // namespace cumulus
