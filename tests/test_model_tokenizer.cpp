// Tokenizers against references nobody here wrote:
//   - SmolLM2 byte-level BPE vs Hugging Face `tokenizers` on 38 texts
//     (tests/data/smollm2_tokens.json, from tools/reference/make_tokenizer_fixture.py),
//     with the vocabulary from tokenizer.json and, when models/ has it, from the GGUF;
//   - llama2.c tok512 (stories260K): round trips and byte fallback; the same vocabulary
//     written as a GGUF `llama` tokenizer gives the same ids.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

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
