// FlexPrefill's block selection (the FlexPrefill paper's "Query-Aware Sparse Pattern Determination" and
// "Cumulative-Attention Based Index Selection", Algorithms 3 and 4), as plain host functions
// in the kernels layer so that the method (src/methods/flexprefill/flexprefill.cpp) and the CUDA port's
// host half (src/kernels/cuda/prefill.cu, cuda::flexprefill_select) share one definition and
// can be tested against it. Not installed. docs/methods.md "flexprefill" states every step
// and each deviation from the paper and its reference code.
//
// Everything is per QUERY head (the reference's GQA handling): head qh reads kv head
// qh / group. Blocks are aligned to absolute positions (kernels/prefill.h).
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include "cumulus/core/shape.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/kernels/prefill.h"

namespace cumulus::flexprefill {

struct Config {
  double gamma = 0.9;     // cumulative attention threshold, (0, 1]; 1 = every causal block
  double tau = 0.1;       // query-aware iff sqrt(JSD(estimate, true)) < tau; 0 = never
  int block_size = 128;   // tokens per query and key block
  int min_budget = 1024;  // tokens: at least ceil(min_budget / block) vertical and slash blocks
  int max_budget = 0;     // tokens: at most ceil(max_budget / block) of each; 0 = no maximum
};

enum class Pattern : uint8_t { dense, query_aware, vertical_slash };
std::string_view pattern_name(Pattern p);

// A chunk of queries at positions [pos, pos + n_q) against the keys [0, pos + n_q).
struct Geometry {
  int pos = 0;
  int n_q = 0;
  int block_size = 128;

  int n_keys() const { return pos + n_q; }
  int n_k_blocks() const { return (n_keys() + block_size - 1) / block_size; }
  int first_q_block() const { return pos / block_size; }
  int n_q_blocks() const { return (n_keys() - 1) / block_size - first_q_block() + 1; }
  // Rows of Q^, the probe: the chunk's last min(block_size, n_q) queries.
  int n_rows() const { return n_q < block_size ? n_q : block_size; }
};

// One query head's inputs.
struct HeadInputs {
  // attention_prefill_projection of the chunk's last n_rows() queries: [n_keys] each.
  const float* vertical = nullptr;
  const float* slash = nullptr;
  // The head's queries of the chunk: row i (position pos + i) at q + i * q_stride, [head_dim].
  const float* q = nullptr;
  size_t q_stride = 0;
  // Optional precomputed query means (another backend computes them where Q lives; q is then
  // not read): the mean of the probe rows (the chunk's last n_rows() queries), [head_dim],
  // and of the chunk's queries in each query block (grid-aligned, a partial block averaged
  // over the queries it holds), [n_q_blocks][head_dim]. Both or neither.
  const float* q_probe_mean = nullptr;
  const float* q_block_mean = nullptr;
  // [n_k_blocks][head_dim]: mean of the keys of each key block (its tokens < n_keys).
  const float* k_block_mean = nullptr;
  int head_dim = 0;
};

struct HeadSelection {
  Pattern pattern = Pattern::dense;
  double js_distance = std::numeric_limits<double>::quiet_NaN();  // NaN when not estimated
  int n_vertical = 0;        // vertical blocks (first block included)
  int n_slash = 0;           // slash offsets (diagonal included)
  int64_t n_query_aware = 0; // (query block, key block) pairs from the query-aware search
  std::vector<std::vector<int32_t>> lists;  // [n_q_blocks]: sorted key blocks per query block
};

// True when every causal block is taken without estimation: gamma = 1, at most 2 key
// blocks, or a min budget that covers every key block. (The general rule would select
// every block there too; this only skips the probe.)
bool selects_everything(const Config& c, const Geometry& g);

HeadSelection select_head(const Config& c, const Geometry& g, const HeadInputs& in);

// Mean key per key block of one kv head over the keys [0, n_keys): out [n_blocks][head_dim].
// Uses the view's per-page means when block_size is a multiple of the page size (weighted
// by page lengths), else reads every key. `exact` forces the float64 pass over every key.
void key_block_means(const PagedHeadView& kv, int n_keys, int block_size, bool exact, float* out);

struct LayerSelection {
  BlockSparseLayout layout;
  std::vector<HeadSelection> heads;  // [n_q_heads]
};

// The selection of one layer's chunk: the projection of every query head (cpu:: kernels, or
// the float64 ref:: ones when `reference`), then select_head per query head, heads in
// parallel on `pool` (results do not depend on the thread count).
//   kv: [n_kv_heads] views holding >= n_keys tokens; q: [n_q][n_kv_heads * group][head_dim]
LayerSelection select_layer(const Config& c, const Geometry& g, const PagedHeadView* kv, int n_kv_heads, int group,
                            const float* q, ThreadPool& pool, bool reference = false);

// The layout of a chunk from per-query-head selections (heads in query-head order).
BlockSparseLayout layout_of(const Geometry& g, const std::vector<HeadSelection>& heads);

// Throws Error naming the bad value (gamma outside (0, 1], tau outside [0, 1], block_size
// outside [8, 4096], negative budgets, max_budget below min_budget).
void validate(const Config& c);

}  // namespace cumulus::flexprefill
