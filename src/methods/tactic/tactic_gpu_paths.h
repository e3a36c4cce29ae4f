// The code paths of tactic's GPU pipeline (src/methods/tactic/tactic.cu), chosen by size in
// make_tactic_gpu and forced here by the twin tests (tests/cuda) and dev/cuda/tactic_paths.cu,
// so that the fallbacks a large context takes run, and are checked, at small sizes. Every
// path gives the same lists. Not installed; plain C++.
#pragma once

#include <memory>

#include "cumulus/methods/cuda_methods.h"

namespace cumulus::cuda {

struct TacticGpuPaths {
  // The ranking as one launch per step: a bucket sort of the clusters by centroid score,
  // their list positions and the exactly scored positions' rows (up to 8192 clusters per
  // kv head, i.e. 128K tokens at cluster_size 16); false, or more clusters: a radix sort
  // and a positions kernel.
  bool bucket_ranking = true;
  // The marks by ranked cluster in shared memory (with the bucket ranking): slices per kv
  // head; 0 picks two CTAs per multiprocessor over the batch's kv heads, at most 32.
  int mark_slices = 0;
  // The marks by token range (with the bucket ranking, when the group's [group][clusters]
  // start positions fit in shared memory and a CTA has at most 4 tiles of 8192 tokens to
  // walk); false, or otherwise: the marks by ranked cluster.
  bool token_marks = true;
};

// make_tactic_gpu(kv, group, o, plan) is this with TacticGpuPaths{}.
std::unique_ptr<SparseDecoder> make_tactic_gpu_paths(const DeviceKvView& kv, int group, const TacticGpuOptions& o,
                                                     const TacticGpuPaths& paths,
                                                     const AttentionPlanOptions& plan = {});

}  // namespace cumulus::cuda
