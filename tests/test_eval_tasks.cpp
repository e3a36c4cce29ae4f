// End-to-end smoke runs of every `cumulus eval` task on stories260K (a real trained model,
// 512-token context) and Pride and Prejudice, small enough for CI: the KL and perplexity of
// the harness equal an independent re-computation from plain Sessions (long double), dense
// is its own reference (KL 0, all K/V read), methods keep their promises inside the
// harness (P = 1 equals dense, certified PSA and oracle top-p reach P on every head-step),
// budget matching hits its target for StreamingLLM exactly, and the NIAH grid has every cell.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cumulus/core/error.h"
#include "cumulus/eval/niah.h"
#include "cumulus/eval/report.h"
#include "cumulus/eval/tasks.h"
#include "cumulus/model/session.h"
#include "fixtures.h"

using namespace cumulus;
namespace fs = std::filesystem;

namespace {

const fs::path kModel = fs::path(CUMULUS_SHARED_DIR) / "data/models/stories260K/stories260K.bin";
const fs::path kText = fs::path(CUMULUS_SHARED_DIR) / "data/text/pg1342_pride_and_prejudice.txt";

class EvalTasks : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (fs::exists(kModel) && fs::exists(kText)) model_ = new LoadedModel(model_load(kModel.string()));
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  void SetUp() override {
    if (!model_) CUMULUS_FIXTURE_MISSING("no " << kModel << " or " << kText << " (../shared missing)");
  }
  static EvalOptions options(const std::string& task) {
    EvalOptions o;
    o.task = task;
    o.text = kText.string();
    o.threads = 2;
    return o;
  }
  static LoadedModel* model_;
};
LoadedModel* EvalTasks::model_ = nullptr;

// Logits of each decode step of `method` after prefilling x[0, prompt), feeding x[prompt, end).
std::vector<std::vector<float>> plain_run(const ModelWeights& w, const std::vector<int32_t>& x, int prompt, int end,
                                          const std::string& method, const std::map<std::string, std::string>& params) {
  SessionOptions so;
  so.method = method;
  so.params = params;
  Session s(w, so);
  s.prefill(std::span<const int32_t>(x).first(prompt));
  std::vector<std::vector<float>> out;
  for (int i = prompt; i < end; ++i) out.push_back(s.decode(x[i]));
  return out;
}

long double log_softmax_at(const std::vector<float>& l, size_t i) {
  long double z = 0;
  for (float v : l) z += std::exp(static_cast<long double>(v));
  return static_cast<long double>(l[i]) - std::log(z);
}

}  // namespace

TEST_F(EvalTasks, KlAndPerplexityEqualAnIndependentComputation) {
  EvalOptions o = options("kl");
  o.context = 160;
  o.steps = 8;
  o.methods = {"dense", "streaming", "tactic"};
  o.params = {"streaming.window=20", "tactic.p=1"};
  const EvalReport rep = eval_run(*model_, o);
  const ContinuationReport& c = rep.continuation;
  EXPECT_EQ(c.prompt_tokens, 152);
  ASSERT_EQ(c.runs.size(), 3u);
  const RunStats& dense = c.runs[0];
  const RunStats& streaming = c.runs[1];
  const RunStats& tactic = c.runs[2];
  EXPECT_EQ(dense.spec.method, "dense");
  ASSERT_EQ(dense.kl.size(), 8u);
  for (double k : dense.kl) EXPECT_EQ(k, 0.0);
  EXPECT_DOUBLE_EQ(dense.kv_fraction, 1.0);
  EXPECT_DOUBLE_EQ(dense.tokens_mean, 152 + 4.5);  // cache holds 153..160 tokens over the steps
  EXPECT_NEAR(dense.mass_true_mean, 1.0, 1e-6);
  EXPECT_DOUBLE_EQ(streaming.tokens_mean, 4 + 20);  // sinks + window
  EXPECT_LT(tactic.kl_summary.max, 1e-6);           // P = 1 equals dense
  // Per layer: every layer has as many head-steps, so the layers' mean is the overall mean.
  ASSERT_EQ(tactic.layer_mass_true.size(), 5u);
  double layer_sum = 0;
  for (double m : tactic.layer_mass_true) layer_sum += m;
  EXPECT_NEAR(layer_sum / 5, tactic.mass_true_mean, 1e-12);
  for (double r : tactic.layer_reached) EXPECT_EQ(r, 1.0);  // P = 1: the whole cache
  EXPECT_TRUE(std::isnan(streaming.layer_reached[0]));      // no target

  // Independent: plain sessions (no eval mode, no restart), long-double softmax.
  const std::vector<int32_t> x = eval_text_tokens(*model_->tokenizer, kText.string(), 161);
  const auto ref_dense = plain_run(model_->weights, x, 152, 160, "dense", {});
  const auto ref_stream = plain_run(model_->weights, x, 152, 160, "streaming", {{"window", "20"}});
  long double nll_sum = 0;
  for (int i = 0; i < 8; ++i) {
    const long double nll = -log_softmax_at(ref_dense[i], static_cast<size_t>(x[153 + i]));
    nll_sum += nll;
    EXPECT_NEAR(dense.nll[i], static_cast<double>(nll), 1e-6) << "step " << i;
    long double kl = 0;
    for (size_t v = 0; v < ref_dense[i].size(); ++v) {
      const long double lp = log_softmax_at(ref_dense[i], v), lq = log_softmax_at(ref_stream[i], v);
      kl += std::exp(lp) * (lp - lq);
    }
    EXPECT_NEAR(streaming.kl[i], static_cast<double>(kl), 1e-7 + 1e-5 * static_cast<double>(kl)) << "step " << i;
  }
  EXPECT_NEAR(dense.ppl, static_cast<double>(std::exp(nll_sum / 8)), 1e-6 * dense.ppl);
  EXPECT_GT(streaming.kl_summary.mean, 0.0);
  EXPECT_LT(streaming.kv_fraction, 0.5);
}

