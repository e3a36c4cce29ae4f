// lfps on the GPU (LFPS (Learn from the Past), section 4.2, Algorithm 1, Eq. 4-10; the CPU method is
// src/methods/lfps/lfps.cpp, docs/methods.md "lfps"; docs/cuda.md "lfps on the GPU"). Per
// (sequence, query head) row the device keeps the two score tables in float64, as the CPU:
// vertical indexed by key position, slash in a ring of max_tokens + 1 entries whose start
// moves back by one per update (Eq. 10's shift, with no copy). A step, for the whole batch,
// with no host wait:
//   rho (one CTA per row): the sink ratio (Eq. 5-6) from token 0, the last six tokens and
//     the prompt's mean key; a bypassed row (rho > epsilon) stops there;
//   moments and marks (one CTA per chunk of 2048 positions of a row): each chunk's moments of
//     both tables, merged by the row's last CTA into the mean and kappa of Eq. 8, the thresholds, and C1 (Eq. 7,
//     9) as a bitmap, compacted into ascending positions;
//   scores: q . k of every candidate; top-k of the candidates (k from the row's own cache
//     length, read on the device);
//   decay (per chunk) and update (one CTA per row): the tables decayed, the slash's ring
//     start moved back, C2's softmax weights (float64) added (Eq. 10), the sinks and C2
//     into the kv head's union;
//   after the attention, a bypassed row's output becomes the prompt's mean value vector.
// prefill() builds the tables from the prompt's last s queries (Eq. 4), the mean key over
// positions [1, n) and the mean value over [0, n), and sigma-hat^2 from the last query.
#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "cumulus/methods/lfps.h"
#include "cumulus/methods/cuda_methods.h"
#include "kernels/cuda/cuda_internal.cuh"

