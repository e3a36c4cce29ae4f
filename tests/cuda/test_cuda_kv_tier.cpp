// The two-tier KV page pool (kv/cuda_kv_pool.h): the tier changes where bytes live, never
// the answer. Three layers of caches over one pool, three sequences of different lengths
// (filled together, then truncated apart), decode steps that append and attend: every
// step's output and log-sum-exp are bit-identical to the same caches in plain device memory,
// for dense, sketch_topp and quest, with a device tier of one mapping granule (most pages on
// the host; promotions and demotions every step) and with an ample one (no host tier); at
// the end every stored K/V row and page statistic equals the plain cache's, so no page was
// lost or overwritten by a move. With a staging area (KvPagePool::stage: the host rows a
// step reads copied to device memory before the attention, which reads them through the
// staged table), large enough for a layer's host pages or too small for them (the rest read
// in place), the outputs are again bit-identical. Then bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "cumulus/core/error.h"
#include "cumulus/core/host_memory.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_decoder.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/kv/cuda_kv_pool.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/registry.h"
#include "kernel_check.h"
#include "model/cuda/decode_methods.h"

using namespace cumulus;

namespace {

constexpr int kLayers = 3, kSeqs = 3, kKv = 2, kQ = 8, kD = 128, kPage = 16, kSteps = 8;
const int kLengths[kSeqs] = {5000, 8200, 3300};
constexpr int kMaxTokens = 8200 + kSteps;

std::vector<float> randoms(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// One side of the comparison: a cache, decoder (null: dense) and attention plan per layer.
struct Side {
  std::vector<cuda::DeviceKvCache> caches;
  std::vector<std::unique_ptr<cuda::SparseDecoder>> decoders;
  std::vector<std::unique_ptr<cuda::AttentionPlan>> plans;
};

struct StepOut {
  std::vector<float> out, lse;
};

class TierRun {
 public:
  TierRun(const std::string& method, const std::map<std::string, std::string>& params,
          std::shared_ptr<cuda::KvPagePool> pool, bool stage)
      : method_(method), params_(params), pool_(std::move(pool)), stage_(stage), sets_(pool_->options().stage_sets) {
    for (int l = 0; l < kLayers; ++l) {
      plain_.caches.push_back(cuda::DeviceKvCache::create(kSeqs, kKv, kD, DType::f16, kPage, kMaxTokens));
      tier_.caches.push_back(cuda::DeviceKvCache::create(pool_, kSeqs, kKv, kMaxTokens));
    }
    // Filled together to the longest length in chunks, then each sequence cut to its own.
    // The keys of a page share a direction (2 u + noise), so that attention falls on some
    // pages and not others, and selections leave pages on the host.
    std::mt19937 rng(7);
    const int chunk = 2048;
    const int n_pages = kLengths[1] / kPage + 1;
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<float> dirs = randoms(static_cast<size_t>(kSeqs) * n_pages * kKv * kD, rng);
      for (int n0 = 0; n0 < kLengths[1]; n0 += chunk) {
        const int n = std::min(chunk, kLengths[1] - n0);
        const size_t elems = static_cast<size_t>(kSeqs) * n * kKv * kD;
        std::vector<float> kh = randoms(elems, rng);
        for (int s = 0; s < kSeqs; ++s)
          for (int i = 0; i < n; ++i)
            for (int h = 0; h < kKv; ++h) {
              float* row = kh.data() + ((static_cast<size_t>(s) * n + i) * kKv + h) * kD;
              const float* u = dirs.data() + ((static_cast<size_t>(s) * n_pages + (n0 + i) / kPage) * kKv + h) * kD;
              for (int j = 0; j < kD; ++j) row[j] = 2.0f * u[j] + 0.5f * row[j];
            }
        const cuda::DeviceBuffer k = cuda::to_device(kh), v = cuda::to_device(randoms(elems, rng));
        for (Side* s : {&plain_, &tier_}) {
          for (int q = 0; q < kSeqs; ++q) s->caches[l].reserve(q, n0 + n);
          s->caches[l].append(k.as<float>(), v.as<float>(), n);
        }
      }
      for (Side* s : {&plain_, &tier_})
        for (int q = 0; q < kSeqs; ++q) s->caches[l].truncate(q, kLengths[q]);
    }
    cuda::device_synchronize();
    pool_->reserve_stage(tier_.caches[0].view());
    const Registry reg = cuda::registry_with_gpu(Registry::builtin());
    const Shape shape{kLayers, kQ, kKv, kD};
    for (Side* s : {&plain_, &tier_})
      for (int l = 0; l < kLayers; ++l) {
        s->decoders.push_back(cuda::model::make_cuda_decoder(reg, method_, params_, s->caches[l].view(), shape, l));
        if (s->decoders.back() != nullptr) {
          s->decoders.back()->prefill();
        } else {
          s->plans.push_back(std::make_unique<cuda::AttentionPlan>(s->caches[l].view(), kQ / kKv));
        }
      }
    cuda::device_synchronize();
  }

  // One decode step of every layer on both sides; the outputs of each layer.
  void step(std::mt19937& rng, std::vector<StepOut>& plain, std::vector<StepOut>& tier) {
    plain.assign(kLayers, {});
    tier.assign(kLayers, {});
    for (int l = 0; l < kLayers; ++l) {
      const size_t kv_elems = static_cast<size_t>(kSeqs) * kKv * kD;
      const cuda::DeviceBuffer k = cuda::to_device(randoms(kv_elems, rng)), v = cuda::to_device(randoms(kv_elems, rng));
      const cuda::DeviceBuffer q = cuda::to_device(randoms(static_cast<size_t>(kSeqs) * kQ * kD, rng));
      for (Side* s : {&plain_, &tier_}) {
        cuda::DeviceKvCache& c = s->caches[l];
        for (int i = 0; i < kSeqs; ++i) c.reserve(i, c.n_tokens()[i] + 1);
        c.append(k.as<float>(), v.as<float>(), 1);
        cuda::DeviceBuffer out(static_cast<size_t>(kSeqs) * kQ * kD * 4), lse(static_cast<size_t>(kSeqs) * kQ * 4);
        cuda::SparseDecoder* dec = s->decoders[l].get();
        if (dec != nullptr) {
          dec->select(q.as<float>());
          if (s == &tier_ && stage_)
            dec->set_attend_page_table(pool_->stage(c.view(), dec->dense_step() ? nullptr : dec->list_idx(),
                                                    dec->list_len(), dec->list_stride(), nullptr, l % sets_));
          dec->attend(q.as<float>(), out.as<float>(), lse.as<float>());
          if (s == &tier_) pool_->mark(c.view(), dec->list_idx(), dec->list_len(), dec->list_stride());
        } else {
          cuda::DeviceDecodeArgs a;
          a.kv = c.view();
          a.group = kQ / kKv;
          a.scale = 1.0f / std::sqrt(static_cast<float>(kD));
          a.q = q.as<float>();
          a.out = out.as<float>();
          a.lse = lse.as<float>();
          if (s == &tier_ && stage_) a.kv.page_table = pool_->stage(c.view(), nullptr, nullptr, 0, nullptr, l % sets_);
          cuda::attention_decode(a, *s->plans[l]);
          if (s == &tier_) pool_->mark(c.view(), nullptr, nullptr, 0);
        }
        StepOut& o = (s == &plain_ ? plain : tier)[l];
        o.out = cuda::to_host<float>(out, static_cast<size_t>(kSeqs) * kQ * kD);
        o.lse = cuda::to_host<float>(lse, static_cast<size_t>(kSeqs) * kQ);
      }
    }
    last_ = pool_->end_step();
  }

  void expect_same_contents() const {
    for (int l = 0; l < kLayers; ++l)
      for (int s = 0; s < kSeqs; ++s)
        for (int h = 0; h < kKv; ++h) {
          const cuda::DeviceKvHeadCopy a = plain_.caches[l].download_head(s, h);
          const cuda::DeviceKvHeadCopy b = tier_.caches[l].download_head(s, h);
          ASSERT_EQ(a.n_tokens, b.n_tokens);
          EXPECT_EQ(a.k, b.k) << "layer " << l << " seq " << s << " head " << h;
          EXPECT_EQ(a.v, b.v) << "layer " << l << " seq " << s << " head " << h;
          if (b.kmin.empty()) continue;  // a pool without key statistics
          ASSERT_EQ(a.kmin.size(), b.kmin.size());
          EXPECT_EQ(0, std::memcmp(a.kmin.data(), b.kmin.data(), a.kmin.size() * 4));
          EXPECT_EQ(0, std::memcmp(a.kmax.data(), b.kmax.data(), a.kmax.size() * 4));
          EXPECT_EQ(0, std::memcmp(a.kmean.data(), b.kmean.data(), a.kmean.size() * 4));
        }
  }

  const cuda::TierStats& last() const { return last_; }

 private:
  std::string method_;
  std::map<std::string, std::string> params_;
  std::shared_ptr<cuda::KvPagePool> pool_;
  bool stage_ = false;
  int sets_ = 1;
  Side plain_, tier_;
  cuda::TierStats last_;
};

int64_t pages_needed() {
  int64_t n = 0;
  for (int s = 0; s < kSeqs; ++s) n += (kMaxTokens + kPage - 1) / kPage;
  return n * kKv * kLayers;
}

}  // namespace

