// dense: full attention over every cached token. The baseline every sparse method is
// measured against; claims mass 1. Also the default prefill method: causal flash-style
// attention of each prompt chunk (kernels/prefill.h).
#include <chrono>

#include "cumulus/core/error.h"
#include "cumulus/methods/registry.h"
#include "methods/method_util.h"

namespace cumulus {
namespace {

class Dense final : public DecodeMethod {
 public:
  explicit Dense(const Shape& shape) : shape_(shape) {}
  std::string name() const override { return "dense"; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    std::vector<PagedHeadView> views = methods::layer_views(kv, layer);
    std::vector<float> lse(shape_.n_q_heads);
    DecodeAttnArgs a;
    a.kv = views.data();
    a.n_kv_heads = shape_.n_kv_heads;
    a.group = shape_.group();
    a.scale = attention_scale(shape_.head_dim);
    a.q = q;
    a.out = out.out.data();
    a.lse = lse.data();
    a.workspace = ctx.attention;
    cpu::attention_decode_dense(a, *ctx.pool);
    const int n = kv.n_tokens(layer);
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      auto& t = out.selection.tokens[h];
      t.resize(n);
      for (int i = 0; i < n; ++i) t[i] = i;
      methods::add_kv_head_bytes(shape_, h, static_cast<double>(n) * kv.bytes_per_token_head(), out);
    }
    for (auto& st : out.stats) {
      st.tokens_attended = n;
      st.mass_claimed = 1.0;
    }
  }

 private:
  Shape shape_;
};

class DensePrefill final : public PrefillMethod {
 public:
  explicit DensePrefill(const Shape& shape) : shape_(shape) {}
  std::string name() const override { return "dense"; }

  void prefill(int layer, int pos, int c, const float* q, const KvCache& kv, const PrefillContext& ctx,
               float* out) override {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<PagedHeadView> views = methods::layer_views(kv, layer);
    cpu::attention_prefill_dense(methods::prefill_args(shape_, views, pos, c, q, out), *ctx.pool,
                                 ctx.workspace);
    stats_.heads_dense += shape_.n_q_heads;
    stats_.attention_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  Shape shape_;
};

}  // namespace

void register_dense(Registry& r) {
  r.add({.name = "dense",
         .kind = MethodKind::decode_and_prefill,
         .paper = "full attention (baseline)",
         .summary = "attend every cached token; prefill: causal flash-style attention",
         .params = {},
         .make_decode = [](const Shape& s, const Params&) { return std::make_unique<Dense>(s); },
         .make_prefill = [](const Shape& s, const Params&) { return std::make_unique<DensePrefill>(s); },
         .color = "#7f7f7f"});
}

}  // namespace cumulus
