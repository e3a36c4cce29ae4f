// The key sketch's estimate on the CPU (Highway, runtime dispatch), the same contract as
// src/kernels/ref/sketch.cpp: tokens sit in 32-bit lanes, 16 to a block, so one 64-byte
// chunk of a block is 16 tokens x 8 dims of nibbles.
//   - AVX-512 with VNNI (Highway's AVX3_DL target, which this file alone is compiled for:
//     CMakeLists.txt): the low and high nibbles of a chunk are two u8 vectors, each lane
//     holding 4 dims of one token, and dpbusd multiplies them by the query's 4 int8 values
//     and adds into the lane: 2 instructions per query per chunk, for 16 tokens x 8 dims.
//   - Every other target: each dim's nibble is shifted out of the lane, converted to float
//     and multiplied by the query's int8 value as float (exact: the sums stay below 2^24),
//     so the integer dot product is the same number on every target.
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

// The integer dot products q8_j . u_t of the 16 tokens of one block for queries [0, G):
// dot[j][16].
template <int G>
CUMULUS_SKETCH_ATTR HWY_INLINE void sketch_block_dots(const uint8_t* HWY_RESTRICT block, int n_chunks, const int32_t* HWY_RESTRICT qlo,
                                  const int32_t* HWY_RESTRICT qhi, float* HWY_RESTRICT dot) {
#if HWY_TARGET == HWY_AVX3_DL
  // qlo[j * n_chunks + c]: q8 of dims 8c..8c+3 of query j as one int32 (byte b = dim 8c+b);
  // qhi: dims 8c+4..8c+7.
  const hn::Full512<int32_t> di;
  const hn::Full512<uint8_t> du8;
  const hn::Full512<float> df;
  const auto low4 = hn::Set(du8, 0x0F);
  hn::Vec<decltype(di)> acc[G];
  for (int j = 0; j < G; ++j) acc[j] = hn::Zero(di);
  for (int c = 0; c < n_chunks; ++c) {
    const auto v = hn::LoadU(du8, block + static_cast<size_t>(c) * 64);
    const auto lo = hn::And(v, low4);
    // x86 has no 8-bit shift: shift 16-bit lanes, then keep each byte's low nibble.
    const auto hi = hn::And(hn::BitCast(du8, hn::ShiftRight<4>(hn::BitCast(hn::Full512<uint16_t>(), v))), low4);
    for (int j = 0; j < G; ++j) {
      acc[j].raw = sketch_dpbusd(acc[j].raw, lo.raw, _mm512_set1_epi32(qlo[j * n_chunks + c]));
      acc[j].raw = sketch_dpbusd(acc[j].raw, hi.raw, _mm512_set1_epi32(qhi[j * n_chunks + c]));
    }
  }
  for (int j = 0; j < G; ++j) hn::StoreU(hn::ConvertTo(df, acc[j]), df, dot + j * kSketchBlock);
#else
  // q8 as float: qlo/qhi reinterpreted, 4 int8 each. Lanes of N tokens, 16 / N parts.
  const hn::ScalableTag<uint32_t> du;
  const hn::Rebind<float, decltype(du)> df;
  const hn::Rebind<int32_t, decltype(du)> di;
  const size_t N = hn::Lanes(du);
  const auto low4 = hn::Set(du, 0x0Fu);
  for (size_t part = 0; part < static_cast<size_t>(kSketchBlock); part += N) {
    hn::Vec<decltype(df)> acc[G];
    for (int j = 0; j < G; ++j) acc[j] = hn::Zero(df);
    for (int c = 0; c < n_chunks; ++c) {
      const auto v = hn::LoadU(du, reinterpret_cast<const uint32_t*>(block + static_cast<size_t>(c) * 64) + part);
      for (int b = 0; b < 8; ++b) {
        // Dim 8c + b: byte b % 4 of the lane, low nibble for b < 4.
        const int shift = 8 * (b % 4) + 4 * (b / 4);
        const auto u = hn::ConvertTo(df, hn::BitCast(di, hn::And(hn::ShiftRightSame(v, shift), low4)));
        for (int j = 0; j < G; ++j) {
          const int32_t word = (b < 4 ? qlo : qhi)[j * n_chunks + c];
          const auto q = static_cast<float>(static_cast<int8_t>(static_cast<uint32_t>(word) >> (8 * (b % 4))));
          acc[j] = hn::MulAdd(u, hn::Set(df, q), acc[j]);
        }
      }
    }
    for (int j = 0; j < G; ++j) hn::StoreU(acc[j], df, dot + j * kSketchBlock + part);
  }
#endif
}

