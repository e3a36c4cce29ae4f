// GPU decode attention against the float64 reference (src/kernels/ref/attention.cpp): dense
// and sparse, batches of sequences of awkward lengths (1, 3, 15, 16, 17, 255, 4097), GQA
// groups 1, 3, 4, 8, 9 (two head tiles), f16 and bf16, head_dim 64, 128 and 256, page sizes 1,
// 16, 64, pages scattered through the pool; split plans from one chunk per list to many,
// and one plan launched repeatedly (its merge tickets reset by each launch); mass = exp(lse - lse_ref); bad lists and
// arguments are errors that name the problem.
// Every test skips when no CUDA device is present.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "cuda_test_util.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/kv/cuda_kv_cache.h"

using namespace cumulus;
using namespace cumulus::cuda_test;

namespace {

// float32 accumulation (with exp2 and split-KV merges) against float64: out by normalised
// error over the batch, lse by absolute error (|lse| <= ~30 on these inputs).
constexpr double kOutTol = 5e-5;
constexpr double kLseTol = 5e-5;

struct Case {
  DType dt;
  int head_dim, n_kv, group, page_size;
  std::vector<int> lens;  // tokens per sequence
};

struct GpuResult {
  std::vector<float> out, lse, mass;
};

// Runs the GPU op on `seqs` (dense if lists is empty) and returns out, lse, mass.
GpuResult run_gpu(const std::vector<KvCache>& seqs, const std::vector<float>& q, int group,
                  const std::vector<std::vector<std::vector<int32_t>>>& lists, const cuda::AttentionPlanOptions& po,
                  const std::vector<float>* lse_ref = nullptr, int launches = 1) {
  cuda::DeviceKvCache dev = cuda::DeviceKvCache::upload(views_of(seqs), 12345);
  const cuda::DeviceKvView kv = dev.view();
  const int n_seqs = kv.n_seqs, n_q = kv.n_kv_heads * group, d = kv.head_dim;
  cuda::DeviceBuffer qd = cuda::to_device(q);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Poisoned outputs: an unwritten element fails the comparison.
  cuda::DeviceBuffer out = cuda::to_device(std::vector<float>(static_cast<size_t>(n_seqs) * n_q * d, nan));
  cuda::DeviceBuffer lse = cuda::to_device(std::vector<float>(static_cast<size_t>(n_seqs) * n_q, nan));
  cuda::DeviceBuffer mass = cuda::to_device(std::vector<float>(static_cast<size_t>(n_seqs) * n_q, nan));
  cuda::DeviceBuffer ref_d, idx, len;
  cuda::AttentionPlan plan(kv, group, po);
  cuda::DeviceDecodeArgs a;
  a.kv = kv;
  a.group = group;
  a.scale = 1.0f / std::sqrt(static_cast<float>(d));
  a.q = qd.as<float>();
  a.out = out.as<float>();
  a.lse = lse.as<float>();
  if (lse_ref != nullptr) {
    ref_d = cuda::to_device(*lse_ref);
    a.lse_ref = ref_d.as<float>();
    a.mass = mass.as<float>();
  }
  if (!lists.empty()) {
    int stride = 1;
    for (const auto& s : lists)
      for (const auto& l : s) stride = std::max<int>(stride, static_cast<int>(l.size()));
    std::vector<int32_t> flat(static_cast<size_t>(n_seqs) * kv.n_kv_heads * stride, -7), lens;
    for (int s = 0; s < n_seqs; ++s)
      for (int h = 0; h < kv.n_kv_heads; ++h) {
        const auto& l = lists[s][h];
        std::copy(l.begin(), l.end(), flat.begin() + (static_cast<size_t>(s) * kv.n_kv_heads + h) * stride);
        lens.push_back(static_cast<int32_t>(l.size()));
      }
    idx = cuda::to_device(flat);
    len = cuda::to_device(lens);
    a.idx = idx.as<int32_t>();
    a.idx_len = len.as<int32_t>();
    a.idx_stride = stride;
  }
  for (int i = 0; i < launches; ++i) {
    if (i + 1 == launches && launches > 1) {  // poison again: the last launch writes everything
      out.upload(std::vector<float>(static_cast<size_t>(n_seqs) * n_q * d, nan).data(), out.size());
      lse.upload(std::vector<float>(static_cast<size_t>(n_seqs) * n_q, nan).data(), lse.size());
    }
    cuda::attention_decode(a, plan);
  }
  plan.check();
  GpuResult r;
  r.out = cuda::to_host<float>(out, static_cast<size_t>(n_seqs) * n_q * d);
  r.lse = cuda::to_host<float>(lse, static_cast<size_t>(n_seqs) * n_q);
  r.mass = cuda::to_host<float>(mass, static_cast<size_t>(n_seqs) * n_q);
  return r;
}

// Reference over every sequence; lists empty = dense.
GpuResult run_ref(const std::vector<KvCache>& seqs, const std::vector<float>& q, int group,
                  const std::vector<std::vector<std::vector<int32_t>>>& lists) {
  GpuResult r;
  const int n_kv = seqs[0].shape().n_kv_heads, d = seqs[0].shape().head_dim, n_q = n_kv * group;
  r.out.resize(seqs.size() * n_q * d);
  r.lse.resize(seqs.size() * n_q);
  for (size_t s = 0; s < seqs.size(); ++s) {
    const auto views = views_of(seqs[s]);
    DecodeAttnArgs a;
    a.kv = views.data();
    a.n_kv_heads = n_kv;
    a.group = group;
    a.scale = 1.0f / std::sqrt(static_cast<float>(d));
    a.q = q.data() + s * n_q * d;
    a.out = r.out.data() + s * n_q * d;
    a.lse = r.lse.data() + s * n_q;
    if (lists.empty()) {
      ref::attention_decode_dense(a);
    } else {
      Selection sel;
      sel.tokens = lists[s];
      ref::attention_decode_sparse(a, sel);
    }
  }
  return r;
}

void expect_close(const GpuResult& g, const GpuResult& r, const std::string& what) {
  // Empty sets: out 0 and lse -inf on both sides.
  std::vector<float> go, ro;
  for (size_t i = 0; i < r.lse.size(); ++i) {
    if (std::isinf(r.lse[i])) {
      EXPECT_TRUE(std::isinf(g.lse[i]) && g.lse[i] < 0) << what << " head " << i << " lse " << g.lse[i];
    } else {
      EXPECT_NEAR(g.lse[i], r.lse[i], kLseTol) << what << " head " << i;
    }
  }
  ASSERT_EQ(g.out.size(), r.out.size());
  for (float x : g.out) ASSERT_FALSE(std::isnan(x)) << what << ": an output element is NaN (unwritten?)";
  EXPECT_LT(norm_err(g.out.data(), r.out.data(), r.out.size()), kOutTol) << what;
}

std::string case_name(const Case& c) {
  std::string s = fmt::format("{} d{} kv{} g{} ps{} lens", dtype_name(c.dt), c.head_dim, c.n_kv, c.group, c.page_size);
  for (int n : c.lens) s += fmt::format(" {}", n);
  return s;
}

std::vector<Case> cases() {
  return {
      {DType::f16, 128, 2, 4, 16, {1, 3, 15, 16, 17}},
      {DType::bf16, 128, 2, 4, 16, {255, 4097}},
      {DType::f16, 64, 3, 3, 16, {17, 4097, 1}},
      {DType::f16, 128, 1, 1, 1, {255, 16}},
      {DType::bf16, 64, 2, 8, 64, {4097, 15}},
      {DType::f16, 128, 1, 9, 16, {3, 255}},
      // head_dim 256 (Gemma 3): tiles of 4 heads only, so group 1 runs masked in one and
      // group 8 in two; the CUDA-core kernel whatever options.tensor_cores says.
      {DType::f16, 256, 1, 4, 16, {1, 3, 15, 16, 17, 4097}},
      {DType::bf16, 256, 2, 1, 64, {255, 16}},
      {DType::bf16, 256, 1, 4, 1, {4097, 17}},
      {DType::f16, 256, 2, 8, 16, {255, 3}},
  };
}

}  // namespace

