// sketch_topp: top-p attention for a GQA group from a 4-bit key sketch (ours; not from a
// seed paper; docs/methods.md "sketch_topp"). The method keeps, per (layer, kv head), a
// 4-bit sketch of every key (kernels/sketch.h: per-channel normalisation from the prompt,
// per-token range, int8 query, an integer dot product per token), about 1/8 of the head's
// K+V bytes at 16 bits. Each decode step, per kv head and once for its query group
// (q_j, j < G):
//   1. every token's weight is estimated from the sketch, e_jt = exp(scale est_jt - c_j),
//      with S_j = sum_t e_jt head j's estimated total;
//   2. the union: the sinks (first tokens) and the recent tokens always, then the other
//      tokens in the order of their largest estimated share max_j e_jt / S_j, up to the
//      smallest prefix at which every head's estimated share reaches candidate_p
//      (select_mass_threshold; one ranking for the group, so each head's mass is counted
//      over the union the group reads, not over a list of its own);
//   3. the union is attended exactly (K and V rows, the shared sparse kernel), which gives
//      each head's exact mass over it, A_j = sum_U exp(scale q_j.k_t - c_j) (from the
//      log-sum-exp); head j's total is T_j = A_j + (S_j - sum_U e_jt): exact over what was
//      read, estimated only over what was not;
//   4. a head whose share A_j / T_j falls short of P gets more tokens: candidate_p moves
//      to 1 - (1 - candidate_p) / 4 (twice), the tokens this adds are attended and merged
//      by log-sum-exp; after that, the rest of the context (then dense; claim 1);
//   5. rest=mean (the default): the tokens not read join the output with their estimated
//      mass R_j = S_j - sum_U e_jt times the head's mean value row (kept as tokens are
//      appended): o = (A_j o_U + R_j vbar) / (A_j + R_j). It changes the output, not the
//      set or the claim; rest=none leaves them out, as the papers' methods do.
// Cost rule: a context of at most min_context tokens, and a kv head whose union passes
// dense_above of its tokens, attend densely (claim 1).
// Claims: A_j / T_j, whose only estimated part is the sketch's weight of the tokens not
// read. Bytes read: the sketch of every token (codes plus the f16 offset and step), then
// the union's K and V rows.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>

#include "core/check.h"
#include "cumulus/core/dtype.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/kernels/sketch.h"
#include "cumulus/methods/sketch_topp.h"
#include "cumulus/methods/registry.h"
#include "methods/method_util.h"

namespace cumulus {
namespace {

// Rounds of step 4 before the rest of the context is attended.
constexpr int kRounds = 3;

// The sketch of one (layer, kv head): tokens [0, n) encoded.
struct HeadSketch {
  std::vector<uint8_t> codes;    // [blocks][head_dim / 8][16][4]
  std::vector<uint16_t> offset;  // [blocks * 16] f16
  std::vector<uint16_t> step;    // [blocks * 16] f16
  std::vector<float> center;     // [head_dim]
  std::vector<float> scale;      // [head_dim]
  int n = 0;
  uint64_t generation = 0;       // the cache's generation the codes were encoded at
  std::vector<double> value_sum;  // [head_dim] sum of the value rows of tokens [0, n) (rest=mean)
  std::vector<float> last_shift;  // [group] the largest scale est of the last step, per query head
  float last_kappa = 0;           // the last step's threshold on the group key (a hint for the next)

  KeySketchView view(int head_dim) const {
    return {codes.data(), offset.data(), step.data(), center.data(), scale.data(), n, head_dim};
  }
  // Brings the sketch to the cache's tokens: new tokens are encoded; after the cache lost
  // tokens (its generation changed: a cut, perhaps followed by appends) every token is
  // encoded again. The normalisation is fixed by the first call (the prompt's keys).
  void update(const PagedHeadView& v, uint64_t cache_generation, bool with_values) {
    if (center.empty()) {
      center.resize(static_cast<size_t>(v.head_dim));
      scale.resize(static_cast<size_t>(v.head_dim));
      key_sketch_channels(v, center.data(), scale.data());
    }
    if (cache_generation != generation) n = 0;
    generation = cache_generation;
    if (n == v.n_tokens) return;
    const size_t blocks = static_cast<size_t>((v.n_tokens + kSketchBlock - 1) / kSketchBlock);
    if (offset.size() < blocks * kSketchBlock) {
      const size_t cap = std::max(blocks, offset.size() / kSketchBlock * 3 / 2);
      codes.resize(cap * key_sketch_block_bytes(v.head_dim));
      offset.resize(cap * kSketchBlock);
      step.resize(cap * kSketchBlock);
    }
    key_sketch_encode(v, n, v.n_tokens, center.data(), scale.data(), {codes.data(), offset.data(), step.data()});
    if (with_values) {
      if (n == 0) value_sum.assign(static_cast<size_t>(v.head_dim), 0.0);
      std::vector<float> row(static_cast<size_t>(v.head_dim));
      for (int t = n; t < v.n_tokens; ++t) {
        convert_to_f32(v.value(t), v.dtype, row.data(), row.size());
        for (int c = 0; c < v.head_dim; ++c) value_sum[c] += row[c];
      }
    }
    n = v.n_tokens;
  }
};

class SketchTopp final : public DecodeMethod {
 public:
  SketchTopp(const Shape& shape, const SketchToppOptions& o)
      : shape_(shape), o_(o), sketch_(static_cast<size_t>(shape.n_layers)) {}
  std::string name() const override { return "sketch_topp"; }

