// SIMD decode attention (Highway, runtime dispatch: one binary picks AVX-512, AVX2 or SSE4
// at run time), dense and sparse over per-kv-head index lists. Same contract as
// src/kernels/ref/attention.cpp; accumulation is float32, online softmax within a chunk and
// log-sum-exp merging across chunks (the flash-decoding split over the context).
//
// Work split: each kv head's token range (dense) or index list (sparse) is cut into chunks
// of kChunkTokens entries; one (kv head, chunk) is one ThreadPool task producing a partial
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
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/row_load-inl.h"

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

// Tokens per block and per chunk. kChunkTokens is a multiple of kBlock so only a list's
// last block is partial.
constexpr int kAttnBlock = 16;
constexpr int kAttnChunkTokens = 1024;

}  // namespace cumulus::cpu
#endif

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace {

constexpr int kBlock = kAttnBlock;
constexpr int kMaxTile = 8;  // query heads per tile: 8 accumulators fit AVX2's 16 registers
constexpr float kMaxSlack = 8.0f;
// How many blocks ahead rows are prefetched: dense ranges, sparse lists (see RowPrefetch).
constexpr int kPrefetchBlocksDense = 1;
constexpr int kPrefetchBlocksSparse = 2;

#if HWY_TARGET != HWY_SCALAR
// Four vectors r0..r3 -> one vector whose every 128-bit block holds
// [sum r0, sum r1, sum r2, sum r3] over that block's 4 lanes.
template <class D>
HWY_INLINE hn::Vec<D> attn_sum4_blocks(D d, hn::Vec<D> r0, hn::Vec<D> r1, hn::Vec<D> r2, hn::Vec<D> r3) {
  const hn::Repartition<uint64_t, D> d64;
  // [a0+a2, b0+b2, a1+a3, b1+b3] per block
  const auto ab = hn::Add(hn::InterleaveLower(d, r0, r1), hn::InterleaveUpper(d, r0, r1));
  const auto cd = hn::Add(hn::InterleaveLower(d, r2, r3), hn::InterleaveUpper(d, r2, r3));
  const auto x = hn::BitCast(d64, ab);
  const auto y = hn::BitCast(d64, cd);
  return hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, x, y)), hn::BitCast(d, hn::InterleaveUpper(d64, x, y)));
}
#endif

// acc: [N][N] floats, row i the accumulator of token i. Returns the vector whose lane i is
// the sum of row i: N horizontal sums for about 3 shuffles + adds each instead of ~8.
template <class D>
HWY_INLINE hn::Vec<D> attn_sum_rows(D d, const float* HWY_RESTRICT acc) {
  constexpr size_t N = hn::MaxLanes(D());
  auto row = [&](size_t i) { return hn::LoadU(d, acc + i * N); };
#if HWY_TARGET != HWY_SCALAR
  if constexpr (N == 4) {
    return attn_sum4_blocks(d, row(0), row(1), row(2), row(3));
  } else if constexpr (N == 8) {
    const auto v0 = attn_sum4_blocks(d, row(0), row(1), row(2), row(3));  // tokens 0-3, per 128-bit half
    const auto v1 = attn_sum4_blocks(d, row(4), row(5), row(6), row(7));
    return hn::Add(hn::ConcatLowerLower(d, v1, v0), hn::ConcatUpperUpper(d, v1, v0));
  } else if constexpr (N == 16) {
    const auto v0 = attn_sum4_blocks(d, row(0), row(1), row(2), row(3));  // tokens 0-3 in each of 4 blocks
    const auto v1 = attn_sum4_blocks(d, row(4), row(5), row(6), row(7));
    const auto v2 = attn_sum4_blocks(d, row(8), row(9), row(10), row(11));
    const auto v3 = attn_sum4_blocks(d, row(12), row(13), row(14), row(15));
    // Blocks [v0.b0+v0.b2, v0.b1+v0.b3, v2.b0+v2.b2, v2.b1+v2.b3] and the same for v1, v3.
    const auto w02 = hn::Add(hn::ConcatLowerLower(d, v2, v0), hn::ConcatUpperUpper(d, v2, v0));
    const auto w13 = hn::Add(hn::ConcatLowerLower(d, v3, v1), hn::ConcatUpperUpper(d, v3, v1));
    // Adjacent blocks summed: [v0, v1, v2, v3] totals.
    const auto s = hn::OddEvenBlocks(w13, w02);
    const auto t = hn::SwapAdjacentBlocks(hn::OddEvenBlocks(w02, w13));
    return hn::Add(s, t);
  } else
#endif
  {
    HWY_ALIGN float sums[N];
    for (size_t i = 0; i < N; ++i) sums[i] = hn::GetLane(hn::SumOfLanes(d, row(i)));
    return hn::Load(d, sums);
  }
}

