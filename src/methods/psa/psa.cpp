// psa: Progressive Sparse Attention (PSA paper, section 3.2 and Algorithm 1). Each query head
// ranks the cache's blocks (our KV pages) by a criticality score q . metadata, then visits
// them in that order, m blocks (a microbatch) at a time, keeping the accumulated attention
// score AS_acc = sum of exp(q.k / sqrt(d)) over visited tokens and AS_min, the smallest
// block score seen. Unvisited blocks are assumed to hold at most AS_min each, so
//   P_acc = AS_acc / (AS_acc + AS_min * N_left)
// and the head stops once P_acc >= threshold. P_acc is the head's claimed mass.
//
// stop=certified (ours, not in any paper) replaces AS_min * N_left by an upper bound that
// holds for every unvisited block b: |b| * exp(ub_b / sqrt(d)) with ub_b Quest's bound of
// q.k over the block (sum_j max(q_j kmin_j, q_j kmax_j)). The claim is then a guaranteed
// lower bound of the visited set's true mass (up to float32 rounding of the scores).
//
// Algorithm 1 merges partial outputs by online softmax; that merge is exact, so the output
// equals attention over the visited set. We therefore run the stopping rule over exact
// per-block scores and attend the visited set with the shared sparse kernel once. GQA:
// every head runs Algorithm 1 on its own, the group attends the union of the visited
// blocks (Tactic 4.5's rule; the paper's Llama-3.1 runs do not say how they batch a group).
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/methods/psa.h"
#include "cumulus/methods/registry.h"
#include "methods/method_util.h"

