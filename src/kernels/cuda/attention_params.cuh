// The decode attention kernels' parameters and shapes (src/kernels/cuda/attention.cu has the
// design): one AttnParams per launch, the SIMT and tensor-core kernels' block shapes, and
// the work one CTA takes. Included by attention_kernels.cuh; not installed.
#pragma once

#include "cuda_internal.cuh"

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
  int* error;                 // bit 0: index out of range; bit 1: list longer than stride
  int target_ctas, min_chunk, max_chunk;
  int prefetch;               // L2 fetch size hint of the K/V copies: 0, 128 or 256 bytes
};

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

// The work of one CTA: chunk [begin, end) of list `list`.
struct AttnWork {
  int item, list, n_chunks, begin, end, seq, h, tile;
  int own;          // chunk length of the list (chunk c covers [c own, min(len, (c + 1) own)))
  int len;          // the list's length
  int list_first;   // item of the list's chunk 0
};

}  // namespace
}  // namespace cumulus::cuda
