// oracle_topk: for each query head, the k tokens with the largest TRUE scores q.k (exact
// top-k, the fixed-budget yardstick). Reads every key to score it. The group attends the
// union of its heads' sets; each head claims the exact mass of its own k tokens.
#include <algorithm>

#include "cumulus/core/error.h"
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
    methods::oracle_decode(shape_, layer, q, kv, ctx, out, scratch_,
                           [&](const float* scores, int n, const std::vector<float>& probs, std::vector<int32_t>& chosen) {
                             cpu::select_topk(scores, n, k_, chosen);
                           });
  }

 private:
  Shape shape_;
  int k_;
  methods::OracleScratch scratch_;
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
