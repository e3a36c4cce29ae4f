// Reference decode attention (scalar, float64 accumulation, never optimised) and the input
// checks every backend shares. One query token per head attends a paged cache of one
// layer: out = softmax(scale * q K^T) V, lse = log sum_i exp(scale * q . k_i). The sparse
// op attends only each kv head's sorted index list (the GQA union of Tactic section 4.5);
// every query head of a group attends the same list. Keys and values are widened from the
// storage dtype exactly (f16 and bf16 are representable in float32) and then in float64.
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/attention.h"

namespace cumulus {

void attention_decode_validate(const DecodeAttnArgs& a, const Selection* sel) {
  CUMULUS_CHECK(a.kv != nullptr, "kv must be non-null");
  CUMULUS_CHECK(a.n_kv_heads > 0, "n_kv_heads={} must be positive", a.n_kv_heads);
  CUMULUS_CHECK(a.group >= 1, "group={} must be >= 1", a.group);
  CUMULUS_CHECK(std::isfinite(a.scale) && a.scale > 0.0f, "scale={} must be finite and > 0", a.scale);
  CUMULUS_CHECK(a.q != nullptr, "q must be non-null");
  CUMULUS_CHECK(a.out != nullptr, "out must be non-null");
  CUMULUS_CHECK(a.lse != nullptr, "lse must be non-null");
  const int head_dim = a.kv[0].head_dim;
  const DType dtype = a.kv[0].dtype;
  for (int h = 0; h < a.n_kv_heads; ++h) {
    const PagedHeadView& v = a.kv[h];
    CUMULUS_CHECK(head_dim_supported(v.head_dim), "kv[{}].head_dim={} is not supported (multiples of 8 in [8, 256])",
                  h, v.head_dim);
    CUMULUS_CHECK(v.head_dim == head_dim, "kv[{}].head_dim={} differs from kv[0].head_dim={}", h, v.head_dim,
                  head_dim);
    CUMULUS_CHECK(v.dtype == dtype, "kv[{}].dtype={} differs from kv[0].dtype={}", h, dtype_name(v.dtype),
                  dtype_name(dtype));
    CUMULUS_CHECK(v.page_size >= 1 && v.page_size <= 256 && v.page_shift >= 0 && v.page_shift < 16 &&
                      (1 << v.page_shift) == v.page_size,
                  "kv[{}].page_size={} must be a power of two in [1, 256] equal to 1 << page_shift={}", h,
                  v.page_size, v.page_shift);
    CUMULUS_CHECK(v.n_tokens >= 0, "kv[{}].n_tokens={} must be >= 0", h, v.n_tokens);
    if (sel == nullptr)
      CUMULUS_CHECK(v.n_tokens > 0, "kv[{}].n_tokens=0: dense decode attention on an empty cache", h);
    if (v.n_tokens > 0)
      CUMULUS_CHECK(v.k_pages != nullptr && v.v_pages != nullptr, "kv[{}].k_pages and v_pages must be non-null", h);
  }
  const int n_q = a.n_kv_heads * a.group;
  for (int qh = 0; qh < n_q; ++qh) {
    for (int j = 0; j < head_dim; ++j) {
      const float x = a.q[static_cast<size_t>(qh) * head_dim + j];
      CUMULUS_CHECK(std::isfinite(x), "q[{}][{}]={} is not finite (query head {}, dimension {})", qh, j, x, qh, j);
    }
  }
  if (sel == nullptr) return;
  CUMULUS_CHECK(sel->tokens.size() == static_cast<size_t>(a.n_kv_heads),
                "sel.tokens.size()={} must equal n_kv_heads={}", sel->tokens.size(), a.n_kv_heads);
  for (int h = 0; h < a.n_kv_heads; ++h) {
    const std::vector<int32_t>& idx = sel->tokens[h];
    const int n = a.kv[h].n_tokens;
    for (size_t i = 0; i < idx.size(); ++i) {
      CUMULUS_CHECK(idx[i] >= 0 && idx[i] < n, "sel.tokens[{}][{}]={} is out of range [0, {}) of kv head {}", h, i,
                    idx[i], n, h);
      if (i > 0)
        CUMULUS_CHECK(idx[i] > idx[i - 1],
                      "sel.tokens[{}][{}]={} is not greater than sel.tokens[{}][{}]={} (lists must be sorted "
                      "ascending and unique)",
                      h, i, idx[i], h, i - 1, idx[i - 1]);
    }
  }
}

void weighted_values_validate(const PagedHeadView& kv, const int32_t* idx, int n, const float* w, int n_q,
                              const float* out) {
  CUMULUS_CHECK(head_dim_supported(kv.head_dim), "kv.head_dim={} is not supported (multiples of 8 in [8, 256])",
                kv.head_dim);
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  CUMULUS_CHECK(out != nullptr, "out must be non-null");
  if (n == 0) return;
  CUMULUS_CHECK(idx != nullptr && w != nullptr, "idx and w must be non-null for n={}", n);
  CUMULUS_CHECK(kv.v_pages != nullptr, "kv.v_pages must be non-null");
  for (int i = 0; i < n; ++i)
    CUMULUS_CHECK(idx[i] >= 0 && idx[i] < kv.n_tokens, "idx[{}]={} out of range [0, {})", i, idx[i], kv.n_tokens);
}

namespace ref {

void attention_weighted_values(const PagedHeadView& kv, const int32_t* idx, int n, const float* w, int n_q,
                               float* out) {
  weighted_values_validate(kv, idx, n, w, n_q, out);
  const int d = kv.head_dim;
  std::vector<double> o(static_cast<size_t>(n_q) * d, 0.0);
  std::vector<float> v(static_cast<size_t>(d));
  for (int i = 0; i < n; ++i) {
    convert_to_f32(kv.value(idx[i]), kv.dtype, v.data(), d);
    for (int g = 0; g < n_q; ++g) {
      const double wi = w[static_cast<size_t>(g) * n + i];
      for (int j = 0; j < d; ++j) o[static_cast<size_t>(g) * d + j] += wi * v[j];
    }
  }
  for (size_t j = 0; j < o.size(); ++j) out[j] = static_cast<float>(o[j]);
}

namespace {

// Attends query heads [h * group, (h + 1) * group) over tokens idx[0..n) of kv[h] (or
// 0..n-1 when idx is null). Two passes: scores, then the normalised weighted sum.
void attend_head(const DecodeAttnArgs& a, int h, const int32_t* idx, int n) {
  const PagedHeadView& kv = a.kv[h];
  const int dim = kv.head_dim;
  std::vector<double> s(static_cast<size_t>(n));
  std::vector<double> o(static_cast<size_t>(dim));
  for (int g = 0; g < a.group; ++g) {
    const int qh = h * a.group + g;
    const float* q = a.q + static_cast<size_t>(qh) * dim;
    float* out = a.out + static_cast<size_t>(qh) * dim;
    if (n == 0) {
      for (int j = 0; j < dim; ++j) out[j] = 0.0f;
      a.lse[qh] = -std::numeric_limits<float>::infinity();
    } else {
      double m = -std::numeric_limits<double>::infinity();
      for (int i = 0; i < n; ++i) {
        const void* k = kv.key(idx != nullptr ? idx[i] : i);
        double dot = 0.0;
        for (int j = 0; j < dim; ++j) dot += static_cast<double>(q[j]) * dtype_load(k, kv.dtype, j);
        s[i] = static_cast<double>(a.scale) * dot;
        if (s[i] > m) m = s[i];
      }
      double l = 0.0;
      for (int j = 0; j < dim; ++j) o[j] = 0.0;
      for (int i = 0; i < n; ++i) {
        const double p = std::exp(s[i] - m);
        l += p;
        const void* v = kv.value(idx != nullptr ? idx[i] : i);
        for (int j = 0; j < dim; ++j) o[j] += p * dtype_load(v, kv.dtype, j);
      }
      for (int j = 0; j < dim; ++j) out[j] = static_cast<float>(o[j] / l);
      a.lse[qh] = static_cast<float>(m + std::log(l));
    }
    if (a.lse_ref != nullptr && a.mass != nullptr)
      a.mass[qh] = static_cast<float>(std::exp(static_cast<double>(a.lse[qh]) - static_cast<double>(a.lse_ref[qh])));
  }
}

}  // namespace

void attention_decode_dense(const DecodeAttnArgs& a) {
  attention_decode_validate(a, nullptr);
  for (int h = 0; h < a.n_kv_heads; ++h) attend_head(a, h, nullptr, a.kv[h].n_tokens);
}

void attention_decode_sparse(const DecodeAttnArgs& a, const Selection& sel) {
  attention_decode_validate(a, &sel);
  for (int h = 0; h < a.n_kv_heads; ++h)
    attend_head(a, h, sel.tokens[h].data(), static_cast<int>(sel.tokens[h].size()));
}

}  // namespace ref
}  // namespace cumulus