// Rows of a block ahead, prefetched while the current block computes: K rows between the
// score computations (one per token), V lines one at a time between the tokens of the PV
// loop, so the requests trickle out over the whole block. A software prefetch holds one of
// the core's few L1 miss buffers for a full DRAM latency; issued in a burst they fill the
// buffers and stall the loads of the computation behind them (Zen 3: a burst costs ~20%
// of the dense step; for sparse lists, K and V rows together in the score loop cost 12-20%
// against this spread, docs/architecture.md). V goes a line at a time, not a row at a
// time, because the PV loop reads the current block's V rows a slice of the head
// dimension at a time, a stride the hardware prefetcher does not follow (Zen 4: the dense
// step 12-13% faster than with a row after each slice). Dense ranges and sparse lists are
// prefetched the same way; lists look two blocks ahead, since each of their rows is a
// separate DRAM access that no hardware prefetcher anticipates.
struct RowPrefetch {
  const void* const* k = nullptr;
  const void* const* v = nullptr;
  int n = 0;
  size_t bytes = 0;
  HWY_INLINE void row(const void* const* rows, int i) const {
    if (i >= n) return;
    const char* c = static_cast<const char*>(rows[i]);
    for (size_t off = 0; off < bytes; off += 64) prefetch_l2(c + off);
  }
  HWY_INLINE void k_row(int i) const { row(k, i); }
  HWY_INLINE void v_row(int i) const { row(v, i); }
  // Prefetches the next `count` lines of the V rows in order; (r, off) is the cursor: row
  // r, byte offset off.
  HWY_INLINE void v_lines(int count, int& r, size_t& off) const {
    for (int c = 0; c < count && r < n; ++c) {
      prefetch_l2(static_cast<const char*>(v[r]) + off);
      off += 64;
      if (off >= bytes) {
        off = 0;
        ++r;
      }
    }
  }
};

// Makes the compiler load v into a register once instead of folding the load into every
// FMA that uses it: a query vector feeds two FMAs (two tokens), and folded it costs two
// loads, which on Zen 3 (two 256-bit loads per cycle) makes the score loop load-bound
// (10 loads per 8 FMAs instead of 6).
template <class V>
HWY_INLINE void attn_keep_in_register(V& v) {
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128 && (defined(__GNUC__) || defined(__clang__))
  __asm__("" : "+x"(v.raw));
#else
  (void)v;
#endif
}

// Vector registers of the target: 2 x G accumulators (two tokens, or two vectors of the
// head dimension, per step for more independent FMA chains) are used only where they fit.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kVecRegs = 32;
#else
constexpr int kVecRegs = 16;
#endif

// Unrolling of the score and PV loops for a tile of G heads, the largest power of two up
// to `want` whose G x U accumulators, U row vectors and 2 more fit in the registers.
// Scores: T tokens per step, T x G >= 8 chains cover the FMA latency, at least 2 so each q
// load serves two FMAs (Zen 4, K/V in L2: T = 4 for G = 4 was no faster than 2). PV: S
// vectors of the head dimension per step, G x S up to 16, so each broadcast weight serves
// S FMAs (G = 4: S = 4 instead of 2 took the step from 27.0 to 25.4 ns per token).
constexpr int attn_unroll(int G, int want) {
  int u = want;
  while (u > 1 && u * G + u + 2 > kVecRegs) u /= 2;
  return u;
}
constexpr int attn_score_unroll(int G) { return attn_unroll(G, G >= 4 ? 2 : 8 / G); }
constexpr int attn_pv_unroll(int G) { return attn_unroll(G, G >= 16 ? 1 : G >= 2 ? 16 / G : 8); }

