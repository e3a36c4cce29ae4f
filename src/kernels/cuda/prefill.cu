// Prefill attention on the GPU (the GPU half of the prefill kernels): dense causal flash-style attention and
// block-sparse causal attention over per-(query head, query block) key-block lists, and
// FlexPrefill's probe (the FlexPrefill paper's "Query-Aware Sparse Pattern Determination", Algorithm 3 step 1:
// the last block's true attention projected onto columns and diagonals; block means for the
// estimate and Algorithm 4). Contract: include/cumulus/kernels/cuda_prefill.h.
//
// Attention kernel (FlashAttention-2 order): CTA = 4 warps = 64 query rows of one query head
// (16 rows per warp), grid (query heads, query tiles): heads vary fastest and the heaviest
// (last) query tiles of every head are issued first, so the causal triangle's long rows start
// early. The CTA streams 64-key tiles of K and V through two shared-memory stages with
// cp.async (the next tile loads while this one is computed); rows are 16-byte-chunk swizzled (chunk ^ (row & 7)) so ldmatrix reads 8 rows
// without bank conflicts. S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, f16
// operands, float32 accumulation; Q fragments stay in registers; P goes from the S
// accumulators straight into A fragments, rounded to f16). Online softmax in exp2 with the
// scale * log2(e) folded into one multiply. Masking only on the tile holding the diagonal
// and a ragged last tile. The dense kernel walks key tiles 0..qt; the sparse one walks the
// tiles of its listed blocks (block_size / 64 tiles each), the diagonal block clipped at qt.
// Since tiles are 64-aligned and the query tile is too, every walked tile holds key
// tile_start <= every row of the CTA, so no row sees an all-masked tile except through an
// empty list (handled: l = 0 gives out 0, lse -inf).
//
// Head dim 256 (Gemma 3) changes two things (`kQInSmem`, D > 128); 64 and 128 compile to the
// code above. Per thread the 64 x 256 CTA would hold Q's fragments (64 registers), the O
// accumulator (128 floats) and S (32 floats): over the 255-register limit. Of the two ways
// down, splitting O's columns over CTAs (gridDim.z = 2, each CTA computing the full S for its
// 128 output columns) keeps Q in registers but computes S twice, 1.5x the tensor-core work of
// the tile; we take the other, FlashAttention-2's for large head dims: Q stays in shared memory
// and each 16-dim k-step of S = Q K^T reloads its A fragment (one more ldmatrix.x4 per four
// of K), so no work is repeated and O keeps all 256 columns (128 floats per thread). Shared
// memory: Q, K and V tiles of 32 KB each would be 160 KB with two (K, V) stages, one CTA per
// SM; instead K and V have one buffer each and their loads interleave with the two products
// (FlashAttention-2's order): K(t+1) is fetched while softmax and P V(t) run, V(t+1) while
// S(t+1) does. 96 KB per CTA, so 2 CTAs (8 warps) share an SM, as at 128 (80 KB). ptxas
// (sm_90a): 245 registers dense, 251 sparse, no spills (128: 206 / 210; 64: 142 / 153).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/cuda/cuda_util.cuh"
#include "cumulus/core/error.h"
#include "cumulus/kernels/cuda_prefill.h"
#include "cumulus/kernels/flexprefill_select.h"

