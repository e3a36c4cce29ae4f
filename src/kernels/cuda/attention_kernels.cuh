// The decode attention kernels (src/kernels/cuda/attention.cu has the design and the host
// side): the split plan every CTA makes, the warps' cp.async pipeline, the SIMT and
// tensor-core kernels and the log-sum-exp merge, each kernel templated on a variant of hooks
// (AttnStatic below: the library's). Included by attention.cu and by the dev/cuda programs
// that time other variants; not installed.
#pragma once

#include <climits>

#include "attention_params.cuh"

namespace cumulus::cuda {
namespace {

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
// list's ticket (and the variant's state: list_done) for the next launch. scratch: shared memory the merge may
// use once the warp results are read (>= max(blockDim.x, groups * G * D) floats).
template <class V, int D, int G>
__device__ void attn_finish(const AttnParams& p, const typename V::Args& va, const AttnWork& w, const float* sm_o, const float* sm_m,
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
    V::chunk_done(va, w);  // every warp of the CTA is done with it
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
  V::list_done(va, w);
}

// The blocks of BT list entries one warp computes, in order, as (start, limit): rows
// start .. start + BT - 1 of the list, those below limit valid; start = -1 past the last.
// Blocks first, first + step, ... below end: the warp's share of its CTA's chunk.
template <int BT>
struct BlockGen {
  int pos, lim, step;  // next block start, the range's end, the warps' stride
  __device__ void next(int& start, int& limit) {
    if (pos >= lim) {
      start = -1;
      limit = 0;
      return;
    }
    start = pos;
    limit = lim;
    pos += step;
  }
};

// The points of a CTA's run at which the kernels call their variant's point() hook.
enum AttnPoint : int {
  kAttnStart = 0,   // the CTA starts
  kAttnPlanned,     // the split plan is made (every CTA makes it from all list lengths)
  kAttnQuery,       // the query rows' loads are issued (after the first copies; the point
                    // does not wait for them to land)
  kAttnFirstBlock,  // warp 0's first block has landed in shared memory
  kAttnWarpDone,    // warp 0 has computed its last block
  kAttnAllWarps,    // every warp of the CTA has (the barrier before the CTA's partial)
  kAttnEnd,         // the CTA ends (after the merge when it is its list's last)
  kAttnPoints
};

// A variant of the decode kernels (FlashInfer's habit: a small struct of hooks the kernels
// call at fixed points, so that one kernel body serves every variant). Args: the variant's
// own launch arguments; blocks(): a warp's block source (a type with next(start, limit));
// point(): a CTA reached an AttnPoint (thread 0 of warp 0 matters); chunk_done(): the CTA
// of a list with one chunk is done; list_done(): a list's last CTA has merged its partials.
// AttnStatic is the library's variant: each warp walks its share of its CTA's chunk and
// nothing is recorded. dev/cuda/attention_steal.cu defines work stealing and the CTA
// timeline over the same kernels.
struct AttnStatic {
  struct Args {};
  template <int BT>
  __device__ static BlockGen<BT> blocks(const Args&, const AttnWork& w, int warp, int warps) {
    return BlockGen<BT>{w.begin + warp * BT, w.end, warps * BT};
  }
  __device__ static void point(const Args&, int) {}
  __device__ static void chunk_done(const Args&, const AttnWork&) {}
  __device__ static void list_done(const Args&, const AttnWork&) {}
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
template <int D, class T, int BT, int U, int TPL, bool kWarpSync, bool kContig, class Gen, class F0, class F>
__device__ __forceinline__ void attn_pipeline(const AttnParams& p, unsigned char* ring, Gen& gen, int n_tok,
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
template <class V, int D, class T, int G, bool kContig>
__global__ void __launch_bounds__(kMaxWarps * 32) attention_simt_kernel(AttnParams p, typename V::Args va) {
  using S = AttnShape<D, G>;
  constexpr int RL = S::kRowLanes, TPL = S::kTokPerLoad, U = S::kUnroll, BT = S::kBlock;
  constexpr int RS = ring_row<D>();
  const int warps = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  __shared__ int s_start[kMaxLists + 1];
  __shared__ int s_len[kMaxLists];
  AttnWork w;
  V::point(va, kAttnStart);
  if (!attn_plan(p, warps * BT, s_start, s_len, w)) return V::point(va, kAttnEnd);
  V::point(va, kAttnPlanned);
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
    V::point(va, kAttnQuery);
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
  auto gen = V::template blocks<BT>(va, w, warp, warps);
  bool first = true;
  attn_pipeline<D, T, BT, U, TPL, false, kContig>(
      p, ring, gen, p.n_tokens[w.seq], idx, pt, load_q, [&](const unsigned char* st, int start, int limit) {
        if (first) V::point(va, kAttnFirstBlock), first = false;
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
  V::point(va, kAttnWarpDone);
  __syncthreads();  // the merge below reuses the rings
  V::point(va, kAttnAllWarps);
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
  attn_finish<V, D, G>(p, va, w, sm_o, sm_m, sm_l, warps, reinterpret_cast<float*>(dyn_smem));
  V::point(va, kAttnEnd);
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
template <class V, int D, class T, int G, bool kContig>
__global__ void __launch_bounds__(kMaxWarps * 32) attention_mma_kernel(AttnParams p, typename V::Args va) {
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
  V::point(va, kAttnStart);
  if (!attn_plan(p, warps * BT, s_start, s_len, w)) return V::point(va, kAttnEnd);
  V::point(va, kAttnPlanned);
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
    V::point(va, kAttnQuery);
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
  auto gen = V::template blocks<BT>(va, w, warp, warps);
  bool first = true;
  attn_pipeline<D, T, BT, U, TPL, true, kContig>(
      p, ring, gen, p.n_tokens[w.seq], idx, pt, load_q, [&](const unsigned char* st, int start, int limit) {
        if (first) V::point(va, kAttnFirstBlock), first = false;
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
  V::point(va, kAttnWarpDone);
  __syncthreads();  // the merge below reuses the rings
  V::point(va, kAttnAllWarps);
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
  attn_finish<V, D, G>(p, va, w, sm_o, sm_m, sm_l, warps, reinterpret_cast<float*>(dyn_smem));
  V::point(va, kAttnEnd);
}

template <class V>
using AttnKernel = void (*)(AttnParams, typename V::Args);

// A plan's kernels: `any` takes every list; `contig` (or null) is the same kernel for dense
// ranges whose pages hold a whole number of blocks (attn_pipeline's kContig), picked at
// launch when the call has no index lists.
template <class V>
struct AttnKernels {
  AttnKernel<V> any = nullptr, contig = nullptr;
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
template <class V, int D, class T, int G>
AttnKernels<V> attn_kernel_ptr(bool mma) {
  if (mma) return {attention_mma_kernel<V, D, T, G, false>, attention_mma_kernel<V, D, T, G, true>};
  return {attention_simt_kernel<V, D, T, G, false>, nullptr};
}

template <class V, int D, class T>
AttnKernels<V> pick_g(int g, bool mma) {
  switch (g) {
    case 1: return attn_kernel_ptr<V, D, T, 1>(mma);
    case 4: return attn_kernel_ptr<V, D, T, 4>(mma);
    default: return attn_kernel_ptr<V, D, T, 8>(mma);
  }
}

template <class V, class T>
AttnKernels<V> pick_d(int d, int g, bool mma) {
  switch (d) {
    case 64: return pick_g<V, 64, T>(g, mma);
    case 128: return pick_g<V, 128, T>(g, mma);
    default:  // tile_heads: 4; no tensor cores (above)
      return {attention_simt_kernel<V, 256, T, 4, false>, attention_simt_kernel<V, 256, T, 4, true>};
  }
}

inline int tile_heads(int group, int d) {
  if (d >= 256) return 4;
  return group <= 1 ? 1 : group <= 4 ? 4 : 8;
}

// Tokens per warp block: SIMT U rows per lane, tensor cores 16.
inline int block_tokens(int d, int g, bool mma) {
  if (mma) return 16;
  const int tpl = 32 / (d / 8);
  return tpl * (g <= 4 ? 8 : 4);
}

}  // namespace
}  // namespace cumulus::cuda
