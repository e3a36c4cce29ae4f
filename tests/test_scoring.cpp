// Scoring ops: the SIMD backend against the float64 reference on fresh random caches of
// awkward sizes (1, 3, 15, 16, 17, 255, 4097 tokens), every storage dtype, 1..8 queries
// (token scores and the group form of the page bound) and every SIMD target this binary
// carries; Quest's bound is >= q.k of every stored key
// in its page; the mean score is q . (mean of the stored keys); bad input names the value.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kv/kv_cache.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

using check::expect_error;
using check::for_each_target;

// float32 against float64 accumulation: |cpu - ref| / sum_j |q_j x_j| stays below this.
// A float32 dot product of d <= 256 terms has worst-case relative error about d * 2^-24
// (1.5e-5 at d = 256); the random inputs here sit far below that.
constexpr double kTol = 1e-5;

// Runs fn once per SIMD target compiled into the binary and supported by this CPU.
// A one-layer, one-kv-head cache of n random tokens (never zero), appended in uneven
// chunks so pages fill across several appends.
KvCache random_cache(int n, int head_dim, DType dt, int page_size, std::mt19937& rng) {
  KvCacheOptions opt;
  opt.dtype = dt;
  opt.page_size = page_size;
  KvCache kv(Shape{1, 1, 1, head_dim}, opt);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k, v;
  int done = 0;
  while (done < n) {
    const int m = std::min(n - done, 1 + static_cast<int>(rng() % 700));
    k.resize(static_cast<size_t>(m) * head_dim);
    v.resize(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = nd(rng) + 0.3f * static_cast<float>(i % 5);
      v[i] = nd(rng);
    }
    kv.append(0, k.data(), v.data(), m);
    done += m;
  }
  return kv;
}

std::vector<float> random_q(int n_q, int head_dim, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n_q) * head_dim);
  for (auto& x : q) x = nd(rng);
  return q;
}

// Stored keys of the cache in float32. [n_tokens][head_dim]
std::vector<float> stored_keys(const KvCache& kv) {
  const int n = kv.n_tokens(0), d = kv.shape().head_dim;
  std::vector<float> keys(static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t) kv.key_f32(0, 0, t, keys.data() + static_cast<size_t>(t) * d);
  return keys;
}

struct Case {
  int n_tokens;
  int head_dim;
  DType dtype;
  int page_size;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  for (int n : {1, 3, 15, 16, 17, 255, 4097}) {
    for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
      c.push_back({n, 128, dt, 16});
      c.push_back({n, 24, dt, n % 2 ? 1 : 256});  // 24: not a multiple of 16 lanes
    }
  }
  c.push_back({300, 8, DType::f16, 16});
  c.push_back({300, 256, DType::bf16, 16});
  return c;
}

std::string name(const Case& c) {
  return "n=" + std::to_string(c.n_tokens) + " d=" + std::to_string(c.head_dim) + " " +
         std::string(dtype_name(c.dtype)) + " page_size=" + std::to_string(c.page_size);
}

// sum_j max(|q_j kmin_j|, |q_j kmax_j|) over page p: the scale of the bound's rounding error.
double bound_norm(const PagedHeadView& v, const float* q, int p) {
  double norm = 0;
  for (int j = 0; j < v.head_dim; ++j) {
    const size_t m = static_cast<size_t>(p) * v.head_dim + j;
    norm += std::max(std::fabs(q[j] * v.kmin[m]), std::fabs(q[j] * v.kmax[m]));
  }
  return norm;
}

}  // namespace

TEST(Scoring, PageScoresMatchReference) {
  std::mt19937 rng(1234);
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    KvCache kv = random_cache(c.n_tokens, c.head_dim, c.dtype, c.page_size, rng);
    const PagedHeadView v = kv.view(0, 0);
    const int np = v.n_pages(), d = c.head_dim;
    const std::vector<float> q = random_q(1, d, rng);
    std::vector<float> ref_b(np), ref_m(np);
    ref::page_score_bound(v, q.data(), ref_b.data());
    ref::page_score_mean(v, q.data(), ref_m.data());
    for_each_target([&] {
      std::vector<float> cpu_b(np, NAN), cpu_m(np, NAN);
      cpu::page_score_bound(v, q.data(), cpu_b.data());
      cpu::page_score_mean(v, q.data(), cpu_m.data());
      for (int p = 0; p < np; ++p) {
        double norm_m = 0;
        for (int j = 0; j < d; ++j) norm_m += std::fabs(q[j] * v.kmean[static_cast<size_t>(p) * d + j]);
        ASSERT_LE(std::fabs(cpu_b[p] - ref_b[p]), kTol * bound_norm(v, q.data(), p)) << "page " << p;
        ASSERT_LE(std::fabs(cpu_m[p] - ref_m[p]), kTol * norm_m) << "page " << p;
      }
    });
  }
}

