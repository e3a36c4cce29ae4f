// Sentencepiece-style BPE (Llama 2 GGUF vocabularies and llama2.c tok*.bin). Encoding:
// prefix one space (add_space_prefix), write spaces as the vocabulary's space symbol
// (U+2581, or ' ' for llama2.c), start from one symbol per UTF-8 character, and repeatedly
// merge the adjacent pair whose concatenation is a vocabulary piece with the highest score
// (leftmost on ties). A symbol left that is not a piece (a character outside the
// vocabulary) is written as its <0xXX> byte tokens, or <unk> without byte tokens.
#include <algorithm>
#include <queue>

#include "core/check.h"
#include "model/tokenizer_impl.h"
#include "model/unicode.h"

namespace cumulus {
namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// "<0xAB>" -> 0xAB, else -1.
int parse_byte_token(const std::string& t) {
  if (t.size() != 6 || !t.starts_with("<0x") || t[5] != '>') return -1;
  const int hi = hex_value(t[3]), lo = hex_value(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

struct Symbol {
  size_t start = 0, len = 0;  // byte range in the normalised text
  int prev = -1, next = -1;
};

struct Bigram {
  float score;
  int left, right;
  size_t len;  // len of the merged piece when queued; a mismatch later means it is stale
  bool operator<(const Bigram& o) const {  // priority_queue pops the largest
    if (score != o.score) return score < o.score;
    return left > o.left;
  }
};

}  // namespace

SpmTokenizer::SpmTokenizer(TokenizerKind kind, std::string source, SpmVocab v)
    : scores_(std::move(v.scores)), add_space_prefix_(v.add_space_prefix), space_symbol_(std::move(v.space_symbol)) {
  kind_ = kind;
  source_ = std::move(source);
  CUMULUS_CHECK(v.types.size() == v.tokens.size() && scores_.size() == v.tokens.size(),
                "{}: {} tokens, {} scores, {} types must agree", source_, v.tokens.size(), scores_.size(),
                v.types.size());
  CUMULUS_CHECK(!space_symbol_.empty(), "{}: empty space symbol", source_);
  tokens_ = std::move(v.tokens);
  types_ = std::move(v.types);
  bos_id_ = v.bos_id;
  eos_id_ = v.eos_id;
  unk_id_ = v.unk_id;
  add_bos_default_ = v.add_bos;
  byte_ids_.fill(-1);
  ids_.reserve(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const TokenType t = types_[i];
    if (t == TokenType::byte) {
      const int b = parse_byte_token(tokens_[i]);
      CUMULUS_CHECK(b >= 0, "{}: byte token {} has text '{}', want <0xXX>", source_, i, tokens_[i]);
      if (byte_ids_[static_cast<size_t>(b)] < 0) byte_ids_[static_cast<size_t>(b)] = static_cast<int32_t>(i);
    } else if ((t == TokenType::normal || t == TokenType::user_defined) && !tokens_[i].empty()) {
      ids_.emplace(tokens_[i], static_cast<int32_t>(i));
    }
  }
  spaces_split_ = true;
  for (const auto& [piece, id] : ids_) {
    size_t at = 0;  // past the leading space symbols
    while (piece.compare(at, space_symbol_.size(), space_symbol_) == 0) at += space_symbol_.size();
    if (piece.find(space_symbol_, at) != std::string::npos) {
      spaces_split_ = false;
      break;
    }
  }
}

std::vector<int32_t> SpmTokenizer::encode_prefix(std::string_view text, bool add_bos, size_t max_tokens) const {
  if (!spaces_split_) return Tokenizer::encode_prefix(text, add_bos, max_tokens);
  // Prefixes that end before a space that follows another character, growing twofold: each
  // gives the first ids of the whole encoding, so the first with max_tokens ids is the
  // answer; the text read is at most about twice what those ids need.
  size_t want = std::min(text.size(), 8 * std::min(max_tokens, text.size()) + 64);
  for (;;) {
    size_t end = want;
    while (end < text.size() && !(text[end] == ' ' && text[end - 1] != ' ' &&
                                  !text.substr(0, end).ends_with(space_symbol_)))
      ++end;
    std::vector<int32_t> ids = encode(text.substr(0, end), add_bos);
    if (ids.size() >= max_tokens || end == text.size()) {
      if (ids.size() > max_tokens) ids.resize(max_tokens);
      return ids;
    }
    want = std::min(text.size(), 2 * end);
  }
}

std::vector<int32_t> SpmTokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> out;
  if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);
  if (text.empty()) return out;

