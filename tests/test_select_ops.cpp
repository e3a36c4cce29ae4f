// The selection ops (kernels/select_ops.h) and the methods written once against them
// (methods/policy.h): the cpu backend against the float64 reference backend, for every
// policy in the registry, on a batch of two sequences of different lengths at awkward
// sizes; the sets against what each method promises, computed here from the reference's
// scores; and bad use of the ops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "cumulus/core/error.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/select_ops.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/registry.h"
#include "kernel_check.h"

namespace cumulus {
namespace {

struct Batch {
  Shape shape;
  std::vector<KvCache> caches;      // one per sequence
  std::vector<PagedHeadView> views;  // [n_seqs][n_kv_heads]
  std::vector<float> q;             // [n_seqs][n_q_heads][head_dim]
  HostSelectBatch b;
};

// Keys N(0, 1) plus every 29th token boosted (a peaked softmax), values N(0, 1).
Batch make_batch(const Shape& shape, const std::vector<int>& n_tokens, int page_size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Batch bt;
  bt.shape = shape;
  const size_t row = static_cast<size_t>(shape.n_kv_heads) * shape.head_dim;
  for (int n : n_tokens) {
    KvCache kv(shape, {.page_size = page_size, .dtype = DType::f16, .max_tokens = 1 << 16});
    std::vector<float> k(row * n), v(row * n);
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = nd(rng) * ((i / shape.head_dim) % 29 == 3 ? 3.0f : 1.0f);
      v[i] = nd(rng);
    }
    kv.append(0, k.data(), v.data(), n);
    bt.caches.push_back(std::move(kv));
  }
  for (const KvCache& kv : bt.caches)
    for (int h = 0; h < shape.n_kv_heads; ++h) bt.views.push_back(kv.view(0, h));
  bt.q.resize(n_tokens.size() * shape.n_q_heads * shape.head_dim);
  for (float& x : bt.q) x = nd(rng);
  bt.b = {.kv = bt.views.data(),
          .n_seqs = static_cast<int>(n_tokens.size()),
          .n_kv_heads = shape.n_kv_heads,
          .group = shape.group(),
          .q = bt.q.data(),
          .pool = nullptr};
  return bt;
}

struct Result {
  std::vector<std::vector<int32_t>> lists;
  std::vector<double> claims, bytes;
};

Result run(HostSelectOps& ops, const SelectPolicy& policy, const Batch& bt, ThreadPool& pool, int layer = 0) {
  HostSelectBatch b = bt.b;
  b.pool = &pool;
  ops.begin(b);
  policy.select(layer, ops);
  Result r;
  r.lists.resize(static_cast<size_t>(b.n_seqs) * b.n_kv_heads);
  r.claims.resize(static_cast<size_t>(b.n_seqs) * b.n_kv_heads * b.group);
  r.bytes.resize(r.lists.size());
  ops.finish(r.lists.data(), r.claims.data(), r.bytes.data());
  return r;
}

double jaccard(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> i;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(i));
  const size_t u = a.size() + b.size() - i.size();
  return u == 0 ? 1.0 : static_cast<double>(i.size()) / static_cast<double>(u);
}

std::shared_ptr<const SelectPolicy> policy(const std::string& name, const Shape& s,
                                           const std::map<std::string, std::string>& params) {
  const Registry& r = Registry::builtin();
  const MethodInfo& m = r.find(name);
  EXPECT_NE(m.make_policy, nullptr) << name;
  return m.make_policy(s, r.parse(name, params));
}

// The softmax weights of one row of raw scores, in float64.
std::vector<double> softmax(const std::vector<float>& s, int head_dim) {
  double mx = -INFINITY;
  for (float x : s) mx = std::max(mx, static_cast<double>(x));
  std::vector<double> w(s.size());
  double tot = 0;
  for (size_t i = 0; i < s.size(); ++i) tot += w[i] = std::exp((s[i] - mx) / std::sqrt(static_cast<double>(head_dim)));
  for (double& x : w) x /= tot;
  return w;
}