namespace cumulus::cuda {
namespace {

constexpr int kTile = 64;     // query rows per CTA and keys per tile
constexpr int kThreads = 128;  // 4 warps x 16 query rows

template <int D>
__host__ __device__ constexpr int tile_bytes() {
  return kTile * D * 2;
}
// Head dims above 128 keep Q in shared memory and K, V single-buffered (file comment).
template <int D>
__host__ __device__ constexpr bool q_in_smem() {
  return D > 128;
}
template <int D>
__host__ __device__ constexpr int attn_smem_bytes() {
  return q_in_smem<D>() ? 3 * tile_bytes<D>()   // Q + K + V
                        : 5 * tile_bytes<D>();  // Q + 2 stages of (K, V)
}

struct PrefillParams {
  const __half* q;  // [n_q_heads][n - q_row0][D]: rows q_row0 .. n - 1
  const __half* k;  // [n_kv][n][D]
  const __half* v;
  __half* out;      // [n_q_heads][out_rows][D], row i at out_row (i - out_row0)
  float* lse;       // [n_q_heads][out_rows] or null
  int n, group;
  int first_q_tile, n_q_tiles;  // query tiles [first_q_tile, first_q_tile + n_q_tiles)
  int out_row0, out_rows;
  int q_row0;  // the first row q holds (DevicePrefillArgs::q_first; the probe: 0)
  float qscale;  // scale * log2(e)
  // sparse only
  const int32_t* offsets;  // [n_q_heads * n_q_blocks + 1]
  const int32_t* blocks;
  int n_q_blocks, tiles_per_block;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of 16-byte chunk c of row r in a tile of D halves per row (swizzled).
template <int D>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>(r * (D * 2) + ((c ^ (r & 7)) << 4));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int sz = valid ? 16 : 0;  // 0: zero-fill (rows past n)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(sz));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows [row0, row0 + 64) of a [n][D] matrix into a swizzled tile; rows >= n read as zeros.
template <int D>
__device__ __forceinline__ void load_tile(uint32_t s, const __half* g, int row0, int n) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int i = threadIdx.x; i < kTile * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int row = row0 + r;
    const bool valid = row < n;
    cp_async16(s + swz<D>(r, c), g + static_cast<size_t>(valid ? row : 0) * D + c * 8, valid);
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <int D, bool kSparse>
__global__ void __launch_bounds__(kThreads, 2) prefill_attn_kernel(PrefillParams p) {
  constexpr bool kQInSmem = q_in_smem<D>();
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int qt = p.first_q_tile + (p.n_q_tiles - 1 - static_cast<int>(blockIdx.y));  // heaviest first
  const int qh = blockIdx.x;
  const int kvh = qh / p.group;
  const int n = p.n;
  const __half* Q = p.q + static_cast<size_t>(qh) * (n - p.q_row0) * D;
  const __half* K = p.k + static_cast<size_t>(kvh) * n * D;
  const __half* V = p.v + static_cast<size_t>(kvh) * n * D;
  const int q0 = qt * kTile;

  const uint32_t sQ = smem_u32(smem);
  const uint32_t sK0 = sQ + tile_bytes<D>(), sV0 = sQ + 2 * tile_bytes<D>();
  constexpr uint32_t kStage = kQInSmem ? 0 : 2 * tile_bytes<D>();  // one stage at D > 128

  // The key tiles this CTA walks.
  int n_iter;
  const int32_t* list = nullptr;
  int tpb = 1;
  if constexpr (kSparse) {
    tpb = p.tiles_per_block;
    const int qb = qt / tpb;
    const int li = qh * p.n_q_blocks + qb;
    const int beg = p.offsets[li], len = p.offsets[li + 1] - beg;
    list = p.blocks + beg;
    n_iter = len * tpb;
    if (len > 0 && list[len - 1] == qb) n_iter -= tpb - 1 - (qt - qb * tpb);  // diagonal block: tiles <= qt
  } else {
    n_iter = qt + 1;
  }
  auto tile_of = [&](int i) { return kSparse ? list[i / tpb] * tpb + i % tpb : i; };

  load_tile<D>(sQ, Q, q0 - p.q_row0, n - p.q_row0);
  if (n_iter > 0) {
    const int t0 = tile_of(0) * kTile;
    load_tile<D>(sK0, K, t0, n);
    if constexpr (kQInSmem) cp_async_commit();  // Q and K(0), then V(0) on its own
    load_tile<D>(sV0, V, t0, n);
  }
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t qf[kQInSmem ? 1 : D / 16][4];  // D > 128: the current k-step's only
  const int row_lo = q0 + warp * 16 + (lane >> 2);  // rows of c0,c1 (c2,c3: + 8)

  for (int it = 0; it < n_iter; ++it) {
    const int kt = tile_of(it);
    if constexpr (kQInSmem) {
      cp_async_wait<1>();  // Q and K(it) have landed; V(it) may be in flight
    } else if (it + 1 < n_iter) {
      const int t1 = tile_of(it + 1) * kTile;
      const uint32_t st = ((it + 1) & 1) * kStage;
      load_tile<D>(sK0 + st, K, t1, n);
      load_tile<D>(sV0 + st, V, t1, n);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (!kQInSmem) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk], sQ + swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      }
    }
    const uint32_t sK = sK0 + (it & 1) * kStage, sV = sV0 + (it & 1) * kStage;

