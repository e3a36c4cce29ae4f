// Synthetic decode workload (docs/workload.md). Per (layer, kv head) the generator draws
//   - cluster centres c_j (unit, [n_clusters][head_dim]) with log-normal size weights;
//   - a sink direction u_s and a recent direction u_r (unit, orthogonal to each other);
// and writes keys token by token, in runs of consecutive tokens that share a cluster:
//   k_t = kKeyNorm * ( P(c_z + kKeyNoise xi_t) + [t < n_sinks] u_s + rho_t u_r )
// where P projects out u_s and u_r, xi_t ~ N(0, I / head_dim) and
// rho_t = exp(-(n-1-t) / recent_window) on the last 8 windows (0 before). Values mix a head
// mean, a per-cluster centre and noise (sinks' values are small, as in real models).
//
// A decode query of head h (kv head g = h / group) at one step is
//   q = q_c + alpha_s u_s + alpha_r u_r,   q_c = G sqrt(d) / kKeyNorm * P(qdir_h)
//   qdir_h = unit(sqrt(corr) a_g + sqrt(1 - corr) e_h),
//   a_g    = unit(kRelevantShare b_g + sqrt(1 - kRelevantShare^2) r_g)
// b_g mixes the step's few relevant cluster centres, r_g and e_h are random directions
// (a_g is shared by the group, which correlates its heads with cosine ~ corr). A random
// direction has cosine ~ N(0, 1/d) with every centre, so the content logits
// G qdir.(c_z + noise) are roughly Gaussian across tokens (log-normal, heavy-tailed
// attention weights) with standard deviation ~ kLogitStd * concentration, correlated within
// a cluster, plus a bump on the relevant clusters. Because q_c is orthogonal to u_s and
// u_r, the logits split exactly:
//   l_t = scale q_c.k_t + gamma [t < n_sinks] + beta rho_t
// and beta (recent band) and gamma (sinks) are solved against the stored keys to give each
// head its target shares of the softmax mass.
#include "cumulus/eval/synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numbers>

#include "core/check.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/methods/method.h"