TEST(SelectOps, CpuEqualsTheReferenceForEveryPolicy) {
  ThreadPool pool(2);
  auto cpu_ops = cpu::make_select_ops();
  auto ref_ops = ref::make_select_ops();
  struct Case {
    std::string method;
    std::map<std::string, std::string> params;
  };
  const std::vector<Case> cases{
      {"oracle_topp", {{"p", "0.9"}}},
      {"oracle_topp", {{"p", "1"}}},
      {"oracle_topk", {{"k", "37"}}},
      {"oracle_topk", {{"k", "5000"}}},
      {"quest", {{"budget", "100"}}},
      {"quest", {{"budget", "1"}}},
      {"streaming", {{"sinks", "4"}, {"window", "60"}}},
      {"streaming", {{"sinks", "0"}, {"window", "1"}}},
  };
  for (const Shape shape : {Shape{1, 4, 1, 64}, Shape{1, 9, 3, 64}, Shape{1, 8, 2, 128}}) {
    for (const int page_size : {16, 8}) {
      const Batch bt = make_batch(shape, {1003, 17}, page_size, 7u + static_cast<uint32_t>(shape.n_q_heads));
      for (const Case& c : cases) {
        SCOPED_TRACE(c.method + " " + (c.params.empty() ? "" : c.params.begin()->second) + " group " +
                     std::to_string(shape.group()) + " page " + std::to_string(page_size));
        const auto pol = policy(c.method, shape, c.params);
        check::for_each_target([&] {
          const Result a = run(*cpu_ops, *pol, bt, pool), b = run(*ref_ops, *pol, bt, pool);
          for (size_t t = 0; t < a.lists.size(); ++t) {
            EXPECT_TRUE(std::is_sorted(a.lists[t].begin(), a.lists[t].end()));
            EXPECT_TRUE(std::adjacent_find(a.lists[t].begin(), a.lists[t].end()) == a.lists[t].end());
            EXPECT_GE(jaccard(a.lists[t], b.lists[t]), 0.98) << "list " << t;
            EXPECT_EQ(a.bytes[t], b.bytes[t]);
          }
          for (size_t r = 0; r < a.claims.size(); ++r) {
            if (std::isnan(b.claims[r])) {
              EXPECT_TRUE(std::isnan(a.claims[r]));
            } else {
              EXPECT_NEAR(a.claims[r], b.claims[r], 2e-3) << "row " << r;
            }
          }
        });
      }
    }
  }
}

