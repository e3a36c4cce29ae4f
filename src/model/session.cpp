// The Llama and Gemma 3 forward pass over a Session's cache (see session.h for the data flow).
// Projections: weight_matmul (weight_matrix.h): OpenBLAS sgemm for prefill chunks, the
// quantised GEMV kernel (or sgemv for float32 weights) for decode.
#include "cumulus/model/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "core/check.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/kernels/prefill.h"
#include "cumulus/methods/registry.h"
#include "model/blas_threads.h"

namespace cumulus {
namespace {

// out [dim] = x / rms(x) * g, rms with eps (float64 sum: the norm is tiny next to the
// matmuls and this keeps it exact enough to match references).
void rmsnorm(const float* x, const float* g, int dim, float eps, float* out) {
  double ss = 0;
  for (int i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
  for (int i = 0; i < dim; ++i) out[i] = x[i] * inv * g[i];
}

// RoPE on n_heads heads of head_dim at position pos, the first rope_dim dimensions: pair
// i (i < rope_dim / 2) rotated by pos * theta^(-2i / head_dim). Adjacent pairs
// (x[2i], x[2i+1]) ("normal", GGUF llama) or halves (x[i], x[i + rope_dim/2]) ("NEOX",
// GGUF gemma3).
void rope(float* x, int n_heads, int head_dim, int rope_dim, int pos, float theta, bool neox) {
  for (int i = 0; i < rope_dim / 2; ++i) {
    const double freq = std::pow(static_cast<double>(theta), -static_cast<double>(2 * i) / head_dim);
    const double angle = pos * freq;
    const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + rope_dim / 2 : 2 * i + 1;
    for (int h = 0; h < n_heads; ++h) {
      float* p = x + h * head_dim;
      const float a = p[i0], b = p[i1];
      p[i0] = a * c - b * s;
      p[i1] = a * s + b * c;
    }
  }
}

// KvSnapshotInfo::setup: what shapes the cached K/V besides the model file, as text. The
// weights' storage (compact vs f32 changes the projections' rounding), the prefill method
// and its resolved parameters.
std::string snapshot_setup(const ModelWeights& w, const SessionOptions& o, const Registry& registry) {
  std::set<std::string_view> storage{w.token_embd.storage_name(), w.output_weight().storage_name()};
  for (const LayerWeights& L : w.layers)
    for (const WeightMatrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_down, &L.w_up})
      storage.insert(m->storage_name());
  std::string s = "weights=";
  for (std::string_view name : storage) s.append(s.back() == '=' ? "" : ",").append(name);
  s += " prefill=" + o.prefill_method;
  const Params params = registry.parse(o.prefill_method, o.prefill_params);
  for (const auto& [k, v] : params.values()) s += " " + k + "=" + v;
  return s;
}

// What a snapshot of this session's cache holds besides its tokens: the model, the setup
// and the cache's shape (n_tokens and prompt_q_rows are the caller's).
KvSnapshotInfo snapshot_expected(const ModelWeights& w, const SessionOptions& o, const Registry& registry,
                                 const KvCache& kv, uint64_t model_id) {
  const ModelConfig& c = w.config;
  return {.model_id = model_id,
          .setup = snapshot_setup(w, o, registry),
          .n_layers = c.n_layers,
          .n_heads = c.n_heads,
          .n_kv_heads = c.n_kv_heads,
          .head_dim = c.head_dim,
          .vocab_size = c.vocab_size,
          .page_size = kv.page_size(),
          .dtype = kv.dtype()};
}

// gelu, tanh approximation (as ggml_gelu and PyTorch's gelu(approximate="tanh")).
float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kCoef = 0.044715f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + kCoef * x * x)));
}

}  // namespace

