// SIMD k-means ops (Highway, runtime dispatch). Same contracts as src/kernels/ref/kmeans.cpp
// (Tactic 001 section 4.2-4.3); accumulation is float32.
//
// Assignment uses ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2 and drops the ||x||^2 term (the
// same for every centroid), so each (row, centroid) pair costs one dot product, computed as
// a GEMM tile of rows x centroids (assign_tile). Rows are split into fixed tasks of
// kKmeansTaskRows, so the result does not depend on the number of threads.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/kmeans.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <limits>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/kmeans.h"
#include "kernels/cpu/prefetch.h"

#ifndef CUMULUS_KERNELS_CPU_KMEANS_ONCE
#define CUMULUS_KERNELS_CPU_KMEANS_ONCE
namespace cumulus::cpu {
// Rows per assignment task: fixed, so the result does not depend on the thread count.
constexpr int kKmeansTaskRows = 64;
}  // namespace cumulus::cpu
#endif

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

// Rows [i0, i1): nearest centroid by ||c||^2 - 2 x.c, GEMM-shaped. The centroids are held
// transposed in tiles of W = kV vectors: ct [k_pad / W][dim][W] (padding columns 0 with
// cnorm +inf, never chosen), so one tile (dim x W floats, 32 KiB at d = 128 and W = 64)
// stays in L1 while every row of the task passes it, kR rows at a time with kR x kV
// accumulators in registers: per step kV centroid loads and kR broadcasts feed kR x kV
// FMAs (the rows-by-centroids product of a GEMM; the previous loop, one row against four
// centroids with a horizontal sum each and the whole centroid table per row, was load-bound).
// Each lane keeps its best distance and centroid; strict < over centroids in increasing
// order, then the lanes' minimum with the lowest index among equals, and across tiles a
// strict < again, gives "ties: the lower c". cnorm: [k_pad].
//   best, arg: [kR] in/out, the rows' best distance and centroid so far
template <int kR, int kV, class D>
HWY_INLINE void assign_tile(D d, const float* x, int i0, int dim, const float* ct_tile, const float* cnorm, int c0,
                            float* best_row, int32_t* arg_row) {
  using V = hn::Vec<D>;
  using DI = hn::RebindToSigned<D>;
  const DI di;
  using VI = hn::Vec<DI>;
  constexpr size_t N = hn::MaxLanes(D());
  const size_t W = kV * hn::Lanes(d);
  const size_t D_ = static_cast<size_t>(dim);
  V acc[kR][kV];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = hn::Zero(d);
  for (size_t j = 0; j < D_; ++j) {
    const float* row = ct_tile + j * W;
    V cv[kV];
    for (int v = 0; v < kV; ++v) cv[v] = hn::LoadU(d, row + v * hn::Lanes(d));
    for (int r = 0; r < kR; ++r) {
      const V xv = hn::Set(d, x[static_cast<size_t>(i0 + r) * D_ + j]);
      for (int v = 0; v < kV; ++v) acc[r][v] = hn::MulAdd(xv, cv[v], acc[r][v]);
    }
  }
  const VI lane = hn::Iota(di, 0);
  const V minus2 = hn::Set(d, -2.0f);
  HWY_ALIGN float bv[N];
  HWY_ALIGN int32_t ai[N];
  for (int r = 0; r < kR; ++r) {
    V best = hn::Set(d, std::numeric_limits<float>::infinity());
    VI arg = hn::Zero(di);
    for (int v = 0; v < kV; ++v) {
      const int cv0 = c0 + v * static_cast<int>(hn::Lanes(d));
      const V dist = hn::MulAdd(minus2, acc[r][v], hn::LoadU(d, cnorm + cv0));
      const auto better = hn::Lt(dist, best);
      best = hn::IfThenElse(better, dist, best);
      arg = hn::IfThenElse(hn::RebindMask(di, better), hn::Add(lane, hn::Set(di, cv0)), arg);
    }
    hn::Store(best, d, bv);
    hn::Store(arg, di, ai);
    for (size_t l = 0; l < hn::Lanes(d); ++l)
      if (bv[l] < best_row[r] || (bv[l] == best_row[r] && ai[l] < arg_row[r])) {
        best_row[r] = bv[l];
        arg_row[r] = ai[l];
      }
  }
}

