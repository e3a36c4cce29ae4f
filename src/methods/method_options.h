// The registry's parameters read into the options the two backends take, in one place: the
// CPU methods' make_decode (src/methods/<name>/<name>.cpp) and their GPU pipelines
// (src/methods/<name>/<name>.cu) both call these, so a parameter means the same on either
// device. Private to the methods layer (flexprefill's, which the GPU runtime reads too, are
// methods/flexprefill.h).
#pragma once

#include <string>
#include <vector>

#include "core/check.h"
#include "cumulus/methods/lfps.h"
#include "cumulus/methods/sketch_topp.h"
#include "cumulus/methods/tactic.h"
#include "cumulus/methods/registry.h"

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

}  // namespace cumulus::methods
