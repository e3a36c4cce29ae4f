// FlexPrefill (src/methods/flexprefill/flexprefill.cpp, docs/methods.md "flexprefill"), tested by what it
// promises: hand-built probes whose pattern and blocks are worked out by hand (vertical-slash,
// query-aware, budgets, a chunk in the middle of a prompt); every selection holds the first
// block and the diagonal; the CPU selection agrees with the float64 one; at gamma = 1 (or a
// min budget covering every block) the method is bit-identical to dense prefill, and
// otherwise its output is block-sparse attention over exactly what it selected; the session
// wiring (registry, chunking, stats) on the real stories260K model; bad parameters are errors
// naming the value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "attention_test_util.h"
#include "kernel_check.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/prefill.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/session.h"
#include "cumulus/model/tokenizer.h"
#include "cumulus/kernels/flexprefill_select.h"
#include "methods/method_util.h"
#include "fixtures.h"

using namespace cumulus;
using namespace cumulus::attn_test;
using namespace cumulus::check;
using flexprefill::Pattern;

namespace {

using Lists = std::vector<std::vector<int32_t>>;

// A hand-built probe for 64 tokens in blocks of 8 (8 key blocks, probe of 8 rows, head_dim 8).
struct HandProbe {
  std::vector<float> vertical = std::vector<float>(64, 0.0f);
  std::vector<float> slash = std::vector<float>(64, 0.0f);
  std::vector<float> q = std::vector<float>(64 * 8, 0.0f);  // [64 positions][8]
  std::vector<float> kmean = std::vector<float>(8 * 8, 0.0f);

  flexprefill::HeadInputs inputs(int pos) const {
    flexprefill::HeadInputs in;
    in.vertical = vertical.data();
    in.slash = slash.data();
    in.q = q.data() + static_cast<size_t>(pos) * 8;
    in.q_stride = 8;
    in.k_block_mean = kmean.data();
    in.head_dim = 8;
    return in;
  }
};

// Vertical-slash: the probe's mass sits on columns of key blocks 0 (0.1), 2 (0.3) and 5 (0.6)
// and on distances 0-7 and 16-23 (half each); the queries are zero, so the pooled estimate is
// uniform and far from the probe (sqrt JSD ~ 0.57 > tau).
HandProbe vertical_slash_probe() {
  HandProbe p;
  p.vertical[0] = 0.8f;                        // block 0: 0.8 / 8 rows = 0.1
  for (int j = 16; j < 24; ++j) p.vertical[j] = 0.3f;  // block 2: 0.3
  for (int j = 40; j < 48; ++j) p.vertical[j] = 0.6f;  // block 5: 0.6
  for (int o = 0; o < 8; ++o) p.slash[o] = 0.5f;       // distance block 0: 0.5
  for (int o = 16; o < 24; ++o) p.slash[o] = 0.5f;     // distance block 2: 0.5
  for (int b = 0; b < 8; ++b) p.kmean[b * 8 + b] = 1.0f;
  return p;
}

flexprefill::Config hand_config() {
  flexprefill::Config c;
  c.block_size = 8;
  c.min_budget = 0;
  return c;
}

}  // namespace

// gamma 0.9: the vertical cover needs 15 of the 64 column tokens (0.1 + 8 x 0.075 + 6 x
// 0.0375 >= 0.9) -> 15 / 8 + 1 = 2 blocks: {0, 5}; the slash cover needs 15 of 16 equal
// distances -> 2 offsets: {0, 2}. Query block r then gets {0, 5} up to r and {r, r - 2}.
TEST(FlexPrefillSelect, HandBuiltVerticalSlash) {
  const HandProbe p = vertical_slash_probe();
  const flexprefill::HeadSelection s = flexprefill::select_head(hand_config(), {0, 64, 8}, p.inputs(0));
  EXPECT_EQ(s.pattern, Pattern::vertical_slash);
  EXPECT_NEAR(s.js_distance, 0.566, 0.002);
  EXPECT_EQ(s.n_vertical, 2);
  EXPECT_EQ(s.n_slash, 2);
  EXPECT_EQ(s.n_query_aware, 0);
  const Lists want = {{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 3, 5}, {0, 4, 5, 6}, {0, 5, 7}};
  EXPECT_EQ(s.lists, want);
}

