// Decode attention ops: one query token per head against a paged cache of one layer.
// Backends share signatures: ref:: (scalar, float64 accumulation, never optimised) and
// cpu:: (Highway SIMD with runtime dispatch, multi-threaded, split over the context with
// log-sum-exp merging). Results of cpu:: do not depend on the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "cumulus/core/selection.h"
#include "cumulus/core/shape.h"
#include "cumulus/core/thread_pool.h"

namespace cumulus {

// The CPU decode ops' scratch that grows with the context: the split-KV partials (a task's
// output, max and sum per query head, per chunk of the context), owned by the caller and
// reused from call to call (a Session keeps one). A call without one allocates its own.
struct AttentionWorkspace {
  std::vector<float> partials;
};

// Arguments shared by the dense and sparse decode ops.
//   kv:  [n_kv_heads] views of one layer (all with the same head_dim, dtype, page size)
//   q:   [n_q_heads][head_dim] float32; query head qh belongs to kv head qh / group
//   out: [n_q_heads][head_dim] float32, softmax(scale * q K^T) V over the attended set
//   lse: [n_q_heads] log sum_i exp(scale * q.k_i) over the attended set (natural log);
//        -inf (and out = 0) when the set is empty
//   lse_ref, mass: optional. When both are set, mass[qh] = exp(lse[qh] - lse_ref[qh]), the
//        share of the softmax mass of a reference set (usually the whole cache) that the
//        attended set holds.
struct DecodeAttnArgs {
  const PagedHeadView* kv = nullptr;
  int n_kv_heads = 0;
  int group = 1;
  float scale = 0.0f;
  const float* q = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
  const float* lse_ref = nullptr;
  float* mass = nullptr;
  AttentionWorkspace* workspace = nullptr;  // cpu:: only (above); ref:: ignores it
};

// Weighted sums of value rows for n_q queries of one kv head, with weights computed by
// the caller (a method that already holds exact softmax weights of its set):
//   out[g] = sum_i w[g][i] v_{idx[i]}
//   idx: [n] token indices into kv; w: [n_q][n]; out: [n_q][head_dim] float32.
// No normalisation: the caller divides by its own sum. Single-threaded (one kv head).
namespace ref {
void attention_weighted_values(const PagedHeadView& kv, const int32_t* idx, int n, const float* w, int n_q,
                               float* out);
}  // namespace ref
namespace cpu {
void attention_weighted_values(const PagedHeadView& kv, const int32_t* idx, int n, const float* w, int n_q,
                               float* out);
}  // namespace cpu
// Checks of attention_weighted_values shared by the backends (Error naming the value).
void weighted_values_validate(const PagedHeadView& kv, const int32_t* idx, int n, const float* w, int n_q,
                              const float* out);

namespace ref {
void attention_decode_dense(const DecodeAttnArgs& a);
// sel.tokens[h]: sorted unique indices into kv[h]; every query head of kv head h attends
// over exactly that list.
void attention_decode_sparse(const DecodeAttnArgs& a, const Selection& sel);
}  // namespace ref

namespace cpu {
void attention_decode_dense(const DecodeAttnArgs& a, ThreadPool& pool);
void attention_decode_sparse(const DecodeAttnArgs& a, const Selection& sel, ThreadPool& pool);
}  // namespace cpu

// Checks shapes, pointers and indices shared by every backend; throws Error naming the
// bad value (index out of range, unsorted list, NaN/Inf in q, ...).
void attention_decode_validate(const DecodeAttnArgs& a, const Selection* sel);

}  // namespace cumulus
