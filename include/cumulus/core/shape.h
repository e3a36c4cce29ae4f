// Model attention shape and the read-only view of one (layer, kv head) of a paged cache
// that kernels consume. The view lives in core so that kernels (which may not use kv/)
// and the cache (which may not use kernels/) share it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cumulus/core/dtype.h"

namespace cumulus {

struct Shape {
  int n_layers = 1;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;

  int group() const { return n_q_heads / n_kv_heads; }
  // Throws Error for zero or negative sizes, n_q_heads not a multiple of n_kv_heads, or a
  // head_dim outside kSupportedHeadDims.
  void validate() const;
};

// head_dim values the kernels support (multiples of 8 up to 256).
bool head_dim_supported(int head_dim);

// One (layer, kv head) of a paged KV cache.
//   k_pages[p], v_pages[p]: [page_size][head_dim] in `dtype`, token t at page t >> page_shift,
//                           row t & (page_size - 1). The last page may be partial.
//   kmin, kmax, kmean:      [n_pages][head_dim] float32 per-page key statistics over the
//                           page's valid tokens, computed from the STORED (rounded) keys.
struct PagedHeadView {
  const void* const* k_pages = nullptr;
  const void* const* v_pages = nullptr;
  const float* kmin = nullptr;
  const float* kmax = nullptr;
  const float* kmean = nullptr;
  int n_tokens = 0;
  int head_dim = 0;
  int page_size = 16;
  int page_shift = 4;
  DType dtype = DType::f16;

  int n_pages() const { return (n_tokens + page_size - 1) >> page_shift; }
  int page_len(int p) const {
    int rest = n_tokens - (p << page_shift);
    return rest < page_size ? rest : page_size;
  }
  size_t row_bytes() const { return static_cast<size_t>(head_dim) * dtype_size(dtype); }
  const void* key(int t) const {
    return static_cast<const char*>(k_pages[t >> page_shift]) + (t & (page_size - 1)) * row_bytes();
  }
  const void* value(int t) const {
    return static_cast<const char*>(v_pages[t >> page_shift]) + (t & (page_size - 1)) * row_bytes();
  }
};

}  // namespace cumulus
