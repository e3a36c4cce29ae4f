// sketch_topp on the GPU (ours; the CPU method is src/methods/sketch_topp/sketch_topp.cpp,
// docs/methods.md "sketch_topp" gives the equations, docs/cuda.md "sketch_topp on the GPU"
// the design and the measurements). Per (sequence, kv head) a 4-bit sketch of every key in
// kernels/sketch.h's layout, built at prefill by the CPU's encoder (same operations in the
// same order, so the same codes, offsets and steps bit for bit). A decode step, all on the
// device, no host synchronisation (graph-capturable):
//   1. weights pass (one launch, many CTAs per list): the group's queries quantised to int8
//      as key_sketch_quantize_query does, every token's estimate s_jt = scale est_jt from
//      the codes (int8 mma on the nibbles), written as 16-bit fixed point below the largest of
//      its 64-token group (s = m64 + q / 1024, q in [-32767, 0]: 2^-11 at most off, a weight
//      within 0.05%; anything e^-32 below its group's largest weighs nothing here) with the
//      groups' maxima, and per CTA the flash-decoding partials (max, sum of exp) per query
//      head from the exact estimates. Tokens appended since the last step are encoded
//      first, by the CTA that owns them.
//   2. histogram pass (one launch): the partials merged (M_j, S_j), each token's key
//      max_j exp(s_jt - M_j) / S_j (2 for the sinks and recent tokens) placed in its
//      threshold bin c(t) = min{m : key >= kmax 2^(-m/64)} (m <= 2048; 2049 below), the
//      weights summed per bin and query head in 2^-31 fixed point (exact and
//      deterministic: shared-memory 32-bit atomics, then the CTAs' bins merged with global
//      64-bit atomics that each carry two 32-bit sums). The list's last
//      CTA (ticket) scans the bins: the first m where every head reaches candidate_p of
//      its total is the CPU's threshold (select_mass_threshold: kmax 2^-m/64, at least one
//      step below kmax; every token when no bin suffices), the cost rule (union above
//      dense_above of the tokens: dense), the union's weight per head for the claims.
//   3. marks (one launch): bitmap words c(t) <= m and per-tile counts; 4. the compaction's
//      emit pass (sparse_decoder's bitmap_emit) into sorted per-kv-head lists.
// Then the shared sparse attention kernel, and the claims from its log-sum-exp:
//   claim_j = A_j / (A_j + T_j - U_j),  A_j = exp(lse_j - M_j) / S_j  (normalised units);
// with rest_mean (the CPU's rest=mean) the same kernel mixes the mean value row of the
// list's tokens into the output, o_j = w o_j + (1 - w) vsum / n with w = A_j / (A_j + T_j - U_j)
// (the value sums in float64: all tokens at prefill, the appended ones at each step).
// Deviation from the CPU (docs/cuda.md): no rounds; a head whose claim falls short of p
// keeps its union.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/sketch.h"
#include "cumulus/methods/cuda_methods.h"
#include "kernels/cuda/cuda_internal.cuh"

namespace cumulus::cuda {
namespace {

constexpr int kMaxGroup = kSketchToppMaxGroup;  // query heads per kv head the kernels hold in registers
constexpr int kThresholds = 2049;  // thresholds kmax 2^(-m/64), m = 0 .. 2048 (32 octaves)
constexpr int kBinBelow = 2049;    // keys below kmax 2^-32 (and zero)
constexpr int kBins = 2050;
// Weights (each <= 1, and a head's sum over all tokens 1 up to rounding) in fixed point,
// 2^-31 units: any bin's or list's sum fits 32 bits, so the shared histogram adds with
// 32-bit integer atomics and the global one with 64-bit atomics that carry two such sums;
// integer sums do not depend on the order of the adds.
constexpr float kFixF = 2147483648.0f;  // 2^31
constexpr double kFix = 2147483648.0;
constexpr float kSketchRange = 6.0e4f;          // src/kernels/ref/sketch.cpp's clamp of normalised values
constexpr int kWeightsThreads = 256;
constexpr int kHistThreads = 512;
constexpr int kGroupTokens = 64;       // tokens per maximum of the 16-bit logits
constexpr float kLogitUnit = 1024.0f;  // 16-bit logits: s = m64 + q / kLogitUnit
constexpr int kTokensPerWarpStep = 64;  // tokens a warp estimates per step of the weights pass (4 mma blocks)

// Everything the kernels of one decoder share (device pointers; plain data).
struct SketchParams {
  DeviceKvView kv;
  int group = 1, n_q = 0;
  // The sketch, per list l = seq * n_kv_heads + h:
  uint8_t* codes = nullptr;   // [L][blocks][head_dim / 8][16][4]
  uint16_t* off = nullptr;    // [L][ts] f16 bits
  uint16_t* step = nullptr;   // [L][ts] f16 bits
  float* center = nullptr;    // [L][head_dim]
  float* scale = nullptr;     // [L][head_dim]
  int32_t* sk_n = nullptr;    // [L] tokens encoded
  size_t codes_stride = 0;    // bytes of codes per list
  int ts = 0;                 // token stride: max_tokens rounded up to 64
  // Step scratch:
  int16_t* logits = nullptr;            // [L][ts][G] q = round((s - m64) * 1024), in [-32767, 0]
  float* gmax = nullptr;                // [L][ts / 64][G] m64: the largest s of each 64-token group
  float* part_m = nullptr;              // [L][n_chunks1][G]
  float* part_s = nullptr;              // [L][n_chunks1][G]
  uint16_t* cbin = nullptr;             // [L][ts] threshold bin of each token
  // [L][kBins][(G + 2) / 2]: the G weight sums and the token count of each bin, two 32-bit values
  // to a 64-bit word (value 2k low, 2k + 1 high); zero between steps.
  unsigned long long* hist = nullptr;
  uint32_t* ticket = nullptr;           // [L] zero between steps
  int32_t* thr = nullptr;               // [L] the chosen bin m* (tokens with c(t) <= m* are the union)
  int32_t* dense = nullptr;             // [L] 1: every token
  float* st_M = nullptr;                // [L][G] largest logit
  double* st_S = nullptr;               // [L][G] sum of exp(s - M)
  double* st_T = nullptr;               // [L][G] sum of the normalised weights (~1)
  double* st_U = nullptr;               // [L][G] ... over the union
  double* vsum = nullptr;               // [L][head_dim] sum of the value rows of tokens [0, vs_n) (rest_mean)
  int32_t* vs_n = nullptr;              // [L]
  // Options:
  float attn_scale = 0;
  double cp = 0.92, dense_above = 0.5;
  int sinks = 4, recent = 64, min_context = 1024, force_dense = 0;
  int chunk1 = 512, n_chunks1 = 1, chunk2 = 1024;
};

__device__ __forceinline__ float f16_bits_to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ uint16_t float_to_f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }

// The next f16 value below h toward -inf (ref/sketch.cpp's f16_next_down).
__device__ __forceinline__ uint16_t f16_next_down(uint16_t h) {
  if ((h & 0x7FFF) == 0) return 0x8001;
  return (h & 0x8000) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}

// std::clamp((k - center) / scale, -R, R), as the CPU encoder computes it.
__device__ __forceinline__ float sketch_norm(float k, float center, float scale) {
  const float y = __fdiv_rn(__fsub_rn(k, center), scale);
  return y < -kSketchRange ? -kSketchRange : (kSketchRange < y ? kSketchRange : y);
}

// Encodes token t of list l (key_sketch_encode's operations in its order: the codes are
// the CPU's bit for bit). Reads the key row twice (the range, then the codes) rather than
// holding head_dim floats.
template <class T>
__device__ void sketch_encode_token(const SketchParams& p, int l, int s, int h, int t) {
  const int d = p.kv.head_dim;
  const int32_t* pt = p.kv.page_table + (static_cast<size_t>(s) * p.kv.n_kv_heads + h) * p.kv.max_pages;
  const int page = pt[t >> p.kv.page_shift];
  const T* row = static_cast<const T*>(p.kv.k) +
                 (static_cast<size_t>(page) * p.kv.page_size + (t & (p.kv.page_size - 1))) * d;
  const float* cen = p.center + static_cast<size_t>(l) * d;
  const float* sc = p.scale + static_cast<size_t>(l) * d;
  float lo = sketch_norm(to_float(row[0]), cen[0], sc[0]), hi = lo;
  for (int c = 1; c < d; ++c) {
    const float y = sketch_norm(to_float(row[c]), cen[c], sc[c]);
    lo = y < lo ? y : lo;  // std::min(lo, y)
    hi = hi < y ? y : hi;  // std::max(hi, y)
  }
  uint16_t off16 = float_to_f16_bits(lo);
  if (f16_bits_to_float(off16) > lo) off16 = f16_next_down(off16);
  const float off = f16_bits_to_float(off16);
  const float range = __fsub_rn(hi, off);
  uint16_t step16 = float_to_f16_bits(__fdiv_rn(range, 15.0f));
  if (__fmul_rn(f16_bits_to_float(step16), 15.0f) < range) step16 = static_cast<uint16_t>(step16 + 1);
  const float step = f16_bits_to_float(step16);
  p.off[static_cast<size_t>(l) * p.ts + t] = off16;
  p.step[static_cast<size_t>(l) * p.ts + t] = step16;
  uint8_t* block = p.codes + static_cast<size_t>(l) * p.codes_stride +
                   static_cast<size_t>(t >> 4) * (d / 8) * 64 + (t & 15) * 4;
  for (int c8 = 0; c8 < d / 8; ++c8) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int c = 8 * c8 + i;
      const float y = sketch_norm(to_float(row[c]), cen[c], sc[c]);
      float u = step > 0.0f ? rintf(__fdiv_rn(__fsub_rn(y, off), step)) : 0.0f;
      u = u < 0.0f ? 0.0f : (15.0f < u ? 15.0f : u);
      word |= static_cast<uint32_t>(u) << (8 * (i % 4) + 4 * (i / 4));
    }
    *reinterpret_cast<uint32_t*>(block + c8 * 64) = word;
  }
}

