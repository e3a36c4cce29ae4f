// Prefill attention kernels (kernels/prefill.h): the SIMD backend (on every SIMD target this
// binary carries) against the float64 reference on fresh random caches, chunks at awkward
// positions and lengths (1, 3, 15, 16, 17, 255, 300 queries; prefixes up to 4097 tokens), GQA
// groups 1, 3, 4, 8, storage dtypes f32, f16, bf16, page sizes 1, 16, 64 and head_dim 8, 24,
// 64, 128. Cache rows past the chunk hold NaN, so a kernel that reads a key it may not attend
// fails. Block-sparse attention is checked as dense attention with the equivalent mask (the
// reference decode kernel over each query's own token list); with every causal block listed
// it is bit-identical to the dense op. 1, 2 and 3 threads give identical bits. The projection
// (FlexPrefill's probe) against the reference and against exp(s - lse) of decode attention.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "kernel_check.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/kernels/prefill.h"

using namespace cumulus;
using namespace cumulus::attn_test;
using namespace cumulus::check;

namespace {

// Tolerances, float32 accumulation against float64 (as tests/test_attention.cpp):
//   out: ||cpu - ref|| / ||ref|| over the chunk; lse: absolute.
constexpr double kOutTol = 2e-5;
constexpr double kLseTol = 2e-5;

// A random cache of n_kv heads holding `used` valid tokens followed by `extra` NaN rows.
AttnTestCache chunk_cache(int n_kv, int used, int extra, int dim, DType dt, int page_size, std::mt19937& rng) {
  AttnTestCache c = attn_cache_random(std::vector<int>(n_kv, used + extra), dim, dt, page_size, rng);
  std::vector<float> nan_row(dim, std::numeric_limits<float>::quiet_NaN());
  for (int h = 0; h < n_kv; ++h)
    for (int t = used; t < used + extra; ++t) attn_cache_set_row(c, h, t, nan_row.data(), nan_row.data());
  return c;
}

// Outputs of one call; NaN-filled so an unwritten element fails the comparison.
struct PrefillResult {
  std::vector<float> out, lse;
  PrefillResult(int n_q, int n_q_heads, int dim)
      : out(static_cast<size_t>(n_q) * n_q_heads * dim, std::numeric_limits<float>::quiet_NaN()),
        lse(static_cast<size_t>(n_q) * n_q_heads, std::numeric_limits<float>::quiet_NaN()) {}
};

PrefillAttnArgs make_args(const AttnTestCache& c, int group, int pos, int n_q, const std::vector<float>& q,
                          PrefillResult& r) {
  PrefillAttnArgs a;
  a.kv = c.views.data();
  a.n_kv_heads = c.n_kv();
  a.group = group;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  a.pos = pos;
  a.n_q = n_q;
  a.q = q.data();
  a.out = r.out.data();
  a.lse = r.lse.data();
  return a;
}

void expect_close(const PrefillResult& got, const PrefillResult& want, const std::string& what) {
  EXPECT_LE(norm_err(got.out, want.out), kOutTol) << what;
  EXPECT_LE(max_abs_err(got.lse, want.lse), kLseTol) << what;
}

void expect_identical(const PrefillResult& a, const PrefillResult& b, const std::string& what) {
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0) << what;
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)), 0) << what;
}

// A random layout: each (query head, query block) lists a random subset of its causal
// blocks with probability `frac` each; the diagonal is kept with probability 0.8 and a list
// may come out empty (its queries then attend nothing).
BlockSparseLayout random_layout(int pos, int n_q, int n_q_heads, int block, double frac, std::mt19937& rng) {
  BlockSparseLayout L = block_sparse_layout_causal(pos, n_q, n_q_heads, block);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  L.blocks.clear();
  L.offsets.assign(1, 0);
  for (int h = 0; h < n_q_heads; ++h)
    for (int r = 0; r < L.n_q_blocks; ++r) {
      const int rb = L.first_q_block + r;
      for (int c = 0; c <= rb; ++c)
        if (u(rng) < (c == rb ? 0.8 : frac)) L.blocks.push_back(c);
      L.offsets.push_back(static_cast<int32_t>(L.blocks.size()));
    }
  return L;
}

