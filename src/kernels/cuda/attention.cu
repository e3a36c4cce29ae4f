// Paged decode attention on the GPU, dense and sparse over per-kv-head token lists, for a
// batch of sequences (the CPU contract of kernels/attention.h with a batch dimension).
//
// Work split (split-KV, "flash decoding"): a *list* is one (sequence, kv head, head tile):
// the token range [0, n_tokens) when dense, or the kv head's index list when sparse. Every
// CTA of the one launch reads all list lengths, cuts every list into equal chunks sized so
// that the chunks of all lists together fill one balanced wave of the GPU (attn_plan) and
// takes chunk number blockIdx.x. Lists of different
// lengths (heads that selected more tokens than others) simply get more chunks: Tactic
// section 4.6's per-kv-head subrequests, which turn head imbalance into sequence imbalance,
// planned on the device so a decode step needs no host round trip. A CTA writes a partial
// (max m, sum l, unnormalised output o) per query head; the last CTA of a list to finish
// (a ticket counter) merges the list's partials by log-sum-exp and writes out and lse.
//
// Work stealing (a benchmarks' option, AttentionPlanBenchOptions::steal in bench_options.h;
// off by default: measured slower): equal chunks do not finish together (the
// multiprocessors do not get equal shares of the memory bandwidth; measured on an H100, 128K tokens, batch 1: the
// SMs were idle 20% of the kernel's time while the last chunks ran). So a chunk is only a
// CTA's starting point: its warps claim units of kUnitBlocks blocks from a per-chunk
// cursor (atomicAdd), and once their own chunk is used up they claim units from the other
// chunks of the same list. A list then finishes when its last unit does, on whichever CTAs;
// each CTA's partial covers the units it took (the log-sum-exp merge does not care which).
// The merge CTA resets the list's cursors for the next launch.
//
// Inside a CTA each warp takes blocks of tokens in turn and streams them through its own
// shared-memory ring with cp.async, kStages blocks in flight (attn_pipeline). Each K/V row
// is read from memory once for all query heads of its kv head in the tile (GQA): up to
// G = 8 heads per tile, larger groups take several tiles. Two kernels compute a block:
//   - SIMT: CUDA-core FMAs, 16 bytes of a row per lane, dot products reduced by shuffles;
//   - tensor cores: mma.sync m16n8k16 with the block's 16 tokens as the rows and the tile's
//     heads as the columns, Q and the softmax weights split into 16-bit parts so the result
//     keeps float32 accuracy.
// With a GQA group of 4 the SIMT kernel needs ~4 FMAs per byte read, about what an H200's
// CUDA cores can feed at its memory bandwidth; the tensor-core kernel leaves them idle.
// Scores are scaled by scale * log2(e) once in q so the online softmax uses exp2.
#include <algorithm>
#include <climits>
#include <cmath>

#include "core/check.h"
#include "bench_options.h"
#include "cuda_internal.cuh"
#include "cumulus/kernels/cuda.h"

