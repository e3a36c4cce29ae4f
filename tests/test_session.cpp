// The model runtime end to end against a golden output nobody here wrote: greedy
// decoding of stories260K from BOS reproduces the sample in stories260K.md (llama2.c's
// run.c at temperature 0) exactly, through every decode method at full budget, and two
// runs and two thread counts agree bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>

#include "cumulus/core/error.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/sampler.h"
#include "cumulus/model/session.h"
#include "cumulus/model/tokenizer.h"
#include "fixtures.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

const std::string kDir = std::string(CUMULUS_SHARED_DIR) + "/data/models/stories260K";

struct Generated {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<float> last_logits;
};

// As run.c: feed BOS, then greedily feed back each token; stop at BOS or `steps`.
Generated generate(const ModelWeights& w, const Tokenizer& tok, SessionOptions opt, int steps) {
  Session s(w, opt);
  Sampler greedy({});
  Generated g;
  std::vector<int32_t> prompt = {tok.bos_id()};
  const std::vector<float>* logits = &s.prefill(prompt);
  for (int pos = 0; pos < steps; ++pos) {
    const int32_t next = greedy.sample(*logits);
    if (next == tok.bos_id()) break;
    g.ids.push_back(next);
    if (pos + 1 < steps) logits = &s.decode(next);
  }
  g.last_logits = *logits;
  g.text = tok.decode(g.ids);
  return g;
}

class Stories260K : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kDir + "/stories260K.bin"))
      CUMULUS_FIXTURE_MISSING("no " << kDir << " (../shared missing)");
    weights_ = std::make_unique<ModelWeights>(model_weights_load(kDir + "/stories260K.bin"));
    tok_ = tokenizer_from_llama2c(kDir + "/tok512.bin", weights_->config.vocab_size);
    sample_ = test::stories260k_golden_sample();
    ASSERT_GT(sample_.size(), 500u) << "could not find the greedy sample in stories260K.md";
  }
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<Tokenizer> tok_;
  std::string sample_;
};

}  // namespace

TEST_F(Stories260K, GreedyReproducesTheGoldenSample) {
  Generated g = generate(*weights_, *tok_, {}, 256);
  ASSERT_GE(g.text.size(), sample_.size()) << g.text;
  EXPECT_EQ(g.text.substr(0, sample_.size()), sample_);
}

TEST_F(Stories260K, PrefillChunksAgreeWithTokenByToken) {
  // Prefill of the sample's tokens in chunks of 1, 7 and 64 ends in the same logits.
  std::vector<int32_t> ids = tok_->encode(sample_.substr(0, 400), true);
  std::vector<std::vector<float>> logits;
  for (int chunk : {1, 7, 64}) {
    SessionOptions o;
    o.prefill_chunk = chunk;
    Session s(*weights_, o);
    logits.push_back(s.prefill(ids));
  }
  // GEMM (chunks) and GEMV (single rows) sum in different orders: compare by normalised
  // error, float32 level.
  for (size_t i = 1; i < logits.size(); ++i) {
    double num = 0, den = 0;
    for (size_t j = 0; j < logits[0].size(); ++j) {
      num += (logits[i][j] - logits[0][j]) * (logits[i][j] - logits[0][j]);
      den += logits[0][j] * logits[0][j];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-4) << "chunk index " << i;
  }
}