// The same probe for the chunk [24, 64) of the prompt: query blocks 3..7 only, same lists.
TEST(FlexPrefillSelect, HandBuiltChunkInTheMiddleOfThePrompt) {
  const HandProbe p = vertical_slash_probe();
  const flexprefill::Geometry g{24, 40, 8};
  EXPECT_EQ(g.first_q_block(), 3);
  EXPECT_EQ(g.n_q_blocks(), 5);
  const flexprefill::HeadSelection s = flexprefill::select_head(hand_config(), g, p.inputs(24));
  const Lists want = {{0, 1, 3}, {0, 2, 4}, {0, 3, 5}, {0, 4, 5, 6}, {0, 5, 7}};
  EXPECT_EQ(s.lists, want);
}

// Budgets: min_budget 24 tokens = 3 blocks of each (vertical {0, 5, 2}; slash {0, 2} plus the
// lowest-index zero-mass distance 1); max_budget 8 tokens = 1 block of each ({0}, {0}).
TEST(FlexPrefillSelect, HandBuiltBudgets) {
  const HandProbe p = vertical_slash_probe();
  flexprefill::Config c = hand_config();
  c.min_budget = 24;
  flexprefill::HeadSelection s = flexprefill::select_head(c, {0, 64, 8}, p.inputs(0));
  EXPECT_EQ(s.n_vertical, 3);
  EXPECT_EQ(s.n_slash, 3);
  EXPECT_EQ(s.lists[7], (std::vector<int32_t>{0, 2, 5, 6, 7}));
  EXPECT_EQ(s.lists[3], (std::vector<int32_t>{0, 1, 2, 3}));
  c.min_budget = 0;
  c.max_budget = 8;
  s = flexprefill::select_head(c, {0, 64, 8}, p.inputs(0));
  EXPECT_EQ(s.n_vertical, 1);
  EXPECT_EQ(s.n_slash, 1);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(s.lists[r], (r == 0 ? std::vector<int32_t>{0} : std::vector<int32_t>{0, r}));
}

// Query-aware: the probe is uniform over the 64 columns and so is the estimate (the last
// block's queries are zero): JS distance 0 < tau. Key block c has mean 10 e_c; the queries of
// block r <= 6 are 20 e_{r/2}, so pooled row r puts all its mass on key block r/2; row 7 is
// uniform. Flattened and divided by 8 rows: seven pairs of 1/8 (0.875), then row 7's pairs of
// 1/64 in index order until 0.9: (7, 0), (7, 1). The min budget adds {0} and the diagonal.
TEST(FlexPrefillSelect, HandBuiltQueryAware) {
  HandProbe p;
  for (int j = 0; j < 64; ++j) p.vertical[j] = p.slash[j] = 0.125f;
  for (int b = 0; b < 8; ++b) p.kmean[b * 8 + b] = 10.0f;
  for (int t = 0; t < 56; ++t) p.q[t * 8 + (t / 8) / 2] = 20.0f;
  const flexprefill::HeadSelection s = flexprefill::select_head(hand_config(), {0, 64, 8}, p.inputs(0));
  EXPECT_EQ(s.pattern, Pattern::query_aware);
  EXPECT_NEAR(s.js_distance, 0.0, 1e-6);
  EXPECT_EQ(s.n_vertical, 1);
  EXPECT_EQ(s.n_slash, 1);
  EXPECT_EQ(s.n_query_aware, 6);  // (2,1) (3,1) (4,2) (5,2) (6,3) (7,1); (0,0) (1,0) (7,0) were in
  const Lists want = {{0}, {0, 1}, {0, 1, 2}, {0, 1, 3}, {0, 2, 4}, {0, 2, 5}, {0, 3, 6}, {0, 1, 7}};
  EXPECT_EQ(s.lists, want);
  // tau = 0 never chooses query-aware.
  flexprefill::Config c = hand_config();
  c.tau = 0.0;
  EXPECT_EQ(flexprefill::select_head(c, {0, 64, 8}, p.inputs(0)).pattern, Pattern::vertical_slash);
}