namespace cumulus::cuda {
namespace {

constexpr int kMaxLists = 512;  // (sequence, kv head, head tile) lists per launch
constexpr int kMaxWarps = 8;

struct AttnParams {
  const void* k;
  const void* v;
  const int32_t* page_table;  // [n_seqs][n_kv][max_pages]
  const int32_t* n_tokens;    // [n_seqs]
  int n_kv, page_shift, max_pages;
  int group, n_tiles, n_lists;
  float qscale;               // scale * log2(e)
  const float* q;             // [n_seqs][n_q][D]
  const int32_t* idx;         // [n_seqs][n_kv][idx_stride] or null
  const int32_t* idx_len;     // [n_seqs][n_kv]
  int idx_stride;
  float* out;                 // [n_seqs][n_q][D]
  float* lse;                 // [n_seqs][n_q]
  const float* lse_ref;
  float* mass;
  float* part_o;              // [max_items][G][D]
  float* part_m;              // [max_items][G]
  float* part_l;              // [max_items][G]
  int* tickets;               // [n_lists]
  int* cursor;                // [max_items] entries claimed from each chunk (work stealing)
  unsigned long long* timeline;  // [max_items][kAttnTimelinePoints] (%globaltimer, ns) or null
  int* error;                 // bit 0: index out of range; bit 1: list longer than stride
  int target_ctas, min_chunk, max_chunk;
  int steal;                  // 1: warps claim units of work from the list's chunks
  int prefetch;               // L2 fetch size hint of the K/V copies: 0, 128 or 256 bytes
};

constexpr int kUnitBlocks = 4;  // blocks per claimed unit of work (work stealing)

// SIMT kernel: a K or V row of D 16-bit values is 16 bytes per lane over D/8 lanes, so one
// warp load covers 32/(D/8) tokens; a lane handles U rows per block.
template <int D, int G>
struct AttnShape {
  static constexpr int kRowLanes = D / 8;              // lanes covering one row (16 B each)
  static constexpr int kTokPerLoad = 32 / kRowLanes;   // tokens one warp load covers
  static constexpr int kUnroll = G <= 4 ? 8 : 4;       // rows per lane per block (K and V each)
  static constexpr int kBlock = kTokPerLoad * kUnroll; // tokens per warp block
};

// Tensor-core kernel: 16 tokens per block (the 16 rows of mma.m16n8k16).
template <int D>
struct MmaShape {
  static constexpr int kRowLanes = D / 8;
  static constexpr int kTokPerLoad = 32 / kRowLanes;
  static constexpr int kBlock = 16;
  static constexpr int kUnroll = kBlock / kTokPerLoad;
};

constexpr int kStages = 3;  // blocks in flight per warp

// One stage of a warp's ring: K [BT][D + 8] then V [BT][D + 8] (16-byte padding per row:
// ldmatrix reads 8 rows at once without bank conflicts).
template <int D>
__host__ __device__ constexpr int ring_row() {
  return D + 8;
}
template <int D, int BT>
__host__ __device__ constexpr int stage_bytes() {
  return 2 * BT * ring_row<D>() * 2;
}

__device__ __forceinline__ int attn_list_len(const AttnParams& p, int l) {
  const int seq = l / (p.n_kv * p.n_tiles);
  const int h = (l / p.n_tiles) % p.n_kv;
  if (p.idx == nullptr) return max(0, p.n_tokens[seq]);
  int len = p.idx_len[seq * p.n_kv + h];
  if (len < 0 || len > p.idx_stride) {
    atomicOr(p.error, 2);
    len = min(max(len, 0), p.idx_stride);
  }
  return len;
}

// Writes the final out/lse/mass of query head (tile * G + g) of list l's kv head: 4
// consecutive dimensions d .. d + 3 (o4: unnormalised), lse and mass with d == 0.
template <int D, int G>
__device__ __forceinline__ void attn_write_final(const AttnParams& p, int seq, int h, int tile, int g, int d, float m,
                                                 float l, float4 o4) {
  const int qi = tile * G + g;
  if (qi >= p.group) return;
  const size_t qh = static_cast<size_t>(seq) * p.n_kv * p.group + static_cast<size_t>(h) * p.group + qi;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  *reinterpret_cast<float4*>(p.out + qh * D + d) = make_float4(o4.x * inv, o4.y * inv, o4.z * inv, o4.w * inv);
  if (d == 0) {
    const float lse = l > 0.0f ? (m + log2f(l)) * kLn2 : -INFINITY;
    p.lse[qh] = lse;
    if (p.mass != nullptr && p.lse_ref != nullptr) p.mass[qh] = expf(lse - p.lse_ref[qh]);
  }
}

// cp.async (sm_80+): 16 bytes global -> shared without registers; src_size 0 fills zeros.
// prefetch: the L2 fetch size on a miss hinted to the memory system (PTX .L2::128B and
// .L2::256B: the whole line or pair of lines comes from DRAM at once instead of the 32-byte
// sectors the lanes ask for one by one; cuBLAS and cuDNN kernels load this way). Warp-uniform.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid, int prefetch) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  if (prefetch == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
  else if (prefetch == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Benchmarks' timeline: %globaltimer at point `which` (AttnTimelinePoint) of the CTA.
__device__ __forceinline__ void attn_timeline(const AttnParams& p, int which) {
  if (p.timeline == nullptr || threadIdx.x != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  p.timeline[kAttnTimelinePoints * blockIdx.x + which] = t;
}

// The work of one CTA: chunk [begin, end) of list `list`.
struct AttnWork {
  int item, list, n_chunks, begin, end, seq, h, tile;
  int own;          // chunk length of the list (chunk c covers [c own, min(len, (c + 1) own)))
  int len;          // the list's length
  int list_first;   // item of the list's chunk 0
};

// The split plan, the same in every CTA. From all list lengths: a chunk size C (a multiple
// of `step`, within [min_chunk, max_chunk]) such that the lists' chunks fit one wave of
// target_ctas when the cap allows (a few rounds of C <- C * chunks / target), then each
// list's own chunk length ceil(len / c_l) for its c_l = ceil(len / C) chunks, so the chunks
// of one list are equal. Returns this CTA's chunk, or false when it has none.
// Warp 0 makes the plan with shuffles (lane i takes lists i, i + 32, ..., then a contiguous
// range of them for the scan of the chunk counts); the CTA waits at one barrier. (A plan
// made by the whole CTA with shared-memory atomics on one word took 4 us at one sequence and
// 10-12 us at 16 of a CTA's first microseconds: every thread's atomic on the same address,
// five times over; measured with the CTA timeline, docs/cuda.md.)
__device__ bool attn_plan(const AttnParams& p, int step, int* s_start, int* s_len, AttnWork& w) {
  const long long cap = max(static_cast<long long>(step), static_cast<long long>(p.max_chunk) / step * step);
  auto round_up = [&](long long x) { return (x + step - 1) / step * step; };
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, n = p.n_lists;
    long long total = 0;
    for (int l = lane; l < n; l += 32) {
      const int len = attn_list_len(p, l);
      s_len[l] = len;
      total += len;
    }
    total = warp_sum(total);
    long long chunk = (total + p.target_ctas - 1) / p.target_ctas;
    chunk = min(cap, round_up(max(chunk, static_cast<long long>(p.min_chunk))));
    for (int round = 0; round < 4; ++round) {
      int items = 0;
      for (int l = lane; l < n; l += 32) items += max(1, static_cast<int>((s_len[l] + chunk - 1) / chunk));
      items = warp_sum(items);
      if (items <= p.target_ctas || chunk >= cap) break;
      chunk = min(cap, round_up((chunk * items + p.target_ctas - 1) / p.target_ctas));
    }
    __syncwarp();  // s_len of every lane's lists is written
    const int per = (n + 31) / 32, b = min(n, lane * per), e = min(n, b + per);
    int own = 0;
    for (int l = b; l < e; ++l) own += max(1, static_cast<int>((s_len[l] + chunk - 1) / chunk));
    const int incl = warp_scan_inclusive(own);
    int run = incl - own;
    for (int l = b; l < e; ++l) {
      const int c = max(1, static_cast<int>((s_len[l] + chunk - 1) / chunk));
      s_start[l] = run;
      run += c;
    }
    if (lane == 31) s_start[n] = incl;
  }
  __syncthreads();
  w.item = blockIdx.x;
  if (w.item >= s_start[p.n_lists]) return false;
  int lo = 0, hi = p.n_lists - 1;  // largest l with s_start[l] <= item
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s_start[mid] <= w.item) lo = mid; else hi = mid - 1;
  }
  w.list = lo;
  w.n_chunks = s_start[lo + 1] - s_start[lo];
  const int len = s_len[lo];
  const int own = static_cast<int>(round_up((len + w.n_chunks - 1) / w.n_chunks));  // this list's chunk length
  w.begin = (w.item - s_start[lo]) * own;
  w.end = min(len, w.begin + own);
  w.own = own;
  w.len = len;
  w.list_first = s_start[lo];
  w.seq = lo / (p.n_kv * p.n_tiles);
  w.h = (lo / p.n_tiles) % p.n_kv;
  w.tile = lo % p.n_tiles;
  return true;
}

constexpr int kMergeTile = 128;  // partials whose (m, l) the merge stages in shared memory at once

// The merge of one list's partials [first, first + nc) by log-sum-exp, run by the list's
// last CTA. Per query head g: M = max_c m_c, L = sum_c 2^(m_c - M) l_c, out = sum_c
// 2^(m_c - M) o_c / L. The threads own float4 columns of the [G][D] output; when there are
// more threads than columns, thread groups take interleaved partials and add up in shared
// memory. Every partial's loads are independent and unrolled, so their latencies overlap
// (the previous version walked 8 partials at a time per output element).
template <int D, int G>
__device__ void attn_merge(const AttnParams& p, const AttnWork& w, int first, int nc, float* scratch) {
  constexpr int kCols = G * D / 4;
  __shared__ float s_w[kMergeTile * G];  // per (tile partial, head): m, then the weight 2^(m - M)
  __shared__ float s_M[G], s_L[G];
  const int tid = threadIdx.x, nt = blockDim.x;
  // Pass 1: M and L per head (threads over (partial, head) pairs; nt is a multiple of G).
  float mx = -INFINITY;
  for (int i = tid; i < nc * G; i += nt) mx = fmaxf(mx, __ldcg(p.part_m + static_cast<size_t>(first) * G + i));
  float* red = scratch;  // [nt] reduction scratch
  red[tid] = mx;
  __syncthreads();
  if (tid < G) {
    float m = -INFINITY;
    for (int t = tid; t < nt; t += G) m = fmaxf(m, red[t]);
    s_M[tid] = m;
  }
  __syncthreads();
  float ls = 0.0f;
  for (int i = tid; i < nc * G; i += nt) {
    const float m = __ldcg(p.part_m + static_cast<size_t>(first) * G + i);
    const float M = s_M[i % G];
    if (m != -INFINITY) ls += exp2f(m - M) * __ldcg(p.part_l + static_cast<size_t>(first) * G + i);
  }
  red[tid] = ls;
  __syncthreads();
  if (tid < G) {
    float l = 0.0f;
    for (int t = tid; t < nt; t += G) l += red[t];
    s_L[tid] = l;
  }
  __syncthreads();
  // Pass 2: the outputs. groups of kCols threads take partials grp, grp + groups, ...
  const int groups = nt >= kCols ? nt / kCols : 1;
  const int grp = tid / kCols;
  float4* acc_s = reinterpret_cast<float4*>(scratch);  // [groups][kCols], after the tiles
  for (int col0 = 0; col0 < kCols; col0 += nt) {      // more columns than threads: several rounds
    const int col = col0 + (groups > 1 ? tid % kCols : tid);
    const bool active = grp < groups && col < kCols;
    const int g = col / (D / 4), d = (col % (D / 4)) * 4;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int c0 = 0; c0 < nc; c0 += kMergeTile) {
      const int n_tile = min(kMergeTile, nc - c0);
      __syncthreads();  // the previous tile's weights are no longer read
      for (int i = tid; i < n_tile * G; i += nt) {
        const float m = __ldcg(p.part_m + static_cast<size_t>(first + c0) * G + i);
        s_w[i] = m == -INFINITY ? 0.0f : exp2f(m - s_M[i % G]);
      }
      __syncthreads();
      if (active) {
        // Partials loaded before any is added: 8, or 16 at head_dim 256, where one thread
        // owns each column of the [4][256] output and walks every partial (Gemma 3's one kv
        // head at 32K: ~130 partials, whose rounds of dependent loads took ~14 us of a 43 us
        // step with 8).
        constexpr int kU = D >= 256 ? 16 : 8;
        for (int c = grp; c < n_tile; c += kU * groups) {
          float4 v[kU];
          float wt[kU];
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int cc = c + u * groups;
            const bool in = cc < n_tile;
            wt[u] = in ? s_w[cc * G + g] : 0.0f;
            v[u] = in ? __ldcg(reinterpret_cast<const float4*>(p.part_o + (static_cast<size_t>(first + c0 + cc) * G + g) * D + d))
                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            acc.x = fmaf(wt[u], v[u].x, acc.x);
            acc.y = fmaf(wt[u], v[u].y, acc.y);
            acc.z = fmaf(wt[u], v[u].z, acc.z);
            acc.w = fmaf(wt[u], v[u].w, acc.w);
          }
        }
      }
    }
    if (groups > 1) {
      __syncthreads();  // red (aliasing acc_s) is no longer read
      if (active) acc_s[grp * kCols + col] = acc;
      __syncthreads();
      if (grp == 0 && active)
        for (int k = 1; k < groups; ++k) {
          const float4 b = acc_s[k * kCols + col];
          acc.x += b.x, acc.y += b.y, acc.z += b.z, acc.w += b.w;
        }
    }
    if (grp == 0 && active) attn_write_final<D, G>(p, w.seq, w.h, w.tile, g, d, s_M[g], s_L[g], acc);
  }
}

