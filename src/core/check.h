// CUMULUS_CHECK and CUMULUS_FAIL: how the library's sources throw cumulus::Error with a
// message naming the function, the argument and its value. Private to the library (fmt
// formats the message, and fmt stays out of the public headers): include/cumulus/core/error.h
// has the Error class users catch.
#pragma once

#include <fmt/format.h>

#include "cumulus/core/error.h"

// CUMULUS_CHECK(cond, "n_q_heads={} must be a multiple of n_kv_heads={}", a, b)
// throws cumulus::Error("<function>: <message>") when cond is false.
#define CUMULUS_CHECK(cond, ...)                                                        \
  do {                                                                                  \
    if (!(cond)) [[unlikely]] {                                                         \
      throw ::cumulus::Error(__func__, ::fmt::format(__VA_ARGS__));                     \
    }                                                                                   \
  } while (0)

// Throws unconditionally, with the same message format.
#define CUMULUS_FAIL(...) \
  throw ::cumulus::Error(__func__, ::fmt::format(__VA_ARGS__))
