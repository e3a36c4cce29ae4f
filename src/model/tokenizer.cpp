// Tokenizer base class and the loaders: GGUF metadata, Hugging Face tokenizer.json,
// llama2.c tok*.bin. The algorithms live in tokenizer_bpe.cpp and tokenizer_spm.cpp.
#include "cumulus/model/tokenizer.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/check.h"
#include "cumulus/core/file.h"
#include "cumulus/model/gguf.h"
#include "model/tokenizer_impl.h"

namespace cumulus {

std::string_view tokenizer_kind_name(TokenizerKind k) {
  switch (k) {
    case TokenizerKind::gpt2_bpe: return "gpt2 (byte-level BPE)";
    case TokenizerKind::sentencepiece: return "llama (sentencepiece-style BPE)";
    case TokenizerKind::llama2c: return "llama2.c (sentencepiece-style BPE)";
  }
  return "unknown";
}

void Tokenizer::check_id(int32_t id) const {
  CUMULUS_CHECK(id >= 0 && static_cast<size_t>(id) < tokens_.size(), "token id={} out of range [0, {})", id,
                tokens_.size());
}

const std::string& Tokenizer::token_text(int32_t id) const {
  check_id(id);
  return tokens_[static_cast<size_t>(id)];
}

TokenType Tokenizer::token_type(int32_t id) const {
  check_id(id);
  return types_[static_cast<size_t>(id)];
}

std::vector<int32_t> Tokenizer::encode_prefix(std::string_view text, bool add_bos, size_t max_tokens) const {
  std::vector<int32_t> ids = encode(text, add_bos);
  if (ids.size() > max_tokens) ids.resize(max_tokens);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += decode_piece(id);
  return out;
}

namespace {

std::vector<TokenType> gguf_token_types(const GgufFile& f, size_t n) {
  std::vector<TokenType> types(n, TokenType::normal);
  if (f.find("tokenizer.ggml.token_type") == nullptr) return types;
  const std::vector<int64_t> raw = f.get_int_array("tokenizer.ggml.token_type");
  CUMULUS_CHECK(raw.size() == n, "gguf: {}: tokenizer.ggml.token_type has {} entries, tokens has {}", f.path(),
                raw.size(), n);
  for (size_t i = 0; i < n; ++i) {
    CUMULUS_CHECK(raw[i] >= 0 && raw[i] <= 6, "gguf: {}: tokenizer.ggml.token_type[{}]={} is not in [0, 6]", f.path(),
                  i, raw[i]);
    // 0 (undefined) is treated as normal.
    types[i] = raw[i] == 0 ? TokenType::normal : static_cast<TokenType>(raw[i]);
  }
  return types;
}

int32_t gguf_token_id(const GgufFile& f, std::string_view key, size_t n, int32_t fallback) {
  if (f.find(key) == nullptr) return fallback;
  const uint64_t id = f.get_u64(key);
  CUMULUS_CHECK(id < n, "gguf: {}: {}={} is not a token id (vocabulary has {})", f.path(), key, id, n);
  return static_cast<int32_t>(id);
}

}  // namespace

std::unique_ptr<Tokenizer> tokenizer_from_gguf(const GgufFile& f) {
  const std::string_view model = f.get_string("tokenizer.ggml.model");
  const std::vector<std::string_view> token_views = f.get_string_array("tokenizer.ggml.tokens");
  const size_t n = token_views.size();
  CUMULUS_CHECK(n > 0 && n < (1u << 31), "gguf: {}: tokenizer.ggml.tokens has {} entries", f.path(), n);
  std::vector<std::string> tokens(token_views.begin(), token_views.end());
  std::vector<TokenType> types = gguf_token_types(f, n);

  if (model == "gpt2") {
    BpeVocab v;
    v.tokens = std::move(tokens);
    v.types = std::move(types);
    const std::string_view pre = f.get_string_or("tokenizer.ggml.pre", "default");
    if (pre == "smollm") {
      v.pre = BpePreTokenizer::smollm;
    } else if (pre == "gpt2" || pre == "default") {
      v.pre = BpePreTokenizer::gpt2;
    } else {
      CUMULUS_FAIL("gguf: {}: tokenizer.ggml.pre='{}' is not supported (supported: smollm, gpt2, default)", f.path(),
                   pre);
    }
    const std::vector<std::string_view> merges = f.get_string_array("tokenizer.ggml.merges");
    v.merges.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      const size_t sp = merges[i].find(' ');
      CUMULUS_CHECK(sp != std::string_view::npos && sp > 0 && sp + 1 < merges[i].size(),
                    "gguf: {}: tokenizer.ggml.merges[{}]='{}' is not 'left right'", f.path(), i, merges[i]);
      v.merges.emplace_back(std::string(merges[i].substr(0, sp)), std::string(merges[i].substr(sp + 1)));
    }
    v.bos_id = gguf_token_id(f, "tokenizer.ggml.bos_token_id", n, -1);
    v.eos_id = gguf_token_id(f, "tokenizer.ggml.eos_token_id", n, -1);
    v.unk_id = gguf_token_id(f, "tokenizer.ggml.unknown_token_id", n, -1);
    v.add_bos = f.get_bool_or("tokenizer.ggml.add_bos_token", false);
    return std::make_unique<BpeTokenizer>(f.path(), std::move(v));
  }
  if (model == "llama") {
    SpmVocab v;
    v.tokens = std::move(tokens);
    v.types = std::move(types);
    const std::vector<double> scores = f.get_float_array("tokenizer.ggml.scores");
    CUMULUS_CHECK(scores.size() == n, "gguf: {}: tokenizer.ggml.scores has {} entries, tokens has {}", f.path(),
                  scores.size(), n);
    v.scores.assign(scores.begin(), scores.end());
    v.bos_id = gguf_token_id(f, "tokenizer.ggml.bos_token_id", n, n > 1 ? 1 : -1);
    v.eos_id = gguf_token_id(f, "tokenizer.ggml.eos_token_id", n, n > 2 ? 2 : -1);
    v.unk_id = gguf_token_id(f, "tokenizer.ggml.unknown_token_id", n, 0);
    v.add_bos = f.get_bool_or("tokenizer.ggml.add_bos_token", true);
    v.add_space_prefix = f.get_bool_or("tokenizer.ggml.add_space_prefix", true);
    v.space_symbol = "\xE2\x96\x81";  // U+2581
    return std::make_unique<SpmTokenizer>(TokenizerKind::sentencepiece, f.path(), std::move(v));
  }
  CUMULUS_FAIL("gguf: {}: tokenizer.ggml.model='{}' is not supported (supported: gpt2, llama)", f.path(), model);
}

