// Tokenizers against references nobody here wrote:
//   - SmolLM2 byte-level BPE vs Hugging Face `tokenizers` on 38 texts
//     (tests/data/smollm2_tokens.json, from tools/reference/make_tokenizer_fixture.py),
//     with the vocabulary from tokenizer.json and, when models/ has it, from the GGUF;
//   - llama2.c tok512 (stories260K): round trips and byte fallback; the same vocabulary
//     written as a GGUF `llama` tokenizer gives the same ids;
//   - byte-level BPE against the merge rule written plainly (PlainBpe), on varied text;
//     long runs of one character in under a second; encode_prefix against encode.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <time.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "cumulus/core/error.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/tokenizer.h"
#include "model/tokenizer_impl.h"
#include "test_model_gguf_writer.h"
#include "fixtures.h"

using namespace cumulus;
namespace fs = std::filesystem;

namespace {

fs::path repo_root() { return cumulus::test::source_dir(); }
fs::path shared_dir() { return fs::path(CUMULUS_SHARED_DIR); }
fs::path smollm2_json() { return shared_dir() / "data/models/smollm2-135m-instruct-meta/tokenizer.json"; }
fs::path smollm2_gguf() { return repo_root() / "models/SmolLM2-135M-Instruct.Q4_1.gguf"; }
fs::path tok512() { return shared_dir() / "data/models/stories260K/tok512.bin"; }

struct FixtureCase {
  std::string text;
  std::vector<int32_t> ids;
};

std::vector<FixtureCase> load_fixture() {
  std::ifstream in(repo_root() / "tests/data/smollm2_tokens.json");
  EXPECT_TRUE(in.good());
  const nlohmann::json j = nlohmann::json::parse(in);
  std::vector<FixtureCase> cases;
  for (const auto& c : j.at("cases")) cases.push_back({c.at("text").get<std::string>(), c.at("ids").get<std::vector<int32_t>>()});
  return cases;
}

void check_fixture(const Tokenizer& tok) {
  const std::vector<FixtureCase> cases = load_fixture();
  ASSERT_GE(cases.size(), 30u);
  size_t n_tokens = 0;
  for (const auto& c : cases) {
    const std::vector<int32_t> got = tok.encode(c.text, /*add_bos=*/false);
    EXPECT_EQ(got, c.ids) << "text: '" << c.text << "'";
    // Byte-level BPE is lossless: decoding gives the text back byte for byte.
    EXPECT_EQ(tok.decode(got), c.text);
    n_tokens += c.ids.size();
  }
  EXPECT_GT(n_tokens, 1000u);  // the fixture holds the long Gutenberg passages
}

std::vector<std::string> split(std::string_view text, BpePreTokenizer pre) {
  std::vector<std::string> out;
  for (auto s : bpe_pre_tokenize(text, pre)) out.emplace_back(s);
  return out;
}

}  // namespace

TEST(Tokenizer, Gpt2PreTokenizerSplits) {
  using V = std::vector<std::string>;
  EXPECT_EQ(split("Hello world", BpePreTokenizer::gpt2), (V{"Hello", " world"}));
  EXPECT_EQ(split("a   b", BpePreTokenizer::gpt2), (V{"a", "  ", " b"}));
  EXPECT_EQ(split("a \n\nb", BpePreTokenizer::gpt2), (V{"a", " \n", "\n", "b"}));
  EXPECT_EQ(split("end  ", BpePreTokenizer::gpt2), (V{"end", "  "}));
  EXPECT_EQ(split("it's I'LL", BpePreTokenizer::gpt2), (V{"it", "'s", " I", "'", "LL"}));
  EXPECT_EQ(split("x=12+ab", BpePreTokenizer::gpt2), (V{"x", "=", "12", "+", "ab"}));
  EXPECT_EQ(split("x=12+ab", BpePreTokenizer::smollm), (V{"x", "=", "1", "2", "+", "ab"}));
  EXPECT_EQ(split("a 12", BpePreTokenizer::smollm), (V{"a", " ", "1", "2"}));
  // Every \p{N} code point is isolated, not only ASCII digits: U+00BD, U+00B2, U+0663.
  EXPECT_EQ(split("x \xC2\xBD\xC2\xB2\xD9\xA3y", BpePreTokenizer::smollm),
            (V{"x", " ", "\xC2\xBD", "\xC2\xB2", "\xD9\xA3", "y"}));
  EXPECT_EQ(split("\xC3\xA9t\xC3\xA9 !!", BpePreTokenizer::gpt2), (V{"\xC3\xA9t\xC3\xA9", " !!"}));
  // Bytes that are not UTF-8 are "other" characters, never dropped.
  EXPECT_EQ(split("a\xFF\xFE b", BpePreTokenizer::gpt2), (V{"a", "\xFF\xFE", " b"}));
  EXPECT_TRUE(split("", BpePreTokenizer::smollm).empty());
}

