// Session (DESIGN.md "Model runtime"): one sequence through a Llama-family model — its KV
// cache, its decode-method state and its position. The forward pass calls the session's
// attention method for every layer and knows nothing else about it.
//
// Forward of a chunk of C tokens at positions [pos, pos + C):
//   x [C][dim] = token_embd rows (* embedding_scale: gemma3 sqrt(dim))
//   per layer: xn = RMSNorm(x) * attn_norm
//              q [C][n_heads*head_dim], k, v [C][n_kv_heads*head_dim] = xn W^T
//              gemma3: per-head RMSNorm of q and k (attn_q_norm, attn_k_norm)
//              RoPE on q and k, adjacent pairs (x[2i], x[2i+1]) per head (gemma3: pairs
//              (x[i], x[i + head_dim/2]), base rope_theta_local on local layers)
//              k, v appended to the cache; attention; a = attn Wo^T
//              (gemma3: a = RMSNorm(a) * post_attention_norm); x += a
//              xn = RMSNorm(x) * ffn_norm; f = W_down (act(xn W_gate^T) * (xn W_up^T)),
//              act silu (gemma3: gelu tanh; f = RMSNorm(f) * post_ffw_norm); x += f
//   logits [vocab] = RMSNorm(x_last) * output_norm, times the classifier (soft-capped
//   when the model has a final_logit_softcapping)
// Local (sliding-window) layers of gemma3 attend their window densely, in prefill and
// decode alike, and the cache keeps only their window (pinned at the prompt's end, so
// restart_decode and kv_save find the prompt's last window); the session's decode and
// prefill methods run on the global layers only, and AttentionSummary / last_step() hold
// only those layers' statistics.
// Prefill attention goes through the session's prefill method (dense causal flash attention
// by default, or flexprefill), in chunks of the size the method asks for
// (PrefillMethod::chunk_tokens: prefill_chunk for dense, the whole prompt for flexprefill);
// once the whole prompt is cached, each layer's decode method gets on_prefill (with the
// prompt's last queries when the method asks for them). Decode (C = 1) goes through
// decode_step.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cumulus/core/thread_pool.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/kv/kv_snapshot.h"
#include "cumulus/methods/method.h"
#include "cumulus/methods/prefill.h"
#include "cumulus/model/model_weights.h"

namespace cumulus {

class Registry;

struct SessionOptions {
  // Where the session's methods come from: a user's registry (Registry::builtin() plus the
  // user's own methods, say), which must outlive the session; nullptr: Registry::builtin().
  const Registry* registry = nullptr;
  std::string method = "dense";                 // decode method (from `registry`)
  std::map<std::string, std::string> params;    // its parameters
  std::string prefill_method = "dense";         // prefill method (from `registry`, kind prefill)
  std::map<std::string, std::string> prefill_params;  // its parameters
  KvCacheOptions kv;                            // page size, storage dtype
  // Sliding-window (local) layers keep only the tokens their queries read (kv_cache.h;
  // docs/model.md); false: every layer keeps every token (`cumulus trace`, which records
  // whole layers).
  bool kv_window = true;
  int n_threads = 2;
  int prefill_chunk = 256;                      // tokens per prefill forward (GEMM rows), unless
                                                // the prefill method asks for another size
  bool eval = false;                            // decode_step eval mode (true mass, error)
  int max_tokens = 0;                           // cache capacity; 0 = model context length
  // Keep at least this many of the prompt's last queries per layer (besides what the
  // method asks for), so restart_decode can start a method that learns from them (lfps).
  int keep_prompt_queries = 0;
  // Called in every decode step for every layer with the query (after RoPE) that layer's
  // method receives: q [n_heads][head_dim] at `position` (`cumulus trace` records it).
  std::function<void(int layer, int position, const float* q)> on_decode_query;
  // Time every op of the decode steps (DecodeProfile); costs ~10 clock reads per layer.
  bool profile = false;
  // The CUDA runtime only: > 0 puts every layer's K/V in one page pool with this many GiB of
  // device memory and the rest in pinned host memory (kv/cuda_kv_pool.h, docs/cuda.md "Host
  // tier"); 0: each layer's whole cache on the device.
  double device_kv_gib = 0;
};

// Where decode time goes, summed over decode steps (SessionOptions::profile), seconds.
struct DecodeProfile {
  int64_t steps = 0;
  double qkv = 0;        // Q, K, V projections
  double attention = 0;  // RoPE, KV append, the decode method (scoring, selection, attention)
  double wo = 0;         // attention output projection
  double mlp = 0;        // gate and up projections, SiLU, down projection
  double head = 0;       // final RMSNorm and output head (logits)
  double other = 0;      // embedding lookup, RMSNorms, residual adds
  double total() const { return qkv + attention + wo + mlp + head + other; }
};

// Running sums over decode steps (all layers, all query heads).
struct AttentionSummary {
  int64_t head_steps = 0;
  double kv_fraction_sum = 0;  // bytes read / dense bytes, per layer-step, summed
  int64_t layer_steps = 0;
  double claimed_sum = 0;      // over head-steps with a claim
  int64_t claimed_count = 0;
  double true_sum = 0;         // eval mode
  int64_t true_count = 0;
  double tokens_sum = 0;       // tokens attended per head-step