// The warps' results are in shared memory (sm_o [warps][G][D], sm_m, sm_l [warps][G]):
// combine them into the CTA's partial (or the final output when the list has one chunk);
// the last CTA of a list to finish merges the list's partials (attn_merge) and resets the
// list's ticket and work cursors for the next launch. scratch: shared memory the merge may
// use once the warp results are read (>= max(blockDim.x, groups * G * D) floats).
template <int D, int G>
__device__ void attn_finish(const AttnParams& p, const AttnWork& w, const float* sm_o, const float* sm_m,
                            const float* sm_l, int warps, float* scratch) {
  __shared__ int s_last;
  const bool single = w.n_chunks == 1;
  for (int i = threadIdx.x; i < G * D / 4; i += blockDim.x) {
    const int g = i / (D / 4), d = (i % (D / 4)) * 4;
    float mm = -INFINITY;
    for (int k = 0; k < warps; ++k) mm = fmaxf(mm, sm_m[k * G + g]);
    float4 oo = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float ll = 0.0f;
    if (mm != -INFINITY)
      for (int k = 0; k < warps; ++k) {
        const float f = exp2f(sm_m[k * G + g] - mm);
        const float4 x = *reinterpret_cast<const float4*>(sm_o + (k * G + g) * D + d);
        oo.x = fmaf(f, x.x, oo.x), oo.y = fmaf(f, x.y, oo.y), oo.z = fmaf(f, x.z, oo.z), oo.w = fmaf(f, x.w, oo.w);
        ll += f * sm_l[k * G + g];
      }
    if (single) {
      attn_write_final<D, G>(p, w.seq, w.h, w.tile, g, d, mm, ll, oo);
    } else {
      *reinterpret_cast<float4*>(p.part_o + (static_cast<size_t>(w.item) * G + g) * D + d) = oo;
      if (d == 0) {
        p.part_m[w.item * G + g] = mm;
        p.part_l[w.item * G + g] = ll;
      }
    }
  }
  if (single) {
    if (threadIdx.x == 0 && p.steal) p.cursor[w.item] = 0;  // every warp of the CTA is done with it
    return;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(p.tickets + w.list, 1) == w.n_chunks - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  attn_merge<D, G>(p, w, w.list_first, w.n_chunks, scratch);
  if (threadIdx.x == 0) p.tickets[w.list] = 0;  // ready for the next launch
  if (p.steal)
    for (int c = threadIdx.x; c < w.n_chunks; c += blockDim.x) p.cursor[w.list_first + c] = 0;
}

// The blocks of BT list entries one warp computes, in order, as (start, limit): rows
// start .. start + BT - 1 of the list, those below limit valid; start = -1 past the last.
// Static: blocks first, first + step, ... below end (the warp's share of its CTA's chunk).
// Stealing: units of kUnitBlocks blocks claimed with atomicAdd on the chunk cursors, the
// CTA's own chunk first, then the other chunks of the list in turn. Lane 0 holds the
// claims; the claim of the next unit is issued when a unit starts, so its latency hides
// behind the unit's blocks. Every field but `pending` is warp-uniform.
template <int BT>
struct BlockGen {
  static constexpr int kUnit = kUnitBlocks * BT;
  int pos, lim;          // next block start and the current unit's (or the static range's) end
  int step;              // static: the warps' stride; 0 when stealing
  bool done;
  int own_c, n_chunks, chunk_len, len, probe;  // stealing: chunk geometry, chunks tried so far
  int* cursor;           // the list's chunk cursors
  int pending;           // lane 0: entries claimed earlier from chunk (own_c + probe) mod n_chunks

  __device__ void init_static(int first, int end, int stride) {
    pos = first;
    lim = end;
    step = stride;
    done = false;
  }
  __device__ void init_steal(const AttnWork& w, int* cursors) {
    step = 0;
    done = false;
    pos = lim = 0;  // no unit yet: the first next() resolves the claim below
    pending = 0;
    own_c = w.item - w.list_first;
    n_chunks = w.n_chunks;
    chunk_len = w.own;
    len = w.len;
    probe = 0;
    cursor = cursors + w.list_first;
    if ((threadIdx.x & 31) == 0) pending = atomicAdd(cursor + own_c, kUnit);
  }
  // Lane 0: turns the pending claim into a unit, probing the list's other chunks once the
  // current one is used up; then claims the following unit ahead. Returns the unit start or
  // -1 (every chunk used up), and its end in *e.
  __device__ int claim(int* e) {
    int got = pending;
    while (probe < n_chunks) {
      int c = own_c + probe;
      if (c >= n_chunks) c -= n_chunks;
      const int cb = c * chunk_len, ce = min(len, cb + chunk_len);
      if (cb + got < ce) {
        *e = min(ce, cb + got + kUnit);
        pending = atomicAdd(cursor + c, kUnit);
        return cb + got;
      }
      if (++probe < n_chunks) {
        c = own_c + probe;
        if (c >= n_chunks) c -= n_chunks;
        got = atomicAdd(cursor + c, kUnit);
      }
    }
    return -1;
  }
  __device__ void next(int& start, int& limit) {
    if (step == 0 && pos >= lim && !done) {
      int b = 0, e = 0;
      if ((threadIdx.x & 31) == 0) b = claim(&e);
      b = __shfl_sync(0xffffffffu, b, 0);
      e = __shfl_sync(0xffffffffu, e, 0);
      if (b < 0) done = true;
      else pos = b, lim = e;
    }
    if (done || pos >= lim) {
      start = -1;
      limit = 0;
      return;
    }
    start = pos;
    limit = lim;
    pos += step == 0 ? BT : step;
  }
};

// A warp's pipeline over the blocks gen yields: each lane copies U rows of K and V per
// block (row u * TPL + tsub, its 16-byte column slice) into stage j % kStages of the
// warp's ring with cp.async, kStages - 1 blocks ahead of the compute; the page-table
// lookups (and for lists the index loads) run one and two blocks ahead of the copies, so
// their latency overlaps the compute too. compute(stage, start, limit) runs once block j
// has landed (rows start + r < limit valid). Every lane later reads only what it copied
// itself (SIMT), or the warp reads the whole stage (tensor cores: __syncwarp).
//
// kContig (dense ranges over pages of a multiple of BT tokens, blocks BT-aligned: every block
// lies in one page): one page-table load per block, by every lane at the same address, and
// the rows' addresses as constant offsets from the block's first row, instead of a token
// index, a page lookup and a 64-bit address per row.
//
// after_prologue() runs once the first blocks' copies are issued, before any is waited for:
// the kernels load the query rows there, so that their round trip overlaps the K/V's.
template <int D, class T, int BT, int U, int TPL, bool kWarpSync, bool kContig, class F0, class F>
__device__ __forceinline__ void attn_pipeline(const AttnParams& p, unsigned char* ring, BlockGen<BT>& gen, int n_tok,
                                              const int32_t* idx, const int32_t* pt, F0&& after_prologue,
                                              F&& compute) {
  constexpr int RS = ring_row<D>();
  constexpr int kStage = stage_bytes<D, BT>();
  constexpr int kNone = INT_MIN;
  constexpr int kAhead = kStages + 2;  // blocks j .. j + kStages + 1 known at iteration j
  const int lane = threadIdx.x & 31;
  const int row_lane = lane % (D / 8), tsub = lane / (D / 8);
  const int shift = p.page_shift, mask = (1 << shift) - 1;
  const T* kb = static_cast<const T*>(p.k);
  const T* vb = static_cast<const T*>(p.v);
  auto load_tok = [&](int start, int limit, int (&t)[U]) {
    if constexpr (kContig) {
      t[0] = start >= 0 ? start : kNone;  // the block's first token; rows below limit are valid
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int pos = start + u * TPL + tsub;
        t[u] = (start >= 0 && pos < limit) ? (idx != nullptr ? __ldg(idx + pos) : pos) : kNone;
      }
    }
  };
  auto load_page = [&](const int (&t)[U], int (&pg)[U]) {
    if constexpr (kContig) {
      pg[0] = t[0] != kNone ? __ldg(pt + (t[0] >> shift)) : -1;
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        pg[u] = -1;
        if (t[u] != kNone) {
          if (static_cast<unsigned>(t[u]) < static_cast<unsigned>(n_tok)) pg[u] = __ldg(pt + (t[u] >> shift));
          else atomicOr(p.error, 1);
        }
      }
    }
  };
  auto issue = [&](int j, const int (&t)[U], const int (&pg)[U], int limit) {
    unsigned char* st = ring + (j % kStages) * kStage;
    if constexpr (kContig) {
      const bool any = pg[0] >= 0;
      const size_t row0 = any ? ((static_cast<size_t>(pg[0]) << shift) | static_cast<size_t>(t[0] & mask)) : 0;
      const T* kr = kb + (row0 + tsub) * D + row_lane * 8;
      const T* vr = vb + (row0 + tsub) * D + row_lane * 8;
      const int n_valid = any ? limit - t[0] : 0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool valid = u * TPL + tsub < n_valid;
        const int slot = ((u * TPL + tsub) * RS + row_lane * 8) * 2;
        cp_async16(st + slot, valid ? kr + u * TPL * D : kb, valid, p.prefetch);
        cp_async16(st + BT * RS * 2 + slot, valid ? vr + u * TPL * D : vb, valid, p.prefetch);
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool valid = pg[u] >= 0;
        const size_t row = valid ? ((static_cast<size_t>(pg[u]) << shift) | static_cast<size_t>(t[u] & mask)) : 0;
        const size_t off = row * D + row_lane * 8;
        const int slot = ((u * TPL + tsub) * RS + row_lane * 8) * 2;
        cp_async16(st + slot, kb + off, valid, p.prefetch);
        cp_async16(st + BT * RS * 2 + slot, vb + off, valid, p.prefetch);
      }
    }
    cp_async_commit();
  };
  int bs[kAhead], bl[kAhead];  // (start, limit) of blocks j .. j + kAhead - 1
