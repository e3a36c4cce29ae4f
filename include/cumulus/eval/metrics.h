// Accuracy metrics of the evaluation harness (docs/architecture.md "Evaluation"): the KL
// divergence between two next-token distributions given as logits (Tactic 5.2.2 compares a
// sparse method's distribution with dense attention's), negative log-likelihood and
// perplexity of a continuation, and the summary statistics the reports print (mean,
// median, p95). Everything accumulates in float64.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace cumulus {

// log softmax(logits) [vocab], float64. Throws Error on an empty or non-finite input.
std::vector<double> log_softmax(std::span<const float> logits);

// KL(P || Q) = sum_i p_i (log p_i - log q_i) in nats, P = softmax(p_logits), Q =
// softmax(q_logits); both [vocab] of the same size. >= 0; 0 when the logits differ by a
// constant. Throws Error on a size mismatch or a non-finite logit.
double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits);
// The same with P given as log-probabilities (log_softmax of the reference, computed once).
double kl_divergence(std::span<const double> p_log_probs, std::span<const float> q_logits);

// -log softmax(logits)[token] in nats. Throws Error for a token outside [0, vocab).
double negative_log_likelihood(std::span<const float> logits, int32_t token);

// exp(mean(nll)): the perplexity of a continuation whose per-token NLLs are given.
// Throws Error on an empty input.
double perplexity(std::span<const double> nll);

// Quantile q in [0, 1] with linear interpolation between order statistics (the "linear"
// rule, numpy's default): position q (n - 1) in the sorted values. Throws Error on an empty
// input or q outside [0, 1]. NaN values are an error.
double quantile(std::span<const double> values, double q);

struct Summary {
  double mean = 0, median = 0, p95 = 0, min = 0, max = 0;
  int64_t count = 0;
};
// mean, median (quantile 0.5), p95 (quantile 0.95), min, max of `values` (count 0 and
// zeros for an empty input).
Summary summarize(std::span<const double> values);

}  // namespace cumulus
