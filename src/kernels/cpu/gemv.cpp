// SIMD matrix-vector product against block-quantised weights (Highway, runtime dispatch),
// the decode-time projection of the model runtime; same contract as src/kernels/ref/gemv.cpp
// (layout and activation rounding in kernels/gemv.h). Decode is memory-bound on the
// weights once the arithmetic keeps up: keeping them in their GGUF block form (Q4_1: 5 bits
// per weight with the scales) reads ~6x fewer bytes than float32, and the inner loop must
// then spend only a few instructions per block to stay under the memory time.
//
// Per row r and block b (32 elements, weight codes c, scale d, min m; activation codes q
// with scale dx):
//   y_r = sum_b (d_b dx_b) * (sum_j c_j q_j) + sum_b m_b * (dx_b sum_j q_j)
// The inner sum is exact in int32: codes are widened to int16 (one vpmovzxbw per 16) and
// multiplied pairwise with the int16 activations, adding neighbours (vpmaddwd); per block
// that is about 12 instructions on AVX2 against about 24 for widening everything to
// float32. The block sum is converted to float once and accumulated with one FMA by
// d_b dx_b (the row's scales are converted from f16 and multiplied by dx in whole vectors
// per row). The min term (Q4_1) is one short dot product per row. Q4_0 subtracts its offset
// 8 from the codes in int16 (exact).
//
// Rows go in groups of kGroupRows sharing the activation loads (and giving four rows' FMA
// chains to interleave), except Q8_0's, which go one at a time (kGemvGroupRows); a row left
// over is computed alone by the same instruction sequence, so every row's result depends on
// nothing but that row and x.
//
// With 8-bit activation codes on AVX3_DL (AVX-512 VNNI) the same structure runs on byte dot
// products (vnni_* below): one vpdpbusd per 32 weights instead of widening and pmaddwd.
//
// Q5_0 and Q5_1 are repacked like Q4_0/Q4_1 plus a u32 of bit-4s per block, merged into
// the codes per 16 lanes (gemv_codes_q5_bit4).
//
// The verbatim formats (Q4_K, Q5_K, Q6_K) read the GGUF blocks in place, one row at a time
// (one stream, which the hardware prefetcher follows): per scale group of 16 or 32
// weights, the codes are widened to int16 and multiplied with the activation codes
// exactly as above, then converted once and accumulated by scale * dx into four
// accumulators in turn; the K-quants' sub-block scales and mins are unpacked per
// 256-weight block (four 6-bit fields per u32 operation, then 8 lanes to float32), and the
// mins' term is one dot product per row, as Q4_1's.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/gemv.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/cache_control.h>
#include <hwy/highway.h>
#if HWY_ARCH_X86
#include <immintrin.h>  // the AVX3_DL path's byte dot products
#endif

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/gemv.h"
#include "kernels/cpu/gemv_pool.h"

#ifndef CUMULUS_KERNELS_CPU_GEMV_ONCE
#define CUMULUS_KERNELS_CPU_GEMV_ONCE
namespace cumulus::cpu {
constexpr int kGroupRows = 4;
// Software prefetch distance, in row groups (see gemv_group).
constexpr int kPrefetchGroups = 2;
// Float scratch rows are padded to a multiple of 16 (the widest float vector) with zeros.
inline int gemv_pad16(int n) { return (n + 15) & ~15; }
}  // namespace cumulus::cpu
#endif

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace {

// Functions of the 8-bit (VNNI) path, on AVX3_DL: Highway's AVX3_DL target string enables
// AVX-VNNI (VEX-encoded vpdpbusd on 128/256-bit vectors), which Zen 4 lacks although it has
// AVX-512 VNNI: with both enabled the compiler emits the VEX form, an illegal instruction
// there. These functions add avx512vnni and remove avxvnni, so their byte dot products are
// EVEX-encoded. They use intrinsics only: a Highway op carries the target string with
// avxvnni and cannot be inlined into a function without it.
#undef CUMULUS_VNNI_ATTR
#if HWY_TARGET == HWY_AVX3_DL
#define CUMULUS_VNNI_ATTR __attribute__((target("avx512vnni,no-avxvnni")))
#else
#define CUMULUS_VNNI_ATTR
#endif

// int16 lanes: at most 16, so the 16 codes of a 4-bit block half fill whole vectors.
using DI16 = hn::CappedTag<int16_t, 16>;
using DI32 = hn::Repartition<int32_t, DI16>;
using DF = hn::Repartition<float, DI16>;
// Scales are converted 8 at a time: scale rows are padded to a multiple of 8 blocks.
using DS = hn::CappedTag<float, 8>;
// Plain float lanes for the activation rounding.
using DX = hn::CappedTag<float, 8>;

// n f16 values (n a multiple of 8) -> float32 times f[i] (f padded to n).
HWY_INLINE void gemv_scales(const uint16_t* src, const float* f, int n, float* dst) {
  const DS ds;
  const hn::Rebind<hwy::float16_t, DS> dh;
  const auto* s = reinterpret_cast<const hwy::float16_t*>(src);
  for (int i = 0; i < n; i += static_cast<int>(hn::Lanes(ds)))
    hn::StoreU(hn::Mul(hn::PromoteTo(ds, hn::LoadU(dh, s + i)), hn::LoadU(ds, f + i)), ds, dst + i);
}

// n f16 values (n a multiple of 8) -> float32.
HWY_INLINE void gemv_f16_to_f32(const uint16_t* src, int n, float* dst) {
  const DS ds;
  const hn::Rebind<hwy::float16_t, DS> dh;
  const auto* s = reinterpret_cast<const hwy::float16_t*>(src);
  for (int i = 0; i < n; i += static_cast<int>(hn::Lanes(ds))) hn::StoreU(hn::PromoteTo(ds, hn::LoadU(dh, s + i)), ds, dst + i);
}

// Codes [j, j + L) of a Q8_0 block as int16.
HWY_INLINE hn::Vec<DI16> gemv_codes_q8(DI16 di16, const uint8_t* qs, size_t j) {
  const hn::Rebind<int8_t, DI16> di8;
  return hn::PromoteTo(di16, hn::LoadU(di8, reinterpret_cast<const int8_t*>(qs) + j));
}

template <QuantFormat F>
constexpr bool kHasMin = F == QuantFormat::q4_1 || F == QuantFormat::q5_1;
template <QuantFormat F>
constexpr bool kIsQ5 = F == QuantFormat::q5_0 || F == QuantFormat::q5_1;

// bit i of lane i (as int16), for testing one bit of a u16 per lane.
alignas(32) constexpr int16_t kLaneBit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                              static_cast<int16_t>(-32768)};

// Codes [j, j + L) (low nibbles) and [16 + j, 16 + j + L) (high nibbles) of a 4-bit block
// as int16, offset by -8 for Q4_0 (the low 4 bits of a Q5_x block, without offset).
template <QuantFormat F>
HWY_INLINE void gemv_codes_q4(DI16 di16, const uint8_t* qs, size_t j, hn::Vec<DI16>& lo, hn::Vec<DI16>& hi) {
  // Widen the bytes first (one vpmovzxbw with a memory operand), then split the nibbles
  // in 16-bit lanes: x86 has no 8-bit shift, so splitting bytes costs two more ops.
  const hn::Rebind<uint8_t, DI16> du8;
  const auto v = hn::PromoteTo(di16, hn::LoadU(du8, qs + j));
  lo = hn::And(v, hn::Set(di16, 0x0F));
  hi = hn::ShiftRight<4>(v);
  if constexpr (F == QuantFormat::q4_0) {
    lo = hn::Sub(lo, hn::Set(di16, 8));
    hi = hn::Sub(hi, hn::Set(di16, 8));
  }
}