#pragma unroll
  for (int i = 0; i < kAhead; ++i) gen.next(bs[i], bl[i]);
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    int t[U], pg[U];
    load_tok(bs[j], bl[j], t);
    load_page(t, pg);
    issue(j, t, pg, bl[j]);
  }
  int ta[U], tb[U], pb[U];
  load_tok(bs[kStages - 1], bl[kStages - 1], tb);
  load_page(tb, pb);
  load_tok(bs[kStages], bl[kStages], ta);
  after_prologue();
  for (int j = 0; bs[0] >= 0; ++j) {
    if (kWarpSync) __syncwarp();     // every lane is done with the stage about to be refilled
    issue(j + kStages - 1, tb, pb, bl[kStages - 1]);  // an empty group past the last block
#pragma unroll
    for (int u = 0; u < U; ++u) tb[u] = ta[u];
    load_page(tb, pb);                                   // block j + kStages, used next iteration
    load_tok(bs[kStages + 1], bl[kStages + 1], ta);      // block j + kStages + 1
    cp_async_wait<kStages - 1>();   // block j has landed (this lane's copies)
    if (kWarpSync) __syncwarp();    // ... and every lane's
    compute(ring + (j % kStages) * kStage, bs[0], bl[0]);
#pragma unroll
    for (int i = 0; i + 1 < kAhead; ++i) bs[i] = bs[i + 1], bl[i] = bl[i + 1];
    gen.next(bs[kAhead - 1], bl[kAhead - 1]);
  }
  cp_async_wait<0>();
}

// The warp's block source for this CTA's work.
template <int BT>
__device__ __forceinline__ BlockGen<BT> attn_blocks(const AttnParams& p, const AttnWork& w, int warp, int warps) {
  BlockGen<BT> gen;
  if (p.steal) gen.init_steal(w, p.cursor);
  else gen.init_static(w.begin + warp * BT, w.end, warps * BT);
  return gen;
}

// One block of U rows per lane (SIMT): scores for every head of the tile, online softmax,
// weighted values. kr/vr: the lane's 16 bytes of each of its rows; ok: row valid.
template <int D, class T, int G>
__device__ __forceinline__ void attn_block(const uint4 (&kr)[AttnShape<D, G>::kUnroll],
                                           const uint4 (&vr)[AttnShape<D, G>::kUnroll],
                                           const bool (&ok)[AttnShape<D, G>::kUnroll], const float (&q)[G][8],
                                           float (&m)[G], float (&l)[G], float (&o)[G][8]) {
  using S = AttnShape<D, G>;
  constexpr int RL = S::kRowLanes, U = S::kUnroll;
  float s[U][G];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float kf[8];
    widen8(kr[u], kf, T());
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(q[g][e], kf[e], acc);
      s[u][g] = acc;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int off = RL / 2; off >= 1; off >>= 1) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);
      if (!ok[u]) s[u][g] = -INFINITY;
    }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float mx = s[0][g];
