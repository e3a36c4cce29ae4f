// Paged KV cache (DESIGN.md "Core types"). Pages of page_size tokens; K and V stored per
// (layer, kv head) so that one head's tokens are contiguous within a page:
//   page p of (layer l, kv head h): K [page_size][head_dim], V [page_size][head_dim]
// in the storage dtype (f16 by default). Every append keeps each page's key min, max and
// mean current (float32, over the page's valid tokens, computed from the stored keys so
// that Quest's bound holds exactly for what the kernels read).
//
// Sliding-window layers (the constructor's layer_window, Gemma 3's local layers) keep only the
// pages their queries can still read: the query at position p reads tokens (p - w, p], so
// before tokens [t0, t0 + n) are appended, every page whose tokens all lie before t0 - w + 1
// is dropped and its memory taken by the next page the layer needs (a ring of whole pages,
// at most ceil((w - 1 + n) / page_size) + 1 live per head while the chunk is attended).
// pin_window(n) keeps the tokens the query at n reads from the cache ([n - w + 1, n)) through
// later appends, so that truncate(n) can return to n (a Session pins its prompt's end for
// restart_decode). Logical page and token numbers stay those of the whole sequence: a
// window layer's view has the same page table, with nullptr for dropped pages, and no page
// statistics (kmin, kmax, kmean are nullptr: no decode method runs on such a layer).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cumulus/core/buffer.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/shape.h"

namespace cumulus {

struct KvCacheOptions {
  int page_size = 16;          // power of two in [1, 256]
  DType dtype = DType::f16;    // storage dtype of K and V
  int max_tokens = 1 << 20;    // capacity per layer; append beyond it throws
};

class KvCache {
 public:
  // layer_window [n_layers]: 0 keeps every token of the layer; w >= 1 marks a sliding-window
  // layer whose queries read their last w tokens only (see above). Empty: every layer keeps
  // every token.
  KvCache(const Shape& shape, const KvCacheOptions& options = {}, std::vector<int> layer_window = {});
  ~KvCache();
  KvCache(KvCache&&) noexcept;
  KvCache& operator=(KvCache&&) noexcept;

  const Shape& shape() const { return shape_; }
  const KvCacheOptions& options() const { return options_; }
  int page_size() const { return options_.page_size; }
  DType dtype() const { return options_.dtype; }

  // Tokens cached in `layer` (layers fill independently during a forward pass).
  int n_tokens(int layer) const;

  // Appends n new tokens to `layer`.
  //   k, v: [n][n_kv_heads][head_dim] float32 (token-major, the layout a projection
  //         produces). Values are rounded to the storage dtype. Non-finite values throw.
  void append(int layer, const float* k, const float* v, int n);
  // Appends n tokens already in the storage dtype (a KV snapshot's rows, kv_snapshot.h):
  //   k, v: [n][n_kv_heads][head_dim] as dtype() values.
  // Pages and key statistics end up bit for bit as append() of the same values as float32
  // leaves them. Non-finite values throw, before anything is written.
  void append_stored(int layer, const void* k, const void* v, int n);

  // Fills this empty cache with the first n tokens of `src` (the same shape, page size, dtype
  // and windows), bit for bit: pages and key statistics as if the same tokens had been
  // appended. A window layer takes only the tokens its next query reads (the last w - 1),
  // which `src` must still hold. Throws, before anything changes, on a mismatch.
  void copy_prefix_from(const KvCache& src, int n);

  // A sliding-window layer: appends n tokens that its queries will never read (the start of
  // a KV snapshot that kept only the window): counted, not stored. The caller appends the
  // tokens the next query reads before any query runs. Throws for a layer that keeps every
  // token.
  void append_dropped(int layer, int n);

  // Drops every token of every layer (keeps allocated pages for reuse).
  void clear();

  // Keeps the first n tokens of every layer and drops the rest (keeps allocated pages).
  // The statistics of a page cut short are recomputed from its remaining keys and its
  // dropped rows read back as zero, exactly as if only n tokens had been appended.
  // Throws when a layer holds fewer than n tokens, or when a sliding-window layer no longer
  // holds the tokens a query at n reads ([n - w + 1, n): keep them with pin_window(n)).
  void truncate(int n);

  // Sliding-window layers keep the tokens [n - w + 1, n) through later appends (one pin at
  // a time; n = 0 releases it). Throws when a layer already dropped some of them.
  void pin_window(int n);

  // The layer's window w (0: it keeps every token).
  int window(int layer) const;
  // The first token whose K/V the layer holds for the query at position n_tokens(layer):
  // 0, or n_tokens - w + 1 for a sliding-window layer (never below 0).
  int first_needed(int layer) const;
  // The same for the query after a prefix of n tokens: 0, or n - w + 1 (never below 0).
  int first_needed(int layer, int n) const;

  // Bytes of memory the cache holds: K/V pages allocated (in use or free for reuse) and
  // the page statistics.
  size_t bytes_allocated() const;

  // Changes whenever `layer` loses tokens (truncate, clear), never on append: what a method
  // that keeps per-token state (an index, a sketch) compares to know its tokens are the
  // cache's, since a cut followed by appends can restore the same token count.
  uint64_t generation(int layer) const;

  // Read-only view of one (layer, kv head) for the kernels. Valid until the next append
  // or clear. A sliding-window layer's view: dropped pages are nullptr, no statistics.
  PagedHeadView view(int layer, int kv_head) const;

  // Token t of (layer, kv_head) converted to float32. out: [head_dim]. Throws for a token a
  // sliding-window layer dropped.
  void key_f32(int layer, int kv_head, int t, float* out) const;
  void value_f32(int layer, int kv_head, int t, float* out) const;

  // Bytes of K plus V storage per token per kv head (2 * head_dim * dtype size).
  size_t bytes_per_token_head() const { return 2 * static_cast<size_t>(shape_.head_dim) * dtype_size(dtype()); }

 private:
  struct HeadStore;
  // append (raw = false: k, v are float32) and append_stored (raw = true: storage dtype).
  void append_rows(int layer, const void* k, const void* v, int n, bool raw);
  HeadStore& head(int layer, int kv_head);
  const HeadStore& head(int layer, int kv_head) const;
  // Sliding-window layer: drops the pages whose tokens all lie before `keep_from`, except
  // the pinned ones (pages below window_first_page_ are dropped already, or pinned).
  void drop_window_pages(int layer, int keep_from);
  // The page table entry p of a window layer's head, taken from its free pages (zeroed) or
  // a new slab.
  void window_page_acquire(HeadStore& s, int p);
  void window_page_release(HeadStore& s, int p);
  bool pinned_page(int layer, int p) const;

  Shape shape_;
  KvCacheOptions options_;
  std::vector<int> n_tokens_;                      // [n_layers]
  std::vector<uint64_t> generation_;               // [n_layers] tokens-lost events
  std::vector<std::unique_ptr<HeadStore>> heads_;  // [n_layers * n_kv_heads]
  std::vector<int> window_;                        // [n_layers] 0 or w
  std::vector<int> window_first_page_;             // [n_layers] window layers: pages below are dropped or pinned
  int pin_ = 0;                                    // pin_window's n (0: none)
};

}  // namespace cumulus
