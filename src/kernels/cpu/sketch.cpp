// The key sketch's estimate on the CPU (Highway, runtime dispatch), the same contract as
// src/kernels/ref/sketch.cpp: tokens sit in 32-bit lanes, 16 to a block, so one 64-byte
// chunk of a block is 16 tokens x 8 dims of nibbles.
//   - AVX-512 with VNNI (Highway's AVX3_DL target, which this file alone is compiled for:
//     CMakeLists.txt): the low and high nibbles of a chunk are two u8 vectors, each lane
//     holding 4 dims of one token, and dpbusd multiplies them by the query's 4 int8 values
//     and adds into the lane: 2 instructions per query per chunk, for 16 tokens x 8 dims.
//   - AVX2 and AVX-512 without VNNI: the same two u8 vectors go through maddubs, which
//     multiplies u8 by s8 and adds pairs into 16-bit lanes (at most 2 x 15 x 127 = 3810 in
//     size, exact); the low and high nibbles' pairs are added, four chunks accumulate in
//     16 bits (4 x 7620 < 2^15), then one madd by ones widens them to 32-bit lanes.
//   - Every other target (SSE4, scalar, non-x86): each dim's nibble is shifted out of the
//     lane, converted to float and multiplied by the query's int8 value as float (exact:
//     the sums stay below 2^24).
//   So the integer dot product is the same number on every target.
// Then est = base + offset_t qsum + step_t qstep dot, in float32.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/sketch.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/sketch.h"
#include "kernels/cpu/prefetch.h"

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Queries per pass over a block: their accumulators stay in registers.
constexpr int kSketchTile = 8;

// Highway 1.0 has no 8-bit dot product, and its AVX3_DL attribute string lacks
// avx512vnni: the functions on the path to dpbusd get it here (AVX3_DL is only dispatched
// on CPUs with VNNI). A function inlined into another must not have more target options
// than its caller, so the whole chain carries the attribute.
#undef CUMULUS_SKETCH_ATTR
#if HWY_TARGET == HWY_AVX3_DL
#define CUMULUS_SKETCH_ATTR __attribute__((target("avx512vnni")))
CUMULUS_SKETCH_ATTR HWY_INLINE __m512i sketch_dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  return _mm512_dpbusd_epi32(acc, u8, s8);
}
#else
#define CUMULUS_SKETCH_ATTR
#endif

// The integer dot products q8_j . u_t of B consecutive blocks of 16 tokens for a tile of G
// queries, as float: dot[b][j][16]. qw[(c * G + j) * 2 + h]: q8 of dims 8c + 4h .. 8c + 4h + 3
// of query j as one int32 (byte i = dim 8c + 4h + i).
template <int G, int B>
CUMULUS_SKETCH_ATTR HWY_INLINE void sketch_block_dots(const uint8_t* HWY_RESTRICT block, size_t block_bytes,
                                                      int n_chunks, const int32_t* HWY_RESTRICT qw,
                                                      float* HWY_RESTRICT dot) {
#if HWY_TARGET == HWY_AVX3_DL
  // Two accumulators per block and query (low and high nibbles): 2 B G independent
  // dpbusd chains, since its latency is several cycles (one chain per query left the unit
  // idle part of the time).
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i acc[B][G][2];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) acc[b][j][0] = acc[b][j][1] = _mm512_setzero_si512();
  for (int c = 0; c < n_chunks; ++c) {
    __m512i lo[B], hi[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const __m512i v = _mm512_loadu_si512(block + b * block_bytes + static_cast<size_t>(c) * 64);
      lo[b] = _mm512_and_si512(v, low4);
      // x86 has no 8-bit shift: shift 16-bit lanes, then keep each byte's low nibble.
      hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const int32_t* q = qw + static_cast<size_t>(c) * G * 2;
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      const __m512i ql = _mm512_set1_epi32(q[2 * j]), qh = _mm512_set1_epi32(q[2 * j + 1]);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) {
        acc[b][j][0] = sketch_dpbusd(acc[b][j][0], lo[b], ql);
        acc[b][j][1] = sketch_dpbusd(acc[b][j][1], hi[b], qh);
      }
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j)
      _mm512_storeu_ps(dot + (b * G + j) * kSketchBlock,
                       _mm512_cvtepi32_ps(_mm512_add_epi32(acc[b][j][0], acc[b][j][1])));
