// SIMD k-means ops (Highway, runtime dispatch). Same contracts as src/kernels/ref/kmeans.cpp
// (Tactic, sections 4.2-4.3); accumulation is float32.
//
// Assignment uses ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2 and drops the ||x||^2 term (the
// same for every centroid), so each (row, centroid) pair costs one dot product, computed as
// a GEMM tile of rows x centroids (assign_tile). Rows are split into fixed tasks of
// kKmeansTaskRows, so the result does not depend on the number of threads.
//
// kmeans_lloyd runs the whole loop with Yinyang bounds (kernels/kmeans.h): per round, (1)
// each row's bounds move by the centroids' drift and decide which groups of centroids it
// must compute, (2) each group is scored against its rows as GEMM tiles (group_tile, the
// same arithmetic as assign_tile), (3) the nearest candidate becomes the assignment and the
// computed distances become the new bounds.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/kmeans.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
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

// The dot products of a GEMM tile: acc[r][v] = rows[r] . the lanes of vector v of the
// centroids in ct, held transposed with `stride` floats per dimension; per dimension kV
// centroid loads and kR broadcasts feed kR x kV lane-wise MulAdds, in dimension order. Both
// assignments (assign_tile, group_tile) compute their distances from these, so they agree
// bit for bit.
template <int kR, int kV, class D, class V = hn::Vec<D>>
HWY_INLINE void tile_dots(D d, const float* const* rows, size_t dim, const float* ct, size_t stride,
                          V (&acc)[kR][kV]) {
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = hn::Zero(d);
  for (size_t j = 0; j < dim; ++j) {
    const float* row = ct + j * stride;
    V cv[kV];
    for (int v = 0; v < kV; ++v) cv[v] = hn::LoadU(d, row + v * hn::Lanes(d));
    for (int r = 0; r < kR; ++r) {
      const V xv = hn::Set(d, rows[r][j]);
      for (int v = 0; v < kV; ++v) acc[r][v] = hn::MulAdd(xv, cv[v], acc[r][v]);
    }
  }
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
  const size_t D_ = static_cast<size_t>(dim);
  const float* rows[kR];
  for (int r = 0; r < kR; ++r) rows[r] = x + static_cast<size_t>(i0 + r) * D_;
  V acc[kR][kV];
  tile_dots<kR, kV>(d, rows, D_, ct_tile, kV * hn::Lanes(d), acc);
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

// Yinyang groups (kmeans_lloyd): gathered rows against one group's centroids, held
// transposed as gt [dim][width] (width a multiple of the lanes; padding slots have cnorm
// +inf and are never chosen). Every distance is assign_tile's (tile_dots, then
// MulAdd(-2, acc, cnorm)), so it equals the plain assignment's value bit for bit. Per row: the least distance m1 at
// slot a1 (ties: the lower slot) and the second least m2 (equal to m1 on a tie), over the
// slots [s0, s0 + kV lanes), merged into m1/a1/m2.
template <int kR, int kV, class D>
HWY_NOINLINE void group_tile(D d, const float* const* rows, int dim, const float* gt, size_t width, const float* cn,
                           int s0, float* m1, int32_t* a1, float* m2) {
  using V = hn::Vec<D>;
  using DI = hn::RebindToSigned<D>;
  const DI di;
  using VI = hn::Vec<DI>;
  const size_t L = hn::Lanes(d);
  V acc[kR][kV];
  tile_dots<kR, kV>(d, rows, static_cast<size_t>(dim), gt + s0, width, acc);
  const VI lane = hn::Iota(di, 0);
  const V minus2 = hn::Set(d, -2.0f);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int r = 0; r < kR; ++r) {
    V best = hn::Set(d, kInf);
    V second = best;
    VI arg = hn::Zero(di);
    for (int v = 0; v < kV; ++v) {
      const int sv0 = s0 + v * static_cast<int>(L);
      const V dist = hn::MulAdd(minus2, acc[r][v], hn::LoadU(d, cn + sv0));
      const auto better = hn::Lt(dist, best);
      second = hn::Min(second, hn::IfThenElse(better, best, dist));
      best = hn::IfThenElse(better, dist, best);
      arg = hn::IfThenElse(hn::RebindMask(di, better), hn::Add(lane, hn::Set(di, sv0)), arg);
    }
    // Across the lanes: the least distance, its lowest slot, and the second least (every
    // lane's second, and the best of every other lane).
    const V b = hn::MinOfLanes(d, best);
    const VI a = hn::MinOfLanes(
        di, hn::IfThenElse(hn::RebindMask(di, hn::Eq(best, b)), arg, hn::Set(di, std::numeric_limits<int32_t>::max())));
    const V others = hn::IfThenElse(hn::RebindMask(d, hn::Eq(arg, a)), hn::Set(d, kInf), best);
    const float bl = hn::GetLane(b), sl = hn::GetLane(hn::MinOfLanes(d, hn::Min(second, others)));
    const int32_t al = hn::GetLane(a);
    if (bl < m1[r] || (bl == m1[r] && al < a1[r])) {
      m2[r] = std::min(m2[r], m1[r]);
      m1[r] = bl;
      a1[r] = al;
    } else {
      m2[r] = std::min(m2[r], bl);
    }
    m2[r] = std::min(m2[r], sl);
  }
}