// ---- prefill ------------------------------------------------------------------------------

// Per-channel mean and standard deviation of a list's keys (key_sketch_channels): one
// thread per channel sums the tokens in order in float64 with explicit roundings (no
// contraction), so center and scale equal the CPU's bit for bit. grid: L, block: head_dim.
template <class T>
__global__ void sketch_channels_kernel(SketchParams p) {
  const int l = blockIdx.x, s = l / p.kv.n_kv_heads, h = l % p.kv.n_kv_heads;
  const int d = p.kv.head_dim, c = threadIdx.x;
  const int n = p.kv.n_tokens[s];
  const int32_t* pt = p.kv.page_table + (static_cast<size_t>(s) * p.kv.n_kv_heads + h) * p.kv.max_pages;
  const T* k = static_cast<const T*>(p.kv.k);
  double sum = 0, sq = 0;
  constexpr int kBatch = 16;  // loads in flight before the ordered adds
  for (int t0 = 0; t0 < n; t0 += kBatch) {
    float x[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int t = t0 + i;
      x[i] = 0.0f;
      if (t < n) {
        const int page = __ldg(pt + (t >> p.kv.page_shift));
        x[i] = to_float(k[(static_cast<size_t>(page) * p.kv.page_size + (t & (p.kv.page_size - 1))) * d + c]);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (t0 + i < n) {
        sum = __dadd_rn(sum, static_cast<double>(x[i]));
        sq = __dadd_rn(sq, __dmul_rn(static_cast<double>(x[i]), static_cast<double>(x[i])));
      }
    }
  }
  const double nn = static_cast<double>(max(1, n));
  const double mean = __ddiv_rn(sum, nn);
  const double var = __dsub_rn(__ddiv_rn(sq, nn), __dmul_rn(mean, mean));
  const double sd = __dsqrt_rn(var > 0.0 ? var : 0.0);
  __shared__ double s_max[8];
  double m = sd;
  for (int o = 16; o >= 1; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((c & 31) == 0) s_max[c >> 5] = m;
  __syncthreads();
  double largest = 0;
  for (int w = 0; w < (d + 31) / 32; ++w) largest = fmax(largest, s_max[w]);
  const double floor = largest > 0 ? __dmul_rn(1e-3, largest) : 1.0;
  p.center[static_cast<size_t>(l) * d + c] = static_cast<float>(mean);
  p.scale[static_cast<size_t>(l) * d + c] = static_cast<float>(sd > floor ? sd : floor);
}

// Every token of every list encoded; sk_n = n. grid: (ceil(max_tokens / 128), L).
template <class T>
__global__ void sketch_encode_kernel(SketchParams p) {
  const int l = blockIdx.y, s = l / p.kv.n_kv_heads, h = l % p.kv.n_kv_heads;
  const int n = p.kv.n_tokens[s];
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < n) sketch_encode_token<T>(p, l, s, h, t);
  if (blockIdx.x == 0 && threadIdx.x == 0) p.sk_n[l] = n;
}

// Prefill: the value rows of every token summed per list in float64 (vsum zeroed before),
// a chunk of kVsumChunk tokens per CTA added with atomics; vs_n = n. grid: (chunks, L),
// block: head_dim.
constexpr int kVsumChunk = 1024;
template <class T>
__global__ void sketch_vsum_prefill_kernel(SketchParams p) {
  const int l = blockIdx.y, s = l / p.kv.n_kv_heads, h = l % p.kv.n_kv_heads;
  const int d = p.kv.head_dim, c = threadIdx.x;
  const int n = p.kv.n_tokens[s];
  const int t0 = blockIdx.x * kVsumChunk, t1 = min(n, t0 + kVsumChunk);
  if (blockIdx.x == 0 && c == 0) p.vs_n[l] = n;
  if (t0 >= t1) return;
  const int32_t* pt = p.kv.page_table + (static_cast<size_t>(s) * p.kv.n_kv_heads + h) * p.kv.max_pages;
  const T* v = static_cast<const T*>(p.kv.v);
  double sum = 0;
#pragma unroll 8
  for (int t = t0; t < t1; ++t) {
    const int page = __ldg(pt + (t >> p.kv.page_shift));
    sum += static_cast<double>(to_float(v[(static_cast<size_t>(page) * p.kv.page_size + (t & (p.kv.page_size - 1))) * d + c]));
  }
  atomicAdd(p.vsum + static_cast<size_t>(l) * d + c, sum);
}

// A step: the value rows of tokens [vs_n, n) (appended since the last step) added to the
// list's sums in token order (deterministic); vs_n = n. grid: L, block: head_dim.
template <class T>
__global__ void sketch_vsum_kernel(SketchParams p) {
  const int l = blockIdx.x, s = l / p.kv.n_kv_heads, h = l % p.kv.n_kv_heads;
  const int d = p.kv.head_dim, c = threadIdx.x;
  const int n = p.kv.n_tokens[s], t_begin = p.vs_n[l];
  const int32_t* pt = p.kv.page_table + (static_cast<size_t>(s) * p.kv.n_kv_heads + h) * p.kv.max_pages;
  const T* v = static_cast<const T*>(p.kv.v);
  double sum = p.vsum[static_cast<size_t>(l) * d + c];
  constexpr int kBatch = 16;  // loads in flight before the ordered adds
  for (int t0 = t_begin; t0 < n; t0 += kBatch) {
    float x[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int t = t0 + i;
      x[i] = 0.0f;
      if (t < n) {
        const int page = __ldg(pt + (t >> p.kv.page_shift));
        x[i] = to_float(v[(static_cast<size_t>(page) * p.kv.page_size + (t & (p.kv.page_size - 1))) * d + c]);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      if (t0 + i < n) sum += static_cast<double>(x[i]);
  }
  p.vsum[static_cast<size_t>(l) * d + c] = sum;
  __syncthreads();  // every thread has read vs_n
  if (c == 0) p.vs_n[l] = n;
}

// ---- a step -------------------------------------------------------------------------------

// Online (max, sum of exp) merge; either side may be empty (m = -inf).
__device__ __forceinline__ void merge_max_sum(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) return;
  s = (m == -INFINITY ? 0.0f : s * __expf(m - nm)) + (om == -INFINITY ? 0.0f : os * __expf(om - nm));
  m = nm;
}

// C[16][8] += A[16][32] B[32][8], A unsigned and B signed bytes, int32 sums (sm_80+).
__device__ __forceinline__ void mma_u8s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 1. The weights pass. grid: (n_chunks1, L), block: 256 threads (8 warps). Each CTA owns
// tokens [t0, t0 + chunk1) of its list: encodes those appended since the last step,
// quantises the group's queries (warp j: query j), then each warp estimates 64 tokens a
// step, four blocks of 16: for every 8-dim chunk a token's 32-bit word of nibbles, split
// into the low and high nibbles (4 dims each as bytes) and multiplied by the query's int8
// bytes on the tensor cores (below). A warp's load reads 8 tokens of 4 chunks: four full
// 32-byte sectors.
// Two CTAs per multiprocessor: up to 128 registers, so every code word of a step can be in
// flight (at three, 85 registers at most, the step took 0.4-2.5% longer at 32K-128K).
template <int G, int D, class T>
__global__ void __launch_bounds__(kWeightsThreads, 2)
    sketch_weights_kernel(SketchParams p, const float* __restrict__ q) {
  const int l = blockIdx.y, s = l / p.kv.n_kv_heads, h = l % p.kv.n_kv_heads;
  const int n = p.kv.n_tokens[s];
  if (p.force_dense || n <= p.min_context) return;
  const int t0 = blockIdx.x * p.chunk1;
  if (t0 >= n) return;
  const int t1 = min(n, t0 + p.chunk1);
  constexpr int d = D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __shared__ __align__(16) int8_t s_q8[G][D];
  __shared__ float s_base[G], s_qsum[G], s_qstep[G];
  __shared__ float s_red_m[kWeightsThreads / 32][G], s_red_s[kWeightsThreads / 32][G];

  const int enc0 = max(t0, p.sk_n[l]);
  for (int t = enc0 + static_cast<int>(threadIdx.x); t < t1; t += blockDim.x) sketch_encode_token<T>(p, l, s, h, t);

  if (warp < G) {  // key_sketch_quantize_query (the float64 sums in another order: equal to rounding)
    const float* qj = q + (static_cast<size_t>(s) * p.n_q + h * G + warp) * d;
    const float* cen = p.center + static_cast<size_t>(l) * d;
    const float* sc = p.scale + static_cast<size_t>(l) * d;
    double amax = 0, base = 0, qsum = 0;
    for (int c = lane; c < d; c += 32) {
      const double qs = static_cast<double>(qj[c]) * sc[c];
      amax = fmax(amax, fabs(qs));
      base += static_cast<double>(qj[c]) * cen[c];
      qsum += qs;
    }
    for (int o = 16; o >= 1; o >>= 1) {
      amax = fmax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      base += __shfl_xor_sync(0xffffffffu, base, o);
      qsum += __shfl_xor_sync(0xffffffffu, qsum, o);
    }
    const double qstep = amax > 0 ? amax / 127.0 : 1.0;
    for (int c = lane; c < d; c += 32) {
      double v = rint(static_cast<double>(qj[c]) * sc[c] / qstep);
      v = v < -127.0 ? -127.0 : (v > 127.0 ? 127.0 : v);
      s_q8[warp][c] = static_cast<int8_t>(v);
    }
    if (lane == 0) {
      const double a = p.attn_scale;
      s_base[warp] = static_cast<float>(a * base);
      s_qsum[warp] = static_cast<float>(a * qsum);
      s_qstep[warp] = static_cast<float>(a * qstep);
    }
  }
  __syncthreads();  // also makes the tokens encoded above visible to the whole CTA

  // The token-by-query products on the tensor cores: mma m16n8k32 (u8 codes x s8 query,
  // exact int32 sums: the integers of the CPU's dot product), a 16-token block as the 16
  // rows of A, the group's heads as the 8 columns of B (the first version, __dp4a on the
  // CUDA cores, was bound by instruction issue: docs/cuda.md). The 32 dims of K tile kt are
  // the 4 chunks 4 kt .. 4 kt + 3 in an order of our choosing (a dot product does not
  // depend on it): lane (g, tq)
  // (g = lane / 4, tq = lane % 4) holds in A the low nibbles of chunk 4 kt + tq of tokens g
  // and g + 8 as k = 4 tq .. 4 tq + 3, and their high nibbles as k = 16 + 4 tq .., so each
  // code word is loaded once; B holds the query's bytes of the same dims.
  static_assert(D % 32 == 0, "whole 32-dim K tiles");
  constexpr int nch = D / 8;   // 8-dim chunks per token
  constexpr int nkt = D / 32;  // K tiles
  const int g = lane >> 2, tq = lane & 3;
  uint32_t bq[nkt][2];
#pragma unroll
  for (int kt = 0; kt < nkt; ++kt) {
    const int2 w = g < G ? reinterpret_cast<const int2*>(s_q8[g < G ? g : 0])[4 * kt + tq] : make_int2(0, 0);
    bq[kt][0] = static_cast<uint32_t>(w.x), bq[kt][1] = static_cast<uint32_t>(w.y);
  }
  // The accumulator's lane (g, tq) holds tokens g and g + 8, heads 2 tq and 2 tq + 1. With
  // G <= 4 the columns 4..7 are empty: lanes tq = 2, 3 take token g + 8 of lane tq - 2, so
  // every lane finishes one token row and two heads (h0, h0 + 1); with G > 4 two rows.
  constexpr bool kHalf = G <= 4;
  constexpr int NR = kHalf ? 1 : 2;
  const int h0 = kHalf ? 2 * (tq & 1) : 2 * tq;
  const int row8 = kHalf ? 8 * (tq >> 1) : 0;
  float qb[2], qs[2], qst[2];
#pragma unroll
  for (int hc = 0; hc < 2; ++hc) {
    const int j = h0 + hc < G ? h0 + hc : 0;
    qb[hc] = s_base[j], qs[hc] = s_qsum[j], qst[hc] = s_qstep[j];
  }
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(p.codes + static_cast<size_t>(l) * p.codes_stride);
  const uint16_t* offs = p.off + static_cast<size_t>(l) * p.ts;
  const uint16_t* steps = p.step + static_cast<size_t>(l) * p.ts;
  int16_t* lq = p.logits + static_cast<size_t>(l) * p.ts * G;
  float* gm = p.gmax + static_cast<size_t>(l) * (p.ts / kGroupTokens) * G;
  // This lane's flash-decoding partials of heads h0, h0 + 1, merged once per 64 tokens.
  float m[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
  // The lanes that share this lane's heads, as a butterfly: step(o) for each xor offset
  // o (2 only with kHalf). One of them writes the heads' results.
  auto over_head_lanes = [](auto&& step) {
    if constexpr (kHalf) step(2);
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) step(o);
  };
  const bool head_writer = g == 0 && (!kHalf || tq < 2);
  // The token of row r (of NR) of block b that this lane finishes.
  auto row_token = [&](int tg, int b, int r) { return tg + 16 * b + g + row8 + 8 * r; };
  constexpr uint32_t kLo = 0x0F0F0F0Fu;

  for (int tg = t0 + warp * kTokensPerWarpStep; tg < t1; tg += (kWeightsThreads / 32) * kTokensPerWarpStep) {
    // Word of chunk c of token t: codes[(t / 16 * nch + c) * 16 + t % 16]; the sketch is
    // padded to 64 tokens, so the 4 blocks of this step are in bounds. Every word of the
    // step is loaded before the first product: 8 nkt loads in flight per lane (a step's
    // 64 x 4 D / 8 bytes per warp), which the pass needs to approach the memory's speed.
    uint32_t x[nkt][4][2];
#pragma unroll
    for (int kt = 0; kt < nkt; ++kt)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t* w = codes + (static_cast<size_t>((tg >> 4) + b) * nch + 4 * kt + tq) * 16 + g;
        x[kt][b][0] = __ldcs(w);
        x[kt][b][1] = __ldcs(w + 8);
      }
    uint16_t off16[4][NR], step16[4][NR];  // of the token rows this lane finishes
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const int t = row_token(tg, b, r);
        off16[b][r] = __ldcs(offs + t), step16[b][r] = __ldcs(steps + t);
      }
    int acc[4][4];
#pragma unroll
    for (int b = 0; b < 4; ++b) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = 0;
#pragma unroll
    for (int kt = 0; kt < nkt; ++kt)
#pragma unroll
      for (int b = 0; b < 4; ++b)
        mma_u8s8(acc[b], x[kt][b][0] & kLo, x[kt][b][1] & kLo, (x[kt][b][0] >> 4) & kLo, (x[kt][b][1] >> 4) & kLo,
                 bq[kt][0], bq[kt][1]);
    // The estimates: est = base + offset qsum + step qstep dot, scaled (the CPU's MulAdd
    // order).
    float sx[4][NR][2];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      int v[NR][2];
      if constexpr (kHalf) {
        const int s2 = __shfl_xor_sync(0xffffffffu, acc[b][2], 2), s3 = __shfl_xor_sync(0xffffffffu, acc[b][3], 2);
        v[0][0] = tq >= 2 ? s2 : acc[b][0];
        v[0][1] = tq >= 2 ? s3 : acc[b][1];
      } else {
        v[0][0] = acc[b][0], v[0][1] = acc[b][1];
        v[NR - 1][0] = acc[b][2], v[NR - 1][1] = acc[b][3];
      }
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const int t = row_token(tg, b, r);
        const float off = f16_bits_to_float(off16[b][r]), stp = f16_bits_to_float(step16[b][r]);
#pragma unroll
        for (int hc = 0; hc < 2; ++hc) {
          const float sj = fmaf(stp * qst[hc], static_cast<float>(v[r][hc]), fmaf(off, qs[hc], qb[hc]));
          sx[b][r][hc] = t < t1 ? sj : -INFINITY;
        }
      }
    }
    // Per head: the largest estimate of the 64 tokens (tg is a multiple of 64: one group),
    // the partials merged once per group, and each token's 16-bit offset below the largest.
    float g64[2];
