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
  // Record each CTA's timeline (%globaltimer at the points of AttnTimelinePoint) at every
  // launch, for attention_plan_timeline (a buffer of [max CTAs][kAttnTimelinePoints] words
  // while set).
  bool timeline = false;
};

// The points of a CTA's timeline, recorded by its thread 0 (warp 0).
enum AttnTimelinePoint : int {
  kTlStart = 0,      // the CTA starts
  kTlPlanned,        // the split plan is made (every CTA makes it from all list lengths)
  kTlQuery,          // the query rows' loads are issued (after the first copies; the point
                     // does not wait for them to land)
  kTlFirstBlock,     // warp 0's first block has landed in shared memory
  kTlWarpDone,       // warp 0 has computed its last block
  kTlAllWarps,       // every warp of the CTA has (the barrier before the CTA's partial)
  kTlEnd,            // the CTA ends (after the merge when it is its list's last)
  kAttnTimelinePoints
};

// Sets the plan's bench knobs; takes effect from the next attention_decode on it (between
// launches; a CUDA graph keeps what it captured, including the timeline buffer's address:
// turning the timeline off frees that buffer, so a graph captured with it on must not be
// replayed afterwards).
void attention_plan_set_bench(AttentionPlan& plan, const AttentionPlanBenchOptions& o);
// The same for the attention plan of a decoder made by a make_*_gpu function.
void sparse_decoder_set_plan_bench(SparseDecoder& m, const AttentionPlanBenchOptions& o);
// With AttentionPlanBenchOptions::timeline set: the last launch's CTA timelines,
// [CTA][kAttnTimelinePoints] nanoseconds after the earliest start (-1: that CTA slot did not
// run, or did not reach that point: a CTA without work records only its start and end).
// Synchronises `stream`.
std::vector<int64_t> attention_plan_timeline(const AttentionPlan& plan, void* stream = nullptr);
// The same for the attention plan of a decoder made by a make_*_gpu function.
std::vector<int64_t> sparse_decoder_plan_timeline(const SparseDecoder& m, void* stream = nullptr);

// ---- every decoder (SparseDecoder) ----------------------------------------------------------

// Mean microseconds of the phases of the decoder's last select() over the batch's query
// heads, where the method records them (sketch_topp; tactic made with record_phases, below);
// else empty. Synchronises.
std::vector<std::pair<std::string, double>> sparse_decoder_phase_times(const SparseDecoder& m, void* stream = nullptr);

}  // namespace cumulus::cuda
