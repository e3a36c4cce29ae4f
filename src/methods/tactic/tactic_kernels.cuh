// tactic's GPU kernels (src/methods/tactic/tactic.cu has the design and the host side):
// k-means helpers, centroid scores, the rankings (bucket sort in one launch, or the radix
// sort's positions), exact scores, fit and budget, and the marks (by token range, or by
// ranked cluster in shared memory or with global atomics). Not installed.
#pragma once

#include <climits>
#include <cmath>

#include "methods/tactic/tactic_params.cuh"
#include "methods/tactic/tactic_rules.h"

#include <cub/block/block_radix_sort.cuh>

namespace cumulus::cuda {
namespace {

// Pool row of token t of list (seq, kv head) `list`: K and V of t are at row * head_dim.
__device__ __forceinline__ int pool_row(const DeviceKvView& kv, int list, int t) {
  return (__ldg(kv.page_table + static_cast<size_t>(list) * kv.max_pages + (t >> kv.page_shift)) << kv.page_shift) |
         (t & (kv.page_size - 1));
}

// The ranked list and the dense tail of one (seq, kv head) holding n tokens, of which the
// first n_idx were clustered: the list is the clustered tokens less the first `sinks` and
// the last `recent` ([lo, hi), len entries, the clusters' members in rank order; prefill
// filtered the rest out of the members), the tail is [0, lo) then [hi, n), n_tail tokens,
// always attended and scored exactly. sinks = recent = 0: the list is [0, n_idx), the tail
// the tokens appended after prefill.
struct TacticSpan {
  int len = 0, lo = 0, hi = 0, n_tail = 0;
  __host__ __device__ int tail_token(int j) const { return j < lo ? j : hi + (j - lo); }
};

__host__ __device__ inline TacticSpan tactic_span(int n_idx, int n, int sinks, int recent) {
  const int idx = n_idx < n ? n_idx : n;
  TacticSpan s;
  s.lo = sinks < idx ? sinks : idx;
  s.hi = idx - recent > s.lo ? idx - recent : s.lo;
  s.len = s.hi - s.lo;
  s.n_tail = s.lo + (n - s.hi);
  return s;
}

__device__ __forceinline__ TacticSpan tactic_span(const TacticParams& p, int list, int n) {
  return tactic_span(p.n_idx[list], n, p.sinks, p.recent);
}

// Sets the bits of the dense tail [0, lo) and [hi, n) in bitmap bw, thread tid of nt.
__device__ __forceinline__ void mark_tail(uint32_t* bw, const TacticSpan& sp, int n, int tid, int nt) {
  for (int t0 = tid * 32; t0 < sp.lo; t0 += nt * 32) bitmap_set_range(bw, t0, min(sp.lo, t0 + 32));
  for (int t0 = sp.hi + tid * 32; t0 < n; t0 += nt * 32) bitmap_set_range(bw, t0, min(n, t0 + 32));
}

// Gathers the keys of tokens [0, n) of one (seq, kv head) as float32 rows. x: [n][D]
template <class T>
__global__ void gather_keys_kernel(DeviceKvView kv, int seq, int h, int n, float* __restrict__ x) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const int D = kv.head_dim;
  if (i >= static_cast<size_t>(n) * D) return;
  const int t = static_cast<int>(i / D), j = static_cast<int>(i % D);
  const int32_t* pt = kv.page_table + (static_cast<size_t>(seq) * kv.n_kv_heads + h) * kv.max_pages;
  const size_t row = (static_cast<size_t>(pt[t >> kv.page_shift]) << kv.page_shift) | (t & (kv.page_size - 1));
  x[i] = to_float(static_cast<const T*>(kv.k)[row * D + j]);
}

__global__ void gather_rows_kernel(const float* __restrict__ x, int dim, const int32_t* __restrict__ rows, int n_rows,
                                   float* __restrict__ out) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<size_t>(n_rows) * dim) return;
  out[i] = x[static_cast<size_t>(rows[i / dim]) * dim + i % dim];
}

__global__ void rows_to_half_kernel(const float* __restrict__ x, int dim, const int32_t* __restrict__ rows, int n_rows,
                                    __half* __restrict__ out) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<size_t>(n_rows) * dim) return;
  out[i] = __float2half_rn(x[static_cast<size_t>(rows[i / dim]) * dim + i % dim]);
}

constexpr int kCentRows = 8;   // centroid rows per lane of step 1 (loads in flight)
constexpr int kCentWarps = 8;

// Step 1. grid: (ceil(kc_max / (warps * block)), n_kv, n_seqs). cscore[row][c] = q . c.
template <int D>
__global__ void centroid_score_step_kernel(TacticParams p) {
  constexpr int RL = D / 8, TPL = 32 / RL, U = kCentRows, BT = TPL * U;
  const int seq = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_lane = lane % RL, tsub = lane / RL;
  const int list = seq * p.kv.n_kv_heads + h;
  const int n_c = p.n_clu[list];
  const int c0 = (blockIdx.x * (blockDim.x >> 5) + warp) * BT;
  if (c0 >= n_c) return;
  uint4 cr[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u * TPL + tsub;
    cr[u] = c < n_c ? load16(p.cent + (static_cast<size_t>(list) * p.kc_max + c) * D + row_lane * 8)
                    : make_uint4(0, 0, 0, 0);
  }
  for (int g = 0; g < p.group; ++g) {
    const int row = seq * p.n_q + h * p.group + g;
    const float* qg = p.q + static_cast<size_t>(row) * D + row_lane * 8;
    float qv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) qv[e] = qg[e];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float acc = lane_group_dot8<RL>(qv, cr[u], __half());
      const int c = c0 + u * TPL + tsub;
      if (row_lane == 0 && c < n_c) p.cscore[static_cast<size_t>(row) * p.kc_max + c] = acc;
    }
  }
}