Session::Session(const ModelWeights& weights, const SessionOptions& options)
    : w_(weights),
      opt_(options),
      registry_(options.registry != nullptr ? *options.registry : Registry::builtin()),
      pool_(options.n_threads),
      kv_(weights.config.shape(),
          [&] {
            KvCacheOptions kvo = options.kv;
            kvo.max_tokens = options.max_tokens > 0 ? options.max_tokens : weights.config.context_length;
            return kvo;
          }(),
          [&] {
            // A local layer's queries read their window only: its cache keeps only that.
            std::vector<int> window;
            if (options.kv_window && !weights.config.layer_local.empty())
              for (int l = 0; l < weights.config.n_layers; ++l)
                window.push_back(weights.config.is_local(l) ? std::max(1, weights.config.sliding_window) : 0);
            return window;
          }()) {
  const ModelConfig& c = w_.config;
  CUMULUS_CHECK(opt_.prefill_chunk >= 1 && opt_.prefill_chunk <= 65536, "prefill_chunk={} must be in [1, 65536]",
                opt_.prefill_chunk);
  CUMULUS_CHECK(opt_.max_tokens >= 0, "max_tokens={} must be >= 0", opt_.max_tokens);
  capacity_ = kv_.options().max_tokens;
  method_ = registry_.make(opt_.method, c.shape(), opt_.params);
  prefill_ = registry_.make_prefill(opt_.prefill_method, c.shape(), opt_.prefill_params);
  CUMULUS_CHECK(c.layer_local.empty() || c.layer_local.size() == static_cast<size_t>(c.n_layers),
                "model config: layer_local has {} entries for {} layers", c.layer_local.size(), c.n_layers);
  CUMULUS_CHECK(c.layer_local.empty() || c.sliding_window >= 1, "model config: sliding_window={} with local layers",
                c.sliding_window);
  for (int w = 0; w < pool_.n_threads(); ++w) inline_pools_.push_back(std::make_unique<ThreadPool>(1));
  local_ws_.resize(static_cast<size_t>(pool_.n_threads()));
  reserve_rows(opt_.prefill_chunk);
  logits_.resize(c.vocab_size);
  last_.resize(c.n_layers);
}

Session::~Session() = default;

const std::vector<float>& Session::prefill(std::span<const int32_t> tokens) {
  CUMULUS_CHECK(!tokens.empty(), "prompt is empty (0 tokens)");
  CUMULUS_CHECK(!prefilled_, "prefill after decode started or the indexes were built (position {}): one prompt per session", pos_);
  CUMULUS_CHECK(pos_ + static_cast<int64_t>(tokens.size()) <= capacity_,
                "prompt of {} tokens at position {} exceeds the context of {} tokens", tokens.size(), pos_, capacity_);
  // Every id before any state changes (a bad id in a later chunk would leave a prompt half
  // prefilled).
  for (size_t i = 0; i < tokens.size(); ++i)
    CUMULUS_CHECK(tokens[i] >= 0 && tokens[i] < w_.config.vocab_size,
                  "token id {} at position {} is outside the vocabulary [0, {})", tokens[i], pos_ + i,
                  w_.config.vocab_size);
  // The prompt's last queries per layer: positions [prompt_end_ - prompt_q_rows_, prompt_end_).
  // A prompt fed in pieces keeps the rows an earlier piece left that are still among them
  // (rows exist only for the positions cached: at most pos_).
  const size_t qd = static_cast<size_t>(w_.config.n_heads) * w_.config.head_dim;
  const int old_first = prompt_end_ - prompt_q_rows_, old_end = std::min(prompt_end_, pos_);
  prompt_end_ = pos_ + static_cast<int>(tokens.size());
  prompt_q_rows_ = std::min(std::max(method_->prompt_queries(), opt_.keep_prompt_queries), prompt_end_);
  const int first = prompt_end_ - prompt_q_rows_;
  for (auto& rows : prompt_q_) {
    std::vector<float> kept(static_cast<size_t>(prompt_q_rows_) * qd);
    for (int t = std::max(first, old_first); t < old_end; ++t)
      std::copy_n(rows.data() + static_cast<size_t>(t - old_first) * qd, qd,
                  kept.data() + static_cast<size_t>(t - first) * qd);
    rows.swap(kept);
  }
  prompt_q_.resize(w_.config.n_layers, std::vector<float>(static_cast<size_t>(prompt_q_rows_) * qd));
  // The prefill method picks the chunk (FlexPrefill probes the last block of the whole prompt).
  const int chunk = prefill_->chunk_tokens(opt_.prefill_chunk, static_cast<int>(tokens.size()));
  CUMULUS_CHECK(chunk >= 1, "prefill method {} asked for chunks of {} tokens", prefill_->name(), chunk);
  reserve_rows(std::min<int>(chunk, static_cast<int>(tokens.size())));
  // The prefill kernels' scratch serves every layer and chunk of this prompt, then goes.
  prefill_workspace_ = std::make_unique<PrefillWorkspace>();
  for (size_t i = 0; i < tokens.size(); i += chunk) {
    const size_t n = std::min<size_t>(chunk, tokens.size() - i);
    forward(tokens.subspan(i, n), false);
  }
  prefill_workspace_.reset();
  // The local layers keep the prompt's last window through decoding, for restart_decode
  // and kv_save.
  kv_.pin_window(prompt_end_);
  prompt_tokens_.insert(prompt_tokens_.end(), tokens.begin(), tokens.end());
  prompt_logits_ = logits_;
  return logits_;
}