// Score steps of T tokens from token t on, while T tokens of the block's B are left: the
// G x T accumulators of q . k over the head dimension, stored to accbuf [G][kBlock][N] for
// the reduction (attn_sum_rows); K rows of the block ahead are prefetched, one per token.
// t is advanced.
template <DType kT, int G, int T, class D>
HWY_INLINE void attn_score_steps(D d, size_t dim, int B, const void* const* krow, const float* HWY_RESTRICT q,
                                 float* HWY_RESTRICT accbuf, const RowPrefetch& pf, int& t) {
  constexpr size_t N = hn::MaxLanes(D());
  using V = hn::Vec<D>;
  for (; t + T <= B; t += T) {
    V a[T][G];
    for (int u = 0; u < T; ++u)
      for (int g = 0; g < G; ++g) a[u][g] = hn::Zero(d);
    for (size_t j = 0; j < dim; j += N) {
      V k[T];
      for (int u = 0; u < T; ++u) k[u] = load_row<kT>(d, krow[t + u], j);
      for (int g = 0; g < G; ++g) {
        V qv = hn::LoadU(d, q + g * dim + j);
        if constexpr (T > 1) attn_keep_in_register(qv);
        for (int u = 0; u < T; ++u) a[u][g] = hn::MulAdd(qv, k[u], a[u][g]);
      }
    }
    // Stores first, prefetches after: a loop between the stores would keep the compiler
    // from unrolling them, and a[][] would live in memory.
    for (int u = 0; u < T; ++u)
      for (int g = 0; g < G; ++g) hn::StoreU(a[u][g], d, accbuf + (static_cast<size_t>(g) * kBlock + t + u) * N);
    for (int u = 0; u < T; ++u) pf.k_row(t + u);
  }
}

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
  auto acc_at = [&](int g, int t) { return accbuf + (static_cast<size_t>(g) * kBlock + t) * N; };

  // Scores: each K vector is widened once and feeds G accumulators; T tokens per step
  // (attn_score_unroll, then the smaller steps for the rest of the block).
  constexpr int kTok = attn_score_unroll(G);
  int t = 0;
  attn_score_steps<kT, G, kTok>(d, dim, B, krow, q, accbuf, pf, t);
  if constexpr (kTok > 4) attn_score_steps<kT, G, 4>(d, dim, B, krow, q, accbuf, pf, t);
  if constexpr (kTok > 2) attn_score_steps<kT, G, 2>(d, dim, B, krow, q, accbuf, pf, t);
  if constexpr (kTok > 1) attn_score_steps<kT, G, 1>(d, dim, B, krow, q, accbuf, pf, t);
  for (t = B; t < kBlock; ++t) {
    for (int g = 0; g < G; ++g) hn::StoreU(hn::Zero(d), d, acc_at(g, t));
    pf.k_row(t);
  }
  for (int g = 0; g < G; ++g)
    for (int t0 = 0; t0 < kBlock; t0 += static_cast<int>(N))
      hn::StoreU(attn_sum_rows(d, acc_at(g, t0)), d, p + g * kBlock + t0);

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
  // (attn_pv_unroll, then smaller steps for the rest), so the accumulators stay in registers; each V vector is widened once for all G heads and each broadcast weight
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

  HWY_ALIGN float accbuf[kMaxTile * kBlock * N];
  HWY_ALIGN float p[kMaxTile * kBlock];
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
      } else if (rest >= 2) {
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

}  // namespace

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
    for (int b = 0; b < n; b += kAttnChunkTokens) tasks.push_back({h, b, std::min(n, b + kAttnChunkTokens)});
  }
  first_task[a.n_kv_heads] = static_cast<int>(tasks.size());

  // Partials per task: o [group][head_dim], m [group], l [group], padded to 64 bytes so
  // tasks on different threads never share a cache line.
  const size_t stride = (static_cast<size_t>(group) * (udim + 2) + 15) & ~size_t{15};
  thread_local std::vector<float> part;
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

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