TEST(FlexPrefillSelect, EveryCausalBlockWhenGammaIsOneOrTheBudgetCoversAll) {
  const HandProbe p = vertical_slash_probe();
  flexprefill::Config c = hand_config();
  const Lists all = {{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4, 5},
                     {0, 1, 2, 3, 4, 5, 6}, {0, 1, 2, 3, 4, 5, 6, 7}};
  c.gamma = 1.0;
  EXPECT_EQ(flexprefill::select_head(c, {0, 64, 8}, p.inputs(0)).lists, all);
  EXPECT_EQ(flexprefill::select_head(c, {0, 64, 8}, p.inputs(0)).pattern, Pattern::dense);
  c = hand_config();
  c.min_budget = 57;  // ceil(57 / 8) = 8 blocks = every key block
  EXPECT_EQ(flexprefill::select_head(c, {0, 64, 8}, p.inputs(0)).lists, all);
  c.min_budget = 0;
  EXPECT_TRUE(flexprefill::selects_everything(c, {0, 16, 8}));  // 2 key blocks
  EXPECT_FALSE(flexprefill::selects_everything(c, {0, 17, 8}));
}

// On random caches: each list is sorted, unique, causal and holds block 0 and the diagonal;
// the CPU selection matches the float64 one (as sets; patterns agree away from tau).
TEST(FlexPrefillSelect, RandomLayersHoldFirstAndDiagonalAndMatchTheReference) {
  std::mt19937 rng(2024);
  ThreadPool pool(2);
  for (auto [pos, n_q, block, group] : {std::tuple{0, 1000, 64, 3}, {200, 555, 32, 4}, {0, 777, 128, 1}}) {
    const int n = pos + n_q, dim = 64, n_kv = 2;
    AttnTestCache c = attn_cache_random({n, n}, dim, DType::f16, 16, rng);
    const std::vector<float> q = attn_random_q(n_q * n_kv * group, dim, rng);
    flexprefill::Config cfg;
    cfg.block_size = block;
    cfg.min_budget = 0;
    const flexprefill::Geometry g{pos, n_q, block};
    const auto cpu_sel = flexprefill::select_layer(cfg, g, c.views.data(), n_kv, group, q.data(), pool);
    const auto ref_sel = flexprefill::select_layer(cfg, g, c.views.data(), n_kv, group, q.data(), pool, true);
    std::set<std::tuple<int, int, int>> a, b;
    for (int h = 0; h < n_kv * group; ++h) {
      for (int r = 0; r < g.n_q_blocks(); ++r) {
        const int rb = g.first_q_block() + r;
        const auto list = cpu_sel.layout.list(h, r);
        ASSERT_FALSE(list.empty());
        EXPECT_EQ(list.front(), 0);
        EXPECT_EQ(list.back(), rb);
        for (size_t k = 1; k < list.size(); ++k) EXPECT_GT(list[k], list[k - 1]);
        for (int32_t x : list) a.insert({h, r, x});
        for (int32_t x : ref_sel.layout.list(h, r)) b.insert({h, r, x});
      }
      const auto& hc = cpu_sel.heads[h];
      const auto& hr = ref_sel.heads[h];
      EXPECT_NEAR(hc.js_distance, hr.js_distance, 1e-4);
      if (std::fabs(hr.js_distance - cfg.tau) > 1e-3) {
        EXPECT_EQ(hc.pattern, hr.pattern) << "head " << h;
      }
    }
    size_t inter = 0;
    for (const auto& x : a) inter += b.count(x);
    const double jaccard = static_cast<double>(inter) / static_cast<double>(a.size() + b.size() - inter);
    EXPECT_GE(jaccard, 0.98) << "pos=" << pos << " n_q=" << n_q;
  }
}

namespace {

// One layer of random keys and values in a real KvCache, and random queries.
struct MethodFixture {
  Shape shape{1, 6, 2, 64};
  KvCache kv{shape, KvCacheOptions{}};
  std::vector<float> q;
  int n = 0;

  explicit MethodFixture(int n_tokens, std::mt19937& rng) : n(n_tokens) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> k(static_cast<size_t>(n) * 2 * 64), v(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = nd(rng) * ((i / 64) % 29 == 0 ? 3.0f : 1.0f);
      v[i] = nd(rng);
    }
    kv.append(0, k.data(), v.data(), n);
    q = attn_random_q(n * 6, 64, rng);
  }

