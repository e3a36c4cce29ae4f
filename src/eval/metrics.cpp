// Metrics of the evaluation harness (see metrics.h): log-softmax, KL divergence, NLL,
// perplexity and quantiles, in float64.
#include "cumulus/eval/metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace cumulus {
namespace {

// log sum_i exp(x_i), max-shifted, float64.
double log_sum_exp(std::span<const float> x) {
  double m = -INFINITY;
  for (size_t i = 0; i < x.size(); ++i) {
    CUMULUS_CHECK(std::isfinite(x[i]), "logit {} at index {} is not finite", x[i], i);
    m = std::max(m, static_cast<double>(x[i]));
  }
  double s = 0;
  for (float v : x) s += std::exp(static_cast<double>(v) - m);
  return m + std::log(s);
}

}  // namespace

std::vector<double> log_softmax(std::span<const float> logits) {
  CUMULUS_CHECK(!logits.empty(), "logits are empty");
  const double lse = log_sum_exp(logits);
  std::vector<double> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
  return out;
}

double kl_divergence(std::span<const double> p_log_probs, std::span<const float> q_logits) {
  CUMULUS_CHECK(p_log_probs.size() == q_logits.size() && !q_logits.empty(),
                "distributions of different sizes: P has {} entries, Q has {}", p_log_probs.size(), q_logits.size());
  const double lse_q = log_sum_exp(q_logits);
  double kl = 0;
  for (size_t i = 0; i < q_logits.size(); ++i) {
    const double lp = p_log_probs[i];
    if (lp == -INFINITY) continue;  // p_i = 0 contributes nothing
    kl += std::exp(lp) * (lp - (static_cast<double>(q_logits[i]) - lse_q));
  }
  // Rounding can leave a tiny negative value when P == Q.
  return std::max(kl, 0.0);
}

double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  CUMULUS_CHECK(p_logits.size() == q_logits.size(), "distributions of different sizes: P has {} entries, Q has {}",
                p_logits.size(), q_logits.size());
  const std::vector<double> lp = log_softmax(p_logits);
  return kl_divergence(std::span<const double>(lp), q_logits);
}

double negative_log_likelihood(std::span<const float> logits, int32_t token) {
  CUMULUS_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "token={} is outside [0, {})", token,
                logits.size());
  return log_sum_exp(logits) - static_cast<double>(logits[token]);
}

double perplexity(std::span<const double> nll) {
  CUMULUS_CHECK(!nll.empty(), "no tokens: perplexity of an empty continuation");
  return std::exp(std::accumulate(nll.begin(), nll.end(), 0.0) / static_cast<double>(nll.size()));
}

double quantile(std::span<const double> values, double q) {
  CUMULUS_CHECK(!values.empty(), "quantile of an empty set");
  CUMULUS_CHECK(q >= 0 && q <= 1, "q={} must be in [0, 1]", q);
  std::vector<double> v(values.begin(), values.end());
  for (double x : v) CUMULUS_CHECK(!std::isnan(x), "NaN among the {} values", v.size());
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

Summary summarize(std::span<const double> values) {
  Summary s;
  if (values.empty()) return s;
  s.count = static_cast<int64_t>(values.size());
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  s.median = quantile(values, 0.5);
  s.p95 = quantile(values, 0.95);
  s.min = *std::min_element(values.begin(), values.end());
  s.max = *std::max_element(values.begin(), values.end());
  return s;
}

}  // namespace cumulus