namespace cumulus::cuda {
namespace {

constexpr int kRowThreads = 256;    // the sink ratio kernel (8 warps: 7 keys and the mean key)
constexpr int kChunkThreads = 256;  // the table passes, one CTA per chunk of a row
constexpr int kChunk = 2048;        // table entries per CTA of the table passes (a multiple of 32)
constexpr int kUpdateThreads = 1024; // the update, one CTA per row over C2's entries
constexpr int kScoreThreads = 256;  // the scoring kernels
constexpr int kMeansChunk = 1024;   // tokens per CTA of the prompt means' partial sums

// Moments of one table over a chunk (Eq. 8's statistics, merged across chunks by
// merge_moments): count, mean, and the sums of (x - mean)^2, ^3 and ^4.
struct Moments {
  double n = 0, mean = 0, m2 = 0, m3 = 0, m4 = 0;
};

struct LfpsParams {
  DeviceKvView kv;
  int group = 1, n_q = 0;
  int ring = 0;    // entries per table row: max_tokens + 1
  int stride = 0;  // candidates per row at most: max_tokens
  int k_max = 1;   // the largest top-k a step can take
  float scale = 1;
  double a = 0, r = 0, epsilon = 0, budget_ratio = 0;
  int budget = 0, sinks = 0;
  const float* q = nullptr;    // [n_seqs][n_q][D] this step's queries
  double* tv = nullptr;        // [rows][ring] vertical table, by position
  double* ts = nullptr;        // [rows][ring] slash table: position i at (i + sbase[row]) mod ring
  int* sbase = nullptr;        // [rows]
  double* sigma2 = nullptr;    // [rows] sigma-hat^2 (prefill)
  double* rho = nullptr;       // [rows] the last step's sink ratio
  int* bypass = nullptr;       // [rows] the last step bypassed
  float* kmean = nullptr;      // [n_seqs * n_kv][D] the prompt's mean key over [1, n)
  float* vmean = nullptr;      // [n_seqs * n_kv][D] the prompt's mean value over [0, n)
  int* mode = nullptr;         // [rows] kModeNone, kModeAll or kModeTables (this step)
  int chunks = 0;              // chunks of kChunk entries covering max_tokens
  Moments* moments = nullptr;  // [rows][chunks][2] each chunk's moments of vertical, slash
  int* tickets = nullptr;      // [rows] CTAs of lfps_moments_kernel done (0 between steps)
  double* thresholds = nullptr;  // [rows][4] Eq. 8: mean and tau of vertical, of slash
  uint32_t* cbits = nullptr;   // [rows][cwords] C1 as a bitmap
  int cwords = 0;
  int32_t* cand = nullptr;     // [rows][stride] C1, ascending positions (compacted cbits)
  int32_t* ncand = nullptr;    // [rows]
  float* cscore = nullptr;     // [rows][stride] raw q . k of the candidates
  int32_t* krow = nullptr;     // [rows] this step's k (0: bypassed)
  int32_t* top = nullptr;      // [rows][k_max] C2 as indices into cand, ascending
  int32_t* ntop = nullptr;     // [rows]
  uint32_t* bits = nullptr;
  int words = 0;
  float* claimed = nullptr;
  int32_t* budget_out = nullptr;
};

// Element offset of token t's row of (seq, kv head h) in the K or V pool.
__device__ __forceinline__ size_t row_offset(const DeviceKvView& kv, int seq, int h, int t) {
  const int32_t page =
      __ldg(kv.page_table + (static_cast<size_t>(seq) * kv.n_kv_heads + h) * kv.max_pages + (t >> kv.page_shift));
  return (static_cast<size_t>(page) * kv.page_size + (t & (kv.page_size - 1))) * kv.head_dim;
}

// Raw q . k (float32) of tokens idx(0 .. count) of (seq, h), out[j] for each, by the warps
// of the CTAs given: D / 8 lanes per token, 16 bytes a lane. first/step: this CTA's share
// of the token groups (grid-stride).
template <int D, class T, class Idx>
__device__ void score_tokens(const DeviceKvView& kv, int seq, int h, const float* __restrict__ q, int count, Idx idx,
                             float* __restrict__ out, int first_warp, int warp_step) {
  constexpr int RL = D / 8, TPL = 32 / RL, U = 4;  // U token groups in flight per warp
  const int lane = threadIdx.x & 31, rl = lane % RL, sub = lane / RL;
  float qv[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) qv[e] = q[rl * 8 + e];
  const T* kb = static_cast<const T*>(kv.k);
  for (int j0 = first_warp * TPL * U; j0 < count; j0 += warp_step * TPL * U) {
    uint4 kr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * TPL + sub;
      kr[u] = j < count ? load16(kb + row_offset(kv, seq, h, idx(j)) + rl * 8) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * TPL + sub;
      const float acc = lane_group_dot8<RL>(qv, kr[u], T());
      if (j < count && rl == 0) out[j] = acc;
    }
  }
}

__device__ __forceinline__ double slash_at(const double* ts, int base, int ring, int i) {
  const int j = i + base;
  return ts[j >= ring ? j - ring : j];
}

// What a row's step does after its sink ratio (LfpsParams::mode).
constexpr int kModeNone = 0;    // bypassed (or an empty cache): no candidates, no update
constexpr int kModeAll = 1;     // k >= the non-sink tokens: every one of them is a candidate
constexpr int kModeTables = 2;  // candidates from the tables (Eq. 7-9)

// Step 1 of Algorithm 1 for one row: rho, the bypass, k and the row's mode. grid: rows.
template <int D, class T>
__global__ void __launch_bounds__(kRowThreads) lfps_rho_kernel(LfpsParams p) {
  __shared__ float s_sc[1 + kLfpsLocalWindow];
  __shared__ double s_q[2];
  const int row = blockIdx.x, seq = row / p.n_q, qh = row % p.n_q, h = qh / p.group;
  const int n = p.kv.n_tokens[seq];
  const int n_sink = min(p.sinks, n);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* q = p.q + static_cast<size_t>(row) * D;
  // Eq. 5's keys: the sink (token 0) and the last kLfpsLocalWindow tokens after it.
  const int first_local = max(1, n - kLfpsLocalWindow);
  const int m = n > 0 ? 1 + (n - first_local) : 0;
  const T* kb = static_cast<const T*>(p.kv.k);
  if (warp < m) {
    const int t = warp == 0 ? 0 : first_local + warp - 1;
    const T* kr = kb + row_offset(p.kv, seq, h, t);
    float acc = 0.0f;
    for (int e = lane; e < D; e += 32) acc = fmaf(q[e], to_float(kr[e]), acc);
    acc = warp_sum(acc);
    if (lane == 0) s_sc[warp] = acc;
  } else if (warp == 1 + kLfpsLocalWindow) {
    const float* km = p.kmean + (static_cast<size_t>(seq) * p.kv.n_kv_heads + h) * D;
    double qk = 0, qn2 = 0;
    for (int e = lane; e < D; e += 32) {
      qk += static_cast<double>(q[e]) * km[e];
      qn2 += static_cast<double>(q[e]) * q[e];
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
      qk += __shfl_xor_sync(0xffffffffu, qk, o);
      qn2 += __shfl_xor_sync(0xffffffffu, qn2, o);
    }
    if (lane == 0) s_q[0] = qk, s_q[1] = qn2;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int by = 0;
  if (n > 0) {
    // Eq. 5-6 in log space, with the CPU's float products.
    const double l_sink = p.scale * s_sc[0];
    double l_local = -INFINITY;
    for (int u = 1; u < m; ++u) l_local = log_add(l_local, static_cast<double>(p.scale * s_sc[u]));
    const double l_global = p.scale * s_q[0] + s_q[1] * p.sigma2[row] / 2 + log(static_cast<double>(n));
    const double rho = exp(l_sink - log_add(log_add(l_sink, l_global), l_local));
    p.rho[row] = rho;
    by = rho > p.epsilon;
  }
  p.bypass[row] = by;
  p.claimed[row] = __int_as_float(0x7fc00000);  // NaN: a fixed budget makes no claim
  const int k = lfps_budget(p.budget, p.budget_ratio, n);
  const int mode = by || n == 0 ? kModeNone : k >= n - n_sink ? kModeAll : kModeTables;
  p.mode[row] = mode;
  p.krow[row] = mode == kModeNone ? 0 : min(k, p.k_max);
  if (mode == kModeNone) p.budget_out[row] = 0;
}

// The moments of the union of two disjoint sets (the pairwise update of Chan et al. and
// Pebay): exact in exact arithmetic, so the merged kappa is the CPU's two-pass one up to
// rounding.
__device__ Moments merge_moments(const Moments& a, const Moments& b) {
  if (a.n == 0) return b;
  if (b.n == 0) return a;
  Moments r;
  const double na = a.n, nb = b.n, n = na + nb, in = 1.0 / n, d = b.mean - a.mean, d2 = d * d;
  r.n = n;
  r.mean = a.mean + d * nb * in;
  r.m2 = a.m2 + b.m2 + d2 * na * nb * in;
  r.m3 = a.m3 + b.m3 + d2 * d * na * nb * (na - nb) * in * in + 3 * d * (na * b.m2 - nb * a.m2) * in;
  r.m4 = a.m4 + b.m4 + d2 * d2 * na * nb * (na * na - na * nb + nb * nb) * in * in * in +
         6 * d2 * (na * na * b.m2 + nb * nb * a.m2) * in * in + 4 * d * (na * b.m3 - nb * a.m3) * in;
  return r;
}

__device__ __forceinline__ Moments load_moments_cg(const Moments* m) {  // past L1: other CTAs wrote it
  const double* d = reinterpret_cast<const double*>(m);
  return Moments{__ldcg(d), __ldcg(d + 1), __ldcg(d + 2), __ldcg(d + 3), __ldcg(d + 4)};
}

__device__ __forceinline__ Moments shfl_down_moments(const Moments& x, int off) {
  Moments r;
  r.n = __shfl_down_sync(0xffffffffu, x.n, off);
  r.mean = __shfl_down_sync(0xffffffffu, x.mean, off);
  r.m2 = __shfl_down_sync(0xffffffffu, x.m2, off);
  r.m3 = __shfl_down_sync(0xffffffffu, x.m3, off);
  r.m4 = __shfl_down_sync(0xffffffffu, x.m4, off);
  return r;
}

// Eq. 8's statistics, per chunk of kChunk table entries of the non-sink positions
// [n_sink, n): two passes over the chunk (its mean, then the central sums). grid: (chunks,
// rows).
__global__ void __launch_bounds__(kChunkThreads) lfps_moments_kernel(LfpsParams p) {
  const int row = blockIdx.y, c = blockIdx.x, seq = row / p.n_q;
  if (p.mode[row] != kModeTables) return;
  const int n = p.kv.n_tokens[seq], n_sink = min(p.sinks, n);
  const int lo = max(n_sink, c * kChunk), hi = min(n, (c + 1) * kChunk);
  Moments* out = p.moments + (static_cast<size_t>(row) * p.chunks + c) * 2;
  if (lo < hi) {
    const double* __restrict__ tv = p.tv + static_cast<size_t>(row) * p.ring;
    const double* __restrict__ ts = p.ts + static_cast<size_t>(row) * p.ring;
    const int base = p.sbase[row];
    double sv = 0, ss = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) sv += tv[i], ss += slash_at(ts, base, p.ring, i);
    const double cnt = hi - lo;
    const double mv = block_sum<double>(sv) / cnt, ms = block_sum<double>(ss) / cnt;
    double v2 = 0, v3 = 0, v4 = 0, s2 = 0, s3 = 0, s4 = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const double dv = tv[i] - mv, ds = slash_at(ts, base, p.ring, i) - ms;
      v2 += dv * dv, v3 += dv * dv * dv, v4 += dv * dv * dv * dv;
      s2 += ds * ds, s3 += ds * ds * ds, s4 += ds * ds * ds * ds;
    }
    v2 = block_sum<double>(v2);
    v3 = block_sum<double>(v3);
    v4 = block_sum<double>(v4);
    s2 = block_sum<double>(s2);
    s3 = block_sum<double>(s3);
    s4 = block_sum<double>(s4);
    if (threadIdx.x == 0) {
      out[0] = Moments{cnt, mv, v2, v3, v4};
      out[1] = Moments{cnt, ms, s2, s3, s4};
    }
  } else if (threadIdx.x == 0) {
    out[0] = out[1] = Moments{};
  }
  // The row's last CTA to finish (a ticket) merges every chunk's moments (warp 0: lane l
  // those with index = l mod 32 in order, then a tree over the lanes) into Eq. 8's means
  // and thresholds, for lfps_marks_kernel.
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(p.tickets + row, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!s_last || threadIdx.x >= 32) return;
  __threadfence();
  Moments v, s;
  const Moments* m = p.moments + static_cast<size_t>(row) * p.chunks * 2;
  for (int j = threadIdx.x; j < static_cast<int>(gridDim.x); j += 32) {
    const Moments a = load_moments_cg(m + 2 * j), b = load_moments_cg(m + 2 * j + 1);
    v = merge_moments(v, a), s = merge_moments(s, b);
  }
  for (int off = 16; off >= 1; off >>= 1) {
    const Moments v2 = shfl_down_moments(v, off), s2 = shfl_down_moments(s, off);
    if (static_cast<int>(threadIdx.x) < off) v = merge_moments(v, v2), s = merge_moments(s, s2);
  }
  if (threadIdx.x == 0) {
    const double kappa_v = v.m2 > 0 ? v.m4 / (v.m2 * v.m2) : 0.0;
    const double kappa_s = s.m2 > 0 ? s.m4 / (s.m2 * s.m2) : 0.0;
    // Eq. 8; a flat table (kappa = 0) gives no candidates.
    double* t = p.thresholds + static_cast<size_t>(row) * 4;
    t[0] = v.mean;
    t[1] = kappa_v > 0 ? p.a * v.mean / kappa_v : INFINITY;
    t[2] = s.mean;
    t[3] = kappa_s > 0 ? p.a * s.mean / kappa_s : INFINITY;
    p.tickets[row] = 0;
  }
}

