// Methods keep their promises (STYLE.md habit 3): oracle_topp reaches P with the fewest
// tokens and equals dense at P = 1; true mass >= claimed mass; the output error stays
// under 2(1-p)max||v|| on every head-step; streaming and quest attend exactly the sets
// they describe (recomputed here in float64 from the stored keys); bad input throws.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "cumulus/core/error.h"
#include "cumulus/kernels/cuda_decoder.h"
#include "cumulus/kernels/sketch.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/registry.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

struct Fixture {
  Shape shape;
  KvCache kv;
  std::vector<float> q;  // [n_q_heads][head_dim]
};

// Random keys around a few cluster centres and a query that prefers some of them, so the
// softmax is peaked (a top-p set much smaller than the context) but not degenerate.
// run: consecutive tokens share a cluster in runs of this length (1: every token draws its
// own), the locality that page-level estimates rely on.
Fixture make_fixture(Shape shape, int n_tokens, uint32_t seed, DType dtype = DType::f16, float q_gain = 3.0f,
                     int run = 1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  KvCacheOptions opt;
  opt.dtype = dtype;
  Fixture f{shape, KvCache(shape, opt), {}};
  const int d = shape.head_dim;
  const int n_centres = 8;
  std::vector<float> centres(static_cast<size_t>(n_centres) * d);
  for (auto& c : centres) c = nd(rng);
  std::vector<float> k(static_cast<size_t>(shape.n_kv_heads) * d), v(k.size());
  std::vector<int> cluster(shape.n_kv_heads);
  for (int t = 0; t < n_tokens; ++t) {
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      if (t % run == 0) cluster[h] = static_cast<int>(rng() % n_centres);
      const int c = cluster[h];
      for (int j = 0; j < d; ++j) {
        k[h * d + j] = 0.8f * centres[c * d + j] + 0.6f * nd(rng);
        v[h * d + j] = nd(rng);
      }
    }
    f.kv.append(0, k.data(), v.data(), 1);
  }
  f.q.resize(static_cast<size_t>(shape.n_q_heads) * d);
  for (int h = 0; h < shape.n_q_heads; ++h) {
    const int c = h % n_centres;
    for (int j = 0; j < d; ++j) f.q[h * d + j] = q_gain * (centres[c * d + j] + 0.5f * nd(rng)) / std::sqrt(2.0f);
  }
  return f;
}

// float64 softmax probabilities of query head qh over all tokens, from the stored keys.
std::vector<double> true_probs(const Fixture& f, int qh) {
  const int d = f.shape.head_dim;
  const int kvh = qh / f.shape.group();
  const int n = f.kv.n_tokens(0);
  std::vector<double> s(n);
  std::vector<float> key(d);
  for (int t = 0; t < n; ++t) {
    f.kv.key_f32(0, kvh, t, key.data());
    double dot = 0;
    for (int j = 0; j < d; ++j) dot += static_cast<double>(f.q[qh * d + j]) * key[j];
    s[t] = dot / std::sqrt(static_cast<double>(d));
  }
  const double mx = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (auto& x : s) sum += (x = std::exp(x - mx));
  for (auto& x : s) x /= sum;
  return s;
}

double max_value_norm(const Fixture& f, int kvh) {
  const int d = f.shape.head_dim;
  std::vector<float> v(d);
  double mx = 0;
  for (int t = 0; t < f.kv.n_tokens(0); ++t) {
    f.kv.value_f32(0, kvh, t, v.data());
    double n2 = 0;
    for (float x : v) n2 += static_cast<double>(x) * x;
    mx = std::max(mx, std::sqrt(n2));
  }
  return mx;
}