void Session::kv_save(const std::string& path, uint64_t model_id) const {
  CUMULUS_CHECK(prompt_end_ > 0, "kv_save('{}') before a prefill: there is no prompt to save", path);
  KvSnapshotInfo info = snapshot_expected(w_, opt_, registry_, kv_, model_id);
  info.n_tokens = prompt_end_;
  info.prompt_q_rows = prompt_q_rows_;
  kv_snapshot_write(path, info, prompt_tokens_, prompt_logits_, prompt_q_, kv_);
}

const std::vector<float>& Session::kv_load(const KvSnapshot& snap, uint64_t model_id) {
  CUMULUS_CHECK(pos_ == 0, "kv_load('{}') into a session at position {}: load into a fresh session", snap.path(),
                pos_);
  const KvSnapshotInfo& got = snap.info();
  snap.check(snapshot_expected(w_, opt_, registry_, kv_, model_id));
  CUMULUS_CHECK(got.n_tokens <= capacity_, "KV snapshot '{}': n_tokens={} exceeds this session's context of {} tokens",
                snap.path(), got.n_tokens, capacity_);
  // The prompt queries prefill would have kept for this session's method.
  const int rows = prompt_q_rows_for(got.n_tokens);
  CUMULUS_CHECK(got.prompt_q_rows >= rows,
                "KV snapshot '{}': prompt_q_rows={} but method {} needs the prompt's last {} queries (save with "
                "SessionOptions::keep_prompt_queries >= {})",
                snap.path(), got.prompt_q_rows, method_->name(), rows, rows);
  snap.restore(kv_);
  return adopt_prompt(got.n_tokens, rows, [&](int l) { return snap.prompt_q(l); }, snap.tokens(), snap.logits());
}

const std::vector<float>& Session::prefill_from(const Session& other) {
  CUMULUS_CHECK(pos_ == 0, "prefill_from into a session at position {}: use a fresh session", pos_);
  CUMULUS_CHECK(other.prompt_end_ > 0, "prefill_from a session with no prompt: prefill it first");
  CUMULUS_CHECK(&other.w_ == &w_, "prefill_from a session over other weights");
  CUMULUS_CHECK(other.opt_.prefill_method == opt_.prefill_method && other.opt_.prefill_params == opt_.prefill_params,
                "prefill_from a session whose prompt was prefilled by {} (this session prefills with {})",
                other.opt_.prefill_method, opt_.prefill_method);
  const int n = other.prompt_end_;
  CUMULUS_CHECK(n <= capacity_, "prefill_from: the prompt of {} tokens exceeds this session's context of {} tokens",
                n, capacity_);
  const int rows = prompt_q_rows_for(n);
  CUMULUS_CHECK(other.prompt_q_rows_ >= rows,
                "prefill_from: method {} needs the prompt's last {} queries but the other session kept {} (set its "
                "SessionOptions::keep_prompt_queries)",
                method_->name(), rows, other.prompt_q_rows_);
  kv_.copy_prefix_from(other.kv_, n);  // checks shape, page size, dtype and windows first
  return adopt_prompt(n, rows, [&](int l) { return std::span<const float>(other.prompt_q_[static_cast<size_t>(l)]); },
                      other.prompt_tokens_, other.prompt_logits_);
}

int Session::prompt_q_rows_for(int n) const {
  return std::min(std::max(method_->prompt_queries(), opt_.keep_prompt_queries), n);
}

const std::vector<float>& Session::adopt_prompt(int n, int rows,
                                                const std::function<std::span<const float>(int)>& q_of,
                                                std::span<const int32_t> tokens, std::span<const float> logits) {
  kv_.pin_window(n);
  pos_ = prompt_end_ = n;
  prompt_q_rows_ = rows;
  const size_t row = static_cast<size_t>(w_.config.n_heads) * w_.config.head_dim;
  prompt_q_.assign(w_.config.n_layers, {});
  for (int l = 0; l < w_.config.n_layers; ++l) {
    const std::span<const float> q = q_of(l);  // that prompt's last rows, at its end
    prompt_q_[static_cast<size_t>(l)].assign(q.end() - static_cast<ptrdiff_t>(rows * row), q.end());
  }
  prompt_tokens_.assign(tokens.begin(), tokens.end());
  prompt_logits_.assign(logits.begin(), logits.end());
  logits_ = prompt_logits_;
  return logits_;
}

