// Scalar reference of the scoring ops (never optimised; the SIMD backend is tested against
// it). Quest's page bound (Quest section 3.2: for each channel the larger of q_j * min and
// q_j * max, summed), PSA's mean-key page score, and raw token scores q . k. Every sum is
// accumulated in float64 and rounded to float32 once at the end.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/scoring.h"

namespace cumulus::ref {

namespace {

// Checks shared by the three ops. n_out: how many scores the call writes (scores may be
// null when it writes none, e.g. the data() of an empty vector).
void check_view(std::string_view fn, const PagedHeadView& kv, const float* q, const void* scores, int64_t n_out) {
  if (kv.n_tokens < 0) throw Error(fmt::format("{}: kv.n_tokens={} must be >= 0", fn, kv.n_tokens));
  if (!head_dim_supported(kv.head_dim))
    throw Error(fmt::format("{}: kv.head_dim={} is not supported (multiples of 8 in [8, 256])", fn, kv.head_dim));
  if (kv.page_size < 1 || kv.page_size > 256 || (1 << kv.page_shift) != kv.page_size)
    throw Error(fmt::format("{}: kv.page_size={} does not match page_shift={}", fn, kv.page_size, kv.page_shift));
  if (q == nullptr) throw Error(fmt::format("{}: q must be non-null", fn));
  if (n_out > 0 && scores == nullptr) throw Error(fmt::format("{}: scores must be non-null", fn));
}

void check_page_meta(std::string_view fn, const PagedHeadView& kv, const float* a, const char* name) {
  if (kv.n_tokens > 0 && a == nullptr) throw Error(fmt::format("{}: kv.{} must be non-null", fn, name));
}

}  // namespace

void page_score_bound(const PagedHeadView& kv, const float* q, float* scores) {
  check_view(__func__, kv, q, scores, kv.n_tokens > 0 ? kv.n_pages() : 0);
  check_page_meta(__func__, kv, kv.kmin, "kmin");
  check_page_meta(__func__, kv, kv.kmax, "kmax");
  const int d = kv.head_dim;
  // kmin, kmax: [n_pages][head_dim]; scores: [n_pages]
  for (int p = 0; p < kv.n_pages(); ++p) {
    const float* mn = kv.kmin + static_cast<size_t>(p) * d;
    const float* mx = kv.kmax + static_cast<size_t>(p) * d;
    double s = 0;
    for (int j = 0; j < d; ++j) {
      const double a = static_cast<double>(q[j]) * mn[j];
      const double b = static_cast<double>(q[j]) * mx[j];
      s += a > b ? a : b;
    }
    scores[p] = static_cast<float>(s);
  }
}

void page_score_mean(const PagedHeadView& kv, const float* q, float* scores) {
  check_view(__func__, kv, q, scores, kv.n_tokens > 0 ? kv.n_pages() : 0);
  check_page_meta(__func__, kv, kv.kmean, "kmean");
  const int d = kv.head_dim;
  // kmean: [n_pages][head_dim]; scores: [n_pages]
  for (int p = 0; p < kv.n_pages(); ++p) {
    const float* m = kv.kmean + static_cast<size_t>(p) * d;
    double s = 0;
    for (int j = 0; j < d; ++j) s += static_cast<double>(q[j]) * m[j];
    scores[p] = static_cast<float>(s);
  }
}

void page_score_mean(const PagedHeadView& kv, const float* q, int n_q, float* scores) {
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  const size_t n_pages = kv.n_tokens > 0 ? static_cast<size_t>(kv.n_pages()) : 0;
  for (int h = 0; h < n_q; ++h)
    page_score_mean(kv, q + static_cast<size_t>(h) * kv.head_dim, scores + static_cast<size_t>(h) * n_pages);
}

float score_max(const float* x, int n) {
  CUMULUS_CHECK(n >= 0 && (n == 0 || x != nullptr), "score_max: n={} with x={}", n, static_cast<const void*>(x));
  float m = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

double score_exp(const float* x, int n, float scale, float shift, float* out) {
  CUMULUS_CHECK(n >= 0 && (n == 0 || (x != nullptr && out != nullptr)), "score_exp: n={} needs non-null x and out",
                n);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    const double e = std::exp(static_cast<double>(scale) * x[i] - shift);
    out[i] = static_cast<float>(e);
    sum += e;
  }
  return sum;
}

void token_score(const PagedHeadView& kv, const float* q, int n_q, const int32_t* idx, int n, float* scores) {
  check_view(__func__, kv, q, scores, static_cast<int64_t>(n_q) * n);
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  if (idx == nullptr) {
    CUMULUS_CHECK(n <= kv.n_tokens, "n={} exceeds kv.n_tokens={} (idx is null: tokens 0..n-1)", n, kv.n_tokens);
  } else {
    for (int i = 0; i < n; ++i)
      CUMULUS_CHECK(idx[i] >= 0 && idx[i] < kv.n_tokens, "idx[{}]={} out of range [0, {})", i, idx[i], kv.n_tokens);
  }
  if (n > 0) CUMULUS_CHECK(kv.k_pages != nullptr, "kv.k_pages must be non-null");
  const int d = kv.head_dim;
  std::vector<float> k(d);  // [head_dim] one key in float32
  // q: [n_q][head_dim]; scores: [n_q][n]
  for (int i = 0; i < n; ++i) {
    const int t = idx == nullptr ? i : idx[i];
    convert_to_f32(kv.key(t), kv.dtype, k.data(), d);
    for (int h = 0; h < n_q; ++h) {
      const float* qh = q + static_cast<size_t>(h) * d;
      double s = 0;
      for (int j = 0; j < d; ++j) s += static_cast<double>(qh[j]) * k[j];
      scores[static_cast<size_t>(h) * n + i] = static_cast<float>(s);
    }
  }
}

}  // namespace cumulus::ref
