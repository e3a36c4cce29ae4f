// Reference prefill attention (scalar, float64 accumulation, never optimised) and the input
// checks every backend shares; the contract is in kernels/prefill.h. Each query row is
// attended on its own: scores over its attended keys, then the normalised weighted sum of
// values (two passes, no online softmax), so this file is the plain definition the SIMD and
// CUDA versions are tested against. Keys and values are widened from the storage dtype
// exactly (f16 and bf16 are representable in float32) and then to float64.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/prefill.h"

namespace cumulus {

namespace {

void validate_view(const PagedHeadView& v, int h, int head_dim, DType dtype, int need_tokens) {
  CUMULUS_CHECK(head_dim_supported(v.head_dim), "kv[{}].head_dim={} is not supported (multiples of 8 in [8, 256])", h,
                v.head_dim);
  CUMULUS_CHECK(v.head_dim == head_dim, "kv[{}].head_dim={} differs from kv[0].head_dim={}", h, v.head_dim, head_dim);
  CUMULUS_CHECK(v.dtype == dtype, "kv[{}].dtype={} differs from kv[0].dtype={}", h, dtype_name(v.dtype),
                dtype_name(dtype));
  CUMULUS_CHECK(v.page_size >= 1 && v.page_size <= 256 && v.page_shift >= 0 && v.page_shift < 16 &&
                    (1 << v.page_shift) == v.page_size,
                "kv[{}].page_size={} must be a power of two in [1, 256] equal to 1 << page_shift={}", h, v.page_size,
                v.page_shift);
  CUMULUS_CHECK(v.n_tokens >= need_tokens, "kv[{}].n_tokens={} must be >= {} (the chunk's last position + 1)", h,
                v.n_tokens, need_tokens);
  CUMULUS_CHECK(v.k_pages != nullptr && v.v_pages != nullptr, "kv[{}].k_pages and v_pages must be non-null", h);
}

void check_finite_rows(const float* x, int64_t rows, int cols, const char* what) {
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) {
      const float v = x[r * cols + j];
      CUMULUS_CHECK(std::isfinite(v), "{}[{}][{}]={} is not finite", what, r, j, v);
    }
}

}  // namespace

