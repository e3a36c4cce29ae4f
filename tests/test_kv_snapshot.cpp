// KV snapshots (kv/kv_snapshot.h, docs/kv_snapshot.md): a session loaded from a snapshot
// decodes bit for bit as the session that prefilled the same prompt, for every decode
// method (their on_prefill rebuilds their indexes from the loaded cache), on stories260K and
// on a small random GGUF; and every bad file (truncated, extended, corrupted, another
// version, another model, another setup, values no writer makes) is an Error naming the
// file, the field and the values, with the session left as it was.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "cumulus/core/file.h"
#include "cumulus/kv/kv_snapshot.h"
#include "cumulus/model/model_identity.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/sampler.h"
#include "cumulus/model/session.h"
#include "fixtures.h"
#include "scratch_dir.h"
#include "test_model_gguf_writer.h"

using namespace cumulus;
namespace fs = std::filesystem;

namespace {

using Params = std::map<std::string, std::string>;

fs::path stories_bin() { return test::stories260k_dir() / "stories260K.bin"; }

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Rewrites the trailing checksum so the file passes it (to reach the checks behind it).
void fix_checksum(std::vector<uint8_t>& b) {
  uint32_t version = 0;
  std::memcpy(&version, b.data() + 8, 4);
  const uint64_t h = kv_snapshot_checksum(b.data(), b.size() - 8, version);
  std::memcpy(b.data() + b.size() - 8, &h, 8);
}

template <class T>
void poke(std::vector<uint8_t>& b, size_t offset, T v) {
  std::memcpy(b.data() + offset, &v, sizeof(T));
}

// Runs fn, which must throw an Error whose message holds every needle.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no error; wanted one naming " << ::testing::PrintToString(needles);
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Greedy decoding of `steps` tokens from `logits`: every step's logits.
std::vector<std::vector<float>> decode_greedy(Session& s, std::vector<float> logits, int steps) {
  Sampler greedy({});
  std::vector<std::vector<float>> out;
  for (int i = 0; i < steps; ++i) {
    logits = s.decode(greedy.sample(logits));
    out.push_back(logits);
  }
  return out;
}

// Two caches hold the same tokens, bits and per-page key statistics.
void expect_same_cache(const KvCache& a, const KvCache& b) {
  ASSERT_EQ(a.shape().n_layers, b.shape().n_layers);
  for (int l = 0; l < a.shape().n_layers; ++l) {
    ASSERT_EQ(a.n_tokens(l), b.n_tokens(l)) << "layer " << l;
    for (int h = 0; h < a.shape().n_kv_heads; ++h) {
      const PagedHeadView va = a.view(l, h), vb = b.view(l, h);
      for (int t = 0; t < va.n_tokens; ++t) {
        ASSERT_EQ(std::memcmp(va.key(t), vb.key(t), va.row_bytes()), 0) << "k layer " << l << " token " << t;
        ASSERT_EQ(std::memcmp(va.value(t), vb.value(t), va.row_bytes()), 0) << "v layer " << l << " token " << t;
      }
      const size_t meta = static_cast<size_t>(va.n_pages()) * va.head_dim * sizeof(float);
      EXPECT_EQ(std::memcmp(va.kmin, vb.kmin, meta), 0) << "kmin layer " << l;
      EXPECT_EQ(std::memcmp(va.kmax, vb.kmax, meta), 0) << "kmax layer " << l;
      EXPECT_EQ(std::memcmp(va.kmean, vb.kmean, meta), 0) << "kmean layer " << l;
    }
  }
}

// A prompt of n token ids drawn from [1, vocab) (stories260K's BOS is 1).
std::vector<int32_t> prompt_ids(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p{1};
  while (static_cast<int>(p.size()) < n) p.push_back(static_cast<int32_t>(1 + rng() % (vocab - 1)));
  return p;
}

class KvSnapshotTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return scratch_.path(name); }

  // For each method: a session that prefilled `prompt` and one that loaded the snapshot a
  // third session saved decode the same greedy tokens with bit-identical logits.
  void expect_round_trip(const ModelWeights& w, uint64_t model_id, const std::vector<int32_t>& prompt,
                         const KvCacheOptions& kv, const std::vector<std::pair<std::string, Params>>& methods,
                         int steps) {
    const std::string file = path("rt.kvsnap");
    SessionOptions base;
    base.kv = kv;
    base.keep_prompt_queries = 32;  // for the restart into lfps below
    {
      SessionOptions so = base;
      so.keep_prompt_queries = kKvSnapshotPromptQueries;
      Session saver(w, so);
      saver.prefill(prompt);
      saver.kv_save(file, model_id);
    }
    const KvSnapshot snap = KvSnapshot::open(file);
    EXPECT_EQ(snap.info().n_tokens, static_cast<int>(prompt.size()));
    EXPECT_EQ(std::vector<int32_t>(snap.tokens().begin(), snap.tokens().end()), prompt);
    for (const auto& [method, params] : methods) {
      SCOPED_TRACE(method);
      SessionOptions so = base;
      so.method = method;
      so.params = params;
      Session fresh(w, so), loaded(w, so);
      const std::vector<float> l0 = fresh.prefill(prompt);
      const std::vector<float> l1 = loaded.kv_load(snap, model_id);
      EXPECT_TRUE(same_bits(l0, l1)) << "prompt logits";
      EXPECT_EQ(loaded.position(), fresh.position());
      EXPECT_EQ(loaded.prompt_length(), fresh.prompt_length());
      EXPECT_EQ(loaded.prompt_tokens(), prompt);
      expect_same_cache(fresh.kv(), loaded.kv());
      const auto a = decode_greedy(fresh, l0, steps);
      const auto b = decode_greedy(loaded, l1, steps);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(same_bits(a[i], b[i])) << "decode step " << i;
      // The cache grew past the prompt: decoding really ran through the method.
      EXPECT_EQ(loaded.kv().n_tokens(0), static_cast<int>(prompt.size()) + steps);
      // restart_decode from the loaded prompt, into a method that learns from its queries.
      fresh.restart_decode("lfps");
      loaded.restart_decode("lfps");
      const auto c = decode_greedy(fresh, l0, 4);
      const auto d = decode_greedy(loaded, l1, 4);
      for (size_t i = 0; i < c.size(); ++i) ASSERT_TRUE(same_bits(c[i], d[i])) << "lfps after restart, step " << i;
    }
  }

  test::ScratchDir scratch_{"cumulus_kvsnap"};
  const fs::path dir_ = scratch_.dir();
};

