// quest: Quest (Tang et al., ICML 2024). Each page of the cache keeps the per-dimension
// min and max of its keys; the upper bound of q.k over the page is
//   sum_j max(q_j * min_j, q_j * max_j),
// and each query head attends the ceil(budget / page_size) pages with the largest bound.
// The page is the cache page (default 16 tokens, Quest's setting). GQA: the group attends
// the union of its heads' pages (Quest was published for MHA; the union is Tactic 4.5's
// rule). A fixed-budget baseline: no mass claim (NaN). dense_layers: the first layers attend
// every token, as Quest's evaluation code does for layers 0 and 1 (default 0 here: off).
// Defined once over the selection ops (methods/policy.h): the CPU and the GPU run this.
#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

class Quest final : public SelectPolicy {
 public:
  Quest(int budget, int dense_layers) : budget_(budget), dense_layers_(dense_layers) {}
  void select(int layer, SelectOps& ops) const override {
    if (dense_layer(layer)) {
      ops.mark_all();
      return;
    }
    ops.score_pages_bound();  // the group's bounds in one pass over the page metadata
    ops.choose_topk((budget_ + ops.page_size() - 1) / ops.page_size());
    ops.mark_chosen(/*claim_mass=*/false);
  }
  bool dense_layer(int layer) const override { return layer < dense_layers_; }

 private:
  int budget_;
  int dense_layers_;
};

}  // namespace

void register_quest(Registry& r) {
  r.add({.name = "quest",
         .kind = MethodKind::decode,
         .paper = "Quest (Tang et al., ICML 2024): top-k pages by the min/max upper bound",
         .summary = "pages with the largest q.k upper bound, budget/page_size pages per query head (no mass claim)",
         .params = {{.name = "budget",
                     .type = ParamType::kInt,
                     .default_value = "2048",
                     .help = "token budget per query head, rounded up to whole pages",
                     .min = 1,
                     .max = 1 << 30},
                    {.name = "dense_layers",
                     .type = ParamType::kInt,
                     .default_value = "0",
                     .help = "the first N layers attend every token (Quest's evaluation code keeps layers 0 and 1 dense)",
                     .min = 0,
                     .max = 1 << 20}},
         .make_policy = [](const Shape&, const Params& p) {
           return std::make_shared<Quest>(p.get_int("budget"), p.get_int("dense_layers"));
         },
         .budget_param = "budget",
         .color = "#f28e2b"});
}

}  // namespace cumulus
