// SIMD scoring ops (Highway, runtime dispatch: one binary picks AVX-512, AVX2 or SSE4 at
// run time). Same contracts as src/kernels/ref/scoring.cpp: Quest's page bound
// sum_j max(q_j kmin_j, q_j kmax_j) (Quest section 3.2), PSA's q . kmean page score, and
// raw token scores q . k. Accumulation is float32 (the reference uses float64; tests
// compare by normalised error). 16-bit keys are widened with PromoteTo as they load.
//
// token_score reads each key row once for up to 8 queries (a GQA group), in blocks of 16
// tokens whose accumulators are reduced together (the score loop of decode attention,
// qk-inl.h), so a group costs one pass over the keys instead of n_q.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/scoring.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/scoring.h"
#include "kernels/cpu/qk-inl.h"

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Calls fn(tag) with the widest float tag whose lane count divides head_dim. head_dim is
// a multiple of 8, so the 8-lane tag always fits; AVX-512 uses 16 lanes when it can.
template <class Fn>
HWY_INLINE void with_tag(int head_dim, Fn&& fn) {
  const hn::ScalableTag<float> df;
  if (head_dim % static_cast<int>(hn::Lanes(df)) == 0) {
    fn(df);
  } else {
    fn(hn::CappedTag<float, 8>());
  }
}

// Quest's bound for queries [0, kH) of qpos/qneg (tiles of a group), one pass over the
// page metadata: max(q kmin, q kmax) = max(q, 0) kmax + min(q, 0) kmin since kmin <= kmax,
// so each term is two FMAs with the query split once into its positive and negative parts.
// kP pages per step, so each query vector load serves kP FMAs (kP x kH chains).
//   qpos, qneg: [kH][dim]; scores: [kH][stride], page p of query h at h * stride + p
template <int kH, int kP, class D>
HWY_INLINE void page_bound_pages(D d, const PagedHeadView& kv, const float* HWY_RESTRICT qpos,
                                 const float* HWY_RESTRICT qneg, float* HWY_RESTRICT scores, size_t stride, int& p) {
  const int n_pages = kv.n_pages();
  const size_t dim = static_cast<size_t>(kv.head_dim);
  const size_t N = hn::Lanes(d);
  for (; p + kP <= n_pages; p += kP) {
    const float* mn = kv.kmin + static_cast<size_t>(p) * dim;
    const float* mx = kv.kmax + static_cast<size_t>(p) * dim;
    hn::Vec<D> a[kP][kH];
    for (int u = 0; u < kP; ++u)
      for (int h = 0; h < kH; ++h) a[u][h] = hn::Zero(d);
    for (size_t j = 0; j < dim; j += N) {
      hn::Vec<D> vmx[kP], vmn[kP];
      for (int u = 0; u < kP; ++u) {
        vmx[u] = hn::LoadU(d, mx + u * dim + j);
        vmn[u] = hn::LoadU(d, mn + u * dim + j);
      }
      for (int h = 0; h < kH; ++h) {
        const auto qp = hn::LoadU(d, qpos + h * dim + j);
        for (int u = 0; u < kP; ++u) a[u][h] = hn::MulAdd(qp, vmx[u], a[u][h]);
        const auto qn = hn::LoadU(d, qneg + h * dim + j);
        for (int u = 0; u < kP; ++u) a[u][h] = hn::MulAdd(qn, vmn[u], a[u][h]);
      }
    }
    for (int u = 0; u < kP; ++u)
      for (int h = 0; h < kH; ++h) scores[h * stride + p + u] = hn::GetLane(hn::SumOfLanes(d, a[u][h]));
  }
}

template <int kH, class D>
void page_bound_tile(D d, const PagedHeadView& kv, const float* HWY_RESTRICT qpos, const float* HWY_RESTRICT qneg,
                     float* HWY_RESTRICT scores, size_t stride) {
  // Pages per step: kP x kH accumulators and 2 kP metadata vectors in the registers.
  constexpr int kP = (4 * kH + 8 + 2 <= kQkVecRegs) ? 4 : (2 * kH + 4 + 2 <= kQkVecRegs) ? 2 : 1;
  int p = 0;
  page_bound_pages<kH, kP>(d, kv, qpos, qneg, scores, stride, p);
  if constexpr (kP > 1) page_bound_pages<kH, 1>(d, kv, qpos, qneg, scores, stride, p);
}

