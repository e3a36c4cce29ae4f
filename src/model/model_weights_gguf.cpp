// GGUF `llama` and `gemma3` loader: hyperparameters from `<arch>.*` metadata, tensors by
// llama.cpp's names (token_embd, blk.N.attn_{norm,q,k,v,output}, blk.N.ffn_{norm,gate,down,up},
// output_norm, output; gemma3 adds blk.N.attn_{q,k}_norm, blk.N.post_attention_norm and
// blk.N.post_ffw_norm), each checked for shape; matrices become WeightMatrix (the block
// formats Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K kept quantised unless
// WeightStorage::f32), norms are dequantised to float32.
#include <fmt/ranges.h>

#include <cmath>

#include "core/check.h"
#include "cumulus/core/file.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"

namespace cumulus {
namespace {

constexpr uint64_t kMaxDim = 1u << 20;  // bound on any single hyperparameter

int get_dim(const GgufFile& f, const std::string& key, uint64_t lo) {
  const uint64_t v = f.get_u64(key);
  CUMULUS_CHECK(v >= lo && v <= kMaxDim, "gguf: {}: {}={} must be in [{}, {}]", f.path(), key, v, lo, kMaxDim);
  return static_cast<int>(v);
}

int get_dim_or(const GgufFile& f, const std::string& key, int fallback) {
  return f.find(key) ? get_dim(f, key, 1) : fallback;
}

// Tensor `name` after checking it has exactly the shape `ne` ([ne0] or [ne0, ne1], ne0
// innermost) and a type that can be dequantised.
const GgufTensorInfo& find_checked(const GgufFile& f, const std::string& name, std::initializer_list<uint64_t> ne) {
  const GgufTensorInfo* t = f.find_tensor(name);
  CUMULUS_CHECK(t != nullptr, "gguf: {}: missing tensor '{}'", f.path(), name);
  bool ok = true;
  size_t d = 0;
  for (uint64_t want : ne) ok = ok && t->ne[d++] == want;
  for (; d < 4; ++d) ok = ok && t->ne[d] == 1;
  if (!ok) {
    CUMULUS_FAIL("gguf: {}: tensor '{}' has shape [{}, {}, {}, {}], want [{}]", f.path(), name, t->ne[0], t->ne[1],
                 t->ne[2], t->ne[3], fmt::join(ne, ", "));
  }
  const GgmlTypeInfo& info = ggml_type_info(t->type);
  CUMULUS_CHECK(info.can_dequantize, "gguf: {}: tensor '{}' has type {}, which cannot be dequantised", f.path(), name,
                info.name);
  return *t;
}

// A vector [ne0], dequantised to float32.
std::vector<float> load_vector(const GgufFile& f, const std::string& name, uint64_t ne0) {
  const GgufTensorInfo& t = find_checked(f, name, {ne0});
  std::vector<float> out(static_cast<size_t>(t.n_elements));
  dequantize_row(t.type, t.data, out.data(), t.n_elements);
  return out;
}

// A matrix [ne1 rows][ne0 cols].
WeightMatrix load_matrix(const GgufFile& f, const std::string& name, uint64_t ne0, uint64_t ne1, WeightStorage storage) {
  const GgufTensorInfo& t = find_checked(f, name, {ne0, ne1});
  return WeightMatrix::from_ggml(t.type, {t.data, static_cast<size_t>(t.n_bytes)}, static_cast<int>(ne1),
                                 static_cast<int>(ne0), storage, name);
}

// gemma3's layer pattern, as llama.cpp reads it: `<arch>.attention.sliding_window_pattern`
// either an array of one bool per layer (true = sliding window) or a period n (every n-th
// layer global: layer l is local when l % n < n - 1; n = 0 makes every layer local);
// absent, the period is 6 (Gemma 3: layers 5, 11, 17 of 18 are global).
std::vector<uint8_t> gemma3_layer_pattern(const GgufFile& f, const std::string& p, int n_layers) {
  const std::string key = p + "attention.sliding_window_pattern";
  const GgufValue* v = f.find(key);
  std::vector<uint8_t> local(static_cast<size_t>(n_layers));
  if (v != nullptr && v->type == GgufType::array) {
    CUMULUS_CHECK(v->elem_type == GgufType::boolean && v->count == static_cast<uint64_t>(n_layers),
                  "gguf: {}: {} is an array of {} {}, want {} booleans (one per layer): unknown layer pattern", f.path(),
                  key, v->count, gguf_type_name(v->elem_type), n_layers);
    for (int l = 0; l < n_layers; ++l) {
      const uint8_t b = v->raw[l];
      CUMULUS_CHECK(b <= 1, "gguf: {}: {}[{}]={} is not a boolean: unknown layer pattern", f.path(), key, l, b);
      local[static_cast<size_t>(l)] = b;
    }
    return local;
  }
  uint64_t period = 6;
  if (v != nullptr) {
    CUMULUS_CHECK(v->is_integer(), "gguf: {}: {} has type {}, want an integer period or a bool array: unknown layer pattern",
                  f.path(), key, gguf_type_name(v->type));
    period = f.get_u64(key);
    CUMULUS_CHECK(period <= static_cast<uint64_t>(n_layers),
                  "gguf: {}: {}={} is more than block_count={}: unknown layer pattern", f.path(), key, period, n_layers);
  }
  for (int l = 0; l < n_layers; ++l)
    local[static_cast<size_t>(l)] = period == 0 || static_cast<uint64_t>(l) % period < period - 1 ? 1 : 0;
  return local;
}

}  // namespace

ModelFormat model_format_of(const std::string& path) {
  file_check_regular(path, "model");  // stat before open: a FIFO would block open()
  if (gguf_has_magic(path)) return ModelFormat::gguf;
  // llama2.c files have no magic: a file is one when its header is consistent with its size.
  try {
    (void)model_config_from_llama2c(path);
  } catch (const Error& e) {
    CUMULUS_FAIL("model '{}': not a GGUF or llama2.c model (no GGUF magic; as llama2.c: {})", path, e.message());
  }
  return ModelFormat::llama2c;
}

ModelConfig model_config_load(const std::string& path) {
  if (model_format_of(path) == ModelFormat::gguf) return model_config_from_gguf(GgufFile::open(path));
  return model_config_from_llama2c(path);
}

ModelConfig model_config_from_gguf(const GgufFile& f) {
  ModelConfig c;
  c.format = ModelFormat::gguf;
  c.architecture = std::string(f.get_string("general.architecture"));
  CUMULUS_CHECK(c.architecture == "llama" || c.architecture == "gemma3",
                "gguf: {}: general.architecture='{}' is not supported (supported: llama, gemma3)", f.path(), c.architecture);
  const bool gemma3 = c.architecture == "gemma3";
  const std::string p = c.architecture + ".";
  c.n_layers = get_dim(f, p + "block_count", 1);
  c.dim = get_dim(f, p + "embedding_length", 1);
  c.hidden_dim = get_dim(f, p + "feed_forward_length", 1);
  c.n_heads = get_dim(f, p + "attention.head_count", 1);
  c.n_kv_heads = get_dim_or(f, p + "attention.head_count_kv", c.n_heads);
  c.context_length = get_dim(f, p + "context_length", 1);
  CUMULUS_CHECK(c.n_heads % c.n_kv_heads == 0, "gguf: {}: head_count={} is not a multiple of head_count_kv={}",
                f.path(), c.n_heads, c.n_kv_heads);
  if (gemma3) {
    // Gemma's head dim is its own (256 for 270M against 640 / 4 = 160): both lengths are required.
    CUMULUS_CHECK(f.find(p + "attention.key_length") != nullptr && f.find(p + "attention.value_length") != nullptr,
                  "gguf: {}: gemma3 needs {}attention.key_length and {}attention.value_length", f.path(), p, p);
  } else if (f.find(p + "attention.key_length") == nullptr) {
    CUMULUS_CHECK(c.dim % c.n_heads == 0, "gguf: {}: embedding_length={} is not a multiple of head_count={}", f.path(),
                  c.dim, c.n_heads);
  }
  c.head_dim = get_dim_or(f, p + "attention.key_length", c.dim / c.n_heads);
  const int value_length = get_dim_or(f, p + "attention.value_length", c.head_dim);
  CUMULUS_CHECK(value_length == c.head_dim, "gguf: {}: attention.value_length={} differs from key_length={}", f.path(),
                value_length, c.head_dim);
  c.rope_dim = get_dim_or(f, p + "rope.dimension_count", c.head_dim);
  CUMULUS_CHECK(c.rope_dim == c.head_dim, "gguf: {}: rope.dimension_count={} != head_dim={} (partial RoPE is not supported)",
                f.path(), c.rope_dim, c.head_dim);
  c.rope_theta = static_cast<float>(f.get_f64_or(p + "rope.freq_base", 10000.0));
  c.rms_eps = static_cast<float>(f.get_f64_or(p + "attention.layer_norm_rms_epsilon", 1e-5));
  if (gemma3) {
    c.rope_neox = true;
    c.embedding_scale = std::sqrt(static_cast<float>(c.dim));
    c.ffn_activation = FfnActivation::gelu_tanh;
    c.qk_norm = true;
    c.post_norms = true;
    // llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 blocks): 1/sqrt(dim / n_heads).
    c.attention_scale = c.n_layers == 62 ? 1.0f / std::sqrt(static_cast<float>(c.dim / c.n_heads))
                                         : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    c.logit_softcap = static_cast<float>(f.get_f64_or(p + "final_logit_softcapping", 0.0));
    CUMULUS_CHECK(c.logit_softcap >= 0, "gguf: {}: {}final_logit_softcapping={} must be >= 0", f.path(), p,
                  c.logit_softcap);
    CUMULUS_CHECK(f.find(p + "rope.scaling.type") == nullptr || f.get_string(p + "rope.scaling.type") == "none",
                  "gguf: {}: {}rope.scaling.type='{}' is not supported (Gemma 3 270M has none)", f.path(), p,
                  f.get_string(p + "rope.scaling.type"));
    const uint64_t window = f.get_u64_or(p + "attention.sliding_window", 0);
    CUMULUS_CHECK(window <= kMaxDim, "gguf: {}: {}attention.sliding_window={} must be <= {}", f.path(), p, window,
                  kMaxDim);
    c.sliding_window = static_cast<int>(window);
    if (c.sliding_window > 0) {
      c.layer_local = gemma3_layer_pattern(f, p, c.n_layers);
      c.rope_theta_local = static_cast<float>(f.get_f64_or(p + "rope.freq_base_swa", 10000.0));
      CUMULUS_CHECK(c.rope_theta_local > 0, "gguf: {}: {}rope.freq_base_swa={} must be > 0", f.path(), p,
                    c.rope_theta_local);
    }
  }
  CUMULUS_CHECK(c.rope_theta > 0 && c.rms_eps > 0 && c.rms_eps < 1, "gguf: {}: rope.freq_base={} / rms eps={} out of range",
                f.path(), c.rope_theta, c.rms_eps);

  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  CUMULUS_CHECK(embd != nullptr, "gguf: {}: missing tensor 'token_embd.weight'", f.path());
  CUMULUS_CHECK(embd->ne[1] >= 1 && embd->ne[1] <= (1u << 24), "gguf: {}: token_embd.weight has {} rows", f.path(),
                embd->ne[1]);
  c.vocab_size = static_cast<int>(embd->ne[1]);
  if (f.find(p + "vocab_size") != nullptr) {
    const uint64_t v = f.get_u64(p + "vocab_size");
    CUMULUS_CHECK(v == static_cast<uint64_t>(c.vocab_size), "gguf: {}: {}vocab_size={} but token_embd.weight has {} rows",
                  f.path(), p, v, c.vocab_size);
  }
  c.tied_output = f.find_tensor("output.weight") == nullptr;
  return c;
}

namespace {

// The weights, or with check_only no data: each tensor found and checked (name, shape,
// type) as the load would, so a file the load refuses is refused without reading it.
ModelWeights weights_from_gguf(const GgufFile& f, WeightStorage storage, bool check_only) {
  auto vec = [&](const std::string& name, uint64_t ne0) {
    if (!check_only) return load_vector(f, name, ne0);
    find_checked(f, name, {ne0});
    return std::vector<float>{};
  };
  auto mat = [&](const std::string& name, uint64_t ne0, uint64_t ne1) {
    if (!check_only) return load_matrix(f, name, ne0, ne1, storage);
    find_checked(f, name, {ne0, ne1});
    return WeightMatrix{};
  };
  ModelWeights w;
  w.config = model_config_from_gguf(f);
  const ModelConfig& c = w.config;
  const auto dim = static_cast<uint64_t>(c.dim), hidden = static_cast<uint64_t>(c.hidden_dim);
  const auto q_dim = static_cast<uint64_t>(c.n_heads) * static_cast<uint64_t>(c.head_dim);
  const auto kv_dim = static_cast<uint64_t>(c.n_kv_heads) * static_cast<uint64_t>(c.head_dim);
  const auto vocab = static_cast<uint64_t>(c.vocab_size);

  w.token_embd = mat("token_embd.weight", dim, vocab);
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string b = fmt::format("blk.{}.", l);
    LayerWeights& L = w.layers[static_cast<size_t>(l)];
    L.attn_norm = vec(b + "attn_norm.weight", dim);
    L.wq = mat(b + "attn_q.weight", dim, q_dim);
    L.wk = mat(b + "attn_k.weight", dim, kv_dim);
    L.wv = mat(b + "attn_v.weight", dim, kv_dim);
    L.wo = mat(b + "attn_output.weight", q_dim, dim);
    L.ffn_norm = vec(b + "ffn_norm.weight", dim);
    L.w_gate = mat(b + "ffn_gate.weight", dim, hidden);
    L.w_down = mat(b + "ffn_down.weight", hidden, dim);
    L.w_up = mat(b + "ffn_up.weight", dim, hidden);
    if (c.qk_norm) {
      L.attn_q_norm = vec(b + "attn_q_norm.weight", static_cast<uint64_t>(c.head_dim));
      L.attn_k_norm = vec(b + "attn_k_norm.weight", static_cast<uint64_t>(c.head_dim));
    }
    if (c.post_norms) {
      L.post_attention_norm = vec(b + "post_attention_norm.weight", dim);
      L.post_ffw_norm = vec(b + "post_ffw_norm.weight", dim);
    }
  }
  w.output_norm = vec("output_norm.weight", dim);
  if (!c.tied_output) w.output = mat("output.weight", dim, vocab);
  return w;
}

}  // namespace

