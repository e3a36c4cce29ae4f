// psa on the GPU (PSA, section 3.2, Algorithm 1, estimate rule; the CPU method is
// src/methods/psa/psa.cpp). Per query head, pages (PSA's blocks) are ranked by a criticality
// score (q . mean key or Quest's bound) and visited in microbatches of m pages; after each
// microbatch AS_acc (sum of exp(q.k / sqrt(d)) over visited tokens) and AS_min (smallest
// per-page sum seen) give P_acc = AS_acc / (AS_acc + AS_min * N_left), and the head stops
// at the first microbatch with P_acc >= threshold.
//
// On the device the visits run in rounds over rank ranges of doubling size, one launch per
// round, enqueued without waiting. A round's CTAs compute each page's log AS for every head
// not yet done; the last CTA of a head to finish (a ticket counter) is PSA's verifying
// kernel (section 3.3): it scans the round's microbatches in order with the carried
// (log AS_acc, log AS_min), finds the exact stopping microbatch if there is one and marks
// the head done, so later rounds skip it. No host round trip per microbatch or per round;
// the cost of the rounds is that a head may score up to one round past its stop. As on
// the CPU, the output is attention over the visited pages (the union over the GQA group),
// computed once by the shared sparse kernel, which equals Algorithm 1's progressive merge.
#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "cumulus/methods/cuda_methods.h"
#include "kernels/cuda/cuda_internal.cuh"

namespace cumulus::cuda {
namespace {

constexpr int kRoundWarps = 4;
constexpr int kPagesPerWarp = 2;
constexpr int kPagesPerCta = kRoundWarps * kPagesPerWarp;
constexpr int kVerifyThreads = kRoundWarps * 32;
constexpr int kPsaTile = 4;  // query heads scored per pass over a page

struct PsaParams {
  DeviceKvView kv;
  int group, n_q;
  float scale;
  double threshold;
  int microbatch;
  const float* q;        // [n_seqs][n_q][D]
  const int32_t* order;  // [rows][max_pages]
  float* las;            // [rows][max_pages] log AS of each page (indexed by page)
  int* flags;            // [n_seqs * n_kv][max_pages] == *epoch: the page's log AS is in las
  const int* epoch;      // this step's number (psa_init_kernel counts steps)
  int* done;             // [rows]
  int* stop;             // [rows] ranks visited
  double* log_acc;       // [rows]
  double* log_min;       // [rows]
  float* claim;          // [rows]
  int* tickets;          // [rows]
  int32_t* rowlen;       // [rows] pages
  uint32_t* bits;
  int words;
  float* claimed;
  int32_t* budget;
};

__global__ void psa_init_kernel(PsaParams p, int* epoch) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r == 0) *epoch += 1;
  if (r >= p.kv.n_seqs * p.n_q) return;
  const int n_pages = (p.kv.n_tokens[r / p.n_q] + p.kv.page_size - 1) >> p.kv.page_shift;
  p.rowlen[r] = n_pages;
  p.done[r] = n_pages == 0;
  p.stop[r] = 0;
  p.log_acc[r] = -INFINITY;
  p.log_min[r] = INFINITY;
  p.claim[r] = 1.0f;
}

struct LseMin {
  double lse, mn;
};
__device__ __forceinline__ LseMin lse_min_op(LseMin a, LseMin b) { return {log_add(a.lse, b.lse), fmin(a.mn, b.mn)}; }

// Inclusive scan of (log-add, min) pairs over the block.
__device__ LseMin block_scan_lse_min(LseMin v, LseMin* total) {
  __shared__ LseMin warp_tot[32];
  __shared__ LseMin s_total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  LseMin x = v;
  for (int o = 1; o < 32; o <<= 1) {
    LseMin y{__shfl_up_sync(0xffffffffu, x.lse, o), __shfl_up_sync(0xffffffffu, x.mn, o)};
    if (lane >= o) x = lse_min_op(y, x);
  }
  if (lane == 31) warp_tot[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    LseMin run{-INFINITY, INFINITY};
    for (int w = 0; w < nw; ++w) {
      run = lse_min_op(run, warp_tot[w]);
      warp_tot[w] = run;
    }
    s_total = run;
  }
  __syncthreads();
  const LseMin r = warp > 0 ? lse_min_op(warp_tot[warp - 1], x) : x;
  *total = s_total;
  __syncthreads();
  return r;
}

