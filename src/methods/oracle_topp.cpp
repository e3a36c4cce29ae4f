// oracle_topp: for each query head, the minimal set of tokens whose TRUE softmax mass
// reaches P (the "Optimal" row of Tactic Table 1, section 3). It reads every key to
// score it, so it is a yardstick for adaptive methods, not a practical one. The group
// attends the union of its heads' sets (Tactic 4.5); each head claims the exact mass of
// its own set, so the union's true mass is >= the claim.
#include "cumulus/core/error.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/methods/registry.h"
#include "method_util.h"

namespace cumulus {
namespace {

class OracleTopP final : public DecodeMethod {
 public:
  OracleTopP(const Shape& shape, double p) : shape_(shape), p_(p) {}
  std::string name() const override { return "oracle_topp"; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    const int n = kv.n_tokens(layer);
    const int g = shape_.group();
    const float scale = attention_scale(shape_.head_dim);
    scores_.resize(static_cast<size_t>(g) * n);
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      const PagedHeadView v = kv.view(layer, h);
      // scores_: [group][n] raw q.k for every token (all keys read once for the group).
      cpu::token_score(v, q + static_cast<size_t>(h) * g * shape_.head_dim, g, nullptr, n, scores_.data());
      auto& uni = out.selection.tokens[h];
      uni.clear();
      for (int j = 0; j < g; ++j) {
        methods::softmax_scaled(scores_.data() + static_cast<size_t>(j) * n, n, scale, probs_);
        cpu::select_top_mass(probs_.data(), n, p_, chosen_);
        double claimed = 0;
        for (int32_t i : chosen_) claimed += probs_[i];
        out.stats[h * g + j].mass_claimed = claimed;
        uni.insert(uni.end(), chosen_.begin(), chosen_.end());
      }
      selection_normalize(uni);
      methods::add_kv_head_bytes(shape_, h, static_cast<double>(n) * kv.bytes_per_token_head() / 2, out);
    }
    methods::attend_selection(kv, layer, q, *ctx.pool, out);
  }

 private:
  Shape shape_;
  double p_;
  std::vector<float> scores_, probs_;
  std::vector<int32_t> chosen_;
};

}  // namespace

void register_oracle_topp(Registry& r) {
  r.add({.name = "oracle_topp",
         .kind = "decode",
         .paper = "Tactic (001) section 3 / Table 1 'Optimal': minimal set reaching P by true score",
         .summary = "exact top-p set per query head (reads every key to score it)",
         .params = {{.name = "p",
                     .type = ParamType::kDouble,
                     .default_value = "0.9",
                     .help = "target cumulative attention mass, in (0, 1]",
                     .min = 0.0,
                     .max = 1.0,
                     .min_exclusive = true}},
         .make_decode = [](const Shape& s, const Params& p) {
           return std::make_unique<OracleTopP>(s, p.get_double("p"));
         }});
}

}  // namespace cumulus