// Each decode method paired with parameters that make it sparse at ~50-100 tokens.
const std::vector<std::pair<std::string, Params>> kMethods = {
    {"dense", {}},
    {"quest", {{"budget", "16"}, {"dense_layers", "0"}}},
    {"tactic", {{"p", "0.8"}}},
    {"psa", {}},
    {"lfps", {}},
    {"streaming", {{"sinks", "4"}, {"window", "16"}}},
    {"oracle_topp", {{"p", "0.9"}}},
    {"oracle_topk", {{"k", "8"}}},
};

// A small random GGUF llama: dim 64, 2 layers, 4 query heads over 2 kv heads (head_dim 16),
// vocab 48, context 256; token_embd in Q8_0, the rest F32. `name` goes into general.name,
// so two files differ in their metadata only.
std::vector<uint8_t> random_gguf(const std::string& name, uint32_t seed) {
  test::GgufWriter w;
  w.kv_string("general.architecture", "llama");
  w.kv_string("general.name", name);
  w.kv_u32("llama.block_count", 2);
  w.kv_u32("llama.context_length", 256);
  w.kv_u32("llama.embedding_length", 64);
  w.kv_u32("llama.feed_forward_length", 96);
  w.kv_u32("llama.attention.head_count", 4);
  w.kv_u32("llama.attention.head_count_kv", 2);
  w.kv_f32("llama.rope.freq_base", 10000.0f);
  w.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.2f);
  auto f32 = [&](const std::string& t, std::vector<uint64_t> dims, float mean) {
    uint64_t n = 1;
    for (auto d : dims) n *= d;
    std::vector<float> v(n);
    for (auto& x : v) x = mean + nd(rng);
    w.tensor(t, dims, 0, test::GgufWriter::as_bytes(v));
  };
  std::vector<uint8_t> q;  // token_embd [48][64] in Q8_0: per block of 32 an f16 scale and 32 int8
  for (int r = 0; r < 48 * 2; ++r) {
    const uint16_t d = f32_to_f16(0.01f);
    q.push_back(static_cast<uint8_t>(d & 0xFF));
    q.push_back(static_cast<uint8_t>(d >> 8));
    for (int e = 0; e < 32; ++e) q.push_back(static_cast<uint8_t>(static_cast<int8_t>(rng() % 255 - 127)));
  }
  w.tensor("token_embd.weight", {64, 48}, 8, q);
  for (int l = 0; l < 2; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    f32(b + "attn_norm.weight", {64}, 1.0f);
    f32(b + "attn_q.weight", {64, 64}, 0.0f);
    f32(b + "attn_k.weight", {64, 32}, 0.0f);
    f32(b + "attn_v.weight", {64, 32}, 0.0f);
    f32(b + "attn_output.weight", {64, 64}, 0.0f);
    f32(b + "ffn_norm.weight", {64}, 1.0f);
    f32(b + "ffn_gate.weight", {64, 96}, 0.0f);
    f32(b + "ffn_down.weight", {96, 64}, 0.0f);
    f32(b + "ffn_up.weight", {64, 96}, 0.0f);
  }
  f32("output_norm.weight", {64}, 1.0f);
  return w.bytes();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// The cache's raw append, which restore uses.