// The verifying pass of one head over ranks [r0, r1) (r0 a multiple of the microbatch).
__device__ void psa_verify(const PsaParams& p, int row, int r0, int r1, int n_pages) {
  const int m = p.microbatch;
  const float* las_page = p.las + static_cast<size_t>(row) * p.kv.max_pages;
  const int32_t* order = p.order + static_cast<size_t>(row) * p.kv.max_pages;
  auto las_at = [&](int r) { return __ldcg(las_page + order[r]); };
  const int n_mb = (r1 - r0 + m - 1) / m;
  const int per = (n_mb + blockDim.x - 1) / blockDim.x;
  const int b = min(n_mb, static_cast<int>(threadIdx.x) * per), e = min(n_mb, b + per);
  LseMin seg{-INFINITY, INFINITY};
  for (int j = b; j < e; ++j)
    for (int r = r0 + j * m; r < min(r1, r0 + (j + 1) * m); ++r) {
      const double x = las_at(r);
      seg = lse_min_op(seg, {x, x});
    }
  LseMin tot;
  const LseMin incl = block_scan_lse_min(seg, &tot);
  // Running state before this thread's segment: the carry, then the earlier segments.
  const LseMin carry{p.log_acc[row], p.log_min[row]};
  // exclusive = incl without seg: recompute by walking from carry + (incl of previous)...
  // (the scan is inclusive; rebuild the exclusive prefix from the previous thread's value)
  __shared__ LseMin s_incl[kVerifyThreads];
  s_incl[threadIdx.x] = incl;
  __syncthreads();
  LseMin run = threadIdx.x > 0 ? lse_min_op(carry, s_incl[threadIdx.x - 1]) : carry;
  __shared__ int s_hit;
  if (threadIdx.x == 0) s_hit = n_mb;
  __syncthreads();
  int hit = n_mb;
  double hit_p = 1.0;
  for (int j = b; j < e; ++j) {
    LseMin mb{-INFINITY, INFINITY};
    const int re = min(r1, r0 + (j + 1) * m);
    for (int r = r0 + j * m; r < re; ++r) {
      const double x = las_at(r);
      mb = lse_min_op(mb, {x, x});
    }
    run = lse_min_op(run, mb);
    const int n_left = n_pages - re;
    const double pa = n_left <= 0 ? 1.0 : 1.0 / (1.0 + exp(run.mn + log(static_cast<double>(n_left)) - run.lse));
    if (pa >= p.threshold) {
      hit = j;
      hit_p = pa;
      break;
    }
  }
  if (hit < n_mb) atomicMin(&s_hit, hit);
  __syncthreads();
  if (s_hit < n_mb) {
    if (hit == s_hit) {
      p.stop[row] = min(r1, r0 + (hit + 1) * m);
      p.claim[row] = static_cast<float>(hit_p);
      p.done[row] = 1;
    }
  } else if (threadIdx.x == 0) {
    const LseMin all = lse_min_op(carry, tot);
    p.log_acc[row] = all.lse;
    p.log_min[row] = all.mn;
    p.stop[row] = r1;
    if (r1 >= n_pages) p.done[row] = 1;  // unreachable: the last microbatch has P_acc = 1
  }
}

