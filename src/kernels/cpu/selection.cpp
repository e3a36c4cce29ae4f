// Selection ops for the CPU backend: the same results as src/kernels/ref/selection.cpp,
// bit for bit, with less work. Neither op sorts more than the part it returns (plus a
// margin); both find that part with a pass over the values that only counts: the float
// bit patterns, mapped to an unsigned key of the same order, are grouped into buckets of
// their sign, 8 exponent and 3 mantissa bits (a bucket spans a factor <= 1.125 of
// magnitudes; equal values, -0 and +0 included, share a bucket).
//   - top-k: counts per bucket from the top find the bucket holding the k-th largest
//     value t; nth_element over that bucket's values alone finds t; the chosen set is
//     every value > t and the lowest indices of those == t, and only it is sorted.
//   - top-mass: float64 sums per bucket from the top find the lowest bucket the answer
//     can reach; the candidates (that bucket and above, plus one bucket of margin for
//     rounding) are sorted and summed. When rounding leaves the candidates short of the
//     target (p = 1, all-zero weights), the chunked search below takes over.
//
// Why the results equal the reference exactly:
//   - Order: the comparator is the strict total order "value descending, then index
//     ascending" (equal values, including -0 == +0, go to the lower index first). It is
//     the order the reference's stable sort produces. Both candidate sets are prefixes of
//     the whole list under that order (every value above a threshold, equal values
//     together), so sorting the candidates gives the first entries of the full sort.
//   - Sums: float64, one value at a time, in the same order as the reference: the total
//     of select_top_mass in index order 0..n-1, each prefix in selection order. The
//     bucket sums only choose the candidates; the stopping point comes from the same
//     running sum as the reference's, over the same sequence.
//   - Inputs are checked the same way (NaN rejected; negative or infinite weights and
//     values rejected), so errors also match.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>

#include "core/check.h"
#include "cumulus/kernels/selection.h"