TEST_F(Stories260K, LfpsKeepsThePromptQueriesOfEveryPiece) {
  // A prompt fed in two pieces, the second shorter than lfps's s, on the chunk grid (so the
  // forward passes are the same ones): lfps learns from the same last s queries and decodes
  // as after one prefill, bit for bit.
  const std::vector<int32_t> ids = tok_->encode(sample_.substr(0, 300), true);
  const size_t split = (ids.size() - 3) / 4 * 4;
  SessionOptions o;
  o.method = "lfps";
  o.params = {{"s", "8"}};
  o.prefill_chunk = 4;
  auto greedy_after = [&](Session& s, std::vector<float> logits) {
    Sampler greedy({});
    std::vector<std::vector<float>> out;
    for (int i = 0; i < 12; ++i) out.push_back(logits = s.decode(greedy.sample(logits)));
    return out;
  };
  Session whole(*weights_, o), pieces(*weights_, o);
  const auto want = greedy_after(whole, whole.prefill(ids));
  pieces.prefill(std::span<const int32_t>(ids).first(split));
  const std::vector<float> last = pieces.prefill(std::span<const int32_t>(ids).subspan(split));
  ASSERT_LT(ids.size() - split, 8u);
  EXPECT_EQ(greedy_after(pieces, last), want);
}

TEST_F(Stories260K, EveryMethodAtFullBudgetMatchesDense) {
  for (const auto& [m, params] : std::vector<std::pair<std::string, std::map<std::string, std::string>>>{
           {"oracle_topp", {{"p", "1"}}},
           {"oracle_topk", {{"k", "512"}}},
           {"streaming", {{"window", "512"}}},
           {"quest", {{"budget", "512"}}},
           {"tactic", {{"p", "1"}}},
           {"psa", {{"threshold", "1"}}},
           {"psa", {{"threshold", "1"}, {"stop", "certified"}, {"criticality", "bound"}}},
           {"lfps", {{"budget", "512"}, {"epsilon", "1"}}}}) {
    SessionOptions o;
    o.method = m;
    o.params = params;
    Generated g = generate(*weights_, *tok_, o, 256);
    EXPECT_EQ(g.text.substr(0, sample_.size()), sample_) << m;
  }
}

// With a real prompt, on_prefill builds every index (Tactic's clusters, LFPS's tables from
// the prompt's last queries); at full budget each method still decodes what dense does.
TEST_F(Stories260K, EveryMethodAtFullBudgetMatchesDenseAfterAPrompt) {
  const std::vector<int32_t> prompt = tok_->encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she "
      "saw a big red ball in the park. She ran to the ball and",
      true);
  ASSERT_GT(prompt.size(), 40u);
  auto run = [&](const std::string& m, const std::map<std::string, std::string>& params) {
    SessionOptions o;
    o.method = m;
    o.params = params;
    Session s(*weights_, o);
    Sampler greedy({});
    std::vector<int32_t> ids;
    const std::vector<float>* logits = &s.prefill(prompt);
    for (int i = 0; i < 48; ++i) {
      ids.push_back(greedy.sample(*logits));
      logits = &s.decode(ids.back());
    }
    return ids;
  };
  const std::vector<int32_t> dense = run("dense", {});
  for (const auto& [m, params] : std::vector<std::pair<std::string, std::map<std::string, std::string>>>{
           {"oracle_topp", {{"p", "1"}}},
           {"tactic", {{"p", "1"}, {"cluster_size", "4"}}},
           {"psa", {{"threshold", "1"}}},
           {"lfps", {{"budget", "512"}, {"epsilon", "1"}, {"s", "8"}}}})
    EXPECT_EQ(run(m, params), dense) << m;
}

TEST_F(Stories260K, DeterministicAcrossRunsAndThreads) {
  SessionOptions one, two;
  one.n_threads = 1;
  two.n_threads = 2;
  Generated a = generate(*weights_, *tok_, two, 64), b = generate(*weights_, *tok_, two, 64),
            c = generate(*weights_, *tok_, one, 64);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.last_logits, b.last_logits);
  EXPECT_EQ(a.ids, c.ids);
  EXPECT_EQ(a.last_logits, c.last_logits);
}

