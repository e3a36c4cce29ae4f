// GPU scoring, selection and k-means ops against the references (src/kernels/ref): page
// scores (Quest bound, mean key) and token scores on batches with scrambled page tables;
// sorts, top-k and top-mass sets on rows of awkward lengths with ties (the set and order
// rules of kernels/selection.h), including rows longer than the shared-memory sort; k-means
// assignment (checked as an argmin in float64), deterministic update, centroid scores.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "cuda_test_util.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/kmeans.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/kv/cuda_kv_cache.h"

using namespace cumulus;
using namespace cumulus::cuda_test;

TEST(CudaScoring, PageAndTokenScoresMatchReference) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(11);
  for (DType dt : {DType::f16, DType::bf16})
    for (int d : {64, 128, 256})
      for (int ps : {1, 16, 64}) {
        const int n_kv = 2, group = 3, n_q = n_kv * group;
        std::vector<KvCache> seqs;
        for (int n : {17, 255, 4097}) seqs.push_back(random_cache(n_kv, d, n, dt, ps, rng));
        cuda::DeviceKvCache dev = cuda::DeviceKvCache::upload(views_of(seqs), 99);
        const cuda::DeviceKvView kv = dev.view();
        const auto q = random_vec(seqs.size() * n_q * d, rng);
        cuda::DeviceBuffer qd = cuda::to_device(q);
        const size_t page_rows = seqs.size() * n_q * kv.max_pages;
        cuda::DeviceBuffer sb(page_rows * sizeof(float)), sm(page_rows * sizeof(float));
        cuda::page_score(kv, group, cuda::PageScoreKind::kBound, qd.as<float>(), sb.as<float>());
        cuda::page_score(kv, group, cuda::PageScoreKind::kMean, qd.as<float>(), sm.as<float>());
        const auto gb = cuda::to_host<float>(sb, page_rows), gm = cuda::to_host<float>(sm, page_rows);
        // Token scores over all tokens, and over a list of every third token.
        const int stride = kv.max_tokens;
        std::vector<int32_t> lens, flat(seqs.size() * n_kv * stride, 0);
        for (size_t s = 0; s < seqs.size(); ++s)
          for (int h = 0; h < n_kv; ++h) {
            int c = 0;
            for (int t = 2; t < seqs[s].n_tokens(0); t += 3) flat[(s * n_kv + h) * stride + c++] = t;
            lens.push_back(c);
          }
        cuda::DeviceBuffer idx = cuda::to_device(flat), len = cuda::to_device(lens);
        const size_t tok_rows = seqs.size() * n_q * stride;
        cuda::DeviceBuffer ta(tok_rows * sizeof(float)), tl(tok_rows * sizeof(float));
        cuda::token_score(kv, group, qd.as<float>(), nullptr, nullptr, 0, ta.as<float>(), stride);
        cuda::token_score(kv, group, qd.as<float>(), idx.as<int32_t>(), len.as<int32_t>(), stride, tl.as<float>(),
                          stride);
        const auto gta = cuda::to_host<float>(ta, tok_rows), gtl = cuda::to_host<float>(tl, tok_rows);
        for (size_t s = 0; s < seqs.size(); ++s)
          for (int qh = 0; qh < n_q; ++qh) {
            const PagedHeadView v = seqs[s].view(0, qh / group);
            const float* qv = q.data() + (s * n_q + qh) * d;
            const int np = v.n_pages();
            std::vector<float> rb(np), rm(np);
            ref::page_score_bound(v, qv, rb.data());
            ref::page_score_mean(v, qv, rm.data());
            const size_t row = (s * n_q + qh) * kv.max_pages;
            // float32 sums of ~d terms of size ~|q||k|/sqrt(d): absolute tolerance.
            for (int p = 0; p < np; ++p) {
              ASSERT_NEAR(gb[row + p], rb[p], 2e-4 * (1 + std::fabs(rb[p]))) << "bound page " << p;
              ASSERT_NEAR(gm[row + p], rm[p], 2e-4 * (1 + std::fabs(rm[p]))) << "mean page " << p;
            }
            for (int p = np; p < kv.max_pages; ++p) ASSERT_TRUE(std::isinf(gb[row + p]) && gb[row + p] < 0);
            const int n = v.n_tokens;
            std::vector<float> rt(n);
            ref::token_score(v, qv, 1, nullptr, n, rt.data());
            const size_t trow = (s * n_q + qh) * stride;
            for (int t = 0; t < n; ++t) ASSERT_NEAR(gta[trow + t], rt[t], 2e-4 * (1 + std::fabs(rt[t]))) << t;
            for (int t = n; t < stride; ++t) ASSERT_TRUE(std::isinf(gta[trow + t]));
            const int c = lens[s * n_kv + qh / group];
            for (int i = 0; i < c; ++i)
              ASSERT_NEAR(gtl[trow + i], rt[2 + 3 * i], 2e-4 * (1 + std::fabs(rt[2 + 3 * i]))) << "list " << i;
          }
      }
}