#elif HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3
#if HWY_TARGET == HWY_AVX2
  // 8 tokens per vector: a 64-byte chunk is two vectors. 4 queries per pass keep their
  // 16-bit accumulators (4 x 2), the chunk (4) and the query words (2) in 16 registers.
  using V = __m256i;
  constexpr int kParts = 2, kQ = 4;
  const auto load = [](const uint8_t* p) HWY_ATTR { return _mm256_loadu_si256(reinterpret_cast<const V*>(p)); };
  const auto low_nibbles = [](V v, V m) HWY_ATTR { return _mm256_and_si256(v, m); };
  const auto high_nibbles = [](V v, V m) HWY_ATTR { return _mm256_and_si256(_mm256_srli_epi16(v, 4), m); };
  const auto dot_pairs = [](V u, V w) HWY_ATTR { return _mm256_maddubs_epi16(u, w); };
  const auto add16 = [](V x, V y) HWY_ATTR { return _mm256_add_epi16(x, y); };
  const auto widen_add = [](V acc, V x, V one) HWY_ATTR { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, one)); };
  const auto store = [](float* p, V x) HWY_ATTR { _mm256_storeu_ps(p, _mm256_cvtepi32_ps(x)); };
  const auto bcast = [](int32_t w) HWY_ATTR { return _mm256_set1_epi32(w); };
  const V low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
#else
  // 16 tokens per vector: a chunk is one vector; 8 queries per pass (32 registers).
  using V = __m512i;
  constexpr int kParts = 1, kQ = 8;
  const auto load = [](const uint8_t* p) HWY_ATTR { return _mm512_loadu_si512(p); };
  const auto low_nibbles = [](V v, V m) HWY_ATTR { return _mm512_and_si512(v, m); };
  const auto high_nibbles = [](V v, V m) HWY_ATTR { return _mm512_and_si512(_mm512_srli_epi16(v, 4), m); };
  const auto dot_pairs = [](V u, V w) HWY_ATTR { return _mm512_maddubs_epi16(u, w); };
  const auto add16 = [](V x, V y) HWY_ATTR { return _mm512_add_epi16(x, y); };
  const auto widen_add = [](V acc, V x, V one) HWY_ATTR { return _mm512_add_epi32(acc, _mm512_madd_epi16(x, one)); };
  const auto store = [](float* p, V x) HWY_ATTR { _mm512_storeu_ps(p, _mm512_cvtepi32_ps(x)); };
  const auto bcast = [](int32_t w) HWY_ATTR { return _mm512_set1_epi32(w); };
  const V low4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
#endif
  constexpr int kLanes = kSketchBlock / kParts;  // tokens per vector
  constexpr int kChunks16 = 4;                    // chunks summed in 16 bits before widening
  constexpr int kMaxQ = G < kQ ? G : kQ;
  for (int b = 0; b < B; ++b) {
    const uint8_t* blk = block + b * block_bytes;
    for (int j0 = 0; j0 < G; j0 += kQ) {
      const int g = std::min(kQ, G - j0);
      V acc[kMaxQ][kParts];
      for (int j = 0; j < kMaxQ; ++j)
        for (int p = 0; p < kParts; ++p) acc[j][p] = zero;
      for (int c0 = 0; c0 < n_chunks; c0 += kChunks16) {
        V acc16[kMaxQ][kParts];
#pragma GCC unroll 8
        for (int j = 0; j < kMaxQ; ++j)
          for (int p = 0; p < kParts; ++p) acc16[j][p] = zero;
        const int c1 = std::min(n_chunks, c0 + kChunks16);
        for (int c = c0; c < c1; ++c) {
          V lo[kParts], hi[kParts];
          for (int p = 0; p < kParts; ++p) {
            const V v = load(blk + static_cast<size_t>(c) * 64 + static_cast<size_t>(p * 64 / kParts));
            lo[p] = low_nibbles(v, low4);
            hi[p] = high_nibbles(v, low4);
          }
          const int32_t* q = qw + (static_cast<size_t>(c) * G + j0) * 2;
#pragma GCC unroll 8
          for (int j = 0; j < kMaxQ; ++j) {
            if (j >= g) break;
            const V ql = bcast(q[2 * j]), qh = bcast(q[2 * j + 1]);
            for (int p = 0; p < kParts; ++p)
              acc16[j][p] = add16(acc16[j][p], add16(dot_pairs(lo[p], ql), dot_pairs(hi[p], qh)));
          }
        }
#pragma GCC unroll 8
        for (int j = 0; j < kMaxQ; ++j)
          for (int p = 0; p < kParts; ++p) acc[j][p] = widen_add(acc[j][p], acc16[j][p], ones);
      }
      for (int j = 0; j < g; ++j)
        for (int p = 0; p < kParts; ++p) store(dot + (b * G + j0 + j) * kSketchBlock + p * kLanes, acc[j][p]);
    }
  }