TEST_F(Stories260K, BadInputIsAnError) {
  Session s(*weights_, {});
  std::vector<int32_t> too_long(513, 1), bad_id = {1, 512};
  EXPECT_THROW(s.prefill(too_long), Error);
  EXPECT_THROW(s.prefill(bad_id), Error);
  EXPECT_THROW(s.decode(5), Error);  // nothing prefilled
  // A bad id in a later chunk is refused before the first chunk runs: the session is as it was.
  SessionOptions chunked;
  chunked.prefill_chunk = 4;
  Session later(*weights_, chunked), fresh(*weights_, chunked);
  EXPECT_THROW(later.prefill(std::vector<int32_t>{1, 2, 3, 4, 5, 512}), Error);
  EXPECT_EQ(later.position(), 0);
  EXPECT_EQ(later.prefill(std::vector<int32_t>{1, 2, 3, 4, 5}), fresh.prefill(std::vector<int32_t>{1, 2, 3, 4, 5}));
  EXPECT_THROW(Sampler({.temperature = -1}), Error);
  EXPECT_THROW(Sampler({.top_p = 0}), Error);
  SessionOptions o;
  o.method = "oracle_topp";
  o.params = {{"p", "2"}};
  EXPECT_THROW(Session(*weights_, o), Error);
}

// A Session builds its methods from the registry it is given (SessionOptions::registry): a
// user's own decode method, registered beside the built-ins, runs in every layer of every
// decode step, restart_decode finds it too, and a session on the built-in registry does not.
TEST_F(Stories260K, UserRegistryRunsACustomDecodeMethod) {
  // Dense attention under another name, counting its decode calls.
  class CountingDense : public DecodeMethod {
   public:
    CountingDense(const Shape& shape, int* calls) : dense_(Registry::builtin().make("dense", shape)), calls_(calls) {}
    std::string name() const override { return "counting_dense"; }
    void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
      ++*calls_;
      dense_->decode(layer, q, kv, ctx, out);
    }

   private:
    std::unique_ptr<DecodeMethod> dense_;
    int* calls_;
  };
  int calls = 0;
  Registry registry = Registry::builtin();
  registry.add({.name = "counting_dense",
                .kind = MethodKind::decode,
                .paper = "test",
                .summary = "dense, counting its calls",
                .params = {},
                .make_decode = [&calls](const Shape& shape, const Params&) -> std::unique_ptr<DecodeMethod> {
                  return std::make_unique<CountingDense>(shape, &calls);
                }});
  SessionOptions custom;
  custom.registry = &registry;
  custom.method = "counting_dense";
  const int steps = 40;
  const Generated got = generate(*weights_, *tok_, custom, steps);
  const Generated want = generate(*weights_, *tok_, {}, steps);
  EXPECT_EQ(got.ids, want.ids);
  EXPECT_EQ(got.last_logits, want.last_logits);
  // generate decodes every token it keeps but the last of a full run.
  const int decoded = static_cast<int>(got.ids.size()) - (got.ids.size() == static_cast<size_t>(steps) ? 1 : 0);
  EXPECT_EQ(calls, decoded * weights_->config.n_layers);

  SessionOptions builtin;
  Session s(*weights_, builtin);
  s.prefill(std::vector<int32_t>{tok_->bos_id()});
  EXPECT_THROW(s.restart_decode("counting_dense"), Error);
  builtin.method = "counting_dense";
  EXPECT_THROW(Session(*weights_, builtin), Error);

  Session r(*weights_, custom);
  r.prefill(std::vector<int32_t>{tok_->bos_id()});
  r.restart_decode("dense");
  r.restart_decode("counting_dense");
  calls = 0;
  r.decode(want.ids[0]);
  EXPECT_EQ(calls, weights_->config.n_layers);
}