void attention_prefill_validate(const PrefillAttnArgs& a, const BlockSparseLayout* layout) {
  CUMULUS_CHECK(a.kv != nullptr, "kv must be non-null");
  CUMULUS_CHECK(a.n_kv_heads > 0, "n_kv_heads={} must be positive", a.n_kv_heads);
  CUMULUS_CHECK(a.group >= 1, "group={} must be >= 1", a.group);
  CUMULUS_CHECK(std::isfinite(a.scale) && a.scale > 0.0f, "scale={} must be finite and > 0", a.scale);
  CUMULUS_CHECK(a.pos >= 0, "pos={} must be >= 0", a.pos);
  CUMULUS_CHECK(a.n_q >= 1, "n_q={} must be >= 1", a.n_q);
  CUMULUS_CHECK(a.q != nullptr && a.out != nullptr, "q and out must be non-null");
  const int head_dim = a.kv[0].head_dim;
  for (int h = 0; h < a.n_kv_heads; ++h) validate_view(a.kv[h], h, head_dim, a.kv[0].dtype, a.pos + a.n_q);
  const int n_q_heads = a.n_kv_heads * a.group;
  // q rows are [n_q][n_q_heads * head_dim]; the message names token and flat column.
  check_finite_rows(a.q, a.n_q, n_q_heads * head_dim, "q");
  if (layout == nullptr) return;
  const BlockSparseLayout& L = *layout;
  const int b = L.block_size;
  CUMULUS_CHECK(b >= 1, "layout.block_size={} must be >= 1", b);
  const int first = a.pos / b, last = (a.pos + a.n_q - 1) / b;
  CUMULUS_CHECK(L.first_q_block == first && L.n_q_blocks == last - first + 1,
                "layout covers query blocks [{}, {}) but the chunk [{}, {}) with block_size={} covers [{}, {}]",
                L.first_q_block, L.first_q_block + L.n_q_blocks, a.pos, a.pos + a.n_q, b, first, last);
  CUMULUS_CHECK(L.n_q_heads == n_q_heads, "layout.n_q_heads={} must equal n_kv_heads * group = {}", L.n_q_heads,
                n_q_heads);
  const size_t n_lists = static_cast<size_t>(n_q_heads) * L.n_q_blocks;
  CUMULUS_CHECK(L.offsets.size() == n_lists + 1, "layout.offsets.size()={} must be n_q_heads * n_q_blocks + 1 = {}",
                L.offsets.size(), n_lists + 1);
  CUMULUS_CHECK(L.offsets[0] == 0 && L.offsets.back() == static_cast<int32_t>(L.blocks.size()),
                "layout.offsets must start at 0 and end at blocks.size()={} (they are {} .. {})", L.blocks.size(),
                L.offsets[0], L.offsets.back());
  for (int h = 0; h < n_q_heads; ++h) {
    for (int r = 0; r < L.n_q_blocks; ++r) {
      const size_t i = static_cast<size_t>(h) * L.n_q_blocks + r;
      CUMULUS_CHECK(L.offsets[i + 1] >= L.offsets[i], "layout.offsets[{}]={} is below offsets[{}]={}", i + 1,
                    L.offsets[i + 1], i, L.offsets[i]);
      const std::span<const int32_t> list = L.list(h, r);
      for (size_t k = 0; k < list.size(); ++k) {
        CUMULUS_CHECK(list[k] >= 0 && list[k] <= first + r,
                      "layout list of query head {}, query block {}: key block {} is outside [0, {}]", h, first + r,
                      list[k], first + r);
        if (k > 0)
          CUMULUS_CHECK(list[k] > list[k - 1],
                        "layout list of query head {}, query block {}: key block {} follows {} (lists must be sorted "
                        "ascending and unique)",
                        h, first + r, list[k], list[k - 1]);
      }
    }
  }
}

void attention_prefill_projection_validate(const PrefillProjectionArgs& a) {
  CUMULUS_CHECK(a.kv != nullptr, "kv must be non-null");
  CUMULUS_CHECK(std::isfinite(a.scale) && a.scale > 0.0f, "scale={} must be finite and > 0", a.scale);
  CUMULUS_CHECK(a.n_keys >= 1, "n_keys={} must be >= 1", a.n_keys);
  CUMULUS_CHECK(a.n_rows >= 1 && a.n_rows <= a.n_keys, "n_rows={} must be in [1, n_keys={}]", a.n_rows, a.n_keys);
  CUMULUS_CHECK(a.q != nullptr && a.vertical != nullptr && a.slash != nullptr, "q, vertical and slash must be non-null");
  validate_view(*a.kv, 0, a.kv->head_dim, a.kv->dtype, a.n_keys);
  check_finite_rows(a.q, a.n_rows, a.kv->head_dim, "q");
}

BlockSparseLayout block_sparse_layout_causal(int pos, int n_q, int n_q_heads, int block_size) {
  CUMULUS_CHECK(pos >= 0 && n_q >= 1 && n_q_heads >= 1 && block_size >= 1,
                "pos={}, n_q={}, n_q_heads={}, block_size={}: need pos >= 0 and the rest >= 1", pos, n_q, n_q_heads,
                block_size);
  BlockSparseLayout L;
  L.block_size = block_size;
  L.first_q_block = pos / block_size;
  L.n_q_blocks = (pos + n_q - 1) / block_size - L.first_q_block + 1;
  L.n_q_heads = n_q_heads;
  L.offsets.push_back(0);
  for (int h = 0; h < n_q_heads; ++h)
    for (int r = 0; r < L.n_q_blocks; ++r) {
      for (int c = 0; c <= L.first_q_block + r; ++c) L.blocks.push_back(c);
      L.offsets.push_back(static_cast<int32_t>(L.blocks.size()));
    }
  return L;
}