// Q5_0/Q5_1: bit 4 of elements [j, j + L) and [16 + j, 16 + j + L) (bits of the block's
// u32 qh) merged into the low-4-bit codes. On AVX-512 the bits are the lane mask itself (a
// k-register move); elsewhere a lane's bit is tested against its own bit of a broadcast
// u16 (3 ops per vector). Then Q5_0 subtracts its offset 16 (exact in int16).
template <QuantFormat F>
HWY_INLINE void gemv_codes_q5_bit4(DI16 di16, uint32_t qh, size_t j, hn::Vec<DI16>& lo, hn::Vec<DI16>& hi) {
  const auto sixteen = hn::Set(di16, 16);
#if HWY_TARGET <= HWY_AVX3
  static_assert(hn::MaxLanes(DI16()) % 8 == 0, "mask bits start on a byte");
  uint8_t bytes[16] = {};  // LoadMaskBits may read 8 bytes
  std::memcpy(bytes, &qh, 4);
  const auto m_lo = hn::LoadMaskBits(di16, bytes + j / 8);
  const auto m_hi = hn::LoadMaskBits(di16, bytes + (16 + j) / 8);
#else
  const auto bits = hn::LoadU(di16, kLaneBit);
  const auto m_lo = hn::TestBit(hn::Set(di16, static_cast<int16_t>(static_cast<uint16_t>(qh >> j))), bits);
  const auto m_hi = hn::TestBit(hn::Set(di16, static_cast<int16_t>(static_cast<uint16_t>(qh >> (16 + j)))), bits);
#endif
  lo = hn::Or(lo, hn::IfThenElseZero(m_lo, sixteen));
  hi = hn::Or(hi, hn::IfThenElseZero(m_hi, sixteen));
  if constexpr (F == QuantFormat::q5_0) {
    lo = hn::Sub(lo, sixteen);
    hi = hn::Sub(hi, sixteen);
  }
}

// y[0..R) = rows [r0, r0 + R) of W times x. scr: float scratch of 2 * R * pad16(stride)
// whose entries past the scale stride are zero.
template <QuantFormat F, int R>
HWY_INLINE void gemv_group(const QuantMatrixView& w, int r0, const QuantActivation& x, float* HWY_RESTRICT scr,
                           float* HWY_RESTRICT y) {
  const DI16 di16;
  const DI32 di32;
  const DF df;
  constexpr size_t L = hn::MaxLanes(DI16());
  constexpr int kXv = kQuantBlock / static_cast<int>(L);
  const int nb = w.cols / kQuantBlock;
  const int stride = quant_scale_stride(w.cols);
  const int ss = gemv_pad16(stride);
  const size_t qb = static_cast<size_t>(quant_block_bytes(F));
  float* dscr = scr;                               // [R][ss] d_b dx_b
  float* mscr = scr + static_cast<size_t>(R) * ss;  // [R][ss] m_b
  for (int r = 0; r < R; ++r) {
    gemv_scales(w.d + static_cast<size_t>(r0 + r) * stride, x.d.data(), stride, dscr + static_cast<size_t>(r) * ss);
    if constexpr (kHasMin<F>)
      gemv_f16_to_f32(w.m + static_cast<size_t>(r0 + r) * stride, stride, mscr + static_cast<size_t>(r) * ss);
  }
  hn::Vec<DF> acc[R];
  for (int r = 0; r < R; ++r) acc[r] = hn::Zero(df);
  const size_t row_bytes = static_cast<size_t>(nb) * qb;
  const uint8_t* q0 = w.qs + static_cast<size_t>(r0) * row_bytes;
  // A group's R rows are R streams, prefetched below; one row alone is one stream, left to
  // the hardware prefetcher.
  const bool prefetch = R > 1 && r0 + (kPrefetchGroups + 1) * R <= w.rows;  // stay inside the matrix
  const int16_t* xq = x.q.data();
  for (int b = 0; b < nb; ++b) {
    // The R rows are R streams row_bytes apart, which the hardware prefetcher follows
    // poorly once rows are long: one core read 576x1536 Q4_1 at 6 GB/s and Q8_0 rows of
    // 576 B at 8.5 GB/s, against 14 GB/s for the 288 B rows of 1536x576. Touching, once per
    // cache line, the same place in the rows kPrefetchGroups groups ahead brought both to
    // 12-14 GB/s (single thread, weights streamed from memory).
    if (prefetch && (static_cast<size_t>(b) * qb) % 64 == 0)
      for (int r = 0; r < R; ++r)
        hwy::Prefetch(q0 + static_cast<size_t>(kPrefetchGroups * R + r) * row_bytes + static_cast<size_t>(b) * qb);
    if constexpr (kIsQ5<F>)  // the bit-4 words: one more stream per row, 4 bytes per block
      if (prefetch && b % 16 == 0)
        for (int r = 0; r < R; ++r) hwy::Prefetch(w.qh + static_cast<size_t>(r0 + kPrefetchGroups * R + r) * nb + b);
    hn::Vec<DI16> xv[kXv];
    for (int i = 0; i < kXv; ++i) xv[i] = hn::LoadU(di16, xq + static_cast<size_t>(b) * kQuantBlock + static_cast<size_t>(i) * L);
    for (int r = 0; r < R; ++r) {
      const uint8_t* qs = q0 + static_cast<size_t>(r) * row_bytes + static_cast<size_t>(b) * qb;
      auto s0 = hn::Zero(di32), s1 = hn::Zero(di32);
      if constexpr (F == QuantFormat::q8_0) {
        for (size_t j = 0; j < kQuantBlock; j += L)
          s0 = hn::ReorderWidenMulAccumulate(di32, gemv_codes_q8(di16, qs, j), xv[j / L], s0, s1);
      } else {
        for (size_t j = 0; j < 16; j += L) {
          hn::Vec<DI16> lo, hi;
          gemv_codes_q4<F>(di16, qs, j, lo, hi);
          if constexpr (kIsQ5<F>) gemv_codes_q5_bit4<F>(di16, w.qh[static_cast<size_t>(r0 + r) * nb + b], j, lo, hi);
          s0 = hn::ReorderWidenMulAccumulate(di32, lo, xv[j / L], s0, s1);
          s0 = hn::ReorderWidenMulAccumulate(di32, hi, xv[(16 + j) / L], s0, s1);
        }
      }
      acc[r] = hn::MulAdd(hn::ConvertTo(df, hn::Add(s0, s1)), hn::Set(df, dscr[static_cast<size_t>(r) * ss + b]), acc[r]);
    }
  }
  constexpr size_t N = hn::MaxLanes(DF());
  for (int r = 0; r < R; ++r) {
    if constexpr (kHasMin<F>) {
      // Entries past nb are zero in both arrays (zero f16 padding, zero activation padding).
      const float* m = mscr + static_cast<size_t>(r) * ss;
      auto t = hn::Zero(df);
      for (int i = 0; i < ss; i += static_cast<int>(N)) t = hn::MulAdd(hn::LoadU(df, m + i), hn::LoadU(df, x.sum.data() + i), t);
      acc[r] = hn::Add(acc[r], t);
    }
    y[r] = hn::GetLane(hn::SumOfLanes(df, acc[r]));
  }
}

