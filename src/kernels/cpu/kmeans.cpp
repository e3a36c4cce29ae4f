// SIMD k-means ops (Highway, runtime dispatch). Same contracts as src/kernels/ref/kmeans.cpp
// (Tactic 001 section 4.2-4.3); accumulation is float32.
//
// Assignment uses ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2 and drops the ||x||^2 term (the
// same for every centroid), so each (row, centroid) pair costs one dot product; a row is
// held in registers while four centroids stream past it. Rows are split into fixed tasks of
// kRowsPerTask, so the result does not depend on the number of threads.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/kmeans.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <limits>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kernels/kmeans.h"

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// a . b over dim floats: SIMD over whole vectors, scalar over the remainder.
HWY_INLINE float dot(const float* a, const float* b, size_t dim) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  auto acc = hn::Zero(d);
  size_t j = 0;
  for (; j + N <= dim; j += N) acc = hn::MulAdd(hn::LoadU(d, a + j), hn::LoadU(d, b + j), acc);
  float s = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; j < dim; ++j) s += a[j] * b[j];
  return s;
}

// Four dot products of one row against four centroids; the row is loaded once.
HWY_INLINE void dot4(const float* x, const float* c0, const float* c1, const float* c2, const float* c3, size_t dim,
                     float* out) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  size_t j = 0;
  for (; j + N <= dim; j += N) {
    const auto xv = hn::LoadU(d, x + j);
    a0 = hn::MulAdd(xv, hn::LoadU(d, c0 + j), a0);
    a1 = hn::MulAdd(xv, hn::LoadU(d, c1 + j), a1);
    a2 = hn::MulAdd(xv, hn::LoadU(d, c2 + j), a2);
    a3 = hn::MulAdd(xv, hn::LoadU(d, c3 + j), a3);
  }
  out[0] = hn::GetLane(hn::SumOfLanes(d, a0));
  out[1] = hn::GetLane(hn::SumOfLanes(d, a1));
  out[2] = hn::GetLane(hn::SumOfLanes(d, a2));
  out[3] = hn::GetLane(hn::SumOfLanes(d, a3));
  for (; j < dim; ++j) {
    out[0] += x[j] * c0[j];
    out[1] += x[j] * c1[j];
    out[2] += x[j] * c2[j];
    out[3] += x[j] * c3[j];
  }
}

// Rows [i0, i1): nearest centroid by ||c||^2 - 2 x.c. cnorm: [k]. Returns changes.
int64_t assign_rows_impl(const float* x, int i0, int i1, int dim, const float* centroids, const float* cnorm, int k,
                         int32_t* assign) {
  const size_t D = static_cast<size_t>(dim);
  int64_t changed = 0;
  float dots[4];
  for (int i = i0; i < i1; ++i) {
    const float* xi = x + static_cast<size_t>(i) * D;
    float best = std::numeric_limits<float>::infinity();
    int32_t arg = 0;
    int c = 0;
    for (; c + 4 <= k; c += 4) {
      const float* cc = centroids + static_cast<size_t>(c) * D;
      dot4(xi, cc, cc + D, cc + 2 * D, cc + 3 * D, D, dots);
      for (int u = 0; u < 4; ++u) {
        const float d2 = cnorm[c + u] - 2.0f * dots[u];
        if (d2 < best) {
          best = d2;
          arg = c + u;
        }
      }
    }
    for (; c < k; ++c) {
      const float d2 = cnorm[c] - 2.0f * dot(xi, centroids + static_cast<size_t>(c) * D, D);
      if (d2 < best) {
        best = d2;
        arg = c;
      }
    }
    if (assign[i] != arg) ++changed;
    assign[i] = arg;
  }
  return changed;
}

void centroid_norms_impl(const float* centroids, int k, int dim, float* cnorm) {
  for (int c = 0; c < k; ++c) {
    const float* cc = centroids + static_cast<size_t>(c) * dim;
    cnorm[c] = dot(cc, cc, static_cast<size_t>(dim));
  }
}

