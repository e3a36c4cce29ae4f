// Helpers of the CUDA tests: a skip when no device is present, random batches of paged
// caches built with the real KvCache (so page statistics come from the stored keys), their
// upload with a scrambled page table, and the normalised error used by every comparison.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cumulus/eval/synthetic.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/registry.h"
#include "model/cuda/decode_methods.h"
#include "cumulus/kv/kv_cache.h"

#define CUMULUS_REQUIRE_GPU()                                                                   \
  do {                                                                                          \
    if (!::cumulus::cuda::device_available())                                                   \
      GTEST_SKIP() << "no CUDA device: CUDA tests run on a GPU machine (tools/device/run.sh)"; \
  } while (0)

namespace cumulus::cuda_test {

// One sequence = one single-layer KvCache with random keys (N(0,1) plus a per-dimension
// offset and occasional heavy tokens, so the softmax is far from uniform) and values N(0,1).
inline KvCache random_cache(int n_kv, int head_dim, int n_tokens, DType dt, int page_size, std::mt19937& rng) {
  KvCache kv(Shape{1, n_kv, n_kv, head_dim}, KvCacheOptions{page_size, dt, std::max(n_tokens, 1)});
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(n_tokens) * n_kv * head_dim), v(k.size());
  for (int t = 0; t < n_tokens; ++t)
    for (int h = 0; h < n_kv; ++h) {
      const float boost = (rng() % 37 == 0) ? 3.0f : 1.0f;
      for (int j = 0; j < head_dim; ++j) {
        const size_t i = (static_cast<size_t>(t) * n_kv + h) * head_dim + j;
        k[i] = boost * nd(rng) + 0.25f * static_cast<float>((j % 7) - 3);
        v[i] = nd(rng);
      }
    }
  if (n_tokens > 0) kv.append(0, k.data(), v.data(), n_tokens);
  return kv;
}

// The GPU decoder of a method defined once over the selection ops (methods/policy.h), with
// the registry's parameters, for one layer.
inline std::unique_ptr<cuda::SparseDecoder> policy_gpu(const std::string& method,
                                                       const std::map<std::string, std::string>& params,
                                                       const cuda::DeviceKvView& kv, int group, int layer = 0) {
  const Shape shape{layer + 1, kv.n_kv_heads * group, kv.n_kv_heads, kv.head_dim};
  return cuda::model::make_policy_decoder(Registry::builtin(), method, params, kv, shape, layer);
}

inline std::vector<PagedHeadView> views_of(const KvCache& kv) {
  std::vector<PagedHeadView> v;
  for (int h = 0; h < kv.shape().n_kv_heads; ++h) v.push_back(kv.view(0, h));
  return v;
}

inline std::vector<std::vector<PagedHeadView>> views_of(const std::vector<KvCache>& seqs) {
  std::vector<std::vector<PagedHeadView>> v;
  for (const auto& kv : seqs) v.push_back(views_of(kv));
  return v;
}

// The queries of steps 0 .. n_seqs - 1 of a synthetic workload, one sequence each.
inline std::vector<float> batch_queries(const SyntheticWorkload& w, int n_seqs) {
  const Shape& sh = w.options.shape;
  std::vector<float> q;
  for (int s = 0; s < n_seqs; ++s) {
    const float* qs = w.query(0, s);
    q.insert(q.end(), qs, qs + static_cast<size_t>(sh.n_q_heads) * sh.head_dim);
  }
  return q;
}

// A synthetic workload's cache replicated for n_seqs sequences on the device, sequence s
// with the workload's query of step s, on the host (q) and the device (qd).
struct ReplicatedBatch {
  cuda::DeviceKvCache dev;
  std::vector<float> q;
  cuda::DeviceBuffer qd;
  ReplicatedBatch(const KvCache& kv, const SyntheticWorkload& w, int n_seqs)
      : dev(cuda::DeviceKvCache::upload_replicated(views_of(kv), n_seqs)),
        q(batch_queries(w, n_seqs)),
        qd(cuda::to_device(q)) {}
};

inline std::vector<float> random_vec(size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (auto& e : x) e = nd(rng);
  return x;
}

inline double norm_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline double jaccard(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0, j = 0, inter = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] == b[j]) ++inter, ++i, ++j;
    else if (a[i] < b[j]) ++i;
    else ++j;
  }
  const size_t uni = a.size() + b.size() - inter;
  return uni == 0 ? 1.0 : static_cast<double>(inter) / uni;
}

// Device lists idx [n_lists][stride], len [n_lists] downloaded as vectors.
inline std::vector<std::vector<int32_t>> download_lists(const int32_t* idx, const int32_t* len, int n_lists,
                                                        int stride) {
  std::vector<int32_t> l(n_lists), all(static_cast<size_t>(n_lists) * stride);
  cuda::memcpy_to_host(l.data(), len, l.size() * sizeof(int32_t));
  cuda::memcpy_to_host(all.data(), idx, all.size() * sizeof(int32_t));
  std::vector<std::vector<int32_t>> out(n_lists);
  for (int i = 0; i < n_lists; ++i)
    out[i].assign(all.begin() + static_cast<size_t>(i) * stride, all.begin() + static_cast<size_t>(i) * stride + l[i]);
  return out;
}

// A GPU method's step for sequence s of its batch against float64 sparse attention over the
// GPU's own lists: lists [n_seqs * n_kv_heads] sorted, unique and in range; out
// [n_seqs][n_q][head_dim] and lse [n_seqs][n_q] within 5e-5. views: sequence s's heads, q:
// its queries.
inline void expect_attends_lists(const std::vector<std::vector<int32_t>>& lists, const std::vector<float>& out,
                                 const std::vector<float>& lse, const std::vector<PagedHeadView>& views,
                                 const Shape& sh, const float* q, int s, const std::string& what) {
  Selection sel;
  const int n = views[0].n_tokens;
  for (int h = 0; h < sh.n_kv_heads; ++h) {
    const auto& l = lists[static_cast<size_t>(s) * sh.n_kv_heads + h];
    for (size_t i = 0; i < l.size(); ++i) {
      ASSERT_TRUE(l[i] >= 0 && l[i] < n) << what << ": token " << l[i] << " out of range";
      if (i > 0) {
        ASSERT_GT(l[i], l[i - 1]) << what << ": list not sorted unique";
      }
    }
    sel.tokens.push_back(l);
  }
  std::vector<float> ref_out(static_cast<size_t>(sh.n_q_heads) * sh.head_dim), ref_lse(sh.n_q_heads);
  DecodeAttnArgs a;
  a.kv = views.data();
  a.n_kv_heads = sh.n_kv_heads;
  a.group = sh.group();
  a.scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
  a.q = q;
  a.out = ref_out.data();
  a.lse = ref_lse.data();
  ref::attention_decode_sparse(a, sel);
  EXPECT_LT(norm_err(out.data() + static_cast<size_t>(s) * ref_out.size(), ref_out.data(), ref_out.size()), 5e-5)
      << what;
  for (int qh = 0; qh < sh.n_q_heads; ++qh)
    EXPECT_NEAR(lse[static_cast<size_t>(s) * sh.n_q_heads + qh], ref_lse[qh], 5e-5) << what;
}

}  // namespace cumulus::cuda_test
