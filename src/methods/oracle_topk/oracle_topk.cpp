// oracle_topk: for each query head, the k tokens with the largest TRUE scores q.k (exact
// top-k, the fixed-budget yardstick). Reads every key to score it. The group attends the
// union of its heads' sets; each head claims the exact mass of its own k tokens. Defined
// once over the selection ops (methods/policy.h).
#include <algorithm>

#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

struct OracleTopKOptions {
  int k = 2048;

  template <class F>
  void fields(F& f) {
    f.number(k, "k", ParamRange::closed(1, 1 << 30), "tokens per query head (k > context attends everything)");
  }
};

class OracleTopK final : public SelectPolicy {
 public:
  explicit OracleTopK(const OracleTopKOptions& o) : k_(o.k) {}
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
         .params = options_params<OracleTopKOptions>(),
         .make_policy = [](const Shape&, const Params& p) {
           return std::make_shared<OracleTopK>(options_read<OracleTopKOptions>(p));
         },
         .budget_param = "k",
         .color = "#59a14f"});
}

}  // namespace cumulus