// Step 2 of Algorithm 1: C1 (Eq. 7, 9) of a chunk as bits of the row's candidate bitmap: x
// joins when x - delta is in C0 for some delta and x's own entry exceeds its table's mean
// (lfps_moments_kernel's thresholds); every non-sink token in mode kModeAll. grid: (chunks,
// rows).
__global__ void __launch_bounds__(kChunkThreads) lfps_marks_kernel(LfpsParams p) {
  __shared__ double s_t[4];  // mean_v, tau_v, mean_s, tau_s
  const int row = blockIdx.y, c = blockIdx.x, seq = row / p.n_q;
  const int mode = p.mode[row];
  const int n = p.kv.n_tokens[seq], n_sink = min(p.sinks, n);
  const int lo = c * kChunk, hi = min(n, lo + kChunk);
  if (mode == kModeNone || lo >= hi) return;
  const double* tv = p.tv + static_cast<size_t>(row) * p.ring;
  const double* ts = p.ts + static_cast<size_t>(row) * p.ring;
  const int base = p.sbase[row];
  if (mode == kModeTables && threadIdx.x < 4) s_t[threadIdx.x] = p.thresholds[static_cast<size_t>(row) * 4 + threadIdx.x];
  __syncthreads();
  // The chunk's positions and two on the left and one on the right (Eq. 9's offsets reach
  // x + 1 .. x - 2): C0 (Eq. 7) and "above its table's mean" of each, every load issued
  // before any test, into shared memory.
  __shared__ uint8_t s_c0[kChunk + 3], s_above[kChunk + 3];
  if (mode == kModeTables) {
    const int span = hi - lo + 3;
#pragma unroll 4
    for (int j = threadIdx.x; j < span; j += blockDim.x) {
      const int i = lo - 2 + j;
      const bool in = i >= n_sink && i < n;
      const double a = in ? tv[i] : 0.0, b = in ? slash_at(ts, base, p.ring, i) : 0.0;
      s_c0[j] = in && (a > s_t[1] || b > s_t[3]);
      s_above[j] = in && (a > s_t[0] || b > s_t[2]);
    }
    __syncthreads();
  }
  uint32_t* w = p.cbits + static_cast<size_t>(row) * p.cwords;
  for (int x0 = lo; x0 < hi; x0 += blockDim.x) {
    const int x = x0 + threadIdx.x, j = x - lo;  // s_*[j + 2] is x
    bool f = x >= n_sink && x < hi;
    if (f && mode == kModeTables)
      f = s_above[j + 2] && (s_c0[j + 3] | s_c0[j + 2] | s_c0[j + 1] | s_c0[j]);  // x - delta, delta = -1 .. 2
    const uint32_t bits = __ballot_sync(0xffffffffu, f);
    if ((threadIdx.x & 31) == 0 && x < hi) w[x >> 5] = bits;
  }
}

