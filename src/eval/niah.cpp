// Needle-in-a-haystack prompt construction and scoring (niah.h).
#include "cumulus/eval/niah.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>

#include "core/check.h"
#include "cumulus/model/tokenizer.h"

namespace cumulus {
namespace {

constexpr std::string_view kChatPrefix =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n";
constexpr std::string_view kChatSuffix =
    "\n\nWhat is the special magic number mentioned in the text above? Answer with the number only.<|im_end|>\n"
    "<|im_start|>assistant\nThe special magic number is";
constexpr std::string_view kPlainSuffix =
    "\n\nQuestion: What is the special magic number mentioned in the text above?\nAnswer: The special magic number is";

bool has_token(const Tokenizer& tok, std::string_view text) {
  for (size_t i = 0; i < tok.vocab_size(); ++i)
    if (tok.token_text(static_cast<int32_t>(i)) == text) return true;
  return false;
}

// Haystack token t ends a sentence: its bytes, without trailing white space and closing
// quotes/brackets, end in . ! or ?.
bool ends_sentence(const std::string& piece) {
  size_t e = piece.size();
  auto strip = [&] {
    while (e > 0) {
      const unsigned char c = static_cast<unsigned char>(piece[e - 1]);
      if (std::isspace(c) || c == '"' || c == '\'' || c == ')' || c == '_') {
        --e;
      } else if (e >= 3 && piece.compare(e - 3, 3, "\xE2\x80\x9D") == 0) {  // U+201D
        e -= 3;
      } else if (e >= 3 && piece.compare(e - 3, 3, "\xE2\x80\x99") == 0) {  // U+2019
        e -= 3;
      } else {
        break;
      }
    }
  };
  strip();
  return e > 0 && (piece[e - 1] == '.' || piece[e - 1] == '!' || piece[e - 1] == '?');
}

bool starts_space(const std::string& piece) {
  return !piece.empty() && std::isspace(static_cast<unsigned char>(piece[0]));
}

bool starts_newline(const std::string& piece) {
  const size_t k = piece.find_first_not_of(" \t");
  return k != std::string::npos && (piece[k] == '\n' || piece[k] == '\r');
}

std::vector<int32_t> encode(const Tokenizer& tok, std::string_view text) {
  return text.empty() ? std::vector<int32_t>{} : tok.encode(text, false);
}

}  // namespace

NiahTemplate niah_template_parse(std::string_view name, const Tokenizer& tok) {
  if (name == "chat") return NiahTemplate::chat;
  if (name == "plain") return NiahTemplate::plain;
  CUMULUS_CHECK(name == "auto", "template '{}' must be auto, chat or plain", name);
  return has_token(tok, "<|im_start|>") && has_token(tok, "<|im_end|>") ? NiahTemplate::chat : NiahTemplate::plain;
}

std::string_view niah_template_name(NiahTemplate t) { return t == NiahTemplate::chat ? "chat" : "plain"; }

NiahPrompt niah_prompt_build(const Tokenizer& tok, std::span<const int32_t> haystack, const NiahPromptOptions& o) {
  CUMULUS_CHECK(o.depth >= 0 && o.depth <= 1, "depth={} must be in [0, 1]", o.depth);
  CUMULUS_CHECK(o.answer_tokens >= 1 && o.answer_tokens <= 256, "answer_tokens={} must be in [1, 256]",
                o.answer_tokens);
  CUMULUS_CHECK(o.trial >= 0, "trial={} must be >= 0", o.trial);
  NiahPrompt p;
  // The number: seeded by everything that names the cell, so each cell's needle is fixed
  // whatever else the run contains.
  std::seed_seq seq{static_cast<uint32_t>(o.seed), static_cast<uint32_t>(o.seed >> 32),
                    static_cast<uint32_t>(o.length), static_cast<uint32_t>(std::lround(o.depth * 1e6)),
                    static_cast<uint32_t>(o.trial)};
  std::mt19937_64 rng(seq);
  std::uniform_int_distribution<int> digits(1000000, 9999999);

  const std::string_view prefix_text = o.style == NiahTemplate::chat ? kChatPrefix : std::string_view{};
  const std::string_view suffix_text = o.style == NiahTemplate::chat ? kChatSuffix : kPlainSuffix;
  std::vector<int32_t> head;
  if (tok.add_bos_default() && tok.bos_id() >= 0) head.push_back(tok.bos_id());
  const std::vector<int32_t> prefix = encode(tok, prefix_text);
  head.insert(head.end(), prefix.begin(), prefix.end());
  const std::vector<int32_t> suffix = encode(tok, suffix_text);

  // Draw until the number is absent from the haystack's text (the needle must be the only
  // place it occurs); the needle's token count can depend on the digits.
  std::vector<int32_t> needle;
  std::string hay_text;
  for (int attempt = 0;; ++attempt) {
    CUMULUS_CHECK(attempt < 100, "no 7-digit number absent from the haystack after 100 draws");
    p.number = std::to_string(digits(rng));
    needle = encode(tok, " The special magic number is " + p.number + ".");
    const int64_t h = static_cast<int64_t>(o.length) - o.answer_tokens - static_cast<int64_t>(head.size()) -
                      static_cast<int64_t>(needle.size()) - static_cast<int64_t>(suffix.size());
    CUMULUS_CHECK(h >= 32, "length={} leaves {} haystack tokens (template {} + needle {} + answer {}): need >= 32",
                  o.length, h, head.size() + suffix.size(), needle.size(), o.answer_tokens);
    CUMULUS_CHECK(static_cast<size_t>(h) <= haystack.size(), "length={} needs {} haystack tokens, the text has {}",
                  o.length, h, haystack.size());
    p.haystack_tokens = static_cast<int>(h);
    hay_text = tok.decode(haystack.first(p.haystack_tokens));
    if (hay_text.find(p.number) == std::string::npos) break;
  }
  const int H = p.haystack_tokens;

  // Insertion point: nearest sentence boundary to depth * H.
  const int target = static_cast<int>(std::lround(o.depth * H));
  p.insert_at = target;
  if (target > 0 && target < H) {
    int best = -1;
    for (int d = 0; d <= kNiahSnapTokens && best < 0; ++d) {
      for (int i : {target - d, target + d}) {
        if (i <= 0 || i >= H) continue;
        const std::string next = tok.decode_piece(haystack[i]);
        if ((ends_sentence(tok.decode_piece(haystack[i - 1])) && starts_space(next)) || starts_newline(next)) {
          best = i;
          break;
        }
      }
    }
    if (best >= 0) p.insert_at = best;
  }
  p.depth = static_cast<double>(p.insert_at) / H;

  p.tokens = head;
  p.tokens.insert(p.tokens.end(), haystack.begin(), haystack.begin() + p.insert_at);
  p.needle_begin = static_cast<int>(p.tokens.size());
  p.tokens.insert(p.tokens.end(), needle.begin(), needle.end());
  p.needle_end = static_cast<int>(p.tokens.size());
  p.tokens.insert(p.tokens.end(), haystack.begin() + p.insert_at, haystack.begin() + H);
  p.tokens.insert(p.tokens.end(), suffix.begin(), suffix.end());
  return p;
}

bool niah_answer_correct(std::string_view answer, std::string_view number) {
  size_t b = 0;
  while (b < answer.size() && !std::isdigit(static_cast<unsigned char>(answer[b]))) ++b;
  size_t e = b;
  while (e < answer.size() && std::isdigit(static_cast<unsigned char>(answer[e]))) ++e;
  return e > b && answer.substr(b, e - b) == number;
}

}  // namespace cumulus
