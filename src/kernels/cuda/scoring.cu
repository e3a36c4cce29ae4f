// Scoring ops on the GPU (kernels/scoring.h with a batch dimension): Quest's page bound
// (Quest section 3.2: per channel the larger of q_j * min_j and q_j * max_j, summed), the
// mean-key page score (PSA's block representative), and raw token scores q . k over a
// token range or an index list. Each page's metadata row and each key row is read once for
// all query heads of its kv head, in tiles of up to 8 heads. Scores are raw (unscaled)
// float32 sums accumulated in float32.
#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/cuda/cuda_util.cuh"
#include "cumulus/kernels/cuda.h"

namespace cumulus::cuda {
namespace {

constexpr int kTileHeads = 8;
constexpr int kScoreWarps = 4;
// Pages a warp loads before reducing any: 8, or 4 at head_dim 256 (each page is then 8 floats
// of min and 8 of max per lane; 8 pages would hold 128 registers of them).
template <int D>
constexpr int kPagesPerWarp = D >= 256 ? 4 : 8;

// grid: (ceil(max_pages / (warps * kPagesPerWarp<D>)), n_kv, n_seqs); lanes cover head_dim.
template <int D>
__global__ void page_score_kernel(DeviceKvView kv, int group, int bound, const float* __restrict__ q,
                                  float* __restrict__ scores) {
  constexpr int J = D / 32;  // elements per lane
  const int seq = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_tok = kv.n_tokens[seq];
  const int n_pages = (n_tok + kv.page_size - 1) >> kv.page_shift;
  const int n_q = kv.n_kv_heads * group;
  const int32_t* pt = kv.page_table + (static_cast<size_t>(seq) * kv.n_kv_heads + h) * kv.max_pages;
  constexpr int kPages = kPagesPerWarp<D>;
  const int p0 = (blockIdx.x * kScoreWarps + warp) * kPages;
  for (int g0 = 0; g0 < group; g0 += kTileHeads) {
    const int gn = min(kTileHeads, group - g0);
    float qr[kTileHeads][J];
#pragma unroll
    for (int g = 0; g < kTileHeads; ++g)
#pragma unroll
      for (int j = 0; j < J; ++j)
        qr[g][j] = g < gn ? q[(static_cast<size_t>(seq) * n_q + h * group + g0 + g) * D + lane + 32 * j] : 0.0f;
    // All of the warp's pages are loaded before any is reduced: kPages independent
    // loads per lane in flight.
    float mn[kPages][J], mx[kPages][J];
#pragma unroll
    for (int pp = 0; pp < kPages; ++pp) {
      const int p = p0 + pp;
      const bool ok = p < n_pages;
      const size_t row = ok ? static_cast<size_t>(__ldg(pt + p)) * D : 0;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (bound) {
          mn[pp][j] = ok ? __ldg(kv.kmin + row + lane + 32 * j) : 0.0f;
          mx[pp][j] = ok ? __ldg(kv.kmax + row + lane + 32 * j) : 0.0f;
        } else {
          mn[pp][j] = ok ? __ldg(kv.kmean + row + lane + 32 * j) : 0.0f;
          mx[pp][j] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int pp = 0; pp < kPages; ++pp) {
      const int p = p0 + pp;
      float acc[kTileHeads];
#pragma unroll
      for (int g = 0; g < kTileHeads; ++g) acc[g] = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int g = 0; g < kTileHeads; ++g)
          acc[g] += bound ? fmaxf(qr[g][j] * mn[pp][j], qr[g][j] * mx[pp][j]) : qr[g][j] * mn[pp][j];
#pragma unroll
      for (int g = 0; g < kTileHeads; ++g) acc[g] = warp_sum(acc[g]);
      if (lane < gn && p < kv.max_pages) {
        float v = 0.0f;
#pragma unroll
        for (int g = 0; g < kTileHeads; ++g)
          if (g == lane) v = acc[g];
        scores[(static_cast<size_t>(seq) * n_q + h * group + g0 + lane) * kv.max_pages + p] = p < n_pages ? v : -INFINITY;
      }
    }
  }
}

// grid: (ceil(stride / (warps * kBlock)), n_kv, n_seqs).
template <int D, class T>
__global__ void token_score_kernel(DeviceKvView kv, int group, const float* __restrict__ q,
                                   const int32_t* __restrict__ idx, const int32_t* __restrict__ idx_len, int idx_stride,
                                   float* __restrict__ scores, int stride) {
  constexpr int RL = D / 8, TPL = 32 / RL, U = 4, BT = TPL * U;
  const int seq = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_lane = lane % RL, tsub = lane / RL;
  const int n_tok = kv.n_tokens[seq];
  const int n_q = kv.n_kv_heads * group;
  const int32_t* list = idx != nullptr ? idx + (static_cast<size_t>(seq) * kv.n_kv_heads + h) * idx_stride : nullptr;
  const int len = list != nullptr ? min(max(idx_len[seq * kv.n_kv_heads + h], 0), idx_stride) : n_tok;
  const int32_t* pt = kv.page_table + (static_cast<size_t>(seq) * kv.n_kv_heads + h) * kv.max_pages;
  const int mask = kv.page_size - 1;
  const int b = (blockIdx.x * kScoreWarps + warp) * BT;
  uint4 kr[U];
  bool ok[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = b + u * TPL + tsub;
    int t = i;
    ok[u] = i < len && i < stride;
    if (ok[u] && list != nullptr) t = __ldg(list + i);
    ok[u] = ok[u] && static_cast<unsigned>(t) < static_cast<unsigned>(n_tok);
    kr[u] = make_uint4(0, 0, 0, 0);
    if (ok[u]) {
      const size_t row = (static_cast<size_t>(__ldg(pt + (t >> kv.page_shift))) << kv.page_shift) | (t & mask);
      kr[u] = load16(static_cast<const T*>(kv.k) + row * D + row_lane * 8);
    }
  }
  for (int g = 0; g < group; ++g) {
    const float* qg = q + (static_cast<size_t>(seq) * n_q + h * group + g) * D + row_lane * 8;
    float qv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) qv[e] = qg[e];
    float* out = scores + (static_cast<size_t>(seq) * n_q + h * group + g) * stride;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float acc = lane_group_dot8<RL>(qv, kr[u], T());
      const int i = b + u * TPL + tsub;
      if (row_lane == 0 && i < stride) out[i] = ok[u] ? acc : -INFINITY;
    }
  }
}

}  // namespace

