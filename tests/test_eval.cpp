// The evaluation harness's parts, without a model run:
//   - metrics (KL, NLL, perplexity, quantiles) against independent long-double computations
//     and hand-computed values;
//   - method specs (--method/--param/--sweep text);
//   - needle insertion (length exact, number exactly once, depth at a sentence boundary)
//     with the real SmolLM2 and stories260K tokenizers;
//   - the report writers: JSON parses, Markdown tables are rectangular, SVGs are well-formed
//     XML (checked by a small parser written here, not by the writer) with the elements
//     a reader expects.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include "cumulus/core/error.h"
#include "cumulus/eval/method_spec.h"
#include "cumulus/eval/metrics.h"
#include "cumulus/eval/niah.h"
#include "cumulus/eval/progress.h"
#include "cumulus/eval/report.h"
#include "cumulus/eval/svg.h"
#include "cumulus/eval/tasks.h"
#include "cumulus/model/text.h"
#include "cumulus/model/tokenizer.h"
#include "fixtures.h"
#include "kernel_check.h"

using namespace cumulus;
namespace fs = std::filesystem;

namespace {

fs::path shared_dir() { return fs::path(CUMULUS_SHARED_DIR); }
fs::path smollm2_json() { return shared_dir() / "data/models/smollm2-135m-instruct-meta/tokenizer.json"; }
fs::path tok512() { return shared_dir() / "data/models/stories260K/tok512.bin"; }
fs::path pride() { return shared_dir() / "data/text/pg1342_pride_and_prejudice.txt"; }

std::vector<float> random_logits(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Independent references: plain softmax in long double, no max shift (|logits| stay small).
std::vector<long double> softmax_ld(const std::vector<float>& x) {
  long double z = 0;
  for (float v : x) z += std::exp(static_cast<long double>(v));
  std::vector<long double> p(x.size());
  for (size_t i = 0; i < x.size(); ++i) p[i] = std::exp(static_cast<long double>(x[i])) / z;
  return p;
}

long double kl_ld(const std::vector<float>& a, const std::vector<float>& b) {
  const auto p = softmax_ld(a), q = softmax_ld(b);
  long double kl = 0;
  for (size_t i = 0; i < p.size(); ++i) kl += p[i] * std::log(p[i] / q[i]);
  return kl;
}

}  // namespace

// ---------------------------------------------------------------------------- metrics

TEST(EvalMetrics, KlMatchesLongDoubleOnRandomLogits) {
  std::mt19937_64 rng(7);
  for (size_t n : {1u, 3u, 17u, 255u, 4097u}) {
    for (float scale : {0.5f, 3.0f}) {
      const auto a = random_logits(rng, n, scale), b = random_logits(rng, n, scale);
      const double ref = static_cast<double>(kl_ld(a, b));
      EXPECT_NEAR(kl_divergence(a, b), ref, 1e-10 + 1e-9 * ref) << "n=" << n;
      const auto lp = log_softmax(a);
      EXPECT_NEAR(kl_divergence(std::span<const double>(lp), b), ref, 1e-10 + 1e-9 * ref);
      if (n > 1) {
        EXPECT_GT(kl_divergence(a, b), 0.0);
      }
    }
  }
}

TEST(EvalMetrics, KlHandComputedAndInvariances) {
  // P = (1/4, 3/4), Q = (1/2, 1/2): KL = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.130812035941...
  const std::vector<float> p = {0.0f, static_cast<float>(std::log(3.0))}, q = {1.5f, 1.5f};
  EXPECT_NEAR(kl_divergence(p, q), 0.25 * std::log(0.5) + 0.75 * std::log(1.5), 1e-7);
  EXPECT_NEAR(kl_divergence(p, q), 0.1308120359, 1e-7);
  std::mt19937_64 rng(3);
  auto a = random_logits(rng, 300, 2.0f);
  auto shifted = a;
  for (auto& x : shifted) x += 40.0f;  // softmax is shift-invariant; the max shift keeps it exact
  EXPECT_NEAR(kl_divergence(a, shifted), 0.0, 1e-9);
  EXPECT_EQ(kl_divergence(a, a), 0.0);
  EXPECT_THROW(kl_divergence(a, std::vector<float>(299, 0.0f)), Error);
  a[5] = NAN;
  EXPECT_THROW(kl_divergence(a, shifted), Error);
}

TEST(EvalMetrics, NllAndPerplexity) {
  // Uniform over V: NLL = ln V, perplexity = V.
  const std::vector<float> uniform(50, 0.25f);
  EXPECT_NEAR(negative_log_likelihood(uniform, 17), std::log(50.0), 1e-12);
  const std::vector<double> nll(9, std::log(50.0));
  EXPECT_NEAR(perplexity(nll), 50.0, 1e-9);
  std::mt19937_64 rng(11);
  std::vector<double> nlls;
  long double sum = 0;
  for (int t = 0; t < 20; ++t) {
    const auto x = random_logits(rng, 1000, 2.5f);
    const int32_t tok = static_cast<int32_t>(rng() % 1000);
    const long double ref = -std::log(softmax_ld(x)[tok]);
    nlls.push_back(negative_log_likelihood(x, tok));
    EXPECT_NEAR(nlls.back(), static_cast<double>(ref), 1e-9);
    sum += ref;
  }
  EXPECT_NEAR(perplexity(nlls), static_cast<double>(std::exp(sum / 20)), 1e-8);
  EXPECT_THROW(negative_log_likelihood(uniform, 50), Error);
  EXPECT_THROW(perplexity(std::vector<double>{}), Error);
}

TEST(EvalMetrics, QuantilesLinearInterpolation) {
  // Values numpy.quantile gives (method "linear"), worked by hand: position q (n - 1).
  const std::vector<double> four = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(quantile(four, 0.5), 2.5);
  EXPECT_DOUBLE_EQ(quantile(four, 0.95), 3.85);
  EXPECT_DOUBLE_EQ(quantile(four, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(quantile(four, 1.0), 4.0);
  std::vector<double> hundred;
  for (int i = 100; i >= 1; --i) hundred.push_back(i);
  EXPECT_NEAR(quantile(hundred, 0.95), 95.05, 1e-12);
  EXPECT_DOUBLE_EQ(quantile(std::vector<double>{7}, 0.95), 7.0);
  const Summary s = summarize(four);
  EXPECT_EQ(s.count, 4);
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.median, 2.5);
  EXPECT_DOUBLE_EQ(s.p95, 3.85);
  EXPECT_DOUBLE_EQ(s.min, 1.0);
  EXPECT_DOUBLE_EQ(s.max, 4.0);
  EXPECT_THROW(quantile(std::vector<double>{}, 0.5), Error);
  EXPECT_THROW(quantile(four, 1.5), Error);
  EXPECT_THROW(quantile(std::vector<double>{1, NAN}, 0.5), Error);
}

// ---------------------------------------------------------------------------- method specs

TEST(EvalMethodSpec, EntriesParamsAndSweeps) {
  const auto specs = method_specs_parse({"dense", "tactic", "psa_bound=psa", "psa"},
                                        {"p=0.8", "psa.threshold=0.9", "psa_bound.criticality=bound"},
                                        {"tactic.cluster_size=8,32"});
  ASSERT_EQ(specs.size(), 5u);
  EXPECT_EQ(specs[0].label, "dense");
  EXPECT_TRUE(specs[0].params.empty());
  EXPECT_EQ(specs[1].label, "tactic cluster_size=8");
  EXPECT_EQ(specs[1].curve, "tactic");
  EXPECT_EQ(specs[1].params.at("p"), "0.8");  // unqualified: every method declaring p
  EXPECT_EQ(specs[2].params.at("cluster_size"), "32");
  EXPECT_EQ(specs[3].label, "psa_bound");
  EXPECT_EQ(specs[3].method, "psa");
  EXPECT_EQ(specs[3].params.at("threshold"), "0.9");  // by method name
  EXPECT_EQ(specs[3].params.at("criticality"), "bound");  // by label
  EXPECT_EQ(specs[4].params.count("criticality"), 0u);
  EXPECT_EQ(specs[4].params.at("threshold"), "0.9");
  // Two sweeps on one entry: every combination.
  EXPECT_EQ(method_specs_parse({"tactic"}, {}, {"p=0.5,0.9", "tactic.cluster_size=8,16,32"}).size(), 6u);
}

TEST(EvalMethodSpec, Errors) {
  EXPECT_THROW(method_specs_parse({"nosuch"}), Error);
  EXPECT_THROW(method_specs_parse({}), Error);
  EXPECT_THROW(method_specs_parse({"tactic", "tactic"}), Error);          // duplicate label
  EXPECT_THROW(method_specs_parse({"dense"}, {"p=0.5"}), Error);           // nobody declares p
  EXPECT_THROW(method_specs_parse({"tactic"}, {"psa.threshold=0.5"}), Error);  // not selected
  EXPECT_THROW(method_specs_parse({"tactic"}, {"tactic.nosuch=1"}), Error);
  EXPECT_THROW(method_specs_parse({"tactic"}, {"tactic.p=2"}), Error);     // out of range
  EXPECT_THROW(method_specs_parse({"tactic"}, {}, {"p=0.5,,0.7"}), Error);
  EXPECT_THROW(method_specs_parse({"tactic"}, {"p"}), Error);
  EXPECT_THROW(method_specs_parse({"a.b=tactic"}), Error);
}

// Each variant is checked as its method's constructor checks it, when it is parsed: a value
// in its range that breaks a relation, a choice no method has, and a value outside a
// half-open range.
TEST(EvalMethodSpec, RelationsAndChoicesAreCheckedWhenParsed) {
  check::expect_error([] { method_specs_parse({"dense", "tactic"}, {"tactic.p1=0.9"}); },
                      "method 'tactic': parameters p1=0.9 and p2=0.6 need p1 < p2");
  check::expect_error([] { method_specs_parse({"tactic"}, {}, {"tactic.p1=0.5,0.7"}); }, "p1=0.7 and p2=0.6");
  check::expect_error([] { method_specs_parse({"sketch_topp"}, {"rest=foo"}); },
                      "method 'sketch_topp': parameter rest='foo' must be none or mean");
  check::expect_error([] { method_specs_parse({"psa"}, {"stop=sure"}); }, "stop='sure' must be estimate or certified");
  check::expect_error([] { method_specs_parse({"lfps"}, {"r=1"}); }, "method 'lfps': parameter r=1 must be in [0, 1)");
  EXPECT_NO_THROW(method_specs_parse({"lfps"}, {"r=0.999"}));
  EXPECT_NO_THROW(method_specs_parse({"tactic"}, {"p1=0.5", "p2=0.7"}));
  // The prefill method's relations too, and the model's shape where a check needs it.
  check::expect_error([] { prefill_spec_check("flexprefill", {{"min_budget", "2048"}, {"max_budget", "64"}}); },
                      "max_budget=64 is below min_budget=2048");
  EXPECT_NO_THROW(prefill_spec_check("flexprefill", {{"min_budget", "64"}, {"max_budget", "2048"}}));
  const std::vector<MethodSpec> quest = method_specs_parse({"quest"}, {"dense_layers=6"});
  check::expect_error([&] { method_specs_check(quest, Shape{5, 8, 4, 64}); },
                      "method 'quest': parameter dense_layers=6 exceeds the model's 5 layers");
  EXPECT_NO_THROW(method_specs_check(quest, Shape{6, 8, 4, 64}));
}

// eval's options carry the prefill method: validate() refuses a broken relation between its
// parameters, before the model is read.
TEST(EvalMethodSpec, EvalOptionsRefuseAPrefillRelation) {
  EvalOptions o;
  o.task = "kl";
  o.text = "unused.txt";
  o.methods = {"tactic"};
  o.prefill_method = "flexprefill";
  o.prefill_params = {{"min_budget", "2048"}, {"max_budget", "64"}};
  check::expect_error([&] { o.validate(); }, "max_budget=64 is below min_budget=2048");
  o.prefill_params = {};
  o.params = {"tactic.p2=0.05"};
  check::expect_error([&] { o.validate(); }, "p1=0.1 and p2=0.05 need p1 < p2");
}

TEST(EvalBudget, ParamOfEachFixedBudgetMethod) {
  EXPECT_EQ(budget_param("quest"), "budget");
  EXPECT_EQ(budget_param("lfps"), "budget");
  EXPECT_EQ(budget_param("oracle_topk"), "k");
  EXPECT_EQ(budget_param("streaming"), "window");
  EXPECT_THROW(budget_param("tactic"), Error);
  EXPECT_THROW(budget_param("nosuch"), Error);
}

// ---------------------------------------------------------------------------- text and needles

class EvalText : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(smollm2_json()) || !fs::exists(tok512()) || !fs::exists(pride()))
      CUMULUS_FIXTURE_MISSING("no " << shared_dir() << " (../shared missing)");
    bpe_ = tokenizer_from_hf_json(smollm2_json().string(), 1, 2);
    spm_ = tokenizer_from_llama2c(tok512().string(), 512);
  }
  std::unique_ptr<Tokenizer> bpe_, spm_;
};