__global__ void crow_len_kernel(const int32_t* __restrict__ n_clu, int n_rows, int n_q, int group, int n_kv,
                                int32_t* __restrict__ rowlen) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n_rows) return;
  rowlen[r] = n_clu[(r / n_q) * n_kv + (r % n_q) / group];
}

// H(n) = sum_{x=1}^{n} 1/x: exact below 64, the asymptotic series above (error < 1e-16).
__host__ __device__ inline double harmonic(long long n) {
  if (n <= 0) return 0.0;
  if (n < 64) {
    double s = 0;
    for (long long x = n; x >= 1; --x) s += 1.0 / static_cast<double>(x);
    return s;
  }
  const double x = static_cast<double>(n), x2 = x * x;
  return log(x) + 0.57721566490153286061 + 1.0 / (2 * x) - 1.0 / (12 * x2) + 1.0 / (120 * x2 * x2) -
         1.0 / (252 * x2 * x2 * x2);
}

// sum_{i=i0}^{i1-1} max(0, a/(i+1) + b) in closed form: the fitted weights past the exact
// head of the list (Algorithm 1 line 9) summed without visiting every position. Agrees
// with the term-by-term sum to ~1e-9 relative.
__host__ __device__ inline double fit_sum(double a, double b, long long i0, long long i1) {
  if (i1 <= i0) return 0.0;
  long long lo = i0, hi = i1;  // [lo, hi): where a/(i+1) + b > 0
  if (a <= 0 && b <= 0) return 0.0;
  if (b < 0) {  // a > 0: positive while i + 1 < a / -b
    long long cut = static_cast<long long>(ceil(a / -b)) - 1;
    if (cut < 0) cut = 0;
    while (cut > 0 && a / static_cast<double>(cut) + b <= 0) --cut;
    while (a / static_cast<double>(cut + 1) + b > 0) ++cut;
    hi = hi < cut ? hi : cut;
  } else if (a < 0) {  // b > 0: positive once i + 1 > -a / b
    long long start = static_cast<long long>(floor(-a / b));
    if (start < 0) start = 0;
    while (start > 0 && a / static_cast<double>(start) + b > 0) --start;
    while (a / static_cast<double>(start + 1) + b <= 0) ++start;
    lo = lo > start ? lo : start;
  }
  if (hi <= lo) return 0.0;
  return a * (harmonic(hi) - harmonic(lo)) + b * static_cast<double>(hi - lo);
}

constexpr int kPosThreads = 512;
constexpr int kPosSmemInts = 12000;  // rank arrays kept in shared memory up to this many clusters
constexpr int kExactItems = 64;      // exactly scored entries per CTA of step 3b (one load round)
constexpr int kExactThreads = 256;
constexpr int kBudgetThreads = 256;
constexpr size_t kPosSmemBytes = 2 * kPosSmemInts * sizeof(int);

// Step 3a, one CTA per (seq, q head) row: list positions of the ranked clusters (prefix
// sums of their sizes) and the tokens at the exactly scored positions.
__global__ void __launch_bounds__(kPosThreads) tactic_positions_kernel(TacticParams p) {
  extern __shared__ int pos_smem[];
  const int row = blockIdx.x;
  const int seq = row / p.n_q, qh = row % p.n_q, h = qh / p.group;
  const int list = seq * p.kv.n_kv_heads + h;
  const int n_c = p.n_clu[list];
  const int n = p.kv.n_tokens[seq];
  const int L = tactic_span(p, list, n).len;
  const int32_t* order = p.order + static_cast<size_t>(row) * p.kc_max;
  const int32_t* csize = p.csize + static_cast<size_t>(list) * p.kc_max;
  const int32_t* cbeg = p.cbeg + static_cast<size_t>(list) * p.kc_max;
  const int32_t* members = p.members + static_cast<size_t>(list) * p.kv.max_tokens;
  int32_t* gpos = p.pos + static_cast<size_t>(row) * (p.kc_max + 1);
  // Shared memory (when the clusters fit): P = list position of each rank, RB = where the
  // members of the cluster at each rank start.
  const bool in_smem = n_c + 1 <= kPosSmemInts;
  int* P = in_smem ? pos_smem : gpos;
  int* RB = pos_smem + kPosSmemInts;
  // Sizes in rank order (coalesced over ranks), then an in-place exclusive scan.
#pragma unroll 4
  for (int r = threadIdx.x; r < n_c; r += blockDim.x) {
    const int c = order[r];
    P[r] = csize[c];
    if (in_smem) RB[r] = cbeg[c];
  }
  __syncthreads();
  const int per = (n_c + blockDim.x - 1) / blockDim.x;
  const int b = min(n_c, static_cast<int>(threadIdx.x) * per), e = min(n_c, b + per);
  int sum = 0;
  for (int r = b; r < e; ++r) sum += P[r];
  int total = 0;
  int run = block_scan_exclusive<int>(sum, &total);
  for (int r = b; r < e; ++r) {
    const int x = P[r];
    P[r] = run;
    run += x;
  }
  if (threadIdx.x == 0) P[n_c] = total;
  __syncthreads();
  if (in_smem)
    for (int r = threadIdx.x; r <= n_c; r += blockDim.x) gpos[r] = P[r];
  const TacticWindows w = tactic_windows(L, p.init_ratio, p.window, p.p1, p.p2);
  int32_t* tok = p.tok + static_cast<size_t>(row) * p.max_exact;
#pragma unroll 4
  for (int u = threadIdx.x; u < w.n_exact; u += blockDim.x) {
    const int i = tactic_position(w, u);
    int lo = 0, hi = n_c - 1;  // largest r with P[r] <= i
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (P[mid] <= i) lo = mid; else hi = mid - 1;
    }
    tok[u] = pool_row(p.kv, list, members[(in_smem ? RB[lo] : cbeg[order[lo]]) + (i - P[lo])]);
  }
}