AttnOutput run(const std::string& method, const Fixture& f, const std::map<std::string, std::string>& params,
               int threads = 2, bool eval = true) {
  auto m = Registry::builtin().make(method, f.shape, params);
  ThreadPool pool(threads);
  DecodeContext ctx{&pool, eval};
  m->on_prefill(0, f.kv, ctx);
  AttnOutput out;
  decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
  return out;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

// A group-of-one head's set must have the size of the minimal top-p set, counted here in
// float64 from the stored keys; float32 probabilities may move the boundary by one token
// when a prefix sum lands within rounding of P.
void expect_minimal_set(const Fixture& f, int qh, double p, size_t got) {
  std::vector<double> pr = true_probs(f, qh);
  std::sort(pr.begin(), pr.end(), std::greater<>());
  double acc = 0;
  size_t m = 0;
  while (m < pr.size() && acc < p) acc += pr[m++];
  EXPECT_NEAR(static_cast<double>(got), static_cast<double>(m), 1.0) << "p=" << p << " head " << qh;
  EXPECT_LT(got, pr.size() / 2) << "fixture not peaked enough to test anything";
}

const std::vector<Shape> kShapes = {{1, 4, 4, 32}, {1, 8, 2, 64}, {1, 9, 3, 64}, {1, 8, 1, 16}};

}  // namespace

TEST(Methods, RegistryListsTheBaselines) {
  std::set<std::string> names;
  for (const auto& m : Registry::builtin().list()) names.insert(m.name);
  for (const char* n : {"dense", "oracle_topk", "oracle_topp", "streaming", "quest"}) EXPECT_TRUE(names.count(n)) << n;
}

// What the evaluation and the GPU runtime read from the registry instead of comparing
// method names: each decode method targets a mass or has a fixed budget (never both), each
// has its own plot colour, and a kind that contradicts the factories is refused.
TEST(Methods, RegistryCarriesTargetsBudgetsColoursAndKinds) {
  std::set<std::string> colors;
  for (const MethodInfo& m : Registry::builtin().list()) {
    if (!method_kind_decodes(m.kind)) continue;
    EXPECT_FALSE(!m.target_param.empty() && !m.budget_param.empty()) << m.name;
    EXPECT_EQ(m.color.size(), 7u) << m.name;
    EXPECT_TRUE(colors.insert(m.color).second) << m.name << " shares colour " << m.color;
    EXPECT_EQ(m.gpu.make, nullptr) << m.name << ": the CPU registry attaches no GPU pipeline";
  }
  const Registry& r = Registry::builtin();
  EXPECT_EQ(r.find("psa").target_param, "threshold");
  EXPECT_EQ(r.find("quest").budget_param, "budget");
  EXPECT_EQ(r.find("oracle_topk").budget_param, "k");
  EXPECT_EQ(r.find("streaming").budget_param, "window");
  EXPECT_EQ(r.find("streaming").budget_extra_param, "sinks");  // it attends sinks + window
  EXPECT_TRUE(r.find("quest").budget_extra_param.empty());
  EXPECT_TRUE(r.find("tactic").budget_param.empty());
  EXPECT_EQ(r.find(kDenseMethod).kind, MethodKind::decode_and_prefill);
  EXPECT_EQ(r.find_if_known("no_such_method"), nullptr);

  Registry mine;
  MethodInfo x = r.find("quest");
  x.kind = MethodKind::prefill;
  check::expect_error([&] { mine.add(x); }, "kind prefill does not match its factories");
  MethodInfo y = r.find("quest");
  y.budget_param = "nope";
  check::expect_error([&] { mine.add(y); }, "no parameter 'nope'");
  Registry copy = r;
  EXPECT_FALSE(copy.attach_gpu("no_such_method", {.make = [](const cuda::DeviceKvView&, const Shape&, int,
                                                             const Params&) -> std::unique_ptr<cuda::SparseDecoder> {
    return nullptr;
  }}));
  check::expect_error([&] { copy.attach_gpu("quest", {}); }, "needs its factory");
}

