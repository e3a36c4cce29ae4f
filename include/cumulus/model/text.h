// Text helpers for prompts: Project Gutenberg files carry a licence header and footer;
// prompts use only the book between the "*** START OF" and "*** END OF" marker lines.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace cumulus {

// The text between the START and END marker lines when both exist, else `text` itself.
std::string text_strip_gutenberg(std::string_view text);
// Texts (prompts, documents, haystacks) are read whole, up to this many bytes.
inline constexpr size_t kTextReadMax = size_t{256} << 20;
// Whole file as bytes; throws Error naming the path when it cannot be read, is a
// directory, or holds more than kTextReadMax bytes.
std::string text_read_file(const std::string& path);

}  // namespace cumulus
