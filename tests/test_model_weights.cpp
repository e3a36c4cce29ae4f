// Model config + weight loaders: llama2.c .bin (stories260K from ../shared, plus synthetic
// untied and corrupt files) and GGUF `llama` (hand-built small files; SmolLM2 when
// models/ has it, checked against the real config.json).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <unistd.h>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/gemv.h"
#include "kernels/cpu/gemv_pool.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/session.h"
#include "test_model_gguf_writer.h"
#include "fixtures.h"

using namespace cumulus;
using cumulus::test::GgufWriter;
namespace fs = std::filesystem;

namespace {

fs::path repo_root() { return cumulus::test::source_dir(); }
fs::path stories260k() { return fs::path(CUMULUS_SHARED_DIR) / "data/models/stories260K/stories260K.bin"; }
fs::path smollm2_gguf() { return repo_root() / "models/SmolLM2-135M-Instruct.Q4_1.gguf"; }
// Gemma 3 270M Q4_K_M (scripts/fetch-model.sh gemma3-270m).
fs::path gemma3_gguf() { return repo_root() / "models/gemma-3-270m-q4_k_m.gguf"; }

fs::path temp_file(const std::string& name) {
  return fs::temp_directory_path() / ("cumulus_" + std::to_string(::getpid()) + "_" + name);
}

void write_file(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<uint8_t> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void expect_error_naming(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "'" << n << "' not in: " << e.what();
  }
}

// A synthetic llama2.c file whose float i (after the header) has the value i.
std::vector<uint8_t> synthetic_llama2c(int32_t dim, int32_t hidden, int32_t layers, int32_t heads, int32_t kv_heads,
                                       int32_t vocab, int32_t seq, size_t n_floats) {
  std::vector<uint8_t> b(28 + 4 * n_floats);
  const int32_t h[7] = {dim, hidden, layers, heads, kv_heads, vocab, seq};
  std::memcpy(b.data(), h, 28);
  for (size_t i = 0; i < n_floats; ++i) {
    const auto v = static_cast<float>(i);
    std::memcpy(b.data() + 28 + 4 * i, &v, 4);
  }
  return b;
}

// A small GGUF llama: dim 32, hidden 64, 2 layers, 4 heads over 2 kv heads (head_dim 8),
// vocab 10. Tensor values are i * 0.001 (F32), embeddings in Q8_0. `skip` drops a tensor,
// `bad_shape` gives one the wrong shape.
std::vector<uint8_t> small_llama_gguf(const std::string& arch = "llama", const std::string& skip = "",
                                      const std::string& bad_shape = "", bool untied = false) {
  GgufWriter w;
  w.kv_string("general.architecture", arch);
  const std::string p = arch + ".";
  w.kv_u32(p + "block_count", 2);
  w.kv_u32(p + "context_length", 128);
  w.kv_u32(p + "embedding_length", 32);
  w.kv_u32(p + "feed_forward_length", 64);
  w.kv_u32(p + "attention.head_count", 4);
  w.kv_u32(p + "attention.head_count_kv", 2);
  w.kv_f32(p + "rope.freq_base", 500000.0f);
  w.kv_f32(p + "attention.layer_norm_rms_epsilon", 1e-6f);
  auto f32 = [&](const std::string& name, std::vector<uint64_t> dims) {
    if (name == skip) return;
    if (name == bad_shape) dims[0] += 1;
    uint64_t n = 1;
    for (auto d : dims) n *= d;
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * 0.001f;
    w.tensor(name, dims, 0, GgufWriter::as_bytes(v));
  };
  // token_embd [10][32] in Q8_0: row r, element e = (e - 16) * 0.25 * (r + 1) / 8.
  if (skip != "token_embd.weight") {
    std::vector<uint8_t> q;
    for (int r = 0; r < 10; ++r) {
      const uint16_t d = f32_to_f16(0.25f * static_cast<float>(r + 1) / 8.0f);
      q.push_back(static_cast<uint8_t>(d & 0xFF));
      q.push_back(static_cast<uint8_t>(d >> 8));
      for (int e = 0; e < 32; ++e) q.push_back(static_cast<uint8_t>(static_cast<int8_t>(e - 16)));
    }
    w.tensor("token_embd.weight", {32, 10}, 8, q);
  }
  for (int l = 0; l < 2; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    f32(b + "attn_norm.weight", {32});
    f32(b + "attn_q.weight", {32, 32});
    f32(b + "attn_k.weight", {32, 16});
    f32(b + "attn_v.weight", {32, 16});
    f32(b + "attn_output.weight", {32, 32});
    f32(b + "ffn_norm.weight", {32});
    f32(b + "ffn_gate.weight", {32, 64});
    f32(b + "ffn_down.weight", {64, 32});
    f32(b + "ffn_up.weight", {32, 64});
  }
  f32("output_norm.weight", {32});
  if (untied) f32("output.weight", {32, 10});
  return w.bytes();
}

}  // namespace