TEST(CudaAttention, DenseMatchesReference) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(101);
  for (const Case& c : cases()) {
    std::vector<KvCache> seqs;
    for (int n : c.lens) seqs.push_back(random_cache(c.n_kv, c.head_dim, n, c.dt, c.page_size, rng));
    const auto q = random_vec(c.lens.size() * c.n_kv * c.group * c.head_dim, rng);
    const GpuResult r = run_ref(seqs, q, c.group, {});
    // Default (tensor cores, 8 warps), tensor cores with 4 warps and many small chunks, and
    // the SIMT kernel with 2 and 4 warps; the tensor-core plans (and SIMT at head_dim 256)
    // take the kernel for contiguous dense ranges where the pages hold whole blocks (page
    // sizes 16 and 64 below); the default plan with the general kernel (contiguous_dense
    // off) too.
    // Each with the 256-byte L2 fetch hint (the default), no hint, and the 128-byte hint.
    // (Work stealing, a variant the library does not run, is checked by
    // dev/cuda/attention_steal.cu.)
    cuda::AttentionPlanOptions general;
    general.contiguous_dense = false;
    for (const cuda::AttentionPlanOptions& po0 :
         {cuda::AttentionPlanOptions{}, cuda::AttentionPlanOptions{4, 1, 64, true},
          cuda::AttentionPlanOptions{8, 0, 64, true}, cuda::AttentionPlanOptions{2, 0, 0, false},
          cuda::AttentionPlanOptions{4, 1, 64, false}, general})
      for (int prefetch : {256, 0, 128}) {
        cuda::AttentionPlanOptions po = po0;
        po.l2_prefetch = prefetch;
        const GpuResult g = run_gpu(seqs, q, c.group, {}, po, nullptr, 1);
        expect_close(g, r,
                     case_name(c) + fmt::format(" warps {} min_chunk {} tensor cores {} l2 prefetch {} "
                                                "contiguous dense {}",
                                                po.warps, po.min_chunk, po.tensor_cores, po.l2_prefetch,
                                                po.contiguous_dense));
      }
  }
}