TEST(KvCacheAppendStored, EqualsAppendOfTheSameValues) {
  const Shape shape{2, 6, 3, 16};
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const KvCacheOptions o{.page_size = 4, .dtype = dt, .max_tokens = 64};
    KvCache a(shape, o), b(shape, o);
    const int n = 23;  // 5 full pages and a partial one
    std::vector<float> k(static_cast<size_t>(n) * 3 * 16), v(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    // The stored form: what append writes for these values.
    std::vector<uint8_t> ks(k.size() * dtype_size(dt)), vs(ks.size());
    convert_from_f32(k.data(), ks.data(), dt, k.size());
    convert_from_f32(v.data(), vs.data(), dt, v.size());
    for (int l = 0; l < 2; ++l) {
      a.append(l, k.data(), v.data(), 9);
      a.append(l, k.data() + 9 * 48, v.data() + 9 * 48, n - 9);
      b.append_stored(l, ks.data(), vs.data(), n);
    }
    expect_same_cache(a, b);
    // The statistics are real: a page's min is below its max somewhere.
    const PagedHeadView view = b.view(1, 2);
    EXPECT_LT(view.kmin[0], view.kmax[0]);
  }
}

TEST(KvCacheAppendStored, NonFiniteIsRejectedBeforeWriting) {
  const Shape shape{1, 2, 2, 8};
  KvCache kv(shape, {.page_size = 4, .dtype = DType::f16, .max_tokens = 16});
  std::vector<uint16_t> k(3 * 2 * 8, f32_to_f16(0.5f)), v = k;
  v[2 * 16 + 8 + 5] = 0x7c00;  // +inf at token 2, head 1, dim 5
  expect_error([&] { kv.append_stored(0, k.data(), v.data(), 3); }, {"v[token=2][head=1][dim=5]", "inf"});
  EXPECT_EQ(kv.n_tokens(0), 0);
  k[0] = 0x7e00;  // NaN
  v[2 * 16 + 8 + 5] = 0;
  expect_error([&] { kv.append_stored(0, k.data(), v.data(), 3); }, {"k[token=0][head=0][dim=0]", "nan"});
  EXPECT_EQ(kv.n_tokens(0), 0);
}

// ---------------------------------------------------------------------------------------
// Round trips.

TEST_F(KvSnapshotTest, Stories260KDecodesBitIdenticallyAfterLoad) {
  if (!fs::exists(stories_bin())) CUMULUS_FIXTURE_MISSING("no " << stories_bin());
  const ModelWeights w = model_weights_load(stories_bin().string());
  const uint64_t id = model_identity(stories_bin().string());
  // 83 tokens: not a multiple of any page size; f16 in pages of 16, bf16 in pages of 4.
  const std::vector<int32_t> prompt = prompt_ids(83, w.config.vocab_size, 1);
  expect_round_trip(w, id, prompt, {.page_size = 16, .dtype = DType::f16}, kMethods, 24);
  expect_round_trip(w, id, prompt, {.page_size = 4, .dtype = DType::bf16},
                    {{"quest", {{"budget", "16"}, {"dense_layers", "0"}}}, {"tactic", {{"p", "0.8"}}}}, 16);
  expect_round_trip(w, id, prompt_ids(40, w.config.vocab_size, 2), {.page_size = 1, .dtype = DType::f32},
                    {{"psa", {}}, {"dense", {}}}, 8);
}