namespace {

// Rows of awkward lengths; values drawn from a small set so that ties are common.
struct Rows {
  int n_rows = 0, stride = 0;
  std::vector<float> v;
  std::vector<int32_t> len;
};

Rows random_rows(const std::vector<int>& lens, std::mt19937& rng, bool nonneg, bool ties) {
  Rows r;
  r.n_rows = static_cast<int>(lens.size());
  r.stride = std::max(1, *std::max_element(lens.begin(), lens.end()));
  r.v.assign(static_cast<size_t>(r.n_rows) * r.stride, std::numeric_limits<float>::quiet_NaN());
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int i = 0; i < r.n_rows; ++i) {
    for (int j = 0; j < lens[i]; ++j) {
      float x = nd(rng);
      if (ties) x = std::round(x * 4.0f) / 4.0f;
      if (nonneg) x = std::exp(x);
      r.v[static_cast<size_t>(i) * r.stride + j] = x;
    }
    r.len.push_back(lens[i]);
  }
  return r;
}

}  // namespace

TEST(CudaSelection, SortMatchesReferenceOrder) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(21);
  for (bool ties : {false, true})
    for (const std::vector<int>& lens :
         {std::vector<int>{1, 3, 15, 16, 17, 255, 4097, 8192, 0}, std::vector<int>{10000, 8193, 3}}) {
      Rows r = random_rows(lens, rng, false, ties);
      cuda::DeviceBuffer v = cuda::to_device(r.v), len = cuda::to_device(r.len);
      cuda::DeviceBuffer order(static_cast<size_t>(r.n_rows) * r.stride * sizeof(int32_t));
      cuda::SortWorkspace ws(r.n_rows, r.stride);
      cuda::sort_rows_desc(v.as<float>(), len.as<int32_t>(), r.n_rows, r.stride, order.as<int32_t>(), ws);
      const auto g = cuda::to_host<int32_t>(order, static_cast<size_t>(r.n_rows) * r.stride);
      for (int i = 0; i < r.n_rows; ++i) {
        if (lens[i] == 0) continue;
        std::vector<int32_t> want;
        ref::select_topk(r.v.data() + static_cast<size_t>(i) * r.stride, lens[i], lens[i], want);
        const std::vector<int32_t> got(g.begin() + static_cast<size_t>(i) * r.stride,
                                       g.begin() + static_cast<size_t>(i) * r.stride + lens[i]);
        ASSERT_EQ(got, want) << "row of " << lens[i] << (ties ? " with ties" : "") << " stride " << r.stride;
      }
    }
}

TEST(CudaSelection, TopKAndTopMassMatchReferenceSets) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(31);
  const std::vector<int> lens{1, 3, 15, 16, 17, 255, 4097};
  for (bool ties : {false, true}) {
    Rows r = random_rows(lens, rng, true, ties);
    cuda::DeviceBuffer v = cuda::to_device(r.v), len = cuda::to_device(r.len);
    for (int k : {1, 5, 16, 300}) {
      cuda::DeviceBuffer out(static_cast<size_t>(r.n_rows) * k * sizeof(int32_t)), olen(r.n_rows * sizeof(int32_t));
      cuda::select_topk_rows(v.as<float>(), len.as<int32_t>(), r.n_rows, r.stride, k, out.as<int32_t>(),
                             olen.as<int32_t>());
      const auto g = cuda::to_host<int32_t>(out, static_cast<size_t>(r.n_rows) * k);
      const auto gl = cuda::to_host<int32_t>(olen, r.n_rows);
      for (int i = 0; i < r.n_rows; ++i) {
        std::vector<int32_t> want;
        ref::select_topk(r.v.data() + static_cast<size_t>(i) * r.stride, lens[i], k, want);
        std::sort(want.begin(), want.end());
        ASSERT_EQ(gl[i], static_cast<int>(want.size())) << "top-" << k << " of " << lens[i];
        const std::vector<int32_t> got(g.begin() + static_cast<size_t>(i) * k, g.begin() + static_cast<size_t>(i) * k + gl[i]);
        ASSERT_EQ(got, want) << "top-" << k << " of " << lens[i] << (ties ? " with ties" : "");
      }
    }
    for (double p : {0.1, 0.5, 0.9, 0.99, 1.0}) {
      cuda::DeviceBuffer out(static_cast<size_t>(r.n_rows) * r.stride * sizeof(int32_t)),
          olen(r.n_rows * sizeof(int32_t));
      cuda::select_top_mass_rows(v.as<float>(), len.as<int32_t>(), r.n_rows, r.stride, p, out.as<int32_t>(),
                                 olen.as<int32_t>());
      const auto g = cuda::to_host<int32_t>(out, static_cast<size_t>(r.n_rows) * r.stride);
      const auto gl = cuda::to_host<int32_t>(olen, r.n_rows);
      for (int i = 0; i < r.n_rows; ++i) {
        const float* w = r.v.data() + static_cast<size_t>(i) * r.stride;
        std::vector<int32_t> want;
        ref::select_top_mass(w, lens[i], p, want);
        std::sort(want.begin(), want.end());
        const std::vector<int32_t> got(g.begin() + static_cast<size_t>(i) * r.stride,
                                       g.begin() + static_cast<size_t>(i) * r.stride + gl[i]);
        if (got == want) continue;
        // Float64 sums in another order may move the boundary by one entry when a prefix
        // lands within rounding of p * total; anything else is a failure.
        double total = 0, mass = 0;
        for (int j = 0; j < lens[i]; ++j) total += w[j];
        for (int32_t j : got) mass += w[j];
        EXPECT_LE(std::abs(static_cast<long>(got.size()) - static_cast<long>(want.size())), 1)
            << "p=" << p << " row of " << lens[i];
        EXPECT_GE(mass, p * total * (1 - 1e-12)) << "p=" << p << " row of " << lens[i];
      }
    }
  }
}

