// Tactic's selection parameters (Tactic, section 4, Algorithm 1; docs/methods.md "tactic"),
// defined once for the CPU method (src/methods/tactic/tactic.cpp) and the GPU pipeline
// (methods/cuda_methods.h, TacticGpuOptions): each field's default, range and help are
// written here, and the registry's parameters are generated from them (methods/options.h).
// The rules that use them (the exactly scored positions, the k-means initial sample) are
// src/methods/tactic/tactic_rules.h, shared the same way.
#pragma once

#include <cstdint>

#include "cumulus/methods/options.h"

namespace cumulus {

struct TacticOptions {
  double p = 0.9;            // target cumulative attention mass P, in (0, 1]
  int cluster_size = 16;     // average tokens per cluster: ceil(n / cluster_size) centroids (section 4.2)
  int max_iter = 10;         // k-means iterations at most
  double init_ratio = 0.02;  // share of the ranked list scored exactly at its head, N (section 4.4)
  int window = 64;           // tokens per sample window around p1 and p2 (not given in the paper)
  double p1 = 0.1, p2 = 0.6; // the sample windows' centres, shares of the list (section 4.4: 10%, 60%)
  // Tokens appended after the prefill are attended densely until this many, then clustered
  // (section 1); the GPU runtime rebuilds the index at the same interval.
  int recluster_interval = 2048;
  uint32_t seed = 0;  // seeds the k-means initial sample, with (layer, kv head, segment start)
  // false: Algorithm 1 (the fit); true: true scores in cluster order (Table 1's
  // "cluster optimal", the CPU's only).
  bool cluster_optimal = false;
  // Ours, default 0 = the paper: the first `sinks` and the last `recent` clustered tokens
  // leave the ranked list and join the dense tail (always attended, scored exactly, counted
  // in the estimate's total), as StreamingLLM and LFPS keep sinks and a window.
  int sinks = 0, recent = 0;

  template <class F>
  void fields(F& f) {
    f.number(p, "p", ParamRange::left_open(0, 1),
             "target cumulative attention mass P, in (0, 1] (Tables 2 and 4 use 0.7-0.9)");
    f.number(cluster_size, "cluster_size", ParamRange::closed(1, 1 << 20),
             "average tokens per cluster (section 5.1 uses 16; section 4.2 says 32)");
    f.number(max_iter, "max_iter", ParamRange::closed(1, 1000), "K-means iterations at most (section 4.2)");
    f.number(init_ratio, "init_ratio", ParamRange::closed(0, 1),
             "share of the list scored exactly at its head, N (section 4.4: 1-2%)");
    f.number(window, "window", ParamRange::closed(1, 1 << 20),
             "tokens per sample window around p1 and p2 (not given in the paper)");
    f.number(p1, "p1", ParamRange::closed(0, 1), "first sample window centre, share of the list (section 4.4: 10%)");
    f.number(p2, "p2", ParamRange::closed(0, 1), "second sample window centre, share of the list (section 4.4: 60%)");
    f.number(recluster_interval, "recluster_interval", ParamRange::closed(1, 1 << 30),
             "appended tokens attended densely before they are clustered (section 1: 2048)");
    f.number(seed, "seed", ParamRange::closed(0, 2147483647), "seed of the K-means initial sample");
    f.choice(cluster_optimal, "mode", {"fit", "cluster_optimal"},
             "fit (Algorithm 1) or cluster_optimal (true scores in cluster order, Table 1)");
    f.number(sinks, "sinks", ParamRange::closed(0, 1 << 30),
             "first tokens always attended and scored exactly, outside the fit (ours; 0 = the paper)");
    f.number(recent, "recent", ParamRange::closed(0, 1 << 30),
             "last clustered tokens always attended and scored exactly (ours; 0 = the paper)");
  }
  // p1 < p2 (an Error naming both); src/methods/tactic/tactic.cpp.
  void check() const;
};

}  // namespace cumulus