  void on_prefill(int layer, const KvCache& kv, const DecodeContext& ctx) override {
    CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "sketch_topp: layer={} out of range [0, {})", layer,
                  shape_.n_layers);
    auto& heads = sketch_[static_cast<size_t>(layer)];
    heads.assign(static_cast<size_t>(shape_.n_kv_heads), HeadSketch{});
    ctx.pool->parallel_for(shape_.n_kv_heads, [&](int64_t h, int) {
      heads[static_cast<size_t>(h)].update(kv.view(layer, static_cast<int>(h)), kv.generation(layer), o_.rest_mean);
    });
  }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    const int n = kv.n_tokens(layer);
    const int g = shape_.group();
    const int n_kv = shape_.n_kv_heads;
    const bool dense = n <= o_.min_context || o_.p >= 1.0;
    auto& heads = sketch_[static_cast<size_t>(layer)];
    if (heads.empty()) heads.resize(static_cast<size_t>(n_kv));
    scratch_.resize(std::max(scratch_.size(), static_cast<size_t>(n_kv)));
    if (dense) {
      for (int h = 0; h < n_kv; ++h) scratch_[static_cast<size_t>(h)].dense = true;
    } else {
      select(layer, q, kv, *ctx.pool, out);
    }
    for (int h = 0; h < n_kv; ++h) {
      if (!scratch_[static_cast<size_t>(h)].dense) continue;
      auto& t = out.selection.tokens[h];
      t.resize(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) t[i] = i;
    }
    // 3. Every head's union in one call of the sparse kernel (split over the context, so
    // the threads share the rows however the heads differ).
    lse_.resize(static_cast<size_t>(shape_.n_q_heads));
    methods::attend_selection(kv, layer, q, ctx, out, lse_.data());
    // 4. Claims, and more tokens for the heads that fall short: one task per kv head. A
    // head short of P adds tokens (extend_union), scores and attends them on its own
    // thread and merges them by log-sum-exp, at most kRounds times.
    ctx.pool->parallel_for(n_kv, [&](int64_t hh, int) {
      const int h = static_cast<int>(hh);
      Scratch& w = scratch_[static_cast<size_t>(h)];
      if (w.dense) {
        for (int j = 0; j < g; ++j) out.stats[h * g + j].mass_claimed = 1.0;
        return;
      }
      auto& t = out.selection.tokens[h];
      for (int round = 1;; ++round) {
        bool short_of_p = false;
        for (int j = 0; j < g; ++j) {
          const double a = std::exp(static_cast<double>(lse_[h * g + j]) - w.shift[j]);
          const double total = a + std::max(0.0, w.est_sum[j] - w.est_union[j]);
          out.stats[h * g + j].mass_claimed = std::min(1.0, a / total);
          short_of_p = short_of_p || a < o_.p * total;
        }
        if (!short_of_p || round > kRounds) break;
        extend_union(round, t, w.added, w);
        if (w.added.empty()) break;
        attend_added(h, q, kv.view(layer, h), w, out);
        w.merged.clear();
        std::merge(t.begin(), t.end(), w.added.begin(), w.added.end(), std::back_inserter(w.merged));
        t.swap(w.merged);
        for (int j = 0; j < g; ++j) out.stats[h * g + j].tokens_attended = static_cast<int>(t.size());
      }
    });
    // rest=mean: the tokens not read join the output with their estimated mass and the
    // mean value row of the head, o = (A o_U + R vbar) / (A + R).
    if (o_.rest_mean && !dense) {
      const int d = shape_.head_dim;
      for (int h = 0; h < n_kv; ++h) {
        const Scratch& w = scratch_[static_cast<size_t>(h)];
        if (w.dense) continue;
        const HeadSketch& sk = heads[static_cast<size_t>(h)];
        for (int j = 0; j < g; ++j) {
          const int qh = h * g + j;
          const double a = std::exp(static_cast<double>(lse_[qh]) - w.shift[j]);
          const double rest = std::max(0.0, w.est_sum[j] - w.est_union[j]);
          const double wa = a / (a + rest), wr = rest / (a + rest) / sk.n;
          float* o = out.out.data() + static_cast<size_t>(qh) * d;
          for (int c = 0; c < d; ++c) o[c] = static_cast<float>(wa * o[c] + wr * sk.value_sum[c]);
        }
      }
    }
  }