TEST(CudaAttention, SparseMatchesReferenceAndMass) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(202);
  for (const Case& c : cases()) {
    std::vector<KvCache> seqs;
    for (int n : c.lens) seqs.push_back(random_cache(c.n_kv, c.head_dim, n, c.dt, c.page_size, rng));
    const auto q = random_vec(c.lens.size() * c.n_kv * c.group * c.head_dim, rng);
    // Lists of very different lengths per head (the imbalance Tactic 4.6 is about),
    // including empty ones.
    std::vector<std::vector<std::vector<int32_t>>> lists(seqs.size());
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (size_t s = 0; s < seqs.size(); ++s)
      for (int h = 0; h < c.n_kv; ++h) {
        const double frac = (h + s) % 4 == 3 ? 0.0 : std::pow(u(rng), 2.0);
        std::vector<int32_t> l;
        for (int t = 0; t < c.lens[s]; ++t)
          if (u(rng) < frac) l.push_back(t);
        lists[s].push_back(l);
      }
    const GpuResult dense = run_ref(seqs, q, c.group, {});
    const GpuResult r = run_ref(seqs, q, c.group, lists);
    for (const cuda::AttentionPlanOptions& po :
         {cuda::AttentionPlanOptions{}, cuda::AttentionPlanOptions{4, 1, 64, true},
          cuda::AttentionPlanOptions{4, 1, 64, false}}) {
      const GpuResult g = run_gpu(seqs, q, c.group, lists, po, &dense.lse);
      expect_close(g, r, case_name(c) + " sparse");
      for (size_t i = 0; i < r.lse.size(); ++i) {
        const double want = std::exp(static_cast<double>(r.lse[i]) - dense.lse[i]);
        EXPECT_NEAR(g.mass[i], want, 1e-4 * std::max(1.0, want)) << case_name(c) << " head " << i;
      }
    }
  }
}