TEST_F(EvalText, PrefixTokensEqualTheWholeTextsTokens) {
  // A 60,000-character file: eval_text_tokens tokenises growing prefixes of it.
  const std::string text = text_strip_gutenberg(text_read_file(pride().string())).substr(0, 60000);
  const fs::path tmp = fs::temp_directory_path() / "cumulus_test_eval_text.txt";
  std::ofstream(tmp, std::ios::binary) << text;
  for (const Tokenizer* tok : {bpe_.get(), spm_.get()}) {
    const std::vector<int32_t> whole = tok->encode(text, tok->add_bos_default());
    for (int64_t n : {1, 100, 3000}) {
      const std::vector<int32_t> got = eval_text_tokens(*tok, tmp.string(), n);
      ASSERT_EQ(got.size(), static_cast<size_t>(n));
      EXPECT_TRUE(std::equal(got.begin(), got.end(), whole.begin())) << "n=" << n;
    }
    EXPECT_THROW(eval_text_tokens(*tok, tmp.string(), static_cast<int64_t>(whole.size()) + 1), Error);
  }
  fs::remove(tmp);
}

TEST_F(EvalText, NeedleInsertion) {
  int boundaries = 0, inner = 0;
  for (const Tokenizer* tok : {bpe_.get(), spm_.get()}) {
    const std::vector<int32_t> hay = eval_text_tokens(*tok, pride().string(), 2100);
    const std::vector<int32_t> hay_nobos(hay.begin() + (tok->add_bos_default() ? 1 : 0), hay.end());
    const NiahTemplate style = niah_template_parse("auto", *tok);
    EXPECT_EQ(style, tok == bpe_.get() ? NiahTemplate::chat : NiahTemplate::plain);
    for (int length : {300, 1024, 2048}) {
      int last_insert = -1;
      for (double depth : {0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0}) {
        NiahPromptOptions o{length, depth, 16, style, 5, 0};
        const NiahPrompt p = niah_prompt_build(*tok, hay_nobos, o);
        SCOPED_TRACE(testing::Message() << "length " << length << " depth " << depth);
        // The prompt plus the answer budget is exactly the length.
        EXPECT_EQ(p.tokens.size() + 16, static_cast<size_t>(length));
        // The number: 7 digits, exactly once in the prompt's text, inside the needle.
        ASSERT_EQ(p.number.size(), 7u);
        EXPECT_NE(p.number[0], '0');
        const std::string text = tok->decode(p.tokens);
        const size_t at = text.find(p.number);
        ASSERT_NE(at, std::string::npos);
        EXPECT_EQ(text.find(p.number, at + 1), std::string::npos);
        const std::string needle = tok->decode(std::span<const int32_t>(p.tokens).subspan(
            p.needle_begin, p.needle_end - p.needle_begin));
        EXPECT_NE(needle.find("The special magic number is " + p.number + "."), std::string::npos) << needle;
        // The haystack around the needle is the text's first H tokens, in order.
        const int pre = p.needle_begin - p.insert_at;
        EXPECT_TRUE(std::equal(hay_nobos.begin(), hay_nobos.begin() + p.insert_at, p.tokens.begin() + pre));
        EXPECT_TRUE(std::equal(hay_nobos.begin() + p.insert_at, hay_nobos.begin() + p.haystack_tokens,
                               p.tokens.begin() + p.needle_end));
        // Depth: 0 first, 1 last, else within the snap distance of depth * H, at a sentence end.
        const double target = depth * p.haystack_tokens;
        if (depth == 0.0) {
          EXPECT_EQ(p.insert_at, 0);
        }
        if (depth == 1.0) {
          EXPECT_EQ(p.insert_at, p.haystack_tokens);
        }
        EXPECT_LE(std::abs(p.insert_at - target), kNiahSnapTokens + 0.5);
        EXPECT_NEAR(p.depth, static_cast<double>(p.insert_at) / p.haystack_tokens, 1e-12);
        if (p.insert_at > 0 && p.insert_at < p.haystack_tokens) {
          std::string before = tok->decode(std::span<const int32_t>(hay_nobos).first(p.insert_at));
          while (!before.empty() && std::string(" \n\r\t\"'_)").find(before.back()) != std::string::npos) before.pop_back();
          if (before.size() >= 3 && (before.compare(before.size() - 3, 3, "\xE2\x80\x9D") == 0 ||
                                     before.compare(before.size() - 3, 3, "\xE2\x80\x99") == 0))
            before.resize(before.size() - 3);
          ASSERT_FALSE(before.empty());
          const std::string after = tok->decode(std::span<const int32_t>(hay_nobos).subspan(p.insert_at, 4));
          const size_t first = after.find_first_not_of(" \t");
          const bool line_break = first != std::string::npos && (after[first] == '\n' || after[first] == '\r');
          const bool sentence = std::string(".!?").find(before.back()) != std::string::npos;
          const bool fallback = p.insert_at == std::lround(target);  // no boundary within reach
          EXPECT_TRUE(line_break || sentence || fallback)
              << "...[" << before.substr(before.size() > 40 ? before.size() - 40 : 0) << "] [" << after << "]";
          boundaries += line_break || sentence;
          ++inner;
        }
        EXPECT_GE(p.insert_at, last_insert);
        last_insert = p.insert_at;
        // Seeded: the same cell gives the same prompt; another trial another number.
        EXPECT_EQ(niah_prompt_build(*tok, hay_nobos, o).tokens, p.tokens);
        o.trial = 1;
        EXPECT_NE(niah_prompt_build(*tok, hay_nobos, o).number, p.number);
      }
    }
    EXPECT_THROW(niah_prompt_build(*tok, hay_nobos, {90, 0.5, 16, style, 0, 0}), Error);    // no room
    EXPECT_THROW(niah_prompt_build(*tok, hay_nobos, {4096, 0.5, 16, style, 0, 0}), Error);  // text too short
    EXPECT_THROW(niah_prompt_build(*tok, hay_nobos, {1024, 1.5, 16, style, 0, 0}), Error);
  }
  EXPECT_GE(boundaries, inner * 9 / 10);  // the fallback is rare
}