// Rows per group. Q8_0 goes one row at a time: its rows are twice the bytes of the 4-bit
// formats', and Gemma 3's 262144x640 head read at 20-22 GB/s one row at a time (a single
// stream, which the hardware prefetcher follows; weights in 2 MiB pages) against ~10 GB/s in
// groups of 2 to 8 with the prefetch in gemv_group (Zen 4; docs/lab/performance-log.md,
// 2026-11-26). For the 4-bit formats the two orders measured within noise, and they keep the
// groups (which share the activation loads). The 8-bit path below uses the same choice.
template <QuantFormat F>
constexpr int kGemvGroupRows = F == QuantFormat::q8_0 ? 1 : kGroupRows;

template <QuantFormat F>
void gemv_rows_format(const QuantMatrixView& w, int row_begin, int row_end, const QuantActivation& x, float* y) {
  constexpr int kR = kGemvGroupRows<F>;
  const int ss = gemv_pad16(quant_scale_stride(w.cols));
  // Per-thread scratch inside a pool task, sized by the matrix's columns alone (a row
  // group's scales, a few KB at any model width, never by the context): it stays
  // thread_local, as do dm and mins below (docs/architecture.md, "Embedding").
  thread_local std::vector<float> scr;
  const size_t need = static_cast<size_t>(2 * kR * ss);
  if (scr.size() < need) scr.resize(need);
  // Scratch past the scale stride stays zero (only [0, stride) of each row is written).
  std::fill(scr.begin(), scr.begin() + static_cast<std::ptrdiff_t>(need), 0.0f);
  int r = row_begin;
  for (; r + kR <= row_end; r += kR) gemv_group<F, kR>(w, r, x, scr.data(), y + (r - row_begin));
  for (; r < row_end; ++r) gemv_group<F, 1>(w, r, x, scr.data(), y + (r - row_begin));
}

// Dequantisation (prefill): codes widened straight to float32 lanes.
using DD = hn::CappedTag<float, 16>;

// Codes [j, j + N) of a block as float32: Q8_0 int8, or the low (hi = false) or high
// nibbles of a 4-bit block, offset by -8 for Q4_0.
template <QuantFormat F>
HWY_INLINE hn::Vec<DD> dequant_codes(DD dd, const uint8_t* qs, size_t j, bool hi) {
  const hn::Rebind<int32_t, DD> d32;
  if constexpr (F == QuantFormat::q8_0) {
    const hn::Rebind<int8_t, DD> di8;
    return hn::ConvertTo(dd, hn::PromoteTo(d32, hn::LoadU(di8, reinterpret_cast<const int8_t*>(qs) + j)));
  } else {
    const hn::Rebind<uint8_t, DD> du8;
    const auto v = hn::LoadU(du8, qs + j);
    auto c = hn::PromoteTo(d32, hi ? hn::ShiftRight<4>(v) : hn::And(v, hn::Set(du8, 0x0F)));
    if constexpr (F == QuantFormat::q4_0) c = hn::Sub(c, hn::Set(d32, 8));
    return hn::ConvertTo(dd, c);
  }
}

template <QuantFormat F>
void dequantize_rows_format(const QuantMatrixView& w, int row_begin, int row_end, float* out) {
  const DD dd;
  constexpr size_t N = hn::MaxLanes(DD());
  const int nb = w.cols / kQuantBlock;
  const int stride = quant_scale_stride(w.cols);
  const size_t qb = static_cast<size_t>(quant_block_bytes(F));
  thread_local std::vector<float> dm;
  if (dm.size() < 2 * static_cast<size_t>(stride)) dm.resize(2 * static_cast<size_t>(stride));
  for (int r = row_begin; r < row_end; ++r) {
    gemv_f16_to_f32(w.d + static_cast<size_t>(r) * stride, stride, dm.data());
    if constexpr (kHasMin<F>) gemv_f16_to_f32(w.m + static_cast<size_t>(r) * stride, stride, dm.data() + stride);
    float* o = out + static_cast<size_t>(r - row_begin) * w.cols;
    for (int b = 0; b < nb; ++b) {
      const uint8_t* qs = w.qs + (static_cast<size_t>(r) * nb + b) * qb;
      const auto d = hn::Set(dd, dm[static_cast<size_t>(b)]);
      const auto m = hn::Set(dd, kHasMin<F> ? dm[static_cast<size_t>(stride + b)] : 0.0f);
      float* ob = o + static_cast<size_t>(b) * kQuantBlock;
      if constexpr (F == QuantFormat::q8_0) {
        for (size_t j = 0; j < kQuantBlock; j += N) hn::StoreU(hn::MulAdd(dequant_codes<F>(dd, qs, j, false), d, m), dd, ob + j);
      } else if constexpr (kIsQ5<F>) {
        // The GEMV's int16 codes, stored and widened to float32.
        const DI16 di16;
        constexpr size_t L = hn::MaxLanes(DI16());
        const hn::Rebind<int16_t, DD> d16;
        const hn::Rebind<int32_t, DD> d32;
        int16_t codes[kQuantBlock];
        for (size_t j = 0; j < 16; j += L) {
          hn::Vec<DI16> lo, hi;
          gemv_codes_q4<F>(di16, qs, j, lo, hi);
          gemv_codes_q5_bit4<F>(di16, w.qh[static_cast<size_t>(r) * nb + b], j, lo, hi);
          hn::StoreU(lo, di16, codes + j);
          hn::StoreU(hi, di16, codes + 16 + j);
        }
        for (size_t j = 0; j < kQuantBlock; j += N)
          hn::StoreU(hn::MulAdd(hn::ConvertTo(dd, hn::PromoteTo(d32, hn::LoadU(d16, codes + j))), d, m), dd, ob + j);
      } else {
        for (size_t j = 0; j < 16; j += N) {
          hn::StoreU(hn::MulAdd(dequant_codes<F>(dd, qs, j, false), d, m), dd, ob + j);
          hn::StoreU(hn::MulAdd(dequant_codes<F>(dd, qs, j, true), d, m), dd, ob + 16 + j);
        }
      }
    }
  }
}

// ---- Verbatim formats (Q4_K, Q5_K, Q6_K): the GGUF blocks read in place ----
//
// A walker decodes one block: sink.block(scale, min) first, with the block's group scales
// scale[G] (d sc, float32; G = 8 or 16 groups) and its mins min[8] per 32 weights (dmin m;
// nullptr for Q6_K), then sink.codes(c, e) with the int16 codes of elements [e, e + L) of
// the block, and sink.group(g, e0, n) after the last codes of group g = [e0, e0 + n)
// (n = 32, or 16 for Q6_K): its weights are scale[g] * code - min.
// The GEMV and the dequantiser are the two sinks, so both read the codes through the same
// instructions. Bits are split in 16-bit lanes after widening the bytes, as for Q4_x above.

// One f16 at p (unaligned) as float32, by the vector conversion (vcvtph2ps on x86).
HWY_INLINE float f16_at(const uint8_t* p) {
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<hwy::float16_t, decltype(d1)> dh1;
  return hn::GetLane(hn::PromoteTo(d1, hn::LoadU(dh1, reinterpret_cast<const hwy::float16_t*>(p))));
}

// out[i] = f * b[i] for n (a multiple of 8) integers b of type T (uint8_t or int8_t).
template <typename T>
HWY_INLINE void scale_bytes(const T* b, float f, int n, float* out) {
  const DS ds;
  const hn::Rebind<int32_t, DS> d32;
  const hn::Rebind<T, DS> d8;
  for (int i = 0; i < n; i += static_cast<int>(hn::Lanes(ds)))
    hn::StoreU(hn::Mul(hn::ConvertTo(ds, hn::PromoteTo(d32, hn::LoadU(d8, b + i))), hn::Set(ds, f)), ds, out + i);
}