struct ChunkCase {
  int pos, n_q;
};
// Chunks at awkward positions: first chunks, chunks that start or end mid-block and mid-tile,
// a single query deep into a 4097-token prefix.
const ChunkCase kChunks[] = {{0, 1}, {0, 3}, {0, 17}, {5, 15}, {16, 16}, {100, 155}, {0, 300}, {4000, 97}, {4096, 1}};
const int kGroups[] = {1, 3, 4, 8};
const DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};
const int kPageSizes[] = {1, 16, 64};

}  // namespace

TEST(PrefillRef, FirstQueryReturnsTheFirstValue) {
  std::mt19937 rng(5);
  AttnTestCache c = chunk_cache(1, 1, 0, 16, DType::f32, 16, rng);
  const std::vector<float> q = attn_random_q(2, 16, rng);
  PrefillResult r(1, 2, 16);
  ref::attention_prefill_dense(make_args(c, 2, 0, 1, q, r));
  const float* v = static_cast<const float*>(c.views[0].value(0));
  for (int g = 0; g < 2; ++g)
    for (int j = 0; j < 16; ++j) EXPECT_EQ(r.out[g * 16 + j], v[j]);
}

// The reference prefill is the reference decode kernel applied to each query over its prefix.
TEST(PrefillRef, DenseEqualsDecodeOverEachPrefix) {
  std::mt19937 rng(6);
  const int group = 3, dim = 24, pos = 7, n_q = 20;
  AttnTestCache c = chunk_cache(2, pos + n_q, 4, dim, DType::f16, 16, rng);
  const std::vector<float> q = attn_random_q(n_q * 2 * group, dim, rng);
  PrefillResult r(n_q, 2 * group, dim);
  ref::attention_prefill_dense(make_args(c, group, pos, n_q, q, r));
  for (int i = 0; i < n_q; ++i) {
    std::vector<PagedHeadView> views = c.views;
    for (auto& v : views) v.n_tokens = pos + i + 1;
    std::vector<float> out(2 * group * dim), lse(2 * group);
    DecodeAttnArgs d;
    d.kv = views.data();
    d.n_kv_heads = 2;
    d.group = group;
    d.scale = 1.0f / std::sqrt(static_cast<float>(dim));
    d.q = q.data() + static_cast<size_t>(i) * 2 * group * dim;
    d.out = out.data();
    d.lse = lse.data();
    ref::attention_decode_dense(d);
    for (int k = 0; k < 2 * group * dim; ++k) EXPECT_EQ(out[k], r.out[static_cast<size_t>(i) * 2 * group * dim + k]);
    for (int k = 0; k < 2 * group; ++k) EXPECT_EQ(lse[k], r.lse[static_cast<size_t>(i) * 2 * group + k]);
  }
}

TEST(PrefillDense, MatchesReferenceAllChunksGroupsDtypes) {
  std::mt19937 rng(1234);
  ThreadPool pool(2);
  int case_no = 0;
  for (DType dt : kDTypes) {
    for (const ChunkCase& ch : kChunks) {
      for (int group : kGroups) {
        const int page_size = kPageSizes[case_no % 3];
        const int dim = (case_no % 5 == 1) ? 24 : (case_no % 7 == 3) ? 8 : (case_no % 2) ? 64 : 128;
        ++case_no;
        // The long prefix runs with one kv head and small groups only (the reference costs
        // n_q x n x head_dim per query head).
        if ((ch.pos > 1000 || ch.n_q >= 300) && group > 3) continue;
        const int n_kv = ch.pos > 1000 ? 1 : 2;
        AttnTestCache c = chunk_cache(n_kv, ch.pos + ch.n_q, 1 + case_no % 5, dim, dt, page_size, rng);
        const std::vector<float> q = attn_random_q(ch.n_q * n_kv * group, dim, rng);
        PrefillResult want(ch.n_q, n_kv * group, dim);
        ref::attention_prefill_dense(make_args(c, group, ch.pos, ch.n_q, q, want));
        const std::string what = fmt::format("dtype={} pos={} n_q={} group={} page_size={} head_dim={}",
                                             dtype_name(dt), ch.pos, ch.n_q, group, page_size, dim);
        auto run = [&] {
          PrefillResult got(ch.n_q, n_kv * group, dim);
          cpu::attention_prefill_dense(make_args(c, group, ch.pos, ch.n_q, q, got), pool);
          expect_close(got, want, what);
        };
        if (case_no % 4 == 0) {
          for_each_target(run);
        } else {
          run();
        }
      }
    }
  }
}

