// oracle_topk: for each query head, the k tokens with the largest TRUE scores q.k (exact
// top-k, the fixed-budget yardstick). Reads every key to score it. The group attends the
// union of its heads' sets; each head claims the exact mass of its own k tokens. Defined
// once over the selection ops (methods/policy.h).
#include <algorithm>

#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

class OracleTopK final : public SelectPolicy {
 public:
  explicit OracleTopK(int k) : k_(k) {}
  void select(int, SelectOps& ops) const override {
    ops.score_tokens();
    ops.choose_topk(k_);
    ops.mark_chosen(/*claim_mass=*/true);
  }

 private:
  int k_;
};

}  // namespace

void register_oracle_topk(Registry& r) {
  r.add({.name = "oracle_topk",
         .kind = MethodKind::decode,
         .paper = "exact top-k by true score (fixed-budget yardstick)",
         .summary = "k highest-scoring tokens per query head (reads every key to score it)",
         .params = {{.name = "k",
                     .type = ParamType::kInt,
                     .default_value = "2048",
                     .help = "tokens per query head (k > context attends everything)",
                     .min = 1,
                     .max = 1 << 30}},
         .make_policy = [](const Shape&, const Params& p) { return std::make_shared<OracleTopK>(p.get_int("k")); },
         .budget_param = "k",
         .color = "#59a14f"});
}

}  // namespace cumulus