// With a sparse prefill, the reference is all-dense (dense prefill + dense decode), and the
// dense-decode run after the sparse prefill differs from it by what the prefill costs:
// checked against plain sessions, one with each prefill method.
TEST_F(EvalTasks, SparsePrefillKlIsAgainstAllDense) {
  EvalOptions o = options("kl");
  o.context = 400;
  o.steps = 4;
  o.methods = {"dense"};
  o.prefill_method = "flexprefill";
  o.prefill_params = {{"block_size", "32"}, {"gamma", "0.5"}, {"min_budget", "32"}};
  const EvalReport rep = eval_run(*model_, o);
  const ContinuationReport& c = rep.continuation;
  ASSERT_EQ(c.runs.size(), 2u);
  EXPECT_EQ(c.runs[0].name, "dense prefill + dense");
  EXPECT_EQ(c.runs[1].name, "flexprefill prefill + dense");
  for (double k : c.runs[0].kl) EXPECT_EQ(k, 0.0);
  EXPECT_FALSE(std::isnan(c.reference_prefill_s));
  EXPECT_GT(c.prefill_stats.blocks_causal, 0);
  EXPECT_LT(c.prefill_stats.block_share(), 1.0);  // gamma 0.5 drops blocks

  const std::vector<int32_t> x = eval_text_tokens(*model_->tokenizer, kText.string(), 401);
  const auto ref_dense = plain_run(model_->weights, x, 396, 400, "dense", {});
  SessionOptions so;
  so.prefill_method = "flexprefill";
  so.prefill_params = o.prefill_params;
  Session s(model_->weights, so);
  s.prefill(std::span<const int32_t>(x).first(396));
  double kl_sum = 0;
  for (int i = 0; i < 4; ++i) {
    const std::vector<float>& l = s.decode(x[396 + i]);
    long double kl = 0;
    for (size_t v = 0; v < l.size(); ++v) {
      const long double lp = log_softmax_at(ref_dense[i], v), lq = log_softmax_at(l, v);
      kl += std::exp(lp) * (lp - lq);
    }
    EXPECT_NEAR(c.runs[1].kl[i], static_cast<double>(kl), 1e-7 + 1e-5 * static_cast<double>(kl)) << "step " << i;
    kl_sum += static_cast<double>(kl);
  }
  EXPECT_GT(kl_sum, 0.0);  // the sparse prefill changed the model's outputs
}

TEST_F(EvalTasks, MassTableKeepsThePromises) {
  EvalOptions o = options("mass");
  o.context = 256;
  o.steps = 4;
  o.targets = {0.5, 0.9};
  const EvalReport rep = eval_run(*model_, o);
  ASSERT_EQ(rep.mass.size(), 2u * 8u);
  const std::vector<std::string> names = {"Optimal",         "Cluster Optimal",      "Tactic",
                                          "PSA (mean)",      "PSA (bound)",          "PSA (certified)",
                                          "LFPS @ Tactic budget", "Quest @ Tactic budget"};
  for (size_t t = 0; t < 2; ++t) {
    const double p = o.targets[t];
    double tactic_tokens = -1;
    for (size_t i = 0; i < names.size(); ++i) {
      const MassRow& row = rep.mass[t * names.size() + i];
      SCOPED_TRACE(names[i] + " at P=" + std::to_string(p));
      EXPECT_EQ(row.run.name, names[i]);
      EXPECT_EQ(row.target, p);
      EXPECT_EQ(row.run.steps, 4);
      EXPECT_GT(row.run.tokens_mean, 0.0);
      if (i < 6) {
        EXPECT_EQ(row.run.target, p);
      }
      if (names[i] == "Tactic") tactic_tokens = row.run.tokens_mean;
      // Oracle top-p and certified PSA reach P on every head-step (the GQA union only adds mass).
      if (names[i] == "Optimal" || names[i] == "PSA (certified)") {
        EXPECT_EQ(row.run.reached, 1.0);
        EXPECT_GE(row.run.mass_true_min, p - 1e-6);
      }
      if (i >= 6) {
        EXPECT_EQ(row.run.match_target, tactic_tokens);
        EXPECT_GE(row.run.match_runs, 1);
      }
    }
  }
  EXPECT_EQ(rep.continuation.runs.size(), 1u);  // the dense reference
}