void page_score_bound_impl(const PagedHeadView& kv, const float* q, int n_q, float* scores) {
  const size_t dim = static_cast<size_t>(kv.head_dim);
  const size_t stride = static_cast<size_t>(kv.n_pages());
  thread_local std::vector<float> split;
  split.resize(2 * static_cast<size_t>(n_q) * dim);
  float* qpos = split.data();
  float* qneg = qpos + static_cast<size_t>(n_q) * dim;
  for (size_t i = 0; i < static_cast<size_t>(n_q) * dim; ++i) {
    qpos[i] = std::max(q[i], 0.0f);
    qneg[i] = std::min(q[i], 0.0f);
  }
  with_tag(kv.head_dim, [&](auto d) {
    for (int h0 = 0; h0 < n_q;) {
      const size_t o = static_cast<size_t>(h0) * dim;
      float* out = scores + static_cast<size_t>(h0) * stride;
      switch (std::min(n_q - h0, 4)) {
        case 1: page_bound_tile<1>(d, kv, qpos + o, qneg + o, out, stride); h0 += 1; break;
        case 2: page_bound_tile<2>(d, kv, qpos + o, qneg + o, out, stride); h0 += 2; break;
        case 3: page_bound_tile<3>(d, kv, qpos + o, qneg + o, out, stride); h0 += 3; break;
        default: page_bound_tile<4>(d, kv, qpos + o, qneg + o, out, stride); h0 += 4; break;
      }
    }
  });
}

void page_score_mean_impl(const PagedHeadView& kv, const float* q, float* scores) {
  const int n_pages = kv.n_pages();
  const size_t dim = static_cast<size_t>(kv.head_dim);
  with_tag(kv.head_dim, [&](auto d) {
    const size_t N = hn::Lanes(d);
    // kmean: [n_pages][head_dim]; scores: [n_pages]
    for (int p = 0; p < n_pages; ++p) {
      const float* m = kv.kmean + static_cast<size_t>(p) * dim;
      auto acc = hn::Zero(d);
      for (size_t j = 0; j < dim; j += N) acc = hn::MulAdd(hn::LoadU(d, q + j), hn::LoadU(d, m + j), acc);
      scores[p] = hn::GetLane(hn::SumOfLanes(d, acc));
    }
  });
}

// Scores of tokens idx[0..n) (or 0..n-1) against the n_q queries, in blocks of kQkBlock
// tokens (qk-inl.h, as decode attention computes its scores): each K row is read once for
// a tile of up to 8 queries, the accumulators of a block are reduced together into whole
// vectors of scores, and the K rows of the block kAhead blocks on are prefetched meanwhile.
//   q: [n_q][head_dim]; scores: [n_q][n]
template <DType kT, class D>
void token_score_typed(D d, const PagedHeadView& kv, const float* q, int n_q, const int32_t* idx, int n,
                       float* scores) {
  constexpr size_t N = hn::MaxLanes(D());
  const size_t dim = static_cast<size_t>(kv.head_dim);
  HWY_ALIGN float accbuf[kQkMaxTile * kQkBlock * N];
  HWY_ALIGN float p[kQkMaxTile * kQkBlock];
  // Row pointers of the current block and the ones up to kAhead blocks on (a ring).
  constexpr int kRing = 4;
  const int ahead = idx != nullptr ? 2 : 1;  // a list's rows are scattered: look further ahead
  const void* krow[kRing][kQkBlock];
  const int n_blocks = (n + kQkBlock - 1) / kQkBlock;
  auto block_len = [&](int blk) { return std::min(kQkBlock, n - blk * kQkBlock); };
  auto fill = [&](int blk) {
    const int pos = blk * kQkBlock;
    for (int i = 0; i < block_len(blk); ++i) krow[blk % kRing][i] = kv.key(idx != nullptr ? idx[pos + i] : pos + i);
  };
  for (int b = 0; b < std::min(ahead, n_blocks); ++b) {
    fill(b);
    const RowPrefetch first{krow[b % kRing], nullptr, block_len(b), kv.row_bytes()};
    for (int i = 0; i < first.n; ++i) first.k_row(i);
  }
  for (int b = 0; b < n_blocks; ++b) {
    const int B = block_len(b);
    RowPrefetch pf;
    if (b + ahead < n_blocks) {
      fill(b + ahead);
      pf = {krow[(b + ahead) % kRing], nullptr, block_len(b + ahead), kv.row_bytes()};
    }
    // Tiles as in decode attention (attn_chunk_typed): 8s, then one of 4, 3, 2 or 1.
    for (int h0 = 0; h0 < n_q;) {
      const float* qh = q + static_cast<size_t>(h0) * dim;
      const void* const* kr = krow[b % kRing];
      const int rest = n_q - h0;
      const int G = rest >= kQkMaxTile ? kQkMaxTile : rest >= 4 ? 4 : rest;
      switch (G) {
        case 8: qk_block_scores<kT, 8>(d, dim, B, kr, qh, accbuf, p, pf); break;
        case 4: qk_block_scores<kT, 4>(d, dim, B, kr, qh, accbuf, p, pf); break;
        case 3: qk_block_scores<kT, 3>(d, dim, B, kr, qh, accbuf, p, pf); break;
        case 2: qk_block_scores<kT, 2>(d, dim, B, kr, qh, accbuf, p, pf); break;
        default: qk_block_scores<kT, 1>(d, dim, B, kr, qh, accbuf, p, pf); break;
      }
      for (int g = 0; g < G; ++g)
        std::memcpy(scores + static_cast<size_t>(h0 + g) * n + static_cast<size_t>(b) * kQkBlock, p + g * kQkBlock,
                    sizeof(float) * static_cast<size_t>(B));
      h0 += G;
      pf.n = 0;  // only the first tile prefetches
    }
  }
}

