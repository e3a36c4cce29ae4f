// The device KV cache filled on the device (DeviceKvCache::create / reserve / append /
// truncate) against the host cache (KvCache) fed the same rows: identical stored K/V bits
// and identical per-page key statistics (min, max, mean), after a prefill chunk, decode
// steps, a truncate and appends after it, for two sequences, awkward head dims, page sizes
// and both 16-bit dtypes; and against DeviceKvCache::upload of the host cache where the
// upload path exists (head_dim 64, 128).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/kv/kv_cache.h"

using namespace cumulus;

namespace {

// The host cache's head h as DeviceKvHeadCopy (16-bit codes, statistics of its pages).
cuda::DeviceKvHeadCopy host_copy(const KvCache& kv, int h) {
  const PagedHeadView v = kv.view(0, h);
  cuda::DeviceKvHeadCopy c;
  c.n_tokens = v.n_tokens;
  const int d = v.head_dim;
  c.k.resize(static_cast<size_t>(v.n_tokens) * d);
  c.v.resize(c.k.size());
  for (int t = 0; t < v.n_tokens; ++t) {
    std::memcpy(c.k.data() + static_cast<size_t>(t) * d, v.key(t), d * 2);
    std::memcpy(c.v.data() + static_cast<size_t>(t) * d, v.value(t), d * 2);
  }
  const size_t m = static_cast<size_t>(v.n_pages()) * d;
  c.kmin.assign(v.kmin, v.kmin + m);
  c.kmax.assign(v.kmax, v.kmax + m);
  c.kmean.assign(v.kmean, v.kmean + m);
  return c;
}

void expect_same(const cuda::DeviceKvHeadCopy& a, const cuda::DeviceKvHeadCopy& b, const std::string& what) {
  ASSERT_EQ(a.n_tokens, b.n_tokens) << what;
  EXPECT_EQ(a.k, b.k) << what << ": K differs";
  EXPECT_EQ(a.v, b.v) << what << ": V differs";
  ASSERT_EQ(a.kmin.size(), b.kmin.size()) << what;
  // Bitwise: memcmp, so -0 vs +0 or NaN would show.
  EXPECT_EQ(0, std::memcmp(a.kmin.data(), b.kmin.data(), a.kmin.size() * 4)) << what << ": kmin differs";
  EXPECT_EQ(0, std::memcmp(a.kmax.data(), b.kmax.data(), a.kmax.size() * 4)) << what << ": kmax differs";
  EXPECT_EQ(0, std::memcmp(a.kmean.data(), b.kmean.data(), a.kmean.size() * 4)) << what << ": kmean differs";
}

}  // namespace

TEST(CudaKvAppend, DeviceAppendEqualsHostCacheAndUpload) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(1234);
  for (const DType dt : {DType::f16, DType::bf16})
    for (const int head_dim : {8, 64, 128})
      for (const int page_size : {1, 16, 32}) {
        const int n_seqs = 2, n_kv = 3, max_tokens = 300;
        const std::string tag = std::string(dtype_name(dt)) + " head_dim=" + std::to_string(head_dim) +
                                " page_size=" + std::to_string(page_size);
        std::vector<KvCache> host;
        for (int s = 0; s < n_seqs; ++s)
          host.emplace_back(Shape{1, n_kv, n_kv, head_dim}, KvCacheOptions{page_size, dt, max_tokens});
        cuda::DeviceKvCache dev = cuda::DeviceKvCache::create(n_seqs, n_kv, head_dim, dt, page_size, max_tokens);
        // Chunks: a prefill of 37 rows, decode steps, a chunk of 17 (crossing pages).
        auto append = [&](int n) {
          for (int s = 0; s < n_seqs; ++s) dev.reserve(s, host[s].n_tokens(0) + n);
          std::vector<float> k(static_cast<size_t>(n_seqs) * n * n_kv * head_dim), v(k.size());
          std::normal_distribution<float> nd(0.0f, 2.0f);
          for (auto& x : k) x = nd(rng);
          for (auto& x : v) x = nd(rng);
          const size_t per_seq = static_cast<size_t>(n) * n_kv * head_dim;
          for (int s = 0; s < n_seqs; ++s) host[s].append(0, k.data() + s * per_seq, v.data() + s * per_seq, n);
          cuda::DeviceBuffer dk = cuda::to_device(k), dv = cuda::to_device(v);
          dev.append(dk.as<float>(), dv.as<float>(), n);
          cuda::device_synchronize();
        };
        auto compare = [&](const std::string& when) {
          for (int s = 0; s < n_seqs; ++s)
            for (int h = 0; h < n_kv; ++h)
              expect_same(dev.download_head(s, h), host_copy(host[s], h),
                          tag + " " + when + " seq " + std::to_string(s) + " head " + std::to_string(h));
        };
        append(37);
        compare("after a prefill chunk of 37");
        for (int i = 0; i < 20; ++i) append(1);
        append(17);
        compare("after 20 decode steps and a chunk of 17");
        if (cuda::head_dim_supported_cuda(head_dim)) {
          const cuda::DeviceKvCache up = cuda::DeviceKvCache::upload(cuda_test::views_of(host), 77);
          for (int s = 0; s < n_seqs; ++s)
            for (int h = 0; h < n_kv; ++h)
              expect_same(dev.download_head(s, h), up.download_head(s, h), tag + " against upload");
        }
        // restart_decode's truncate: both sequences back to 45 tokens (mid-page for most
        // page sizes), then more rows after it.
        const int free_before = dev.free_pages();
        for (int s = 0; s < n_seqs; ++s) {
          host[s].truncate(45);
          dev.truncate(s, 45);
        }
        EXPECT_GE(dev.free_pages(), free_before) << tag;
        compare("after truncate to 45");
        append(3);
        append(1);
        compare("after appends following the truncate");
      }
}

TEST(CudaKvAppend, RejectsAppendBeyondReservedPages) {
  CUMULUS_REQUIRE_GPU();
  cuda::DeviceKvCache dev = cuda::DeviceKvCache::create(1, 2, 64, DType::f16, 16, 64, 4);
  std::vector<float> k(static_cast<size_t>(17) * 2 * 64, 1.0f);
  cuda::DeviceBuffer dk = cuda::to_device(k);
  EXPECT_THROW(dev.append(dk.as<float>(), dk.as<float>(), 1), Error);  // nothing reserved
  dev.reserve(0, 16);                                                   // 2 heads x 1 page
  EXPECT_THROW(dev.append(dk.as<float>(), dk.as<float>(), 17), Error);
  EXPECT_THROW(dev.reserve(0, 48), Error);  // 2 heads x 3 pages > the pool's 4
  EXPECT_THROW(dev.reserve(0, 65), Error);  // beyond max_tokens' pages
}
