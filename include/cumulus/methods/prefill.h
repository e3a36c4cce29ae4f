// The prefill-method contract (DESIGN.md "Methods"): a prefill method maps the Q, K, V of a
// prompt chunk to the attention output O (dense flash attention, FlexPrefill). One
// PrefillMethod object per sequence; a Session calls it for every layer of every prefill
// chunk after that chunk's keys and values are appended to the cache.
#pragma once

#include <cstdint>
#include <string>

#include "cumulus/core/shape.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/kv/kv_cache.h"

namespace cumulus {

// Running totals over every (layer, chunk) a prefill method ran.
struct PrefillStats {
  // (query head, query block, key block) triples under the causal mask and those attended.
  // Block-sparse methods count in their own block size; dense counts none (share 1).
  int64_t blocks_causal = 0;
  int64_t blocks_computed = 0;
  // Per (layer, chunk, query head): the pattern a head got (FlexPrefill's pattern
  // determination).
  int64_t heads_dense = 0;           // every causal block (short chunk, gamma = 1)
  int64_t heads_query_aware = 0;
  int64_t heads_vertical_slash = 0;
  // Wall time inside the method: the attention kernel, and everything before it
  // (estimation and block selection).
  double attention_seconds = 0;
  double select_seconds = 0;

  double block_share() const {
    return blocks_causal > 0 ? static_cast<double>(blocks_computed) / static_cast<double>(blocks_causal) : 1.0;
  }
};

struct PrefillWorkspace;  // kernels/prefill.h

struct PrefillContext {
  ThreadPool* pool = nullptr;
  // Scratch the prefill kernels reuse from call to call; nullptr: each call allocates its
  // own. A Session passes one for the whole prompt and frees it afterwards.
  PrefillWorkspace* workspace = nullptr;
};

class PrefillMethod {
 public:
  virtual ~PrefillMethod() = default;
  virtual std::string name() const = 0;
  // Tokens per prefill forward pass for a prompt of prompt_tokens tokens, given the
  // session's own choice (SessionOptions::prefill_chunk). A method that estimates its
  // pattern from the prompt's last block (FlexPrefill) asks for the whole prompt at once.
  virtual int chunk_tokens(int session_chunk, int prompt_tokens) const { return session_chunk; }
  // Attention of the queries of positions [pos, pos + c) of `layer`.
  //   q:   [c][n_q_heads][head_dim] float32, after RoPE
  //   kv:  holds the layer's tokens [0, pos + c) (the chunk's own keys included)
  //   out: [c][n_q_heads][head_dim] float32
  virtual void prefill(int layer, int pos, int c, const float* q, const KvCache& kv, const PrefillContext& ctx,
                       float* out) = 0;
  const PrefillStats& stats() const { return stats_; }

 protected:
  PrefillStats stats_;
};

}  // namespace cumulus
