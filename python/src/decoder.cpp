// cumulus.Decoder: one decode method over a paged KV cache the object owns, for a batch of
// sequences: the layer a serving engine's attention backend calls. Thin over the C++ API:
// per sequence a KvCache (kv/kv_cache.h) and a DecodeMethod (methods/method.h, one object per
// sequence as the contract asks), one ThreadPool and one AttentionWorkspace reused by every
// step, and decode_step (eval mode fills the true mass and the error against dense).
//
// The order a Session keeps: K/V are appended before the step that reads them; the method's
// index over what is cached (on_prefill: tactic's k-means, lfps's tables) is built by
// build_index or by the layer's first decode; tokens appended after it reach the method
// through on_append. truncate starts the sequences' methods afresh (as restart_decode does),
// so their indexes are built again over what remains.
//
// Arrays: K/V float32 (or already in the storage dtype: float16 for dtype f16, bfloat16 for
// bf16), q float32, all CPU and C-contiguous, read where they lie. device="cuda" runs the
// GPU decoders over DeviceKvCaches instead (cuda_decoder.h): the same calls on CUDA float32
// tensors.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>

#include "binding.h"
#include "cuda_decoder.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/method.h"
#include "cumulus/methods/registry.h"

namespace cumulus::python {
namespace {

template <typename T>
using NumpyArray = nb::ndarray<nb::numpy, T>;

// A numpy array owning `v` (moved, no copy) of `shape`.
template <typename T>
NumpyArray<T> numpy_from(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return NumpyArray<T>(owned->data(), shape.size(), shape.begin(), owner);
}

// Per query head of each sequence, one decode step's statistics (methods/method.h StepStats).
struct DecodeStats {
  NumpyArray<int32_t> tokens_attended;
  NumpyArray<double> mass_claimed, bytes_read, mass_true, out_err;
  NumpyArray<bool> bypass;
  std::vector<Selection> selections;  // [batch]
};

// The first element of `bytes` bytes of `type` values that is NaN or infinite; -1 if none.
int64_t first_non_finite(const char* p, size_t bytes, DType type) {
  if (type == DType::f32) {
    const float* f = reinterpret_cast<const float*>(p);
    for (size_t i = 0; i < bytes / 4; ++i)
      if (!std::isfinite(f[i])) return static_cast<int64_t>(i);
    return -1;
  }
  const uint16_t exponent = type == DType::f16 ? 0x7C00 : 0x7F80;  // all ones: Inf or NaN
  for (size_t i = 0; i < bytes / 2; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    if ((h & exponent) == exponent) return static_cast<int64_t>(i);
  }
  return -1;
}

class Decoder {
 public:
  Decoder(const std::string& method, int n_kv_heads, int n_q_heads, int head_dim, int n_layers, int batch,
          const std::string& dtype, int page_size, int max_tokens, std::optional<int> threads, bool eval,
          const std::string& device, const std::optional<nb::dict>& params, const nb::kwargs& method_params)
      : shape_{n_layers, n_q_heads, n_kv_heads, head_dim}, batch_(batch), eval_(eval) {
    constexpr const char* where = "Decoder";
    device_check(where, device);
    if (batch < 1) fail(where, "batch={} must be >= 1", batch);
    const int n_threads = threads.value_or(default_threads());
    if (n_threads < 1 || n_threads > 256) fail(where, "threads={} must be in [1, 256]", n_threads);
    if (max_tokens < 1) fail(where, "max_tokens={} must be >= 1", max_tokens);
    shape_.validate();
    params_ = params ? param_strings(where, *params) : std::map<std::string, std::string>{};
    for (const auto& [k, v] : param_strings(where, method_params)) {
      if (params_.count(k)) fail(where, "method parameter '{}' given twice (in params and as a keyword)", k);
      params_[k] = v;
    }
    kv_options_.page_size = page_size;
    kv_options_.dtype = dtype_from_name(dtype);
    kv_options_.max_tokens = max_tokens;
    method_name_ = method;
    resolved_ = Registry::builtin().parse(method, params_).values();
    if (device == "cuda") {
      if (!method_kind_decodes(Registry::builtin().find(method).kind))
        fail(where, "method='{}' is not a decode method", method);
#ifdef CUMULUS_HAVE_CUDA
      cuda_ = CudaDecoder::make(method, params_, shape_, batch, kv_options_.dtype, page_size, max_tokens, eval);
      prompt_queries_ = cuda_->prompt_queries();
#endif
      pool_ = std::make_unique<ThreadPool>(1);
      return;
    }
    for (int b = 0; b < batch; ++b) {
      seqs_.push_back(Seq{KvCache(shape_, kv_options_), Registry::builtin().make(method, shape_, params_),
                          std::vector<bool>(n_layers, false), AttnOutput{}});
    }
    prompt_queries_ = seqs_.front().method->prompt_queries();
    totals_.assign(n_layers, StepTotals{});
    pool_ = std::make_unique<ThreadPool>(n_threads);
  }

