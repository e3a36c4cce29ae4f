// Byte-level BPE (GPT-2 family; SmolLM2). Encoding runs in three steps:
//   1. special tokens (control / user-defined) are cut out of the text verbatim;
//   2. the pre-tokenizer splits the rest into words: SmolLM2 isolates every numeric code
//      point (\p{N}: Hugging Face's Digits(individual_digits) uses Rust's char::is_numeric)
//      first, then applies the GPT-2 regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      to each piece -- implemented by hand below as a scan over code points;
//   3. each word's bytes become the printable code points of GPT-2's byte map, one symbol
//      per byte, and the adjacent pair with the lowest merge rank is merged (leftmost first)
//      until no pair has a merge (a priority queue of pairs: O(n log n) in the word's length).
#include <algorithm>
#include <limits>
#include <queue>

#include "core/check.h"
#include "model/tokenizer_impl.h"
#include "model/unicode.h"

namespace cumulus {
namespace {

// GPT-2's byte -> code point map: printable Latin-1 bytes map to themselves, the others
// (controls, space, DEL, NBSP, soft hyphen) to 256, 257, ... in byte order.
struct ByteMap {
  std::array<uint32_t, 256> to_cp{};
  std::unordered_map<uint32_t, uint8_t> to_byte;
  ByteMap() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? b : next++;
      to_byte[to_cp[b]] = static_cast<uint8_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

enum class CharClass { letter, number, space, other };

CharClass char_class(uint32_t cp) {
  if (unicode::is_whitespace(cp)) return CharClass::space;
  if (unicode::is_letter(cp)) return CharClass::letter;
  if (unicode::is_number(cp)) return CharClass::number;
  return CharClass::other;  // includes bytes that are not valid UTF-8
}

// The GPT-2 regex over one piece; appends the matches to out.
void gpt2_split(std::string_view text, std::vector<std::string_view>& out) {
  // Code points with their byte offsets; off[n] = text.size().
  std::vector<uint32_t> cps;
  std::vector<size_t> off;
  for (size_t i = 0; i < text.size();) {
    uint32_t cp;
    const size_t len = unicode::utf8_decode(text, i, &cp);
    cps.push_back(cp);
    off.push_back(i);
    i += len;
  }
  const size_t n = cps.size();
  off.push_back(text.size());
  auto emit = [&](size_t a, size_t b) { out.push_back(text.substr(off[a], off[b] - off[a])); };
  auto run_end = [&](size_t j, CharClass c) {
    while (j < n && char_class(cps[j]) == c) ++j;
    return j;
  };

  size_t i = 0;
  while (i < n) {
    // 's 't 're 've 'm 'll 'd (case-sensitive)
    if (cps[i] == '\'' && i + 1 < n) {
      const uint32_t c1 = cps[i + 1];
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        emit(i, i + 2);
        i += 2;
        continue;
      }
      if (i + 2 < n) {
        const uint32_t c2 = cps[i + 2];
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          emit(i, i + 3);
          i += 3;
          continue;
        }
      }
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional ASCII space, then a run
    // of one class. (A space itself is \s, so without the optional space the run must
    // start at i with a non-space.)
    const size_t j = cps[i] == ' ' ? i + 1 : i;
    if (j < n) {
      const CharClass c = char_class(cps[j]);
      if (c != CharClass::space) {
        const size_t e = run_end(j, c);
        emit(i, e);
        i = e;
        continue;
      }
    }
    // '\s+(?!\S)' then '\s+': a whitespace run; when a non-space follows, leave the run's
    // last character to start the next match (unless the run is one character long).
    const size_t e = run_end(i, CharClass::space);
    if (e == n || e - i == 1) {
      emit(i, e);
      i = e;
    } else {
      emit(i, e - 1);
      i = e - 1;
    }
  }
}

}  // namespace

std::vector<std::string_view> bpe_pre_tokenize(std::string_view text, BpePreTokenizer pre) {
  std::vector<std::string_view> out;
  if (pre == BpePreTokenizer::gpt2) {
    gpt2_split(text, out);
    return out;
  }
  // smollm: isolate each \p{N} code point, then split the pieces between them.
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    uint32_t cp;
    const size_t len = unicode::utf8_decode(text, i, &cp);
    if (unicode::is_number(cp)) {
      if (i > start) gpt2_split(text.substr(start, i - start), out);
      out.push_back(text.substr(i, len));
      start = i + len;
    }
    i += len;
  }
  if (start < text.size()) gpt2_split(text.substr(start), out);
  return out;
}

