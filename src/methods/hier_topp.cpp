// hier_topp: hierarchical top-p for a GQA group (ours; not from a seed paper). Each step,
// per kv head and once for its whole query group:
//   1. the sinks (the first pages) and the recent tokens (the last pages) are scored and
//      attended exactly, as Tactic's dense tail and StreamingLLM's sinks;
//   2. every other page is estimated from its mean key (the cache keeps it current):
//      e[j][p] = len_p exp(scale q_j . kmean_p). By Jensen, e is a lower bound of the
//      page's true mass exp-sum; the pages are ranked by max_j of their share e[j][p] /
//      sum_p e[j][p], and the shortest prefix holding `candidate_p` of every head's
//      estimated mass becomes the candidate set (Twilight's "select, then prune");
//   3. the candidates' keys are scored exactly (whole pages: contiguous reads). The mass
//      of the pages left out is estimated as their e times the ratio exact / e measured on
//      the candidate pages in the same step (>= 1 by Jensen), so each head's total is
//      exact over what was read and estimated only for what was not;
//   4. the group's union is pruned at token granularity to the smallest prefix of the
//      candidates, ranked by max_j of their exact share, at which EVERY head's share of
//      that total reaches P: each head's mass is counted over the union the group reads,
//      not over a list of its own (the lever of issue 17: no 2.4x union inflation);
//   5. if a head cannot reach P over the candidates, the candidate prefix doubles (more
//      pages scored exactly) until it can; a kv head whose candidates pass `dense_above`
//      of the pages, and every kv head of a context of at most `min_context` tokens,
//      attends densely instead (the cost rule: there the selection would not pay).
// Claims: each head's share of the estimated total over the attended union (1 for dense).
// Bytes read: the page means (float32) once per kv head, the candidates' K rows once, and
// the union's K and V rows (the sparse attention kernel).
#include <algorithm>
#include <cmath>

#include "cumulus/core/error.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/methods/registry.h"
#include "method_util.h"

namespace cumulus {
namespace {

struct HierToppOptions {
  double p = 0.9;
  double candidate_p = 0.95;
  int sinks = 4;
  int recent = 64;
  int min_context = 1024;
  double dense_above = 0.5;
};

class HierTopp final : public DecodeMethod {
 public:
  HierTopp(const Shape& shape, const HierToppOptions& o) : shape_(shape), o_(o) {}
  std::string name() const override { return "hier_topp"; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    const int n = kv.n_tokens(layer);
    const bool dense = n <= o_.min_context || o_.p >= 1.0;
    heads_.resize(std::max(heads_.size(), static_cast<size_t>(shape_.n_kv_heads)));
    // One task per kv head: each writes only its own list and its group's stats.
    ctx.pool->parallel_for(shape_.n_kv_heads, [&](int64_t hh, int) {
      const int h = static_cast<int>(hh);
      if (dense || !select_head(layer, h, q, kv, heads_[static_cast<size_t>(h)], out)) {
        auto& t = out.selection.tokens[h];
        t.resize(static_cast<size_t>(n));
        for (int i = 0; i < n; ++i) t[i] = i;
        for (int j = 0; j < shape_.group(); ++j) out.stats[h * shape_.group() + j].mass_claimed = 1.0;
      }
    });
    methods::attend_selection(kv, layer, q, *ctx.pool, out);
  }

 private:
  struct HeadScratch {
    std::vector<float> page_scores;   // [group][n_pages] q_j . kmean_p
    std::vector<float> page_weights;  // [group][n_mid] len_p exp(scale score - page max)
    std::vector<float> page_key;      // [n_mid] max_j of the page's share of head j's estimate
    std::vector<int32_t> page_order;  // [n_mid] middle pages, ranked by page_key
    std::vector<int32_t> idx;         // [m] scored tokens: exact region, then candidates
    std::vector<float> scores;        // [group][m] raw q . k
    std::vector<float> weights;       // [group][m] exp(scale score - shift_j)
    std::vector<float> token_key;     // [m_cand] max_j share of head j's total
    std::vector<int32_t> token_order;
    std::vector<int32_t> chosen;
    std::vector<int32_t> cand_pages;  // sorted page indices of the candidate prefix
  };

