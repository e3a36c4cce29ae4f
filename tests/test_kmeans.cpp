// K-means ops: the SIMD backend against the float64 reference on fresh random rows of
// awkward sizes (1, 3, 15, 16, 17, 255, 4097 rows), several centroid counts and dims, on
// every SIMD target this binary carries, never on zeros. Assignments compare exactly
// except at near-ties (where float32 may pick the other centroid: then both distances must
// agree within rounding); updates and scores compare by normalised error. Lloyd's loop
// built from the ops converges on clustered data; bad input names the value.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
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