TEST(Llama2c, Stories260KLoads) {
  if (!fs::exists(stories260k())) CUMULUS_FIXTURE_MISSING(stories260k() << " missing (../shared not present)");
  const ModelConfig c = model_config_from_llama2c(stories260k().string());
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.context_length, 512);
  EXPECT_TRUE(c.tied_output);
  EXPECT_EQ(c.format, ModelFormat::llama2c);
  EXPECT_EQ(model_format_of(stories260k().string()), ModelFormat::llama2c);

  const ModelWeights w = model_weights_load(stories260k().string());
  ASSERT_EQ(w.layers.size(), 5u);
  EXPECT_EQ(w.token_embd.size(), 512u * 64);
  EXPECT_EQ(w.output_norm.size(), 64u);
  EXPECT_TRUE(w.output.empty());
  EXPECT_EQ(&w.output_weight(), &w.token_embd);
  EXPECT_FALSE(w.token_embd.quantized());  // llama2.c checkpoints are float32
  for (const auto& L : w.layers) {
    EXPECT_EQ(L.attn_norm.size(), 64u);
    EXPECT_EQ(L.wq.size(), 64u * 64);
    EXPECT_EQ(L.wk.size(), 32u * 64);
    EXPECT_EQ(L.wv.size(), 32u * 64);
    EXPECT_EQ(L.wo.size(), 64u * 64);
    EXPECT_EQ(L.w_gate.size(), 172u * 64);
    EXPECT_EQ(L.w_down.size(), 64u * 172);
    EXPECT_EQ(L.w_up.size(), 172u * 64);
    for (float v : L.wq.to_f32()) ASSERT_TRUE(std::isfinite(v));
  }
  // Spot-check offsets against the raw file: tok_emb[0][0] is the first float; rms_final
  // is the D floats before the two freq_cis tables (2 x 512 x 4 floats).
  const std::vector<uint8_t> raw = read_file(stories260k());
  float first, final0;
  std::memcpy(&first, raw.data() + 28, 4);
  std::memcpy(&final0, raw.data() + raw.size() - 4 * (2 * 512 * 4 + 64), 4);
  EXPECT_EQ(w.token_embd.f32()[0], first);
  EXPECT_EQ(w.output_norm[0], final0);
  // Layer 4's last w3 float sits just before rms_final.
  float w3_last;
  std::memcpy(&w3_last, raw.data() + raw.size() - 4 * (2 * 512 * 4 + 64 + 1), 4);
  EXPECT_EQ(w.layers[4].w_up.f32()[w.layers[4].w_up.size() - 1], w3_last);
}

TEST(Llama2c, WrongSizeAndBadHeader) {
  if (!fs::exists(stories260k())) CUMULUS_FIXTURE_MISSING(stories260k() << " missing (../shared not present)");
  const std::vector<uint8_t> good = read_file(stories260k());
  const fs::path p = temp_file("stories.bin");
  std::vector<uint8_t> b(good.begin(), good.end() - 1);
  write_file(p, b);
  expect_error_naming([&] { model_weights_from_llama2c(p.string()); }, {p.string(), "1056539 bytes", "implies 1056540"});
  b = good;
  b.push_back(0);
  write_file(p, b);
  expect_error_naming([&] { model_config_from_llama2c(p.string()); }, {p.string(), "1056541 bytes"});
  b = good;
  const int32_t zero = 0, big = 1 << 30;
  std::memcpy(b.data(), &zero, 4);
  write_file(p, b);
  expect_error_naming([&] { model_weights_from_llama2c(p.string()); }, {"dim=0"});
  b = good;
  std::memcpy(b.data() + 20, &big, 4);  // vocab_size
  write_file(p, b);
  expect_error_naming([&] { model_weights_from_llama2c(p.string()); }, {"|vocab_size|=1073741824"});
  write_file(p, std::vector<uint8_t>(10));
  expect_error_naming([&] { model_weights_from_llama2c(p.string()); }, {"truncated header"});
  fs::remove(p);
  EXPECT_THROW(model_weights_from_llama2c("/nonexistent/model.bin"), Error);
}

