// PSA's parameters (PSA: Progressive Sparse Attention, section 3.2, Algorithm 1;
// docs/methods.md "psa"), defined once for the CPU method (src/methods/psa/psa.cpp) and the
// GPU pipeline (methods/cuda_methods.h, PsaGpuOptions): each field's default, range and help
// are written here, and the registry's parameters are generated from them
// (methods/options.h).
#pragma once

#include "cumulus/methods/options.h"

namespace cumulus {

// A block's criticality: q . its mean key, or Quest's upper bound of q . k over it.
enum class PsaCriticality { mean, bound };
// When a head stops: Algorithm 1's estimate (AS_min * N_left for the blocks not visited) or
// ours, certified (Quest's bound on every block not visited: the claim is a lower bound).
enum class PsaStop { estimate, certified };

struct PsaOptions {
  double threshold = 0.95;  // attention weight threshold epsilon, in (0, 1]
  int microbatch = 1;       // blocks per attention step m
  PsaCriticality criticality = PsaCriticality::mean;
  PsaStop stop = PsaStop::estimate;

  template <class F>
  void fields(F& f) {
    f.number(threshold, "threshold", ParamRange::left_open(0, 1),
             "attention weight threshold epsilon, in (0, 1] (section 3.2 example: 95%)");
    f.number(microbatch, "microbatch", ParamRange::closed(1, 1 << 20),
             "blocks per attention step m (Algorithm 1 uses 1, Figure 4 uses 4)");
    f.choice(criticality, "criticality", {"mean", "bound"},
             "block score: mean (q . mean key) or bound (Quest's q.k upper bound)");
    f.choice(stop, "stop", {"estimate", "certified"},
             "estimate (Algorithm 1, AS_min * N_left) or certified (Quest bound on every unvisited block: the claim "
             "is a lower bound of the true mass)");
  }
};

}  // namespace cumulus