std::unique_ptr<Tokenizer> tokenizer_from_hf_json(const std::string& path, int32_t bos_id, int32_t eos_id) {
  std::ifstream in(path);
  CUMULUS_CHECK(in.good(), "cannot open tokenizer '{}'", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    CUMULUS_FAIL("{}: not valid JSON: {}", path, e.what());
  }
  try {
    const auto& model = j.at("model");
    CUMULUS_CHECK(model.at("type") == "BPE", "{}: model.type={} is not BPE", path, model.at("type").dump());
    BpeVocab v;
    const auto& vocab = model.at("vocab");
    v.tokens.resize(vocab.size());
    std::vector<bool> seen(vocab.size(), false);
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const int64_t id = it.value().get<int64_t>();
      CUMULUS_CHECK(id >= 0 && static_cast<size_t>(id) < vocab.size() && !seen[static_cast<size_t>(id)],
                    "{}: vocab id {} of '{}' is out of range or repeated", path, id, it.key());
      seen[static_cast<size_t>(id)] = true;
      v.tokens[static_cast<size_t>(id)] = it.key();
    }
    v.types.assign(v.tokens.size(), TokenType::normal);
    for (const auto& at : j.value("added_tokens", nlohmann::json::array())) {
      const int64_t id = at.at("id").get<int64_t>();
      const std::string content = at.at("content").get<std::string>();
      CUMULUS_CHECK(id >= 0 && static_cast<size_t>(id) < v.tokens.size() && v.tokens[static_cast<size_t>(id)] == content,
                    "{}: added token {} '{}' is not in the vocabulary", path, id, content);
      v.types[static_cast<size_t>(id)] = at.value("special", false) ? TokenType::control : TokenType::user_defined;
    }
    for (const auto& m : model.at("merges")) {
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        CUMULUS_CHECK(sp != std::string::npos, "{}: merge '{}' is not 'left right'", path, s);
        v.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else {
        v.merges.emplace_back(m.at(0).get<std::string>(), m.at(1).get<std::string>());
      }
    }
    // Pre-tokenizer: ByteLevel (use_regex, no prefix space), optionally after
    // Digits(individual_digits) -- the SmolLM2 configuration.
    const auto& pt = j.at("pre_tokenizer");
    auto is_byte_level = [](const nlohmann::json& p) {
      return p.at("type") == "ByteLevel" && !p.value("add_prefix_space", false) && p.value("use_regex", true);
    };
    if (is_byte_level(pt)) {
      v.pre = BpePreTokenizer::gpt2;
    } else if (pt.at("type") == "Sequence" && pt.at("pretokenizers").size() == 2 &&
               pt["pretokenizers"][0].at("type") == "Digits" &&
               pt["pretokenizers"][0].value("individual_digits", false) && is_byte_level(pt["pretokenizers"][1])) {
      v.pre = BpePreTokenizer::smollm;
    } else {
      CUMULUS_FAIL("{}: pre_tokenizer {} is not supported", path, pt.dump());
    }
    CUMULUS_CHECK(j.at("normalizer").is_null(), "{}: normalizers are not supported", path);
    v.bos_id = bos_id;
    v.eos_id = eos_id;
    return std::make_unique<BpeTokenizer>(path, std::move(v));
  } catch (const nlohmann::json::exception& e) {
    CUMULUS_FAIL("{}: unexpected tokenizer.json layout: {}", path, e.what());
  }
}

