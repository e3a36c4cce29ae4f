// K-means ops: the SIMD backend against the float64 reference on fresh random rows of
// awkward sizes (1, 3, 15, 16, 17, 255, 4097 rows), several centroid counts and dims, on
// every SIMD target this binary carries, never on zeros. Assignments compare exactly
// except at near-ties (where float32 may pick the other centroid: then both distances must
// agree within rounding); updates and scores compare by normalised error. Lloyd's loop
// built from the ops converges on clustered data; kmeans_lloyd (bounds) equals that loop bit
// for bit and skips most distances; bad input names the value.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kernels/kmeans.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

using check::for_each_target;

// float32 against float64 accumulation, relative to the sum of |terms|.
constexpr double kTol = 1e-5;

std::vector<float> random_rows(int n, int dim, std::mt19937& rng, float offset = 0.3f) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n) * dim);
  for (auto& v : x) v = nd(rng) + offset;
  return x;
}

double dist2(const float* a, const float* b, int dim) {
  double s = 0;
  for (int j = 0; j < dim; ++j) s += (static_cast<double>(a[j]) - b[j]) * (static_cast<double>(a[j]) - b[j]);
  return s;
}

}  // namespace

TEST(Kmeans, AssignMatchesReference) {
  std::mt19937 rng(7);
  for_each_target([&] {
    for (int n : {1, 3, 15, 16, 17, 255, 4097})
      for (int k : {1, 3, 4, 17})
        for (int dim : {8, 20, 64, 128, 256}) {  // 256: Gemma 3
          std::vector<float> x = random_rows(n, dim, rng), c = random_rows(k, dim, rng);
          std::vector<int32_t> a_ref(n, -1), a_cpu(n, -1);
          const int64_t ch_ref = ref::kmeans_assign(x.data(), n, dim, c.data(), k, a_ref.data());
          ThreadPool pool(2);
          const int64_t ch_cpu = cpu::kmeans_assign(x.data(), n, dim, c.data(), k, a_cpu.data(), &pool);
          EXPECT_EQ(ch_ref, n);
          EXPECT_EQ(ch_cpu, n);
          for (int i = 0; i < n; ++i) {
            if (a_ref[i] == a_cpu[i]) continue;
            const float* xi = x.data() + static_cast<size_t>(i) * dim;
            const double dr = dist2(xi, c.data() + static_cast<size_t>(a_ref[i]) * dim, dim);
            const double dc = dist2(xi, c.data() + static_cast<size_t>(a_cpu[i]) * dim, dim);
            EXPECT_NEAR(dc, dr, 1e-4 * (1 + dr)) << "n=" << n << " k=" << k << " dim=" << dim << " row " << i;
          }
          // A second pass with the same centroids changes nothing.
          EXPECT_EQ(cpu::kmeans_assign(x.data(), n, dim, c.data(), k, a_cpu.data(), &pool), 0);
        }
  });
}

TEST(Kmeans, ThreadCountDoesNotChangeAssignment) {
  std::mt19937 rng(3);
  std::vector<float> x = random_rows(4097, 64, rng), c = random_rows(256, 64, rng);
  std::vector<int32_t> a1(4097, -1), a2(4097, -1);
  ThreadPool p1(1), p2(2);
  cpu::kmeans_assign(x.data(), 4097, 64, c.data(), 256, a1.data(), &p1);
  cpu::kmeans_assign(x.data(), 4097, 64, c.data(), 256, a2.data(), &p2);
  EXPECT_EQ(a1, a2);
}

TEST(Kmeans, UpdateMatchesReference) {
  std::mt19937 rng(11);
  for_each_target([&] {
    for (int n : {1, 3, 15, 16, 17, 255, 4097})
      for (int k : {1, 3, 17})
        for (int dim : {8, 20, 64}) {
          std::vector<float> x = random_rows(n, dim, rng), c0 = random_rows(k, dim, rng);
          std::vector<int32_t> a(n);
          for (auto& v : a) v = static_cast<int32_t>(rng() % k);
          std::vector<float> c_ref = c0, c_cpu = c0;
          std::vector<int32_t> n_ref(k), n_cpu(k);
          ref::kmeans_update(x.data(), n, dim, a.data(), k, c_ref.data(), n_ref.data());
          cpu::kmeans_update(x.data(), n, dim, a.data(), k, c_cpu.data(), n_cpu.data());
          EXPECT_EQ(n_ref, n_cpu);
          for (int cc = 0; cc < k; ++cc) {
            double num = 0, den = 0;
            for (int j = 0; j < dim; ++j) {
              const size_t o = static_cast<size_t>(cc) * dim + j;
              num += std::abs(static_cast<double>(c_cpu[o]) - c_ref[o]);
              den += std::abs(static_cast<double>(c_ref[o]));
            }
            EXPECT_LE(num, kTol * (den + dim)) << "n=" << n << " k=" << k << " centroid " << cc;
            if (n_ref[cc] == 0) {  // empty clusters keep their centroid
              for (int j = 0; j < dim; ++j) {
                EXPECT_EQ(c_cpu[static_cast<size_t>(cc) * dim + j], c0[static_cast<size_t>(cc) * dim + j]);
              }
            }
          }
        }
  });
}

