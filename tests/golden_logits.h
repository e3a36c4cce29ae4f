// Comparison of our logits with llama.cpp's top-20 at a position (the golden fixtures made
// by tools/reference/make_*llamacpp*_fixture.py), shared by the SmolLM2 and Gemma 3 tests:
// |diff| over the 20 ids (max, sum, and max after removing the mean shift, which is what
// changes the softmax), top-1 agreement where llama.cpp's margin is clear, top-20 overlap.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <utility>
#include <vector>

namespace cumulus::test {

struct GoldenTop {
  int position = 0;
  std::vector<std::pair<int, float>> top;  // [20] (id, logit), best first
};

struct GoldenTolerance {
  double max_abs;       // max |diff| over the top-20 ids
  double max_centered;  // max |diff - mean diff|
  int min_overlap;      // of our top-20 with llama.cpp's
};

// The fixture's "logits" entries: {position, top: [[id, logit], ...]}.
inline std::vector<GoldenTop> golden_top_load(const nlohmann::json& fx) {
  std::vector<GoldenTop> golden;
  for (const auto& p : fx.at("logits")) {
    GoldenTop g;
    g.position = p.at("position").get<int>();
    for (const auto& e : p.at("top")) g.top.emplace_back(e.at(0).get<int>(), e.at(1).get<float>());
    EXPECT_EQ(g.top.size(), 20u) << "position " << g.position;
    golden.push_back(std::move(g));
  }
  return golden;
}

// The k largest logits' ids, best first (ties: lower id).
inline std::vector<int> golden_top_ids(const std::vector<float>& logits, int k) {
  std::vector<int> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

// Checks one position against the tolerance and prints its figures; returns the sum of
// |diff| over the top-20 ids (for the mean over all positions).
inline double golden_top_expect(const std::vector<float>& logits, const GoldenTop& g, const GoldenTolerance& tol,
                                const char* path) {
  double mean = 0, max_abs = 0, sum_abs = 0, max_centered = 0;
  for (const auto& [id, v] : g.top) mean += (static_cast<double>(logits[id]) - v) / static_cast<double>(g.top.size());
  for (const auto& [id, v] : g.top) {
    const double d = static_cast<double>(logits[id]) - v;
    max_abs = std::max(max_abs, std::fabs(d));
    sum_abs += std::fabs(d);
    max_centered = std::max(max_centered, std::fabs(d - mean));
  }
  const std::vector<int> ours = golden_top_ids(logits, static_cast<int>(g.top.size()));
  int overlap = 0;
  for (const auto& [id, v] : g.top) overlap += std::count(ours.begin(), ours.end(), id) > 0 ? 1 : 0;
  const double margin = g.top[0].second - g.top[1].second;
  const bool top1_agrees = ours[0] == g.top[0].first;
  std::printf("  %-7s position %4d: |diff| over top-20 max %.3f mean %.3f centered max %.3f, top-1 %s (llama.cpp "
              "margin %.3f), top-20 overlap %d/20\n",
              path, g.position, max_abs, sum_abs / static_cast<double>(g.top.size()), max_centered,
              top1_agrees ? "agrees" : "differs", margin, overlap);
  EXPECT_LE(max_abs, tol.max_abs) << path << " position " << g.position;
  EXPECT_LE(max_centered, tol.max_centered) << path << " position " << g.position;
  if (margin > 2 * tol.max_abs) {
    EXPECT_TRUE(top1_agrees) << path << " position " << g.position;
  }
  EXPECT_GE(overlap, tol.min_overlap) << path << " position " << g.position;
  return sum_abs;
}

}  // namespace cumulus::test
