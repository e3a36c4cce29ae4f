// Real-attention statistics and the trace reader (include/cumulus/eval/synthetic.h,
// include/cumulus/eval/trace.h). attention_profile's per-head top-p share and GQA-group
// figures (union share, Jaccard, logit correlation) against a float64 computation written
// here from the definitions, on random keys and queries of awkward sizes; identical heads
// give a union equal to each head's set; a trace written by hand in the documented format
// (docs/cuda.md "Traces") reads back bit for bit; bad files and arguments are Errors.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/eval/trace.h"
#include "cumulus/kv/kv_cache.h"

namespace cumulus {
namespace {

std::vector<float> random_vec(size_t n, std::mt19937& rng, float sd) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The fewest tokens whose softmax weights reach p, as a set: [n] 0/1 (float64, from the
// definition: weights sorted descending, first prefix reaching p of the total).
std::vector<int> topp_set(const std::vector<double>& logit, double p) {
  const int n = static_cast<int>(logit.size());
  const double mx = *std::max_element(logit.begin(), logit.end());
  std::vector<double> w(n);
  double z = 0;
  for (int t = 0; t < n; ++t) z += w[t] = std::exp(logit[t] - mx);
  std::vector<int> idx(n);
  for (int t = 0; t < n; ++t) idx[t] = t;
  std::sort(idx.begin(), idx.end(), [&](int a, int b) { return w[a] > w[b]; });
  std::vector<int> in(n, 0);
  double acc = 0;
  for (int t : idx) {
    in[t] = 1;
    acc += w[t];
    if (acc >= p * z) break;
  }
  return in;
}

struct Expected {
  double topp_fraction = 0, union_fraction = 0, jaccard = 0;
};

// Means over (kv head, step) of the union share and pairwise Jaccard, over (head, step) of
// the per-head share; K from the cache's stored (f32) keys.
Expected expected_profile(const KvCache& kv, const std::vector<float>& q, int steps, const std::vector<int>& attended,
                          double p) {
  const Shape& s = kv.shape();
  const int d = s.head_dim, group = s.group();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Expected e;
  std::vector<float> key(d);
  for (int h = 0; h < s.n_kv_heads; ++h)
    for (int st = 0; st < steps; ++st) {
      const int n = attended[st];
      std::vector<std::vector<int>> sets;
      for (int g = 0; g < group; ++g) {
        const float* qv = q.data() + (static_cast<size_t>(st) * s.n_q_heads + h * group + g) * d;
        std::vector<double> logit(n);
        for (int t = 0; t < n; ++t) {
          kv.key_f32(0, h, t, key.data());
          double acc = 0;
          for (int i = 0; i < d; ++i) acc += static_cast<double>(qv[i]) * key[i];
          logit[t] = acc * scale;
        }
        sets.push_back(topp_set(logit, p));
        e.topp_fraction += static_cast<double>(std::count(sets.back().begin(), sets.back().end(), 1)) / n;
      }
      int uni = 0;
      for (int t = 0; t < n; ++t) {
        bool any = false;
        for (const auto& st_set : sets) any |= st_set[t] != 0;
        uni += any;
      }
      e.union_fraction += static_cast<double>(uni) / n;
      double jac = 0;
      int pairs = 0;
      for (int a = 0; a < group; ++a)
        for (int b = a + 1; b < group; ++b, ++pairs) {
          int inter = 0, either = 0;
          for (int t = 0; t < n; ++t) inter += sets[a][t] & sets[b][t], either += sets[a][t] | sets[b][t];
          jac += static_cast<double>(inter) / either;
        }
      e.jaccard += pairs > 0 ? jac / pairs : 0.0;
    }
  e.topp_fraction /= static_cast<double>(s.n_q_heads) * steps;
  e.union_fraction /= static_cast<double>(s.n_kv_heads) * steps;
  e.jaccard /= static_cast<double>(s.n_kv_heads) * steps;
  return e;
}

KvCache random_cache(const Shape& s, int n, std::mt19937& rng) {
  KvCache kv(s, KvCacheOptions{16, DType::f32, n});
  const auto k = random_vec(static_cast<size_t>(n) * s.n_kv_heads * s.head_dim, rng, 1.0f);
  const auto v = random_vec(k.size(), rng, 1.0f);
  kv.append(0, k.data(), v.data(), n);
  return kv;
}

TEST(AttentionProfile, GroupFiguresMatchTheDefinition) {
  ThreadPool pool(2);
  std::mt19937 rng(31);
  for (const auto& [shape, n] : {std::pair{Shape{1, 12, 3, 16}, 255}, std::pair{Shape{1, 8, 2, 8}, 17},
                                 std::pair{Shape{1, 9, 1, 24}, 4097}}) {
    const int steps = 3;
    const KvCache kv = random_cache(shape, n, rng);
    // Queries of norm ~3 x sqrt(d): peaked enough that the top-p sets are small and differ.
    const auto q = random_vec(static_cast<size_t>(steps) * shape.n_q_heads * shape.head_dim, rng, 3.0f);
    const std::vector<int> attended = {n, std::max(1, n - 1), std::max(1, n - 2)};
    for (double p : {0.5, 0.9}) {
      const AttentionProfile a = attention_profile(kv, 0, q.data(), steps, attended.data(), 1, 4, p, pool);
      const Expected e = expected_profile(kv, q, steps, attended, p);
      const std::string what = fmt::format("n {} group {} p {}", n, shape.group(), p);
      EXPECT_NEAR(a.topp_fraction, e.topp_fraction, 1e-9) << what;
      EXPECT_NEAR(a.union_fraction, e.union_fraction, 1e-9) << what;
      EXPECT_NEAR(a.group_jaccard, e.jaccard, 1e-9) << what;
      EXPECT_NEAR(a.union_inflation, e.union_fraction / e.topp_fraction, 1e-9) << what;
      EXPECT_GT(a.union_inflation, 1.0) << what << ": random heads should not share their sets";
      EXPECT_GE(a.group_logit_corr, -1.0) << what;
      EXPECT_LE(a.group_logit_corr, 1.0) << what;
    }
  }
}

TEST(AttentionProfile, IdenticalHeadsShareOneSetAndGroupOneHasNoPairs) {
  ThreadPool pool(2);
  std::mt19937 rng(32);
  const Shape s{1, 8, 2, 16};
  const int n = 333, steps = 2;
  const KvCache kv = random_cache(s, n, rng);
  auto q = random_vec(static_cast<size_t>(steps) * s.n_q_heads * s.head_dim, rng, 3.0f);
  // Every head of a group gets its group's first head's query.
  for (int st = 0; st < steps; ++st)
    for (int qh = 0; qh < s.n_q_heads; ++qh)
      std::memcpy(&q[(static_cast<size_t>(st) * s.n_q_heads + qh) * s.head_dim],
                  &q[(static_cast<size_t>(st) * s.n_q_heads + qh / 4 * 4) * s.head_dim], s.head_dim * sizeof(float));
  const AttentionProfile a = attention_profile(kv, 0, q.data(), steps, nullptr, 4, 16, 0.9, pool);
  EXPECT_NEAR(a.union_inflation, 1.0, 1e-12);
  EXPECT_NEAR(a.group_jaccard, 1.0, 1e-12);
  EXPECT_NEAR(a.group_logit_corr, 1.0, 1e-9);
  // Group 1: no pairs, so no correlation or Jaccard.
  const Shape s1{1, 2, 2, 16};
  const KvCache kv1 = random_cache(s1, n, rng);
  const auto q1 = random_vec(static_cast<size_t>(steps) * 2 * 16, rng, 3.0f);
  const AttentionProfile a1 = attention_profile(kv1, 0, q1.data(), steps, nullptr, 4, 16, 0.9, pool);
  EXPECT_TRUE(std::isnan(a1.group_jaccard));
  EXPECT_TRUE(std::isnan(a1.group_logit_corr));
  EXPECT_NEAR(a1.union_inflation, 1.0, 1e-12);
}

TEST(AttentionProfile, BadArgumentsAreErrors) {
  ThreadPool pool(1);
  std::mt19937 rng(33);
  const Shape s{1, 4, 2, 8};
  const KvCache kv = random_cache(s, 20, rng);
  const auto q = random_vec(4 * 8, rng, 1.0f);
  const int too_many[1] = {21}, none[1] = {0};
  EXPECT_THROW(attention_profile(kv, 0, q.data(), 1, too_many, 1, 4, 0.9, pool), Error);
  EXPECT_THROW(attention_profile(kv, 0, q.data(), 1, none, 1, 4, 0.9, pool), Error);
  EXPECT_THROW(attention_profile(kv, 0, nullptr, 1, nullptr, 1, 4, 0.9, pool), Error);
  EXPECT_THROW(attention_profile(kv, 0, q.data(), 0, nullptr, 1, 4, 0.9, pool), Error);
  EXPECT_THROW(attention_profile(kv, 0, q.data(), 1, nullptr, -1, 4, 0.9, pool), Error);
  EXPECT_THROW(attention_profile(kv, 0, q.data(), 1, nullptr, 1, 4, 1.5, pool), Error);
  EXPECT_THROW(attention_profile(kv, 1, q.data(), 1, nullptr, 1, 4, 0.9, pool), Error);
}

// A trace in the documented format: "CUMTRACE", uint32 version 1, uint32 header length, the
// JSON header, then per layer K [n][n_kv][d] f16, V likewise, Q [steps][n_q][d] f32.
struct HandTrace {
  int n_q = 6, n_kv = 2, d = 8, prompt = 13, steps = 3;
  std::vector<int> layers = {2, 5};
  std::vector<std::vector<uint16_t>> k, v;
  std::vector<std::vector<float>> q;

  std::string write(const std::string& path, const std::string& header_override = "", uint32_t version = 1,
                    size_t cut = 0) const {
    std::string h = header_override;
    if (h.empty())
      h = fmt::format(R"({{"n_q_heads": {}, "n_kv_heads": {}, "head_dim": {}, "n_tokens": {}, "prompt_tokens": {},)"
                      R"( "steps": {}, "layers": [{}, {}]}})",
                      n_q, n_kv, d, prompt + steps, prompt, steps, layers[0], layers[1]);
    std::string bytes = "CUMTRACE";
    const uint32_t hb = static_cast<uint32_t>(h.size());
    bytes.append(reinterpret_cast<const char*>(&version), 4);
    bytes.append(reinterpret_cast<const char*>(&hb), 4);
    bytes += h;
    for (size_t l = 0; l < layers.size(); ++l) {
      bytes.append(reinterpret_cast<const char*>(k[l].data()), k[l].size() * 2);
      bytes.append(reinterpret_cast<const char*>(v[l].data()), v[l].size() * 2);
      bytes.append(reinterpret_cast<const char*>(q[l].data()), q[l].size() * 4);
    }
    bytes.resize(bytes.size() - cut);
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
  }
};

TEST(Trace, ReadsBackWhatWasWrittenAndRejectsBadFiles) {
  std::mt19937 rng(34);
  HandTrace ht;
  const int n = ht.prompt + ht.steps;
  for (size_t l = 0; l < ht.layers.size(); ++l) {
    std::vector<uint16_t> k, v;
    for (float x : random_vec(static_cast<size_t>(n) * ht.n_kv * ht.d, rng, 1.0f)) k.push_back(f32_to_f16(x));
    for (float x : random_vec(static_cast<size_t>(n) * ht.n_kv * ht.d, rng, 1.0f)) v.push_back(f32_to_f16(x));
    ht.k.push_back(k);
    ht.v.push_back(v);
    ht.q.push_back(random_vec(static_cast<size_t>(ht.steps) * ht.n_q * ht.d, rng, 1.0f));
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / ("cumulus_trace_test_" + std::to_string(::getpid()) + ".bin")).string();
  const TraceFile t = trace_read(ht.write(path));
  EXPECT_EQ(t.n_q_heads, ht.n_q);
  EXPECT_EQ(t.n_kv_heads, ht.n_kv);
  EXPECT_EQ(t.group(), 3);
  EXPECT_EQ(t.head_dim, ht.d);
  EXPECT_EQ(t.n_tokens, n);
  EXPECT_EQ(t.attended(0), ht.prompt + 1);
  EXPECT_EQ(t.layers, ht.layers);
  EXPECT_EQ(t.k, ht.k);
  EXPECT_EQ(t.v, ht.v);
  EXPECT_EQ(t.q, ht.q);
  // The cache of record 1 holds its keys and values: token 7, kv head 1.
  const KvCache kv = t.cache(1);
  std::vector<float> row(ht.d);
  kv.key_f32(0, 1, 7, row.data());
  for (int i = 0; i < ht.d; ++i) EXPECT_EQ(row[i], f16_to_f32(ht.k[1][(7 * ht.n_kv + 1) * ht.d + i]));
  kv.value_f32(0, 1, 7, row.data());
  for (int i = 0; i < ht.d; ++i) EXPECT_EQ(row[i], f16_to_f32(ht.v[1][(7 * ht.n_kv + 1) * ht.d + i]));
  EXPECT_THROW(t.cache(2), Error);
  // Truncated data, wrong version, inconsistent or malformed header, missing file.
  EXPECT_THROW(trace_read(ht.write(path, "", 1, 5)), Error);
  EXPECT_THROW(trace_read(ht.write(path, "", 2)), Error);
  EXPECT_THROW(trace_read(ht.write(path, R"({"n_q_heads": 5, "n_kv_heads": 2, "head_dim": 8, "n_tokens": 16,)"
                                         R"( "prompt_tokens": 13, "steps": 3, "layers": [2, 5]})")),
               Error);
  EXPECT_THROW(trace_read(ht.write(path, R"({"n_q_heads": 6)")), Error);
  std::filesystem::remove(path);
  EXPECT_THROW(trace_read(path), Error);
}

}  // namespace
}  // namespace cumulus