namespace cumulus::cpu {

namespace {

// "a before b": value descending, ties by lower index. A strict total order for non-NaN.
struct DescendingThenIndex {
  const float* v;
  bool operator()(int32_t a, int32_t b) const { return v[a] > v[b] || (v[a] == v[b] && a < b); }
};

// Buckets of the order key: the float's bits mapped to an unsigned integer of the same
// order (negatives flipped, positives above them; -0 taken as +0 so that equal values
// share a bucket), keeping the top 12 bits: sign, exponent, 3 mantissa bits.
constexpr int kBucketShift = 20;
constexpr int kBuckets = 1 << (32 - kBucketShift);
inline uint32_t order_key(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
inline int order_bucket(float x) { return static_cast<int>(order_key(x) >> kBucketShift); }

// The whole list in "value descending, then index ascending" order, by a stable LSD radix
// sort of the order keys (negated, so ascending keys are descending values) over indices
// that start ascending: equal values keep their index order, as DescendingThenIndex
// wants. Three passes of 11 bits; a pass whose digit is the same for every key is
// skipped. Tactic and PSA rank every cluster or page of a head each step: 2,048 of them
// sorted this way instead of by std::sort with the comparator took a decode step's
// sorting from ~19% of Tactic's step to ~3% (docs/lab/performance-log.md).
void sort_descending(const float* v, int n, std::vector<int32_t>& out, SelectWorkspace& ws) {
  std::vector<uint32_t>& key = ws.key;
  std::vector<uint32_t>& key2 = ws.key2;
  std::vector<int32_t>& idx2 = ws.idx2;
  key.resize(n);
  key2.resize(n);
  idx2.resize(n);
  out.resize(n);
  for (int i = 0; i < n; ++i) {
    key[i] = ~order_key(v[i]);
    out[i] = i;
  }
  constexpr int kBits = 11;
  int count[1 << kBits];
  uint32_t* src_k = key.data();
  uint32_t* dst_k = key2.data();
  int32_t* src_i = out.data();
  int32_t* dst_i = idx2.data();
  for (int shift = 0; shift < 32; shift += kBits) {
    std::fill(std::begin(count), std::end(count), 0);
    for (int i = 0; i < n; ++i) ++count[(src_k[i] >> shift) & ((1u << kBits) - 1)];
    if (n == 0 || count[(src_k[0] >> shift) & ((1u << kBits) - 1)] == n) continue;  // one digit: order kept
    int sum = 0;
    for (int& c : count) {
      const int c0 = c;
      c = sum;
      sum += c0;
    }
    for (int i = 0; i < n; ++i) {
      const int pos = count[(src_k[i] >> shift) & ((1u << kBits) - 1)]++;
      dst_k[pos] = src_k[i];
      dst_i[pos] = src_i[i];
    }
    std::swap(src_k, dst_k);
    std::swap(src_i, dst_i);
  }
  if (src_i != out.data()) std::copy(src_i, src_i + n, out.begin());
}

}  // namespace

void select_topk(const float* scores, int n, int k, std::vector<int32_t>& out, SelectWorkspace* workspace) {
  CUMULUS_CHECK(k >= 1, "k={} must be >= 1", k);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  CUMULUS_CHECK(n == 0 || scores != nullptr, "scores must be non-null for n={}", n);
  for (int i = 0; i < n; ++i) CUMULUS_CHECK(!std::isnan(scores[i]), "scores[{}]=nan", i);
  const DescendingThenIndex before{scores};
  if (k >= n) {
    SelectWorkspace own;
    sort_descending(scores, n, out, workspace != nullptr ? *workspace : own);
    return;
  }
  // b: the bucket of the k-th largest score; n_above scores lie in higher buckets.
  SelectWorkspace own;
  SelectWorkspace& ws = workspace != nullptr ? *workspace : own;
  std::vector<int>& count = ws.count;
  count.assign(kBuckets, 0);
  for (int i = 0; i < n; ++i) ++count[order_bucket(scores[i])];
  int b = kBuckets - 1, n_above = 0;
  for (; b > 0 && n_above + count[b] < k; --b) n_above += count[b];
  // t: the k-th largest score, the (k - n_above)-th largest of bucket b (nth_element on
  // plain floats, only that bucket's). The chosen set is every score > t, then the
  // lowest indices of the scores == t.
  std::vector<float>& in_b = ws.in_b;
  in_b.clear();
  for (int i = 0; i < n; ++i)
    if (order_bucket(scores[i]) == b) in_b.push_back(scores[i]);
  const int r = k - n_above;
  std::nth_element(in_b.begin(), in_b.begin() + (r - 1), in_b.end(), std::greater<float>());
  const float t = in_b[static_cast<size_t>(r - 1)];
  int n_greater = 0;
  for (float x : in_b) n_greater += x > t ? 1 : 0;
  int n_equal = r - n_greater;
  out.clear();
  for (int i = 0; i < n; ++i) {
    if (scores[i] > t) {
      out.push_back(i);
    } else if (n_equal > 0 && scores[i] == t) {
      out.push_back(i);
      --n_equal;
    }
  }
  std::sort(out.begin(), out.end(), before);
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

namespace {

// The reference's answer by partial sorting: out[0, done) is sorted and holds the `done`
// heaviest; each round brings the next `chunk` heaviest of the rest to the front, sorts
// them and extends the running sum. Stops after at least one index (so an all-zero input
// still yields a set), as the reference does.
void top_mass_chunked(const float* weights, int n, double target, std::vector<int32_t>& out) {
  out.resize(n);
  std::iota(out.begin(), out.end(), 0);
  const DescendingThenIndex before{weights};
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

}  // namespace

void select_top_mass(const float* weights, int n, double p, std::vector<int32_t>& out, SelectWorkspace* workspace) {
  CUMULUS_CHECK(p > 0 && p <= 1, "p={} must be in (0, 1]", p);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  CUMULUS_CHECK(n == 0 || weights != nullptr, "weights must be non-null for n={}", n);
  // [kBuckets] float64 sums of the weights per bucket (they only pick candidates).
  SelectWorkspace own;
  std::vector<double>& bucket_sum = (workspace != nullptr ? *workspace : own).bucket_sum;
  bucket_sum.assign(kBuckets, 0.0);
  double total = 0;  // index order 0..n-1, as the reference
  for (int i = 0; i < n; ++i) {
    CUMULUS_CHECK(std::isfinite(weights[i]) && weights[i] >= 0, "weights[{}]={} must be finite and >= 0", i,
                  weights[i]);
    total += weights[i];
    bucket_sum[order_bucket(weights[i])] += weights[i];
  }
  const double target = p * total;
  // Lowest bucket whose sum from the top reaches the target, one more as the margin for
  // the different summation order; candidates are the weights in buckets >= lo.
  double acc = 0;
  int b = kBuckets - 1;
  for (; b > 0; --b) {
    acc += bucket_sum[b];
    if (acc >= target) break;
  }
  const int lo = std::max(b - 1, 0);
  if (target > 0 && lo > 0) {
    out.clear();
    for (int i = 0; i < n; ++i)
      if (order_bucket(weights[i]) >= lo) out.push_back(i);
    std::sort(out.begin(), out.end(), DescendingThenIndex{weights});
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      s += weights[out[i]];
      if (s >= target) {
        out.resize(i + 1);
        return;
      }
    }
  }
  top_mass_chunked(weights, n, target, out);
}

}  // namespace cumulus::cpu