// Raw scores of list items [c0, c1) of a row by the whole block: item u < n_exact is the
// exactly scored list position u (token tok[u]), item u >= n_exact the tail token
// sp.tail_token(u - n_exact), whose scaled score goes into the block's (max, sum of exp).
// Returns (tail max, sum of exp(x - max)) on every thread (max -inf: no tail item).
template <int D, class T>
__device__ float2 tactic_score_items(const TacticParams& p, int row, int list, const TacticSpan& sp, int n_exact, int c0,
                                     int c1) {
  constexpr int RL = D / 8, TPL = 32 / RL, U = 4, BT = TPL * U;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int row_lane = lane % RL, tsub = lane / RL;
  float qv[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) qv[e] = p.q[static_cast<size_t>(row) * D + row_lane * 8 + e];
  const int32_t* tok = p.tok + static_cast<size_t>(row) * p.max_exact;
  float* ex = p.exact + static_cast<size_t>(row) * p.max_exact;
  const int32_t* pt = p.kv.page_table + static_cast<size_t>(list) * p.kv.max_pages;
  const int shift = p.kv.page_shift, mask = p.kv.page_size - 1;
  const T* kb = static_cast<const T*>(p.kv.k);
  float tail_m = -INFINITY, tail_s = 0.0f;  // natural units
  // The pool rows of an iteration's items, loaded one iteration ahead of their keys.
  auto rows_of = [&](int b0, int (&r)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = b0 + u * TPL + tsub;
      r[u] = -1;
      if (i < c1) {
        if (i < n_exact) {
          r[u] = __ldcg(tok + i);
        } else {
          const int t = sp.tail_token(i - n_exact);
          r[u] = (__ldg(pt + (t >> shift)) << shift) | (t & mask);
        }
      }
    }
  };
  int rows_next[U];
  rows_of(c0 + warp * BT, rows_next);
  for (int b0 = c0 + warp * BT; b0 < c1; b0 += nw * BT) {
    uint4 kr[U];
    int it[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      it[u] = b0 + u * TPL + tsub;
      kr[u] = rows_next[u] >= 0 ? load16(kb + static_cast<size_t>(rows_next[u]) * D + row_lane * 8)
                                : make_uint4(0, 0, 0, 0);
    }
    rows_of(b0 + nw * BT, rows_next);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float acc = lane_group_dot8<RL>(qv, kr[u], T());
      if (it[u] < n_exact) {
        if (row_lane == 0) ex[it[u]] = acc;
      } else if (it[u] < c1 && row_lane == 0) {
        const float x = p.scale * acc;
        if (x > tail_m) {
          tail_s = tail_s * expf(tail_m - x) + 1.0f;
          tail_m = x;
        } else {
          tail_s += expf(x - tail_m);
        }
      }
    }
  }
  const float mw = block_max(tail_m);
  float sw = tail_m == -INFINITY ? 0.0f : tail_s * expf(tail_m - mw);
  sw = block_sum<float>(sw);
  return make_float2(mw, sw);
}

// Step 3b. grid: (chunks of kExactItems, rows). Raw scores of the exactly scored tokens
// into exact[row][u]; the dense tail as one (max, sum of exp) pair per CTA.
template <int D, class T>
__global__ void __launch_bounds__(kExactThreads) tactic_exact_kernel(TacticParams p) {
  const int row = blockIdx.y;
  const int seq = row / p.n_q, h = (row % p.n_q) / p.group;
  const int list = seq * p.kv.n_kv_heads + h;
  const TacticSpan sp = tactic_span(p, list, p.kv.n_tokens[seq]);
  const TacticWindows w = tactic_windows(sp.len, p.init_ratio, p.window, p.p1, p.p2);
  const int n_items = w.n_exact + sp.n_tail;
  const int c0 = blockIdx.x * kExactItems;
  if (c0 >= n_items) return;
  const float2 t = tactic_score_items<D, T>(p, row, list, sp, w.n_exact, c0, min(n_items, c0 + kExactItems));
  if (threadIdx.x == 0) p.tail_part[static_cast<size_t>(row) * p.max_exact_ctas + blockIdx.x] = t;
}

