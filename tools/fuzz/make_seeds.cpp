// Writes the seed corpus for gguf_fuzzer: small but complete GGUF files (a llama model with
// tensors of every supported type, a byte-level BPE tokenizer, a sentencepiece-style one,
// versions 2 and 3) so that the fuzzer starts from inputs that reach deep into the loader.
//
// Usage: make_seeds DIR
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
  if (with_tokenizer) {
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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int n = 0;
  auto write = [&](const std::vector<uint8_t>& bytes) {
    const std::string path = dir + "/seed" + std::to_string(n++) + ".gguf";
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!f) {
      std::fprintf(stderr, "make_seeds: cannot write %s\n", path.c_str());
      std::exit(1);
    }
  };
  for (const TypeSize& t : kTypes) write(llama(3, t, false, false));
  write(llama(2, kTypes[0], true, true));
  write(llama(3, kTypes[7], true, false));
  std::printf("make_seeds: wrote %d files to %s\n", n, dir.c_str());
  return 0;
}
