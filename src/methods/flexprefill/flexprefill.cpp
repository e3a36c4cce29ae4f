// flexprefill: FlexPrefill (ICLR 2025), adaptive block-sparse prefill. Per query head
// and per prompt chunk: probe the attention of the chunk's last block of queries, decide the
// head's pattern by the Jensen-Shannon distance between the pooled estimate and the probe
// ("Query-Aware Sparse Pattern Determination"), choose the blocks whose cumulative attention
// reaches gamma ("Cumulative-Attention Based Index Selection": vertical-slash, Algorithm 3;
// query-aware, Algorithm 4), then attend them with the
// block-sparse prefill kernel. The selection is kernels/flexprefill_select.h's (shared
// with the CUDA port); this file is the method around it. docs/methods.md "flexprefill" lists
// each step, the defaults and every deviation from the paper and its reference code.
#include <algorithm>
#include <chrono>

#include "cumulus/methods/registry.h"
#include "cumulus/kernels/flexprefill_select.h"
#include "cumulus/methods/flexprefill.h"
#include "methods/method_util.h"

namespace cumulus {
namespace {

class FlexPrefill final : public PrefillMethod {
 public:
  FlexPrefill(const Shape& shape, const flexprefill::Config& cfg, int chunk) : shape_(shape), cfg_(cfg), chunk_(chunk) {
    flexprefill::validate(cfg_);
  }
  std::string name() const override { return "flexprefill"; }
  int chunk_tokens(int session_chunk, int prompt_tokens) const override {
    return chunk_ > 0 ? chunk_ : std::max(1, prompt_tokens);
  }

  void prefill(int layer, int pos, int c, const float* q, const KvCache& kv, const PrefillContext& ctx,
               float* out) override {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    std::vector<PagedHeadView> views = methods::layer_views(kv, layer);
    const flexprefill::Geometry g{pos, c, cfg_.block_size};
    flexprefill::LayerSelection sel =
        flexprefill::select_layer(cfg_, g, views.data(), shape_.n_kv_heads, shape_.group(), q, *ctx.pool);
    const auto t1 = clock::now();
    cpu::attention_prefill_block_sparse(methods::prefill_args(shape_, views, pos, c, q, out), sel.layout, *ctx.pool,
                                        ctx.workspace);
    const auto t2 = clock::now();

    flexprefill_stats_add(stats_, g, sel.layout, sel.heads);
    stats_.select_seconds += std::chrono::duration<double>(t1 - t0).count();
    stats_.attention_seconds += std::chrono::duration<double>(t2 - t1).count();
  }

 private:
  Shape shape_;
  flexprefill::Config cfg_;
  int chunk_ = 0;
};

}  // namespace

void flexprefill_stats_add(PrefillStats& s, const flexprefill::Geometry& g, const BlockSparseLayout& layout,
                           const std::vector<flexprefill::HeadSelection>& heads) {
  int64_t causal = 0;
  for (int r = g.first_q_block(); r < g.first_q_block() + g.n_q_blocks(); ++r) causal += r + 1;
  s.blocks_causal += causal * static_cast<int64_t>(heads.size());
  s.blocks_computed += static_cast<int64_t>(layout.blocks.size());
  for (const auto& h : heads) {
    switch (h.pattern) {
      case flexprefill::Pattern::dense: ++s.heads_dense; break;
      case flexprefill::Pattern::query_aware: ++s.heads_query_aware; break;
      case flexprefill::Pattern::vertical_slash: ++s.heads_vertical_slash; break;
    }
  }
}

void register_flexprefill(Registry& r) {
  r.add({.name = "flexprefill",
         .kind = MethodKind::prefill,
         .paper = "FlexPrefill (ICLR 2025): pattern determination, index selection, Algorithms 3-4",
         .summary = "per head: query-aware or vertical-slash blocks reaching cumulative attention gamma",
         .params = options_params<FlexPrefillOptions>(),  // methods/flexprefill.h
         .make_prefill = [](const Shape& s, const Params& p) -> std::unique_ptr<PrefillMethod> {
           const FlexPrefillOptions o = options_read<FlexPrefillOptions>(p);
           return std::make_unique<FlexPrefill>(s, o.config, o.chunk);
         },
         .check = options_check<FlexPrefillOptions>()});
}

}  // namespace cumulus
