// The gemma3 architecture: the loader's config and errors on small
// synthetic GGUF files, the sliding-window layers (prefill, decode and chunking agree; the
// window changes logits exactly where it should), methods running on the global layers
// only, the local layers' cache holding only their window (decode, restart_decode and KV
// snapshots bit-identical to a cache of every token), and the real Gemma 3 270M Q4_K_M
// (layer pattern, deterministic greedy text, the window cache at 700 tokens). The golden
// comparison with llama.cpp on the real file is tests/test_model_gemma3_logits.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <span>
#include <filesystem>
#include <functional>
#include <string>
#include <unistd.h>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kv/kv_snapshot.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/session.h"
#include "cumulus/model/model_identity.h"
#include "cumulus/model/text.h"
#include "cumulus/model/tokenizer.h"
#include "fixtures.h"
#include "test_model_gguf_writer.h"

using namespace cumulus;
using cumulus::test::GgufWriter;
namespace fs = std::filesystem;

namespace {

fs::path gemma3_gguf() { return cumulus::test::source_dir() / "models/gemma-3-270m-q4_k_m.gguf"; }

struct SmallGemma3 {
  int layers = 4;
  int window = 4;
  std::string pattern = "u32";  // none (llama.cpp's default period 6), u32 (period 2), bools, short_bools, string
  std::string skip;             // a tensor left out
  std::string bad_shape;        // a tensor given one more element in ne[0]
  int key_length = 16, value_length = 16;
  std::string arch = "gemma3";
};

// A small gemma3: dim 32, hidden 64, 4 query heads over 2 kv heads of head_dim 16 (not
// dim / heads = 8, as Gemma's own head dim), vocab 12, F32 tensors of smooth pseudo-random
// values (norm weights near 1), so logits depend on every weight.
std::vector<uint8_t> small_gemma3_gguf(const SmallGemma3& o) {
  GgufWriter w;
  w.kv_string("general.architecture", o.arch);
  const std::string p = o.arch + ".";
  w.kv_u32(p + "block_count", static_cast<uint32_t>(o.layers));
  w.kv_u32(p + "context_length", 256);
  w.kv_u32(p + "embedding_length", 32);
  w.kv_u32(p + "feed_forward_length", 64);
  w.kv_u32(p + "attention.head_count", 4);
  w.kv_u32(p + "attention.head_count_kv", 2);
  if (o.key_length > 0) w.kv_u32(p + "attention.key_length", static_cast<uint32_t>(o.key_length));
  if (o.value_length > 0) w.kv_u32(p + "attention.value_length", static_cast<uint32_t>(o.value_length));
  w.kv_f32(p + "rope.freq_base", 1000000.0f);
  w.kv_f32(p + "attention.layer_norm_rms_epsilon", 1e-6f);
  w.kv_u32(p + "attention.sliding_window", static_cast<uint32_t>(o.window));
  const std::string pk = p + "attention.sliding_window_pattern";
  if (o.pattern == "u32") w.kv_u32(pk, 2);
  if (o.pattern == "bools") {
    std::vector<uint8_t> b(static_cast<size_t>(o.layers), 1);
    b[2] = 0;  // only layer 2 global
    w.kv_array(pk, GgufWriter::BOOL, b);
  }
  if (o.pattern == "short_bools") w.kv_array(pk, GgufWriter::BOOL, std::vector<uint8_t>{1, 0});
  if (o.pattern == "string") w.kv_string(pk, "LLLG");
  uint32_t salt = 0;
  auto f32 = [&](const std::string& name, std::vector<uint64_t> dims, float base, float amp) {
    ++salt;
    if (name == o.skip) return;
    if (name == o.bad_shape) dims[0] += 1;
    uint64_t n = 1;
    for (auto d : dims) n *= d;
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = base + amp * std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(salt));
    w.tensor(name, dims, 0, GgufWriter::as_bytes(v));
  };
  const uint64_t hd = 16;
  f32("token_embd.weight", {32, 12}, 0.0f, 0.2f);
  for (int l = 0; l < o.layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    f32(b + "attn_norm.weight", {32}, 1.0f, 0.2f);
    f32(b + "attn_q.weight", {32, 4 * hd}, 0.0f, 0.3f);
    f32(b + "attn_k.weight", {32, 2 * hd}, 0.0f, 0.3f);
    f32(b + "attn_v.weight", {32, 2 * hd}, 0.0f, 0.3f);
    f32(b + "attn_output.weight", {4 * hd, 32}, 0.0f, 0.2f);
    f32(b + "attn_q_norm.weight", {hd}, 1.0f, 0.3f);
    f32(b + "attn_k_norm.weight", {hd}, 1.0f, 0.3f);
    f32(b + "post_attention_norm.weight", {32}, 0.5f, 0.2f);
    f32(b + "ffn_norm.weight", {32}, 1.0f, 0.2f);
    f32(b + "ffn_gate.weight", {32, 64}, 0.0f, 0.3f);
    f32(b + "ffn_down.weight", {64, 32}, 0.0f, 0.2f);
    f32(b + "ffn_up.weight", {32, 64}, 0.0f, 0.3f);
    f32(b + "post_ffw_norm.weight", {32}, 0.5f, 0.2f);
  }
  f32("output_norm.weight", {32}, 1.0f, 0.2f);
  return w.bytes();
}

