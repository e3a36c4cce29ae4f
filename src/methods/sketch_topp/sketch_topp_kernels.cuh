// sketch_topp's GPU kernels (src/methods/sketch_topp/sketch_topp.cu has the design and the
// host side): the sketch's encoder, the value sums, the weights pass (integer mma on the
// codes), the histogram and threshold, the marks and the claims. Not installed.
#pragma once

#include "methods/sketch_topp/sketch_topp_params.cuh"

namespace cumulus::cuda {
namespace {

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

}  // namespace
}  // namespace cumulus::cuda