 private:
  struct Scratch {
    bool dense = false;
    std::vector<float> est;          // [g][n] estimated weights e_jt
    std::vector<float> top_f;        // [g] the largest scale est_jt - c_j
    std::vector<float> shift_f;      // [g] c_j as the kernel takes it
    std::vector<double> part_sum;    // [parts][g] weight sums of each part of the context
    std::vector<float> part_top;     // [parts][g] the largest scale est_jt - c_j of each part
    bool redo = false;               // the weights pass runs (again) for this head
    std::vector<float> key;          // [n] max_j e_jt / S_j; the sinks and recent tokens above any share
    std::vector<double> shift;       // [g] c_j: weights are exp(scale score - c_j)
    std::vector<double> est_sum;     // [g] S_j
    std::vector<double> est_union;   // [g] sum over the union of e_jt
    std::vector<double> need;        // [g]
    std::vector<float> inv;          // [g] 1 / S_j
    std::vector<int32_t> wider;      // a round's union
    std::vector<int32_t> added;      // a round's tokens not in the union yet
    std::vector<int32_t> merged;     // the union with them
    std::vector<float> added_w;      // [g][added] their scores, then normalised weights
    std::vector<float> added_o;      // [g][head_dim] attention over them
    double candidate_p = 0;          // the share the union was chosen at
    MassThresholdWorkspace threshold;  // select_mass_threshold's band (grows with the context)
  };

