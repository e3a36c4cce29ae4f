// Errors: every public function checks its inputs and throws cumulus::Error with a message
// that names the function, the argument and its value, e.g.
//   "KvCache: page_size=0 must be a power of two in [1, 256]".
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace cumulus {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace cumulus

// CUMULUS_CHECK(cond, "n_q_heads={} must be a multiple of n_kv_heads={}", a, b)
// throws cumulus::Error("<function>: <message>") when cond is false.
#define CUMULUS_CHECK(cond, ...)                                                        \
  do {                                                                                  \
    if (!(cond)) [[unlikely]] {                                                         \
      throw ::cumulus::Error(::fmt::format("{}: {}", __func__, ::fmt::format(__VA_ARGS__))); \
    }                                                                                   \
  } while (0)

// Throws unconditionally, with the same message format.
#define CUMULUS_FAIL(...) \
  throw ::cumulus::Error(::fmt::format("{}: {}", __func__, ::fmt::format(__VA_ARGS__)))
