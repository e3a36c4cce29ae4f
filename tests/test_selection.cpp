// Selection ops: the CPU backend returns exactly the reference's indices, in the same
// order, on fresh random inputs of awkward sizes, including heavy ties; top-k holds the k
// largest with ties to the lower index; top_mass returns the fewest indices reaching p
// (dropping the last falls short, and no set of the same size holds more);
// cumulative_prefix is the first prefix reaching the threshold; bad input names the value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kernels/selection.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

using check::expect_error;

const int kSizes[] = {1, 3, 15, 16, 17, 255, 4097, 20000};

// Random scores of three kinds: continuous (few ties), few distinct levels (many ties,
// -0 and +0 among them), and a peaked softmax-like distribution.
std::vector<float> random_values(std::mt19937& rng, int n, int kind, bool nonnegative) {
  std::vector<float> x(n);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : x) {
    switch (kind) {
      case 0: v = nd(rng); break;
      case 1: v = static_cast<float>(static_cast<int>(rng() % 5) - 2) * 0.5f; break;  // includes 0
      default: v = std::exp(4.0f * nd(rng)); break;
    }
    if (nonnegative) v = std::fabs(v);
  }
  if (kind == 1 && n > 2) x[n / 2] = -0.0f;
  return x;
}

// float64 sum of weights over an index list, in list order.
double mass(const std::vector<float>& w, const std::vector<int32_t>& idx, size_t count) {
  double s = 0;
  for (size_t i = 0; i < count; ++i) s += w[idx[i]];
  return s;
}

}  // namespace

TEST(Selection, TopkCpuEqualsReferenceAndHoldsTheLargest) {
  std::mt19937 rng(11);
  SelectWorkspace ws;
  for (int n : kSizes) {
    for (int kind = 0; kind < 3; ++kind) {
      const std::vector<float> s = random_values(rng, n, kind, false);
      for (int k : {1, 2, 7, 16, n / 3 + 1, n / 16 + 1, n - 1, n, n + 5}) {
        if (k < 1) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " kind=" + std::to_string(kind) + " k=" + std::to_string(k));
        std::vector<int32_t> r, c = {42}, cw = {3};  // c, cw start dirty: the op must overwrite them
        ref::select_topk(s.data(), n, k, r);
        cpu::select_topk(s.data(), n, k, c);
        cpu::select_topk(s.data(), n, k, cw, &ws);  // one workspace through every size
        ASSERT_EQ(c, r);
        ASSERT_EQ(cw, r);
        ASSERT_EQ(static_cast<int>(r.size()), std::min(n, k));
        // Ordered by score descending, ties by lower index; nothing left out beats the last.
        for (size_t i = 1; i < r.size(); ++i) {
          ASSERT_TRUE(s[r[i - 1]] > s[r[i]] || (s[r[i - 1]] == s[r[i]] && r[i - 1] < r[i])) << i;
        }
        std::vector<char> chosen(n, 0);
        for (int32_t i : r) chosen[i] = 1;
        const int32_t last = r.back();
        for (int i = 0; i < n; ++i) {
          if (chosen[i]) continue;
          ASSERT_TRUE(s[i] < s[last] || (s[i] == s[last] && i > last)) << "index " << i << " should be chosen";
        }
      }
    }
  }
}

TEST(Selection, TopMassCpuEqualsReferenceAndIsMinimal) {
  std::mt19937 rng(12);
  SelectWorkspace ws;
  for (int n : kSizes) {
    for (int kind = 0; kind < 3; ++kind) {
      const std::vector<float> w = random_values(rng, n, kind, true);
      double total = 0;
      for (float x : w) total += x;
      for (double p : {1e-9, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " kind=" + std::to_string(kind) + " p=" + std::to_string(p));
        std::vector<int32_t> r, c = {7, 7}, cw = {1};
        ref::select_top_mass(w.data(), n, p, r);
        cpu::select_top_mass(w.data(), n, p, c);
        cpu::select_top_mass(w.data(), n, p, cw, &ws);  // one workspace through every size
        ASSERT_EQ(c, r);
        ASSERT_EQ(cw, r);
        ASSERT_GE(r.size(), 1u);
        std::vector<int32_t> sorted = r;
        std::sort(sorted.begin(), sorted.end());
        ASSERT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end()) << "duplicate index";
        const double target = p * total;
        const double got = mass(w, r, r.size());
        if (r.size() < static_cast<size_t>(n)) {
          ASSERT_GE(got, target);
        }
        // Fewest: without the last index the set falls short (an all-zero input, target 0,
        // still gets one index).
        if (target > 0) {
          ASSERT_LT(mass(w, r, r.size() - 1), target);
        } else {
          ASSERT_EQ(r.size(), 1u);
        }
        // No set of the same size holds more: every index left out weighs no more than the
        // lightest chosen one (so swapping can only lose mass), checked also on random
        // subsets of the same size.
        std::vector<char> chosen(n, 0);
        for (int32_t i : r) chosen[i] = 1;
        const float lightest = w[r.back()];
        for (int i = 0; i < n; ++i) {
          if (!chosen[i]) {
            ASSERT_LE(w[i], lightest) << "index " << i;
          }
        }
        std::vector<int32_t> perm(n);
        std::iota(perm.begin(), perm.end(), 0);
        for (int trial = 0; trial < 5; ++trial) {
          std::shuffle(perm.begin(), perm.end(), rng);
          ASSERT_LE(mass(w, perm, r.size()), got * (1 + 1e-12));
        }
      }
    }
  }
}