TEST(Tokenizer, SmolLM2MatchesHuggingFaceFromTokenizerJson) {
  if (!fs::exists(smollm2_json())) CUMULUS_FIXTURE_MISSING(smollm2_json() << " missing (../shared not present)");
  const auto tok = tokenizer_from_hf_json(smollm2_json().string(), 1, 2);
  EXPECT_EQ(tok->kind(), TokenizerKind::gpt2_bpe);
  EXPECT_EQ(tok->vocab_size(), 49152u);
  check_fixture(*tok);
}

TEST(Tokenizer, SmolLM2MatchesHuggingFaceFromGguf) {
  if (!fs::exists(smollm2_gguf())) CUMULUS_FIXTURE_MISSING(smollm2_gguf() << " missing: run scripts/fetch-model.sh");
  const GgufFile f = GgufFile::open(smollm2_gguf().string());
  const auto tok = tokenizer_from_gguf(f);
  EXPECT_EQ(tok->kind(), TokenizerKind::gpt2_bpe);
  EXPECT_EQ(tok->vocab_size(), 49152u);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_FALSE(tok->add_bos_default());
  EXPECT_EQ(tok->token_text(2), "<|im_end|>");
  EXPECT_EQ(tok->token_type(2), TokenType::control);
  check_fixture(*tok);
  const std::vector<int32_t> with_bos = tok->encode("Hi", true);
  ASSERT_FALSE(with_bos.empty());
  EXPECT_EQ(with_bos[0], 1);
}

TEST(Tokenizer, Llama2cTok512RoundTrips) {
  if (!fs::exists(tok512())) CUMULUS_FIXTURE_MISSING(tok512() << " missing (../shared not present)");
  const auto tok = tokenizer_from_llama2c(tok512().string(), 512);
  EXPECT_EQ(tok->kind(), TokenizerKind::llama2c);
  EXPECT_EQ(tok->vocab_size(), 512u);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->encode("", true), std::vector<int32_t>{1});
  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily.",
      "She liked to play outside in the sun. One day, she saw a big, red ball!",
      "  two leading spaces and\nnewlines\n\nhere",
      "Unicode falls back to bytes: caf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80",
      "Numbers 1234567 and symbols #$%^&*()",
      "a",
  };
  for (const auto& t : texts) {
    const std::vector<int32_t> ids = tok->encode(t, true);
    ASSERT_GE(ids.size(), 2u);
    EXPECT_EQ(ids[0], 1);
    for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 512);
    EXPECT_EQ(tok->decode(ids), t) << "ids: " << ::testing::PrintToString(ids);
    // Merges happen: fewer tokens than bytes for plain English.
    if (t[0] == 'O') {
      EXPECT_LT(ids.size(), t.size() / 2);
    }
  }
  // Byte fallback: U+00FC is not in the 512-piece vocabulary (U+00E9 is), so it becomes
  // <0xC3> <0xBC> (byte b is id 3 + b).
  const std::vector<int32_t> e = tok->encode("\xC3\xBC", false);
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(tok->token_text(e[0]), " ");
  EXPECT_EQ(e[1], 3 + 0xC3);
  EXPECT_EQ(e[2], 3 + 0xBC);
  EXPECT_EQ(tok->encode("\xC3\xA9", false).size(), 2u);
  EXPECT_EQ(tok->decode_piece(3 + 0x41), "A");
  EXPECT_EQ(tok->decode_piece(1), "");
  EXPECT_THROW(tok->decode_piece(512), Error);
  EXPECT_THROW(tok->decode_piece(-1), Error);
}