CUMULUS_SKETCH_ATTR void key_sketch_score_impl(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float* scores,
                                               float* top) {
  const int d = s.head_dim;
  const int n_chunks = d / 8;
  const int n = t1 - t0;
  const size_t block_bytes = key_sketch_block_bytes(d);
  // Per query: the int8 query as packed words, and the affine terms.
  thread_local std::vector<int32_t> qlo, qhi;
  thread_local std::vector<int8_t> q8;
  thread_local std::vector<SketchQuery> sq;
  qlo.resize(static_cast<size_t>(n_q) * n_chunks);
  qhi.resize(qlo.size());
  q8.resize(static_cast<size_t>(d));
  sq.resize(static_cast<size_t>(n_q));
  for (int j = 0; j < n_q; ++j) {
    sq[j] = key_sketch_quantize_query(s, q + static_cast<size_t>(j) * d, q8.data());
    for (int c = 0; c < n_chunks; ++c) {
      std::memcpy(&qlo[static_cast<size_t>(j) * n_chunks + c], q8.data() + 8 * c, 4);
      std::memcpy(&qhi[static_cast<size_t>(j) * n_chunks + c], q8.data() + 8 * c + 4, 4);
    }
  }
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const size_t N = hn::Lanes(df);
  HWY_ALIGN float dot[kSketchTile * kSketchBlock];
  HWY_ALIGN float est[kSketchBlock];
  // Each query's largest estimate, over the valid lanes (a partial last block's padding
  // lanes are masked out).
  thread_local std::vector<float> best;  // [n_q][N]
  best.assign(static_cast<size_t>(n_q) * N, -std::numeric_limits<float>::infinity());
  for (int t = t0; t < t1; t += kSketchBlock) {
    const uint8_t* block = s.codes + static_cast<size_t>(t / kSketchBlock) * block_bytes;
    const int len = std::min(kSketchBlock, t1 - t);
    for (int j0 = 0; j0 < n_q; j0 += kSketchTile) {
      const int G = std::min(kSketchTile, n_q - j0);
      const int32_t* lo = qlo.data() + static_cast<size_t>(j0) * n_chunks;
      const int32_t* hi = qhi.data() + static_cast<size_t>(j0) * n_chunks;
      switch (G) {
        case 8: sketch_block_dots<8>(block, n_chunks, lo, hi, dot); break;
        case 7: sketch_block_dots<7>(block, n_chunks, lo, hi, dot); break;
        case 6: sketch_block_dots<6>(block, n_chunks, lo, hi, dot); break;
        case 5: sketch_block_dots<5>(block, n_chunks, lo, hi, dot); break;
        case 4: sketch_block_dots<4>(block, n_chunks, lo, hi, dot); break;
        case 3: sketch_block_dots<3>(block, n_chunks, lo, hi, dot); break;
        case 2: sketch_block_dots<2>(block, n_chunks, lo, hi, dot); break;
        default: sketch_block_dots<1>(block, n_chunks, lo, hi, dot); break;
      }
      for (int j = 0; j < G; ++j) {
        const SketchQuery& a = sq[j0 + j];
        const auto base = hn::Set(df, static_cast<float>(a.base));
        const auto qsum = hn::Set(df, static_cast<float>(a.qsum));
        const auto qstep = hn::Set(df, static_cast<float>(a.qstep));
        for (size_t i = 0; i < static_cast<size_t>(kSketchBlock); i += N) {
          const auto off = hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(s.offset + t + i)));
          const auto stp = hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(s.step + t + i)));
          const auto e = hn::MulAdd(hn::Mul(stp, qstep), hn::LoadU(df, dot + j * kSketchBlock + i),
                                    hn::MulAdd(off, qsum, base));
          hn::StoreU(e, df, est + i);
          const size_t valid = i < static_cast<size_t>(len) ? static_cast<size_t>(len) - i : 0;
          float* bj = best.data() + static_cast<size_t>(j0 + j) * N;
          const auto b = hn::LoadU(df, bj);
          hn::StoreU(hn::Max(b, hn::IfThenElse(hn::FirstN(df, valid), e, b)), df, bj);
        }
        std::memcpy(scores + static_cast<size_t>(j0 + j) * n + (t - t0), est, sizeof(float) * static_cast<size_t>(len));
      }
    }
  }
  if (top != nullptr)
    for (int j = 0; j < n_q; ++j) top[j] = hn::GetLane(hn::MaxOfLanes(df, hn::LoadU(df, best.data() + static_cast<size_t>(j) * N)));
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(key_sketch_score_impl);

void key_sketch_score(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float* scores, float* top) {
  ref::key_sketch_score(s, q, n_q, t0, t0, scores, top);  // the reference's checks, on no tokens
  CUMULUS_CHECK(t1 <= s.n_tokens, "key_sketch_score: t1={} past n_tokens={}", t1, s.n_tokens);
  if (t1 > t0) HWY_DYNAMIC_DISPATCH(key_sketch_score_impl)(s, q, n_q, t0, t1, scores, top);
}

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