ModelWeights small_gemma3(const SmallGemma3& o = {}) {
  return model_weights_from_gguf(GgufFile::from_bytes("g.gguf", small_gemma3_gguf(o)));
}

void expect_error_naming(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "'" << n << "' not in: " << e.what();
  }
}

std::vector<int32_t> small_tokens(int n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i * 7 + 3) % 12;
  return t;
}

// Decodes `tokens` (teacher-forced) in both sessions; every step's logits must be the same bits.
void expect_same_decode(Session& a, Session& b, std::span<const int32_t> tokens, const std::string& where) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::vector<float> la = a.decode(tokens[i]);
    const std::vector<float>& lb = b.decode(tokens[i]);
    ASSERT_EQ(la, lb) << where << ", decode step " << i;
  }
}

// The window cache against a cache of every token, on one model and prompt: prefill (in
// chunks of `chunk`), decode, restart_decode and decode again, a KV snapshot loaded into a
// fresh window session; every logit the same bits. Returns the two caches' bytes after the
// first decode run.
std::pair<size_t, size_t> expect_window_cache_equal(const ModelWeights& w, std::span<const int32_t> prompt,
                                                     std::span<const int32_t> next, int chunk, int page_size) {
  SessionOptions o;
  o.prefill_chunk = chunk;
  o.kv.page_size = page_size;
  o.max_tokens = static_cast<int>(prompt.size() + next.size());
  SessionOptions full_o = o;
  full_o.kv_window = false;
  Session win(w, o), full(w, full_o);
  const std::string where = "page size " + std::to_string(page_size);
  EXPECT_EQ(win.prefill(prompt), full.prefill(prompt)) << where;
  expect_same_decode(win, full, next, where);
  const std::pair<size_t, size_t> bytes{win.kv().bytes_allocated(), full.kv().bytes_allocated()};
  // The local layers dropped what their window left behind; the global ones did not.
  for (int l = 0; l < w.config.n_layers; ++l)
    EXPECT_EQ(win.kv().window(l), w.config.is_local(l) ? w.config.sliding_window : 0) << "layer " << l;
  win.restart_decode("dense");
  full.restart_decode("dense");
  expect_same_decode(win, full, next.first(next.size() / 2), where + ", after restart_decode");
  // A snapshot of the window session (the local layers' last window only) decodes as the
  // cache of every token did.
  const std::string file =
      (fs::temp_directory_path() / ("cumulus_gemma3_window_" + std::to_string(::getpid()) + ".kvsnap")).string();
  const uint64_t id = 1234;
  win.kv_save(file, id);
  const KvSnapshot snap = KvSnapshot::open(file);
  for (int l = 0; l < w.config.n_layers; ++l)
    EXPECT_EQ(snap.info().first_token[static_cast<size_t>(l)],
              w.config.is_local(l) ? std::max(0, static_cast<int>(prompt.size()) - w.config.sliding_window + 1) : 0);
  Session loaded(w, o), fresh(w, full_o);
  EXPECT_EQ(loaded.kv_load(snap, id), fresh.prefill(prompt)) << where;
  expect_same_decode(loaded, fresh, next, where + ", after kv_load");
  // Into a session that keeps every token, the snapshot lacks the local layers' early tokens.
  Session keeps_all(w, full_o);
  try {
    keeps_all.kv_load(snap, id);
    ADD_FAILURE() << "a window snapshot loaded into a cache of every token";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds tokens from"), std::string::npos) << e.what();
  }
  fs::remove(file);
  return bytes;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

}  // namespace

