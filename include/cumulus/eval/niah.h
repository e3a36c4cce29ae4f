// Needle-in-a-haystack prompts (docs/results.md "niah"): a needle sentence that
// carries a random 7-digit number is put into a haystack of real text at a given depth; the
// model is asked for the number and answers greedily; retrieval is exact.
//
// Prompt (token ids, concatenated from separately tokenised pieces so that every length is
// exact):  [BOS] prefix  haystack[0, i)  needle  haystack[i, H)  suffix
//   needle  " The special magic number is NNNNNNN."
//   chat    prefix "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by
//                   Hugging Face<|im_end|>\n<|im_start|>user\n"   (SmolLM2's ChatML and its
//                   default system prompt, from the GGUF's chat template)
//           suffix "\n\nWhat is the special magic number mentioned in the text above? Answer
//                   with the number only.<|im_end|>\n<|im_start|>assistant\nThe special magic
//                   number is"
//   plain   prefix ""
//           suffix "\n\nQuestion: What is the special magic number mentioned in the text
//                   above?\nAnswer: The special magic number is"
// The haystack is the first H tokens of the text, H chosen so that the prompt plus
// `answer_tokens` fills `length` exactly. The needle goes before haystack token i, the
// boundary nearest to depth * H within kNiahSnapTokens: before a line break, or after a
// sentence end (a token ending in . ! or ?, closing quotes allowed, followed by a token
// that starts with white space). Depth 0 puts it first, depth 1 last; with no boundary in
// reach, i = round(depth * H).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cumulus {

class Tokenizer;

enum class NiahTemplate { chat, plain };
// "chat" / "plain"; "auto" = chat when the vocabulary has <|im_start|> and <|im_end|>.
NiahTemplate niah_template_parse(std::string_view name, const Tokenizer& tok);
std::string_view niah_template_name(NiahTemplate t);

struct NiahPromptOptions {
  int length = 1024;       // prompt + answer_tokens, in tokens
  double depth = 0.5;      // [0, 1]
  int answer_tokens = 16;  // greedy answer budget (kept free in `length`)
  NiahTemplate style = NiahTemplate::chat;
  uint64_t seed = 0;       // the number: a function of (seed, length, depth, trial)
  int trial = 0;
};

struct NiahPrompt {
  std::vector<int32_t> tokens;  // the whole prompt, length - answer_tokens ids
  std::string number;           // 7 digits, first one non-zero
  int needle_begin = 0, needle_end = 0;  // [begin, end) of the needle in tokens
  int haystack_tokens = 0;      // H
  int insert_at = 0;            // i: haystack tokens before the needle
  double depth = 0;             // insert_at / H: the depth achieved
};

inline constexpr int kNiahSnapTokens = 64;

// `haystack` holds the tokenised text without BOS (at least H tokens). Throws Error when
// the length leaves fewer than 32 haystack tokens, the haystack is too short, or a value is
// out of range.
NiahPrompt niah_prompt_build(const Tokenizer& tok, std::span<const int32_t> haystack, const NiahPromptOptions& o);

// Exact retrieval: the first run of digits in `answer` equals `number`.
bool niah_answer_correct(std::string_view answer, std::string_view number);

}  // namespace cumulus