TEST(CudaKmeans, AssignUpdateAndScoreMatchReference) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(41);
  for (int dim : {8, 64, 128, 256})
    for (int n : {1, 17, 255, 4097})
      for (int k : {1, 3, 16, 200}) {
        // Points around k' cluster centres so assignments are meaningful; never zero.
        std::vector<float> centres = random_vec(static_cast<size_t>(std::max(k, 2)) * dim, rng, 3.0f);
        std::vector<float> x(static_cast<size_t>(n) * dim);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (int i = 0; i < n; ++i) {
          const int c = static_cast<int>(rng() % std::max(k, 2));
          for (int j = 0; j < dim; ++j) x[static_cast<size_t>(i) * dim + j] = centres[static_cast<size_t>(c) * dim + j] + nd(rng);
        }
        std::vector<float> cent = random_vec(static_cast<size_t>(k) * dim, rng, 3.0f);
        cuda::DeviceBuffer xd = cuda::to_device(x), cd = cuda::to_device(cent);
        cuda::DeviceBuffer ad = cuda::to_device(std::vector<int32_t>(n, -1));
        const int64_t changed = cuda::kmeans_assign(xd.as<float>(), n, dim, cd.as<float>(), k, ad.as<int32_t>());
        const auto a = cuda::to_host<int32_t>(ad, n);
        EXPECT_EQ(changed, n);  // every entry started at -1
        for (int i = 0; i < n; ++i) {
          ASSERT_GE(a[i], 0);
          ASSERT_LT(a[i], k);
          double best = 1e300, got = 0, norm = 0;
          for (int c = 0; c < k; ++c) {
            double d2 = 0;
            for (int j = 0; j < dim; ++j) {
              const double df = static_cast<double>(x[static_cast<size_t>(i) * dim + j]) - cent[static_cast<size_t>(c) * dim + j];
              d2 += df * df;
            }
            best = std::min(best, d2);
            if (c == a[i]) got = d2;
          }
          for (int j = 0; j < dim; ++j) norm += static_cast<double>(cent[static_cast<size_t>(a[i]) * dim + j]) * cent[static_cast<size_t>(a[i]) * dim + j];
          // float32 ||c||^2 - 2 x.c: near-ties within ~1e-5 of ||c||^2 may pick either.
          ASSERT_LE(got - best, 1e-5 * (norm + 1)) << "row " << i << " n=" << n << " k=" << k << " dim=" << dim;
        }
        // Reassigning with the same centroids changes nothing.
        EXPECT_EQ(cuda::kmeans_assign(xd.as<float>(), n, dim, cd.as<float>(), k, ad.as<int32_t>()), 0);
        // Update against the reference with the GPU's assignment.
        std::vector<float> want = cent;
        std::vector<int32_t> want_counts(k);
        ref::kmeans_update(x.data(), n, dim, a.data(), k, want.data(), want_counts.data());
        cuda::DeviceBuffer counts(static_cast<size_t>(k) * sizeof(int32_t));
        cuda::kmeans_update(xd.as<float>(), n, dim, ad.as<int32_t>(), k, cd.as<float>(), counts.as<int32_t>());
        const auto gc = cuda::to_host<float>(cd, static_cast<size_t>(k) * dim);
        EXPECT_EQ(cuda::to_host<int32_t>(counts, k), want_counts);
        EXPECT_LT(norm_err(gc.data(), want.data(), want.size()), 1e-6) << "n=" << n << " k=" << k;
        // Centroid scores.
        const auto q = random_vec(static_cast<size_t>(3) * dim, rng);
        cuda::DeviceBuffer qd = cuda::to_device(q), sd(static_cast<size_t>(3) * k * sizeof(float));
        cuda::kmeans_centroid_score(cd.as<float>(), k, dim, qd.as<float>(), 3, sd.as<float>());
        std::vector<float> rs(static_cast<size_t>(3) * k);
        ref::kmeans_centroid_score(gc.data(), k, dim, q.data(), 3, rs.data());
        const auto gs = cuda::to_host<float>(sd, static_cast<size_t>(3) * k);
        EXPECT_LT(norm_err(gs.data(), rs.data(), rs.size()), 1e-5);
      }
  EXPECT_THROW(cuda::kmeans_assign(nullptr, 5, 8, nullptr, 2, nullptr), Error);
}