// kV vectors of centroids per tile: 4 with 16 lanes (16 accumulators of 32 registers), 2
// with fewer (AVX2: 8 of 16).
template <class D>
constexpr int assign_vectors() {
  return hn::MaxLanes(D()) >= 16 ? 4 : 2;
}

// Returns how many assignments of rows [i0, i1) changed; at most kKmeansTaskRows rows.
int64_t assign_rows_impl(const float* x, int i0, int i1, int dim, const float* ct, const float* cnorm, int k_pad,
                         int32_t* assign) {
  const hn::ScalableTag<float> d;
  constexpr int kV = assign_vectors<decltype(d)>();
  const int W = kV * static_cast<int>(hn::Lanes(d));
  float best[kKmeansTaskRows];
  int32_t arg[kKmeansTaskRows];
  for (int r = 0; r < i1 - i0; ++r) {
    best[r] = std::numeric_limits<float>::infinity();
    arg[r] = 0;
  }
  for (int c0 = 0; c0 < k_pad; c0 += W) {
    const float* tile = ct + static_cast<size_t>(c0) * dim;  // [dim][W]
    int i = i0;
    for (; i + 4 <= i1; i += 4) assign_tile<4, kV>(d, x, i, dim, tile, cnorm, c0, best + (i - i0), arg + (i - i0));
    for (; i < i1; ++i) assign_tile<1, kV>(d, x, i, dim, tile, cnorm, c0, best + (i - i0), arg + (i - i0));
  }
  int64_t changed = 0;
  for (int i = i0; i < i1; ++i) {
    if (assign[i] != arg[i - i0]) ++changed;
    assign[i] = arg[i - i0];
  }
  return changed;
}

// Centroids per tile of assign_rows_impl (kV x lanes): k_pad is a multiple of it.
int assign_tile_width() {
  const hn::ScalableTag<float> d;
  return assign_vectors<decltype(d)>() * static_cast<int>(hn::Lanes(d));
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

// Blocks of 4 centroids prefetched ahead by score_tile (8 blocks: 16 KB at head_dim 128).
constexpr int kScoreAhead = 8;

// Scores of Q queries against 4 centroids at c, each centroid row loaded once for all Q;
// every dot product is accumulated as dot() accumulates it (lane-wise FMAs over the
// dimension, then the lanes summed), so the values equal dot()'s bit for bit.
template <int Q>
HWY_INLINE void score_tile(const float* centroids, int k, size_t dim, const float* q, int c, float* scores) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  using V = hn::Vec<decltype(d)>;
  const float* cc = centroids + static_cast<size_t>(c) * dim;
  // The rows about 16 KB on, into L2 (prefetch.h): with the FMAs between the loads the
  // hardware prefetcher alone kept this scan far below the read bandwidth, as the sketch's.
  if (c + 4 * kScoreAhead < k) {
    const char* ahead = reinterpret_cast<const char*>(cc + 4 * kScoreAhead * dim);
    for (size_t off = 0; off < 4 * dim * sizeof(float); off += 64) prefetch_l2(ahead + off);
  }
  V acc[Q][4];
  for (int h = 0; h < Q; ++h)
    for (int u = 0; u < 4; ++u) acc[h][u] = hn::Zero(d);
  size_t j = 0;
  for (; j + N <= dim; j += N) {
    V cv[4];
    for (int u = 0; u < 4; ++u) cv[u] = hn::LoadU(d, cc + u * dim + j);
    for (int h = 0; h < Q; ++h) {
      const V qv = hn::LoadU(d, q + static_cast<size_t>(h) * dim + j);
      for (int u = 0; u < 4; ++u) acc[h][u] = hn::MulAdd(qv, cv[u], acc[h][u]);
    }
  }
  for (int h = 0; h < Q; ++h) {
    float* out = scores + static_cast<size_t>(h) * k + c;
    for (int u = 0; u < 4; ++u) out[u] = hn::GetLane(hn::SumOfLanes(d, acc[h][u]));
    for (size_t t = j; t < dim; ++t)
      for (int u = 0; u < 4; ++u) out[u] += q[static_cast<size_t>(h) * dim + t] * cc[u * dim + t];
  }
}

