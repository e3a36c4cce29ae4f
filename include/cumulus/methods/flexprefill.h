// FlexPrefill's options as the registry's parameters give them, for the CPU method
// (src/methods/flexprefill/flexprefill.cpp) and the GPU runtime's prefill alike, and the
// statistics both report (docs/methods.md "flexprefill").
#pragma once

#include <vector>

#include "cumulus/kernels/flexprefill_select.h"
#include "cumulus/kernels/prefill.h"
#include "cumulus/methods/prefill.h"
#include "cumulus/methods/registry.h"

namespace cumulus {

// The selection's Config (checked by flexprefill::validate: Error naming the value) and
// chunk, tokens per prefill forward pass (0 = the whole prompt in one).
struct FlexPrefillOptions {
  flexprefill::Config config;
  int chunk = 0;
};
FlexPrefillOptions flexprefill_options(const Params& params);

// One layer's chunk of a flexprefill prefill added to the method's statistics: its causal
// (query head, query block, key block) triples, those `layout` lists, each head's pattern.
// The CPU method and the GPU runtime report through this, so their block shares compare.
void flexprefill_stats_add(PrefillStats& stats, const flexprefill::Geometry& g, const BlockSparseLayout& layout,
                           const std::vector<flexprefill::HeadSelection>& heads);

}  // namespace cumulus