// A method's parameters come from its options struct (methods/options.h): one spec per
// field in order, the default the field's initial value, the range and the choices as
// written there; Registry::check and the factories refuse what the constructor would.
TEST(Methods, RegistryParametersComeFromTheOptionsStructs) {
  const Registry& r = Registry::builtin();
  auto spec = [&](const std::string& method, const std::string& key) {
    for (const ParamSpec& p : r.find(method).params)
      if (p.name == key) return p;
    ADD_FAILURE() << method << " has no parameter " << key;
    return ParamSpec{};
  };
  const ParamSpec decay = spec("lfps", "r");  // LFPS section 5: 0.95, in [0, 1)
  EXPECT_EQ(decay.type, ParamType::kDouble);
  EXPECT_EQ(decay.default_value, "0.95");
  EXPECT_EQ(decay.min, 0.0);
  EXPECT_EQ(decay.max, 1.0);
  EXPECT_FALSE(decay.min_exclusive);
  EXPECT_TRUE(decay.max_exclusive);
  const ParamSpec mode = spec("tactic", "mode");
  EXPECT_EQ(mode.type, ParamType::kChoice);
  EXPECT_EQ(mode.default_value, "fit");
  EXPECT_EQ(mode.choices, (std::vector<std::string>{"fit", "cluster_optimal"}));
  EXPECT_EQ(spec("tactic", "seed").type, ParamType::kInt);
  EXPECT_EQ(spec("sketch_topp", "rest").default_value, "mean");
  EXPECT_EQ(spec("sketch_topp", "gpu_dense_mib").default_value, "256");
  EXPECT_EQ(spec("psa", "threshold").default_value, "0.95");
  EXPECT_EQ(spec("quest", "budget").default_value, "2048");
  EXPECT_EQ(spec("streaming", "window").default_value, "2044");
  EXPECT_EQ(spec("flexprefill", "min_budget").default_value, "1024");
  std::vector<std::string> names;
  for (const ParamSpec& p : r.find("psa").params) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"threshold", "microbatch", "criticality", "stop"}));

  const Shape s{2, 4, 2, 32};
  check::expect_error([&] { r.check("lfps", {{"r", "1"}}); }, "parameter r=1 must be in [0, 1)");
  EXPECT_NO_THROW(r.check("lfps", {{"r", "0"}}));
  check::expect_error([&] { r.check("psa", {{"threshold", "0"}}); }, "threshold=0 must be in (0, 1]");
  check::expect_error([&] { r.check("tactic", {{"p1", "0.6"}}); }, "p1=0.6 and p2=0.6 need p1 < p2");
  check::expect_error([&] { r.make("tactic", s, {{"p2", "0.05"}}); }, "need p1 < p2");
  check::expect_error([&] { r.check("tactic", {{"mode", "best"}}); }, "mode='best' must be fit or cluster_optimal");
  check::expect_error([&] { r.check("flexprefill", {{"max_budget", "8"}}); }, "max_budget=8 is below min_budget=1024");
  // quest's dense_layers against the model's layers: only with a shape, and in make.
  EXPECT_NO_THROW(r.check("quest", {{"dense_layers", "3"}}));
  EXPECT_NO_THROW(r.check("quest", {{"dense_layers", "2"}}, &s));
  check::expect_error([&] { r.check("quest", {{"dense_layers", "3"}}, &s); }, "dense_layers=3 exceeds the model's 2 layers");
  check::expect_error([&] { r.make("quest", s, {{"dense_layers", "3"}}); }, "exceeds the model's 2 layers");
}

TEST(Methods, OracleTopPReachesPWithFewestTokens) {
  // Group 1: the union is the head's own set, so its size must equal the minimal count
  // computed here in float64.
  for (double p : {0.5, 0.9, 0.99}) {
    Fixture f = make_fixture({1, 4, 4, 32}, 1000, 11);
    AttnOutput out = run("oracle_topp", f, {{"p", std::to_string(p)}});
    for (int qh = 0; qh < f.shape.n_q_heads; ++qh) {
      expect_minimal_set(f, qh, p, out.selection.tokens[qh].size());
      EXPECT_GE(out.stats[qh].mass_claimed, p - 1e-5);
      EXPECT_GE(out.stats[qh].mass_true, p - 1e-4);
    }
  }
}

TEST(Methods, TrueMassCoversTheClaim) {
  for (const Shape& s : kShapes) {
    Fixture f = make_fixture(s, 777, 5);
    for (const char* m : {"oracle_topp", "oracle_topk"}) {
      AttnOutput out = run(m, f, {});
      for (int qh = 0; qh < s.n_q_heads; ++qh)
        EXPECT_GE(out.stats[qh].mass_true, out.stats[qh].mass_claimed - 1e-4) << m << " head " << qh;
    }
  }
}