// Q4_K (f16 d, f16 dmin, scales[12], qs[128]) and Q5_K (the same with qh[32] before qs):
// sub-block s (32 weights) of 64-element group s / 2 has its low 4 bits in the low (even s)
// or high (odd s) nibbles of qs[32 (s / 2) .. + 31]; Q5_K's bit 4 of its element l is bit s
// of qh[l]. The 6-bit scale sc_s and min m_s of sub-block s: s < 4 in the low 6 bits of
// bytes s and s + 4 of the 12; s >= 4 in the low and high nibbles of byte s + 4, with the top
// 2 bits in bits 6-7 of bytes s - 4 and s. Unpacked here 4 at a time in u32 words (x86 is
// little-endian, as the file is): bits 6-7 of each byte move to bits 4-5 by a shift of 2.
template <QuantFormat F, class Sink>
HWY_INLINE void walk_k45(const uint8_t* blk, Sink& sink) {
  const DI16 di16;
  const hn::Rebind<uint8_t, DI16> du8;
  constexpr size_t L = hn::MaxLanes(DI16());
  constexpr bool kFive = F == QuantFormat::q5_k;
  uint32_t w[3];
  std::memcpy(w, blk + 4, 12);
  const uint32_t packed[4] = {w[0] & 0x3F3F3F3Fu, (w[2] & 0x0F0F0F0Fu) | ((w[0] >> 2) & 0x30303030u),
                              w[1] & 0x3F3F3F3Fu, ((w[2] >> 4) & 0x0F0F0F0Fu) | ((w[1] >> 2) & 0x30303030u)};
  uint8_t sc_m[16];  // sc_0..7, m_0..7
  std::memcpy(sc_m, packed, 16);
  alignas(32) float scale[8], min[8];
  scale_bytes(sc_m, f16_at(blk), 8, scale);
  scale_bytes(sc_m + 8, f16_at(blk + 2), 8, min);
  sink.block(scale, min);
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (kFive ? 48 : 16);
  if constexpr (L == 16) {
    // Two vectors are one group of 32: the 32 bytes of a sub-block pair are loaded once for
    // both (low and high nibbles), and Q5_K's qh bytes once per block.
    const auto m4 = hn::Set(di16, 0x0F), sixteen = hn::Set(di16, 16);
    hn::Vec<DI16> h0 = hn::Zero(di16), h1 = hn::Zero(di16);
    if constexpr (kFive) {
      h0 = hn::PromoteTo(di16, hn::LoadU(du8, qh));
      h1 = hn::PromoteTo(di16, hn::LoadU(du8, qh + 16));
    }
    for (int g = 0; g < 4; ++g) {
      const uint8_t* q = qs + 32 * g;
      const auto a0 = hn::PromoteTo(di16, hn::LoadU(du8, q)), a1 = hn::PromoteTo(di16, hn::LoadU(du8, q + 16));
      auto c00 = hn::And(a0, m4), c01 = hn::And(a1, m4);                   // sub-block 2g
      auto c10 = hn::ShiftRight<4>(a0), c11 = hn::ShiftRight<4>(a1);       // sub-block 2g + 1
      if constexpr (kFive) {
        const auto b0 = hn::Set(di16, static_cast<int16_t>(1 << (2 * g)));
        const auto b1 = hn::Set(di16, static_cast<int16_t>(1 << (2 * g + 1)));
        c00 = hn::Or(c00, hn::IfThenElseZero(hn::TestBit(h0, b0), sixteen));
        c01 = hn::Or(c01, hn::IfThenElseZero(hn::TestBit(h1, b0), sixteen));
        c10 = hn::Or(c10, hn::IfThenElseZero(hn::TestBit(h0, b1), sixteen));
        c11 = hn::Or(c11, hn::IfThenElseZero(hn::TestBit(h1, b1), sixteen));
      }
      sink.codes(c00, static_cast<size_t>(64 * g));
      sink.codes(c01, static_cast<size_t>(64 * g + 16));
      sink.group(2 * g, 64 * g, 32);
      sink.codes(c10, static_cast<size_t>(64 * g + 32));
      sink.codes(c11, static_cast<size_t>(64 * g + 48));
      sink.group(2 * g + 1, 64 * g + 32, 32);
    }
    return;
  }
  for (int s = 0; s < 8; ++s) {
    const uint8_t* q = qs + 32 * (s / 2);
    for (size_t j = 0; j < 32; j += L) {
      const auto v = hn::PromoteTo(di16, hn::LoadU(du8, q + j));
      auto c = s % 2 ? hn::ShiftRight<4>(v) : hn::And(v, hn::Set(di16, 0x0F));
      if constexpr (kFive) {
        const auto h = hn::PromoteTo(di16, hn::LoadU(du8, qh + j));
        c = hn::Or(c, hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(h, s), hn::Set(di16, 1))));
      }
      sink.codes(c, static_cast<size_t>(32 * s) + j);
    }
    sink.group(s, 32 * s, 32);
  }
}

// Q6_K (ql[128], qh[64], int8 scales[16], f16 d): half h (128 weights), quarter k (32),
// element l: low 4 bits in ql[64 h + 32 (k % 2) + l] (low nibble for k < 2, high for
// k >= 2), top 2 bits at bits 2k of qh[32 h + l]; code q - 32; scale scales[8 h + 2 k + l / 16].
template <class Sink>
HWY_INLINE void walk_q6k(const uint8_t* blk, Sink& sink) {
  const DI16 di16;
  const hn::Rebind<uint8_t, DI16> du8;
  constexpr size_t L = hn::MaxLanes(DI16());
  alignas(32) float scale[16];
  scale_bytes(reinterpret_cast<const int8_t*>(blk + 192), f16_at(blk + 208), 16, scale);
  sink.block(scale, nullptr);
  if constexpr (L == 16) {
    // One vector is one group of 16: the ql and qh bytes of a half are loaded once for its
    // four quarters k, and each k's top 2 bits are moved to bits 4-5 by a fixed shift.
    const auto m4 = hn::Set(di16, 0x0F), m30 = hn::Set(di16, 0x30), c32 = hn::Set(di16, 32);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = blk + 64 * h;
      const uint8_t* qh = blk + 128 + 32 * h;
      for (size_t l16 = 0; l16 < 32; l16 += 16) {
        const auto a = hn::PromoteTo(di16, hn::LoadU(du8, ql + l16));       // k = 0 (low), 2 (high nibbles)
        const auto b = hn::PromoteTo(di16, hn::LoadU(du8, ql + 32 + l16));  // k = 1, 3
        const auto t = hn::PromoteTo(di16, hn::LoadU(du8, qh + l16));
        const hn::Vec<DI16> codes[4] = {hn::Or(hn::And(a, m4), hn::And(hn::ShiftLeft<4>(t), m30)),
                                        hn::Or(hn::And(b, m4), hn::And(hn::ShiftLeft<2>(t), m30)),
                                        hn::Or(hn::ShiftRight<4>(a), hn::And(t, m30)),
                                        hn::Or(hn::ShiftRight<4>(b), hn::And(hn::ShiftRight<2>(t), m30))};
        for (int k = 0; k < 4; ++k) {
          const int e0 = 128 * h + 32 * k + static_cast<int>(l16);
          sink.codes(hn::Sub(codes[k], c32), static_cast<size_t>(e0));
          sink.group(e0 / 16, e0, 16);
        }
      }
    }
    return;
  }
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = blk + 64 * h;
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int k = 0; k < 4; ++k) {
      for (size_t l16 = 0; l16 < 32; l16 += 16) {
        for (size_t j = l16; j < l16 + 16; j += L) {
          const auto v = hn::PromoteTo(di16, hn::LoadU(du8, ql + 32 * (k % 2) + j));
          const auto lo = k < 2 ? hn::And(v, hn::Set(di16, 0x0F)) : hn::ShiftRight<4>(v);
          const auto top = hn::And(hn::ShiftRightSame(hn::PromoteTo(di16, hn::LoadU(du8, qh + j)), 2 * k), hn::Set(di16, 3));
          sink.codes(hn::Sub(hn::Or(lo, hn::ShiftLeft<4>(top)), hn::Set(di16, 32)), static_cast<size_t>(128 * h + 32 * k) + j);
        }
        const int e0 = 128 * h + 32 * k + static_cast<int>(l16);
        sink.group(e0 / 16, e0, 16);
      }
    }
  }
}