#pragma unroll
    for (int hc = 0; hc < 2; ++hc) {
      float mx = -INFINITY;
#pragma unroll
      for (int b = 0; b < 4; ++b)
#pragma unroll
        for (int r = 0; r < NR; ++r) mx = fmaxf(mx, sx[b][r][hc]);
      over_head_lanes([&](int o) { mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o)); });
      g64[hc] = mx;  // finite: token tg < t1 is in the group
      float e = 0.0f;
#pragma unroll
      for (int b = 0; b < 4; ++b)
#pragma unroll
        for (int r = 0; r < NR; ++r) e += __expf(sx[b][r][hc] - g64[hc]);  // 0 past t1
      merge_max_sum(m[hc], sum[hc], g64[hc], e);
      if (head_writer && h0 + hc < G) gm[static_cast<size_t>(tg / kGroupTokens) * G + h0 + hc] = g64[hc];
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const int t = row_token(tg, b, r);
        if (t >= t1 || h0 >= G) continue;
        int q16[2];
#pragma unroll
        for (int hc = 0; hc < 2; ++hc) {
          const float qv = rintf((sx[b][r][hc] - g64[hc]) * kLogitUnit);
          q16[hc] = static_cast<int>(qv < -32767.0f ? -32767.0f : qv);
        }
        int16_t* dst = lq + static_cast<size_t>(t) * G + h0;
        if constexpr (G % 2 == 0) {  // heads h0, h0 + 1 in one 4-byte store
          *reinterpret_cast<uint32_t*>(dst) =
              static_cast<uint32_t>(static_cast<uint16_t>(q16[0])) | (static_cast<uint32_t>(q16[1]) << 16);
        } else {
          dst[0] = static_cast<int16_t>(q16[0]);
          if (h0 + 1 < G) dst[1] = static_cast<int16_t>(q16[1]);
        }
      }
    }
  }
  // The CTA's partials: the lanes that share a head, then warps, in a fixed order
  // (deterministic).
