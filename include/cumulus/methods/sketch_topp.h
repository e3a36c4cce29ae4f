// sketch_topp's selection parameters (ours; docs/methods.md "sketch_topp"), defined once for
// the CPU method (src/methods/sketch_topp/sketch_topp.cpp) and the GPU pipeline
// (methods/cuda_methods.h, SketchToppGpuOptions, which adds the GPU's own fields), as
// TacticOptions (methods/tactic.h) is for tactic: each field's default, range and help are
// written here, and the registry's parameters are generated from them (methods/options.h).
#pragma once

#include "cumulus/methods/options.h"

namespace cumulus {

struct SketchToppOptions {
  double p = 0.9;            // target cumulative attention mass of every query head, in (0, 1]
  double candidate_p = 0.92; // share of each head's estimated mass the union is chosen to hold
  int sinks = 4;             // first tokens always attended
  int recent = 64;           // last tokens always attended
  int min_context = 1024;    // contexts of at most this many tokens attend densely
  // rest=mean: the tokens not read join the output with their estimated mass times the
  // head's mean value row, o = (A o_U + R vbar) / (A + R), the claim unchanged; false
  // (rest=none) leaves them out, as the papers' methods do.
  bool rest_mean = true;
  double dense_above = 0.5;  // a kv head whose union exceeds this share of its tokens attends densely
  // The GPU's cost rule (SketchToppGpuOptions::dense_kv_bytes, in MiB); the CPU ignores it.
  int gpu_dense_mib = 256;

  template <class F>
  void fields(F& f) {
    f.number(p, "p", ParamRange::left_open(0, 1),
             "target cumulative attention mass of every query head over the group's union, in (0, 1]");
    f.number(candidate_p, "candidate_p", ParamRange::left_open(0, 1),
             "share of each head's estimated mass the union is chosen to hold (the margin over p absorbs the "
             "sketch's error)");
    f.number(sinks, "sinks", ParamRange::closed(0, 1 << 30), "first tokens always attended");
    f.number(recent, "recent", ParamRange::closed(0, 1 << 30), "last tokens always attended");
    f.number(min_context, "min_context", ParamRange::closed(0, 1 << 30),
             "contexts of at most this many tokens attend densely (the selection would not pay)");
    f.choice(rest_mean, "rest", {"none", "mean"},
             "the tokens not read: mean (their estimated mass times the head's mean value row joins the output) or "
             "none (left out, as in every top-p method of the papers)");
    f.number(dense_above, "dense_above", ParamRange::closed(0, 1),
             "a kv head whose union exceeds this share of its tokens attends densely");
    f.number(gpu_dense_mib, "gpu_dense_mib", ParamRange::closed(0, 1 << 30),
             "--device cuda only (the CPU ignores it): a layer whose batch K/V is at most this many MiB attends "
             "densely, its selection's fixed launches costing more than the bytes they save (docs/cuda.md); 0: "
             "never");
  }
};

}  // namespace cumulus