TEST(Tokenizer, Llama2cTokenizerFileErrors) {
  if (!fs::exists(tok512())) CUMULUS_FIXTURE_MISSING(tok512() << " missing (../shared not present)");
  EXPECT_THROW(tokenizer_from_llama2c(tok512().string(), 511), Error);  // bytes left over
  EXPECT_THROW(tokenizer_from_llama2c(tok512().string(), 513), Error);  // truncated
  EXPECT_THROW(tokenizer_from_llama2c("/nonexistent/tok.bin", 512), Error);
}

// The tok512 vocabulary written as a GGUF `llama` tokenizer (spaces as U+2581, token types)
// must encode exactly like the llama2.c loader.
TEST(Tokenizer, GgufLlamaSentencepieceMatchesLlama2c) {
  if (!fs::exists(tok512())) CUMULUS_FIXTURE_MISSING(tok512() << " missing (../shared not present)");
  const auto ref = tokenizer_from_llama2c(tok512().string(), 512);
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  std::ifstream in(tok512(), std::ios::binary);
  int32_t max_len = 0;
  in.read(reinterpret_cast<char*>(&max_len), 4);
  for (int i = 0; i < 512; ++i) {
    float s;
    int32_t len;
    in.read(reinterpret_cast<char*>(&s), 4);
    in.read(reinterpret_cast<char*>(&len), 4);
    std::string t(static_cast<size_t>(len), '\0');
    in.read(t.data(), len);
    std::string spm;
    for (char c : t) spm += c == ' ' ? std::string("\xE2\x96\x81") : std::string(1, c);
    tokens.push_back(i == 0 ? "<unk>" : i == 1 ? "<s>" : i == 2 ? "</s>" : spm);
    scores.push_back(s);
    types.push_back(i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1);
  }
  cumulus::test::GgufWriter w;
  w.kv_string("tokenizer.ggml.model", "llama");
  w.kv_string_array("tokenizer.ggml.tokens", tokens);
  w.kv_array<float>("tokenizer.ggml.scores", cumulus::test::GgufWriter::F32, scores);
  w.kv_array<int32_t>("tokenizer.ggml.token_type", cumulus::test::GgufWriter::I32, types);
  w.kv_u32("tokenizer.ggml.bos_token_id", 1);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  const GgufFile f = GgufFile::from_bytes("tok512.gguf", w.bytes());
  const auto tok = tokenizer_from_gguf(f);
  EXPECT_EQ(tok->kind(), TokenizerKind::sentencepiece);
  EXPECT_TRUE(tok->add_bos_default());
  for (const std::string t : {"Once upon a time, there was a little girl named Lily.", "  spaces  and\ttabs",
                              "caf\xC3\xA9 \xF0\x9F\x98\x80!", "The end."}) {
    const auto ids = tok->encode(t, true);
    EXPECT_EQ(ids, ref->encode(t, true)) << t;
    EXPECT_EQ(tok->decode(ids), t);
  }
}

