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
//      of the pages left out is estimated as their e times the Jensen gap (exact / e,
//      >= 1) measured in the same step on the last quarter of the scored ranking, the
//      pages most like the pages left out; so each head's total is exact over
//      what was read and estimated only for what was not;
//   4. the group's union is pruned at token granularity to the smallest prefix of the
//      candidates, ranked by max_j of their exact share, at which EVERY head's share of
//      that total reaches P: each head's mass is counted over the union the group reads,
//      not over a list of its own;
//   5. if a head cannot reach P over the candidates, the candidate prefix grows by half
//      (only the added pages are scored) until it can; a kv head whose candidates pass
//      `dense_above` of the pages, and every kv head of a context of at most `min_context`
//      tokens, attends densely instead (the cost rule: there the selection would not pay);
//   6. the union is attended from the weights of step 3: only its V rows are read.
// With rest=bound (ours too, off by default) the pages not scored count with Quest's upper
// bound instead of the estimate, so every claim is a lower bound of the true mass.
// Claims: each head's share of the estimated total over the attended union (1 for dense).
// Bytes read: the page means (float32) once per kv head, the candidates' K rows once, and
// the union's V rows. docs/methods.md has the measurements behind these choices.
#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "cumulus/kernels/attention.h"
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
  bool rest_bound = false;  // the pages not scored bounded by Quest's bound, not estimated
};

class HierTopp final : public DecodeMethod {
 public:
  HierTopp(const Shape& shape, const HierToppOptions& o) : shape_(shape), o_(o) {}
  std::string name() const override { return "hier_topp"; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    const int n = kv.n_tokens(layer);
    const int g = shape_.group();
    const bool dense = n <= o_.min_context || o_.p >= 1.0;
    heads_.resize(std::max(heads_.size(), static_cast<size_t>(shape_.n_kv_heads)));
    dense_head_.assign(static_cast<size_t>(shape_.n_kv_heads), 0);
    // One task per kv head: each writes only its own list, output rows and stats. A head
    // that stays sparse is attended here from its exact weights (only V rows read again);
    // the heads the cost rule sends to dense attention go to the sparse kernel below.
    ctx.pool->parallel_for(shape_.n_kv_heads, [&](int64_t hh, int) {
      const int h = static_cast<int>(hh);
      if (dense || !select_head(layer, h, q, kv, heads_[static_cast<size_t>(h)], out)) {
        dense_head_[static_cast<size_t>(h)] = 1;
        auto& t = out.selection.tokens[h];
        t.resize(static_cast<size_t>(n));
        for (int i = 0; i < n; ++i) t[i] = i;
        for (int j = 0; j < g; ++j) out.stats[h * g + j].mass_claimed = 1.0;
      }
    });
    if (std::find(dense_head_.begin(), dense_head_.end(), 1) != dense_head_.end())
      methods::attend_dense_heads(shape_, kv, layer, q, *ctx.pool, dense_head_, dense_, out);
  }

 private:
  struct HeadScratch {
    std::vector<float> page_scores;   // [group][n_pages] q_j . kmean_p
    std::vector<float> page_weights;  // [group][n_mid] exp(scale score - page_shift_j)
    std::vector<float> page_key;      // [n_mid] max_j of the page's share of head j's estimate
    std::vector<int32_t> page_order;  // [n_mid] middle pages, ranked by page_key
    std::vector<int32_t> idx;         // [m] scored tokens: exact region, then candidates by round
    std::vector<float> scores;        // [group][cap] raw q . k of idx
    std::vector<float> weights;       // [group][cap] exp(scale score - shift_j)
    std::vector<float> fresh;         // [group][m_new] scores of one round's new tokens
    std::vector<float> token_key;     // [m_cand] max_j share of head j's total
    std::vector<int32_t> token_order;
    std::vector<int32_t> new_pages;   // one round's new candidate pages, ascending
    std::vector<int32_t> chosen;      // positions into idx of the union, by token
    std::vector<float> page_exact;    // [group][n_mid] exact weight sums of scored pages
    std::vector<uint64_t> mark;       // [ceil(n / 64)] the union as a bitmap over tokens
    std::vector<int32_t> pos_of;      // [n] position in idx of a marked token
    std::vector<float> union_w;       // [group][u] exact weights of the union's tokens
    std::vector<float> page_bound;    // [group][n_pages] Quest's bound of q_j . k over the page
  };