// kR rows against kV vectors of slots: kV picked at run time, at most assign_vectors().
template <int kR, class D>
HWY_INLINE void group_tile_v(D d, int kv, const float* const* rows, int dim, const float* gt, size_t width,
                             const float* cn, int s0, float* m1, int32_t* a1, float* m2) {
  constexpr int kMax = assign_vectors<D>();
  if (kMax >= 4 && kv >= 4) return group_tile<kR, (kMax >= 4 ? 4 : 1)>(d, rows, dim, gt, width, cn, s0, m1, a1, m2);
  if (kMax >= 3 && kv == 3) return group_tile<kR, (kMax >= 3 ? 3 : 1)>(d, rows, dim, gt, width, cn, s0, m1, a1, m2);
  if (kv >= 2) return group_tile<kR, 2>(d, rows, dim, gt, width, cn, s0, m1, a1, m2);
  group_tile<kR, 1>(d, rows, dim, gt, width, cn, s0, m1, a1, m2);
}

// n_rows gathered rows against one group (above): m1, a1 (slot), m2 per row.
void group_scores_impl(const float* const* rows, int n_rows, int dim, const float* gt, int width, const float* cn,
                       float* m1, int32_t* a1, float* m2) {
  const hn::ScalableTag<float> d;
  const int L = static_cast<int>(hn::Lanes(d));
  constexpr int kMax = assign_vectors<decltype(d)>();
  for (int r = 0; r < n_rows; ++r) {
    m1[r] = m2[r] = std::numeric_limits<float>::infinity();
    a1[r] = std::numeric_limits<int32_t>::max();
  }
  const size_t w = static_cast<size_t>(width);
  for (int s0 = 0; s0 < width; s0 += kMax * L) {
    const int kv = std::min(kMax, (width - s0) / L);
    int r = 0;
    for (; r + 4 <= n_rows; r += 4) group_tile_v<4>(d, kv, rows + r, dim, gt, w, cn, s0, m1 + r, a1 + r, m2 + r);
    for (; r < n_rows; ++r) group_tile_v<1>(d, kv, rows + r, dim, gt, w, cn, s0, m1 + r, a1 + r, m2 + r);
  }
}

// One row's distance to one centroid, accumulated as one lane of assign_tile (the same
// MulAdd chain), so it equals the plain assignment's value bit for bit.
float row_distance_impl(const float* x, const float* c, int dim, float cn) {
  const hn::ScalableTag<float> d;
  auto acc = hn::Zero(d);
  for (int j = 0; j < dim; ++j) acc = hn::MulAdd(hn::Set(d, x[j]), hn::Set(d, c[j]), acc);
  return hn::GetLane(hn::MulAdd(hn::Set(d, -2.0f), acc, hn::Set(d, cn)));
}