    // S = Q K^T: [16 rows][64 keys] per warp as 8 n-tiles of 8 keys.
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      if constexpr (kQInSmem) ldsm_x4(qf[0], sQ + swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      const uint32_t(&a)[4] = qf[kQInSmem ? 0 : kk];
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ldsm_x4(b, sK + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
        mma16816(s[2 * np], a, b[0], b[1]);
        mma16816(s[2 * np + 1], a, b[2], b[3]);
      }
    }
    if constexpr (kQInSmem) {
      __syncthreads();  // every warp has read K(it): its buffer takes K(it + 1)
      if (it + 1 < n_iter) {
        load_tile<D>(sK0, K, tile_of(it + 1) * kTile, n);
        cp_async_commit();
      }
    }

    // Online softmax (base 2). Mask on the diagonal tile and a ragged last tile.
    const int k0 = kt * kTile;
    const bool mask = k0 + kTile - 1 > q0 || k0 + kTile > n;
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * p.qscale;
        if (mask) {
          const int key = k0 + j * 8 + (lane & 3) * 2 + (e & 1);
          const int row = row_lo + (e >> 1) * 8;
          if (key > row || key >= n) x = -INFINITY;
        }
        s[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float alpha[2], mu[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      mu[h] = mx[h] == -INFINITY ? 0.0f : mx[h];
      alpha[h] = exp2f(m[h] - mu[h]);  // m = -inf: 0
      m[h] = mx[h];
      l[h] *= alpha[h];
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha[0];
      o[i][1] *= alpha[0];
      o[i][2] *= alpha[1];
      o[i][3] *= alpha[1];
    }
    uint32_t pf[4][4];  // P as A fragments, one per 16-key step
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float p0 = exp2f(s[j][0] - mu[0]), p1 = exp2f(s[j][1] - mu[0]);
      const float p2 = exp2f(s[j][2] - mu[1]), p3 = exp2f(s[j][3] - mu[1]);
      l[0] += p0 + p1;
      l[1] += p2 + p3;
      pf[j >> 1][(j & 1) * 2] = pack_half2(p0, p1);
      pf[j >> 1][(j & 1) * 2 + 1] = pack_half2(p2, p3);
    }

    if constexpr (kQInSmem) {
      if (it + 1 < n_iter) {
        cp_async_wait<1>();  // V(it); K(it + 1) may be in flight
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
    }

    // O += P V: 4 k-steps of 16 keys, D / 8 n-tiles of 8 dims.
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldsm_x4_t(b, sV + swz<D>(ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dp * 2 + (lane >> 4)));
        mma16816(o[2 * dp], pf[ks], b[0], b[1]);
        mma16816(o[2 * dp + 1], pf[ks], b[2], b[3]);
      }
    }
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
    if constexpr (kQInSmem) {
      if (it + 1 < n_iter) {
        load_tile<D>(sV0, V, tile_of(it + 1) * kTile, n);
        cp_async_commit();
      }
    }
  }
  cp_async_wait<0>();

  // Normalise and write rows < n.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_lo + h * 8;
    if (row >= n) continue;
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
    __half* orow = p.out + (static_cast<size_t>(qh) * p.out_rows + (row - p.out_row0)) * D;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const __half2 v2 = __floats2half2_rn(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
      *reinterpret_cast<__half2*>(orow + i * 8 + (lane & 3) * 2) = v2;
    }
    if (p.lse != nullptr && (lane & 3) == 0)
      p.lse[static_cast<size_t>(qh) * p.out_rows + (row - p.out_row0)] =
          l[h] > 0.0f ? (m[h] + log2f(l[h])) * kLn2 : -INFINITY;
  }
}

template <int D, bool kSparse>
void launch_attn(const PrefillParams& p, int n_q_heads, cudaStream_t stream) {
  // Shared memory above 48 KB needs the opt-in, once per instantiation (a thread-safe static;
  // the current device at the first call).
  static const bool configured = [] {
    CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(prefill_attn_kernel<D, kSparse>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, attn_smem_bytes<D>()));
    return true;
  }();
  (void)configured;
  const dim3 grid(static_cast<unsigned>(n_q_heads), static_cast<unsigned>(p.n_q_tiles));  // heads vary fastest
  prefill_attn_kernel<D, kSparse><<<grid, kThreads, attn_smem_bytes<D>(), stream>>>(p);
  CUMULUS_CUDA_LAUNCH("prefill_attn_kernel");
}

