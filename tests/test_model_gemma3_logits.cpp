// Gemma 3 270M (Q4_K_M GGUF) against llama.cpp, software nobody here wrote: the
// top-20 logits llama.cpp computes at 12 positions of a >= 4096-token excerpt of
// Pride and Prejudice, on both sides of the 512-token sliding window, and its 32-token
// greedy continuation of the excerpt with its top-1 margins (tests/data/gemma3_llamacpp_logits.json, from
// tools/reference/make_gemma3_llamacpp_fixture.py with the llama.cpp that llama-cpp-python
// 0.3.36 vendors). cumulus must first tokenise the excerpt to exactly llama.cpp's ids (BOS
// included), then reproduce the logits through the prefill path at every position and the
// decode path at the last two, then the greedy continuation.
//
// Tolerance: as for SmolLM2 (tests/test_model_logits.cpp), llama.cpp rounds activations to
// 8 bits before its integer dot products and rounds attention to f16, cumulus does not;
// the bounds below are checked over llama.cpp's top-20 ids and sit ~1.5x above what this
// test measures (printed; 2026-11-25: max 0.60, centered max 0.37, mean 0.16, top-1
// agrees at all 12 positions, overlap >= 18/20, greedy identical; 2026-11-26 with 8-bit
// activations, which the runtime does not use: max 0.71, centered max 0.42, mean 0.16, top-1
// at all 12, overlap >= 18/20, the greedy continuation off at its 9th token), far below what
// a wrong RoPE layout, norm, window or scale gives (whole units).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <span>
#include <vector>

#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/session.h"
#include "cumulus/model/tokenizer.h"
#include "fixtures.h"
#include "golden_logits.h"

using namespace cumulus;
using cumulus::test::GoldenTop;
namespace fs = std::filesystem;

namespace {

constexpr double kMaxAbsDiff = 0.9;
constexpr double kMaxCenteredDiff = 0.5;
constexpr double kMeanAbsDiff = 0.25;
constexpr int kMinOverlap = 17;

fs::path gemma3_gguf() { return cumulus::test::source_dir() / "models/gemma-3-270m-q4_k_m.gguf"; }
fs::path fixture_path() { return cumulus::test::source_dir() / "tests/data/gemma3_llamacpp_logits.json"; }

constexpr cumulus::test::GoldenTolerance kTolerance{kMaxAbsDiff, kMaxCenteredDiff, kMinOverlap};

}  // namespace

