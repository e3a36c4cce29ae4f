// Sparse decode methods on the GPU (src/kernels/cuda; docs/cuda.md, docs/methods.md): the
// fused select-then-attend pipelines of tactic, psa and sketch_topp, and the backend of the
// methods written once against the selection ops (make_ops_gpu), over a DeviceKvCache,
// for a batch of sequences, entirely on the device. A decode step is select() then
// attend(): selection ends in per-kv-head sorted token lists (each the union of its GQA
// group's choices, Tactic 4.5), attention runs the shared split-KV kernel over them
// (Tactic 4.6 balancing); neither synchronises with the host, so a step can be captured in
// a CUDA graph. Plain C++: no CUDA header here.
//
// These mirror the CPU methods in src/methods (same equations, same parameters); the
// deviations are listed in docs/cuda.md (centroids scored in f16, no re-clustering on the
// GPU, psa's estimate rule only, progressive rounds).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/select_ops.h"
#include "cumulus/kernels/sketch_topp.h"
#include "cumulus/kernels/tactic.h"

namespace cumulus::cuda {

// Host copy of one step's selection (download: synchronises).
struct SparseStepStats {
  std::vector<int> tokens;     // [n_seqs][n_kv_heads] tokens each kv head attended (the union)
  std::vector<float> claimed;  // [n_seqs][n_q_heads] mass claimed (NaN: the method makes no claim)
  std::vector<int> budget;     // [n_seqs][n_q_heads] the head's own choice (tactic: tokens; psa,
                               // quest: pages; oracle_topp: tokens)
};

class SparseDecoder {
 public:
  virtual ~SparseDecoder();
  SparseDecoder(const SparseDecoder&) = delete;
  SparseDecoder& operator=(const SparseDecoder&) = delete;

  virtual std::string name() const = 0;
  // Builds indexes over the cached prompt (tactic: k-means per sequence and kv head).
  // May synchronise (prefill is not a decode step).
  virtual void prefill(void* stream = nullptr) {}
  // Selection of one decode step. q: [n_seqs][n_q_heads][head_dim] on the device.
  virtual void select(const float* q, void* stream = nullptr) = 0;
  // Sparse attention over the lists of the last select() (DeviceDecodeArgs semantics:
  // lse_ref and mass optional, both or neither).
  void attend(const float* q, float* out, float* lse, const float* lse_ref = nullptr, float* mass = nullptr,
              void* stream = nullptr);

  // The lists of the last select(): idx [n_seqs][n_kv_heads][stride], len [n_seqs][n_kv_heads]
  // (not written by a step that a method's cost rule sends wholly to dense attention:
  // stats() then reports every token).
  const int32_t* list_idx() const;
  const int32_t* list_len() const;
  int list_stride() const;
  SparseStepStats stats(void* stream = nullptr) const;
  // The last step's statistics added to acc[4] on the device, with no host wait (a decode
  // step captured in a CUDA graph keeps it): acc[0] += tokens attended summed over query
  // heads (each its kv head's list), acc[1] += the claims of query heads that make one,
  // acc[2] += their count, acc[3] += the share of the cached K/V read, summed over the
  // batch's sequences. The model runtime's AttentionSummary comes from these.
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
  // rest=mean); lse is never null (attend() supplies its own buffer when the caller passes
  // none and needs_lse() is true).
  virtual bool needs_lse() const { return false; }
  virtual void after_attend(const float* lse, float* out, void* stream) {
    (void)lse;
    (void)out;
    (void)stream;
  }