// cscore[row][j] = q . k of candidate j. grid: (CTAs per row, rows).
template <int D, class T>
__global__ void __launch_bounds__(kScoreThreads) lfps_score_kernel(LfpsParams p) {
  const int row = blockIdx.y, seq = row / p.n_q, h = (row % p.n_q) / p.group;
  const int count = p.ncand[row];
  if (count == 0) return;
  const int32_t* cand = p.cand + static_cast<size_t>(row) * p.stride;
  constexpr int kWarps = kScoreThreads / 32;
  score_tokens<D, T>(p.kv, seq, h, p.q + static_cast<size_t>(row) * D, count, [&](int j) { return cand[j]; },
                     p.cscore + static_cast<size_t>(row) * p.stride, blockIdx.x * kWarps + (threadIdx.x >> 5),
                     gridDim.x * kWarps);
}

// Step 4 of Algorithm 1, Eq. 10's decay of a chunk of both tables (rows with an update:
// C2 not empty). The slash's positions [0, n) move to [1, n + 1) by lfps_update_kernel
// moving the ring's start. grid: (chunks, rows).
__global__ void __launch_bounds__(kChunkThreads) lfps_decay_kernel(LfpsParams p) {
  const int row = blockIdx.y, c = blockIdx.x, seq = row / p.n_q;
  if (p.krow[row] == 0 || p.ntop[row] == 0) return;
  const int n = p.kv.n_tokens[seq];
  const int hi = min(n, (c + 1) * kChunk);
  double* __restrict__ tv = p.tv + static_cast<size_t>(row) * p.ring;
  double* __restrict__ ts = p.ts + static_cast<size_t>(row) * p.ring;
  const int base = p.sbase[row];
#pragma unroll 4
  for (int i = c * kChunk + threadIdx.x; i < hi; i += blockDim.x) {
    tv[i] *= p.r;
    const int j = i + base;
    ts[j >= p.ring ? j - p.ring : j] *= p.r;
  }
}

// Step 4 of Algorithm 1 for one row, after the decay: the sinks and C2 into the kv head's
// union; the ring's start moved back by one (the entry that becomes position 0 cleared);
// C2's weights (the softmax over C2 in float64) minus 1 / (2 |C2|) added (Eq. 10). grid: rows.
__global__ void __launch_bounds__(kUpdateThreads) lfps_update_kernel(LfpsParams p) {
  const int row = blockIdx.x, seq = row / p.n_q, h = (row % p.n_q) / p.group;
  if (p.krow[row] == 0) return;  // bypassed: Algorithm 1 lines 4-5, no update
  const int n = p.kv.n_tokens[seq];
  const int n_sink = min(p.sinks, n);
  const int c2 = p.ntop[row];
  uint32_t* w = p.bits + (static_cast<size_t>(seq) * p.kv.n_kv_heads + h) * p.words;
  if (threadIdx.x == 0) {
    bitmap_set_range(w, 0, n_sink);  // the first `sinks` tokens, always
    p.budget_out[row] = c2;
  }
  if (c2 == 0) return;  // nothing to attend beyond the sinks, nothing to learn
  const int32_t* cand = p.cand + static_cast<size_t>(row) * p.stride;
  const int32_t* top = p.top + static_cast<size_t>(row) * p.k_max;
  const float* cs = p.cscore + static_cast<size_t>(row) * p.stride;
  const double scale = p.scale;
  double mx = -INFINITY;
  for (int u = threadIdx.x; u < c2; u += blockDim.x) mx = fmax(mx, scale * cs[top[u]]);
  mx = block_max(mx);
  double sum = 0;
  for (int u = threadIdx.x; u < c2; u += blockDim.x) sum += exp(scale * cs[top[u]] - mx);
  sum = block_sum<double>(sum);
  const double c = 1.0 / (2.0 * c2);
  double* tv = p.tv + static_cast<size_t>(row) * p.ring;
  double* ts = p.ts + static_cast<size_t>(row) * p.ring;
  const int base = p.sbase[row];
  const int nb = base == 0 ? p.ring - 1 : base - 1;
  __syncthreads();  // every thread has read the old start
  if (threadIdx.x == 0) {
    ts[nb] = 0.0;  // position ring - 1 before the move: never a cached position (n < ring)
    p.sbase[row] = nb;
  }
  for (int u = threadIdx.x; u < c2; u += blockDim.x) {
    const int x = cand[top[u]];
    const double d = exp(scale * cs[top[u]] - mx) / sum - c;
    tv[x] += d;
    const int j = x + nb;
    ts[j >= p.ring ? j - p.ring : j] += d;
    atomicOr(w + (x >> 5), 1u << (x & 31));
  }
}