TEST_F(EvalTasks, MatchedGivesTheBaselinesTheAdaptiveBudget) {
  EvalOptions o = options("matched");
  o.context = 256;
  o.steps = 4;
  o.matched_niah = true;
  o.lengths = {200};
  o.depths = {0.5};
  const EvalReport rep = eval_run(*model_, o);
  ASSERT_EQ(rep.matched.size(), 1u);
  const MatchedGroup& g = rep.matched[0];
  EXPECT_EQ(g.adaptive.spec.method, "tactic");
  ASSERT_EQ(g.baselines.size(), 4u);
  for (const RunStats& b : g.baselines) {
    EXPECT_EQ(b.match_target, g.adaptive.tokens_mean);
    EXPECT_EQ(b.kl.size(), 4u);
  }
  // The budget found is the parameter the baseline ran with: streaming attends its 4 sinks
  // plus the window it was given (the cache, 252-256 tokens, is larger).
  const RunStats& streaming = g.baselines[1];
  ASSERT_EQ(streaming.spec.method, "streaming");
  EXPECT_LT(4 + streaming.match_budget, 252);
  EXPECT_DOUBLE_EQ(streaming.tokens_mean, 4.0 + std::stoi(streaming.resolved.at("window")));
  EXPECT_EQ(std::stoi(streaming.resolved.at("window")), streaming.match_budget);
  // streaming attends exactly sinks + window: matching is exact to rounding.
  EXPECT_NEAR(g.baselines[1].tokens_mean, g.adaptive.tokens_mean, 0.5);
  ASSERT_EQ(rep.niah.size(), 1u);
  ASSERT_EQ(rep.niah[0].runs.size(), 1u + 1u + 4u);  // dense, tactic, its 4 baselines
  EXPECT_EQ(rep.niah[0].runs[2].match_target, rep.niah[0].runs[1].tokens_mean);
}

TEST_F(EvalTasks, NiahGridHasEveryCell) {
  EvalOptions o = options("niah");
  o.methods = {"dense", "tactic", "psa"};
  o.lengths = {160, 256};
  o.depths = {0, 0.5, 1};
  o.answer_tokens = 8;
  const EvalReport rep = eval_run(*model_, o);
  EXPECT_EQ(rep.niah_template, "plain");  // tok512 has no ChatML
  ASSERT_EQ(rep.niah.size(), 6u);
  for (const NiahCell& c : rep.niah) {
    EXPECT_EQ(c.prompt_tokens, c.length - 8);
    ASSERT_EQ(c.runs.size(), 3u);
    EXPECT_EQ(c.runs[0].spec.method, "dense");
    for (const RunStats& r : c.runs) {
      EXPECT_GE(r.steps, 1);
      EXPECT_LE(r.steps, 8);
      EXPECT_EQ(r.correct, niah_answer_correct(r.answer, c.number));
    }
  }
  EXPECT_EQ(rep.niah[0].depth_achieved, 0.0);
  EXPECT_EQ(rep.niah[2].depth_achieved, 1.0);
}

TEST_F(EvalTasks, BadOptionsAreErrors) {
  EvalOptions o = options("kl");
  o.context = 600;  // stories260K holds 512
  EXPECT_THROW(eval_run(*model_, o), Error);
  o = options("niah");
  o.lengths = {1024};
  EXPECT_THROW(eval_run(*model_, o), Error);
  o = options("bogus");
  EXPECT_THROW(eval_run(*model_, o), Error);
  o = options("kl");
  o.text = "/nonexistent.txt";
  o.context = 64;
  o.steps = 4;
  EXPECT_THROW(eval_run(*model_, o), Error);
  o = options("matched");
  o.baselines = {"tactic"};  // no budget to match
  EXPECT_THROW(eval_run(*model_, o), Error);
  o = options("mass");
  o.methods = {"tactic"};  // mass runs its fixed variants
  EXPECT_THROW(eval_run(*model_, o), Error);
  o = options("kl");
  o.context = 64;
  o.steps = 4;
  o.prefill_method = "nosuch";
  EXPECT_THROW(eval_run(*model_, o), Error);
}

// --weights f32 loads dequantised weights and every report says which storage it used.
TEST_F(EvalTasks, WeightStorageIsReported) {
  const LoadedModel f32 = model_load(kModel.string(), "", WeightStorage::f32);
  EvalOptions o = options("kl");
  o.context = 64;
  o.steps = 2;
  o.methods = {"dense"};
  const EvalReport a = eval_run(*model_, o);
  const EvalReport b = eval_run(f32, o);
  EXPECT_EQ(a.weights, "compact");
  EXPECT_EQ(b.weights, "f32");
  EXPECT_NE(eval_markdown(b).find("weights f32"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(eval_json(b))["model"]["weights"], "f32");
}