  // Selects kv head h's union into out.selection.tokens[h] with each head's claim.
  // Returns false where the cost rule sends the head to dense attention.
  bool select_head(int layer, int h, const float* q_all, const KvCache& kv, HeadScratch& w, AttnOutput& out) const {
    const int g = shape_.group();
    const int d = shape_.head_dim;
    const float scale = attention_scale(d);
    const float* q = q_all + static_cast<size_t>(h) * g * d;
    const PagedHeadView v = kv.view(layer, h);
    const int n = v.n_tokens;
    const int ps = v.page_size;
    const int n_pages = v.n_pages();
    // Exact region: whole pages [0, lo_page) and tokens [hi_page * ps, n).
    const int lo_page = std::min(n_pages, (o_.sinks + ps - 1) / ps);
    const int hi_page = std::max(lo_page, (n - o_.recent) / ps);
    const int n_mid = hi_page - lo_page;
    if (n_mid <= 0) return false;

    // 2. Page estimates for the middle pages, per head, relative to the head's best page.
    w.page_scores.resize(static_cast<size_t>(g) * n_pages);
    cpu::page_score_mean(v, q, g, w.page_scores.data());
    methods::add_kv_head_bytes(shape_, h, static_cast<double>(n_pages) * d * sizeof(float), out);
    w.page_weights.resize(static_cast<size_t>(g) * n_mid);
    std::vector<double> est_total(g), page_shift(g);
    for (int j = 0; j < g; ++j) {
      const float* s = w.page_scores.data() + static_cast<size_t>(j) * n_pages + lo_page;
      float* e = w.page_weights.data() + static_cast<size_t>(j) * n_mid;
      page_shift[j] = scale * cpu::score_max(s, n_mid);
      // Every middle page holds ps tokens (the partial last page is in the exact region).
      est_total[j] = cpu::score_exp(s, n_mid, scale, static_cast<float>(page_shift[j]), e) * ps;
    }
    w.page_key.assign(static_cast<size_t>(n_mid), 0.0f);
    for (int j = 0; j < g; ++j) {
      const float inv = static_cast<float>(1.0 / est_total[j]);
      const float* e = w.page_weights.data() + static_cast<size_t>(j) * n_mid;
      for (int p = 0; p < n_mid; ++p) w.page_key[p] = std::max(w.page_key[p], e[p] * ps * inv);
    }
    cpu::select_topk(w.page_key.data(), n_mid, n_mid, w.page_order);
    // The shortest prefix of the ranking that holds candidate_p of every head's estimate.
    int n_cand = 0;
    {
      std::vector<double> acc(g, 0.0);
      int reached = 0;
      while (n_cand < n_mid && reached < g) {
        const int p = w.page_order[n_cand++];
        reached = 0;
        for (int j = 0; j < g; ++j) {
          acc[j] += static_cast<double>(w.page_weights[static_cast<size_t>(j) * n_mid + p]) * ps;
          reached += acc[j] >= o_.candidate_p * est_total[j] ? 1 : 0;
        }
      }
    }

    // 3-5. Score the candidates exactly; double them until every head can reach P.
    const int n_exact_lo = lo_page * ps;
    w.idx.clear();
    for (int t = 0; t < n_exact_lo; ++t) w.idx.push_back(t);
    for (int t = hi_page * ps; t < n; ++t) w.idx.push_back(t);
    const int m_exact = static_cast<int>(w.idx.size());
    std::vector<double> shift(g), exact_sum(g), cand_exact(g), cand_est(g), rest_est(g), total(g);
    for (;;) {
      if (n_cand > o_.dense_above * n_pages) return false;
      // Candidate pages in address order, so their K rows are read as ascending runs.
      w.cand_pages.assign(w.page_order.begin(), w.page_order.begin() + n_cand);
      std::sort(w.cand_pages.begin(), w.cand_pages.end());
      w.idx.resize(static_cast<size_t>(m_exact));
      for (int p : w.cand_pages)
        for (int i = 0; i < ps; ++i) w.idx.push_back((lo_page + p) * ps + i);
      const int m = static_cast<int>(w.idx.size());
      w.scores.resize(static_cast<size_t>(g) * m);
      w.weights.resize(static_cast<size_t>(g) * m);
      cpu::token_score(v, q, g, w.idx.data(), m, w.scores.data());
      // A round that doubles the candidates scores every row again: all of them count.
      methods::add_kv_head_bytes(shape_, h, static_cast<double>(m) * v.row_bytes(), out);
      bool all_can = true;
      for (int j = 0; j < g; ++j) {
        const float* s = w.scores.data() + static_cast<size_t>(j) * m;
        float* e = w.weights.data() + static_cast<size_t>(j) * m;
        shift[j] = std::max(static_cast<double>(scale * cpu::score_max(s, m)), page_shift[j]);
        exact_sum[j] = cpu::score_exp(s, m, scale, static_cast<float>(shift[j]), e);
        // The candidates' estimate and the rest's, rescaled from page_shift to shift.
        const double rescale = std::exp(page_shift[j] - shift[j]) * ps;
        const float* pe = w.page_weights.data() + static_cast<size_t>(j) * n_mid;
        double ce = 0, re = 0;
        for (int r = 0; r < n_mid; ++r) (r < n_cand ? ce : re) += pe[w.page_order[r]];
        cand_est[j] = ce * rescale;
        rest_est[j] = re * rescale;
        double cx = 0;
        for (int i = m_exact; i < m; ++i) cx += e[i];
        cand_exact[j] = cx;
        const double ratio = cand_est[j] > 0 ? std::max(1.0, cand_exact[j] / cand_est[j]) : 1.0;
        total[j] = exact_sum[j] + ratio * rest_est[j];
        all_can = all_can && exact_sum[j] >= o_.p * total[j];
      }
      if (all_can) break;
      if (n_cand == n_mid) break;  // every page scored: the rest estimate is 0, P is reachable
      n_cand = std::min(n_mid, 2 * n_cand);
    }

    // Prune: the exact region always, then candidates by max_j share until all heads reach P.
    const int m = static_cast<int>(w.idx.size());
    const int m_cand = m - m_exact;
    std::vector<double> mass(g, 0.0);
    std::vector<float> inv(g);
    for (int j = 0; j < g; ++j) {
      inv[j] = static_cast<float>(1.0 / total[j]);
      const float* e = w.weights.data() + static_cast<size_t>(j) * m;
      for (int i = 0; i < m_exact; ++i) mass[j] += e[i];
      mass[j] /= total[j];
    }
    w.token_key.assign(static_cast<size_t>(m_cand), 0.0f);
    for (int j = 0; j < g; ++j) {
      const float* e = w.weights.data() + static_cast<size_t>(j) * m + m_exact;
      for (int i = 0; i < m_cand; ++i) w.token_key[i] = std::max(w.token_key[i], e[i] * inv[j]);
    }
    auto reached = [&] {
      for (int j = 0; j < g; ++j)
        if (mass[j] < o_.p) return false;
      return true;
    };
    auto& t = out.selection.tokens[h];
    t.assign(w.idx.begin(), w.idx.begin() + m_exact);
    if (!reached() && m_cand > 0) {
      cpu::select_topk(w.token_key.data(), m_cand, m_cand, w.token_order);
      for (int r = 0; r < m_cand && !reached(); ++r) {
        const int i = m_exact + w.token_order[r];
        t.push_back(w.idx[i]);
        for (int j = 0; j < g; ++j) mass[j] += static_cast<double>(w.weights[static_cast<size_t>(j) * m + i]) / total[j];
      }
    }
    selection_normalize(t);
    for (int j = 0; j < g; ++j) out.stats[h * g + j].mass_claimed = std::min(1.0, mass[j]);
    return true;
  }

