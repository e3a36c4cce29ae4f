// The selection ops on the host (kernels/select_ops.h, host_select_ops.h): one task per
// (sequence, kv head) holds its group's scores, chosen sets, claims and a bitmap of the
// union; the cpu backend runs the tasks on the pool, the ref backend one after another.
// Each task writes only its own state, so the result does not depend on the threads.
// Checks run as the policy issues each op, before any work.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "kernels/host_select_ops.h"
#include "kernels/select_ops_check.h"

namespace cumulus {
namespace kernels {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
using Units = SelectOpsCheck::Units;

// Bits [b, e) of a bitmap.
void set_range(std::vector<uint64_t>& bits, int b, int e) {
  for (int i = b; i < e;) {
    const int w = i >> 6, lo = i & 63;
    const int hi = std::min(64, lo + (e - i));
    const uint64_t m = (hi == 64 ? ~uint64_t{0} : (uint64_t{1} << hi) - 1) & ~((uint64_t{1} << lo) - 1);
    bits[static_cast<size_t>(w)] |= m;
    i += hi - lo;
  }
}

// The ops are recorded (and checked) as the policy issues them and run by finish(): one
// task per (sequence, kv head) runs the whole step for its group, so a step costs one
// dispatch on the pool, as a method written by hand would.
class HostOps final : public HostSelectOps {
 public:
  explicit HostOps(const HostSelectKernels& k) : k_(k), check_(std::string("select ops (") + k.backend + ")") {}

  void begin(const HostSelectBatch& b) override {
    CUMULUS_CHECK(b.kv != nullptr && b.q != nullptr, "select ops ({}): kv and q must be non-null", k_.backend);
    CUMULUS_CHECK(b.n_seqs >= 1 && b.n_kv_heads >= 1 && b.group >= 1,
                  "select ops ({}): n_seqs={}, n_kv_heads={}, group={} must be >= 1", k_.backend, b.n_seqs,
                  b.n_kv_heads, b.group);
    CUMULUS_CHECK(!k_.parallel || b.pool != nullptr, "select ops ({}): a thread pool is required", k_.backend);
    for (int t = 1; t < b.n_seqs * b.n_kv_heads; ++t)
      CUMULUS_CHECK(b.kv[t].head_dim == b.kv[0].head_dim && b.kv[t].page_size == b.kv[0].page_size,
                    "select ops ({}): view {} has head_dim={}, page_size={}; view 0 has {}, {}", k_.backend, t,
                    b.kv[t].head_dim, b.kv[t].page_size, b.kv[0].head_dim, b.kv[0].page_size);
    b_ = b;
    check_.begin();
    ops_.clear();
  }

  int page_size() const override {
    CUMULUS_CHECK(b_.kv != nullptr, "select ops ({}): page_size before begin", k_.backend);
    return b_.kv[0].page_size;
  }

  void score_tokens() override {
    check_.score(Units::kTokens);
    ops_.push_back({.kind = Kind::kScoreTokens});
  }

  void score_pages_bound() override {
    for (int t = 0; t < b_.n_seqs * b_.n_kv_heads; ++t)
      CUMULUS_CHECK(b_.kv[t].n_pages() == 0 || (b_.kv[t].kmin != nullptr && b_.kv[t].kmax != nullptr),
                    "select ops ({}): score_pages_bound needs the pages' key min and max", k_.backend);
    check_.score(Units::kPages);
    ops_.push_back({.kind = Kind::kScorePages});
  }

  void choose_topk(int k) override {
    check_.choose_topk(k);
    ops_.push_back({.kind = Kind::kTopk, .k = k});
  }

  void choose_top_mass(double p) override {
    check_.choose_top_mass(p);
    ops_.push_back({.kind = Kind::kTopMass, .p = p});
  }

  void mark_chosen(bool claim_mass) override {
    check_.mark_chosen(claim_mass);
    ops_.push_back({.kind = Kind::kMarkChosen, .claim = claim_mass});
  }