  std::vector<float> run(PrefillMethod& m, ThreadPool& pool, int pos = 0, int c = -1) {
    if (c < 0) c = n - pos;
    std::vector<float> out(static_cast<size_t>(c) * 6 * 64);
    m.prefill(0, pos, c, q.data() + static_cast<size_t>(pos) * 6 * 64, kv, PrefillContext{&pool}, out.data());
    return out;
  }
};

}  // namespace

TEST(FlexPrefillMethod, GammaOneOrFullBudgetIsBitIdenticalToDense) {
  std::mt19937 rng(7);
  ThreadPool pool(2);
  MethodFixture f(700, rng);
  const Registry& reg = Registry::builtin();
  auto dense = reg.make_prefill("dense", f.shape);
  const std::vector<float> want = f.run(*dense, pool);
  for (const auto& params : std::vector<std::map<std::string, std::string>>{
           {{"gamma", "1"}, {"block_size", "64"}, {"min_budget", "0"}},
           {{"block_size", "32"}, {"min_budget", "700"}},
           {{"gamma", "1"}}}) {
    auto flex = reg.make_prefill("flexprefill", f.shape, params);
    const std::vector<float> got = f.run(*flex, pool);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
    EXPECT_EQ(flex->stats().blocks_computed, flex->stats().blocks_causal);
    EXPECT_EQ(flex->stats().heads_dense, 6);
  }
}

// Below gamma = 1 the output is block-sparse attention (the float64 reference) over exactly
// the blocks the selection chose, for a whole prompt and for a chunk; stats count them.
TEST(FlexPrefillMethod, OutputIsBlockSparseAttentionOverItsSelection) {
  std::mt19937 rng(8);
  ThreadPool pool(2);
  MethodFixture f(600, rng);
  const std::map<std::string, std::string> params = {{"block_size", "64"}, {"min_budget", "0"}, {"gamma", "0.8"}};
  flexprefill::Config cfg;
  cfg.block_size = 64;
  cfg.min_budget = 0;
  cfg.gamma = 0.8;
  for (auto [pos, c] : {std::pair{0, 600}, {350, 250}}) {
    auto flex = Registry::builtin().make_prefill("flexprefill", f.shape, params);
    const std::vector<float> got = f.run(*flex, pool, pos, c);
    std::vector<PagedHeadView> views = {f.kv.view(0, 0), f.kv.view(0, 1)};
    for (auto& v : views) v.n_tokens = pos + c;
    const float* q = f.q.data() + static_cast<size_t>(pos) * 6 * 64;
    const auto sel = flexprefill::select_layer(cfg, {pos, c, 64}, views.data(), 2, 3, q, pool);
    std::vector<float> want(got.size());
    ref::attention_prefill_block_sparse(methods::prefill_args(f.shape, views, pos, c, q, want.data()), sel.layout);
    EXPECT_LE(norm_err(got, want), 2e-5) << "pos=" << pos;
    const PrefillStats& st = flex->stats();
    EXPECT_EQ(st.blocks_computed, static_cast<int64_t>(sel.layout.blocks.size()));
    EXPECT_LT(st.blocks_computed, st.blocks_causal);
    EXPECT_EQ(st.heads_query_aware + st.heads_vertical_slash + st.heads_dense, 6);
  }
}

TEST(FlexPrefillMethod, BadParametersAreErrorsNamingTheValue) {
  const Shape s{1, 6, 2, 64};
  const Registry& reg = Registry::builtin();
  expect_error([&] { reg.make_prefill("flexprefill", s, {{"gamma", "0"}}); }, "gamma=0 must be in (0");
  expect_error([&] { reg.make_prefill("flexprefill", s, {{"gamma", "1.5"}}); }, "gamma=1.5");
  expect_error([&] { reg.make_prefill("flexprefill", s, {{"tau", "-0.1"}}); }, "tau=-0.1");
  expect_error([&] { reg.make_prefill("flexprefill", s, {{"block_size", "4"}}); }, "block_size=4");
  expect_error([&] { reg.make_prefill("flexprefill", s, {{"block_size", "12.5"}}); }, "block_size='12.5'");
  expect_error([&] { reg.make_prefill("flexprefill", s, {{"min_budget", "-1"}}); }, "min_budget=-1");
  expect_error([&] { reg.make_prefill("flexprefill", s, {{"max_budget", "512"}}); },
               "max_budget=512 is below min_budget=1024");
  expect_error([&] { reg.make_prefill("flexprefill", s, {{"lambda", "1"}}); }, "no parameter 'lambda'");
  expect_error([&] { reg.make_prefill("tactic", s); }, "not a prefill method");
  expect_error([&] { reg.make("flexprefill", s); }, "not a decode method");
  EXPECT_EQ(reg.find("flexprefill").kind, MethodKind::prefill);
  EXPECT_TRUE(reg.find("dense").make_decode && reg.find("dense").make_prefill);
}