namespace ref {
namespace {

double dot(const float* q, const PagedHeadView& kv, int t) {
  const void* k = kv.key(t);
  double s = 0.0;
  for (int j = 0; j < kv.head_dim; ++j) s += static_cast<double>(q[j]) * dtype_load(k, kv.dtype, j);
  return s;
}

// One query row over the keys `keys` (ascending): out [head_dim], returns the lse.
float attend_row(const PagedHeadView& kv, double scale, const float* q, const std::vector<int>& keys, float* out) {
  const int dim = kv.head_dim;
  if (keys.empty()) {
    std::fill(out, out + dim, 0.0f);
    return -std::numeric_limits<float>::infinity();
  }
  std::vector<double> s(keys.size());
  double m = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < keys.size(); ++i) {
    s[i] = scale * dot(q, kv, keys[i]);
    m = std::max(m, s[i]);
  }
  std::vector<double> o(static_cast<size_t>(dim), 0.0);
  double l = 0.0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const double p = std::exp(s[i] - m);
    l += p;
    const void* v = kv.value(keys[i]);
    for (int j = 0; j < dim; ++j) o[j] += p * dtype_load(v, kv.dtype, j);
  }
  for (int j = 0; j < dim; ++j) out[j] = static_cast<float>(o[j] / l);
  return static_cast<float>(m + std::log(l));
}

// Shared by dense (layout == nullptr) and block-sparse.
void attend_chunk(const PrefillAttnArgs& a, const BlockSparseLayout* layout) {
  const int dim = a.kv[0].head_dim;
  const int n_q_heads = a.n_kv_heads * a.group;
  std::vector<int> keys;
  for (int i = 0; i < a.n_q; ++i) {
    const int p = a.pos + i;
    for (int qh = 0; qh < n_q_heads; ++qh) {
      keys.clear();
      if (layout == nullptr) {
        for (int j = 0; j <= p; ++j) keys.push_back(j);
      } else {
        const int b = layout->block_size;
        for (int32_t c : layout->list(qh, p / b - layout->first_q_block))
          for (int j = c * b; j < (c + 1) * b && j <= p; ++j) keys.push_back(j);
      }
      const size_t row = static_cast<size_t>(i) * n_q_heads + qh;
      const float lse = attend_row(a.kv[qh / a.group], a.scale, a.q + row * dim, keys, a.out + row * dim);
      if (a.lse != nullptr) a.lse[row] = lse;
    }
  }
}

}  // namespace

void attention_prefill_dense(const PrefillAttnArgs& a) {
  attention_prefill_validate(a, nullptr);
  attend_chunk(a, nullptr);
}

void attention_prefill_block_sparse(const PrefillAttnArgs& a, const BlockSparseLayout& layout) {
  attention_prefill_validate(a, &layout);
  attend_chunk(a, &layout);
}

void attention_prefill_projection(const PrefillProjectionArgs& a) {
  attention_prefill_projection_validate(a);
  const PagedHeadView& kv = *a.kv;
  const int dim = kv.head_dim;
  std::vector<double> vert(static_cast<size_t>(a.n_keys), 0.0), slash(static_cast<size_t>(a.n_keys), 0.0);
  std::vector<double> s;
  for (int i = 0; i < a.n_rows; ++i) {
    const int p = a.n_keys - a.n_rows + i;
    const float* q = a.q + static_cast<size_t>(i) * dim;
    s.assign(static_cast<size_t>(p) + 1, 0.0);
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j <= p; ++j) {
      s[j] = static_cast<double>(a.scale) * dot(q, kv, j);
      m = std::max(m, s[j]);
    }
    double l = 0.0;
    for (int j = 0; j <= p; ++j) l += (s[j] = std::exp(s[j] - m));
    for (int j = 0; j <= p; ++j) {
      vert[j] += s[j] / l;
      slash[p - j] += s[j] / l;
    }
  }
  for (int j = 0; j < a.n_keys; ++j) {
    a.vertical[j] = static_cast<float>(vert[j]);
    a.slash[j] = static_cast<float>(slash[j]);
  }
}

}  // namespace ref
}  // namespace cumulus
