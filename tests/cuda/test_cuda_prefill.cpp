// CUDA prefill kernels (src/kernels/cuda/prefill.cu) against the float64 references of
// kernels/prefill.h on fresh random inputs of awkward sizes: dense causal attention, block-
// sparse attention over random layouts (the reference is dense attention with the
// equivalent mask, tests/test_prefill.cpp checks that), FlexPrefill's device probe against
// ref::attention_prefill_projection, and the device+host selection against the CPU method's
// float64 selection. Each at head_dim 64 and 128, and at 256 in Gemma 3's attention shape
// (4 query heads, 1 kv head) on ragged prompts. Outputs are poisoned (NaN) before each run.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/cuda_prefill.h"
#include "cumulus/kernels/prefill.h"
#include "cumulus/kernels/flexprefill_select.h"

using namespace cumulus;
using cumulus::cuda_test::norm_err;

namespace {

// One layer's prompt: an f16 KvCache (keys with heavy tokens, so softmax is far from uniform)
// and f16-rounded queries, on the host in the CPU layouts and on the device head-major.
struct Problem {
  int n, n_kv, group, dim;
  KvCache cache;
  std::vector<float> q;  // [n][n_q][dim], f16-representable
  cuda::DeviceBuffer dq, dk, dv, dout, dlse;

  Problem(int n_, int n_kv_, int group_, int dim_, std::mt19937& rng)
      : n(n_), n_kv(n_kv_), group(group_), dim(dim_),
        cache(cuda_test::random_cache(n_kv_, dim_, n_, DType::f16, 16, rng)) {
    const int nq = n_kv * group;
    q = cuda_test::random_vec(static_cast<size_t>(n) * nq * dim, rng, 1.5f);
    for (float& x : q) x = dtype_round(x, DType::f16);
    std::vector<uint16_t> qh(q.size()), kh(static_cast<size_t>(n) * n_kv * dim), vh(kh.size());
    for (int h = 0; h < nq; ++h)
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < dim; ++j)
          qh[(static_cast<size_t>(h) * n + i) * dim + j] = f32_to_f16(q[(static_cast<size_t>(i) * nq + h) * dim + j]);
    for (int h = 0; h < n_kv; ++h) {
      const PagedHeadView v = cache.view(0, h);
      for (int t = 0; t < n; ++t) {
        std::memcpy(&kh[(static_cast<size_t>(h) * n + t) * dim], v.key(t), dim * 2);
        std::memcpy(&vh[(static_cast<size_t>(h) * n + t) * dim], v.value(t), dim * 2);
      }
    }
    dq = cuda::to_device(qh);
    dk = cuda::to_device(kh);
    dv = cuda::to_device(vh);
    dout = cuda::DeviceBuffer(qh.size() * 2);
    dlse = cuda::DeviceBuffer(static_cast<size_t>(nq) * n * 4);
  }
  int nq() const { return n_kv * group; }
  std::vector<PagedHeadView> views() const { return cuda_test::views_of(cache); }

  cuda::DevicePrefillArgs dargs() {
    dout.fill_bytes(0xff);  // f16 NaN
    dlse.fill_bytes(0xff);
    cuda::DevicePrefillArgs a;
    a.q = dq.data();
    a.k = dk.data();
    a.v = dv.data();
    a.out = dout.data();
    a.lse = dlse.as<float>();
    a.n = n;
    a.n_q_heads = nq();
    a.n_kv_heads = n_kv;
    a.head_dim = dim;
    a.scale = 1.0f / std::sqrt(static_cast<float>(dim));
    return a;
  }

  // The float64 reference (dense, or block-sparse over `layout`): out [n][nq][dim], lse [n][nq].
  void reference(const BlockSparseLayout* layout, std::vector<float>& out, std::vector<float>& lse) const {
    const std::vector<PagedHeadView> v = views();
    out.assign(q.size(), 0.0f);
    lse.assign(static_cast<size_t>(n) * nq(), 0.0f);
    PrefillAttnArgs a;
    a.kv = v.data();
    a.n_kv_heads = n_kv;
    a.group = group;
    a.scale = 1.0f / std::sqrt(static_cast<float>(dim));
    a.pos = 0;
    a.n_q = n;
    a.q = q.data();
    a.out = out.data();
    a.lse = lse.data();
    if (layout != nullptr) {
      ref::attention_prefill_block_sparse(a, *layout);
    } else {
      ref::attention_prefill_dense(a);
    }
  }

