// Decode attention: the SIMD backend (on every SIMD target this binary carries) against the
// float64 reference on fresh random caches of awkward sizes (1, 3, 15, 16, 17, 255, 4097
// tokens), GQA groups 1, 2, 3, 4, 8, storage dtypes f32, f16, bf16 and page sizes 1, 16,
// 64; bit-identical results for 1, 2 and 3 threads; sparse attention equals dense
// attention over a cache holding only the selected tokens; mass = exp(lse - lse_ref);
// bad input is a cumulus::Error that names the value.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/attention.h"
#include "kernel_check.h"

using namespace cumulus;
using namespace cumulus::attn_test;

namespace {

using check::expect_error;
using check::for_each_target;
using check::norm_err;
using check::max_abs_err;

// Tolerances, float32 accumulation against float64:
//   out: ||cpu - ref|| / ||ref|| over all heads. Scores carry about dim * 2^-24 relative
//        error each, the online-softmax sums about log2(n) * 2^-24; 2e-5 leaves a margin
//        over the ~1e-6 seen on these inputs.
//   lse: absolute error; lse has magnitude ~|scale q.k| <= ~20 here.
constexpr double kOutTol = 2e-5;
constexpr double kLseTol = 2e-5;

// Outputs of one call; NaN-filled so an unwritten lane fails the comparison.
struct AttnResult {
  std::vector<float> out, lse, mass;
  AttnResult(int n_q, int dim)
      : out(static_cast<size_t>(n_q) * dim, std::numeric_limits<float>::quiet_NaN()),
        lse(n_q, std::numeric_limits<float>::quiet_NaN()),
        mass(n_q, std::numeric_limits<float>::quiet_NaN()) {}
};

DecodeAttnArgs make_args(const AttnTestCache& c, int group, const std::vector<float>& q, AttnResult& r) {
  DecodeAttnArgs a;
  a.kv = c.views.data();
  a.n_kv_heads = c.n_kv();
  a.group = group;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  a.q = q.data();
  a.out = r.out.data();
  a.lse = r.lse.data();
  return a;
}

void expect_close(const AttnResult& got, const AttnResult& want, const std::string& what) {
  EXPECT_LE(norm_err(got.out, want.out), kOutTol) << what;
  EXPECT_LE(max_abs_err(got.lse, want.lse), kLseTol) << what;
}

void expect_identical(const AttnResult& a, const AttnResult& b, const std::string& what) {
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0) << what;
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)), 0) << what;
}

const int kTokenCounts[] = {1, 3, 15, 16, 17, 255, 4097};
const int kGroups[] = {1, 2, 3, 4, 8};
const DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};
const int kPageSizes[] = {1, 16, 64};

}  // namespace

TEST(AttentionRef, SingleTokenReturnsItsValue) {
  std::mt19937 rng(11);
  AttnTestCache c = attn_cache_random({1}, 16, DType::f32, 16, rng);
  const std::vector<float> q = attn_random_q(2, 16, rng);
  AttnResult r(2, 16);
  DecodeAttnArgs a = make_args(c, 2, q, r);
  ref::attention_decode_dense(a);
  const float* k = static_cast<const float*>(c.views[0].key(0));
  const float* v = static_cast<const float*>(c.views[0].value(0));
  for (int g = 0; g < 2; ++g) {
    double dot = 0.0;
    for (int j = 0; j < 16; ++j) dot += static_cast<double>(q[g * 16 + j]) * k[j];
    EXPECT_NEAR(r.lse[g], a.scale * dot, 1e-6);
    for (int j = 0; j < 16; ++j) EXPECT_EQ(r.out[g * 16 + j], v[j]);
  }
}

