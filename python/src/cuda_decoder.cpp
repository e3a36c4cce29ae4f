// cumulus.Decoder on the GPU (cuda_decoder.h). Built only with CUMULUS_CUDA=ON; the order
// of calls is the CPU Decoder's: K/V appended before the step that reads them, the method's
// index built by build_index or the layer's first decode, rebuilt after truncate (the GPU
// decoders encode appended tokens themselves at the next select).
#ifdef CUMULUS_HAVE_CUDA
#include "cuda_decoder.h"

#include <cuda_runtime.h>

#include <cmath>
#include <limits>

#include "cumulus/core/cuda_runtime.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_decoder.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/methods/cuda_methods.h"
#include "model/cuda/decode_methods.h"

namespace cumulus::python {
namespace {

const Registry& gpu_registry() {
  static const Registry r = cuda::registry_with_gpu(Registry::builtin());
  return r;
}

void cuda_check(const char* where, cudaError_t e) {
  if (e != cudaSuccess) fail(where, "CUDA error: {}", cudaGetErrorString(e));
}

// A CUDA float32 array of the current device, C-contiguous, of `shape` (-1: any extent).
const float* device_floats(const char* where, const char* name, const AnyArray& a, const std::vector<int64_t>& shape) {
  array_check(where, name, a, shape, nb::device::cuda::value);
  if (a.device_id() != cuda_current_device())
    fail(where, "{} is on {}: this Decoder is on cuda:{}", name, device_text(a), cuda_current_device());
  if (!is_float32(a)) fail(where, "{} is {}: give float32 on cuda", name, dtype_text(a));
  return static_cast<const float*>(a.data());
}

// As device_floats, for an array [batch, tail...], or [tail...] when batch is 1.
const float* batched_floats(const char* where, const char* name, const AnyArray& a, int batch,
                            std::vector<int64_t> tail) {
  if (batch != 1 || a.ndim() != tail.size()) tail.insert(tail.begin(), batch);
  return device_floats(where, name, a, tail);
}

// The extent of dimension `i` counted from the end.
int extent_from_end(const AnyArray& a, size_t i) { return static_cast<int>(a.shape(a.ndim() - 1 - i)); }

class CudaDecoderImpl final : public CudaDecoder {
 public:
  CudaDecoderImpl(const std::string& method, const std::map<std::string, std::string>& params, const Shape& shape,
                  int batch, DType dtype, int page_size, int max_tokens, bool eval)
      : shape_(shape), batch_(batch), eval_(eval), esize_(dtype_size(dtype)) {
    for (int l = 0; l < shape.n_layers; ++l) {
      Layer L;
      L.kv = std::make_unique<cuda::DeviceKvCache>(
          cuda::DeviceKvCache::create(batch, shape.n_kv_heads, shape.head_dim, dtype, page_size, max_tokens));
      L.dec = cuda::model::make_cuda_decoder(gpu_registry(), method, params, L.kv->view(), shape, l);
      L.plan = std::make_unique<cuda::AttentionPlan>(L.kv->view(), shape.group());
      L.acc = cuda::DeviceBuffer(4 * sizeof(double));
      cuda::memset_async(L.acc.data(), 0, 4 * sizeof(double));
      layers_.push_back(std::move(L));
    }
    const size_t bh = static_cast<size_t>(batch) * shape.n_q_heads;
    lse_ = cuda::DeviceBuffer(bh * sizeof(float));
    if (eval) {
      ref_out_ = cuda::DeviceBuffer(bh * shape.head_dim * sizeof(float));
      ref_lse_ = cuda::DeviceBuffer(bh * sizeof(float));
      mass_ = cuda::DeviceBuffer(bh * sizeof(float));
    }
    for (const Layer& L : layers_)
      if (L.dec) prompt_queries_ = std::max(prompt_queries_, L.dec->prompt_queries());
  }

  void append(const AnyArray& k, const AnyArray& v, int layer) override {
    constexpr const char* where = "Decoder.append";
    const float* kp = batched_floats(where, "k", k, batch_, {-1, shape_.n_kv_heads, shape_.head_dim});
    const int n = extent_from_end(k, 2);
    const float* vp = batched_floats(where, "v", v, batch_, {n, shape_.n_kv_heads, shape_.head_dim});
    cuda::DeviceKvCache& kv = *layers_[layer].kv;
    for (int s = 0; s < batch_; ++s)
      if (kv.n_tokens()[s] + static_cast<int64_t>(n) > kv.view().max_tokens)
        fail(where, "sequence {} layer {}: {} cached + {} appended tokens exceed max_tokens={}", s, layer,
             kv.n_tokens()[s], n, kv.view().max_tokens);
    nb::gil_scoped_release release;
    for (int s = 0; s < batch_; ++s) kv.reserve(s, kv.n_tokens()[s] + n);
    kv.append(kp, vp, n, nullptr);
  }