  // Steps 1-2 for every kv head: the unions into out.selection.tokens, Scratch::dense for
  // the heads the cost rule sends to dense attention. The work runs as tasks over (kv head,
  // part of the context), so that a model with fewer kv heads than twice the threads (3 for
  // SmolLM2, 1 for Gemma 3) still keeps every thread busy: the sketch's weights and the
  // group key per part, then the threshold per kv head.
  void select(int layer, const float* q_all, const KvCache& kv, ThreadPool& pool, AttnOutput& out) {
    const int g = shape_.group();
    const int d = shape_.head_dim;
    const int n_kv = shape_.n_kv_heads;
    const float scale = attention_scale(d);
    const int n = kv.n_tokens(layer);
    auto& heads = sketch_[static_cast<size_t>(layer)];
    // Parts of whole sketch blocks, at least kMinPart tokens each, about kTasks tasks in
    // all. The split depends on the problem alone, never on the thread count, so the sums
    // (and the results) are the same for any number of threads.
    constexpr int kMinPart = 1024, kTasks = 8;
    const int want = std::max(1, kTasks / n_kv);
    const int parts = std::max(1, std::min(want, n / kMinPart));
    const int part_len = (n / parts + kSketchBlock - 1) / kSketchBlock * kSketchBlock;
    auto part_range = [&](int k) { return std::pair{std::min(n, k * part_len), std::min(n, (k + 1) * part_len)}; };
    for (int h = 0; h < n_kv; ++h) {
      Scratch& w = scratch_[static_cast<size_t>(h)];
      w.est.resize(static_cast<size_t>(g) * n);
      w.key.resize(static_cast<size_t>(n));
      w.shift.resize(static_cast<size_t>(g));
      w.est_sum.resize(static_cast<size_t>(g));
      w.est_union.resize(static_cast<size_t>(g));
      w.need.resize(static_cast<size_t>(g));
      w.part_sum.resize(static_cast<size_t>(parts) * g);
      w.part_top.resize(static_cast<size_t>(parts) * g);
      w.top_f.resize(static_cast<size_t>(g));
    }
    // The sketch brought to the cache: one new token per decode step here, on this thread;
    // many (the first step without on_prefill, or after a cut) one task per kv head.
    bool bulk = false;
    for (int h = 0; h < n_kv; ++h) {
      const HeadSketch& sk = heads[static_cast<size_t>(h)];
      bulk = bulk || sk.generation != kv.generation(layer) || n - sk.n > 64;
    }
    auto update = [&](int64_t h, int) {
      heads[static_cast<size_t>(h)].update(kv.view(layer, static_cast<int>(h)), kv.generation(layer), o_.rest_mean);
    };
    if (bulk) {
      pool.parallel_for(n_kv, update);
    } else {
      for (int h = 0; h < n_kv; ++h) update(h, 0);
    }
    // 1. The weights against a shift guessed from the head's last step (the largest
    // estimate moves little between steps); a guess off by more than kShiftSlack (or none
    // yet) costs a second pass with the measured one.
    constexpr float kShiftSlack = 30.0f;
    for (int h = 0; h < n_kv; ++h) {
      Scratch& w = scratch_[static_cast<size_t>(h)];
      const HeadSketch& sk = heads[static_cast<size_t>(h)];
      w.shift_f.assign(sk.last_shift.begin(), sk.last_shift.end());
      w.shift_f.resize(static_cast<size_t>(g), 0.0f);
      w.redo = true;
    }
    for (int pass = 0; pass < 2; ++pass) {
      pool.parallel_for(static_cast<int64_t>(n_kv) * parts, [&](int64_t task, int) {
        const int h = static_cast<int>(task / parts), k = static_cast<int>(task % parts);
        Scratch& w = scratch_[static_cast<size_t>(h)];
        if (!w.redo) return;
        const auto [t0, t1] = part_range(k);
        cpu::key_sketch_weights(heads[static_cast<size_t>(h)].view(d), q_all + static_cast<size_t>(h) * g * d, g, t0,
                                t1, scale, w.shift_f.data(), w.est.data() + t0, static_cast<size_t>(n),
                                w.part_sum.data() + static_cast<size_t>(k) * g,
                                w.part_top.data() + static_cast<size_t>(k) * g);
      });
      bool again = false;
      for (int h = 0; h < n_kv; ++h) {
        Scratch& w = scratch_[static_cast<size_t>(h)];
        if (!w.redo) continue;
        w.redo = false;
        for (int j = 0; j < g; ++j) {
          double sum = 0;
          float top = -std::numeric_limits<float>::infinity();
          for (int k = 0; k < parts; ++k) {
            sum += w.part_sum[static_cast<size_t>(k) * g + j];
            top = std::max(top, w.part_top[static_cast<size_t>(k) * g + j]);
          }
          w.est_sum[j] = sum;
          w.top_f[j] = top;
          w.redo = w.redo || std::abs(top) > kShiftSlack;
        }
        if (w.redo && pass == 0) {
          for (int j = 0; j < g; ++j) w.shift_f[j] += w.top_f[j];
          again = true;
        } else {
          w.redo = false;
        }
      }
      if (!again) break;
    }
    for (int h = 0; h < n_kv; ++h) {
      Scratch& w = scratch_[static_cast<size_t>(h)];
      HeadSketch& sk = heads[static_cast<size_t>(h)];
      sk.last_shift.resize(static_cast<size_t>(g));
      for (int j = 0; j < g; ++j) {
        sk.last_shift[j] = w.shift_f[j] + w.top_f[j];
        w.shift[j] = w.shift_f[j];
      }
      methods::add_kv_head_bytes(shape_, h, static_cast<double>(n) * key_sketch_token_bytes(d), out);
    }
    // 2. Per kv head: the group key, max_j e_jt / S_j (the sinks and the recent tokens
    // first in the order: a share is at most 1), the threshold and the union.
    const int lo = std::min(o_.sinks, n), hi = std::max(lo, n - o_.recent);
    pool.parallel_for(n_kv, [&](int64_t hh, int) {
      const int h = static_cast<int>(hh);
      Scratch& w = scratch_[static_cast<size_t>(h)];
      w.candidate_p = o_.candidate_p;
      for (int j = 0; j < g; ++j) w.need[j] = w.candidate_p * w.est_sum[j];
      w.inv.resize(static_cast<size_t>(g));
      for (int j = 0; j < g; ++j) w.inv[j] = static_cast<float>(1.0 / w.est_sum[j]);
      HeadSketch& sk = heads[static_cast<size_t>(h)];
      const float kappa = cpu::select_group_threshold(w.est.data(), g, n, w.inv.data(), lo, hi, w.key.data(),
                                                      w.need.data(), w.est_union.data(), sk.last_kappa, &w.threshold);
      auto& t = out.selection.tokens[h];
      t.clear();
      cpu::select_any_above(w.key.data(), 1, n, &kappa, 0, t);
      if (std::isfinite(kappa) && kappa > 0) sk.last_kappa = kappa;
      w.dense = static_cast<double>(t.size()) > o_.dense_above * n;
    });
  }