  void append(const AnyArray& k, const AnyArray& v, int layer, std::optional<int> seq) {
    constexpr const char* where = "Decoder.append";
    check_layer(where, layer);
    if (cuda_) {
      if (seq && batch_ != 1)
        fail(where, "seq={}: on cuda every sequence appends at once (k [batch, n, n_kv_heads, head_dim])", *seq);
      if (seq) seq_index(where, seq);
      return cuda_->append(k, v, layer);
    }
    const int kvh = shape_.n_kv_heads, d = shape_.head_dim;
    int first = 0, count = batch_;
    if (seq || k.ndim() == 3) {
      first = seq_index(where, seq);
      count = 1;
      array_check(where, "k", k, {-1, kvh, d});
    } else {
      array_check(where, "k", k, {batch_, -1, kvh, d});
    }
    const int n = static_cast<int>(k.shape(k.ndim() - 3));
    std::vector<int64_t> want(k.ndim());
    for (size_t i = 0; i < k.ndim(); ++i) want[i] = static_cast<int64_t>(k.shape(i));
    array_check(where, "v", v, want);
    if (k.dtype() != v.dtype()) fail(where, "k is {} but v is {}: give both in one dtype", dtype_text(k), dtype_text(v));
    // float32, or the storage dtype itself (appended as stored, bit for bit).
    const DType store = kv_options_.dtype;
    const bool stored = !is_float32(k);
    const bool as_stored = (store == DType::f16 && k.dtype().code == uint8_t(nb::dlpack::dtype_code::Float) &&
                            k.dtype().bits == 16) ||
                           (store == DType::bf16 && k.dtype().code == uint8_t(nb::dlpack::dtype_code::Bfloat) &&
                            k.dtype().bits == 16);
    if (stored && !as_stored)
      fail(where, "k and v are {}: give float32, or {} (this Decoder's KV dtype)", dtype_text(k),
           store == DType::f16 ? "float16" : store == DType::bf16 ? "bfloat16" : "float32");
    for (int b = first; b < first + count; ++b)
      if (seqs_[b].kv.n_tokens(layer) + static_cast<int64_t>(n) > kv_options_.max_tokens)
        fail(where, "sequence {} layer {}: {} cached + {} appended tokens exceed max_tokens={}", b, layer,
             seqs_[b].kv.n_tokens(layer), n, kv_options_.max_tokens);
    const size_t per_seq = static_cast<size_t>(n) * kvh * d * (stored ? 2 : 4);
    const char* kp = static_cast<const char*>(k.data());
    const char* vp = static_cast<const char*>(v.data());
    nb::gil_scoped_release release;
    // KvCache::append refuses non-finite values before it writes; across a batch, every
    // sequence's values are checked before the first is appended, so a failed call changes
    // nothing.
    if (count > 1)
      for (const char* p : {kp, vp})
        if (const int64_t at = first_non_finite(p, per_seq * count, stored ? store : DType::f32); at >= 0)
          fail(where, "{}[{}] (flat index) is not finite: K/V must be finite", p == kp ? "k" : "v", at);
    for (int b = first; b < first + count; ++b) {
      Seq& s = seqs_[b];
      const size_t off = (b - first) * per_seq;
      const int pos0 = s.kv.n_tokens(layer);
      if (stored)
        s.kv.append_stored(layer, kp + off, vp + off, n);
      else
        s.kv.append(layer, reinterpret_cast<const float*>(kp + off), reinterpret_cast<const float*>(vp + off), n);
      if (s.built[layer])
        for (int t = pos0; t < pos0 + n; ++t) s.method->on_append(layer, t, s.kv);
    }
  }