  void build_index(int layer, const AnyArray* prompt_q) override {
    constexpr const char* where = "Decoder.build_index";
    Layer& L = layers_[layer];
    cuda::DevicePromptQueries pq;
    if (prompt_q) {
      pq.q = batched_floats(where, "prompt_q", *prompt_q, batch_, {-1, shape_.n_q_heads, shape_.head_dim});
      pq.rows = extent_from_end(*prompt_q, 2);
    }
    for (int s = 0; s < batch_; ++s) {
      const int n = L.kv->n_tokens()[s];
      if (n == 0) fail(where, "sequence {} layer {} holds no tokens: append the prompt's K/V first", s, layer);
      if (pq.rows > n) fail(where, "prompt_q has {} rows but sequence {} layer {} holds {} tokens", pq.rows, s, layer, n);
    }
    nb::gil_scoped_release release;
    if (L.dec) L.dec->prefill(nullptr, pq);
    L.built = true;
  }

  CudaStepStats decode(const AnyArray& q, int layer, float* out, bool want_stats) override {
    constexpr const char* where = "Decoder.decode";
    const float* qp = batched_floats(where, "q", q, batch_, {shape_.n_q_heads, shape_.head_dim});
    Layer& L = layers_[layer];
    for (int s = 0; s < batch_; ++s)
      if (L.kv->n_tokens()[s] == 0)
        fail(where, "sequence {} layer {} holds no tokens: append K/V before decoding", s, layer);
    const int h = shape_.n_q_heads, kvh = shape_.n_kv_heads, g = shape_.group();
    const size_t bh = static_cast<size_t>(batch_) * h;
    CudaStepStats st;
    st.tokens.resize(bh);
    st.claimed.assign(bh, 1.0);
    st.bytes.resize(bh);
    st.mass_true.assign(bh, std::numeric_limits<double>::quiet_NaN());
    st.bypass.assign(bh, 0);
    nb::gil_scoped_release release;
    auto dense = [&](float* o, float* lse) {
      cuda::DeviceDecodeArgs a;
      a.kv = L.kv->view();
      a.group = g;
      a.scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim));
      a.q = qp;
      a.out = o;
      a.lse = lse;
      cuda::attention_decode(a, *L.plan, nullptr);
    };
    const double row = 2.0 * shape_.head_dim * esize_;  // one token's K and V in one kv head
    StepTotals& T = L.host;
    T.steps += batch_;
    if (!L.dec) {  // dense: every token, claim 1, the whole K/V; known on the host
      dense(out, lse_.as<float>());
      for (int s = 0; s < batch_; ++s) {
        T.tokens += static_cast<double>(L.kv->n_tokens()[s]) * h;
        T.claimed += h;
        T.claimed_n += h;
        T.kv_share += 1;
        if (eval_) T.true_mass += h, T.true_n += h;
        for (int i = 0; i < h; ++i) {
          const size_t j = static_cast<size_t>(s) * h + i;
          st.tokens[j] = L.kv->n_tokens()[s];
          st.bytes[j] = st.tokens[j] * row / g;
          if (eval_) st.mass_true[j] = 1.0;
        }
      }
      return st;
    }
    if (!L.built) {
      L.dec->prefill(nullptr, {});
      L.built = true;
    }
    L.dec->select(qp, nullptr);
    if (eval_) {
      dense(ref_out_.as<float>(), ref_lse_.as<float>());
      L.dec->attend(qp, out, lse_.as<float>(), ref_lse_.as<float>(), mass_.as<float>(), nullptr);
    } else {
      L.dec->attend(qp, out, lse_.as<float>(), nullptr, nullptr, nullptr);
    }
    L.dec->accumulate_stats(L.acc.as<double>(), nullptr);
    if (!want_stats) return {};
    const cuda::SparseStepStats ss = L.dec->stats(nullptr);  // synchronises
    std::vector<float> mass;
    if (eval_) {
      mass = cuda::to_host<float>(mass_, bh);
      for (float m : mass)
        if (!std::isnan(m)) T.true_mass += m, T.true_n += 1;
    }
    const double select_bytes = L.dec->select_bytes_per_token();
    for (int s = 0; s < batch_; ++s) {
      const int n = L.kv->n_tokens()[s];
      const bool selected = n > L.dec->select_min_tokens();
      for (int i = 0; i < h; ++i) {
        const size_t j = static_cast<size_t>(s) * h + i;
        st.bypass[j] = ss.bypass.empty() ? 0 : ss.bypass[j];
        st.tokens[j] = st.bypass[j] ? 0 : ss.tokens[static_cast<size_t>(s) * kvh + i / g];
        st.claimed[j] = ss.claimed[j];
        st.bytes[j] = (st.tokens[j] * row + (selected ? select_bytes * n : 0.0)) / g;
        if (eval_) st.mass_true[j] = mass[j];
      }
    }
    return st;
  }