TEST(EvalNiah, AnswerScoring) {
  EXPECT_TRUE(niah_answer_correct(" 4827361.", "4827361"));
  EXPECT_TRUE(niah_answer_correct(": **4827361**", "4827361"));
  EXPECT_FALSE(niah_answer_correct(" 48273610", "4827361"));
  EXPECT_FALSE(niah_answer_correct(" 482736", "4827361"));
  EXPECT_FALSE(niah_answer_correct(" 1 and 4827361", "4827361"));  // the first number counts
  EXPECT_FALSE(niah_answer_correct(" not given", "4827361"));
  EXPECT_FALSE(niah_answer_correct("", "4827361"));
}

// ---------------------------------------------------------------------------- reports

namespace {

// A minimal XML well-formedness check written for this test (independent of svg.cpp):
// elements nest and close, attributes are quoted and unique, entities are the five
// predefined ones; returns the count of each element name, throws std::runtime_error.
struct XmlCheck {
  std::map<std::string, int> elements;
  std::vector<std::string> texts;  // character data of <text> elements
  std::string root;

  explicit XmlCheck(const std::string& s) {
    size_t i = 0;
    std::vector<std::string> stack;
    auto fail = [&](const std::string& what) { throw std::runtime_error(what + " at offset " + std::to_string(i)); };
    auto check_entities = [&](const std::string& t) {
      for (size_t k = t.find('&'); k != std::string::npos; k = t.find('&', k + 1)) {
        const size_t e = t.find(';', k);
        if (e == std::string::npos) fail("unterminated entity");
        const std::string ent = t.substr(k, e - k + 1);
        if (ent != "&amp;" && ent != "&lt;" && ent != "&gt;" && ent != "&quot;" && ent != "&apos;")
          fail("unknown entity " + ent);
      }
    };
    if (s.compare(0, 5, "<?xml") == 0) i = s.find("?>") + 2;
    while (i < s.size()) {
      if (s[i] != '<') {
        const size_t e = s.find('<', i);
        const std::string t = s.substr(i, e - i);
        if (stack.empty() && t.find_first_not_of(" \n\r\t") != std::string::npos) fail("text outside the root");
        check_entities(t);
        if (!stack.empty() && stack.back() == "text") texts.push_back(t);
        i = e == std::string::npos ? s.size() : e;
        continue;
      }
      if (s.compare(i, 2, "</") == 0) {
        const size_t e = s.find('>', i);
        const std::string name = s.substr(i + 2, e - i - 2);
        if (stack.empty() || stack.back() != name) fail("mismatched </" + name + ">");
        stack.pop_back();
        i = e + 1;
        continue;
      }
      size_t k = i + 1;
      while (k < s.size() && (std::isalnum(static_cast<unsigned char>(s[k])) || s[k] == '-' || s[k] == ':')) ++k;
      const std::string name = s.substr(i + 1, k - i - 1);
      if (name.empty()) fail("empty element name");
      if (stack.empty() && !root.empty()) fail("second root element");
      if (root.empty()) root = name;
      ++elements[name];
      std::set<std::string> attrs;
      while (true) {
        while (k < s.size() && std::isspace(static_cast<unsigned char>(s[k]))) ++k;
        if (k >= s.size()) fail("unterminated tag");
        if (s[k] == '>' || s.compare(k, 2, "/>") == 0) break;
        const size_t eq = s.find('=', k);
        const std::string an = s.substr(k, eq - k);
        if (an.empty() || an.find_first_of(" <>\"") != std::string::npos) fail("bad attribute name '" + an + "'");
        if (!attrs.insert(an).second) fail("duplicate attribute " + an);
        if (s[eq + 1] != '"') fail("unquoted attribute " + an);
        const size_t close = s.find('"', eq + 2);
        const std::string av = s.substr(eq + 2, close - eq - 2);
        if (av.find('<') != std::string::npos) fail("'<' in attribute " + an);
        check_entities(av);
        k = close + 1;
      }
      if (s[k] == '>') {
        stack.push_back(name);
        i = k + 1;
      } else {
        i = k + 2;
      }
    }
    if (!stack.empty()) throw std::runtime_error("unclosed <" + stack.back() + ">");
  }
};

RunStats fake_run(const std::string& label, const std::string& method, double kv, double kl, double target,
                  double mass) {
  RunStats r;
  r.spec = {label, label, method, {}};
  r.name = label;
  r.target = target;
  r.steps = 2;
  r.kl = {kl, kl};
  r.kl_summary = summarize(r.kl);
  r.nll = {1.0, 2.0};
  r.ppl = perplexity(r.nll);
  r.kv_fraction = kv;
  r.tokens_mean = 100 * kv;
  r.mass_true_mean = mass;
  return r;
}

EvalReport fake_report(const std::string& task) {
  EvalReport r;
  r.options.task = task;
  r.model = "models/x.gguf";
  r.text = "t.txt";
  r.continuation.prompt_tokens = 1000;
  r.continuation.steps = 2;
  r.continuation.context = 1002;
  r.continuation.prefill_s = 1.0;
  r.continuation.runs.push_back(fake_run("dense", "dense", 1.0, 0.0, kNaN, 1.0));
  r.continuation.runs.push_back(fake_run("tactic p=0.5", "tactic", 0.1, 0.2, 0.5, 0.7));
  r.continuation.runs.back().spec.curve = "tactic";
  r.continuation.runs.push_back(fake_run("tactic p=0.9", "tactic", 0.3, 0.02, 0.9, 0.93));
  r.continuation.runs.back().spec.curve = "tactic";
  r.continuation.runs.push_back(fake_run("a<b&c", "quest", 0.2, 0.5, kNaN, 0.8));
  r.continuation.runs.back().match_target = 30;
  r.continuation.runs.back().match_param = "budget";
  r.continuation.runs.back().match_budget = 28;
  for (int len : {1024, 2048})
    for (double d : {0.0, 0.5, 1.0}) {
      NiahCell c;
      c.length = len;
      c.depth = c.depth_achieved = d;
      c.number = "1234567";
      for (const char* m : {"dense", "tactic"}) {
        RunStats run;
        run.spec = {m, m, m, {}};
        run.name = m;
        run.steps = 3;
        run.answer = " 1234567.";
        run.correct = !(len == 2048 && d == 0.5 && std::string(m) == "tactic");
        c.runs.push_back(run);
      }
      r.niah.push_back(c);
    }
  return r;
}

// Every Markdown table row has as many cells as its header.
void expect_rectangular_tables(const std::string& md) {
  std::istringstream in(md);
  int columns = -1;
  int rows = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] != '|') {
      columns = -1;
      continue;
    }
    const int cells = static_cast<int>(std::count(line.begin(), line.end(), '|')) - 1;
    if (columns < 0) columns = cells;
    EXPECT_EQ(cells, columns) << line;
    ++rows;
  }
  EXPECT_GT(rows, 4);
}

}  // namespace