// The fit, the budget and the claim of one row by the whole block (Algorithm 1 lines
// 8-11), from the raw exact scores exact[row][0 .. n_exact) and the tail's (max, sum of
// exp(x - max)) (tail_m = -inf: no tail). Writes claimed[row] and budget[row] and returns
// the budget k on every thread.
__device__ int tactic_budget_block(const TacticParams& p, int row, int L, const TacticWindows& w, float tail_m,
                                   double tail_s) {
  const float* ex = p.exact + static_cast<size_t>(row) * p.max_exact;
  // Shift: the largest scaled score among the exact and the tail tokens.
  // The loops over the exact scores load kB values per thread before using any, so the
  // loads' latencies overlap (loop by loop, each iteration waited for its load; the kernel
  // took 23 us per step at 128K, 2750 exact scores per row, under Nsight Compute).
  constexpr int kB = 8;
  float mx = -INFINITY;
  for (int u0 = threadIdx.x; u0 < w.n_exact; u0 += kB * blockDim.x) {
    float x[kB];
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int u = u0 + j * blockDim.x;
      x[j] = u < w.n_exact ? __ldcg(ex + u) : -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < kB; ++j) mx = fmaxf(mx, x[j]);
  }
  const float ex_max = block_max(mx);
  const double shift_v = fmax(static_cast<double>(p.scale) * ex_max, static_cast<double>(tail_m));
  const double tail_sum = tail_m == -INFINITY ? 0.0 : tail_s * exp(static_cast<double>(tail_m) - shift_v);
  auto weight_exact = [&](int u) { return exp(p.scale * static_cast<double>(ex[u]) - shift_v); };

  // The fit through the two window means (warp 0).
  __shared__ double s_fit[2];
  if (!w.exact_all && threadIdx.x < 32) {
    const int n1 = w.e1 - w.b1, n2 = w.e2 - w.b2;
    double mu1 = 0, h1 = 0, mu2 = 0, h2 = 0;
    for (int i = threadIdx.x; i < n1; i += 32) mu1 += weight_exact(w.N + i), h1 += 1.0 / (w.b1 + i + 1);
    for (int i = threadIdx.x; i < n2; i += 32) mu2 += weight_exact(w.N + n1 + i), h2 += 1.0 / (w.b2 + i + 1);
    for (int o = 16; o >= 1; o >>= 1) {
      mu1 += __shfl_xor_sync(0xffffffffu, mu1, o);
      h1 += __shfl_xor_sync(0xffffffffu, h1, o);
      mu2 += __shfl_xor_sync(0xffffffffu, mu2, o);
      h2 += __shfl_xor_sync(0xffffffffu, h2, o);
    }
    if (threadIdx.x == 0) {
      mu1 /= n1, h1 /= n1, mu2 /= n2, h2 /= n2;
      const double a = (mu1 - mu2) / (h1 - h2);
      s_fit[0] = a;
      s_fit[1] = mu1 - a * h1;
    }
  }
  __syncthreads();
  const double fa = w.exact_all ? 0.0 : s_fit[0], fb = w.exact_all ? 0.0 : s_fit[1];
  const int n_head = w.exact_all ? L : w.N;  // exactly weighted prefix of the list

  // Head sums in order (one contiguous segment per thread), the fitted part in closed form.
  const int per = (n_head + blockDim.x - 1) / blockDim.x;
  const int hb = min(n_head, static_cast<int>(threadIdx.x) * per), he = min(n_head, hb + per);
  double seg = 0;
  for (int u0 = hb; u0 < he; u0 += kB) {
    float x[kB];
#pragma unroll
    for (int j = 0; j < kB; ++j) x[j] = u0 + j < he ? __ldcg(ex + u0 + j) : 0.0f;
#pragma unroll
    for (int j = 0; j < kB; ++j)
      if (u0 + j < he) seg += exp(p.scale * static_cast<double>(x[j]) - shift_v);  // weight_exact, in order
  }
  double head_total = 0;
  const double pre = block_scan_exclusive<double>(seg, &head_total);
  const double fit_total = fit_sum(fa, fb, n_head, L);
  const double total = head_total + fit_total;

  // The budget: minimal k with sum_{i<k} w_i >= P * total (Alg. 1 line 11).
  __shared__ int s_k, s_first;
  __shared__ double s_prefix;
  if (threadIdx.x == 0) {
    s_k = L;
    s_prefix = total;
    s_first = blockDim.x;
  }
  __syncthreads();
  const bool search = p.p < 1.0 && total > 0;
  const double target = p.p * total;
  if (search && target <= head_total) {
    if (he > hb && pre + seg >= target) atomicMin(&s_first, static_cast<int>(threadIdx.x));
    __syncthreads();
    if (threadIdx.x == s_first) {
      double acc = pre;
      int k = hb;
      while (k < he && acc < target) acc += weight_exact(k++);
      s_k = k;
      s_prefix = acc;
    }
  } else if (search && threadIdx.x < 32) {
    // Past the head: the minimal k in [n_head + 1, L] with F(k) = head_total + fit_sum(n_head,
    // k) >= target (L if none); F is nondecreasing. Warp 0 evaluates F at 32 evenly spaced
    // candidates per round and keeps the bracket of the first that reaches the target: the
    // k a binary search finds, in 4 rounds instead of 17 dependent steps (fit_sum is a few
    // hundred double-precision operations, so one warp is as fast as the block here).
    const int lane = threadIdx.x;
    int lo = n_head + 1, hi = L;
    while (lo < hi) {
      const int step = (hi - lo + 31) / 32;
      const long long cand = lo + static_cast<long long>(lane) * step;
      const bool ok = cand < hi && head_total + fit_sum(fa, fb, n_head, cand) >= target;
      const unsigned hit = __ballot_sync(0xffffffffu, ok);
      if (hit != 0) {
        const int i = __ffs(hit) - 1;
        hi = lo + i * step;
        lo = i == 0 ? lo : lo + (i - 1) * step + 1;
      } else {
        lo = lo + ((hi - 1 - lo) / step) * step + 1;  // past the last candidate below hi
      }
    }
    if (lane == 0) {
      s_k = lo;
      s_prefix = head_total + fit_sum(fa, fb, n_head, lo);
    }
  }
  __syncthreads();
  const int k = s_k;
  if (threadIdx.x == 0) {
    const double den = total + tail_sum;
    p.claimed[row] = den > 0 ? static_cast<float>((s_prefix + tail_sum) / den) : 1.0f;
    p.budget[row] = k;
  }
  return k;
}