#pragma unroll
  for (int hc = 0; hc < 2; ++hc) {
    over_head_lanes([&](int o) {
      const float om = __shfl_xor_sync(0xffffffffu, m[hc], o), os = __shfl_xor_sync(0xffffffffu, sum[hc], o);
      merge_max_sum(m[hc], sum[hc], om, os);
    });
    if (head_writer && h0 + hc < G) s_red_m[warp][h0 + hc] = m[hc], s_red_s[warp][h0 + hc] = sum[hc];
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int j = threadIdx.x;
    float mm = -INFINITY, ss = 0.0f;
    for (int w = 0; w < kWeightsThreads / 32; ++w) merge_max_sum(mm, ss, s_red_m[w][j], s_red_s[w][j]);
    const size_t at = (static_cast<size_t>(l) * p.n_chunks1 + blockIdx.x) * G + j;
    p.part_m[at] = mm;
    p.part_s[at] = ss;
  }
}

// 2^x by the multifunction unit (ex2.approx: 2 ulp; results below 2^-126 are 0, which the
// weights' 2^-31 fixed point does not see).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Threshold bin of a key: c = min{m <= 2048 : key >= T[m]}, or kBinBelow. Since T[m] = kmax
// 2^(-m/64), c = ceil(x) with x = -64 (log2 key - log2 kmax). x computed from log2_key (the
// exponent whose ex2.approx is the key: 2 ulp, 2.2e-5 after the factor 64) and log2_kmax
// (lg2.approx: relative 2^-22, 2.6e-4 at kmax = 2^-17) is within 4.4e-4 of the x of the
// table's T[m] (exp2f and the product: 3 ulp, 3.3e-5; the float subtraction: 1.2e-4). So
// where x lies further than kBinSlack = 2^-8 from an integer (all but ~0.8% of the keys)
// ceil(x) is the bin, without the table; otherwise the guess is corrected against the
// table, so the bin is exact either way.
constexpr float kBinSlack = 1.0f / 256.0f;
__device__ __forceinline__ int sketch_bin(float key, float log2_key, float log2_kmax, const float* T) {
  if (!(key > 0.0f)) return kBinBelow;
  const float x = -64.0f * (log2_key - log2_kmax);
  const float g = ceilf(x);
  if (g - x > kBinSlack && g - x < 1.0f - kBinSlack && x > 0.0f && g <= static_cast<float>(kThresholds - 1))
    return static_cast<int>(g);
  int m = g < 0.0f ? 0 : (g > static_cast<float>(kBinBelow) ? kBinBelow : static_cast<int>(g));
  while (m < kThresholds && key < T[m]) ++m;
  while (m > 0 && key >= T[m - 1]) --m;
  return m;
}