#else
  // q8 as float (exact: the sums stay below 2^24). Lanes of N tokens, 16 / N parts.
  const hn::ScalableTag<uint32_t> du;
  const hn::Rebind<float, decltype(du)> df;
  const hn::Rebind<int32_t, decltype(du)> di;
  const size_t N = hn::Lanes(du);
  const auto low4 = hn::Set(du, 0x0Fu);
  for (int b = 0; b < B; ++b) {
    for (size_t part = 0; part < static_cast<size_t>(kSketchBlock); part += N) {
      hn::Vec<decltype(df)> acc[G];
      for (int j = 0; j < G; ++j) acc[j] = hn::Zero(df);
      for (int c = 0; c < n_chunks; ++c) {
        const auto v = hn::LoadU(
            du, reinterpret_cast<const uint32_t*>(block + b * block_bytes + static_cast<size_t>(c) * 64) + part);
        const int32_t* q = qw + static_cast<size_t>(c) * G * 2;
        for (int i = 0; i < 8; ++i) {
          // Dim 8c + i: byte i % 4 of the lane, low nibble for i < 4.
          const int shift = 8 * (i % 4) + 4 * (i / 4);
          const auto u = hn::ConvertTo(df, hn::BitCast(di, hn::And(hn::ShiftRightSame(v, shift), low4)));
          for (int j = 0; j < G; ++j) {
            const int32_t word = q[2 * j + i / 4];
            const auto qv = static_cast<float>(static_cast<int8_t>(static_cast<uint32_t>(word) >> (8 * (i % 4))));
            acc[j] = hn::MulAdd(u, hn::Set(df, qv), acc[j]);
          }
        }
      }
      for (int j = 0; j < G; ++j) hn::StoreU(acc[j], df, dot + (b * G + j) * kSketchBlock + part);
    }
  }
#endif
}

// exp(x) for the sketch's weights: 2^(x log2 e) = 2^n 2^f with n = round(x log2 e), f in
// [-1/2, 1/2], 2^f by its Taylor polynomial of degree 5 (relative error below 3e-6, far
// under the sketch's own error), 2^n added to the exponent bits. x is clamped to [-87, 80]
// (no denormals; sums of 256 lanes stay finite in float32). About half the operations of Highway's
// Exp, which handles the whole range to 1 ulp.
template <class D>
HWY_INLINE hn::Vec<D> sketch_exp(D d, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  x = hn::Min(hn::Max(x, hn::Set(d, -87.0f)), hn::Set(d, 80.0f));
  const auto y = hn::Mul(x, hn::Set(d, 1.44269504088896341f));
  const auto n = hn::Round(y);
  const auto f = hn::Sub(y, n);
  // 2^f = e^(f ln 2): coefficients (ln 2)^k / k!
  auto p = hn::Set(d, 1.3333558146428443e-3f);
  p = hn::MulAdd(p, f, hn::Set(d, 9.6181291076284772e-3f));
  p = hn::MulAdd(p, f, hn::Set(d, 5.5504108664821580e-2f));
  p = hn::MulAdd(p, f, hn::Set(d, 2.4022650695910071e-1f));
  p = hn::MulAdd(p, f, hn::Set(d, 6.9314718055994531e-1f));
  p = hn::MulAdd(p, f, hn::Set(d, 1.0f));
  const auto e = hn::ShiftLeft<23>(hn::ConvertTo(di, n));
  return hn::BitCast(d, hn::Add(hn::BitCast(di, p), e));
}

