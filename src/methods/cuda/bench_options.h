// tactic's GPU knobs that only benchmarks and tests set (bench/cuda_decode_bench.cpp,
// tests/cuda): the experiment variants kept to measure against the defaults. Not installed
// and not part of the public API (methods/cuda_methods.h, whose make_tactic_gpu runs the
// defaults below). Plain C++. docs/cuda.md has the measurements behind each default.
#pragma once

#include <memory>
#include <vector>

#include "cumulus/methods/cuda_methods.h"
#include "kernels/cuda/bench_options.h"

namespace cumulus::cuda {

// ---- tactic (make_tactic_gpu) ---------------------------------------------------------------

struct TacticGpuBenchOptions {
  // replica_of[s] = r < s: sequence s holds the same keys as sequence r and reuses its
  // clustering (the result would be identical: the sample is seeded per layer and head).
  // Empty (default): every sequence is clustered.
  std::vector<int> replica_of;
  // The ranking as one launch per step: a bucket sort of the clusters by centroid score,
  // their list positions and the exactly scored positions' rows (up to 8192 clusters per
  // kv head, i.e. 128K tokens at cluster_size 16); false, or more clusters: a radix sort
  // and a positions kernel. Both give the same order, so the same tokens.
  bool bucket_ranking = true;
  // Record the bucket ranking's phases for sparse_decoder_phase_times.
  bool record_phases = false;
  // The shared-memory marks' slices per kv head (with the bucket ranking): 0 picks two CTAs
  // per multiprocessor over the batch's kv heads, at most 32; fewer slices means fewer
  // global atomics and less parallel marking. The lists are the same for any value.
  int mark_slices = 0;
  // The marks by token range (with the bucket ranking, when the group's [group][clusters]
  // start positions fit in shared memory and a CTA has at most 4 tiles of 8192 tokens to
  // walk): CTAs over runs of a list's tokens test each token's list position against every
  // head's budget and store whole bitmap words; false, or otherwise: the marks by ranked
  // cluster (shared-memory bitmaps per slice, flushed with atomics). The lists are the same
  // either way.
  bool token_marks = true;
};

// make_tactic_gpu with the bench knobs (make_tactic_gpu(kv, group, o, plan) is this with
// TacticGpuBenchOptions{}).
std::unique_ptr<SparseDecoder> make_tactic_gpu_bench(const DeviceKvView& kv, int group, const TacticGpuOptions& o,
                                                     const TacticGpuBenchOptions& bench,
                                                     const AttentionPlanOptions& plan = {});

}  // namespace cumulus::cuda
