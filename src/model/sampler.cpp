// Sampling. Greedy is argmax with the lowest id winning ties, so it is reproducible
// across backends; temperature and top-p draw from a seeded mt19937_64.
#include "cumulus/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"

namespace cumulus {

Sampler::Sampler(const SamplerOptions& options) : opt_(options), rng_(options.seed) {
  CUMULUS_CHECK(std::isfinite(opt_.temperature) && opt_.temperature >= 0, "temperature={} must be >= 0",
                opt_.temperature);
  CUMULUS_CHECK(opt_.top_p > 0 && opt_.top_p <= 1, "top_p={} must be in (0, 1]", opt_.top_p);
}

int32_t Sampler::sample(std::span<const float> logits) {
  CUMULUS_CHECK(!logits.empty(), "logits are empty");
  for (size_t i = 0; i < logits.size(); ++i)
    CUMULUS_CHECK(!std::isnan(logits[i]), "logit of token {} is NaN", i);
  if (opt_.temperature == 0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const float mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) sum += (p[i] = std::exp((logits[i] - mx) / opt_.temperature));
  std::vector<int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  size_t keep = p.size();
  if (opt_.top_p < 1) {
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    double acc = 0;
    keep = 0;
    while (keep < order.size() && acc < opt_.top_p * sum) acc += p[order[keep++]];
    sum = acc;
  }
  const double r = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  double acc = 0;
  for (size_t j = 0; j < keep; ++j) {
    acc += p[order[j]];
    if (r < acc) return order[j];
  }
  return order[keep - 1];
}

}  // namespace cumulus