template <QuantFormat F, class Sink>
HWY_INLINE void walk_block(const uint8_t* blk, Sink& sink) {
  if constexpr (F == QuantFormat::q4_k || F == QuantFormat::q5_k) walk_k45<F>(blk, sink);
  else walk_q6k(blk, sink);
}

constexpr bool verbatim_has_min(QuantFormat f) { return f == QuantFormat::q4_k || f == QuantFormat::q5_k; }
constexpr int kVerbatimBlock = 256;  // the K-quants' block

// GEMV sink: a group's codes against the activation codes, summed exactly in int32
// (pmaddwd), then one conversion and one FMA by scale * dx of the group's activation block,
// into four accumulators in turn (one chain would wait an FMA latency per group). The mins
// are stored per 32 weights and dotted with dx sum q once per row (as Q4_1's above).
template <QuantFormat F>
struct GemvSink {
  static constexpr int kMins = kVerbatimBlock / kQuantBlock;
  const int16_t* xq;  // the block's activation codes [block]
  const float* dx;    // its activation scales, one per 32
  float* mins;        // the row's mins at this block, one per 32
  const float* scale = nullptr;
  hn::Vec<DI32> s0, s1;
  hn::Vec<DF> acc0, acc1, acc2, acc3;
  HWY_INLINE void block(const float* sc, const float* mn) {
    scale = sc;
    if constexpr (verbatim_has_min(F))
      for (int i = 0; i < kMins; ++i) mins[i] = mn[i];
  }
  HWY_INLINE void codes(hn::Vec<DI16> c, size_t e) {
    s0 = hn::ReorderWidenMulAccumulate(DI32(), c, hn::LoadU(DI16(), xq + e), s0, s1);
  }
  HWY_INLINE void group(int g, int e0, int n) {
    const DF df;
    const auto next = hn::MulAdd(hn::ConvertTo(df, hn::Add(s0, s1)), hn::Set(df, scale[g] * dx[e0 / kQuantBlock]), acc0);
    acc0 = acc1;
    acc1 = acc2;
    acc2 = acc3;
    acc3 = next;
    s0 = hn::Zero(DI32());
    s1 = hn::Zero(DI32());
    (void)n;
  }
};

template <QuantFormat F>
void gemv_rows_verbatim(const QuantMatrixView& w, int row_begin, int row_end, const QuantActivation& x, float* y) {
  const DF df;
  constexpr int kBlock = kVerbatimBlock;
  const int nb = w.cols / kBlock;
  const size_t tb = static_cast<size_t>(quant_block_bytes(F));
  const size_t row_bytes = static_cast<size_t>(nb) * tb;
  // The row's mins [cols / 32], zero-padded like x.sum to a multiple of 16.
  const int n32 = gemv_pad16(w.cols / kQuantBlock);
  thread_local std::vector<float> mins;
  if (verbatim_has_min(F)) mins.assign(static_cast<size_t>(n32), 0.0f);
  for (int r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w.qs + static_cast<size_t>(r) * row_bytes;
    GemvSink<F> sink{nullptr, nullptr, nullptr, nullptr, hn::Zero(DI32()), hn::Zero(DI32()),
                     hn::Zero(df),    hn::Zero(df), hn::Zero(df), hn::Zero(df)};
    for (int b = 0; b < nb; ++b) {
      const size_t e = static_cast<size_t>(b) * kBlock;
      sink.xq = x.q.data() + e;
      sink.dx = x.d.data() + e / kQuantBlock;
      if constexpr (verbatim_has_min(F)) sink.mins = mins.data() + e / kQuantBlock;
      walk_block<F>(row + static_cast<size_t>(b) * tb, sink);
    }
    auto acc = hn::Add(hn::Add(sink.acc0, sink.acc1), hn::Add(sink.acc2, sink.acc3));
    if constexpr (verbatim_has_min(F)) {
      constexpr size_t N = hn::MaxLanes(DF());
      auto t = hn::Zero(df);
      for (int i = 0; i < n32; i += static_cast<int>(N))
        t = hn::MulAdd(hn::LoadU(df, mins.data() + i), hn::LoadU(df, x.sum.data() + i), t);
      acc = hn::Sub(acc, t);
    }
    y[r - row_begin] = hn::GetLane(hn::SumOfLanes(df, acc));
  }
}

// Dequantisation sink: codes to float32 in out, then scale * code - min per group.
struct DequantSink {
  float* out;  // the block's [block] outputs
  const float* scale = nullptr;
  const float* min = nullptr;
  HWY_INLINE void block(const float* sc, const float* mn) {
    scale = sc;
    min = mn;
  }
  HWY_INLINE void codes(hn::Vec<DI16> c, size_t e) {
    const DI16 di16;
    alignas(32) int16_t buf[hn::MaxLanes(DI16())];
    hn::Store(c, di16, buf);
    for (size_t i = 0; i < hn::Lanes(di16); ++i) out[e + i] = static_cast<float>(buf[i]);
  }
  HWY_INLINE void group(int g, int e0, int n) {
    const DD dd;
    const auto vs = hn::Set(dd, scale[g]), vm = hn::Set(dd, min ? min[e0 / kQuantBlock] : 0.0f);
    for (int i = e0; i < e0 + n; i += static_cast<int>(hn::Lanes(dd)))
      hn::StoreU(hn::MulSub(hn::LoadU(dd, out + i), vs, vm), dd, out + i);
  }
};

template <QuantFormat F>
void dequantize_rows_verbatim(const QuantMatrixView& w, int row_begin, int row_end, float* out) {
  constexpr int kBlock = kVerbatimBlock;
  const int nb = w.cols / kBlock;
  const size_t tb = static_cast<size_t>(quant_block_bytes(F));
  for (int r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w.qs + static_cast<size_t>(r) * nb * tb;
    for (int b = 0; b < nb; ++b) {
      DequantSink sink{out + static_cast<size_t>(r - row_begin) * w.cols + static_cast<size_t>(b) * kBlock};
      walk_block<F>(row + static_cast<size_t>(b) * tb, sink);
    }
  }
}

#if HWY_TARGET == HWY_AVX3_DL
// ---- 8-bit activations: byte dot products (AVX-512 VNNI, the AVX3_DL target) ----
//
// Highway 1.0.3 has no byte dot product, so this path is written with intrinsics on
// 256-bit vectors: one vector is one activation block of 32 codes (x.q8), in element order,
// and one vpdpbusd multiplies 32 weight codes, as unsigned bytes, by the 32 signed activation
// codes and adds each 4 neighbouring products into one of 8 int32 lanes: exact, and about
// half the instructions of the 16-bit path per weight (Zen 4 runs a 512-bit op as two
// 256-bit halves, so wider vectors would only add shuffles). Per 32 weights of a row:
//   sum_j c_j q_j = dpbusd(bias, u, q),  u = c + offset as an unsigned byte,
//   bias (lane i) = -offset * (q_4i + ... + q_4i+3)  (from x.sum4, shared by all rows)
// with offset 128 for Q8_0 (its signed codes xor 0x80), 8 for Q4_0, 16 for Q5_0 and 32 for
// Q6_K (their stored codes are already code + offset), 0 for the formats with mins (Q4_1,
// Q5_1, Q4_K, Q5_K, whose min term is a dot product with x.sum once per row, as on the 16-bit
// path). Then one conversion to float and one FMA by the group's scale times dx. The
// integer sums are those of the 16-bit path on the same codes; only the float32 order of
// the scale products differs.