// The group's q . kmean over every page: the page means read as float32 key rows, pages of
// kv.page_size rows each, through token_score's loop (one pass for the whole group).
void page_score_mean_group_impl(const PagedHeadView& kv, const float* q, int n_q, float* scores) {
  const int n_pages = kv.n_pages();
  const size_t dim = static_cast<size_t>(kv.head_dim);
  thread_local std::vector<const void*> rows;  // [ceil(n_pages / page_size)] "pages" of means
  rows.resize(static_cast<size_t>((n_pages + kv.page_size - 1) >> kv.page_shift));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = kv.kmean + (i << kv.page_shift) * dim;
  PagedHeadView means = kv;
  means.k_pages = rows.data();
  means.v_pages = nullptr;
  means.n_tokens = n_pages;
  means.dtype = DType::f32;
  with_tag(kv.head_dim, [&](auto d) { token_score_typed<DType::f32>(d, means, q, n_q, nullptr, n_pages, scores); });
}

float score_max_impl(const float* x, int n) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  auto m0 = hn::Set(d, -std::numeric_limits<float>::infinity());
  auto m1 = m0;
  size_t i = 0;
  for (; i + 2 * N <= static_cast<size_t>(n); i += 2 * N) {
    m0 = hn::Max(m0, hn::LoadU(d, x + i));
    m1 = hn::Max(m1, hn::LoadU(d, x + i + N));
  }
  float m = hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1)));
  for (; i < static_cast<size_t>(n); ++i) m = std::max(m, x[i]);
  return m;
}

// exp in float32 (Highway's Exp, as decode attention's softmax); the lanes sum in float32
// for 16 vectors at a time, those sums in float64. (A float64 add of each vector's lane
// sum made one serial chain through the loop: 4x slower at 32K entries.)
double score_exp_impl(const float* x, int n, float scale, float shift, float* out) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  const auto vs = hn::Set(d, scale);
  const auto vb = hn::Set(d, -shift);
  constexpr size_t kChunk = 16;
  double sum = 0;
  size_t i = 0;
  while (i + N <= static_cast<size_t>(n)) {
    const size_t end = std::min(static_cast<size_t>(n) / N * N, i + kChunk * N);
    auto acc0 = hn::Zero(d), acc1 = hn::Zero(d);
    for (; i + 2 * N <= end; i += 2 * N) {
      const auto e0 = hn::Exp(d, hn::MulAdd(hn::LoadU(d, x + i), vs, vb));
      const auto e1 = hn::Exp(d, hn::MulAdd(hn::LoadU(d, x + i + N), vs, vb));
      hn::StoreU(e0, d, out + i);
      hn::StoreU(e1, d, out + i + N);
      acc0 = hn::Add(acc0, e0);
      acc1 = hn::Add(acc1, e1);
    }
    for (; i < end; i += N) {
      const auto e = hn::Exp(d, hn::MulAdd(hn::LoadU(d, x + i), vs, vb));
      hn::StoreU(e, d, out + i);
      acc0 = hn::Add(acc0, e);
    }
    sum += hn::GetLane(hn::SumOfLanes(d, hn::Add(acc0, acc1)));
  }
  for (; i < static_cast<size_t>(n); ++i) {
    out[i] = std::exp(x[i] * scale - shift);
    sum += out[i];
  }
  return sum;
}