// After the attention: a bypassed row outputs the prompt's mean value vector and has no
// true mass. grid: rows, block: D.
__global__ void lfps_bypass_kernel(LfpsParams p, float* out, float* mass) {
  const int row = blockIdx.x;
  if (!p.bypass[row]) return;
  const int seq = row / p.n_q, h = (row % p.n_q) / p.group, d = p.kv.head_dim;
  const float* vm = p.vmean + (static_cast<size_t>(seq) * p.kv.n_kv_heads + h) * d;
  for (int e = threadIdx.x; e < d; e += blockDim.x) out[static_cast<size_t>(row) * d + e] = vm[e];
  if (mass != nullptr && threadIdx.x == 0) mass[row] = __int_as_float(0x7fc00000);
}

// Prefill, the prompt means: partial float64 sums of keys at positions >= 1 and of values
// over chunks of kMeansChunk tokens. grid: (chunks, n_seqs * n_kv), block: D.
template <class T>
__global__ void lfps_means_partial_kernel(LfpsParams p, double* part, int chunks) {
  const int list = blockIdx.y, seq = list / p.kv.n_kv_heads, h = list % p.kv.n_kv_heads, d = p.kv.head_dim;
  const int n = p.kv.n_tokens[seq], e = threadIdx.x;
  const T* kb = static_cast<const T*>(p.kv.k);
  const T* vb = static_cast<const T*>(p.kv.v);
  double ks = 0, vs = 0;
  const int t1 = min(n, static_cast<int>(blockIdx.x + 1) * kMeansChunk);
  for (int t = blockIdx.x * kMeansChunk; t < t1; ++t) {
    const size_t o = row_offset(p.kv, seq, h, t) + e;
    vs += to_float(vb[o]);
    if (t >= 1 || n == 1) ks += to_float(kb[o]);
  }
  double* o = part + (static_cast<size_t>(list) * chunks + blockIdx.x) * 2 * d;
  o[e] = ks;
  o[d + e] = vs;
}

// The partial sums added in chunk order. grid: n_seqs * n_kv, block: D.
__global__ void lfps_means_kernel(LfpsParams p, const double* part, int chunks) {
  const int list = blockIdx.x, seq = list / p.kv.n_kv_heads, d = p.kv.head_dim, e = threadIdx.x;
  const int n = p.kv.n_tokens[seq];
  double ks = 0, vs = 0;
  for (int c = 0; c < chunks; ++c) {
    const double* o = part + (static_cast<size_t>(list) * chunks + c) * 2 * d;
    ks += o[e];
    vs += o[d + e];
  }
  const int k0 = n > 1 ? 1 : 0;
  p.kmean[static_cast<size_t>(list) * d + e] = n - k0 > 0 ? static_cast<float>(ks / (n - k0)) : 0.0f;
  p.vmean[static_cast<size_t>(list) * d + e] = n > 0 ? static_cast<float>(vs / n) : 0.0f;
}

// Prefill (Eq. 4) for one (sequence, kv head): the query jd positions before the end
// (jd = blockIdx.x + 1, at position n - jd) of group member blockIdx.y scores keys [0, n - jd]
// into scr[member][jd - 1][.]; ml[member][jd - 1] = the max and the exp-sum of its weights
// over the non-sink keys; the last query (jd = 1) also gives sigma-hat^2 over keys [1, n).
template <int D, class T>
__global__ void __launch_bounds__(kScoreThreads)
    lfps_prompt_scores_kernel(LfpsParams p, const float* pq, int pq_rows, int rows, int seq, int h, float* scr,
                              double* ml) {
  const int jd = blockIdx.x + 1, jq = blockIdx.y, qh = h * p.group + jq, row = seq * p.n_q + qh;
  const int n = p.kv.n_tokens[seq];
  const int n_sink = min(p.sinks, n);
  const int pos = n - jd;
  const float* q = pq + ((static_cast<size_t>(seq) * pq_rows + (pq_rows - jd)) * p.n_q + qh) * D;
  float* s = scr + (static_cast<size_t>(jq) * rows + jd - 1) * p.stride;
  if (pos < 0) return;
  score_tokens<D, T>(p.kv, seq, h, q, pos + 1, [](int j) { return j; }, s, threadIdx.x >> 5, kScoreThreads / 32);
  __syncthreads();
  const double scale = p.scale;
  if (pos >= n_sink) {
    double mx = -INFINITY;
    for (int i = n_sink + threadIdx.x; i <= pos; i += blockDim.x) mx = fmax(mx, scale * s[i]);
    mx = block_max(mx);
    double sum = 0;
    for (int i = n_sink + threadIdx.x; i <= pos; i += blockDim.x) sum += exp(scale * s[i] - mx);
    sum = block_sum<double>(sum);
    if (threadIdx.x == 0) {
      ml[(static_cast<size_t>(jq) * rows + jd - 1) * 2] = mx;
      ml[(static_cast<size_t>(jq) * rows + jd - 1) * 2 + 1] = sum;
    }
  }
  if (jd != 1) return;
  // sigma-hat^2 = Var_i(q . k_i / sqrt(d)) / ||q||^2 over keys [1, n), with the CPU's float
  // products.
  double sigma2 = 0;
  if (n > 2) {
    double mu = 0;
    for (int i = 1 + threadIdx.x; i < n; i += blockDim.x) mu += p.scale * s[i];
    mu = block_sum<double>(mu) / (n - 1);
    double m2 = 0, qn2 = 0;
    for (int i = 1 + threadIdx.x; i < n; i += blockDim.x) {
      const double x = p.scale * s[i] - mu;
      m2 += x * x;
    }
    for (int e = threadIdx.x; e < D; e += blockDim.x) qn2 += static_cast<double>(q[e]) * q[e];
    m2 = block_sum<double>(m2);
    qn2 = block_sum<double>(qn2);
    sigma2 = qn2 > 0 ? (m2 / (n - 1)) / qn2 : 0.0;
  }
  if (threadIdx.x == 0) p.sigma2[row] = sigma2;
}