TEST(Kmeans, CentroidScoreMatchesReference) {
  std::mt19937 rng(5);
  for_each_target([&] {
    for (int k : {1, 3, 15, 16, 17, 255})
      for (int n_q : {1, 3, 4, 8})
        for (int dim : {8, 64, 128}) {
          std::vector<float> c = random_rows(k, dim, rng), q = random_rows(n_q, dim, rng);
          std::vector<float> s_ref(static_cast<size_t>(n_q) * k), s_cpu(s_ref.size());
          ref::kmeans_centroid_score(c.data(), k, dim, q.data(), n_q, s_ref.data());
          cpu::kmeans_centroid_score(c.data(), k, dim, q.data(), n_q, s_cpu.data());
          for (int h = 0; h < n_q; ++h)
            for (int cc = 0; cc < k; ++cc) {
              double mag = 0;
              for (int j = 0; j < dim; ++j)
                mag += std::abs(static_cast<double>(q[static_cast<size_t>(h) * dim + j]) * c[static_cast<size_t>(cc) * dim + j]);
              const size_t o = static_cast<size_t>(h) * k + cc;
              EXPECT_LE(std::abs(static_cast<double>(s_cpu[o]) - s_ref[o]), kTol * mag) << "k=" << k << " dim=" << dim;
            }
        }
  });
}

TEST(Kmeans, LloydConvergesOnClusteredRows) {
  // 8 well-separated centres, 50 rows each; initialised from one row of each centre, the
  // loop must stop (no assignment changes) within 10 iterations and recover the groups.
  std::mt19937 rng(9);
  const int dim = 32, k = 8, per = 50, n = k * per;
  std::vector<float> centres = random_rows(k, dim, rng, 0.0f);
  for (auto& v : centres) v *= 10.0f;
  std::normal_distribution<float> nd(0.0f, 0.5f);
  std::vector<float> x(static_cast<size_t>(n) * dim);
  std::vector<int> truth(n);
  for (int i = 0; i < n; ++i) {
    truth[i] = i % k;
    for (int j = 0; j < dim; ++j) x[static_cast<size_t>(i) * dim + j] = centres[static_cast<size_t>(truth[i]) * dim + j] + nd(rng);
  }
  std::vector<float> c(static_cast<size_t>(k) * dim);
  for (int cc = 0; cc < k; ++cc)
    for (int j = 0; j < dim; ++j) c[static_cast<size_t>(cc) * dim + j] = x[static_cast<size_t>(cc) * dim + j];
  std::vector<int32_t> a(n, -1), counts(k);
  int it = 0;
  while (it < 10 && cpu::kmeans_assign(x.data(), n, dim, c.data(), k, a.data()) > 0) {
    cpu::kmeans_update(x.data(), n, dim, a.data(), k, c.data(), counts.data());
    ++it;
  }
  EXPECT_LT(it, 10);
  for (int i = 0; i < n; ++i) EXPECT_EQ(a[i], truth[i]) << "row " << i;
}

TEST(Kmeans, BadInputNamesTheValue) {
  std::vector<float> x(64, 1.5f), c(64, 0.5f);
  std::vector<int32_t> a(8, 0), counts(8);
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, wanted one mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { cpu::kmeans_assign(x.data(), 8, 8, c.data(), 0, a.data()); }, "k=0");
  expect_error([&] { cpu::kmeans_assign(x.data(), -1, 8, c.data(), 1, a.data()); }, "n=-1");
  expect_error([&] { ref::kmeans_assign(x.data(), 8, 0, c.data(), 1, a.data()); }, "dim=0");
  a[3] = 9;
  expect_error([&] { cpu::kmeans_update(x.data(), 8, 8, a.data(), 8, c.data(), counts.data()); }, "assign[3]=9");
  expect_error([&] { ref::kmeans_update(x.data(), 8, 8, a.data(), 8, c.data(), counts.data()); }, "assign[3]=9");
}