// Estimates of every token of [t0, t1) for a tile of G queries (sq, qw: the tile's).
// scores: [G][stride], token t at t - t0; top: [G] largest estimate over the range.
// kWeights: scores get exp(scale est - shift[j]) instead (sketch_exp), sum [G] their sums
// and top [G] the largest scale est - shift[j].
template <int G, bool kWeights>
CUMULUS_SKETCH_ATTR void sketch_tile(const KeySketchView& s, const SketchQuery* sq, const int32_t* qw, int t0, int t1,
                                     float* scores, size_t stride, float* top, float scale, const float* shift,
                                     double* sum) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const size_t N = hn::Lanes(df);
  const int n_chunks = s.head_dim / 8;
  const size_t block_bytes = key_sketch_block_bytes(s.head_dim);
  constexpr int kB = 1;  // blocks per step (two interleaved streams defeated the hardware prefetcher)
  HWY_ALIGN float dot[kB * G * kSketchBlock];
  HWY_ALIGN float est[G * kSketchBlock];
  // The affine terms and the running maxima stay in memory: held in registers across the
  // dot-product loop they pushed its accumulators out to the stack.
  // In weights mode the affine terms carry the scale and the shift: x = scale est - shift.
  float base[G], qsum[G], qstep[G];
  HWY_ALIGN float best[G * hn::MaxLanes(df)];
  HWY_ALIGN float acc[G * hn::MaxLanes(df)];  // weight sums of the current chunk of blocks
  for (int j = 0; j < G; ++j) {
    const double sc = kWeights ? scale : 1.0;
    base[j] = static_cast<float>(sc * sq[j].base - (kWeights ? shift[j] : 0.0f));
    qsum[j] = static_cast<float>(sc * sq[j].qsum);
    qstep[j] = static_cast<float>(sc * sq[j].qstep);
    hn::Store(hn::Set(df, -std::numeric_limits<float>::infinity()), df, best + j * N);
    hn::Store(hn::Zero(df), df, acc + j * N);
    if (kWeights) sum[j] = 0;
  }
  // est = base + offset qsum + step qstep dot for B blocks from token t (len valid tokens).
  auto finish = [&](int t, int nb, int len) HWY_ATTR {
    for (int b = 0; b < nb; ++b) {
      const int tb = t + b * kSketchBlock;
      const int valid = std::min(kSketchBlock, len - b * kSketchBlock);
      for (size_t i = 0; i < static_cast<size_t>(kSketchBlock); i += N) {
        // The tokens' offsets and steps once for every query of the tile.
        const auto off = hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(s.offset + tb + i)));
        const auto stp = hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(s.step + tb + i)));
        const auto keep = hn::FirstN(df, static_cast<size_t>(valid) > i ? static_cast<size_t>(valid) - i : 0);
        for (int j = 0; j < G; ++j) {
          float* out = scores + static_cast<size_t>(j) * stride + (tb - t0);
          const auto e =
              hn::MulAdd(hn::Mul(stp, hn::Set(df, qstep[j])), hn::LoadU(df, dot + (b * G + j) * kSketchBlock + i),
                         hn::MulAdd(off, hn::Set(df, qsum[j]), hn::Set(df, base[j])));
          const auto bj = hn::Load(df, best + j * N);
          hn::Store(hn::Max(bj, hn::IfThenElse(keep, e, bj)), df, best + j * N);
          auto r = e;
          if constexpr (kWeights) {
            r = sketch_exp(df, e);
            hn::Store(hn::Add(hn::Load(df, acc + j * N), hn::IfThenElseZero(keep, r)), df, acc + j * N);
          }
          if (valid == kSketchBlock) {
            hn::StoreU(r, df, out + i);
          } else {  // a partial last block: only the valid lanes reach scores
            hn::StoreU(r, df, est + static_cast<size_t>(j) * kSketchBlock + i);
          }
        }
      }
      if (valid < kSketchBlock)
        for (int j = 0; j < G; ++j)
          std::memcpy(scores + static_cast<size_t>(j) * stride + (tb - t0), est + static_cast<size_t>(j) * kSketchBlock,
                      sizeof(float) * static_cast<size_t>(valid));
    }
  };
  // The weight sums: float32 lanes for 16 blocks, then float64.
  auto flush = [&]() HWY_ATTR {
    if constexpr (kWeights) {
      for (int j = 0; j < G; ++j) {
        sum[j] += hn::GetLane(hn::SumOfLanes(df, hn::Load(df, acc + j * N)));
        hn::Store(hn::Zero(df), df, acc + j * N);
      }
    }
  };
  // The codes about 8 KB on, into L2 (prefetch.h): the dot products keep the core busy
  // enough that the hardware prefetcher alone let the scan fall to a third of the
  // bandwidth a plain read reaches.
  // About 8 KB ahead: 8 blocks at head_dim 128, 16 at 64, 4 at 256.
  const int kAhead = std::max(4, static_cast<int>(8192 / block_bytes));
  auto prefetch = [&](int t_next) {
    if (t_next >= t1) return;
    const char* p = reinterpret_cast<const char*>(s.codes + static_cast<size_t>(t_next / kSketchBlock) * block_bytes);
    for (size_t off = 0; off < block_bytes; off += 64) prefetch_l2(p + off);
    if ((t_next / kSketchBlock) % 2 == 0) {  // 32 tokens of offsets and steps: one line each
      prefetch_l2(s.offset + t_next);
      prefetch_l2(s.step + t_next);
    }
  };
  int t = t0;
  for (int b = 0; b < kAhead; ++b) prefetch(t0 + b * kSketchBlock);
  for (; t + kB * kSketchBlock <= t1; t += kB * kSketchBlock) {
    for (int b = 0; b < kB; ++b) prefetch(t + (kAhead + b) * kSketchBlock);
    sketch_block_dots<G, kB>(s.codes + static_cast<size_t>(t / kSketchBlock) * block_bytes, block_bytes, n_chunks, qw,
                             dot);
    finish(t, kB, kB * kSketchBlock);
    if ((t / kSketchBlock) % 16 == 15) flush();
  }
  for (; t < t1; t += kSketchBlock) {
    sketch_block_dots<G, 1>(s.codes + static_cast<size_t>(t / kSketchBlock) * block_bytes, block_bytes, n_chunks, qw,
                            dot);
    finish(t, 1, std::min(kSketchBlock, t1 - t));
  }
  flush();
  for (int j = 0; j < G; ++j) top[j] = hn::GetLane(hn::MaxOfLanes(df, hn::Load(df, best + j * N)));
}

