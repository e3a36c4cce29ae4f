// FlexPrefill's options as the registry's parameters give them, for the CPU method
// (src/methods/flexprefill/flexprefill.cpp) and the GPU runtime's prefill alike, and the
// statistics both report (docs/methods.md "flexprefill").
#pragma once

#include <vector>

#include "cumulus/kernels/flexprefill_select.h"
#include "cumulus/kernels/prefill.h"
#include "cumulus/methods/prefill.h"
#include "cumulus/methods/options.h"
#include "cumulus/methods/registry.h"

namespace cumulus {

// The selection's Config (its defaults are the kernel's, kernels/flexprefill_select.h) and
// chunk, tokens per prefill forward pass (0 = the whole prompt in one); the registry's
// parameters are generated from `fields` (methods/options.h).
struct FlexPrefillOptions {
  flexprefill::Config config;
  int chunk = 0;

  template <class F>
  void fields(F& f) {
    f.number(config.gamma, "gamma", ParamRange::left_open(0, 1), "cumulative attention threshold (1 = dense)");
    f.number(config.tau, "tau", ParamRange::closed(0, 1), "query-aware iff sqrt(JSD) < tau (0 = never)");
    f.number(config.block_size, "block_size", ParamRange::closed(8, 4096), "tokens per query/key block");
    f.number(config.min_budget, "min_budget", ParamRange::closed(0, 1 << 30),
             "tokens: min vertical and slash budget each");
    f.number(config.max_budget, "max_budget", ParamRange::closed(0, 1 << 30),
             "tokens: max vertical and slash budget each (0 = none)");
    f.number(chunk, "chunk", ParamRange::closed(0, 1 << 30), "tokens per prefill forward (0 = the whole prompt)");
  }
  // flexprefill::validate: max_budget >= min_budget unless 0 (an Error naming both).
  void check() const { flexprefill::validate(config); }
};

// One layer's chunk of a flexprefill prefill added to the method's statistics: its causal
// (query head, query block, key block) triples, those `layout` lists, each head's pattern.
// The CPU method and the GPU runtime report through this, so their block shares compare.
void flexprefill_stats_add(PrefillStats& stats, const flexprefill::Geometry& g, const BlockSparseLayout& layout,
                           const std::vector<flexprefill::HeadSelection>& heads);

}  // namespace cumulus