TEST(Gemma3, SmallGgufConfig) {
  const ModelWeights w = small_gemma3();
  const ModelConfig& c = w.config;
  EXPECT_EQ(c.architecture, "gemma3");
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_TRUE(c.rope_neox);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.post_norms);
  EXPECT_EQ(c.ffn_activation, FfnActivation::gelu_tanh);
  EXPECT_FLOAT_EQ(c.embedding_scale, std::sqrt(32.0f));
  EXPECT_FLOAT_EQ(c.attention_scale, 0.25f);
  EXPECT_EQ(c.logit_softcap, 0.0f);
  EXPECT_EQ(c.sliding_window, 4);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
  EXPECT_FLOAT_EQ(c.rope_theta_local, 1e4f);
  EXPECT_EQ(c.layer_local, (std::vector<uint8_t>{1, 0, 1, 0}));  // period 2: every second layer global
  EXPECT_EQ(c.n_global_layers(), 2);
  EXPECT_EQ(w.layers[1].attn_q_norm.size(), 16u);
  EXPECT_EQ(w.layers[3].post_ffw_norm.size(), 32u);

  SmallGemma3 bools;
  bools.pattern = "bools";
  EXPECT_EQ(small_gemma3(bools).config.layer_local, (std::vector<uint8_t>{1, 1, 0, 1}));
  // No pattern key: llama.cpp's period 6 (layers 5, 11, ... global).
  SmallGemma3 none;
  none.pattern = "none";
  none.layers = 7;
  EXPECT_EQ(small_gemma3(none).config.layer_local, (std::vector<uint8_t>{1, 1, 1, 1, 1, 0, 1}));
}

TEST(Gemma3, BadInputNamesTheValue) {
  auto load = [](const SmallGemma3& o) { return [o] { (void)small_gemma3(o); }; };
  SmallGemma3 o;
  o.skip = "blk.1.attn_k_norm.weight";
  expect_error_naming(load(o), {"g.gguf", "missing tensor 'blk.1.attn_k_norm.weight'"});
  o = {};
  o.skip = "blk.3.post_ffw_norm.weight";
  expect_error_naming(load(o), {"g.gguf", "missing tensor 'blk.3.post_ffw_norm.weight'"});
  o = {};
  o.bad_shape = "blk.0.attn_q_norm.weight";  // a q norm of 17 for head_dim 16
  expect_error_naming(load(o), {"g.gguf", "tensor 'blk.0.attn_q_norm.weight' has shape [17, 1, 1, 1], want [16]"});
  o = {};
  o.value_length = 8;
  expect_error_naming(load(o), {"g.gguf", "attention.value_length=8 differs from key_length=16"});
  o = {};
  o.key_length = 0;
  expect_error_naming(load(o), {"g.gguf", "gemma3.attention.key_length"});
  o = {};
  o.key_length = o.value_length = 8;  // the tensors hold head_dim 16
  expect_error_naming(load(o), {"g.gguf", "blk.0.attn_q.weight", "want [32, 32]"});
  o = {};
  o.pattern = "short_bools";
  expect_error_naming(load(o), {"g.gguf", "gemma3.attention.sliding_window_pattern", "2 bool", "want 4 booleans",
                                "unknown layer pattern"});
  o = {};
  o.pattern = "string";
  expect_error_naming(load(o), {"g.gguf", "gemma3.attention.sliding_window_pattern", "string", "unknown layer pattern"});
  o = {};
  o.arch = "gemma2";
  expect_error_naming(load(o), {"g.gguf", "general.architecture='gemma2'", "supported: llama, gemma3"});
}