TEST_F(KvSnapshotTest, RandomGgufDecodesBitIdenticallyAfterLoad) {
  const std::string model = path("random.gguf");
  write_bytes(model, random_gguf("a", 11));
  const ModelWeights w = model_weights_load(model);
  ASSERT_EQ(w.token_embd.storage_name(), "Q8_0");
  expect_round_trip(w, model_identity(model), prompt_ids(70, 48, 3), {.page_size = 8, .dtype = DType::f16},
                    {{"dense", {}}, {"quest", {{"budget", "16"}, {"dense_layers", "0"}}}, {"lfps", {}}}, 12);
}

TEST_F(KvSnapshotTest, ModelIdentityTellsFilesApart) {
  const std::string a = path("a.gguf"), b = path("b.gguf"), c = path("c.gguf");
  write_bytes(a, random_gguf("a", 11));
  write_bytes(b, random_gguf("b", 11));  // one metadata byte differs
  write_bytes(c, random_gguf("a", 12));  // same metadata, other weights
  EXPECT_EQ(model_identity(a), model_identity(a));
  EXPECT_NE(model_identity(a), model_identity(b));
  EXPECT_NE(model_identity(a), model_identity(c));
  if (fs::exists(stories_bin())) {
    EXPECT_NE(model_identity(stories_bin().string()), model_identity(a));
  }
  expect_error([&] { model_identity(path("none.gguf")); }, {"none.gguf"});
}

// ---------------------------------------------------------------------------------------
// Bad snapshots and mismatched sessions.

TEST_F(KvSnapshotTest, AnotherModelOrSetupIsRejected) {
  const std::string ma = path("a.gguf"), mb = path("b.gguf");
  write_bytes(ma, random_gguf("a", 11));
  write_bytes(mb, random_gguf("b", 11));
  const ModelWeights wa = model_weights_load(ma);
  const ModelWeights wa_f32 = model_weights_load(ma, WeightStorage::f32);
  const uint64_t ida = model_identity(ma), idb = model_identity(mb);
  const std::string file = path("a.kvsnap");
  const std::vector<int32_t> prompt = prompt_ids(30, 48, 4);
  {
    Session s(wa, {});
    s.prefill(prompt);
    s.kv_save(file, ida);
  }
  const KvSnapshot snap = KvSnapshot::open(file);
  auto untouched = [](const Session& s) {
    EXPECT_EQ(s.position(), 0);
    EXPECT_EQ(s.kv().n_tokens(0), 0);
    EXPECT_TRUE(s.prompt_tokens().empty());
  };
  {
    Session s(wa, {});  // b's identity: another model
    expect_error([&] { s.kv_load(snap, idb); },
                 {file, "model_id=", fmt::format("0x{:016x}", ida), fmt::format("0x{:016x}", idb)});
    untouched(s);
  }
  {
    Session s(wa_f32, {});  // the same file, weights dequantised: another cache
    expect_error([&] { s.kv_load(snap, ida); }, {file, "setup", "weights=F32,Q8_0 prefill=dense", "weights=F32 "});
    untouched(s);
  }
  {
    SessionOptions so;
    so.prefill_method = "flexprefill";
    Session s(wa, so);
    expect_error([&] { s.kv_load(snap, ida); }, {file, "setup", "prefill=flexprefill"});
    untouched(s);
  }
  {
    SessionOptions so;
    so.kv.dtype = DType::bf16;
    Session s(wa, so);
    expect_error([&] { s.kv_load(snap, ida); }, {file, "dtype=f16", "bf16"});
    untouched(s);
  }
  {
    SessionOptions so;
    so.kv.page_size = 4;
    Session s(wa, so);
    expect_error([&] { s.kv_load(snap, ida); }, {file, "page_size=16 but this session has page_size=4"});
    untouched(s);
  }
  {
    SessionOptions so;
    so.max_tokens = 20;
    Session s(wa, so);
    expect_error([&] { s.kv_load(snap, ida); }, {file, "n_tokens=30", "context of 20"});
    untouched(s);
  }
  {
    SessionOptions so;
    so.method = "lfps";  // needs the prompt's last 30 (of 30) queries; the snapshot kept none
    Session s(wa, so);
    expect_error([&] { s.kv_load(snap, ida); }, {file, "prompt_q_rows=0", "lfps", "needs the prompt's last 30"});
    untouched(s);
    // The session is still good for a prefill, and gives what a fresh one gives.
    Session fresh(wa, so);
    EXPECT_TRUE(same_bits(s.prefill(prompt), fresh.prefill(prompt)));
  }
  {
    Session s(wa, {});
    s.prefill(prompt);
    expect_error([&] { s.kv_load(snap, ida); }, {file, "position 30", "fresh session"});
    Session t(wa, {});
    expect_error([&] { t.kv_save(path("x.kvsnap"), ida); }, {"before a prefill"});
    EXPECT_FALSE(fs::exists(path("x.kvsnap")));
  }
}