// Centroids in blocks of 4, each block read once for a tile of up to 4 queries (the
// centroids of a kv head are about 1 MB at 2048 x 128: read once per step, not once per
// query head).
void centroid_score_impl(const float* centroids, int k, int dim, const float* q, int n_q, float* scores) {
  const size_t D = static_cast<size_t>(dim);
  for (int h0 = 0; h0 < n_q; h0 += 4) {
    const int Q = std::min(4, n_q - h0);
    const float* qh = q + static_cast<size_t>(h0) * D;
    float* out = scores + static_cast<size_t>(h0) * k;
    int c = 0;
    for (; c + 4 <= k; c += 4) {
      switch (Q) {
        case 4: score_tile<4>(centroids, k, D, qh, c, out); break;
        case 3: score_tile<3>(centroids, k, D, qh, c, out); break;
        case 2: score_tile<2>(centroids, k, D, qh, c, out); break;
        default: score_tile<1>(centroids, k, D, qh, c, out); break;
      }
    }
    for (int h = 0; h < Q; ++h)
      for (int cr = c; cr < k; ++cr) out[static_cast<size_t>(h) * k + cr] = dot(qh + h * D, centroids + cr * D, D);
  }
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(assign_rows_impl);
HWY_EXPORT(assign_tile_width);
HWY_EXPORT(centroid_norms_impl);
HWY_EXPORT(accumulate_rows_impl);
HWY_EXPORT(centroid_score_impl);

int64_t kmeans_assign(const float* x, int n, int dim, const float* centroids, int k, int32_t* assign,
                      ThreadPool* pool) {
  kmeans_validate(__func__, x, n, dim, centroids, k);
  CUMULUS_CHECK(n == 0 || assign != nullptr, "assign must be non-null (n={})", n);
  if (n == 0) return 0;
  // Centroids transposed in tiles of `width` and padded, once per call:
  // ct [k_pad / width][dim][width], cnorm [k_pad].
  const int width = HWY_DYNAMIC_DISPATCH(assign_tile_width)();
  const int k_pad = (k + width - 1) / width * width;
  std::vector<float> cnorm(static_cast<size_t>(k_pad), std::numeric_limits<float>::infinity());
  HWY_DYNAMIC_DISPATCH(centroid_norms_impl)(centroids, k, dim, cnorm.data());
  std::vector<float> ct(static_cast<size_t>(dim) * k_pad, 0.0f);
  for (int c = 0; c < k; ++c)
    for (int j = 0; j < dim; ++j)
      ct[(static_cast<size_t>(c / width) * dim + j) * width + c % width] = centroids[static_cast<size_t>(c) * dim + j];
  const int64_t n_tasks = (n + kKmeansTaskRows - 1) / kKmeansTaskRows;
  std::vector<int64_t> changed(n_tasks, 0);
  auto task = [&](int64_t t, int) {
    const int i0 = static_cast<int>(t) * kKmeansTaskRows;
    const int i1 = i0 + kKmeansTaskRows < n ? i0 + kKmeansTaskRows : n;
    changed[t] = HWY_DYNAMIC_DISPATCH(assign_rows_impl)(x, i0, i1, dim, ct.data(), cnorm.data(), k_pad, assign);
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