TEST(CudaAttention, SparseEqualsDenseOverAllTokens) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(303);
  std::vector<KvCache> seqs;
  for (int n : {4097, 17, 255}) seqs.push_back(random_cache(8, 128, n, DType::f16, 16, rng));
  const auto q = random_vec(3 * 32 * 128, rng);
  std::vector<std::vector<std::vector<int32_t>>> all(3);
  for (size_t s = 0; s < 3; ++s)
    for (int h = 0; h < 8; ++h) {
      std::vector<int32_t> l(seqs[s].n_tokens(0));
      for (size_t t = 0; t < l.size(); ++t) l[t] = static_cast<int32_t>(t);
      all[s].push_back(l);
    }
  const GpuResult d = run_gpu(seqs, q, 4, {}, {});
  // The default plan, and one whose index lists are cut at 128 entries a chunk (the lists'
  // own cap, AttentionPlanOptions::max_chunk_lists; the dense range keeps its chunks): the
  // 4097-entry lists in 33 chunks each.
  cuda::AttentionPlanOptions capped;
  capped.max_chunk_lists = 128;
  for (const cuda::AttentionPlanOptions& po : {cuda::AttentionPlanOptions{}, capped}) {
    const GpuResult sp = run_gpu(seqs, q, 4, all, po);
    EXPECT_LT(norm_err(sp.out.data(), d.out.data(), d.out.size()), 1e-6) << "max_chunk_lists " << po.max_chunk_lists;
    for (size_t i = 0; i < d.lse.size(); ++i) EXPECT_NEAR(sp.lse[i], d.lse[i], 1e-5) << "max_chunk_lists " << po.max_chunk_lists;
  }
}

TEST(CudaAttention, LongChunksMatchReference) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(606);
  // head_dim 128 with 2 kv heads, and Gemma 3's 32K global layer (1 kv head, group 4,
  // head_dim 256).
  for (const auto& [d, n_kv, lens] : {std::tuple{128, 2, std::vector<int>{140000, 70001}},
                                      std::tuple{256, 1, std::vector<int>{32016, 40001}}}) {
    std::vector<KvCache> seqs;
    for (int n : lens) seqs.push_back(random_cache(n_kv, d, n, DType::f16, 16, rng));
    const auto q = random_vec(lens.size() * n_kv * 4 * d, rng);
    const GpuResult r = run_ref(seqs, q, 4, {});
    // One chunk of the whole list (SIMT and tensor cores), two chunks of about half, and
    // the default plan (chunks capped at 32768).
    for (const cuda::AttentionPlanOptions& po :
         {cuda::AttentionPlanOptions{4, 1, 200000, false, 200000}, cuda::AttentionPlanOptions{8, 1, 200000, true, 200000},
          cuda::AttentionPlanOptions{4, 1, 70016, true, 70016}, cuda::AttentionPlanOptions{}}) {
      const GpuResult g = run_gpu(seqs, q, 4, {}, po);
      expect_close(g, r, fmt::format("long chunks: d {} warps {} min_chunk {} max_chunk {} tensor cores {}", d, po.warps,
                                     po.min_chunk, po.max_chunk, po.tensor_cores));
    }
  }
}

// The merge holds the weights of at most 128 partials in shared memory; a list cut into
// more chunks is merged tile by tile. One kv head of 20000 tokens in chunks of 64 entries
// (max_chunk, 2 warps) gives 313 partials (3 tiles), and a second
// sequence of 3000 tokens the one-tile path in the same launch.
TEST(CudaAttention, MergeOfManyPartialsMatchesReference) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(707);
  for (int d : {64, 128}) {
    std::vector<KvCache> seqs;
    for (int n : {20000, 3000}) seqs.push_back(random_cache(1, d, n, DType::f16, 16, rng));
    const auto q = random_vec(seqs.size() * 4 * d, rng);
    const GpuResult r = run_ref(seqs, q, 4, {});
    for (bool tc : {true, false}) {
      const GpuResult g = run_gpu(seqs, q, 4, {}, cuda::AttentionPlanOptions{2, 0, 1, tc, 64});
      expect_close(g, r, fmt::format("many partials: d {} tensor cores {}", d, tc));
    }
  }
}

// The plan keeps options.warps where the rings fit the device's shared memory and takes
// fewer where they do not (head_dim 256: a warp's ring is 25.3 KB, so 8 warps fit an H100
// but not an A100; 4 fit both); head_dim 256 runs the CUDA-core kernel even when tensor
// cores are asked for.
TEST(CudaAttention, PlanFitsItsKernelAndWarpsToTheDevice) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(808);
  for (int d : {128, 256}) {
    std::vector<KvCache> seqs;
    seqs.push_back(random_cache(1, d, 100, DType::f16, 16, rng));
    cuda::DeviceKvCache dev = cuda::DeviceKvCache::upload(views_of(seqs));
    for (bool tc : {true, false})
      for (int warps : {2, 4, 8}) {
        cuda::AttentionPlanOptions po;
        po.warps = warps;
        po.tensor_cores = tc;
        cuda::AttentionPlan plan(dev.view(), 4, po);
        const std::string what = fmt::format("d {} tensor cores {} warps {}", d, tc, warps);
        EXPECT_EQ(plan.tensor_cores(), tc && d == 128) << what;
        EXPECT_LE(plan.warps(), warps) << what;
        EXPECT_GE(plan.warps(), std::min(warps, 4)) << what;
        if (d == 128) {
          EXPECT_EQ(plan.warps(), warps) << what;
        }
      }
  }
}