TEST(EvalReport, JsonMarkdownAndSvgsAreValid) {
  for (const std::string task : {"kl", "niah"}) {
    const EvalReport rep = fake_report(task);
    const nlohmann::json j = nlohmann::json::parse(eval_json(rep));
    EXPECT_EQ(j.at("task"), task);
    ASSERT_EQ(j.at("continuation").at("runs").size(), 4u);
    EXPECT_TRUE(j["continuation"]["runs"][0]["target"].is_null());  // NaN -> null
    EXPECT_DOUBLE_EQ(j["continuation"]["runs"][2]["kl"]["mean"].get<double>(), 0.02);
    EXPECT_EQ(j["continuation"]["runs"][3]["matched"]["budget"], 28);
    ASSERT_EQ(j.at("niah").size(), 6u);
    EXPECT_EQ(j["niah"][0]["runs"][1]["answer"], " 1234567.");
    expect_rectangular_tables(eval_markdown(rep));
  }
  const EvalReport kl = fake_report("kl");
  const std::string md = eval_markdown(kl);
  EXPECT_NE(md.find("| tactic p=0.9 |"), std::string::npos);
  EXPECT_NE(md.find("budget=28 (matched to 30)"), std::string::npos);
  EXPECT_NE(md.find("| tactic | 3/3 | 2/3 | 5/6 | 5/6 |"), std::string::npos) << md;  // niah accuracy row

  std::map<std::string, std::string> svgs;
  for (const auto& [name, svg] : eval_svgs(kl)) svgs[name] = svg;
  ASSERT_EQ(svgs.size(), 4u);  // kl_vs_kv, mass_vs_target, niah_dense, niah_tactic
  {
    const XmlCheck x(svgs.at("kl_vs_kv.svg"));
    EXPECT_EQ(x.root, "svg");
    // Curves: dense (KL 0: no visible point, no line), tactic (2 points), a<b&c (1 point).
    EXPECT_EQ(x.elements.at("polyline"), 2);
    EXPECT_EQ(x.elements.at("circle"), 3 + 3);  // visible points + one legend marker per series
    const auto has_text = [&](const std::string& t) {
      return std::find(x.texts.begin(), x.texts.end(), t) != x.texts.end();
    };
    EXPECT_TRUE(has_text("a&lt;b&amp;c"));  // escaped legend entry
    EXPECT_TRUE(has_text("tactic"));
    EXPECT_TRUE(has_text("share of dense K/V bytes read per decode step"));
  }
  {
    const XmlCheck x(svgs.at("mass_vs_target.svg"));
    EXPECT_EQ(x.elements.at("polyline"), 1);  // only tactic has a target
    EXPECT_GE(x.elements.at("line"), 2);      // grid and the y = x reference
  }
  {
    const XmlCheck x(svgs.at("niah_tactic.svg"));
    EXPECT_EQ(x.root, "svg");
    int cells = 0, percents = 0;
    for (const auto& t : x.texts) percents += t == "50%" || t == "100%";
    const std::string& s = svgs.at("niah_tactic.svg");
    for (size_t k = s.find("class=\"cell\""); k != std::string::npos; k = s.find("class=\"cell\"", k + 1)) ++cells;
    EXPECT_EQ(cells, 3 * 2);  // depths x lengths
    EXPECT_GE(percents, 6);
  }
  // The checker itself rejects broken XML.
  EXPECT_THROW(XmlCheck("<svg><g></svg>"), std::runtime_error);
  EXPECT_THROW(XmlCheck("<svg a=\"1\" a=\"2\"/>"), std::runtime_error);
  EXPECT_THROW(XmlCheck("<svg><text>a & b</text></svg>"), std::runtime_error);
}

TEST(EvalReport, NiahGridAccuracy) {
  const EvalReport rep = fake_report("niah");
  const NiahGrid g = niah_grid(rep, "tactic");
  ASSERT_EQ(g.lengths, (std::vector<int>{1024, 2048}));
  ASSERT_EQ(g.depths.size(), 3u);
  EXPECT_EQ(g.accuracy[1][1], 0.0);
  EXPECT_EQ(g.accuracy[1][0], 1.0);
  EXPECT_EQ(niah_run_names(rep), (std::vector<std::string>{"dense", "tactic"}));
}

TEST(EvalProgress, TimeLeftFromMeasuredRates) {
  Progress p(nullptr);
  p.plan(1000, 10);
  EXPECT_EQ(p.seconds_left(), 0.0);  // nothing measured yet
  EXPECT_NE(p.line().find("? left"), std::string::npos);
  EXPECT_EQ(duration_text(42), "42s");
  EXPECT_EQ(duration_text(185), "3m05s");
  EXPECT_EQ(duration_text(3720), "1h02m");
}