  double mean_kv_fraction() const { return layer_steps ? kv_fraction_sum / layer_steps : 0; }
  double mean_claimed() const { return claimed_count ? claimed_sum / claimed_count : 0; }
  double mean_true() const { return true_count ? true_sum / true_count : 0; }
  double mean_tokens() const { return head_steps ? tokens_sum / head_steps : 0; }
};

// A Session has no process-wide side effects beyond one: while prefill or decode runs a
// forward pass, OpenBLAS (whose thread count is one per process) runs single-threaded, since
// the session splits the matrix products over its own thread pool; the count the program
// had comes back when the last running forward pass in the process ends
// (src/model/blas_threads.h). A program that calls OpenBLAS on another thread during that
// time gets one thread too.
class Session {
 public:
  // `weights` (and options.registry, when given) must outlive the session.
  Session(const ModelWeights& weights, const SessionOptions& options = {});
  ~Session();

  // Feeds prompt tokens (any count >= 1, in chunks of prefill_chunk); returns the logits
  // [vocab] after the last one. Throws Error when the prompt would exceed the context or
  // an id is out of the vocabulary.
  const std::vector<float>& prefill(std::span<const int32_t> tokens);
  // Builds the decode method's indexes over the prompt (DecodeMethod::on_prefill for every
  // layer it runs on: tactic's k-means, LFPS's tables) once the prompt is in. The first
  // decode calls it when nobody has; call it right after the prefill to count the index
  // build with the prefill, where it happens (`cumulus generate` does). Idempotent until
  // restart_decode, whose method builds again.
  void build_indexes();
  // Feeds one token through the decode method; returns logits [vocab].
  const std::vector<float>& decode(int32_t token);
  // Drops every token after the prompt and starts decoding again with a new decode method
  // (its on_prefill runs at the next decode), so several methods continue one prefill.
  // The prompt's logits are not recomputed: keep prefill's return value. Throws before a
  // prefill, or for an unknown method or parameter.
  void restart_decode(const std::string& method, const std::map<std::string, std::string>& params = {});

  // KV snapshots (kv/kv_snapshot.h, docs/kv_snapshot.md); model_id is model_identity() of
  // the model's file. kv_save writes the prompt's cache, tokens, last logits and last
  // queries (any time after the prefill: decoded tokens are not saved). kv_load takes the
  // place of prefill in a fresh session: it checks `snap` against this session (model,
  // weights' storage and prefill method, shapes, page size, dtype, capacity, the prompt
  // queries its methods need) before changing anything, then restores them, so decoding
  // gives bit for bit the logits it gives after the prefill. Returns the prompt's logits.
  void kv_save(const std::string& path, uint64_t model_id) const;
  const std::vector<float>& kv_load(const KvSnapshot& snap, uint64_t model_id);
  // The same in memory: takes the place of prefill in a fresh session by copying `other`'s
  // prompt (its cache up to the prompt's end, tokens, last logits and last queries), so
  // several methods continue one prefill side by side. `other` must run the same weights,
  // cache options and prefill method, and have kept the prompt queries this session's
  // method needs (SessionOptions::keep_prompt_queries); checked before anything changes.
  // Decoding then gives bit for bit the logits it gives after the prefill. Returns the
  // prompt's logits.
  const std::vector<float>& prefill_from(const Session& other);
  // The prompt's tokens, prefilled or loaded.
  const std::vector<int32_t>& prompt_tokens() const { return prompt_tokens_; }

