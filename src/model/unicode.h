// UTF-8 decoding and the few Unicode properties the tokenizers need (letters, numbers,
// White_Space). Tables are generated (tools/reference/make_unicode_tables.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace cumulus::unicode {

// Stands for a byte that does not start a valid UTF-8 sequence; it has no category.
constexpr uint32_t kInvalid = 0xFFFFFFFFu;

// Decodes the code point starting at s[i]; returns its length in bytes (>= 1). Invalid or
// truncated sequences, overlong forms and surrogates decode as kInvalid of length 1.
size_t utf8_decode(std::string_view s, size_t i, uint32_t* cp);
void utf8_append(std::string& out, uint32_t cp);
// Length of the sequence its first byte announces, clamped to the bytes left (>= 1).
size_t utf8_sequence_length(std::string_view s, size_t i);

bool is_letter(uint32_t cp);         // \p{L}
bool is_number(uint32_t cp);         // \p{N}
bool is_whitespace(uint32_t cp);     // White_Space property (what Oniguruma's \s matches)

}  // namespace cumulus::unicode
