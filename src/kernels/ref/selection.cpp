// Scalar reference of the selection ops: top-k, the minimal prefix reaching a threshold,
// and the minimal set reaching a share p of the total mass (the "top-p" set of Tactic
// section 3; oracle_topp uses it on exact softmax probabilities). Written the obvious way
// (full stable sort, float64 sums) so src/kernels/cpu/selection.cpp can be checked
// against it for exact equality.
//
// Rules every backend follows, so all return the same indices in the same order:
//   - Order: score (or weight) descending; equal values (including -0 == +0) go to the
//     lower index first. This is a strict total order over (value, index), so the top-k
//     set and its order are unique.
//   - NaN is rejected (it has no place in that order). select_top_mass and
//     select_cumulative_prefix also reject negative and infinite values.
//   - Sums are float64, accumulated one value at a time: the total of select_top_mass in
//     index order 0..n-1, every prefix in selection order. Rounding is therefore the same
//     in every backend; only the boundary of a prefix that lands within rounding of the
//     threshold can differ from exact arithmetic, and it differs identically everywhere.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/check.h"
#include "cumulus/kernels/selection.h"

namespace cumulus::ref {

namespace {

void select_threshold_check(const float* key, const float* w, int n_rows, int n, const double* need) {
  CUMULUS_CHECK(n_rows >= 1 && n >= 0, "select_mass_threshold: n_rows={} must be >= 1 and n={} >= 0", n_rows, n);
  CUMULUS_CHECK(need != nullptr && (n == 0 || (key != nullptr && w != nullptr)),
                "select_mass_threshold: key, w and need must be non-null for n={}", n);
  for (int i = 0; i < n; ++i)
    CUMULUS_CHECK(std::isfinite(key[i]) && key[i] >= 0, "select_mass_threshold: key[{}]={} must be finite and >= 0", i,
                  key[i]);
  for (int64_t i = 0; i < static_cast<int64_t>(n_rows) * n; ++i)
    CUMULUS_CHECK(std::isfinite(w[i]) && w[i] >= 0, "select_mass_threshold: w[{}]={} must be finite and >= 0", i, w[i]);
}

}  // namespace

void select_topk(const float* scores, int n, int k, std::vector<int32_t>& out) {
  CUMULUS_CHECK(k >= 1, "k={} must be >= 1", k);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  CUMULUS_CHECK(n == 0 || scores != nullptr, "scores must be non-null for n={}", n);
  for (int i = 0; i < n; ++i) CUMULUS_CHECK(!std::isnan(scores[i]), "scores[{}]=nan", i);
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Stable sort on score alone: equal scores keep index order (lower index first).
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
  order.resize(std::min(n, k));
  out = std::move(order);
}

int select_cumulative_prefix(const float* values, int n, double threshold) {
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  CUMULUS_CHECK(n == 0 || values != nullptr, "values must be non-null for n={}", n);
  CUMULUS_CHECK(!std::isnan(threshold), "threshold={} must not be nan", threshold);
  // The empty prefix sums to 0, so a threshold <= 0 needs nothing.
  if (threshold <= 0) return 0;
  double s = 0;
  for (int i = 0; i < n; ++i) {
    CUMULUS_CHECK(std::isfinite(values[i]) && values[i] >= 0, "values[{}]={} must be finite and >= 0", i, values[i]);
    s += values[i];
    if (s >= threshold) return i + 1;
  }
  return n;
}

void select_top_mass(const float* weights, int n, double p, std::vector<int32_t>& out) {
  CUMULUS_CHECK(p > 0 && p <= 1, "p={} must be in (0, 1]", p);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  CUMULUS_CHECK(n == 0 || weights != nullptr, "weights must be non-null for n={}", n);
  double total = 0;  // index order 0..n-1
  for (int i = 0; i < n; ++i) {
    CUMULUS_CHECK(std::isfinite(weights[i]) && weights[i] >= 0, "weights[{}]={} must be finite and >= 0", i,
                  weights[i]);
    total += weights[i];
  }
  const double target = p * total;
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return weights[a] > weights[b]; });
  // The shortest prefix (at least one index when n >= 1, so an all-zero input still yields
  // a set) whose float64 sum in this order reaches target; all n if rounding leaves the
  // full sum short of it (possible at p = 1: the total was summed in another order).
  double s = 0;
  int m = 0;
  while (m < n) {
    s += weights[order[m]];
    ++m;
    if (s >= target) break;
  }
  order.resize(m);
  out = std::move(order);
}

float select_mass_threshold(const float* key, const float* w, int n_rows, int n, const double* need, double* sum_at) {
  select_threshold_check(key, w, n_rows, n, need);
  bool any = false;
  for (int j = 0; j < n_rows; ++j) any = any || need[j] > 0;
  if (!any) {
    if (sum_at != nullptr) std::fill(sum_at, sum_at + n_rows, 0.0);
    return std::numeric_limits<float>::infinity();
  }
  // Keys descending; every entry of one key value joins at once (a threshold cannot split
  // equal keys), and the first key at which every row has reached its need is the answer.
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key[a] > key[b]; });
  std::vector<double> acc(n_rows, 0.0);
  for (int r = 0; r < n;) {
    const float k = key[order[r]];
    for (; r < n && key[order[r]] == k; ++r)
      for (int j = 0; j < n_rows; ++j) acc[j] += w[static_cast<size_t>(j) * n + order[r]];
    bool all = true;
    for (int j = 0; j < n_rows; ++j) all = all && acc[j] >= need[j];
    if (all || r == n) {
      if (sum_at != nullptr) std::copy(acc.begin(), acc.end(), sum_at);
      if (all) return k;
    }
  }
  if (n == 0 && sum_at != nullptr) std::fill(sum_at, sum_at + n_rows, 0.0);
  return -std::numeric_limits<float>::infinity();
}

void select_any_above(const float* w, int n_rows, int n, const float* tau, int32_t base, std::vector<int32_t>& out) {
  CUMULUS_CHECK(n_rows >= 1 && n >= 0, "select_any_above: n_rows={} must be >= 1 and n={} >= 0", n_rows, n);
  CUMULUS_CHECK(n == 0 || (w != nullptr && tau != nullptr), "select_any_above: w and tau must be non-null");
  for (int i = 0; i < n; ++i) {
    bool hit = false;
    for (int j = 0; j < n_rows; ++j) hit = hit || w[static_cast<size_t>(j) * n + i] >= tau[j];
    if (hit) out.push_back(base + i);
  }
}

}  // namespace cumulus::ref
