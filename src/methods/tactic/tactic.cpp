// tactic: Tactic (section 4, Algorithm 1 in Appendix B).
// Selects, per query head, the fewest tokens whose ESTIMATED cumulative attention mass
// reaches P:
//   4.2 at prefill, per (layer, kv head): K-means on the keys, ceil(n / cluster_size)
//       centroids initialised from randomly sampled keys (seeded), assignment by squared
//       L2 distance, centroid = mean of its keys, until no assignment changes or max_iter;
//   4.3 at decode: clusters ranked by q . centroid and unpacked into a partially sorted
//       token list x_1..x_L (cluster by cluster);
//   4.4 / Alg. 1: exp(q.k / sqrt(d)) is computed exactly for the first N = init_ratio * L
//       tokens and for two windows around p1 = 10% and p2 = 60% of the list; y = a/x + b is
//       fitted through the two window means and estimates every token past N; the budget
//       is the minimal k with sum_{i<=k} w_i >= P * sum_i w_i;
//   4.5 the GQA group attends the union of its heads' sets.
// Tokens appended after clustering (the tail) are attended densely; once the tail reaches
// recluster_interval tokens it is clustered and joins the index (Tactic, section 1: "performs
// full attention on newly generated tokens and updates the clustering every fixed number of
// decoding steps (e.g., 2048)"). mode=cluster_optimal replaces the fit by the TRUE scores
// in cluster order ("Cluster Optimal" of Table 1). The claim is the method's own estimate
// of its set's mass (tail included, scored exactly); decode_step reports the true one.
// sinks / recent (ours, default 0 = the paper): the first `sinks` and the last `recent`
// clustered tokens leave the ranked list and join the dense tail (always attended, scored
// exactly, in the estimate's total), as StreamingLLM and LFPS keep sinks and a window.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "cumulus/kernels/kmeans.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/methods/tactic.h"
#include "cumulus/methods/registry.h"
#include "methods/tactic/tactic_rules.h"
#include "methods/method_util.h"
#include "tactic_fit.h"

namespace cumulus {
namespace {

// The cluster index of one (layer, kv head): tokens [0, n_indexed) are in clusters.
struct HeadIndex {
  int n_indexed = 0;
  std::vector<float> centroids;  // [n_clusters][head_dim]
  std::vector<int32_t> begin;    // [n_clusters + 1] offsets into members
  std::vector<int32_t> members;  // tokens grouped by cluster, ascending within a cluster
  int n_clusters() const { return static_cast<int>(begin.size()) - 1; }
  // With sinks or recent tokens taken out (decode): each cluster's other members, for the
  // range [f_lo, f_hi) and f_clusters clusters they were filtered for.
  std::vector<int32_t> fmem, fbegin;
  int f_lo = -1, f_hi = -1, f_clusters = -1;
};

// Decode scratch of one kv head (the heads of a step run as parallel tasks).
struct Scratch {
  std::vector<float> cscores, tail_scores, all_scores, exact;
  std::vector<double> weights, ew;  // [list] estimated weights; exact weights of the scored positions
  std::vector<int32_t> list, tail_idx;  // list: cluster_optimal's unpacked list
  // Per query head of the group: its clusters in rank order, RankedList::cum, the
  // positions Algorithm 1 scores exactly and their tokens.
  struct HeadList {
    std::vector<int32_t> order, cum, gather;
    std::vector<int> pos;
    TacticWindows tw;
  };
  std::vector<HeadList> heads;
  std::vector<int32_t> group_tokens, slot_of;  // the heads' exactly scored tokens; token -> index
  std::vector<float> group_scores;             // [g][group_tokens]
  int n_scored = 0;  // cluster_optimal: tokens in all_scores per query head
  SelectWorkspace select;  // the clusters' ranking's sort keys
};

// A head's list x_1..x_L (4.3) without unpacking it: the clusters in rank order, each one's
// entries src[fbegin[c] .. fbegin[c + 1]); cum[r] entries precede rank r. Algorithm 1 reads
// only the positions it scores and the first k, a small part of the list.
struct RankedList {
  const int32_t* src = nullptr;
  const int32_t* fbegin = nullptr;
  const int32_t* order = nullptr;
  std::vector<int32_t>* cum = nullptr;
  int size() const { return cum->back(); }
  void rank(int n_clusters) {
    cum->assign(1, 0);
    for (int r = 0; r < n_clusters; ++r) cum->push_back(cum->back() + fbegin[order[r] + 1] - fbegin[order[r]]);
  }
  // out[u] = x_{pos[u]} for ascending positions.
  void gather(const int* pos, int n, int32_t* out) const {
    const int32_t* c = cum->data();
    int r = 0;
    for (int u = 0; u < n; ++u) {
      while (c[r + 1] <= pos[u]) ++r;
      out[u] = src[fbegin[order[r]] + (pos[u] - c[r])];
    }
  }
  // Appends x_1..x_k to into.
  void prefix(int k, std::vector<int32_t>& into) const {
    for (int r = 0; k > 0; ++r) {
      const int32_t* b = src + fbegin[order[r]];
      const int n = std::min(k, fbegin[order[r] + 1] - fbegin[order[r]]);
      into.insert(into.end(), b, b + n);
      k -= n;
    }
  }
};

class Tactic final : public DecodeMethod {
 public:
  Tactic(const Shape& shape, const TacticOptions& o)
      : shape_(shape),
        o_(o),
        index_(shape.n_layers),
        prefilled_(shape.n_layers, false),
        generation_(shape.n_layers, 0) {}
  std::string name() const override { return "tactic"; }