  // The smallest prefix of the key order at which every head's estimated share reaches
  // cp, as ascending token ids into `t`; est_union gets the estimates' sums over it (a
  // round's wider union; the first comes from select_group_threshold in select()).
  static float choose(Scratch& w, int g, int n, double cp, std::vector<int32_t>& t) {
    for (int j = 0; j < g; ++j) w.need[j] = cp * w.est_sum[j];
    const float kappa =
        cpu::select_mass_threshold(w.key.data(), w.est.data(), g, n, w.need.data(), w.est_union.data(), 0.0f,
                                   &w.threshold);
    cpu::select_any_above(w.key.data(), 1, n, &kappa, 0, t);
    return kappa;
  }

  // Attends kv head h's group over w.added (tokens not in its union) on this thread and
  // merges the result into out's rows and lse_ by log-sum-exp; counts their K and V bytes.
  void attend_added(int h, const float* q_all, const PagedHeadView& v, Scratch& w, AttnOutput& out) {
    const int g = shape_.group();
    const int d = shape_.head_dim;
    const float scale = attention_scale(d);
    const int m = static_cast<int>(w.added.size());
    const float* q = q_all + static_cast<size_t>(h) * g * d;
    w.added_w.resize(static_cast<size_t>(g) * m);
    w.added_o.resize(static_cast<size_t>(g) * d);
    cpu::token_score(v, q, g, w.added.data(), m, w.added_w.data());
    std::vector<float> lse(static_cast<size_t>(g));
    for (int j = 0; j < g; ++j) {
      float* x = w.added_w.data() + static_cast<size_t>(j) * m;
      const float top = scale * cpu::score_max(x, m);
      const double l = cpu::score_exp(x, m, scale, top, x);
      const float inv = static_cast<float>(1.0 / l);
      for (int i = 0; i < m; ++i) x[i] *= inv;
      lse[j] = top + static_cast<float>(std::log(l));
    }
    cpu::attention_weighted_values(v, w.added.data(), m, w.added_w.data(), g, w.added_o.data());
    for (int j = 0; j < g; ++j) {
      const int qh = h * g + j;
      methods::merge_partial(lse_[qh], out.out.data() + static_cast<size_t>(qh) * d, lse[j],
                             w.added_o.data() + static_cast<size_t>(j) * d, d);
    }
    methods::add_kv_head_bytes(shape_, h, static_cast<double>(m) * 2 * v.row_bytes(), out);
  }

  // Step 4 for a kv head (its scratch w) in `round` (1-based): the tokens to add to its union `have`.
  void extend_union(int round, const std::vector<int32_t>& have, std::vector<int32_t>& add, Scratch& w) const {
    const int g = shape_.group();
    const int n = static_cast<int>(w.key.size());
    add.clear();
    w.wider.clear();
    if (round < kRounds) {
      w.candidate_p = 1 - (1 - w.candidate_p) / 4;
      choose(w, g, n, w.candidate_p, w.wider);
    } else {  // the rest of the context: the head ends dense
      w.wider.resize(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) w.wider[i] = i;
      for (int j = 0; j < g; ++j) w.est_union[j] = w.est_sum[j];
    }
    std::set_difference(w.wider.begin(), w.wider.end(), have.begin(), have.end(), std::back_inserter(add));
  }

  Shape shape_;
  SketchToppOptions o_;
  std::vector<std::vector<HeadSketch>> sketch_;  // [n_layers][n_kv_heads]
  std::vector<Scratch> scratch_;                 // [n_kv_heads]
  std::vector<float> lse_;                       // [n_q_heads]
};

}  // namespace

void register_sketch_topp(Registry& r) {
  r.add({.name = "sketch_topp",
         .kind = MethodKind::decode,
         .paper = "ours: top-p from a 4-bit key sketch (every token estimated, the group's union attended exactly, "
                  "claims exact over what was read)",
         .summary = "sinks + recent; union by 4-bit sketch estimate where every head reaches candidate_p; more tokens "
                    "until every head's exact share reaches P",
         .params = options_params<SketchToppOptions>(),  // methods/sketch_topp.h
         .make_decode = [](const Shape& s, const Params& p) {
           return std::make_unique<SketchTopp>(s, options_read<SketchToppOptions>(p));
         },
         .check = options_check<SketchToppOptions>(),
         .target_param = "p",
         .color = "#9467bd"});
}

}  // namespace cumulus