  Shape shape_;
  HierToppOptions o_;
  std::vector<HeadScratch> heads_;  // [n_kv_heads]
};

}  // namespace

void register_hier_topp(Registry& r) {
  r.add({.name = "hier_topp",
         .kind = "decode",
         .paper = "ours: hierarchical top-p (page means, then exact scores of candidate pages, group union pruned to P)",
         .summary = "sinks + recent exact; candidate pages by mean-key estimate; smallest group union where every head "
                    "reaches P",
         .params = {{.name = "p",
                     .type = ParamType::kDouble,
                     .default_value = "0.9",
                     .help = "target cumulative attention mass of every query head over the group's union, in (0, 1]",
                     .min = 0.0,
                     .max = 1.0,
                     .min_exclusive = true},
                    {.name = "candidate_p",
                     .type = ParamType::kDouble,
                     .default_value = "0.95",
                     .help = "share of each head's estimated page mass the candidate pages must hold",
                     .min = 0.0,
                     .max = 1.0,
                     .min_exclusive = true},
                    {.name = "sinks",
                     .type = ParamType::kInt,
                     .default_value = "4",
                     .help = "first tokens always attended, rounded up to whole pages",
                     .min = 0,
                     .max = 1 << 30},
                    {.name = "recent",
                     .type = ParamType::kInt,
                     .default_value = "64",
                     .help = "last tokens always attended (and the partial last page)",
                     .min = 0,
                     .max = 1 << 30},
                    {.name = "min_context",
                     .type = ParamType::kInt,
                     .default_value = "1024",
                     .help = "contexts of at most this many tokens attend densely (the selection would not pay)",
                     .min = 0,
                     .max = 1 << 30},
                    {.name = "dense_above",
                     .type = ParamType::kDouble,
                     .default_value = "0.5",
                     .help = "a kv head whose candidate pages exceed this share of its pages attends densely",
                     .min = 0.0,
                     .max = 1.0}},
         .make_decode = [](const Shape& s, const Params& p) {
           HierToppOptions o;
           o.p = p.get_double("p");
           o.candidate_p = p.get_double("candidate_p");
           o.sinks = p.get_int("sinks");
           o.recent = p.get_int("recent");
           o.min_context = p.get_int("min_context");
           o.dense_above = p.get_double("dense_above");
           return std::make_unique<HierTopp>(s, o);
         }});
}

}  // namespace cumulus