#pragma unroll
    for (int u = 1; u < U; ++u) mx = fmaxf(mx, s[u][g]);
#pragma unroll
    for (int off = RL; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float mn = fmaxf(m[g], mx);
    if (mn == -INFINITY) {
#pragma unroll
      for (int u = 0; u < U; ++u) s[u][g] = 0.0f;
      continue;
    }
    const float alpha = exp2f(m[g] - mn);
    m[g] = mn;
    l[g] *= alpha;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[g][e] *= alpha;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      s[u][g] = exp2f(s[u][g] - mn);
      l[g] += s[u][g];
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float vf[8];
    widen8(vr[u], vf, T());
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[g][e] = fmaf(s[u][g], vf[e], o[g][e]);
  }
}

// SIMT kernel: CUDA-core FMAs, every row of a block read once for all heads of the tile.
template <int D, class T, int G, bool kContig>
__global__ void __launch_bounds__(kMaxWarps * 32) attention_simt_kernel(AttnParams p) {
  using S = AttnShape<D, G>;
  constexpr int RL = S::kRowLanes, TPL = S::kTokPerLoad, U = S::kUnroll, BT = S::kBlock;
  constexpr int RS = ring_row<D>();
  const int warps = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  __shared__ int s_start[kMaxLists + 1];
  __shared__ int s_len[kMaxLists];
  AttnWork w;
  attn_timeline(p, kTlStart);
  if (!attn_plan(p, warps * BT, s_start, s_len, w)) return attn_timeline(p, kTlEnd);
  attn_timeline(p, kTlPlanned);
  const int row_lane = lane % RL, tsub = lane / RL;
  float q[G][8];
  auto load_q = [&] {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int qi = w.tile * G + g;
      const size_t qh = static_cast<size_t>(w.seq) * p.n_kv * p.group + static_cast<size_t>(w.h) * p.group + qi;
#pragma unroll
      for (int e = 0; e < 8; ++e) q[g][e] = qi < p.group ? p.q[qh * D + row_lane * 8 + e] * p.qscale : 0.0f;
    }
    attn_timeline(p, kTlQuery);
  };
  float m[G], l[G], o[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[g][e] = 0.0f;
  }
  const int32_t* pt = p.page_table + (static_cast<size_t>(w.seq) * p.n_kv + w.h) * p.max_pages;
  const int32_t* idx = p.idx != nullptr ? p.idx + (static_cast<size_t>(w.seq) * p.n_kv + w.h) * p.idx_stride : nullptr;
  unsigned char* ring = dyn_smem + static_cast<size_t>(warp) * kStages * stage_bytes<D, BT>();
  BlockGen<BT> gen = attn_blocks<BT>(p, w, warp, warps);
  bool first = true;
  attn_pipeline<D, T, BT, U, TPL, false, kContig>(
      p, ring, gen, p.n_tokens[w.seq], idx, pt, load_q, [&](const unsigned char* st, int start, int limit) {
        if (first) attn_timeline(p, kTlFirstBlock), first = false;
        uint4 kr[U], vr[U];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int slot = ((u * TPL + tsub) * RS + row_lane * 8) * 2;
          kr[u] = *reinterpret_cast<const uint4*>(st + slot);
          vr[u] = *reinterpret_cast<const uint4*>(st + BT * RS * 2 + slot);
          ok[u] = start + u * TPL + tsub < limit;
        }
        attn_block<D, T, G>(kr, vr, ok, q, m, l, o);
      });
  attn_timeline(p, kTlWarpDone);
  __syncthreads();  // the merge below reuses the rings
  attn_timeline(p, kTlAllWarps);
  // Token groups of the warp hold disjoint tokens: sum them (m is warp-uniform).
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int off = RL; off < 32; off <<= 1) {
      l[g] += __shfl_xor_sync(0xffffffffu, l[g], off);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[g][e] += __shfl_xor_sync(0xffffffffu, o[g][e], off);
    }
  float* sm_o = reinterpret_cast<float*>(dyn_smem);  // [warps][G][D]
  float* sm_m = sm_o + warps * G * D;                 // [warps][G]
  float* sm_l = sm_m + warps * G;                     // [warps][G]
  if (lane < RL)
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) sm_o[(warp * G + g) * D + row_lane * 8 + e] = o[g][e];
  if (lane == 0)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      sm_m[warp * G + g] = m[g];
      sm_l[warp * G + g] = l[g];
    }
  __syncthreads();
  attn_finish<D, G>(p, w, sm_o, sm_m, sm_l, warps, reinterpret_cast<float*>(dyn_smem));
  attn_timeline(p, kTlEnd);
}