TEST(AttentionDense, MatchesReferenceAllSizesGroupsDtypes) {
  std::mt19937 rng(1234);
  ThreadPool pool(2);
  int case_no = 0;
  for (DType dt : kDTypes) {
    for (int n : kTokenCounts) {
      for (int group : kGroups) {
        const int page_size = kPageSizes[case_no % 3];
        // head_dim 128 mostly; 24 and 8 exercise the 8-lane path of AVX-512 builds.
        const int dim = (case_no % 7 == 3) ? 24 : (case_no % 11 == 5) ? 8 : 128;
        ++case_no;
        const int n_kv = 2;
        // Heads of different lengths: the second head has n or n + 5 tokens.
        AttnTestCache c = attn_cache_random({n, n + (case_no % 2) * 5}, dim, dt, page_size, rng);
        const std::vector<float> q = attn_random_q(n_kv * group, dim, rng);
        AttnResult want(n_kv * group, dim);
        ref::attention_decode_dense(make_args(c, group, q, want));
        const std::string what = fmt::format("dtype={} n={} group={} page_size={} head_dim={}", dtype_name(dt), n,
                                             group, page_size, dim);
        for_each_target([&] {
          AttnResult got(n_kv * group, dim);
          cpu::attention_decode_dense(make_args(c, group, q, got), pool);
          expect_close(got, want, what);
        });
      }
    }
  }
}

TEST(AttentionDense, ThreadCountDoesNotChangeBits) {
  std::mt19937 rng(77);
  for (DType dt : kDTypes) {
    AttnTestCache c = attn_cache_random({4097, 3000, 17}, 128, dt, 16, rng);
    const int group = 4;
    const std::vector<float> q = attn_random_q(3 * group, 128, rng);
    ThreadPool p1(1), p2(2), p3(3);
    AttnResult r1(3 * group, 128), r2(3 * group, 128), r3(3 * group, 128);
    cpu::attention_decode_dense(make_args(c, group, q, r1), p1);
    cpu::attention_decode_dense(make_args(c, group, q, r2), p2);
    cpu::attention_decode_dense(make_args(c, group, q, r3), p3);
    expect_identical(r1, r2, std::string("1 vs 2 threads ") + std::string(dtype_name(dt)));
    expect_identical(r1, r3, std::string("1 vs 3 threads ") + std::string(dtype_name(dt)));
  }
}

// Sparse attention = dense attention over a cache holding only the selected tokens (the
// equivalent mask), for both backends; lists of different lengths per head, some longer
// than one chunk of the SIMD backend.
TEST(AttentionSparse, EqualsDenseOverSelectedTokens) {
  std::mt19937 rng(99);
  ThreadPool pool(2);
  int case_no = 0;
  for (DType dt : kDTypes) {
    for (int n : {1, 17, 255, 4097}) {
      for (int group : {1, 3, 4, 8}) {
        const int page_size = kPageSizes[case_no % 3];
        ++case_no;
        const int n_kv = 3;
        AttnTestCache c = attn_cache_random({n, n, n}, 128, dt, page_size, rng);
        Selection sel;
        sel.tokens.push_back(attn_random_list(n, 0.6, rng));
        sel.tokens.push_back(attn_random_list(n, 0.1, rng));
        sel.tokens.push_back(attn_random_list(n, 1.0, rng));
        const std::vector<float> q = attn_random_q(n_kv * group, 128, rng);
        AttnTestCache sub = attn_cache_gather(c, sel, kPageSizes[(case_no + 1) % 3]);
        AttnResult want(n_kv * group, 128);
        ref::attention_decode_dense(make_args(sub, group, q, want));
        const std::string what =
            fmt::format("dtype={} n={} group={} page_size={}", dtype_name(dt), n, group, page_size);
        AttnResult got_ref(n_kv * group, 128);
        ref::attention_decode_sparse(make_args(c, group, q, got_ref), sel);
        EXPECT_LE(norm_err(got_ref.out, want.out), 1e-12) << what;
        EXPECT_LE(max_abs_err(got_ref.lse, want.lse), 1e-6) << what;
        for_each_target([&] {
          AttnResult got(n_kv * group, 128);
          cpu::attention_decode_sparse(make_args(c, group, q, got), sel, pool);
          expect_close(got, want, what);
        });
      }
    }
  }
}

