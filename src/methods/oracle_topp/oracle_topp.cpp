// oracle_topp: for each query head, the minimal set of tokens whose TRUE softmax mass
// reaches P (the "Optimal" row of Tactic Table 1, section 3). It reads every key to
// score it, so it is a yardstick for adaptive methods, not a practical one. The group
// attends the union of its heads' sets (Tactic 4.5); each head claims the exact mass of
// its own set, so the union's true mass is >= the claim. Defined once over the selection
// ops (methods/policy.h): the CPU and the GPU run this definition.
#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

struct OracleTopPOptions {
  double p = 0.9;

  template <class F>
  void fields(F& f) {
    f.number(p, "p", ParamRange::left_open(0, 1), "target cumulative attention mass, in (0, 1]");
  }
};

class OracleTopP final : public SelectPolicy {
 public:
  explicit OracleTopP(const OracleTopPOptions& o) : p_(o.p) {}
  void select(int, SelectOps& ops) const override {
    ops.score_tokens();
    ops.choose_top_mass(p_);
    ops.mark_chosen(/*claim_mass=*/true);
  }

 private:
  double p_;
};

}  // namespace

void register_oracle_topp(Registry& r) {
  r.add({.name = "oracle_topp",
         .kind = MethodKind::decode,
         .paper = "Tactic, section 3 / Table 1 'Optimal': minimal set reaching P by true score",
         .summary = "exact top-p set per query head (reads every key to score it)",
         .params = options_params<OracleTopPOptions>(),
         .make_policy = [](const Shape&, const Params& p) {
           return std::make_shared<OracleTopP>(options_read<OracleTopPOptions>(p));
         },
         .target_param = "p",
         .color = "#4e79a7"});
}

}  // namespace cumulus
