// The registry's parameters read into the options the two backends take, in one place: the
// CPU methods' make_decode / make_prefill (src/methods) and the GPU runtime's pipelines and
// prefill (src/model/cuda/decode_methods.cu, prefill_methods.cu) both call these, so a
// parameter means the same on either device. Internal to src (no public header).
#pragma once

#include <string>
#include <vector>

#include "core/check.h"
#include "cumulus/methods/lfps.h"
#include "cumulus/methods/sketch_topp.h"
#include "cumulus/methods/tactic.h"
#include "cumulus/methods/prefill.h"
#include "cumulus/methods/registry.h"
#include "kernels/cpu/flexprefill_select.h"

namespace cumulus::methods {

// tactic's shared fields (TacticOptions, the base of the CPU and GPU options); checks
// p1 < p2. recluster_interval and mode are the CPU method's.
inline void read_tactic_options(const Params& p, TacticOptions& o) {
  o.p = p.get_double("p");
  o.cluster_size = p.get_int("cluster_size");
  o.max_iter = p.get_int("max_iter");
  o.init_ratio = p.get_double("init_ratio");
  o.window = p.get_int("window");
  o.p1 = p.get_double("p1");
  o.p2 = p.get_double("p2");
  o.seed = static_cast<uint32_t>(p.get_int("seed"));
  o.sinks = p.get_int("sinks");
  o.recent = p.get_int("recent");
  CUMULUS_CHECK(o.p1 < o.p2, "method 'tactic': parameters p1={} and p2={} need p1 < p2", o.p1, o.p2);
}

// sketch_topp's shared fields (SketchToppOptions, the CPU method's options and the base of
// cuda::SketchToppGpuOptions): p, candidate_p, sinks, recent, min_context, dense_above and
// rest (none or mean). The GPU's own fields (dense_kv_bytes, ...) are the runtime's.
inline void read_sketch_topp_options(const Params& p, SketchToppOptions& o) {
  o.p = p.get_double("p");
  o.candidate_p = p.get_double("candidate_p");
  o.sinks = p.get_int("sinks");
  o.recent = p.get_int("recent");
  o.min_context = p.get_int("min_context");
  o.dense_above = p.get_double("dense_above");
  const std::string& rest = p.get_string("rest");
  CUMULUS_CHECK(rest == "none" || rest == "mean", "method 'sketch_topp': parameter rest='{}' must be none or mean",
                rest);
  o.rest_mean = rest == "mean";
}

// lfps's parameters (LfpsOptions, the CPU method's and the GPU pipeline's); checks r < 1.
inline LfpsOptions read_lfps_options(const Params& p) {
  LfpsOptions o;
  o.a = p.get_double("a");
  o.r = p.get_double("r");
  o.epsilon = p.get_double("epsilon");
  o.s = p.get_int("s");
  o.budget = p.get_int("budget");
  o.budget_ratio = p.get_double("budget_ratio");
  o.sinks = p.get_int("sinks");
  CUMULUS_CHECK(o.r < 1.0, "method 'lfps': parameter r={} must be in [0, 1)", o.r);
  return o;
}

// flexprefill's parameters: the selection's Config (checked by flexprefill::validate) and
// chunk, tokens per prefill forward pass (0 = the whole prompt in one).
struct FlexPrefillOptions {
  flexprefill::Config config;
  int chunk = 0;
};
inline FlexPrefillOptions read_flexprefill_options(const Params& p) {
  FlexPrefillOptions o;
  o.config.gamma = p.get_double("gamma");
  o.config.tau = p.get_double("tau");
  o.config.block_size = p.get_int("block_size");
  o.config.min_budget = p.get_int("min_budget");
  o.config.max_budget = p.get_int("max_budget");
  flexprefill::validate(o.config);
  o.chunk = p.get_int("chunk");
  return o;
}

// One layer's chunk of a flexprefill prefill added to the method's statistics: its causal
// (query head, query block, key block) triples, those `layout` lists, each head's pattern.
// The CPU method and the GPU runtime report through this, so their block shares compare.
inline void add_flexprefill_stats(PrefillStats& s, const flexprefill::Geometry& g, const BlockSparseLayout& layout,
                                  const std::vector<flexprefill::HeadSelection>& heads) {
  int64_t causal = 0;
  for (int r = g.first_q_block(); r < g.first_q_block() + g.n_q_blocks(); ++r) causal += r + 1;
  s.blocks_causal += causal * static_cast<int64_t>(heads.size());
  s.blocks_computed += static_cast<int64_t>(layout.blocks.size());
  for (const auto& h : heads) {
    switch (h.pattern) {
      case flexprefill::Pattern::dense: ++s.heads_dense; break;
      case flexprefill::Pattern::query_aware: ++s.heads_query_aware; break;
      case flexprefill::Pattern::vertical_slash: ++s.heads_vertical_slash; break;
    }
  }
}

}  // namespace cumulus::methods
