// lfps: Learn From the Past for Sparse indexing (LFPS paper, section 4.2, Algorithm 1, Eq. 4-10,
// Appendix B). Each query head keeps two score tables over key positions, learnt from past
// attention: vertical (fixed positions) and slash (fixed distances to the query).
//   on_prefill (Eq. 4): the tables from the attention of the last s prompt queries,
//     scaled by 1 / (2 s (1 - r)) so each sums to 0.5 / (1 - r) (Eq. 15); per head the
//     mean key, mean value and sigma-hat^2 = Var(q.k / sqrt(d)) / ||q||^2 of the last
//     prompt query (section 4.2).
//   decode (Algorithm 1): the sink ratio rho = w_sink / (w_sink + w_global + w_local)
//     (Eq. 5-6); rho > epsilon: output the mean value vector (bypass). Otherwise
//     thresholds tau = a * mean / kappa from the tables' kurtosis (Eq. 8), candidates
//     C0 = {Phi_ver > tau_ver} u {Phi_sla > tau_sla} (Eq. 7), expanded by offsets
//     {-1, 0, 1, 2} keeping positions whose Phi_ver or Phi_sla exceeds its mean (Eq. 9),
//     exact top-k over the candidates (C2), attended with the first `sinks` tokens, and
//     the tables updated with decay r (Eq. 10) using C2's attention weights.
// The sink tokens are outside the tables (footnote 1: they stay on the GPU "to prevent
// bias"); the weights that feed the tables are renormalised over the non-sink tokens,
// which is what makes Eq. 15 hold exactly. A fixed-budget method: no mass claim (NaN).
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "cumulus/methods/lfps.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/methods/registry.h"
#include "lfps_tables.h"
#include "methods/method_util.h"

namespace cumulus {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// probs[i] = exp(scale * s[i]) / sum_j exp(scale * s[j]) in float64: the table updates
// must keep Eq. 15's sums to double precision over thousands of steps.
void softmax_f64(const float* s, int n, float scale, std::vector<double>& probs) {
  probs.resize(n);
  double mx = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(scale) * s[i]);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += (probs[i] = std::exp(static_cast<double>(scale) * s[i] - mx));
  for (auto& p : probs) p /= sum;
}

