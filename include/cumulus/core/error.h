// Errors: every public function checks its inputs and throws cumulus::Error with a message
// that names the function, the argument and its value, e.g.
//   "KvCache: page_size=0 must be a power of two in [1, 256]"
// (where() "KvCache", message() the rest).
// The library's sources throw through CUMULUS_CHECK / CUMULUS_FAIL (src/core/check.h,
// private: they format with fmt, which stays out of the public headers).
#pragma once

#include <stdexcept>
#include <string>

namespace cumulus {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what), message_(what) {}
  // what() is "where: message"; a command-line front end shows message() alone, which says
  // what is wrong in the user's terms (the option, the file, the value).
  Error(const std::string& where, const std::string& message)
      : std::runtime_error(where.empty() ? message : where + ": " + message), where_(where), message_(message) {}
  const std::string& where() const noexcept { return where_; }
  const std::string& message() const noexcept { return message_; }

 private:
  std::string where_, message_;
};

}  // namespace cumulus