TEST(Llama2c, UntiedClassifierAndLayerSplit) {
  // dim 8, hidden 12, 2 layers, 2 heads over 1 kv head (head_dim 4, kv_dim 4), vocab -10
  // (untied), seq 4.
  const size_t D = 8, H = 12, L = 2, KV = 4, V = 10, S = 4;
  const size_t n = V * D + L * D + L * D * D + 2 * L * KV * D + L * D * D + L * D + 3 * L * H * D + D + 2 * S * 2 + V * D;
  const fs::path p = temp_file("untied.bin");
  write_file(p, synthetic_llama2c(8, 12, 2, 2, 1, -10, 4, n));
  const ModelWeights w = model_weights_from_llama2c(p.string());
  fs::remove(p);
  EXPECT_FALSE(w.config.tied_output);
  EXPECT_EQ(w.config.vocab_size, 10);
  ASSERT_EQ(w.output.size(), V * D);
  EXPECT_EQ(&w.output_weight(), &w.output);
  EXPECT_EQ(w.output.f32()[0], static_cast<float>(n - V * D));
  EXPECT_EQ(w.output.f32()[V * D - 1], static_cast<float>(n - 1));
  EXPECT_EQ(w.token_embd.f32()[V * D - 1], static_cast<float>(V * D - 1));
  EXPECT_EQ(w.layers[0].attn_norm.front(), static_cast<float>(V * D));
  EXPECT_EQ(w.layers[1].attn_norm.front(), static_cast<float>(V * D + D));
  const size_t wk_start = V * D + L * D + L * D * D;
  EXPECT_EQ(w.layers[1].wk.f32()[0], static_cast<float>(wk_start + KV * D));
  EXPECT_EQ(w.output_norm.front(), static_cast<float>(n - V * D - 2 * S * 2 - D));
}

TEST(Model, GgufSmallLlamaLoads) {
  const GgufFile f = GgufFile::from_bytes("small.gguf", small_llama_gguf());
  const ModelConfig c = model_config_from_gguf(f);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.dim, 32);
  EXPECT_EQ(c.hidden_dim, 64);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.rope_dim, 8);
  EXPECT_EQ(c.vocab_size, 10);
  EXPECT_EQ(c.context_length, 128);
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.rms_eps, 1e-6f);
  EXPECT_TRUE(c.tied_output);
  const ModelWeights w = model_weights_from_gguf(f);
  ASSERT_EQ(w.token_embd.size(), 320u);
  // Q8_0 stays quantised (compact storage); its values read back as the format defines.
  EXPECT_EQ(w.token_embd.storage_name(), "Q8_0");
  EXPECT_EQ(w.token_embd.to_f32()[3 * 32 + 20], 4.0f * 0.25f * 4.0f / 8.0f);  // row 3, e = 20
  ASSERT_EQ(w.layers.size(), 2u);
  EXPECT_EQ(w.layers[1].wk.size(), 16u * 32);
  EXPECT_EQ(w.layers[1].wk.to_f32()[5], static_cast<float>(5) * 0.001f);
  const ModelWeights wf = model_weights_from_gguf(f, WeightStorage::f32);
  EXPECT_EQ(wf.token_embd.storage_name(), "F32");
  EXPECT_EQ(wf.token_embd.to_f32(), w.token_embd.to_f32());
  EXPECT_EQ(w.layers[0].w_down.size(), 32u * 64);
  EXPECT_TRUE(w.output.empty());

  const GgufFile u = GgufFile::from_bytes("untied.gguf", small_llama_gguf("llama", "", "", true));
  const ModelWeights wu = model_weights_from_gguf(u);
  EXPECT_FALSE(wu.config.tied_output);
  EXPECT_EQ(wu.output.size(), 320u);
  EXPECT_EQ(&wu.output_weight(), &wu.output);
}