// The group form scores every query of a GQA group in one pass over the metadata; each
// query's row must match the float64 reference for that query alone (1..8 queries: tiles
// of 4, 3, 2 and 1; page counts that leave the 4-page steps a remainder).
TEST(Scoring, GroupPageBoundMatchesReference) {
  std::mt19937 rng(4321);
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    KvCache kv = random_cache(c.n_tokens, c.head_dim, c.dtype, c.page_size, rng);
    const PagedHeadView v = kv.view(0, 0);
    const int np = v.n_pages(), d = c.head_dim;
    for (int n_q : {1, 2, 3, 4, 5, 8}) {
      SCOPED_TRACE("n_q=" + std::to_string(n_q));
      const std::vector<float> q = random_q(n_q, d, rng);
      for_each_target([&] {
        std::vector<float> cpu_b(static_cast<size_t>(n_q) * np, NAN), ref_b(np);
        cpu::page_score_bound(v, q.data(), n_q, cpu_b.data());
        for (int h = 0; h < n_q; ++h) {
          const float* qh = q.data() + static_cast<size_t>(h) * d;
          ref::page_score_bound(v, qh, ref_b.data());
          for (int p = 0; p < np; ++p)
            ASSERT_LE(std::fabs(cpu_b[static_cast<size_t>(h) * np + p] - ref_b[p]), kTol * bound_norm(v, qh, p))
                << "query " << h << " page " << p;
        }
      });
    }
  }
}

// The group form of the mean score, each query's row against the float64 reference.
TEST(Scoring, GroupPageMeanMatchesReference) {
  std::mt19937 rng(2468);
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    KvCache kv = random_cache(c.n_tokens, c.head_dim, c.dtype, c.page_size, rng);
    const PagedHeadView v = kv.view(0, 0);
    const int np = v.n_pages(), d = c.head_dim;
    for (int n_q : {1, 3, 4, 8}) {
      SCOPED_TRACE("n_q=" + std::to_string(n_q));
      const std::vector<float> q = random_q(n_q, d, rng);
      std::vector<float> ref_m(static_cast<size_t>(n_q) * np);
      ref::page_score_mean(v, q.data(), n_q, ref_m.data());
      for_each_target([&] {
        std::vector<float> cpu_m(static_cast<size_t>(n_q) * np, NAN);
        cpu::page_score_mean(v, q.data(), n_q, cpu_m.data());
        for (int h = 0; h < n_q; ++h)
          for (int p = 0; p < np; ++p) {
            double norm = 0;
            for (int j = 0; j < d; ++j) norm += std::fabs(q[h * d + j] * v.kmean[static_cast<size_t>(p) * d + j]);
            const size_t i = static_cast<size_t>(h) * np + p;
            ASSERT_LE(std::fabs(cpu_m[i] - ref_m[i]), kTol * norm) << "query " << h << " page " << p;
          }
      });
    }
  }
}

// score_max and score_exp against plain float64 loops (not the reference functions: the
// reference is one of the two things checked), lengths around the vector widths.
TEST(Scoring, SoftmaxPiecesMatchFloat64) {
  std::mt19937 rng(97);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  for (int n : {0, 1, 3, 15, 16, 17, 31, 33, 255, 4097}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = nd(rng);
    double want_max = -INFINITY;
    for (float v : x) want_max = std::max(want_max, static_cast<double>(v));
    const float scale = 0.125f, shift = n ? static_cast<float>(want_max * scale) : 0.0f;
    double want_sum = 0;
    std::vector<double> want(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) want_sum += (want[i] = std::exp(static_cast<double>(scale) * x[i] - shift));
    std::vector<float> got(static_cast<size_t>(n), NAN);
    EXPECT_EQ(ref::score_max(x.data(), n), static_cast<float>(want_max));
    EXPECT_NEAR(ref::score_exp(x.data(), n, scale, shift, got.data()), want_sum, 1e-12 * (1 + want_sum));
    for_each_target([&] {
      EXPECT_EQ(cpu::score_max(x.data(), n), static_cast<float>(want_max));
      std::fill(got.begin(), got.end(), NAN);
      // float32 exp: a few ulps per term.
      EXPECT_NEAR(cpu::score_exp(x.data(), n, scale, shift, got.data()), want_sum, 1e-5 * (1 + want_sum));
      for (int i = 0; i < n; ++i) ASSERT_NEAR(got[i], want[i], 1e-6 * (1 + want[i])) << "i=" << i;
    });
  }
}

