// The KV cache on the device (src/kv/cuda, library cumulus_kv_cuda; docs/cuda.md): one
// layer of a batch of paged caches, the device twin of KvCache (kv/kv_cache.h) with the same
// pages and per-page key statistics, handed to the kernels as a DeviceKvView
// (core/cuda_runtime.h). Plain C++: no CUDA header. Built only with CUMULUS_CUDA=ON.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cumulus/core/cuda_runtime.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/shape.h"

namespace cumulus::cuda {

class KvPagePool;  // kv/cuda_kv_pool.h

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
  // An empty cache whose pages come from `pool` (kv/cuda_kv_pool.h), shared with other
  // caches (one per layer, PSA's unified pool) and maybe in two tiers: the pool's head_dim,
  // dtype and page size; this cache owns its page tables and counts, and gives its pages back
  // when it is destroyed or truncated. reserve() takes pages from the pool (on the device
  // while it has room, demoting the least recently used pages to the host tier).
  static DeviceKvCache create(std::shared_ptr<KvPagePool> pool, int n_seqs, int n_kv_heads, int max_tokens);
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

  DeviceKvCache() = default;
  ~DeviceKvCache();
  DeviceKvCache(DeviceKvCache&& o) noexcept = default;
  DeviceKvCache& operator=(DeviceKvCache&& o) noexcept;

  DeviceKvView view() const { return view_; }
  const std::vector<int>& n_tokens() const { return n_tokens_; }
  // Attend a prefix: n[s] <= the tokens uploaded for s (synchronous upload of the counts).
  void set_n_tokens(const std::vector<int>& n);
  // Bytes of this cache's own K/V pool (0 over a KvPagePool, whose bytes are its own).
  size_t kv_bytes() const { return kv_bytes_; }
  // Free pages left in the pool (over a KvPagePool: its free pages, both tiers).
  int free_pages() const;

 private:
  // Points view_ at this cache's buffers with these shapes (create and upload).
  void bind_view(int n_seqs, int n_kv_heads, int head_dim, int page_size, int max_pages, int max_tokens, DType dtype);

  // The slots of every assigned page (pool mode), for the pool.
  std::vector<int32_t> assigned_slots() const;
  // The page arrays the kernels write (this cache's buffers or the pool's).
  template <class T>
  T* pool_k() const {
    return static_cast<T*>(const_cast<void*>(view_.k));
  }
  template <class T>
  T* pool_v() const {
    return static_cast<T*>(const_cast<void*>(view_.v));
  }

  DeviceBuffer k_, v_, kmin_, kmax_, kmean_, table_, n_tok_;
  std::shared_ptr<KvPagePool> pool_;  // pool mode: the pages are the pool's, k_..kmean_ empty
  std::vector<int> n_tokens_, capacity_;
  std::vector<int32_t> table_host_;  // [n_seqs][n_kv_heads][max_pages]; -1 = no page yet
  std::vector<int32_t> free_;        // pool pages not in any table (create() caches)
  std::vector<int> reserved_;        // [n_seqs] tokens the assigned pages hold
  DeviceKvView view_;
  size_t kv_bytes_ = 0;
};

}  // namespace cumulus::cuda