// Each policy's sets, checked against the promise computed here from the reference scores.
TEST(SelectOps, PoliciesSelectWhatTheirMethodsPromise) {
  ThreadPool pool(2);
  const Shape shape{1, 6, 2, 64};
  const Batch bt = make_batch(shape, {517, 2000}, 16, 3);
  auto ops = cpu::make_select_ops();
  const int g = shape.group();
  for (int s = 0; s < 2; ++s) {
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      const PagedHeadView& v = bt.views[static_cast<size_t>(s * shape.n_kv_heads + h)];
      const int n = v.n_tokens;
      const float* q = bt.q.data() + (static_cast<size_t>(s) * shape.n_q_heads + h * g) * shape.head_dim;
      const size_t t = static_cast<size_t>(s * shape.n_kv_heads + h);
      {  // oracle_topp: each head's claim reaches p, and its union holds at least that mass
        const Result r = run(*ops, *policy("oracle_topp", shape, {{"p", "0.8"}}), bt, pool);
        for (int j = 0; j < g; ++j) {
          std::vector<float> sc(n);
          ref::token_score(v, q + static_cast<size_t>(j) * shape.head_dim, 1, nullptr, n, sc.data());
          const std::vector<double> w = softmax(sc, shape.head_dim);
          double in_union = 0;
          for (int32_t i : r.lists[t]) in_union += w[static_cast<size_t>(i)];
          const double claim = r.claims[static_cast<size_t>(s * shape.n_q_heads + h * g + j)];
          EXPECT_GE(claim, 0.8 - 1e-6);
          EXPECT_GE(in_union, claim - 1e-5);
        }
        EXPECT_LT(r.lists[t].size(), static_cast<size_t>(n));
        EXPECT_EQ(r.bytes[t], static_cast<double>(n) * v.row_bytes());
      }
      {  // oracle_topk: each head's 50 largest scores are in the union, and it claims their mass
        const Result r = run(*ops, *policy("oracle_topk", shape, {{"k", "50"}}), bt, pool);
        for (int j = 0; j < g; ++j) {
          std::vector<float> sc(n);
          ref::token_score(v, q + static_cast<size_t>(j) * shape.head_dim, 1, nullptr, n, sc.data());
          const std::vector<double> w = softmax(sc, shape.head_dim);
          std::vector<int32_t> order(static_cast<size_t>(n));
          for (int i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
          std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return sc[a] > sc[b]; });
          double top = 0;
          for (int k = 0; k < 50; ++k) {
            top += w[static_cast<size_t>(order[k])];
            EXPECT_TRUE(std::binary_search(r.lists[t].begin(), r.lists[t].end(), order[k]));
          }
          EXPECT_NEAR(r.claims[static_cast<size_t>(s * shape.n_q_heads + h * g + j)], top, 1e-5);
        }
        EXPECT_LE(r.lists[t].size(), static_cast<size_t>(50 * g));
      }
      {  // streaming: exactly the first 4 and the last 100
        const Result r = run(*ops, *policy("streaming", shape, {{"sinks", "4"}, {"window", "100"}}), bt, pool);
        std::vector<int32_t> want;
        for (int i = 0; i < n; ++i)
          if (i < 4 || i >= n - 100) want.push_back(i);
        EXPECT_EQ(r.lists[t], want);
        EXPECT_TRUE(std::isnan(r.claims[t * g]));
        EXPECT_EQ(r.bytes[t], 0.0);
      }
      {  // quest: each head's ceil(48 / 16) = 3 pages of largest bound (float64 reference
         // bounds, ranked here), whole; a dense layer reads all
        const auto pol = policy("quest", shape, {{"budget", "48"}, {"dense_layers", "1"}});
        const Result r = run(*ops, *pol, bt, pool, /*layer=*/1);
        std::vector<int32_t> want;
        for (int j = 0; j < g; ++j) {
          std::vector<float> bound(static_cast<size_t>(v.n_pages()));
          ref::page_score_bound(v, q + static_cast<size_t>(j) * shape.head_dim, bound.data());
          std::vector<int32_t> order(bound.size());
          for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
          std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return bound[a] > bound[b]; });
          for (int k = 0; k < 3; ++k)
            for (int i = order[k] * 16; i < std::min(n, order[k] * 16 + 16); ++i) want.push_back(i);
        }
        std::sort(want.begin(), want.end());
        want.erase(std::unique(want.begin(), want.end()), want.end());
        EXPECT_EQ(r.lists[t], want);
        EXPECT_EQ(r.bytes[t], 2.0 * v.n_pages() * shape.head_dim * sizeof(float));
        const Result d = run(*ops, *pol, bt, pool, /*layer=*/0);
        EXPECT_EQ(d.lists[t].size(), static_cast<size_t>(n));
        EXPECT_EQ(d.claims[t * g], 1.0);
        EXPECT_TRUE(pol->dense_layer(0));
        EXPECT_FALSE(pol->dense_layer(1));
      }
    }
  }
}

TEST(SelectOps, BadUseNamesTheProblem) {
  ThreadPool pool(1);
  const Shape shape{1, 2, 1, 64};
  const Batch bt = make_batch(shape, {40}, 16, 5);
  for (auto* make : {&cpu::make_select_ops, &ref::make_select_ops}) {
    auto ops = make();
    HostSelectBatch b = bt.b;
    b.pool = &pool;
    ops->begin(b);
    check::expect_error([&] { ops->choose_topk(3); }, "choose_topk before any scores");
    check::expect_error([&] { ops->choose_top_mass(0.9); }, "needs token scores");
    ops->score_pages_bound();
    check::expect_error([&] { ops->choose_top_mass(0.9); }, "needs token scores");
    check::expect_error([&] { ops->mark_chosen(true); }, "a mass claim needs token scores");
    ops->score_tokens();
    check::expect_error([&] { ops->choose_top_mass(0); }, "p=0");
    check::expect_error([&] { ops->choose_topk(0); }, "k=0");
    check::expect_error([&] { ops->mark_ends(-1, 3); }, "head=-1");
    check::expect_error([&] { ops->mark_chosen(false); }, "before a choice");  // scores, no choice
    ops->score_pages_bound();
    ops->choose_topk(2);
    ops->score_tokens();  // the choice was of the page scores
    check::expect_error([&] { ops->mark_chosen(false); }, "before a choice");
    HostSelectBatch bad = b;
    bad.group = 0;
    check::expect_error([&] { ops->begin(bad); }, "group=0");
  }
  auto ops = cpu::make_select_ops();
  HostSelectBatch nopool = bt.b;
  check::expect_error([&] { ops->begin(nopool); }, "thread pool");
}

}  // namespace
}  // namespace cumulus