  void mark_ends(int head, int tail) override {
    check_.mark_ends(head, tail);
    ops_.push_back({.kind = Kind::kMarkEnds, .k = head, .k2 = tail});
  }

  void mark_all() override { ops_.push_back({.kind = Kind::kMarkAll}); }

  void finish(std::vector<int32_t>* lists, double* claims, double* bytes) override {
    CUMULUS_CHECK(b_.kv != nullptr, "select ops ({}): finish before begin", k_.backend);
    heads_.resize(static_cast<size_t>(b_.n_seqs) * b_.n_kv_heads);
    const int n = b_.n_seqs * b_.n_kv_heads;
    auto task = [&](int t) {
      Head& h = heads_[static_cast<size_t>(t)];
      run(h, b_.kv[t], query(t));
      lists[t].swap(h.list);
      for (int j = 0; j < b_.group; ++j) claims[t * b_.group + j] = h.claims[static_cast<size_t>(j)];
      bytes[t] = h.bytes;
    };
    if (k_.parallel && n > 1) {
      b_.pool->parallel_for(n, [&](int64_t t, int) { task(static_cast<int>(t)); });
    } else {
      for (int t = 0; t < n; ++t) task(t);
    }
  }

 private:
  enum class Kind { kScoreTokens, kScorePages, kTopk, kTopMass, kMarkChosen, kMarkEnds, kMarkAll };
  struct Op {
    Kind kind;
    int k = 0, k2 = 0;
    double p = 0;
    bool claim = false;
  };
  struct Head {
    std::vector<float> scores;                 // [group][units]
    std::vector<float> probs;                  // [group][n_tokens], when probs_ok
    std::vector<std::vector<int32_t>> chosen;  // [group]
    std::vector<uint64_t> marks;               // the union, a bit per token
    std::vector<double> claims;                // [group]
    std::vector<int32_t> list;                 // the union as a list, before the swap
    SelectWorkspace select;                    // top-k's and top-mass's scratch
    double bytes = 0;
    bool probs_ok = false;
  };

  const float* query(int t) const {
    const int s = t / b_.n_kv_heads, h = t % b_.n_kv_heads;
    return b_.q + (static_cast<size_t>(s) * b_.n_kv_heads * b_.group + static_cast<size_t>(h) * b_.group) *
                      b_.kv[t].head_dim;
  }