void Session::reserve_rows(int rows) {
  if (rows <= rows_) return;
  const ModelConfig& c = w_.config;
  const size_t r = static_cast<size_t>(rows);
  x_.resize(r * c.dim);
  xn_.resize(r * c.dim);
  q_.resize(r * c.n_heads * c.head_dim);
  k_.resize(r * c.n_kv_heads * c.head_dim);
  v_.resize(r * c.n_kv_heads * c.head_dim);
  att_.resize(r * c.n_heads * c.head_dim);
  gate_.resize(r * c.hidden_dim);
  up_.resize(r * c.hidden_dim);
  rows_ = rows;
}

void Session::build_indexes() {
  CUMULUS_CHECK(pos_ > 0, "build_indexes before prefill (position 0): prefill at least one token first");
  if (prefilled_) return;
  DecodeContext ctx{.pool = &pool_, .eval = opt_.eval, .attention = &attention_ws_};
  for (int l = 0; l < w_.config.n_layers; ++l) {
    if (w_.config.is_local(l)) continue;  // methods run on global layers only
    ctx.prompt_q = prompt_q_rows_ > 0 ? prompt_q_[l].data() : nullptr;
    ctx.prompt_q_rows = prompt_q_rows_;
    method_->on_prefill(l, kv_, ctx);
  }
  prefilled_ = true;
}

const std::vector<float>& Session::decode(int32_t token) {
  CUMULUS_CHECK(pos_ > 0, "decode before prefill (position 0): prefill at least one token first");
  CUMULUS_CHECK(pos_ + 1 <= capacity_, "decode at position {} exceeds the context of {} tokens", pos_, capacity_);
  build_indexes();
  const int32_t t[1] = {token};
  forward(t, true);
  return logits_;
}

void Session::restart_decode(const std::string& method, const std::map<std::string, std::string>& params) {
  CUMULUS_CHECK(prompt_end_ > 0, "restart_decode(method={}) before a prefill: there is no prompt to restart from", method);
  auto made = registry_.make(method, w_.config.shape(), params);
  CUMULUS_CHECK(made->prompt_queries() <= prompt_q_rows_ || prompt_q_rows_ == prompt_end_,
                "restart_decode(method={}) needs the prompt's last {} queries but the session kept {} "
                "(set SessionOptions::keep_prompt_queries)",
                method, made->prompt_queries(), prompt_q_rows_);
  method_ = std::move(made);
  opt_.method = method;
  opt_.params = params;
  kv_.truncate(prompt_end_);
  pos_ = prompt_end_;
  prefilled_ = false;
  summary_ = {};
  profile_ = {};
  for (AttnOutput& o : last_) o = {};
}

void Session::attention_prefill(int layer, int c, const float* q, float* out) {
  // The chunk's queries at positions [pos_, pos_ + c) against the layer's cache, which
  // already holds the chunk's keys: the prefill method (dense: causal flash attention).
  prefill_->prefill(layer, pos_, c, q, kv_, PrefillContext{&pool_, prefill_workspace_.get()}, out);
}

void Session::attention_local(int layer, int c, const float* q, float* out) {
  // Row i (position p = pos_ + i) attends keys (p - window, p]: the decode kernel over an
  // index list, one row per task on a one-thread pool (rows are independent, so results do
  // not depend on the thread count).
  const ModelConfig& mc = w_.config;
  const Shape shape = mc.shape();
  const std::vector<PagedHeadView> views = layer_views(layer);
  const int qd = mc.n_heads * mc.head_dim;
  auto row = [&](int64_t i, ThreadPool& pool, AttentionWorkspace& ws) {
    const int p = pos_ + static_cast<int>(i);
    const int first = std::max(0, p - mc.sliding_window + 1);
    Selection sel;
    sel.tokens.assign(shape.n_kv_heads, std::vector<int32_t>(static_cast<size_t>(p - first + 1)));
    for (auto& t : sel.tokens)
      for (int j = first; j <= p; ++j) t[static_cast<size_t>(j - first)] = j;
    std::vector<float> lse(shape.n_q_heads);
    DecodeAttnArgs a;
    a.kv = views.data();
    a.n_kv_heads = shape.n_kv_heads;
    a.group = shape.group();
    a.scale = attention_scale(shape.head_dim);
    a.q = q + i * qd;
    a.out = out + i * qd;
    a.lse = lse.data();
    a.workspace = &ws;
    cpu::attention_decode_sparse(a, sel, pool);
  };
  if (c == 1) {
    row(0, pool_, attention_ws_);
    return;
  }
  pool_.parallel_for(c, [&](int64_t i, int worker) {
    row(i, *inline_pools_[static_cast<size_t>(worker)], local_ws_[static_cast<size_t>(worker)]);
  });
}