TEST(Selection, TopMassTiesGoToLowerIndexAndFullMassTakesEverythingPositive) {
  // Four equal weights of 0.25: p = 0.5 needs two, and the lower indices win.
  const std::vector<float> w = {0.25f, 0.25f, 0.25f, 0.25f};
  using TopMass = std::function<void(const float*, int, double, std::vector<int32_t>&)>;
  for (const TopMass& fn : {TopMass(ref::select_top_mass), TopMass([](const float* x, int n, double p,
                                                                       std::vector<int32_t>& o) {
                              cpu::select_top_mass(x, n, p, o);
                            })}) {
    std::vector<int32_t> out;
    fn(w.data(), 4, 0.5, out);
    EXPECT_EQ(out, (std::vector<int32_t>{0, 1}));
    fn(w.data(), 4, 0.50001, out);
    EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2}));
    const std::vector<float> z = {0.0f, 0.0f, 0.0f};
    fn(z.data(), 3, 0.9, out);  // all zero: the first index alone (at least one chosen)
    EXPECT_EQ(out, (std::vector<int32_t>{0}));
    const std::vector<float> mixed = {0.0f, 0.5f, 0.0f, 0.125f, 0.375f};
    fn(mixed.data(), 5, 1.0, out);  // exact binary fractions: the sum reaches 1 exactly
    EXPECT_EQ(out, (std::vector<int32_t>{1, 4, 3}));
    fn(mixed.data(), 0, 0.5, out);
    EXPECT_TRUE(out.empty());
  }
}

TEST(Selection, CumulativePrefixCpuEqualsReferenceAndIsTheFirstToReach) {
  std::mt19937 rng(13);
  for (int n : kSizes) {
    for (int kind = 0; kind < 3; ++kind) {
      const std::vector<float> v = random_values(rng, n, kind, true);
      double total = 0;
      for (float x : v) total += x;
      for (double frac : {-1.0, 0.0, 1e-9, 0.3, 0.5, 0.999, 1.0, 1.5}) {
        const double threshold = frac * total;
        SCOPED_TRACE("n=" + std::to_string(n) + " kind=" + std::to_string(kind) + " frac=" + std::to_string(frac));
        const int r = ref::select_cumulative_prefix(v.data(), n, threshold);
        ASSERT_EQ(cpu::select_cumulative_prefix(v.data(), n, threshold), r);
        double before = 0;  // sum of the first r - 1
        for (int i = 0; i + 1 < r; ++i) before += v[i];
        const double at = r > 0 ? before + v[r - 1] : 0.0;
        if (threshold <= 0) {
          ASSERT_EQ(r, 0);
        } else if (r < n) {
          ASSERT_GE(at, threshold);
          ASSERT_LT(before, threshold);
        } else {
          ASSERT_LT(before, threshold);  // either the last one reaches it or nothing does
        }
      }
    }
  }
}

TEST(Selection, BadInputNamesTheValue) {
  const std::vector<float> w = {0.5f, 0.25f, NAN, 0.25f};
  const std::vector<float> neg = {0.5f, -0.25f};
  std::vector<int32_t> out;
  for (int backend = 0; backend < 2; ++backend) {
    auto topk = [backend](const float* x, int n, int k, std::vector<int32_t>& o) {
      backend ? cpu::select_topk(x, n, k, o) : ref::select_topk(x, n, k, o);
    };
    auto top_mass = [backend](const float* x, int n, double p, std::vector<int32_t>& o) {
      backend ? cpu::select_top_mass(x, n, p, o) : ref::select_top_mass(x, n, p, o);
    };
    auto prefix = backend ? cpu::select_cumulative_prefix : ref::select_cumulative_prefix;
    expect_error([&] { topk(w.data(), 2, 0, out); }, "k=0 must be >= 1");
    expect_error([&] { topk(w.data(), 4, 2, out); }, "scores[2]=nan");
    expect_error([&] { topk(w.data(), -1, 2, out); }, "n=-1");
    expect_error([&] { topk(nullptr, 3, 2, out); }, "scores must be non-null");
    expect_error([&] { top_mass(w.data(), 2, 0.0, out); }, "p=0 must be in (0, 1]");
    expect_error([&] { top_mass(w.data(), 2, 1.5, out); }, "p=1.5 must be in (0, 1]");
    expect_error([&] { top_mass(w.data(), 2, NAN, out); }, "p=nan");
    expect_error([&] { top_mass(w.data(), 4, 0.5, out); }, "weights[2]=nan");
    expect_error([&] { top_mass(neg.data(), 2, 0.5, out); }, "weights[1]=-0.25");
    expect_error([&] { prefix(w.data(), 4, 0.9); }, "values[2]=nan");
    expect_error([&] { prefix(neg.data(), 2, 0.6); }, "values[1]=-0.25");
    expect_error([&] { prefix(w.data(), 2, NAN); }, "threshold=nan");
  }
}
