// Llama-family model configuration and weights, loaded from GGUF (architecture `llama`)
// or llama2.c's legacy `.bin`. Matrices are WeightMatrix: GGUF Q4_0/Q4_1/Q8_0 stay
// quantised, everything else is float32 (weight_matrix.h); norms are float32.
//
// Matrices are row-major [out][in] (y = W x reads row o for output o), as both formats
// store them: GGUF ne[0] is the input dimension, llama2.c writes PyTorch's [out][in].
//
// DESIGN (RoPE layout): Q and K rows of GGUF `llama` tensors are stored permuted for
// adjacent-pair rotation ("normal" RoPE in llama.cpp): within each head, rotate
// (x[2i], x[2i+1]) by pos * theta^(-2i / head_dim). llama2.c uses the same convention, so
// the forward pass applies one RoPE to both formats and never permutes on load.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cumulus/core/shape.h"
#include "cumulus/model/weight_matrix.h"

namespace cumulus {

class GgufFile;

enum class ModelFormat { gguf, llama2c };

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

  Shape shape() const { return Shape{n_layers, n_heads, n_kv_heads, head_dim}; }
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
// architecture other than `llama`, a missing key or inconsistent values.
ModelConfig model_config_from_gguf(const GgufFile& file);
ModelConfig model_config_from_llama2c(const std::string& path);

// Config and all tensors (matrices stored as `storage` says; llama2.c is always float32).
// Throws Error naming the file and tensor for a missing tensor, a wrong shape or a type
// that cannot be dequantised.
ModelWeights model_weights_from_gguf(const GgufFile& file, WeightStorage storage = WeightStorage::compact);
ModelWeights model_weights_from_llama2c(const std::string& path);
// Either format, by magic.
ModelWeights model_weights_load(const std::string& path, WeightStorage storage = WeightStorage::compact);

}  // namespace cumulus