// Prefill (Eq. 4), the tables of one (sequence, kv head) from the scores: each entry sums
// its weights over jd = 1 .. used in order, then is scaled by 1 / (2 used (1 - r)).
// grid: (ceil(n / kScoreThreads), group).
__global__ void __launch_bounds__(kScoreThreads)
    lfps_tables_kernel(LfpsParams p, int rows, int used, int seq, int h, const float* scr, const double* ml) {
  const int jq = blockIdx.y, row = seq * p.n_q + h * p.group + jq;
  const int n = p.kv.n_tokens[seq];
  const int n_sink = min(p.sinks, n);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_sink || i >= n) return;
  const double scale = p.scale;
  double v = 0, s = 0;
  for (int jd = 1; jd <= used; ++jd) {
    const float* sc = scr + (static_cast<size_t>(jq) * rows + jd - 1) * p.stride;
    const double mx = ml[(static_cast<size_t>(jq) * rows + jd - 1) * 2];
    const double sum = ml[(static_cast<size_t>(jq) * rows + jd - 1) * 2 + 1];
    if (i <= n - jd) v += exp(scale * sc[i] - mx) / sum;
    const int src = i - jd + 1;  // the slash entry of distance jd - 1 behind i
    if (src >= n_sink) s += exp(scale * sc[src] - mx) / sum;
  }
  const double norm = used > 0 ? 1.0 / (2.0 * used * (1.0 - p.r)) : 0.0;
  p.tv[static_cast<size_t>(row) * p.ring + i] = v * norm;
  p.ts[static_cast<size_t>(row) * p.ring + i] = s * norm;
}

class LfpsGpu final : public SparseDecoder {
 public:
  LfpsGpu(const DeviceKvView& kv, int group, const LfpsOptions& o, const AttentionPlanOptions& po)
      : SparseDecoder(kv, group, po), o_(o) {
    CUMULUS_CHECK(o.a > 0, "lfps: a={} must be > 0", o.a);
    CUMULUS_CHECK(o.r >= 0 && o.r < 1, "lfps: r={} must be in [0, 1)", o.r);
    CUMULUS_CHECK(o.epsilon >= 0 && o.epsilon <= 1, "lfps: epsilon={} must be in [0, 1]", o.epsilon);
    CUMULUS_CHECK(o.s >= 1, "lfps: s={} must be >= 1", o.s);
    CUMULUS_CHECK(o.budget >= 0, "lfps: budget={} must be >= 0", o.budget);
    CUMULUS_CHECK(o.budget_ratio > 0 && o.budget_ratio <= 1, "lfps: budget_ratio={} must be in (0, 1]",
                  o.budget_ratio);
    CUMULUS_CHECK(o.sinks >= 1, "lfps: sinks={} must be >= 1", o.sinks);
    const Base& b = base();
    const int rows = kv.n_seqs * b.n_q;
    p_.kv = kv;
    p_.group = group;
    p_.n_q = b.n_q;
    p_.ring = kv.max_tokens + 1;
    p_.stride = std::max(1, kv.max_tokens);
    p_.k_max = std::max(1, std::min(p_.stride, lfps_budget(o, kv.max_tokens)));
    p_.scale = 1.0f / std::sqrt(static_cast<float>(kv.head_dim));
    p_.a = o.a;
    p_.r = o.r;
    p_.epsilon = o.epsilon;
    p_.budget_ratio = o.budget_ratio;
    p_.budget = o.budget;
    p_.sinks = o.sinks;
    const size_t table = static_cast<size_t>(rows) * p_.ring * sizeof(double);
    tv_ = DeviceBuffer(table);
    ts_ = DeviceBuffer(table);
    sbase_ = DeviceBuffer(rows * sizeof(int));
    sigma2_ = DeviceBuffer(rows * sizeof(double));
    rho_ = DeviceBuffer(rows * sizeof(double));
    bypass_ = DeviceBuffer(rows * sizeof(int));
    bypass_.fill_bytes(0);
    kmean_ = DeviceBuffer(static_cast<size_t>(b.n_lists) * kv.head_dim * sizeof(float));
    vmean_ = DeviceBuffer(static_cast<size_t>(b.n_lists) * kv.head_dim * sizeof(float));
    mode_ = DeviceBuffer(rows * sizeof(int));
    p_.chunks = ceil_div(p_.stride, kChunk);
    moments_ = DeviceBuffer(static_cast<size_t>(rows) * p_.chunks * 2 * sizeof(Moments));
    tickets_ = DeviceBuffer(rows * sizeof(int));
    tickets_.fill_bytes(0);
    thresholds_ = DeviceBuffer(static_cast<size_t>(rows) * 4 * sizeof(double));
    p_.cwords = (p_.stride + 31) / 32;
    cbits_ = DeviceBuffer(static_cast<size_t>(rows) * p_.cwords * sizeof(uint32_t));
    cbits_.fill_bytes(0);
    ccounts_ = DeviceBuffer(static_cast<size_t>(rows) * bitmap_tiles(p_.cwords) * sizeof(int));
    cand_ = DeviceBuffer(static_cast<size_t>(rows) * p_.stride * sizeof(int32_t));
    ncand_ = DeviceBuffer(rows * sizeof(int32_t));
    cscore_ = DeviceBuffer(static_cast<size_t>(rows) * p_.stride * sizeof(float));
    krow_ = DeviceBuffer(rows * sizeof(int32_t));
    top_ = DeviceBuffer(static_cast<size_t>(rows) * p_.k_max * sizeof(int32_t));
    ntop_ = DeviceBuffer(rows * sizeof(int32_t));
    p_.tv = tv_.as<double>();
    p_.ts = ts_.as<double>();
    p_.sbase = sbase_.as<int>();
    p_.sigma2 = sigma2_.as<double>();
    p_.rho = rho_.as<double>();
    p_.bypass = bypass_.as<int>();
    p_.kmean = kmean_.as<float>();
    p_.vmean = vmean_.as<float>();
    p_.mode = mode_.as<int>();
    p_.moments = moments_.as<Moments>();
    p_.tickets = tickets_.as<int>();
    p_.thresholds = thresholds_.as<double>();
    p_.cbits = cbits_.as<uint32_t>();
    p_.cand = cand_.as<int32_t>();
    p_.ncand = ncand_.as<int32_t>();
    p_.cscore = cscore_.as<float>();
    p_.krow = krow_.as<int32_t>();
    p_.top = top_.as<int32_t>();
    p_.ntop = ntop_.as<int32_t>();
    p_.bits = b.bits.as<uint32_t>();
    p_.words = b.words;
    p_.claimed = b.claimed.as<float>();
    p_.budget_out = b.budget.as<int32_t>();
    base().bypass = bypass_.as<int>();
  }
  std::string name() const override { return "lfps"; }
  int prompt_queries() const override { return o_.s; }
  // Both float64 tables of every query head of the kv head; the candidates' keys, which
  // vary by step, are left out (a lower bound, as tactic's).
  double select_bytes_per_token() const override { return 2.0 * sizeof(double) * base().group; }

