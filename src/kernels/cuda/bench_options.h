// Knobs of the CUDA backend that only benchmarks and tests set (bench/cuda_decode_bench.cpp,
// tests/cuda): experiment variants kept to measure against the defaults, and test hooks. Not
// installed and not part of the public API (kernels/cuda.h, kernels/cuda_methods.h), whose
// functions always run the defaults below. Plain C++: no CUDA header here. docs/cuda.md has
// the measurements behind each default.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_methods.h"

namespace cumulus::cuda {

// ---- the attention plan (AttentionPlan) ----------------------------------------------------

struct AttentionPlanBenchOptions {
  // Work stealing: a chunk is a CTA's starting point; its warps claim units of 4 blocks
  // from the chunk, then from the list's other chunks, so a list ends when its last unit
  // does, whichever multiprocessors ran faster. false (default): each CTA computes exactly
  // its chunk. Measured on an H100 at 128K tokens (docs/cuda.md): stealing evens out the
  // CTAs' end times but costs 2-3% on dense and ~9% on tactic's lists (a claim's atomic
  // round trip sits in front of each unit's loads).
  bool steal = false;
  // Record each CTA's start and end (%globaltimer) at every launch, for
  // attention_plan_timeline (a buffer of [max CTAs][2] words while set).
  bool timeline = false;
};

// Sets the plan's bench knobs; takes effect from the next attention_decode on it (between
// launches; a CUDA graph keeps what it captured).
void attention_plan_set_bench(AttentionPlan& plan, const AttentionPlanBenchOptions& o);
// The same for the attention plan of a decoder made by a make_*_gpu function.
void sparse_decoder_set_plan_bench(SparseDecoder& m, const AttentionPlanBenchOptions& o);
// With AttentionPlanBenchOptions::timeline set: the last launch's CTA start and end times,
// [CTA][2] nanoseconds after the earliest start (-1: that CTA slot did not run).
// Synchronises `stream`.
std::vector<int64_t> attention_plan_timeline(const AttentionPlan& plan, void* stream = nullptr);

// ---- every decoder (SparseDecoder) ----------------------------------------------------------

// Mean microseconds of the phases of the decoder's last select() over the batch's query
// heads, where the method records them (sketch_topp; tactic made with record_phases, below);
// else empty. Synchronises.
std::vector<std::pair<std::string, double>> sparse_decoder_phase_times(const SparseDecoder& m, void* stream = nullptr);

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