// Both ops: weights = false gives key_sketch_score, true key_sketch_weights.
template <bool kWeights>
CUMULUS_SKETCH_ATTR void key_sketch_run(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float* scores,
                                        size_t n, float* top, float scale, const float* shift, double* sum) {
  const int d = s.head_dim;
  const int n_chunks = d / 8;
  // Per query: the int8 query as packed words, tile by tile ([c][j][lo, hi] within a
  // tile), and the affine terms.
  thread_local std::vector<int32_t> qw;
  thread_local std::vector<int8_t> q8;
  thread_local std::vector<SketchQuery> sq;
  thread_local std::vector<float> tops;
  qw.resize(static_cast<size_t>(n_q) * n_chunks * 2);
  q8.resize(static_cast<size_t>(d));
  sq.resize(static_cast<size_t>(n_q));
  tops.resize(static_cast<size_t>(n_q));
  for (int j0 = 0; j0 < n_q; j0 += kSketchTile) {
    const int G = std::min(kSketchTile, n_q - j0);
    int32_t* w = qw.data() + static_cast<size_t>(j0) * n_chunks * 2;
    for (int j = 0; j < G; ++j) {
      sq[j0 + j] = key_sketch_quantize_query(s, q + static_cast<size_t>(j0 + j) * d, q8.data());
      for (int c = 0; c < n_chunks; ++c) {
        std::memcpy(&w[(static_cast<size_t>(c) * G + j) * 2], q8.data() + 8 * c, 4);
        std::memcpy(&w[(static_cast<size_t>(c) * G + j) * 2 + 1], q8.data() + 8 * c + 4, 4);
      }
    }
  }
  for (int j0 = 0; j0 < n_q; j0 += kSketchTile) {
    const int G = std::min(kSketchTile, n_q - j0);
    const int32_t* w = qw.data() + static_cast<size_t>(j0) * n_chunks * 2;
    float* out = scores + static_cast<size_t>(j0) * n;
    const SketchQuery* a = sq.data() + j0;
    float* tp = tops.data() + j0;
    const float* sh = kWeights ? shift + j0 : nullptr;
    double* sm = kWeights ? sum + j0 : nullptr;
    switch (G) {
      case 8: sketch_tile<8, kWeights>(s, a, w, t0, t1, out, n, tp, scale, sh, sm); break;
      case 7: sketch_tile<7, kWeights>(s, a, w, t0, t1, out, n, tp, scale, sh, sm); break;
      case 6: sketch_tile<6, kWeights>(s, a, w, t0, t1, out, n, tp, scale, sh, sm); break;
      case 5: sketch_tile<5, kWeights>(s, a, w, t0, t1, out, n, tp, scale, sh, sm); break;
      case 4: sketch_tile<4, kWeights>(s, a, w, t0, t1, out, n, tp, scale, sh, sm); break;
      case 3: sketch_tile<3, kWeights>(s, a, w, t0, t1, out, n, tp, scale, sh, sm); break;
      case 2: sketch_tile<2, kWeights>(s, a, w, t0, t1, out, n, tp, scale, sh, sm); break;
      default: sketch_tile<1, kWeights>(s, a, w, t0, t1, out, n, tp, scale, sh, sm); break;
    }
  }
  if (top != nullptr) std::copy(tops.begin(), tops.end(), top);
}

