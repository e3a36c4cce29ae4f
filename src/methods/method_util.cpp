#include "method_util.h"

#include <algorithm>

#include "cumulus/core/error.h"
#include "cumulus/kernels/scoring.h"

namespace cumulus::methods {

std::vector<PagedHeadView> layer_views(const KvCache& kv, int layer) {
  std::vector<PagedHeadView> views(kv.shape().n_kv_heads);
  for (int h = 0; h < kv.shape().n_kv_heads; ++h) views[h] = kv.view(layer, h);
  return views;
}

PrefillAttnArgs prefill_args(const Shape& shape, const std::vector<PagedHeadView>& views, int pos, int c,
                             const float* q, float* out) {
  PrefillAttnArgs a;
  a.kv = views.data();
  a.n_kv_heads = shape.n_kv_heads;
  a.group = shape.group();
  a.scale = attention_scale(shape.head_dim);
  a.pos = pos;
  a.n_q = c;
  a.q = q;
  a.out = out;
  return a;
}

void attn_output_reset(const Shape& shape, AttnOutput& out) {
  out.out.assign(static_cast<size_t>(shape.n_q_heads) * shape.head_dim, 0.0f);
  out.stats.assign(shape.n_q_heads, StepStats{});
  out.selection.tokens.resize(shape.n_kv_heads);
}

void add_kv_head_bytes(const Shape& shape, int kv_head, double bytes, AttnOutput& out) {
  const int g = shape.group();
  for (int j = 0; j < g; ++j) out.stats[kv_head * g + j].bytes_read += bytes / g;
}

void attend_selection(const KvCache& kv, int layer, const float* q, const DecodeContext& ctx, AttnOutput& out,
                      float* lse) {
  const Shape& s = kv.shape();
  std::vector<PagedHeadView> views = layer_views(kv, layer);
  std::vector<float> lse_local;
  if (lse == nullptr) {
    lse_local.resize(s.n_q_heads);
    lse = lse_local.data();
  }
  DecodeAttnArgs a;
  a.kv = views.data();
  a.n_kv_heads = s.n_kv_heads;
  a.group = s.group();
  a.scale = attention_scale(s.head_dim);
  a.q = q;
  a.out = out.out.data();
  a.lse = lse;
  a.workspace = ctx.attention;
  cpu::attention_decode_sparse(a, out.selection, *ctx.pool);
  for (int h = 0; h < s.n_kv_heads; ++h) {
    const auto n = out.selection.tokens[h].size();
    for (int j = 0; j < s.group(); ++j) out.stats[h * s.group() + j].tokens_attended = static_cast<int>(n);
    add_kv_head_bytes(s, h, static_cast<double>(n) * kv.bytes_per_token_head(), out);
  }
}

void merge_partial(float& lse1, float* o1, float lse2, const float* o2, int head_dim) {
  if (lse2 == -std::numeric_limits<float>::infinity()) return;
  if (lse1 == -std::numeric_limits<float>::infinity()) {
    std::copy_n(o2, head_dim, o1);
    lse1 = lse2;
    return;
  }
  const double m = std::max(lse1, lse2);
  const double a = std::exp(lse1 - m), b = std::exp(lse2 - m);
  const double inv = 1.0 / (a + b);
  for (int i = 0; i < head_dim; ++i) o1[i] = static_cast<float>((a * o1[i] + b * o2[i]) * inv);
  lse1 = static_cast<float>(m + std::log(a + b));
}

}  // namespace cumulus::methods