// Step 3c, one CTA per row: the tail partials of step 3b combined, then the fit, the
// budget and the claim.
__global__ void __launch_bounds__(kBudgetThreads) tactic_budget_kernel(TacticParams p) {
  const int row = blockIdx.x;
  const int seq = row / p.n_q, h = (row % p.n_q) / p.group;
  const int list = seq * p.kv.n_kv_heads + h;
  const TacticSpan sp = tactic_span(p, list, p.kv.n_tokens[seq]);
  const float2* tail_part = p.tail_part + static_cast<size_t>(row) * p.max_exact_ctas;
  const TacticWindows w = tactic_windows(sp.len, p.init_ratio, p.window, p.p1, p.p2);
  const int n_items = w.n_exact + sp.n_tail;
  const int n_ctas = (n_items + kExactItems - 1) / kExactItems;
  const int tail_cta0 = w.n_exact / kExactItems;  // first CTA that saw tail tokens
  float tm = -INFINITY;
  if (sp.n_tail > 0)
    for (int c = tail_cta0 + threadIdx.x; c < n_ctas; c += blockDim.x) tm = fmaxf(tm, tail_part[c].x);
  const float tail_m = block_max(tm);
  double ts = 0;
  if (sp.n_tail > 0)
    for (int c = tail_cta0 + threadIdx.x; c < n_ctas; c += blockDim.x) {
      const float2 t = tail_part[c];
      if (t.x != -INFINITY) ts += static_cast<double>(t.y) * exp(static_cast<double>(t.x - tail_m));
    }
  const double tail_s = block_sum<double>(ts);
  tactic_budget_block(p, row, sp.len, w, tail_m, tail_s);
}

// Marks the first cnt members of one cluster (members[0 .. cnt)) in the bitmap bw. The
// members of a cluster are ascending tokens: the thread loads 8 at a time (independent
// loads), ORs the bits that fall in one bitmap word together and does one atomic per word.
__device__ __forceinline__ void mark_cluster(uint32_t* bw, const int32_t* members, int cnt) {
  constexpr int kB = 8;
  int word = -1;
  uint32_t bits = 0;
  for (int j0 = 0; j0 < cnt; j0 += kB) {
    int t[kB];
#pragma unroll
    for (int j = 0; j < kB; ++j) t[j] = j0 + j < cnt ? __ldg(members + j0 + j) : -1;
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      if (t[j] < 0) continue;
      if ((t[j] >> 5) != word) {
        if (bits != 0) atomicOr(bw + word, bits);
        word = t[j] >> 5;
        bits = 0;
      }
      bits |= 1u << (t[j] & 31);
    }
  }
  if (bits != 0) atomicOr(bw + word, bits);
}

constexpr int kMarkRanks = 128;  // ranked clusters per CTA of step 3d, one per thread

// Step 3d. grid: (ceil(kc_max / kMarkRanks), rows). The row's first k list positions (the
// members of its top-ranked clusters, the last one cut), a thread per ranked cluster, and,
// for the group's first head, the dense tail, into the kv head's bitmap.
__global__ void __launch_bounds__(kMarkRanks) tactic_mark_kernel(TacticParams p) {
  const int row = blockIdx.y;
  const int seq = row / p.n_q, qh = row % p.n_q, h = qh / p.group;
  const int list = seq * p.kv.n_kv_heads + h;
  const int n_c = p.n_clu[list];
  const int k = p.budget[row];
  uint32_t* bw = p.bits + static_cast<size_t>(list) * p.words;
  if (blockIdx.x == 0 && qh % p.group == 0) {
    const int n = p.kv.n_tokens[seq];
    mark_tail(bw, tactic_span(p, list, n), n, threadIdx.x, blockDim.x);
  }
  const int r = blockIdx.x * kMarkRanks + threadIdx.x;
  if (r >= n_c) return;
  const int32_t* pos = p.pos + static_cast<size_t>(row) * (p.kc_max + 1);
  const int p0 = pos[r];
  if (p0 >= k) return;
  const int cnt = min(pos[r + 1], k) - p0;
  const int c = p.order[static_cast<size_t>(row) * p.kc_max + r];
  mark_cluster(bw, p.members + static_cast<size_t>(list) * p.kv.max_tokens + p.cbeg[static_cast<size_t>(list) * p.kc_max + c],
               cnt);
}

// Step 3d with the bitmap in shared memory (with the bucket ranking, whose kv heads hold at
// most kRankMaxClusters clusters, so the bitmap fits). grid: (slices S, lists). A CTA builds
// the marks of its slice of the ranked clusters of every head of its kv head's group in a
// shared-memory bitmap (shared-memory atomics), then ORs its non-zero words into the kv
// head's bitmap in global memory, a warp over 32 consecutive words (the global kernel above
// does one global atomic per (cluster, word) at scattered addresses; see the constructor
// for how the two compare).
// Slice s takes ranks s, s + S, s + 2S, ... of every head (interleaved: the marked ranks
// are a prefix [0, R) of unknown length, so each slice gets about R / S of them without
// searching for R); a thread takes one (head, rank) pair at a time, all heads at once, so
// the chain of dependent loads (position, order, cluster start, members) is paid once per
// pair, not once per head. Slice 0 also marks the dense tail.
constexpr int kMarkSmemThreads = 1024;
constexpr int kMarkSmemMaxWords = 12288;  // 48 KiB of shared memory: 393,216 tokens