  void build_index(int layer, const std::optional<AnyArray>& prompt_q, std::optional<int> seq) {
    constexpr const char* where = "Decoder.build_index";
    check_layer(where, layer);
    if (cuda_) {
      if (seq && batch_ != 1) fail(where, "seq={}: on cuda the index is built for every sequence at once", *seq);
      if (seq) seq_index(where, seq);
      return cuda_->build_index(layer, prompt_q ? &*prompt_q : nullptr);
    }
    int first = 0, count = batch_;
    int rows = 0;
    const float* qp = nullptr;
    const size_t qd = static_cast<size_t>(shape_.n_q_heads) * shape_.head_dim;
    if (seq) {
      first = seq_index(where, seq);
      count = 1;
    }
    if (prompt_q) {
      const AnyArray& q = *prompt_q;
      if (seq || q.ndim() == 3) {
        first = seq_index(where, seq);
        count = 1;
        array_check(where, "prompt_q", q, {-1, shape_.n_q_heads, shape_.head_dim});
      } else {
        array_check(where, "prompt_q", q, {batch_, -1, shape_.n_q_heads, shape_.head_dim});
      }
      if (!is_float32(q)) fail(where, "prompt_q is {}: give float32", dtype_text(q));
      rows = static_cast<int>(q.shape(q.ndim() - 3));
      qp = static_cast<const float*>(q.data());
    }
    for (int b = first; b < first + count; ++b) {
      const int n = seqs_[b].kv.n_tokens(layer);
      if (n == 0) fail(where, "sequence {} layer {} holds no tokens: append the prompt's K/V first", b, layer);
      if (rows > n) fail(where, "prompt_q has {} rows but sequence {} layer {} holds {} tokens", rows, b, layer, n);
    }
    nb::gil_scoped_release release;
    for (int b = first; b < first + count; ++b) {
      DecodeContext ctx{.pool = pool_.get(), .eval = eval_, .attention = &workspace_};
      ctx.prompt_q = qp ? qp + static_cast<size_t>(b - first) * rows * qd : nullptr;
      ctx.prompt_q_rows = rows;
      seqs_[b].method->on_prefill(layer, seqs_[b].kv, ctx);
      seqs_[b].built[layer] = true;
    }
  }