TEST_F(KvSnapshotTest, BadFilesNameTheFieldAndValues) {
  if (!fs::exists(stories_bin())) CUMULUS_FIXTURE_MISSING("no " << stories_bin());
  const ModelWeights w = model_weights_load(stories_bin().string());
  const uint64_t id = model_identity(stories_bin().string());
  const std::string good = path("good.kvsnap");
  const std::vector<int32_t> prompt = prompt_ids(21, w.config.vocab_size, 5);
  {
    SessionOptions so;
    so.keep_prompt_queries = 8;
    Session s(w, so);
    s.prefill(prompt);
    s.kv_save(good, id);
  }
  const std::vector<uint8_t> bytes = read_bytes(good);
  const size_t n = bytes.size();
  ASSERT_GT(n, 1000u);
  KvSnapshot::open(good);  // the good file opens

  // The session every bad file is offered to: it must stay untouched throughout.
  Session target(w, {});
  const std::string bad = path("bad.kvsnap");
  auto check = [&](const std::vector<uint8_t>& b, const std::vector<std::string>& needles) {
    write_bytes(bad, b);
    std::vector<std::string> all = needles;
    all.push_back(bad);
    expect_error([&] { target.kv_load(KvSnapshot::open(bad), id); }, all);
    EXPECT_EQ(target.position(), 0);
    EXPECT_EQ(target.kv().n_tokens(0), 0);
  };

  // Truncated, anywhere.
  for (size_t cut : {size_t{0}, size_t{7}, size_t{135}}) {
    SCOPED_TRACE(cut);
    check(std::vector<uint8_t>(bytes.begin(), bytes.begin() + cut), {fmt::format("{} bytes is less than", cut)});
  }
  check(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 136),
        {"the file has 136 bytes", "before the layers' first tokens end", "truncated"});
  for (size_t cut : {size_t{300}, n / 2, n - 1}) {
    SCOPED_TRACE(cut);
    check(std::vector<uint8_t>(bytes.begin(), bytes.begin() + cut),
          {fmt::format("the file has {} bytes", cut), fmt::format("implies {} bytes", n), "truncated", "n_tokens=21"});
  }
  // Extended.
  {
    std::vector<uint8_t> b = bytes;
    b.push_back(0);
    check(b, {fmt::format("the file has {} bytes", n + 1), "extra bytes"});
  }
  // Corrupted: one bit of the last value, one of the header's shape.
  {
    std::vector<uint8_t> b = bytes;
    b[n - 9] ^= 0x10;
    check(b, {"checksum mismatch", "corrupted"});
    b = bytes;
    b[24] ^= 0x01;  // n_layers 5 -> 4: the size no longer fits
    check(b, {"n_layers=4", "implies"});
  }
  // Magic and version, checked before the checksum.
  {
    std::vector<uint8_t> b = bytes;
    b[0] = 'X';
    check(b, {"magic is 0x58", "not a cumulus KV snapshot"});
    b = bytes;
    poke<uint32_t>(b, 8, 4);
    check(b, {"version=4 is not supported", "versions 1 to 3"});
    fix_checksum(b);
    check(b, {"version=4 is not supported"});
    b = bytes;
    poke<uint32_t>(b, 8, 0);
    check(b, {"version=0 is not supported"});
  }
  // Fields out of range, and sizes claimed far beyond the file: refused before allocating.
  {
    std::vector<uint8_t> b = bytes;
    poke<uint32_t>(b, 12, 7);
    check(b, {"dtype=7"});
    b = bytes;
    poke<uint32_t>(b, 48, 0xffffffffu);
    check(b, {"byte 48", "4294967295"});
    b = bytes;
    poke<uint32_t>(b, 48, 1u << 24);  // n_tokens 16M: gigabytes the file does not have
    fix_checksum(b);
    check(b, {"n_tokens=16777216", "implies"});
    b = bytes;
    poke<uint32_t>(b, 36, 12);  // head_dim 12
    check(b, {"head_dim=12"});
    b = bytes;
    poke<uint32_t>(b, 44, 3);
    check(b, {"page_size=3"});
    b = bytes;
    poke<uint32_t>(b, 52, 22);  // prompt_q_rows > n_tokens
    check(b, {"prompt_q_rows=22"});
    b = bytes;
    b[100] = 1;
    fix_checksum(b);
    check(b, {"reserved header byte 100"});
  }
  // Values no writer makes, behind a valid checksum.
  uint32_t setup_bytes = 0;
  std::memcpy(&setup_bytes, bytes.data() + 56, 4);
  const size_t first_at = (128 + setup_bytes + 63) / 64 * 64;  // versions 2, 3: u32 per layer
  const size_t tokens_at = (first_at + 4 * 5 + 63) / 64 * 64;   // stories260K: 5 layers
  {
    std::vector<uint8_t> b = bytes;
    poke<uint32_t>(b, first_at + 4 * 2, 22);  // layer 2 from token 22 of 21
    fix_checksum(b);
    check(b, {"first_token[2]=22 must be in [0, n_tokens=21]"});
    b = bytes;
    poke<uint32_t>(b, first_at + 4 * 2, 5);  // layer 2 from token 5: 5 rows fewer than the file has
    fix_checksum(b);
    check(b, {"implies", "extra bytes"});
    b = bytes;
    b[first_at + 4 * 5] = 1;  // padding after the first tokens
    fix_checksum(b);
    check(b, {fmt::format("padding byte {} is 0x01", first_at + 20)});
  }
  {
    std::vector<uint8_t> b = bytes;
    poke<int32_t>(b, tokens_at + 4 * 3, 512);
    fix_checksum(b);
    check(b, {"token 3 is 512", "[0, 512)"});
    b = bytes;
    poke<uint16_t>(b, n - 10, 0x7c00);  // the last V value: +inf in f16
    fix_checksum(b);
    check(b, {"v[layer=4][token=20][head=3][dim=7]", "inf", "not finite"});
    b = bytes;
    b[128] = 0x07;  // a control character in the setup text
    fix_checksum(b);
    check(b, {"setup byte 0 is 0x07"});
  }
  // Not a file.
  expect_error([&] { KvSnapshot::open(dir_.string()); }, {dir_.string(), "directory"});
  expect_error([&] { KvSnapshot::open(path("missing.kvsnap")); }, {"missing.kvsnap"});

  // The file is version 3, whose checksum is XXH3-64: the FNV-1a of versions 1 and 2 over
  // the same bytes is refused, and a version 2 file (the same bytes, FNV-1a) loads and gives
  // what the version 3 file gives.
  {
    uint32_t version = 0;
    std::memcpy(&version, bytes.data() + 8, 4);
    EXPECT_EQ(version, 3u);
    std::vector<uint8_t> b = bytes;
    const uint64_t fnv = fnv1a64(b.data(), b.size() - 8);
    std::memcpy(b.data() + b.size() - 8, &fnv, 8);
    check(b, {"checksum mismatch"});
    poke<uint32_t>(b, 8, 2);
    const uint64_t fnv2 = fnv1a64(b.data(), b.size() - 8);  // the header changed: FNV again
    std::memcpy(b.data() + b.size() - 8, &fnv2, 8);
    write_bytes(path("v2.kvsnap"), b);
    Session s1(w, {}), s2(w, {});
    const std::vector<float> l1 = s1.kv_load(KvSnapshot::open(path("v2.kvsnap")), id);
    const std::vector<float> l2 = s2.kv_load(KvSnapshot::open(good), id);
    EXPECT_TRUE(same_bits(l1, l2));
    expect_same_cache(s1.kv(), s2.kv());
    const auto a1 = decode_greedy(s1, l1, 6), a2 = decode_greedy(s2, l2, 6);
    for (size_t i = 0; i < a1.size(); ++i) EXPECT_TRUE(same_bits(a1[i], a2[i])) << "version 2, step " << i;
  }
  // A version 1 file (the same without the first tokens: every layer from token 0, FNV-1a)
  // loads and gives what the version 3 file gives.
  {
    std::vector<uint8_t> v1(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(first_at));
    v1.insert(v1.end(), bytes.begin() + static_cast<std::ptrdiff_t>(tokens_at), bytes.end());
    poke<uint32_t>(v1, 8, 1);
    fix_checksum(v1);
    write_bytes(path("v1.kvsnap"), v1);
    Session s1(w, {}), s2(w, {});
    const std::vector<float> l1 = s1.kv_load(KvSnapshot::open(path("v1.kvsnap")), id);
    const std::vector<float> l2 = s2.kv_load(KvSnapshot::open(good), id);
    EXPECT_TRUE(same_bits(l1, l2));
    expect_same_cache(s1.kv(), s2.kv());
    const auto a1 = decode_greedy(s1, l1, 6), a2 = decode_greedy(s2, l2, 6);
    for (size_t i = 0; i < a1.size(); ++i) EXPECT_TRUE(same_bits(a1[i], a2[i])) << "version 1, step " << i;
  }

  // After all that, the session loads the good file and decodes like a prefilled one.
  const std::vector<float> l1 = target.kv_load(KvSnapshot::open(good), id);
  Session fresh(w, {});
  const std::vector<float> l0 = fresh.prefill(prompt);
  EXPECT_TRUE(same_bits(l0, l1));
  const auto a = decode_greedy(fresh, l0, 6), c = decode_greedy(target, l1, 6);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(a[i], c[i])) << i;
}