__global__ void __launch_bounds__(kMarkSmemThreads) tactic_mark_smem_kernel(TacticParams p) {
  extern __shared__ uint32_t mark_bits[];
  __shared__ int s_k[64];  // budgets of the group's heads (group <= 64 here; see the launch)
  const int list = blockIdx.y, slice = blockIdx.x, n_slices = gridDim.x;
  const int seq = list / p.kv.n_kv_heads, h = list % p.kv.n_kv_heads;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int n = p.kv.n_tokens[seq];
  const int n_words = (n + 31) >> 5;  // words of this list's bitmap in use
  const int row0 = seq * p.n_q + h * p.group;
  for (int g = tid; g < p.group; g += nt) s_k[g] = p.budget[row0 + g];
  for (int w = tid; w < n_words; w += nt) mark_bits[w] = 0;
  __syncthreads();
  if (slice == 0) mark_tail(mark_bits, tactic_span(p, list, n), n, tid, nt);
  const int n_c = p.n_clu[list];
  const int per_head = n_c > slice ? (n_c - slice + n_slices - 1) / n_slices : 0;  // this slice's ranks per head
  const int32_t* members = p.members + static_cast<size_t>(list) * p.kv.max_tokens;
  const int32_t* cbeg = p.cbeg + static_cast<size_t>(list) * p.kc_max;
  for (int x = tid; x < p.group * per_head; x += nt) {
    const int g = x / per_head, r = slice + (x % per_head) * n_slices;
    const int row = row0 + g, k = s_k[g];
    const int32_t* pos = p.pos + static_cast<size_t>(row) * (p.kc_max + 1);
    const int p0 = __ldg(pos + r);
    if (p0 >= k) continue;
    const int cnt = min(__ldg(pos + r + 1), k) - p0;
    const int c = __ldg(p.order + static_cast<size_t>(row) * p.kc_max + r);
    mark_cluster(mark_bits, members + __ldg(cbeg + c), cnt);
  }
  __syncthreads();
  uint32_t* bw = p.bits + static_cast<size_t>(list) * p.words;
  for (int w = tid; w < n_words; w += nt) {
    const uint32_t x = mark_bits[w];
    if (x != 0) atomicOr(bw + w, x);
  }
}

// Step 3d by token range, with the bucket ranking. grid: (CTAs per list, lists); a CTA owns
// a run of tiles of kBitmapTileWords words of one list's bitmap. Token t of the list is in
// head g's set when it is in the dense tail or start_g[cid[t]] + midx[t] < k_g (its list
// position is below the head's budget; start_g[c] = the list position where cluster c
// starts for head g, staged in shared memory from the ranking's order and positions). A
// warp builds a word with one ballot and stores it (no atomics, no zeroing, no flush), and
// the CTA stores each tile's count of set bits for the compaction's emit pass
// (bitmap_count_kernel is not needed).
constexpr int kMarkRangeThreads = 1024;
constexpr size_t kRangeSmemMax = 160 * 1024;  // [group][clusters] ints: 4 x 8192 is 128 KiB
constexpr int kRangeTilesMax = 4;  // tiles one CTA may walk (see the constructor)

__global__ void __launch_bounds__(kMarkRangeThreads) tactic_mark_range_kernel(TacticParams p) {
  extern __shared__ int32_t st[];  // [group][n_c]
  __shared__ int s_k[64];
  const int list = blockIdx.y;
  const int seq = list / p.kv.n_kv_heads, h = list % p.kv.n_kv_heads;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int n = p.kv.n_tokens[seq];
  const TacticSpan sp = tactic_span(p, list, n);
  const int n_c = p.n_clu[list];
  const int row0 = seq * p.n_q + h * p.group;
  const int tiles = (p.words + kBitmapTileWords - 1) / kBitmapTileWords;
  const int per_cta = (tiles + gridDim.x - 1) / gridDim.x;
  const int tile0 = blockIdx.x * per_cta, tile1 = min(tiles, tile0 + per_cta);
  const bool live = tile0 < tile1 && tile0 * kBitmapTileWords * 32 < n && sp.len > 0;  // list tokens to test
  if (live) {
    for (int g = tid; g < p.group; g += nt) s_k[g] = p.budget[row0 + g];
    for (int g = 0; g < p.group; ++g) {
      const int32_t* order = p.order + static_cast<size_t>(row0 + g) * p.kc_max;
      const int32_t* pos = p.pos + static_cast<size_t>(row0 + g) * (p.kc_max + 1);
      for (int r = tid; r < n_c; r += nt) st[g * n_c + __ldcg(order + r)] = __ldcg(pos + r);
    }
  }
  __syncthreads();
  const int32_t* cid = p.cid + static_cast<size_t>(list) * p.kv.max_tokens;
  const int32_t* midx = p.midx + static_cast<size_t>(list) * p.kv.max_tokens;
  uint32_t* bw = p.bits + static_cast<size_t>(list) * p.words;
  constexpr int kWordsPerWarp = kBitmapTileWords / (kMarkRangeThreads / 32);
  for (int tile = tile0; tile < tile1; ++tile) {
    int set = 0;
#pragma unroll 2
    for (int j = 0; j < kWordsPerWarp; ++j) {
      const int word = tile * kBitmapTileWords + warp * kWordsPerWarp + j;
      if (word >= p.words) break;  // warp-uniform
      const int t = word * 32 + lane;
      bool sel = false;
      if (t < n) {
        if (t < sp.lo || t >= sp.hi) {
          sel = true;  // the dense tail
        } else if (live) {
          const int c = __ldg(cid + t);
          if (c >= 0) {
            const int m = __ldg(midx + t);
            for (int g = 0; g < p.group && !sel; ++g) sel = st[g * n_c + c] + m < s_k[g];
          }
        }
      }
      const uint32_t bits = __ballot_sync(0xffffffffu, sel);
      if (lane == 0) {
        bw[word] = bits;
        set += __popc(bits);
      }
    }
    const int total = block_sum<int>(set);
    if (tid == 0) p.counts[static_cast<size_t>(list) * tiles + tile] = total;
  }
}