PrefillParams base_params(const DevicePrefillArgs& a) {
  PrefillParams p{};
  p.q = static_cast<const __half*>(a.q);
  p.k = static_cast<const __half*>(a.k);
  p.v = static_cast<const __half*>(a.v);
  p.out = static_cast<__half*>(a.out);
  p.lse = a.lse;
  p.n = a.n;
  p.group = a.n_q_heads / a.n_kv_heads;
  p.first_q_tile = a.q_first / kTile;
  p.n_q_tiles = (a.n + kTile - 1) / kTile - p.first_q_tile;
  p.q_row0 = a.q_first;
  p.out_row0 = a.q_first;
  p.out_rows = a.n - a.q_first;
  p.qscale = a.scale * kLog2e;
  return p;
}

template <bool kSparse>
void dispatch_attn(const PrefillParams& p, int head_dim, int n_q_heads, cudaStream_t s) {
  if (head_dim == 64) {
    launch_attn<64, kSparse>(p, n_q_heads, s);
  } else if (head_dim == 128) {
    launch_attn<128, kSparse>(p, n_q_heads, s);
  } else {
    launch_attn<256, kSparse>(p, n_q_heads, s);
  }
}

// ---- FlexPrefill probe -------------------------------------------------------------------

constexpr int kProbeKeys = 64;      // keys per CTA
constexpr int kProbeThreads = 256;  // 4 groups of 64 threads; thread = (key, row group)

// Projection of the last L rows (positions n - L + i) onto columns and diagonals for one
// query head per blockIdx.y and 64 keys per blockIdx.x: p = exp(scale q_i.k_j - lse_i) for
// j <= p_i; vertical[j] = sum_i p (one owner per j: a fixed-order sum), slash[p_i - j] += p
// (float atomics: the order of additions varies between runs at float32 rounding).
// Shared memory: Q rows [L][D] float32, K tile [64][D + 1] float32 (padded: threads of a
// warp read different keys at the same d).
template <int D>
__global__ void __launch_bounds__(kProbeThreads) probe_projection_kernel(const __half* __restrict__ q,
                                                                          const __half* __restrict__ k, int n, int L,
                                                                          int group, float scale,
                                                                          const float* __restrict__ lse,
                                                                          int lse_stride,
                                                                          float* __restrict__ vertical,
                                                                          float* __restrict__ slash) {
  extern __shared__ float psm[];
  float* sq = psm;                          // [L][D]
  float* sk = psm + L * D;                  // [64][D + 1]
  float* sred = sk + kProbeKeys * (D + 1);  // [4][64]
  const int qh = blockIdx.y, kvh = qh / group;
  const int j0 = blockIdx.x * kProbeKeys;
  const int first = n - L;
  // Keys past every row's position (j > n - 1) do not exist; the block may be ragged.
  for (int i = threadIdx.x; i < L * D; i += kProbeThreads)
    sq[i] = __half2float(q[(static_cast<size_t>(qh) * n + first + i / D) * D + i % D]);
  for (int i = threadIdx.x; i < kProbeKeys * D; i += kProbeThreads) {
    const int j = j0 + i / D;
    sk[(i / D) * (D + 1) + i % D] = j < n ? __half2float(k[(static_cast<size_t>(kvh) * n + j) * D + i % D]) : 0.0f;
  }
  __syncthreads();
  const int kj = threadIdx.x % kProbeKeys, grp = threadIdx.x / kProbeKeys;
  const int j = j0 + kj;
  float vsum = 0.0f;
  if (j < n) {
    // Rows i = grp, grp + 4, ...: 8 at a time for register reuse of the key element.
    for (int i0 = grp; i0 < L; i0 += 32) {
      float acc[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) acc[r] = 0.0f;
      for (int d = 0; d < D; ++d) {
        const float kd = sk[kj * (D + 1) + d];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const int i = i0 + 4 * r;
          if (i < L) acc[r] += sq[i * D + d] * kd;
        }
      }
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int i = i0 + 4 * r;
        if (i >= L) continue;
        const int pos = first + i;
        if (j > pos) continue;
        const float pr = expf(acc[r] * scale - lse[static_cast<size_t>(qh) * lse_stride + i]);
        vsum += pr;
        atomicAdd(&slash[static_cast<size_t>(qh) * n + (pos - j)], pr);
      }
    }
  }
  sred[grp * kProbeKeys + kj] = vsum;
  __syncthreads();
  if (grp == 0 && j < n)
    vertical[static_cast<size_t>(qh) * n + j] =
        sred[kj] + sred[kProbeKeys + kj] + sred[2 * kProbeKeys + kj] + sred[3 * kProbeKeys + kj];
}