namespace cumulus {

namespace {

constexpr float kKeyNorm = 4.0f;      // scale of every key (cancels out of the logits)
constexpr float kKeyNoise = 0.6f;     // isotropic key noise relative to the cluster centre
constexpr double kClusterSizeSigma = 1.0;  // log-normal spread of cluster size weights
// Standard deviation of the content logits across tokens at concentration 1 (before the
// per-head jitter). Log-normal weights of spread s need ~Phi(1.28 - s) of the tokens for 90%
// of the mass: s = 3 -> ~4%.
constexpr double kLogitStd = 3.0;
constexpr double kRelevantShare = 0.35;  // weight of the relevant clusters in a group's direction
constexpr float kSinkValueScale = 0.25f;  // sink tokens carry small values, as in real models
constexpr int kBandWindows = 8;       // the recent band spans 8 decay lengths
constexpr int kChunkTokens = 2048;    // tokens generated per append
constexpr int kScoreRows = 32;        // query rows scored per token_score call

// Tags that separate the random streams drawn from one seed.
enum : uint64_t { kTagHead = 1, kTagTokens = 2, kTagGroup = 3, kTagQuery = 4 };

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t stream_seed(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  uint64_t s = seed;
  uint64_t h = splitmix64(s);
  for (uint64_t x : {tag, a, b, c}) {
    s = h ^ (x + 0x632be59bd9b4e019ULL);
    h = splitmix64(s);
  }
  return h;
}

// splitmix64 stream with uniform and Gaussian draws (Box-Muller, second value cached).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return splitmix64(state_); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  uint64_t state_;
  double spare_ = 0;
  bool has_spare_ = false;
};

void random_unit(Rng& rng, float* x, int d) {
  double n2 = 0;
  for (int i = 0; i < d; ++i) {
    x[i] = static_cast<float>(rng.normal());
    n2 += static_cast<double>(x[i]) * x[i];
  }
  const float inv = static_cast<float>(1.0 / std::sqrt(n2));
  for (int i = 0; i < d; ++i) x[i] *= inv;
}

double dot(const float* a, const float* b, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// x -= (x.u) u for a unit u.
void project_out(float* x, const float* u, int d) {
  const float c = static_cast<float>(dot(x, u, d));
  for (int i = 0; i < d; ++i) x[i] -= c * u[i];
}

void normalize(float* x, int d) {
  const double n = std::sqrt(dot(x, x, d));
  const float inv = n > 0 ? static_cast<float>(1.0 / n) : 0.0f;
  for (int i = 0; i < d; ++i) x[i] *= inv;
}

// What one (layer, kv head) is made of. See the file comment.
struct HeadModel {
  int n_clusters = 0;
  std::vector<float> centres;   // [n_clusters][d] unit
  std::vector<float> vcentres;  // [n_clusters][d] unit
  std::vector<double> cdf;      // [n_clusters] cumulative size weights, last = 1
  std::vector<float> u_sink, u_recent, v_mean;  // [d]
};

HeadModel head_model_make(const SyntheticOptions& o, int layer, int kv_head) {
  const int d = o.shape.head_dim;
  Rng rng(stream_seed(o.seed, kTagHead, layer, kv_head));
  HeadModel m;
  m.n_clusters = std::max(4, o.n_tokens / o.tokens_per_cluster);
  m.centres.resize(static_cast<size_t>(m.n_clusters) * d);
  m.vcentres.resize(m.centres.size());
  m.cdf.resize(m.n_clusters);
  m.u_sink.resize(d);
  m.u_recent.resize(d);
  m.v_mean.resize(d);
  random_unit(rng, m.u_sink.data(), d);
  random_unit(rng, m.u_recent.data(), d);
  project_out(m.u_recent.data(), m.u_sink.data(), d);
  normalize(m.u_recent.data(), d);
  random_unit(rng, m.v_mean.data(), d);
  double total = 0;
  for (int j = 0; j < m.n_clusters; ++j) {
    random_unit(rng, &m.centres[static_cast<size_t>(j) * d], d);
    random_unit(rng, &m.vcentres[static_cast<size_t>(j) * d], d);
    total += std::exp(kClusterSizeSigma * rng.normal());
    m.cdf[j] = total;
  }
  for (double& c : m.cdf) c /= total;
  m.cdf.back() = 1.0;
  return m;
}

// Token stream of one (layer, kv head): the current cluster run survives across chunks.
struct HeadStream {
  Rng rng{0};
  int cluster = 0;
  int run_left = 0;
};

// Writes tokens [t0, t0 + n) of one kv head into k, v: [n][n_kv_heads][d] at column kv_head.
void head_tokens_write(const SyntheticOptions& o, const HeadModel& m, HeadStream& st, int kv_head, int t0, int n,
                       float* k, float* v) {
  const int d = o.shape.head_dim;
  const int n_kv = o.shape.n_kv_heads;
  const int band_start = std::max(o.n_sinks, o.n_tokens - kBandWindows * o.recent_window);
  const double p_stay = 1.0 - 1.0 / o.segment_length;  // geometric runs, mean segment_length
  const float noise = kKeyNoise / std::sqrt(static_cast<float>(d));
  for (int i = 0; i < n; ++i) {
    const int t = t0 + i;
    if (st.run_left == 0) {
      const double u = st.rng.uniform();
      st.cluster = static_cast<int>(std::lower_bound(m.cdf.begin(), m.cdf.end(), u) - m.cdf.begin());
      st.cluster = std::min(st.cluster, m.n_clusters - 1);
      st.run_left = 1;
      if (p_stay > 0) st.run_left += static_cast<int>(std::log(1.0 - st.rng.uniform()) / std::log(p_stay));
    }
    --st.run_left;
    float* kt = k + (static_cast<size_t>(i) * n_kv + kv_head) * d;
    float* vt = v + (static_cast<size_t>(i) * n_kv + kv_head) * d;
    const float* c = &m.centres[static_cast<size_t>(st.cluster) * d];
    const float* vc = &m.vcentres[static_cast<size_t>(st.cluster) * d];
    for (int j = 0; j < d; ++j) kt[j] = c[j] + noise * static_cast<float>(st.rng.normal());
    project_out(kt, m.u_sink.data(), d);
    project_out(kt, m.u_recent.data(), d);
    const float sink = t < o.n_sinks ? 1.0f : 0.0f;
    const float rho = t >= band_start ? std::exp(-static_cast<float>(o.n_tokens - 1 - t) / o.recent_window) : 0.0f;
    for (int j = 0; j < d; ++j) kt[j] = kKeyNorm * (kt[j] + sink * m.u_sink[j] + rho * m.u_recent[j]);
    const float vs = t < o.n_sinks ? kSinkValueScale : 1.0f;
    const float vnoise = 0.5f / std::sqrt(static_cast<float>(d));
    for (int j = 0; j < d; ++j)
      vt[j] = vs * (0.5f * m.v_mean[j] + 0.7f * vc[j] + vnoise * static_cast<float>(st.rng.normal()));
  }
}

double lognormal_jitter(Rng& rng, double sigma) { return std::exp(sigma * rng.normal() - 0.5 * sigma * sigma); }

// Target shares of one query head (after its per-head jitter).
struct QueryPlan {
  double sink_target = 0, recent_target = 0;
};

// Solves the recent-band boost beta and the sink boost gamma (in logits) for one query row
// so that the band holds `recent` of the non-sink mass and the sinks hold `sink` of all.
//   logit: [n] scale * q_c.k_t
void boosts_solve(const SyntheticOptions& o, const float* logit, int n, const QueryPlan& plan, double& beta,
                  double& gamma) {
  const int ns = std::min(o.n_sinks, n);
  const int band_start = std::max(ns, o.n_tokens - kBandWindows * o.recent_window);
  double mx = -1e300;
  for (int t = 0; t < n; ++t) mx = std::max(mx, static_cast<double>(logit[t]));
  double z_sink = 0, z_rest = 0;
  for (int t = 0; t < ns; ++t) z_sink += std::exp(logit[t] - mx);
  for (int t = ns; t < band_start; ++t) z_rest += std::exp(logit[t] - mx);
  std::vector<double> e_band(n - band_start), rho(n - band_start);
  for (int t = band_start; t < n; ++t) {
    e_band[t - band_start] = std::exp(logit[t] - mx);
    rho[t - band_start] = std::exp(-static_cast<double>(o.n_tokens - 1 - t) / o.recent_window);
  }
  auto band_mass = [&](double b) {
    double s = 0;
    for (size_t i = 0; i < e_band.size(); ++i) s += e_band[i] * std::exp(b * rho[i]);
    return s;
  };
  auto band_share = [&](double b) {
    const double s = band_mass(b);
    return s / (s + z_rest);
  };
  beta = 0;
  if (!e_band.empty() && plan.recent_target > 0 && band_share(0) < plan.recent_target) {
    double lo = 0, hi = 1;
    while (band_share(hi) < plan.recent_target && hi < 400) hi *= 2;
    for (int it = 0; it < 60; ++it) {
      const double mid = 0.5 * (lo + hi);
      (band_share(mid) < plan.recent_target ? lo : hi) = mid;
    }
    beta = 0.5 * (lo + hi);
  }
  gamma = 0;
  if (ns > 0 && plan.sink_target > 0) {
    const double z_non_sink = z_rest + band_mass(beta);
    gamma = std::log(plan.sink_target / (1.0 - plan.sink_target) * z_non_sink / z_sink);
  }
}

}  // namespace

Shape shape_preset(std::string_view name, int n_layers) {
  CUMULUS_CHECK(n_layers >= 1 && n_layers <= 1024, "n_layers={} must be in [1, 1024]", n_layers);
  if (name == "llama3-8b") return Shape{.n_layers = n_layers, .n_q_heads = 32, .n_kv_heads = 8, .head_dim = 128};
  if (name == "smollm2-135m") return Shape{.n_layers = n_layers, .n_q_heads = 9, .n_kv_heads = 3, .head_dim = 64};
  CUMULUS_FAIL("shape='{}' is unknown (known: llama3-8b, smollm2-135m)", name);
}

void SyntheticOptions::validate() const {
  shape.validate();
  CUMULUS_CHECK(n_tokens >= 16 && n_tokens <= (1 << 20), "n_tokens={} must be in [16, 1048576]", n_tokens);
  CUMULUS_CHECK(n_steps >= 1 && n_steps <= 4096, "n_steps={} must be in [1, 4096]", n_steps);
  CUMULUS_CHECK(std::isfinite(concentration) && concentration > 0 && concentration <= 16,
                "concentration={} must be in (0, 16]", concentration);
  CUMULUS_CHECK(n_sinks >= 0 && n_sinks <= 64 && n_sinks < n_tokens, "n_sinks={} must be in [0, 64] and < n_tokens={}",
                n_sinks, n_tokens);
  CUMULUS_CHECK(std::isfinite(sink_mass) && sink_mass >= 0 && sink_mass <= 0.9, "sink_mass={} must be in [0, 0.9]",
                sink_mass);
  CUMULUS_CHECK(recent_window >= 1 && recent_window <= 4096, "recent_window={} must be in [1, 4096]", recent_window);
  CUMULUS_CHECK(std::isfinite(recent_mass) && recent_mass >= 0 && recent_mass <= 0.9,
                "recent_mass={} must be in [0, 0.9]", recent_mass);
  CUMULUS_CHECK(std::isfinite(head_spread) && head_spread >= 0 && head_spread <= 2, "head_spread={} must be in [0, 2]",
                head_spread);
  CUMULUS_CHECK(tokens_per_cluster >= 1 && tokens_per_cluster <= n_tokens,
                "tokens_per_cluster={} must be in [1, n_tokens={}]", tokens_per_cluster, n_tokens);
  CUMULUS_CHECK(segment_length >= 1 && segment_length <= 4096, "segment_length={} must be in [1, 4096]",
                segment_length);
  CUMULUS_CHECK(relevant_clusters >= 1 && relevant_clusters <= 64, "relevant_clusters={} must be in [1, 64]",
                relevant_clusters);
  CUMULUS_CHECK(std::isfinite(head_correlation) && head_correlation >= 0 && head_correlation <= 1,
                "head_correlation={} must be in [0, 1]", head_correlation);
}

const float* SyntheticWorkload::query(int layer, int step) const {
  const Shape& s = options.shape;
  CUMULUS_CHECK(layer >= 0 && layer < s.n_layers, "layer={} out of range [0, {})", layer, s.n_layers);
  CUMULUS_CHECK(step >= 0 && step < options.n_steps, "step={} out of range [0, {})", step, options.n_steps);
  return queries.data() + (static_cast<size_t>(layer) * options.n_steps + step) * s.n_q_heads * s.head_dim;
}

SyntheticWorkload synthetic_generate(const SyntheticOptions& o, KvCache& kv, ThreadPool& pool) {
  o.validate();
  const Shape& s = o.shape;
  const Shape& ks = kv.shape();
  CUMULUS_CHECK(ks.n_layers == s.n_layers && ks.n_q_heads == s.n_q_heads && ks.n_kv_heads == s.n_kv_heads &&
                    ks.head_dim == s.head_dim,
                "cache shape ({} layers, {}/{} heads, head_dim {}) differs from options.shape ({}, {}/{}, {})",
                ks.n_layers, ks.n_q_heads, ks.n_kv_heads, ks.head_dim, s.n_layers, s.n_q_heads, s.n_kv_heads,
                s.head_dim);
  for (int l = 0; l < s.n_layers; ++l)
    CUMULUS_CHECK(kv.n_tokens(l) == 0, "cache layer {} already holds n_tokens={} (must be empty)", l, kv.n_tokens(l));
  CUMULUS_CHECK(o.n_tokens <= kv.options().max_tokens, "n_tokens={} exceeds the cache's max_tokens={}", o.n_tokens,
                kv.options().max_tokens);

  const int d = s.head_dim;
  const int n_kv = s.n_kv_heads;
  const int group = s.group();
  const int n = o.n_tokens;
  const float scale = attention_scale(d);

  SyntheticWorkload w;
  w.options = o;
  w.queries.assign(static_cast<size_t>(s.n_layers) * o.n_steps * s.n_q_heads * d, 0.0f);

  for (int layer = 0; layer < s.n_layers; ++layer) {
    std::vector<HeadModel> models(n_kv);
    std::vector<HeadStream> streams(n_kv);
    pool.parallel_for(n_kv, [&](int64_t h, int) {
      models[h] = head_model_make(o, layer, static_cast<int>(h));
      streams[h].rng = Rng(stream_seed(o.seed, kTagTokens, layer, h));
    });

    // Keys and values, chunk by chunk; each kv head continues its own random stream, so the
    // result does not depend on which thread ran which head.
    std::vector<float> kbuf(static_cast<size_t>(kChunkTokens) * n_kv * d), vbuf(kbuf.size());
    for (int t0 = 0; t0 < n; t0 += kChunkTokens) {
      const int m = std::min(kChunkTokens, n - t0);
      pool.parallel_for(n_kv, [&](int64_t h, int) {
        head_tokens_write(o, models[h], streams[h], static_cast<int>(h), t0, m, kbuf.data(), vbuf.data());
      });
      kv.append(layer, kbuf.data(), vbuf.data(), m);
    }

    // Queries, calibrated against the stored keys.
    pool.parallel_for(n_kv, [&](int64_t g, int) {
      const HeadModel& hm = models[g];
      const PagedHeadView view = kv.view(layer, static_cast<int>(g));
      const int n_rows = o.n_steps * group;  // row r: step r / group, head g * group + r % group
      std::vector<float> qc(static_cast<size_t>(n_rows) * d);
      std::vector<QueryPlan> plans(n_rows);
      std::vector<float> b(d), e(d);
      const float rel = static_cast<float>(kRelevantShare);
      const float rel_rest = std::sqrt(1.0f - rel * rel);
      const float corr = std::sqrt(static_cast<float>(o.head_correlation));
      const float corr_rest = std::sqrt(static_cast<float>(1.0 - o.head_correlation));
      // Gain that turns a unit direction into content logits of std ~kLogitStd: a random
      // direction's cosine with a key of this model has variance (1 + kKeyNoise^2) / d.
      const double gain0 = o.concentration * kLogitStd * std::sqrt(d / (1.0 + kKeyNoise * kKeyNoise));
      for (int step = 0; step < o.n_steps; ++step) {
        Rng grng(stream_seed(o.seed, kTagGroup, layer, step, g));
        std::fill(b.begin(), b.end(), 0.0f);
        for (int r = 0; r < o.relevant_clusters; ++r) {
          const int j = static_cast<int>(grng.next() % static_cast<uint64_t>(hm.n_clusters));
          const float wj = static_cast<float>(lognormal_jitter(grng, 0.5));
          for (int i = 0; i < d; ++i) b[i] += wj * hm.centres[static_cast<size_t>(j) * d + i];
        }
        normalize(b.data(), d);
        random_unit(grng, e.data(), d);
        for (int i = 0; i < d; ++i) b[i] = rel * b[i] + rel_rest * e[i];  // a_g
        normalize(b.data(), d);
        for (int k = 0; k < group; ++k) {
          const int qh = static_cast<int>(g) * group + k;
          Rng qrng(stream_seed(o.seed, kTagQuery, layer, step, qh));
          random_unit(qrng, e.data(), d);
          float* q = &qc[(static_cast<size_t>(step) * group + k) * d];
          for (int i = 0; i < d; ++i) q[i] = corr * b[i] + corr_rest * e[i];
          project_out(q, hm.u_sink.data(), d);
          project_out(q, hm.u_recent.data(), d);
          normalize(q, d);
          const double gain = gain0 * lognormal_jitter(qrng, 0.4 * o.head_spread);
          const float qscale = static_cast<float>(gain * std::sqrt(static_cast<double>(d)) / kKeyNorm);
          for (int i = 0; i < d; ++i) q[i] *= qscale;
          QueryPlan& p = plans[step * group + k];
          p.sink_target = std::min(0.95, o.sink_mass * lognormal_jitter(qrng, o.head_spread));
          p.recent_target = std::min(0.95, o.recent_mass * lognormal_jitter(qrng, o.head_spread));
        }
      }
      std::vector<float> scores(static_cast<size_t>(kScoreRows) * n);
      for (int r0 = 0; r0 < n_rows; r0 += kScoreRows) {
        const int nr = std::min(kScoreRows, n_rows - r0);
        cpu::token_score(view, &qc[static_cast<size_t>(r0) * d], nr, nullptr, n, scores.data());
        for (int r = r0; r < r0 + nr; ++r) {
          float* logit = &scores[static_cast<size_t>(r - r0) * n];
          for (int t = 0; t < n; ++t) logit[t] *= scale;
          double beta = 0, gamma = 0;
          boosts_solve(o, logit, n, plans[r], beta, gamma);
          const int step = r / group;
          const int qh = static_cast<int>(g) * group + r % group;
          float* q = w.queries.data() + ((static_cast<size_t>(layer) * o.n_steps + step) * s.n_q_heads + qh) * d;
          const float a_s = static_cast<float>(gamma / (scale * kKeyNorm));
          const float a_r = static_cast<float>(beta / (scale * kKeyNorm));
          for (int i = 0; i < d; ++i)
            q[i] = qc[static_cast<size_t>(r) * d + i] + a_s * hm.u_sink[i] + a_r * hm.u_recent[i];
        }
      }
    });
  }
  return w;
}

AttentionProfile attention_profile(const KvCache& kv, const SyntheticWorkload& w, int layer, double topp,
                                   ThreadPool& pool) {
  const SyntheticOptions& o = w.options;
  CUMULUS_CHECK(layer >= 0 && layer < o.shape.n_layers, "layer={} out of range [0, {})", layer, o.shape.n_layers);
  return attention_profile(kv, layer, w.query(layer, 0), o.n_steps, nullptr, o.n_sinks, o.recent_window, topp, pool);
}

namespace {

// A level that keeps some tokens or pages and drops the `n_dropped` listed in `dropped`:
// over the group's heads (share[k * stride + i]: item i's exact share of head k's mass), the
// mean mass kept and the share of heads whose kept mass reaches topp.
struct KeptFigures {
  double mass = 0, reach = 0;
};
KeptFigures kept_figures(const std::vector<double>& share, size_t stride, int group, const int* dropped,
                         size_t n_dropped, double topp) {
  double mass = 0;
  int reach = 0;
  for (int k = 0; k < group; ++k) {
    double lost = 0;
    for (size_t i = 0; i < n_dropped; ++i) lost += share[static_cast<size_t>(k) * stride + dropped[i]];
    mass += 1 - lost;
    reach += 1 - lost >= topp * (1 - 1e-12);
  }
  return {mass / group, static_cast<double>(reach) / group};
}

}  // namespace

AttentionProfile attention_profile(const KvCache& kv, int layer, const float* queries, int n_steps,
                                   const int* n_attended, int n_sinks, int recent_window, double topp,
                                   ThreadPool& pool) {
  const Shape& s = kv.shape();
  CUMULUS_CHECK(std::isfinite(topp) && topp > 0 && topp <= 1, "topp={} must be in (0, 1]", topp);
  CUMULUS_CHECK(layer >= 0 && layer < s.n_layers, "layer={} out of range [0, {})", layer, s.n_layers);
  CUMULUS_CHECK(queries != nullptr && n_steps >= 1, "queries must be non-null and n_steps={} >= 1", n_steps);
  CUMULUS_CHECK(n_sinks >= 0 && recent_window >= 0, "n_sinks={} and recent_window={} must be >= 0", n_sinks,
                recent_window);
  const int n_cached = kv.n_tokens(layer);
  CUMULUS_CHECK(n_cached > 0, "layer {} of the cache is empty", layer);
  for (int st = 0; n_attended != nullptr && st < n_steps; ++st)
    CUMULUS_CHECK(n_attended[st] >= 1 && n_attended[st] <= n_cached,
                  "n_attended[{}]={} out of range [1, {}] (tokens cached)", st, n_attended[st], n_cached);
  const int d = s.head_dim;
  const int group = s.group();
  const int n_rows = n_steps * group;  // row r: step r / group, query head g * group + r % group
  const float scale = attention_scale(d);
  // Rows are scored a whole number of steps at a time, so a group's heads are together.
  const int steps_per_chunk = std::max(1, kScoreRows / group);
  // Per (kv head, row): sink mass, recent mass, top-p fraction; per (kv head, step): the
  // group's union share, mean pairwise logit correlation and top-p Jaccard (NaN: group 1).
  std::vector<double> sink(static_cast<size_t>(s.n_kv_heads) * n_rows), recent(sink.size()), frac(sink.size());
  std::vector<double> uni(static_cast<size_t>(s.n_kv_heads) * n_steps), corr(uni.size()), jac(uni.size());
  // Per (kv head, step): the page level's figures (AttentionProfile::page_*).
  std::vector<double> adm(uni.size()), keep_mass[2] = {std::vector<double>(uni.size()), std::vector<double>(uni.size())},
                                       keep_reach[2] = {keep_mass[0], keep_mass[0]};
  std::vector<double> b1_mass[2] = {keep_mass[0], keep_mass[0]}, b1_reach[2] = {keep_mass[0], keep_mass[0]};
  pool.parallel_for(s.n_kv_heads, [&](int64_t g, int) {
    const PagedHeadView view = kv.view(layer, static_cast<int>(g));
    const bool page_stats = view.kmin != nullptr && view.kmax != nullptr;
    const int n_pages = view.n_pages();
    // [head of the group][page]: the page's exact share of the head's mass, and its upper-bound
    // share (len_p exp(scale U_p - mx) / z).
    std::vector<double> pmass(static_cast<size_t>(group) * n_pages), pbound(pmass.size());
    std::vector<int> cand;
    // The 1-bit sketch: per channel the mean and mean absolute deviation of the cached keys,
    // per token and channel the side of the mean (1: at or above).
    std::vector<double> mu(d, 0.0), dev(d, 0.0);
    std::vector<uint8_t> above(static_cast<size_t>(n_cached) * d);
    {
      std::vector<float> row(d);
      for (int t = 0; t < n_cached; ++t) {
        convert_to_f32(view.key(t), view.dtype, row.data(), d);
        for (int c = 0; c < d; ++c) mu[c] += row[c];
      }
      for (int c = 0; c < d; ++c) mu[c] /= n_cached;
      for (int t = 0; t < n_cached; ++t) {
        convert_to_f32(view.key(t), view.dtype, row.data(), d);
        for (int c = 0; c < d; ++c) {
          dev[c] += std::abs(row[c] - mu[c]);
          above[static_cast<size_t>(t) * d + c] = row[c] >= mu[c];
        }
      }
      for (int c = 0; c < d; ++c) dev[c] /= n_cached;
    }
    // [head][token]: the exact share of the head's mass, and the 1-bit estimate's log weight
    // relative to the head's largest.
    std::vector<double> tshare(static_cast<size_t>(group) * n_cached), b1key(tshare.size());
    std::vector<int> tcand;
    const int rows_chunk = steps_per_chunk * group;
    std::vector<float> q(static_cast<size_t>(rows_chunk) * d), scores(static_cast<size_t>(rows_chunk) * n_cached);
    std::vector<double> p(n_cached), sorted(n_cached);
    std::vector<uint8_t> in_set(static_cast<size_t>(group) * n_cached);
    for (int st0 = 0; st0 < n_steps; st0 += steps_per_chunk) {
      const int ns = std::min(steps_per_chunk, n_steps - st0);
      for (int r = 0; r < ns * group; ++r)
        std::memcpy(&q[static_cast<size_t>(r) * d],
                    queries + (static_cast<size_t>(st0 + r / group) * s.n_q_heads + g * group + r % group) * d,
                    d * sizeof(float));
      cpu::token_score(view, q.data(), ns * group, nullptr, n_cached, scores.data());
      for (int st = st0; st < st0 + ns; ++st) {
        const int n = n_attended != nullptr ? n_attended[st] : n_cached;
        for (int k = 0; k < group; ++k) {
          const int r = st * group + k;
          const float* sc = &scores[static_cast<size_t>((st - st0) * group + k) * n_cached];
          double mx = -1e300, z = 0;
          for (int t = 0; t < n; ++t) mx = std::max(mx, static_cast<double>(sc[t]) * scale);
          for (int t = 0; t < n; ++t) z += p[t] = std::exp(static_cast<double>(sc[t]) * scale - mx);
          double ms = 0, mr = 0;
          for (int t = 0; t < std::min(n_sinks, n); ++t) ms += p[t];
          for (int t = std::max(0, n - recent_window); t < n; ++t) mr += p[t];
          std::copy_n(p.begin(), n, sorted.begin());
          std::sort(sorted.begin(), sorted.begin() + n, std::greater<>());
          const double target = topp * z;
          double acc = 0;
          int count = n;
          for (int t = 0; t < n; ++t) {
            acc += sorted[t];
            if (acc >= target * (1 - 1e-12)) {
              count = t + 1;
              break;
            }
          }
          // The set: weights at or above the count-th largest (ties may add a few tokens).
          const double thr = sorted[count - 1];
          uint8_t* mine = &in_set[static_cast<size_t>(k) * n_cached];
          for (int t = 0; t < n; ++t) mine[t] = p[t] >= thr;
          const size_t i = static_cast<size_t>(g) * n_rows + r;
          sink[i] = ms / z;
          recent[i] = mr / z;
          frac[i] = static_cast<double>(count) / n;
          const float* qr = &q[static_cast<size_t>((st - st0) * group + k) * d];
          {
            double base = 0;
            for (int c = 0; c < d; ++c) base += qr[c] * mu[c];
            double emax = -1e300;
            double* bk = &b1key[static_cast<size_t>(k) * n_cached];
            for (int t = 0; t < n; ++t) {
              double e = base;
              const uint8_t* a = &above[static_cast<size_t>(t) * d];
              for (int c = 0; c < d; ++c) e += (a[c] ? 1.0 : -1.0) * qr[c] * dev[c];
              bk[t] = e * scale;
              emax = std::max(emax, bk[t]);
              tshare[static_cast<size_t>(k) * n_cached + t] = p[t] / z;
            }
            for (int t = 0; t < n; ++t) bk[t] -= emax;
          }
          if (!page_stats) continue;
          for (int pg = 0; pg < (n + view.page_size - 1) >> view.page_shift; ++pg) {
            const float* lo = view.kmin + static_cast<size_t>(pg) * d;
            const float* hi = view.kmax + static_cast<size_t>(pg) * d;
            double ub = 0;
            for (int c = 0; c < d; ++c)
              ub += std::max(static_cast<double>(qr[c]) * lo[c], static_cast<double>(qr[c]) * hi[c]);
            const int t0 = pg << view.page_shift, t1 = std::min(n, t0 + view.page_size);
            double pm = 0;
            for (int t = t0; t < t1; ++t) pm += p[t];
            pmass[static_cast<size_t>(k) * n_pages + pg] = pm / z;
            pbound[static_cast<size_t>(k) * n_pages + pg] = (t1 - t0) * std::exp(ub * scale - mx) / z;
          }
        }
        {
          // The 1-bit token level: candidates past the sinks and before the recent band, the
          // largest group key first (ties to the earlier token).
          tcand.clear();
          for (int t = std::min(n_sinks, n); t < std::max(std::min(n_sinks, n), n - recent_window); ++t) tcand.push_back(t);
          std::vector<double> key(n);
          for (int t : tcand) {
            double m = -1e300;
            for (int k = 0; k < group; ++k) m = std::max(m, b1key[static_cast<size_t>(k) * n_cached + t]);
            key[t] = m;
          }
          std::stable_sort(tcand.begin(), tcand.end(), [&](int a, int b) { return key[a] > key[b]; });
          const size_t u = static_cast<size_t>(g) * n_steps + st;
          for (int b = 0; b < 2; ++b) {
            const size_t keep =
                std::min(tcand.size(), static_cast<size_t>(std::ceil(AttentionProfile::keep_budget[b] * n)));
            const KeptFigures f = kept_figures(tshare, n_cached, group, tcand.data() + keep, tcand.size() - keep, topp);
            b1_mass[b][u] = f.mass;
            b1_reach[b][u] = f.reach;
          }
        }
        if (page_stats) {
          // Candidates: pages with no sink and no recent token; the others are always kept.
          const int np = (n + view.page_size - 1) >> view.page_shift;
          cand.clear();
          for (int pg = 0; pg < np; ++pg)
            if ((pg << view.page_shift) >= n_sinks && std::min(n, (pg + 1) << view.page_shift) <= n - recent_window)
              cand.push_back(pg);
          auto share = [&](int pg) {  // the largest upper-bound share over the group's heads
            double m = 0;
            for (int k = 0; k < group; ++k) m = std::max(m, pbound[static_cast<size_t>(k) * n_pages + pg]);
            return m;
          };
          std::vector<double> key(np);
          for (int pg : cand) key[pg] = share(pg);
          std::sort(cand.begin(), cand.end(), [&](int a, int b) { return key[a] < key[b] || (key[a] == key[b] && a < b); });
          std::vector<double> used(group, 0.0);
          int skipped = 0;
          for (int pg : cand) {
            bool fits = true;
            for (int k = 0; k < group; ++k) fits &= used[k] + pbound[static_cast<size_t>(k) * n_pages + pg] <= 1 - topp;
            if (!fits) break;
            for (int k = 0; k < group; ++k) used[k] += pbound[static_cast<size_t>(k) * n_pages + pg];
            ++skipped;
          }
          const size_t u = static_cast<size_t>(g) * n_steps + st;
          adm[u] = static_cast<double>(skipped) / np;
          for (int b = 0; b < 2; ++b) {
            // Kept: the forced pages and the candidates of the largest bound share, budget x np.
            const size_t keep = std::min(cand.size(), static_cast<size_t>(std::ceil(
                                                          AttentionProfile::keep_budget[b] * np)));
            // cand ascends by share: the first size - keep are dropped
            const KeptFigures f = kept_figures(pmass, n_pages, group, cand.data(), cand.size() - keep, topp);
            keep_mass[b][u] = f.mass;
            keep_reach[b][u] = f.reach;
          }
        }
        // The group: union of the heads' sets; per pair of heads the Pearson correlation of
        // the logits over the content tokens (past the sinks, before the recent window) and
        // the Jaccard of their sets.
        int n_union = 0;
        for (int t = 0; t < n; ++t) {
          bool any = false;
          for (int k = 0; k < group; ++k) any |= in_set[static_cast<size_t>(k) * n_cached + t] != 0;
          n_union += any;
        }
        const int c0 = std::min(n_sinks, n), c1 = std::max(c0, n - recent_window);
        double corr_sum = 0, jac_sum = 0;
        int pairs = 0;
        for (int a = 0; a < group; ++a)
          for (int b = a + 1; b < group; ++b) {
            const float* la = &scores[static_cast<size_t>((st - st0) * group + a) * n_cached];
            const float* lb = &scores[static_cast<size_t>((st - st0) * group + b) * n_cached];
            double sa = 0, sb = 0, saa = 0, sbb = 0, sab = 0;
            for (int t = c0; t < c1; ++t) {
              sa += la[t], sb += lb[t], saa += static_cast<double>(la[t]) * la[t];
              sbb += static_cast<double>(lb[t]) * lb[t], sab += static_cast<double>(la[t]) * lb[t];
            }
            const double m = std::max(1, c1 - c0);
            const double va = saa / m - (sa / m) * (sa / m), vb = sbb / m - (sb / m) * (sb / m);
            corr_sum += va > 0 && vb > 0 ? (sab / m - (sa / m) * (sb / m)) / std::sqrt(va * vb) : 0.0;
            int inter = 0, either = 0;
            const uint8_t* ia = &in_set[static_cast<size_t>(a) * n_cached];
            const uint8_t* ib = &in_set[static_cast<size_t>(b) * n_cached];
            for (int t = 0; t < n; ++t) inter += ia[t] & ib[t], either += ia[t] | ib[t];
            jac_sum += either > 0 ? static_cast<double>(inter) / either : 1.0;
            ++pairs;
          }
        const size_t u = static_cast<size_t>(g) * n_steps + st;
        uni[u] = static_cast<double>(n_union) / n;
        corr[u] = pairs > 0 ? corr_sum / pairs : std::nan("");
        jac[u] = pairs > 0 ? jac_sum / pairs : std::nan("");
      }
    }
  });
  AttentionProfile prof;
  prof.topp = topp;
  const double m = static_cast<double>(sink.size());
  for (size_t i = 0; i < sink.size(); ++i) {
    prof.sink_mass += sink[i] / m;
    prof.recent_mass += recent[i] / m;
    prof.topp_fraction += frac[i] / m;
  }
  const double mu = static_cast<double>(uni.size());
  for (size_t i = 0; i < uni.size(); ++i) {
    prof.union_fraction += uni[i] / mu;
    prof.group_logit_corr += corr[i] / mu;
    prof.group_jaccard += jac[i] / mu;
  }
  prof.union_inflation = prof.topp_fraction > 0 ? prof.union_fraction / prof.topp_fraction : 0.0;
  for (size_t i = 0; i < uni.size(); ++i)
    for (int b = 0; b < 2; ++b) {
      prof.bit1_keep_mass[b] += b1_mass[b][i] / mu;
      prof.bit1_keep_reach[b] += b1_reach[b][i] / mu;
    }
  if (kv.view(layer, 0).kmin == nullptr) {
    prof.page_admissible = std::nan("");
    for (int b = 0; b < 2; ++b) prof.page_keep_mass[b] = prof.page_keep_reach[b] = std::nan("");
  } else {
    for (size_t i = 0; i < uni.size(); ++i) {
      prof.page_admissible += adm[i] / mu;
      for (int b = 0; b < 2; ++b) {
        prof.page_keep_mass[b] += keep_mass[b][i] / mu;
        prof.page_keep_reach[b] += keep_reach[b][i] / mu;
      }
    }
  }
  std::sort(frac.begin(), frac.end());
  auto quantile = [&](double qq) { return frac[static_cast<size_t>(qq * (frac.size() - 1) + 0.5)]; };
  prof.topp_fraction_p10 = quantile(0.1);
  prof.topp_fraction_p50 = quantile(0.5);
  prof.topp_fraction_p90 = quantile(0.9);
  return prof;
}

}  // namespace cumulus