TEST(Methods, AtFullMassEveryMethodEqualsDense) {
  for (const Shape& s : kShapes) {
    Fixture f = make_fixture(s, 300, 9);
    AttnOutput dense = run("dense", f, {});
    for (int qh = 0; qh < s.n_q_heads; ++qh) {
      EXPECT_NEAR(dense.stats[qh].mass_true, 1.0, 1e-5);
      EXPECT_LT(dense.stats[qh].out_err, 1e-5);
    }
    const std::vector<std::pair<std::string, std::map<std::string, std::string>>> full = {
        {"oracle_topp", {{"p", "1"}}},
        {"oracle_topk", {{"k", "300"}}},
        {"streaming", {{"sinks", "4"}, {"window", "296"}}},
        {"quest", {{"budget", "300"}}},
        {"sketch_topp", {{"p", "1"}, {"min_context", "0"}}}};
    for (const auto& [m, params] : full) {
      AttnOutput out = run(m, f, params);
      EXPECT_LT(rel_err(out.out, dense.out), 1e-5) << m;
    }
  }
}

TEST(Methods, OutputErrorWithinTheBound) {
  // ||o - o~|| <= 2 (1 - p) max ||v|| (Tactic Appendix A) with p the true mass of the set.
  for (const Shape& s : kShapes) {
    Fixture f = make_fixture(s, 2000, 21);
    const std::vector<std::pair<std::string, std::map<std::string, std::string>>> runs = {
        {"oracle_topp", {{"p", "0.8"}}},
        {"oracle_topk", {{"k", "64"}}},
        {"streaming", {{"sinks", "4"}, {"window", "100"}}},
        {"quest", {{"budget", "128"}}},
        // The bound is for attention over a set: rest=none (rest=mean adds an estimate of
        // what was left out; SketchTopp.RestMeanAddsTheEstimatedRestTimesTheMeanValue).
        {"sketch_topp", {{"p", "0.8"}, {"min_context", "0"}, {"rest", "none"}}}};
    for (const auto& [m, params] : runs) {
      AttnOutput out = run(m, f, params);
      for (int qh = 0; qh < s.n_q_heads; ++qh) {
        const double bound = 2 * (1 - out.stats[qh].mass_true) * max_value_norm(f, qh / s.group());
        EXPECT_LE(out.stats[qh].out_err, bound + 1e-4) << m << " head " << qh;
      }
    }
  }
}

TEST(Methods, StreamingAttendsSinksAndWindow) {
  Fixture f = make_fixture({1, 8, 2, 64}, 500, 3);
  AttnOutput out = run("streaming", f, {{"sinks", "4"}, {"window", "50"}});
  std::vector<int32_t> want;
  for (int i = 0; i < 4; ++i) want.push_back(i);
  for (int i = 450; i < 500; ++i) want.push_back(i);
  for (const auto& t : out.selection.tokens) EXPECT_EQ(t, want);
  for (const auto& st : out.stats) {
    EXPECT_EQ(st.tokens_attended, 54);
    EXPECT_TRUE(std::isnan(st.mass_claimed));
  }
  // Window larger than the cache: everything, once.
  AttnOutput all = run("streaming", f, {{"sinks", "4"}, {"window", "5000"}});
  for (const auto& t : all.selection.tokens) EXPECT_EQ(t.size(), 500u);
}

TEST(Methods, QuestAttendsTheTopBoundPages) {
  for (const Shape& s : kShapes) {
    Fixture f = make_fixture(s, 1001, 17);  // 63 pages, the last one partial
    const int budget = 80;                   // 5 pages per query head
    AttnOutput out = run("quest", f, {{"budget", std::to_string(budget)}});
    const int d = s.head_dim, ps = f.kv.page_size(), n = f.kv.n_tokens(0);
    const int n_pages = (n + ps - 1) / ps;
    std::vector<float> key(d);
    for (int kvh = 0; kvh < s.n_kv_heads; ++kvh) {
      std::set<int32_t> want;
      for (int j = 0; j < s.group(); ++j) {
        const int qh = kvh * s.group() + j;
        std::vector<std::pair<double, int>> bound(n_pages);
        for (int p = 0; p < n_pages; ++p) {
          std::vector<double> lo(d, 1e300), hi(d, -1e300);
          for (int t = p * ps; t < std::min(n, (p + 1) * ps); ++t) {
            f.kv.key_f32(0, kvh, t, key.data());
            for (int i = 0; i < d; ++i) lo[i] = std::min(lo[i], double(key[i])), hi[i] = std::max(hi[i], double(key[i]));
          }
          double b = 0;
          for (int i = 0; i < d; ++i) b += std::max(f.q[qh * d + i] * lo[i], f.q[qh * d + i] * hi[i]);
          bound[p] = {-b, p};
        }
        std::sort(bound.begin(), bound.end());
        for (int r = 0; r < budget / ps; ++r)
          for (int t = bound[r].second * ps; t < std::min(n, (bound[r].second + 1) * ps); ++t) want.insert(t);
      }
      std::set<int32_t> got(out.selection.tokens[kvh].begin(), out.selection.tokens[kvh].end());
      EXPECT_EQ(got, want) << "kv head " << kvh;
    }
  }
}