TEST_F(KvSnapshotTest, FailedWriteKeepsThePreviousFile) {
  const std::string file = path("keep.bin");
  file_write_atomic(file, "good", "test");
  expect_error(
      [&] {
        file_write_atomic_stream(file, "test", [](const FileAppend& append) {
          append("partial");
          CUMULUS_FAIL("stopped half way");
        });
      },
      {"stopped half way"});
  const std::vector<uint8_t> b = read_bytes(file);
  EXPECT_EQ(std::string(b.begin(), b.end()), "good");
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++files;
  EXPECT_EQ(files, 1) << "a temporary file was left behind";
}

// ---------------------------------------------------------------------------------------
// The command line: one prefill, then runs from the snapshot.

namespace {

struct CliRun {
  int code = -1;
  std::string out;  // stdout only
  std::string all;  // stdout and stderr
};

CliRun cli(const std::string& args, const std::string& err_file) {
  const std::string cmd = "timeout 120 " + std::string(CUMULUS_CLI_PATH) + " " + args + " 2>" + err_file;
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t k = 0;
  while ((k = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), k);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  const std::vector<uint8_t> e = read_bytes(err_file);
  r.all = r.out + std::string(e.begin(), e.end());
  return r;
}

// Every gap between sections must be zero (docs/kv_snapshot.md), those after the tokens
// too; and the file is read, not mapped: replacing it after open() changes nothing.
TEST_F(KvSnapshotTest, PaddingAfterTheTokensIsCheckedAndTheFileIsCopied) {
  if (!fs::exists(stories_bin())) CUMULUS_FIXTURE_MISSING("no " << stories_bin());
  const ModelWeights w = model_weights_load(stories_bin().string());
  const uint64_t id = model_identity(stories_bin().string());
  const std::string good = path("good.kvsnap");
  const std::vector<int32_t> prompt = prompt_ids(21, w.config.vocab_size, 5);
  {
    Session s(w, {});
    s.prefill(prompt);
    s.kv_save(good, id);
  }
  const std::vector<uint8_t> bytes = read_bytes(good);
  // The layout from the format's description: header 128 bytes, setup text, `first`
  // (n_layers u32), tokens (n_tokens i32), logits (vocab f32); each section at a multiple of 64.
  auto align = [](size_t x) { return (x + 63) / 64 * 64; };
  uint32_t n_layers = 0, vocab = 0, n_tokens = 0, setup = 0;
  std::memcpy(&n_layers, bytes.data() + 24, 4);
  std::memcpy(&vocab, bytes.data() + 40, 4);
  std::memcpy(&n_tokens, bytes.data() + 48, 4);
  std::memcpy(&setup, bytes.data() + 56, 4);
  ASSERT_EQ(n_tokens, 21u);
  const size_t tokens = align(align(128 + setup) + 4 * n_layers);
  const size_t tokens_end = tokens + 4 * n_tokens, logits = align(tokens_end);
  const size_t logits_end = logits + 4 * vocab, prompt_q = align(logits_end);
  for (size_t at : {tokens_end, logits - 1, logits_end, prompt_q - 1}) {
    if (at >= prompt_q || (at >= logits && at < logits_end)) continue;  // no gap there
    SCOPED_TRACE(at);
    std::vector<uint8_t> b = bytes;
    b[at] = 0x5a;
    fix_checksum(b);
    write_bytes(path("bad.kvsnap"), b);
    expect_error([&] { KvSnapshot::open(path("bad.kvsnap")); },
                 {fmt::format("padding byte {} is 0x5a, must be 0", at)});
  }
  // Opened, then truncated and rewritten under it (`cp` over the file): the snapshot keeps
  // what it read (a mapping would die of SIGBUS here).
  const KvSnapshot snap = KvSnapshot::open(good);
  const std::vector<int32_t> before(snap.tokens().begin(), snap.tokens().end());
  write_bytes(good, std::vector<uint8_t>(100, 0));
  Session s(w, {});
  s.kv_load(snap, id);
  EXPECT_EQ(before, prompt);
  EXPECT_EQ(s.position(), 21);
}

}  // namespace