namespace {

// Rows around `centres` centres (spread 1, noise 0.3), plus `offset` on every coordinate.
std::vector<float> clustered_rows(int n, int dim, int centres, float offset, std::mt19937& rng) {
  std::vector<float> mu = random_rows(centres, dim, rng, 0.0f);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  std::uniform_int_distribution<int> pick(0, centres - 1);
  std::vector<float> x(static_cast<size_t>(n) * dim);
  for (int i = 0; i < n; ++i) {
    const int c = pick(rng);
    for (int j = 0; j < dim; ++j)
      x[static_cast<size_t>(i) * dim + j] = mu[static_cast<size_t>(c) * dim + j] + nd(rng) + offset;
  }
  return x;
}

struct LloydResult {
  std::vector<float> centroids;
  std::vector<int32_t> assign, counts;
  int rounds = 0;
};

// The plain loop kmeans_lloyd must equal: assign + update until nothing changes.
LloydResult plain_loop(const std::vector<float>& x, int n, int dim, std::vector<float> c, int k, int max_iter) {
  LloydResult r{std::move(c), std::vector<int32_t>(n, -1), std::vector<int32_t>(k, -7), 0};
  for (int it = 0; it < max_iter; ++it) {
    ++r.rounds;
    if (cpu::kmeans_assign(x.data(), n, dim, r.centroids.data(), k, r.assign.data()) == 0) break;
    cpu::kmeans_update(x.data(), n, dim, r.assign.data(), k, r.centroids.data(), r.counts.data());
  }
  return r;
}

LloydResult bounded(const std::vector<float>& x, int n, int dim, std::vector<float> c, int k, int max_iter,
                    ThreadPool* pool, cpu::KmeansRun* run = nullptr) {
  LloydResult r{std::move(c), std::vector<int32_t>(n, 5), std::vector<int32_t>(k, -7), 0};
  const cpu::KmeansRun got =
      cpu::kmeans_lloyd(x.data(), n, dim, r.centroids.data(), k, max_iter, r.assign.data(), r.counts.data(), pool,
                        cpu::KmeansBounds::kAlways);
  r.rounds = got.rounds;
  if (run != nullptr) *run = got;
  return r;
}

// k initial centroids: rows picked at random, with repeats allowed (equal centroids: ties).
std::vector<float> pick_rows(const std::vector<float>& x, int n, int dim, int k, std::mt19937& rng) {
  std::uniform_int_distribution<int> pick(0, n - 1);
  std::vector<float> c(static_cast<size_t>(k) * dim);
  for (int cc = 0; cc < k; ++cc) {
    const int i = pick(rng);
    std::copy_n(x.data() + static_cast<size_t>(i) * dim, dim, c.data() + static_cast<size_t>(cc) * dim);
  }
  return c;
}

void expect_same(const LloydResult& want, const LloydResult& got, const std::string& what) {
  EXPECT_EQ(got.rounds, want.rounds) << what;
  EXPECT_EQ(got.assign, want.assign) << what;
  EXPECT_EQ(got.counts, want.counts) << what;
  ASSERT_EQ(got.centroids.size(), want.centroids.size());
  // Bit for bit: every float equal as a bit pattern (0 == -0 would hide a difference).
  EXPECT_EQ(std::memcmp(got.centroids.data(), want.centroids.data(), want.centroids.size() * sizeof(float)), 0)
      << what;
}

}  // namespace