// dense_layers: layers below it attend every token (output equal to dense), the others
// select exactly as without the parameter.
TEST(Methods, QuestDenseLayersAttendEverything) {
  const Shape s{3, 8, 2, 64};
  Fixture one = make_fixture({1, 8, 2, 64}, 700, 23);
  KvCache kv(s, KvCacheOptions{});
  std::vector<float> k(static_cast<size_t>(s.n_kv_heads) * s.head_dim), v(k.size());
  for (int t = 0; t < one.kv.n_tokens(0); ++t) {
    for (int h = 0; h < s.n_kv_heads; ++h) {
      one.kv.key_f32(0, h, t, k.data() + h * s.head_dim);
      one.kv.value_f32(0, h, t, v.data() + h * s.head_dim);
    }
    for (int layer = 0; layer < s.n_layers; ++layer) kv.append(layer, k.data(), v.data(), 1);
  }
  ThreadPool pool(2);
  DecodeContext ctx{&pool, true};
  auto decode = [&](const std::string& method, const std::map<std::string, std::string>& params, int layer) {
    auto m = Registry::builtin().make(method, s, params);
    for (int l = 0; l < s.n_layers; ++l) m->on_prefill(l, kv, ctx);
    AttnOutput out;
    decode_step(*m, layer, one.q.data(), kv, ctx, out);
    return out;
  };
  const std::map<std::string, std::string> sparse{{"budget", "64"}}, mixed{{"budget", "64"}, {"dense_layers", "2"}};
  for (int layer = 0; layer < s.n_layers; ++layer) {
    const AttnOutput got = decode("quest", mixed, layer);
    if (layer < 2) {
      const AttnOutput want = decode("dense", {}, layer);
      EXPECT_LT(rel_err(got.out, want.out), 1e-5) << "layer " << layer;
      for (const auto& st : got.stats) {
        EXPECT_EQ(st.tokens_attended, 700) << "layer " << layer;
        EXPECT_EQ(st.mass_claimed, 1.0);
      }
    } else {
      const AttnOutput want = decode("quest", sparse, layer);
      EXPECT_EQ(got.selection.tokens, want.selection.tokens);
      EXPECT_EQ(got.out, want.out);
      for (const auto& st : got.stats) EXPECT_LT(st.tokens_attended, 700);
    }
  }
}

TEST(Methods, ThreadCountDoesNotChangeResults) {
  Fixture f = make_fixture({1, 8, 2, 64}, 5000, 4);
  for (const char* m : {"dense", "oracle_topp", "oracle_topk", "streaming", "quest"}) {
    AttnOutput a = run(m, f, {}, 1, false), b = run(m, f, {}, 2, false);
    EXPECT_EQ(a.out, b.out) << m;
    EXPECT_EQ(a.selection.tokens, b.selection.tokens) << m;
    for (size_t qh = 0; qh < a.stats.size(); ++qh) {
      const double ca = a.stats[qh].mass_claimed, cb = b.stats[qh].mass_claimed;
      EXPECT_TRUE(ca == cb || (std::isnan(ca) && std::isnan(cb))) << m << " head " << qh;
    }
  }
}