  int position() const { return pos_; }
  int prompt_length() const { return prompt_end_; }
  int capacity() const { return capacity_; }
  const KvCache& kv() const { return kv_; }
  const DecodeMethod& method() const { return *method_; }
  const PrefillMethod& prefill_method() const { return *prefill_; }
  const AttentionSummary& summary() const { return summary_; }
  const DecodeProfile& profile() const { return profile_; }
  // The stats of the last decode step, per layer: [n_layers] AttnOutput (empty for the
  // local layers of a sliding-window model, where no method runs).
  const std::vector<AttnOutput>& last_step() const { return last_; }

 private:
  void forward(std::span<const int32_t> tokens, bool decode_mode);
  void attention_prefill(int layer, int c, const float* q, float* out);
  // Rows [pos_, pos_ + c) of a local layer, each over its window of the cache.
  void attention_local(int layer, int c, const float* q, float* out);
  std::vector<PagedHeadView> layer_views(int layer) const;  // [n_kv_heads] views of a layer
  void reserve_rows(int rows);  // grows the scratch below to `rows` tokens
  // How many of an n-token prompt's last queries this session keeps: what its method needs,
  // or SessionOptions::keep_prompt_queries, at most n.
  int prompt_q_rows_for(int n) const;
  // Takes over a prompt of n tokens whose K/V is already in kv_ (kv_load, prefill_from): the
  // position, the last `rows` queries of each layer (`q_of(layer)` ends with them), the
  // tokens and the logits after the last one.
  const std::vector<float>& adopt_prompt(int n, int rows, const std::function<std::span<const float>(int)>& q_of,
                                         std::span<const int32_t> tokens, std::span<const float> logits);

  const ModelWeights& w_;
  SessionOptions opt_;
  const Registry& registry_;  // opt_.registry or Registry::builtin()
  ThreadPool pool_;
  std::vector<std::unique_ptr<ThreadPool>> inline_pools_;  // [pool_ workers] 1-thread pools
  KvCache kv_;
  std::unique_ptr<DecodeMethod> method_;
  std::unique_ptr<PrefillMethod> prefill_;
  std::unique_ptr<PrefillWorkspace> prefill_workspace_;  // while prefill runs
  AttentionWorkspace attention_ws_;  // decode attention's split-KV partials (DecodeContext::attention)
  std::vector<AttentionWorkspace> local_ws_;  // [pool_ workers] the same for a window's rows in parallel
  int pos_ = 0;
  int capacity_ = 0;
  bool prefilled_ = false;
  AttentionSummary summary_;
  DecodeProfile profile_;
  std::vector<AttnOutput> last_;
  std::vector<float> logits_;
  // Scratch, sized for rows_ tokens (prefill_chunk, or the prefill method's chunk).
  int rows_ = 0;
  std::vector<float> x_, xn_, q_, k_, v_, att_, gate_, up_;
  MatmulWorkspace matmul_ws_;  // the projections' scratch (weight_matmul)
  // The last prompt_q_rows_ queries of the prompt (after RoPE), per layer, for methods that
  // learn from the prompt's attention (DecodeMethod::prompt_queries):
  //   prompt_q_[layer]: [prompt_q_rows_][n_heads][head_dim]
  int prompt_end_ = 0;
  int prompt_q_rows_ = 0;
  std::vector<std::vector<float>> prompt_q_;
  std::vector<int32_t> prompt_tokens_;  // [prompt_end_]
  std::vector<float> prompt_logits_;    // [vocab] after the prompt's last token
};

}  // namespace cumulus