// Shared memory of probe_projection_kernel for L rows of head_dim D (bytes).
size_t probe_smem_bytes(int L, int D) {
  return (static_cast<size_t>(L) * D + kProbeKeys * (D + 1) + 4 * kProbeKeys) * 4;
}

template <int D>
void launch_probe(const __half* q, const __half* k, int n, int n_q_heads, int L, int group, float scale,
                  const float* lse, int lse_stride, float* vertical, float* slash, cudaStream_t s) {
  const size_t smem = probe_smem_bytes(L, D);
  CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(probe_projection_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((n + kProbeKeys - 1) / kProbeKeys), static_cast<unsigned>(n_q_heads));
  probe_projection_kernel<D><<<grid, kProbeThreads, smem, s>>>(q, k, n, L, group, scale, lse, lse_stride, vertical,
                                                               slash);
  CUMULUS_CUDA_LAUNCH("probe_projection_kernel");
}

// Mean of rows [row0 + b * B, min(n, row0 + (b + 1) * B)) of head blockIdx.y of a
// [heads][n][D] matrix (blockIdx.x = b), one thread per dimension, float32 sums in row order.
//   out: [heads][gridDim.x][D]
__global__ void block_mean_kernel(const __half* __restrict__ x, int n, int D, int row0, int B, float* __restrict__ out) {
  const int b = blockIdx.x, h = blockIdx.y, nb = gridDim.x;
  const int r0 = row0 + b * B, r1 = min(n, r0 + B);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float s = 0.0f;
    for (int r = r0; r < r1; ++r) s += __half2float(x[(static_cast<size_t>(h) * n + r) * D + d]);
    out[(static_cast<size_t>(h) * nb + b) * D + d] = s / static_cast<float>(r1 - r0);
  }
}

}  // namespace

void DevicePrefillArgs::validate(const char* fn) const {
  if (q == nullptr || k == nullptr || v == nullptr || out == nullptr)
    throw Error(fmt::format("{}: q, k, v and out must be non-null device pointers", fn));
  if (n < 1) throw Error(fmt::format("{}: n={} must be >= 1", fn, n));
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    throw Error(fmt::format("{}: head_dim={} is not built for the CUDA prefill kernels (64, 128, 256)", fn, head_dim));
  if (n_kv_heads < 1 || n_q_heads < 1 || n_q_heads % n_kv_heads != 0)
    throw Error(fmt::format("{}: n_q_heads={} must be a positive multiple of n_kv_heads={}", fn, n_q_heads,
                            n_kv_heads));
  if (!(scale > 0.0f) || !std::isfinite(scale)) throw Error(fmt::format("{}: scale={} must be finite and > 0", fn, scale));
  if (q_first < 0 || q_first >= n || q_first % kTile != 0)
    throw Error(fmt::format("{}: q_first={} must be a multiple of {} in [0, n={})", fn, q_first, kTile, n));
  if (n > 65535 * kTile)  // query tiles are the grid's y dimension
    throw Error(fmt::format("{}: n={} exceeds the kernel's {} tokens", fn, n, 65535 * kTile));
}