// sums[assign[i]] += x[i] for every row; sums: [k][dim] float32, zeroed by the caller.
void accumulate_rows_impl(const float* x, int n, int dim, const int32_t* assign, float* sums) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  const size_t D = static_cast<size_t>(dim);
  for (int i = 0; i < n; ++i) {
    const float* xi = x + static_cast<size_t>(i) * D;
    float* s = sums + static_cast<size_t>(assign[i]) * D;
    size_t j = 0;
    for (; j + N <= D; j += N) hn::StoreU(hn::Add(hn::LoadU(d, s + j), hn::LoadU(d, xi + j)), d, s + j);
    for (; j < D; ++j) s[j] += xi[j];
  }
}

void centroid_score_impl(const float* centroids, int k, int dim, const float* q, int n_q, float* scores) {
  const size_t D = static_cast<size_t>(dim);
  float dots[4];
  for (int h = 0; h < n_q; ++h) {
    const float* qh = q + static_cast<size_t>(h) * D;
    float* out = scores + static_cast<size_t>(h) * k;
    int c = 0;
    for (; c + 4 <= k; c += 4) {
      const float* cc = centroids + static_cast<size_t>(c) * D;
      dot4(qh, cc, cc + D, cc + 2 * D, cc + 3 * D, D, dots);
      for (int u = 0; u < 4; ++u) out[c + u] = dots[u];
    }
    for (; c < k; ++c) out[c] = dot(qh, centroids + static_cast<size_t>(c) * D, D);
  }
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(assign_rows_impl);
HWY_EXPORT(centroid_norms_impl);
HWY_EXPORT(accumulate_rows_impl);
HWY_EXPORT(centroid_score_impl);

namespace {
constexpr int kRowsPerTask = 64;
}  // namespace

int64_t kmeans_assign(const float* x, int n, int dim, const float* centroids, int k, int32_t* assign,
                      ThreadPool* pool) {
  kmeans_validate(__func__, x, n, dim, centroids, k);
  CUMULUS_CHECK(n == 0 || assign != nullptr, "assign must be non-null (n={})", n);
  if (n == 0) return 0;
  std::vector<float> cnorm(k);
  HWY_DYNAMIC_DISPATCH(centroid_norms_impl)(centroids, k, dim, cnorm.data());
  const int64_t n_tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<int64_t> changed(n_tasks, 0);
  auto task = [&](int64_t t, int) {
    const int i0 = static_cast<int>(t) * kRowsPerTask;
    const int i1 = i0 + kRowsPerTask < n ? i0 + kRowsPerTask : n;
    changed[t] = HWY_DYNAMIC_DISPATCH(assign_rows_impl)(x, i0, i1, dim, centroids, cnorm.data(), k, assign);
  };
  if (pool != nullptr && n_tasks > 1) {
    pool->parallel_for(n_tasks, task);
  } else {
    for (int64_t t = 0; t < n_tasks; ++t) task(t, 0);
  }
  int64_t total = 0;
  for (int64_t c : changed) total += c;
  return total;
}

void kmeans_update(const float* x, int n, int dim, const int32_t* assign, int k, float* centroids, int32_t* counts) {
  kmeans_validate(__func__, x, n, dim, centroids, k);
  CUMULUS_CHECK(n == 0 || assign != nullptr, "assign must be non-null (n={})", n);
  CUMULUS_CHECK(counts != nullptr, "counts must be non-null");
  for (int c = 0; c < k; ++c) counts[c] = 0;
  for (int i = 0; i < n; ++i) {
    CUMULUS_CHECK(assign[i] >= 0 && assign[i] < k, "assign[{}]={} out of range [0, {})", i, assign[i], k);
    ++counts[assign[i]];
  }
  std::vector<float> sums(static_cast<size_t>(k) * dim, 0.0f);
  HWY_DYNAMIC_DISPATCH(accumulate_rows_impl)(x, n, dim, assign, sums.data());
  for (int c = 0; c < k; ++c) {
    if (counts[c] == 0) continue;
    const float inv = 1.0f / static_cast<float>(counts[c]);
    for (int j = 0; j < dim; ++j)
      centroids[static_cast<size_t>(c) * dim + j] = sums[static_cast<size_t>(c) * dim + j] * inv;
  }
}

void kmeans_centroid_score(const float* centroids, int k, int dim, const float* q, int n_q, float* scores) {
  kmeans_validate(__func__, nullptr, 0, dim, centroids, k);
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  CUMULUS_CHECK(q != nullptr && scores != nullptr, "q and scores must be non-null");
  HWY_DYNAMIC_DISPATCH(centroid_score_impl)(centroids, k, dim, q, n_q, scores);
}

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