  void prefill(void* stream, const DevicePromptQueries& pq) override {
    const cudaStream_t st = as_stream(stream);
    const Base& b = base();
    const int d = b.kv.head_dim;
    CUMULUS_CHECK(pq.q != nullptr && pq.rows > 0,
                  "lfps needs the prompt's last queries (DevicePromptQueries: q={}, rows={}) to build its score "
                  "tables (LFPS, Eq. 4)",
                  static_cast<const void*>(pq.q), pq.rows);
    std::vector<int> n(static_cast<size_t>(b.kv.n_seqs));
    CUMULUS_CUDA_CHECK(cudaStreamSynchronize(st));
    memcpy_to_host(n.data(), b.kv.n_tokens, n.size() * sizeof(int));
    for (int s = 0; s < b.kv.n_seqs; ++s)
      CUMULUS_CHECK(pq.rows <= n[s], "lfps: DevicePromptQueries::rows={} exceeds the {} tokens cached for sequence {}",
                    pq.rows, n[s], s);
    tv_.fill_bytes(0);
    ts_.fill_bytes(0);
    sbase_.fill_bytes(0);
    bypass_.fill_bytes(0);
    // The means.
    const int chunks = std::max(1, ceil_div(b.kv.max_tokens, kMeansChunk));
    DeviceBuffer part(static_cast<size_t>(b.n_lists) * chunks * 2 * d * sizeof(double));
    const bool f16 = b.kv.dtype == DType::f16;
    if (f16)
      lfps_means_partial_kernel<__half><<<dim3(chunks, b.n_lists), d, 0, st>>>(p_, part.as<double>(), chunks);
    else
      lfps_means_partial_kernel<__nv_bfloat16><<<dim3(chunks, b.n_lists), d, 0, st>>>(p_, part.as<double>(), chunks);
    CUMULUS_CUDA_LAUNCH("lfps_means_partial_kernel");
    lfps_means_kernel<<<b.n_lists, d, 0, st>>>(p_, part.as<double>(), chunks);
    CUMULUS_CUDA_LAUNCH("lfps_means_kernel");
    // The tables, one (sequence, kv head) at a time: its group's scores of the last `rows`
    // queries take group * rows * max_tokens floats.
    const int rows = std::min(o_.s, pq.rows);
    DeviceBuffer scr(static_cast<size_t>(b.group) * rows * p_.stride * sizeof(float));
    DeviceBuffer ml(static_cast<size_t>(b.group) * rows * 2 * sizeof(double));
    for (int s = 0; s < b.kv.n_seqs; ++s) {
      const int n_sink = std::min(o_.sinks, n[s]);
      const int used = std::max(0, std::min(rows, n[s] - n_sink));  // queries with a non-sink key
      for (int h = 0; h < b.kv.n_kv_heads; ++h) {
        with_head_dim_type(d, b.kv.dtype, [&](auto dd, auto t) {
          lfps_prompt_scores_kernel<decltype(dd)::value, decltype(t)><<<dim3(rows, b.group), kScoreThreads, 0, st>>>(
              p_, pq.q, pq.rows, rows, s, h, scr.as<float>(), ml.as<double>());
        });
        CUMULUS_CUDA_LAUNCH("lfps_prompt_scores_kernel");
        if (n[s] > 0) {
          lfps_tables_kernel<<<dim3(ceil_div(n[s], kScoreThreads), b.group), kScoreThreads, 0, st>>>(
              p_, rows, used, s, h, scr.as<float>(), ml.as<double>());
          CUMULUS_CUDA_LAUNCH("lfps_tables_kernel");
        }
      }
    }
    CUMULUS_CUDA_CHECK(cudaStreamSynchronize(st));  // the scratch outlives its kernels
    prefilled_ = true;
  }

