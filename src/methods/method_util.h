// Pieces every decode method shares: the per-layer cache views, the sparse attend over
// a Selection with stats, and bookkeeping of bytes read. Internal to src/methods.
#pragma once

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "cumulus/kernels/attention.h"
#include "cumulus/kernels/prefill.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/method.h"

namespace cumulus::methods {

inline constexpr double kNoClaim = std::numeric_limits<double>::quiet_NaN();

// [n_kv_heads] views of one layer.
std::vector<PagedHeadView> layer_views(const KvCache& kv, int layer);

// Prefill-kernel arguments for a chunk [pos, pos + c) of a model of `shape` over `views`
// ([n_kv_heads] of one layer): q, out [c][n_q_heads][head_dim], scale 1/sqrt(head_dim).
PrefillAttnArgs prefill_args(const Shape& shape, const std::vector<PagedHeadView>& views, int pos, int c,
                             const float* q, float* out);

// Sizes out.out [n_q_heads][head_dim] and out.stats [n_q_heads] (stats reset).
void attn_output_reset(const Shape& shape, AttnOutput& out);

// Attends every query head of kv head h over out.selection.tokens[h] (the group's
// union) with the CPU sparse kernel. Sets tokens_attended and adds the K+V bytes of the
// attended rows to bytes_read (split evenly over the group). mass_claimed is left to the
// caller. lse: optional [n_q_heads] output. Runs on ctx.pool with ctx.attention.
void attend_selection(const KvCache& kv, int layer, const float* q, const DecodeContext& ctx, AttnOutput& out,
                      float* lse = nullptr);

// Merges two attention outputs over disjoint sets of one query head (log-sum-exp lse1,
// lse2; -inf for an empty set) into the first: o1 = (e^lse1 o1 + e^lse2 o2) / (e^lse1 +
// e^lse2), lse1 = log(e^lse1 + e^lse2). o1, o2: [head_dim].
void merge_partial(float& lse1, float* o1, float lse2, const float* o2, int head_dim);

// Adds `bytes` read on behalf of kv head h, split evenly over its query heads.
void add_kv_head_bytes(const Shape& shape, int kv_head, double bytes, AttnOutput& out);

}  // namespace cumulus::methods