TEST(AttentionSparse, ThreadCountDoesNotChangeBits) {
  std::mt19937 rng(5);
  AttnTestCache c = attn_cache_random({6000, 6000}, 64, DType::f16, 16, rng);
  Selection sel;
  sel.tokens.push_back(attn_random_list(6000, 0.7, rng));
  sel.tokens.push_back(attn_random_list(6000, 0.05, rng));
  const std::vector<float> q = attn_random_q(2 * 3, 64, rng);
  ThreadPool p1(1), p2(2);
  AttnResult r1(6, 64), r2(6, 64);
  cpu::attention_decode_sparse(make_args(c, 3, q, r1), sel, p1);
  cpu::attention_decode_sparse(make_args(c, 3, q, r2), sel, p2);
  expect_identical(r1, r2, "sparse 1 vs 2 threads");
}

TEST(AttentionSparse, EmptyListGivesZeroOutputAndMinusInfLse) {
  std::mt19937 rng(3);
  ThreadPool pool(2);
  AttnTestCache c = attn_cache_random({40, 40}, 32, DType::bf16, 16, rng);
  Selection sel;
  sel.tokens.push_back({});
  sel.tokens.push_back({0, 5, 39});
  const std::vector<float> q = attn_random_q(4, 32, rng);
  std::vector<float> lse_ref = {1.0f, 2.0f, 3.0f, 4.0f};
  auto check = [&](AttnResult& r) {
    for (int qh = 0; qh < 2; ++qh) {
      EXPECT_EQ(r.lse[qh], -std::numeric_limits<float>::infinity());
      EXPECT_EQ(r.mass[qh], 0.0f);
      for (int j = 0; j < 32; ++j) EXPECT_EQ(r.out[qh * 32 + j], 0.0f);
    }
    for (int qh = 2; qh < 4; ++qh) EXPECT_TRUE(std::isfinite(r.lse[qh]));
  };
  AttnResult rr(4, 32);
  DecodeAttnArgs a = make_args(c, 2, q, rr);
  a.lse_ref = lse_ref.data();
  a.mass = rr.mass.data();
  ref::attention_decode_sparse(a, sel);
  check(rr);
  for_each_target([&] {
    AttnResult rc(4, 32);
    DecodeAttnArgs b = make_args(c, 2, q, rc);
    b.lse_ref = lse_ref.data();
    b.mass = rc.mass.data();
    cpu::attention_decode_sparse(b, sel, pool);
    check(rc);
  });
}

// mass = exp(lse - lse_ref) with lse_ref from the dense pass: in (0, 1], equal to the
// share of the reference softmax held by the list, and 1 for the full list.
TEST(AttentionSparse, MassIsShareOfDenseSoftmax) {
  std::mt19937 rng(21);
  ThreadPool pool(2);
  const int n = 2000, group = 4, dim = 64;
  AttnTestCache c = attn_cache_random({n, n}, dim, DType::f16, 16, rng);
  const std::vector<float> q = attn_random_q(2 * group, dim, rng);
  AttnResult dense(2 * group, dim);
  ref::attention_decode_dense(make_args(c, group, q, dense));
  Selection sel;
  sel.tokens.push_back(attn_random_list(n, 0.3, rng));
  sel.tokens.emplace_back();
  for (int t = 0; t < n; ++t) sel.tokens[1].push_back(t);
  // True share from float64 probabilities over the stored keys.
  std::vector<double> share(2 * group, 0.0);
  for (int qh = 0; qh < 2 * group; ++qh) {
    const int h = qh / group;
    const auto& v = c.views[h];
    std::vector<double> s(n);
    double m = -1e300;
    for (int t = 0; t < n; ++t) {
      double dot = 0.0;
      for (int j = 0; j < dim; ++j)
        dot += static_cast<double>(q[qh * dim + j]) * f16_to_f32(static_cast<const uint16_t*>(v.key(t))[j]);
      s[t] = dot / std::sqrt(static_cast<double>(dim));
      m = std::max(m, s[t]);
    }
    double z = 0.0, in = 0.0;
    for (int t = 0; t < n; ++t) z += std::exp(s[t] - m);
    for (int t : sel.tokens[h]) in += std::exp(s[t] - m);
    share[qh] = in / z;
  }
  auto check = [&](const AttnResult& r, const std::string& what) {
    for (int qh = 0; qh < 2 * group; ++qh) {
      EXPECT_NEAR(r.mass[qh], std::exp(static_cast<double>(r.lse[qh]) - dense.lse[qh]), 1e-6) << what;
      EXPECT_NEAR(r.mass[qh], share[qh], 5e-5 * std::max(1.0, share[qh])) << what << " qh=" << qh;
      EXPECT_GT(r.mass[qh], 0.0f);
      EXPECT_LE(r.mass[qh], 1.0f + 5e-5f);
    }
  };
  AttnResult rr(2 * group, dim);
  DecodeAttnArgs a = make_args(c, group, q, rr);
  a.lse_ref = dense.lse.data();
  a.mass = rr.mass.data();
  ref::attention_decode_sparse(a, sel);
  check(rr, "ref");
  for_each_target([&] {
    AttnResult rc(2 * group, dim);
    DecodeAttnArgs b = make_args(c, group, q, rc);
    b.lse_ref = dense.lse.data();
    b.mass = rc.mass.data();
    cpu::attention_decode_sparse(b, sel, pool);
    check(rc, "cpu");
  });
}