// 2. The histogram pass. grid: (n_chunks2, L), block: 512 threads; dynamic shared memory:
// the list's layout of p.hist, [kBins][P] 64-bit words, P = (G + 2) / 2, each two 32-bit
// sums (value 2k low, 2k + 1 high; values 0 .. G - 1 the heads' weights, G the token
// count), added to with 32-bit atomics; one 64-bit global atomic then adds a word's two
// sums (no carry crosses: every sum stays below 2^32). (A value-major layout, [2 P][kBins],
// whose banks collide less, measured 3-5% slower at batch 16.)
template <int G>
__global__ void __launch_bounds__(kHistThreads, 2) sketch_hist_kernel(SketchParams p) {
  constexpr int P = (G + 2) / 2;  // 64-bit words per bin
  extern __shared__ __align__(16) unsigned char s_raw[];
  unsigned long long* s_hist = reinterpret_cast<unsigned long long*>(s_raw);
  uint32_t* s_h32 = reinterpret_cast<uint32_t*>(s_raw);  // value v of bin c: s_h32[2 P c + v]
  auto value_at = [&](int c, int v) -> uint32_t { return s_h32[2 * P * c + v]; };
  __shared__ float s_T[kThresholds];
  __shared__ float s_M[G], s_l2S[G];
  __shared__ double s_S[G];
  __shared__ float s_kmax;
  __shared__ int s_last, s_mj[G], s_m;
  __shared__ unsigned long long s_tot[G], s_un[G];
  __shared__ int s_count;

  const int l = blockIdx.y, s = l / p.kv.n_kv_heads;
  const int n = p.kv.n_tokens[s];
  const int tid = threadIdx.x, bd = blockDim.x, warp = tid >> 5, lane = tid & 31;
  if (p.force_dense || n <= p.min_context || n <= 0) {
    if (blockIdx.x == 0 && tid == 0) p.thr[l] = kBinBelow, p.dense[l] = 1;
    return;
  }
  const int t0 = blockIdx.x * p.chunk2;
  if (t0 >= n) return;
  const int t1 = min(n, t0 + p.chunk2);
  const int n_ck1 = (n + p.chunk1 - 1) / p.chunk1, n_ck2 = (n + p.chunk2 - 1) / p.chunk2;

  // The weights pass's partials merged (every CTA of the list computes the same, in order).
  if (warp < G) {
    const int j = warp;
    const float* pm = p.part_m + static_cast<size_t>(l) * p.n_chunks1 * G;
    const float* ps = p.part_s + static_cast<size_t>(l) * p.n_chunks1 * G;
    float mx = -INFINITY;
    for (int c = lane; c < n_ck1; c += 32) mx = fmaxf(mx, pm[c * G + j]);
    mx = warp_max(mx);
    double sm = 0;
    for (int c = lane; c < n_ck1; c += 32) {
      const float x = pm[c * G + j];
      if (x > -INFINITY) sm += static_cast<double>(ps[c * G + j]) * static_cast<double>(__expf(x - mx));
    }
    for (int o = 16; o >= 1; o >>= 1) sm += __shfl_xor_sync(0xffffffffu, sm, o);
    if (lane == 0) {
      s_M[j] = mx;
      s_S[j] = sm;
      s_l2S[j] = static_cast<float>(log2(sm));
    }
  }
  for (int i = tid; i < kBins * P; i += bd) s_hist[i] = 0ull;
  __syncthreads();
  const int lo = min(p.sinks, n), hi = max(lo, n - p.recent);
  if (tid == 0) {
    // The largest key: a forced token's 2, else the largest weight, the top token's 2^z
    // below with m64 = M_j and q = 0, so z = -log2 S_j exactly (the same ex2 as there).
    float km = 0.0f;
    if (lo > 0 || hi < n) {
      km = 2.0f;
    } else {
      for (int j = 0; j < G; ++j) km = fmaxf(km, exp2_approx(-s_l2S[j]));
    }
    s_kmax = km;
  }
  __syncthreads();
  const float kmax = s_kmax;
  for (int m = tid; m < kThresholds; m += bd) s_T[m] = kmax * exp2f(-static_cast<float>(m) / 64.0f);
  __syncthreads();
  const float log2_kmax = __log2f(kmax);
  const int16_t* lq = p.logits + static_cast<size_t>(l) * p.ts * G;
  const float* gm = p.gmax + static_cast<size_t>(l) * (p.ts / kGroupTokens) * G;
  uint16_t* cb = p.cbin + static_cast<size_t>(l) * p.ts;
  // Four consecutive tokens per thread (one 64-token group: one set of group maxima, their
  // logits in 8 G contiguous bytes, their bins in one 8-byte store), two quads at a time at
  // G <= 4 (one above: registers), loaded before either is used (the loop is bound by the
  // loads' latency otherwise). A chunk starts at a multiple of 512 and ends there or at n;
  // the buffers are padded to 64 tokens, so a quad is in bounds and only its tokens past t1
  // are left out.
  constexpr int kQ = 4, kU = G <= 4 ? 2 : 1;
  for (int q_base = t0 + kQ * tid; q_base < t1; q_base += kQ * bd * kU) {
    int16_t v[kU][kQ * G];
    float gx[kU][G];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int quad = min(q_base + u * kQ * bd, (t1 - 1) & ~(kQ - 1));  // past t1: a valid quad, not used
      const int16_t* src = lq + static_cast<size_t>(quad) * G;
      if constexpr (G % 2 == 0) {  // 8 G bytes at a multiple of 16
#pragma unroll
        for (int k = 0; k < G / 2; ++k) {
          const uint4 r = __ldcs(reinterpret_cast<const uint4*>(src) + k);
          const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            v[u][8 * k + 2 * i] = static_cast<int16_t>(w[i] & 0xffffu);
            v[u][8 * k + 2 * i + 1] = static_cast<int16_t>(w[i] >> 16);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < kQ * G; ++i) v[u][i] = src[i];
      }
      const float* gq = gm + static_cast<size_t>(quad / kGroupTokens) * G;
      if constexpr (G == 4) {
        const float4 f = *reinterpret_cast<const float4*>(gq);
        gx[u][0] = f.x, gx[u][1] = f.y, gx[u][2] = f.z, gx[u][3] = f.w;
      } else {
#pragma unroll
        for (int j = 0; j < G; ++j) gx[u][j] = gq[j];
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int quad = q_base + u * kQ * bd;
      if (quad >= t1) break;
      // A token's weight exp(s - M_j) / S_j = 2^z, z = (m64 - M_j) log2 e - log2 S_j + q log2 e
      // / 1024: one FMA and one exp2 per head and token.
      float zb[G];
#pragma unroll
      for (int j = 0; j < G; ++j) zb[j] = fmaf(gx[u][j] - s_M[j], kLog2e, -s_l2S[j]);
      uint16_t cq[kQ];
#pragma unroll
      for (int i = 0; i < kQ; ++i) {
        const int t = quad + i;
        float w[G], key = 0.0f, zmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const float z = fmaf(static_cast<float>(v[u][i * G + j]), kLog2e / kLogitUnit, zb[j]);
          w[j] = exp2_approx(z);
          key = fmaxf(key, w[j]);
          zmax = fmaxf(zmax, z);
        }
        if (t < lo || t >= hi) key = 2.0f, zmax = 1.0f;  // the sinks and the recent tokens first
        const int c = sketch_bin(key, zmax, log2_kmax, s_T);
        cq[i] = static_cast<uint16_t>(t < t1 ? c : kBinBelow);
        if (t >= t1) continue;
        // 32-bit atomics (shared-memory 64-bit adds, two values at once, measured 2.4x
        // slower for the whole pass at 128K batch 16).
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const uint32_t f = __float2uint_rn(w[j] * kFixF);
          if (f != 0) atomicAdd(s_h32 + 2 * P * c + j, f);
        }
        atomicAdd(s_h32 + 2 * P * c + G, 1u);
      }
      *reinterpret_cast<uint2*>(cb + quad) = make_uint2(cq[0] | (static_cast<uint32_t>(cq[1]) << 16),
                                                     cq[2] | (static_cast<uint32_t>(cq[3]) << 16));
    }
  }
  __syncthreads();
  if (n_ck2 > 1) {  // the list's other CTAs add theirs; the last one decides
    unsigned long long* gh = p.hist + static_cast<size_t>(l) * kBins * P;
    // Two 32-bit sums per 64-bit atomic: a sum stays below 2^32 (weights: 2^31 for a
    // whole head; counts: the tokens), so the low half never carries into the high half.
    for (int i = tid; i < kBins * P; i += bd) {
      const unsigned long long v = s_hist[i];
      if (v != 0) atomicAdd(gh + i, v);
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(p.ticket + l, 1u) == static_cast<uint32_t>(n_ck2 - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // The list's totals into shared memory (4 loads in flight per thread), zeroed for the
    // next step.
    for (int i0 = tid; i0 < kBins * P; i0 += bd * 4) {
      unsigned long long v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = i0 + u * bd < kBins * P ? __ldcg(gh + i0 + u * bd) : 0ull;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = i0 + u * bd;
        if (i >= kBins * P) break;
        gh[i] = 0ull;
        s_hist[i] = v[u];
      }
    }
  }
  if (tid < G) s_mj[tid] = kBinBelow;
  __syncthreads();  // the bins read back above are read by other threads below
  // The scan, on the list's critical path (it runs once every CTA of the list is done): one
  // block scan of the G + 1 values at once (each head's weight, and the token count) over
  // runs of bins, then each thread walks its run for the first threshold m at which head
  // j's sum over the bins <= m reaches cp of its total.
  constexpr int V = G + 1;
  const int per = (kBins + bd - 1) / bd;
  const int c0 = min(kBins, tid * per), c1 = min(kBins, c0 + per);
  unsigned long long run[V];
#pragma unroll
  for (int v = 0; v < V; ++v) run[v] = 0;
  for (int c = c0; c < c1; ++c) {
#pragma unroll
    for (int v = 0; v < V; ++v) run[v] += value_at(c, v);
  }
  __shared__ unsigned long long s_wsum[kHistThreads / 32][V];
#pragma unroll
  for (int v = 0; v < V; ++v) {  // inclusive within the warp
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, run[v], o);
      if (lane >= o) run[v] += y;
    }
    if (lane == 31) s_wsum[warp][v] = run[v];
  }
  __syncthreads();
  if (warp == 0) {  // the warps' totals scanned (lanes over warps)
    const int nw = bd >> 5;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      unsigned long long x = lane < nw ? s_wsum[lane][v] : 0ull;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
      }
      if (lane < nw) s_wsum[lane][v] = x;  // inclusive over warps
      if (lane == nw - 1 && v < G) s_tot[v] = x;
    }
  }
  __syncthreads();
  // This thread's exclusive prefix: the warp's exclusive part, then the lanes before it.
  unsigned long long excl[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    unsigned long long own = 0;
    for (int c = c0; c < c1; ++c) own += value_at(c, v);
    excl[v] = run[v] - own + (warp > 0 ? s_wsum[warp - 1][v] : 0ull);
  }
  {
    unsigned long long r[G];
    double need[G];
    bool found[G];
#pragma unroll
    for (int j = 0; j < G; ++j) r[j] = excl[j], need[j] = p.cp * static_cast<double>(s_tot[j]), found[j] = false;
    for (int c = c0; c < c1 && c < kThresholds; ++c) {
#pragma unroll
      for (int j = 0; j < G; ++j) {
        r[j] += value_at(c, j);
        if (!found[j] && static_cast<double>(r[j]) >= need[j]) {
          atomicMin(s_mj + j, c);
          found[j] = true;
        }
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    int mm = 0;
    for (int j = 0; j < G; ++j) mm = max(mm, s_mj[j]);
    // The CPU's bisection never returns kmax itself (one step below at least), and every
    // token when no threshold down to kmax 2^-32 suffices.
    s_m = mm < kThresholds ? max(1, mm) : kBinBelow;
  }
  __syncthreads();
  const int msel = s_m;
  // The union's sums (bins <= msel) from the thread whose run holds msel.
  if (msel >= c0 && msel < c1) {
    unsigned long long u[V];
#pragma unroll
    for (int v = 0; v < V; ++v) u[v] = excl[v];
    for (int c = c0; c <= msel; ++c) {
#pragma unroll
      for (int v = 0; v < V; ++v) u[v] += value_at(c, v);
    }
#pragma unroll
    for (int j = 0; j < G; ++j) s_un[j] = u[j];
    s_count = static_cast<int>(u[G]);
  }
  __syncthreads();
  const int count = s_count;
  if (tid == 0) {
    const bool dense = static_cast<double>(count) > p.dense_above * n;
    p.thr[l] = dense ? kBinBelow : msel;
    p.dense[l] = dense ? 1 : 0;
    for (int j = 0; j < G; ++j) {
      const size_t at = static_cast<size_t>(l) * G + j;
      p.st_M[at] = s_M[j];
      p.st_S[at] = s_S[j];
      p.st_T[at] = static_cast<double>(s_tot[j]) / kFix;
      p.st_U[at] = dense ? p.st_T[at] : static_cast<double>(s_un[j]) / kFix;
    }
    p.sk_n[l] = n;
    p.ticket[l] = 0;
  }
}

// 3. Marks: bitmap word wi of list l = the tokens of [32 wi, 32 wi + 32) in the union (c(t)
// <= m*, or every token of a dense list), and counts[l][tile] its tile's bits for
// bitmap_emit. grid: (tiles, L), block: kBitmapTileWords threads.
__global__ void __launch_bounds__(kBitmapTileWords) sketch_marks_kernel(SketchParams p, uint32_t* bits, int words,
                                                                     int tiles, int* counts) {
  const int l = blockIdx.y, s = l / p.kv.n_kv_heads;
  const int n = p.kv.n_tokens[s];
  const int wi = blockIdx.x * kBitmapTileWords + threadIdx.x;
  const int msel = p.thr[l];
  const bool dense = p.dense[l] != 0;
  uint32_t x = 0;
  if (wi < words) {
    const int t = wi * 32;
    if (t < n) {
      if (dense) {
        x = n - t >= 32 ? 0xffffffffu : ((1u << (n - t)) - 1u);
      } else {
        const uint4* c4 = reinterpret_cast<const uint4*>(p.cbin + static_cast<size_t>(l) * p.ts + t);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const uint4 u = c4[v];
          const uint32_t pr[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int b = v * 8 + k * 2;
            if (t + b < n && static_cast<int>(pr[k] & 0xffffu) <= msel) x |= 1u << b;
            if (t + b + 1 < n && static_cast<int>(pr[k] >> 16) <= msel) x |= 1u << (b + 1);
          }
        }
      }
    }
    bits[static_cast<size_t>(l) * words + wi] = x;
  }
  const int total = block_sum<int>(__popc(x));
  if (threadIdx.x == 0) counts[static_cast<size_t>(l) * tiles + blockIdx.x] = total;
}

