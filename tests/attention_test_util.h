// Test-local paged K/V for the attention tests: page buffers built by hand (no KvCache),
// so the kernels are tested against nothing but PagedHeadView.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/core/selection.h"
#include "cumulus/core/shape.h"

namespace cumulus::attn_test {

// One layer: n_kv heads, each with its own token count, pages of page_size rows.
struct AttnTestCache {
  int head_dim = 0;
  int page_size = 16;
  DType dtype = DType::f16;
  // [n_kv][n_pages] page buffers of [page_size][head_dim] in dtype (64-byte aligned rows
  // are not required by the view; buffers are plain vectors)
  std::vector<std::vector<std::vector<uint8_t>>> k_bufs, v_bufs;
  std::vector<std::vector<const void*>> k_ptrs, v_ptrs;
  std::vector<PagedHeadView> views;

  int n_kv() const { return static_cast<int>(views.size()); }
};

inline int attn_log2(int x) {
  int s = 0;
  while ((1 << s) < x) ++s;
  return s;
}

// Empty per-head structure; rows are written by attn_cache_set_row.
inline AttnTestCache attn_cache_alloc(const std::vector<int>& n_tokens, int head_dim, DType dt, int page_size) {
  AttnTestCache c;
  c.head_dim = head_dim;
  c.page_size = page_size;
  c.dtype = dt;
  const size_t page_bytes = static_cast<size_t>(page_size) * head_dim * dtype_size(dt);
  const int n_kv = static_cast<int>(n_tokens.size());
  c.k_bufs.resize(n_kv);
  c.v_bufs.resize(n_kv);
  c.k_ptrs.resize(n_kv);
  c.v_ptrs.resize(n_kv);
  c.views.resize(n_kv);
  for (int h = 0; h < n_kv; ++h) {
    const int n_pages = (n_tokens[h] + page_size - 1) / page_size;
    // Poison bytes (0x7f..: large finite values / NaN patterns) so a kernel that reads
    // past the last valid row of a partial page changes the result.
    c.k_bufs[h].assign(n_pages, std::vector<uint8_t>(page_bytes, 0x7f));
    c.v_bufs[h].assign(n_pages, std::vector<uint8_t>(page_bytes, 0x7f));
    for (int p = 0; p < n_pages; ++p) {
      c.k_ptrs[h].push_back(c.k_bufs[h][p].data());
      c.v_ptrs[h].push_back(c.v_bufs[h][p].data());
    }
    PagedHeadView& v = c.views[h];
    v.k_pages = c.k_ptrs[h].data();
    v.v_pages = c.v_ptrs[h].data();
    v.n_tokens = n_tokens[h];
    v.head_dim = head_dim;
    v.page_size = page_size;
    v.page_shift = attn_log2(page_size);
    v.dtype = dt;
  }
  return c;
}

inline void attn_cache_set_row(AttnTestCache& c, int h, int t, const float* k, const float* v) {
  const size_t row = static_cast<size_t>(c.head_dim) * dtype_size(c.dtype);
  uint8_t* kd = c.k_bufs[h][t / c.page_size].data() + static_cast<size_t>(t % c.page_size) * row;
  uint8_t* vd = c.v_bufs[h][t / c.page_size].data() + static_cast<size_t>(t % c.page_size) * row;
  convert_from_f32(k, kd, c.dtype, c.head_dim);
  convert_from_f32(v, vd, c.dtype, c.head_dim);
}

// Random cache: keys N(0,1) plus a per-dimension offset and a few "heavy" tokens with
// large norms so the softmax is far from uniform; values N(0,1). Never zero.
inline AttnTestCache attn_cache_random(const std::vector<int>& n_tokens, int head_dim, DType dt, int page_size,
                                       std::mt19937& rng) {
  AttnTestCache c = attn_cache_alloc(n_tokens, head_dim, dt, page_size);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(head_dim), v(head_dim);
  for (int h = 0; h < c.n_kv(); ++h) {
    for (int t = 0; t < n_tokens[h]; ++t) {
      const float boost = (rng() % 37 == 0) ? 3.0f : 1.0f;
      for (int j = 0; j < head_dim; ++j) {
        k[j] = boost * nd(rng) + 0.25f * static_cast<float>((j % 7) - 3);
        v[j] = nd(rng);
      }
      attn_cache_set_row(c, h, t, k.data(), v.data());
    }
  }
  return c;
}

// Copies the selected tokens of every head, in list order, into a fresh cache (what a
// dense pass over only those tokens would see).
inline AttnTestCache attn_cache_gather(const AttnTestCache& src, const Selection& sel, int page_size) {
  std::vector<int> n;
  for (const auto& l : sel.tokens) n.push_back(static_cast<int>(l.size()));
  AttnTestCache c = attn_cache_alloc(n, src.head_dim, src.dtype, page_size);
  const size_t row = static_cast<size_t>(src.head_dim) * dtype_size(src.dtype);
  for (int h = 0; h < c.n_kv(); ++h) {
    for (int i = 0; i < n[h]; ++i) {
      const int t = sel.tokens[h][i];
      uint8_t* kd = c.k_bufs[h][i / page_size].data() + static_cast<size_t>(i % page_size) * row;
      uint8_t* vd = c.v_bufs[h][i / page_size].data() + static_cast<size_t>(i % page_size) * row;
      std::memcpy(kd, src.views[h].key(t), row);
      std::memcpy(vd, src.views[h].value(t), row);
    }
  }
  return c;
}

inline std::vector<float> attn_random_q(int n_q, int head_dim, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n_q) * head_dim);
  for (auto& x : q) x = nd(rng);
  return q;
}

// A random sorted unique subset of [0, n) with about `frac` of the tokens (at least one
// when n > 0 and nonempty is set).
inline std::vector<int32_t> attn_random_list(int n, double frac, std::mt19937& rng, bool nonempty = true) {
  std::vector<int32_t> out;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int t = 0; t < n; ++t)
    if (u(rng) < frac) out.push_back(t);
  if (out.empty() && nonempty && n > 0) out.push_back(static_cast<int32_t>(rng() % n));
  return out;
}

}  // namespace cumulus::attn_test