DeviceBlockLayout DeviceBlockLayout::upload(const BlockSparseLayout& L, int n) {
  const char* fn = "DeviceBlockLayout::upload";
  if (L.block_size < kTile || L.block_size % kTile != 0)
    throw Error(fmt::format("{}: block_size={} must be a positive multiple of {} on the GPU", fn, L.block_size, kTile));
  if (L.first_q_block != 0)
    throw Error(fmt::format("{}: first_q_block={} must be 0 (the GPU prefills the whole prompt)", fn, L.first_q_block));
  const int nqb = (n + L.block_size - 1) / L.block_size;
  if (n < 1 || L.n_q_blocks != nqb)
    throw Error(fmt::format("{}: n_q_blocks={} does not match n={} with block_size={} ({} blocks)", fn, L.n_q_blocks, n,
                            L.block_size, nqb));
  const size_t n_lists = static_cast<size_t>(L.n_q_heads) * nqb;
  if (L.n_q_heads < 1 || L.offsets.size() != n_lists + 1 || L.offsets[0] != 0 ||
      static_cast<size_t>(L.offsets.back()) != L.blocks.size())
    throw Error(fmt::format("{}: offsets must hold n_q_heads * n_q_blocks + 1 = {} entries from 0 to blocks.size()={}",
                            fn, n_lists + 1, L.blocks.size()));
  for (size_t li = 0; li < n_lists; ++li) {
    const int r = static_cast<int>(li % nqb);
    if (L.offsets[li + 1] < L.offsets[li]) throw Error(fmt::format("{}: offsets decrease at list {}", fn, li));
    for (int32_t e = L.offsets[li]; e < L.offsets[li + 1]; ++e) {
      const int32_t b = L.blocks[e];
      if (b < 0 || b > r || (e > L.offsets[li] && b <= L.blocks[e - 1]))
        throw Error(fmt::format("{}: list {} (query head {}, query block {}) entry {} = {} is not sorted, unique and "
                                "in [0, {}]",
                                fn, li, li / nqb, r, e - L.offsets[li], b, r));
    }
  }
  DeviceBlockLayout d;
  d.offsets_ = to_device(L.offsets);
  d.blocks_ = L.blocks.empty() ? DeviceBuffer(4) : to_device(L.blocks);
  d.block_size_ = L.block_size;
  d.n_q_blocks_ = nqb;
  d.n_q_heads_ = L.n_q_heads;
  d.n_entries_ = static_cast<int64_t>(L.blocks.size());
  return d;
}

void attention_prefill_dense(const DevicePrefillArgs& a, void* stream) {
  a.validate("cuda::attention_prefill_dense");
  dispatch_attn<false>(base_params(a), a.head_dim, a.n_q_heads, as_stream(stream));
}

void attention_prefill_block_sparse(const DevicePrefillArgs& a, const DeviceBlockLayout& layout, void* stream) {
  const char* fn = "cuda::attention_prefill_block_sparse";
  a.validate(fn);
  if (a.q_first != 0) throw Error(fmt::format("{}: q_first={} must be 0 (the whole prompt)", fn, a.q_first));
  const int nqb = (a.n + layout.block_size() - 1) / std::max(1, layout.block_size());
  if (layout.offsets() == nullptr || layout.n_q_heads() != a.n_q_heads || layout.n_q_blocks() != nqb)
    throw Error(fmt::format("{}: layout of {} query heads x {} query blocks does not match n={}, n_q_heads={}", fn,
                            layout.n_q_heads(), layout.n_q_blocks(), a.n, a.n_q_heads));
  PrefillParams p = base_params(a);
  p.offsets = layout.offsets();
  p.blocks = layout.blocks();
  p.n_q_blocks = nqb;
  p.tiles_per_block = layout.block_size() / kTile;
  dispatch_attn<true>(p, a.head_dim, a.n_q_heads, as_stream(stream));
}

FlexPrefillProbe::FlexPrefillProbe(int n_, int n_q_heads_, int n_kv_heads_, int head_dim_, int block_size_)
    : n(n_),
      n_q_heads(n_q_heads_),
      n_kv_heads(n_kv_heads_),
      head_dim(head_dim_),
      block_size(block_size_),
      n_blocks((n_ + block_size_ - 1) / std::max(1, block_size_)),
      n_rows(std::min(n_, block_size_)) {
  if (n < 1 || block_size < 1 || n_q_heads < 1 || n_kv_heads < 1)
    throw Error(fmt::format("FlexPrefillProbe: n={}, block_size={}, heads {}/{} must be >= 1", n, block_size,
                            n_q_heads, n_kv_heads));
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    throw Error(fmt::format("FlexPrefillProbe: head_dim={} is not built for the CUDA prefill kernels (64, 128, 256)",
                            head_dim));
  // The projection kernel holds the L probe rows in shared memory as float32: L * head_dim * 4
  // bytes plus a 64-key tile (at 256, block_size 128 takes 193 KB, under an H100's 227 KB).
  if (n_rows > max_rows(head_dim)) {
    int dev = 0, optin = 0;
    CUMULUS_CUDA_CHECK(cudaGetDevice(&dev));
    CUMULUS_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    throw Error(fmt::format("FlexPrefillProbe: block_size={} gives {} probe rows of head_dim {}: {} bytes of shared "
                            "memory, the device allows {} (at most {} rows)",
                            block_size, n_rows, head_dim, probe_smem_bytes(n_rows, head_dim), optin,
                            max_rows(head_dim)));
  }
  const size_t nq = static_cast<size_t>(n_q_heads);
  vertical_ = DeviceBuffer(nq * n * 4);
  slash_ = DeviceBuffer(nq * n * 4);
  kmean_ = DeviceBuffer(static_cast<size_t>(n_kv_heads) * n_blocks * head_dim * 4);
  qmean_ = DeviceBuffer(nq * n_blocks * head_dim * 4);
  qprobe_ = DeviceBuffer(nq * head_dim * 4);
  // The dense kernel over the last query tiles writes rows from a 64-aligned start.
  const int row0 = ((n - n_rows) / kTile) * kTile;
  lse_ = DeviceBuffer(nq * (n - row0) * 4);
  scratch_out_ = DeviceBuffer(nq * (n - row0) * head_dim * 2);
}

