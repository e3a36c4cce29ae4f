// llama2.c legacy `.bin` loader. Header: 7 int32 (dim, hidden_dim, n_layers, n_heads,
// n_kv_heads, vocab_size, seq_len); a negative vocab_size means the classifier is not
// shared and is stored last. Then float32 tensors, each layer-stacked: tok_emb[V][D],
// rms_att[L][D], wq[L][D][D], wk[L][KV][D], wv[L][KV][D], wo[L][D][D], rms_ffn[L][D],
// w1[L][H][D], w2[L][D][H], w3[L][H][D], rms_final[D], freq_cis_real[S][hd/2],
// freq_cis_imag[S][hd/2] (skipped: RoPE is recomputed), [wcls[V][D]]. The file must be
// exactly that long.
#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/check.h"
#include "cumulus/core/file.h"
#include "cumulus/model/model_weights.h"

namespace cumulus {
namespace {

struct Llama2cHeader {
  int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

constexpr uint64_t kHeaderBytes = 7 * sizeof(int32_t);

Llama2cHeader read_header(const std::string& path, std::ifstream& in) {
  Llama2cHeader h{};
  in.read(reinterpret_cast<char*>(&h), sizeof(h));
  CUMULUS_CHECK(in.gcount() == static_cast<std::streamsize>(sizeof(h)),
                "llama2c: {}: truncated header ({} of {} bytes)", path, in.gcount(), sizeof(h));
  return h;
}

void check_range(const std::string& path, const char* what, int64_t v, int64_t lo, int64_t hi) {
  CUMULUS_CHECK(v >= lo && v <= hi, "llama2c: {}: header {}={} must be in [{}, {}]", path, what, v, lo, hi);
}

// Floats per section, in file order.
struct Llama2cLayout {
  uint64_t tok_emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq_cis, wcls;
  uint64_t total() const {
    return tok_emb + rms_att + wq + wk + wv + wo + rms_ffn + w1 + w2 + w3 + rms_final + 2 * freq_cis + wcls;
  }
};

ModelConfig config_from_header(const std::string& path, const Llama2cHeader& h, uint64_t file_size,
                               Llama2cLayout* layout) {
  check_range(path, "dim", h.dim, 1, 1 << 16);
  check_range(path, "hidden_dim", h.hidden_dim, 1, 1 << 18);
  check_range(path, "n_layers", h.n_layers, 1, 1024);
  check_range(path, "n_heads", h.n_heads, 1, h.dim);
  check_range(path, "n_kv_heads", h.n_kv_heads, 1, h.n_heads);
  check_range(path, "|vocab_size|", h.vocab_size < 0 ? -static_cast<int64_t>(h.vocab_size) : h.vocab_size, 1, 1 << 22);
  check_range(path, "seq_len", h.seq_len, 1, 1 << 24);
  CUMULUS_CHECK(h.dim % h.n_heads == 0, "llama2c: {}: dim={} is not a multiple of n_heads={}", path, h.dim, h.n_heads);
  CUMULUS_CHECK(h.n_heads % h.n_kv_heads == 0, "llama2c: {}: n_heads={} is not a multiple of n_kv_heads={}", path,
                h.n_heads, h.n_kv_heads);
  const int head_dim = h.dim / h.n_heads;
  CUMULUS_CHECK(head_dim % 2 == 0, "llama2c: {}: head_dim={} must be even for RoPE", path, head_dim);

  ModelConfig c;
  c.architecture = "llama";
  c.format = ModelFormat::llama2c;
  c.dim = h.dim;
  c.hidden_dim = h.hidden_dim;
  c.n_layers = h.n_layers;
  c.n_heads = h.n_heads;
  c.n_kv_heads = h.n_kv_heads;
  c.head_dim = head_dim;
  c.rope_dim = head_dim;
  c.tied_output = h.vocab_size > 0;
  c.vocab_size = c.tied_output ? h.vocab_size : -h.vocab_size;
  c.context_length = h.seq_len;
  c.rope_theta = 10000.0f;  // llama2.c's fixed values
  c.rms_eps = 1e-5f;

  // All factors are bounded above, so no product overflows u64.
  const auto D = static_cast<uint64_t>(c.dim), H = static_cast<uint64_t>(c.hidden_dim),
             L = static_cast<uint64_t>(c.n_layers), V = static_cast<uint64_t>(c.vocab_size),
             KV = static_cast<uint64_t>(c.n_kv_heads) * static_cast<uint64_t>(head_dim),
             S = static_cast<uint64_t>(c.context_length);
  Llama2cLayout& y = *layout;
  y = Llama2cLayout{V * D, L * D, L * D * D, L * KV * D, L * KV * D, L * D * D, L * D,
                    L * H * D, L * D * H, L * H * D, D, S * static_cast<uint64_t>(head_dim) / 2,
                    c.tied_output ? 0 : V * D};
  const uint64_t want = kHeaderBytes + y.total() * sizeof(float);
  CUMULUS_CHECK(file_size == want,
                "llama2c: {}: file has {} bytes, but the header (dim={} hidden_dim={} n_layers={} n_heads={} "
                "n_kv_heads={} vocab_size={} seq_len={}) implies {}",
                path, file_size, h.dim, h.hidden_dim, h.n_layers, h.n_heads, h.n_kv_heads, h.vocab_size, h.seq_len,
                want);
  return c;
}

uint64_t file_size_of(const std::string& path, std::ifstream& in) {
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  in.seekg(0, std::ios::beg);
  return size;
}

}  // namespace

ModelConfig model_config_from_llama2c(const std::string& path) {
  file_check_regular(path, "llama2c model");
  std::ifstream in(path, std::ios::binary);
  CUMULUS_CHECK(in.good(), "llama2c: cannot open '{}' ({})", path, std::strerror(errno));
  const uint64_t size = file_size_of(path, in);
  Llama2cLayout layout{};
  return config_from_header(path, read_header(path, in), size, &layout);
}

ModelWeights model_weights_from_llama2c(const std::string& path) {
  file_check_regular(path, "llama2c model");
  std::ifstream in(path, std::ios::binary);
  CUMULUS_CHECK(in.good(), "llama2c: cannot open '{}' ({})", path, std::strerror(errno));
  const uint64_t size = file_size_of(path, in);
  Llama2cLayout y{};
  ModelWeights w;
  w.config = config_from_header(path, read_header(path, in), size, &y);
  const ModelConfig& c = w.config;

  auto read = [&](uint64_t n, const char* what) {
    std::vector<float> v(static_cast<size_t>(n));
    in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
    CUMULUS_CHECK(in.gcount() == static_cast<std::streamsize>(n * sizeof(float)), "llama2c: {}: short read of {}",
                  path, what);
    return v;
  };
  // Splits a layer-stacked tensor [L][per] into the layers.
  auto per_layer_slices = [&](uint64_t total, const char* what) {
    const std::vector<float> all = read(total, what);
    const size_t per = all.size() / static_cast<size_t>(c.n_layers);
    std::vector<std::vector<float>> out(w.layers.size());
    for (size_t l = 0; l < w.layers.size(); ++l)
      out[l].assign(all.begin() + static_cast<std::ptrdiff_t>(l * per),
                    all.begin() + static_cast<std::ptrdiff_t>((l + 1) * per));
    return out;
  };
  auto per_layer_vector = [&](uint64_t total, const char* what, std::vector<float> LayerWeights::*field) {
    auto slices = per_layer_slices(total, what);
    for (size_t l = 0; l < w.layers.size(); ++l) w.layers[l].*field = std::move(slices[l]);
  };
  // Matrices [rows][cols], as PyTorch writes them.
  auto per_layer_matrix = [&](uint64_t total, const char* what, WeightMatrix LayerWeights::*field, int rows, int cols) {
    auto slices = per_layer_slices(total, what);
    for (size_t l = 0; l < w.layers.size(); ++l)
      w.layers[l].*field = WeightMatrix::from_f32(std::move(slices[l]), rows, cols);
  };
  const int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;

  w.layers.resize(static_cast<size_t>(c.n_layers));
  w.token_embd = WeightMatrix::from_f32(read(y.tok_emb, "tok_emb"), c.vocab_size, c.dim);
  per_layer_vector(y.rms_att, "rms_att", &LayerWeights::attn_norm);
  per_layer_matrix(y.wq, "wq", &LayerWeights::wq, qd, c.dim);
  per_layer_matrix(y.wk, "wk", &LayerWeights::wk, kvd, c.dim);
  per_layer_matrix(y.wv, "wv", &LayerWeights::wv, kvd, c.dim);
  per_layer_matrix(y.wo, "wo", &LayerWeights::wo, c.dim, qd);
  per_layer_vector(y.rms_ffn, "rms_ffn", &LayerWeights::ffn_norm);
  per_layer_matrix(y.w1, "w1", &LayerWeights::w_gate, c.hidden_dim, c.dim);
  per_layer_matrix(y.w2, "w2", &LayerWeights::w_down, c.dim, c.hidden_dim);
  per_layer_matrix(y.w3, "w3", &LayerWeights::w_up, c.hidden_dim, c.dim);
  w.output_norm = read(y.rms_final, "rms_final");
  in.seekg(static_cast<std::streamoff>(2 * y.freq_cis * sizeof(float)), std::ios::cur);  // freq_cis tables
  if (!c.tied_output) w.output = WeightMatrix::from_f32(read(y.wcls, "wcls"), c.vocab_size, c.dim);
  return w;
}

}  // namespace cumulus