TEST(Model, GgufLoaderErrorsNameFileAndTensor) {
  expect_error_naming([] { model_weights_from_gguf(GgufFile::from_bytes("m.gguf", small_llama_gguf("gpt2"))); },
                      {"m.gguf", "general.architecture='gpt2'"});
  expect_error_naming(
      [] { model_weights_from_gguf(GgufFile::from_bytes("m.gguf", small_llama_gguf("llama", "blk.1.attn_k.weight"))); },
      {"m.gguf", "missing tensor 'blk.1.attn_k.weight'"});
  expect_error_naming(
      [] { model_weights_from_gguf(GgufFile::from_bytes("m.gguf", small_llama_gguf("llama", "token_embd.weight"))); },
      {"m.gguf", "token_embd.weight"});
  expect_error_naming(
      [] {
        model_weights_from_gguf(GgufFile::from_bytes("m.gguf", small_llama_gguf("llama", "", "blk.0.ffn_up.weight")));
      },
      {"m.gguf", "tensor 'blk.0.ffn_up.weight' has shape [33, 64, 1, 1], want [32, 64]"});
  // Hyperparameters that do not fit together.
  GgufWriter w;
  w.kv_string("general.architecture", "llama");
  w.kv_u32("llama.block_count", 1);
  w.kv_u32("llama.context_length", 16);
  w.kv_u32("llama.embedding_length", 30);
  w.kv_u32("llama.feed_forward_length", 8);
  w.kv_u32("llama.attention.head_count", 4);
  expect_error_naming([&] { model_config_from_gguf(GgufFile::from_bytes("h.gguf", w.bytes())); },
                      {"h.gguf", "embedding_length=30"});
  GgufWriter w2;
  w2.kv_string("general.architecture", "llama");
  expect_error_naming([&] { model_config_from_gguf(GgufFile::from_bytes("k.gguf", w2.bytes())); },
                      {"k.gguf", "missing metadata key 'llama.block_count'"});
}

namespace {

// Random blocks of a ggml type for n elements, with finite f16 fields (random bytes could
// make Inf/NaN): d (and m / dmin) at the block's start, Q6_K's d at byte 208. Scales are
// chosen so that the model's activations stay of order 1.
std::vector<uint8_t> random_blocks(GgmlType t, uint64_t n, std::mt19937& rng) {
  const GgmlTypeInfo& info = ggml_type_info(t);
  std::vector<uint8_t> raw(n / info.block_size * info.type_size);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const bool k = info.block_size == 256;
  const float mag = k ? 2e-4f : 4e-3f;  // K-quants multiply d by a 6- or 8-bit sub-block scale
  for (size_t b = 0; b < raw.size(); b += info.type_size) {
    for (size_t i = 0; i < info.type_size; ++i) raw[b + i] = static_cast<uint8_t>(byte(rng));
    std::vector<size_t> fields{0};
    if (t == GgmlType::q6_k) fields = {208};
    if (t == GgmlType::q4_1 || t == GgmlType::q5_1 || t == GgmlType::q4_k || t == GgmlType::q5_k) fields = {0, 2};
    for (size_t off : fields) {
      const uint16_t h = f32_to_f16(mag * u(rng));
      std::memcpy(&raw[b + off], &h, 2);
    }
  }
  return raw;
}

// A llama of dim 256, hidden 512, 4 heads over 2 kv heads (head_dim 64), vocab 10, one
// layer, whose matrices are in the types a Q4_K_M file mixes (and Q5_K, Q5_1).
struct KQuantLlama {
  std::vector<uint8_t> bytes;
  std::map<std::string, std::pair<GgmlType, std::vector<uint8_t>>> tensors;  // name -> type, data
};
KQuantLlama kquant_llama() {
  std::mt19937 rng(4);
  GgufWriter w;
  w.kv_string("general.architecture", "llama");
  w.kv_u32("llama.block_count", 1);
  w.kv_u32("llama.context_length", 64);
  w.kv_u32("llama.embedding_length", 256);
  w.kv_u32("llama.feed_forward_length", 512);
  w.kv_u32("llama.attention.head_count", 4);
  w.kv_u32("llama.attention.head_count_kv", 2);
  KQuantLlama m;
  auto add = [&](const std::string& name, uint64_t ne0, uint64_t ne1, GgmlType t) {
    std::vector<uint8_t> data;
    if (t == GgmlType::f32) {
      std::vector<float> v(ne0 * ne1, 1.0f);
      data = GgufWriter::as_bytes(v);
    } else {
      data = random_blocks(t, ne0 * ne1, rng);
    }
    w.tensor(name, ne1 == 1 ? std::vector<uint64_t>{ne0} : std::vector<uint64_t>{ne0, ne1}, static_cast<uint32_t>(t), data);
    m.tensors[name] = {t, data};
  };
  add("token_embd.weight", 256, 10, GgmlType::q8_0);
  add("blk.0.attn_norm.weight", 256, 1, GgmlType::f32);
  add("blk.0.attn_q.weight", 256, 256, GgmlType::q4_k);
  add("blk.0.attn_k.weight", 256, 128, GgmlType::q5_0);
  add("blk.0.attn_v.weight", 256, 128, GgmlType::q6_k);
  add("blk.0.attn_output.weight", 256, 256, GgmlType::q5_k);
  add("blk.0.ffn_norm.weight", 256, 1, GgmlType::f32);
  add("blk.0.ffn_gate.weight", 256, 512, GgmlType::q4_k);
  add("blk.0.ffn_down.weight", 512, 256, GgmlType::q6_k);
  add("blk.0.ffn_up.weight", 256, 512, GgmlType::q5_1);
  add("output_norm.weight", 256, 1, GgmlType::f32);
  m.bytes = w.bytes();
  return m;
}

}  // namespace