  // The device result in the CPU layouts.
  void download(std::vector<float>& out, std::vector<float>& lse) const {
    const std::vector<uint16_t> oh = cuda::to_host<uint16_t>(dout, q.size());
    const std::vector<float> lh = cuda::to_host<float>(dlse, static_cast<size_t>(n) * nq());
    out.assign(q.size(), 0.0f);
    lse.assign(lh.size(), 0.0f);
    for (int h = 0; h < nq(); ++h)
      for (int i = 0; i < n; ++i) {
        lse[static_cast<size_t>(i) * nq() + h] = lh[static_cast<size_t>(h) * n + i];
        for (int j = 0; j < dim; ++j)
          out[(static_cast<size_t>(i) * nq() + h) * dim + j] = f16_to_f32(oh[(static_cast<size_t>(h) * n + i) * dim + j]);
      }
  }
};

// f16 operands with float32 accumulation and an f16 output: ~1e-3 normwise.
void expect_close(const Problem& pb, const std::vector<float>& out, const std::vector<float>& lse,
                  const std::vector<float>& ref_out, const std::vector<float>& ref_lse, const char* what) {
  for (size_t i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out[i])) << what << ": out[" << i << "] unwritten";
  EXPECT_LT(norm_err(out.data(), ref_out.data(), out.size()), 3e-3) << what;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << what << ": lse[" << i << "]";
      for (int j = 0; j < pb.dim; ++j) EXPECT_EQ(out[i * pb.dim + j], 0.0f);
    } else {
      EXPECT_NEAR(lse[i], ref_lse[i], 2e-3 * (1.0 + std::fabs(ref_lse[i]))) << what << ": lse[" << i << "]";
    }
  }
}

// The block-sparse kernel over `lay` against the float64 reference over it.
void check_block_sparse(Problem& pb, const BlockSparseLayout& lay, const char* what) {
  const cuda::DeviceBlockLayout dl = cuda::DeviceBlockLayout::upload(lay, pb.n);
  cuda::attention_prefill_block_sparse(pb.dargs(), dl);
  cuda::device_synchronize();
  std::vector<float> out, lse, ro, rl;
  pb.download(out, lse);
  pb.reference(&lay, ro, rl);
  expect_close(pb, out, lse, ro, rl, what);
}

// A random layout: each (head, query block) lists a random subset of [0, r], the diagonal
// left out with probability 1/8 and the whole list empty with probability 1/16.
BlockSparseLayout random_layout(int n, int n_q_heads, int block, std::mt19937& rng) {
  BlockSparseLayout l;
  l.block_size = block;
  l.n_q_blocks = (n + block - 1) / block;
  l.n_q_heads = n_q_heads;
  l.offsets.assign(1, 0);
  for (int h = 0; h < n_q_heads; ++h)
    for (int r = 0; r < l.n_q_blocks; ++r) {
      if (rng() % 16 != 0) {
        for (int b = 0; b < r; ++b)
          if (rng() % 3 == 0) l.blocks.push_back(b);
        if (rng() % 8 != 0) l.blocks.push_back(r);
      }
      l.offsets.push_back(static_cast<int32_t>(l.blocks.size()));
    }
  return l;
}

}  // namespace

TEST(CudaPrefill, DenseMatchesReference) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(71);
  struct Case {
    int n, n_kv, group, dim;
  };
  const Case cases[] = {{1, 1, 1, 64},   {3, 2, 3, 128}, {15, 1, 4, 64},  {16, 2, 1, 128}, {17, 1, 8, 128},
                        {63, 3, 1, 64},  {64, 1, 2, 128}, {65, 2, 2, 64},  {255, 1, 4, 128}, {1000, 2, 3, 64},
                        {4097, 1, 2, 128},
                        // head_dim 256: one key tile (no prefetch), GQA 2, Gemma 3's 4:1 ragged
                        {1, 1, 4, 256},  {65, 2, 2, 256}, {1000, 1, 4, 256}};
  for (const Case& c : cases) {
    Problem pb(c.n, c.n_kv, c.group, c.dim, rng);
    cuda::attention_prefill_dense(pb.dargs());
    cuda::device_synchronize();
    std::vector<float> out, lse, ro, rl;
    pb.download(out, lse);
    pb.reference(nullptr, ro, rl);
    SCOPED_TRACE(testing::Message() << "n=" << c.n << " n_kv=" << c.n_kv << " group=" << c.group << " dim=" << c.dim);
    expect_close(pb, out, lse, ro, rl, "dense");
  }
}

