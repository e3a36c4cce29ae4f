// Knobs of the CUDA backend that only benchmarks and tests set (bench/cuda_decode_bench.cpp,
// tests/cuda): experiment variants kept to measure against the defaults, and test hooks
// (tactic's are src/methods/cuda/bench_options.h). Not installed and not part of the public
// API (kernels/cuda.h, kernels/cuda_decoder.h), whose
// functions always run the defaults below. Plain C++: no CUDA header here. docs/cuda.md has
// the measurements behind each default.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_decoder.h"

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

}  // namespace cumulus::cuda