std::unique_ptr<Tokenizer> tokenizer_from_llama2c(const std::string& path, int32_t vocab_size) {
  CUMULUS_CHECK(vocab_size > 3, "llama2c tokenizer '{}': vocab_size={} must be > 3", path, vocab_size);
  CUMULUS_CHECK(!path.empty(), "llama2c tokenizer: no path given (none was found beside the model: give one)");
  // A tok*.bin holds at most vocab_size x (8 + max_token_length <= 1024) bytes after its
  // 4-byte header; file_read refuses directories and caps what it reads.
  const std::string bytes = file_read(path, "llama2c tokenizer",
                                      4 + static_cast<size_t>(vocab_size) * (8 + 1024));
  size_t pos = 0;
  auto read = [&](void* dst, size_t n, std::string_view what) {
    CUMULUS_CHECK(n <= bytes.size() - pos, "llama2c tokenizer '{}': truncated at offset {} reading {}", path, pos, what);
    std::memcpy(dst, bytes.data() + pos, n);
    pos += n;
  };
  int32_t max_len = 0;
  read(&max_len, 4, "max_token_length");
  CUMULUS_CHECK(max_len > 0 && max_len <= 1024, "llama2c tokenizer '{}': max_token_length={} must be in [1, 1024]",
                path, max_len);
  SpmVocab v;
  v.tokens.resize(static_cast<size_t>(vocab_size));
  v.scores.resize(static_cast<size_t>(vocab_size));
  v.types.assign(static_cast<size_t>(vocab_size), TokenType::normal);
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    int32_t len = 0;
    read(&v.scores[i], 4, "score");
    const size_t len_at = pos;
    read(&len, 4, "token length");
    CUMULUS_CHECK(len >= 0 && len <= max_len, "llama2c tokenizer '{}': token {} at offset {} has length {} (max {})",
                  path, i, len_at, len, max_len);
    v.tokens[i].resize(static_cast<size_t>(len));
    read(v.tokens[i].data(), static_cast<size_t>(len), "token bytes");
  }
  CUMULUS_CHECK(pos == bytes.size(), "llama2c tokenizer '{}': {} bytes left over after {} tokens", path,
                bytes.size() - pos, vocab_size);
  // llama2.c's convention: 0 <unk>, 1 <s>, 2 </s>; <0xXX> byte tokens.
  v.types[0] = TokenType::unknown;
  v.types[1] = TokenType::control;
  v.types[2] = TokenType::control;
  for (size_t i = 3; i < v.tokens.size(); ++i) {
    const std::string& t = v.tokens[i];
    if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>') v.types[i] = TokenType::byte;
  }
  v.unk_id = 0;
  v.bos_id = 1;
  v.eos_id = 2;
  v.add_bos = true;
  v.add_space_prefix = true;
  v.space_symbol.assign(1, ' ');  // (assign: GCC 12 -Wrestrict false positive on = " ")
  return std::make_unique<SpmTokenizer>(TokenizerKind::llama2c, path, std::move(v));
}

std::string tokenizer_find_llama2c(const std::string& model_path, int32_t vocab_size) {
  const std::filesystem::path dir = std::filesystem::path(model_path).parent_path();
  for (const std::string& name : {"tok" + std::to_string(vocab_size) + ".bin", std::string("tokenizer.bin")}) {
    const std::filesystem::path p = dir / name;
    if (std::filesystem::is_regular_file(p)) return p.string();
  }
  return "";
}

}  // namespace cumulus