namespace cumulus {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// log(exp(a) + exp(b)) without overflow; either may be -inf.
double log_add(double a, double b) {
  if (a == kNegInf) return b;
  if (b == kNegInf) return a;
  const double m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

// Scratch of one kv head's task.
struct Scratch {
  std::vector<float> crit_scores, bounds, scores;
  std::vector<double> log_rest;
  std::vector<int32_t> order, idx;
  SelectWorkspace select;  // the ranking's sort keys
};

class Psa final : public DecodeMethod {
 public:
  Psa(const Shape& shape, const PsaOptions& o)
      : shape_(shape), threshold_(o.threshold), microbatch_(o.microbatch), crit_(o.criticality), stop_(o.stop) {}
  std::string name() const override { return "psa"; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    const int g = shape_.group();
    const int d = shape_.head_dim;
    // One task per kv head: each writes its own list, stats and scratch.
    scratch_.resize(std::max(scratch_.size(), static_cast<size_t>(shape_.n_kv_heads)));
    ctx.pool->parallel_for(shape_.n_kv_heads, [&](int64_t hh, int) {
      const int h = static_cast<int>(hh);
      const PagedHeadView v = kv.view(layer, h);
      auto& uni = out.selection.tokens[h];
      uni.clear();
      for (int j = 0; j < g; ++j) {
        const int qh = h * g + j;
        Scratch& w = scratch_[static_cast<size_t>(h)];
        out.stats[qh].mass_claimed = run_head(v, q + static_cast<size_t>(qh) * d, w, uni);
      }
      selection_normalize(uni);
      // Block metadata (float32 [n_pages][head_dim] arrays) is read once per kv head.
      const int meta_arrays = (crit_ == PsaCriticality::mean ? 1 : 2) +
                              (stop_ == PsaStop::certified && crit_ == PsaCriticality::mean ? 2 : 0);
      methods::add_kv_head_bytes(shape_, h, static_cast<double>(meta_arrays) * v.n_pages() * d * sizeof(float), out);
    });
    methods::attend_selection(kv, layer, q, ctx, out);
  }

 private:
  // Algorithm 1 for one query head: appends the visited blocks' tokens to `visited` and
  // returns P_acc at the stop (1 when every block was visited).
  double run_head(const PagedHeadView& v, const float* q, Scratch& w, std::vector<int32_t>& visited) const {
    const int n_pages = v.n_pages();
    const double scale = attention_scale(v.head_dim);
    w.crit_scores.resize(n_pages);
    if (crit_ == PsaCriticality::mean) {
      cpu::page_score_mean(v, q, w.crit_scores.data());
    } else {
      cpu::page_score_bound(v, q, w.crit_scores.data());
    }
    cpu::select_topk(w.crit_scores.data(), n_pages, n_pages, w.order, &w.select);  // line 6: rank by CS

    // certified: w.log_rest[r] = log sum_{r' >= r} |b_r'| exp(scale * ub_b_r'), the bound on
    // what the blocks from rank r on can hold.
    if (stop_ == PsaStop::certified) {
      if (crit_ == PsaCriticality::bound) {
        w.bounds = w.crit_scores;
      } else {
        w.bounds.resize(n_pages);
        cpu::page_score_bound(v, q, w.bounds.data());
      }
      w.log_rest.assign(n_pages + 1, kNegInf);
      for (int r = n_pages - 1; r >= 0; --r) {
        const int b = w.order[r];
        w.log_rest[r] = log_add(w.log_rest[r + 1], std::log(static_cast<double>(v.page_len(b))) + scale * w.bounds[b]);
      }
    }

    double log_acc = kNegInf;                               // log AS_acc
    double log_min = std::numeric_limits<double>::infinity();  // log AS_min (MAX_VAL)
    int n_left = n_pages;
    double p_acc = 1.0;
    for (int r = 0; r < n_pages;) {
      const int r_end = std::min(n_pages, r + microbatch_);
      w.idx.clear();
      for (int u = r; u < r_end; ++u) {
        const int b = w.order[u];
        for (int i = 0; i < v.page_len(b); ++i) w.idx.push_back(b * v.page_size + i);
      }
      w.scores.resize(w.idx.size());
      cpu::token_score(v, q, 1, w.idx.data(), static_cast<int>(w.idx.size()), w.scores.data());
      // Per-block AS (the paper aggregates the weights of each block on chip, section 4).
      size_t t = 0;
      for (int u = r; u < r_end; ++u) {
        const int len = v.page_len(w.order[u]);
        double mx = kNegInf;
        for (int i = 0; i < len; ++i) mx = std::max(mx, scale * w.scores[t + i]);
        double sum = 0;
        for (int i = 0; i < len; ++i) sum += std::exp(scale * w.scores[t + i] - mx);
        const double log_as = mx + std::log(sum);
        t += len;
        log_acc = log_add(log_acc, log_as);  // line 12
        log_min = std::min(log_min, log_as);  // line 13
      }
      visited.insert(visited.end(), w.idx.begin(), w.idx.end());
      n_left -= r_end - r;  // line 14
      r = r_end;
      // Lines 15-16: P_acc = AS_acc / AS_total, as 1 / (1 + rest / AS_acc) in log space.
      double log_rest = kNegInf;
      if (stop_ == PsaStop::estimate) {
        if (n_left > 0) log_rest = log_min + std::log(static_cast<double>(n_left));
      } else {
        log_rest = w.log_rest[r];
      }
      p_acc = log_rest == kNegInf ? 1.0 : 1.0 / (1.0 + std::exp(log_rest - log_acc));
      if (p_acc >= threshold_) break;  // line 17 (">=": section 3.2 stops when P_acc equals it)
    }
    return p_acc;
  }

  Shape shape_;
  double threshold_;
  int microbatch_;
  PsaCriticality crit_;
  PsaStop stop_;
  std::vector<Scratch> scratch_;  // [n_kv_heads], one per task
};

}  // namespace

void register_psa(Registry& r) {
  r.add({.name = "psa",
         .kind = MethodKind::decode,
         .paper = "PSA: Progressive Sparse Attention, section 3.2, Algorithm 1: progressive block attention until "
                  "the estimated mass reaches the threshold",
         .summary = "visit pages by criticality until AS_acc / (AS_acc + AS_min * N_left) >= threshold "
                    "(stop=certified: a guaranteed lower bound instead)",
         .params = options_params<PsaOptions>(),  // methods/psa.h
         .make_decode = [](const Shape& s, const Params& p) {
           return std::make_unique<Psa>(s, options_read<PsaOptions>(p));
         },
         .target_param = "threshold",
         .color = "#76b7b2"});
}

}  // namespace cumulus
