// sketch_topp's selection parameters (ours; docs/methods.md "sketch_topp"), defined once for
// the CPU method (src/methods/sketch_topp/sketch_topp.cpp, whose registry parameters take
// their names and these defaults) and the GPU pipeline (methods/cuda_methods.h, SketchToppGpuOptions, which
// adds the GPU's own fields), as TacticOptions (methods/tactic.h) is for tactic. The
// registry's parameters are read into it once for both, src/methods/method_options.h.
#pragma once

namespace cumulus {

struct SketchToppOptions {
  double p = 0.9;            // target cumulative attention mass of every query head, in (0, 1]
  double candidate_p = 0.92; // share of each head's estimated mass the union is chosen to hold
  int sinks = 4;             // first tokens always attended
  int recent = 64;           // last tokens always attended
  int min_context = 1024;    // contexts of at most this many tokens attend densely
  double dense_above = 0.5;  // a kv head whose union exceeds this share of its tokens attends densely
  // rest=mean: the tokens not read join the output with their estimated mass times the
  // head's mean value row, o = (A o_U + R vbar) / (A + R), the claim unchanged; false
  // (rest=none) leaves them out, as the papers' methods do.
  bool rest_mean = true;
};

}  // namespace cumulus
