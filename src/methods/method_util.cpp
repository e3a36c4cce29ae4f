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

void attend_selection(const KvCache& kv, int layer, const float* q, ThreadPool& pool, AttnOutput& out,
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
  cpu::attention_decode_sparse(a, out.selection, pool);
  for (int h = 0; h < s.n_kv_heads; ++h) {
    const auto n = out.selection.tokens[h].size();
    for (int j = 0; j < s.group(); ++j) out.stats[h * s.group() + j].tokens_attended = static_cast<int>(n);
    add_kv_head_bytes(s, h, static_cast<double>(n) * kv.bytes_per_token_head(), out);
  }
}

double softmax_scaled(const float* scores, int n, float scale, std::vector<float>& probs) {
  probs.resize(n);
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) mx = std::max(mx, scores[i] * scale);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(scores[i] * scale - mx));
  const double lse = mx + std::log(sum);
  for (int i = 0; i < n; ++i) probs[i] = static_cast<float>(std::exp(static_cast<double>(scores[i] * scale) - lse));
  return lse;
}

void oracle_decode(const Shape& shape, int layer, const float* q, const KvCache& kv, const DecodeContext& ctx,
                   AttnOutput& out, OracleScratch& scratch, const OracleChoose& choose) {
  attn_output_reset(shape, out);
  const int n = kv.n_tokens(layer);
  const int g = shape.group();
  const float scale = attention_scale(shape.head_dim);
  scratch.scores.resize(static_cast<size_t>(g) * n);
  for (int h = 0; h < shape.n_kv_heads; ++h) {
    const PagedHeadView v = kv.view(layer, h);
    cpu::token_score(v, q + static_cast<size_t>(h) * g * shape.head_dim, g, nullptr, n, scratch.scores.data());
    auto& uni = out.selection.tokens[h];
    uni.clear();
    for (int j = 0; j < g; ++j) {
      const float* s = scratch.scores.data() + static_cast<size_t>(j) * n;
      softmax_scaled(s, n, scale, scratch.probs);
      choose(s, n, scratch.probs, scratch.chosen);
      double claimed = 0;
      for (int32_t i : scratch.chosen) claimed += scratch.probs[i];
      out.stats[h * g + j].mass_claimed = claimed;
      uni.insert(uni.end(), scratch.chosen.begin(), scratch.chosen.end());
    }
    selection_normalize(uni);
    add_kv_head_bytes(shape, h, static_cast<double>(n) * kv.bytes_per_token_head() / 2, out);
  }
  attend_selection(kv, layer, q, *ctx.pool, out);
}

}  // namespace cumulus::methods
