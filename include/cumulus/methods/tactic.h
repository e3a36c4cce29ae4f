// Tactic's selection parameters (Tactic, section 4, Algorithm 1; docs/methods.md "tactic"),
// defined once for the CPU method (src/methods/tactic/tactic.cpp, whose registry parameters take
// these names and their defaults from here) and the GPU pipeline (methods/cuda_methods.h,
// TacticGpuOptions). The rules that use them (the exactly scored positions, the k-means
// initial sample) are src/methods/tactic/tactic_rules.h, shared the same way.
#pragma once

#include <cstdint>

namespace cumulus {

struct TacticOptions {
  double p = 0.9;            // target cumulative attention mass P, in (0, 1]
  int cluster_size = 16;     // average tokens per cluster: ceil(n / cluster_size) centroids (section 4.2)
  int max_iter = 10;         // k-means iterations at most
  double init_ratio = 0.02;  // share of the ranked list scored exactly at its head, N (section 4.4)
  int window = 64;           // tokens per sample window around p1 and p2 (not given in the paper)
  double p1 = 0.1, p2 = 0.6; // the sample windows' centres, shares of the list (section 4.4: 10%, 60%)
  // Ours, default 0 = the paper: the first `sinks` and the last `recent` clustered tokens
  // leave the ranked list and join the dense tail (always attended, scored exactly, counted
  // in the estimate's total), as StreamingLLM and LFPS keep sinks and a window.
  int sinks = 0, recent = 0;
  uint32_t seed = 0;  // seeds the k-means initial sample, with (layer, kv head, segment start)
};

}  // namespace cumulus