// Claims after attention: claim = A / (A + T - U) in the weights' normalised units, with A =
// exp(lse - M) / S the union's exact mass; 1 for dense lists. budget = the union's length.
// With out (rest_mean), o = w o + (1 - w) vsum / n, w = A / (A + T - U), for sparse lists.
// grid: n_seqs * n_q (one query head each), block: kClaimsThreads (the output's channels).
constexpr int kClaimsThreads = 64;
__global__ void __launch_bounds__(kClaimsThreads) sketch_claims_kernel(SketchParams p, const float* __restrict__ lse,
                                                                       const int32_t* __restrict__ len, float* claimed,
                                                                       int32_t* budget, float* out) {
  const int i = blockIdx.x;
  const int s = i / p.n_q, qh = i % p.n_q;
  const int l = s * p.kv.n_kv_heads + qh / p.group, j = qh % p.group;
  const bool sparse = p.dense[l] == 0;
  double w = 1.0;
  float claim = 1.0f;
  if (sparse) {
    const size_t at = static_cast<size_t>(l) * p.group + j;
    const double a = exp(static_cast<double>(lse[i]) - p.st_M[at]) / p.st_S[at];
    const double rest = fmax(0.0, p.st_T[at] - p.st_U[at]);
    w = a + rest > 0 ? a / (a + rest) : 1.0;
    claim = a + rest > 0 ? static_cast<float>(fmin(1.0, w)) : 0.0f;
  }
  if (threadIdx.x == 0) {
    claimed[i] = claim;
    budget[i] = len[l];
  }
  if (out == nullptr || !sparse) return;
  const int d = p.kv.head_dim;
  const double wr = (1.0 - w) / static_cast<double>(max(1, p.kv.n_tokens[s]));
  float* o = out + static_cast<size_t>(i) * d;
  const double* vs = p.vsum + static_cast<size_t>(l) * d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] = static_cast<float>(w * o[c] + wr * vs[c]);
}