TEST(PrefillDense, ThreadCountDoesNotChangeBits) {
  std::mt19937 rng(77);
  for (DType dt : kDTypes) {
    const int group = 3, pos = 300, n_q = 500, dim = 64;
    AttnTestCache c = chunk_cache(3, pos + n_q, 0, dim, dt, 16, rng);
    const std::vector<float> q = attn_random_q(n_q * 3 * group, dim, rng);
    ThreadPool p1(1), p2(2), p3(3);
    PrefillResult r1(n_q, 3 * group, dim), r2(n_q, 3 * group, dim), r3(n_q, 3 * group, dim);
    cpu::attention_prefill_dense(make_args(c, group, pos, n_q, q, r1), p1);
    cpu::attention_prefill_dense(make_args(c, group, pos, n_q, q, r2), p2);
    cpu::attention_prefill_dense(make_args(c, group, pos, n_q, q, r3), p3);
    expect_identical(r1, r2, "1 vs 2 threads " + std::string(dtype_name(dt)));
    expect_identical(r1, r3, "1 vs 3 threads " + std::string(dtype_name(dt)));
  }
}

// A chunk's rows do not depend on how the prompt was cut into chunks: the second half of a
// prompt prefilled as its own chunk equals those rows of the whole prompt's chunk.
TEST(PrefillDense, RowsDoNotDependOnTheChunking) {
  std::mt19937 rng(8);
  ThreadPool pool(2);
  const int group = 4, dim = 64, n = 333, cut = 141;
  AttnTestCache c = chunk_cache(2, n, 0, dim, DType::bf16, 16, rng);
  const std::vector<float> q = attn_random_q(n * 2 * group, dim, rng);
  PrefillResult whole(n, 2 * group, dim), tail(n - cut, 2 * group, dim);
  cpu::attention_prefill_dense(make_args(c, group, 0, n, q, whole), pool);
  const std::vector<float> q_tail(q.begin() + static_cast<ptrdiff_t>(cut) * 2 * group * dim, q.end());
  cpu::attention_prefill_dense(make_args(c, group, cut, n - cut, q_tail, tail), pool);
  const size_t off = static_cast<size_t>(cut) * 2 * group * dim;
  EXPECT_EQ(std::memcmp(whole.out.data() + off, tail.out.data(), tail.out.size() * sizeof(float)), 0);
}

