// Writes the seed corpora for the fuzzers in tools/fuzz, small but complete inputs that
// reach deep into each parser:
//   gguf               GGUF files: a llama model with tensors of every supported type, a
//                      byte-level BPE tokenizer, a sentencepiece-style one, versions 2 and 3
//   gguf_tokenizer     [text length] + GGUF files holding tokenizer metadata only + text
//   llama2c            llama2.c .bin models (shared and separate classifier, GQA)
//   llama2c_tokenizer  [vocab_size - 4][text length] + tok*.bin files + text
//   trace              `cumulus trace` files (one and two records)
//   kv_snapshot        [flag] + KV snapshot files (f16, bf16, f32; with and without prompt
//                      queries), written here from docs/kv_snapshot.md, not by the library
//
// Usage: make_seeds [KIND] DIR   (KIND defaults to gguf)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../../tests/test_model_gguf_writer.h"

using cumulus::test::GgufWriter;

namespace {

// ggml type id -> (block elements, block bytes) for the types the loader supports.
struct TypeSize {
  uint32_t id, block, bytes;
};
constexpr TypeSize kTypes[] = {{0, 1, 4},    {1, 1, 2},    {30, 1, 2},     {2, 32, 18},   {3, 32, 20},
                               {6, 32, 22},  {7, 32, 24},  {8, 32, 34},    {12, 256, 144}, {13, 256, 176},
                               {14, 256, 210}};

std::vector<uint8_t> random_bytes(std::mt19937& rng, size_t n, bool f32) {
  std::vector<uint8_t> b(n);
  if (f32) {
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (size_t i = 0; i + 4 <= n; i += 4) {
      const float v = nd(rng);
      std::memcpy(b.data() + i, &v, 4);
    }
    return b;
  }
  // Half-precision scales must stay finite: fill with small f16 values 0x2000-0x3bff.
  for (size_t i = 0; i + 1 < n; i += 2) {
    const uint16_t h = static_cast<uint16_t>(0x2000 + rng() % 0x1c00);
    b[i] = static_cast<uint8_t>(h & 0xFF);
    b[i + 1] = static_cast<uint8_t>(h >> 8);
  }
  return b;
}

// tokenizer.ggml.* metadata for a 16-token vocabulary: byte-level BPE (gpt2) or
// sentencepiece-style (llama) with scores and token types.
void tokenizer_kv(GgufWriter& w, bool bpe) {
  const uint32_t vocab = 16;
  std::vector<std::string> tokens;
  if (bpe) {
    w.kv_string("tokenizer.ggml.model", "gpt2");
    w.kv_string("tokenizer.ggml.pre", "smollm");
    tokens = {"<|endoftext|>", "H", "e", "l", "o", "\xC4\xA0", "w", "r", "d", "He", "ll", "llo", "\xC4\xA0w", "or",
              "Hello", "ld"};
    w.kv_string_array("tokenizer.ggml.merges", {"H e", "l l", "ll o", "\xC4\xA0 w", "o r", "He llo", "l d"});
  } else {
    w.kv_string("tokenizer.ggml.model", "llama");
    tokens = {"<unk>", "<s>", "</s>", "<0x0A>", "<0x41>", "\xE2\x96\x81", "H", "e", "l", "o",
              "\xE2\x96\x81H", "ll", "llo", "w", "r", "d"};
    std::vector<float> scores(vocab);
    for (uint32_t i = 0; i < vocab; ++i) scores[i] = -static_cast<float>(i);
    w.kv_array("tokenizer.ggml.scores", GgufWriter::F32, scores);
    std::vector<int32_t> types(vocab, 1);
    types[0] = 2, types[1] = 3, types[2] = 3, types[3] = 6, types[4] = 6;
    w.kv_array("tokenizer.ggml.token_type", GgufWriter::I32, types);
  }
  w.kv_string_array("tokenizer.ggml.tokens", tokens);
  w.kv_u32("tokenizer.ggml.bos_token_id", 1);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  w.kv_bool("tokenizer.ggml.add_bos_token", true);
}

// A one-layer llama whose matrices have type `t`; dim is 32, or 256 for the K-quants
// (256-element blocks), so the seeds stay small enough for the fuzzer to mutate quickly.
std::vector<uint8_t> llama(uint32_t version, const TypeSize& t, bool with_tokenizer, bool bpe) {
  std::mt19937 rng(t.id * 7 + version);
  GgufWriter w;
  w.version = version;
  w.kv_string("general.architecture", "llama");
  w.kv_string("general.name", "seed");
  w.kv_u32("llama.block_count", 1);
  w.kv_u32("llama.context_length", 64);
  const uint64_t dim = t.block == 256 ? 256 : 32;
  w.kv_u32("llama.embedding_length", static_cast<uint32_t>(dim));
  w.kv_u32("llama.feed_forward_length", static_cast<uint32_t>(dim));
  w.kv_u32("llama.attention.head_count", 4);
  w.kv_u32("llama.attention.head_count_kv", 2);
  w.kv_f32("llama.rope.freq_base", 10000.0f);
  w.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  const uint32_t vocab = 16;
  if (with_tokenizer) tokenizer_kv(w, bpe);
  auto tensor = [&](const std::string& name, uint64_t cols, uint64_t rows, const TypeSize& ty) {
    const size_t bytes = static_cast<size_t>(cols / ty.block * ty.bytes * rows);
    w.tensor(name, {cols, rows}, ty.id, random_bytes(rng, bytes, ty.id == 0));
  };
  const TypeSize f32 = kTypes[0];
  tensor("token_embd.weight", dim, vocab, t);
  const std::string b = "blk.0.";
  w.tensor(b + "attn_norm.weight", {dim}, 0, random_bytes(rng, 4 * dim, true));
  tensor(b + "attn_q.weight", dim, dim, t);
  tensor(b + "attn_k.weight", dim, dim / 2, t);
  tensor(b + "attn_v.weight", dim, dim / 2, t);
  tensor(b + "attn_output.weight", dim, dim, t);
  w.tensor(b + "ffn_norm.weight", {dim}, 0, random_bytes(rng, 4 * dim, true));
  tensor(b + "ffn_gate.weight", dim, dim, t);
  tensor(b + "ffn_down.weight", dim, dim, t);
  tensor(b + "ffn_up.weight", dim, dim, t);
  w.tensor("output_norm.weight", {dim}, 0, random_bytes(rng, 4 * dim, true));
  if (t.id == 1) tensor("output.weight", dim, vocab, f32);
  return w.bytes();
}

// A llama2.c model: 7 int32 header, then every tensor as float32 (layer-stacked), the
// RoPE tables, and the classifier when not shared (negative vocab_size).
std::vector<uint8_t> llama2c(int32_t dim, int32_t hidden, int32_t layers, int32_t heads, int32_t kv_heads,
                             int32_t vocab, int32_t seq) {
  std::mt19937 rng(static_cast<uint32_t>(dim * 131 + vocab));
  const int32_t header[7] = {dim, hidden, layers, heads, kv_heads, vocab, seq};
  std::vector<uint8_t> b(reinterpret_cast<const uint8_t*>(header), reinterpret_cast<const uint8_t*>(header) + 28);
  const uint64_t D = dim, H = hidden, L = layers, V = vocab < 0 ? -vocab : vocab, hd = D / heads, KV = kv_heads * hd;
  const uint64_t floats = V * D + L * D + L * D * D + 2 * L * KV * D + L * D * D + L * D + 3 * L * H * D + D +
                          2 * seq * hd / 2 + (vocab < 0 ? V * D : 0);
  const std::vector<uint8_t> f = random_bytes(rng, floats * 4, true);
  b.insert(b.end(), f.begin(), f.end());
  return b;
}

// A tok*.bin for `tokens`: int32 max_token_length, then per token f32 score, int32 length,
// bytes.
std::vector<uint8_t> llama2c_tokenizer(const std::vector<std::string>& tokens) {
  std::vector<uint8_t> b;
  auto put = [&](const void* p, size_t n) {
    b.insert(b.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  };
  int32_t max_len = 0;
  for (const auto& t : tokens) max_len = std::max(max_len, static_cast<int32_t>(t.size()));
  put(&max_len, 4);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const float score = -static_cast<float>(i);
    const int32_t len = static_cast<int32_t>(tokens[i].size());
    put(&score, 4);
    put(&len, 4);
    put(tokens[i].data(), tokens[i].size());
  }
  return b;
}

// A `cumulus trace` file (docs/cuda.md "Traces") with random K/V (finite f16) and queries.
std::vector<uint8_t> trace(int n_q, int n_kv, int d, int prompt, int steps, const std::vector<int>& layers) {
  std::mt19937 rng(static_cast<uint32_t>(n_q * 7 + layers.size()));
  std::string h = "{\"n_q_heads\": " + std::to_string(n_q) + ", \"n_kv_heads\": " + std::to_string(n_kv) +
                  ", \"head_dim\": " + std::to_string(d) + ", \"n_tokens\": " + std::to_string(prompt + steps) +
                  ", \"prompt_tokens\": " + std::to_string(prompt) + ", \"steps\": " + std::to_string(steps) +
                  ", \"layers\": [";
  for (size_t i = 0; i < layers.size(); ++i) h += (i ? ", " : "") + std::to_string(layers[i]);
  h += "]}";
  std::vector<uint8_t> b = {'C', 'U', 'M', 'T', 'R', 'A', 'C', 'E', 1, 0, 0, 0};
  const uint32_t hb = static_cast<uint32_t>(h.size());
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(hb >> (8 * i)));
  b.insert(b.end(), h.begin(), h.end());
  const size_t kv = static_cast<size_t>(prompt + steps) * n_kv * d * 2, q = static_cast<size_t>(steps) * n_q * d * 4;
  for (size_t l = 0; l < layers.size(); ++l) {
    for (const auto& part : {random_bytes(rng, kv, false), random_bytes(rng, kv, false), random_bytes(rng, q, true)})
      b.insert(b.end(), part.begin(), part.end());
  }
  return b;
}