double log_sum_exp(double a, double b) {
  if (a == kNegInf) return b;
  if (b == kNegInf) return a;
  const double m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

// Mean and the kurtosis-like kappa of Eq. 8 over x[b, e):
//   kappa = sum (x - mean)^4 / (sum (x - mean)^2)^2   (no factor n, as printed).
void table_stats(const std::vector<double>& x, int b, int e, double& mean, double& kappa) {
  const int n = e - b;
  mean = 0;
  for (int i = b; i < e; ++i) mean += x[i];
  mean /= n;
  double m2 = 0, m4 = 0;
  for (int i = b; i < e; ++i) {
    const double dlt = x[i] - mean, d2 = dlt * dlt;
    m2 += d2;
    m4 += d2 * d2;
  }
  kappa = m2 > 0 ? m4 / (m2 * m2) : 0.0;
}

class Lfps final : public DecodeMethod {
  // A worker's scratch in the kv head tasks (on_prefill, decode).
  struct Scratch {
    std::vector<float> scores, rho_scores, c2_scores;
    std::vector<double> probs;
    std::vector<int32_t> rho_idx, cand, top, chosen;
    std::vector<uint8_t> mark;
    SelectWorkspace select_ws;
  };

 public:
  Lfps(const Shape& shape, const LfpsOptions& o)
      : shape_(shape),
        o_(o),
        tables_(static_cast<size_t>(shape.n_layers) * shape.n_q_heads),
        kmean_(static_cast<size_t>(shape.n_layers) * shape.n_kv_heads),
        vmean_(kmean_.size()),
        prefilled_(shape.n_layers, false), generation_(shape.n_layers, 0) {}
  std::string name() const override { return "lfps"; }
  int prompt_queries() const override { return o_.s; }

  const methods::LfpsTables& tables(int layer, int qh) const {
    CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers && qh >= 0 && qh < shape_.n_q_heads,
                  "layer={} q_head={} out of range", layer, qh);
    return tables_[static_cast<size_t>(layer) * shape_.n_q_heads + qh];
  }

  void on_prefill(int layer, const KvCache& kv, const DecodeContext& ctx) override {
    CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
    CUMULUS_CHECK(ctx.prompt_q != nullptr && ctx.prompt_q_rows > 0,
                  "lfps needs the last prompt queries of layer={} (DecodeContext::prompt_q, prompt_q_rows={}) to "
                  "build its score tables (LFPS, Eq. 4)",
                  layer, ctx.prompt_q_rows);
    const int n = kv.n_tokens(layer);
    CUMULUS_CHECK(ctx.prompt_q_rows <= n, "prompt_q_rows={} exceeds the layer's n_tokens={}", ctx.prompt_q_rows, n);
    const int g = shape_.group(), d = shape_.head_dim;
    const float scale = attention_scale(d);
    const int n_sink = std::min(o_.sinks, n);
    const int rows = std::min(o_.s, ctx.prompt_q_rows);
    CUMULUS_CHECK(ctx.pool != nullptr, "lfps: on_prefill needs DecodeContext::pool");
    scratch_.resize(std::max(scratch_.size(), static_cast<size_t>(ctx.pool->n_threads())));
    // One task per kv head (its group's tables); the same arithmetic as one thread.
    ctx.pool->parallel_for(shape_.n_kv_heads, [&](int64_t hh, int worker) {
      const int h = static_cast<int>(hh);
      Scratch& w = scratch_[static_cast<size_t>(worker)];
      std::vector<float> key(d), val(d);
      // Mean key over the non-sink token positions [1, n) (w_global models "all tokens
      // excluding the sink token", Appendix B.1); mean value over all n (Algorithm 1 line 5).
      std::vector<double> ks(d, 0.0), vs(d, 0.0);
      const int k0 = n > 1 ? 1 : 0;
      for (int t = 0; t < n; ++t) {
        kv.value_f32(layer, h, t, val.data());
        for (int j = 0; j < d; ++j) vs[j] += val[j];
        if (t < k0) continue;
        kv.key_f32(layer, h, t, key.data());
        for (int j = 0; j < d; ++j) ks[j] += key[j];
      }
      auto& km = kmean_[static_cast<size_t>(layer) * shape_.n_kv_heads + h];
      auto& vm = vmean_[static_cast<size_t>(layer) * shape_.n_kv_heads + h];
      km.resize(d);
      vm.resize(d);
      for (int j = 0; j < d; ++j) km[j] = static_cast<float>(ks[j] / (n - k0)), vm[j] = static_cast<float>(vs[j] / n);

      const PagedHeadView v = kv.view(layer, h);
      for (int jq = 0; jq < g; ++jq) {
        const int qh = h * g + jq;
        methods::LfpsTables& tb = tables_[static_cast<size_t>(layer) * shape_.n_q_heads + qh];
        tb = methods::LfpsTables{};
        tb.vertical.assign(n, 0.0);
        tb.slash.assign(n, 0.0);
        // Eq. 4: rows j = 1..s are the queries at positions n - j; each attends [0, n - j].
        int used = 0;
        for (int jd = 1; jd <= rows; ++jd) {
          const int pos = n - jd;
          if (pos < n_sink) break;  // no non-sink key to attend
          const float* qr =
              ctx.prompt_q + (static_cast<size_t>(ctx.prompt_q_rows - jd) * shape_.n_q_heads + qh) * d;
          w.scores.resize(pos + 1);
          cpu::token_score(v, qr, 1, nullptr, pos + 1, w.scores.data());
          // Weights over the non-sink keys [n_sink, pos], renormalised (see the top).
          softmax_f64(w.scores.data() + n_sink, pos + 1 - n_sink, scale, w.probs);
          for (int i = n_sink; i <= pos; ++i) {
            tb.vertical[i] += w.probs[i - n_sink];
            tb.slash[i + jd - 1] += w.probs[i - n_sink];
          }
          ++used;
        }
        const double norm = used > 0 ? 1.0 / (2.0 * used * (1.0 - o_.r)) : 0.0;
        for (auto& x : tb.vertical) x *= norm;
        for (auto& x : tb.slash) x *= norm;
        // sigma-hat^2 from the last prompt query over the non-sink keys [1, n).
        const float* ql = ctx.prompt_q + (static_cast<size_t>(ctx.prompt_q_rows - 1) * shape_.n_q_heads + qh) * d;
        if (n > 2) {
          w.scores.resize(n);
          cpu::token_score(v, ql, 1, nullptr, n, w.scores.data());
          double mu = 0, m2 = 0;
          for (int i = 1; i < n; ++i) mu += scale * w.scores[i];
          mu /= n - 1;
          for (int i = 1; i < n; ++i) m2 += (scale * w.scores[i] - mu) * (scale * w.scores[i] - mu);
          double qn2 = 0;
          for (int j = 0; j < d; ++j) qn2 += static_cast<double>(ql[j]) * ql[j];
          tb.sigma_hat2 = qn2 > 0 ? (m2 / (n - 1)) / qn2 : 0.0;
        }
      }
    });
    prefilled_[layer] = true;
    generation_[layer] = kv.generation(layer);
  }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    CUMULUS_CHECK(prefilled_[layer], "lfps: decode on layer={} before on_prefill built its score tables", layer);
    // Its index describes the tokens the cache held at on_prefill plus those appended since;
    // a cut (truncate, clear) may have replaced them, even with as many new ones.
    CUMULUS_CHECK(kv.generation(layer) == generation_[layer],
                  "lfps: the cache of layer={} lost tokens since on_prefill built its score tables; run on_prefill "
                  "again (Session::restart_decode does)",
                  layer);
    methods::attn_output_reset(shape_, out);
    const int g = shape_.group(), d = shape_.head_dim;
    const float scale = attention_scale(d);
    const int n = kv.n_tokens(layer);
    const int n_sink = std::min(o_.sinks, n);
    const int k = lfps_budget(o_, n);
    CUMULUS_CHECK(ctx.pool != nullptr, "lfps: decode needs DecodeContext::pool");
    scratch_.resize(std::max(scratch_.size(), static_cast<size_t>(ctx.pool->n_threads())));
    // One task per kv head: its group's query heads, tables and union. The tables are per
    // query head, so the tasks share nothing they write; each task's scratch is its
    // worker's, every entry written before it is read.
    ctx.pool->parallel_for(shape_.n_kv_heads, [&](int64_t hh, int worker) {
      const int h = static_cast<int>(hh);
      Scratch& w = scratch_[static_cast<size_t>(worker)];
      const PagedHeadView v = kv.view(layer, h);
      const float* km = kmean_[static_cast<size_t>(layer) * shape_.n_kv_heads + h].data();
      const double row = static_cast<double>(v.row_bytes());
      // Eq. 5 reads the sink key (token 0) and the last kLfpsLocalWindow keys (not the sink).
      w.rho_idx.assign(1, 0);
      for (int t = std::max(1, n - kLfpsLocalWindow); t < n; ++t) w.rho_idx.push_back(t);
      const int m = static_cast<int>(w.rho_idx.size());
      w.rho_scores.resize(static_cast<size_t>(g) * m);
      cpu::token_score(v, q + static_cast<size_t>(h) * g * d, g, w.rho_idx.data(), m, w.rho_scores.data());
      methods::add_kv_head_bytes(shape_, h, m * row + 2.0 * d * sizeof(float), out);

      auto& uni = out.selection.tokens[h];
      uni.clear();
      for (int j = 0; j < g; ++j) {
        const int qh = h * g + j;
        const float* qj = q + static_cast<size_t>(qh) * d;
        methods::LfpsTables& tb = tables_[static_cast<size_t>(layer) * shape_.n_q_heads + qh];
        // Eq. 5-6 in log space: log w_sink, log w_global, log w_local.
        const float* sc = w.rho_scores.data() + static_cast<size_t>(j) * m;
        const double l_sink = scale * sc[0];
        double l_local = kNegInf;
        for (int u = 1; u < m; ++u) l_local = log_sum_exp(l_local, scale * sc[u]);
        double qk = 0, qn2 = 0;
        for (int x = 0; x < d; ++x) qk += static_cast<double>(qj[x]) * km[x], qn2 += static_cast<double>(qj[x]) * qj[x];
        const double l_global = scale * qk + qn2 * tb.sigma_hat2 / 2 + std::log(static_cast<double>(n));
        tb.rho = std::exp(l_sink - log_sum_exp(log_sum_exp(l_sink, l_global), l_local));
        tb.bypass = tb.rho > o_.epsilon;
        out.stats[qh].bypass = tb.bypass;
        if (tb.bypass) continue;  // Algorithm 1 lines 4-5: steps 2-4 skipped

        select_head(v, qj, scale, n, n_sink, k, tb, w);
        out.stats[qh].bytes_read += w.cand.size() * row + 2.0 * n * sizeof(double);
        for (int i = 0; i < n_sink; ++i) uni.push_back(i);  // the first `sinks` tokens, always
        uni.insert(uni.end(), w.chosen.begin(), w.chosen.end());
      }
      selection_normalize(uni);
    });
    methods::attend_selection(kv, layer, q, ctx, out);
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      const float* vm = vmean_[static_cast<size_t>(layer) * shape_.n_kv_heads + h].data();
      for (int j = 0; j < g; ++j) {
        StepStats& st = out.stats[h * g + j];
        st.mass_claimed = methods::kNoClaim;
        if (!st.bypass) continue;
        std::copy_n(vm, d, out.out.data() + static_cast<size_t>(h * g + j) * d);
        st.tokens_attended = 0;
      }
    }
  }

 private:
  // Steps 2-4 of Algorithm 1 for one query head: w.chosen = C2 (exact top-k over the
  // expanded candidates), and the tables updated by Eq. 10.
  void select_head(const PagedHeadView& v, const float* q, float scale, int n, int n_sink, int k,
                   methods::LfpsTables& tb, Scratch& w) {
    if (static_cast<int>(tb.vertical.size()) < n) tb.vertical.resize(n, 0.0);
    if (static_cast<int>(tb.slash.size()) < n) tb.slash.resize(n, 0.0);
    w.cand.clear();
    if (k >= n - n_sink) {
      // The exact top-k of every non-sink token is all of them: no candidate filter can add
      // anything (this makes budget >= n equal dense).
      for (int i = n_sink; i < n; ++i) w.cand.push_back(i);
    } else {
      double mean_v, kappa_v, mean_s, kappa_s;
      table_stats(tb.vertical, n_sink, n, mean_v, kappa_v);
      table_stats(tb.slash, n_sink, n, mean_s, kappa_s);
      // Eq. 8; a flat table (kappa = 0) gives no candidates.
      const double inf = std::numeric_limits<double>::infinity();
      const double tau_v = kappa_v > 0 ? o_.a * mean_v / kappa_v : inf;
      const double tau_s = kappa_s > 0 ? o_.a * mean_s / kappa_s : inf;
      w.mark.assign(n, 0);
      for (int i = n_sink; i < n; ++i) {
        if (!(tb.vertical[i] > tau_v || tb.slash[i] > tau_s)) continue;  // Eq. 7
        for (int off = kLfpsOffsetMin; off <= kLfpsOffsetMax; ++off) {                                        // Eq. 9
          const int x = i + off;
          if (x < n_sink || x >= n || w.mark[x]) continue;
          if (tb.vertical[x] > mean_v || tb.slash[x] > mean_s) {
            w.mark[x] = 1;
          }
        }
      }
      for (int i = n_sink; i < n; ++i)
        if (w.mark[i]) w.cand.push_back(i);
    }
    w.chosen.clear();
    if (w.cand.empty()) return;  // nothing to attend beyond the sinks, nothing to learn
    w.scores.resize(w.cand.size());
    cpu::token_score(v, q, 1, w.cand.data(), static_cast<int>(w.cand.size()), w.scores.data());
    cpu::select_topk(w.scores.data(), static_cast<int>(w.cand.size()), k, w.top, &w.select_ws);
    w.chosen.resize(w.top.size());
    w.c2_scores.resize(w.top.size());
    for (size_t u = 0; u < w.top.size(); ++u) w.chosen[u] = w.cand[w.top[u]], w.c2_scores[u] = w.scores[w.top[u]];
    // Eq. 10: w_i = softmax over C2 (sums to 1); positions outside C2 have w_i = 1/(2|C2|),
    // so they only decay. The slash table shifts by one (aligned to the next query).
    softmax_f64(w.c2_scores.data(), static_cast<int>(w.c2_scores.size()), scale, w.probs);
    const double c = 1.0 / (2.0 * w.chosen.size());
    for (auto& x : tb.vertical) x *= o_.r;
    tb.slash.push_back(0.0);
    for (size_t i = tb.slash.size() - 1; i > 0; --i) tb.slash[i] = o_.r * tb.slash[i - 1];
    tb.slash[0] = 0.0;
    for (size_t u = 0; u < w.chosen.size(); ++u) {
      tb.vertical[w.chosen[u]] += w.probs[u] - c;
      tb.slash[w.chosen[u]] += w.probs[u] - c;
    }
    selection_normalize(w.chosen);
  }

  Shape shape_;
  LfpsOptions o_;
  std::vector<methods::LfpsTables> tables_;   // [n_layers][n_q_heads]
  std::vector<std::vector<float>> kmean_;     // [n_layers][n_kv_heads] -> [head_dim]
  std::vector<std::vector<float>> vmean_;     // [n_layers][n_kv_heads] -> [head_dim]
  std::vector<bool> prefilled_;       // [n_layers]
  std::vector<uint64_t> generation_;  // [n_layers] the cache's generation at on_prefill
  std::vector<Scratch> scratch_;      // [pool threads], one per worker
};

}  // namespace

namespace methods {
const LfpsTables& lfps_tables(const DecodeMethod& method, int layer, int q_head) {
  const auto* m = dynamic_cast<const Lfps*>(&method);
  CUMULUS_CHECK(m != nullptr, "method '{}' is not lfps", method.name());
  return m->tables(layer, q_head);
}
}  // namespace methods

void register_lfps(Registry& r) {
  r.add({.name = "lfps",
         .kind = MethodKind::decode,
         .paper = "LFPS: Learn from the Past, section 4.2, Algorithm 1, Eq. 4-10: candidates from vertical/slash "
                  "score tables of past attention, exact top-k over them, sink bypass",
         .summary = "top-k over candidates predicted from past attention (no mass claim); mean value vector when "
                    "the sink dominates",
         .params = options_params<LfpsOptions>(),  // methods/lfps.h
         .make_decode = [](const Shape& s, const Params& p) {
           return std::make_unique<Lfps>(s, options_read<LfpsOptions>(p));
         },
         .budget_param = "budget",
         .color = "#ff9da7"});
}

}  // namespace cumulus
