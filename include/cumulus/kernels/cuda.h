// CUDA backend of the decode ops (src/kernels/cuda, docs/cuda.md): device buffers, a batch
// of paged KV caches of one layer on the device, and the ops of kernels/attention.h,
// scoring.h, selection.h and kmeans.h over device memory. Plain C++: this header includes
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

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/core/shape.h"

namespace cumulus::cuda {

// ---- runtime ----------------------------------------------------------------------------

// True when a CUDA device can be used (never throws; false without a driver or device).
bool device_available() noexcept;

struct DeviceInfo {
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t memory_bytes = 0;
  size_t l2_bytes = 0;
  int driver_version = 0, runtime_version = 0;
};
DeviceInfo device_info();

// Waits for all work on the device.
void device_synchronize();

// Synchronous copies between host memory and device memory (device_* are device pointers).
void memcpy_to_host(void* dst, const void* device_src, size_t bytes);
void memcpy_to_device(void* device_dst, const void* src, size_t bytes);

// What a failed device allocation throws: an Error (callers that need not tell it apart
// catch Error), so that a caller can answer "does not fit" to exactly that failure.
class DeviceMemoryError : public Error {
 public:
  using Error::Error;
};

// Owning device allocation (cudaMalloc), move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  // Synchronous (the device is done when they return, whatever stream runs next); offset
  // and bytes are checked against size().
  void upload(const void* src, size_t bytes, size_t offset = 0);
  void download(void* dst, size_t bytes, size_t offset = 0) const;
  void fill_bytes(int value);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
DeviceBuffer to_device(const std::vector<T>& v) {
  DeviceBuffer b(v.size() * sizeof(T));
  if (!v.empty()) b.upload(v.data(), v.size() * sizeof(T));
  return b;
}
template <class T>
std::vector<T> to_host(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  if (n > 0) b.download(v.data(), n * sizeof(T));
  return v;
}

// A created stream (cudaStreamNonBlocking), move-only.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* handle() const { return s_; }
  void synchronize() const;

 private:
  void* s_ = nullptr;
};

// Asynchronous fill and device-to-device copy on a stream (benchmarks: cache flushes and
// the copy-bandwidth reference).
void memset_async(void* device_dst, int value, size_t bytes, void* stream = nullptr);
void memcpy_device_async(void* device_dst, const void* device_src, size_t bytes, void* stream = nullptr);

// A pair of CUDA events around work on a stream; elapsed_ms() waits for the stop event.
class EventTimer {
 public:
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start(void* stream = nullptr);
  void stop(void* stream = nullptr);
  float elapsed_ms() const;

 private:
  void* a_ = nullptr;
  void* b_ = nullptr;
};

// Work captured from a stream (which must not be the legacy default stream) and replayed
// as one CUDA graph: how a serving loop launches a decode step without per-kernel gaps.
class Graph {
 public:
  // Captures everything `fn` enqueues on `stream`.
  template <class Fn>
  static Graph capture(void* stream, Fn&& fn) {
    Graph g;
    g.begin(stream);
    fn();
    g.end(stream);
    return g;
  }
  Graph() = default;
  ~Graph();
  Graph(Graph&& o) noexcept;
  Graph& operator=(Graph&& o) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch(void* stream) const;

 private:
  void begin(void* stream);
  void end(void* stream);
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

// ---- paged KV on the device -------------------------------------------------------------

// One layer of a batch of paged caches on the device (device pointers; plain data).
//   k, v:              [n_pool_pages][page_size][head_dim] in dtype (f16 or bf16)
//   kmin, kmax, kmean: [n_pool_pages][head_dim] float32 per-page key statistics
//   page_table:        [n_seqs][n_kv_heads][max_pages] pool page of each logical page
//   n_tokens:          [n_seqs] tokens cached per sequence (every kv head holds them all)
// max_tokens is a host-side bound of n_tokens (grids and scratch are sized from it).
struct DeviceKvView {
  const void* k = nullptr;
  const void* v = nullptr;
  const float* kmin = nullptr;
  const float* kmax = nullptr;
  const float* kmean = nullptr;
  const int32_t* page_table = nullptr;
  const int32_t* n_tokens = nullptr;
  int n_seqs = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int page_size = 16;
  int page_shift = 4;
  int max_pages = 0;
  int max_tokens = 0;
  DType dtype = DType::f16;