// One plan launched again and again (as a CUDA graph replays it): the merge tickets are
// reset by each launch, so every launch computes the same attention, for dense and for
// lists of very different lengths.
TEST(CudaAttention, RepeatedLaunchesOfOnePlanAgree) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(707);
  std::vector<KvCache> seqs;
  for (int n : {20000, 4097, 333}) seqs.push_back(random_cache(4, 128, n, DType::f16, 16, rng));
  const auto q = random_vec(3 * 16 * 128, rng);
  std::vector<std::vector<std::vector<int32_t>>> lists(3);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (size_t s = 0; s < 3; ++s)
    for (int h = 0; h < 4; ++h) {
      std::vector<int32_t> l;
      for (int t = 0; t < seqs[s].n_tokens(0); ++t)
        if (u(rng) < 0.1 + 0.3 * h) l.push_back(t);
      lists[s].push_back(l);
    }
  for (bool sparse : {false, true}) {
    const GpuResult r = run_ref(seqs, q, 4, sparse ? lists : std::vector<std::vector<std::vector<int32_t>>>{});
    for (const cuda::AttentionPlanOptions& po0 :
         {cuda::AttentionPlanOptions{}, cuda::AttentionPlanOptions{4, 0, 64, true},
          cuda::AttentionPlanOptions{2, 0, 64, false}}) {
      const cuda::AttentionPlanOptions& po = po0;
      const GpuResult g = run_gpu(seqs, q, 4, sparse ? lists : std::vector<std::vector<std::vector<int32_t>>>{}, po,
                                  nullptr, 5);
      expect_close(g, r, fmt::format("5 launches of one plan, {} warps {} min_chunk {} tensor cores {}",
                                     sparse ? "sparse" : "dense", po.warps, po.min_chunk, po.tensor_cores));
    }
  }
}

TEST(CudaAttention, BadListIsAnError) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(404);
  std::vector<KvCache> seqs;
  seqs.push_back(random_cache(1, 64, 40, DType::f16, 16, rng));
  const auto q = random_vec(64, rng);
  try {
    run_gpu(seqs, q, 1, {{{1, 5, 40}}}, {});  // 40 is outside [0, 40)
    ADD_FAILURE() << "no error for an index outside the cache";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside [0, n_tokens)"), std::string::npos) << e.what();
  }
}

TEST(CudaAttention, ArgumentsAreChecked) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(505);
  std::vector<KvCache> seqs;
  seqs.push_back(random_cache(2, 64, 20, DType::f16, 16, rng));
  cuda::DeviceKvCache dev = cuda::DeviceKvCache::upload(views_of(seqs));
  cuda::AttentionPlan plan(dev.view(), 2);
  cuda::DeviceBuffer q(4 * 64 * sizeof(float)), out(4 * 64 * sizeof(float)), lse(4 * sizeof(float));
  cuda::DeviceDecodeArgs a;
  a.kv = dev.view();
  a.group = 2;
  a.q = q.as<float>();
  a.out = out.as<float>();
  a.lse = lse.as<float>();
  a.scale = 0.0f;
  EXPECT_THROW(cuda::attention_decode(a, plan), Error);
  a.scale = 0.125f;
  a.group = 3;  // the plan was made for 2
  try {
    cuda::attention_decode(a, plan);
    ADD_FAILURE() << "no error for a plan of another group";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("group=2"), std::string::npos) << e.what();
  }
  // f32 caches are CPU only.
  KvCache f32(Shape{1, 1, 1, 64}, KvCacheOptions{16, DType::f32, 8});
  std::vector<float> k(64, 1.0f);
  f32.append(0, k.data(), k.data(), 1);
  try {
    cuda::DeviceKvCache::upload({views_of(f32)});
    ADD_FAILURE() << "no error for an f32 cache";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype=f32"), std::string::npos) << e.what();
  }
}