TEST(Gemma3, LogitsAndGreedyMatchLlamaCpp) {
  if (!fs::exists(gemma3_gguf()))
    CUMULUS_FIXTURE_MISSING(gemma3_gguf() << " missing: run scripts/fetch-model.sh gemma3-270m");
  std::ifstream in(fixture_path());
  ASSERT_TRUE(in.good()) << fixture_path();
  const nlohmann::json fx = nlohmann::json::parse(in);
  const std::vector<int32_t> ids = fx.at("token_ids").get<std::vector<int32_t>>();
  const std::vector<int32_t> want_greedy = fx.at("greedy").get<std::vector<int32_t>>();
  std::vector<GoldenTop> golden = cumulus::test::golden_top_load(fx);
  ASSERT_FALSE(::testing::Test::HasFailure()) << "every golden position needs 20 entries";
  ASSERT_GE(golden.size(), 10u);
  ASSERT_GE(ids.size(), 4096u);
  ASSERT_EQ(want_greedy.size(), 32u);
#ifdef CUMULUS_SANITIZED
  // Under the sanitizers only the positions up to 63 (prefill and the window's first rows;
  // the two kept past them are dropped with the decode path below).
  std::erase_if(golden, [](const GoldenTop& g) { return g.position > 63; });
  golden.resize(golden.size() + 2);
#endif

  // Same input: cumulus's tokenizer gives exactly llama.cpp's ids (BOS as add_bos_token says).
  const GgufFile f = GgufFile::open(gemma3_gguf().string());
  const auto tok = tokenizer_from_gguf(f);
  EXPECT_EQ(tok->encode(fx.at("excerpt").get<std::string>(), tok->add_bos_default()), ids);

  const ModelWeights w = model_weights_from_gguf(f);
  double sum_abs = 0;
  int n_compared = 0;
  const int capacity = static_cast<int>(ids.size()) + static_cast<int>(want_greedy.size());
  // One session (a 4K prefill takes ~30 s on two cores): the prefill path up to each golden
  // position but the last two in turn, then the decode path (one token at a time) through
  // the last two, then the greedy continuation.
  {
    SessionOptions o;
    o.max_tokens = capacity;
    Session s(w, o);
    const size_t split = golden.size() - 2;
    int fed = 0;
    for (size_t i = 0; i < split; ++i) {
      const GoldenTop& g = golden[i];
      ASSERT_GT(g.position + 1, fed);
      const std::vector<float>& logits = s.prefill(
          std::span<const int32_t>(ids).subspan(static_cast<size_t>(fed), static_cast<size_t>(g.position + 1 - fed)));
      fed = g.position + 1;
      sum_abs += cumulus::test::golden_top_expect(logits, g, kTolerance, "prefill");
      n_compared += static_cast<int>(g.top.size());
    }
#ifndef CUMULUS_SANITIZED
    std::map<int, const GoldenTop*> want;
    for (size_t i = split; i < golden.size(); ++i) want[golden[i].position] = &golden[i];
    std::vector<float> logits;
    for (int p = fed; p < static_cast<int>(ids.size()); ++p) {
      logits = s.decode(ids[static_cast<size_t>(p)]);
      if (auto it = want.find(p); it != want.end()) {
        sum_abs += cumulus::test::golden_top_expect(logits, *it->second, kTolerance, "decode");
        n_compared += static_cast<int>(it->second->top.size());
      }
    }
    // The greedy continuation must match: cumulus's own 32 greedy tokens equal
    // llama.cpp's, with the 16-bit activations the runtime uses (kernels/gemv.h; 8-bit codes
    // took another 9th token at a near tie: margin 0.184 in llama.cpp, 0.003 in cumulus).
    // Fragile by nature: llama.cpp's own top-1 margin (in the fixture) is under 0.2 at 5 of
    // its 32 steps, and its own attention paths disagree on the 4th (docs/model.md); at a
    // divergence the test prints llama.cpp's margin there.
    const std::vector<double> want_margin = fx.at("greedy_margin").get<std::vector<double>>();
    ASSERT_EQ(want_margin.size(), want_greedy.size());
    std::vector<int32_t> greedy;
    double min_margin = 1e9;
    size_t min_at = 0;
    bool diverged = false;
    for (size_t i = 0; i < want_greedy.size(); ++i) {
      const std::vector<int> top2 = cumulus::test::golden_top_ids(logits, 2);
      if (logits[top2[0]] - logits[top2[1]] < min_margin) min_margin = logits[top2[0]] - logits[top2[1]], min_at = i;
      if (!diverged && top2[0] != want_greedy[i]) {
        diverged = true;
        std::printf("  greedy: first divergence at token %zu (llama.cpp's margin there %.3f)\n", i, want_margin[i]);
      }
      greedy.push_back(top2[0]);
      logits = s.decode(top2[0]);
    }
    std::printf("  greedy: smallest top-1 margin %.3f at token %zu\n", min_margin, min_at);
    std::printf("  greedy (cumulus):   '%s'\n  greedy (llama.cpp): '%s'\n", tok->decode(greedy).c_str(),
                tok->decode(want_greedy).c_str());
    EXPECT_EQ(greedy, want_greedy);
#endif
  }
  std::printf("  mean |diff| over all %d compared logits: %.4f\n", n_compared, sum_abs / n_compared);
  EXPECT_LE(sum_abs / n_compared, kMeanAbsDiff);
}