TEST(Model, GgufKQuantWeightsStayCompact) {
  // A Q4_K_M-like file keeps its size in memory: every matrix in its block format, the
  // model's bytes equal to the tensors' bytes, and values equal to the GGUF dequantiser's.
  const KQuantLlama m = kquant_llama();
  const GgufFile f = GgufFile::from_bytes("kq.gguf", m.bytes);
  const ModelWeights w = model_weights_from_gguf(f);
  size_t tensor_bytes = 0;
  for (const auto& [name, t] : m.tensors) tensor_bytes += t.second.size();
  EXPECT_EQ(w.bytes(), tensor_bytes);
  const LayerWeights& L = w.layers[0];
  const std::pair<const WeightMatrix*, const char*> mats[] = {
      {&w.token_embd, "token_embd.weight"}, {&L.wq, "blk.0.attn_q.weight"},       {&L.wk, "blk.0.attn_k.weight"},
      {&L.wv, "blk.0.attn_v.weight"},       {&L.wo, "blk.0.attn_output.weight"}, {&L.w_gate, "blk.0.ffn_gate.weight"},
      {&L.w_down, "blk.0.ffn_down.weight"}, {&L.w_up, "blk.0.ffn_up.weight"}};
  for (const auto& [mat, name] : mats) {
    const auto& [type, data] = m.tensors.at(name);
    EXPECT_EQ(mat->storage_name(), ggml_type_name(type)) << name;
    std::vector<float> want(mat->size());
    dequantize_row(type, data.data(), want.data(), want.size());
    const std::vector<float> got = mat->to_f32();
    float mx = 0;
    for (float v : want) mx = std::max(mx, std::fabs(v));
    ASSERT_GT(mx, 0.0f) << name;
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-6f * mx) << name << " element " << i;
  }
  // Decode on the compact weights against the same weights in float32: logits agree up to
  // the activation rounding (kernels/gemv.h), bit-identically over thread counts. Its bound
  // follows the width the GEMV takes here: 16-bit codes move an activation by at most
  // amax / 65534 of its block, 8-bit ones by amax / 254 (seen: up to 7.5e-3 of the largest
  // logit on this model with 8 bits).
  const double tol = cpu::gemv_quant_activation_bits() == 8 ? 2e-2 : 1e-3;
  const ModelWeights w32 = model_weights_from_gguf(f, WeightStorage::f32);
  EXPECT_GT(w32.bytes(), 4 * w.bytes());
  const std::vector<int32_t> prompt{1, 7, 3, 9, 2};
  std::vector<std::vector<float>> first;
  for (int threads : {1, 2}) {
    SessionOptions o;
    o.n_threads = threads;
    Session a(w, o), b(w32, o);
    a.prefill(prompt);
    b.prefill(prompt);
    const int32_t steps[] = {4, 8, 0};
    for (size_t s = 0; s < 3; ++s) {
      const int32_t t = steps[s];
      const std::vector<float> la = a.decode(t);
      const std::vector<float>& lb = b.decode(t);
      double worst = 0, mag = 0;
      for (size_t i = 0; i < la.size(); ++i) {
        worst = std::max(worst, std::fabs(static_cast<double>(la[i]) - lb[i]));
        mag = std::max(mag, std::fabs(static_cast<double>(lb[i])));
      }
      EXPECT_LE(worst, tol * mag + 1e-4) << "threads " << threads << " token " << t;
      if (threads == 1) first.push_back(la);
      else EXPECT_EQ(la, first[s]) << "token " << t;
    }
  }
}