TEST(CudaKvTier, TierChangesWhereBytesLiveNeverTheAnswer) {
  CUMULUS_REQUIRE_GPU();
  const int64_t need = pages_needed();
  ASSERT_GT(need, cuda::KvPagePool::device_pages_granule(kD, DType::f16, kPage))
      << "the test's caches must outgrow a one-granule device tier";
  struct Case {
    std::string method;
    std::map<std::string, std::string> params;
    bool key_stats = true;
    int promote_reads = 1;
    // staging pages: 0 none, 1 one granule (fewer than a layer's host pages), 2 a layer's
    // share, 3 two sets of a layer's share (layer l stages into set l % 2)
    int stage = 0;
  };
  const std::vector<Case> cases{{"dense", {}},
                                {"sketch_topp", {{"gpu_dense_mib", "0"}}},
                                {"sketch_topp", {{"gpu_dense_mib", "0"}}, false, 2},
                                {"quest", {{"budget", "512"}}},
                                {"dense", {}, true, 1, 1},
                                {"dense", {}, true, 1, 2},
                                {"sketch_topp", {{"gpu_dense_mib", "0"}}, true, 2, 1},
                                {"sketch_topp", {{"gpu_dense_mib", "0"}}, false, 1, 2},
                                {"quest", {{"budget", "512"}}, true, 1, 2},
                                {"dense", {}, true, 1, 3},
                                {"sketch_topp", {{"gpu_dense_mib", "0"}}, true, 1, 3}};
  for (const Case& c : cases)
    for (const bool tiny : {true, false}) {
      SCOPED_TRACE(c.method + (tiny ? ", one-granule device tier" : ", ample device tier") +
                   (c.key_stats ? "" : ", no key statistics") + ", promote_reads " + std::to_string(c.promote_reads) +
                   ", stage " + std::to_string(c.stage));
      const int64_t granule = cuda::KvPagePool::device_pages_granule(kD, DType::f16, kPage, c.key_stats);
      cuda::KvPoolOptions o;
      o.key_stats = c.key_stats;
      o.promote_reads = c.promote_reads;
      o.head_dim = kD;
      o.dtype = DType::f16;
      o.page_size = kPage;
      o.device_pages = tiny ? granule : (need + granule) / granule * granule;
      o.host_pages = tiny ? need : 0;
      o.stage_pages = c.stage == 1 ? 1 : c.stage >= 2 ? need / kLayers : 0;
      o.stage_sets = c.stage == 3 ? 2 : 1;
      auto pool = cuda::KvPagePool::create(o);
      if (tiny && c.stage == 1) {
        ASSERT_LT(pool->stage_pages(), need / kLayers / 2) << "the small staging area must not hold a layer's pages";
      }
      TierRun run(c.method, c.params, pool, c.stage != 0);
      if (tiny) {
        EXPECT_GT(pool->free_host_pages(), 0);
      }
      std::mt19937 rng(99);
      int64_t misses = 0, promoted = 0, hits = 0, staged = 0, unstaged = 0;
      for (int t = 0; t < kSteps; ++t) {
        std::vector<StepOut> a, b;
        run.step(rng, a, b);
        for (int l = 0; l < kLayers; ++l) {
          ASSERT_EQ(0, std::memcmp(a[l].out.data(), b[l].out.data(), a[l].out.size() * 4))
              << "step " << t << " layer " << l << ": outputs differ";
          ASSERT_EQ(0, std::memcmp(a[l].lse.data(), b[l].lse.data(), a[l].lse.size() * 4))
              << "step " << t << " layer " << l << ": log-sum-exps differ";
        }
        misses += run.last().misses;
        promoted += run.last().promoted;
        hits += run.last().hits;
        staged += run.last().staged_rows;
        unstaged += run.last().unstaged_pages;
      }
      std::printf("%s %s promote_reads %d: hits %lld misses %lld promoted %lld over %d steps\n", c.method.c_str(),
                  tiny ? "tiny" : "ample", c.promote_reads, static_cast<long long>(hits),
                  static_cast<long long>(misses), static_cast<long long>(promoted), kSteps);
      if (tiny) {
        EXPECT_GT(hits, 0);
        EXPECT_GT(misses, 0);
        // Staging copied rows; a one-granule area was too small for dense's host pages,
        // and a layer's share held every page a step read.
        EXPECT_EQ(staged > 0, c.stage != 0);
        if (c.stage == 1 && c.method == "dense") {
          EXPECT_GT(unstaged, 0);
        }
        if (c.stage != 1) {
          EXPECT_EQ(unstaged, 0);
        }
        // Dense reads every page each step, more than the device holds: LRU then promotes
        // nothing (each device page was used in the same step), and the host pages are
        // read where they are. The sparse methods read a subset, and promote.
        if (c.method == "dense") {
          EXPECT_EQ(promoted, 0);
        } else if (c.promote_reads == 1) {
          EXPECT_GT(promoted, 0);
        }
        // The victims the pool would take now are the least recently used device pages:
        // ascending last step, then slot, among those read before this step.
        const std::vector<int32_t> ep = pool->device_epochs();
        std::vector<int32_t> order;
        for (int32_t sl = 0; sl < static_cast<int32_t>(pool->options().device_pages); ++sl)
          if (ep[sl] != 0x7fffffff && ep[sl] < static_cast<int32_t>(pool->step())) order.push_back(sl);
        std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return ep[x] < ep[y]; });
        order.resize(std::min<size_t>(order.size(), 300));
        EXPECT_FALSE(order.empty());
        EXPECT_EQ(pool->victims(300), order);
      } else {
        EXPECT_EQ(hits + misses, 0);  // one tier: nothing is marked
        EXPECT_EQ(pool->stage_pages(), 0);  // nothing to stage
        EXPECT_EQ(staged, 0);
      }
      run.expect_same_contents();
    }
}