int lanes_impl() {
  const hn::ScalableTag<float> d;
  return static_cast<int>(hn::Lanes(d));
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
HWY_EXPORT(group_scores_impl);
HWY_EXPORT(row_distance_impl);
HWY_EXPORT(lanes_impl);

namespace {

// Runs fn(task, worker) for tasks [0, n): on the pool when there is more than one.
template <class Fn>
void for_tasks(ThreadPool* pool, int64_t n, Fn&& fn) {
  if (pool != nullptr && n > 1) {
    pool->parallel_for(n, fn);
  } else {
    for (int64_t t = 0; t < n; ++t) fn(t, 0);
  }
}

}  // namespace

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
  for_tasks(pool, n_tasks, task);
  int64_t total = 0;
  for (int64_t c : changed) total += c;
  return total;
}

namespace {

// Centroids per Yinyang group (about; the groups are a k-means of the initial centroids).
constexpr int kGroupSize = 64;
// Rounds of that k-means (the paper's 5).
constexpr int kGroupRounds = 5;
// KmeansBounds::kAuto: bounds from this many centroids on (kmeans.h).
constexpr int kBoundsMinCentroids = 384;

// Bounds are kept in float, moved outward by 2^-20 of their size before the conversion
// (which rounds by at most 2^-24 of it), so that they stay bounds; cheaper than nextafter on
// the n x groups bounds of every round.
constexpr double kOut = 0x1p-20;
float round_up(double v) { return static_cast<float>(v >= 0 ? v * (1 + kOut) : v * (1 - kOut)); }
float round_down(double v) { return static_cast<float>(v >= 0 ? v * (1 - kOut) : v * (1 + kOut)); }

// True when every centroid at distance >= lo from a row is farther (in computed distance)
// than the row's centroid, at distance <= up: lo^2 - up^2 > 2 err, err bounding the float32
// error of one computed distance.
bool beyond(double lo, double up, double err) { return lo > 0 && lo * lo > up * up + 2 * err; }

// The Yinyang groups: centroids split by a k-means of their initial positions into groups
// of about kGroupSize, each group's centroids in increasing index (empty groups dropped).
struct Groups {
  int count = 0;
  std::vector<int32_t> of;       // [k] group of each centroid
  std::vector<int32_t> members;  // centroids, group by group: group g's are [begin[g], begin[g + 1])
  std::vector<int32_t> begin;    // [count + 1]
  std::vector<int32_t> width;    // [count] slots: the size rounded up to the lanes
  std::vector<size_t> slot0;     // [count] first slot of each group in gt / gcn
  size_t slots = 0;
};

Groups make_groups(const float* centroids, int k, int dim, int lanes, ThreadPool* pool) {
  Groups g;
  const int want = std::max(1, std::min(k, (k + kGroupSize - 1) / kGroupSize));
  std::vector<float> gc(centroids, centroids + static_cast<size_t>(want) * dim);  // seeds: the first centroids
  std::vector<int32_t> ga(k, -1), gn(want);
  for (int it = 0; it < kGroupRounds; ++it) {
    if (kmeans_assign(centroids, k, dim, gc.data(), want, ga.data(), pool) == 0) break;
    kmeans_update(centroids, k, dim, ga.data(), want, gc.data(), gn.data());
  }
  // The centroids in the order of their k-means groups, cut into runs of kGroupSize: every
  // group but the last is a whole GEMM tile wide (a run may straddle two k-means groups,
  // which loosens its bound a little). Within a run, increasing index (the tie rule).
  std::vector<int32_t> order(k);
  for (int c = 0; c < k; ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ga[a] < ga[b]; });
  g.count = (k + kGroupSize - 1) / kGroupSize;
  g.of.resize(k);
  g.begin.resize(g.count + 1);
  g.members = order;
  for (int q = 0; q < g.count; ++q) {
    g.begin[q] = q * kGroupSize;
    g.begin[q + 1] = std::min(k, (q + 1) * kGroupSize);
    std::sort(g.members.begin() + g.begin[q], g.members.begin() + g.begin[q + 1]);
    for (int s = g.begin[q]; s < g.begin[q + 1]; ++s) g.of[g.members[s]] = q;
  }
  std::vector<int32_t> size(g.count);
  for (int q = 0; q < g.count; ++q) size[q] = g.begin[q + 1] - g.begin[q];
  g.width.resize(g.count);
  g.slot0.resize(g.count);
  for (int q = 0; q < g.count; ++q) {
    g.width[q] = (size[q] + lanes - 1) / lanes * lanes;
    g.slot0[q] = g.slots;
    g.slots += static_cast<size_t>(g.width[q]);
  }
  return g;
}