// Block-sparse attention is dense attention with the equivalent mask: for every query row,
// the reference decode kernel over exactly the tokens of its listed blocks up to its position.
TEST(PrefillBlockSparse, EqualsDenseWithTheEquivalentMask) {
  std::mt19937 rng(99);
  ThreadPool pool(2);
  int case_no = 0;
  for (DType dt : kDTypes) {
    for (const ChunkCase& ch : {ChunkCase{0, 17}, ChunkCase{5, 150}, ChunkCase{100, 155}, ChunkCase{0, 200}}) {
      for (int group : kGroups) {
        const int block = (case_no % 3 == 0) ? 16 : (case_no % 3 == 1) ? 128 : 40;
        const int page_size = kPageSizes[case_no % 3];
        const int dim = (case_no % 4 == 1) ? 24 : 64;
        ++case_no;
        const int n_kv = 2, n_q_heads = n_kv * group;
        AttnTestCache c = chunk_cache(n_kv, ch.pos + ch.n_q, 3, dim, dt, page_size, rng);
        const std::vector<float> q = attn_random_q(ch.n_q * n_q_heads, dim, rng);
        const BlockSparseLayout L = random_layout(ch.pos, ch.n_q, n_q_heads, block, 0.4, rng);
        const std::string what = fmt::format("dtype={} pos={} n_q={} group={} block={} page_size={} head_dim={}",
                                             dtype_name(dt), ch.pos, ch.n_q, group, block, page_size, dim);
        PrefillResult want(ch.n_q, n_q_heads, dim);
        ref::attention_prefill_block_sparse(make_args(c, group, ch.pos, ch.n_q, q, want), L);
        // The mask, query by query, through the reference decode kernel.
        for (int i = 0; i < ch.n_q; ++i) {
          const int p = ch.pos + i;
          for (int qh = 0; qh < n_q_heads; ++qh) {
            Selection sel;
            sel.tokens.emplace_back();
            for (int32_t b : L.list(qh, p / block - L.first_q_block))
              for (int t = b * block; t < (b + 1) * block && t <= p; ++t) sel.tokens[0].push_back(t);
            float out[128], lse;
            DecodeAttnArgs d;
            d.kv = &c.views[qh / group];
            d.n_kv_heads = 1;
            d.group = 1;
            d.scale = 1.0f / std::sqrt(static_cast<float>(dim));
            d.q = q.data() + (static_cast<size_t>(i) * n_q_heads + qh) * dim;
            d.out = out;
            d.lse = &lse;
            ref::attention_decode_sparse(d, sel);
            const size_t row = static_cast<size_t>(i) * n_q_heads + qh;
            for (int j = 0; j < dim; ++j) ASSERT_EQ(out[j], want.out[row * dim + j]) << what << " row " << row;
            ASSERT_EQ(lse, want.lse[row]) << what << " row " << row;
          }
        }
        auto run = [&] {
          PrefillResult got(ch.n_q, n_q_heads, dim);
          cpu::attention_prefill_block_sparse(make_args(c, group, ch.pos, ch.n_q, q, got), L, pool);
          // Empty lists give out = 0, lse = -inf on both sides; compare those exactly.
          for (size_t k = 0; k < want.lse.size(); ++k)
            if (std::isinf(want.lse[k])) {
              EXPECT_EQ(got.lse[k], want.lse[k]) << what;
            }
          std::vector<float> a = got.out, b = want.out, la, lb;
          for (size_t k = 0; k < want.lse.size(); ++k)
            if (!std::isinf(want.lse[k])) la.push_back(got.lse[k]), lb.push_back(want.lse[k]);
          EXPECT_LE(norm_err(a, b), kOutTol) << what;
          EXPECT_LE(max_abs_err(la, lb), kLseTol) << what;
        };
        if (case_no % 3 == 0) {
          for_each_target(run);
        } else {
          run();
        }
      }
    }
  }
}

TEST(PrefillBlockSparse, EveryCausalBlockIsBitIdenticalToDense) {
  std::mt19937 rng(31);
  ThreadPool pool(2);
  for (int block : {16, 40, 64, 128, 256}) {
    for (int group : {1, 3, 8}) {
      const int pos = 37, n_q = 400, dim = 64;
      AttnTestCache c = chunk_cache(2, pos + n_q, 2, dim, DType::f16, 16, rng);
      const std::vector<float> q = attn_random_q(n_q * 2 * group, dim, rng);
      PrefillResult dense(n_q, 2 * group, dim), sparse(n_q, 2 * group, dim);
      cpu::attention_prefill_dense(make_args(c, group, pos, n_q, q, dense), pool);
      cpu::attention_prefill_block_sparse(make_args(c, group, pos, n_q, q, sparse),
                                          block_sparse_layout_causal(pos, n_q, 2 * group, block), pool);
      expect_identical(sparse, dense, fmt::format("block={} group={}", block, group));
    }
  }
}

