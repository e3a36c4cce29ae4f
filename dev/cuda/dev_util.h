// What every dev/cuda program shares: the median of timings, comma lists of whole numbers
// and option values read strictly (core/number.h: decimal, in range, the whole text), and
// main(), which reports bad input (cumulus::Error: what, which value) and any other failure
// as "<program>: error: ..." with exit status 1.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "cumulus/core/error.h"
#include "cumulus/core/number.h"

namespace cumulus::cuda::dev {

inline double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// The value of option `name`: a decimal whole number in [1, INT_MAX].
inline int positive_int(const std::string& name, const std::string& v) {
  int64_t x = 0;
  const std::string err = number_parse_int(v, 1, INT_MAX, &x);
  CUMULUS_CHECK(err.empty(), "{}='{}': {}", name, v, err);
  return static_cast<int>(x);
}

// The value of option `name`: a decimal number.
inline double real(const std::string& name, const std::string& v) {
  double x = 0;
  const std::string err = number_parse_double(v, &x);
  CUMULUS_CHECK(err.empty(), "{}='{}': {}", name, v, err);
  return x;
}

// "1,16" -> {1, 16}; every item a decimal whole number >= 1, none empty.
inline std::vector<int> ints(const std::string& name, const std::string& s) {
  std::vector<int> r;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) r.push_back(positive_int(name, x));
  CUMULUS_CHECK(!r.empty() && s.back() != ',', "{}='{}' has an empty item", name, s);
  return r;
}

template <typename Run>
int main_of(const char* program, Run run, int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const Error& e) {  // bad input: what, which value
    fmt::print(stderr, "{}: error: {}\n", program, e.message());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error: {}\n", program, e.what());
    return 1;
  }
}

}  // namespace cumulus::cuda::dev
