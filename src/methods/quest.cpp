// quest: Quest (Tang et al., ICML 2024). Each page of the cache keeps the per-dimension
// min and max of its keys; the upper bound of q.k over the page is
//   sum_j max(q_j * min_j, q_j * max_j),
// and each query head attends the ceil(budget / page_size) pages with the largest bound.
// The page is the cache page (default 16 tokens, Quest's setting). GQA: the group attends
// the union of its heads' pages (Quest was published for MHA; the union is Tactic 4.5's
// rule). A fixed-budget baseline: no mass claim (NaN). dense_layers: the first layers attend
// every token, as Quest's evaluation code does for layers 0 and 1 (default 0 here: off).
#include <algorithm>

#include "cumulus/core/error.h"
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/methods/registry.h"
#include "method_util.h"

namespace cumulus {
namespace {

class Quest final : public DecodeMethod {
 public:
  Quest(const Shape& shape, int budget, int dense_layers)
      : shape_(shape), budget_(budget), dense_layers_(dense_layers) {}
  std::string name() const override { return "quest"; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    const int g = shape_.group();
    const int ps = kv.page_size();
    const int k_pages = (budget_ + ps - 1) / ps;
    const bool dense = layer < dense_layers_;
    heads_.resize(std::max(heads_.size(), static_cast<size_t>(shape_.n_kv_heads)));
    // One task per kv head: the group's bounds in one pass over the page metadata, then
    // each query head's top pages; kv heads write disjoint lists and stats.
    ctx.pool->parallel_for(shape_.n_kv_heads, [&](int64_t hh, int) {
      const int h = static_cast<int>(hh);
      HeadScratch& w = heads_[static_cast<size_t>(h)];
      const PagedHeadView v = kv.view(layer, h);
      const int n_pages = v.n_pages();
      w.page_union.clear();
      if (dense) {
        w.page_union.resize(n_pages);
        for (int p = 0; p < n_pages; ++p) w.page_union[p] = p;
      } else if (n_pages > 0) {
        w.scores.resize(static_cast<size_t>(g) * n_pages);
        cpu::page_score_bound(v, q + static_cast<size_t>(h * g) * shape_.head_dim, g, w.scores.data());
        for (int j = 0; j < g; ++j) {
          cpu::select_topk(w.scores.data() + static_cast<size_t>(j) * n_pages, n_pages, k_pages, w.chosen);
          w.page_union.insert(w.page_union.end(), w.chosen.begin(), w.chosen.end());
        }
        selection_normalize(w.page_union);
      }
      auto& t = out.selection.tokens[h];
      t.clear();
      for (int32_t p : w.page_union)
        for (int i = 0; i < v.page_len(p); ++i) t.push_back(p * ps + i);
      // Page min and max (float32) are read once per kv head: its group shares them.
      if (!dense) methods::add_kv_head_bytes(shape_, h, 2.0 * n_pages * shape_.head_dim * sizeof(float), out);
    });
    methods::attend_selection(kv, layer, q, *ctx.pool, out);
    for (auto& st : out.stats) st.mass_claimed = dense ? 1.0 : methods::kNoClaim;
  }

 private:
  struct HeadScratch {
    std::vector<float> scores;  // [group][n_pages]
    std::vector<int32_t> chosen, page_union;
  };
  Shape shape_;
  int budget_;
  int dense_layers_;
  std::vector<HeadScratch> heads_;  // [n_kv_heads]
};

}  // namespace

void register_quest(Registry& r) {
  r.add({.name = "quest",
         .kind = "decode",
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
         .make_decode = [](const Shape& s, const Params& p) {
           return std::make_unique<Quest>(s, p.get_int("budget"), p.get_int("dense_layers"));
         }});
}

}  // namespace cumulus