// q_first (a prompt prefilled in chunks): queries [q_first, n) over keys [0, n) give the
// whole prompt's rows [q_first, n) bit for bit (every CTA walks the same key tiles either
// way), out and lse; at head_dim 64, 128 and 256, q_first 64 and 1024 of ragged n.
TEST(CudaPrefill, ChunkFromQFirstEqualsTheWholePromptsRows) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(73);
  struct Case {
    int n, n_kv, group, dim, q_first;
  };
  for (const Case& c : {Case{1000, 2, 3, 64, 64}, Case{2100, 2, 4, 128, 1024}, Case{777, 1, 4, 256, 64}}) {
    SCOPED_TRACE(testing::Message() << "n=" << c.n << " dim=" << c.dim << " q_first=" << c.q_first);
    Problem pb(c.n, c.n_kv, c.group, c.dim, rng);
    cuda::attention_prefill_dense(pb.dargs());
    cuda::device_synchronize();
    const int nq = pb.nq(), rows = c.n - c.q_first;
    const std::vector<uint16_t> full = cuda::to_host<uint16_t>(pb.dout, static_cast<size_t>(nq) * c.n * c.dim);
    const std::vector<float> full_lse = cuda::to_host<float>(pb.dlse, static_cast<size_t>(nq) * c.n);
    std::vector<uint16_t> qc(static_cast<size_t>(nq) * rows * c.dim);
    for (int h = 0; h < nq; ++h)
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < c.dim; ++j)
          qc[(static_cast<size_t>(h) * rows + i) * c.dim + j] =
              f32_to_f16(pb.q[(static_cast<size_t>(c.q_first + i) * nq + h) * c.dim + j]);
    cuda::DeviceBuffer dq = cuda::to_device(qc), dout(qc.size() * 2), dlse(static_cast<size_t>(nq) * rows * 4);
    dout.fill_bytes(0xff);
    cuda::DevicePrefillArgs a = pb.dargs();
    a.q = dq.data();
    a.out = dout.data();
    a.lse = dlse.as<float>();
    a.q_first = c.q_first;
    cuda::attention_prefill_dense(a);
    cuda::device_synchronize();
    const std::vector<uint16_t> part = cuda::to_host<uint16_t>(dout, qc.size());
    const std::vector<float> part_lse = cuda::to_host<float>(dlse, static_cast<size_t>(nq) * rows);
    int bad = 0;
    for (int h = 0; h < nq; ++h)
      for (int i = 0; i < rows; ++i) {
        bad += std::memcmp(&part_lse[static_cast<size_t>(h) * rows + i],
                           &full_lse[static_cast<size_t>(h) * c.n + c.q_first + i], 4) != 0;
        bad += std::memcmp(&part[(static_cast<size_t>(h) * rows + i) * c.dim],
                           &full[(static_cast<size_t>(h) * c.n + c.q_first + i) * c.dim], c.dim * 2) != 0;
      }
    EXPECT_EQ(bad, 0);
  }
  // q_first must be a multiple of 64 below n.
  Problem pb(100, 1, 1, 64, rng);
  cuda::DevicePrefillArgs a = pb.dargs();
  a.q_first = 32;
  EXPECT_THROW(cuda::attention_prefill_dense(a), Error);
  a.q_first = 128;
  EXPECT_THROW(cuda::attention_prefill_dense(a), Error);
}

TEST(CudaPrefill, BlockSparseMatchesMaskedReference) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(72);
  struct Case {
    int n, n_kv, group, dim, block;
  };
  const Case cases[] = {{1, 1, 1, 64, 64},    {17, 1, 3, 128, 64},  {129, 2, 2, 64, 64}, {255, 1, 4, 128, 128},
                        {300, 2, 1, 128, 192}, {1000, 1, 3, 64, 128}, {2049, 2, 2, 128, 128},
                        // head_dim 256 in Gemma 3's shape
                        {777, 1, 4, 256, 128}, {1000, 1, 4, 256, 192}};
  for (const Case& c : cases) {
    Problem pb(c.n, c.n_kv, c.group, c.dim, rng);
    const BlockSparseLayout lay = random_layout(c.n, pb.nq(), c.block, rng);
    SCOPED_TRACE(testing::Message() << "n=" << c.n << " group=" << c.group << " dim=" << c.dim << " block=" << c.block);
    check_block_sparse(pb, lay, "block-sparse");
  }
}