// ---- tensor cores: mma.sync.m16n8k16 with split operands ----
// Q (the tile's heads as the 16 rows of A, rows >= G zero) and the softmax weights P are
// rounded to the 16-bit type of the cache; to keep float32 accuracy each is split into
// NS parts (hi + lo [+ lo2]) whose sum carries 22 (f16) or 24 (bf16) significant bits, and
// one mma per part accumulates in float32. K and V enter exactly.
template <class T>
struct MmaOps;
template <>
struct MmaOps<__half> {
  static constexpr int kSplits = 2;
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t x) {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct MmaOps<__nv_bfloat16> {
  static constexpr int kSplits = 3;
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t x) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// x ~= sum of NS packed pairs: part k = round(x - parts 0..k-1).
template <class T>
__device__ __forceinline__ void split_pack(float a, float b, uint32_t (&out)[MmaOps<T>::kSplits]) {
#pragma unroll
  for (int k = 0; k < MmaOps<T>::kSplits; ++k) {
    out[k] = MmaOps<T>::pack(a, b);
    const float2 r = MmaOps<T>::unpack(out[k]);
    a -= r.x;
    b -= r.y;
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem, bool trans) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// movmatrix (sm_75+): the transpose of the 8x8 16-bit matrix whose fragment the warp holds
// (lane: row lane / 4, columns 2 (lane % 4) and + 1), in the same fragment layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Tensor-core kernel, with the block's 16 tokens as the 16 rows of mma.m16n8k16 and the
// tile's heads as its 8 columns (a group of 4 fills half of them; with heads as rows it
// filled 4 of 16 and took twice the mmas). Per 16-token block and warp:
//   S^T = K Q^T: D/16 k-steps of one mma per split part; K straight from the ring
//     (ldmatrix), Q^T held as B fragments (lane: head lane / 4, dims 2 (lane % 4), +1, +8);
//   the online softmax on the accumulator (lane: tokens r = lane / 4 and r + 8, heads
//     2c and 2c + 1 for c = lane % 4), each head's max over the 8 lanes of its column;
//   O^T += V^T P^T: D/16 mmas per split part, V^T from the ring (ldmatrix .trans) as A,
//     P^T as B: the accumulator's weights packed as 16-bit pairs are an 8x8 fragment of
//     (tokens x heads), and movmatrix .trans turns it into (heads x tokens), B's layout.
// The O^T accumulator holds dims 16 vs + r and + 8 for heads 2c, 2c + 1: D/4 floats a lane.
template <int D, class T, int G, bool kContig>
__global__ void __launch_bounds__(kMaxWarps * 32) attention_mma_kernel(AttnParams p) {
  using S = MmaShape<D>;
  using Ops = MmaOps<T>;
  constexpr int TPL = S::kTokPerLoad, U = S::kUnroll, BT = S::kBlock, NS = Ops::kSplits;
  constexpr int RS = ring_row<D>();
  constexpr int KS = D / 16;  // k-steps of K Q^T, and 16-dim slabs of V^T P^T
  const int warps = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  __shared__ int s_start[kMaxLists + 1];
  __shared__ int s_len[kMaxLists];
  AttnWork w;
  attn_timeline(p, kTlStart);
  if (!attn_plan(p, warps * BT, s_start, s_len, w)) return attn_timeline(p, kTlEnd);
  attn_timeline(p, kTlPlanned);
  const int r = lane >> 2, c = lane & 3;
  // B fragments of Q^T: b0 = (dims 16 ks + 2c, +1; head r), b1 = (dims + 8; head r).
  uint32_t qb[NS][KS][2];
  auto load_q = [&] {
    const int qi = w.tile * G + r;
    const bool head_ok = r < G && qi < p.group;
    const size_t qh = static_cast<size_t>(w.seq) * p.n_kv * p.group + static_cast<size_t>(w.h) * p.group + qi;
    const float* qrow = p.q + qh * D;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d0 = ks * 16 + half * 8 + 2 * c;
        const float x0 = head_ok ? qrow[d0] * p.qscale : 0.0f, x1 = head_ok ? qrow[d0 + 1] * p.qscale : 0.0f;
        uint32_t parts[NS];
        split_pack<T>(x0, x1, parts);
#pragma unroll
        for (int k = 0; k < NS; ++k) qb[k][ks][half] = parts[k];
      }
    attn_timeline(p, kTlQuery);
  };
  float o[KS][4];
#pragma unroll
  for (int vs = 0; vs < KS; ++vs)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[vs][e] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // heads 2c, 2c + 1
  const int32_t* pt = p.page_table + (static_cast<size_t>(w.seq) * p.n_kv + w.h) * p.max_pages;
  const int32_t* idx = p.idx != nullptr ? p.idx + (static_cast<size_t>(w.seq) * p.n_kv + w.h) * p.idx_stride : nullptr;
  unsigned char* ring = dyn_smem + static_cast<size_t>(warp) * kStages * stage_bytes<D, BT>();
  // ldmatrix row addresses: lane i feeds row i % 8 of matrix i / 8. A's four matrices are
  // (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15).
  const int mi = lane >> 3, mr = lane & 7;
  const int k_tok = (mi & 1) * 8 + mr, k_dim = (mi >> 1) * 8;  // K: rows tokens, cols dims
  const int v_tok = (mi >> 1) * 8 + mr, v_dim = (mi & 1) * 8;  // V^T (transposed): rows dims, cols tokens
  BlockGen<BT> gen = attn_blocks<BT>(p, w, warp, warps);
  bool first = true;
  attn_pipeline<D, T, BT, U, TPL, true, kContig>(
      p, ring, gen, p.n_tokens[w.seq], idx, pt, load_q, [&](const unsigned char* st, int start, int limit) {
        if (first) attn_timeline(p, kTlFirstBlock), first = false;
        const unsigned char* ks_base = st + (k_tok * RS + k_dim) * 2;
        const unsigned char* vs_base = st + BT * RS * 2 + (v_tok * RS + v_dim) * 2;
        float sc[4] = {};  // (token r, heads 2c, 2c+1), (token r + 8, heads 2c, 2c+1)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          uint32_t ka[4];
          ldmatrix_x4(ka, ks_base + ks * 32, false);
#pragma unroll
          for (int k = 0; k < NS; ++k) Ops::mma(sc, ka, qb[k][ks][0], qb[k][ks][1]);
        }
        const bool in0 = start + r < limit, in1 = start + r + 8 < limit;
        float pv[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float s0 = in0 ? sc[h] : -INFINITY, s1 = in1 ? sc[2 + h] : -INFINITY;
          float mx = fmaxf(s0, s1);
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
          const float mn = fmaxf(m[h], mx);
          if (mn == -INFINITY) {
            pv[h] = pv[2 + h] = 0.0f;
            continue;
          }
          const float alpha = exp2f(m[h] - mn);
          m[h] = mn;
          pv[h] = exp2f(s0 - mn);
          pv[2 + h] = exp2f(s1 - mn);
          l[h] = l[h] * alpha + pv[h] + pv[2 + h];
#pragma unroll
          for (int vs = 0; vs < KS; ++vs) {
            o[vs][h] *= alpha;
            o[vs][2 + h] *= alpha;
          }
        }
        // P^T as the B operand: b0 = (tokens 2c, 2c+1; head r), b1 = (tokens 8 + 2c, +1; head r).
        uint32_t pb0[NS], pb1[NS];
        split_pack<T>(pv[0], pv[1], pb0);
        split_pack<T>(pv[2], pv[3], pb1);
#pragma unroll
        for (int k = 0; k < NS; ++k) {
          pb0[k] = movmatrix_trans(pb0[k]);
          pb1[k] = movmatrix_trans(pb1[k]);
        }
#pragma unroll
        for (int vs = 0; vs < KS; ++vs) {
          uint32_t va[4];
          ldmatrix_x4(va, vs_base + vs * 32, true);
#pragma unroll
          for (int k = 0; k < NS; ++k) Ops::mma(o[vs], va, pb0[k], pb1[k]);
        }
      });
  attn_timeline(p, kTlWarpDone);
  __syncthreads();  // the merge below reuses the rings
  attn_timeline(p, kTlAllWarps);
  // l: sum over the 8 lanes of each head's column (m is already the same on them).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
  }
  float* sm_o = reinterpret_cast<float*>(dyn_smem);  // [warps][G][D]
  float* sm_m = sm_o + warps * G * D;                 // [warps][G]
  float* sm_l = sm_m + warps * G;                     // [warps][G]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int hh = 2 * c + h;
    if (hh >= G) continue;
    float* row = sm_o + (warp * G + hh) * D;
#pragma unroll
    for (int vs = 0; vs < KS; ++vs) {
      row[vs * 16 + r] = o[vs][h];
      row[vs * 16 + r + 8] = o[vs][2 + h];
    }
    if (r == 0) {
      sm_m[warp * G + hh] = m[h];
      sm_l[warp * G + hh] = l[h];
    }
  }
  __syncthreads();
  attn_finish<D, G>(p, w, sm_o, sm_m, sm_l, warps, reinterpret_cast<float*>(dyn_smem));
  attn_timeline(p, kTlEnd);
}

using AttnKernel = void (*)(AttnParams);

// A plan's kernels: `any` takes every list; `contig` (or null) is the same kernel for dense
// ranges whose pages hold a whole number of blocks (attn_pipeline's kContig), picked at
// launch when the call has no index lists.
struct AttnKernels {
  AttnKernel any = nullptr, contig = nullptr;
};

// Instantiated for head tiles of 1, 4 and 8 query heads (a group of 2 or 3 runs in a tile
// of 4 with the rest masked), head_dim 64 and 128, f16 and bf16, SIMT and tensor cores:
// 24 kernels per architecture, and the tensor-core ones again for contiguous dense ranges.
// Head_dim 256 (Gemma 3): SIMT only, in tiles of 4 heads (a group of 1 masked in one, 8 as
// two tiles), both forms: 4 more. The tensor-core kernel does not hold
// 256 dimensions in registers: Q's split fragments (64 or 96 registers), 32 n8 output
// tiles and the pipeline's 16 rows per lane spilled 330-870 bytes per thread even with Q in
// shared memory and half the accumulators, and ran 2.6x slower than SIMT on an H100
// (Gemma 3 32K: 114 vs 44 us); AttentionPlan runs SIMT there instead.
template <int D, class T, int G>
AttnKernels attn_kernel_ptr(bool mma) {
  if (mma) return {attention_mma_kernel<D, T, G, false>, attention_mma_kernel<D, T, G, true>};
  return {attention_simt_kernel<D, T, G, false>, nullptr};
}