// A five-piece vocabulary where the merge order is worked out by hand: pieces merge by
// highest score, so "abc" -> "▁abc" -> [▁ a b c] -> "ab" (-0.5) first -> [▁ ab c] ->
// "▁ab" (-0.1) -> [▁ab c]; "bc" (-2) never gets its turn.
TEST(Tokenizer, SentencepieceMergesByScore) {
  SpmVocab v;
  v.tokens = {"<unk>", "<s>", "</s>", "\xE2\x96\x81", "a", "b", "c", "ab", "\xE2\x96\x81" "a", "bc", "\xE2\x96\x81" "ab"};
  v.scores = {0, 0, 0, -5, -5, -5, -5, -0.5f, -1, -2, -0.1f};
  v.types = {TokenType::unknown, TokenType::control, TokenType::control, TokenType::normal, TokenType::normal,
             TokenType::normal, TokenType::normal, TokenType::normal, TokenType::normal, TokenType::normal,
             TokenType::normal};
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  v.space_symbol = "\xE2\x96\x81";
  SpmTokenizer tok(TokenizerKind::sentencepiece, "hand", v);
  EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{10, 6}));
  EXPECT_EQ(tok.encode("bc", true), (std::vector<int32_t>{1, 3, 9}));
  // 'z' is not a piece and there are no byte tokens: <unk>.
  EXPECT_EQ(tok.encode("z", false), (std::vector<int32_t>{3, 0}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{1, 10, 6}), "abc");
}

TEST(Tokenizer, GgufTokenizerErrorsNameTheFile) {
  cumulus::test::GgufWriter w;
  w.kv_string("tokenizer.ggml.model", "wordpiece");
  w.kv_string_array("tokenizer.ggml.tokens", {"a", "b"});
  const GgufFile f = GgufFile::from_bytes("odd.gguf", w.bytes());
  try {
    tokenizer_from_gguf(f);
    ADD_FAILURE() << "accepted an unknown tokenizer model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("odd.gguf"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("wordpiece"), std::string::npos) << e.what();
  }
  cumulus::test::GgufWriter w2;
  w2.kv_string("tokenizer.ggml.model", "gpt2");
  w2.kv_string_array("tokenizer.ggml.tokens", {"a", "b"});
  w2.kv_string_array("tokenizer.ggml.merges", {"a c"});
  EXPECT_THROW(tokenizer_from_gguf(GgufFile::from_bytes("m.gguf", w2.bytes())), Error);
  cumulus::test::GgufWriter w3;
  w3.kv_string("tokenizer.ggml.model", "gpt2");
  w3.kv_string_array("tokenizer.ggml.tokens", {"a", "b"});
  w3.kv_string_array("tokenizer.ggml.merges", {});
  w3.kv_u32("tokenizer.ggml.bos_token_id", 5);
  EXPECT_THROW(tokenizer_from_gguf(GgufFile::from_bytes("b.gguf", w3.bytes())), Error);
}

namespace {

// The byte-level BPE rule written plainly, as the reference for the tokenizer's priority
// queue: each word's bytes become GPT-2's byte-map code points, one symbol each; the adjacent
// pair with the lowest merge rank merges, leftmost first, until no pair has a merge. O(n^2)
// in a word's length, on strings.
struct PlainBpe {
  std::map<std::string, int32_t> ids;
  std::map<std::pair<std::string, std::string>, size_t> ranks;
  std::array<std::string, 256> byte_symbol;
  BpePreTokenizer pre = BpePreTokenizer::smollm;

  explicit PlainBpe(const nlohmann::json& tokenizer_json) {
    for (auto it = tokenizer_json.at("model").at("vocab").begin(); it != tokenizer_json.at("model").at("vocab").end();
         ++it)
      ids.emplace(it.key(), it.value().get<int32_t>());
    size_t rank = 0;
    for (const auto& m : tokenizer_json.at("model").at("merges")) {
      std::pair<std::string, std::string> p;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        p = {s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)};
      } else {
        p = {m.at(0).get<std::string>(), m.at(1).get<std::string>()};
      }
      ranks.emplace(p, rank++);
    }
    // GPT-2's byte map: printable Latin-1 bytes are themselves, the rest 256, 257, ...
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? b : next++;
      std::string& s = byte_symbol[b];
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
    }
  }

  std::vector<int32_t> encode(std::string_view text) const {
    std::vector<int32_t> out;
    for (std::string_view word : bpe_pre_tokenize(text, pre)) {
      std::vector<std::string> sym;
      for (char c : word) sym.push_back(byte_symbol[static_cast<uint8_t>(c)]);
      for (;;) {
        size_t best = sym.size(), best_rank = SIZE_MAX;
        for (size_t i = 0; i + 1 < sym.size(); ++i) {
          const auto it = ranks.find({sym[i], sym[i + 1]});
          if (it != ranks.end() && it->second < best_rank) best_rank = it->second, best = i;
        }
        if (best == sym.size()) break;
        sym[best] += sym[best + 1];
        sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      }
      for (const auto& s : sym) out.push_back(ids.at(s));
    }
    return out;
  }
};

