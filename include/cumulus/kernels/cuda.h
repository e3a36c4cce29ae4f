// CUDA backend of the decode ops (src/kernels/cuda, docs/cuda.md): the ops of
// kernels/attention.h, scoring.h, selection.h and kmeans.h over device memory, reading K/V
// through a DeviceKvView (the runtime, buffers and the view: core/cuda_runtime.h; the cache
// that fills it: kv/cuda_kv_cache.h). Plain C++: this header includes
// no CUDA header (DESIGN.md); device memory is owned by DeviceBuffer and handed to the ops
// as plain pointers, a stream is an opaque handle (a cudaStream_t as void*, nullptr = the
// default stream). Ops are asynchronous on their stream unless they say they synchronise;
// none synchronises inside a decode step. Every CUDA call is checked: a failure throws
// cumulus::Error naming the call, the file and the line.
//
// Shapes use the batch dimension s (sequence) in front of the CPU ops' shapes:
//   q, out: [n_seqs][n_q_heads][head_dim] float32;  lse, mass: [n_seqs][n_q_heads]
//   per-kv-head lists: idx [n_seqs][n_kv_heads][stride] int32, len [n_seqs][n_kv_heads]
// Built only with CUMULUS_CUDA=ON (the library cumulus_cuda).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cumulus/core/cuda_runtime.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/core/shape.h"

namespace cumulus::cuda {

// ---- decode attention (kernels/attention.h on the device) --------------------------------

// Dense when idx is null (each sequence's tokens [0, n_tokens)); sparse otherwise: kv head
// h of sequence s attends idx[s][h][0 .. idx_len[s][h]) (sorted unique token indices, as
// Selection holds them), all of its query heads the same list. lse_ref and mass as in
// DecodeAttnArgs: mass = exp(lse - lse_ref) when both are set.
struct DeviceDecodeArgs {
  DeviceKvView kv;
  int group = 1;
  float scale = 0.0f;
  const float* q = nullptr;
  const int32_t* idx = nullptr;
  const int32_t* idx_len = nullptr;
  int idx_stride = 0;
  float* out = nullptr;
  float* lse = nullptr;
  const float* lse_ref = nullptr;
  float* mass = nullptr;
};

struct AttentionPlanOptions {
  // Warps per CTA, in {2, 4, 8}. At head_dim 256 the plan may take fewer: the most whose
  // shared-memory rings fit the device (AttentionPlan::warps()).
  int warps = 8;
  int ctas_per_sm = 0;   // CTAs per multiprocessor in the balanced wave; 0 = occupancy limit
  int min_chunk = 0;     // fewest list entries per CTA; 0 = 2 warp blocks per warp
  // Both kernels stream K/V through a per-warp shared-memory ring (cp.async, 3 blocks in
  // flight). true: scores and outputs on tensor cores (mma.sync, split 16-bit operands,
  // float32 accuracy); false: CUDA-core FMAs. Head_dim 256 always runs the CUDA-core
  // kernel (the tensor-core one spills there; AttentionPlan::tensor_cores() says which ran).
  bool tensor_cores = true;
  int max_chunk = 0;     // most entries per CTA of a dense range; 0 = 32768
  // Most entries per CTA of an index list; 0 = 8192. Sparse lists differ in length across
  // kv heads and sequences, and a plan that fits one wave with big chunks leaves a tail
  // behind the longest list (sketch_topp at 128K, batch 16: 605 us at 32768, 402 at 8192;
  // docs/cuda.md); dense ranges are equal and take the larger cap (2% faster there).
  int max_chunk_lists = 0;
  // Each CTA computes exactly its chunk (work stealing, measured slower, is a variant in
  // dev/cuda/attention_steal.cu).
  // L2 fetch size hinted by the K/V copies on a miss: 0 (the 32-byte sectors asked for),
  // 128 or 256 bytes (default: 256; measured ~2% faster than 0 on dense at 128K).
  int l2_prefetch = 256;
  // Dense calls (no index lists) over pages of a whole number of a warp's blocks (16
  // tokens with tensor cores, the default page size; 8 for the head_dim-256 CUDA-core
  // kernel) take a kernel whose copies need one page-table load per block instead of a
  // lookup per row. The CUDA-core kernel at head_dim 64 and 128 has no such form. false:
  // the general kernel everywhere (benchmarks compare the two).
  bool contiguous_dense = true;
};

// Workspace of attention_decode for one (kv shape, group): per-CTA partial results of the
// split-KV pass, per-list tickets of the in-kernel log-sum-exp merge, and an error word.
// The split is planned on the device inside the kernel from the list lengths (Tactic 4.6:
// each kv head's list is a subrequest; work is cut into equal chunks over all of them), so
// a decode step needs no host round trip.
class AttentionPlan {
 public:
  AttentionPlan(const DeviceKvView& kv, int group, const AttentionPlanOptions& options = {});
  ~AttentionPlan();
  AttentionPlan(const AttentionPlan&) = delete;
  AttentionPlan& operator=(const AttentionPlan&) = delete;