TEST(Scoring, TokenScoresMatchReference) {
  std::mt19937 rng(99);
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    KvCache kv = random_cache(c.n_tokens, c.head_dim, c.dtype, c.page_size, rng);
    const PagedHeadView v = kv.view(0, 0);
    const std::vector<float> keys = stored_keys(kv);
    const int n = c.n_tokens, d = c.head_dim;
    for (int n_q : {1, 2, 3, 4, 5, 6, 7, 8, 11}) {
      SCOPED_TRACE("n_q=" + std::to_string(n_q));
      const std::vector<float> q = random_q(n_q, d, rng);
      // All tokens (idx null), and an index list out of order with repeats.
      std::vector<int32_t> idx(1 + rng() % n);
      for (auto& i : idx) i = static_cast<int32_t>(rng() % n);
      for (const bool use_idx : {false, true}) {
        const int m = use_idx ? static_cast<int>(idx.size()) : n;
        const int32_t* ip = use_idx ? idx.data() : nullptr;
        std::vector<float> ref_s(static_cast<size_t>(n_q) * m);
        ref::token_score(v, q.data(), n_q, ip, m, ref_s.data());
        std::vector<double> norm(ref_s.size());  // [n_q][m] sum_j |q_j k_j|
        for (int h = 0; h < n_q; ++h) {
          for (int i = 0; i < m; ++i) {
            const float* k = keys.data() + static_cast<size_t>(ip ? ip[i] : i) * d;
            double nrm = 0, exact = 0;
            for (int j = 0; j < d; ++j) {
              nrm += std::fabs(static_cast<double>(q[h * d + j]) * k[j]);
              exact += static_cast<double>(q[h * d + j]) * k[j];
            }
            const size_t o = static_cast<size_t>(h) * m + i;
            norm[o] = nrm;
            // The reference is the float64 dot product of the stored key, rounded once.
            ASSERT_EQ(ref_s[o], static_cast<float>(exact)) << "h=" << h << " i=" << i;
          }
        }
        for_each_target([&] {
          std::vector<float> cpu_s(ref_s.size(), NAN);
          cpu::token_score(v, q.data(), n_q, ip, m, cpu_s.data());
          for (size_t o = 0; o < ref_s.size(); ++o) {
            ASSERT_LE(std::fabs(cpu_s[o] - ref_s[o]), kTol * norm[o]) << "h=" << o / m << " i=" << o % m;
          }
        });
      }
    }
  }
}

TEST(Scoring, BoundIsAtLeastEveryScoreInItsPage) {
  std::mt19937 rng(7);
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    KvCache kv = random_cache(c.n_tokens, c.head_dim, c.dtype, c.page_size, rng);
    const PagedHeadView v = kv.view(0, 0);
    const std::vector<float> keys = stored_keys(kv);
    const int d = c.head_dim;
    for (int trial = 0; trial < 3; ++trial) {
      const std::vector<float> q = random_q(1, d, rng);
      std::vector<float> ref_b(v.n_pages()), cpu_b(v.n_pages());
      ref::page_score_bound(v, q.data(), ref_b.data());
      cpu::page_score_bound(v, q.data(), cpu_b.data());
      for (int t = 0; t < c.n_tokens; ++t) {
        double qk = 0, norm = 0;
        for (int j = 0; j < d; ++j) {
          qk += static_cast<double>(q[j]) * keys[static_cast<size_t>(t) * d + j];
          norm += std::fabs(static_cast<double>(q[j]) * keys[static_cast<size_t>(t) * d + j]);
        }
        const int p = t / c.page_size;
        // Exact for the reference: float products are exact in float64, each bound term is
        // >= the key's term, and rounded addition and the final rounding are monotone.
        ASSERT_GE(ref_b[p], static_cast<float>(qk)) << "token " << t;
        ASSERT_GE(cpu_b[p], qk - kTol * norm) << "token " << t;
      }
    }
  }
}

