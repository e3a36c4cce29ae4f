// The selection ops a decode method's select step is written against (DESIGN.md "one
// engine, two backends"; methods/policy.h holds the methods written this way). One
// interface, three backends: ref (float64 scoring, serial), cpu (Highway, on a thread pool)
// and cuda (kernels/cuda_decoder.h, make_ops_gpu: batched on the device, no host wait).
//
// A step works on a batch of sequences of one layer. Its rows are (sequence, query head)
// pairs; row (s, j) reads the cache of kv head j / group of sequence s. The ops keep the
// step's state between calls:
//   scores  per row, one value per cached token (score_tokens) or page (score_pages_bound);
//   chosen  per row, a set of those units (choose_*);
//   union   per (sequence, kv head), the tokens its group attends (mark_*);
//   claim   per row, the mass the method claims for its own set (NaN: none).
// A step starts with empty unions and no claims; the backend turns the unions into sorted
// lists after the policy's last op. Every op acts on every row, so the sequence of ops does
// not depend on the data: the GPU sizes its buffers and captures the step from it. Each
// backend counts the bytes its scoring reads (keys, page statistics) against the step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cumulus/core/shape.h"
#include "cumulus/core/thread_pool.h"

namespace cumulus {

class SelectOps {
 public:
  virtual ~SelectOps() = default;
  // Tokens per page of the cache the ops read.
  virtual int page_size() const = 0;
  // scores = q . k of every cached token (raw, unscaled). Reads every key.
  virtual void score_tokens() = 0;
  // scores = Quest's bound sum_j max(q_j min_j, q_j max_j) of every page. Reads the pages'
  // key min and max (float32).
  virtual void score_pages_bound() = 0;
  // chosen = the k units with the largest scores (all of them when fewer; ties to the
  // lower index, as cpu::select_topk).
  virtual void choose_topk(int k) = 0;
  // Token scores only: chosen = the fewest tokens whose softmax mass (scale 1/sqrt(head_dim))
  // reaches p, in (0, 1].
  virtual void choose_top_mass(double p) = 0;
  // union += the chosen units (a page: its tokens). claim_mass (token scores only): each
  // row claims the softmax mass of its chosen tokens; else no claim (NaN).
  virtual void mark_chosen(bool claim_mass) = 0;
  // union += the first `head` and the last `tail` tokens of every kv head; no claim.
  virtual void mark_ends(int head, int tail) = 0;
  // union = every token; each row claims 1.
  virtual void mark_all() = 0;
};

// A step of the host backends over one layer of n_seqs host caches.
struct HostSelectBatch {
  const PagedHeadView* kv = nullptr;  // [n_seqs][n_kv_heads]
  int n_seqs = 1;
  int n_kv_heads = 0;
  int group = 1;
  const float* q = nullptr;     // [n_seqs][n_kv_heads * group][head_dim]
  ThreadPool* pool = nullptr;   // cpu: required; ref: ignored (serial)
};

class HostSelectOps : public SelectOps {
 public:
  // Starts a step (empty unions, no claims, no bytes). The views and q must outlive it.
  virtual void begin(const HostSelectBatch& b) = 0;
  // Ends it, for t = seq * n_kv_heads + kv head and row r = seq * n_q_heads + j:
  //   lists[t]  the union, sorted ascending and unique (swapped in: the vector's old
  //             storage is reused by the next step);
  //   claims[r] row r's claim (NaN: none);
  //   bytes[t]  the bytes the step's scoring read from that kv head's cache.
  virtual void finish(std::vector<int32_t>* lists, double* claims, double* bytes) = 0;
};

namespace cpu {
std::unique_ptr<HostSelectOps> make_select_ops();
}
namespace ref {
std::unique_ptr<HostSelectOps> make_select_ops();
}

}  // namespace cumulus
