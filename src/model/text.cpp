#include "cumulus/model/text.h"

#include "cumulus/core/file.h"

namespace cumulus {

std::string text_strip_gutenberg(std::string_view text) {
  const size_t start = text.find("*** START OF");
  if (start == std::string_view::npos) return std::string(text);
  const size_t body = text.find('\n', start);
  const size_t end = text.find("*** END OF", start);
  if (body == std::string_view::npos || end == std::string_view::npos || end < body) return std::string(text);
  std::string_view b = text.substr(body + 1, end - body - 1);
  const size_t first = b.find_first_not_of(" \r\n\t");
  const size_t last = b.find_last_not_of(" \r\n\t");
  if (first == std::string_view::npos) return "";
  return std::string(b.substr(first, last - first + 1));
}

std::string text_read_file(const std::string& path) {
  // A directory opens as an empty stream with std::ifstream, and /dev/zero never ends:
  // file_read refuses the first and caps the second.
  return file_read(path, "text file", kTextReadMax);
}

}  // namespace cumulus