TEST(PrefillBlockSparse, ThreadCountDoesNotChangeBits) {
  std::mt19937 rng(78);
  const int group = 4, pos = 300, n_q = 700, dim = 64;
  AttnTestCache c = chunk_cache(2, pos + n_q, 0, dim, DType::f16, 16, rng);
  const std::vector<float> q = attn_random_q(n_q * 2 * group, dim, rng);
  const BlockSparseLayout L = random_layout(pos, n_q, 2 * group, 64, 0.3, rng);
  ThreadPool p1(1), p2(2), p3(3);
  PrefillResult r1(n_q, 2 * group, dim), r2(n_q, 2 * group, dim), r3(n_q, 2 * group, dim);
  cpu::attention_prefill_block_sparse(make_args(c, group, pos, n_q, q, r1), L, p1);
  cpu::attention_prefill_block_sparse(make_args(c, group, pos, n_q, q, r2), L, p2);
  cpu::attention_prefill_block_sparse(make_args(c, group, pos, n_q, q, r3), L, p3);
  expect_identical(r1, r2, "1 vs 2 threads");
  expect_identical(r1, r3, "1 vs 3 threads");
}

// The projection: cpu against ref, both sums equal n_rows, and the reference against the
// probabilities exp(scale q.k_j - lse) that the reference decode kernel's lse implies.
TEST(PrefillProjection, MatchesReferenceAndDecodeProbabilities) {
  std::mt19937 rng(17);
  int case_no = 0;
  for (DType dt : kDTypes) {
    for (auto [n_keys, n_rows] : {std::pair{1, 1}, {17, 3}, {130, 128}, {255, 16}, {4097, 128}}) {
      const int dim = (case_no % 3 == 1) ? 24 : 64;
      const int page_size = kPageSizes[case_no % 3];
      ++case_no;
      AttnTestCache c = chunk_cache(1, n_keys, 2, dim, dt, page_size, rng);
      const std::vector<float> q = attn_random_q(n_rows, dim, rng);
      PrefillProjectionArgs a;
      a.kv = &c.views[0];
      a.n_keys = n_keys;
      a.scale = 1.0f / std::sqrt(static_cast<float>(dim));
      a.q = q.data();
      a.n_rows = n_rows;
      std::vector<float> v_ref(n_keys), s_ref(n_keys);
      a.vertical = v_ref.data();
      a.slash = s_ref.data();
      ref::attention_prefill_projection(a);
      const std::string what = fmt::format("dtype={} n_keys={} n_rows={} dim={}", dtype_name(dt), n_keys, n_rows, dim);
      double sv = 0, ss = 0;
      for (int j = 0; j < n_keys; ++j) sv += v_ref[j], ss += s_ref[j];
      EXPECT_NEAR(sv, n_rows, 1e-4 * n_rows) << what;
      EXPECT_NEAR(ss, n_rows, 1e-4 * n_rows) << what;
      // Independent probabilities from decode's lse, row by row.
      std::vector<double> v_dec(n_keys, 0.0), s_dec(n_keys, 0.0);
      for (int i = 0; i < n_rows; ++i) {
        const int p = n_keys - n_rows + i;
        PagedHeadView view = c.views[0];
        view.n_tokens = p + 1;
        std::vector<float> out(dim);
        float lse;
        DecodeAttnArgs d;
        d.kv = &view;
        d.n_kv_heads = 1;
        d.scale = a.scale;
        d.q = q.data() + static_cast<size_t>(i) * dim;
        d.out = out.data();
        d.lse = &lse;
        ref::attention_decode_dense(d);
        for (int j = 0; j <= p; ++j) {
          std::vector<float> k(dim);
          convert_to_f32(view.key(j), dt, k.data(), dim);
          double s = 0;
          for (int t = 0; t < dim; ++t) s += static_cast<double>(d.q[t]) * k[t];
          const double w = std::exp(a.scale * s - lse);
          v_dec[j] += w;
          s_dec[p - j] += w;
        }
      }
      for (int j = 0; j < n_keys; ++j) {
        EXPECT_NEAR(v_ref[j], v_dec[j], 1e-5 * n_rows) << what << " j=" << j;
        EXPECT_NEAR(s_ref[j], s_dec[j], 1e-5 * n_rows) << what << " o=" << j;
      }
      for_each_target([&] {
        std::vector<float> v_cpu(n_keys), s_cpu(n_keys);
        PrefillProjectionArgs b = a;
        b.vertical = v_cpu.data();
        b.slash = s_cpu.data();
        cpu::attention_prefill_projection(b);
        EXPECT_LE(max_abs_err(v_cpu, v_ref), 1e-5 * n_rows) << what;
        EXPECT_LE(max_abs_err(s_cpu, s_ref), 1e-5 * n_rows) << what;
      });
    }
  }
}