TEST(Model, GgufKQuantTensorsThatDoNotFit) {
  // A K-quant tensor whose rows are not whole blocks, and one cut short: errors name the
  // tensor, its type and the value.
  GgufWriter w;
  w.kv_string("general.architecture", "llama");
  w.tensor("blk.0.attn_q.weight", {640, 2}, static_cast<uint32_t>(GgmlType::q4_k), std::vector<uint8_t>(2 * 144 * 3));
  expect_error_naming([&] { GgufFile::from_bytes("a.gguf", w.bytes()); },
                      {"a.gguf", "tensor 'blk.0.attn_q.weight'", "ne[0]=640", "Q4_K block size 256"});
  GgufWriter w2;
  w2.kv_string("general.architecture", "llama");
  // [512][3] Q6_K needs 3 * 2 * 210 = 1260 bytes; the file holds 1000.
  w2.tensor("blk.0.ffn_down.weight", {512, 3}, static_cast<uint32_t>(GgmlType::q6_k), std::vector<uint8_t>(1000));
  expect_error_naming([&] { GgufFile::from_bytes("b.gguf", w2.bytes()); },
                      {"b.gguf", "tensor 'blk.0.ffn_down.weight' (Q6_K, 1536 elements, 1260 bytes)", "past the end",
                       "(1000 bytes)"});
}

TEST(Model, Gemma3Q4KMMatricesStayCompact) {
  // Every matrix of the real Q4_K_M file (Q8_0, Q5_0, Q4_K, Q6_K), each loaded on its own
  // (tests/test_model_gemma3.cpp loads the whole model), kept compact: the same bytes as
  // the file up to the scale padding of the repacked rows, rows reading back as the GGUF
  // dequantiser's values (itself checked against gguf-py), and the GEMV equal to the
  // float64 reference on the first 64 rows.
  if (!fs::exists(gemma3_gguf()))
    CUMULUS_FIXTURE_MISSING(gemma3_gguf() << " missing: run scripts/fetch-model.sh gemma3-270m");
  const GgufFile f = GgufFile::open(gemma3_gguf().string());
  std::mt19937 rng(18);
  std::normal_distribution<float> g(0.0f, 1.0f);
  ThreadPool pool(2);
  size_t file_bytes = 0, held_bytes = 0;
  std::map<std::string, int> by_type;
  for (const GgufTensorInfo& t : f.tensors()) {
    if (t.n_dims != 2 || t.type == GgmlType::f32) continue;
    const int rows = static_cast<int>(t.ne[1]), cols = static_cast<int>(t.ne[0]);
    const std::string name(t.name);
    const WeightMatrix w = WeightMatrix::from_ggml(t.type, {t.data, static_cast<size_t>(t.n_bytes)}, rows, cols,
                                                   WeightStorage::compact, name);
    ASSERT_TRUE(w.quantized()) << name;
    ASSERT_EQ(w.storage_name(), ggml_type_name(t.type)) << name;
    ++by_type[std::string(ggml_type_name(t.type))];
    file_bytes += t.n_bytes;
    held_bytes += w.bytes();
    const size_t row_bytes = ggml_row_bytes(t.type, t.ne[0]);
    std::vector<float> got(static_cast<size_t>(cols)), want(static_cast<size_t>(cols));
    for (int r : {0, 1, rows / 2, rows - 1}) {
      w.rows_to_f32(r, r + 1, got.data());
      dequantize_row(t.type, t.data + static_cast<size_t>(r) * row_bytes, want.data(), want.size());
      float mx = 0;
      for (float v : want) mx = std::max(mx, std::fabs(v));
      for (int c = 0; c < cols; ++c)
        ASSERT_NEAR(got[static_cast<size_t>(c)], want[static_cast<size_t>(c)], 1e-6f * mx) << name << " row " << r;
    }
    std::vector<float> x(static_cast<size_t>(cols)), y(static_cast<size_t>(rows));
    for (auto& v : x) v = g(rng);
    cpu::gemv_quant(w.quant_view(), x.data(), y.data(), pool);
    QuantMatrixView head = w.quant_view();
    head.rows = std::min(rows, 64);
    QuantActivation xq;
    ref::quant_activation(x.data(), cols, cpu::gemv_quant_activation_bits(), xq);
    std::vector<double> ref_y(static_cast<size_t>(head.rows)), deq(static_cast<size_t>(head.rows) * cols);
    ref::gemv_quant(head, xq, ref_y.data());
    ref::quant_dequantize_rows(head, 0, head.rows, deq.data());
    for (int r = 0; r < head.rows; ++r) {
      double mag = 0;
      for (int c = 0; c < cols; ++c) mag += std::fabs(deq[static_cast<size_t>(r) * cols + c] * x[static_cast<size_t>(c)]);
      ASSERT_LE(std::fabs(y[static_cast<size_t>(r)] - ref_y[static_cast<size_t>(r)]), 1e-5 * mag) << name << " row " << r;
    }
  }
  EXPECT_EQ(by_type["Q8_0"], 10);
  EXPECT_EQ(by_type["Q5_0"], 81);
  EXPECT_EQ(by_type["Q4_K"], 27);
  EXPECT_EQ(by_type["Q6_K"], 9);
  std::printf("  Gemma 3 270M Q4_K_M matrices: %.1f MB in the file, %.1f MB held compact\n", file_bytes / 1e6,
              held_bytes / 1e6);
  EXPECT_GE(held_bytes, file_bytes);
  EXPECT_LE(static_cast<double>(held_bytes), 1.02 * static_cast<double>(file_bytes));
}

