// LFPS's parameters and rules (LFPS (Learn from the Past), section 4.2, Algorithm 1; docs/methods.md "lfps"),
// defined once for the CPU method (src/methods/lfps/lfps.cpp) and the GPU pipeline
// (methods/cuda_methods.h, make_lfps_gpu): each field's default, range and help are written
// here, and the registry's parameters are generated from them (methods/options.h).
#pragma once

#include <cmath>

#include "cumulus/methods/options.h"

namespace cumulus {

struct LfpsOptions {
  double a = 0.2;         // threshold scale of Eq. 8
  double r = 0.95;        // table decay of Eq. 10, in [0, 1)
  double epsilon = 0.85;  // sink ratio above which a head outputs the mean value (Eq. 6); 1 disables
  int s = 32;             // prompt queries that build the tables (Eq. 4)
  int budget = 0;         // top-k size per query head in tokens; 0: budget_ratio of the cache
  double budget_ratio = 0.02;
  int sinks = 4;          // first tokens always attended, kept out of the tables

  template <class F>
  void fields(F& f) {
    f.number(a, "a", ParamRange::left_open(0, 1e6), "threshold scale of Eq. 8 (section 5: 0.2 and 0.3)");
    f.number(r, "r", ParamRange::right_open(0, 1), "table decay of Eq. 10, in [0, 1) (section 5: 0.95)");
    f.number(epsilon, "epsilon", ParamRange::closed(0, 1),
             "sink ratio above which a head outputs the mean value (Eq. 6; 1 disables)");
    f.number(s, "s", ParamRange::closed(1, 1 << 20), "prompt queries that build the tables (Eq. 4; section 5: 32)");
    f.number(budget, "budget", ParamRange::closed(0, 1 << 30),
             "top-k size per query head in tokens (0: budget_ratio of the cache)");
    f.number(budget_ratio, "budget_ratio", ParamRange::left_open(0, 1),
             "top-k size as a share of the cache when budget=0 (Tables 1-2: 2%)");
    f.number(sinks, "sinks", ParamRange::closed(1, 1 << 20),
             "first tokens always attended and kept out of the tables (section 5: four)");
  }
};

// w_local sums the keys at positions t-6 .. t-1 (Eq. 5).
inline constexpr int kLfpsLocalWindow = 6;
// The expansion offsets of Eq. 9: position i + delta joins C1 for i in C0 and delta in
// [kLfpsOffsetMin, kLfpsOffsetMax] = {-1, 0, 1, 2}.
inline constexpr int kLfpsOffsetMin = -1, kLfpsOffsetMax = 2;

#ifdef __CUDACC__
#define CUMULUS_LFPS_HD __host__ __device__
#else
#define CUMULUS_LFPS_HD
#endif

// The top-k size of a step over n cached tokens: budget, or ceil(budget_ratio n) and at
// least 1 when budget is 0 (host and device: the GPU computes it per step in its kernels).
CUMULUS_LFPS_HD inline int lfps_budget(int budget, double budget_ratio, int n) {
  if (budget > 0) return budget;
  const int k = static_cast<int>(ceil(budget_ratio * n));
  return k < 1 ? 1 : k;
}
inline int lfps_budget(const LfpsOptions& o, int n) { return lfps_budget(o.budget, o.budget_ratio, n); }

}  // namespace cumulus