TEST(AttentionValidate, BadInputNamesTheValue) {
  std::mt19937 rng(8);
  ThreadPool pool(2);
  AttnTestCache c = attn_cache_random({50, 50}, 16, DType::f16, 16, rng);
  std::vector<float> q = attn_random_q(4, 16, rng);
  AttnResult r(4, 16);
  const DecodeAttnArgs a = make_args(c, 2, q, r);

  // Each bad case through the validator and both backends.
  auto expect_all = [&](const DecodeAttnArgs& args, const Selection* sel, const std::string& needle) {
    expect_error([&] { attention_decode_validate(args, sel); }, needle);
    if (sel != nullptr) {
      expect_error([&] { ref::attention_decode_sparse(args, *sel); }, needle);
      expect_error([&] { cpu::attention_decode_sparse(args, *sel, pool); }, needle);
    } else {
      expect_error([&] { ref::attention_decode_dense(args); }, needle);
      expect_error([&] { cpu::attention_decode_dense(args, pool); }, needle);
    }
  };

  Selection unsorted{{{1, 7, 7, 9}, {0}}};
  expect_all(a, &unsorted, "sel.tokens[0][2]=7");
  Selection descending{{{3}, {4, 2}}};
  expect_all(a, &descending, "sel.tokens[1][1]=2");
  Selection too_big{{{1, 50}, {0}}};
  expect_all(a, &too_big, "sel.tokens[0][1]=50 is out of range [0, 50)");
  Selection negative{{{0}, {-3, 4}}};
  expect_all(a, &negative, "sel.tokens[1][0]=-3");
  Selection wrong_heads{{{0}}};
  expect_all(a, &wrong_heads, "sel.tokens.size()=1");

  std::vector<float> q_nan = q;
  q_nan[3 * 16 + 5] = std::numeric_limits<float>::quiet_NaN();
  DecodeAttnArgs b = a;
  b.q = q_nan.data();
  expect_all(b, nullptr, "q[3][5]=nan");
  std::vector<float> q_inf = q;
  q_inf[1 * 16 + 0] = -std::numeric_limits<float>::infinity();
  b.q = q_inf.data();
  expect_all(b, nullptr, "q[1][0]=-inf");

  AttnTestCache empty = attn_cache_alloc({50, 0}, 16, DType::f16, 16);
  b = make_args(empty, 2, q, r);
  expect_all(b, nullptr, "kv[1].n_tokens=0");

  b = a;
  b.scale = 0.0f;
  expect_all(b, nullptr, "scale=0");
  b.scale = std::numeric_limits<float>::quiet_NaN();
  expect_all(b, nullptr, "scale=nan");
  b = a;
  b.group = 0;
  expect_all(b, nullptr, "group=0");
  b = a;
  b.q = nullptr;
  expect_all(b, nullptr, "q must be non-null");
  b = a;
  b.lse = nullptr;
  expect_all(b, nullptr, "lse must be non-null");

  AttnTestCache odd = attn_cache_random({5, 5}, 16, DType::f16, 16, rng);
  odd.views[1].head_dim = 12;
  b = make_args(odd, 2, q, r);
  expect_all(b, nullptr, "kv[1].head_dim=12");
}