TEST(KmeansLloyd, EqualsThePlainLoopBitForBit) {
  // Clustered rows, uniform rows, rows far from the origin (offset 300: the distances are
  // small differences of large norms, where float32 rounding matters most), and rows that
  // repeat with centroids that repeat (exact ties, which go to the lower index).
  std::mt19937 rng(21);
  for_each_target([&] {
    struct Case {
      int n, dim, k, centres;
      float offset;
      bool repeats;
    };
    for (const Case& cs : {Case{1, 8, 1, 1, 0, false}, Case{65, 20, 7, 4, 0, false}, Case{64, 8, 64, 8, 0, true},
                           Case{700, 64, 45, 30, 0, false}, Case{700, 64, 45, 700, 0, false},
                           Case{900, 24, 130, 60, 300, false}, Case{600, 16, 150, 20, 0, true},
                           Case{2500, 128, 160, 200, 0.5f, false}}) {
      std::vector<float> x = clustered_rows(cs.n, cs.dim, cs.centres, cs.offset, rng);
      const size_t row = static_cast<size_t>(cs.dim);
      if (cs.repeats)  // every row equal to one of the first eight
        for (int i = 8; i < cs.n; ++i) std::copy_n(x.data() + (i % 8) * row, row, x.data() + i * row);
      const std::vector<float> c = pick_rows(x, cs.n, cs.dim, cs.k, rng);
      const std::string what = fmt::format("n={} dim={} k={} centres={} offset={} repeats={}", cs.n, cs.dim, cs.k,
                                           cs.centres, cs.offset, cs.repeats);
      const LloydResult want = plain_loop(x, cs.n, cs.dim, c, cs.k, 10);
      ThreadPool pool(2);
      expect_same(want, bounded(x, cs.n, cs.dim, c, cs.k, 10, &pool), what + " pool");
      expect_same(want, bounded(x, cs.n, cs.dim, c, cs.k, 10, nullptr), what + " no pool");
      for (int max_iter : {1, 2})
        expect_same(plain_loop(x, cs.n, cs.dim, c, cs.k, max_iter),
                    bounded(x, cs.n, cs.dim, c, cs.k, max_iter, &pool), what + fmt::format(" max_iter={}", max_iter));
    }
  });
}

TEST(KmeansLloyd, SkipsMostDistances) {
  // What the bounds are for: on clustered rows, Tactic's shape (clusters of ~16 rows), the
  // rounds after the first compute a small share of the distances.
  std::mt19937 rng(5);
  const int n = 8192, dim = 64, k = 512;
  const std::vector<float> x = clustered_rows(n, dim, 1024, 0.0f, rng);
  const std::vector<float> c = pick_rows(x, n, dim, k, rng);
  ThreadPool pool(2);
  cpu::KmeansRun run;
  const LloydResult got = bounded(x, n, dim, c, k, 10, &pool, &run);
  expect_same(plain_loop(x, n, dim, c, k, 10), got, "clustered");
  EXPECT_GE(run.rounds, 4);
  EXPECT_EQ(run.distances_full, static_cast<int64_t>(run.rounds) * n * k);
  const double share = static_cast<double>(run.distances) / run.distances_full;
  std::printf("k-means: %d rounds, %.1f%% of the distances\n", run.rounds, 100 * share);
  // The first round computes all of them (1 / rounds of the total); the rest, less than half.
  EXPECT_LT(share, 1.0 / run.rounds + 0.5 * (run.rounds - 1.0) / run.rounds);
  // kAuto: bounds here (k = 512), the plain loop with the first 256 centroids.
  std::vector<float> c_auto = c;
  std::vector<int32_t> a_auto(n), n_auto(k);
  const cpu::KmeansRun with = cpu::kmeans_lloyd(x.data(), n, dim, c_auto.data(), k, 10, a_auto.data(), n_auto.data(),
                                                &pool, cpu::KmeansBounds::kAuto);
  EXPECT_LT(with.distances, with.distances_full);
  EXPECT_EQ(a_auto, got.assign);
  c_auto = c;
  const cpu::KmeansRun plain = cpu::kmeans_lloyd(x.data(), n, dim, c_auto.data(), k / 2, 10, a_auto.data(),
                                                 n_auto.data(), &pool, cpu::KmeansBounds::kAuto);
  EXPECT_EQ(plain.distances, plain.distances_full);
}

TEST(KmeansLloyd, BadInputNamesTheValue) {
  std::vector<float> x(64, 1.5f), c(64, 0.5f);
  std::vector<int32_t> a(8), counts(8);
  using check::expect_error;
  expect_error([&] { cpu::kmeans_lloyd(x.data(), 8, 8, c.data(), 8, -1, a.data(), counts.data()); }, "max_iter=-1");
  expect_error([&] { cpu::kmeans_lloyd(x.data(), 8, 8, c.data(), 8, 3, a.data(), nullptr); }, "counts");
  expect_error([&] { cpu::kmeans_lloyd(x.data(), 8, 8, c.data(), 0, 3, a.data(), counts.data()); }, "k=0");
}
