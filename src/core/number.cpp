// Decimal numbers for user-facing parsers (core/number.h), on std::from_chars: decimal
// only, no locale, no clamping.
#include "cumulus/core/number.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdlib>

namespace cumulus {
namespace {

// Digits with an optional leading '-' (allow_minus), nothing else.
bool is_decimal_integer(std::string_view s, bool allow_minus) {
  size_t i = allow_minus && !s.empty() && s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  for (; i < s.size(); ++i)
    if (s[i] < '0' || s[i] > '9') return false;
  return true;
}

}  // namespace

std::string number_parse_int(std::string_view s, int64_t lo, int64_t hi, int64_t* out) {
  if (!is_decimal_integer(s, true)) return "is not a decimal integer";
  int64_t v = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (r.ec != std::errc() || v < lo || v > hi) return fmt::format("is out of range [{}, {}]", lo, hi);
  *out = v;
  return "";
}

std::string number_parse_uint(std::string_view s, uint64_t hi, uint64_t* out) {
  if (!is_decimal_integer(s, false))
    return "is not a non-negative decimal integer";
  uint64_t v = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (r.ec != std::errc() || v > hi) return fmt::format("is out of range [0, {}]", hi);
  *out = v;
  return "";
}

std::string number_parse_double(std::string_view s, double* out) {
  // from_chars' general format: [-]digits[.digits][e[+-]digits]; also "inf" and "nan",
  // refused below. A leading '+' and hex are not in it.
  double v = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), v, std::chars_format::general);
  if (r.ptr != s.data() + s.size() || (r.ec != std::errc() && r.ec != std::errc::result_out_of_range) ||
      s.empty())
    return "is not a decimal number";
  if (r.ec == std::errc::result_out_of_range) {
    // Overflow or underflow: strtod tells which (HUGE_VAL or a value at or near 0).
    const double x = std::strtod(std::string(s).c_str(), nullptr);
    if (std::isinf(x)) return fmt::format("is out of range: its magnitude exceeds {:g}", 1.7976931348623157e308);
    return fmt::format("underflows: its magnitude is below the smallest double, {:g} (write 0 for zero)",
                       4.9406564584124654e-324);
  }
  if (!std::isfinite(v)) return "is not a finite number";
  *out = v;
  return "";
}

}  // namespace cumulus