int FlexPrefillProbe::max_rows(int head_dim) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    throw Error(fmt::format("FlexPrefillProbe::max_rows: head_dim={} is not built for the CUDA prefill kernels (64, "
                            "128, 256)",
                            head_dim));
  int dev = 0, optin = 0;
  CUMULUS_CUDA_CHECK(cudaGetDevice(&dev));
  CUMULUS_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const size_t avail = static_cast<size_t>(optin), fixed = probe_smem_bytes(0, head_dim);
  return avail > fixed ? static_cast<int>((avail - fixed) / (4 * static_cast<size_t>(head_dim))) : 0;
}

size_t FlexPrefillProbe::device_bytes(int n, int n_q_heads, int n_kv_heads, int head_dim, int block_size) {
  // The buffers of the constructor below.
  const size_t nq = static_cast<size_t>(n_q_heads), nb = (n + block_size - 1) / std::max(1, block_size);
  const int rows = std::min(n, block_size), row0 = ((n - rows) / kTile) * kTile;
  const size_t tail = static_cast<size_t>(n - row0);
  return 4 * (2 * nq * n + (static_cast<size_t>(n_kv_heads) + nq) * nb * head_dim + nq * head_dim + nq * tail) +
         2 * nq * tail * head_dim;
}

void FlexPrefillProbe::run(const DevicePrefillArgs& a, void* stream) {
  const char* fn = "FlexPrefillProbe::run";
  a.validate(fn);
  if (a.q_first != 0) throw Error(fmt::format("{}: q_first={} must be 0 (the whole prompt)", fn, a.q_first));
  if (a.n != n || a.n_q_heads != n_q_heads || a.n_kv_heads != n_kv_heads || a.head_dim != head_dim)
    throw Error(fmt::format("{}: args (n={}, heads {}/{}, head_dim {}) differ from the probe's ({}, {}/{}, {})", fn,
                            a.n, a.n_q_heads, a.n_kv_heads, a.head_dim, n, n_q_heads, n_kv_heads, head_dim));
  cudaStream_t s = as_stream(stream);
  const int L = n_rows, row0 = ((n - L) / kTile) * kTile;
  // 1. lse of the probe rows: the dense kernel over query tiles [row0 / 64, end).
  PrefillParams p = base_params(a);
  p.first_q_tile = row0 / kTile;
  p.n_q_tiles = (n + kTile - 1) / kTile - p.first_q_tile;
  p.out = scratch_out_.as<__half>();
  p.lse = lse_.as<float>();
  p.out_row0 = row0;
  p.out_rows = n - row0;
  dispatch_attn<false>(p, head_dim, n_q_heads, s);
  // 2. projection: the probe row i's lse sits at lse_[qh * (n - row0) + (n - L - row0) + i].
  CUMULUS_CUDA_CHECK(cudaMemsetAsync(slash_.data(), 0, slash_.size(), s));
  const int group = n_q_heads / n_kv_heads;
  const float* lse_rows = lse_.as<float>() + (n - L - row0);
  const auto* qp = static_cast<const __half*>(a.q);
  const auto* kp = static_cast<const __half*>(a.k);
  float* vp = vertical_.as<float>();
  float* sp = slash_.as<float>();
  if (head_dim == 64) {
    launch_probe<64>(qp, kp, n, n_q_heads, L, group, a.scale, lse_rows, n - row0, vp, sp, s);
  } else if (head_dim == 128) {
    launch_probe<128>(qp, kp, n, n_q_heads, L, group, a.scale, lse_rows, n - row0, vp, sp, s);
  } else {
    launch_probe<256>(qp, kp, n, n_q_heads, L, group, a.scale, lse_rows, n - row0, vp, sp, s);
  }
  // 3. block means of K and Q, and the mean of the probe rows [n - L, n).
  block_mean_kernel<<<dim3(static_cast<unsigned>(n_blocks), static_cast<unsigned>(n_kv_heads)), head_dim, 0, s>>>(
      kp, n, head_dim, 0, block_size, kmean_.as<float>());
  CUMULUS_CUDA_LAUNCH("block_mean_kernel");
  block_mean_kernel<<<dim3(static_cast<unsigned>(n_blocks), static_cast<unsigned>(n_q_heads)), head_dim, 0, s>>>(
      qp, n, head_dim, 0, block_size, qmean_.as<float>());
  CUMULUS_CUDA_LAUNCH("block_mean_kernel");
  block_mean_kernel<<<dim3(1, static_cast<unsigned>(n_q_heads)), head_dim, 0, s>>>(qp, n, head_dim, n - L, L,
                                                                                   qprobe_.as<float>());
  CUMULUS_CUDA_LAUNCH("block_mean_kernel");
}

