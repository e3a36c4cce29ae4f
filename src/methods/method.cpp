// decode_step: the engine's wrapper around DecodeMethod::decode. It rejects bad input
// before any method sees it and, in eval mode, checks every claim against a dense pass.
#include "cumulus/methods/method.h"

#include <cmath>
#include <limits>

#include "core/check.h"
#include "cumulus/kernels/attention.h"
#include "method_util.h"

namespace cumulus {

void decode_step(DecodeMethod& method, int layer, const float* q, const KvCache& kv, const DecodeContext& ctx,
                 AttnOutput& out) {
  const Shape& s = kv.shape();
  CUMULUS_CHECK(layer >= 0 && layer < s.n_layers, "layer={} out of range [0, {})", layer, s.n_layers);
  CUMULUS_CHECK(q != nullptr, "q is null");
  CUMULUS_CHECK(ctx.pool != nullptr, "ctx.pool is null");
  CUMULUS_CHECK(kv.n_tokens(layer) > 0, "decode on an empty cache (layer={}, n_tokens=0)", layer);
  // NaN/Inf in q are rejected, not propagated: a non-finite query has no meaningful top-p
  // set, and every method would silently pick an arbitrary one.
  for (int h = 0; h < s.n_q_heads; ++h)
    for (int d = 0; d < s.head_dim; ++d)
      CUMULUS_CHECK(std::isfinite(q[h * s.head_dim + d]), "q[head={}][dim={}]={} is not finite", h, d,
                    q[h * s.head_dim + d]);

  method.decode(layer, q, kv, ctx, out);
  CUMULUS_CHECK(out.out.size() == static_cast<size_t>(s.n_q_heads) * s.head_dim &&
                    out.stats.size() == static_cast<size_t>(s.n_q_heads) &&
                    out.selection.tokens.size() == static_cast<size_t>(s.n_kv_heads),
                "method '{}' returned malformed output", method.name());
  if (!ctx.eval) return;

  // Dense pass: o_dense and the full log-sum-exp; then the sparse kernel over the
  // method's union with lse_ref gives each query head's true mass of that set.
  std::vector<PagedHeadView> views = methods::layer_views(kv, layer);
  std::vector<float> o_dense(out.out.size()), lse_dense(s.n_q_heads);
  DecodeAttnArgs a;
  a.kv = views.data();
  a.n_kv_heads = s.n_kv_heads;
  a.group = s.group();
  a.scale = attention_scale(s.head_dim);
  a.q = q;
  a.out = o_dense.data();
  a.lse = lse_dense.data();
  a.workspace = ctx.attention;
  cpu::attention_decode_dense(a, *ctx.pool);

  std::vector<float> o_set(out.out.size()), lse_set(s.n_q_heads), mass(s.n_q_heads);
  a.out = o_set.data();
  a.lse = lse_set.data();
  a.lse_ref = lse_dense.data();
  a.mass = mass.data();
  cpu::attention_decode_sparse(a, out.selection, *ctx.pool);
  for (int h = 0; h < s.n_q_heads; ++h) {
    double err = 0;
    for (int d = 0; d < s.head_dim; ++d) {
      const double diff = static_cast<double>(out.out[h * s.head_dim + d]) - o_dense[h * s.head_dim + d];
      err += diff * diff;
    }
    // A bypassed head (LFPS's sink bypass) attended no set: it has no mass to check.
    out.stats[h].mass_true = out.stats[h].bypass ? std::numeric_limits<double>::quiet_NaN() : mass[h];
    out.stats[h].out_err = std::sqrt(err);
  }
}

}  // namespace cumulus
