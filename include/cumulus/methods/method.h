// The decode-method contract (DESIGN.md "Methods"): given a query and the cache, return
// the attention output together with the set attended and the mass claimed for it.
// One DecodeMethod object per sequence; it may keep per-layer state (indexes, tables).
#pragma once

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cumulus/core/selection.h"
#include "cumulus/core/shape.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/kv/kv_cache.h"

namespace cumulus {

// Per query head, per decode step.
struct StepStats {
  int tokens_attended = 0;  // size of the set this head's output was computed over
  double mass_claimed = 0;  // the method's own claim of the mass that set holds
  // K/V bytes this head's step read, scoring included: the kv head's bytes divided by
  // its group size, so summing over query heads gives the layer's total.
  double bytes_read = 0;
  // mass_claimed is NaN for methods that make no claim (fixed-budget baselines).
  // Eval mode only (NaN otherwise): the set's true softmax mass and ||o - o_dense||.
  double mass_true = std::numeric_limits<double>::quiet_NaN();
  double out_err = std::numeric_limits<double>::quiet_NaN();
  // The head's output is not attention over a selected set (LFPS's sink bypass, LFPS Eq. 5-6:
  // it returns the prompt's mean value vector). Such a head attends nothing
  // (tokens_attended = 0, mass_claimed = NaN) and has no set whose mass could be checked:
  // mass_true should read NaN for it, while out_err (the distance to dense) stays meaningful.
  bool bypass = false;
};

struct AttnOutput {
  std::vector<float> out;        // [n_q_heads][head_dim]
  std::vector<StepStats> stats;  // [n_q_heads]
  Selection selection;           // what each kv head's group attended (the union)
};

// What a decode call may use besides the cache.
struct DecodeContext {
  ThreadPool* pool = nullptr;
  bool eval = false;  // fill mass_true and out_err (costs a dense pass)
  // on_prefill only: queries of the last prompt positions of the layer being prefilled,
  // for methods that learn from the prompt's own attention (LFPS, Eq. 4).
  //   prompt_q: [prompt_q_rows][n_q_heads][head_dim] float32; row j is the query at position
  //             n_tokens - prompt_q_rows + j. nullptr when the caller keeps none.
  const float* prompt_q = nullptr;
  int prompt_q_rows = 0;
  // The attention ops' split-KV partials (kernels/attention.h), reused from step to step;
  // nullptr: each call allocates its own. A Session passes its own.
  AttentionWorkspace* attention = nullptr;
};

class DecodeMethod {
 public:
  virtual ~DecodeMethod() = default;
  virtual std::string name() const = 0;
  // The prompt of `layer` is cached: build indexes.
  virtual void on_prefill(int layer, const KvCache& kv, const DecodeContext& ctx) {}
  // q: [n_q_heads][head_dim] float32 for `layer`. Fills out.out, out.stats and
  // out.selection (eval fields are filled by decode_step, not here).
  virtual void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) = 0;
  // Token `pos` was appended to `layer`.
  virtual void on_append(int layer, int pos, const KvCache& kv) {}
  // How many of the prompt's last queries on_prefill wants in DecodeContext::prompt_q
  // (0: none). A Session keeps that many rows per layer while it prefills.
  virtual int prompt_queries() const { return 0; }
};

// Runs method.decode and, in eval mode, fills mass_true (the true softmax mass of the
// attended union for each query head) and out_err (||o - o_dense||) from a dense pass.
// Checks q for NaN/Inf and the cache for emptiness first (both throw Error).
void decode_step(DecodeMethod& method, int layer, const float* q, const KvCache& kv, const DecodeContext& ctx,
                 AttnOutput& out);

// 1 / sqrt(head_dim): the softmax scale every method uses.
inline float attention_scale(int head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

}  // namespace cumulus