std::vector<PagedHeadView> Session::layer_views(int layer) const {
  std::vector<PagedHeadView> views(static_cast<size_t>(w_.config.n_kv_heads));
  for (int h = 0; h < w_.config.n_kv_heads; ++h) views[static_cast<size_t>(h)] = kv_.view(layer, h);
  return views;
}

void Session::forward(std::span<const int32_t> tokens, bool decode_mode) {
  // The matrix products run in pool_'s tasks, each OpenBLAS call on its task's thread.
  const BlasSingleThreaded blas_single_threaded;
  const ModelConfig& c = w_.config;
  const int n = static_cast<int>(tokens.size());
  const int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
  // Decode profile: lap(slot) adds the time since the previous lap to that op.
  using Clock = std::chrono::steady_clock;
  const bool prof = decode_mode && opt_.profile;
  Clock::time_point t_prev = prof ? Clock::now() : Clock::time_point{};
  auto lap = [&](double DecodeProfile::*slot) {
    if (!prof) return;
    const Clock::time_point now = Clock::now();
    profile_.*slot += std::chrono::duration<double>(now - t_prev).count();
    t_prev = now;
  };
  for (int i = 0; i < n; ++i) {
    CUMULUS_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab_size, "token id {} at position {} is outside the vocabulary [0, {})",
                  tokens[i], pos_ + i, c.vocab_size);
    w_.token_embd.rows_to_f32(tokens[i], tokens[i] + 1, x_.data() + i * c.dim);
    if (c.embedding_scale != 1.0f)
      for (int d = 0; d < c.dim; ++d) x_[static_cast<size_t>(i) * c.dim + d] *= c.embedding_scale;
  }
  // The kernels scale q.k by 1/sqrt(head_dim); a model with another scale has q rescaled.
  const float q_scale = c.attention_scale > 0 ? c.attention_scale / attention_scale(c.head_dim) : 1.0f;
  DecodeContext ctx{.pool = &pool_, .eval = opt_.eval, .attention = &attention_ws_};
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w_.layers[l];
    for (int i = 0; i < n; ++i) rmsnorm(x_.data() + i * c.dim, L.attn_norm.data(), c.dim, c.rms_eps, xn_.data() + i * c.dim);
    lap(&DecodeProfile::other);
    const MatmulOut qkv[] = {{&L.wq, q_.data()}, {&L.wk, k_.data()}, {&L.wv, v_.data()}};
    weight_matmul(pool_, xn_.data(), n, qkv, &matmul_ws_);
    lap(&DecodeProfile::qkv);
    const bool local = c.is_local(l);
    if (c.qk_norm) {
      // Per-head RMSNorm of q [n][n_heads][head_dim] and k [n][n_kv_heads][head_dim], in place.
      for (int r = 0; r < n * c.n_heads; ++r) {
        float* h = q_.data() + static_cast<size_t>(r) * c.head_dim;
        rmsnorm(h, L.attn_q_norm.data(), c.head_dim, c.rms_eps, h);
      }
      for (int r = 0; r < n * c.n_kv_heads; ++r) {
        float* h = k_.data() + static_cast<size_t>(r) * c.head_dim;
        rmsnorm(h, L.attn_k_norm.data(), c.head_dim, c.rms_eps, h);
      }
    }
    const float theta = local ? c.rope_theta_local : c.rope_theta;
    for (int i = 0; i < n; ++i) {
      rope(q_.data() + i * qd, c.n_heads, c.head_dim, c.rope_dim, pos_ + i, theta, c.rope_neox);
      rope(k_.data() + i * kvd, c.n_kv_heads, c.head_dim, c.rope_dim, pos_ + i, theta, c.rope_neox);
    }
    if (q_scale != 1.0f)
      for (int i = 0; i < n * qd; ++i) q_[static_cast<size_t>(i)] *= q_scale;
    kv_.append(l, k_.data(), v_.data(), n);
    if (local) {
      if (decode_mode) {
        if (opt_.on_decode_query) opt_.on_decode_query(l, pos_, q_.data());
        last_[l] = {};
      }
      attention_local(l, n, q_.data(), att_.data());
    } else if (!decode_mode && prompt_q_rows_ > 0) {
      // Keep the queries of positions [prompt_end_ - prompt_q_rows_, prompt_end_).
      const int first = prompt_end_ - prompt_q_rows_;
      for (int i = std::max(0, first - pos_); i < n; ++i)
        std::copy_n(q_.data() + static_cast<size_t>(i) * qd, qd,
                    prompt_q_[l].data() + static_cast<size_t>(pos_ + i - first) * qd);
    }
    if (decode_mode && !local) {
      method_->on_append(l, pos_, kv_);
      if (opt_.on_decode_query) opt_.on_decode_query(l, pos_, q_.data());
      AttnOutput& out = last_[l];
      decode_step(*method_, l, q_.data(), kv_, ctx, out);
      std::copy(out.out.begin(), out.out.end(), att_.begin());
      const double dense_bytes = static_cast<double>(kv_.n_tokens(l)) * kv_.bytes_per_token_head() * c.n_kv_heads;
      double bytes = 0;
      for (const StepStats& st : out.stats) {
        bytes += st.bytes_read;
        summary_.tokens_sum += st.tokens_attended;
        ++summary_.head_steps;
        if (!std::isnan(st.mass_claimed)) summary_.claimed_sum += st.mass_claimed, ++summary_.claimed_count;
        if (!std::isnan(st.mass_true)) summary_.true_sum += st.mass_true, ++summary_.true_count;
      }
      summary_.kv_fraction_sum += bytes / dense_bytes;
      ++summary_.layer_steps;
    } else if (!local) {
      attention_prefill(l, n, q_.data(), att_.data());
    }
    lap(&DecodeProfile::attention);
    // x += att Wo^T (xn_ as scratch for the projection).
    const MatmulOut wo[] = {{&L.wo, xn_.data()}};
    weight_matmul(pool_, att_.data(), n, wo, &matmul_ws_);
    lap(&DecodeProfile::wo);
    if (c.post_norms)
      for (int i = 0; i < n; ++i) {
        float* a = xn_.data() + static_cast<size_t>(i) * c.dim;
        rmsnorm(a, L.post_attention_norm.data(), c.dim, c.rms_eps, a);
      }
    for (int i = 0; i < n * c.dim; ++i) x_[i] += xn_[i];
    for (int i = 0; i < n; ++i) rmsnorm(x_.data() + i * c.dim, L.ffn_norm.data(), c.dim, c.rms_eps, xn_.data() + i * c.dim);
    lap(&DecodeProfile::other);
    const MatmulOut gate_up[] = {{&L.w_gate, gate_.data()}, {&L.w_up, up_.data()}};
    weight_matmul(pool_, xn_.data(), n, gate_up, &matmul_ws_);
    if (c.ffn_activation == FfnActivation::gelu_tanh) {
      for (int i = 0; i < n * c.hidden_dim; ++i) gate_[i] = gelu_tanh(gate_[i]) * up_[i];
    } else {
      for (int i = 0; i < n * c.hidden_dim; ++i) {
        const float g = gate_[i];
        gate_[i] = g / (1.0f + std::exp(-g)) * up_[i];
      }
    }
    const MatmulOut down[] = {{&L.w_down, xn_.data()}};
    weight_matmul(pool_, gate_.data(), n, down, &matmul_ws_);
    if (c.post_norms)
      for (int i = 0; i < n; ++i) {
        float* f = xn_.data() + static_cast<size_t>(i) * c.dim;
        rmsnorm(f, L.post_ffw_norm.data(), c.dim, c.rms_eps, f);
      }
    lap(&DecodeProfile::mlp);
    for (int i = 0; i < n * c.dim; ++i) x_[i] += xn_[i];
  }
  pos_ += n;
  lap(&DecodeProfile::other);
  // Logits of the last token only.
  std::vector<float> last(c.dim);
  rmsnorm(x_.data() + static_cast<size_t>(n - 1) * c.dim, w_.output_norm.data(), c.dim, c.rms_eps, last.data());
  const MatmulOut head[] = {{&w_.output_weight(), logits_.data()}};
  weight_matmul(pool_, last.data(), 1, head, &matmul_ws_);
  if (c.logit_softcap > 0)
    for (float& z : logits_) z = c.logit_softcap * std::tanh(z / c.logit_softcap);
  lap(&DecodeProfile::head);
  if (prof) ++profile_.steps;
}

}  // namespace cumulus