TEST(Methods, BadInputNamesTheValue) {
  const Shape s{1, 8, 2, 64};
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, wanted one mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const Registry& r = Registry::builtin();
  expect_error([&] { r.make("oracle_topp", s, {{"p", "0"}}); }, "p=0");
  expect_error([&] { r.make("oracle_topp", s, {{"p", "1.5"}}); }, "p=1.5");
  expect_error([&] { r.make("oracle_topp", s, {{"p", "nan"}}); }, "p='nan'");
  expect_error([&] { r.make("oracle_topk", s, {{"k", "0"}}); }, "k=0");
  expect_error([&] { r.make("oracle_topk", s, {{"k", "2.5"}}); }, "k='2.5'");
  expect_error([&] { r.make("quest", s, {{"pages", "3"}}); }, "'pages'");
  expect_error([&] { r.make("nope", s); }, "method='nope'");
  expect_error([&] { r.make("dense", Shape{1, 9, 4, 64}); }, "n_q_heads=9");
  expect_error([&] { r.make("dense", Shape{1, 8, 2, 0}); }, "head_dim=0");

  KvCache empty(s);
  auto m = r.make("dense", s);
  ThreadPool pool(1);
  DecodeContext ctx{&pool, false};
  std::vector<float> q(static_cast<size_t>(s.n_q_heads) * s.head_dim, 0.5f);
  AttnOutput out;
  expect_error([&] { decode_step(*m, 0, q.data(), empty, ctx, out); }, "empty cache");

  Fixture f = make_fixture(s, 20, 1);
  f.q[3 * 64 + 7] = std::nanf("");
  expect_error([&] { decode_step(*m, 0, f.q.data(), f.kv, ctx, out); }, "q[head=3][dim=7]=nan");
  f.q[3 * 64 + 7] = INFINITY;
  expect_error([&] { decode_step(*m, 0, f.q.data(), f.kv, ctx, out); }, "q[head=3][dim=7]=inf");
  expect_error([&] { decode_step(*m, 1, f.q.data(), f.kv, ctx, out); }, "layer=1");
}

namespace {

// The sketch sketch_topp builds from a fixture's cache (the channels of every token at
// on_prefill, then every token encoded), and the bound of each token's estimate error
// (raw logit; kernels/sketch.h): sum_c |q_c scale_c| step_t / 2 + step_t (qstep / 2) sum_c u_tc.
std::vector<double> sketch_error_bound(const Fixture& f, int qh) {
  const int d = f.shape.head_dim, n = f.kv.n_tokens(0);
  const PagedHeadView v = f.kv.view(0, qh / f.shape.group());
  const size_t blocks = static_cast<size_t>((n + kSketchBlock - 1) / kSketchBlock);
  std::vector<uint8_t> codes(blocks * key_sketch_block_bytes(d));
  std::vector<uint16_t> off(blocks * kSketchBlock), st(off.size());
  std::vector<float> center(d), scale(d);
  key_sketch_channels(v, center.data(), scale.data());
  key_sketch_encode(v, 0, n, center.data(), scale.data(), {codes.data(), off.data(), st.data()});
  const KeySketchView s{codes.data(), off.data(), st.data(), center.data(), scale.data(), n, d};
  std::vector<int8_t> q8(d);
  const SketchQuery sq = key_sketch_quantize_query(s, f.q.data() + static_cast<size_t>(qh) * d, q8.data());
  double qabs = 0;
  for (int c = 0; c < d; ++c) qabs += std::abs(static_cast<double>(f.q[qh * d + c]) * scale[c]);
  std::vector<double> bound(n);
  for (int t = 0; t < n; ++t) {
    double usum = 0;
    for (int c = 0; c < d; ++c) {
      const uint8_t b = codes[static_cast<size_t>(t / 16) * key_sketch_block_bytes(d) + (c / 8) * 64 + (t % 16) * 4 + c % 4];
      usum += (c % 8) < 4 ? (b & 0x0F) : (b >> 4);
    }
    const double stp = f16_to_f32(st[t]);
    bound[t] = qabs * stp / 2 + stp * sq.qstep / 2 * usum;
  }
  return bound;
}

}  // namespace

