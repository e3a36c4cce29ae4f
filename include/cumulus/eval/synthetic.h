// Seeded synthetic decode workload whose attention looks like real attention
// (docs/workload.md): attention sinks at the first tokens, a recent-token band, keys in
// clusters of varied size laid out in runs of consecutive tokens, and a heavy-tailed
// score distribution whose concentration is a knob. It fills a KvCache and returns the
// decode queries; the same options (seed included) give bit-identical caches and queries
// for any thread count.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "cumulus/core/shape.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/kv/kv_cache.h"

namespace cumulus {

// Attention shapes of the models the bench imitates (one layer unless n_layers says so):
//   "llama3-8b":    32 query heads, 8 kv heads, head_dim 128
//   "smollm2-135m":  9 query heads, 3 kv heads, head_dim 64
// Throws Error naming the value for any other name.
Shape shape_preset(std::string_view name, int n_layers = 1);

struct SyntheticOptions {
  Shape shape;               // must equal the cache's shape
  int n_tokens = 32768;      // context cached per layer, [16, 1 << 20]
  int n_steps = 16;          // decode queries per layer, [1, 4096]
  uint64_t seed = 1;
  // Logit gain of each query's content part (its pull towards a few "relevant" key
  // clusters), in (0, 16]. Higher = fewer tokens hold the mass: the share of tokens needed
  // to reach 90% of the mass falls monotonically as this grows (docs/workload.md has the
  // measured curve).
  double concentration = 1.0;
  int n_sinks = 4;             // sink tokens at positions [0, n_sinks), [0, 64]
  double sink_mass = 0.2;      // mean target share of each head's mass on the sinks, [0, 0.9]
  int recent_window = 64;      // decay length (tokens) of the recent band, [1, 4096]
  double recent_mass = 0.1;    // mean target share of the non-sink mass on the band, [0, 0.9]
  // Per-head spread of the sink and recent shares and of the gain (log-normal sigma), so
  // heads differ as in real models, [0, 2].
  double head_spread = 0.5;
  int tokens_per_cluster = 128;  // mean cluster size; n_clusters = max(4, n_tokens / it)
  int segment_length = 16;       // mean run of consecutive tokens in one cluster, [1, 4096]
  int relevant_clusters = 4;     // clusters each query group draws on per step, [1, 64]
  // Cosine between the content directions of two query heads of one GQA group, [0, 1]:
  // 1 = identical heads, 0 = unrelated.
  double head_correlation = 0.8;

  // Throws Error naming the first bad value.
  void validate() const;
};

struct SyntheticWorkload {
  SyntheticOptions options;
  // [n_layers][n_steps][n_q_heads][head_dim] float32
  std::vector<float> queries;

  // q for (layer, step): [n_q_heads][head_dim]
  const float* query(int layer, int step) const;
};

// Fills every layer of `kv` (which must be empty and have shape options.shape) with
// options.n_tokens tokens and returns the decode queries. Queries are calibrated against
// the STORED keys, so the sink and recent shares hold for what kernels read.
SyntheticWorkload synthetic_generate(const SyntheticOptions& options, KvCache& kv, ThreadPool& pool);

// Exact softmax statistics of the workload's queries against the cache, averaged over
// (step, query head) of one layer.
struct AttentionProfile {
  double sink_mass = 0;      // mass on tokens [0, n_sinks)
  double recent_mass = 0;    // mass on the last recent_window tokens
  double topp = 0.9;         // the p of the fractions below
  double topp_fraction = 0;  // mean of (fewest tokens reaching topp) / n_tokens
  double topp_fraction_p10 = 0, topp_fraction_p50 = 0, topp_fraction_p90 = 0;  // over head-steps
  // GQA groups (Tactic 4.5: a group attends the union of its heads' sets), means over
  // (step, kv head): the union's share of the tokens, the union over the per-head set
  // (union_fraction / topp_fraction), and between two heads of a group the Pearson
  // correlation of their logits over the content tokens (past the sinks, before the recent
  // window) and the Jaccard of their top-p sets. NaN for group 1.
  double union_fraction = 0, union_inflation = 0, group_logit_corr = 0, group_jaccard = 0;
  // A page level over the page key bounds (Quest's: a token of page p scores at most
  // U_p = sum_c max(q_c kmin_c, q_c kmax_c)), per (step, kv head), means; pages holding a
  // sink or a recent token are always kept. NaN without page statistics.
  //   page_admissible: the share of pages a group could skip while, for every head of the
  //     group, the skipped pages' upper-bound mass (sum of len_p exp(scale U_p)) stays within
  //     (1 - topp) of the head's exact total: pages in ascending order of the largest such
  //     share over the heads, while every head's sum fits. The exact total is an oracle's
  //     (a filter knows only a lower bound), so this is the most an admissible filter skips.
  //   page_keep_mass[i], page_keep_reach[i]: keeping the pages of the largest bound share
  //     (over the group's heads), keep_budget[i] of all pages besides the forced ones:
  //     the heads' mean exact mass in the kept pages, and the share of head-steps whose kept
  //     pages hold at least topp (a budgeted page level, as Twilight's, keeps P reachable).
  static constexpr double keep_budget[2] = {0.125, 0.25};
  double page_admissible = 0;
  double page_keep_mass[2] = {0, 0}, page_keep_reach[2] = {0, 0};
  // A token level from a 1-bit key sketch (each key channel as its mean plus or minus its
  // mean absolute deviation, both over the cached keys of the kv head), a candidate first
  // stage before a finer estimate: keeping keep_budget[i] of the tokens besides the sinks and
  // the recent band, those of the largest estimated weight relative to each head's largest
  // (over the group's heads; ties to the earlier token), the heads' mean exact mass in them
  // and the share of head-steps where it reaches topp.
  double bit1_keep_mass[2] = {0, 0}, bit1_keep_reach[2] = {0, 0};
};

// topp in (0, 1]. Reads the stored keys (the scores kernels see).
AttentionProfile attention_profile(const KvCache& kv, const SyntheticWorkload& w, int layer, double topp,
                                   ThreadPool& pool);
// The same statistics for any decode queries (real traces): queries [n_steps][n_q_heads]
// [head_dim] against layer `layer` of kv; step s attends tokens [0, n_attended[s]) (all
// cached tokens when n_attended is null); tokens [0, n_sinks) count as sinks and the last
// recent_window as the recent band.
AttentionProfile attention_profile(const KvCache& kv, int layer, const float* queries, int n_steps,
                                   const int* n_attended, int n_sinks, int recent_window, double topp,
                                   ThreadPool& pool);

}  // namespace cumulus
