// oracle_topp: for each query head, the minimal set of tokens whose TRUE softmax mass
// reaches P (the "Optimal" row of Tactic Table 1, section 3). It reads every key to
// score it, so it is a yardstick for adaptive methods, not a practical one. The group
// attends the union of its heads' sets (Tactic 4.5); each head claims the exact mass of
// its own set, so the union's true mass is >= the claim.
#include "cumulus/core/error.h"
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
    methods::oracle_decode(shape_, layer, q, kv, ctx, out, scratch_,
                           [&](const float* scores, int n, const std::vector<float>& probs, std::vector<int32_t>& chosen) {
                             cpu::select_top_mass(probs.data(), n, p_, chosen);
                           });
  }

 private:
  Shape shape_;
  double p_;
  methods::OracleScratch scratch_;
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
         },
         .target_param = "p"});
}

}  // namespace cumulus