 private:
  std::unique_ptr<Base> base_;
};

// tactic (001 section 4, Algorithm 1): k-means of the keys at prefill; per step clusters
// ranked by q . centroid, the exactly scored head and windows of the unpacked list, the
// a/x + b fit, the budget reaching P, the group's union, plus the dense tail. The ranking
// and the marks run as docs/cuda.md describes (the variants kept for benchmarks are
// src/kernels/cuda/bench_options.h's). The parameters are the CPU method's (kernels/tactic.h:
// p, cluster_size, max_iter, init_ratio, window, p1, p2, sinks, recent, seed), plus:
struct TacticGpuOptions : TacticOptions {
  int layer = 0;  // seeds the k-means initial sample as on the CPU (seed, layer, kv head, 0)
};
std::unique_ptr<SparseDecoder> make_tactic_gpu(const DeviceKvView& kv, int group, const TacticGpuOptions& o,
                                               const AttentionPlanOptions& plan = {});

// psa (004 section 3.2, Algorithm 1; estimate rule): pages ranked by criticality, visited
// in microbatches until AS_acc / (AS_acc + AS_min N_left) >= threshold. The visits run in
// rounds of growing size; after each round a verifying pass (the round's last CTA for each
// head) finds the exact stopping microbatch on the device and marks the head done, and
// later rounds skip done heads: no host round trip per microbatch (section 3.3).
struct PsaGpuOptions {
  double threshold = 0.95;
  int microbatch = 1;
  PageScoreKind criticality = PageScoreKind::kMean;
};
std::unique_ptr<SparseDecoder> make_psa_gpu(const DeviceKvView& kv, int group, const PsaGpuOptions& o,
                                            const AttentionPlanOptions& plan = {});

// A decode method written once against the selection ops (kernels/select_ops.h; the methods
// are methods/policy.h's: quest, oracle_topp, oracle_topk, streaming): `step` issues one
// decode step's ops, here on the device for the whole batch, with no host wait. It must
// issue the same ops at every step: the decoder calls it once at construction, launching
// nothing, to size its buffers. select_bytes_per_token() counts what its scoring reads
// (every key, or the pages' key min and max), as the host backends do.
using SelectStep = std::function<void(SelectOps&)>;
std::unique_ptr<SparseDecoder> make_ops_gpu(const DeviceKvView& kv, int group, std::string name, SelectStep step,
                                            const AttentionPlanOptions& plan = {});

// sketch_topp (ours, issue 17; docs/methods.md "sketch_topp", docs/cuda.md "sketch_topp on
// the GPU"). prefill() builds a 4-bit sketch of
// every key of every sequence (kernels/sketch.h's layout and encoder: the CPU's codes bit
// for bit); a step estimates every token's weight from the sketch, chooses each kv head's
// union (the smallest prefix of the tokens ordered by their largest estimated share at
// which every query head's estimated share reaches candidate_p, to 1/64 of an octave as the
// CPU's select_mass_threshold), attends it, and claims A / (A + the sketch's estimate of
// the tokens not read). Tokens appended after prefill are encoded by the next select()
// with the prompt's normalisation; after DeviceKvCache::truncate call prefill() again.
// Deviation from the CPU: no rounds (a head whose claim falls short of p keeps its union).
// The parameters are the CPU method's (kernels/sketch_topp.h: p, candidate_p, sinks, recent,
// min_context, dense_above, rest_mean), except that rest_mean defaults to false here: the
// kernel benchmark and the twin tests time and check the selection; the model runtime
// passes the registry's value. With rest_mean the value sums are kept per (sequence, kv
// head) on the device: all tokens at prefill(), the appended ones at each select(). Plus:
struct SketchToppGpuOptions : SketchToppOptions {
  SketchToppGpuOptions() { rest_mean = false; }
  // GPU only, a cost rule of the whole step: when the batch's K/V (every sequence at the
  // view's max_tokens, K and V) is at most this many bytes, select() enqueues nothing and
  // attend() runs the dense kernel (claims 1). A step's selection costs a few fixed
  // launches whatever the context; below this size they cost more than the bytes they
  // save (docs/cuda.md "sketch_topp on the GPU" has the measurements). 0: never.
  size_t dense_kv_bytes = size_t{256} << 20;
  // Tokens per CTA of the weights pass and of the histogram pass (0: planned from the batch
  // and the multiprocessor count; multiples of 512).
  int weights_chunk = 0;
  int hist_chunk = 0;
};
// The most query heads per kv head make_sketch_topp_gpu takes (its kernels hold the group
// in registers).
inline constexpr int kSketchToppMaxGroup = 8;
std::unique_ptr<SparseDecoder> make_sketch_topp_gpu(const DeviceKvView& kv, int group, const SketchToppGpuOptions& o,
                                                    const AttentionPlanOptions& plan = {});

// Tests and tools: the device sketch of sequence `seq`, kv head `h` of a decoder made by
// make_sketch_topp_gpu, copied to the host (synchronous), in kernels/sketch.h's layout:
//   codes [ceil(n / 16)][head_dim / 8][16][4], offset and step [ceil(n / 16) * 16] f16 bits,
//   center and scale [head_dim]; n = the tokens encoded.
struct DeviceSketchCopy {
  int n_tokens = 0;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> offset, step;
  std::vector<float> center, scale;
};
DeviceSketchCopy sketch_topp_gpu_download(const SparseDecoder& m, int seq, int h);

}  // namespace cumulus::cuda