// build_indexes builds the method's indexes once the prompt is in, where `cumulus generate`
// times it: each layer's on_prefill runs exactly once (not again at the first decode), and
// decoding after it gives bit for bit what decoding with the lazy build gives.
TEST_F(Stories260K, BuildIndexesRunsOnPrefillOnceAndMatchesTheLazyBuild) {
  class CountingPrefill : public DecodeMethod {
   public:
    CountingPrefill(const Shape& shape, int* builds) : dense_(Registry::builtin().make("dense", shape)), builds_(builds) {}
    std::string name() const override { return "counting_prefill"; }
    void on_prefill(int, const KvCache&, const DecodeContext&) override { ++*builds_; }
    void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
      dense_->decode(layer, q, kv, ctx, out);
    }

   private:
    std::unique_ptr<DecodeMethod> dense_;
    int* builds_;
  };
  int builds = 0;
  Registry registry = Registry::builtin();
  registry.add({.name = "counting_prefill",
                .kind = MethodKind::decode,
                .paper = "test",
                .summary = "dense, counting its on_prefill calls",
                .params = {},
                .make_decode = [&builds](const Shape& shape, const Params&) -> std::unique_ptr<DecodeMethod> {
                  return std::make_unique<CountingPrefill>(shape, &builds);
                }});
  const std::vector<int32_t> prompt = tok_->encode("Once upon a time, there was a little girl named Lily.", true);
  SessionOptions counting;
  counting.registry = &registry;
  counting.method = "counting_prefill";
  Session c(*weights_, counting);
  EXPECT_THROW(c.build_indexes(), Error);  // nothing prefilled
  c.prefill(prompt);
  EXPECT_EQ(builds, 0);
  c.build_indexes();
  EXPECT_EQ(builds, weights_->config.n_layers);
  c.build_indexes();  // idempotent
  c.decode(tok_->bos_id());
  EXPECT_EQ(builds, weights_->config.n_layers);
  EXPECT_THROW(c.prefill(prompt), Error);  // the prompt is closed once the indexes are built
  c.restart_decode("counting_prefill");
  c.decode(tok_->bos_id());  // the new method builds lazily
  EXPECT_EQ(builds, 2 * weights_->config.n_layers);

  for (const auto& [m, params] : std::vector<std::pair<std::string, std::map<std::string, std::string>>>{
           {"tactic", {{"p", "0.7"}, {"cluster_size", "4"}}}, {"lfps", {{"s", "8"}}}}) {
    SessionOptions o;
    o.method = m;
    o.params = params;
    Session eager(*weights_, o), lazy(*weights_, o);
    std::vector<float> le = eager.prefill(prompt), ll = lazy.prefill(prompt);
    eager.build_indexes();
    Sampler greedy({});
    for (int i = 0; i < 20; ++i) {
      const int32_t next = greedy.sample(le);
      ASSERT_EQ(next, greedy.sample(ll)) << m << " step " << i;
      le = eager.decode(next);
      ll = lazy.decode(next);
      ASSERT_EQ(le, ll) << m << " step " << i;
    }
  }
}