  void on_prefill(int layer, const KvCache& kv, const DecodeContext& ctx) override {
    CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
    auto& heads = index_[layer];
    heads.assign(shape_.n_kv_heads, HeadIndex{});
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      heads[h].begin = {0};
      cluster_segment(kv, layer, h, 0, kv.n_tokens(layer), ctx.pool, heads[h]);
    }
    prefilled_[layer] = true;
    generation_[layer] = kv.generation(layer);
  }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    CUMULUS_CHECK(prefilled_[layer], "tactic: decode on layer={} before on_prefill built its clusters", layer);
    // Its index describes the tokens the cache held at on_prefill plus those appended since;
    // a cut (truncate, clear) may have replaced them, even with as many new ones.
    CUMULUS_CHECK(kv.generation(layer) == generation_[layer],
                  "tactic: the cache of layer={} lost tokens since on_prefill built its clusters; run on_prefill "
                  "again (Session::restart_decode does)",
                  layer);
    methods::attn_output_reset(shape_, out);
    const int g = shape_.group();
    const int d = shape_.head_dim;
    const float scale = attention_scale(d);
    const int n = kv.n_tokens(layer);
    // Reclustering first, one kv head at a time (K-means spreads over the pool itself);
    // then one task per kv head: each reads its own index and writes its own list, stats
    // and scratch.
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      HeadIndex& idx = index_[layer][h];
      if (n - idx.n_indexed >= o_.recluster_interval) cluster_segment(kv, layer, h, idx.n_indexed, n, ctx.pool, idx);
    }
    scratch_.resize(std::max(scratch_.size(), static_cast<size_t>(shape_.n_kv_heads)));
    // The harmonic numbers the tasks read (budget's sums of the fitted curve).
    int most = 0;
    for (int h = 0; h < shape_.n_kv_heads; ++h) most = std::max(most, index_[layer][h].n_indexed);
    tactic_harmonic(harmonic_, most);
    ctx.pool->parallel_for(shape_.n_kv_heads, [&](int64_t hh, int) {
      const int h = static_cast<int>(hh);
      HeadIndex& idx = index_[layer][h];
      Scratch& w = scratch_[static_cast<size_t>(h)];
      const PagedHeadView v = kv.view(layer, h);
      const float* qg = q + static_cast<size_t>(h) * g * d;
      const int n_list = idx.n_indexed, n_clusters = idx.n_clusters();
      const double row = static_cast<double>(v.row_bytes());

      // Centroid scores [g][n_clusters] (4.3) and exact tail scores [g][n_tail].
      w.cscores.resize(static_cast<size_t>(g) * std::max(n_clusters, 1));
      if (n_clusters > 0) cpu::kmeans_centroid_score(idx.centroids.data(), n_clusters, d, qg, g, w.cscores.data());
      // The dense tail: tokens after the clusters, plus the sinks and recent tokens taken
      // out of the clusters (ascending; clustered tokens in [lo, hi) stay in the list).
      const int lo = std::min(o_.sinks, n_list), hi = std::max(lo, n_list - o_.recent);
      w.tail_idx.clear();
      for (int t = 0; t < lo; ++t) w.tail_idx.push_back(t);
      for (int t = hi; t < n; ++t) w.tail_idx.push_back(t);
      const int n_tail = static_cast<int>(w.tail_idx.size());
      w.tail_scores.resize(static_cast<size_t>(g) * n_tail);
      if (n_tail > 0) cpu::token_score(v, qg, g, w.tail_idx.data(), n_tail, w.tail_scores.data());
      // cluster_optimal reads every clustered key once for the group: scores by token id.
      w.n_scored = n_list;
      if (o_.cluster_optimal && n_list > 0) {
        w.all_scores.resize(static_cast<size_t>(g) * n_list);
        cpu::token_score(v, qg, g, nullptr, n_list, w.all_scores.data());
      }
      methods::add_kv_head_bytes(shape_, h,
                                 static_cast<double>(n_clusters) * d * sizeof(float) +
                                     (static_cast<double>(n_tail) + (o_.cluster_optimal ? n_list : 0)) * row,
                                 out);

      auto& uni = out.selection.tokens[h];
      uni.clear();
      // Each cluster's list entries, the same for every head of the group (the heads
      // differ only in the clusters' order): its tokens without the sinks and recent ones;
      // src[fbegin[c] .. fbegin[c + 1]) for cluster c. Kept in the index until the
      // clusters or the range change.
      const bool whole = lo == 0 && hi == n_list;  // no sinks or recent tokens taken out
      if (!whole && (idx.f_lo != lo || idx.f_hi != hi || idx.f_clusters != n_clusters)) {
        idx.fmem.clear();
        idx.fbegin.assign(1, 0);
        for (int c = 0; c < n_clusters; ++c) {
          for (int u = idx.begin[c]; u < idx.begin[c + 1]; ++u) {
            const int32_t t = idx.members[u];
            if (t >= lo && t < hi) idx.fmem.push_back(t);
          }
          idx.fbegin.push_back(static_cast<int32_t>(idx.fmem.size()));
        }
        idx.f_lo = lo;
        idx.f_hi = hi;
        idx.f_clusters = n_clusters;
      }
      const int32_t* src = whole ? idx.members.data() : idx.fmem.data();
      const int32_t* fbegin = whole ? idx.begin.data() : idx.fbegin.data();
      // 4.3 per query head: clusters by q . centroid (descending, ties to the lower index),
      // the list they unpack into, and the positions Algorithm 1 scores exactly.
      w.heads.resize(static_cast<size_t>(g));
      w.group_tokens.clear();
      for (int j = 0; j < g; ++j) {
        Scratch::HeadList& hl = w.heads[static_cast<size_t>(j)];
        hl.order.clear();
        if (n_clusters > 0)
          cpu::select_topk(w.cscores.data() + static_cast<size_t>(j) * n_clusters, n_clusters, n_clusters, hl.order,
                           &w.select);
        RankedList list{src, fbegin, hl.order.data(), &hl.cum};
        list.rank(static_cast<int>(hl.order.size()));
        hl.tw = TacticWindows{};
        hl.gather.clear();
        if (!o_.cluster_optimal && list.size() > 0) {
          // [0, N) and the two windows (Alg. 1 lines 4 and 8); every position of a list
          // too short for two disjoint windows past N (no fit).
          hl.tw = tactic_windows(list.size(), o_.init_ratio, o_.window, o_.p1, o_.p2);
          hl.pos.resize(static_cast<size_t>(hl.tw.n_exact));
          for (int u = 0; u < hl.tw.n_exact; ++u) hl.pos[u] = tactic_position(hl.tw, u);
          hl.gather.resize(hl.pos.size());
          list.gather(hl.pos.data(), hl.tw.n_exact, hl.gather.data());
          w.group_tokens.insert(w.group_tokens.end(), hl.gather.begin(), hl.gather.end());
        }
      }
      // The heads' exactly scored tokens, read once for the group (a token two heads score
      // is read once) and scored for every head.
      selection_normalize(w.group_tokens);
      const int mu = static_cast<int>(w.group_tokens.size());
      if (mu > 0) {
        w.group_scores.resize(static_cast<size_t>(g) * mu);
        cpu::token_score(v, qg, g, w.group_tokens.data(), mu, w.group_scores.data());
        w.slot_of.resize(static_cast<size_t>(n));
        for (int i = 0; i < mu; ++i) w.slot_of[w.group_tokens[i]] = i;
        methods::add_kv_head_bytes(shape_, h, static_cast<double>(mu) * row, out);
      }
      for (int j = 0; j < g; ++j) {
        const int qh = h * g + j;
        Scratch::HeadList& hl = w.heads[static_cast<size_t>(j)];
        RankedList list{src, fbegin, hl.order.data(), &hl.cum};
        if (o_.cluster_optimal) {  // reads every position
          w.list.clear();
          list.prefix(list.size(), w.list);
        }
        w.exact.resize(hl.gather.size());
        const float* sj = w.group_scores.data() + static_cast<size_t>(j) * mu;
        for (size_t u = 0; u < hl.gather.size(); ++u) w.exact[u] = sj[w.slot_of[hl.gather[u]]];
        const float* tail_j = w.tail_scores.data() + static_cast<size_t>(j) * n_tail;
        const int k = budget(list, hl.tw, scale, j, tail_j, n_tail, w, out.stats[qh].mass_claimed);
        list.prefix(k, uni);
      }
      uni.insert(uni.end(), w.tail_idx.begin(), w.tail_idx.end());  // the dense tail
      selection_normalize(uni);
    });
    methods::attend_selection(kv, layer, q, ctx, out);
  }

 private:
  // K-means (4.2) on tokens [t0, t1) of (layer, kv head h); the non-empty clusters are
  // appended to idx and idx.n_indexed becomes t1.
  void cluster_segment(const KvCache& kv, int layer, int h, int t0, int t1, ThreadPool* pool, HeadIndex& idx) {
    const int n = t1 - t0, d = shape_.head_dim;
    idx.n_indexed = t1;
    if (n <= 0) return;
    // x: [n][head_dim] the stored keys widened to float32.
    x_.resize(static_cast<size_t>(n) * d);
    for (int i = 0; i < n; ++i) kv.key_f32(layer, h, t0 + i, x_.data() + static_cast<size_t>(i) * d);
    const int k = tactic_cluster_count(n, o_.cluster_size);
    // Initial centroids: k distinct keys sampled uniformly (partial Fisher-Yates), seeded
    // by (seed, layer, kv head, segment start) so runs repeat exactly.
    tactic_initial_sample(o_.seed, layer, h, t0, n, k, perm_);
    cent_.resize(static_cast<size_t>(k) * d);
    for (int c = 0; c < k; ++c)
      std::copy_n(x_.data() + static_cast<size_t>(perm_[c]) * d, d, cent_.data() + static_cast<size_t>(c) * d);
    assign_.resize(n);
    counts_.resize(k);
    // Lloyd's rounds, the same result as assign + update until nothing changes, with most
    // distances skipped by bounds (kernels/kmeans.h).
    cpu::kmeans_lloyd(x_.data(), n, d, cent_.data(), k, o_.max_iter, assign_.data(), counts_.data(), pool);
    // counts_ matches assign_ (the loop ends after an update or with no change).
    std::vector<int32_t> slot(k, -1);
    for (int c = 0; c < k; ++c) {
      if (counts_[c] == 0) continue;  // an empty cluster ranks nothing: dropped
      slot[c] = idx.n_clusters();
      idx.centroids.insert(idx.centroids.end(), cent_.begin() + static_cast<size_t>(c) * d,
                           cent_.begin() + static_cast<size_t>(c + 1) * d);
      idx.begin.push_back(idx.begin.back() + counts_[c]);
    }
    const size_t base = idx.members.size();
    idx.members.resize(base + n);
    std::vector<int32_t> fill(k, 0);
    for (int i = 0; i < n; ++i) {
      const int c = assign_[i];
      const int dst = idx.begin[slot[c]] + fill[c]++;
      idx.members[dst] = t0 + i;  // ascending within a cluster: i visits tokens in order
    }
  }

  // Algorithm 1 for query head j over its list (cluster_optimal: also unpacked in w.list):
  // returns the budget k and sets `claimed`.
  //   tail: [n_tail] raw scores of the dense tail for this head
  //   tw: the positions scored exactly, w.exact their scores (fit)
  int budget(const RankedList& list, const TacticWindows& tw, float scale, int j, const float* tail, int n_tail,
             Scratch& w, double& claimed) const {
    const int L = list.size();
    w.weights.clear();  // the list's weights; the fit keeps only its first N (the rest is the curve)
    double fa = 0, fb = 0;  // the fitted curve a/x + b (0 where nothing is fitted)
    double shift = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < n_tail; ++i) shift = std::max(shift, static_cast<double>(scale * tail[i]));
    if (o_.cluster_optimal) {
      const float* s = w.all_scores.data() + static_cast<size_t>(j) * w.n_scored;  // by token id
      for (int i = 0; i < L; ++i) shift = std::max(shift, static_cast<double>(scale * s[w.list[i]]));
      w.weights.resize(static_cast<size_t>(L));
      for (int i = 0; i < L; ++i) w.weights[i] = std::exp(scale * s[w.list[i]] - shift);
    } else if (L > 0) {
      const int N = tw.N, b1 = tw.b1, e1 = tw.e1, b2 = tw.b2, e2 = tw.e2;
      const bool exact_all = tw.exact_all;
      for (float s : w.exact) shift = std::max(shift, static_cast<double>(scale * s));
      w.ew.resize(w.exact.size());
      for (size_t u = 0; u < w.exact.size(); ++u) w.ew[u] = std::exp(scale * w.exact[u] - shift);
      if (exact_all) {
        w.weights.assign(w.ew.begin(), w.ew.begin() + L);
      } else {
        w.weights.assign(w.ew.begin(), w.ew.begin() + N);
        // Window means of y and of 1/x (x = 1-based position): the mean of a/x + b over a
        // window is a * mean(1/x) + b, so the curve passes through both window means.
        auto means = [&](int off, int b, int e) {
          double mu = 0, hx = 0;
          for (int i = b; i < e; ++i) mu += w.ew[off + i - b], hx += 1.0 / (i + 1);
          return std::pair<double, double>{mu / (e - b), hx / (e - b)};
        };
        const auto [mu1, h1] = means(N, b1, e1);
        const auto [mu2, h2] = means(N + (e1 - b1), b2, e2);
        fa = (mu1 - mu2) / (h1 - h2);
        fb = mu1 - fa * h1;
      }
    }
    double tail_sum = 0;
    for (int i = 0; i < n_tail; ++i) tail_sum += std::exp(scale * tail[i] - shift);
    // Estimates past N (fit): summed in closed form (tactic_fit.h). Without a fit every
    // position is known (n_known == L) and the fit's range is empty.
    const int n_known = static_cast<int>(w.weights.size());
    const TacticFit fit(fa, fb, n_known, L, harmonic_.data());
    double total = 0;
    for (double x : w.weights) total += x;
    total += fit.sum(fit.L);
    int k = L;
    double prefix = total;
    if (o_.p < 1.0 && total > 0) {
      // Alg. 1 line 11: minimal k with sum_{i<=k} w_i >= P * sum_i w_i (list only; the
      // tail is attended regardless).
      const double target = o_.p * total;
      prefix = 0;
      k = 0;
      while (k < n_known && prefix < target) prefix += w.weights[k++];
      if (prefix < target && k < L) {  // inside the fit
        const double known = prefix;
        k = fit.first_reaching(known, target);
        prefix = known + fit.sum(k);
      }
    }
    claimed = total + tail_sum > 0 ? (prefix + tail_sum) / (total + tail_sum) : 1.0;
    return k;
  }

  Shape shape_;
  TacticOptions o_;
  std::vector<std::vector<HeadIndex>> index_;  // [n_layers][n_kv_heads]
  std::vector<bool> prefilled_;       // [n_layers]
  std::vector<uint64_t> generation_;  // [n_layers] the cache's generation at on_prefill
  // Clustering scratch (one kv head at a time).
  std::vector<float> x_, cent_;
  std::vector<int32_t> assign_, counts_, perm_;
  std::vector<Scratch> scratch_;  // [n_kv_heads] decode scratch, one per task
  std::vector<double> harmonic_;  // [x] = sum_{m=1..x} 1/m (budget)
};

}  // namespace

void TacticOptions::check() const {
  CUMULUS_CHECK(p1 < p2, "method 'tactic': parameters p1={} and p2={} need p1 < p2", p1, p2);
}

void register_tactic(Registry& r) {
  r.add({.name = "tactic",
         .kind = MethodKind::decode,
         .paper = "Tactic, section 4 + Algorithm 1: K-means clusters, ranked by q . centroid, budget by "
                  "fitting y = a/x + b",
         .summary = "fewest tokens whose estimated cumulative mass reaches P (dense tail after prefill)",
         .params = options_params<TacticOptions>(),  // methods/tactic.h
         .make_decode = [](const Shape& s, const Params& p) {
           return std::make_unique<Tactic>(s, options_read<TacticOptions>(p));
         },
         .check = options_check<TacticOptions>(),
         .target_param = "p",
         .color = "#e15759"});
}

}  // namespace cumulus