TEST(Gemma3, SlidingWindowPrefillDecodeAndChunksAgree) {
  // 20 tokens through a window of 4: every position past 3 drops keys on the local layers.
  const ModelWeights w = small_gemma3();
  const std::vector<int32_t> t = small_tokens(20);
  SessionOptions o;
  o.n_threads = 2;
  Session whole(w, o);
  const std::vector<float> ref = whole.prefill(t);
  for (float z : ref) ASSERT_TRUE(std::isfinite(z));
  // Prefill in chunks of 3 (rows cross chunk and window boundaries), one thread.
  SessionOptions o3 = o;
  o3.prefill_chunk = 3;
  o3.n_threads = 1;
  Session chunked(w, o3);
  EXPECT_LE(max_abs_diff(chunked.prefill(t), ref), 1e-4);
  // Prefill 5, decode 15 (the decode path of local and global layers).
  Session dec(w, o);
  dec.prefill(std::span<const int32_t>(t).first(5));
  std::vector<float> last;
  for (size_t i = 5; i < t.size(); ++i) last = dec.decode(t[i]);
  EXPECT_LE(max_abs_diff(last, ref), 1e-4);
  // Deterministic: the same run again is bit-identical.
  Session again(w, o);
  EXPECT_EQ(again.prefill(t), ref);
}

TEST(Gemma3, WindowChangesLogitsOnlyPastIt) {
  // Within the first `window` positions the local layers see every key, so a window of 4
  // and a window of 1000 give the same logits; past it they differ.
  SmallGemma3 wide;
  wide.window = 1000;
  const ModelWeights w4 = small_gemma3(), w1000 = small_gemma3(wide);
  const std::vector<int32_t> t = small_tokens(12);
  SessionOptions o;
  Session a(w4, o), b(w1000, o);
  for (int n = 1; n <= 12; ++n) {
    const std::vector<float> la = a.prefill(std::span<const int32_t>(t).subspan(static_cast<size_t>(n - 1), 1));
    const std::vector<float> lb = b.prefill(std::span<const int32_t>(t).subspan(static_cast<size_t>(n - 1), 1));
    if (n <= 4) {
      EXPECT_EQ(la, lb) << "position " << n - 1;
    } else {
      EXPECT_GT(max_abs_diff(la, lb), 1e-3) << "position " << n - 1;
    }
  }
}

TEST(Gemma3, MethodsRunOnGlobalLayersOnly) {
  const ModelWeights w = small_gemma3();  // layers 1 and 3 global
  const std::vector<int32_t> t = small_tokens(40);
  SessionOptions o;
  o.method = "oracle_topk";
  o.params = {{"k", "8"}};
  o.eval = true;
  Session s(w, o);
  s.prefill(std::span<const int32_t>(t).first(32));
  for (size_t i = 32; i < t.size(); ++i) s.decode(t[i]);
  for (int l = 0; l < 4; ++l) {
    if (w.config.is_local(l)) {
      EXPECT_TRUE(s.last_step()[static_cast<size_t>(l)].stats.empty()) << "layer " << l;
    } else {
      ASSERT_EQ(s.last_step()[static_cast<size_t>(l)].stats.size(), 4u) << "layer " << l;
      // The 2 query heads of a kv head attend the union of their top-8 lists.
      const int t_att = s.last_step()[static_cast<size_t>(l)].stats[0].tokens_attended;
      EXPECT_GE(t_att, 8) << "layer " << l;
      EXPECT_LE(t_att, 16) << "layer " << l;
    }
  }
  EXPECT_EQ(s.summary().layer_steps, 8 * 2);     // 8 decode steps x 2 global layers
  EXPECT_EQ(s.summary().head_steps, 8 * 2 * 4);  // x 4 query heads
  EXPECT_GE(s.summary().mean_tokens(), 8.0);  // of the 33-40 cached: the global layers' sets alone
  EXPECT_LE(s.summary().mean_tokens(), 16.0);
}

