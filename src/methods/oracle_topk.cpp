// oracle_topk: for each query head, the k tokens with the largest TRUE scores q.k (exact
// top-k, the fixed-budget yardstick). Reads every key to score it. The group attends the
// union of its heads' sets; each head claims the exact mass of its own k tokens.
#include <algorithm>

#include "cumulus/core/error.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/methods/registry.h"
#include "method_util.h"

namespace cumulus {
namespace {

class OracleTopK final : public DecodeMethod {
 public:
  OracleTopK(const Shape& shape, int k) : shape_(shape), k_(k) {}
  std::string name() const override { return "oracle_topk"; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    const int n = kv.n_tokens(layer);
    const int g = shape_.group();
    const float scale = attention_scale(shape_.head_dim);
    scores_.resize(static_cast<size_t>(g) * n);
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      const PagedHeadView v = kv.view(layer, h);
      cpu::token_score(v, q + static_cast<size_t>(h) * g * shape_.head_dim, g, nullptr, n, scores_.data());
      auto& uni = out.selection.tokens[h];
      uni.clear();
      for (int j = 0; j < g; ++j) {
        const float* s = scores_.data() + static_cast<size_t>(j) * n;
        cpu::select_topk(s, n, k_, chosen_);
        methods::softmax_scaled(s, n, scale, probs_);
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
  int k_;
  std::vector<float> scores_, probs_;
  std::vector<int32_t> chosen_;
};

}  // namespace

void register_oracle_topk(Registry& r) {
  r.add({.name = "oracle_topk",
         .kind = "decode",
         .paper = "exact top-k by true score (fixed-budget yardstick)",
         .summary = "k highest-scoring tokens per query head (reads every key to score it)",
         .params = {{.name = "k",
                     .type = ParamType::kInt,
                     .default_value = "2048",
                     .help = "tokens per query head (k > context attends everything)",
                     .min = 1,
                     .max = 1 << 30}},
         .make_decode = [](const Shape& s, const Params& p) {
           return std::make_unique<OracleTopK>(s, p.get_int("k"));
         }});
}

}  // namespace cumulus
