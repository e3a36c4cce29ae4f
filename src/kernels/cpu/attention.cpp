// SIMD decode attention (Highway, runtime dispatch: one binary picks AVX-512, AVX2 or SSE4
// at run time), dense and sparse over per-kv-head index lists. Same contract as
// src/kernels/ref/attention.cpp; accumulation is float32, online softmax within a chunk and
// log-sum-exp merging across chunks (the flash-decoding split over the context).
//
// Work split: each kv head's token range (dense) or index list (sparse) is cut into chunks
// of kAttnChunkTokens (dense) or kAttnChunkSparse (lists) entries; one (kv head, chunk) is one ThreadPool task producing a partial
// (max m, sum l, unnormalised output o) for every query head of the group. The chunk
// count depends on the token count alone, and partials are merged in chunk order, so the
// result is bit-identical for any number of threads.
//
// Inside a chunk, tokens go in blocks of kBlock = 16. Each K and V row of a block is
// fetched from memory once for the whole GQA group; the group is processed in tiles of
// up to 8 query heads that re-read the block from L1. Scores q . k need a horizontal sum
// per (token, query head); instead of reducing each accumulator alone, the accumulators
// of N tokens (N = lanes) are reduced together by a transpose-and-add tree that yields one
// vector holding the N scores, so the softmax of a block is vectorised too.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kernels/attention.h"
#include "kernels/cpu/qk-inl.h"