// A KV snapshot (docs/kv_snapshot.md) with random finite K/V in `dtype` (0 f32, 1 f16,
// 2 bf16), written from the format's description; `flag` is the fuzzer's first byte (odd:
// it rewrites the checksum itself). Version 2 with `first` (one per layer): each layer's
// K/V from that token on.
std::vector<uint8_t> kv_snapshot(uint8_t flag, uint32_t dtype, uint32_t layers, uint32_t heads, uint32_t kv_heads,
                                 uint32_t head_dim, uint32_t vocab, uint32_t page, uint32_t tokens, uint32_t rows,
                                 const std::vector<uint32_t>& first = {}) {
  std::mt19937 rng(dtype * 31 + layers * 7 + tokens);
  const std::string setup = "weights=F32 prefill=dense";
  std::vector<uint8_t> b(128, 0);
  auto u32 = [&](size_t at, uint32_t v) { std::memcpy(b.data() + at, &v, 4); };
  std::memcpy(b.data(), "CUMKVSNP", 8);
  u32(8, first.empty() ? 1 : 2);
  u32(12, dtype);
  const uint64_t model_id = 0x0123456789abcdefull;
  std::memcpy(b.data() + 16, &model_id, 8);
  const uint32_t fields[] = {layers, heads, kv_heads, head_dim, vocab, page, tokens, rows,
                             static_cast<uint32_t>(setup.size())};
  for (size_t i = 0; i < 9; ++i) u32(24 + 4 * i, fields[i]);
  auto pad = [&] { b.resize((b.size() + 63) / 64 * 64, 0); };
  auto append = [&](const std::vector<uint8_t>& v) { b.insert(b.end(), v.begin(), v.end()); };
  b.insert(b.end(), setup.begin(), setup.end());
  pad();
  if (!first.empty()) {
    for (uint32_t f : first) b.insert(b.end(), reinterpret_cast<const uint8_t*>(&f), reinterpret_cast<const uint8_t*>(&f) + 4);
    pad();
  }
  for (uint32_t t = 0; t < tokens; ++t) {
    const uint32_t id = rng() % vocab;
    b.insert(b.end(), reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + 4);
  }
  pad();
  append(random_bytes(rng, 4 * static_cast<size_t>(vocab), true));
  pad();
  append(random_bytes(rng, 4 * static_cast<size_t>(layers) * rows * heads * head_dim, true));
  pad();
  for (uint32_t l = 0; l < layers; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      const size_t half = static_cast<size_t>(tokens - (first.empty() ? 0 : first[l])) * kv_heads * head_dim;
      if (dtype == 0) {
        append(random_bytes(rng, 4 * half, true));
      } else if (dtype == 1) {
        append(random_bytes(rng, 2 * half, false));
      } else {  // bf16: the top halves of small float32 values
        for (size_t i = 0; i < half; ++i) {
          const uint16_t h = static_cast<uint16_t>(0x3c00 + rng() % 0x0380);
          b.push_back(static_cast<uint8_t>(h & 0xFF));
          b.push_back(static_cast<uint8_t>(h >> 8));
        }
      }
    }
  uint64_t h = 14695981039346656037ull;  // FNV-1a 64 of every byte so far
  for (uint8_t c : b) h = (h ^ c) * 1099511628211ull;
  b.insert(b.end(), reinterpret_cast<const uint8_t*>(&h), reinterpret_cast<const uint8_t*>(&h) + 8);
  b.insert(b.begin(), flag);
  return b;
}