// ---- step 2 as one launch: the bucket-sort ranking (up to kRankMaxClusters clusters) ----
// One CTA of kRankThreads threads per row does what the sort and positions kernels do, with
// everything in shared memory: the clusters ordered by centroid score, descending, ties to
// the lower index (the order of the CPU's select_topk and of sort_rows_desc), the list
// position of every rank, and the pool rows of the exactly scored positions. It writes
// order, pos and tok as those two kernels do; steps 3b-3d follow unchanged.
//
// The order comes from a bucket sort: B linear bins of [min score, max score] (the bin
// index is monotone in the score, so bins are in rank order; B about half the clusters),
// then each cluster placed in its bin by counting the bin's clusters ahead of it (key, then
// index), a thread per cluster. A bin of more than
// kRankBinMax clusters (scores piled up, e.g. around an outlier that stretches the range)
// sends the row to CUB's block radix sort instead: the same order either way. Measured on
// an H100 at 128K tokens (8192 clusters per kv head): the sort and positions kernels took
// 26 and 31 us per step; this kernel about 15 us.
constexpr int kRankThreads = 1024;
constexpr int kRankItems = 8;
constexpr int kRankMaxClusters = kRankThreads * kRankItems;
constexpr int kRankBinMax = 64;
using RankSort = cub::BlockRadixSort<uint32_t, kRankThreads, kRankItems, int32_t>;

// Dynamic shared memory of the ranking: key [kc + 1] (after the ranking: pos [kc + 1]) and
// order [kc] in a first region that CUB's storage may overlay, then size [kc], bin count
// [bins], bin start [bins], and the scatter's order by bin [kc]. Returns the bytes;
// *sz_off = the first int after the first region.
size_t tactic_rank_smem(int kc, int bins, int* sz_off) {
  const size_t first = std::max(4 * (2 * static_cast<size_t>(kc) + 1), sizeof(typename RankSort::TempStorage));
  *sz_off = static_cast<int>((first + 15) / 16 * 4);
  return 4 * (static_cast<size_t>(*sz_off) + 2 * static_cast<size_t>(kc) + 2 * static_cast<size_t>(bins));
}