CUMULUS_SKETCH_ATTR void key_sketch_score_impl(const KeySketchView& s, const float* q, int n_q, int t0, int t1,
                                               float* scores, float* top) {
  key_sketch_run<false>(s, q, n_q, t0, t1, scores, static_cast<size_t>(t1 - t0), top, 1.0f, nullptr, nullptr);
}

CUMULUS_SKETCH_ATTR void key_sketch_weights_impl(const KeySketchView& s, const float* q, int n_q, int t0, int t1,
                                                 float scale, const float* shift, float* w, size_t stride,
                                                 double* sum, float* top) {
  key_sketch_run<true>(s, q, n_q, t0, t1, w, stride, top, scale, shift, sum);
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(key_sketch_score_impl);
HWY_EXPORT(key_sketch_weights_impl);

void key_sketch_score(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float* scores, float* top) {
  key_sketch_score_validate("key_sketch_score", s, q, n_q, t0, t1, scores);
  if (t1 > t0) {
    HWY_DYNAMIC_DISPATCH(key_sketch_score_impl)(s, q, n_q, t0, t1, scores, top);
  } else if (top != nullptr) {
    std::fill_n(top, n_q, -std::numeric_limits<float>::infinity());  // no tokens
  }
}

void key_sketch_weights(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float scale,
                        const float* shift, float* w, size_t stride, double* sum, float* top) {
  key_sketch_weights_validate("key_sketch_weights", s, q, n_q, t0, t1, shift, w, stride, sum, top);
  if (t1 > t0) {
    HWY_DYNAMIC_DISPATCH(key_sketch_weights_impl)(s, q, n_q, t0, t1, scale, shift, w, stride, sum, top);
  } else {
    for (int j = 0; j < n_q; ++j) sum[j] = 0, top[j] = -std::numeric_limits<float>::infinity();
  }
}

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