// The weighted value sum (a method's own weights over a list, no softmax) against the
// float64 reference: awkward list lengths, unsorted lists with repeats, 1..8 queries.
TEST(AttentionWeightedValues, MatchesReference) {
  std::mt19937 rng(4242);
  int case_no = 0;
  for (DType dt : kDTypes) {
    for (int n : {0, 1, 3, 15, 16, 17, 255, 4097}) {
      for (int n_q : {1, 2, 3, 4, 5, 8}) {
        const int dim = (case_no % 5 == 2) ? 24 : (case_no % 7 == 3) ? 64 : 128;
        const int page_size = kPageSizes[case_no % 3];
        ++case_no;
        AttnTestCache c = attn_cache_random({std::max(n, 40)}, dim, dt, page_size, rng);
        std::vector<int32_t> idx(static_cast<size_t>(n));
        for (auto& t : idx) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(std::max(n, 40)));
        std::uniform_real_distribution<float> ud(0.0f, 1.0f);
        std::vector<float> w(static_cast<size_t>(n_q) * n);
        for (auto& x : w) x = ud(rng);
        std::vector<float> want(static_cast<size_t>(n_q) * dim, NAN);
        ref::attention_weighted_values(c.views[0], idx.data(), n, w.data(), n_q, want.data());
        const std::string what = fmt::format("dtype={} n={} n_q={} dim={}", dtype_name(dt), n, n_q, dim);
        if (n > 0) {
          double norm = 0;
          for (float x : want) norm += static_cast<double>(x) * x;
          ASSERT_GT(norm, 0.0) << what;
        }
        for_each_target([&] {
          std::vector<float> got(want.size(), NAN);
          cpu::attention_weighted_values(c.views[0], idx.data(), n, w.data(), n_q, got.data());
          if (n == 0) {
            for (float x : got) ASSERT_EQ(x, 0.0f) << what;
          } else {
            EXPECT_LE(norm_err(got, want), kOutTol) << what;
          }
        });
      }
    }
  }
  AttnTestCache c = attn_cache_random({20}, 32, DType::f16, 16, rng);
  const int32_t bad[] = {3, 20};
  std::vector<float> w(4, 1.0f), out(64);
  for (auto fn : {cpu::attention_weighted_values, ref::attention_weighted_values}) {
    expect_error([&] { fn(c.views[0], bad, 2, w.data(), 1, out.data()); }, "idx[1]=20 out of range [0, 20)");
    expect_error([&] { fn(c.views[0], bad, 1, w.data(), 0, out.data()); }, "n_q=0");
    expect_error([&] { fn(c.views[0], bad, 1, nullptr, 1, out.data()); }, "idx and w must be non-null");
  }
}

TEST(AttentionDecode, GemmaHeadDim256) {
  // Gemma 3's shape: head_dim 256, 4 query heads over 1 kv head; dense over the
  // whole cache (global layers) and sparse over a 512-token window (local layers).
  std::mt19937 rng(256);
  ThreadPool pool(2);
  for (DType dt : kDTypes) {
    for (int n : {1, 17, 513, 4097}) {
      AttnTestCache c = attn_cache_random({n}, 256, dt, 16, rng);
      const std::vector<float> q = attn_random_q(4, 256, rng);
      const std::string what = fmt::format("dtype={} n={} head_dim=256 group=4", dtype_name(dt), n);
      AttnResult want(4, 256);
      ref::attention_decode_dense(make_args(c, 4, q, want));
      for_each_target([&] {
        AttnResult got(4, 256);
        cpu::attention_decode_dense(make_args(c, 4, q, got), pool);
        expect_close(got, want, what + " dense");
      });
      Selection window;
      window.tokens.emplace_back();
      for (int t = std::max(0, n - 512); t < n; ++t) window.tokens[0].push_back(t);
      AttnResult want_w(4, 256);
      ref::attention_decode_sparse(make_args(c, 4, q, want_w), window);
      for_each_target([&] {
        AttnResult got(4, 256);
        cpu::attention_decode_sparse(make_args(c, 4, q, got), window, pool);
        expect_close(got, want_w, what + " window");
      });
    }
  }
}
