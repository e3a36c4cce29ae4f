// Llama-family model configuration and weights, loaded from GGUF (architectures `llama`
// and `gemma3`) or llama2.c's legacy `.bin`. Matrices are WeightMatrix: GGUF Q4_0/Q4_1/Q8_0 stay
// quantised, everything else is float32 (weight_matrix.h); norms are float32.
//
// Matrices are row-major [out][in] (y = W x reads row o for output o), as both formats
// store them: GGUF ne[0] is the input dimension, llama2.c writes PyTorch's [out][in].
//
// DESIGN (RoPE layout): Q and K rows of GGUF `llama` tensors are stored permuted for
// adjacent-pair rotation ("normal" RoPE in llama.cpp): within each head, rotate
// (x[2i], x[2i+1]) by pos * theta^(-2i / head_dim). llama2.c uses the same convention, so
// the forward pass applies one RoPE to both formats and never permutes on load. GGUF
// `gemma3` tensors are not permuted: they rotate (x[i], x[i + head_dim/2]) ("NEOX" RoPE).
//
// DESIGN (gemma3, as llama.cpp's Gemma 3 graph): the embedding row is scaled by sqrt(dim);
// per-head RMSNorms of q and k (attn_q_norm, attn_k_norm) before RoPE; RMSNorms of the
// attention output (post_attention_norm) and of the FFN output (post_ffw_norm) before
// their residual adds; FFN down(gelu_tanh(gate x) * up x). Layers are local (sliding
// window of `sliding_window` tokens: the query at p attends keys (p - window, p], RoPE base
// rope_theta_local) or global (the whole prefix, RoPE base rope_theta). The GGUF norm
// weights already hold Gemma's (1 + w): the converter adds the 1, so they are used as is.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cumulus/core/shape.h"
#include "cumulus/model/weight_matrix.h"

namespace cumulus {

class GgufFile;

enum class ModelFormat { gguf, llama2c };

// The feed-forward's gate activation: silu (llama) or gelu with the tanh approximation
// (gemma3: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))).
enum class FfnActivation { silu, gelu_tanh };

struct ModelConfig {
  std::string architecture = "llama";
  ModelFormat format = ModelFormat::gguf;
  int n_layers = 0;
  int n_heads = 0;        // query heads
  int n_kv_heads = 0;
  int dim = 0;            // embedding length
  int hidden_dim = 0;     // feed-forward length
  int head_dim = 0;       // dim / n_heads
  int rope_dim = 0;       // dimensions rotated per head (== head_dim for llama)
  int vocab_size = 0;
  int context_length = 0;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_output = true;  // classifier shares token_embd (no output.weight)
  // gemma3 (llama: the defaults).
  bool rope_neox = false;          // rotate (x[i], x[i + head_dim/2]) instead of adjacent pairs
  float embedding_scale = 1.0f;    // token_embd rows are multiplied by this (gemma3: sqrt(dim))
  FfnActivation ffn_activation = FfnActivation::silu;
  bool qk_norm = false;            // attn_q_norm / attn_k_norm [head_dim] per head, before RoPE
  bool post_norms = false;         // post_attention_norm, post_ffw_norm [dim]
  float attention_scale = 0.0f;    // softmax scale of q.k; 0 = 1/sqrt(head_dim)
  float logit_softcap = 0.0f;      // logits = c tanh(logits / c) when > 0
  int sliding_window = 0;          // tokens a local layer attends (the query's own included)
  float rope_theta_local = 10000.0f;
  std::vector<uint8_t> layer_local;  // [n_layers], 1 = sliding-window layer; empty = all global

  Shape shape() const { return Shape{n_layers, n_heads, n_kv_heads, head_dim}; }
  bool is_local(int layer) const { return !layer_local.empty() && layer_local[static_cast<size_t>(layer)] != 0; }
  // The layers that attend the whole prefix (where decode and prefill methods run).
  int n_global_layers() const {
    int n = 0;
    for (int l = 0; l < n_layers; ++l) n += is_local(l) ? 0 : 1;
    return n;
  }
};

struct LayerWeights {
  std::vector<float> attn_norm;  // [dim]
  WeightMatrix wq;               // [n_heads * head_dim][dim]
  WeightMatrix wk;               // [n_kv_heads * head_dim][dim]
  WeightMatrix wv;               // [n_kv_heads * head_dim][dim]
  WeightMatrix wo;               // [dim][n_heads * head_dim]
  std::vector<float> ffn_norm;   // [dim]
  WeightMatrix w_gate;           // [hidden_dim][dim]  (llama2.c w1)
  WeightMatrix w_down;           // [dim][hidden_dim]  (llama2.c w2)
  WeightMatrix w_up;             // [hidden_dim][dim]  (llama2.c w3)
  // gemma3 only (empty otherwise).
  std::vector<float> attn_q_norm;          // [head_dim]
  std::vector<float> attn_k_norm;          // [head_dim]
  std::vector<float> post_attention_norm;  // [dim]
  std::vector<float> post_ffw_norm;        // [dim]
};

struct ModelWeights {
  ModelConfig config;
  WeightMatrix token_embd;         // [vocab_size][dim]
  std::vector<LayerWeights> layers;
  std::vector<float> output_norm;  // [dim]
  WeightMatrix output;             // [vocab_size][dim]; empty (0 rows) when config.tied_output

  // The classifier [vocab_size][dim]: `output`, or `token_embd` when tied.
  const WeightMatrix& output_weight() const { return config.tied_output ? token_embd : output; }
  // Bytes of all weights in memory.
  size_t bytes() const;
};

// GGUF magic -> gguf; a llama2.c header consistent with the file's size -> llama2c. Throws
// Error for a path that cannot be read, a directory, or "not a GGUF or llama2.c model".
ModelFormat model_format_of(const std::string& path);
// Either format's hyperparameters, by model_format_of; no tensor data is read, so commands
// check their options against the model (its context) before loading it.
ModelConfig model_config_load(const std::string& path);

// Hyperparameters only (no tensor data read). Throws Error naming the file and key for an
// architecture other than `llama` or `gemma3` (naming those), a missing key or
// inconsistent values (gemma3: head dims, an unknown sliding-window layer pattern).
ModelConfig model_config_from_gguf(const GgufFile& file);
ModelConfig model_config_from_llama2c(const std::string& path);

// Config and all tensors (matrices stored as `storage` says; llama2.c is always float32).
// Throws Error naming the file and tensor for a missing tensor, a wrong shape or a type
// that cannot be dequantised.
ModelWeights model_weights_from_gguf(const GgufFile& file, WeightStorage storage = WeightStorage::compact);
ModelWeights model_weights_from_llama2c(const std::string& path);
// Either format, by magic.
ModelWeights model_weights_load(const std::string& path, WeightStorage storage = WeightStorage::compact);
// Throws the Error model_weights_load would for this file (a missing tensor, a wrong shape, a
// type that cannot be dequantised; llama2.c: a size its header does not imply) without
// reading any tensor data: what `cumulus info` checks.
void model_weights_check(const std::string& path);

}  // namespace cumulus