__global__ void __launch_bounds__(kRankThreads) tactic_rank_kernel(TacticParams p) {
  extern __shared__ __align__(16) unsigned char rank_smem[];
  const int row = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  const int seq = row / p.n_q, qh = row % p.n_q, h = qh / p.group;
  const int list = seq * p.kv.n_kv_heads + h;
  const int n_c = p.n_clu[list];
  const int L = tactic_span(p, list, p.kv.n_tokens[seq]).len;
  const int kc = p.kc_max, B = p.rank_bins;
  uint32_t* key = reinterpret_cast<uint32_t*>(rank_smem);
  int* pos = reinterpret_cast<int*>(rank_smem);  // key's place once the ranking is done
  int* order = reinterpret_cast<int*>(rank_smem) + (kc + 1);
  int* sz = reinterpret_cast<int*>(rank_smem) + p.rank_sz_off;
  int* bcnt = sz + kc;
  int* bend = bcnt + B;
  int* by_bin = bend + B;  // the clusters grouped by bin, in no order within a bin
  const float* sc = p.cscore + static_cast<size_t>(row) * kc;
  const int32_t* csize = p.csize + static_cast<size_t>(list) * kc;
  const int32_t* cbeg = p.cbeg + static_cast<size_t>(list) * kc;
  const int32_t* members = p.members + static_cast<size_t>(list) * p.kv.max_tokens;

  // Keys, sizes, the score range.
  float lo = INFINITY, hi = -INFINITY;
  int bad = 0;
  // kRankItems loads per thread issued before their first use: one memory latency for the
  // whole row instead of one per item (the loop as written waited for each load in turn).
  for (int c0 = 0; c0 < n_c; c0 += nt * kRankItems) {
    float x[kRankItems];
    int32_t z[kRankItems];
#pragma unroll
    for (int j = 0; j < kRankItems; ++j) {
      const int c = c0 + j * nt + tid;
      x[j] = c < n_c ? __ldcg(sc + c) : 0.0f;
      z[j] = c < n_c ? __ldg(csize + c) : 0;
    }
#pragma unroll
    for (int j = 0; j < kRankItems; ++j) {
      const int c = c0 + j * nt + tid;
      if (c >= n_c) continue;
      key[c] = float_key(x[j]);
      sz[c] = z[j];
      lo = fminf(lo, x[j]);
      hi = fmaxf(hi, x[j]);
      bad |= isnan(x[j]);
    }
  }
  for (int b = tid; b < B; b += nt) bcnt[b] = 0;
  lo = -block_max(-lo);
  hi = block_max(hi);
  bad = __syncthreads_or(bad);
  const float scale = static_cast<float>(B - 1) / (hi - lo);
  bool cub_sort = bad || !(hi > lo) || !isfinite(scale) || n_c > kRankMaxClusters;
  // Bucket sort: histogram, bin starts, scatter, each bin sorted by one thread.
  auto bin_of = [&](uint32_t k) { return min(B - 1, static_cast<int>((hi - key_float(k)) * scale)); };
  if (!cub_sort) {
    for (int c = tid; c < n_c; c += nt) atomicAdd(bcnt + bin_of(key[c]), 1);
    __syncthreads();
    const int per = (B + nt - 1) / nt;
    const int b0 = min(B, tid * per), b1 = min(B, b0 + per);
    int sum = 0, big = 0;
    for (int b = b0; b < b1; ++b) sum += bcnt[b], big |= bcnt[b] > kRankBinMax;
    int total = 0;
    int run = block_scan_exclusive<int>(sum, &total);
    for (int b = b0; b < b1; ++b) run += bcnt[b], bend[b] = run - bcnt[b];  // bin start, grows to its end
    cub_sort = __syncthreads_or(big);
  }
  if (!cub_sort) {
    for (int c = tid; c < n_c; c += nt) by_bin[atomicAdd(bend + bin_of(key[c]), 1)] = c;
    __syncthreads();
    // Each cluster's place in its bin (key descending, index ascending) by counting the
    // bin's members ahead of it: a thread per cluster, so the longest chain is one bin's
    // size, not (as with a thread sorting each bin) the square of the most crowded bin's.
    for (int i = tid; i < n_c; i += nt) {
      const int c = by_bin[i];
      const uint32_t kk = key[c];
      const int b = bin_of(kk);
      const int e = bend[b], s0 = e - bcnt[b];
      int ahead = 0;
      for (int j = s0; j < e; ++j) {
        const int o = by_bin[j];
        const uint32_t ko = key[o];
        ahead += ko > kk || (ko == kk && o < c);
      }
      order[s0 + ahead] = c;
    }
  } else {
    uint32_t keys[kRankItems];
    int32_t vals[kRankItems];
#pragma unroll
    for (int j = 0; j < kRankItems; ++j) {
      const int i = tid * kRankItems + j;  // blocked: index order = rank order of ties
      keys[j] = i < n_c ? key[i] : 0u;
      vals[j] = i;
    }
    __syncthreads();  // CUB's storage overlays key and order
    RankSort(*reinterpret_cast<typename RankSort::TempStorage*>(rank_smem)).SortDescendingBlockedToStriped(keys, vals);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRankItems; ++j) {
      const int rank = j * nt + tid;
      if (rank < n_c) order[rank] = vals[j];
    }
  }
  __syncthreads();
  // List positions of the ranks (prefix sums of the sizes in rank order), over key; order
  // and pos to global memory for the marks. A warp scans one contiguous segment of ranks,
  // 32 consecutive ranks per round (lanes on consecutive words: no bank conflicts), then
  // the segments are offset by the block's scan of the warps' totals. (A thread per
  // segment of 8 ranks, lanes 8 words apart, took 9.0 us at 8192 clusters; this 4.8 us.)
  int32_t* gorder = p.order + static_cast<size_t>(row) * kc;
  int32_t* gpos = p.pos + static_cast<size_t>(row) * (kc + 1);
  {
    const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    const int seg = ((n_c + nw - 1) / nw + 31) & ~31;
    const int r0 = min(n_c, warp * seg), r1 = min(n_c, r0 + seg);
    int carry = 0;
    for (int j = r0; j < r1; j += 32) {
      const int r = j + lane;
      const int x = r < r1 ? sz[order[r]] : 0;
      const int inc = warp_scan_inclusive(x);
      if (r < r1) pos[r] = carry + inc - x;
      carry += __shfl_sync(0xffffffffu, inc, 31);
    }
    int total = 0;
    const int before = __shfl_sync(0xffffffffu, block_scan_exclusive<int>(lane == 0 ? carry : 0, &total), 0);
    for (int r = r0 + lane; r < r1; r += 32) pos[r] += before;
    if (tid == 0) pos[n_c] = total;
  }
  __syncthreads();
  for (int r = tid; r <= n_c; r += nt) {
    gpos[r] = pos[r];
    if (r < n_c) gorder[r] = order[r];
  }
  // The pool rows at the exactly scored positions.
  const TacticWindows w = tactic_windows(L, p.init_ratio, p.window, p.p1, p.p2);
  int32_t* tok = p.tok + static_cast<size_t>(row) * p.max_exact;
  // A position's pool row takes three dependent global loads (cluster start, member, page
  // table): kExactBatch positions per thread go through each level together.
  constexpr int kExactBatch = 4;
  for (int u0 = 0; u0 < w.n_exact; u0 += nt * kExactBatch) {
    int at[kExactBatch], t[kExactBatch];
#pragma unroll
    for (int j = 0; j < kExactBatch; ++j) {
      const int u = u0 + j * nt + tid;
      at[j] = -1;
      if (u >= w.n_exact) continue;
      const int i = tactic_position(w, u);
      int a = 0, b = n_c - 1;  // largest r with pos[r] <= i
      while (a < b) {
        const int mid = (a + b + 1) >> 1;
        if (pos[mid] <= i) a = mid; else b = mid - 1;
      }
      at[j] = i - pos[a];
      t[j] = order[a];
    }
#pragma unroll
    for (int j = 0; j < kExactBatch; ++j)
      if (at[j] >= 0) t[j] = __ldg(cbeg + t[j]) + at[j];
#pragma unroll
    for (int j = 0; j < kExactBatch; ++j)
      if (at[j] >= 0) t[j] = __ldg(members + t[j]);
#pragma unroll
    for (int j = 0; j < kExactBatch; ++j)
      if (at[j] >= 0) tok[u0 + j * nt + tid] = pool_row(p.kv, list, t[j]);
  }
  __syncthreads();
}

}  // namespace
}  // namespace cumulus::cuda