template <int D, class T>
AttnKernels pick_g(int g, bool mma) {
  switch (g) {
    case 1: return attn_kernel_ptr<D, T, 1>(mma);
    case 4: return attn_kernel_ptr<D, T, 4>(mma);
    default: return attn_kernel_ptr<D, T, 8>(mma);
  }
}

template <class T>
AttnKernels pick_d(int d, int g, bool mma) {
  switch (d) {
    case 64: return pick_g<64, T>(g, mma);
    case 128: return pick_g<128, T>(g, mma);
    default:  // tile_heads: 4; no tensor cores (above)
      return {attention_simt_kernel<256, T, 4, false>, attention_simt_kernel<256, T, 4, true>};
  }
}

int tile_heads(int group, int d) {
  if (d >= 256) return 4;
  return group <= 1 ? 1 : group <= 4 ? 4 : 8;
}

// Tokens per warp block: SIMT U rows per lane, tensor cores 16.
int block_tokens(int d, int g, bool mma) {
  if (mma) return 16;
  const int tpl = 32 / (d / 8);
  return tpl * (g <= 4 ? 8 : 4);
}

}  // namespace

struct AttentionPlan::Impl {
  DeviceKvView kv;
  int group = 1, g = 1, n_tiles = 1, n_lists = 0, warps = 4, target = 0, min_chunk = 0, max_chunk = 0, max_items = 0;
  int max_chunk_lists = 0, items_dense = 0, items_lists = 0;  // index lists' cap; each call's grid
  bool mma = false;
  size_t smem = 0;
  AttnKernel kernel = nullptr;
  AttnKernel kernel_contig = nullptr;  // dense calls whose pages hold whole blocks (null: none, or off)
  int block = 16;                      // tokens per warp block (the contiguous kernel's page-size unit)
  bool steal = false;
  int prefetch = 256;
  DeviceBuffer part_o, part_m, part_l, tickets, cursor, timeline, error;
};

AttentionPlan::AttentionPlan(const DeviceKvView& kv, int group, const AttentionPlanOptions& o) {
  kv.validate("AttentionPlan");
  CUMULUS_CHECK(group >= 1, "group={} must be >= 1", group);
  CUMULUS_CHECK(o.warps == 2 || o.warps == 4 || o.warps == 8, "options.warps={} must be 2, 4 or 8", o.warps);
  CUMULUS_CHECK(o.ctas_per_sm >= 0 && o.ctas_per_sm <= 32, "options.ctas_per_sm={} must be in [0, 32]",
                o.ctas_per_sm);
  CUMULUS_CHECK(o.min_chunk >= 0, "options.min_chunk={} must be >= 0", o.min_chunk);
  CUMULUS_CHECK(o.max_chunk >= 0, "options.max_chunk={} must be >= 0", o.max_chunk);
  CUMULUS_CHECK(o.max_chunk_lists >= 0, "options.max_chunk_lists={} must be >= 0", o.max_chunk_lists);
  CUMULUS_CHECK(o.l2_prefetch == 0 || o.l2_prefetch == 128 || o.l2_prefetch == 256,
                "options.l2_prefetch={} must be 0, 128 or 256", o.l2_prefetch);
  auto im = std::make_unique<Impl>();
  im->kv = kv;
  im->group = group;
  im->g = tile_heads(group, kv.head_dim);
  im->n_tiles = ceil_div(group, im->g);
  im->n_lists = kv.n_seqs * kv.n_kv_heads * im->n_tiles;
  CUMULUS_CHECK(im->n_lists <= kMaxLists,
                "n_seqs={} x n_kv_heads={} x head tiles={} = {} lists exceed the kernel's limit of {}", kv.n_seqs,
                kv.n_kv_heads, im->n_tiles, im->n_lists, kMaxLists);
  im->mma = o.tensor_cores && kv.head_dim <= 128;  // head_dim 256: SIMT (see attn_kernel_ptr)
  const AttnKernels ks = kv.dtype == DType::f16 ? pick_d<__half>(kv.head_dim, im->g, im->mma)
                                                : pick_d<__nv_bfloat16>(kv.head_dim, im->g, im->mma);
  im->kernel = ks.any;
  im->block = block_tokens(kv.head_dim, im->g, im->mma);
  if (o.contiguous_dense) im->kernel_contig = ks.contig;  // taken per call, where its page size allows
  // Dynamic shared memory: the warps' cp.async rings; the warps' results and the merge
  // scratch (a float per thread, a float4 per thread) reuse them.
  auto smem_of = [&](int warps) {
    const size_t merge = std::max(static_cast<size_t>(warps) * im->g * (kv.head_dim + 2) * sizeof(float),
                                  static_cast<size_t>(warps) * 32 * 4 * sizeof(float));
    const size_t ring = static_cast<size_t>(warps) * kStages * 2 * block_tokens(kv.head_dim, im->g, im->mma) *
                        (kv.head_dim + 8) * 2;  // padded rows of 16-bit values
    return std::max(merge, ring);
  };
  // The rings must fit one multiprocessor's shared memory. At head_dim 256 a SIMT warp's
  // ring holds 3 blocks of 8 tokens' 512-byte K and V rows, 25.3 KB: 8 warps (203 KB) fit
  // an H100 (227 KB) but not an A100 (163 KB). The plan then takes the most warps of 8, 4,
  // 2, at most options.warps, whose rings fit (warps() says which); at head_dim 64 and 128
  // every option fits.
  cudaFuncAttributes fa{};
  CUMULUS_CUDA_CHECK(cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(im->kernel)));
  int dev = 0, optin = 0;
  CUMULUS_CUDA_CHECK(cudaGetDevice(&dev));
  CUMULUS_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  im->warps = o.warps;
  while (im->warps > 2 && smem_of(im->warps) + fa.sharedSizeBytes > static_cast<size_t>(optin)) im->warps /= 2;
  CUMULUS_CHECK(smem_of(im->warps) + fa.sharedSizeBytes <= static_cast<size_t>(optin),
                "the attention kernel's rings (head_dim={}, {} warps, {}) need {} bytes of shared memory, the device "
                "allows {}",
                kv.head_dim, im->warps, im->mma ? "tensor cores" : "SIMT", smem_of(im->warps) + fa.sharedSizeBytes,
                optin);
  im->smem = smem_of(im->warps);
  for (AttnKernel k : {im->kernel, im->kernel_contig})
    if (k != nullptr)
      CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(k),
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(im->smem)));
  int per_sm = 0;
  CUMULUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, im->kernel, im->warps * 32, im->smem));
  CUMULUS_CHECK(per_sm >= 1, "the attention kernel does not fit a multiprocessor (warps={}, smem={})", im->warps,
                im->smem);
  im->target = sm_count() * (o.ctas_per_sm > 0 ? std::min(o.ctas_per_sm, per_sm) : per_sm);
  im->min_chunk = o.min_chunk > 0 ? o.min_chunk : 2 * block_tokens(kv.head_dim, im->g, im->mma) * im->warps;
  // A grid that holds every chunk: one wave when the cap allows, else each list cut into
  // chunks of at most max_chunk entries.
  const int step = block_tokens(kv.head_dim, im->g, im->mma) * im->warps;
  im->max_chunk = std::max(step, (o.max_chunk > 0 ? o.max_chunk : 32768) / step * step);
  im->max_chunk_lists = std::max(step, (o.max_chunk_lists > 0 ? o.max_chunk_lists : 8192) / step * step);
  auto grid_for = [&](int cap) {
    return std::max(im->target + im->n_lists, im->n_lists * (ceil_div(std::max(1, kv.max_tokens), cap) + 1));
  };
  im->items_dense = grid_for(im->max_chunk);
  im->items_lists = grid_for(im->max_chunk_lists);
  im->max_items = std::max(im->items_dense, im->items_lists);
  const size_t gd = static_cast<size_t>(im->g) * kv.head_dim;
  im->part_o = DeviceBuffer(im->max_items * gd * sizeof(float));
  im->part_m = DeviceBuffer(static_cast<size_t>(im->max_items) * im->g * sizeof(float));
  im->part_l = DeviceBuffer(static_cast<size_t>(im->max_items) * im->g * sizeof(float));
  im->tickets = DeviceBuffer(static_cast<size_t>(im->n_lists) * sizeof(int));
  im->tickets.fill_bytes(0);
  im->prefetch = o.l2_prefetch;
  im->cursor = DeviceBuffer(static_cast<size_t>(im->max_items) * sizeof(int));
  im->cursor.fill_bytes(0);
  im->error = DeviceBuffer(sizeof(int));
  im->error.fill_bytes(0);
  impl_ = im.release();
}