template <QuantFormat F>
constexpr int kVnniOffsetShift = F == QuantFormat::q8_0   ? 7
                                 : F == QuantFormat::q4_0 ? 3
                                 : F == QuantFormat::q5_0 ? 4
                                 : F == QuantFormat::q6_k ? 5
                                                          : -1;  // no offset

CUMULUS_VNNI_ATTR HWY_INLINE __m256i vnni_dot(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }

// The bias of 32 activation codes (x.sum4 [8] at s4) for offset 2^shift.
template <int kShift>
CUMULUS_VNNI_ATTR HWY_INLINE __m256i vnni_bias(const int32_t* s4) {
  if constexpr (kShift < 0) return _mm256_setzero_si256();
  else
    return _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s4))), kShift);
}

CUMULUS_VNNI_ATTR HWY_INLINE float vnni_sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

CUMULUS_VNNI_ATTR HWY_INLINE __m256 vnni_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 32 codes of a repacked block as unsigned bytes in element order: Q8_0's int8 codes
// xor 0x80; a 4-bit block's 16 bytes in both halves, shifted right by 0 (low nibbles:
// elements 0-15) or 4 (high nibbles: 16-31) per 16-bit lane and masked; Q5_x's u32 of bit 4s
// is the byte mask of the 16 added (bit j: element j).
template <QuantFormat F>
CUMULUS_VNNI_ATTR HWY_INLINE __m256i vnni_codes(const uint8_t* qs, uint32_t qh) {
  if constexpr (F == QuantFormat::q8_0) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)), _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m256i shift = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    __m256i c = _mm256_and_si256(_mm256_srlv_epi16(v, shift), _mm256_set1_epi8(0x0F));
    if constexpr (kIsQ5<F>) c = _mm256_mask_add_epi8(c, static_cast<__mmask32>(qh), c, _mm256_set1_epi8(16));
    (void)qh;
    return c;
  }
}

// Repacked formats, rows [r0, r0 + R) (the 16-bit path's gemv_group, with byte codes).
// scr: float scratch of 2 * R * pad16(stride).
template <QuantFormat F, int R>
CUMULUS_VNNI_ATTR void vnni_group(const QuantMatrixView& w, int r0, const QuantActivation& x, float* HWY_RESTRICT scr,
                                  float* HWY_RESTRICT y) {
  const int nb = w.cols / kQuantBlock;
  const int stride = quant_scale_stride(w.cols);
  const int ss = gemv_pad16(stride);
  const size_t qb = static_cast<size_t>(quant_block_bytes(F));
  float* dscr = scr;                                // [R][ss] d_b dx_b
  float* mscr = scr + static_cast<size_t>(R) * ss;  // [R][ss] m_b
  for (int r = 0; r < R; ++r) {
    const size_t row = static_cast<size_t>(r0 + r) * stride;
    for (int i = 0; i < stride; i += 8) {
      _mm256_storeu_ps(dscr + static_cast<size_t>(r) * ss + i, _mm256_mul_ps(vnni_f16x8(w.d + row + i), _mm256_loadu_ps(x.d.data() + i)));
      if constexpr (kHasMin<F>) _mm256_storeu_ps(mscr + static_cast<size_t>(r) * ss + i, vnni_f16x8(w.m + row + i));
    }
  }
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const size_t row_bytes = static_cast<size_t>(nb) * qb;
  const uint8_t* q0 = w.qs + static_cast<size_t>(r0) * row_bytes;
  // Groups of several rows (several streams): the same prefetch as gemv_group, once per
  // cache line of each stream, kPrefetchGroups groups ahead. One row alone is one stream,
  // left to the hardware prefetcher.
  const bool prefetch = R > 1 && r0 + (kPrefetchGroups + 1) * R <= w.rows;  // stay inside the matrix
  for (int b = 0; b < nb; ++b) {
    if (prefetch && (static_cast<size_t>(b) * qb) % 64 == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(q0 + static_cast<size_t>(kPrefetchGroups * R + r) * row_bytes + static_cast<size_t>(b) * qb);
    if constexpr (kIsQ5<F>)
      if (prefetch && b % 16 == 0)
        for (int r = 0; r < R; ++r) __builtin_prefetch(w.qh + static_cast<size_t>(r0 + kPrefetchGroups * R + r) * nb + b);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q8.data() + static_cast<size_t>(b) * kQuantBlock));
    const __m256i bias = vnni_bias<kVnniOffsetShift<F>>(x.sum4.data() + static_cast<size_t>(b) * 8);
    for (int r = 0; r < R; ++r) {
      const uint8_t* qs = q0 + static_cast<size_t>(r) * row_bytes + static_cast<size_t>(b) * qb;
      const uint32_t qh = kIsQ5<F> ? w.qh[static_cast<size_t>(r0 + r) * nb + b] : 0u;
      const __m256i s = vnni_dot(bias, vnni_codes<F>(qs, qh), xv);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dscr[static_cast<size_t>(r) * ss + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (kHasMin<F>) {
      // Entries past nb are zero in both arrays (zero f16 padding, zero activation padding).
      const float* m = mscr + static_cast<size_t>(r) * ss;
      __m256 t = _mm256_setzero_ps();
      for (int i = 0; i < ss; i += 8) t = _mm256_fmadd_ps(_mm256_loadu_ps(m + i), _mm256_loadu_ps(x.sum.data() + i), t);
      acc[r] = _mm256_add_ps(acc[r], t);
    }
    y[r] = vnni_sum8(acc[r]);
  }
}

template <QuantFormat F>
CUMULUS_VNNI_ATTR void vnni_rows_repacked(const QuantMatrixView& w, int row_begin, int row_end, const QuantActivation& x, float* y) {
  constexpr int kR = kGemvGroupRows<F>;  // as on the 16-bit path
  const int ss = gemv_pad16(quant_scale_stride(w.cols));
  thread_local std::vector<float> scr;
  const size_t need = static_cast<size_t>(2 * kR * ss);
  if (scr.size() < need) scr.resize(need);
  std::fill(scr.begin(), scr.begin() + static_cast<std::ptrdiff_t>(need), 0.0f);
  int r = row_begin;
  for (; r + kR <= row_end; r += kR) vnni_group<F, kR>(w, r, x, scr.data(), y + (r - row_begin));
  for (; r < row_end; ++r) vnni_group<F, 1>(w, r, x, scr.data(), y + (r - row_begin));
}

// Q4_K and Q5_K, one 256-weight block (layout at walk_k45): sub-blocks 2g and 2g + 1 are the
// low and high nibbles of the same 32 bytes, each against its 32 activation codes in element
// order; Q5_K's bit 4 of sub-block s is bit s of the 32 qh bytes (a byte mask). acc0 and acc1
// take the even and odd sub-blocks, macc the mins (dmin m_s) times dx_s sum q_s.
template <QuantFormat F>
CUMULUS_VNNI_ATTR HWY_INLINE void vnni_block_k45(const uint8_t* blk, const int8_t* xq, const float* dx, const float* xsum,
                                                 __m256& acc0, __m256& acc1, __m256& macc) {
  constexpr bool kFive = F == QuantFormat::q5_k;
  uint32_t wd[3];
  std::memcpy(wd, blk + 4, 12);
  const uint32_t packed[4] = {wd[0] & 0x3F3F3F3Fu, (wd[2] & 0x0F0F0F0Fu) | ((wd[0] >> 2) & 0x30303030u),
                              wd[1] & 0x3F3F3F3Fu, ((wd[2] >> 4) & 0x0F0F0F0Fu) | ((wd[1] >> 2) & 0x30303030u)};
  __m128i sc_m;  // sc_0..7, m_0..7
  std::memcpy(&sc_m, packed, 16);
  const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(blk[0] | blk[1] << 8))));
  const __m256 dmin = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(blk[2] | blk[3] << 8))));
  alignas(32) float scale[8];  // d sc_s dx_s
  _mm256_store_ps(scale, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc_m)), d), _mm256_loadu_ps(dx)));
  const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc_m, 8))), dmin);
  macc = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsum), macc);
  const uint8_t* qs = blk + (kFive ? 48 : 16);
  const __m256i m4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
  __m256i h = _mm256_setzero_si256();
  if constexpr (kFive) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
  for (int g = 0; g < 4; ++g) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g));
    __m256i lo = _mm256_and_si256(a, m4), hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
    if constexpr (kFive) {
      lo = _mm256_mask_add_epi8(lo, _mm256_test_epi8_mask(h, _mm256_set1_epi8(static_cast<char>(1 << (2 * g)))), lo, sixteen);
      hi = _mm256_mask_add_epi8(hi, _mm256_test_epi8_mask(h, _mm256_set1_epi8(static_cast<char>(1 << (2 * g + 1)))), hi, sixteen);
    }
    const __m256i s0 = vnni_dot(_mm256_setzero_si256(), lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * g)));
    const __m256i s1 = vnni_dot(_mm256_setzero_si256(), hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * g + 32)));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(scale[2 * g]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(scale[2 * g + 1]), acc1);
  }
}

