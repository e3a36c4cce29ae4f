// CUDA prefill attention (src/kernels/cuda/prefill.cu, docs/cuda.md "Prefill"): the device
// twins of kernels/prefill.h for one layer's whole prompt, and FlexPrefill's probe (FlexPrefill,
// "Query-Aware Sparse Pattern Determination", Algorithm 3 step 1) on the device with the
// block selection on the host (include/cumulus/kernels/flexprefill_select.h, the CPU method's own
// code).
//
// Tensors are contiguous and head-major (what a GPU projection writes per head), f16:
//   q, out: [n_q_heads][n][head_dim];  k, v: [n_kv_heads][n][head_dim]
// query head qh reads kv head qh / group (non-interleaved GQA, as on the CPU). Query i sits at
// position i and attends keys j <= i (the prompt from position 0; no chunking on the device).
// Kernels: flash-style (FlashAttention-2 order: a CTA owns 64 query rows, streams 64-key tiles
// through shared memory with cp.async, online softmax in registers), scores and P.V on
// tensor cores (mma.sync m16n8k16, f16 operands, float32 accumulation; P rounded to f16 as
// FlashAttention does). At head_dim 256 Q stays in shared memory (its fragments reloaded per
// k-step) and K, V have one buffer each, so O's 256 columns fit in registers without spills
// (prefill.cu's file comment). Plain C++ header: no CUDA header (DESIGN.md).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cumulus/core/thread_pool.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/prefill.h"

namespace cumulus::flexprefill {
struct Config;
struct HeadSelection;
}  // namespace cumulus::flexprefill

namespace cumulus::cuda {

// Device pointers; head_dim 64, 128 or 256.
//   lse: optional [n_q_heads][n] float32, log sum_j exp(scale q_i.k_j) (natural log) over
//        the attended keys; -inf (and out = 0) for a row that attends nothing
struct DevicePrefillArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int n = 0;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  float scale = 0.0f;
  // attention_prefill_dense only: the queries are rows [q_first, n) of the sequence (q and
  // out hold n - q_first rows per head; k and v all n rows), so a prompt can be prefilled
  // in chunks against the keys cached before each chunk. A multiple of 64.
  int q_first = 0;

  // Throws Error naming the first bad field.
  void validate(const char* fn) const;
};

// A BlockSparseLayout on the device (first_q_block 0: the whole prompt). block_size must be
// a multiple of 64 (the kernel's key tile).
class DeviceBlockLayout {
 public:
  DeviceBlockLayout() = default;
  // Validates the layout against a prompt of n tokens (sorted, unique, causal lists).
  static DeviceBlockLayout upload(const BlockSparseLayout& layout, int n);
  const int32_t* offsets() const { return offsets_.as<int32_t>(); }
  const int32_t* blocks() const { return blocks_.as<int32_t>(); }
  int block_size() const { return block_size_; }
  int n_q_blocks() const { return n_q_blocks_; }
  int n_q_heads() const { return n_q_heads_; }
  int64_t n_entries() const { return n_entries_; }

 private:
  DeviceBuffer offsets_, blocks_;
  int block_size_ = 0, n_q_blocks_ = 0, n_q_heads_ = 0;
  int64_t n_entries_ = 0;
};

// Dense causal prefill: out[qh][i] = softmax_{j <= i}(scale q.k_j) V.
void attention_prefill_dense(const DevicePrefillArgs& a, void* stream = nullptr);
// Only the key blocks the layout lists for (qh, query block), causal inside them.
void attention_prefill_block_sparse(const DevicePrefillArgs& a, const DeviceBlockLayout& layout,
                                    void* stream = nullptr);

// FlexPrefill's inputs computed where Q and K live (one layer, the whole prompt):
//   vertical, slash: [n_q_heads][n] the last L = min(block_size, n) rows' causal attention
//                    summed onto columns and diagonals (the CPU's attention_prefill_projection)
//   k_block_mean:    [n_kv_heads][nb][head_dim] mean key per key block
//   q_block_mean:    [n_q_heads][nb][head_dim] mean query per query block
//   q_probe_mean:    [n_q_heads][head_dim]     mean of the L probe rows
// all float32 in page-locked host memory after download() (views valid while the probe
// lives; the next download overwrites them). The probe's row normalisers come from the dense
// tensor-core kernel run over the last rows (lse); the projection is float32 CUDA-core work.
class FlexPrefillProbe {
 public:
  FlexPrefillProbe(int n, int n_q_heads, int n_kv_heads, int head_dim, int block_size);
  ~FlexPrefillProbe();
  FlexPrefillProbe(const FlexPrefillProbe&) = delete;
  FlexPrefillProbe& operator=(const FlexPrefillProbe&) = delete;

  // The most probe rows (min(block_size, n)) of head_dim 64, 128 or 256 that the current
  // device's shared memory holds (the constructor refuses more).
  static int max_rows(int head_dim);
  // Device memory a probe of these sizes allocates (its page-locked host copy, made by the
  // first download, is the five results: less than this).
  static size_t device_bytes(int n, int n_q_heads, int n_kv_heads, int head_dim, int block_size);

  // Enqueues the probe kernels on `stream` (no host wait).
  void run(const DevicePrefillArgs& a, void* stream = nullptr);
  // Copies the results to the host views below (on `stream`, then waits for it).
  void download(void* stream = nullptr);

  int n, n_q_heads, n_kv_heads, head_dim, block_size, n_blocks, n_rows;
  std::span<const float> vertical, slash, k_block_mean, q_block_mean, q_probe_mean;

 private:
  DeviceBuffer vertical_, slash_, kmean_, qmean_, qprobe_, lse_, scratch_out_;
  float* host_ = nullptr;  // page-locked: the five results back to back
};

// The host half: flexprefill::select_head per query head (in parallel on `pool`) on the
// probe's downloaded results; the layout and, when `heads` is given, each head's selection.
BlockSparseLayout flexprefill_select(const flexprefill::Config& c, const FlexPrefillProbe& probe, ThreadPool& pool,
                                     std::vector<flexprefill::HeadSelection>* heads = nullptr);

}  // namespace cumulus::cuda
