#include "cumulus/model/text.h"

#include <fstream>
#include <sstream>

#include "cumulus/core/error.h"

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
  std::ifstream f(path, std::ios::binary);
  CUMULUS_CHECK(f.good(), "cannot open '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  CUMULUS_CHECK(!f.bad(), "cannot read '{}'", path);
  return ss.str();
}

}  // namespace cumulus