TEST(CudaKvTier, BadInputIsRefused) {
  CUMULUS_REQUIRE_GPU();
  using check::expect_error;
  cuda::KvPoolOptions o;
  o.device_pages = 0;
  expect_error([&] { cuda::KvPagePool::create(o); }, "device_pages=0");
  o.device_pages = 1;
  expect_error([&] { cuda::KvPagePool::create(o); }, "below one mapping granule");
  o.head_dim = 96;
  expect_error([&] { cuda::KvPagePool::create(o); }, "head_dim=96");
  o.head_dim = 128;
  o.dtype = DType::f32;
  expect_error([&] { cuda::KvPagePool::create(o); }, "dtype=f32");
  o.dtype = DType::f16;
  o.device_pages = int64_t{1} << 30;
  expect_error([&] { cuda::KvPagePool::create(o); }, "are free on the device");
  // A host tier larger than the host's available memory is refused before any pinning:
  // twice what is available (where this host says).
  o.device_pages = cuda::KvPagePool::device_pages_granule(128, DType::f16, 16);
  if (const size_t avail = host_available_bytes(); avail > 0) {
    o.host_pages = static_cast<int64_t>(2 * avail / cuda::KvPagePool::page_bytes(128, DType::f16, 16)) + 1;
    expect_error([&] { cuda::KvPagePool::create(o); }, "available (MemAvailable)");
  } else {
    std::printf("no MemAvailable on this host: the host-memory check was not exercised\n");
  }
  // A pool that is full refuses the page a cache asks for, naming the sequence and counts.
  o.device_pages = cuda::KvPagePool::device_pages_granule(128, DType::f16, 16);
  o.host_pages = 0;
  auto pool = cuda::KvPagePool::create(o);
  auto c = cuda::DeviceKvCache::create(pool, 1, 1, static_cast<int>(o.device_pages) * 16 + 64);
  c.reserve(0, static_cast<int>(o.device_pages) * 16);
  expect_error([&] { c.reserve(0, static_cast<int>(o.device_pages) * 16 + 1); }, "the pool has 0 free");
  // Pages of another cache's memory are not the pool's.
  auto other = cuda::DeviceKvCache::create(1, 1, 128, DType::f16, 16, 64);
  expect_error([&] { pool->mark(other.view(), nullptr, nullptr, 0); }, "not this pool's");
  expect_error([&] { pool->stage(other.view(), nullptr, nullptr, 0); }, "not this pool's");
  o.stage_pages = -1;
  expect_error([&] { cuda::KvPagePool::create(o); }, "stage_pages=-1");
  o.stage_pages = 0;
  o.stage_sets = 3;
  expect_error([&] { cuda::KvPagePool::create(o); }, "stage_sets=3");
  o.stage_sets = 1;
  // stage() needs its scratch sized first.
  o.stage_pages = 1;
  o.host_pages = 1;
  auto staged = cuda::KvPagePool::create(o);
  auto sc = cuda::DeviceKvCache::create(staged, 1, 1, 64);
  expect_error([&] { staged->stage(sc.view(), nullptr, nullptr, 0); }, "reserve_stage() was not called");
  staged->reserve_stage(sc.view());
  expect_error([&] { staged->stage(sc.view(), nullptr, nullptr, 0, nullptr, 1); }, "set=1 out of range [0, 1)");
  expect_error([&] { cuda::DeviceKvCache::create(nullptr, 1, 1, 16); }, "the pool is null");
}