// A head's claim is A / (A + R_est): A its exact mass over the union (from the attention's
// log-sum-exp), R_est the sketch's estimate of the tokens not read. The true mass is
// A / (A + R_true), so (1/claim - 1) / (1/true - 1) = R_est / R_true, which the
// quantisation bound confines to exp(+-scale max_t bound_t) over the tokens not read.
// Every sparse head also claims at least P, and the union holds the sinks and the recent
// tokens, sorted.
TEST(SketchTopp, ClaimsAreExactOverTheUnionAndBoundedForTheRest) {
  int sparse_heads = 0;
  for (const Shape& s : kShapes) {
    Fixture f = make_fixture(s, 3000, 17, DType::f16, 3.0f, 32);
    AttnOutput out = run("sketch_topp", f, {{"min_context", "0"}});
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
    for (int h = 0; h < s.n_kv_heads; ++h) {
      const auto& t = out.selection.tokens[h];
      EXPECT_TRUE(std::is_sorted(t.begin(), t.end()));
      EXPECT_EQ(std::adjacent_find(t.begin(), t.end()), t.end());
      for (int i : {0, 1, 2, 3, 2936, 2999}) EXPECT_TRUE(std::binary_search(t.begin(), t.end(), i)) << i;
      const bool dense = t.size() == 3000u;
      sparse_heads += dense ? 0 : 1;
      for (int j = 0; j < s.group(); ++j) {
        const int qh = h * s.group() + j;
        const StepStats& st = out.stats[qh];
        EXPECT_EQ(st.tokens_attended, static_cast<int>(t.size()));
        if (dense) {
          EXPECT_EQ(st.mass_claimed, 1.0);
          continue;
        }
        EXPECT_GE(st.mass_claimed, 0.9 - 1e-6) << "kv head " << h << " query " << j;
        const std::vector<double> bound = sketch_error_bound(f, qh);
        double worst = 0;
        for (int i = 0; i < 3000; ++i)
          if (!std::binary_search(t.begin(), t.end(), i)) worst = std::max(worst, bound[i]);
        const double ratio = (1 / st.mass_claimed - 1) / (1 / st.mass_true - 1);
        EXPECT_LE(ratio, std::exp(scale * worst) * 1.001) << "kv head " << h << " query " << j;
        EXPECT_GE(ratio, std::exp(-scale * worst) / 1.001) << "kv head " << h << " query " << j;
      }
    }
  }
  EXPECT_GE(sparse_heads, 6) << "the fixtures should leave most kv heads sparse";
}

// A union chosen at a small estimated share falls short of P; the rounds add tokens (and
// at the end the rest of the context) until every head's claim reaches P.
TEST(SketchTopp, HeadsShortOfPGetMoreTokens) {
  for (const Shape& s : kShapes) {
    Fixture f = make_fixture(s, 3000, 41, DType::f16, 3.0f, 32);
    AttnOutput out = run("sketch_topp", f, {{"min_context", "0"}, {"candidate_p", "0.05"}, {"dense_above", "1"}});
    for (int qh = 0; qh < s.n_q_heads; ++qh) {
      EXPECT_GE(out.stats[qh].mass_claimed, 0.9 - 1e-6) << "head " << qh;
      EXPECT_GE(out.stats[qh].mass_true, 0.85) << "head " << qh;
    }
    for (const auto& t : out.selection.tokens) {
      EXPECT_TRUE(std::is_sorted(t.begin(), t.end()));
      EXPECT_EQ(std::adjacent_find(t.begin(), t.end()), t.end());
    }
  }
}