TEST(Model, SmolLM2GgufMatchesConfigJson) {
  if (!fs::exists(smollm2_gguf())) CUMULUS_FIXTURE_MISSING(smollm2_gguf() << " missing: run scripts/fetch-model.sh");
  const GgufFile f = GgufFile::open(smollm2_gguf().string());
  const ModelConfig c = model_config_from_gguf(f);
  const fs::path cfg_path = fs::path(CUMULUS_SHARED_DIR) / "data/models/smollm2-135m-instruct-meta/config.json";
  if (fs::exists(cfg_path)) {
    std::ifstream in(cfg_path);
    const nlohmann::json cfg = nlohmann::json::parse(in);
    EXPECT_EQ(c.n_layers, cfg.at("num_hidden_layers").get<int>());
    EXPECT_EQ(c.n_heads, cfg.at("num_attention_heads").get<int>());
    EXPECT_EQ(c.n_kv_heads, cfg.at("num_key_value_heads").get<int>());
    EXPECT_EQ(c.dim, cfg.at("hidden_size").get<int>());
    EXPECT_EQ(c.hidden_dim, cfg.at("intermediate_size").get<int>());
    EXPECT_EQ(c.vocab_size, cfg.at("vocab_size").get<int>());
    EXPECT_EQ(c.context_length, cfg.at("max_position_embeddings").get<int>());
    EXPECT_EQ(c.rope_theta, cfg.at("rope_theta").get<float>());
    EXPECT_FLOAT_EQ(c.rms_eps, cfg.at("rms_norm_eps").get<float>());
    EXPECT_EQ(c.tied_output, cfg.at("tie_word_embeddings").get<bool>());
  }
  EXPECT_EQ(c.head_dim, 64);
  const ModelWeights w = model_weights_from_gguf(f);
  ASSERT_EQ(w.layers.size(), 30u);
  EXPECT_EQ(w.token_embd.size(), 49152u * 576);
  EXPECT_EQ(w.layers[29].wk.size(), 192u * 576);
  EXPECT_EQ(w.layers[29].w_down.size(), 576u * 1536);
  EXPECT_EQ(w.layers[29].w_down.storage_name(), "Q4_1");
  EXPECT_EQ(w.token_embd.storage_name(), "Q8_0");
  for (float v : w.layers[29].w_down.to_f32()) ASSERT_TRUE(std::isfinite(v));
  for (float v : w.output_norm) ASSERT_TRUE(std::isfinite(v));
}