// Q6_K, one 256-weight block (layout at walk_q6k): quarter k of half h (32 weights, one
// activation block, two scale groups of 16) is the low (k < 2) or high nibbles of
// ql[64 h + 32 (k % 2) + l] with bits 2k, 2k + 1 of qh[32 h + l] on top, offset 32. A vpdpbusd
// lane covers 4 weights of one group: lanes 0-3 take group 2k of the half, 4-7 group 2k + 1,
// so their scales (d sc_g dx) are permuted into that pattern from the half's 8.
CUMULUS_VNNI_ATTR HWY_INLINE void vnni_block_q6k(const uint8_t* blk, const int8_t* xq, const float* dx, const int32_t* s4,
                                                 __m256& acc0, __m256& acc1) {
  const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(blk[208] | blk[209] << 8))));
  const __m256 dxv = _mm256_loadu_ps(dx);
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    // The half's 8 group scales; group g of the block uses dx[g / 2].
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * h))));
    const __m256i dx_idx = _mm256_setr_epi32(4 * h, 4 * h, 4 * h + 1, 4 * h + 1, 4 * h + 2, 4 * h + 2, 4 * h + 3, 4 * h + 3);
    const __m256 g8 = _mm256_mul_ps(_mm256_mul_ps(sc, d), _mm256_permutevar8x32_ps(dxv, dx_idx));
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));       // k = 0 (low), 2 (high)
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));  // k = 1, 3
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i codes[4] = {
        _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(t, 4), m30)),
        _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_and_si256(_mm256_slli_epi16(t, 2), m30)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(t, m30)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), _mm256_and_si256(_mm256_srli_epi16(t, 2), m30))};
    for (int k = 0; k < 4; ++k) {
      const int e0 = 128 * h + 32 * k;
      const __m256i s = vnni_dot(vnni_bias<kVnniOffsetShift<QuantFormat::q6_k>>(s4 + e0 / 4), codes[k],
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + e0)));
      const __m256 scale = _mm256_permutevar8x32_ps(g8, _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1));
      __m256& acc = k % 2 ? acc1 : acc0;
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
    }
  }
}

// The verbatim formats, one row at a time (as gemv_rows_verbatim).
template <QuantFormat F>
CUMULUS_VNNI_ATTR void vnni_rows_verbatim(const QuantMatrixView& w, int row_begin, int row_end, const QuantActivation& x, float* y) {
  constexpr int kBlock = kVerbatimBlock;
  const int nb = w.cols / kBlock;
  const size_t tb = static_cast<size_t>(quant_block_bytes(F));
  const size_t row_bytes = static_cast<size_t>(nb) * tb;
  for (int r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w.qs + static_cast<size_t>(r) * row_bytes;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const size_t e = static_cast<size_t>(b) * kBlock;
      const uint8_t* blk = row + static_cast<size_t>(b) * tb;
      if constexpr (F == QuantFormat::q6_k)
        vnni_block_q6k(blk, x.q8.data() + e, x.d.data() + e / kQuantBlock, x.sum4.data() + e / 4, acc0, acc1);
      else
        vnni_block_k45<F>(blk, x.q8.data() + e, x.d.data() + e / kQuantBlock, x.sum.data() + e / kQuantBlock, acc0, acc1, macc);
    }
    y[r - row_begin] = vnni_sum8(_mm256_sub_ps(_mm256_add_ps(acc0, acc1), macc));
  }
}

void vnni_rows(const QuantMatrixView& w, int row_begin, int row_end, const QuantActivation& x, float* y) {
  switch (w.format) {
    case QuantFormat::q4_0: return vnni_rows_repacked<QuantFormat::q4_0>(w, row_begin, row_end, x, y);
    case QuantFormat::q4_1: return vnni_rows_repacked<QuantFormat::q4_1>(w, row_begin, row_end, x, y);
    case QuantFormat::q8_0: return vnni_rows_repacked<QuantFormat::q8_0>(w, row_begin, row_end, x, y);
    case QuantFormat::q5_0: return vnni_rows_repacked<QuantFormat::q5_0>(w, row_begin, row_end, x, y);
    case QuantFormat::q5_1: return vnni_rows_repacked<QuantFormat::q5_1>(w, row_begin, row_end, x, y);
    case QuantFormat::q4_k: return vnni_rows_verbatim<QuantFormat::q4_k>(w, row_begin, row_end, x, y);
    case QuantFormat::q5_k: return vnni_rows_verbatim<QuantFormat::q5_k>(w, row_begin, row_end, x, y);
    case QuantFormat::q6_k: return vnni_rows_verbatim<QuantFormat::q6_k>(w, row_begin, row_end, x, y);
  }
}
#endif  // HWY_TARGET == HWY_AVX3_DL

// Activation rounding, exactly as ref::quant_activation: per block, amax by a max over
// lanes, inv = qmax / amax (scalar; qmax = 32767 or 127), q = nearest-even(x * inv) (float
// multiply, then cvtps2dq), dx = amax / qmax, sum = dx * (integer sum of q).
void quant_activation_block(const float* xb, float qmax, int16_t* q, float* d, float* sum) {
  const DX dx;
  const hn::Rebind<int32_t, DX> d32;
  const hn::Rebind<int16_t, DX> d16;
  constexpr size_t N = hn::MaxLanes(DX());
  auto mx = hn::Zero(dx);
  for (size_t j = 0; j < kQuantBlock; j += N) mx = hn::Max(mx, hn::Abs(hn::LoadU(dx, xb + j)));
  const float amax = hn::GetLane(hn::MaxOfLanes(dx, mx));
  const auto inv = hn::Set(dx, amax > 0.0f ? qmax / amax : 0.0f);
  auto isum = hn::Zero(d32);
  for (size_t j = 0; j < kQuantBlock; j += N) {
    const auto qi = hn::NearestInt(hn::Mul(hn::LoadU(dx, xb + j), inv));
    isum = hn::Add(isum, qi);
    hn::StoreU(hn::DemoteTo(d16, qi), d16, q + j);
  }
  *d = amax / qmax;
  *sum = *d * static_cast<float>(hn::GetLane(hn::SumOfLanes(d32, isum)));
}