template <class F>
void with_group(int g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

class SketchToppGpu final : public SparseDecoder {
 public:
  SketchToppGpu(const DeviceKvView& kv, int group, const SketchToppGpuOptions& o, const AttentionPlanOptions& po)
      : SparseDecoder(kv, group, po), o_(o) {
    base().phase_times = [this](void* stream) { return phase_times(stream); };
    CUMULUS_CHECK(o.p > 0 && o.p <= 1, "sketch_topp: p={} must be in (0, 1]", o.p);
    CUMULUS_CHECK(o.candidate_p > 0 && o.candidate_p <= 1, "sketch_topp: candidate_p={} must be in (0, 1]",
                  o.candidate_p);
    CUMULUS_CHECK(o.sinks >= 0 && o.recent >= 0 && o.min_context >= 0,
                  "sketch_topp: sinks={}, recent={} and min_context={} must be >= 0", o.sinks, o.recent,
                  o.min_context);
    CUMULUS_CHECK(o.dense_above >= 0 && o.dense_above <= 1, "sketch_topp: dense_above={} must be in [0, 1]",
                  o.dense_above);
    CUMULUS_CHECK(group >= 1 && group <= kMaxGroup, "sketch_topp: group={} must be in [1, {}] on the GPU", group,
                  kMaxGroup);
    CUMULUS_CHECK(o.weights_chunk >= 0 && o.weights_chunk % 512 == 0,
                  "sketch_topp: weights_chunk={} must be a multiple of 512", o.weights_chunk);
    CUMULUS_CHECK(o.hist_chunk >= 0 && o.hist_chunk % 512 == 0, "sketch_topp: hist_chunk={} must be a multiple of 512",
                  o.hist_chunk);
    Base& b = base();
    const int d = kv.head_dim;
    const size_t L = static_cast<size_t>(b.n_lists);
    const size_t nt = round_up(static_cast<size_t>(std::max(1, kv.max_tokens)), kTokensPerWarpStep);
    p_.kv = kv;
    p_.group = group;
    p_.n_q = b.n_q;
    p_.ts = static_cast<int>(nt);
    p_.codes_stride = nt / kSketchBlock * key_sketch_block_bytes(d);
    codes_ = DeviceBuffer(L * p_.codes_stride);
    codes_.fill_bytes(0);
    off_ = DeviceBuffer(L * nt * sizeof(uint16_t));
    step_ = DeviceBuffer(L * nt * sizeof(uint16_t));
    center_ = DeviceBuffer(L * d * sizeof(float));
    scale_ = DeviceBuffer(L * d * sizeof(float));
    sk_n_ = DeviceBuffer(L * sizeof(int32_t));
    sk_n_.fill_bytes(0);
    // Planning from the bound max_tokens, each list cut into equal chunks (multiples of 512
    // tokens) so that each pass's CTAs fit one wave of the device (as many CTAs per
    // multiprocessor as its registers and shared memory allow): a second, partial wave
    // measured as a tail of ~20% on the weights pass at 128K.
    hist_smem_ = static_cast<size_t>(kBins) * ((group + 2) / 2) * sizeof(unsigned long long);
    int occ1 = 1, occ2 = 1;
    with_group(group, [&](auto g) {
      constexpr int G = decltype(g)::value;
      const void* k2 = reinterpret_cast<const void*>(sketch_hist_kernel<G>);
      CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(hist_smem_)));
      // Two CTAs per multiprocessor need more than the default carveout of shared memory.
      CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(k2, cudaFuncAttributePreferredSharedMemoryCarveout,
                                              static_cast<int>(cudaSharedmemCarveoutMaxShared)));
      CUMULUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ2, k2, kHistThreads, hist_smem_));
      with_head_dim_type(d, kv.dtype, [&](auto dd, auto t) {
        constexpr int D = decltype(dd)::value;
        const void* k1 = reinterpret_cast<const void*>(sketch_weights_kernel<G, D, decltype(t)>);
        CUMULUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ1, k1, kWeightsThreads, 0));
      });
    });
    const int sms = sm_count();
    auto plan = [&](int ctas, size_t least) {
      const size_t per_list = std::max<size_t>(1, static_cast<size_t>(ctas) / L);
      return static_cast<int>(std::max<size_t>(least, round_up((nt + per_list - 1) / per_list, 512)));
    };
    p_.chunk1 = o.weights_chunk > 0 ? o.weights_chunk : plan(std::max(1, occ1) * sms, 512);
    // At least 8192 tokens per histogram CTA: each CTA's fixed work (zeroing its bins, the
    // thresholds, merging its bins into the list's with global atomics) measured more than
    // the parallelism it buys below that (128K batch 1: 29 vs 36 us with 4096).
    p_.chunk2 = o.hist_chunk > 0 ? o.hist_chunk : plan(std::max(1, occ2) * sms, 8192);
    p_.n_chunks1 = static_cast<int>((nt + p_.chunk1 - 1) / p_.chunk1);
    n_chunks2_ = static_cast<int>((nt + p_.chunk2 - 1) / p_.chunk2);
    logits_ = DeviceBuffer(L * nt * group * sizeof(int16_t));
    gmax_ = DeviceBuffer(L * (nt / kGroupTokens) * group * sizeof(float));
    part_m_ = DeviceBuffer(L * p_.n_chunks1 * group * sizeof(float));
    part_s_ = DeviceBuffer(L * p_.n_chunks1 * group * sizeof(float));
    cbin_ = DeviceBuffer(L * nt * sizeof(uint16_t));
    hist_ = DeviceBuffer(L * kBins * ((group + 2) / 2) * sizeof(unsigned long long));
    hist_.fill_bytes(0);
    ticket_ = DeviceBuffer(L * sizeof(uint32_t));
    ticket_.fill_bytes(0);
    thr_ = DeviceBuffer(L * sizeof(int32_t));
    dense_ = DeviceBuffer(L * sizeof(int32_t));
    dense_.fill_bytes(0);
    st_M_ = DeviceBuffer(L * group * sizeof(float));
    st_S_ = DeviceBuffer(L * group * sizeof(double));
    st_T_ = DeviceBuffer(L * group * sizeof(double));
    st_U_ = DeviceBuffer(L * group * sizeof(double));
    if (o.rest_mean) {
      vsum_ = DeviceBuffer(L * d * sizeof(double));
      vs_n_ = DeviceBuffer(L * sizeof(int32_t));
      p_.vsum = vsum_.as<double>();
      p_.vs_n = vs_n_.as<int32_t>();
    }
    p_.codes = codes_.as<uint8_t>();
    p_.off = off_.as<uint16_t>();
    p_.step = step_.as<uint16_t>();
    p_.center = center_.as<float>();
    p_.scale = scale_.as<float>();
    p_.sk_n = sk_n_.as<int32_t>();
    p_.logits = logits_.as<int16_t>();
    p_.gmax = gmax_.as<float>();
    p_.part_m = part_m_.as<float>();
    p_.part_s = part_s_.as<float>();
    p_.cbin = cbin_.as<uint16_t>();
    p_.hist = hist_.as<unsigned long long>();
    p_.ticket = ticket_.as<uint32_t>();
    p_.thr = thr_.as<int32_t>();
    p_.dense = dense_.as<int32_t>();
    p_.st_M = st_M_.as<float>();
    p_.st_S = st_S_.as<double>();
    p_.st_T = st_T_.as<double>();
    p_.st_U = st_U_.as<double>();
    p_.attn_scale = 1.0f / std::sqrt(static_cast<float>(d));
    p_.cp = o.candidate_p;
    p_.dense_above = o.dense_above;
    p_.sinks = o.sinks;
    p_.recent = o.recent;
    p_.min_context = o.min_context;
    p_.force_dense = o.p >= 1.0 ? 1 : 0;
    const size_t kv_bytes = static_cast<size_t>(kv.n_seqs) * kv.n_kv_heads * kv.max_tokens * d * 2 * 2;
    b.dense_step = o.dense_kv_bytes > 0 && kv_bytes <= o.dense_kv_bytes;
  }

  std::string name() const override { return "sketch_topp"; }
  double select_bytes_per_token() const override {  // codes, f16 offset and step; none at p = 1
    return base().dense_step || p_.force_dense ? 0.0 : static_cast<double>(key_sketch_token_bytes(base().kv.head_dim));
  }
  int select_min_tokens() const override { return o_.min_context; }

  void prefill(void* stream, const DevicePromptQueries& /*pq*/) override {
    const cudaStream_t st = as_stream(stream);
    const Base& b = base();
    const int d = b.kv.head_dim;
    if (b.kv.dtype == DType::f16) {
      sketch_channels_kernel<__half><<<b.n_lists, d, 0, st>>>(p_);
      CUMULUS_CUDA_LAUNCH("sketch_channels_kernel");
      sketch_encode_kernel<__half><<<dim3(ceil_div(p_.ts, 128), b.n_lists), 128, 0, st>>>(p_);
    } else {
      sketch_channels_kernel<__nv_bfloat16><<<b.n_lists, d, 0, st>>>(p_);
      CUMULUS_CUDA_LAUNCH("sketch_channels_kernel");
      sketch_encode_kernel<__nv_bfloat16><<<dim3(ceil_div(p_.ts, 128), b.n_lists), 128, 0, st>>>(p_);
    }
    CUMULUS_CUDA_LAUNCH("sketch_encode_kernel");
    if (o_.rest_mean) {
      CUMULUS_CUDA_CHECK(cudaMemsetAsync(vsum_.data(), 0, vsum_.size(), st));
      const dim3 grid(ceil_div(std::max(1, b.kv.max_tokens), kVsumChunk), b.n_lists);
      if (b.kv.dtype == DType::f16) {
        sketch_vsum_prefill_kernel<__half><<<grid, d, 0, st>>>(p_);
      } else {
        sketch_vsum_prefill_kernel<__nv_bfloat16><<<grid, d, 0, st>>>(p_);
      }
      CUMULUS_CUDA_LAUNCH("sketch_vsum_prefill_kernel");
    }
    prefilled_ = true;
  }

  void select(const float* q, void* stream) override {
    CUMULUS_CHECK(prefilled_, "sketch_topp: select() before prefill() (the sketch is built there)");
    last_q_ = q;
    if (base().dense_step) return;  // the cost rule: attend() runs the dense kernel
    const cudaStream_t st = as_stream(stream);
    if (o_.rest_mean) launch_vsum(st);  // the tokens appended since the last step
    launch_weights(q, st);
    launch_hist(st);
    launch_marks(st);
    base().emit(st);
  }

  // sparse_decoder_phase_times (bench_options.h), registered in the constructor.
  std::vector<std::pair<std::string, double>> phase_times(void* stream) const {
    // Each phase of the last select() again, alone between events, after one untimed run
    // of it (the caches as that run left them, no flush): where the selection's time goes.
    if (last_q_ == nullptr || base().dense_step) return {};
    const cudaStream_t st = as_stream(stream);
    auto* self = const_cast<SketchToppGpu*>(this);
    std::vector<std::pair<std::string, double>> r;
    EventTimer t;
    auto timed = [&](const char* name, auto&& before, auto&& fn) {
      before();
      fn();
      before();
      t.start(stream);
      fn();
      t.stop(stream);
      r.emplace_back(name, 1e3 * t.elapsed_ms());
    };
    const auto nothing = [] {};
    timed("weights", nothing, [&] { self->launch_weights(last_q_, st); });
    timed("hist", nothing, [&] { self->launch_hist(st); });
    timed("marks", nothing, [&] { self->launch_marks(st); });
    // The emit pass clears the bitmap it reads: the marks run (untimed) before each.
    timed("emit", [&] { self->launch_marks(st); }, [&] { self->base().emit(st); });
    return r;
  }

  const SketchParams& params() const { return p_; }

 protected:
  bool needs_lse() const override { return true; }
  void after_attend(const float* lse, float* out, float* /*mass*/, void* stream) override {
    Base& b = base();
    if (b.dense_step) return;  // stats() reports claim 1
    const int rows = b.kv.n_seqs * b.n_q;
    sketch_claims_kernel<<<rows, kClaimsThreads, 0, as_stream(stream)>>>(
        p_, lse, b.len.as<int32_t>(), b.claimed.as<float>(), b.budget.as<int32_t>(), o_.rest_mean ? out : nullptr);
    CUMULUS_CUDA_LAUNCH("sketch_claims_kernel");
  }

 private:
  void launch_weights(const float* q, cudaStream_t st) {
    const Base& b = base();
    with_group(b.group, [&](auto g) {
      constexpr int G = decltype(g)::value;
      with_head_dim_type(b.kv.head_dim, b.kv.dtype, [&](auto dd, auto t) {
        constexpr int D = decltype(dd)::value;
        sketch_weights_kernel<G, D, decltype(t)><<<dim3(p_.n_chunks1, b.n_lists), kWeightsThreads, 0, st>>>(p_, q);
      });
    });
    CUMULUS_CUDA_LAUNCH("sketch_weights_kernel");
  }
  void launch_vsum(cudaStream_t st) {
    const Base& b = base();
    if (b.kv.dtype == DType::f16) {
      sketch_vsum_kernel<__half><<<b.n_lists, b.kv.head_dim, 0, st>>>(p_);
    } else {
      sketch_vsum_kernel<__nv_bfloat16><<<b.n_lists, b.kv.head_dim, 0, st>>>(p_);
    }
    CUMULUS_CUDA_LAUNCH("sketch_vsum_kernel");
  }
  void launch_hist(cudaStream_t st) {
    const Base& b = base();
    with_group(b.group, [&](auto g) {
      constexpr int G = decltype(g)::value;
      sketch_hist_kernel<G><<<dim3(n_chunks2_, b.n_lists), kHistThreads, hist_smem_, st>>>(p_);
    });
    CUMULUS_CUDA_LAUNCH("sketch_hist_kernel");
  }
  void launch_marks(cudaStream_t st) {
    Base& b = base();
    const int tiles = bitmap_tiles(b.words);
    sketch_marks_kernel<<<dim3(tiles, b.n_lists), kBitmapTileWords, 0, st>>>(p_, b.bits.as<uint32_t>(), b.words, tiles,
                                                                           b.counts.as<int>());
    CUMULUS_CUDA_LAUNCH("sketch_marks_kernel");
  }

  SketchToppGpuOptions o_;
  SketchParams p_;
  int n_chunks2_ = 1;
  size_t hist_smem_ = 0;
  bool prefilled_ = false;
  const float* last_q_ = nullptr;
  DeviceBuffer codes_, off_, step_, center_, scale_, sk_n_, logits_, gmax_, part_m_, part_s_, cbin_, hist_,
      ticket_, thr_, dense_, st_M_, st_S_, st_T_, st_U_, vsum_, vs_n_;
};

}  // namespace

