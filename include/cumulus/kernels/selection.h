// Selection ops: top-k, and the minimal set reaching a share of the total mass.
// Ties always break toward the lower index, so every backend returns the same set.
#pragma once

#include <cstdint>
#include <vector>

namespace cumulus {

// Thresholds for a group of weight rows sharing one key (ours; sketch_topp's candidate and
// union steps, docs/methods.md):
//   select_mass_threshold: the largest k such that, for every row j, the weights of the
//     entries whose key is >= k sum to at least need[j]:
//       for all j: sum_{i : key[i] >= k} w[j][i] >= need[j]
//     key: [n] nonnegative finite; w: [n_rows][n] nonnegative finite (w may be key itself,
//     n_rows = 1); need: [n_rows]. Returns +inf when every need[j] <= 0 (nothing needed),
//     -inf when the whole list falls short for some row. The reference returns the exact
//     key at which the last row is reached; the CPU backend bisects the keys' logarithm and
//     returns a k_cpu with k_ref * 2^(-1/64) <= k_cpu <= k_ref (or k_cpu = 0 when k_ref
//     lies below max(key) * 2^-32, so every key is taken): it never takes less
//     than the reference, and at most the entries of keys within 1.1% below k_ref more.
//     Its sums are float32 within chunks of 256 entries and float64 across, within about
//     1e-7 of each row's total: a need that close to a boundary may land either side.
//     sum_at: optional [n_rows], each row's sum over the keys >= the returned threshold
//     (the row totals for -inf, 0 for +inf). hint (CPU only; 0: none): a guess of the
//     answer (a caller's last one); a good guess saves the CPU's passes over the whole
//     list, a bad one costs one pass; the answer is the same either way up to the stated
//     resolution. workspace (CPU only): the caller's scratch (MassThresholdWorkspace below).
//   select_any_above: appends to `out` the indices i (ascending, plus `base`) at which
//     some row reaches its threshold, w[j][i] >= tau[j] for some j; w: [n_rows][n], tau:
//     [n_rows] (+inf: the row selects nothing). Both backends return the same list.
namespace ref {
float select_mass_threshold(const float* key, const float* w, int n_rows, int n, const double* need,
                            double* sum_at = nullptr);
void select_any_above(const float* w, int n_rows, int n, const float* tau, int32_t base, std::vector<int32_t>& out);
}  // namespace ref
// Scratch of cpu::select_mass_threshold, owned by the caller and reused across calls: the
// band the bisection copies out of the list grows with the context ([n_rows + 1] rows of up
// to n floats), so it lives as long as its owner (sketch_topp: one per kv head, for the
// method's life), not as long as a thread. A call without one allocates its own.
struct MassThresholdWorkspace {
  std::vector<float> band_key, band_w;                // [n + lanes], [n_rows][n + lanes]
  std::vector<float*> band_rows;                      // [n_rows]
  std::vector<const float*> row_of, deciding;         // [n_rows] the rows a pass sums
  std::vector<double> total, base, sums, band_total;  // [n_rows]
  std::vector<int> id_of;                             // [n_rows] the rows still deciding
};
namespace cpu {
float select_mass_threshold(const float* key, const float* w, int n_rows, int n, const double* need,
                            double* sum_at = nullptr, float hint = 0.0f, MassThresholdWorkspace* workspace = nullptr);
void select_any_above(const float* w, int n_rows, int n, const float* tau, int32_t base, std::vector<int32_t>& out);
// select_mass_threshold over a group's key, which it computes and writes to key [n]:
//   key[t] = 2 for t < always_lo or t >= always_hi (above any share), else max_j w[j][t] inv[j]
// The answer and sum_at equal those of computing that key and calling select_mass_threshold
// (key, w, n_rows, n, need, sum_at, hint, workspace). With a hint, and some entry always
// taken, one pass over the rows computes the key, its largest value, the rows' totals and
// the hint's band together (sketch_topp's step: four passes before; up to 8 rows, more
// take the passes one by one). inv: [n_rows] finite and > 0.
float select_group_threshold(const float* w, int n_rows, int n, const float* inv, int always_lo, int always_hi,
                             float* key, const double* need, double* sum_at = nullptr, float hint = 0.0f,
                             MassThresholdWorkspace* workspace = nullptr);
}  // namespace cpu

namespace ref {
// The k largest scores: out = their indices ordered by score descending (ties: lower
// index first). Requires 1 <= k; k > n returns all n.
void select_topk(const float* scores, int n, int k, std::vector<int32_t>& out);
// Smallest m such that sum_{i<m} values[i] >= threshold (values visited in the given
// order, nonnegative). Returns n if the whole list falls short.
int select_cumulative_prefix(const float* values, int n, double threshold);
// The fewest indices whose weights (nonnegative) sum to at least p * sum(weights):
// weights sorted descending, then the minimal prefix. out: indices, weight descending.
void select_top_mass(const float* weights, int n, double p, std::vector<int32_t>& out);
}  // namespace ref

// The CPU's scratch of select_topk and select_top_mass (sort keys, bucket counts and sums:
// up to 3 n words), owned by the caller so that it lives as long as its owner (a method's
// head, a pool worker), not as long as a thread. A call without one allocates its own.
struct SelectWorkspace {
  std::vector<uint32_t> key, key2;  // [n] radix sort keys
  std::vector<int32_t> idx2;        // [n] the sort's second index buffer
  std::vector<int> count;           // [buckets]
  std::vector<float> in_b;          // the k-th largest score's bucket
  std::vector<double> bucket_sum;   // [buckets]
};
namespace cpu {
void select_topk(const float* scores, int n, int k, std::vector<int32_t>& out, SelectWorkspace* workspace = nullptr);
int select_cumulative_prefix(const float* values, int n, double threshold);
void select_top_mass(const float* weights, int n, double p, std::vector<int32_t>& out,
                     SelectWorkspace* workspace = nullptr);
}  // namespace cpu

}  // namespace cumulus