TEST(Scoring, MeanScoreIsQueryDotMeanOfStoredKeys) {
  std::mt19937 rng(8);
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    KvCache kv = random_cache(c.n_tokens, c.head_dim, c.dtype, c.page_size, rng);
    const PagedHeadView v = kv.view(0, 0);
    const std::vector<float> keys = stored_keys(kv);
    const int d = c.head_dim;
    const std::vector<float> q = random_q(1, d, rng);
    std::vector<float> ref_m(v.n_pages()), cpu_m(v.n_pages());
    ref::page_score_mean(v, q.data(), ref_m.data());
    cpu::page_score_mean(v, q.data(), cpu_m.data());
    for (int p = 0; p < v.n_pages(); ++p) {
      double s = 0, norm = 0;
      for (int j = 0; j < d; ++j) {
        double mean = 0;
        for (int t = p * c.page_size; t < p * c.page_size + v.page_len(p); ++t) mean += keys[static_cast<size_t>(t) * d + j];
        mean /= v.page_len(p);
        s += q[j] * mean;
        norm += std::fabs(q[j] * mean);
      }
      // The means are stored as float32, so even the reference is off by that rounding.
      ASSERT_LE(std::fabs(ref_m[p] - s), 1e-6 * norm) << "page " << p;
      ASSERT_LE(std::fabs(cpu_m[p] - s), kTol * norm) << "page " << p;
    }
  }
}

TEST(Scoring, BadInputNamesTheValue) {
  std::mt19937 rng(5);
  KvCache kv = random_cache(20, 32, DType::f16, 16, rng);
  const PagedHeadView v = kv.view(0, 0);
  const std::vector<float> q = random_q(2, 32, rng);
  std::vector<float> s(64);
  const int32_t bad_idx[] = {0, 5, 20};
  const int32_t neg_idx[] = {-1};
  // Both backends check the same way.
  for (int backend = 0; backend < 2; ++backend) {
    auto token = backend ? cpu::token_score : ref::token_score;
    using BoundFn = void (*)(const PagedHeadView&, const float*, float*);
    auto bound = backend ? static_cast<BoundFn>(cpu::page_score_bound) : ref::page_score_bound;
    auto mean = backend ? static_cast<BoundFn>(cpu::page_score_mean) : static_cast<BoundFn>(ref::page_score_mean);
    expect_error([&] { token(v, q.data(), 2, bad_idx, 3, s.data()); }, "idx[2]=20 out of range [0, 20)");
    expect_error([&] { token(v, q.data(), 2, neg_idx, 1, s.data()); }, "idx[0]=-1");
    expect_error([&] { token(v, q.data(), 2, nullptr, -1, s.data()); }, "n=-1");
    expect_error([&] { token(v, q.data(), 2, nullptr, 21, s.data()); }, "n=21 exceeds kv.n_tokens=20");
    expect_error([&] { token(v, q.data(), 0, nullptr, 3, s.data()); }, "n_q=0");
    expect_error([&] { token(v, nullptr, 1, nullptr, 3, s.data()); }, "q must be non-null");
    expect_error([&] { token(v, q.data(), 1, nullptr, 3, nullptr); }, "scores must be non-null");
    expect_error([&] { bound(v, nullptr, s.data()); }, "page_score_bound: q must be non-null");
    expect_error([&] { mean(v, q.data(), nullptr); }, "page_score_mean: scores must be non-null");
    PagedHeadView broken = v;
    broken.kmin = nullptr;
    expect_error([&] { bound(broken, q.data(), s.data()); }, "kv.kmin must be non-null");
    broken = v;
    broken.head_dim = 12;
    expect_error([&] { mean(broken, q.data(), s.data()); }, "kv.head_dim=12");
    // Nothing to score is not an error.
    token(v, q.data(), 2, nullptr, 0, nullptr);
  }
  expect_error([&] { cpu::page_score_bound(v, q.data(), 0, s.data()); }, "n_q=0");
  expect_error([&] { cpu::page_score_mean(v, q.data(), 0, s.data()); }, "n_q=0");
  expect_error([&] { cpu::page_score_mean(v, q.data(), 2, nullptr); }, "page_score_mean: scores must be non-null");
  expect_error([&] { cpu::score_exp(s.data(), 3, 1.0f, 0.0f, nullptr); }, "score_exp: n=3");
  expect_error([&] { ref::score_max(nullptr, 2); }, "score_max: n=2");
  expect_error([&] { cpu::page_score_bound(v, q.data(), 2, nullptr); }, "page_score_bound: scores must be non-null");
}
