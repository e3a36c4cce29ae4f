// Numbers as every user-facing parser reads them (command-line options, method parameters):
// decimal only -- no octal "010", no hex "0x10", no "0b11", no leading '+' or spaces -- and
// never clamped: a value outside the type's range is an error that says so, as is a
// floating-point value that overflows or underflows to zero.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace cumulus {

// Each returns "" and sets *out, or says what is wrong with s ("is not a decimal integer",
// "is out of range [-2147483648, 2147483647]", "underflows: ..."); the caller puts the
// option or parameter and the value first ("--max-tokens: '0x10' is not a decimal integer").
std::string number_parse_int(std::string_view s, int64_t lo, int64_t hi, int64_t* out);
std::string number_parse_uint(std::string_view s, uint64_t hi, uint64_t* out);
std::string number_parse_double(std::string_view s, double* out);

}  // namespace cumulus