ModelWeights model_weights_from_gguf(const GgufFile& f, WeightStorage storage) {
  return weights_from_gguf(f, storage, false);
}

void model_weights_check(const std::string& path) {
  if (model_format_of(path) == ModelFormat::gguf) weights_from_gguf(GgufFile::open(path), WeightStorage::compact, true);
  // llama2.c: model_config_from_llama2c checks the file's size against its header.
  else (void)model_config_from_llama2c(path);
}

ModelWeights model_weights_load(const std::string& path, WeightStorage storage) {
  if (model_format_of(path) == ModelFormat::gguf) return model_weights_from_gguf(GgufFile::open(path), storage);
  return model_weights_from_llama2c(path);
}

size_t ModelWeights::bytes() const {
  size_t n = token_embd.bytes() + output.bytes() + output_norm.size() * sizeof(float);
  for (const LayerWeights& L : layers) {
    n += L.wq.bytes() + L.wk.bytes() + L.wv.bytes() + L.wo.bytes() + L.w_gate.bytes() + L.w_down.bytes() +
         L.w_up.bytes() +
         (L.attn_norm.size() + L.ffn_norm.size() + L.attn_q_norm.size() + L.attn_k_norm.size() +
          L.post_attention_norm.size() + L.post_ffw_norm.size()) *
             sizeof(float);
  }
  return n;
}

}  // namespace cumulus