TEST_F(KvSnapshotTest, CliGenerateAndEvalFromASnapshot) {
  const std::string text = (test::shared_dir() / "data/text/tinyshakespeare_input.txt").string();
  if (!fs::exists(stories_bin()) || !fs::exists(text)) CUMULUS_FIXTURE_MISSING("no stories260K or text");
  const std::string model = stories_bin().string(), snap = path("g.kvsnap"), err = path("err.txt");
  const std::string gen = "generate --model " + model + " --max-tokens 40 --method dense,quest,lfps ";
  const CliRun a = cli(gen + "--prompt 'Once upon a time there was a dog' --kv-save " + snap, err);
  ASSERT_EQ(a.code, 0) << a.all;
  EXPECT_NE(a.all.find("kv-save: "), std::string::npos) << a.all;
  const CliRun b = cli(gen + "--kv-load " + snap, err);
  ASSERT_EQ(b.code, 0) << b.all;
  EXPECT_NE(b.all.find("kv-load: "), std::string::npos) << b.all;
  // The generated text of every method (the lines before the summary table) is the same.
  auto texts = [](const std::string& out) { return out.substr(0, out.find("\nmethod ")); };
  EXPECT_GT(texts(a.out).size(), 100u) << a.out;
  EXPECT_EQ(texts(a.out), texts(b.out));

  // eval kl: the per-step KL and NLL of every method from the snapshot equal the prefilled run's.
  const std::string ev = "eval kl --model " + model + " --text " + text +
                         " --context 300 --steps 8 --method quest,lfps,tactic --param quest.budget=32 "
                         "--param quest.dense_layers=0 --json ";
  const std::string esnap = path("e.kvsnap");
  const CliRun c = cli(ev + path("c.json") + " --kv-save " + esnap, err);
  ASSERT_EQ(c.code, 0) << c.all;
  const CliRun d = cli(ev + path("d.json") + " --kv-load " + esnap, err);
  ASSERT_EQ(d.code, 0) << d.all;
  const auto jc = nlohmann::json::parse(read_bytes(path("c.json")));
  const auto jd = nlohmann::json::parse(read_bytes(path("d.json")));
  const auto& rc = jc["continuation"]["runs"];
  const auto& rd = jd["continuation"]["runs"];
  ASSERT_EQ(rc.size(), 4u);
  ASSERT_EQ(rd.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(rc[i]["kl"]["per_step"], rd[i]["kl"]["per_step"]) << i;
    EXPECT_EQ(rc[i]["nll_per_step"], rd[i]["nll_per_step"]) << i;
  }
  EXPECT_GT(rc[1]["kl"]["mean"].get<double>(), 0.0);  // quest differs from dense: the KL is real
  EXPECT_EQ(jd["options"]["kv_load"], esnap);

  // Bad use, each rejected before any model loads.
  auto rejected = [&](const std::string& args, const std::string& needle) {
    const CliRun r = cli(args, err);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.code, 124) << args;
    EXPECT_NE(r.all.find(needle), std::string::npos) << args << "\nwanted '" << needle << "' in:\n" << r.all;
  };
  rejected(gen + "--kv-load " + snap + " --prompt hi", "--kv-load '" + snap + "' gives the prompt");
  rejected(gen + "--kv-load " + snap + " --kv-save " + path("x"), "give --kv-save or --kv-load, not both");
  rejected(gen + "--kv-load " + snap + " --bench", "not for --bench");
  rejected(gen + "--kv-load " + snap + " --page-size 8", "page_size=16 but this session has page_size=8");
  rejected(gen + "--kv-load " + text, "not a cumulus KV snapshot");
  rejected(gen + "--prompt hi --kv-save /nonexistent/x.kvsnap", "--kv-save '/nonexistent/x.kvsnap'");
  rejected(ev + path("e.json") + " --kv-load " + snap, "needs 292");
  rejected("eval niah --model " + model + " --text " + text + " --lengths 256 --kv-save " + path("n"),
           "niah prefills one prompt per cell");
  rejected(ev + path("f.json") + " --prefill flexprefill --kv-save " + path("f"), "use the dense prefill");
}
