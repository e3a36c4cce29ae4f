// Selection ops for the CPU backend: the same results as src/kernels/ref/selection.cpp,
// bit for bit, with less work. Top-k partitions with nth_element and sorts only the k it
// keeps; top-mass sorts the heaviest weights in chunks of doubling size and stops as soon
// as the running sum reaches p * total, so a peaked distribution (the usual softmax) never
// sorts its long tail.
//
// Why the results equal the reference exactly:
//   - Order: the comparator is the strict total order "value descending, then index
//     ascending" (equal values, including -0 == +0, go to the lower index first). It is
//     the order the reference's stable sort produces, and the k first elements under it
//     are unique, so partitioning and then sorting the kept part gives the same list.
//   - Sums: float64, one value at a time, in the same order as the reference: the total
//     of select_top_mass in index order 0..n-1, each prefix in selection order. Chunks are
//     sorted and visited in order, so the running sum sees the same sequence.
//   - Inputs are checked the same way (NaN rejected; negative or infinite weights and
//     values rejected), so errors also match.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "cumulus/core/error.h"
#include "cumulus/kernels/selection.h"

namespace cumulus::cpu {

namespace {

// "a before b": value descending, ties by lower index. A strict total order for non-NaN.
struct DescendingThenIndex {
  const float* v;
  bool operator()(int32_t a, int32_t b) const { return v[a] > v[b] || (v[a] == v[b] && a < b); }
};

}  // namespace

void select_topk(const float* scores, int n, int k, std::vector<int32_t>& out) {
  CUMULUS_CHECK(k >= 1, "k={} must be >= 1", k);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  CUMULUS_CHECK(n == 0 || scores != nullptr, "scores must be non-null for n={}", n);
  for (int i = 0; i < n; ++i) CUMULUS_CHECK(!std::isnan(scores[i]), "scores[{}]=nan", i);
  // out doubles as the index scratch: [n] indices, cut to [min(n, k)] at the end.
  out.resize(n);
  std::iota(out.begin(), out.end(), 0);
  const DescendingThenIndex before{scores};
  if (k >= n) {
    std::sort(out.begin(), out.end(), before);
    return;
  }
  if (static_cast<int64_t>(k) * 16 < n) {
    std::partial_sort(out.begin(), out.begin() + k, out.end(), before);  // n log k for small k
  } else {
    std::nth_element(out.begin(), out.begin() + k, out.end(), before);
    std::sort(out.begin(), out.begin() + k, before);
  }
  out.resize(k);
}

int select_cumulative_prefix(const float* values, int n, double threshold) {
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  CUMULUS_CHECK(n == 0 || values != nullptr, "values must be non-null for n={}", n);
  CUMULUS_CHECK(!std::isnan(threshold), "threshold={} must not be nan", threshold);
  // A running float64 sum in the given order, stopping at the first prefix that reaches
  // the threshold (the empty prefix, sum 0, when threshold <= 0). The sum is sequential on
  // purpose: a blocked or vectorised sum would round differently from the reference.
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
  double total = 0;  // index order 0..n-1, as the reference
  for (int i = 0; i < n; ++i) {
    CUMULUS_CHECK(std::isfinite(weights[i]) && weights[i] >= 0, "weights[{}]={} must be finite and >= 0", i,
                  weights[i]);
    total += weights[i];
  }
  const double target = p * total;
  out.resize(n);
  std::iota(out.begin(), out.end(), 0);
  const DescendingThenIndex before{weights};
  // out[0, done) is sorted and holds the `done` heaviest; each round brings the next
  // `chunk` heaviest of the rest to the front, sorts them and extends the running sum.
  // Stops after at least one index (so an all-zero input still yields a set), as the
  // reference does.
  double s = 0;
  int done = 0;
  int chunk = std::max(256, n / 32);
  while (done < n) {
    const int end = n - done > chunk ? done + chunk : n;
    if (end < n) std::nth_element(out.begin() + done, out.begin() + end, out.end(), before);
    std::sort(out.begin() + done, out.begin() + end, before);
    for (int i = done; i < end; ++i) {
      s += weights[out[i]];
      if (s >= target) {
        out.resize(i + 1);
        return;
      }
    }
    done = end;
    chunk = chunk > n / 2 ? n : 2 * chunk;
  }
}

}  // namespace cumulus::cpu