  void select(const float* q, void* stream) override {
    CUMULUS_CHECK(prefilled_, "lfps: select() before prefill() built its score tables");
    Base& b = base();
    const cudaStream_t st = as_stream(stream);
    p_.q = q;
    const int rows = b.kv.n_seqs * b.n_q;
    const dim3 chunked(p_.chunks, rows);
    with_head_dim_type(b.kv.head_dim, b.kv.dtype, [&](auto dd, auto t) {
      lfps_rho_kernel<decltype(dd)::value, decltype(t)><<<rows, kRowThreads, 0, st>>>(p_);
    });
    CUMULUS_CUDA_LAUNCH("lfps_rho_kernel");
    lfps_moments_kernel<<<chunked, kChunkThreads, 0, st>>>(p_);
    CUMULUS_CUDA_LAUNCH("lfps_moments_kernel");
    lfps_marks_kernel<<<chunked, kChunkThreads, 0, st>>>(p_);
    CUMULUS_CUDA_LAUNCH("lfps_marks_kernel");
    bitmap_compact(p_.cbits, rows, p_.cwords, p_.cand, p_.stride, p_.ncand, ccounts_.as<int>(), st);
    with_head_dim_type(b.kv.head_dim, b.kv.dtype, [&](auto dd, auto t) {
      // About 8 CTAs per multiprocessor over the batch's rows, each warp with 4 token groups
      // in flight.
      const int per_row = std::max(1, std::min(ceil_div(p_.stride, 256), 8 * sm_count() / std::max(1, rows)));
      lfps_score_kernel<decltype(dd)::value, decltype(t)><<<dim3(per_row, rows), kScoreThreads, 0, st>>>(p_);
    });
    CUMULUS_CUDA_LAUNCH("lfps_score_kernel");
    select_topk_rows_k(p_.cscore, p_.ncand, rows, p_.stride, p_.krow, p_.k_max, p_.top, p_.ntop, st);
    lfps_decay_kernel<<<chunked, kChunkThreads, 0, st>>>(p_);
    CUMULUS_CUDA_LAUNCH("lfps_decay_kernel");
    lfps_update_kernel<<<rows, kUpdateThreads, 0, st>>>(p_);
    CUMULUS_CUDA_LAUNCH("lfps_update_kernel");
    b.compact(st);
  }

  LfpsTablesCopy download(int seq, int q_head) const {
    const Base& b = base();
    CUMULUS_CHECK(seq >= 0 && seq < b.kv.n_seqs && q_head >= 0 && q_head < b.n_q, "seq={} q_head={} out of range",
                  seq, q_head);
    CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());
    const size_t row = static_cast<size_t>(seq) * b.n_q + q_head;
    int n = 0, base_s = 0, by = 0;
    memcpy_to_host(&n, b.kv.n_tokens + seq, sizeof(int));
    memcpy_to_host(&base_s, sbase_.as<int>() + row, sizeof(int));
    memcpy_to_host(&by, bypass_.as<int>() + row, sizeof(int));
    LfpsTablesCopy c;
    std::vector<double> v(static_cast<size_t>(p_.ring)), s(static_cast<size_t>(p_.ring));
    memcpy_to_host(v.data(), tv_.as<double>() + row * p_.ring, v.size() * sizeof(double));
    memcpy_to_host(s.data(), ts_.as<double>() + row * p_.ring, s.size() * sizeof(double));
    c.vertical.assign(v.begin(), v.begin() + n);
    for (int i = 0; i < n; ++i) c.slash.push_back(s[static_cast<size_t>((i + base_s) % p_.ring)]);
    memcpy_to_host(&c.sigma_hat2, sigma2_.as<double>() + row, sizeof(double));
    memcpy_to_host(&c.rho, rho_.as<double>() + row, sizeof(double));
    c.bypass = by != 0;
    return c;
  }

 protected:
  bool needs_lse() const override { return true; }
  void after_attend(const float* /*lse*/, float* out, float* mass, void* stream) override {
    const Base& b = base();
    lfps_bypass_kernel<<<b.kv.n_seqs * b.n_q, 128, 0, as_stream(stream)>>>(p_, out, mass);
    CUMULUS_CUDA_LAUNCH("lfps_bypass_kernel");
  }

 private:
  LfpsOptions o_;
  LfpsParams p_;
  bool prefilled_ = false;
  DeviceBuffer tv_, ts_, sbase_, sigma2_, rho_, bypass_, kmean_, vmean_, mode_, moments_, tickets_, thresholds_;
  DeviceBuffer cbits_, ccounts_, cand_, ncand_, cscore_, krow_, top_, ntop_;
};

}  // namespace

std::unique_ptr<SparseDecoder> make_lfps_gpu(const DeviceKvView& kv, int group, const LfpsOptions& o,
                                             const AttentionPlanOptions& plan) {
  return std::make_unique<LfpsGpu>(kv, group, o, plan);
}

LfpsTablesCopy lfps_gpu_download(const SparseDecoder& m, int seq, int q_head) {
  const auto* l = dynamic_cast<const LfpsGpu*>(&m);
  CUMULUS_CHECK(l != nullptr, "decoder '{}' is not lfps", m.name());
  return l->download(seq, q_head);
}

// The registry's "lfps" on the GPU (MethodInfo::gpu).
void attach_lfps_gpu(Registry& r) {
  r.attach_gpu("lfps", {.make = [](const DeviceKvView& kv, const Shape& shape, int,
                                   const Params& p) -> std::unique_ptr<SparseDecoder> {
    return make_lfps_gpu(kv, shape.group(), options_read<LfpsOptions>(p));
  }});
}

}  // namespace cumulus::cuda
