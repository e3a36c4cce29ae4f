// The GPU decoder every sparse decode method runs as (src/kernels/cuda; docs/cuda.md): a
// decode step is select() then attend() for a batch of sequences over a DeviceKvCache.
// Selection ends in per-kv-head sorted token lists (each the union of its GQA group's
// choices, Tactic 4.5); attention runs the shared split-KV kernel over them (Tactic 4.6
// balancing); neither synchronises with the host, so a step can be captured in a CUDA
// graph. make_ops_gpu is the selection ops' CUDA backend (kernels/select_ops.h), which runs
// the methods defined once over them (methods/policy.h); the fused pipelines of tactic, psa
// and sketch_topp are methods/cuda_methods.h. Plain C++: no CUDA header here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/select_ops.h"

namespace cumulus::cuda {

// Host copy of one step's selection (download: synchronises).
struct SparseStepStats {
  std::vector<int> tokens;     // [n_seqs][n_kv_heads] tokens each kv head attended (the union)
  std::vector<float> claimed;  // [n_seqs][n_q_heads] mass claimed (NaN: the method makes no claim)
  std::vector<int> budget;     // [n_seqs][n_q_heads] the head's own choice (tactic: tokens; psa,
                               // quest: pages; oracle_topp, oracle_topk: tokens; streaming:
                               // the tokens it marks; lfps: |C2|)
  std::vector<uint8_t> bypass; // [n_seqs][n_q_heads] 1: the head output the mean value and attended
                               // no set (lfps's sink bypass); empty for methods without one
};

// The prompt's last queries (after RoPE), for methods that learn from the prompt's attention
// (lfps): q [n_seqs][rows][n_q_heads][head_dim] on the device, row j of a sequence being the
// query at position n - rows + j, n its cached tokens at prefill().
struct DevicePromptQueries {
  const float* q = nullptr;
  int rows = 0;
};

class SparseDecoder {
 public:
  virtual ~SparseDecoder();
  SparseDecoder(const SparseDecoder&) = delete;
  SparseDecoder& operator=(const SparseDecoder&) = delete;

  virtual std::string name() const = 0;
  // Builds indexes over the cached prompt (tactic: k-means per sequence and kv head; lfps:
  // its score tables from `pq`). May synchronise (prefill is not a decode step).
  virtual void prefill(void* stream = nullptr, const DevicePromptQueries& pq = {}) { (void)stream, (void)pq; }
  // The prompt queries prefill() needs per sequence (0: none; lfps: its s).
  virtual int prompt_queries() const { return 0; }
  // Selection of one decode step. q: [n_seqs][n_q_heads][head_dim] on the device.
  virtual void select(const float* q, void* stream = nullptr) = 0;
  // Sparse attention over the lists of the last select() (DeviceDecodeArgs semantics:
  // lse_ref and mass optional, both or neither).
  void attend(const float* q, float* out, float* lse, const float* lse_ref = nullptr, float* mass = nullptr,
              void* stream = nullptr);

  // attend() reads pages through this table instead of the view's (null: the view's own):
  // a table with the same pages at other slots, as KvPagePool::stage returns, where copies
  // of host pages wait in device memory. Selection always reads the view's own table.
  void set_attend_page_table(const int32_t* table);

  // The lists of the last select(): idx [n_seqs][n_kv_heads][stride], len [n_seqs][n_kv_heads]
  // (not written by a step that a method's cost rule sends wholly to dense attention:
  // stats() then reports every token).
  const int32_t* list_idx() const;
  // True when the method's cost rule sends every step to dense attention (sketch_topp's
  // gpu_dense_mib): the lists are then not written, and every token is read.
  bool dense_step() const;
  const int32_t* list_len() const;
  int list_stride() const;
  SparseStepStats stats(void* stream = nullptr) const;
  // The last step's statistics added to acc[4] on the device, with no host wait (a decode
  // step captured in a CUDA graph keeps it): acc[0] += tokens attended summed over query
  // heads (each its kv head's list; a bypassed head none), acc[1] += the claims of query
  // heads that make one, acc[2] += their count, acc[3] += the share of the cached K/V read,
  // summed over the batch's sequences. The model runtime's AttentionSummary comes from these.
  void accumulate_stats(double* acc, void* stream = nullptr) const;
  // Bytes per cached token of one kv head that a step's selection reads besides the K/V
  // rows of its lists, as the CPU method counts them (sketch_topp: the sketch; oracle_topp:
  // every key; quest, psa: page metadata; tactic: the centroids, its exactly scored tail
  // left out); 0 for a step the cost rule sends to dense attention. accumulate_stats adds
  // it to the K/V share.
  virtual double select_bytes_per_token() const { return 0; }
  // Lists of at most this many tokens skip the selection (sketch_topp's min_context): no
  // selection bytes are counted for them.
  virtual int select_min_tokens() const { return 0; }
  // Throws Error if a kernel flagged bad input (synchronises).
  void check(void* stream = nullptr);

  struct Base;

 protected:
  SparseDecoder(const DeviceKvView& kv, int group, const AttentionPlanOptions& plan);
  Base& base() const { return *base_; }
  // Methods whose claims come from the attention's log-sum-exp (sketch_topp) enqueue their
  // claims here, at the end of attend(), and may adjust the output (sketch_topp's
  // rest=mean; lfps's bypassed heads, whose mass, when asked for, becomes NaN); lse is
  // never null (attend() supplies its own buffer when the caller passes none and
  // needs_lse() is true), mass may be.
  virtual bool needs_lse() const { return false; }
  virtual void after_attend(const float* lse, float* out, float* mass, void* stream) {
    (void)lse;
    (void)out;
    (void)mass;
    (void)stream;
  }

 private:
  std::unique_ptr<Base> base_;
};

// A decode method written once against the selection ops (kernels/select_ops.h; the methods
// are methods/policy.h's: quest, oracle_topp, oracle_topk, streaming): `step` issues one
// decode step's ops, here on the device for the whole batch, with no host wait. It must
// issue the same ops at every step: the decoder calls it once at construction, launching
// nothing, to size its buffers. select_bytes_per_token() counts what its scoring reads
// (every key, or the pages' key min and max), as the host backends do.
using SelectStep = std::function<void(SelectOps&)>;
std::unique_ptr<SparseDecoder> make_ops_gpu(const DeviceKvView& kv, int group, std::string name, SelectStep step,
                                            const AttentionPlanOptions& plan = {});

// Profiling: microseconds of each phase of the decoder's last select(), where the method
// times them (sketch_topp: each pass again alone between events); else empty. Synchronises.
std::vector<std::pair<std::string, double>> sparse_decoder_phase_times(const SparseDecoder& m, void* stream = nullptr);

}  // namespace cumulus::cuda
