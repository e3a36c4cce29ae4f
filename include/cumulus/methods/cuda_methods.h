// The fused GPU pipelines of the sparse decode methods (src/methods/cuda; docs/cuda.md,
// docs/methods.md): tactic, psa, sketch_topp and lfps, each a SparseDecoder
// (kernels/cuda_decoder.h) whose select() fuses what the selection ops would separate, for
// a batch of sequences, entirely on the device. The methods defined once over the ops
// (quest, oracle_topp, oracle_topk, streaming) need nothing here: cuda::make_ops_gpu runs
// their policy. Plain C++: no CUDA header here.
//
// These mirror the CPU methods in src/methods (same equations, same parameters); the
// deviations are listed in docs/cuda.md (centroids scored in f16, no re-clustering on the
// GPU, psa's estimate rule only, progressive rounds).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cumulus/kernels/cuda_decoder.h"
#include "cumulus/kernels/cuda_prefill.h"
#include "cumulus/methods/lfps.h"
#include "cumulus/methods/psa.h"
#include "cumulus/methods/registry.h"
#include "cumulus/methods/sketch_topp.h"
#include "cumulus/methods/tactic.h"

namespace cumulus::cuda {

// `base` with the GPU pipelines attached (MethodInfo::gpu) to the methods that have one
// (dense, tactic, psa, lfps, sketch_topp: each method's .cu attaches its own,
// src/methods/cuda/gpu_pipelines.cu lists them) and the GPU prefill attentions
// (MethodInfo::gpu_prefill: dense, flexprefill); a method of `base` that is not built in
// keeps what it has. The CUDA runtime builds its decoders and its prefill from this.
Registry registry_with_gpu(const Registry& base);

// Each fused method's attachment, called by registry_with_gpu (src/methods/<name>/<name>.cu).
void attach_tactic_gpu(Registry& r);
void attach_psa_gpu(Registry& r);
void attach_lfps_gpu(Registry& r);
void attach_sketch_topp_gpu(Registry& r);
// Each prefill method's GPU attention (MethodInfo::gpu_prefill), the same way.
void attach_flexprefill_gpu(Registry& r);

// A prefill method's attention on the GPU (MethodInfo::gpu_prefill makes it), for one
// sequence: the runtime prefills the prompt in one forward pass from position 0 and hands
// each layer's attention of it here (dense needs none: the runtime's own kernels).
class PrefillAttention {
 public:
  virtual ~PrefillAttention() = default;
  // Device memory a prompt of n tokens takes besides the runtime's scratch (at most).
  virtual size_t device_bytes(int n) const = 0;
  // Throws Error when the current device cannot run it (reads the device, allocates nothing).
  virtual void device_check() const {}
  // Before the first layer of a prompt of n tokens.
  virtual void begin(int n) = 0;
  // One layer's attention of the prompt (a: head-major, q_first 0) into a.out, enqueued on
  // `stream`; may wait for it. Adds the layer's blocks, patterns and times to `stats`.
  virtual void attend(const DevicePrefillArgs& a, void* stream, PrefillStats& stats) = 0;
  // After the prompt's last layer: frees what begin() took.
  virtual void end() = 0;
};

// tactic (Tactic, section 4, Algorithm 1): k-means of the keys at prefill; per step clusters
// ranked by q . centroid, the exactly scored head and windows of the unpacked list, the
// a/x + b fit, the budget reaching P, the group's union, plus the dense tail. The ranking
// and the marks run as docs/cuda.md describes, each path chosen by size (tests force each:
// src/methods/tactic/tactic_gpu_paths.h). The parameters are the CPU method's (methods/tactic.h:
// p, cluster_size, max_iter, init_ratio, window, p1, p2, sinks, recent, seed), plus:
struct TacticGpuOptions : TacticOptions {
  int layer = 0;  // seeds the k-means initial sample as on the CPU (seed, layer, kv head, 0)
};
std::unique_ptr<SparseDecoder> make_tactic_gpu(const DeviceKvView& kv, int group, const TacticGpuOptions& o,
                                               const AttentionPlanOptions& plan = {});

// psa (PSA, section 3.2, Algorithm 1; estimate rule): pages ranked by criticality, visited
// in microbatches until AS_acc / (AS_acc + AS_min N_left) >= threshold. The visits run in
// rounds of growing size; after each round a verifying pass (the round's last CTA for each
// head) finds the exact stopping microbatch on the device and marks the head done, and
// later rounds skip done heads: no host round trip per microbatch (section 3.3). The
// parameters are the CPU method's (methods/psa.h); stop must be estimate.
struct PsaGpuOptions : PsaOptions {};
std::unique_ptr<SparseDecoder> make_psa_gpu(const DeviceKvView& kv, int group, const PsaGpuOptions& o,
                                            const AttentionPlanOptions& plan = {});

// sketch_topp (ours; docs/methods.md "sketch_topp", docs/cuda.md "sketch_topp on
// the GPU"). prefill() builds a 4-bit sketch of
// every key of every sequence (kernels/sketch.h's layout and encoder: the CPU's codes bit
// for bit); a step estimates every token's weight from the sketch, chooses each kv head's
// union (the smallest prefix of the tokens ordered by their largest estimated share at
// which every query head's estimated share reaches candidate_p, to 1/64 of an octave as the
// CPU's select_mass_threshold), attends it, and claims A / (A + the sketch's estimate of
// the tokens not read). Tokens appended after prefill are encoded by the next select()
// with the prompt's normalisation; after DeviceKvCache::truncate call prefill() again.
// Deviation from the CPU: no rounds (a head whose claim falls short of p keeps its union).
// The parameters are the CPU method's (methods/sketch_topp.h: p, candidate_p, sinks, recent,
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
  // Its default is the registry's gpu_dense_mib (methods/sketch_topp.h).
  size_t dense_kv_bytes = static_cast<size_t>(gpu_dense_mib) << 20;
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

// lfps (LFPS (Learn from the Past), section 4.2, Algorithm 1; docs/cuda.md "lfps on the GPU"): per query head two
// float64 score tables over key positions, built by prefill() from the prompt's last s
// queries (DevicePromptQueries, required); a step computes the sink ratio (a bypassed head
// outputs the prompt's mean value vector and attends nothing), the tables' thresholds, the
// candidates, their exact top-k, attends the group's union with the first `sinks` tokens
// and updates the tables (Eq. 10), all on the device with no host wait. The parameters are
// the CPU method's (methods/lfps.h). No claim (NaN); stats().bypass marks the bypassed heads.
std::unique_ptr<SparseDecoder> make_lfps_gpu(const DeviceKvView& kv, int group, const LfpsOptions& o,
                                             const AttentionPlanOptions& plan = {});

// Tests: one (sequence, query head)'s state of a decoder made by make_lfps_gpu, copied to the
// host (synchronous): the tables at positions [0, n) (n: the sequence's cached tokens; the
// slash aligned as the CPU's, methods/lfps_tables.h), sigma-hat^2, the last step's rho and
// bypass.
struct LfpsTablesCopy {
  std::vector<double> vertical, slash;
  double sigma_hat2 = 0, rho = 0;
  bool bypass = false;
};
LfpsTablesCopy lfps_gpu_download(const SparseDecoder& m, int seq, int q_head);

}  // namespace cumulus::cuda