#ifndef CUMULUS_KERNELS_CPU_ATTENTION_ONCE
#define CUMULUS_KERNELS_CPU_ATTENTION_ONCE
namespace cumulus::cpu {

// One task: query heads of one kv head against entries [begin, end) of that head's token
// range (idx == nullptr: tokens begin..end-1) or index list idx.
struct AttentionChunk {
  const PagedHeadView* kv = nullptr;
  const float* q = nullptr;  // [group][head_dim], already multiplied by scale
  int group = 1;
  const int32_t* idx = nullptr;
  int begin = 0, end = 0;
  float* o = nullptr;  // [group][head_dim] out: sum_i exp(s_i - m) v_i
  float* m = nullptr;  // [group] out: max_i s_i
  float* l = nullptr;  // [group] out: sum_i exp(s_i - m)
};

// Tokens per block and per chunk. Chunks are multiples of kBlock so only a list's last
// block is partial. Sparse lists are cut finer: a union of ~900 tokens per kv head
// (SmolLM2 at 8K, 3 kv heads) was one task per head, three tasks for two threads.
constexpr int kAttnBlock = 16;
constexpr int kAttnChunkTokens = 1024;
constexpr int kAttnChunkSparse = 256;

}  // namespace cumulus::cpu
#endif

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace {

constexpr int kBlock = kAttnBlock;
static_assert(kBlock == kQkBlock, "the score loop (qk-inl.h) works in blocks of kAttnBlock tokens");
constexpr float kMaxSlack = 8.0f;
// How many blocks ahead rows are prefetched: dense ranges, sparse lists (see RowPrefetch).
constexpr int kPrefetchBlocksDense = 1;
constexpr int kPrefetchBlocksSparse = 2;

// PV loop unrolling for a tile of G heads: S vectors of the head dimension per step, G x S
// up to 16, so each broadcast weight serves S FMAs (G = 4: S = 4 instead of 2 took the
// step from 27.0 to 25.4 ns per token; the score loop's unrolling is qk_score_unroll).
constexpr int attn_pv_unroll(int G) { return qk_unroll(G, G >= 16 ? 1 : G >= 8 ? 2 : G >= 4 ? 4 : 8); }

// PV steps of S vectors of the head dimension from column j on, while S whole vectors are
// left: o[g] = alpha[g] * o[g] + sum_i p[g][i] v_i over those columns. j is advanced.
template <DType kT, int G, int S, class D>
HWY_INLINE void attn_pv_steps(D d, size_t dim, int B, const void* const* vrow, const float* HWY_RESTRICT p,
                              const float* alpha, float* HWY_RESTRICT o, const RowPrefetch& pf, int pf_per,
                              int& pf_row, size_t& pf_off, size_t& j) {
  constexpr size_t N = hn::MaxLanes(D());
  using V = hn::Vec<D>;
  for (; j + S * N <= dim; j += S * N) {
    V a[G][S];
    for (int g = 0; g < G; ++g) {
      const V al = hn::Set(d, alpha[g]);
      for (int s = 0; s < S; ++s) a[g][s] = hn::Mul(hn::LoadU(d, o + g * dim + j + s * N), al);
    }
    for (int i = 0; i < B; ++i) {
      V v[S];
      for (int s = 0; s < S; ++s) v[s] = load_row<kT>(d, vrow[i], j + s * N);
      pf.v_lines(pf_per, pf_row, pf_off);
      for (int g = 0; g < G; ++g) {
        const V w = hn::Set(d, p[g * kBlock + i]);
        for (int s = 0; s < S; ++s) a[g][s] = hn::MulAdd(w, v[s], a[g][s]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int s = 0; s < S; ++s) hn::StoreU(a[g][s], d, o + g * dim + j + s * N);
  }
}

// One block of B <= kBlock tokens for a tile of G query heads.
//   krow, vrow: [B] row pointers; q: [G][dim] scaled queries; o: [G][dim]; m: [G];
//   lsum: [G][N] lane-wise sums of the weights;
//   accbuf: [G][kBlock][N] scratch; p: [G][kBlock] scratch (scores, then weights)
//   pf: rows of a later block to prefetch (K rows in the score loop, V rows in the PV loop)
template <DType kT, int G, class D>
HWY_INLINE void attn_block_tile(D d, size_t dim, int B, const void* const* krow, const void* const* vrow,
                                const float* HWY_RESTRICT q, float* HWY_RESTRICT o, float* m,
                                float* HWY_RESTRICT lsum, float* HWY_RESTRICT accbuf, float* HWY_RESTRICT p,
                                const RowPrefetch& pf) {
  constexpr size_t N = hn::MaxLanes(D());
  using V = hn::Vec<D>;

  qk_block_scores<kT, G>(d, dim, B, krow, q, accbuf, p, pf);

  // Online softmax over the block, vectorised over its tokens. The running max m moves
  // only when a score exceeds it by more than kMaxSlack (weights stay <= e^kMaxSlack, far
  // from float overflow), so most blocks skip the horizontal max and the rescale, and the
  // sum stays lane-wise in lsum [G][N] until the chunk ends.
  float alpha[G];
  for (int g = 0; g < G; ++g) {
    float* pg = p + g * kBlock;
    for (int i = B; i < kBlock; ++i) pg[i] = -std::numeric_limits<float>::infinity();
    V vmax = hn::LoadU(d, pg);
    for (int t0 = static_cast<int>(N); t0 < kBlock; t0 += static_cast<int>(N)) vmax = hn::Max(vmax, hn::LoadU(d, pg + t0));
    V vl = hn::LoadU(d, lsum + g * N);
    alpha[g] = 1.0f;
    if (!hn::AllFalse(d, hn::Gt(vmax, hn::Set(d, m[g] + kMaxSlack)))) {
      const float m_new = hn::GetLane(hn::MaxOfLanes(d, vmax));
      alpha[g] = std::exp(m[g] - m_new);  // 0 for the first block (m = -inf)
      m[g] = m_new;
      vl = hn::Mul(vl, hn::Set(d, alpha[g]));
    }
    const V vm = hn::Set(d, m[g]);
    for (int t0 = 0; t0 < kBlock; t0 += static_cast<int>(N)) {
      const V e = hn::Exp(d, hn::Sub(hn::LoadU(d, pg + t0), vm));  // exp(-inf) = 0 for padding
      hn::StoreU(e, d, pg + t0);
      vl = hn::Add(vl, e);
    }
    hn::StoreU(vl, d, lsum + g * N);
  }

  // o = alpha * o + sum_t p_t v_t over S vectors of the head dimension at a time
  // (attn_pv_unroll, then smaller steps for the rest), so the accumulators stay in
  // registers; each V vector is widened once for all G heads and each broadcast weight
  // serves S vectors. The V lines of the block ahead are prefetched in order, pf_per after
  // each token of each step, so they spread over all steps * B tokens of the loop.
  constexpr int kS = attn_pv_unroll(G);
  int pf_row = 0;
  size_t pf_off = 0;
  int pf_per = 0;
  if (pf.n > 0 && B > 0) {
    const int lines = pf.n * static_cast<int>((pf.bytes + 63) / 64);
    const int slots = static_cast<int>((dim + kS * N - 1) / (kS * N)) * B;
    pf_per = (lines + slots - 1) / slots;
  }
  size_t j = 0;
  attn_pv_steps<kT, G, kS>(d, dim, B, vrow, p, alpha, o, pf, pf_per, pf_row, pf_off, j);
  if constexpr (kS > 4) attn_pv_steps<kT, G, 4>(d, dim, B, vrow, p, alpha, o, pf, pf_per, pf_row, pf_off, j);
  if constexpr (kS > 2) attn_pv_steps<kT, G, 2>(d, dim, B, vrow, p, alpha, o, pf, pf_per, pf_row, pf_off, j);
  if constexpr (kS > 1) attn_pv_steps<kT, G, 1>(d, dim, B, vrow, p, alpha, o, pf, pf_per, pf_row, pf_off, j);
}

template <DType kT, class D>
void attn_chunk_typed(D d, const AttentionChunk& job) {
  constexpr size_t N = hn::MaxLanes(D());
  const PagedHeadView& kv = *job.kv;
  const size_t dim = static_cast<size_t>(kv.head_dim);
  const size_t row_bytes = kv.row_bytes();
  for (int g = 0; g < job.group; ++g) job.m[g] = -std::numeric_limits<float>::infinity();
  // [group][N] lane-wise running sums of the softmax weights, reduced once at the end.
  std::vector<float> lsum(static_cast<size_t>(job.group) * N, 0.0f);
  std::memset(job.o, 0, sizeof(float) * dim * static_cast<size_t>(job.group));

  HWY_ALIGN float accbuf[kQkMaxTile * kBlock * N];
  HWY_ALIGN float p[kQkMaxTile * kBlock];
  // Row pointers of blocks in a ring of kRing: the current block and the ones up to
  // the prefetch distance ahead, whose rows are prefetched while the current block computes.
  constexpr int kRing = 4;
  const void* krow[kRing][kBlock];
  const void* vrow[kRing][kBlock];
  const char* const* k_pages = reinterpret_cast<const char* const*>(kv.k_pages);
  const char* const* v_pages = reinterpret_cast<const char* const*>(kv.v_pages);
  const int shift = kv.page_shift;
  const int mask = kv.page_size - 1;
  auto fill_rows = [&](int blk) {
    const int pos = job.begin + blk * kBlock;
    const int n = std::min(kBlock, job.end - pos);
    for (int i = 0; i < n; ++i) {
      const int tok = job.idx != nullptr ? job.idx[pos + i] : pos + i;
      const size_t off = static_cast<size_t>(tok & mask) * row_bytes;
      krow[blk % kRing][i] = k_pages[tok >> shift] + off;
      vrow[blk % kRing][i] = v_pages[tok >> shift] + off;
    }
  };
  const int n_blocks = (job.end - job.begin + kBlock - 1) / kBlock;
  const bool sparse = job.idx != nullptr;
  const int pd = std::min(sparse ? kPrefetchBlocksSparse : kPrefetchBlocksDense, kRing - 1);
  for (int b = 0; b < std::min(pd, n_blocks); ++b) fill_rows(b);
  // The first blocks have nobody to prefetch them.
  for (int b = 0; b < std::min(pd, n_blocks); ++b) {
    const int pos = job.begin + b * kBlock;
    RowPrefetch first{krow[b % kRing], vrow[b % kRing], std::min(kBlock, job.end - pos), row_bytes};
    for (int i = 0; i < first.n; ++i) {
      first.k_row(i);
      first.v_row(i);
    }
  }
  for (int b = 0; b < n_blocks; ++b) {
    const int pos = job.begin + b * kBlock;
    const int B = std::min(kBlock, job.end - pos);
    RowPrefetch pf;
    if (b + pd < n_blocks) {
      fill_rows(b + pd);
      pf = {krow[(b + pd) % kRing], vrow[(b + pd) % kRing], std::min(kBlock, job.end - pos - pd * kBlock), row_bytes};
    }
    const void* const* kr = krow[b % kRing];
    const void* const* vr = vrow[b % kRing];
    // Tiles as in token_score (scoring.cpp): 8s, then one of 4, 3, 2 or 1. Written out: a
    // shared helper taking a lambda cost the SmolLM2 shape 7% (13.2 -> 14.2 ns per token
    // per kv head, K/V in L2), even with the lambda forced inline.
    for (int g0 = 0; g0 < job.group;) {
      const int rest = job.group - g0;
      const float* q = job.q + g0 * dim;
      float* o = job.o + g0 * dim;
      float* ls = lsum.data() + g0 * N;
      if (rest >= 8) {
        attn_block_tile<kT, 8>(d, dim, B, kr, vr, q, o, job.m + g0, ls, accbuf, p, pf);
        g0 += 8;
      } else if (rest >= 4) {
        attn_block_tile<kT, 4>(d, dim, B, kr, vr, q, o, job.m + g0, ls, accbuf, p, pf);
        g0 += 4;
      } else if (rest == 3) {  // SmolLM2's group: one pass over the block, not 2 + 1
        attn_block_tile<kT, 3>(d, dim, B, kr, vr, q, o, job.m + g0, ls, accbuf, p, pf);
        g0 += 3;
      } else if (rest == 2) {
        attn_block_tile<kT, 2>(d, dim, B, kr, vr, q, o, job.m + g0, ls, accbuf, p, pf);
        g0 += 2;
      } else {
        attn_block_tile<kT, 1>(d, dim, B, kr, vr, q, o, job.m + g0, ls, accbuf, p, pf);
        g0 += 1;
      }
      pf.n = 0;  // only the first tile prefetches
    }
  }
  for (int g = 0; g < job.group; ++g) job.l[g] = hn::GetLane(hn::SumOfLanes(d, hn::LoadU(d, lsum.data() + g * N)));
}

// out[g] = sum_i w[g][i] v_{idx[i]} for a tile of G heads, in blocks of kBlock tokens
// through the PV loop of attention (alpha = 1), V rows of the next block prefetched.
template <DType kT, int G, class D>
void weighted_values_tile(D d, const PagedHeadView& kv, const int32_t* idx, int n, const float* w, size_t w_stride,
                          float* out) {
  const size_t dim = static_cast<size_t>(kv.head_dim);
  HWY_ALIGN float p[G * kBlock];
  float ones[G];  // alpha of the PV loop: nothing to rescale
  for (int g = 0; g < G; ++g) ones[g] = 1.0f;
  const void* vrow[2][kBlock];
  auto fill = [&](int blk) {
    const int pos = blk * kBlock;
    for (int i = 0; i < std::min(kBlock, n - pos); ++i) vrow[blk & 1][i] = kv.value(idx[pos + i]);
  };
  const int n_blocks = (n + kBlock - 1) / kBlock;
  if (n_blocks > 0) fill(0);
  constexpr int kS = attn_pv_unroll(G);
  for (int b = 0; b < n_blocks; ++b) {
    const int pos = b * kBlock;
    const int B = std::min(kBlock, n - pos);
    RowPrefetch pf;
    if (b + 1 < n_blocks) {
      fill(b + 1);
      pf = {nullptr, vrow[(b + 1) & 1], std::min(kBlock, n - pos - kBlock), kv.row_bytes()};
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < B; ++i) p[g * kBlock + i] = w[static_cast<size_t>(g) * w_stride + pos + i];
    int pf_row = 0;
    size_t pf_off = 0;
    int pf_per = 0;
    if (pf.n > 0) {
      const int lines = pf.n * static_cast<int>((pf.bytes + 63) / 64);
      const int slots = static_cast<int>((dim + kS * hn::Lanes(d) - 1) / (kS * hn::Lanes(d))) * B;
      pf_per = (lines + slots - 1) / slots;
    }
    size_t j = 0;
    const void* const* vr = vrow[b & 1];
    attn_pv_steps<kT, G, kS>(d, dim, B, vr, p, ones, out, pf, pf_per, pf_row, pf_off, j);
    if constexpr (kS > 4) attn_pv_steps<kT, G, 4>(d, dim, B, vr, p, ones, out, pf, pf_per, pf_row, pf_off, j);
    if constexpr (kS > 2) attn_pv_steps<kT, G, 2>(d, dim, B, vr, p, ones, out, pf, pf_per, pf_row, pf_off, j);
    if constexpr (kS > 1) attn_pv_steps<kT, G, 1>(d, dim, B, vr, p, ones, out, pf, pf_per, pf_row, pf_off, j);
  }
}

template <DType kT, class D>
void weighted_values_typed(D d, const PagedHeadView& kv, const int32_t* idx, int n, const float* w, int n_q,
                           float* out) {
  const size_t dim = static_cast<size_t>(kv.head_dim);
  std::fill(out, out + static_cast<size_t>(n_q) * dim, 0.0f);
  for (int g0 = 0; g0 < n_q;) {
    const int rest = n_q - g0;
    const float* wg = w + static_cast<size_t>(g0) * n;
    float* o = out + static_cast<size_t>(g0) * dim;
    const size_t ws = static_cast<size_t>(n);
    if (rest >= 4) {
      weighted_values_tile<kT, 4>(d, kv, idx, n, wg, ws, o);
      g0 += 4;
    } else if (rest == 3) {
      weighted_values_tile<kT, 3>(d, kv, idx, n, wg, ws, o);
      g0 += 3;
    } else if (rest == 2) {
      weighted_values_tile<kT, 2>(d, kv, idx, n, wg, ws, o);
      g0 += 2;
    } else {
      weighted_values_tile<kT, 1>(d, kv, idx, n, wg, ws, o);
      g0 += 1;
    }
  }
}

}  // namespace

void attention_weighted_values_impl(const PagedHeadView& kv, const int32_t* idx, int n, const float* w, int n_q,
                                    float* out) {
  const hn::ScalableTag<float> df;
  auto run = [&](auto d) {
    switch (kv.dtype) {
      case DType::f32: weighted_values_typed<DType::f32>(d, kv, idx, n, w, n_q, out); break;
      case DType::f16: weighted_values_typed<DType::f16>(d, kv, idx, n, w, n_q, out); break;
      case DType::bf16: weighted_values_typed<DType::bf16>(d, kv, idx, n, w, n_q, out); break;
    }
  };
  if (kv.head_dim % static_cast<int>(hn::Lanes(df)) == 0) {
    run(df);
  } else {
    run(hn::CappedTag<float, 8>());
  }
}

void attention_chunk_impl(const AttentionChunk& job) {
  // The widest float vector whose lane count divides head_dim (a multiple of 8).
  const hn::ScalableTag<float> df;
  auto run = [&](auto d) {
    switch (job.kv->dtype) {
      case DType::f32: attn_chunk_typed<DType::f32>(d, job); break;
      case DType::f16: attn_chunk_typed<DType::f16>(d, job); break;
      case DType::bf16: attn_chunk_typed<DType::bf16>(d, job); break;
    }
  };
  if (job.kv->head_dim % static_cast<int>(hn::Lanes(df)) == 0) {
    run(df);
  } else {
    run(hn::CappedTag<float, 8>());
  }
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(attention_chunk_impl);
HWY_EXPORT(attention_weighted_values_impl);

namespace {

struct AttnTask {
  int head, begin, end;
};

// Shared driver of the dense (sel == nullptr) and sparse ops; inputs already validated.
void attention_decode_run(const DecodeAttnArgs& a, const Selection* sel, ThreadPool& pool) {
  const int dim = a.kv[0].head_dim;
  const int group = a.group;
  const int n_q = a.n_kv_heads * group;
  const size_t udim = static_cast<size_t>(dim);

  // Scaled queries [n_q][head_dim]: scores come out as scale * q . k directly.
  std::vector<float> qs(static_cast<size_t>(n_q) * udim);
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = a.q[i] * a.scale;

  // Tasks in (kv head, chunk) order; first_task[h] .. first_task[h + 1] belong to head h.
  std::vector<AttnTask> tasks;
  std::vector<int> first_task(static_cast<size_t>(a.n_kv_heads) + 1);
  for (int h = 0; h < a.n_kv_heads; ++h) {
    first_task[h] = static_cast<int>(tasks.size());
    const int n = sel != nullptr ? static_cast<int>(sel->tokens[h].size()) : a.kv[h].n_tokens;
    const int chunk = sel != nullptr ? kAttnChunkSparse : kAttnChunkTokens;
    for (int b = 0; b < n; b += chunk) tasks.push_back({h, b, std::min(n, b + chunk)});
  }
  first_task[a.n_kv_heads] = static_cast<int>(tasks.size());

  // Partials per task: o [group][head_dim], m [group], l [group], padded to 64 bytes so
  // tasks on different threads never share a cache line.
  const size_t stride = (static_cast<size_t>(group) * (udim + 2) + 15) & ~size_t{15};
  AttentionWorkspace own;
  std::vector<float>& part = (a.workspace != nullptr ? *a.workspace : own).partials;
  if (part.size() < tasks.size() * stride) part.resize(tasks.size() * stride);
  float* base = part.data();

  pool.parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t t, int) {
    const AttnTask& task = tasks[static_cast<size_t>(t)];
    float* slot = base + static_cast<size_t>(t) * stride;
    AttentionChunk job;
    job.kv = &a.kv[task.head];
    job.q = qs.data() + static_cast<size_t>(task.head) * group * udim;
    job.group = group;
    job.idx = sel != nullptr ? sel->tokens[task.head].data() : nullptr;
    job.begin = task.begin;
    job.end = task.end;
    job.o = slot;
    job.m = slot + static_cast<size_t>(group) * udim;
    job.l = job.m + group;
    HWY_DYNAMIC_DISPATCH(attention_chunk_impl)(job);
  });

  // Log-sum-exp merge of each head's chunks in chunk order (deterministic), one task per
  // kv head.
  pool.parallel_for(a.n_kv_heads, [&](int64_t hh, int) {
    const int h = static_cast<int>(hh);
    const int t0 = first_task[h], t1 = first_task[h + 1];
    for (int g = 0; g < group; ++g) {
      const int qh = h * group + g;
      float* out = a.out + static_cast<size_t>(qh) * udim;
      if (t0 == t1) {
        std::fill(out, out + dim, 0.0f);
        a.lse[qh] = -std::numeric_limits<float>::infinity();
      } else {
        auto m_of = [&](int t) { return base[static_cast<size_t>(t) * stride + static_cast<size_t>(group) * udim + g]; };
        auto l_of = [&](int t) { return base[static_cast<size_t>(t) * stride + static_cast<size_t>(group) * udim + group + g]; };
        float m = -std::numeric_limits<float>::infinity();
        for (int t = t0; t < t1; ++t) m = std::max(m, m_of(t));
        float l = 0.0f;
        std::fill(out, out + dim, 0.0f);
        for (int t = t0; t < t1; ++t) {
          const float w = std::exp(m_of(t) - m);
          l += l_of(t) * w;
          const float* o = base + static_cast<size_t>(t) * stride + static_cast<size_t>(g) * udim;
          for (int j = 0; j < dim; ++j) out[j] += w * o[j];
        }
        const float inv = 1.0f / l;
        for (int j = 0; j < dim; ++j) out[j] *= inv;
        a.lse[qh] = m + std::log(l);
      }
      if (a.lse_ref != nullptr && a.mass != nullptr) a.mass[qh] = std::exp(a.lse[qh] - a.lse_ref[qh]);
    }
  });
}

}  // namespace

void attention_decode_dense(const DecodeAttnArgs& a, ThreadPool& pool) {
  attention_decode_validate(a, nullptr);
  attention_decode_run(a, nullptr, pool);
}

void attention_decode_sparse(const DecodeAttnArgs& a, const Selection& sel, ThreadPool& pool) {
  attention_decode_validate(a, &sel);
  attention_decode_run(a, &sel, pool);
}

void attention_weighted_values(const PagedHeadView& kv, const int32_t* idx, int n, const float* w, int n_q,
                               float* out) {
  weighted_values_validate(kv, idx, n, w, n_q, out);
  HWY_DYNAMIC_DISPATCH(attention_weighted_values_impl)(kv, idx, n, w, n_q, out);
}

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