  // Synchronises `stream` and throws Error if a kernel flagged bad input since the last
  // check (an index outside [0, n_tokens), a list longer than its stride).
  void check(void* stream = nullptr);
  // Warps per CTA the plan runs: options.warps, or fewer where their rings would not fit
  // the device's shared memory (head_dim 256: 8 on an H100, 4 on an A100).
  int warps() const;
  // Whether the plan runs the tensor-core kernel: options.tensor_cores, except at head_dim
  // 256, which runs the CUDA-core kernel.
  bool tensor_cores() const;

  struct Impl;
  Impl* impl() const { return impl_; }

 private:
  Impl* impl_ = nullptr;
};

void attention_decode(const DeviceDecodeArgs& a, AttentionPlan& plan, void* stream = nullptr);

// ---- scoring (kernels/scoring.h on the device) -------------------------------------------

enum class PageScoreKind { kBound, kMean };

// scores[s][qh][p] for p < n_pages(s): Quest's bound sum_j max(q_j kmin_pj, q_j kmax_pj) or
// q . kmean_p (raw, unscaled); -inf for p in [n_pages(s), max_pages).
void page_score(const DeviceKvView& kv, int group, PageScoreKind kind, const float* q, float* scores,
                void* stream = nullptr);

// scores[s][qh][i] = q . k[t] (raw) with t = idx[s][h][i] for i < idx_len[s][h], or t = i
// for i < n_tokens(s) when idx is null; the rest of each row of `stride` entries is -inf.
void token_score(const DeviceKvView& kv, int group, const float* q, const int32_t* idx, const int32_t* idx_len,
                 int idx_stride, float* scores, int stride, void* stream = nullptr);

// ---- selection (kernels/selection.h on the device) ---------------------------------------
// Rows: values [n_rows][stride] float32 with row r holding len[r] <= stride entries.

// Workspace for sort_rows_desc (rows longer than the in-shared-memory sort take a
// device-wide segmented radix sort).
class SortWorkspace {
 public:
  SortWorkspace(int n_rows, int stride);
  ~SortWorkspace();
  SortWorkspace(const SortWorkspace&) = delete;
  SortWorkspace& operator=(const SortWorkspace&) = delete;
  struct Impl;
  Impl* impl() const { return impl_; }

 private:
  Impl* impl_ = nullptr;
};
// Largest row the shared-memory sort handles; longer rows use the segmented sort.
int sort_rows_block_capacity();

// order[r][0 .. len[r]): indices of row r by value descending, ties to the lower index (the
// order of ref::select_topk with k = n).
void sort_rows_desc(const float* values, const int32_t* len, int n_rows, int stride, int32_t* order, SortWorkspace& ws,
                    void* stream = nullptr);

// The k largest of each row (ties to the lower index, the set ref::select_topk returns),
// written as ascending indices: out[r][0 .. out_len[r]) with out_len[r] = min(k, len[r]).
//   out: [n_rows][k]
void select_topk_rows(const float* values, const int32_t* len, int n_rows, int stride, int k, int32_t* out,
                      int32_t* out_len, void* stream = nullptr);

// The fewest entries of each row whose nonnegative weights reach p * (row total) (the set
// ref::select_top_mass returns), as ascending indices: out[r][0 .. out_len[r]).
//   out: [n_rows][stride]; p in (0, 1]
void select_top_mass_rows(const float* weights, const int32_t* len, int n_rows, int stride, double p, int32_t* out,
                          int32_t* out_len, void* stream = nullptr);

// ---- k-means (kernels/kmeans.h on the device) --------------------------------------------

// assign[i] = argmin_c ||x_i - c||^2 (ties: the lower c), computed as ||c||^2 - 2 x_i . c
// in tiles of a matrix product X C^T with the argmin fused. x: [n][dim], centroids: [k][dim],
// assign: [n] in/out. Returns how many entries changed (synchronises the stream).
int64_t kmeans_assign(const float* x, int n, int dim, const float* centroids, int k, int32_t* assign,
                      void* stream = nullptr);
// centroids[c] = mean of the rows assigned to c (float64 sums in row order, so the result
// does not depend on scheduling); a centroid with no rows keeps its value. counts: [k].
void kmeans_update(const float* x, int n, int dim, const int32_t* assign, int k, float* centroids, int32_t* counts,
                   void* stream = nullptr);
// scores[h][c] = q[h] . centroids[c]. q: [n_q][dim]; scores: [n_q][k]
void kmeans_centroid_score(const float* centroids, int k, int dim, const float* q, int n_q, float* scores,
                           void* stream = nullptr);

}  // namespace cumulus::cuda