// Every causal block listed: the sparse kernel walks the dense kernel's tiles in the same
// order, so the results are identical bit for bit (head_dim 128, and 256 in Gemma 3's shape).
TEST(CudaPrefill, EveryCausalBlockIsBitIdenticalToDense) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(73);
  struct Case {
    int n_kv, group, dim;
  };
  for (const Case& c : {Case{2, 2, 128}, Case{1, 4, 256}}) {
    SCOPED_TRACE(testing::Message() << "dim=" << c.dim);
    Problem pb(777, c.n_kv, c.group, c.dim, rng);
    cuda::attention_prefill_dense(pb.dargs());
    cuda::device_synchronize();
    const std::vector<uint16_t> dense = cuda::to_host<uint16_t>(pb.dout, pb.q.size());
    const cuda::DeviceBlockLayout dl =
        cuda::DeviceBlockLayout::upload(block_sparse_layout_causal(0, 777, pb.nq(), 128), 777);
    cuda::attention_prefill_block_sparse(pb.dargs(), dl);
    cuda::device_synchronize();
    const std::vector<uint16_t> sparse = cuda::to_host<uint16_t>(pb.dout, pb.q.size());
    EXPECT_TRUE(dense == sparse);
  }
}

// The device probe against ref::attention_prefill_projection (float64) and the host means;
// then the whole device selection against the CPU method's float64 selection.
TEST(CudaPrefill, FlexPrefillProbeAndSelectionMatchCpu) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(74);
  struct Case {
    int n, n_kv, group, dim, block;
  };
  // head_dim 256 at block_size 128: 128 probe rows, 193 KB of shared memory (an H100's 227 KB
  // opt-in holds it, an A100's 163 KB does not; block_size 64 fits both).
  const Case cases[] = {{200, 1, 2, 64, 64},  {1500, 2, 2, 128, 128}, {3001, 1, 3, 64, 128},
                        {777, 1, 4, 256, 64}, {1000, 1, 4, 256, 128}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "n=" << c.n << " dim=" << c.dim << " block=" << c.block);
    Problem pb(c.n, c.n_kv, c.group, c.dim, rng);
    cuda::FlexPrefillProbe probe(c.n, pb.nq(), c.n_kv, c.dim, c.block);
    probe.run(pb.dargs());
    probe.download();
    const int L = std::min(c.n, c.block);
    ASSERT_EQ(probe.n_rows, L);
    const std::vector<PagedHeadView> v = pb.views();
    for (int qh = 0; qh < pb.nq(); ++qh) {
      std::vector<float> rows(static_cast<size_t>(L) * c.dim), vert(c.n), slash(c.n);
      for (int i = 0; i < L; ++i)
        std::copy_n(&pb.q[(static_cast<size_t>(c.n - L + i) * pb.nq() + qh) * c.dim], c.dim, &rows[i * c.dim]);
      PrefillProjectionArgs pa;
      pa.kv = &v[qh / c.group];
      pa.n_keys = c.n;
      pa.scale = 1.0f / std::sqrt(static_cast<float>(c.dim));
      pa.q = rows.data();
      pa.n_rows = L;
      pa.vertical = vert.data();
      pa.slash = slash.data();
      ref::attention_prefill_projection(pa);
      EXPECT_LT(norm_err(&probe.vertical[static_cast<size_t>(qh) * c.n], vert.data(), c.n), 2e-3) << "head " << qh;
      EXPECT_LT(norm_err(&probe.slash[static_cast<size_t>(qh) * c.n], slash.data(), c.n), 2e-3) << "head " << qh;
      // Query means of the probe rows and of block 0.
      for (int j = 0; j < c.dim; ++j) {
        double s = 0.0, s0 = 0.0;
        for (int i = 0; i < L; ++i) s += rows[i * c.dim + j];
        const int r1 = std::min(c.n, c.block);
        for (int i = 0; i < r1; ++i) s0 += pb.q[(static_cast<size_t>(i) * pb.nq() + qh) * c.dim + j];
        EXPECT_NEAR(probe.q_probe_mean[static_cast<size_t>(qh) * c.dim + j], s / L, 1e-4);
        EXPECT_NEAR(probe.q_block_mean[static_cast<size_t>(qh) * probe.n_blocks * c.dim + j], s0 / r1, 1e-4);
      }
    }
    std::vector<float> kmean(static_cast<size_t>(probe.n_blocks) * c.dim);
    for (int h = 0; h < c.n_kv; ++h) {
      flexprefill::key_block_means(v[h], c.n, c.block, true, kmean.data());
      EXPECT_LT(norm_err(&probe.k_block_mean[static_cast<size_t>(h) * kmean.size()], kmean.data(), kmean.size()), 1e-5);
    }

    // Selection: tau 0.3 so both patterns occur on these inputs; min_budget small so the
    // search (not the shortcut) decides.
    flexprefill::Config cfg;
    cfg.block_size = c.block;
    cfg.tau = 0.3;
    cfg.min_budget = c.block;
    ThreadPool pool(2);
    std::vector<flexprefill::HeadSelection> heads;
    const BlockSparseLayout lay = cuda::flexprefill_select(cfg, probe, pool, &heads);
    const flexprefill::LayerSelection ref = flexprefill::select_layer(
        cfg, flexprefill::Geometry{0, c.n, c.block}, v.data(), c.n_kv, c.group, pb.q.data(), pool, true);
    ASSERT_EQ(lay.offsets.size(), ref.layout.offsets.size());
    for (int qh = 0; qh < pb.nq(); ++qh) {
      const auto& g = heads[qh];
      const auto& r = ref.heads[qh];
      if (std::fabs(r.js_distance - cfg.tau) > 1e-3) {
        EXPECT_EQ(g.pattern, r.pattern) << "head " << qh;
      }
      std::vector<int32_t> a, b;  // (query block, key block) pairs as r * nb + c
      const int nb = probe.n_blocks;
      for (int qb = 0; qb < nb; ++qb) {
        for (int32_t kb : g.lists[qb]) a.push_back(qb * nb + kb);
        for (int32_t kb : r.lists[qb]) b.push_back(qb * nb + kb);
      }
      EXPECT_GE(cuda_test::jaccard(a, b), 0.98) << "head " << qh;
    }
    // And the sparse kernel over the device selection equals the reference over it.
    check_block_sparse(pb, lay, "flexprefill");
  }
}

