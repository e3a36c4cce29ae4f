// The Llama forward pass on the GPU (issue 16, part 3; cuda_runner.h). The data flow is
// Session's (session.h), for one sequence:
//   x [C][dim] f32 = embd[tokens] (f16 table)
//   per layer: xn f16 = RMSNorm(x) * attn_norm
//              q, k, v f32 = xn W^T (cuBLAS GemmEx: f16 in, f32 accumulate and out)
//              RoPE on q and k at the positions the layer's cache holds (read on the device)
//              k, v appended to the layer's DeviceKvCache (rounded to f16 there)
//              attention: decode (C = 1) through attention_decode (head_dim 64/128) or the
//              generic rows kernel; prefill from position 0 through attention_prefill_dense
//              (head_dim 64/128), else the rows kernel
//              x += att Wo^T (the residual is the GEMM's beta = 1)
//              xn = RMSNorm(x) * ffn_norm; act f16 = silu(xn Wg^T) * (xn Wu^T); x += act Wd^T
//   logits [vocab] f32 = RMSNorm(x_last) * output_norm, times the classifier
// A decode step enqueues everything on one stream and waits once, for the logits; nothing
// in it reads back from the device (positions come from the caches' device counts).
// Activations that feed a product are rounded to f16 (cuBLAS takes f16 for both operands),
// the residual stream and every accumulation stay f32.
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_prefill.h"
#include "cumulus/methods/method.h"
#include "cumulus/model/cuda_runner.h"
#include "forward_kernels.cuh"
#include "kernels/cuda/cuda_util.cuh"