// [length byte] + bytes + text: the fuzzers that also encode a text take it from the end.
std::vector<uint8_t> with_text(std::vector<uint8_t> prefix, std::vector<uint8_t> body, const std::string& text) {
  prefix.push_back(static_cast<uint8_t>(text.size()));
  prefix.insert(prefix.end(), body.begin(), body.end());
  prefix.insert(prefix.end(), text.begin(), text.end());
  return prefix;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s [gguf|gguf_tokenizer|llama2c|llama2c_tokenizer|tokenizer_text|trace|kv_snapshot] DIR\n", argv[0]);
    return 2;
  }
  const std::string kind = argc == 3 ? argv[1] : "gguf";
  const std::string dir = argv[argc - 1];
  int n = 0;
  auto write = [&](const std::vector<uint8_t>& bytes) {
    const std::string path = dir + "/seed" + std::to_string(n++) + "." + kind;
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!f) {
      std::fprintf(stderr, "make_seeds: cannot write %s\n", path.c_str());
      std::exit(1);
    }
  };
  if (kind == "gguf") {
    for (const TypeSize& t : kTypes) write(llama(3, t, false, false));
    write(llama(2, kTypes[0], true, true));
    write(llama(3, kTypes[7], true, false));
  } else if (kind == "gguf_tokenizer") {
    for (bool bpe : {true, false})
      for (const char* text : {"Hello world", "\nA\xE2\x96\x81llo"}) {
        GgufWriter w;
        tokenizer_kv(w, bpe);
        write(with_text({}, w.bytes(), text));
      }
  } else if (kind == "llama2c") {
    write(llama2c(8, 16, 1, 2, 1, 16, 8));
    write(llama2c(8, 12, 2, 2, 2, -16, 4));
  } else if (kind == "llama2c_tokenizer") {
    const std::vector<std::string> tokens = {"<unk>", "<s>", "</s>", "<0x0A>", "<0x41>", " ", " H", "e",
                                             "l",     "o",   "ll",   "llo",    " w",     "r", "d", "He"};
    for (const char* text : {"Hello world", "A\nllo"})
      write(with_text({static_cast<uint8_t>(tokens.size() - 4)}, llama2c_tokenizer(tokens), text));
  } else if (kind == "tokenizer_text") {
    // [tokenizer and prefix length][repeat count, little-endian][text]
    auto seed = [&](uint8_t pick, uint16_t repeat, const std::string& text) {
      std::vector<uint8_t> b = {pick, static_cast<uint8_t>(repeat & 0xFF), static_cast<uint8_t>(repeat >> 8)};
      b.insert(b.end(), text.begin(), text.end());
      write(b);
    };
    for (uint8_t tok : {0, 1}) {
      seed(static_cast<uint8_t>(tok | 16 << 1), 0, "Once upon a time, there was a little girl named Lily.\n");
      seed(static_cast<uint8_t>(tok | 3 << 1), 4000, "a");
      seed(static_cast<uint8_t>(tok | 1 << 1), 2000, " ");
      seed(static_cast<uint8_t>(tok | 40 << 1), 300, "ab 12 \xC3\xA9<|im_end|>\n\n");
    }
  } else if (kind == "trace") {
    write(trace(4, 2, 8, 5, 2, {0}));
    write(trace(6, 2, 8, 3, 3, {2, 5}));
    // A header claiming far more data than follows (the reader must refuse it before
    // allocating): a realistic shape, cut after 4 KiB.
    std::vector<uint8_t> cut = trace(32, 8, 128, 64, 16, {0});
    cut.resize(4096);
    write(cut);
  } else if (kind == "kv_snapshot") {
    write(kv_snapshot(1, 1, 2, 4, 2, 8, 16, 4, 5, 2));
    write(kv_snapshot(0, 1, 2, 4, 2, 8, 16, 4, 5, 2));
    write(kv_snapshot(1, 2, 1, 2, 1, 16, 8, 1, 3, 0));
    write(kv_snapshot(1, 0, 3, 3, 3, 8, 4, 16, 17, 17));
    // Version 2: a layer of every token and sliding-window layers that kept their last 3 and 1.
    write(kv_snapshot(1, 1, 3, 4, 2, 8, 16, 4, 9, 2, {0, 7, 9}));
    write(kv_snapshot(1, 2, 2, 2, 1, 16, 8, 2, 5, 0, {0, 0}));
    // A header claiming far more than follows (the reader must refuse it before reading
    // it): a realistic shape, cut after 4 KiB.
    std::vector<uint8_t> cut = kv_snapshot(1, 1, 4, 8, 2, 64, 64, 16, 40, 4);
    cut.resize(4096);
    write(cut);
  } else {
    std::fprintf(stderr, "make_seeds: unknown kind '%s'\n", kind.c_str());
    return 2;
  }
  std::printf("make_seeds: wrote %d %s files to %s\n", n, kind.c_str(), dir.c_str());
  return 0;
}