AttentionPlan::~AttentionPlan() { delete impl_; }

void attention_plan_set_bench(AttentionPlan& plan, const AttentionPlanBenchOptions& o) {
  // The chunk cursors exist (zero) in every plan and are zero again after each launch that
  // steals, so the knob may change between launches.
  AttentionPlan::Impl& im = *plan.impl();
  im.steal = o.steal;
  if (o.timeline && im.timeline.data() == nullptr) {
    im.timeline = DeviceBuffer(static_cast<size_t>(im.max_items) * kAttnTimelinePoints * sizeof(unsigned long long));
    im.timeline.fill_bytes(0);
  } else if (!o.timeline) {
    im.timeline = DeviceBuffer();
  }
}

int AttentionPlan::warps() const { return impl_->warps; }
bool AttentionPlan::tensor_cores() const { return impl_->mma; }

void AttentionPlan::check(void* stream) {
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  int err = 0;
  impl_->error.download(&err, sizeof(int));
  if (err != 0) {
    impl_->error.fill_bytes(0);
    throw Error(fmt::format("attention_decode: {}{}", (err & 1) ? "a list holds a token index outside [0, n_tokens) " : "",
                            (err & 2) ? "a list length is negative or exceeds idx_stride" : ""));
  }
}

std::vector<int64_t> attention_plan_timeline(const AttentionPlan& plan, void* stream) {
  const AttentionPlan::Impl& im = *plan.impl();
  CUMULUS_CHECK(im.timeline.data() != nullptr,
                "attention_plan_timeline: the plan's bench options do not set timeline");
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  std::vector<unsigned long long> t(static_cast<size_t>(im.max_items) * kAttnTimelinePoints);
  im.timeline.download(t.data(), t.size() * sizeof(unsigned long long));
  unsigned long long t0 = ~0ull;
  for (unsigned long long x : t)
    if (x != 0) t0 = std::min(t0, x);
  std::vector<int64_t> r(t.size(), -1);
  for (size_t i = 0; i < t.size(); ++i)
    if (t[i] != 0) r[i] = static_cast<int64_t>(t[i] - t0);
  return r;
}

void attention_decode(const DeviceDecodeArgs& a, AttentionPlan& plan, void* stream) {
  AttentionPlan::Impl& im = *plan.impl();
  a.kv.validate(__func__);
  CUMULUS_CHECK(a.kv.n_seqs == im.kv.n_seqs && a.kv.n_kv_heads == im.kv.n_kv_heads &&
                    a.kv.head_dim == im.kv.head_dim && a.kv.dtype == im.kv.dtype && a.group == im.group,
                "the plan was made for n_seqs={} n_kv_heads={} head_dim={} dtype={} group={}, the call has {} {} {} {} {}",
                im.kv.n_seqs, im.kv.n_kv_heads, im.kv.head_dim, dtype_name(im.kv.dtype), im.group, a.kv.n_seqs,
                a.kv.n_kv_heads, a.kv.head_dim, dtype_name(a.kv.dtype), a.group);
  CUMULUS_CHECK(std::isfinite(a.scale) && a.scale > 0.0f, "scale={} must be finite and > 0", a.scale);
  CUMULUS_CHECK(a.q != nullptr && a.out != nullptr && a.lse != nullptr, "q, out and lse must be non-null");
  CUMULUS_CHECK((a.idx == nullptr) == (a.idx_len == nullptr), "idx and idx_len must be both set or both null");
  CUMULUS_CHECK(a.idx == nullptr || a.idx_stride >= 1, "idx_stride={} must be >= 1 with a list", a.idx_stride);
  CUMULUS_CHECK((a.mass == nullptr) == (a.lse_ref == nullptr), "mass and lse_ref must be both set or both null");
  AttnParams p{};
  p.k = a.kv.k;
  p.v = a.kv.v;
  p.page_table = a.kv.page_table;
  p.n_tokens = a.kv.n_tokens;
  p.n_kv = a.kv.n_kv_heads;
  p.page_shift = a.kv.page_shift;
  p.max_pages = a.kv.max_pages;
  p.group = a.group;
  p.n_tiles = im.n_tiles;
  p.n_lists = im.n_lists;
  p.qscale = a.scale * kLog2e;
  p.q = a.q;
  p.idx = a.idx;
  p.idx_len = a.idx_len;
  p.idx_stride = a.idx_stride;
  p.out = a.out;
  p.lse = a.lse;
  p.lse_ref = a.lse_ref;
  p.mass = a.mass;
  p.part_o = im.part_o.as<float>();
  p.part_m = im.part_m.as<float>();
  p.part_l = im.part_l.as<float>();
  p.tickets = im.tickets.as<int>();
  p.cursor = im.cursor.as<int>();
  p.timeline = im.timeline.as<unsigned long long>();
  p.steal = im.steal ? 1 : 0;
  p.prefetch = im.prefetch;
  p.error = im.error.as<int>();
  p.target_ctas = im.target;
  p.min_chunk = im.min_chunk;
  p.max_chunk = a.idx != nullptr ? im.max_chunk_lists : im.max_chunk;
  if (im.timeline.data() != nullptr)  // points a CTA does not reach this launch read -1, not the last launch's
    CUMULUS_CUDA_CHECK(cudaMemsetAsync(im.timeline.data(), 0, im.timeline.size(), as_stream(stream)));
  // The contiguous kernel reads a block's rows from one page: only where the call's pages
  // hold whole blocks (the plan's view may have had another page size).
  const bool contig = a.idx == nullptr && im.kernel_contig != nullptr && a.kv.page_size % im.block == 0;
  const AttnKernel kernel = contig ? im.kernel_contig : im.kernel;
  kernel<<<a.idx != nullptr ? im.items_lists : im.items_dense, im.warps * 32, im.smem, as_stream(stream)>>>(p);
  CUMULUS_CUDA_LAUNCH("attention_kernel");
}

}  // namespace cumulus::cuda
