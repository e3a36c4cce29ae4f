// Checks the kernel and method tests share (attention, scoring, selection, k-means, KV
// cache, prefill, flexprefill, gemv): an Error naming a value, a run on every SIMD target
// this binary carries, and the error metrics the tolerances are stated in.
#pragma once

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kernels/simd.h"

namespace cumulus::check {

// fn() must throw cumulus::Error whose message contains `needle`.
template <class Fn>
void expect_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error, wanted one mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Runs fn once per SIMD target that is compiled in, supported here and within
// CUMULUS_SIMD's cap (kernels/simd.h), then restores that cap.
template <class Fn>
void for_each_target(Fn fn) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    fn();
  }
  cpu::simd_select_from_env();
}

// ||a - b|| / ||b||
inline double norm_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::sqrt(den);
}

inline double max_abs_err(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

}  // namespace cumulus::check