// Varied text: runs of one character (the longest merge chains), random strings over a small
// alphabet of letters, spaces, digits, punctuation, accents and cut UTF-8 sequences, and a
// passage of prose.
std::vector<std::string> varied_texts() {
  std::vector<std::string> texts;
  for (const char* unit : {"a", " ", "\n", "e\xCC\x81", "ab", "1", "!?", "\xE4\xB8"})
    for (int n : {1, 2, 3, 7, 16, 33, 100, 257, 1000}) {
      std::string t;
      for (int i = 0; i < n; ++i) t += unit;
      texts.push_back(t);
    }
  std::mt19937 rng(7);
  const std::vector<std::string> alphabet = {"a", "b", "aa", " ", "  ", "\n", "the", "'s", "!", "\xC3\xA9", "7", "\t",
                                             "\xE4\xB8\xAD", "\xE4", "ll", "ing", ".", ","};
  for (int k = 0; k < 200; ++k) {
    std::string t;
    const int n = 1 + static_cast<int>(rng() % 120);
    for (int i = 0; i < n; ++i) t += alphabet[rng() % alphabet.size()];
    texts.push_back(t);
  }
  std::ifstream in(shared_dir() / "data/text/tinyshakespeare_input.txt");
  std::string prose(20000, '\0');
  in.read(prose.data(), static_cast<std::streamsize>(prose.size()));
  prose.resize(static_cast<size_t>(in.gcount()));
  if (!prose.empty()) texts.push_back(prose);
  return texts;
}

// This thread's CPU time: what the work costs, whatever else the machine runs.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