  // Throws Error naming the first bad field (null pointer, unsupported head_dim or dtype).
  void validate(const char* fn) const;
};

// Head dims the CUDA decode kernels are built for: 64, 128 and 256 (the prefill kernels:
// 64 and 128, checked by the functions of cuda_prefill.h).
bool head_dim_supported_cuda(int head_dim);

// One (sequence, kv head) of a DeviceKvCache copied back to the host (tests, tools):
// k, v: [n_tokens][head_dim] as stored (16-bit codes); kmin, kmax, kmean: [n_pages][head_dim].
struct DeviceKvHeadCopy {
  int n_tokens = 0;
  std::vector<uint16_t> k, v;
  std::vector<float> kmin, kmax, kmean;
};

// Owns the device copy of DeviceKvView's arrays: a pool of pages, a page table per
// (sequence, kv head) and the per-page key statistics. Either uploaded from host caches
// (upload, upload_replicated) or created empty and filled on the device (create, reserve,
// append), as the model runtime does (src/model/cuda, docs/cuda.md "Model runtime").
class DeviceKvCache {
 public:
  // An empty cache: n_seqs sequences of n_kv_heads heads, each holding up to max_tokens
  // tokens, pages of page_size tokens from a pool of pool_pages pages (0: enough for every
  // sequence at max_tokens). No page is assigned until reserve().
  static DeviceKvCache create(int n_seqs, int n_kv_heads, int head_dim, DType dtype, int page_size, int max_tokens,
                              int pool_pages = 0);
  // Bytes create() allocates for these arguments (memory checks before any work).
  static size_t create_bytes(int n_seqs, int n_kv_heads, int head_dim, DType dtype, int page_size, int max_tokens,
                             int pool_pages = 0);
  // Gives sequence s pool pages (every kv head) until it can hold n tokens; uploads the new
  // page-table entries (synchronous: call it outside a decode step). Throws Error when n
  // exceeds max_tokens or the pool has too few free pages.
  void reserve(int seq, int n);
  // Appends n_new tokens to every sequence, on the device: row t = n_tokens[s] + i of
  // sequence s gets k[s][i][h] and v[s][i][h] rounded to the storage dtype, the key
  // statistics of every page it touches are recomputed over the page's stored keys (as
  // KvCache::append keeps them: min, max, float64 sum in row order / length), and n_tokens
  // advances. The position is read on the device (no host round trip; graph-capturable);
  // the host copy of the counts advances too, and must stay within what reserve() gave.
  //   k, v: [n_seqs][n_new][n_kv_heads][head_dim] float32, device pointers
  void append(const float* k, const float* v, int n_new, void* stream = nullptr);
  // An append() captured in a CUDA graph, replayed: advances the host copy of the counts as
  // append() does, with its checks, and enqueues nothing (the graph does the device work).
  void append_replayed(int n_new);
  // Drops the tokens of sequence s from n on (KvCache::truncate): their rows become zero,
  // the statistics of the page cut short are recomputed, pages past it go back to the pool.
  // Synchronous.
  void truncate(int seq, int n);
  // Sequence s, kv head h as stored (synchronous).
  DeviceKvHeadCopy download_head(int seq, int h) const;
  // seqs[s][h]: the view of kv head h of sequence s (one layer; one head_dim, dtype and
  // page size; every head of a sequence holds the same token count). Pages go to the pool
  // in order, or in a seeded random order when scramble_seed != 0 (tests use it to prove
  // that kernels follow the page table).
  static DeviceKvCache upload(const std::vector<std::vector<PagedHeadView>>& seqs, uint64_t scramble_seed = 0);
  // n_copies sequences that all hold the contents of `seq`, each in its own memory.
  static DeviceKvCache upload_replicated(const std::vector<PagedHeadView>& seq, int n_copies);

  DeviceKvView view() const { return view_; }
  const std::vector<int>& n_tokens() const { return n_tokens_; }
  // Attend a prefix: n[s] <= the tokens uploaded for s (synchronous upload of the counts).
  void set_n_tokens(const std::vector<int>& n);
  size_t kv_bytes() const { return kv_bytes_; }
  // Free pages left in the pool.
  int free_pages() const { return static_cast<int>(free_.size()); }

 private:
  // Points view_ at this cache's buffers with these shapes (create and upload).
  void bind_view(int n_seqs, int n_kv_heads, int head_dim, int page_size, int max_pages, int max_tokens, DType dtype);

  DeviceBuffer k_, v_, kmin_, kmax_, kmean_, table_, n_tok_;
  std::vector<int> n_tokens_, capacity_;
  std::vector<int32_t> table_host_;  // [n_seqs][n_kv_heads][max_pages]; -1 = no page yet
  std::vector<int32_t> free_;        // pool pages not in any table (create() caches)
  std::vector<int> reserved_;        // [n_seqs] tokens the assigned pages hold
  DeviceKvView view_;
  size_t kv_bytes_ = 0;
};

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
