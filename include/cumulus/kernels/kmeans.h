// K-means ops (Tactic, 001 section 4.2): assign rows to their nearest centroid, move each
// centroid to the mean of its rows, and score queries against centroids (section 4.3:
// clusters are ranked by q . centroid). Rows are dense float32 (the caller widens the
// stored keys once per clustering); the ops know nothing about the cache.
// Backends share signatures: ref:: (scalar, float64 accumulation, never optimised) and
// cpu:: (Highway SIMD with runtime dispatch). Results of cpu:: do not depend on the
// number of threads.
#pragma once

#include <cstdint>

#include "cumulus/core/thread_pool.h"

namespace cumulus {

namespace ref {
// assign[i] = argmin_c ||x[i] - centroids[c]||^2 (ties: the lower c).
//   x: [n][dim]; centroids: [k][dim]; assign: [n] in/out (the previous assignment, or -1)
// Returns how many entries of assign changed.
int64_t kmeans_assign(const float* x, int n, int dim, const float* centroids, int k, int32_t* assign);
// centroids[c] = mean of the rows assigned to c; a centroid with no rows keeps its value.
//   assign: [n] in [0, k); centroids: [k][dim] in/out; counts: [k] out (rows per centroid)
void kmeans_update(const float* x, int n, int dim, const int32_t* assign, int k, float* centroids, int32_t* counts);
// scores[h][c] = q[h] . centroids[c].
//   centroids: [k][dim]; q: [n_q][dim]; scores: [n_q][k]
void kmeans_centroid_score(const float* centroids, int k, int dim, const float* q, int n_q, float* scores);
}  // namespace ref

namespace cpu {
int64_t kmeans_assign(const float* x, int n, int dim, const float* centroids, int k, int32_t* assign,
                      ThreadPool* pool = nullptr);
void kmeans_update(const float* x, int n, int dim, const int32_t* assign, int k, float* centroids, int32_t* counts);
void kmeans_centroid_score(const float* centroids, int k, int dim, const float* q, int n_q, float* scores);
}  // namespace cpu

// Checks the arguments shared by every backend; throws Error naming the bad value.
void kmeans_validate(const char* fn, const float* x, int n, int dim, const float* centroids, int k);

}  // namespace cumulus