// restart_decode lets several methods continue one prefill (the eval harness): each
// restarted run decodes exactly what a fresh session with that method decodes, whatever
// ran before it (including lfps, which needs the prompt's last queries kept).
// prefill_from copies another session's prompt: every method then decodes bit for bit as
// after its own prefill (the methods `cumulus generate` runs side by side share one prefill).
TEST_F(Stories260K, PrefillFromEqualsItsOwnPrefill) {
  const std::vector<int32_t> prompt = tok_->encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she "
      "saw a big red ball in the park.",
      true);
  const std::vector<std::pair<std::string, std::map<std::string, std::string>>> methods = {
      {"dense", {}}, {"tactic", {{"p", "0.7"}, {"cluster_size", "4"}}}, {"lfps", {{"s", "8"}}}, {"quest", {}}};
  auto greedy_steps = [](Session& s, std::vector<float> logits) {
    Sampler greedy({});
    std::vector<float> all;
    for (int i = 0; i < 16; ++i) {
      logits = s.decode(greedy.sample(logits));
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  };
  SessionOptions source_opt;
  source_opt.keep_prompt_queries = 8;
  Session source(*weights_, source_opt);
  const std::vector<float> prompt_logits = source.prefill(prompt);
  source.build_indexes();
  for (const auto& [m, params] : methods) {
    SessionOptions o;
    o.method = m;
    o.params = params;
    Session own(*weights_, o), copied(*weights_, o);
    const std::vector<float> want_logits = own.prefill(prompt);
    const std::vector<float> got_logits = copied.prefill_from(source);
    EXPECT_EQ(got_logits, want_logits) << m;
    EXPECT_EQ(got_logits, prompt_logits) << m;
    EXPECT_EQ(copied.position(), static_cast<int>(prompt.size())) << m;
    EXPECT_EQ(copied.prompt_tokens(), prompt) << m;
    EXPECT_EQ(greedy_steps(copied, got_logits), greedy_steps(own, want_logits)) << m;
  }
  // Refused before anything changes: a used session, a source without a prompt or with too
  // few kept queries, another prefill method.
  Session used(*weights_, {});
  used.prefill(prompt);
  EXPECT_THROW(used.prefill_from(source), Error);
  Session empty(*weights_, {}), target(*weights_, {});
  EXPECT_THROW(target.prefill_from(empty), Error);
  Session few(*weights_, {});
  few.prefill(prompt);
  SessionOptions lfps;
  lfps.method = "lfps";
  lfps.params = {{"s", "8"}};
  Session needs_queries(*weights_, lfps);
  check::expect_error([&] { needs_queries.prefill_from(few); }, "needs the prompt's last 8 queries");
  EXPECT_EQ(needs_queries.position(), 0);
  SessionOptions flex;
  flex.prefill_method = "flexprefill";
  Session other_prefill(*weights_, flex);
  check::expect_error([&] { other_prefill.prefill_from(source); }, "prefilled by dense");
}

TEST_F(Stories260K, RestartDecodeEqualsAFreshSession) {
  const std::vector<int32_t> prompt = tok_->encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she "
      "saw a big red ball in the park.",
      true);
  const std::vector<std::pair<std::string, std::map<std::string, std::string>>> methods = {
      {"dense", {}}, {"tactic", {{"p", "0.7"}, {"cluster_size", "4"}}}, {"lfps", {{"s", "8"}}}, {"quest", {}}};
  auto continue_greedy = [](Session& s, const std::vector<float>& first_logits) {
    Sampler greedy({});
    std::vector<int32_t> ids;
    std::vector<float> logits = first_logits;
    for (int i = 0; i < 20; ++i) {
      ids.push_back(greedy.sample(logits));
      logits = s.decode(ids.back());
    }
    return std::make_pair(ids, logits);
  };
  SessionOptions shared_opt;
  shared_opt.keep_prompt_queries = 8;
  Session shared(*weights_, shared_opt);
  const std::vector<float> prompt_logits = shared.prefill(prompt);
  for (int round = 0; round < 2; ++round) {
    for (const auto& [m, params] : methods) {
      SessionOptions o;
      o.method = m;
      o.params = params;
      Session fresh(*weights_, o);
      const auto want = continue_greedy(fresh, fresh.prefill(prompt));
      shared.restart_decode(m, params);
      EXPECT_EQ(shared.position(), static_cast<int>(prompt.size()));
      const auto got = continue_greedy(shared, prompt_logits);
      EXPECT_EQ(got.first, want.first) << m << " round " << round;
      EXPECT_EQ(got.second, want.second) << m << " round " << round;
      EXPECT_EQ(shared.summary().layer_steps, fresh.summary().layer_steps);
    }
  }
  Session none(*weights_, {});
  EXPECT_THROW(none.restart_decode("dense"), Error);  // nothing prefilled
  Session few(*weights_, {});
  few.prefill(prompt);
  EXPECT_THROW(few.restart_decode("lfps", {{"s", "8"}}), Error);  // kept no prompt queries
  EXPECT_THROW(shared.restart_decode("no_such_method"), Error);
}
