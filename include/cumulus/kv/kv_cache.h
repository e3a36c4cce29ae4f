// Paged KV cache (DESIGN.md "Core types"). Pages of page_size tokens; K and V stored per
// (layer, kv head) so that one head's tokens are contiguous within a page:
//   page p of (layer l, kv head h): K [page_size][head_dim], V [page_size][head_dim]
// in the storage dtype (f16 by default). Every append keeps each page's key min, max and
// mean current (float32, over the page's valid tokens, computed from the stored keys so
// that Quest's bound holds exactly for what the kernels read).
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
  KvCache(const Shape& shape, const KvCacheOptions& options = {});
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

  // Drops every token of every layer (keeps allocated pages for reuse).
  void clear();

  // Keeps the first n tokens of every layer and drops the rest (keeps allocated pages).
  // The statistics of a page cut short are recomputed from its remaining keys and its
  // dropped rows read back as zero, exactly as if only n tokens had been appended.
  // Throws when a layer holds fewer than n tokens.
  void truncate(int n);

  // Changes whenever `layer` loses tokens (truncate, clear), never on append: what a method
  // that keeps per-token state (an index, a sketch) compares to know its tokens are the
  // cache's, since a cut followed by appends can restore the same token count.
  uint64_t generation(int layer) const;

  // Read-only view of one (layer, kv head) for the kernels. Valid until the next append
  // or clear.
  PagedHeadView view(int layer, int kv_head) const;

  // Token t of (layer, kv_head) converted to float32. out: [head_dim].
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

  Shape shape_;
  KvCacheOptions options_;
  std::vector<int> n_tokens_;                      // [n_layers]
  std::vector<uint64_t> generation_;               // [n_layers] tokens-lost events
  std::vector<std::unique_ptr<HeadStore>> heads_;  // [n_layers * n_kv_heads]
};

}  // namespace cumulus
