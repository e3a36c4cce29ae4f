// Errors: every public function checks its inputs and throws cumulus::Error with a message
// that names the function, the argument and its value, e.g.
//   "KvCache: page_size=0 must be a power of two in [1, 256]".
// The library's sources throw through CUMULUS_CHECK / CUMULUS_FAIL (src/core/check.h,
// private: they format with fmt, which stays out of the public headers).
#pragma once

#include <stdexcept>
#include <string>

namespace cumulus {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace cumulus

// Programs built inside this tree that link the `cumulus` target (the CLI, the CUDA
// backend, tests, benchmarks) get CUMULUS_IN_TREE (CMakeLists.txt) and with it the check
// macros from here, for sources that include only this header. An installed package never
// defines it.
#if defined(CUMULUS_IN_TREE)
#include "core/check.h"
#endif