// A hand-worked vocabulary: ties in rank merge leftmost first ("aaa" -> [aa, a]), and a
// lower-ranked pair wins over an earlier one ("aab": "a b" ranks before "a a" -> [a, ab]).
TEST(Tokenizer, BpeMergesLowestRankLeftmostFirst) {
  auto make = [](std::vector<std::pair<std::string, std::string>> merges) {
    BpeVocab v;
    v.tokens = {"a", "b", "aa", "ab", "aaaa"};
    v.types.assign(v.tokens.size(), TokenType::normal);
    v.merges = std::move(merges);
    return BpeTokenizer("hand", std::move(v));
  };
  const BpeTokenizer aa_first = make({{"a", "a"}, {"a", "b"}, {"aa", "aa"}});
  EXPECT_EQ(aa_first.encode("aaa", false), (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(aa_first.encode("aaaaa", false), (std::vector<int32_t>{4, 0}));
  EXPECT_EQ(aa_first.encode("aab", false), (std::vector<int32_t>{2, 1}));
  const BpeTokenizer ab_first = make({{"a", "b"}, {"a", "a"}, {"aa", "aa"}});
  EXPECT_EQ(ab_first.encode("aab", false), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(ab_first.encode("aaab", false), (std::vector<int32_t>{2, 3}));
}

// The tokenizer against the plain rule above on varied text, SmolLM2's vocabulary.
TEST(Tokenizer, BpeMatchesThePlainMergeRule) {
  if (!fs::exists(smollm2_json())) CUMULUS_FIXTURE_MISSING(smollm2_json() << " missing (../shared not present)");
  const auto tok = tokenizer_from_hf_json(smollm2_json().string(), 1, 2);
  std::ifstream in(smollm2_json());
  const PlainBpe plain(nlohmann::json::parse(in));
  size_t n_tokens = 0;
  for (const std::string& t : varied_texts()) {
    const std::vector<int32_t> want = plain.encode(t);
    EXPECT_EQ(tok->encode(t, false), want) << "text: '" << t.substr(0, 80) << "' (" << t.size() << " bytes)";
    n_tokens += want.size();
  }
  EXPECT_GT(n_tokens, 5000u);
}

// A pre-token of 1 MB of one character, or 50 KB of spaces, is one word for BPE: its merges
// must not take quadratic time (the plain rule took 25 s on 100 KB, so hours on 1 MB). Both
// tokenizers, within one second of CPU time in an optimised build (0.2-0.5 s here), five in
// a sanitized or unoptimised one: a quadratic merge misses either by orders of magnitude.
TEST(Tokenizer, LongRunsOfOneCharacterTokenizeInUnderASecond) {
#if defined(__SANITIZE_ADDRESS__) || !defined(NDEBUG)
  const double bound_s = 5.0;
#else
  const double bound_s = 1.0;
#endif
  std::vector<std::unique_ptr<Tokenizer>> toks;
  if (fs::exists(smollm2_json())) toks.push_back(tokenizer_from_hf_json(smollm2_json().string(), 1, 2));
  if (fs::exists(tok512())) toks.push_back(tokenizer_from_llama2c(tok512().string(), 512));
  if (toks.empty()) CUMULUS_FIXTURE_MISSING("no tokenizer in " << shared_dir() << " (../shared not present)");
  for (const auto& tok : toks) {
    for (const std::string& text : {std::string(1 << 20, 'a'), std::string(50 << 10, ' '), std::string(1 << 20, '\n')}) {
      const double t0 = thread_cpu_seconds();
      const std::vector<int32_t> ids = tok->encode(text, false);
      const double s = thread_cpu_seconds() - t0;
      std::printf("%s: %zu bytes of 0x%02x: %zu ids in %.3f s of CPU\n", tok->source().c_str(), text.size(), text[0],
                  ids.size(), s);
      EXPECT_LT(s, bound_s) << tok->source() << ": " << text.size() << " bytes of 0x" << std::hex << int{text[0]};
      EXPECT_EQ(tok->decode(ids), text);
      if (text[0] == 'a' && tok->kind() == TokenizerKind::gpt2_bpe) {
        EXPECT_LT(ids.size(), text.size() / 2);  // merged, not left as bytes
      }
    }
  }
}

// encode_prefix(text, n) is the first n ids of encode(text), for every n, on both kinds.
TEST(Tokenizer, EncodePrefixIsTheFirstIdsOfEncode) {
  std::vector<std::unique_ptr<Tokenizer>> toks;
  if (fs::exists(smollm2_json())) toks.push_back(tokenizer_from_hf_json(smollm2_json().string(), 1, 2));
  if (fs::exists(tok512())) toks.push_back(tokenizer_from_llama2c(tok512().string(), 512));
  if (toks.empty()) CUMULUS_FIXTURE_MISSING("no tokenizer in " << shared_dir() << " (../shared not present)");
  std::vector<std::string> texts = varied_texts();
  texts.push_back("hi <|im_start|>user\nhello<|im_end|> there  friend");
  for (const auto& tok : toks)
    for (const std::string& t : texts)
      for (bool bos : {false, true}) {
        const std::vector<int32_t> all = tok->encode(t, bos);
        for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{5}, size_t{16}, all.size() / 2, all.size() - 1,
                         all.size(), all.size() + 3}) {
          const std::vector<int32_t> want(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(std::min(n, all.size())));
          EXPECT_EQ(tok->encode_prefix(t, bos, n), want) << tok->source() << " n=" << n << " text: '" << t.substr(0, 60) << "'";
        }
      }
}
