// Device helpers shared by the CUDA ops and the GPU methods (tactic.cu, psa.cu): block
// scans, the per-list token bitmap that forms a GQA group's union (Tactic section 4.5),
// and its compaction into sorted index lists. Internal to src/kernels/cuda.
#pragma once

#include <cstdint>

#include "core/cuda/cuda_util.cuh"

namespace cumulus::cuda {

// Inclusive scan of one value per lane over a full warp (every lane must call it).
template <class T>
__device__ __forceinline__ T warp_scan_inclusive(T x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// Exclusive scan of one value per thread over the block (blockDim.x <= 1024, a multiple
// of 32); returns the prefix of this thread and writes the block total to *total (every
// thread). Contains __syncthreads: every thread of the block must call it.
template <class T>
__device__ __forceinline__ T block_scan_exclusive(T v, T* total) {
  __shared__ T warp_sums[32];
  __shared__ T s_total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const T x = warp_scan_inclusive(v);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const T w = warp_scan_inclusive(lane < nw ? warp_sums[lane] : T(0));
    if (lane < nw) warp_sums[lane] = w;
    if (lane == nw - 1) s_total = w;
  }
  __syncthreads();
  const T r = x - v + (warp > 0 ? warp_sums[warp - 1] : T(0));
  *total = s_total;
  __syncthreads();
  return r;
}

// Sum / max of one value per thread over the block (every thread gets the result).
template <class T>
__device__ __forceinline__ T block_sum(T v) {
  T total;
  block_scan_exclusive<T>(v, &total);
  return total;
}
template <class T>
__device__ __forceinline__ T block_max(T v) {
  __shared__ T s_m[32];
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) s_m[threadIdx.x >> 5] = v;
  __syncthreads();
  T m = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) m = fmax(m, s_m[w]);
  __syncthreads();
  return m;
}

// bits: [n_lists][words] token bitmaps (bit t of list l: token t selected). Writes each
// list's set bits as ascending token indices idx[l][0 .. len[l]) (at most stride) and
// clears the bitmap for the next step. Two passes over tiles of 256 words (count, then
// emit at the tile's offset), so every list is spread over many CTAs.
//   counts: [n_lists][bitmap_tiles(words)] scratch
void bitmap_compact(uint32_t* bits, int n_lists, int words, int32_t* idx, int stride, int32_t* len, int* counts,
                    cudaStream_t stream);
// The compaction's second pass alone, for a producer that wrote every word of the bitmaps
// and counts[l][tile] (the set bits of tile `tile`, kBitmapTileWords words) itself.
void bitmap_emit(uint32_t* bits, int n_lists, int words, int32_t* idx, int stride, int32_t* len, const int* counts,
                 cudaStream_t stream);
constexpr int kBitmapTileWords = 256;
int bitmap_tiles(int words);

// select_topk_rows (kernels/cuda.h) with each row's k read on the device, so that a captured
// step follows a k that grows with the cache: row r takes the min(k_row[r], k_max) largest
// of its len[r] values (k_row[r] = 0: none), ascending, into out[r][0 .. out_len[r]).
//   out: [n_rows][k_max]
void select_topk_rows_k(const float* values, const int32_t* len, int n_rows, int stride, const int32_t* k_row,
                        int k_max, int32_t* out, int32_t* out_len, cudaStream_t stream);

// Groups rows by cluster (kmeans.cu): counts[c] rows per cluster, begin[c] = exclusive
// prefix of counts, members = row indices sorted stably by cluster (ascending within one).
//   assign: [n] in [0, k); members: [n]; begin, counts: [k]. Synchronises the stream.
void kmeans_group(const int32_t* assign, int n, int k, int32_t* members, int32_t* begin, int32_t* counts,
                  cudaStream_t stream);

}  // namespace cumulus::cuda

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cumulus/kernels/cuda_decoder.h"

namespace cumulus::cuda {

// Sets bits [t0, t1) of a token bitmap (atomically: several heads of a group mark the same
// list concurrently).
__device__ __forceinline__ void bitmap_set_range(uint32_t* w, int t0, int t1) {
  while (t0 < t1) {
    const int word = t0 >> 5, b0 = t0 & 31;
    const int b1 = min(32, b0 + (t1 - t0));
    const uint32_t m = (b1 - b0 == 32) ? 0xffffffffu : (((1u << (b1 - b0)) - 1u) << b0);
    atomicOr(w + word, m);
    t0 += b1 - b0;
  }
}

// State every GPU sparse method shares: the union bitmaps, the lists they compact into, the
// per-head claims and budgets, and the attention plan.
struct SparseDecoder::Base {
  DeviceKvView kv;
  int group = 1, n_q = 0, n_lists = 0, words = 0, stride = 0;
  DeviceBuffer bits;     // [n_seqs * n_kv_heads][words] uint32, all zero between steps
  DeviceBuffer idx;      // [n_seqs * n_kv_heads][stride] int32
  DeviceBuffer len;      // [n_seqs * n_kv_heads] int32
  DeviceBuffer claimed;  // [n_seqs * n_q] float32
  DeviceBuffer budget;   // [n_seqs * n_q] int32
  DeviceBuffer counts;   // [n_seqs * n_kv_heads][bitmap_tiles(words)] compaction scratch
  DeviceBuffer lse_own;  // [n_seqs * n_q] attend()'s lse when the caller passes none and the method needs it
  // Set by a method whose cost rule sends the whole step to dense attention (sketch_topp's
  // dense_kv_bytes): select() writes no list, attend() runs the dense kernel, stats()
  // reports every token with claim 1.
  bool dense_step = false;
  // attend()'s page table when set (set_attend_page_table), else kv.page_table.
  const int32_t* attend_table = nullptr;
  // [n_seqs * n_q] set by a method whose heads may attend no set (lfps's sink bypass): a
  // nonzero entry leaves its head out of the tokens attended (accumulate_stats, stats()).
  const int* bypass = nullptr;
  std::unique_ptr<AttentionPlan> plan;
  // Profiling (sparse_decoder_phase_times, kernels/cuda_decoder.h): the phases of the last
  // select(), set by the methods that record them; empty for the others.
  std::function<std::vector<std::pair<std::string, double>>(void* stream)> phase_times;

  Base(const DeviceKvView& v, int g, const AttentionPlanOptions& po);
  // The state of any decoder (a nested class may reach SparseDecoder's private members).
  static Base& of(SparseDecoder& m) { return *m.base_; }
  static const Base& of(const SparseDecoder& m) { return *m.base_; }
  // Turns the bitmaps into the lists (and clears them).
  void compact(cudaStream_t s) {
    bitmap_compact(bits.as<uint32_t>(), n_lists, words, idx.as<int32_t>(), stride, len.as<int32_t>(),
                   counts.as<int>(), s);
  }
  // The same when the marks also wrote `counts` (bitmap_emit).
  void emit(cudaStream_t s) {
    bitmap_emit(bits.as<uint32_t>(), n_lists, words, idx.as<int32_t>(), stride, len.as<int32_t>(), counts.as<int>(),
                s);
  }
};

}  // namespace cumulus::cuda
