// Tokenizers: text <-> token ids for the models cumulus runs.
//
//   gpt2_bpe       byte-level BPE (GPT-2 style, SmolLM2): bytes mapped to printable code
//                  points, a regex-like pre-tokenizer splits words, merges applied by rank.
//                  From GGUF (`tokenizer.ggml.model` = "gpt2") or a Hugging Face
//                  tokenizer.json.
//   sentencepiece  sentencepiece-style BPE (Llama 2, TinyStories): spaces become U+2581,
//                  a space is prefixed, pieces merge by highest score, characters outside
//                  the vocabulary fall back to <0xXX> byte tokens. From GGUF
//                  (`tokenizer.ggml.model` = "llama").
//   llama2c        the same algorithm over llama2.c's `tok*.bin` (vocabulary stores ' '
//                  instead of U+2581).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cumulus {

class GgufFile;

enum class TokenizerKind { gpt2_bpe, sentencepiece, llama2c };
std::string_view tokenizer_kind_name(TokenizerKind k);

// As in GGUF `tokenizer.ggml.token_type`.
enum class TokenType : int32_t { normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  TokenizerKind kind() const { return kind_; }
  size_t vocab_size() const { return tokens_.size(); }
  int32_t bos_id() const { return bos_id_; }  // -1 when the vocabulary has none
  int32_t eos_id() const { return eos_id_; }  // -1 when the vocabulary has none
  // Whether the model expects a BOS at the start of a prompt (GGUF
  // `tokenizer.ggml.add_bos_token`; true for sentencepiece and llama2.c).
  bool add_bos_default() const { return add_bos_default_; }
  const std::string& source() const { return source_; }

  // The vocabulary entry as stored (byte-level BPE: mapped code points; sentencepiece:
  // with U+2581). Throws on an id out of range.
  const std::string& token_text(int32_t id) const;
  TokenType token_type(int32_t id) const;

  // Text (UTF-8, or any bytes) to ids; prepends bos_id() when add_bos and there is one.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos) const = 0;
  // The first max_tokens ids of encode(text, add_bos) (all of them when it gives fewer),
  // tokenizing no more of the text than that needs where the algorithm allows: byte-level
  // BPE stops after the word that completes them; sentencepiece-style BPE encodes growing
  // prefixes that end before a space no vocabulary piece can span.
  virtual std::vector<int32_t> encode_prefix(std::string_view text, bool add_bos, size_t max_tokens) const;
  // The bytes one token stands for. Control tokens: byte-level BPE gives their text
  // ("<|im_end|>"), sentencepiece/llama2c give "" (their text is not part of the output).
  virtual std::string decode_piece(int32_t id) const = 0;
  // Concatenated pieces; sentencepiece/llama2c also drop the one leading space that
  // encode() prefixed.
  virtual std::string decode(std::span<const int32_t> ids) const;

 protected:
  void check_id(int32_t id) const;

  TokenizerKind kind_ = TokenizerKind::gpt2_bpe;
  std::string source_;
  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t unk_id_ = -1;
  bool add_bos_default_ = false;
};

// From GGUF metadata (`tokenizer.ggml.*`): model "gpt2" (pre "smollm", "gpt2" or
// "default") or "llama". Throws Error naming the file and key for anything else.
std::unique_ptr<Tokenizer> tokenizer_from_gguf(const GgufFile& file);

// Byte-level BPE from a Hugging Face tokenizer.json (model BPE, ByteLevel pre-tokenizer,
// optionally preceded by Digits with individual_digits). tokenizer.json does not say which
// ids are BOS/EOS; pass them (or -1).
std::unique_ptr<Tokenizer> tokenizer_from_hf_json(const std::string& path, int32_t bos_id = -1,
                                                  int32_t eos_id = -1);

// llama2.c `tok*.bin`: i32 max_token_len, then per token f32 score, i32 len, len bytes.
// vocab_size is the model's (the file has no count); the file must hold exactly that many.
std::unique_ptr<Tokenizer> tokenizer_from_llama2c(const std::string& path, int32_t vocab_size);

// The tokenizer that llama2.c keeps next to a model: `tok<vocab_size>.bin`, then
// `tokenizer.bin`, in the model's folder; "" when neither exists.
std::string tokenizer_find_llama2c(const std::string& model_path, int32_t vocab_size);

}  // namespace cumulus