namespace {

const std::string kStories = std::string(CUMULUS_SHARED_DIR) + "/data/models/stories260K";

class FlexPrefillStories : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kStories + "/stories260K.bin")) CUMULUS_FIXTURE_MISSING("no " << kStories);
    weights_ = std::make_unique<ModelWeights>(model_weights_load(kStories + "/stories260K.bin"));
    tok_ = tokenizer_from_llama2c(kStories + "/tok512.bin", weights_->config.vocab_size);
    std::string text;
    for (int i = 0; i < 8; ++i)
      text += "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, "
              "she saw a big red ball in the park. ";
    prompt_ = tok_->encode(text, true);
    ASSERT_GT(prompt_.size(), 300u);
  }
  std::vector<float> prefill(const std::string& method, const std::map<std::string, std::string>& params,
                             int threads = 2, int chunk = 256, PrefillStats* stats = nullptr) {
    SessionOptions o;
    o.prefill_method = method;
    o.prefill_params = params;
    o.n_threads = threads;
    o.prefill_chunk = chunk;
    Session s(*weights_, o);
    std::vector<float> logits = s.prefill(prompt_);
    if (stats != nullptr) *stats = s.prefill_method().stats();
    return logits;
  }
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<Tokenizer> tok_;
  std::vector<int32_t> prompt_;
};

}  // namespace

// Through the session: flexprefill at gamma = 1 in the dense session's chunks gives the same
// bits; over the whole prompt at once (its default) the same logits up to GEMM rounding.
TEST_F(FlexPrefillStories, GammaOneEqualsDenseThroughTheSession) {
  const std::vector<float> dense = prefill("dense", {});
  EXPECT_EQ(prefill("flexprefill", {{"gamma", "1"}, {"chunk", "256"}}), dense);
  EXPECT_LT(norm_err(prefill("flexprefill", {{"gamma", "1"}}), dense), 1e-4);
  // Dense prefill in one chunk of the whole prompt agrees as well.
  EXPECT_LT(norm_err(prefill("dense", {}, 2, 4096), dense), 1e-4);
}

TEST_F(FlexPrefillStories, SparsePrefillCountsItsBlocksAndIsDeterministic) {
  const std::map<std::string, std::string> sparse = {{"block_size", "16"}, {"min_budget", "0"}};
  PrefillStats st;
  const std::vector<float> a = prefill("flexprefill", sparse, 2, 256, &st);
  const int heads = weights_->config.n_layers * weights_->config.n_heads;
  EXPECT_EQ(st.heads_dense + st.heads_query_aware + st.heads_vertical_slash, heads);  // one chunk
  EXPECT_GT(st.blocks_computed, 0);
  EXPECT_LT(st.block_share(), 1.0);
  EXPECT_EQ(prefill("flexprefill", sparse, 1), a);
  EXPECT_EQ(prefill("flexprefill", sparse, 3), a);
  // Chunked: three forward passes, each probing its own last block.
  PrefillStats chunked;
  prefill("flexprefill", {{"block_size", "16"}, {"min_budget", "0"}, {"chunk", "128"}}, 2, 256, &chunked);
  EXPECT_EQ(chunked.heads_dense + chunked.heads_query_aware + chunked.heads_vertical_slash,
            heads * static_cast<int64_t>((prompt_.size() + 127) / 128));
  // A session with a bad prefill method or parameter does not start.
  SessionOptions o;
  o.prefill_method = "flexprefill";
  o.prefill_params = {{"gamma", "2"}};
  EXPECT_THROW(Session(*weights_, o), Error);
  o.prefill_method = "quest";
  o.prefill_params = {};
  EXPECT_THROW(Session(*weights_, o), Error);
}
