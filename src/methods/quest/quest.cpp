// quest: Quest (Tang et al., ICML 2024). Each page of the cache keeps the per-dimension
// min and max of its keys; the upper bound of q.k over the page is
//   sum_j max(q_j * min_j, q_j * max_j),
// and each query head attends the ceil(budget / page_size) pages with the largest bound.
// The page is the cache page (default 16 tokens, Quest's setting). GQA: the group attends
// the union of its heads' pages (Quest was published for MHA; the union is Tactic 4.5's
// rule). A fixed-budget baseline: no mass claim (NaN). dense_layers: the first layers attend
// every token, as Quest's evaluation code does for layers 0 and 1 (default 0 here: off).
// Defined once over the selection ops (methods/policy.h): the CPU and the GPU run this.
#include "core/check.h"
#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

struct QuestOptions {
  int budget = 2048;
  int dense_layers = 0;

  template <class F>
  void fields(F& f) {
    f.number(budget, "budget", ParamRange::closed(1, 1 << 30), "token budget per query head, rounded up to whole pages");
    f.number(dense_layers, "dense_layers", ParamRange::closed(0, 1 << 20),
             "the first N layers attend every token (Quest's evaluation code keeps layers 0 and 1 dense)");
  }
  void check(const Shape& shape) const {
    CUMULUS_CHECK(dense_layers <= shape.n_layers, "method 'quest': parameter dense_layers={} exceeds the model's {} layers",
                  dense_layers, shape.n_layers);
  }
};

class Quest final : public SelectPolicy {
 public:
  explicit Quest(const QuestOptions& o) : budget_(o.budget), dense_layers_(o.dense_layers) {}
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
         .params = options_params<QuestOptions>(),
         .make_policy = [](const Shape&, const Params& p) {
           return std::make_shared<Quest>(options_read<QuestOptions>(p));
         },
         .check = options_check<QuestOptions>(),
         .budget_param = "budget",
         .color = "#f28e2b"});
}

}  // namespace cumulus