TEST(Gemma3, RealModelConfigAndDeterministicGreedy) {
  if (!fs::exists(gemma3_gguf()))
    CUMULUS_FIXTURE_MISSING(gemma3_gguf() << " missing: run scripts/fetch-model.sh gemma3-270m");
  const GgufFile f = GgufFile::open(gemma3_gguf().string());
  const ModelWeights w = model_weights_from_gguf(f);
  const ModelConfig& c = w.config;
  EXPECT_EQ(c.n_layers, 18);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.sliding_window, 512);
  std::vector<int> global;
  for (int l = 0; l < c.n_layers; ++l)
    if (!c.is_local(l)) global.push_back(l);
  EXPECT_EQ(global, (std::vector<int>{5, 11, 17}));
  const auto tok = tokenizer_from_gguf(f);
  const std::vector<int32_t> prompt = tok->encode("The capital of France is", tok->add_bos_default());
  ASSERT_EQ(prompt.front(), 2);  // <bos>
  auto greedy = [&](int threads) {
    SessionOptions o;
    o.n_threads = threads;
    o.max_tokens = 64;
    Session s(w, o);
    std::vector<float> logits = s.prefill(prompt);
    std::vector<int32_t> out;
    for (int i = 0; i < 12; ++i) {
      const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      out.push_back(next);
      logits = s.decode(next);
    }
    return out;
  };
  const std::vector<int32_t> a = greedy(2);
  const std::string text = tok->decode(a);
  std::printf("  greedy: 'The capital of France is' -> '%s'\n", text.c_str());
  // Plausible English (the exact tokens are llama.cpp's golden's job): mostly letters and
  // spaces, not one token repeated.
  size_t letters = 0;
  for (char ch : text) letters += std::isalpha(static_cast<unsigned char>(ch)) || ch == ' ' ? 1 : 0;
  EXPECT_GE(letters, text.size() * 9 / 10) << text;
  EXPECT_LT(std::count(a.begin(), a.end(), a[0]), 6) << text;
  EXPECT_EQ(greedy(1), a);  // deterministic across runs and thread counts
}

TEST(Gemma3, WindowCacheDecodesAsACacheOfEveryToken) {
  // Window 4 over 40 prompt tokens and 30 decoded, prefill chunks of 7; pages of 2 (pages
  // drop as the window moves) and of 16 (larger than the window).
  const ModelWeights w = small_gemma3();
  const std::vector<int32_t> t = small_tokens(70);
  const std::span<const int32_t> all(t);
  for (int ps : {2, 16}) {
    const auto [win, full] = expect_window_cache_equal(w, all.first(40), all.subspan(40), 7, ps);
    EXPECT_LT(win, full) << "page size " << ps;
  }
}

TEST(Gemma3, RealModelWindowCacheDecodesAsACacheOfEveryToken) {
  // The real model: 700 tokens of Pride and Prejudice (past the 512-token window), 8
  // decoded; the 15 local layers keep their window (and a prefill chunk) instead of 708.
#ifdef CUMULUS_SANITIZED
  GTEST_SKIP() << "three 700-token prefills of the 270M model skipped under the sanitizers (the small model's test covers the same paths)";
#endif
  if (!fs::exists(gemma3_gguf()))
    CUMULUS_FIXTURE_MISSING(gemma3_gguf() << " missing: run scripts/fetch-model.sh gemma3-270m");
  const fs::path book = cumulus::test::shared_dir() / "data/text/pg1342_pride_and_prejudice.txt";
  if (!fs::exists(book)) CUMULUS_FIXTURE_MISSING(book << " missing");
  const GgufFile f = GgufFile::open(gemma3_gguf().string());
  const ModelWeights w = model_weights_from_gguf(f);
  const auto tok = tokenizer_from_gguf(f);
  std::vector<int32_t> ids = tok->encode(text_strip_gutenberg(text_read_file(book.string())).substr(0, 8000), true);
  ASSERT_GE(ids.size(), 708u);
  ids.resize(708);
  const std::span<const int32_t> all(ids);
  const auto [win, full] = expect_window_cache_equal(w, all.first(700), all.subspan(700), 256, 16);
  std::printf("  KV cache after 708 tokens: %.1f MB with the local layers' windows, %.1f MB with every token\n",
              win / 1e6, full / 1e6);
  EXPECT_LT(win, full);
}
