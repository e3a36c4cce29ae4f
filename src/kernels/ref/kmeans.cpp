// Scalar reference of the k-means ops (Tactic, section 4.2: assignment by distance,
// update by mean; section 4.3: clusters ranked by q . centroid). Plain loops, float64
// accumulation, never optimised: the SIMD backend is tested against it.
#include <limits>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/kmeans.h"

namespace cumulus {

void kmeans_validate(const char* fn, const float* x, int n, int dim, const float* centroids, int k) {
  if (n < 0) throw Error(fmt::format("{}: n={} must be >= 0", fn, n));
  if (dim < 1) throw Error(fmt::format("{}: dim={} must be >= 1", fn, dim));
  if (k < 1) throw Error(fmt::format("{}: k={} must be >= 1", fn, k));
  if (n > 0 && x == nullptr) throw Error(fmt::format("{}: x must be non-null (n={})", fn, n));
  if (centroids == nullptr) throw Error(fmt::format("{}: centroids must be non-null", fn));
}

namespace ref {

int64_t kmeans_assign(const float* x, int n, int dim, const float* centroids, int k, int32_t* assign) {
  kmeans_validate(__func__, x, n, dim, centroids, k);
  CUMULUS_CHECK(n == 0 || assign != nullptr, "assign must be non-null (n={})", n);
  int64_t changed = 0;
  for (int i = 0; i < n; ++i) {
    const float* xi = x + static_cast<size_t>(i) * dim;
    double best = std::numeric_limits<double>::infinity();
    int32_t arg = 0;
    for (int c = 0; c < k; ++c) {
      const float* cc = centroids + static_cast<size_t>(c) * dim;
      double d2 = 0;
      for (int j = 0; j < dim; ++j) {
        const double diff = static_cast<double>(xi[j]) - cc[j];
        d2 += diff * diff;
      }
      if (d2 < best) {
        best = d2;
        arg = c;
      }
    }
    if (assign[i] != arg) ++changed;
    assign[i] = arg;
  }
  return changed;
}

void kmeans_update(const float* x, int n, int dim, const int32_t* assign, int k, float* centroids, int32_t* counts) {
  kmeans_validate(__func__, x, n, dim, centroids, k);
  CUMULUS_CHECK(n == 0 || assign != nullptr, "assign must be non-null (n={})", n);
  CUMULUS_CHECK(counts != nullptr, "counts must be non-null");
  std::vector<double> sum(static_cast<size_t>(k) * dim, 0.0);
  for (int c = 0; c < k; ++c) counts[c] = 0;
  for (int i = 0; i < n; ++i) {
    CUMULUS_CHECK(assign[i] >= 0 && assign[i] < k, "assign[{}]={} out of range [0, {})", i, assign[i], k);
    const float* xi = x + static_cast<size_t>(i) * dim;
    double* s = sum.data() + static_cast<size_t>(assign[i]) * dim;
    for (int j = 0; j < dim; ++j) s[j] += xi[j];
    ++counts[assign[i]];
  }
  for (int c = 0; c < k; ++c) {
    if (counts[c] == 0) continue;
    for (int j = 0; j < dim; ++j)
      centroids[static_cast<size_t>(c) * dim + j] = static_cast<float>(sum[static_cast<size_t>(c) * dim + j] / counts[c]);
  }
}

void kmeans_centroid_score(const float* centroids, int k, int dim, const float* q, int n_q, float* scores) {
  kmeans_validate(__func__, nullptr, 0, dim, centroids, k);
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  CUMULUS_CHECK(q != nullptr && scores != nullptr, "q and scores must be non-null");
  for (int h = 0; h < n_q; ++h)
    for (int c = 0; c < k; ++c) {
      double s = 0;
      for (int j = 0; j < dim; ++j)
        s += static_cast<double>(q[static_cast<size_t>(h) * dim + j]) * centroids[static_cast<size_t>(c) * dim + j];
      scores[static_cast<size_t>(h) * k + c] = static_cast<float>(s);
    }
}

}  // namespace ref
}  // namespace cumulus
