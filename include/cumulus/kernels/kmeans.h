// K-means ops (Tactic, section 4.2): assign rows to their nearest centroid, move each
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
// What kmeans_lloyd did: assignment passes run (the last one changed nothing, unless
// max_iter ran out), and the (row, centroid) distances it computed against the
// rounds x n x k a plain loop computes.
struct KmeansRun {
  int rounds = 0;
  int64_t distances = 0;
  int64_t distances_full = 0;
};

// Lloyd's algorithm: from assign = -1, up to max_iter rounds of kmeans_assign then
// kmeans_update, stopping at the first assignment that changes nothing. The assignments,
// centroids and counts equal those of that plain loop of cpu:: ops bit for bit, but most
// distances are never computed: the centroids are cut into groups of 64 (one GEMM tile)
// in the order of a k-means of the initial centroids, and each row keeps an upper bound on
// its distance to its centroid and a lower bound per group on its distance to the group's
// other centroids, moved by how far the centroids moved (Ding et al., "Yinyang K-Means",
// ICML 2015). A group is skipped only where its bound proves that no centroid in it could win,
// with room for float32's rounding of the distances, so the result cannot change.
// The bounds pay where the rounds skip enough of the k distances per row to cover their
// bookkeeping: kAuto bounds from 384 centroids on, the plain loop below (measured on 2 Zen 4
// cores, keys of the synthetic llama3-8b workload and of SmolLM2: k = 2048, dim 128:
// 2.55-2.77x faster; k = 512, dim 128: 1.6x; k = 500, dim 64: 1.45x; k = 256, dim 64:
// 0.86-0.90x; k = 128: 0.7-1.1x). kAlways / kNever force one path (the result is the same).
//   x: [n][dim]; centroids: [k][dim] in/out; assign: [n] out; counts: [k] out (after the
//   last update; untouched when no update ran). max_iter >= 0.
enum class KmeansBounds { kAuto, kAlways, kNever };
KmeansRun kmeans_lloyd(const float* x, int n, int dim, float* centroids, int k, int max_iter, int32_t* assign,
                       int32_t* counts, ThreadPool* pool = nullptr, KmeansBounds bounds = KmeansBounds::kAuto);

int64_t kmeans_assign(const float* x, int n, int dim, const float* centroids, int k, int32_t* assign,
                      ThreadPool* pool = nullptr);
void kmeans_update(const float* x, int n, int dim, const int32_t* assign, int k, float* centroids, int32_t* counts);
void kmeans_centroid_score(const float* centroids, int k, int dim, const float* q, int n_q, float* scores);
}  // namespace cpu

// Checks the arguments shared by every backend; throws Error naming the bad value.
void kmeans_validate(const char* fn, const float* x, int n, int dim, const float* centroids, int k);

}  // namespace cumulus