FlexPrefillProbe::~FlexPrefillProbe() {
  if (host_ != nullptr) cudaFreeHost(host_);
}

void FlexPrefillProbe::download(void* stream) {
  cudaStream_t s = as_stream(stream);
  DeviceBuffer* parts[] = {&vertical_, &slash_, &kmean_, &qmean_, &qprobe_};
  size_t total = 0;
  for (const DeviceBuffer* b : parts) total += b->size();
  if (host_ == nullptr) CUMULUS_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_), total));
  std::span<const float>* views[] = {&vertical, &slash, &k_block_mean, &q_block_mean, &q_probe_mean};
  size_t off = 0;
  for (int i = 0; i < 5; ++i) {
    CUMULUS_CUDA_CHECK(cudaMemcpyAsync(host_ + off, parts[i]->data(), parts[i]->size(), cudaMemcpyDeviceToHost, s));
    *views[i] = std::span<const float>(host_ + off, parts[i]->size() / 4);
    off += parts[i]->size() / 4;
  }
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
}

BlockSparseLayout flexprefill_select(const flexprefill::Config& c, const FlexPrefillProbe& pr, ThreadPool& pool,
                                     std::vector<flexprefill::HeadSelection>* heads) {
  flexprefill::validate(c);
  if (c.block_size != pr.block_size)
    throw Error(fmt::format("cuda::flexprefill_select: config block_size={} differs from the probe's {}", c.block_size,
                            pr.block_size));
  const flexprefill::Geometry g{0, pr.n, c.block_size};
  const int group = pr.n_q_heads / pr.n_kv_heads, D = pr.head_dim;
  std::vector<flexprefill::HeadSelection> sel(static_cast<size_t>(pr.n_q_heads));
  const bool all = flexprefill::selects_everything(c, g);
  if (!all && pr.vertical.empty())
    throw Error("cuda::flexprefill_select: the probe has not been downloaded (FlexPrefillProbe::download)");
  pool.parallel_for(pr.n_q_heads, [&](int64_t qh, int) {
    flexprefill::HeadInputs in;
    in.head_dim = D;
    if (!all) {
      const size_t h = static_cast<size_t>(qh);
      in.vertical = pr.vertical.data() + h * pr.n;
      in.slash = pr.slash.data() + h * pr.n;
      in.k_block_mean = pr.k_block_mean.data() + (h / group) * pr.n_blocks * D;
      in.q_block_mean = pr.q_block_mean.data() + h * pr.n_blocks * D;
      in.q_probe_mean = pr.q_probe_mean.data() + h * D;
    }
    sel[static_cast<size_t>(qh)] = flexprefill::select_head(c, g, in);
  });
  BlockSparseLayout lay = flexprefill::layout_of(g, sel);
  if (heads != nullptr) *heads = std::move(sel);
  return lay;
}

}  // namespace cumulus::cuda
