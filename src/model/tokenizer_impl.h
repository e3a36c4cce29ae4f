// Internal: the two tokenizer algorithms behind tokenizer.h's factories.
#pragma once

#include <array>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cumulus/model/tokenizer.h"

namespace cumulus {

// Pre-tokenizers of byte-level BPE vocabularies.
enum class BpePreTokenizer {
  gpt2,    // GPT-2 regex: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  smollm,  // every \p{N} code point isolated first, then the GPT-2 regex on each piece
};

// Splits text into the pieces BPE runs on (substrings of `text`, in order, covering it).
std::vector<std::string_view> bpe_pre_tokenize(std::string_view text, BpePreTokenizer pre);

struct BpeVocab {
  std::vector<std::string> tokens;
  std::vector<TokenType> types;  // control / user_defined tokens are matched verbatim in text
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  BpePreTokenizer pre = BpePreTokenizer::gpt2;
  int32_t bos_id = -1, eos_id = -1, unk_id = -1;
  bool add_bos = false;
};

class BpeTokenizer final : public Tokenizer {
 public:
  BpeTokenizer(std::string source, BpeVocab vocab);
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override;
  std::vector<int32_t> encode_prefix(std::string_view text, bool add_bos, size_t max_tokens) const override;
  std::string decode_piece(int32_t id) const override;

 private:
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  BpePreTokenizer pre_;
  std::unordered_map<std::string, int32_t> ids_;
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::array<int32_t, 256> byte_ids_{};  // token of each single (mapped) byte, or -1
  std::vector<int32_t> specials_;        // control / user-defined ids, longest text first
  std::array<bool, 256> special_first_{};  // bytes that start some special token
};

struct SpmVocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<TokenType> types;
  int32_t bos_id = -1, eos_id = -1, unk_id = -1;
  bool add_space_prefix = true;
  bool add_bos = true;
  std::string space_symbol;  // "\u2581" (GGUF llama) or " " (llama2.c)
};

class SpmTokenizer final : public Tokenizer {
 public:
  SpmTokenizer(TokenizerKind kind, std::string source, SpmVocab vocab);
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override;
  std::vector<int32_t> encode_prefix(std::string_view text, bool add_bos, size_t max_tokens) const override;
  std::string decode_piece(int32_t id) const override;
  std::string decode(std::span<const int32_t> ids) const override;

 private:
  // Whether no piece holds the space symbol after another character: then no merge spans
  // the boundary between a character other than a space and the space after it, and the
  // text before such a boundary encodes to the first ids of the whole text's encoding.
  bool spaces_split_ = false;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t> ids_;  // normal / user-defined tokens only
  std::array<int32_t, 256> byte_ids_{};           // <0xXX> tokens, or -1
  bool add_space_prefix_;
  std::string space_symbol_;
};

}  // namespace cumulus