TEST(PrefillValidate, BadInputIsAnErrorNamingTheValue) {
  std::mt19937 rng(3);
  ThreadPool pool(1);
  AttnTestCache c = chunk_cache(2, 40, 0, 16, DType::f16, 16, rng);
  std::vector<float> q = attn_random_q(40 * 4, 16, rng);
  PrefillResult r(40, 4, 16);
  expect_error([&] { cpu::attention_prefill_dense(make_args(c, 2, 1, 40, q, r), pool); }, "n_tokens=40 must be >= 41");
  expect_error([&] { cpu::attention_prefill_dense(make_args(c, 2, 0, 0, q, r), pool); }, "n_q=0");
  expect_error([&] { cpu::attention_prefill_dense(make_args(c, 2, -1, 5, q, r), pool); }, "pos=-1");
  q[5 * 4 * 16 + 17] = std::numeric_limits<float>::infinity();
  expect_error([&] { cpu::attention_prefill_dense(make_args(c, 2, 0, 40, q, r), pool); }, "q[5][17]=inf");
  q[5 * 4 * 16 + 17] = 0.5f;
  BlockSparseLayout L = block_sparse_layout_causal(0, 40, 4, 16);
  BlockSparseLayout bad = L;
  bad.blocks[bad.offsets[2] + 1] = 7;  // query head 0, block 2 lists 0, 7, 2
  expect_error([&] { cpu::attention_prefill_block_sparse(make_args(c, 2, 0, 40, q, r), bad, pool); },
               "key block 7 is outside [0, 2]");
  bad = L;
  std::swap(bad.blocks[bad.offsets[2]], bad.blocks[bad.offsets[2] + 1]);
  expect_error([&] { cpu::attention_prefill_block_sparse(make_args(c, 2, 0, 40, q, r), bad, pool); },
               "key block 0 follows 1");
  bad = L;
  bad.first_q_block = 1;
  expect_error([&] { cpu::attention_prefill_block_sparse(make_args(c, 2, 0, 40, q, r), bad, pool); },
               "covers query blocks [1, 4)");
  expect_error([&] { cpu::attention_prefill_block_sparse(make_args(c, 1, 0, 40, q, r), L, pool); },
               "layout.n_q_heads=4");
  PrefillProjectionArgs a;
  std::vector<float> v(41), s(41);
  a.kv = &c.views[0];
  a.n_keys = 41;
  a.scale = 0.25f;
  a.q = q.data();
  a.n_rows = 3;
  a.vertical = v.data();
  a.slash = s.data();
  expect_error([&] { cpu::attention_prefill_projection(a); }, "n_tokens=40 must be >= 41");
  a.n_keys = 40;
  a.n_rows = 41;
  expect_error([&] { cpu::attention_prefill_projection(a); }, "n_rows=41");
}

TEST(PrefillDense, GemmaHeadDim256) {
  // Gemma 3's shape: head_dim 256, 4 query heads over 1 kv head, chunks that
  // start at 0 and past a 512-token window.
  std::mt19937 rng(256);
  ThreadPool pool(2);
  for (DType dt : kDTypes) {
    for (auto [pos, n_q] : {std::pair{0, 17}, {500, 37}, {1023, 1}}) {
      AttnTestCache c = chunk_cache(1, pos + n_q, 3, 256, dt, 16, rng);
      const std::vector<float> q = attn_random_q(n_q * 4, 256, rng);
      PrefillResult want(n_q, 4, 256);
      ref::attention_prefill_dense(make_args(c, 4, pos, n_q, q, want));
      const std::string what = fmt::format("dtype={} pos={} n_q={} head_dim=256 group=4", dtype_name(dt), pos, n_q);
      for_each_target([&] {
        PrefillResult got(n_q, 4, 256);
        cpu::attention_prefill_dense(make_args(c, 4, pos, n_q, q, got), pool);
        expect_close(got, want, what);
      });
    }
  }
}