void page_score(const DeviceKvView& kv, int group, PageScoreKind kind, const float* q, float* scores, void* stream) {
  kv.validate(__func__);
  CUMULUS_CHECK(group >= 1, "group={} must be >= 1", group);
  CUMULUS_CHECK(q != nullptr && scores != nullptr, "q and scores must be non-null");
  if (kind == PageScoreKind::kBound)
    CUMULUS_CHECK(kv.kmin != nullptr && kv.kmax != nullptr, "kv.kmin and kv.kmax must be non-null");
  else
    CUMULUS_CHECK(kv.kmean != nullptr, "kv.kmean must be non-null");
  const int bound = kind == PageScoreKind::kBound;
  auto launch = [&](auto kernel, int pages_per_warp) {
    const dim3 grid(ceil_div(kv.max_pages, kScoreWarps * pages_per_warp), kv.n_kv_heads, kv.n_seqs);
    kernel<<<grid, kScoreWarps * 32, 0, as_stream(stream)>>>(kv, group, bound, q, scores);
  };
  with_head_dim(kv.head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    launch(page_score_kernel<D>, kPagesPerWarp<D>);
  });
  CUMULUS_CUDA_LAUNCH("page_score_kernel");
}

void token_score(const DeviceKvView& kv, int group, const float* q, const int32_t* idx, const int32_t* idx_len,
                 int idx_stride, float* scores, int stride, void* stream) {
  kv.validate(__func__);
  CUMULUS_CHECK(group >= 1, "group={} must be >= 1", group);
  CUMULUS_CHECK(q != nullptr && scores != nullptr, "q and scores must be non-null");
  CUMULUS_CHECK((idx == nullptr) == (idx_len == nullptr), "idx and idx_len must be both set or both null");
  CUMULUS_CHECK(idx == nullptr || idx_stride >= 1, "idx_stride={} must be >= 1 with a list", idx_stride);
  CUMULUS_CHECK(stride >= 1, "stride={} must be >= 1", stride);
  const int bt = (32 / (kv.head_dim / 8)) * 4;
  const dim3 grid(ceil_div(stride, kScoreWarps * bt), kv.n_kv_heads, kv.n_seqs);
  auto launch = [&](auto kernel) {
    kernel<<<grid, kScoreWarps * 32, 0, as_stream(stream)>>>(kv, group, q, idx, idx_len, idx_stride, scores, stride);
  };
  with_head_dim_type(kv.head_dim, kv.dtype,
                     [&](auto d, auto t) { launch(token_score_kernel<decltype(d)::value, decltype(t)>); });
  CUMULUS_CUDA_LAUNCH("token_score_kernel");
}

}  // namespace cumulus::cuda