// The sketch follows the cache: a token appended after on_prefill that holds most of a
// head's mass (its key along that head's query), outside the recent window, is found and
// attended; after the cache is cut back below it, and another such token appended
// elsewhere, that one is found instead.
TEST(SketchTopp, SketchFollowsAppendsAndTruncation) {
  const Shape s{1, 4, 1, 64};
  Fixture f = make_fixture(s, 2000, 5);
  auto m = Registry::builtin().make("sketch_topp", s, {{"min_context", "0"}, {"recent", "16"}});
  ThreadPool pool(2);
  DecodeContext ctx{&pool, true};
  m->on_prefill(0, f.kv, ctx);
  AttnOutput out;
  decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
  auto append = [&](int count, int needle) {
    std::mt19937 rng(static_cast<uint32_t>(needle));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> k(64), v(64);
    for (int i = 0; i < count; ++i) {
      const int pos = f.kv.n_tokens(0);
      for (int c = 0; c < 64; ++c) {
        k[c] = pos == needle ? 2.0f * f.q[c] : 0.6f * nd(rng);
        v[c] = nd(rng);
      }
      f.kv.append(0, k.data(), v.data(), 1);
    }
  };
  append(100, 2030);
  decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
  EXPECT_TRUE(std::binary_search(out.selection.tokens[0].begin(), out.selection.tokens[0].end(), 2030));
  EXPECT_GE(out.stats[0].mass_true, 0.9);
  f.kv.truncate(2000);
  append(100, 2050);
  decode_step(*m, 0, f.q.data(), f.kv, ctx, out);
  const auto& t = out.selection.tokens[0];
  EXPECT_TRUE(std::binary_search(t.begin(), t.end(), 2050));
  EXPECT_GE(out.stats[0].mass_true, 0.9);
  for (int qh = 0; qh < 4; ++qh) EXPECT_GE(out.stats[qh].mass_claimed, 0.9 - 1e-6);
  // Found by the sketch, not by the rounds' fall-back to every token (which would hold
  // token 2050 and reach P with a stale sketch too): the union stays sparse.
  EXPECT_LT(t.size(), 2100u / 4) << "the union fell back to dense";
}

// The cost rule: contexts of at most min_context tokens attend every token and claim 1.
TEST(SketchTopp, ShortContextsAttendDensely) {
  Fixture f = make_fixture({1, 8, 2, 64}, 900, 5);
  AttnOutput dense = run("dense", f, {});
  AttnOutput out = run("sketch_topp", f, {});  // min_context defaults to 1024
  for (const auto& t : out.selection.tokens) EXPECT_EQ(t.size(), 900u);
  for (const auto& st : out.stats) EXPECT_EQ(st.mass_claimed, 1.0);
  // Two float32 sums over 900 tokens in different orders (the sparse kernel over every
  // token against the dense one): 1.3e-6 apart on the scalar target (CUMULUS_SIMD=scalar).
  EXPECT_LT(rel_err(out.out, dense.out), 1e-5);
}

// rest=mean: o = claim o_U + (1 - claim) vbar, with o_U attention over the union and vbar
// the mean value row of the head (both in float64 here); the set and the claim are those
// of the default.
TEST(SketchTopp, RestMeanAddsTheEstimatedRestTimesTheMeanValue) {
  const Shape s{1, 8, 2, 64};
  Fixture f = make_fixture(s, 3000, 29, DType::f16, 3.0f, 32);
  AttnOutput plain = run("sketch_topp", f, {{"min_context", "0"}, {"rest", "none"}});
  AttnOutput out = run("sketch_topp", f, {{"min_context", "0"}});  // rest=mean is the default
  const int d = s.head_dim, n = 3000;
  std::vector<float> v(d);
  for (int h = 0; h < s.n_kv_heads; ++h) {
    EXPECT_EQ(out.selection.tokens[h], plain.selection.tokens[h]);
    std::vector<double> vbar(d, 0.0);
    for (int t = 0; t < n; ++t) {
      f.kv.value_f32(0, h, t, v.data());
      for (int c = 0; c < d; ++c) vbar[c] += v[c] / n;
    }
    for (int j = 0; j < s.group(); ++j) {
      const int qh = h * s.group() + j;
      const double claim = out.stats[qh].mass_claimed;
      EXPECT_EQ(claim, plain.stats[qh].mass_claimed);
      const std::vector<double> pr = true_probs(f, qh);
      std::vector<double> ou(d, 0.0);
      double a = 0;
      for (int t : out.selection.tokens[h]) a += pr[t];
      for (int t : out.selection.tokens[h]) {
        f.kv.value_f32(0, h, t, v.data());
        for (int c = 0; c < d; ++c) ou[c] += pr[t] / a * v[c];
      }
      double num = 0, den = 0;
      for (int c = 0; c < d; ++c) {
        const double want = claim * ou[c] + (1 - claim) * vbar[c];
        num += (out.out[qh * d + c] - want) * (out.out[qh * d + c] - want);
        den += want * want;
      }
      EXPECT_LT(std::sqrt(num / den), 1e-5) << "head " << qh;
      EXPECT_LT(claim, 1.0);  // something was left out, so the test sees the correction
    }
  }
  EXPECT_THROW(run("sketch_topp", f, {{"rest", "median"}}), Error);
}
