// LFPS's per-head state (LFPS (Learn from the Past), section 4.2), exposed to tests so that they can check the
// score tables' invariant (Appendix B.2, Eq. 15). Internal to src/methods and tests.
#pragma once

#include <vector>

#include "cumulus/methods/method.h"

namespace cumulus::methods {

// One (layer, query head) of an lfps method.
struct LfpsTables {
  // [>= n_tokens] indexed by key position; entries below `sinks` stay 0. The slash table
  // may run one entry past the cache per update (its shift, Eq. 10, aligns it to the next
  // query); those entries wait for the tokens they describe.
  std::vector<double> vertical, slash;
  double sigma_hat2 = 0;  // sigma_h^2 / ||q_h||^2 from the last prompt query (section 4.2)
  double rho = 0;         // the last decode step's sparsity ratio (Eq. 6)
  bool bypass = false;    // whether the last decode step bypassed (rho > epsilon)
};

// The tables of `method` (which must be an lfps method) for (layer, q_head).
const LfpsTables& lfps_tables(const DecodeMethod& method, int layer, int q_head);

}  // namespace cumulus::methods