TEST(CudaPrefill, BadInputIsAnError) {
  CUMULUS_REQUIRE_GPU();
  std::mt19937 rng(75);
  Problem pb(100, 1, 2, 64, rng);
  cuda::DevicePrefillArgs a = pb.dargs();
  a.head_dim = 96;
  EXPECT_THROW(cuda::attention_prefill_dense(a), Error);
  try {
    cuda::attention_prefill_dense(a);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(64, 128, 256)"), std::string::npos) << e.what();
  }
  a = pb.dargs();
  a.n_kv_heads = 2;
  a.n_q_heads = 3;  // not a multiple of the kv heads
  EXPECT_THROW(cuda::attention_prefill_dense(a), Error);
  BlockSparseLayout lay = block_sparse_layout_causal(0, 100, 2, 64);
  lay.blocks[1] = 5;  // query block 1 may list blocks 0..1 only
  EXPECT_THROW(cuda::DeviceBlockLayout::upload(lay, 100), Error);
  EXPECT_THROW(cuda::DeviceBlockLayout::upload(block_sparse_layout_causal(0, 100, 2, 96), 100), Error);
  const cuda::DeviceBlockLayout other = cuda::DeviceBlockLayout::upload(block_sparse_layout_causal(0, 100, 4, 64), 100);
  EXPECT_THROW(cuda::attention_prefill_block_sparse(pb.dargs(), other), Error);
  // 4096 probe rows of head_dim 128, or 256 rows of head_dim 256, do not fit in shared memory.
  EXPECT_THROW(cuda::FlexPrefillProbe(5000, 2, 1, 128, 4096), Error);
  EXPECT_THROW(cuda::FlexPrefillProbe(5000, 4, 1, 256, 256), Error);
  EXPECT_THROW(cuda::FlexPrefillProbe(5000, 4, 1, 96, 64), Error);
}