// One worker's gathered rows for group_scores_impl.
struct LloydScratch {
  std::vector<const float*> rows;
  std::vector<float> m1, m2;
  std::vector<int32_t> a1;
  int64_t distances = 0;
};

}  // namespace

KmeansRun kmeans_lloyd(const float* x, int n, int dim, float* centroids, int k, int max_iter, int32_t* assign,
                       int32_t* counts, ThreadPool* pool, KmeansBounds bounds) {
  kmeans_validate(__func__, x, n, dim, centroids, k);
  CUMULUS_CHECK(max_iter >= 0, "max_iter={} must be >= 0", max_iter);
  CUMULUS_CHECK(n == 0 || assign != nullptr, "assign must be non-null (n={})", n);
  CUMULUS_CHECK(counts != nullptr, "counts must be non-null");
  KmeansRun run;
  for (int i = 0; i < n; ++i) assign[i] = -1;
  const size_t D = static_cast<size_t>(dim);
  std::vector<double> xn(static_cast<size_t>(n)), xs(static_cast<size_t>(n));  // ||x||^2, ||x||
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    double s = 0;
    for (size_t j = 0; j < D; ++j) s += static_cast<double>(x[i * D + j]) * x[i * D + j];
    xn[i] = s;
    xs[i] = std::sqrt(s);
    finite = finite && s <= 1e36;  // finite, and every distance (bound) fits a float
  }
  for (size_t j = 0; j < static_cast<size_t>(k) * D; ++j) finite = finite && std::isfinite(centroids[j]);
  const bool pays = k >= kBoundsMinCentroids;
  if (!finite || n == 0 || bounds == KmeansBounds::kNever || (bounds == KmeansBounds::kAuto && !pays)) {
    // The plain loop (and on infinities or norms beyond float's range, which have no bounds).
    for (int it = 0; it < max_iter; ++it) {
      ++run.rounds;
      run.distances += static_cast<int64_t>(n) * k;
      if (kmeans_assign(x, n, dim, centroids, k, assign, pool) == 0) break;
      kmeans_update(x, n, dim, assign, k, centroids, counts);
    }
    run.distances_full = run.distances;
    return run;
  }
  const int lanes = HWY_DYNAMIC_DISPATCH(lanes_impl)();
  const Groups gr = make_groups(centroids, k, dim, lanes, pool);
  const int G = gr.count;
  // A computed distance ||c||^2 - 2 x.c is within err_of(i) of the true one (float32 dot
  // products of dim terms and the norms: gamma (cmax + 2 |x| |c|max), a factor 2 to spare).
  const double gamma = 2.0 * (dim + 8) * 0x1p-24;
  double cmax = 0, cs = 0;  // the largest ||c||^2 and ||c|| of this round
  auto err_of = [&](int i) { return gamma * (cmax + 2 * xs[i] * cs) + 1e-12 * xn[i]; };
  // The bound on the true distance that a computed distance v gives, below and above.
  auto below = [&](int i, float v) { return round_down(std::sqrt(std::max(0.0, xn[i] + v - err_of(i)))); };
  auto above = [&](int i, float v) { return round_up(std::sqrt(std::max(0.0, xn[i] + v + err_of(i)))); };

  std::vector<float> upper(static_cast<size_t>(n));      // >= the distance to assign[i]
  std::vector<float> lower(static_cast<size_t>(n) * G);  // <= the distance to group g's others
  std::vector<uint8_t> need(static_cast<size_t>(n) * G);  // this round computes (row, group)
  std::vector<uint8_t> active(static_cast<size_t>(n));   // this round computes something for the row
  // The row's nearest candidate so far: distance, centroid, the second distance of its
  // group and the group (-1: the current centroid, from va).
  std::vector<float> best(static_cast<size_t>(n)), best2(static_cast<size_t>(n)), va(static_cast<size_t>(n));
  std::vector<int32_t> best_arg(static_cast<size_t>(n)), best_group(static_cast<size_t>(n));
  std::vector<float> gt(gr.slots * D), gcn(gr.slots), cnorm(static_cast<size_t>(k));
  std::vector<double> drift(static_cast<size_t>(k), 0.0), gdrift(static_cast<size_t>(G), 0.0);
  std::vector<float> old(static_cast<size_t>(k) * D);
  std::vector<int32_t> list;  // rows of one group
  std::vector<LloydScratch> scratch(pool != nullptr ? pool->n_threads() : 1);
  for (auto& w : scratch) {
    w.rows.resize(kKmeansTaskRows);
    w.m1.resize(kKmeansTaskRows);
    w.m2.resize(kKmeansTaskRows);
    w.a1.resize(kKmeansTaskRows);
  }
  const int64_t n_tasks = (n + kKmeansTaskRows - 1) / kKmeansTaskRows;
  std::vector<int64_t> changed(n_tasks);
  for (int it = 0; it < max_iter; ++it) {
    // The groups' centroids transposed: gt [slot0 + dim x width], padding slots 0 with norm +inf.
    HWY_DYNAMIC_DISPATCH(centroid_norms_impl)(centroids, k, dim, cnorm.data());
    cmax = 0;
    for (int c = 0; c < k; ++c) cmax = std::max(cmax, static_cast<double>(cnorm[c]));
    cs = std::sqrt(cmax);
    std::fill(gcn.begin(), gcn.end(), std::numeric_limits<float>::infinity());
    std::fill(gt.begin(), gt.end(), 0.0f);
    for (int q = 0; q < G; ++q) {
      float* t = gt.data() + gr.slot0[q] * D;
      for (int s = 0; s < gr.begin[q + 1] - gr.begin[q]; ++s) {
        const int c = gr.members[gr.begin[q] + s];
        gcn[gr.slot0[q] + s] = cnorm[c];
        for (size_t j = 0; j < D; ++j) t[j * gr.width[q] + s] = centroids[c * D + j];
      }
    }
    // 1. Bounds moved by the centroids' drift; the groups each row must compute.
    for_tasks(pool, n_tasks, [&](int64_t t, int worker) {
      const int i0 = static_cast<int>(t) * kKmeansTaskRows, i1 = std::min(n, i0 + kKmeansTaskRows);
      for (int i = i0; i < i1; ++i) {
        uint8_t* nd = need.data() + static_cast<size_t>(i) * G;
        best_group[i] = -1;
        best2[i] = std::numeric_limits<float>::infinity();
        if (it == 0) {  // every distance
          std::fill(nd, nd + G, uint8_t{1});
          active[i] = 1;
          best[i] = std::numeric_limits<float>::infinity();
          best_arg[i] = std::numeric_limits<int32_t>::max();
          continue;
        }
        active[i] = 0;  // need[i] is read only for active rows
        const double err = err_of(i);
        const int a = assign[i];
        double up = static_cast<double>(upper[i]) + drift[a];
        float* lo = lower.data() + static_cast<size_t>(i) * G;
        double least = std::numeric_limits<double>::infinity();
        for (int q = 0; q < G; ++q) {
          lo[q] = round_down(static_cast<double>(lo[q]) - gdrift[q]);
          least = std::min(least, static_cast<double>(lo[q]));
        }
        if (beyond(least, up, err)) {  // no group can hold a nearer centroid
          upper[i] = round_up(up);
          continue;
        }
        va[i] = HWY_DYNAMIC_DISPATCH(row_distance_impl)(x + i * D, centroids + a * D, dim, cnorm[a]);
        ++scratch[worker].distances;
        upper[i] = above(i, va[i]);
        best[i] = va[i];
        best_arg[i] = a;
        for (int q = 0; q < G; ++q) {
          nd[q] = beyond(lo[q], upper[i], err) ? 0 : 1;
          active[i] |= nd[q];
        }
      }
    });
    // 2. Each group against the rows that need it, kKmeansTaskRows rows at a time
    //    (score_rows): the first round, where every row needs every group, takes each task
    //    of rows through all groups (the rows stay in L1, as kmeans_assign's); later rounds
    //    take the groups in turn, each against the rows that need it, so each row's nearest
    //    candidate is updated by one task at a time.
    auto score_rows = [&](int q, const int32_t* ids, int m, LloydScratch& w) {
      for (int u = 0; u < m; ++u) w.rows[u] = x + ids[u] * D;
      HWY_DYNAMIC_DISPATCH(group_scores_impl)(w.rows.data(), m, dim, gt.data() + gr.slot0[q] * D, gr.width[q],
                                              gcn.data() + gr.slot0[q], w.m1.data(), w.a1.data(), w.m2.data());
      w.distances += static_cast<int64_t>(m) * (gr.begin[q + 1] - gr.begin[q]);
      for (int u = 0; u < m; ++u) {
        const int i = ids[u];
        const float m1 = w.m1[u];
        const int32_t c = gr.members[gr.begin[q] + w.a1[u]];
        lower[static_cast<size_t>(i) * G + q] = below(i, m1);  // the winner's group: m2, in pass 3
        // Nearest first, then the lower index; on the current centroid itself the group wins.
        if (m1 < best[i] || (m1 == best[i] && c <= best_arg[i])) {
          best[i] = m1;
          best_arg[i] = c;
          best2[i] = w.m2[u];
          best_group[i] = q;
        }
      }
    };
    if (it == 0) {
      for_tasks(pool, n_tasks, [&](int64_t t, int worker) {
        const int i0 = static_cast<int>(t) * kKmeansTaskRows, i1 = std::min(n, i0 + kKmeansTaskRows);
        int32_t ids[kKmeansTaskRows];
        for (int i = i0; i < i1; ++i) ids[i - i0] = i;
        for (int q = 0; q < G; ++q) score_rows(q, ids, i1 - i0, scratch[worker]);
      });
    } else {
      for (int q = 0; q < G; ++q) {
        list.clear();
        for (int i = 0; i < n; ++i)
          if (active[i] && need[static_cast<size_t>(i) * G + q]) list.push_back(i);
        const int m = static_cast<int>(list.size());
        for_tasks(pool, (m + kKmeansTaskRows - 1) / kKmeansTaskRows, [&](int64_t t, int worker) {
          const int u0 = static_cast<int>(t) * kKmeansTaskRows;
          score_rows(q, list.data() + u0, std::min(m, u0 + kKmeansTaskRows) - u0, scratch[worker]);
        });
      }
    }
    // 3. The new assignments and their bounds.
    for_tasks(pool, n_tasks, [&](int64_t t, int) {
      const int i0 = static_cast<int>(t) * kKmeansTaskRows, i1 = std::min(n, i0 + kKmeansTaskRows);
      int64_t ch = 0;
      for (int i = i0; i < i1; ++i) {
        if (!active[i]) continue;
        float* lo = lower.data() + static_cast<size_t>(i) * G;
        const int a = assign[i], arg = best_arg[i];
        upper[i] = above(i, best[i]);
        if (best_group[i] >= 0) lo[best_group[i]] = below(i, best2[i]);
        if (it > 0 && arg != a && !need[static_cast<size_t>(i) * G + gr.of[a]])
          lo[gr.of[a]] = std::min(lo[gr.of[a]], below(i, va[i]));
        if (arg != a) {
          ++ch;
          assign[i] = arg;
        }
      }
      changed[t] = ch;
    });
    ++run.rounds;
    run.distances_full += static_cast<int64_t>(n) * k;
    int64_t total = 0;
    for (int64_t c : changed) total += c;
    if (total == 0) break;
    std::copy_n(centroids, old.size(), old.data());
    kmeans_update(x, n, dim, assign, k, centroids, counts);
    // How far each centroid moved (rounded up), and the most in each group.
    std::fill(gdrift.begin(), gdrift.end(), 0.0);
    for (int c = 0; c < k; ++c) {
      double s = 0;
      for (size_t j = 0; j < D; ++j) {
        const double dj = static_cast<double>(centroids[c * D + j]) - old[c * D + j];
        s += dj * dj;
      }
      drift[c] = std::sqrt(s) * (1 + 1e-12);
      gdrift[gr.of[c]] = std::max(gdrift[gr.of[c]], drift[c]);
    }
  }
  for (const auto& w : scratch) run.distances += w.distances;
  return run;
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