BpeTokenizer::BpeTokenizer(std::string source, BpeVocab v) : pre_(v.pre) {
  kind_ = TokenizerKind::gpt2_bpe;
  source_ = std::move(source);
  CUMULUS_CHECK(v.types.size() == v.tokens.size(), "{}: {} token types for {} tokens", source_, v.types.size(),
                v.tokens.size());
  tokens_ = std::move(v.tokens);
  types_ = std::move(v.types);
  bos_id_ = v.bos_id;
  eos_id_ = v.eos_id;
  unk_id_ = v.unk_id;
  add_bos_default_ = v.add_bos;
  ids_.reserve(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    // Keep the first id when a text repeats (some vocabularies carry duplicates).
    ids_.emplace(tokens_[i], static_cast<int32_t>(i));
    if (types_[i] == TokenType::control || types_[i] == TokenType::user_defined) {
      if (!tokens_[i].empty()) {
        specials_.push_back(static_cast<int32_t>(i));
        special_first_[static_cast<uint8_t>(tokens_[i][0])] = true;
      }
    }
  }
  std::stable_sort(specials_.begin(), specials_.end(), [&](int32_t a, int32_t b) {
    return tokens_[static_cast<size_t>(a)].size() > tokens_[static_cast<size_t>(b)].size();
  });
  const ByteMap& bm = byte_map();
  for (size_t b = 0; b < 256; ++b) {
    std::string s;
    unicode::utf8_append(s, bm.to_cp[b]);
    const auto it = ids_.find(s);
    byte_ids_[b] = it == ids_.end() ? -1 : it->second;
  }
  merges_.reserve(v.merges.size());
  for (size_t r = 0; r < v.merges.size(); ++r) {
    const auto& [left, right] = v.merges[r];
    const auto l = ids_.find(left), rr = ids_.find(right), m = ids_.find(left + right);
    CUMULUS_CHECK(l != ids_.end() && rr != ids_.end() && m != ids_.end(),
                  "{}: merge {} '{} {}' names a token that is not in the vocabulary", source_, r, left, right);
    const uint64_t key = (static_cast<uint64_t>(l->second) << 32) | static_cast<uint32_t>(rr->second);
    merges_.emplace(key, std::make_pair(static_cast<int32_t>(r), m->second));  // first rank wins
  }
}