  std::pair<nb::object, nb::object> decode(const AnyArray& q, int layer, const std::optional<nb::object>& out_obj,
                                           bool want_stats) {
    constexpr const char* where = "Decoder.decode";
    check_layer(where, layer);
    const int h = shape_.n_q_heads, d = shape_.head_dim;
    const bool single = q.ndim() == 2;
    if (single && batch_ != 1)
      fail(where, "q has shape {}: this Decoder holds {} sequences, give q as [{}, {}, {}]", shape_text(q), batch_,
           batch_, h, d);
    const int32_t dev = cuda_ ? nb::device::cuda::value : nb::device::cpu::value;
    if (single)
      array_check(where, "q", q, {h, d}, dev);
    else
      array_check(where, "q", q, {batch_, h, d}, dev);
    if (!is_float32(q)) fail(where, "q is {}: give float32", dtype_text(q));
    std::vector<int64_t> qshape(q.ndim());
    for (size_t i = 0; i < q.ndim(); ++i) qshape[i] = static_cast<int64_t>(q.shape(i));
    if (cuda_) return decode_cuda(q, qshape, layer, out_obj, single, want_stats);
    float* dst = nullptr;
    std::vector<float> fresh;
    const bool out = out_obj.has_value() && !out_obj->is_none();
    if (out) {
      nb::ndarray<> o;  // writable
      if (!nb::try_cast(*out_obj, o, false))
        fail(where, "out={} is not a writable array", nb::repr(*out_obj).c_str());
      const AnyArray view(o);
      array_check(where, "out", view, qshape);
      if (!is_float32(view)) fail(where, "out is {}: give float32", dtype_text(view));
      if (o.data() == q.data()) fail(where, "out is q: give another array");
      dst = static_cast<float*>(o.data());
    } else {
      fresh.resize(static_cast<size_t>(batch_) * h * d);
      dst = fresh.data();
    }
    for (int b = 0; b < batch_; ++b)
      if (seqs_[b].kv.n_tokens(layer) == 0)
        fail(where, "sequence {} layer {} holds no tokens: append K/V before decoding", b, layer);
    const float* qp = static_cast<const float*>(q.data());
    const size_t qd = static_cast<size_t>(h) * d;
    std::vector<int32_t> tokens(static_cast<size_t>(batch_) * h);
    std::vector<double> claimed(tokens.size()), bytes(tokens.size()), mass_true(tokens.size()), err(tokens.size());
    std::vector<bool> bypass(tokens.size());
    DecodeStats stats;
    {
      nb::gil_scoped_release release;
      for (int b = 0; b < batch_; ++b) {
        Seq& s = seqs_[b];
        DecodeContext ctx{.pool = pool_.get(), .eval = eval_, .attention = &workspace_};
        if (!s.built[layer]) {
          s.method->on_prefill(layer, s.kv, ctx);
          s.built[layer] = true;
        }
        decode_step(*s.method, layer, qp + b * qd, s.kv, ctx, s.result);
        std::memcpy(dst + b * qd, s.result.out.data(), qd * sizeof(float));
        add_totals(totals_[layer], s.result, s.kv.n_tokens(layer));
        for (int i = 0; i < h; ++i) {
          const StepStats& st = s.result.stats[i];
          const size_t j = static_cast<size_t>(b) * h + i;
          tokens[j] = st.tokens_attended;
          claimed[j] = st.mass_claimed;
          bytes[j] = st.bytes_read;
          mass_true[j] = st.mass_true;
          err[j] = st.out_err;
          bypass[j] = st.bypass;
        }
        stats.selections.push_back(s.result.selection);
      }
    }
    const size_t bh = static_cast<size_t>(batch_) * h;
    auto shape2 = [&](auto&& v) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      return single ? numpy_from<T>(std::move(v), {static_cast<size_t>(h)})
                    : numpy_from<T>(std::move(v), {static_cast<size_t>(batch_), static_cast<size_t>(h)});
    };
    std::vector<uint8_t> by(bh);
    for (size_t j = 0; j < bh; ++j) by[j] = bypass[j];
    stats.tokens_attended = shape2(tokens);
    stats.mass_claimed = shape2(claimed);
    stats.bytes_read = shape2(bytes);
    stats.mass_true = shape2(mass_true);
    stats.out_err = shape2(err);
    {
      auto* owned = new std::vector<uint8_t>(std::move(by));
      nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<uint8_t>*>(p); });
      const size_t s1[1] = {static_cast<size_t>(h)};
      const size_t s2[2] = {static_cast<size_t>(batch_), static_cast<size_t>(h)};
      stats.bypass = NumpyArray<bool>(reinterpret_cast<bool*>(owned->data()), single ? 1 : 2, single ? s1 : s2, owner);
    }
    nb::object result_out;
    if (out) {
      result_out = *out_obj;
    } else {
      result_out = single ? nb::cast(numpy_from<float>(std::move(fresh), {static_cast<size_t>(h), static_cast<size_t>(d)}))
                          : nb::cast(numpy_from<float>(std::move(fresh), {static_cast<size_t>(batch_),
                                                                          static_cast<size_t>(h), static_cast<size_t>(d)}));
    }
    if (!want_stats) return {result_out, nb::none()};
    return {result_out, nb::cast(std::move(stats))};
  }

  StepTotals totals(int layer) {
    check_layer("Decoder.totals", layer);
#ifdef CUMULUS_HAVE_CUDA
    if (cuda_) {
      nb::gil_scoped_release release;
      return cuda_->totals(layer);
    }
#endif
    return totals_[layer];
  }

  void truncate(int n, std::optional<int> seq) {
    constexpr const char* where = "Decoder.truncate";
    int first = 0, count = batch_;
    if (seq) {
      first = seq_index(where, seq);
      count = 1;
    }
    if (cuda_) return cuda_->truncate(n, seq);
    if (n < 0) fail(where, "n={} must be >= 0", n);
    for (int b = first; b < first + count; ++b)
      for (int l = 0; l < shape_.n_layers; ++l)
        if (seqs_[b].kv.n_tokens(l) < n)
          fail(where, "n={}: sequence {} layer {} holds only {} tokens", n, b, l, seqs_[b].kv.n_tokens(l));
    for (int b = first; b < first + count; ++b) {
      Seq& s = seqs_[b];
      s.kv.truncate(n);
      s.method = Registry::builtin().make(method_name_, shape_, params_);
      s.built.assign(shape_.n_layers, false);
    }
  }

  std::vector<int> lengths(int layer) const {
    check_layer("Decoder.lengths", layer);
    if (cuda_) return cuda_->lengths(layer);
    std::vector<int> out;
    for (const Seq& s : seqs_) out.push_back(s.kv.n_tokens(layer));
    return out;
  }

  size_t kv_bytes() const {
    if (cuda_) return cuda_->kv_bytes();
    size_t b = 0;
    for (const Seq& s : seqs_) b += s.kv.bytes_allocated();
    return b;
  }

  const Shape& shape() const { return shape_; }
  int batch() const { return batch_; }
  const std::string& method() const { return method_name_; }
  const std::map<std::string, std::string>& resolved_params() const { return resolved_; }
  const KvCacheOptions& kv_options() const { return kv_options_; }
  int threads() const { return pool_->n_threads(); }
  bool eval() const { return eval_; }
  std::string device() const { return cuda_ ? "cuda" : "cpu"; }
  int prompt_queries() const { return prompt_queries_; }

 private:
  struct Seq {
    KvCache kv;
    std::unique_ptr<DecodeMethod> method;
    std::vector<bool> built;  // [n_layers] on_prefill ran since the last truncate
    AttnOutput result;        // the last step's, reused
  };

  void check_layer(const char* where, int layer) const {
    if (layer < 0 || layer >= shape_.n_layers)
      fail(where, "layer={} must be in [0, {}) (n_layers={})", layer, shape_.n_layers, shape_.n_layers);
  }
  int seq_index(const char* where, std::optional<int> seq) const {
    if (!seq) {
      if (batch_ != 1) fail(where, "a one-sequence array with a Decoder of batch {}: give seq=", batch_);
      return 0;
    }
    if (*seq < 0 || *seq >= batch_) fail(where, "seq={} must be in [0, {}) (batch={})", *seq, batch_, batch_);
    return *seq;
  }

  // device="cuda": q and out on the device; the statistics as the CPU's (no selections).
  std::pair<nb::object, nb::object> decode_cuda(const AnyArray& q, const std::vector<int64_t>& qshape, int layer,
                                                const std::optional<nb::object>& out_obj, bool single,
                                                bool want_stats) {
    constexpr const char* where = "Decoder.decode";
    const int h = shape_.n_q_heads;
    float* dst = nullptr;
    nb::object result_out;
    if (out_obj.has_value() && !out_obj->is_none()) {
      nb::ndarray<> o;
      if (!nb::try_cast(*out_obj, o, false))
        fail(where, "out={} is not a writable array", nb::repr(*out_obj).c_str());
      const AnyArray view(o);
      array_check(where, "out", view, qshape, nb::device::cuda::value);
      if (!is_float32(view)) fail(where, "out is {}: give float32", dtype_text(view));
      if (o.data() == q.data()) fail(where, "out is q: give another array");
      dst = static_cast<float*>(o.data());
      result_out = *out_obj;
    }
#ifdef CUMULUS_HAVE_CUDA
    if (dst == nullptr) {
      nb::capsule owner;
      dst = cuda_alloc_floats(static_cast<size_t>(batch_) * h * shape_.head_dim, owner);
      std::vector<size_t> shape(qshape.begin(), qshape.end());
      result_out = nb::cast(nb::ndarray<nb::pytorch, float>(dst, shape.size(), shape.data(), owner, nullptr,
                                                            nb::dtype<float>(), nb::device::cuda::value,
                                                            cuda_current_device()));
    }
    CudaStepStats cs = cuda_->decode(q, layer, dst, want_stats);
#else
    (void)dst;
    CudaStepStats cs;
#endif
    if (!want_stats) return {result_out, nb::none()};
    auto shape2 = [&](auto&& v) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      return single ? numpy_from<T>(std::move(v), {static_cast<size_t>(h)})
                    : numpy_from<T>(std::move(v), {static_cast<size_t>(batch_), static_cast<size_t>(h)});
    };
    DecodeStats stats;
    stats.tokens_attended = shape2(cs.tokens);
    stats.mass_claimed = shape2(cs.claimed);
    stats.bytes_read = shape2(cs.bytes);
    std::vector<double> err(cs.mass_true.size(), std::numeric_limits<double>::quiet_NaN());
    stats.mass_true = shape2(cs.mass_true);
    stats.out_err = shape2(err);
    {
      auto* owned = new std::vector<uint8_t>(std::move(cs.bypass));
      nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<uint8_t>*>(p); });
      const size_t s1[1] = {static_cast<size_t>(h)};
      const size_t s2[2] = {static_cast<size_t>(batch_), static_cast<size_t>(h)};
      stats.bypass = NumpyArray<bool>(reinterpret_cast<bool*>(owned->data()), single ? 1 : 2, single ? s1 : s2, owner);
    }
    return {result_out, nb::cast(std::move(stats))};
  }

  // One sequence-step of a CPU layer into its totals: the share of the dense bytes (n
  // tokens' K and V in every kv head) that the step read.
  void add_totals(StepTotals& t, const AttnOutput& r, int n) const {
    double bytes = 0;
    t.steps += 1;
    for (const StepStats& st : r.stats) {
      t.tokens += st.tokens_attended;
      if (!std::isnan(st.mass_claimed)) t.claimed += st.mass_claimed, t.claimed_n += 1;
      if (!std::isnan(st.mass_true)) t.true_mass += st.mass_true, t.true_n += 1;
      bytes += st.bytes_read;
    }
    const double dense = static_cast<double>(n) * shape_.n_kv_heads * shape_.head_dim * 2 * dtype_size(kv_options_.dtype);
    if (dense > 0) t.kv_share += bytes / dense;
  }

  Shape shape_;
  int batch_;
  bool eval_;
  std::unique_ptr<CudaDecoder> cuda_;
  KvCacheOptions kv_options_;
  std::string method_name_;
  std::map<std::string, std::string> params_, resolved_;
  std::vector<Seq> seqs_;
  std::vector<StepTotals> totals_;  // [n_layers], the CPU decoder's
  std::unique_ptr<ThreadPool> pool_;
  AttentionWorkspace workspace_;
  int prompt_queries_ = 0;
};

}  // namespace

