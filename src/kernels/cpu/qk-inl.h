// Per-target building blocks of the CPU kernels that score a group of queries against
// K rows (decode attention, token scoring): row prefetching, the score loop over blocks of
// kQkBlock tokens, and the transposed reduction that turns the per-token accumulators of a
// block into one vector of scores. Included by each kernel file after
// hwy/foreach_target.h, so it is compiled once per SIMD target (the guard toggles with
// HWY_TARGET_TOGGLE).
#if defined(CUMULUS_KERNELS_CPU_QK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef CUMULUS_KERNELS_CPU_QK_INL_H_
#undef CUMULUS_KERNELS_CPU_QK_INL_H_
#else
#define CUMULUS_KERNELS_CPU_QK_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>

#include "cumulus/core/dtype.h"
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/row_load-inl.h"

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Tokens per block: the reduction turns kQkBlock accumulators into whole vectors of scores.
constexpr int kQkBlock = 16;

#if HWY_TARGET != HWY_SCALAR
// Four vectors r0..r3 -> one vector whose every 128-bit block holds
// [sum r0, sum r1, sum r2, sum r3] over that block's 4 lanes.
template <class D>
HWY_INLINE hn::Vec<D> qk_sum4_blocks(D d, hn::Vec<D> r0, hn::Vec<D> r1, hn::Vec<D> r2, hn::Vec<D> r3) {
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
HWY_INLINE hn::Vec<D> qk_sum_rows(D d, const float* HWY_RESTRICT acc) {
  constexpr size_t N = hn::MaxLanes(D());
  auto row = [&](size_t i) { return hn::LoadU(d, acc + i * N); };
#if HWY_TARGET != HWY_SCALAR
  if constexpr (N == 4) {
    return qk_sum4_blocks(d, row(0), row(1), row(2), row(3));
  } else if constexpr (N == 8) {
    const auto v0 = qk_sum4_blocks(d, row(0), row(1), row(2), row(3));  // tokens 0-3, per 128-bit half
    const auto v1 = qk_sum4_blocks(d, row(4), row(5), row(6), row(7));
    return hn::Add(hn::ConcatLowerLower(d, v1, v0), hn::ConcatUpperUpper(d, v1, v0));
  } else if constexpr (N == 16) {
    const auto v0 = qk_sum4_blocks(d, row(0), row(1), row(2), row(3));  // tokens 0-3 in each of 4 blocks
    const auto v1 = qk_sum4_blocks(d, row(4), row(5), row(6), row(7));
    const auto v2 = qk_sum4_blocks(d, row(8), row(9), row(10), row(11));
    const auto v3 = qk_sum4_blocks(d, row(12), row(13), row(14), row(15));
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
// against this spread, docs/lab/performance-log.md). V goes a line at a time, not a row at a
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
HWY_INLINE void qk_keep_in_register(V& v) {
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128 && (defined(__GNUC__) || defined(__clang__))
  __asm__("" : "+x"(v.raw));
#else
  (void)v;
#endif
}

// Vector registers of the target: loops are unrolled only as far as their accumulators fit.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kQkVecRegs = 32;
#else
constexpr int kQkVecRegs = 16;
#endif

// Queries per tile, at most: 8 accumulators fit AVX2's 16 registers.
constexpr int kQkMaxTile = 8;

// Loop unrolling for a tile of G queries: the largest power of two up to `want` whose
// G x U accumulators, U row vectors and 2 more fit in the registers (the PV loop's choice
// of `want` is attn_pv_unroll in attention.cpp). Scores: T tokens per step, T x G >= 8
// chains cover the FMA latency, at least 2 so each q load serves two FMAs (Zen 4, K/V in
// L2: T = 4 for G = 4 was no faster than 2).
constexpr int qk_unroll(int G, int want) {
  int u = want;
  while (u > 1 && u * G + u + 2 > kQkVecRegs) u /= 2;
  return u;
}
constexpr int qk_score_unroll(int G) { return qk_unroll(G, G >= 4 ? 2 : 8 / G); }

// Score steps of T tokens from token t on, while T tokens of the block's B are left: the
// G x T accumulators of q . k over the head dimension, stored to accbuf [G][kQkBlock][N] for
// the reduction (qk_sum_rows); K rows of the block ahead are prefetched, one per token.
// t is advanced.
template <DType kT, int G, int T, class D>
HWY_INLINE void qk_score_steps(D d, size_t dim, int B, const void* const* krow, const float* HWY_RESTRICT q,
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
        if constexpr (T > 1) qk_keep_in_register(qv);
        for (int u = 0; u < T; ++u) a[u][g] = hn::MulAdd(qv, k[u], a[u][g]);
      }
    }
    // Stores first, prefetches after: a loop between the stores would keep the compiler
    // from unrolling them, and a[][] would live in memory.
    for (int u = 0; u < T; ++u)
      for (int g = 0; g < G; ++g) hn::StoreU(a[u][g], d, accbuf + (static_cast<size_t>(g) * kQkBlock + t + u) * N);
    for (int u = 0; u < T; ++u) pf.k_row(t + u);
  }
}

// Scores of one block of B <= kQkBlock tokens for a tile of G queries: p[g][i] = q_g . k_i
// for i < B and 0 for the padding. K rows of a later block (pf) are prefetched meanwhile.
//   krow: [B] K row pointers; q: [G][dim]; accbuf: [G][kQkBlock][N] scratch;
//   p: [G][kQkBlock]
template <DType kT, int G, class D>
HWY_INLINE void qk_block_scores(D d, size_t dim, int B, const void* const* krow, const float* HWY_RESTRICT q,
                                float* HWY_RESTRICT accbuf, float* HWY_RESTRICT p, const RowPrefetch& pf) {
  constexpr size_t N = hn::MaxLanes(D());
  auto acc_at = [&](int g, int t) { return accbuf + (static_cast<size_t>(g) * kQkBlock + t) * N; };
  // Each K vector is widened once and feeds G accumulators; T tokens per step
  // (qk_score_unroll, then the smaller steps for the rest of the block).
  constexpr int kTok = qk_score_unroll(G);
  int t = 0;
  qk_score_steps<kT, G, kTok>(d, dim, B, krow, q, accbuf, pf, t);
  if constexpr (kTok > 4) qk_score_steps<kT, G, 4>(d, dim, B, krow, q, accbuf, pf, t);
  if constexpr (kTok > 2) qk_score_steps<kT, G, 2>(d, dim, B, krow, q, accbuf, pf, t);
  if constexpr (kTok > 1) qk_score_steps<kT, G, 1>(d, dim, B, krow, q, accbuf, pf, t);
  for (t = B; t < kQkBlock; ++t) {
    for (int g = 0; g < G; ++g) hn::StoreU(hn::Zero(d), d, acc_at(g, t));
    pf.k_row(t);
  }
  for (int g = 0; g < G; ++g)
    for (int t0 = 0; t0 < kQkBlock; t0 += static_cast<int>(N))
      hn::StoreU(qk_sum_rows(d, acc_at(g, t0)), d, p + g * kQkBlock + t0);
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // CUMULUS_KERNELS_CPU_QK_INL_H_ toggle