// The merges run over a linked list of symbols with a priority queue of adjacent pairs
// keyed by (merge rank, position of the left symbol): the lowest rank first, the leftmost
// among equal ranks -- the order of the plain rule "merge the lowest-ranked adjacent pair,
// leftmost first", in O(n log n) for a word of n bytes instead of O(n^2). A merge absorbs
// the right symbol into the left one, so a symbol's index is its first byte's position and
// index order is text order. An entry whose symbols have changed since it was queued is
// stale and skipped.
void BpeTokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;          // -1 once merged into its left neighbour
    int32_t prev, next;  // neighbours' indices, -1 at the ends
  };
  struct Pair {
    int32_t rank, left, right, left_id, right_id, merged_id;
  };
  // priority_queue pops the largest: "a after b" when a has the higher rank, or on equal
  // ranks (the same pair of tokens) the later position.
  struct After {
    bool operator()(const Pair& a, const Pair& b) const {
      return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
    }
  };
  CUMULUS_CHECK(word.size() < (size_t{1} << 31), "{}: a word of {} bytes is too long to encode", source_, word.size());
  const int32_t n = static_cast<int32_t>(word.size());
  std::vector<Symbol> sym(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    const uint8_t ch = static_cast<uint8_t>(word[static_cast<size_t>(i)]);
    int32_t id = byte_ids_[ch];
    if (id < 0) {
      CUMULUS_CHECK(unk_id_ >= 0, "{}: byte 0x{:02x} has no token and there is no unknown token", source_, ch);
      id = unk_id_;
    }
    sym[static_cast<size_t>(i)] = Symbol{id, i - 1, i + 1 < n ? i + 1 : -1};
  }
  // The pair (l, r) of the current symbols, when the vocabulary has its merge.
  auto pair_of = [&](int32_t l, int32_t r, Pair* p) {
    if (l < 0 || r < 0) return false;
    const int32_t lid = sym[static_cast<size_t>(l)].id, rid = sym[static_cast<size_t>(r)].id;
    const auto it = merges_.find((static_cast<uint64_t>(lid) << 32) | static_cast<uint32_t>(rid));
    if (it == merges_.end()) return false;
    *p = Pair{it->second.first, l, r, lid, rid, it->second.second};
    return true;
  };
  std::vector<Pair> initial;
  initial.reserve(static_cast<size_t>(n));
  for (int32_t i = 0; i + 1 < n; ++i)
    if (Pair p; pair_of(i, i + 1, &p)) initial.push_back(p);
  std::priority_queue<Pair, std::vector<Pair>, After> queue(After{}, std::move(initial));  // heapified in O(n)
  auto push = [&](int32_t l, int32_t r) {
    if (Pair p; pair_of(l, r, &p)) queue.push(p);
  };
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Symbol& l = sym[static_cast<size_t>(p.left)];
    Symbol& r = sym[static_cast<size_t>(p.right)];
    if (l.id != p.left_id || l.next != p.right || r.id != p.right_id) continue;  // stale
    l.id = p.merged_id;
    l.next = r.next;
    if (r.next >= 0) sym[static_cast<size_t>(r.next)].prev = p.left;
    r.id = -1;
    push(l.prev, p.left);
    push(p.left, l.next);
  }
  for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = sym[static_cast<size_t>(i)].next)
    out.push_back(sym[static_cast<size_t>(i)].id);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool add_bos) const {
  return encode_prefix(text, add_bos, std::numeric_limits<size_t>::max());
}

// Words encode independently of what follows them, so the ids stop after the word (or
// special token) that brings them to max_tokens.
std::vector<int32_t> BpeTokenizer::encode_prefix(std::string_view text, bool add_bos, size_t max_tokens) const {
  std::vector<int32_t> out;
  if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);
  auto encode_plain = [&](std::string_view s) {
    for (std::string_view w : bpe_pre_tokenize(s, pre_)) {
      if (out.size() >= max_tokens) return;
      encode_word(w, out);
    }
  };
  size_t start = 0, i = 0;
  while (i < text.size() && out.size() < max_tokens) {
    int32_t hit = -1;
    if (special_first_[static_cast<uint8_t>(text[i])]) {
      for (int32_t id : specials_) {
        const std::string& t = tokens_[static_cast<size_t>(id)];
        if (text.compare(i, t.size(), t) == 0) {
          hit = id;
          break;  // specials_ is sorted longest first
        }
      }
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    if (i > start) encode_plain(text.substr(start, i - start));
    if (out.size() < max_tokens) out.push_back(hit);
    i += tokens_[static_cast<size_t>(hit)].size();
    start = i;
  }
  if (start < text.size() && out.size() < max_tokens) encode_plain(text.substr(start));
  if (out.size() > max_tokens) out.resize(max_tokens);
  return out;
}

std::string BpeTokenizer::decode_piece(int32_t id) const {
  check_id(id);
  const std::string& t = tokens_[static_cast<size_t>(id)];
  const TokenType type = types_[static_cast<size_t>(id)];
  if (type == TokenType::control || type == TokenType::user_defined) return t;
  const ByteMap& bm = byte_map();
  std::string out;
  for (size_t i = 0; i < t.size();) {
    uint32_t cp;
    const size_t len = unicode::utf8_decode(t, i, &cp);
    const auto it = bm.to_byte.find(cp);
    if (it != bm.to_byte.end()) out += static_cast<char>(it->second);
    else out.append(t, i, len);  // not a mapped byte: keep as is
    i += len;
  }
  return out;
}

}  // namespace cumulus
