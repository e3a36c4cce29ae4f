// Tactic's rules (Tactic, section 4, Algorithm 1) written once for the CPU method
// (src/methods/tactic/tactic.cpp) and the GPU pipeline (src/methods/tactic/tactic.cu), so that both
// select from the same positions and start k-means from the same sample: the exactly scored
// positions of a ranked list (host and device: the GPU computes them in its kernels), the
// number of clusters, and the seeded initial sample. The parameters are
// cumulus/methods/tactic.h's TacticOptions. Plain C++ outside nvcc; not installed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "cumulus/methods/tactic.h"

#ifdef __CUDACC__
#define CUMULUS_TACTIC_HD __host__ __device__
#define CUMULUS_TACTIC_FORCEINLINE __forceinline__
#else
#define CUMULUS_TACTIC_HD
#define CUMULUS_TACTIC_FORCEINLINE inline
#endif

namespace cumulus {

// Exactly scored positions of a ranked list of L entries (Alg. 1 lines 4 and 8): the head
// [0, N), N = ceil(init_ratio L) clamped to [1, L], and the windows [b1, e1), [b2, e2) of
// `window` entries starting at p L - window / 2 (clamped into the list). A list too short for
// two disjoint windows past N (they overlap each other or the head) is scored exactly
// everywhere (exact_all; no fit). n_exact: how many positions are scored.
struct TacticWindows {
  int N = 0, b1 = 0, e1 = 0, b2 = 0, e2 = 0, n_exact = 0;
  bool exact_all = true;
};

CUMULUS_TACTIC_HD inline TacticWindows tactic_windows(int L, double init_ratio, int window, double p1, double p2) {
  TacticWindows w;
  if (L <= 0) return w;
  w.N = static_cast<int>(ceil(init_ratio * L));
  w.N = w.N < 1 ? 1 : (w.N > L ? L : w.N);
  const int hi = L - window > 0 ? L - window : 0;
  auto at = [&](double p, int& b, int& e) {
    b = static_cast<int>(p * L) - window / 2;
    b = b < 0 ? 0 : (b > hi ? hi : b);
    e = b + window < L ? b + window : L;
  };
  at(p1, w.b1, w.e1);
  at(p2, w.b2, w.e2);
  w.exact_all = w.e1 > w.b2 || w.b1 < w.N || w.N >= L;
  w.n_exact = w.exact_all ? L : w.N + (w.e1 - w.b1) + (w.e2 - w.b2);
  return w;
}

// The list position of the u-th exactly scored entry, u in [0, n_exact): the head, then
// the first window, then the second.
CUMULUS_TACTIC_HD CUMULUS_TACTIC_FORCEINLINE int tactic_position(const TacticWindows& w, int u) {
  if (w.exact_all || u < w.N) return u;
  if (u < w.N + (w.e1 - w.b1)) return w.b1 + (u - w.N);
  return w.b2 + (u - w.N - (w.e1 - w.b1));
}

// Clusters of a segment of n keys (section 4.2): ceil(n / cluster_size), at most n.
inline int tactic_cluster_count(int n, int cluster_size) { return std::min(n, (n + cluster_size - 1) / cluster_size); }

// The initial centroids of a segment of n keys starting at token segment_start of (layer,
// kv head): k distinct keys sampled uniformly by a partial Fisher-Yates shuffle seeded by
// (seed, layer, kv head, segment start), so runs repeat exactly and both backends start
// from the same keys. perm: [n] on return, the sample in perm[0 .. k).
inline void tactic_initial_sample(uint32_t seed, int layer, int kv_head, int segment_start, int n, int k,
                                  std::vector<int32_t>& perm) {
  std::seed_seq seq{seed, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                    static_cast<uint32_t>(segment_start)};
  std::mt19937 rng(seq);
  perm.resize(n);
  for (int i = 0; i < n; ++i) perm[i] = i;
  for (int i = 0; i < k; ++i) std::swap(perm[i], perm[i + static_cast<int>(rng() % static_cast<uint32_t>(n - i))]);
}

}  // namespace cumulus

#undef CUMULUS_TACTIC_HD
#undef CUMULUS_TACTIC_FORCEINLINE