// One round: ranks [r0, r1). grid: (ceil((r1 - r0) / kPagesPerCta), rows).
template <int D, class T>
__global__ void __launch_bounds__(kRoundWarps * 32) psa_round_kernel(PsaParams p, int r0, int r1) {
  constexpr int RL = D / 8, TPL = 32 / RL, U = 4, BT = TPL * U;
  const int row = blockIdx.y;
  if (p.done[row]) return;
  const int seq = row / p.n_q, qh = row % p.n_q, h = qh / p.group;
  const int n = p.kv.n_tokens[seq];
  const int n_pages = p.rowlen[row];
  const int re = min(r1, n_pages);
  const int n_ctas = (re - r0 + kPagesPerCta - 1) / kPagesPerCta;
  if (static_cast<int>(blockIdx.x) >= n_ctas) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_lane = lane % RL, tsub = lane / RL;
  const int32_t* pt = p.kv.page_table + (static_cast<size_t>(seq) * p.kv.n_kv_heads + h) * p.kv.max_pages;
  const int32_t* order = p.order + static_cast<size_t>(row) * p.kv.max_pages;
  int* flags = p.flags + (static_cast<size_t>(seq) * p.kv.n_kv_heads + h) * p.kv.max_pages;
  const int ep = *p.epoch;
  const T* kb = static_cast<const T*>(p.kv.k);
  const int ps = p.kv.page_size;
  const int row0 = seq * p.n_q + h * p.group;  // the group's first row
  for (int w = 0; w < kPagesPerWarp; ++w) {
    const int rank = r0 + blockIdx.x * kPagesPerCta + warp * kPagesPerWarp + w;
    if (rank >= re) break;
    const int page = order[rank];
    // A page's log AS is computed once for the whole GQA group: the first head to reach it
    // computes every head's value and publishes it; the others reuse it.
    if (*reinterpret_cast<volatile int*>(flags + page) == ep) continue;
    const int len = min(ps, n - page * ps);
    const size_t base = static_cast<size_t>(__ldg(pt + page)) * ps;
    for (int g0 = 0; g0 < p.group; g0 += kPsaTile) {
      const int gn = min(kPsaTile, p.group - g0);
      float qv[kPsaTile][8];
#pragma unroll
      for (int g = 0; g < kPsaTile; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e)
          qv[g][e] = g < gn ? p.q[static_cast<size_t>(row0 + g0 + g) * D + row_lane * 8 + e] * p.scale : 0.0f;
      float m[kPsaTile], sm[kPsaTile];
#pragma unroll
      for (int g = 0; g < kPsaTile; ++g) m[g] = -INFINITY, sm[g] = 0.0f;
      for (int b0 = 0; b0 < len; b0 += BT) {
        uint4 kr[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = b0 + u * TPL + tsub;
          kr[u] = i < len ? load16(kb + (base + i) * D + row_lane * 8) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float kf[8];
          widen8(kr[u], kf, T());
          const bool valid = b0 + u * TPL + tsub < len;
#pragma unroll
          for (int g = 0; g < kPsaTile; ++g) {
            float acc = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(qv[g][e], kf[e], acc);
#pragma unroll
            for (int off = RL / 2; off >= 1; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            if (valid && row_lane == 0) {
              if (acc > m[g]) {
                sm[g] = sm[g] * expf(m[g] - acc) + 1.0f;
                m[g] = acc;
              } else {
                sm[g] += expf(acc - m[g]);
              }
            }
          }
        }
      }
      // Combine the token groups of the warp (only row_lane 0 lanes carry values).
#pragma unroll
      for (int g = 0; g < kPsaTile; ++g) {
        const float mw = warp_max(m[g]);
        float sw = m[g] == -INFINITY ? 0.0f : sm[g] * expf(m[g] - mw);
        sw = warp_sum(sw);
        if (lane == 0 && g < gn) p.las[static_cast<size_t>(row0 + g0 + g) * p.kv.max_pages + page] = mw + logf(sw);
      }
    }
    __threadfence();
    if (lane == 0) *reinterpret_cast<volatile int*>(flags + page) = ep;
  }
  __threadfence();
  __syncthreads();
  __shared__ int s_last;
  if (threadIdx.x == 0) s_last = atomicAdd(p.tickets + row, 1) == n_ctas - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (threadIdx.x == 0) p.tickets[row] = 0;
  psa_verify(p, row, r0, re, n_pages);
}

// Marks the visited pages of every head into its kv head's bitmap.
__global__ void psa_mark_kernel(PsaParams p) {
  const int row = blockIdx.x;
  const int seq = row / p.n_q, qh = row % p.n_q;
  const int n = p.kv.n_tokens[seq];
  const int stop = p.stop[row];
  const int32_t* order = p.order + static_cast<size_t>(row) * p.kv.max_pages;
  uint32_t* w = p.bits + (static_cast<size_t>(seq) * p.kv.n_kv_heads + qh / p.group) * p.words;
  const int ps = p.kv.page_size;
  for (int r = threadIdx.x; r < stop; r += blockDim.x) {
    const int page = order[r];
    bitmap_set_range(w, page * ps, min(n, (page + 1) * ps));
  }
  if (threadIdx.x == 0) {
    p.claimed[row] = p.claim[row];
    p.budget[row] = stop;
  }
}

class PsaGpu final : public SparseDecoder {
 public:
  PsaGpu(const DeviceKvView& kv, int group, const PsaGpuOptions& o, const AttentionPlanOptions& po)
      : SparseDecoder(kv, group, po), o_(o) {
    CUMULUS_CHECK(o.threshold > 0 && o.threshold <= 1, "psa: threshold={} must be in (0, 1]", o.threshold);
    CUMULUS_CHECK(o.microbatch >= 1, "psa: microbatch={} must be >= 1", o.microbatch);
    if (o.criticality == PsaCriticality::mean)
      CUMULUS_CHECK(kv.kmean != nullptr, "psa: kv.kmean must be non-null");
    else
      CUMULUS_CHECK(kv.kmin != nullptr && kv.kmax != nullptr, "psa: kv.kmin and kv.kmax must be non-null");
    const int rows = kv.n_seqs * base().n_q, mp = kv.max_pages;
    crit_ = DeviceBuffer(static_cast<size_t>(rows) * mp * sizeof(float));
    order_ = DeviceBuffer(static_cast<size_t>(rows) * mp * sizeof(int32_t));
    las_ = DeviceBuffer(static_cast<size_t>(rows) * mp * sizeof(float));
    done_ = DeviceBuffer(rows * sizeof(int));
    stop_ = DeviceBuffer(rows * sizeof(int));
    acc_ = DeviceBuffer(rows * sizeof(double));
    min_ = DeviceBuffer(rows * sizeof(double));
    claim_ = DeviceBuffer(rows * sizeof(float));
    tickets_ = DeviceBuffer(rows * sizeof(int));
    tickets_.fill_bytes(0);
    flags_ = DeviceBuffer(static_cast<size_t>(base().n_lists) * mp * sizeof(int));
    flags_.fill_bytes(0);
    epoch_ = DeviceBuffer(sizeof(int));
    epoch_.fill_bytes(0);
    rowlen_ = DeviceBuffer(rows * sizeof(int32_t));
    sort_ = std::make_unique<SortWorkspace>(rows, mp);
    // Round boundaries: multiples of the microbatch, sizes doubling from max(microbatch,
    // max_pages / 64).
    const int m = o.microbatch;
    int size = std::max(m, (mp + 63) / 64);
    size = (size + m - 1) / m * m;
    bounds_.push_back(0);
    while (bounds_.back() < mp) {
      bounds_.push_back(std::min(mp, bounds_.back() + size));
      size *= 2;
    }
  }
  std::string name() const override { return "psa"; }
  double select_bytes_per_token() const override {  // kmean, or kmin and kmax, float32 per page
    return (o_.criticality == PsaCriticality::mean ? 1.0 : 2.0) * base().kv.head_dim * sizeof(float) /
           base().kv.page_size;
  }

  void select(const float* q, void* stream) override {
    Base& b = base();
    const cudaStream_t s = as_stream(stream);
    PsaParams p = params(q);
    const int rows = b.kv.n_seqs * b.n_q;
    psa_init_kernel<<<ceil_div(rows, 256), 256, 0, s>>>(p, epoch_.as<int>());
    CUMULUS_CUDA_LAUNCH("psa_init_kernel");
    const PageScoreKind kind = o_.criticality == PsaCriticality::mean ? PageScoreKind::kMean : PageScoreKind::kBound;
    page_score(b.kv, b.group, kind, q, crit_.as<float>(), stream);
    sort_rows_desc(crit_.as<float>(), rowlen_.as<int32_t>(), rows, b.kv.max_pages, order_.as<int32_t>(), *sort_,
                   stream);
    for (size_t i = 0; i + 1 < bounds_.size(); ++i) {
      const int r0 = bounds_[i], r1 = bounds_[i + 1];
      const dim3 grid(ceil_div(r1 - r0, kPagesPerCta), rows);
      auto launch = [&](auto kernel) { kernel<<<grid, kRoundWarps * 32, 0, s>>>(p, r0, r1); };
      with_head_dim_type(b.kv.head_dim, b.kv.dtype,
                         [&](auto d, auto t) { launch(psa_round_kernel<decltype(d)::value, decltype(t)>); });
      CUMULUS_CUDA_LAUNCH("psa_round_kernel");
    }
    psa_mark_kernel<<<rows, 128, 0, s>>>(p);
    CUMULUS_CUDA_LAUNCH("psa_mark_kernel");
    b.compact(s);
  }

 private:
  PsaParams params(const float* q) {
    Base& b = base();
    PsaParams p{};
    p.kv = b.kv;
    p.group = b.group;
    p.n_q = b.n_q;
    p.scale = 1.0f / std::sqrt(static_cast<float>(b.kv.head_dim));
    p.threshold = o_.threshold;
    p.microbatch = o_.microbatch;
    p.q = q;
    p.order = order_.as<int32_t>();
    p.las = las_.as<float>();
    p.done = done_.as<int>();
    p.stop = stop_.as<int>();
    p.log_acc = acc_.as<double>();
    p.log_min = min_.as<double>();
    p.claim = claim_.as<float>();
    p.tickets = tickets_.as<int>();
    p.flags = flags_.as<int>();
    p.epoch = epoch_.as<int>();
    p.rowlen = rowlen_.as<int32_t>();
    p.bits = b.bits.as<uint32_t>();
    p.words = b.words;
    p.claimed = b.claimed.as<float>();
    p.budget = b.budget.as<int32_t>();
    return p;
  }

  PsaGpuOptions o_;
  std::vector<int> bounds_;
  DeviceBuffer crit_, order_, las_, done_, stop_, acc_, min_, claim_, tickets_, rowlen_, flags_, epoch_;
  std::unique_ptr<SortWorkspace> sort_;
};

}  // namespace

std::unique_ptr<SparseDecoder> make_psa_gpu(const DeviceKvView& kv, int group, const PsaGpuOptions& o,
                                            const AttentionPlanOptions& plan) {
  return std::make_unique<PsaGpu>(kv, group, o, plan);
}

// The registry's "psa" on the GPU (MethodInfo::gpu): stop=estimate only.
void attach_psa_gpu(Registry& r) {
  r.attach_gpu("psa", {.make = [](const DeviceKvView& kv, const Shape& shape, int,
                                  const Params& p) -> std::unique_ptr<SparseDecoder> {
                         PsaGpuOptions o;
                         options_read(p, o);
                         return make_psa_gpu(kv, shape.group(), o);
                       },
                       .check = [](const Shape&, const Params& p) {
                         CUMULUS_CHECK(options_read<PsaOptions>(p).stop == PsaStop::estimate,
                                       "--device cuda: psa stop='{}' is not on cuda (the GPU pipeline implements "
                                       "stop=estimate)",
                                       p.get_string("stop"));
                       }});
}

}  // namespace cumulus::cuda