  // Selects kv head h's union into out.selection.tokens[h], attends it (out rows, stats,
  // bytes) and returns true; returns false where the cost rule sends the head to dense
  // attention (nothing of it written but the bytes already read).
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
      est_total[j] = cpu::score_exp(s, n_mid, scale, static_cast<float>(page_shift[j]), e);
    }
    w.page_key.assign(static_cast<size_t>(n_mid), 0.0f);
    for (int j = 0; j < g; ++j) {
      const float inv = static_cast<float>(1.0 / est_total[j]);
      const float* e = w.page_weights.data() + static_cast<size_t>(j) * n_mid;
      for (int p = 0; p < n_mid; ++p) w.page_key[p] = std::max(w.page_key[p], e[p] * inv);
    }
    cpu::select_topk(w.page_key.data(), n_mid, n_mid, w.page_order);
    const bool use_bound = o_.rest_bound;
    if (use_bound) {  // Quest's bound per page and head: the rest's mass from above
      w.page_bound.resize(static_cast<size_t>(g) * n_pages);
      cpu::page_score_bound(v, q, g, w.page_bound.data());
      methods::add_kv_head_bytes(shape_, h, 2.0 * n_pages * d * sizeof(float), out);
    }
    // The shortest prefix of the ranking that holds candidate_p of every head's estimate.
    int n_cand = 0;
    {
      std::vector<double> acc(g, 0.0);
      int reached = 0;
      while (n_cand < n_mid && reached < g) {
        const int p = w.page_order[n_cand++];
        reached = 0;
        for (int j = 0; j < g; ++j) {
          acc[j] += w.page_weights[static_cast<size_t>(j) * n_mid + p];
          reached += acc[j] >= o_.candidate_p * est_total[j] ? 1 : 0;
        }
      }
    }

    // 3-5. Score the candidates exactly, round by round (a round adds half as many pages again
    // and scores only those)
    // until every head can reach P.
    w.idx.clear();
    for (int t = 0; t < lo_page * ps; ++t) w.idx.push_back(t);
    for (int t = hi_page * ps; t < n; ++t) w.idx.push_back(t);
    const int m_exact = static_cast<int>(w.idx.size());
    const size_t cap = static_cast<size_t>(m_exact) + static_cast<size_t>(n_mid) * ps;
    w.scores.resize(static_cast<size_t>(g) * cap);
    w.weights.resize(static_cast<size_t>(g) * cap);
    w.page_exact.resize(static_cast<size_t>(g) * n_mid);
    // Weights are exp(scale s - shift_j) with shift_j fixed by the first round (the page
    // estimates' and the first scores' maximum); a later round whose scores pass it by more
    // than kShiftSlack (float exp would near overflow) raises it and rescales what is held.
    constexpr double kShiftSlack = 60.0;
    std::vector<double> shift(g), exact(g), total(g);
    int n_scored = 0;  // candidate pages scored so far (a prefix of page_order)
    int m_done = 0;    // entries of idx scored so far
    for (;;) {
      if (n_cand > o_.dense_above * n_pages) return false;
      // The round's new pages in address order, so their K rows are read as ascending runs.
      w.new_pages.assign(w.page_order.begin() + n_scored, w.page_order.begin() + n_cand);
      std::sort(w.new_pages.begin(), w.new_pages.end());
      const int m_old = m_done;  // the first round also scores the exact region
      for (int p : w.new_pages)
        for (int i = 0; i < ps; ++i) w.idx.push_back((lo_page + p) * ps + i);
      const int m = static_cast<int>(w.idx.size());
      const int m_new = m - m_old;
      w.fresh.resize(static_cast<size_t>(g) * m_new);
      cpu::token_score(v, q, g, w.idx.data() + m_old, m_new, w.fresh.data());
      methods::add_kv_head_bytes(shape_, h, static_cast<double>(m_new) * v.row_bytes(), out);
      bool all_can = true;
      for (int j = 0; j < g; ++j) {
        float* sc = w.scores.data() + static_cast<size_t>(j) * cap;
        float* e = w.weights.data() + static_cast<size_t>(j) * cap;
        float* px = w.page_exact.data() + static_cast<size_t>(j) * n_mid;
        std::copy_n(w.fresh.data() + static_cast<size_t>(j) * m_new, m_new, sc + m_old);
        const double s_new = static_cast<double>(scale * cpu::score_max(sc + m_old, m_new));
        if (m_old == 0) {
          shift[j] = std::max(page_shift[j], s_new);
          exact[j] = 0;
        } else if (s_new > shift[j] + kShiftSlack) {
          const float r = static_cast<float>(std::exp(shift[j] - s_new));
          for (int i = 0; i < m_old; ++i) e[i] *= r;
          for (int k = 0; k < n_scored; ++k) px[w.page_order[k]] *= r;
          exact[j] *= r;
          shift[j] = s_new;
        }
        exact[j] += cpu::score_exp(sc + m_old, m_new, scale, static_cast<float>(shift[j]), e + m_old);
        // Per-page exact sums of the round's pages (their tokens follow in page order).
        const int base = m_old == 0 ? m_exact : m_old;
        for (size_t k = 0; k < w.new_pages.size(); ++k) {
          const float* ek = e + base + k * ps;
          float sum = 0;
          for (int i = 0; i < ps; ++i) sum += ek[i];
          px[w.new_pages[k]] = sum;
        }
        // The pages not scored: their estimate times the Jensen gap measured on the last
        // quarter of the scored ranking (the scored pages most like the pages left out),
        // never below 1; rescaled from page_shift to shift.
        const float* pe = w.page_weights.data() + static_cast<size_t>(j) * n_mid;
        double gap_x = 0, gap_e = 0, rest = 0;
        for (int r = n_cand - (n_cand + 3) / 4; r < n_cand; ++r) {
          gap_x += px[w.page_order[r]];
          gap_e += pe[w.page_order[r]];
        }
        for (int r = n_cand; r < n_mid; ++r) rest += pe[w.page_order[r]];
        const double rescale = std::exp(page_shift[j] - shift[j]) * ps;
        const double gap = gap_e > 0 ? std::max(1.0, gap_x / (gap_e * rescale)) : 1.0;
        total[j] = exact[j] + gap * rest * rescale;
        if (use_bound) {  // each page holds at most ps exp(scale bound - shift)
          const float* b = w.page_bound.data() + static_cast<size_t>(j) * n_pages + lo_page;
          double ub = 0;
          for (int r = n_cand; r < n_mid; ++r) ub += std::exp(scale * b[w.page_order[r]] - shift[j]);
          total[j] = exact[j] + ub * ps;
        }
        all_can = all_can && exact[j] >= o_.p * total[j];
      }
      n_scored = n_cand;
      m_done = m;
      if (all_can || n_cand == n_mid) break;  // all pages scored: the total is exact
      n_cand = std::min(n_mid, n_cand + (n_cand + 1) / 2);
    }

    // Prune: the exact region always, then candidates by max_j share until all heads reach P.
    const int m = static_cast<int>(w.idx.size());
    const int m_cand = m - m_exact;
    std::vector<double> mass(g, 0.0);
    std::vector<float> inv(g);
    for (int j = 0; j < g; ++j) {
      inv[j] = static_cast<float>(1.0 / total[j]);
      const float* e = w.weights.data() + static_cast<size_t>(j) * cap;
      for (int i = 0; i < m_exact; ++i) mass[j] += e[i];
      mass[j] /= total[j];
    }
    w.token_key.assign(static_cast<size_t>(m_cand), 0.0f);
    for (int j = 0; j < g; ++j) {
      const float* e = w.weights.data() + static_cast<size_t>(j) * cap + m_exact;
      const float iv = inv[j];
      float* key = w.token_key.data();
      for (int i = 0; i < m_cand; ++i) key[i] = std::max(key[i], e[i] * iv);
    }
    auto reached = [&] {
      for (int j = 0; j < g; ++j)
        if (mass[j] < o_.p) return false;
      return true;
    };
    // The union as a bitmap over tokens, with each chosen token's position in idx.
    w.mark.assign(static_cast<size_t>((n + 63) / 64), 0);
    if (w.pos_of.size() < static_cast<size_t>(n)) w.pos_of.resize(static_cast<size_t>(n));
    auto choose = [&](int i) {
      const int32_t tok = w.idx[i];
      w.mark[tok >> 6] |= uint64_t{1} << (tok & 63);
      w.pos_of[tok] = i;
    };
    for (int i = 0; i < m_exact; ++i) choose(i);
    int u = m_exact;
    if (!reached() && m_cand > 0) {
      cpu::select_topk(w.token_key.data(), m_cand, m_cand, w.token_order);
      for (int r = 0; r < m_cand && !reached(); ++r) {
        const int i = m_exact + w.token_order[r];
        choose(i);
        ++u;
        for (int j = 0; j < g; ++j) mass[j] += static_cast<double>(w.weights[static_cast<size_t>(j) * cap + i]) / total[j];
      }
    }
    auto& t = out.selection.tokens[h];
    t.clear();
    w.chosen.clear();
    for (size_t word = 0; word < w.mark.size(); ++word)
      for (uint64_t bits = w.mark[word]; bits != 0; bits &= bits - 1) {
        const int32_t tok = static_cast<int32_t>(word * 64 + static_cast<size_t>(__builtin_ctzll(bits)));
        t.push_back(tok);
        w.chosen.push_back(w.pos_of[tok]);
      }

    // Attend the union from the exact weights: o_j = sum_U e_ji v_i / sum_U e_ji.
    w.union_w.resize(static_cast<size_t>(g) * u);
    for (int j = 0; j < g; ++j) {
      const float* e = w.weights.data() + static_cast<size_t>(j) * cap;
      float* uw = w.union_w.data() + static_cast<size_t>(j) * u;
      double sum = 0;
      for (int r = 0; r < u; ++r) sum += (uw[r] = e[w.chosen[r]]);
      const float sc = static_cast<float>(1.0 / sum);
      for (int r = 0; r < u; ++r) uw[r] *= sc;
    }
    float* o = out.out.data() + static_cast<size_t>(h) * g * d;
    cpu::attention_weighted_values(v, t.data(), u, w.union_w.data(), g, o);
    methods::add_kv_head_bytes(shape_, h, static_cast<double>(u) * v.row_bytes(), out);
    for (int j = 0; j < g; ++j) {
      out.stats[h * g + j].tokens_attended = u;
      out.stats[h * g + j].mass_claimed = std::min(1.0, mass[j]);
    }
    return true;
  }

  Shape shape_;
  HierToppOptions o_;
  std::vector<HeadScratch> heads_;  // [n_kv_heads]
  std::vector<char> dense_head_;    // [n_kv_heads] sent to dense attention this step
  AttnOutput dense_;                // the heads sent to dense attention this step
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
                    {.name = "rest",
                     .type = ParamType::kString,
                     .default_value = "estimate",
                     .help = "mass of the pages not scored: estimate (page means x measured Jensen gap) or bound "
                             "(Quest's upper bound: every claim a lower bound of the true mass)"},
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
           const std::string& rest = p.get_string("rest");
           CUMULUS_CHECK(rest == "estimate" || rest == "bound",
                         "method 'hier_topp': parameter rest='{}' must be estimate or bound", rest);
           o.rest_bound = rest == "bound";
           return std::make_unique<HierTopp>(s, o);
         },
         .target_param = "p"});
}

}  // namespace cumulus
