// Selection ops: top-k, and the minimal set reaching a share of the total mass.
// Ties always break toward the lower index, so every backend returns the same set.
#pragma once

#include <cstdint>
#include <vector>

namespace cumulus {

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

namespace cpu {
void select_topk(const float* scores, int n, int k, std::vector<int32_t>& out);
int select_cumulative_prefix(const float* values, int n, double threshold);
void select_top_mass(const float* weights, int n, double p, std::vector<int32_t>& out);
}  // namespace cpu

}  // namespace cumulus