  std::string norm;
  norm.reserve(text.size() + 8);
  if (add_space_prefix_) norm += space_symbol_;
  for (char c : text) {
    if (c == ' ') norm += space_symbol_;
    else norm += c;
  }

  std::vector<Symbol> sym;
  for (size_t i = 0; i < norm.size();) {
    uint32_t cp;
    const size_t len = unicode::utf8_decode(norm, i, &cp);
    Symbol s;
    s.start = i;
    s.len = len;
    s.prev = static_cast<int>(sym.size()) - 1;
    s.next = static_cast<int>(sym.size()) + 1;
    sym.push_back(s);
    i += len;
  }
  sym.back().next = -1;

  std::priority_queue<Bigram> queue;
  auto try_add = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    const size_t len = sym[static_cast<size_t>(l)].len + sym[static_cast<size_t>(r)].len;
    const auto it = ids_.find(std::string(norm, sym[static_cast<size_t>(l)].start, len));
    if (it == ids_.end()) return;
    queue.push(Bigram{scores_[static_cast<size_t>(it->second)], l, r, len});
  };
  for (size_t i = 1; i < sym.size(); ++i) try_add(static_cast<int>(i) - 1, static_cast<int>(i));

  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& l = sym[static_cast<size_t>(b.left)];
    Symbol& r = sym[static_cast<size_t>(b.right)];
    if (l.len == 0 || r.len == 0 || l.len + r.len != b.len || l.next != b.right) continue;  // stale
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[static_cast<size_t>(r.next)].prev = b.left;
    try_add(l.prev, b.left);
    try_add(b.left, l.next);
  }

  for (int i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next) {
    const Symbol& s = sym[static_cast<size_t>(i)];
    const std::string piece(norm, s.start, s.len);
    const auto it = ids_.find(piece);
    if (it != ids_.end()) {
      out.push_back(it->second);
      continue;
    }
    for (char c : piece) {
      const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
      if (id >= 0) {
        out.push_back(id);
      } else {
        CUMULUS_CHECK(unk_id_ >= 0, "{}: '{}' is not in the vocabulary, which has no byte or unknown tokens", source_,
                      piece);
        out.push_back(unk_id_);
        break;  // one <unk> for the whole character
      }
    }
  }
  return out;
}

std::string SpmTokenizer::decode_piece(int32_t id) const {
  check_id(id);
  const std::string& t = tokens_[static_cast<size_t>(id)];
  switch (types_[static_cast<size_t>(id)]) {
    case TokenType::control:
    case TokenType::unused:
      return "";
    case TokenType::byte:
      return std::string(1, static_cast<char>(parse_byte_token(t)));
    default:
      break;
  }
  std::string out;
  for (size_t i = 0; i < t.size();) {
    if (t.compare(i, space_symbol_.size(), space_symbol_) == 0) {
      out += ' ';
      i += space_symbol_.size();
    } else {
      out += t[i++];
    }
  }
  return out;
}

std::string SpmTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  bool first = true;
  for (int32_t id : ids) {
    std::string piece = decode_piece(id);
    if (piece.empty()) continue;
    if (first && add_space_prefix_ && piece[0] == ' ') piece.erase(0, 1);
    first = false;
    out += piece;
  }
  return out;
}

}  // namespace cumulus