namespace cumulus {
namespace {

using cuda::DeviceBuffer;

#define CUMULUS_CUBLAS_CHECK(call)                                                                        \
  do {                                                                                                    \
    const cublasStatus_t cumulus_blas_s_ = (call);                                                        \
    if (cumulus_blas_s_ != CUBLAS_STATUS_SUCCESS)                                                         \
      throw Error(fmt::format("cuBLAS error {} ({}) in {} at {}:{}", cublasGetStatusName(cumulus_blas_s_), \
                              cublasGetStatusString(cumulus_blas_s_), #call, __FILE__, __LINE__));        \
  } while (0)

int context_of(const ModelConfig& c, const SessionOptions& o) {
  return o.max_tokens > 0 ? o.max_tokens : c.context_length;
}

// Rows of the prefill chunk the scratch is sized for.
int chunk_of(const ModelConfig& c, const SessionOptions& o) {
  return std::max(1, std::min(std::max(o.prefill_chunk, 2048), context_of(c, o)));
}

size_t weight_elems(const ModelConfig& c) {
  const size_t dim = c.dim, qd = static_cast<size_t>(c.n_heads) * c.head_dim,
               kvd = static_cast<size_t>(c.n_kv_heads) * c.head_dim, hid = c.hidden_dim;
  const size_t layer = qd * dim + 2 * kvd * dim + dim * qd + 3 * hid * dim;
  return c.n_layers * layer + static_cast<size_t>(c.vocab_size) * dim * (c.tied_output ? 1 : 2);
}

size_t scratch_bytes(const ModelConfig& c, int rows) {
  const size_t r = rows, qd = static_cast<size_t>(c.n_heads) * c.head_dim,
               kvd = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  const size_t f32 = r * (c.dim + qd + 2 * kvd + 2 * static_cast<size_t>(c.hidden_dim) + qd) + c.vocab_size + qd;
  const size_t f16 = r * (c.dim + qd + c.hidden_dim) + 4 * r * qd;  // xn, att, act; head-major q, k, v, o
  return 4 * f32 + 2 * f16 + 4 * r;
}

std::string gib(size_t b) { return fmt::format("{:.2f} GiB", b / 1073741824.0); }

// W [rows][cols] as f16 on the device (dequantised on the host in slices of rows).
DeviceBuffer upload_f16(const WeightMatrix& w) {
  DeviceBuffer d(w.size() * sizeof(uint16_t));
  const int slice = std::max(1, static_cast<int>((size_t{1} << 22) / std::max(1, w.cols())));
  std::vector<float> f;
  std::vector<uint16_t> h;
  for (int r = 0; r < w.rows(); r += slice) {
    const int e = std::min(w.rows(), r + slice);
    const size_t n = static_cast<size_t>(e - r) * w.cols();
    f.resize(n);
    h.resize(n);
    w.rows_to_f32(r, e, f.data());
    convert_from_f32(f.data(), h.data(), DType::f16, n);
    d.upload(h.data(), n * sizeof(uint16_t), static_cast<size_t>(r) * w.cols() * sizeof(uint16_t));
  }
  return d;
}

class CudaRunner final : public ModelRunner {
 public:
  CudaRunner(const ModelWeights& w, const SessionOptions& o);
  ~CudaRunner() override;
  const std::vector<float>& prefill(std::span<const int32_t> tokens) override;
  const std::vector<float>& decode(int32_t token) override;
  void restart_decode(const std::string& method, const std::map<std::string, std::string>& params) override;
  int position() const override { return pos_; }
  int capacity() const override { return capacity_; }
  AttentionSummary summary() const override { return summary_; }
  PrefillStats prefill_stats() const override { return {}; }
  std::string device() const override { return "cuda: " + cuda_device_summary(); }

 private:
  struct Layer {
    DeviceBuffer attn_norm, ffn_norm, wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  // y [n][w.rows] f32 = beta * y + x [n][cols] f16 W^T (W f16 [rows][cols] row-major).
  void gemm(const DeviceBuffer& w, int rows, int cols, const __half* x, int n, float* y, float beta);
  void forward(std::span<const int32_t> tokens, bool decode_mode);

  const ModelWeights& w_;
  SessionOptions opt_;
  ModelConfig c_;
  cuda::Stream stream_;
  cudaStream_t st_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  DeviceBuffer embd_, out_w_, out_norm_;
  std::vector<Layer> layers_;
  std::vector<cuda::DeviceKvCache> kv_;
  std::unique_ptr<cuda::AttentionPlan> plan_;  // attention_decode, head_dim 64/128
  int rows_ = 0;
  DeviceBuffer tok_, x_, xn_, q_, k_, v_, att_, att16_, gate_, up_, act_, logits_d_, lse_, qh_, kh_, vh_, oh_;
  int32_t* tok_host_ = nullptr;    // page-locked [rows_]
  float* logits_host_ = nullptr;   // page-locked [vocab]
  std::vector<float> logits_;
  int pos_ = 0, capacity_ = 0, prompt_end_ = 0;
  AttentionSummary summary_;
};

CudaRunner::CudaRunner(const ModelWeights& w, const SessionOptions& o) : w_(w), opt_(o), c_(w.config) {
  cuda_runner_check(c_, o);
  st_ = cuda::as_stream(stream_.handle());
  CUMULUS_CUBLAS_CHECK(cublasCreate(&blas_));
  CUMULUS_CUBLAS_CHECK(cublasSetStream(blas_, st_));
  capacity_ = context_of(c_, o);
  rows_ = chunk_of(c_, o);
  // Weights.
  embd_ = upload_f16(w.token_embd);
  if (!c_.tied_output) out_w_ = upload_f16(w.output);
  out_norm_ = cuda::to_device(w.output_norm);
  for (const LayerWeights& L : w.layers) {
    Layer d;
    d.attn_norm = cuda::to_device(L.attn_norm);
    d.ffn_norm = cuda::to_device(L.ffn_norm);
    d.wq = upload_f16(L.wq);
    d.wk = upload_f16(L.wk);
    d.wv = upload_f16(L.wv);
    d.wo = upload_f16(L.wo);
    d.w_gate = upload_f16(L.w_gate);
    d.w_up = upload_f16(L.w_up);
    d.w_down = upload_f16(L.w_down);
    layers_.push_back(std::move(d));
  }
  // One cache per layer, its pages reserved for the whole context up front (a decode step
  // then never touches the host's page tables).
  for (int l = 0; l < c_.n_layers; ++l) {
    kv_.push_back(cuda::DeviceKvCache::create(1, c_.n_kv_heads, c_.head_dim, o.kv.dtype, o.kv.page_size, capacity_));
    kv_.back().reserve(0, capacity_);
  }
  if (cuda::head_dim_supported_cuda(c_.head_dim)) plan_ = std::make_unique<cuda::AttentionPlan>(kv_[0].view(), c_.shape().group());
  // Scratch for rows_ rows.
  const size_t r = rows_, qd = static_cast<size_t>(c_.n_heads) * c_.head_dim,
               kvd = static_cast<size_t>(c_.n_kv_heads) * c_.head_dim;
  tok_ = DeviceBuffer(r * sizeof(int32_t));
  x_ = DeviceBuffer(r * c_.dim * sizeof(float));
  xn_ = DeviceBuffer(r * c_.dim * sizeof(__half));
  q_ = DeviceBuffer(r * qd * sizeof(float));
  k_ = DeviceBuffer(r * kvd * sizeof(float));
  v_ = DeviceBuffer(r * kvd * sizeof(float));
  att_ = DeviceBuffer(qd * sizeof(float));
  att16_ = DeviceBuffer(r * qd * sizeof(__half));
  gate_ = DeviceBuffer(r * c_.hidden_dim * sizeof(float));
  up_ = DeviceBuffer(r * c_.hidden_dim * sizeof(float));
  act_ = DeviceBuffer(r * c_.hidden_dim * sizeof(__half));
  logits_d_ = DeviceBuffer(static_cast<size_t>(c_.vocab_size) * sizeof(float));
  lse_ = DeviceBuffer(c_.n_heads * sizeof(float));
  if (plan_) {
    qh_ = DeviceBuffer(r * qd * sizeof(__half));
    kh_ = DeviceBuffer(r * kvd * sizeof(__half));
    vh_ = DeviceBuffer(r * kvd * sizeof(__half));
    oh_ = DeviceBuffer(r * qd * sizeof(__half));
  }
  CUMULUS_CUDA_CHECK(cudaMallocHost(&tok_host_, r * sizeof(int32_t)));
  CUMULUS_CUDA_CHECK(cudaMallocHost(&logits_host_, static_cast<size_t>(c_.vocab_size) * sizeof(float)));
  logits_.resize(c_.vocab_size);
}

CudaRunner::~CudaRunner() {
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (tok_host_ != nullptr) cudaFreeHost(tok_host_);
  if (logits_host_ != nullptr) cudaFreeHost(logits_host_);
}

void CudaRunner::gemm(const DeviceBuffer& w, int rows, int cols, const __half* x, int n, float* y, float beta) {
  // Column-major view: y^T [rows][n] = W [rows][cols] x^T [cols][n]; W row-major is W^T
  // column-major with leading dimension cols, hence op(A) = T.
  const float alpha = 1.0f;
  CUMULUS_CUBLAS_CHECK(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &alpha, w.data(), CUDA_R_16F,
                                    cols, x, CUDA_R_16F, cols, &beta, y, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

const std::vector<float>& CudaRunner::prefill(std::span<const int32_t> tokens) {
  CUMULUS_CHECK(!tokens.empty(), "prompt is empty (0 tokens)");
  CUMULUS_CHECK(pos_ + static_cast<int64_t>(tokens.size()) <= capacity_,
                "prompt of {} tokens at position {} exceeds the context of {} tokens", tokens.size(), pos_, capacity_);
  CUMULUS_CHECK(pos_ == prompt_end_, "prefill after decode started (position {}): one prompt per session", pos_);
  for (size_t i = 0; i < tokens.size(); i += rows_)
    forward(tokens.subspan(i, std::min<size_t>(rows_, tokens.size() - i)), false);
  prompt_end_ = pos_;
  return logits_;
}

const std::vector<float>& CudaRunner::decode(int32_t token) {
  CUMULUS_CHECK(pos_ > 0, "decode before prefill (position 0): prefill at least one token first");
  CUMULUS_CHECK(pos_ + 1 <= capacity_, "decode at position {} exceeds the context of {} tokens", pos_, capacity_);
  const int32_t t[1] = {token};
  forward(t, true);
  // Dense attention: every head-step reads the whole cache.
  summary_.head_steps += static_cast<int64_t>(c_.n_layers) * c_.n_heads;
  summary_.tokens_sum += static_cast<double>(pos_) * c_.n_layers * c_.n_heads;
  summary_.kv_fraction_sum += c_.n_layers;
  summary_.layer_steps += c_.n_layers;
  return logits_;
}

void CudaRunner::restart_decode(const std::string& method, const std::map<std::string, std::string>& params) {
  CUMULUS_CHECK(prompt_end_ > 0, "restart_decode(method={}) before a prefill: there is no prompt to restart from",
                method);
  CUMULUS_CHECK(method == "dense" && params.empty(),
                "restart_decode(method={}): decode method '{}' is not yet on cuda (dense only)", method, method);
  for (cuda::DeviceKvCache& kv : kv_) {
    kv.truncate(0, prompt_end_);
    kv.reserve(0, capacity_);
  }
  pos_ = prompt_end_;
  summary_ = {};
}

void CudaRunner::forward(std::span<const int32_t> tokens, bool decode_mode) {
  const ModelConfig& c = c_;
  const int n = static_cast<int>(tokens.size());
  for (int i = 0; i < n; ++i)
    CUMULUS_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab_size,
                  "token id {} at position {} is outside the vocabulary [0, {})", tokens[i], pos_ + i, c.vocab_size);
  const int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
  const float scale = attention_scale(c.head_dim);
  std::memcpy(tok_host_, tokens.data(), n * sizeof(int32_t));
  CUMULUS_CUDA_CHECK(cudaMemcpyAsync(tok_.data(), tok_host_, n * sizeof(int32_t), cudaMemcpyHostToDevice, st_));
  float* x = x_.as<float>();
  __half* xn = xn_.as<__half>();
  float *q = q_.as<float>(), *k = k_.as<float>(), *v = v_.as<float>();
  __half* att16 = att16_.as<__half>();
  cuda::model::embed(tok_.as<int32_t>(), n, embd_.as<__half>(), c.dim, c.embedding_scale, x, st_);
  // The tuned prefill kernel attends a chunk that starts at position 0 (causal within it);
  // later chunks take the rows kernel over the cache.
  const bool prefill_first = !decode_mode && plan_ && pos_ == 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
    cuda::DeviceKvCache& kv = kv_[l];
    cuda::model::rmsnorm(x, L.attn_norm.as<float>(), n, c.dim, c.rms_eps, xn, st_);
    gemm(L.wq, qd, c.dim, xn, n, q, 0.0f);
    gemm(L.wk, kvd, c.dim, xn, n, k, 0.0f);
    gemm(L.wv, kvd, c.dim, xn, n, v, 0.0f);
    const int32_t* pos0 = kv.view().n_tokens;  // before this layer's append
    cuda::model::rope(q, n, c.n_heads, c.head_dim, c.rope_dim, pos0, c.rope_theta, st_);
    cuda::model::rope(k, n, c.n_kv_heads, c.head_dim, c.rope_dim, pos0, c.rope_theta, st_);
    kv.append(k, v, n, st_);
    if (decode_mode && plan_) {
      cuda::DeviceDecodeArgs a;
      a.kv = kv.view();
      a.group = c.shape().group();
      a.scale = scale;
      a.q = q;
      a.out = att_.as<float>();
      a.lse = lse_.as<float>();
      cuda::attention_decode(a, *plan_, st_);
      cuda::model::to_half(att_.as<float>(), qd, att16, st_);
    } else if (prefill_first) {
      cuda::model::to_head_major(q, n, c.n_heads, c.head_dim, qh_.as<__half>(), st_);
      cuda::model::to_head_major(k, n, c.n_kv_heads, c.head_dim, kh_.as<__half>(), st_);
      cuda::model::to_head_major(v, n, c.n_kv_heads, c.head_dim, vh_.as<__half>(), st_);
      cuda::DevicePrefillArgs a;
      a.q = qh_.data();
      a.k = kh_.data();
      a.v = vh_.data();
      a.out = oh_.data();
      a.n = n;
      a.n_q_heads = c.n_heads;
      a.n_kv_heads = c.n_kv_heads;
      a.head_dim = c.head_dim;
      a.scale = scale;
      cuda::attention_prefill_dense(a, st_);
      cuda::model::from_head_major(oh_.as<__half>(), n, c.n_heads, c.head_dim, att16, st_);
    } else {
      cuda::model::attention_rows(kv.view(), n, c.n_heads, scale, q, att16, st_);
    }
    gemm(L.wo, c.dim, qd, att16, n, x, 1.0f);  // x += att Wo^T
    cuda::model::rmsnorm(x, L.ffn_norm.as<float>(), n, c.dim, c.rms_eps, xn, st_);
    gemm(L.w_gate, c.hidden_dim, c.dim, xn, n, gate_.as<float>(), 0.0f);
    gemm(L.w_up, c.hidden_dim, c.dim, xn, n, up_.as<float>(), 0.0f);
    cuda::model::swiglu(gate_.as<float>(), up_.as<float>(), static_cast<size_t>(n) * c.hidden_dim,
                        act_.as<__half>(), st_);
    gemm(L.w_down, c.dim, c.hidden_dim, act_.as<__half>(), n, x, 1.0f);  // x += act Wd^T
  }
  pos_ += n;
  // Logits of the last row only.
  cuda::model::rmsnorm(x + static_cast<size_t>(n - 1) * c.dim, out_norm_.as<float>(), 1, c.dim, c.rms_eps, xn, st_);
  gemm(c.tied_output ? embd_ : out_w_, c.vocab_size, c.dim, xn, 1, logits_d_.as<float>(), 0.0f);
  CUMULUS_CUDA_CHECK(cudaMemcpyAsync(logits_host_, logits_d_.data(), static_cast<size_t>(c.vocab_size) * sizeof(float),
                                     cudaMemcpyDeviceToHost, st_));
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(st_));
  std::copy_n(logits_host_, c.vocab_size, logits_.begin());
}

}  // namespace

size_t cuda_runner_bytes(const ModelConfig& c, const SessionOptions& o) {
  const int ctx = context_of(c, o);
  const size_t kv = cuda::DeviceKvCache::create_bytes(1, c.n_kv_heads, c.head_dim, o.kv.dtype, o.kv.page_size, ctx);
  const size_t norms = (2 * static_cast<size_t>(c.n_layers) + 1) * c.dim * sizeof(float);
  return weight_elems(c) * 2 + norms + c.n_layers * kv + scratch_bytes(c, chunk_of(c, o));
}

void cuda_runner_check(const ModelConfig& c, const SessionOptions& o) {
  CUMULUS_CHECK(cuda::device_available(),
                "--device cuda: no CUDA device is available (no GPU, or no driver that this build's CUDA runtime can "
                "use)");
  CUMULUS_CHECK(c.architecture == "llama" && !c.rope_neox && !c.qk_norm && !c.post_norms && c.layer_local.empty() &&
                    c.ffn_activation == FfnActivation::silu && c.logit_softcap == 0 && c.attention_scale == 0,
                "--device cuda: architecture '{}' is not yet on cuda (llama only)", c.architecture);
  CUMULUS_CHECK(c.rope_dim == c.head_dim && c.head_dim % 2 == 0 && c.head_dim <= 256,
                "--device cuda: head_dim={} rope_dim={} not supported (even head_dim <= 256, rope_dim == head_dim)",
                c.head_dim, c.rope_dim);
  CUMULUS_CHECK(o.method == "dense", "--device cuda: decode method '{}' is not yet on cuda (dense only)", o.method);
  CUMULUS_CHECK(o.prefill_method == "dense", "--device cuda: prefill method '{}' is not yet on cuda (dense only)",
                o.prefill_method);
  CUMULUS_CHECK(!o.eval, "--device cuda: eval mode (true mass) is not yet on cuda");
  CUMULUS_CHECK(o.kv.dtype == DType::f16 || o.kv.dtype == DType::bf16,
                "--device cuda: KV dtype {} is not supported on the GPU (f16, bf16)", dtype_name(o.kv.dtype));
  const size_t need = cuda_runner_bytes(c, o);
  size_t free_b = 0, total_b = 0;
  CUMULUS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  CUMULUS_CHECK(need <= free_b,
                "--device cuda: the model with a context of {} tokens needs {} of device memory (weights f16 {}, KV "
                "cache {}), the device has {} free of {}",
                context_of(c, o), gib(need), gib(weight_elems(c) * 2),
                gib(c.n_layers * cuda::DeviceKvCache::create_bytes(1, c.n_kv_heads, c.head_dim, o.kv.dtype,
                                                                    o.kv.page_size, context_of(c, o))),
                gib(free_b), gib(total_b));
}

std::unique_ptr<ModelRunner> model_runner_cuda(const ModelWeights& weights, const SessionOptions& options) {
  return std::make_unique<CudaRunner>(weights, options);
}

std::string cuda_device_summary() {
  if (!cuda::device_available()) return "no CUDA device available";
  const cuda::DeviceInfo d = cuda::device_info();
  return fmt::format("{} (sm_{}{}, {} SMs, {})", d.name, d.cc_major, d.cc_minor, d.sm_count, gib(d.memory_bytes));
}

}  // namespace cumulus