void bind_decoder(nb::module_& mod) {
  nb::class_<DecodeStats>(mod, "DecodeStats",
                          "One Decoder.decode step's statistics per query head: arrays [batch, n_q_heads] "
                          "([n_q_heads] for a one-sequence q).")
      .def_prop_ro("tokens_attended", [](const DecodeStats& s) { return s.tokens_attended; }, nb::rv_policy::automatic, "tokens the head's output was computed over")
      .def_prop_ro("mass_claimed", [](const DecodeStats& s) { return s.mass_claimed; }, nb::rv_policy::automatic,
              "the method's claim of the mass that set holds; NaN for methods that claim none")
      .def_prop_ro("bytes_read", [](const DecodeStats& s) { return s.bytes_read; }, nb::rv_policy::automatic,
              "K/V bytes the step read, selection included, shared out over the group's query heads")
      .def_prop_ro("mass_true", [](const DecodeStats& s) { return s.mass_true; }, nb::rv_policy::automatic, "eval=True: the set's true softmax mass; NaN otherwise")
      .def_prop_ro("out_err", [](const DecodeStats& s) { return s.out_err; }, nb::rv_policy::automatic, "eval=True: ||o - o_dense||; NaN otherwise")
      .def_prop_ro("bypass", [](const DecodeStats& s) { return s.bypass; }, nb::rv_policy::automatic, "the head's output is not attention over a set (lfps's sink bypass)")
      .def(
          "selection",
          [](const DecodeStats& s, int seq) {
            if (seq < 0 || seq >= static_cast<int>(s.selections.size()))
              fail("DecodeStats.selection", "seq={} must be in [0, {})", seq, s.selections.size());
            nb::list out;
            for (const auto& t : s.selections[seq].tokens) {
              std::vector<int32_t> copy = t;
              const size_t n = copy.size();
              out.append(numpy_from<int32_t>(std::move(copy), {n}));
            }
            return out;
          },
          nb::arg("seq") = 0,
          "Per kv head, the sorted token indices its query group attended (the union), as int32 arrays.");

  nb::class_<Decoder>(mod, "Decoder",
                      "One decode method over a paged KV cache this object owns, for `batch` sequences of one "
                      "shape: append K/V, decode a query, truncate. Output: softmax(q . k / sqrt(head_dim)) V over "
                      "the set the method attends (scale q beforehand for another softmax scale). Not thread-safe.")
      .def(nb::init<const std::string&, int, int, int, int, int, const std::string&, int, int, std::optional<int>,
                    bool, const std::string&, const std::optional<nb::dict>&, const nb::kwargs&>(),
           nb::arg("method") = "dense", nb::kw_only(), nb::arg("n_kv_heads"), nb::arg("n_q_heads"),
           nb::arg("head_dim"), nb::arg("n_layers") = 1, nb::arg("batch") = 1, nb::arg("dtype") = "f16",
           nb::arg("page_size") = 16, nb::arg("max_tokens") = KvCacheOptions{}.max_tokens,
           nb::arg("threads") = nb::none(), nb::arg("eval") = false, nb::arg("device") = "cpu",
           nb::arg("params") = nb::none(), nb::arg("method_params"),
           "A decoder running `method` (cumulus.methods()) with its parameters as keywords or in `params`. "
           "dtype: the KV storage, 'f16', 'bf16' or 'f32'; max_tokens: capacity per sequence and layer; threads: "
           "default the CPUs this process may run on; eval=True: each step also runs dense attention and reports "
           "mass_true and out_err.")
      .def("append", &Decoder::append, nb::arg("k"), nb::arg("v"), nb::kw_only(), nb::arg("layer") = 0,
           nb::arg("seq") = nb::none(),
           "Appends n tokens' keys and values to `layer`: k, v [batch, n, n_kv_heads, head_dim] for every sequence, "
           "or [n, n_kv_heads, head_dim] for sequence `seq` (default 0 when batch is 1). float32, or the KV dtype "
           "itself (float16 / bfloat16, stored as given); CPU, C-contiguous.")
      .def("build_index", &Decoder::build_index, nb::kw_only(), nb::arg("layer") = 0,
           nb::arg("prompt_q") = nb::none(), nb::arg("seq") = nb::none(),
           "Builds the method's index over what `layer` holds (tactic's clusters, lfps's tables); the layer's "
           "first decode does it otherwise, without prompt queries. prompt_q: the prompt's last queries "
           "[rows, n_q_heads, head_dim] (or [batch, rows, ...]) float32, for methods that learn from them "
           "(prompt_queries > 0).")
      .def("decode", &Decoder::decode, nb::arg("q"), nb::kw_only(), nb::arg("layer") = 0,
           nb::arg("out") = nb::none(), nb::arg("stats") = true,
           "One decode step of every sequence at `layer`: q [batch, n_q_heads, head_dim] (or [n_q_heads, "
           "head_dim] when batch is 1) float32, after the step's K/V were appended. Returns (out, stats): out "
           "like q (numpy or a CUDA tensor, or the `out` array given, written in place), stats a DecodeStats, or "
           "None with stats=False (on cuda nothing then waits for the device; totals() still counts the step).")
      .def(
          "totals",
          [](Decoder& d, int layer) {
            const StepTotals t = d.totals(layer);
            nb::dict r;
            r["steps"] = t.steps;
            r["tokens_attended"] = t.tokens;
            r["claimed_mass"] = t.claimed;
            r["claimed_count"] = t.claimed_n;
            r["kv_read_share"] = t.kv_share;
            r["true_mass"] = t.true_mass;
            r["true_count"] = t.true_n;
            return r;
          },
          nb::arg("layer") = 0,
          "The layer's decode steps summed since the Decoder was made, as a dict: steps (sequence-steps), "
          "tokens_attended (summed over query heads), claimed_mass and claimed_count (heads that claim), "
          "kv_read_share (each step's share of the dense K/V bytes read, selection included), true_mass and "
          "true_count (eval). On cuda it waits for the device.")
      .def("truncate", &Decoder::truncate, nb::arg("n"), nb::kw_only(), nb::arg("seq") = nb::none(),
           "Keeps the first n tokens of every layer (of sequence `seq`, or of all) and starts its method afresh: "
           "the index is built again by build_index or the next decode.")
      .def("lengths", &Decoder::lengths, nb::arg("layer") = 0, "Tokens cached per sequence in `layer`.")
      .def_prop_ro("kv_bytes", &Decoder::kv_bytes, "bytes the KV caches hold (pages and page statistics)")
      .def_prop_ro("method", &Decoder::method)
      .def_prop_ro("params", &Decoder::resolved_params, "every parameter of the method, defaults filled in")
      .def_prop_ro("batch", &Decoder::batch)
      .def_prop_ro("n_layers", [](const Decoder& d) { return d.shape().n_layers; })
      .def_prop_ro("n_q_heads", [](const Decoder& d) { return d.shape().n_q_heads; })
      .def_prop_ro("n_kv_heads", [](const Decoder& d) { return d.shape().n_kv_heads; })
      .def_prop_ro("head_dim", [](const Decoder& d) { return d.shape().head_dim; })
      .def_prop_ro("dtype", [](const Decoder& d) { return std::string(dtype_name(d.kv_options().dtype)); })
      .def_prop_ro("page_size", [](const Decoder& d) { return d.kv_options().page_size; })
      .def_prop_ro("max_tokens", [](const Decoder& d) { return d.kv_options().max_tokens; })
      .def_prop_ro("device", &Decoder::device, "'cpu' or 'cuda'")
      .def_prop_ro("threads", &Decoder::threads)
      .def_prop_ro("eval", &Decoder::eval)
      .def_prop_ro("prompt_queries", &Decoder::prompt_queries,
                   "how many of the prompt's last queries build_index wants in prompt_q (0: none)")
      .def("__repr__", [](const Decoder& d) {
        return fmt::format("Decoder({}, batch={}, n_layers={}, n_q_heads={}, n_kv_heads={}, head_dim={}, dtype={})",
                           d.method(), d.batch(), d.shape().n_layers, d.shape().n_q_heads, d.shape().n_kv_heads,
                           d.shape().head_dim, dtype_name(d.kv_options().dtype));
      });
}

}  // namespace cumulus::python