void token_score_impl(const PagedHeadView& kv, const float* q, int n_q, const int32_t* idx, int n, float* scores) {
  with_tag(kv.head_dim, [&](auto d) {
    switch (kv.dtype) {
      case DType::f32: token_score_typed<DType::f32>(d, kv, q, n_q, idx, n, scores); break;
      case DType::f16: token_score_typed<DType::f16>(d, kv, q, n_q, idx, n, scores); break;
      case DType::bf16: token_score_typed<DType::bf16>(d, kv, q, n_q, idx, n, scores); break;
    }
  });
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(page_score_bound_impl);
HWY_EXPORT(page_score_mean_impl);
HWY_EXPORT(token_score_impl);
HWY_EXPORT(page_score_mean_group_impl);
HWY_EXPORT(score_max_impl);
HWY_EXPORT(score_exp_impl);

namespace {

// Checks shared by the three ops. n_out: how many scores the call writes (scores may be
// null when it writes none, e.g. the data() of an empty vector).
void check_view(std::string_view fn, const PagedHeadView& kv, const float* q, const void* scores, int64_t n_out) {
  if (kv.n_tokens < 0) throw Error(fmt::format("{}: kv.n_tokens={} must be >= 0", fn, kv.n_tokens));
  if (!head_dim_supported(kv.head_dim))
    throw Error(fmt::format("{}: kv.head_dim={} is not supported (multiples of 8 in [8, 256])", fn, kv.head_dim));
  if (kv.page_size < 1 || kv.page_size > 256 || (1 << kv.page_shift) != kv.page_size)
    throw Error(fmt::format("{}: kv.page_size={} does not match page_shift={}", fn, kv.page_size, kv.page_shift));
  if (q == nullptr) throw Error(fmt::format("{}: q must be non-null", fn));
  if (n_out > 0 && scores == nullptr) throw Error(fmt::format("{}: scores must be non-null", fn));
}

void check_page_meta(std::string_view fn, const PagedHeadView& kv, const float* a, const char* name) {
  if (kv.n_tokens > 0 && a == nullptr) throw Error(fmt::format("{}: kv.{} must be non-null", fn, name));
}

}  // namespace

void page_score_bound(const PagedHeadView& kv, const float* q, int n_q, float* scores) {
  check_view(__func__, kv, q, scores, kv.n_tokens > 0 ? static_cast<int64_t>(n_q) * kv.n_pages() : 0);
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  check_page_meta(__func__, kv, kv.kmin, "kmin");
  check_page_meta(__func__, kv, kv.kmax, "kmax");
  if (kv.n_tokens > 0) HWY_DYNAMIC_DISPATCH(page_score_bound_impl)(kv, q, n_q, scores);
}

void page_score_bound(const PagedHeadView& kv, const float* q, float* scores) { page_score_bound(kv, q, 1, scores); }

void page_score_mean(const PagedHeadView& kv, const float* q, float* scores) {
  check_view(__func__, kv, q, scores, kv.n_tokens > 0 ? kv.n_pages() : 0);
  check_page_meta(__func__, kv, kv.kmean, "kmean");
  HWY_DYNAMIC_DISPATCH(page_score_mean_impl)(kv, q, scores);
}

void page_score_mean(const PagedHeadView& kv, const float* q, int n_q, float* scores) {
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  check_view(__func__, kv, q, scores, kv.n_tokens > 0 ? static_cast<int64_t>(n_q) * kv.n_pages() : 0);
  check_page_meta(__func__, kv, kv.kmean, "kmean");
  if (kv.n_tokens > 0) HWY_DYNAMIC_DISPATCH(page_score_mean_group_impl)(kv, q, n_q, scores);
}

float score_max(const float* x, int n) {
  CUMULUS_CHECK(n >= 0 && (n == 0 || x != nullptr), "score_max: n={} with x={}", n, static_cast<const void*>(x));
  return HWY_DYNAMIC_DISPATCH(score_max_impl)(x, n);
}

double score_exp(const float* x, int n, float scale, float shift, float* out) {
  CUMULUS_CHECK(n >= 0 && (n == 0 || (x != nullptr && out != nullptr)), "score_exp: n={} needs non-null x and out",
                n);
  return HWY_DYNAMIC_DISPATCH(score_exp_impl)(x, n, scale, shift, out);
}

void token_score(const PagedHeadView& kv, const float* q, int n_q, const int32_t* idx, int n, float* scores) {
  check_view(__func__, kv, q, scores, static_cast<int64_t>(n_q) * n);
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  if (idx == nullptr) {
    CUMULUS_CHECK(n <= kv.n_tokens, "n={} exceeds kv.n_tokens={} (idx is null: tokens 0..n-1)", n, kv.n_tokens);
  } else {
    for (int i = 0; i < n; ++i)
      CUMULUS_CHECK(idx[i] >= 0 && idx[i] < kv.n_tokens, "idx[{}]={} out of range [0, {})", i, idx[i], kv.n_tokens);
  }
  if (n > 0) CUMULUS_CHECK(kv.k_pages != nullptr, "kv.k_pages must be non-null");
  HWY_DYNAMIC_DISPATCH(token_score_impl)(kv, q, n_q, idx, n, scores);
}

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