  void truncate(int n, std::optional<int> seq) override {
    constexpr const char* where = "Decoder.truncate";
    if (n < 0) fail(where, "n={} must be >= 0", n);
    const int first = seq ? *seq : 0, count = seq ? 1 : batch_;
    for (Layer& L : layers_)
      for (int s = first; s < first + count; ++s)
        if (L.kv->n_tokens()[s] < n)
          fail(where, "n={}: sequence {} holds only {} tokens", n, s, L.kv->n_tokens()[s]);
    nb::gil_scoped_release release;
    for (Layer& L : layers_) {
      for (int s = first; s < first + count; ++s) L.kv->truncate(s, n);
      L.built = false;  // every sequence's index is rebuilt: the GPU decoders index the batch
    }
  }

  StepTotals totals(int layer) override {
    const Layer& L = layers_[layer];
    StepTotals t = L.host;
    const std::vector<double> acc = cuda::to_host<double>(L.acc, 4);  // synchronises
    t.tokens += acc[0];
    t.claimed += acc[1];
    t.claimed_n += acc[2];
    t.kv_share += acc[3];
    return t;
  }

  std::vector<int> lengths(int layer) const override { return layers_[layer].kv->n_tokens(); }

  size_t kv_bytes() const override {
    size_t b = 0;
    for (const Layer& L : layers_) b += L.kv->kv_bytes();
    return b;
  }

  int prompt_queries() const override { return prompt_queries_; }

 private:
  struct Layer {
    std::unique_ptr<cuda::DeviceKvCache> kv;
    std::unique_ptr<cuda::SparseDecoder> dec;  // nullptr: dense attention
    std::unique_ptr<cuda::AttentionPlan> plan;
    cuda::DeviceBuffer acc;  // 4 doubles: SparseDecoder::accumulate_stats
    StepTotals host;         // steps, dense layers' sums, eval's true mass
    bool built = false;
  };
  Shape shape_;
  int batch_;
  bool eval_;
  size_t esize_;
  std::vector<Layer> layers_;
  cuda::DeviceBuffer lse_, ref_out_, ref_lse_, mass_;
  int prompt_queries_ = 0;
};

}  // namespace

std::unique_ptr<CudaDecoder> CudaDecoder::make(const std::string& method,
                                               const std::map<std::string, std::string>& params, const Shape& shape,
                                               int batch, DType dtype, int page_size, int max_tokens, bool eval) {
  constexpr const char* where = "Decoder";
  if (!cuda::device_available()) fail(where, "device='cuda': no CUDA device is visible");
  if (!cuda::head_dim_supported_cuda(shape.head_dim))
    fail(where, "device='cuda': head_dim={} is not built for the CUDA kernels (64, 128, 256)", shape.head_dim);
  if (dtype != DType::f16 && dtype != DType::bf16)
    fail(where, "device='cuda' stores K/V as f16 or bf16, not dtype='{}'", dtype_name(dtype));
  cuda::model::cuda_decode_method_check(gpu_registry(), method, params, shape);
  const size_t need = cuda::DeviceKvCache::create_bytes(batch, shape.n_kv_heads, shape.head_dim, dtype, page_size,
                                                        max_tokens) *
                      static_cast<size_t>(shape.n_layers);
  size_t free = 0, total = 0;
  cuda_check(where, cudaMemGetInfo(&free, &total));
  if (need > free)
    fail(where, "the K/V caches of {} layers x {} sequences at max_tokens={} need {:.1f} GiB; the device has "
                "{:.1f} GiB free (give a smaller max_tokens)",
         shape.n_layers, batch, max_tokens, need / 1073741824.0, free / 1073741824.0);
  return std::make_unique<CudaDecoderImpl>(method, params, shape, batch, dtype, page_size, max_tokens, eval);
}

float* cuda_alloc_floats(size_t n, nb::capsule& owner) {
  void* p = nullptr;
  cuda_check("Decoder.decode", cudaMalloc(&p, n * sizeof(float)));
  owner = nb::capsule(p, [](void* q) noexcept { cudaFree(q); });
  return static_cast<float*>(p);
}

int cuda_current_device() {
  int d = 0;
  cuda_check("cumulus", cudaGetDevice(&d));
  return d;
}

}  // namespace cumulus::python
#endif  // CUMULUS_HAVE_CUDA