// An 8-bit activation's codes as int8 and their sums of 4 (QuantActivation::q8, sum4);
// nothing for 16 bits. Plain loops (exact integers), vectorised by the compiler: on AVX3_DL
// under CUMULUS_VNNI_ATTR, so that no AVX-VNNI (VEX) instruction can come of them.
CUMULUS_VNNI_ATTR void quant_activation_bytes(QuantActivation& a) {
  a.q8.clear();
  a.sum4.clear();
  if (a.bits != 8) return;
  const size_t n = static_cast<size_t>(a.cols);
  a.q8.resize(n);
  a.sum4.resize(n / 4);
  const int16_t* q = a.q.data();
  for (size_t j = 0; j < n; ++j) a.q8[j] = static_cast<int8_t>(q[j]);  // |q| <= 127
  for (size_t i = 0; i < n / 4; ++i) a.sum4[i] = q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3];
}

}  // namespace

void quant_activation_impl(const float* x, int cols, int bits, QuantActivation& a) {
  const int nb = cols / kQuantBlock;
  const float qmax = bits == 8 ? 127.0f : 32767.0f;
  a.cols = cols;
  a.bits = bits;
  a.q.resize(static_cast<size_t>(cols));
  a.d.assign(static_cast<size_t>(gemv_pad16(nb)), 0.0f);
  a.sum.assign(static_cast<size_t>(gemv_pad16(nb)), 0.0f);
  for (int b = 0; b < nb; ++b)
    quant_activation_block(x + static_cast<size_t>(b) * kQuantBlock, qmax, a.q.data() + static_cast<size_t>(b) * kQuantBlock,
                           &a.d[static_cast<size_t>(b)], &a.sum[static_cast<size_t>(b)]);
  quant_activation_bytes(a);
}


void gemv_quant_rows_impl(const QuantMatrixView& w, int row_begin, int row_end, const QuantActivation& x, float* y) {
#if HWY_TARGET == HWY_AVX3_DL
  if (x.bits == 8) return vnni_rows(w, row_begin, row_end, x, y);
#endif
  switch (w.format) {
    case QuantFormat::q4_0: return gemv_rows_format<QuantFormat::q4_0>(w, row_begin, row_end, x, y);
    case QuantFormat::q4_1: return gemv_rows_format<QuantFormat::q4_1>(w, row_begin, row_end, x, y);
    case QuantFormat::q8_0: return gemv_rows_format<QuantFormat::q8_0>(w, row_begin, row_end, x, y);
    case QuantFormat::q5_0: return gemv_rows_format<QuantFormat::q5_0>(w, row_begin, row_end, x, y);
    case QuantFormat::q5_1: return gemv_rows_format<QuantFormat::q5_1>(w, row_begin, row_end, x, y);
    case QuantFormat::q4_k: return gemv_rows_verbatim<QuantFormat::q4_k>(w, row_begin, row_end, x, y);
    case QuantFormat::q5_k: return gemv_rows_verbatim<QuantFormat::q5_k>(w, row_begin, row_end, x, y);
    case QuantFormat::q6_k: return gemv_rows_verbatim<QuantFormat::q6_k>(w, row_begin, row_end, x, y);
  }
}

void quant_dequantize_rows_impl(const QuantMatrixView& w, int row_begin, int row_end, float* out) {
  switch (w.format) {
    case QuantFormat::q4_0: return dequantize_rows_format<QuantFormat::q4_0>(w, row_begin, row_end, out);
    case QuantFormat::q4_1: return dequantize_rows_format<QuantFormat::q4_1>(w, row_begin, row_end, out);
    case QuantFormat::q8_0: return dequantize_rows_format<QuantFormat::q8_0>(w, row_begin, row_end, out);
    case QuantFormat::q5_0: return dequantize_rows_format<QuantFormat::q5_0>(w, row_begin, row_end, out);
    case QuantFormat::q5_1: return dequantize_rows_format<QuantFormat::q5_1>(w, row_begin, row_end, out);
    case QuantFormat::q4_k: return dequantize_rows_verbatim<QuantFormat::q4_k>(w, row_begin, row_end, out);
    case QuantFormat::q5_k: return dequantize_rows_verbatim<QuantFormat::q5_k>(w, row_begin, row_end, out);
    case QuantFormat::q6_k: return dequantize_rows_verbatim<QuantFormat::q6_k>(w, row_begin, row_end, out);
  }
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(quant_activation_impl);
HWY_EXPORT(gemv_quant_rows_impl);
HWY_EXPORT(quant_dequantize_rows_impl);

void quant_activation(const float* x, int cols, int bits, QuantActivation& a) {
  CUMULUS_CHECK(cols >= kQuantBlock && cols % kQuantBlock == 0, "quant_activation: cols={} must be a positive multiple of {}",
                cols, kQuantBlock);
  CUMULUS_CHECK(bits == 8 || bits == 16, "quant_activation: bits={} must be 8 or 16", bits);
  HWY_DYNAMIC_DISPATCH(quant_activation_impl)(x, cols, bits, a);
}

int gemv_quant_activation_bits() { return 16; }

void gemv_quant_rows(const QuantMatrixView& w, int row_begin, int row_end, const QuantActivation& x, float* y) {
  HWY_DYNAMIC_DISPATCH(gemv_quant_rows_impl)(w, row_begin, row_end, x, y);
}

void quant_dequantize_rows(const QuantMatrixView& w, int row_begin, int row_end, float* out) {
  HWY_DYNAMIC_DISPATCH(quant_dequantize_rows_impl)(w, row_begin, row_end, out);
}

int gemv_quant_task_rows(int rows, int n_threads) {
  // One task per thread. The split was at most 64 tasks of at least 16 rows: SmolLM2's
  // decode at a 256-token context ran 120-133 tok/s with it, 158-199 tok/s with one task
  // per thread and 162-192 with two (2 threads, the same runs alternated; mlp 4.1-4.6 ->
  // 2.5-3.2 ms per token, docs/lab/performance-log.md 2026-11-27). Our reading: short tasks
  // restart the row-group prefetch, whose first groups then wait on memory, and cost a
  // claim each. The split assumes the threads run: a descheduled one holds up its half.
  const int threads = std::max(1, n_threads);
  const int t = std::max(16, (rows + threads - 1) / threads);
  return (t + kGroupRows - 1) / kGroupRows * kGroupRows;
}

void gemv_quant(const QuantMatrixView& w, const float* x, float* y, ThreadPool& pool) {
  quant_matrix_validate(w);
  CUMULUS_CHECK(x != nullptr && y != nullptr, "gemv_quant: x and y must be non-null");
  // This call's codes (tests and benchmarks; the runtime's weight_matmul keeps its own in
  // the caller's MatmulWorkspace).
  QuantActivation codes;
  const QuantActivation* a = &codes;
  quant_activation(x, w.cols, gemv_quant_activation_bits(), codes);
  const int per = gemv_quant_task_rows(w.rows, pool.n_threads());
  pool.parallel_for((w.rows + per - 1) / per, [&](int64_t t, int) {
    const int r0 = static_cast<int>(t) * per;
    gemv_quant_rows(w, r0, std::min(w.rows, r0 + per), *a, y + r0);
  });
}

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