std::unique_ptr<SparseDecoder> make_sketch_topp_gpu(const DeviceKvView& kv, int group, const SketchToppGpuOptions& o,
                                                    const AttentionPlanOptions& plan) {
  return std::make_unique<SketchToppGpu>(kv, group, o, plan);
}

DeviceSketchCopy sketch_topp_gpu_download(const SparseDecoder& m, int seq, int h) {
  const auto* sk = dynamic_cast<const SketchToppGpu*>(&m);
  CUMULUS_CHECK(sk != nullptr, "sketch_topp_gpu_download: decoder '{}' is not sketch_topp", m.name());
  const SketchParams& p = sk->params();
  CUMULUS_CHECK(seq >= 0 && seq < p.kv.n_seqs && h >= 0 && h < p.kv.n_kv_heads,
                "sketch_topp_gpu_download: seq={} h={} outside the batch's {} x {}", seq, h, p.kv.n_seqs,
                p.kv.n_kv_heads);
  device_synchronize();
  const size_t l = static_cast<size_t>(seq) * p.kv.n_kv_heads + h;
  const int d = p.kv.head_dim;
  DeviceSketchCopy c;
  int32_t n = 0;
  memcpy_to_host(&n, p.sk_n + l, sizeof(n));
  c.n_tokens = n;
  const size_t blocks = (static_cast<size_t>(n) + kSketchBlock - 1) / kSketchBlock;
  c.codes.resize(blocks * key_sketch_block_bytes(d));
  c.offset.resize(blocks * kSketchBlock);
  c.step.resize(blocks * kSketchBlock);
  c.center.resize(d);
  c.scale.resize(d);
  if (blocks > 0) {
    memcpy_to_host(c.codes.data(), p.codes + l * p.codes_stride, c.codes.size());
    memcpy_to_host(c.offset.data(), p.off + l * p.ts, c.offset.size() * sizeof(uint16_t));
    memcpy_to_host(c.step.data(), p.step + l * p.ts, c.step.size() * sizeof(uint16_t));
  }
  memcpy_to_host(c.center.data(), p.center + l * d, d * sizeof(float));
  memcpy_to_host(c.scale.data(), p.scale + l * d, d * sizeof(float));
  return c;
}

// The registry's "sketch_topp" on the GPU (MethodInfo::gpu): groups of at most
// kSketchToppMaxGroup query heads; gpu_dense_mib is the GPU's cost rule.
void attach_sketch_topp_gpu(Registry& r) {
  r.attach_gpu("sketch_topp",
               {.make = [](const DeviceKvView& kv, const Shape& shape, int,
                           const Params& p) -> std::unique_ptr<SparseDecoder> {
                  SketchToppGpuOptions o;
                  options_read(p, o);
                  o.dense_kv_bytes = static_cast<size_t>(o.gpu_dense_mib) << 20;
                  return make_sketch_topp_gpu(kv, shape.group(), o);
                },
                .check = [](const Shape& shape, const Params&) {
                  CUMULUS_CHECK(shape.group() <= kSketchToppMaxGroup,
                                "--device cuda: sketch_topp takes at most {} query heads per kv head on the GPU, "
                                "this model has {}",
                                kSketchToppMaxGroup, shape.group());
                }});
}

}  // namespace cumulus::cuda