  // The recorded step for one (sequence, kv head): its group's rows.
  void run(Head& h, const PagedHeadView& v, const float* q) const {
    const int g = b_.group, n = v.n_tokens;
    h.probs_ok = false;
    h.bytes = 0;
    h.claims.assign(static_cast<size_t>(g), kNaN);
    h.chosen.resize(static_cast<size_t>(g));
    h.marks.assign(static_cast<size_t>((n + 63) >> 6), 0);
    Units units = Units::kNone;
    for (const Op& op : ops_) {
      switch (op.kind) {
        case Kind::kScoreTokens:
          units = Units::kTokens;
          h.scores.resize(static_cast<size_t>(g) * n);
          k_.token_score(v, q, g, nullptr, n, h.scores.data());
          h.probs_ok = false;
          h.bytes += static_cast<double>(n) * v.row_bytes();
          break;
        case Kind::kScorePages: {
          units = Units::kPages;
          const int np = v.n_pages();
          h.scores.resize(static_cast<size_t>(g) * np);
          if (np > 0) k_.page_score_bound(v, q, g, h.scores.data());
          h.probs_ok = false;
          h.bytes += 2.0 * np * v.head_dim * sizeof(float);
          break;
        }
        case Kind::kTopk: {
          const int m = units == Units::kPages ? v.n_pages() : n;
          for (int j = 0; j < g; ++j)
            k_.select_topk(h.scores.data() + static_cast<size_t>(j) * m, m, op.k, h.chosen[static_cast<size_t>(j)],
                           &h.select);
          break;
        }
        case Kind::kTopMass:
          ensure_probs(h, v);
          for (int j = 0; j < g; ++j)
            k_.select_top_mass(h.probs.data() + static_cast<size_t>(j) * n, n, op.p, h.chosen[static_cast<size_t>(j)],
                               &h.select);
          break;
        case Kind::kMarkChosen:
          if (op.claim) ensure_probs(h, v);
          for (int j = 0; j < g; ++j) {
            const auto& ch = h.chosen[static_cast<size_t>(j)];
            if (units == Units::kPages) {
              for (int32_t p : ch) set_range(h.marks, p * v.page_size, p * v.page_size + v.page_len(p));
            } else {
              for (int32_t t : ch) h.marks[static_cast<size_t>(t >> 6)] |= uint64_t{1} << (t & 63);
            }
            double claimed = kNaN;
            if (op.claim) {
              const float* pr = h.probs.data() + static_cast<size_t>(j) * n;
              claimed = 0;
              for (int32_t t : ch) claimed += pr[t];
            }
            h.claims[static_cast<size_t>(j)] = claimed;
          }
          break;
        case Kind::kMarkEnds:
          set_range(h.marks, 0, std::min(op.k, n));
          set_range(h.marks, std::max(0, n - op.k2), n);
          h.claims.assign(static_cast<size_t>(g), kNaN);
          break;
        case Kind::kMarkAll:
          set_range(h.marks, 0, n);
          h.claims.assign(static_cast<size_t>(g), 1.0);
          break;
      }
    }
    h.list.clear();
    for (size_t w = 0; w < h.marks.size(); ++w)
      for (uint64_t m = h.marks[w]; m != 0; m &= m - 1)
        h.list.push_back(static_cast<int32_t>(w * 64 + static_cast<size_t>(std::countr_zero(m))));
  }

  // probs = each row's softmax of scale * scores (a float exp per token, summed in
  // float64, scaled by the float reciprocal of the sum).
  void ensure_probs(Head& h, const PagedHeadView& v) const {
    if (h.probs_ok) return;
    const int n = v.n_tokens;
    const float scale = 1.0f / std::sqrt(static_cast<float>(v.head_dim));
    h.probs.resize(static_cast<size_t>(b_.group) * n);
    for (int j = 0; j < b_.group; ++j) {
      const float* s = h.scores.data() + static_cast<size_t>(j) * n;
      float* pr = h.probs.data() + static_cast<size_t>(j) * n;
      float mx = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < n; ++i) mx = std::max(mx, s[i] * scale);
      double sum = 0;
      for (int i = 0; i < n; ++i) {
        const float e = std::exp(s[i] * scale - mx);
        pr[i] = e;
        sum += e;
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int i = 0; i < n; ++i) pr[i] *= inv;
    }
    h.probs_ok = true;
  }

  HostSelectKernels k_;
  HostSelectBatch b_;
  SelectOpsCheck check_;  // the ops recorded so far, checked as they come
  std::vector<Op> ops_;
  std::vector<Head> heads_;  // [n_seqs][n_kv_heads]
};

}  // namespace

std::unique_ptr<HostSelectOps> make_host_select_ops(const HostSelectKernels& k) {
  return std::make_unique<HostOps>(k);
}

}  // namespace kernels

namespace cpu {

std::unique_ptr<HostSelectOps> make_select_ops() {
  return kernels::make_host_select_ops({.backend = "cpu",
                                        .token_score = &cpu::token_score,
                                        .page_score_bound = [](const PagedHeadView& kv, const float* q, int n_q,
                                                               float* s) { cpu::page_score_bound(kv, q, n_q, s); },
                                        .select_topk = &cpu::select_topk,
                                        .select_top_mass = &cpu::select_top_mass,
                                        .parallel = true});
}

}  // namespace cpu
}  // namespace cumulus
