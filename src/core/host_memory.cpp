// Host memory available (core/host_memory.h): /proc/meminfo's MemAvailable.
#include "cumulus/core/host_memory.h"

#include <charconv>
#include <fstream>
#include <iterator>
#include <string>

namespace cumulus {

size_t meminfo_available_bytes(std::string_view text) {
  constexpr std::string_view key = "MemAvailable:";
  size_t at = 0;
  while (true) {  // the key at the start of a line
    at = text.find(key, at);
    if (at == std::string_view::npos) return 0;
    if (at == 0 || text[at - 1] == '\n') break;
    at += key.size();
  }
  std::string_view rest = text.substr(at + key.size());
  rest = rest.substr(0, rest.find('\n'));
  const size_t b = rest.find_first_not_of(' ');
  if (b == std::string_view::npos) return 0;
  rest = rest.substr(b);
  unsigned long long kib = 0;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), kib);
  if (ec != std::errc() || end == rest.data()) return 0;
  std::string_view unit(end, static_cast<size_t>(rest.data() + rest.size() - end));
  if (unit != " kB") return 0;  // the kernel writes kibibytes as " kB"
  if (kib > ~size_t{0} / 1024) return 0;
  return static_cast<size_t>(kib) * 1024;
}

size_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  if (!f) return 0;
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return meminfo_available_bytes(text);
}

}  // namespace cumulus
