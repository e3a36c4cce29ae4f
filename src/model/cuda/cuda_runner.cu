// The Llama forward pass on the GPU (cuda_runner.h). The data flow is
// Session's (session.h), for one sequence:
//   x [C][dim] f32 = embd[tokens] (f16 table)
//   per layer: xn f16 = RMSNorm(x) * attn_norm
//              q, k, v f32 = xn W^T (cuBLAS GemmEx: f16 in, f32 accumulate and out)
//              RoPE on q and k at the positions the layer's cache holds (read on the device)
//              k, v appended to the layer's DeviceKvCache (rounded to f16 there)
//              attention: decode (C = 1) through the decode method (dense: attention_decode,
//              head_dim 64/128/256) or the generic rows kernel; a prefill chunk starting at
//              a multiple of 64 through attention_prefill_dense (head_dim 64/128/256; after
//              the first chunk over the cached keys gathered head-major), else the rows kernel;
//              with a prefill method of its own (MethodInfo::gpu_prefill: flexprefill) the
//              whole prompt in one chunk through its cuda::PrefillAttention
//              x += att Wo^T (the residual is the GEMM's beta = 1)
//              xn = RMSNorm(x) * ffn_norm; act f16 = silu(xn Wg^T) * (xn Wu^T); x += act Wd^T
//   logits [vocab] f32 = RMSNorm(x_last) * output_norm, times the classifier
// A decode step enqueues everything on one stream and waits once, for the logits; nothing
// in it reads back from the device (positions come from the caches' device counts).
// Activations that feed a product are rounded to f16 (cuBLAS takes f16 for both operands),
// the residual stream and every accumulation stay f32.
#include <cublas_v2.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>

#include "core/check.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/core/host_memory.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/kv/cuda_kv_pool.h"
#include "cumulus/kernels/cuda_prefill.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/method.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/cuda_runner.h"
#include "decode_methods.h"
#include "forward_kernels.cuh"
#include "core/cuda/cuda_util.cuh"
#include "prefill_methods.h"

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
// A multiple of 64 from 64 up, so every chunk of a prompt starts where the tuned prefill
// kernel can take it. whole_prompt (a prefill method's own attention, as flexprefill's, whose
// probe reads the prompt's last block): the whole context, the prompt in one forward pass
// (the CPU method's chunk_tokens, chunk=0).
int chunk_of(const ModelConfig& c, const SessionOptions& o, bool whole_prompt) {
  if (whole_prompt) return context_of(c, o);
  const int ch = std::max(1, std::min(std::max(o.prefill_chunk, 2048), context_of(c, o)));
  return ch >= 64 ? ch - ch % 64 : ch;
}

// The two-tier pool of SessionOptions::device_kv_gib: that much device memory (whole
// mapping granules), the rest of every layer's pages for the whole context in host memory.
cuda::KvPoolOptions tier_options(const ModelConfig& c, const SessionOptions& o, int n_seqs) {
  cuda::KvPoolOptions p;
  p.head_dim = c.head_dim;
  p.dtype = o.kv.dtype;
  p.page_size = o.kv.page_size;
  const int64_t pages = static_cast<int64_t>(c.n_layers) * n_seqs * c.n_kv_heads *
                        ((context_of(c, o) + o.kv.page_size - 1) / o.kv.page_size);
  const size_t page = cuda::KvPagePool::page_bytes(p.head_dim, p.dtype, p.page_size);
  const int64_t granule = cuda::KvPagePool::device_pages_granule(p.head_dim, p.dtype, p.page_size);
  const int64_t all = (pages + granule - 1) / granule * granule;
  const double want = o.device_kv_gib * 1073741824.0 / static_cast<double>(page);  // may exceed int64
  p.device_pages = want >= static_cast<double>(all) ? all : static_cast<int64_t>(want);
  CUMULUS_CHECK(p.device_pages >= granule,
                "--device-kv-gib={}: the device tier must hold at least one mapping granule of {} pages ({:.3f} GiB)",
                o.device_kv_gib, granule, static_cast<double>(granule * page) / 1073741824.0);
  p.host_pages = std::max<int64_t>(0, pages - p.device_pages / granule * granule);
  if (p.host_pages > 0 && !o.eval) {
    // The staging area (KvPagePool::stage; eval mode reads in place): one layer's share of
    // the host tier (the pages are reserved in rounds across layers), in whole K/V granules,
    // out of the device tier's bytes while it keeps a granule, else none. The share is taken
    // of the host tier as it grows by what the device gives; a step that reads more host
    // pages than the area holds reads the rest in place.
    const size_t kv_page = cuda::KvPagePool::page_bytes(p.head_dim, p.dtype, p.page_size, false);
    const int64_t kv_granule = cuda::KvPagePool::device_pages_granule(p.head_dim, p.dtype, p.page_size, false);
    const auto stage_of = [&](int64_t host) {
      return ((host + c.n_layers - 1) / c.n_layers + kv_granule - 1) / kv_granule * kv_granule;
    };
    const auto give_of = [&](int64_t stage) {
      return (static_cast<int64_t>((static_cast<size_t>(stage) * kv_page + page - 1) / page) + granule - 1) /
             granule * granule;
    };
    const int64_t stage = stage_of(p.host_pages + give_of(stage_of(p.host_pages)));
    const int64_t give = give_of(stage);
    if (p.device_pages - give >= granule) {
      p.device_pages -= give;
      p.host_pages += give;
      p.stage_pages = stage;
    }
  }
  return p;
}

size_t weight_elems(const ModelConfig& c) {
  const size_t dim = c.dim, qd = static_cast<size_t>(c.n_heads) * c.head_dim,
               kvd = static_cast<size_t>(c.n_kv_heads) * c.head_dim, hid = c.hidden_dim;
  const size_t layer = qd * dim + 2 * kvd * dim + dim * qd + 3 * hid * dim;
  return c.n_layers * layer + static_cast<size_t>(c.vocab_size) * dim * (c.tied_output ? 1 : 2);
}

size_t scratch_bytes(const ModelConfig& c, int rows, int capacity) {
  const size_t r = rows, qd = static_cast<size_t>(c.n_heads) * c.head_dim,
               kvd = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  const size_t f32 = r * (c.dim + qd + 2 * kvd + 2 * static_cast<size_t>(c.hidden_dim) + qd) + c.vocab_size + qd;
  // xn, att, act; head-major q and o of a chunk, k and v of every token up to the chunk's end
  const size_t f16 = r * (c.dim + qd + c.hidden_dim) + 2 * r * qd + 2 * std::max<size_t>(r, capacity) * kvd;
  return 4 * f32 + 2 * f16 + 4 * r;
}

std::string gib(size_t b) { return fmt::format("{:.2f} GiB", b / 1073741824.0); }

// W [rows][cols] as f16 into d from element `offset` on (dequantised on the host in slices
// of rows).
void upload_f16_into(DeviceBuffer& d, size_t offset, const WeightMatrix& w) {
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
    d.upload(h.data(), n * sizeof(uint16_t), (offset + static_cast<size_t>(r) * w.cols()) * sizeof(uint16_t));
  }
}
DeviceBuffer upload_f16(const WeightMatrix& w) {
  DeviceBuffer d(w.size() * sizeof(uint16_t));
  upload_f16_into(d, 0, w);
  return d;
}
// Matrices of one input stacked by rows: [sum of rows][cols] f16.
DeviceBuffer upload_f16_stacked(std::initializer_list<const WeightMatrix*> ws) {
  size_t n = 0;
  for (const WeightMatrix* w : ws) n += w->size();
  DeviceBuffer d(n * sizeof(uint16_t));
  size_t off = 0;
  for (const WeightMatrix* w : ws) {
    upload_f16_into(d, off, *w);
    off += w->size();
  }
  return d;
}

class CudaRunner final : public CudaModelRunner {
 public:
  // Device memory for everything but the weights, for n_seqs sequences; then load() or
  // randomize() fills them.
  CudaRunner(const ModelConfig& c, const SessionOptions& o, int n_seqs);
  void load(const ModelWeights& w);
  void randomize(uint64_t seed);
  ~CudaRunner() override;
  const std::vector<float>& prefill(std::span<const int32_t> tokens) override;
  const std::vector<float>& decode(int32_t token) override;
  void restart_decode(const std::string& method, const std::map<std::string, std::string>& params) override;
  void build_indexes() override;
  int position() const override { return pos_; }
  int capacity() const override { return capacity_; }
  AttentionSummary summary() const override;
  const std::vector<AttnOutput>& last_step() const override { return last_; }
  PrefillStats prefill_stats() const override { return prefill_stats_; }
  std::string device() const override { return "cuda: " + cuda_device_summary(); }
  void fill_random_context(int n, uint64_t seed) override;
  std::vector<int32_t> decode_batch(std::span<const int32_t> tokens) override;
  cuda::TierStats tier_totals() const override { return pool_ ? pool_->totals() : cuda::TierStats{}; }
  int n_seqs() const override { return n_seqs_; }
  size_t decode_weight_bytes() const override {
    return (weight_elems(c_) - static_cast<size_t>(c_.tied_output ? 0 : c_.vocab_size) * c_.dim) * sizeof(__half);
  }
  size_t kv_bytes_per_token() const override {
    return 2 * static_cast<size_t>(c_.n_layers) * c_.n_kv_heads * c_.head_dim * dtype_size(opt_.kv.dtype);
  }

 private:
  struct Layer {
    // wqkv: Wq, Wk, Wv stacked [qd + 2 kvd][dim]; w_gate_up: Wgate, Wup [2 hidden][dim]. A
    // decode step takes each stack in one product (its output row holds q, k, v, or gate
    // and up, back to back); a prefill chunk takes the parts one by one.
    DeviceBuffer attn_norm, ffn_norm, wqkv, wo, w_gate_up, w_down;
  };
  // y [n][w.rows] f32 = beta * y + x [n][cols] f16 W^T (W f16 [rows][cols] row-major).
  void gemm(const void* w, int rows, int cols, const __half* x, int n, float* y, float beta);
  void forward(std::span<const int32_t> tokens, bool decode_mode);
  // Everything a forward of n tokens (already in tok_host_) does on the device, ending with
  // the copy of the last row's logits to logits_host_ (or, with `greedy`, of every row's
  // argmax to ids_host_); no host wait (a decode step is captured from it). decode_mode:
  // row i is one token of sequence i (n == n_seqs_); else n rows of sequence 0's prompt.
  void enqueue_forward(int n, bool decode_mode, bool greedy = false);
  // Replays (captures first) the decode step of one token per sequence.
  void decode_step(std::optional<cuda::Graph>& graph, bool greedy);
  // The summary's host part of the decode step just run.
  void count_step();
  // Eval mode: last_ from the step just run (the eval buffers and each decoder's stats()).
  void collect_eval_step();
  // The decode method's decoders, one per layer (nullptr: the layer attends densely); on
  // success the runner's method becomes `method`.
  void make_decoders(const std::string& method, const std::map<std::string, std::string>& params);
  // Before a decode step: the decoders' indexes over the cache (their prefill(): tactic's
  // k-means, sketch_topp's sketch) built if nobody has, and tactic's clusters built again
  // every recluster_interval decoded tokens (the captured steps are dropped: a rebuilt
  // index may move its buffers).
  void prepare_decode();

  SessionOptions opt_;
  ModelConfig c_;
  cuda::Stream stream_;
  cudaStream_t st_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  DeviceBuffer embd_, out_w_, out_norm_;
  std::vector<Layer> layers_;
  std::shared_ptr<cuda::KvPagePool> pool_;  // SessionOptions::device_kv_gib: one pool, two tiers
  std::vector<cuda::DeviceKvCache> kv_;
  std::unique_ptr<cuda::AttentionPlan> plan_;  // attention_decode, head_dim 64/128/256
  DeviceBuffer blas_ws_;                       // cuBLAS workspace (no allocation while capturing)
  // The decode step as one CUDA graph, captured at the first decode (CUMULUS_CUDA_GRAPHS=0:
  // launched kernel by kernel instead).
  bool use_graph_ = true;
  std::optional<cuda::Graph> decode_graph_, batch_graph_;
  int n_seqs_ = 1;
  int rows_ = 0;
  DeviceBuffer tok_, x_, xn_, q_, k_, v_, att_, att16_, gate_, up_, act_, logits_d_, lse_, ids_, qh_, kh_, vh_, oh_;
  int32_t* tok_host_ = nullptr;    // page-locked [rows_]
  float* logits_host_ = nullptr;   // page-locked [vocab]
  int32_t* ids_host_ = nullptr;    // page-locked [n_seqs_]
  std::vector<float> logits_;
  int pos_ = 0, capacity_ = 0, prompt_end_ = 0;
  // The decode method (SessionOptions::method and params, or restart_decode's), from the
  // options' registry with the GPU pipelines attached (cuda::registry_with_gpu).
  Registry registry_gpu_;
  const Registry* registry_ = nullptr;
  std::string method_;
  std::map<std::string, std::string> params_;
  cuda::model::CudaDecodePlan mplan_;
  std::vector<std::unique_ptr<cuda::SparseDecoder>> dec_;  // [n_layers]
  bool indexed_ = false;
  int indexed_at_ = 0;  // position of the last index build
  // The summary: dense layers' head-steps counted here, the decoders' statistics summed on
  // the device (SparseDecoder::accumulate_stats into stats_acc_, 4 doubles).
  AttentionSummary summary_;
  DeviceBuffer stats_acc_;
  // Eval mode (SessionOptions::eval): per layer, the dense pass's output and log-sum-exp,
  // the true mass of each query head's set (SparseDecoder::attend's lse_ref / mass) and the
  // method's output, [n_layers][n_heads (x head_dim)]; last_ is made from them.
  DeviceBuffer ev_dense_out_, ev_dense_lse_, ev_mass_, ev_out_;
  std::vector<AttnOutput> last_;
  // The prompt's last pq_rows_ queries (after RoPE), [n_layers][pq_rows_][n_heads][head_dim],
  // for a method that learns from them (SparseDecoder::prompt_queries: lfps), kept by prefill().
  DeviceBuffer pq_;
  int pq_rows_ = 0, pq_end_ = 0;  // rows kept; the end of the prompt they are the last of
  // The prefill method (SessionOptions::prefill_method and prefill_params; its attention,
  // unless dense) and the statistics the CPU method reports.
  cuda::model::CudaPrefillPlan pplan_;
  PrefillStats prefill_stats_;
};

void CudaRunner::load(const ModelWeights& w) {
  embd_ = upload_f16(w.token_embd);
  if (!c_.tied_output) out_w_ = upload_f16(w.output);
  out_norm_ = cuda::to_device(w.output_norm);
  layers_.clear();
  for (const LayerWeights& L : w.layers) {
    Layer d;
    d.attn_norm = cuda::to_device(L.attn_norm);
    d.ffn_norm = cuda::to_device(L.ffn_norm);
    d.wqkv = upload_f16_stacked({&L.wq, &L.wk, &L.wv});
    d.wo = upload_f16(L.wo);
    d.w_gate_up = upload_f16_stacked({&L.w_gate, &L.w_up});
    d.w_down = upload_f16(L.w_down);
    layers_.push_back(std::move(d));
  }
}

void CudaRunner::randomize(uint64_t seed) {
  const ModelConfig& c = c_;
  auto matrix = [&](int rows, int cols) {
    DeviceBuffer b(static_cast<size_t>(rows) * cols * sizeof(__half));
    // Uniform in [-a, a) has variance a^2 / 3: a = sqrt(3 / cols) gives 1 / cols.
    cuda::model::fill_uniform(b.as<__half>(), static_cast<size_t>(rows) * cols, std::sqrt(3.0f / cols), seed++, st_);
    return b;
  };
  const std::vector<float> ones(c.dim, 1.0f);
  const int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
  embd_ = matrix(c.vocab_size, c.dim);
  if (!c.tied_output) out_w_ = matrix(c.vocab_size, c.dim);
  out_norm_ = cuda::to_device(ones);
  layers_.clear();
  for (int l = 0; l < c.n_layers; ++l) {
    Layer d;
    d.attn_norm = cuda::to_device(ones);
    d.ffn_norm = cuda::to_device(ones);
    d.wqkv = matrix(qd + 2 * kvd, c.dim);
    d.wo = matrix(c.dim, qd);
    d.w_gate_up = matrix(2 * c.hidden_dim, c.dim);
    d.w_down = matrix(c.dim, c.hidden_dim);
    layers_.push_back(std::move(d));
  }
  stream_.synchronize();
}

void CudaRunner::fill_random_context(int n, uint64_t seed) {
  CUMULUS_CHECK(pos_ == 0, "fill_random_context(n={}) at position {}: a fresh runner only", n, pos_);
  CUMULUS_CHECK(n >= 1 && n <= capacity_, "fill_random_context: n={} must be in [1, {}]", n, capacity_);
  // Random rows for one chunk of the prefill scratch (k_, v_), appended again and again.
  const size_t kvd = static_cast<size_t>(c_.n_kv_heads) * c_.head_dim;
  cuda::model::fill_uniform(k_.as<float>(), static_cast<size_t>(rows_) * kvd, 2.0f, seed, st_);
  cuda::model::fill_uniform(v_.as<float>(), static_cast<size_t>(rows_) * kvd, 2.0f, seed + 1, st_);
  // Every sequence gets its own rows of the buffer: chunks of rows_ / n_seqs tokens.
  const int chunk = std::max(1, rows_ / n_seqs_);
  for (cuda::DeviceKvCache& kv : kv_)
    for (int t = 0; t < n; t += chunk) kv.append(k_.as<float>(), v_.as<float>(), std::min(chunk, n - t), st_);
  stream_.synchronize();
  pos_ = prompt_end_ = n;
}

CudaRunner::CudaRunner(const ModelConfig& c, const SessionOptions& o, int n_seqs) : opt_(o), c_(c), n_seqs_(n_seqs) {
  cuda_runner_check(c_, o, n_seqs);
  st_ = cuda::as_stream(stream_.handle());
  CUMULUS_CUBLAS_CHECK(cublasCreate(&blas_));
  CUMULUS_CUBLAS_CHECK(cublasSetStream(blas_, st_));
  blas_ws_ = DeviceBuffer(size_t{32} << 20);
  CUMULUS_CUBLAS_CHECK(cublasSetWorkspace(blas_, blas_ws_.data(), blas_ws_.size()));
  const char* graphs = std::getenv("CUMULUS_CUDA_GRAPHS");
  use_graph_ = graphs == nullptr || std::string(graphs) != "0";
  capacity_ = context_of(c_, o);
  registry_gpu_ = cuda::registry_with_gpu(o.registry != nullptr ? *o.registry : Registry::builtin());
  registry_ = &registry_gpu_;
  pplan_ = cuda::model::cuda_prefill_plan(*registry_, o.prefill_method, o.prefill_params, c_.shape(), o.n_threads);
  rows_ = std::max(chunk_of(c_, o, pplan_.attention != nullptr), n_seqs_);
  // One cache per layer, its pages reserved for the whole context up front (a decode step
  // then never touches the host's page tables). With device_kv_gib, every layer's pages
  // come from one pool of that much device memory, the rest in pinned host memory.
  if (o.device_kv_gib > 0) pool_ = cuda::KvPagePool::create(tier_options(c_, o, n_seqs_));
  for (int l = 0; l < c_.n_layers; ++l) {
    kv_.push_back(pool_ ? cuda::DeviceKvCache::create(pool_, n_seqs_, c_.n_kv_heads, capacity_)
                        : cuda::DeviceKvCache::create(n_seqs_, c_.n_kv_heads, c_.head_dim, o.kv.dtype,
                                                      o.kv.page_size, capacity_));
    if (!pool_)
      for (int s = 0; s < n_seqs_; ++s) kv_.back().reserve(s, capacity_);
  }
  if (pool_) {
    // Every layer's pages in rounds of 16384 tokens, each round a step of the pool's clock:
    // once the device tier is full the earliest rounds go to the host, so the newest tokens
    // of every layer (the recent ones, which every step reads) start on the device.
    for (int t = 0; t < capacity_; t += 16384) {
      for (cuda::DeviceKvCache& kv : kv_)
        for (int s = 0; s < n_seqs_; ++s) kv.reserve(s, std::min(capacity_, t + 16384));
      pool_->end_step();
    }
    cuda::device_synchronize();  // the last round's step, on the default stream, before any capture
    pool_->reset_totals();
    pool_->reserve_stage(kv_[0].view());  // every layer's view has this shape
  }
  if (cuda::head_dim_supported_cuda(c_.head_dim))
    plan_ = std::make_unique<cuda::AttentionPlan>(kv_[0].view(), c_.shape().group());
  CUMULUS_CHECK(n_seqs_ == 1 || plan_ != nullptr, "a batch of {} sequences needs head_dim 64, 128 or 256, not {}",
                n_seqs_, c_.head_dim);
  // Scratch for rows_ rows.
  const size_t r = rows_, qd = static_cast<size_t>(c_.n_heads) * c_.head_dim,
               kvd = static_cast<size_t>(c_.n_kv_heads) * c_.head_dim;
  tok_ = DeviceBuffer(r * sizeof(int32_t));
  x_ = DeviceBuffer(r * c_.dim * sizeof(float));
  xn_ = DeviceBuffer(r * c_.dim * sizeof(__half));
  q_ = DeviceBuffer((r * qd + 2 * kvd) * sizeof(float));  // decode: q, k, v back to back
  k_ = DeviceBuffer(r * kvd * sizeof(float));
  v_ = DeviceBuffer(r * kvd * sizeof(float));
  att_ = DeviceBuffer(n_seqs_ * qd * sizeof(float));
  att16_ = DeviceBuffer(r * qd * sizeof(__half));
  gate_ = DeviceBuffer((r + 1) * c_.hidden_dim * sizeof(float));  // decode: gate, up back to back
  up_ = DeviceBuffer(r * c_.hidden_dim * sizeof(float));
  act_ = DeviceBuffer(r * c_.hidden_dim * sizeof(__half));
  logits_d_ = DeviceBuffer(static_cast<size_t>(n_seqs_) * c_.vocab_size * sizeof(float));
  lse_ = DeviceBuffer(static_cast<size_t>(n_seqs_) * c_.n_heads * sizeof(float));
  ids_ = DeviceBuffer(n_seqs_ * sizeof(int32_t));
  if (plan_) {
    qh_ = DeviceBuffer(r * qd * sizeof(__half));
    // k and v of every token up to a chunk's end: a chunk after the first attends the keys
    // cached before it through the same kernel (DevicePrefillArgs::q_first).
    const size_t kv_rows = std::max<size_t>(r, static_cast<size_t>(capacity_));
    kh_ = DeviceBuffer(kv_rows * kvd * sizeof(__half));
    vh_ = DeviceBuffer(kv_rows * kvd * sizeof(__half));
    oh_ = DeviceBuffer(r * qd * sizeof(__half));
  }
  CUMULUS_CUDA_CHECK(cudaMallocHost(&tok_host_, r * sizeof(int32_t)));
  CUMULUS_CUDA_CHECK(cudaMallocHost(&logits_host_, static_cast<size_t>(c_.vocab_size) * sizeof(float)));
  CUMULUS_CUDA_CHECK(cudaMallocHost(&ids_host_, n_seqs_ * sizeof(int32_t)));
  logits_.resize(c_.vocab_size);
  stats_acc_ = DeviceBuffer(4 * sizeof(double));
  stats_acc_.fill_bytes(0);
  if (o.eval) {
    const size_t heads = static_cast<size_t>(c_.n_layers) * c_.n_heads;
    ev_dense_out_ = DeviceBuffer(heads * c_.head_dim * sizeof(float));
    ev_dense_lse_ = DeviceBuffer(heads * sizeof(float));
    ev_mass_ = DeviceBuffer(heads * sizeof(float));
    ev_out_ = DeviceBuffer(heads * c_.head_dim * sizeof(float));
  }
  make_decoders(o.method, o.params);
}

void CudaRunner::make_decoders(const std::string& method, const std::map<std::string, std::string>& params) {
  // Built aside and swapped in only when every layer's is: a failure (an allocation, say)
  // leaves the runner's method and decoders as they were.
  std::vector<std::unique_ptr<cuda::SparseDecoder>> dec;
  for (int l = 0; l < c_.n_layers; ++l)
    dec.push_back(cuda::model::make_cuda_decoder(*registry_, method, params, kv_[l].view(), c_.shape(), l));
  mplan_ = cuda::model::cuda_decode_plan(*registry_, method, params);
  dec_.swap(dec);
  method_ = method;
  params_ = params;
  indexed_ = false;
  decode_graph_.reset();  // a captured step holds the old decoders
  batch_graph_.reset();
}

void CudaRunner::build_indexes() {
  CUMULUS_CHECK(pos_ > 0, "build_indexes before a prefill (position 0): there is no prompt to index");
  if (indexed_) return;
  const size_t qd = static_cast<size_t>(c_.n_heads) * c_.head_dim;
  for (int l = 0; l < c_.n_layers; ++l)
    if (dec_[l])
      dec_[l]->prefill(st_, cuda::DevicePromptQueries{
                                pq_rows_ > 0 ? pq_.as<float>() + static_cast<size_t>(l) * pq_rows_ * qd : nullptr,
                                pq_rows_});
  stream_.synchronize();
  for (auto& d : dec_)
    if (d) d->check(st_);
  indexed_ = true;
  indexed_at_ = pos_;
}

void CudaRunner::prepare_decode() {
  if (!indexed_) {
    build_indexes();
  } else if (mplan_.recluster_interval > 0 && pos_ - indexed_at_ >= mplan_.recluster_interval) {
    // tactic: the CPU clusters each new segment of recluster_interval tokens and adds it to
    // the index; the GPU pipeline clusters the whole cache again (docs/cuda.md).
    indexed_ = false;
    build_indexes();
    decode_graph_.reset();
    batch_graph_.reset();
  }
}

AttentionSummary CudaRunner::summary() const {
  AttentionSummary s = summary_;
  double acc[4];
  stream_.synchronize();
  cuda::memcpy_to_host(acc, stats_acc_.data(), sizeof(acc));
  s.tokens_sum += acc[0];
  s.claimed_sum += acc[1];
  s.claimed_count += static_cast<int64_t>(acc[2]);
  s.kv_fraction_sum += acc[3] / n_seqs_;
  return s;
}

CudaRunner::~CudaRunner() {
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (tok_host_ != nullptr) cudaFreeHost(tok_host_);
  if (logits_host_ != nullptr) cudaFreeHost(logits_host_);
  if (ids_host_ != nullptr) cudaFreeHost(ids_host_);
}

void CudaRunner::gemm(const void* w, int rows, int cols, const __half* x, int n, float* y, float beta) {
  // Column-major view: y^T [rows][n] = W [rows][cols] x^T [cols][n]; W row-major is W^T
  // column-major with leading dimension cols, hence op(A) = T.
  const float alpha = 1.0f;
  CUMULUS_CUBLAS_CHECK(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &alpha, w, CUDA_R_16F,
                                    cols, x, CUDA_R_16F, cols, &beta, y, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

const std::vector<float>& CudaRunner::prefill(std::span<const int32_t> tokens) {
  CUMULUS_CHECK(!tokens.empty(), "prompt is empty (0 tokens)");
  CUMULUS_CHECK(pos_ + static_cast<int64_t>(tokens.size()) <= capacity_,
                "prompt of {} tokens at position {} exceeds the context of {} tokens", tokens.size(), pos_, capacity_);
  CUMULUS_CHECK(pos_ == prompt_end_, "prefill after decode started (position {}): one prompt per session", pos_);
  CUMULUS_CHECK(n_seqs_ == 1, "prefill of a runner of {} sequences (fill_random_context fills batches)", n_seqs_);
  // Every id before any state changes (a bad id in a later chunk would leave a prompt half
  // prefilled).
  for (size_t i = 0; i < tokens.size(); ++i)
    CUMULUS_CHECK(tokens[i] >= 0 && tokens[i] < c_.vocab_size,
                  "token id {} at position {} is outside the vocabulary [0, {})", tokens[i], pos_ + i, c_.vocab_size);
  if (pplan_.attention) {
    // The CPU Session runs a prompt fed in pieces as the method's chunks at their positions;
    // a prefill attention on the GPU (flexprefill's probe and block-sparse kernel) takes a
    // prompt from position 0 only.
    CUMULUS_CHECK(pos_ == 0,
                  "prefill of {} tokens at position {}: {} on cuda prefills one prompt in one call from "
                  "position 0 (a prompt fed in pieces is not yet on cuda)",
                  tokens.size(), pos_, opt_.prefill_method);
    pplan_.attention->begin(static_cast<int>(tokens.size()));
  }
  // The prompt's last queries per layer (after RoPE), for a method that learns from them
  // (lfps) now or after restart_decode (keep_prompt_queries), as the CPU Session keeps them.
  // A prompt fed in pieces keeps the rows an earlier piece left that are still among them
  // (rows exist only for the positions cached: at most pos_).
  int want = opt_.keep_prompt_queries;
  for (const auto& d : dec_)
    if (d) want = std::max(want, d->prompt_queries());
  const size_t qd = static_cast<size_t>(c_.n_heads) * c_.head_dim;
  const int old_first = pq_end_ - pq_rows_, old_end = std::min(pq_end_, pos_), old_rows = pq_rows_;
  pq_end_ = pos_ + static_cast<int>(tokens.size());
  const int rows = std::min(want, pq_end_), first = pq_end_ - rows, keep = std::max(first, old_first);
  DeviceBuffer kept;  // nothing kept: no allocation, no copy
  if (rows > 0) kept = DeviceBuffer(static_cast<size_t>(rows) * c_.n_layers * qd * sizeof(float));
  if (rows > 0 && keep < old_end)
    for (int l = 0; l < c_.n_layers; ++l)
      cuda::memcpy_device_async(kept.as<float>() + (static_cast<size_t>(l) * rows + keep - first) * qd,
                                pq_.as<float>() + (static_cast<size_t>(l) * old_rows + keep - old_first) * qd,
                                static_cast<size_t>(old_end - keep) * qd * sizeof(float), st_);
  if (rows > 0 && keep < old_end) stream_.synchronize();  // the old rows are copied before their buffer goes
  pq_ = std::move(kept);
  pq_rows_ = rows;
  for (size_t i = 0; i < tokens.size(); i += rows_)
    forward(tokens.subspan(i, std::min<size_t>(rows_, tokens.size() - i)), false);
  if (pplan_.attention) pplan_.attention->end();
  prompt_end_ = pos_;
  return logits_;
}

const std::vector<float>& CudaRunner::decode(int32_t token) {
  CUMULUS_CHECK(pos_ > 0, "decode before prefill (position 0): prefill at least one token first");
  CUMULUS_CHECK(pos_ + 1 <= capacity_, "decode at position {} exceeds the context of {} tokens", pos_, capacity_);
  CUMULUS_CHECK(token >= 0 && token < c_.vocab_size, "token id {} at position {} is outside the vocabulary [0, {})",
                token, pos_, c_.vocab_size);
  CUMULUS_CHECK(n_seqs_ == 1, "decode(token) of a runner of {} sequences: use decode_batch", n_seqs_);
  prepare_decode();
  if (use_graph_) {
    tok_host_[0] = token;  // the graph's first node copies it from here
    decode_step(decode_graph_, false);
    std::copy_n(logits_host_, c_.vocab_size, logits_.begin());
  } else {
    const int32_t t[1] = {token};
    forward(t, true);
    if (pool_) pool_->end_step(st_);
  }
  count_step();
  if (opt_.eval) collect_eval_step();
  return logits_;
}

void CudaRunner::collect_eval_step() {
  // As the CPU's eval mode (methods/method.cpp): per query head, the tokens its kv head's
  // union held, the method's claim, the true mass of that union and ||o - o_dense||. A layer
  // without a decoder attends densely: every cached token, claim 1, mass 1, distance 0 (its
  // output is the dense pass itself). bytes_read stays 0: the K/V share is the summary's.
  const int nh = c_.n_heads, hd = c_.head_dim, group = c_.shape().group();
  const size_t heads = static_cast<size_t>(c_.n_layers) * nh;
  std::vector<float> dense_out(heads * hd), out(heads * hd), mass(heads);
  stream_.synchronize();
  cuda::memcpy_to_host(dense_out.data(), ev_dense_out_.data(), dense_out.size() * sizeof(float));
  cuda::memcpy_to_host(out.data(), ev_out_.data(), out.size() * sizeof(float));
  cuda::memcpy_to_host(mass.data(), ev_mass_.data(), mass.size() * sizeof(float));
  last_.assign(c_.n_layers, {});
  for (int l = 0; l < c_.n_layers; ++l) {
    std::vector<StepStats>& st = last_[l].stats;
    st.resize(nh);
    if (!dec_[l]) {
      for (StepStats& h : st) h.tokens_attended = pos_, h.mass_claimed = 1.0, h.mass_true = 1.0, h.out_err = 0.0;
      continue;
    }
    const cuda::SparseStepStats ss = dec_[l]->stats(st_);
    last_[l].out.assign(out.begin() + static_cast<ptrdiff_t>(l) * nh * hd,
                        out.begin() + static_cast<ptrdiff_t>(l + 1) * nh * hd);
    for (int h = 0; h < nh; ++h) {
      const size_t row = (static_cast<size_t>(l) * nh + h) * hd;
      double err = 0;
      for (int d = 0; d < hd; ++d) {
        const double diff = static_cast<double>(out[row + d]) - dense_out[row + d];
        err += diff * diff;
      }
      // A bypassed head (lfps) attended no set: no tokens, no mass to check (as the CPU).
      st[h].bypass = !ss.bypass.empty() && ss.bypass[h] != 0;
      st[h].tokens_attended = st[h].bypass ? 0 : ss.tokens[h / group];
      st[h].mass_claimed = ss.claimed[h];
      st[h].mass_true = st[h].bypass ? std::numeric_limits<double>::quiet_NaN() : mass[static_cast<size_t>(l) * nh + h];
      st[h].out_err = std::sqrt(err);
    }
  }
  for (const AttnOutput& layer : last_)
    for (const StepStats& h : layer.stats)
      if (!std::isnan(h.mass_true)) summary_.true_sum += h.mass_true, ++summary_.true_count;
}

void CudaRunner::count_step() {
  // Every head-step of the step (pos_ is past it); the dense layers' here (every token,
  // claim 1, as the CPU's dense attention), the decoders' on the device.
  int dense_layers = 0;
  for (const auto& d : dec_) dense_layers += d ? 0 : 1;
  const int64_t dense_heads = static_cast<int64_t>(dense_layers) * c_.n_heads * n_seqs_;
  summary_.head_steps += static_cast<int64_t>(c_.n_layers) * c_.n_heads * n_seqs_;
  summary_.layer_steps += c_.n_layers;
  summary_.tokens_sum += static_cast<double>(pos_) * dense_heads;
  summary_.kv_fraction_sum += dense_layers;
  summary_.claimed_sum += static_cast<double>(dense_heads);
  summary_.claimed_count += dense_heads;
}

void CudaRunner::decode_step(std::optional<cuda::Graph>& graph, bool greedy) {
  if (!use_graph_) {
    enqueue_forward(n_seqs_, true, greedy);
  } else if (!graph) {
    // Capturing enqueues nothing: the caches' host counts advance once, here, for the
    // launch below; later replays advance them with append_replayed.
    graph = cuda::Graph::capture(stream_.handle(), [&] { enqueue_forward(n_seqs_, true, greedy); });
  } else {
    for (cuda::DeviceKvCache& kv : kv_) kv.append_replayed(1);
  }
  if (use_graph_) graph->launch(stream_.handle());
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(st_));
  if (pool_) pool_->end_step(st_);  // promotions, on the stream before the next step
  ++pos_;
}

std::vector<int32_t> CudaRunner::decode_batch(std::span<const int32_t> tokens) {
  CUMULUS_CHECK(static_cast<int>(tokens.size()) == n_seqs_, "decode_batch: {} tokens for {} sequences", tokens.size(),
                n_seqs_);
  CUMULUS_CHECK(pos_ > 0, "decode_batch before the context is filled (position 0)");
  CUMULUS_CHECK(pos_ + 1 <= capacity_, "decode at position {} exceeds the context of {} tokens", pos_, capacity_);
  for (int32_t t : tokens)
    CUMULUS_CHECK(t >= 0 && t < c_.vocab_size, "token id {} is outside the vocabulary [0, {})", t, c_.vocab_size);
  prepare_decode();
  std::copy(tokens.begin(), tokens.end(), tok_host_);
  decode_step(batch_graph_, true);
  count_step();
  return std::vector<int32_t>(ids_host_, ids_host_ + n_seqs_);
}

void CudaRunner::restart_decode(const std::string& method, const std::map<std::string, std::string>& params) {
  CUMULUS_CHECK(prompt_end_ > 0, "restart_decode(method={}) before a prefill: there is no prompt to restart from",
                method);
  cuda::model::cuda_decode_method_check(*registry_, method, params, c_.shape());
  const int wants = registry_->make(method, c_.shape(), params)->prompt_queries();
  CUMULUS_CHECK(wants <= pq_rows_ || pq_rows_ == prompt_end_,
                "restart_decode(method={}) needs the prompt's last {} queries but the runner kept {} "
                "(set SessionOptions::keep_prompt_queries)",
                method, wants, pq_rows_);
  stream_.synchronize();
  // The new decoders are built beside the current ones (so that a failure leaves the runner
  // as it was): their memory, measured on one layer's cache as the constructor's check
  // measures it, must be free now, beside the current method's. Checked before any is built.
  size_t need = 0, free_b = 0, total_b = 0;
  try {
    need = cuda::model::cuda_decoder_bytes(*registry_, method, params, kv_[0].view(), c_.shape());
    CUMULUS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  } catch (const cuda::DeviceMemoryError& e) {  // even one layer's decoder did not fit
    CUMULUS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    CUMULUS_FAIL("method={}: one layer's decoder does not fit beside the current method '{}' ({} of "
                 "device memory free of {}): {}",
                 method, method_, gib(free_b), gib(total_b), e.what());
  }
  CUMULUS_CHECK(need <= free_b,
                "method={}: its decoders need {} of device memory beside those of the current method "
                "'{}', the device has {} free of {}",
                method, gib(need), method_, gib(free_b), gib(total_b));
  make_decoders(method, params);  // first: a failure leaves the runner as it was
  for (cuda::DeviceKvCache& kv : kv_)
    for (int s = 0; s < n_seqs_; ++s) {
      kv.truncate(s, prompt_end_);
      kv.reserve(s, capacity_);
    }
  pos_ = prompt_end_;
  summary_ = {};
  stats_acc_.fill_bytes(0);
  last_.clear();
}

void CudaRunner::forward(std::span<const int32_t> tokens, bool decode_mode) {
  const ModelConfig& c = c_;
  const int n = static_cast<int>(tokens.size());
  for (int i = 0; i < n; ++i)
    CUMULUS_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab_size,
                  "token id {} at position {} is outside the vocabulary [0, {})", tokens[i], pos_ + i, c.vocab_size);
  std::memcpy(tok_host_, tokens.data(), n * sizeof(int32_t));
  enqueue_forward(n, decode_mode);
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(st_));
  std::copy_n(logits_host_, c.vocab_size, logits_.begin());
  pos_ += n;
}

void CudaRunner::enqueue_forward(int n, bool decode_mode, bool greedy) {
  const ModelConfig& c = c_;
  const int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
  const float scale = attention_scale(c.head_dim);
  CUMULUS_CUDA_CHECK(cudaMemcpyAsync(tok_.data(), tok_host_, n * sizeof(int32_t), cudaMemcpyHostToDevice, st_));
  float* x = x_.as<float>();
  __half* xn = xn_.as<__half>();
  // One row: q, k, v back to back in q_ (one product), gate and up in gate_; more rows: the
  // separate buffers.
  const bool stacked = n == 1;
  float* q = q_.as<float>();
  float* k = stacked ? q + qd : k_.as<float>();
  float* v = stacked ? q + qd + kvd : v_.as<float>();
  float* gate = gate_.as<float>();
  float* up = stacked ? gate + c.hidden_dim : up_.as<float>();
  __half* att16 = att16_.as<__half>();
  cuda::model::embed(tok_.as<int32_t>(), n, embd_.as<__half>(), c.dim, c.embedding_scale, x, st_);
  // The tuned prefill kernel attends a chunk that starts at a multiple of 64 (the first, and
  // every later chunk of a prompt fed in one prefill call: chunks are multiples of 2048),
  // causal within the chunk, over the keys cached before it; other chunks (a prompt fed in
  // pieces of other sizes) take the rows kernel over the cache.
  const bool prefill_tuned = !decode_mode && plan_ && pos_ % 64 == 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
    cuda::DeviceKvCache& kv = kv_[l];
    cuda::model::rmsnorm(x, L.attn_norm.as<float>(), n, c.dim, c.rms_eps, xn, st_);
    const __half* wqkv = L.wqkv.as<__half>();
    if (stacked) {
      gemm(wqkv, qd + 2 * kvd, c.dim, xn, 1, q, 0.0f);
    } else {
      gemm(wqkv, qd, c.dim, xn, n, q, 0.0f);
      gemm(wqkv + static_cast<size_t>(qd) * c.dim, kvd, c.dim, xn, n, k, 0.0f);
      gemm(wqkv + static_cast<size_t>(qd + kvd) * c.dim, kvd, c.dim, xn, n, v, 0.0f);
    }
    const int32_t* pos0 = kv.view().n_tokens;  // before this layer's append
    // Decode: row i is sequence i at its own position; prefill: rows from sequence 0's.
    cuda::model::rope(q, n, c.n_heads, c.head_dim, c.rope_dim, pos0, decode_mode, c.rope_theta, st_);
    cuda::model::rope(k, n, c.n_kv_heads, c.head_dim, c.rope_dim, pos0, decode_mode, c.rope_theta, st_);
    if (!decode_mode && pq_rows_ > 0) {
      // Keep the queries of positions [pq_end_ - pq_rows_, pq_end_).
      const int first = pq_end_ - pq_rows_, i0 = std::max(0, first - pos_);
      if (i0 < n)
        cuda::memcpy_device_async(pq_.as<float>() + (static_cast<size_t>(l) * pq_rows_ + pos_ + i0 - first) * qd,
                                  q + static_cast<size_t>(i0) * qd, static_cast<size_t>(n - i0) * qd * sizeof(float),
                                  st_);
    }
    kv.append(k, v, decode_mode ? 1 : n, st_);
    auto attend_dense = [&](float* out, float* lse, const int32_t* table = nullptr) {
      cuda::DeviceDecodeArgs a;
      a.kv = kv.view();
      if (table != nullptr) a.kv.page_table = table;  // KvPagePool::stage's
      a.group = c.shape().group();
      a.scale = scale;
      a.q = q;
      a.out = out;
      a.lse = lse;
      cuda::attention_decode(a, *plan_, st_);
    };
    if (decode_mode && dec_[l]) {
      cuda::SparseDecoder& d = *dec_[l];
      d.select(q, st_);
      // The host rows the lists read, copied to the device first (eval mode's dense pass
      // reads every page in place).
      if (pool_ && !opt_.eval)
        d.set_attend_page_table(pool_->stage(kv.view(), d.dense_step() ? nullptr : d.list_idx(), d.list_len(),
                                             d.list_stride(), st_));
      if (opt_.eval) {
        // The dense pass, then the method's attention judged against its log-sum-exp.
        const size_t h0 = static_cast<size_t>(l) * c.n_heads;
        attend_dense(ev_dense_out_.as<float>() + h0 * c.head_dim, ev_dense_lse_.as<float>() + h0);
        d.attend(q, att_.as<float>(), lse_.as<float>(), ev_dense_lse_.as<float>() + h0, ev_mass_.as<float>() + h0,
                 st_);
        cuda::memcpy_device_async(ev_out_.as<float>() + h0 * c.head_dim, att_.data(), qd * sizeof(float), st_);
      } else {
        d.attend(q, att_.as<float>(), lse_.as<float>(), nullptr, nullptr, st_);
      }
      d.accumulate_stats(stats_acc_.as<double>(), st_);
      if (pool_) {  // the pages this step read, for the tier (every page: eval mode's dense pass)
        const bool all = opt_.eval || d.dense_step();
        pool_->mark(kv.view(), all ? nullptr : d.list_idx(), all ? nullptr : d.list_len(), d.list_stride(), st_);
      }
      cuda::model::to_half(att_.as<float>(), static_cast<size_t>(n) * qd, att16, st_);
    } else if (decode_mode && plan_) {
      attend_dense(att_.as<float>(), lse_.as<float>(), pool_ ? pool_->stage(kv.view(), nullptr, nullptr, 0, st_) : nullptr);
      if (pool_) pool_->mark(kv.view(), nullptr, nullptr, 0, st_);
      cuda::model::to_half(att_.as<float>(), static_cast<size_t>(n) * qd, att16, st_);
    } else if (prefill_tuned) {
      cuda::model::to_head_major(q, n, c.n_heads, c.head_dim, qh_.as<__half>(), st_);
      if (pos_ == 0) {
        cuda::model::to_head_major(k, n, c.n_kv_heads, c.head_dim, kh_.as<__half>(), st_);
        cuda::model::to_head_major(v, n, c.n_kv_heads, c.head_dim, vh_.as<__half>(), st_);
      } else {  // the cache holds the earlier chunks and this one
        cuda::model::cache_to_head_major(kv.view(), pos_ + n, kh_.as<__half>(), vh_.as<__half>(), st_);
      }
      cuda::DevicePrefillArgs a;
      a.q = qh_.data();
      a.k = kh_.data();
      a.v = vh_.data();
      a.out = oh_.data();
      a.n = pos_ + n;
      a.q_first = pos_;
      a.n_q_heads = c.n_heads;
      a.n_kv_heads = c.n_kv_heads;
      a.head_dim = c.head_dim;
      a.scale = scale;
      if (pplan_.attention) {
        pplan_.attention->attend(a, st_, prefill_stats_);  // waits for the stream
      } else {
        cuda::attention_prefill_dense(a, st_);
      }
      cuda::model::from_head_major(oh_.as<__half>(), n, c.n_heads, c.head_dim, att16, st_);
    } else {
      cuda::model::attention_rows(kv.view(), n, c.n_heads, scale, q, att16, st_);
    }
    gemm(L.wo.data(), c.dim, qd, att16, n, x, 1.0f);  // x += att Wo^T
    cuda::model::rmsnorm(x, L.ffn_norm.as<float>(), n, c.dim, c.rms_eps, xn, st_);
    const __half* wgu = L.w_gate_up.as<__half>();
    if (stacked) {
      gemm(wgu, 2 * c.hidden_dim, c.dim, xn, 1, gate, 0.0f);
    } else {
      gemm(wgu, c.hidden_dim, c.dim, xn, n, gate, 0.0f);
      gemm(wgu + static_cast<size_t>(c.hidden_dim) * c.dim, c.hidden_dim, c.dim, xn, n, up, 0.0f);
    }
    cuda::model::swiglu(gate, up, static_cast<size_t>(n) * c.hidden_dim, act_.as<__half>(), st_);
    gemm(L.w_down.data(), c.dim, c.hidden_dim, act_.as<__half>(), n, x, 1.0f);  // x += act Wd^T
  }
  // Logits of the last row (a prompt), or of every row (a batch decode step).
  const int out_rows = decode_mode ? n : 1;
  cuda::model::rmsnorm(x + static_cast<size_t>(n - out_rows) * c.dim, out_norm_.as<float>(), out_rows, c.dim,
                       c.rms_eps, xn, st_);
  gemm(c.tied_output ? embd_.data() : out_w_.data(), c.vocab_size, c.dim, xn, out_rows, logits_d_.as<float>(), 0.0f);
  if (greedy) {
    cuda::model::argmax_rows(logits_d_.as<float>(), out_rows, c.vocab_size, ids_.as<int32_t>(), st_);
    CUMULUS_CUDA_CHECK(cudaMemcpyAsync(ids_host_, ids_.data(), out_rows * sizeof(int32_t), cudaMemcpyDeviceToHost, st_));
  } else {
    CUMULUS_CUDA_CHECK(cudaMemcpyAsync(logits_host_, logits_d_.data(),
                                       static_cast<size_t>(c.vocab_size) * sizeof(float), cudaMemcpyDeviceToHost, st_));
  }
}

}  // namespace

namespace {

// Device bytes of the KV caches: every layer's whole cache, or with device_kv_gib the
// device tier and each layer's page tables and counts.
size_t kv_device_bytes(const ModelConfig& c, const SessionOptions& o, int n_seqs) {
  const int ctx = context_of(c, o);
  if (o.device_kv_gib <= 0)
    return c.n_layers *
           cuda::DeviceKvCache::create_bytes(n_seqs, c.n_kv_heads, c.head_dim, o.kv.dtype, o.kv.page_size, ctx);
  const cuda::KvPoolOptions t = tier_options(c, o, n_seqs);
  const size_t tables =
      (static_cast<size_t>(n_seqs) * c.n_kv_heads * ((ctx + t.page_size - 1) / t.page_size) + n_seqs) * sizeof(int32_t);
  // The staging area (rounded up to a granule of K/V pages) and stage()'s table and flags.
  const int64_t kv_granule = cuda::KvPagePool::device_pages_granule(t.head_dim, t.dtype, t.page_size, false);
  const size_t stage = t.stage_pages == 0 ? 0
                                          : cuda::KvPagePool::page_bytes(t.head_dim, t.dtype, t.page_size, false) *
                                                    static_cast<size_t>((t.stage_pages + kv_granule - 1) / kv_granule *
                                                                        kv_granule) +
                                                tables * 5 / 4;
  return cuda::KvPagePool::page_bytes(t.head_dim, t.dtype, t.page_size) * static_cast<size_t>(t.device_pages) +
         cuda::KvPagePool::overhead_bytes(t.device_pages, t.host_pages) + c.n_layers * tables + stage;
}

}  // namespace

size_t cuda_runner_bytes(const ModelConfig& c, const SessionOptions& o, int n_seqs) {
  const int ctx = context_of(c, o);
  const size_t norms = (2 * static_cast<size_t>(c.n_layers) + 1) * c.dim * sizeof(float);
  // Eval mode: the dense pass's outputs and log-sum-exp, the masses and the method's outputs.
  const size_t eval = o.eval ? 2 * static_cast<size_t>(c.n_layers) * c.n_heads * (c.head_dim + 1) * sizeof(float) : 0;
  const cuda::model::CudaPrefillPlan pplan =
      cuda::model::cuda_prefill_plan(cuda::registry_with_gpu(o.registry != nullptr ? *o.registry : Registry::builtin()),
                                     o.prefill_method, o.prefill_params, c.shape(), o.n_threads);
  const size_t kv_all = kv_device_bytes(c, o, n_seqs);
  return weight_elems(c) * 2 + norms + kv_all +
         scratch_bytes(c, std::max(chunk_of(c, o, pplan.attention != nullptr), n_seqs), ctx) +
         cuda::model::cuda_prefill_bytes(pplan, ctx) +
         static_cast<size_t>(n_seqs) * c.vocab_size * sizeof(float) + eval;
}

void cuda_runner_check(const ModelConfig& c, const SessionOptions& o, int n_seqs) {
  CUMULUS_CHECK(n_seqs >= 1, "--device cuda: n_seqs={} must be >= 1", n_seqs);
  // The prefill method and its values first: they need no device, so a bad one is named on
  // any machine.
  const Registry registry = cuda::registry_with_gpu(o.registry != nullptr ? *o.registry : Registry::builtin());
  const cuda::model::CudaPrefillPlan pplan =
      cuda::model::cuda_prefill_plan(registry, o.prefill_method, o.prefill_params, c.shape(), o.n_threads);
  CUMULUS_CHECK(cuda::device_available(),
                "--device cuda: no CUDA device is available (no GPU, or no driver that this build's CUDA runtime can "
                "use)");
  CUMULUS_CHECK(c.architecture == "llama" && !c.rope_neox && !c.qk_norm && !c.post_norms && c.layer_local.empty() &&
                    c.ffn_activation == FfnActivation::silu && c.logit_softcap == 0 && c.attention_scale == 0,
                "--device cuda: architecture '{}' is not yet on cuda (llama only)", c.architecture);
  CUMULUS_CHECK(c.rope_dim == c.head_dim && c.head_dim % 2 == 0 && c.head_dim <= 256,
                "--device cuda: head_dim={} rope_dim={} not supported (even head_dim <= 256, rope_dim == head_dim)",
                c.head_dim, c.rope_dim);
  cuda::model::cuda_decode_method_check(registry, o.method, o.params, c.shape());
  cuda::model::cuda_prefill_device_check(pplan);
  CUMULUS_CHECK(!o.eval || n_seqs == 1, "--device cuda: eval mode (true mass) runs one sequence, not {}", n_seqs);
  CUMULUS_CHECK(o.kv.dtype == DType::f16 || o.kv.dtype == DType::bf16,
                "--device cuda: KV dtype {} is not supported on the GPU (f16, bf16)", dtype_name(o.kv.dtype));
  const int ctx = context_of(c, o);
  CUMULUS_CHECK(o.device_kv_gib >= 0 && std::isfinite(o.device_kv_gib), "--device-kv-gib={} must be >= 0",
                o.device_kv_gib);
  std::string tier;
  if (o.device_kv_gib > 0) {
    CUMULUS_CHECK(cuda::head_dim_supported_cuda(c.head_dim),
                  "--device-kv-gib: the host tier needs head_dim 64, 128 or 256, not {}", c.head_dim);
    const cuda::KvPoolOptions t = tier_options(c, o, n_seqs);
    const size_t page = cuda::KvPagePool::page_bytes(t.head_dim, t.dtype, t.page_size);
    const size_t host_need = page * static_cast<size_t>(t.host_pages), host_free = host_available_bytes();
    tier = fmt::format(" on the device, {} more in pinned host memory", gib(host_need));
    CUMULUS_CHECK(host_free == 0 || host_need <= host_free,
                  "--device-kv-gib={}: a context of {} tokens x {} sequence(s) keeps {} of K/V in pinned host memory "
                  "({} on the device); the host has {} available (MemAvailable)",
                  o.device_kv_gib, ctx, n_seqs, gib(host_need),
                  gib(cuda::KvPagePool::page_bytes(t.head_dim, t.dtype, t.page_size) *
                      static_cast<size_t>(t.device_pages)),
                  gib(host_free));
  }
  const size_t kv_layer = cuda::DeviceKvCache::create_bytes(n_seqs, c.n_kv_heads, c.head_dim, o.kv.dtype,
                                                            o.kv.page_size, ctx);
  size_t free_b = 0, total_b = 0;
  CUMULUS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  // The decode method's buffers (sketch_topp's sketch, tactic's clusters, the lists) grow
  // with the context: measured on one layer's cache, when that cache fits.
  size_t decoders = 0;
  if (o.method != kDenseMethod && kv_layer < free_b) {
    cuda::DeviceKvCache kv = cuda::DeviceKvCache::create(n_seqs, c.n_kv_heads, c.head_dim, o.kv.dtype,
                                                         o.kv.page_size, ctx);
    decoders = cuda::model::cuda_decoder_bytes(registry, o.method, o.params, kv.view(), c.shape());
  }
  const size_t need = cuda_runner_bytes(c, o, n_seqs) + decoders;
  CUMULUS_CHECK(need <= free_b,
                "--device cuda: the model with a context of {} tokens x {} sequence(s) needs {} of device memory "
                "(weights f16 {}, KV cache {}{}, decode method '{}' {}{}), the device has {} free of {}",
                ctx, n_seqs, gib(need), gib(weight_elems(c) * 2),
                gib(kv_device_bytes(c, o, n_seqs)),
                tier, o.method, gib(decoders),
                // a prefill attention (flexprefill's) takes the whole prompt in one forward pass:
                // scratch for the context
                pplan.attention
                    ? fmt::format(", {}'s whole-prompt scratch {}", o.prefill_method,
                                  gib(scratch_bytes(c, ctx, ctx) + cuda::model::cuda_prefill_bytes(pplan, ctx)))
                    : std::string(),
                gib(free_b), gib(total_b));
}

std::vector<std::string> cuda_runner_methods(const ModelConfig& config) {
  std::vector<std::string> out{kDenseMethod};
  const Registry registry = cuda::registry_with_gpu(Registry::builtin());
  for (const auto& m : registry.list()) {
    if (m.kind != MethodKind::decode || m.name == kDenseMethod ||
        !cuda::model::cuda_decode_method_supported(registry, m.name))
      continue;
    try {
      cuda::model::cuda_decode_method_check(registry, m.name, {}, config.shape());
    } catch (const Error&) {
      continue;  // its pipeline does not take this model's shape
    }
    out.push_back(m.name);
  }
  return out;
}

std::unique_ptr<CudaModelRunner> model_runner_cuda(const ModelWeights& weights, const SessionOptions& options) {
  auto r = std::make_unique<CudaRunner>(weights.config, options, 1);
  r->load(weights);
  return r;
}

std::unique_ptr<CudaModelRunner> model_runner_cuda_random(const ModelConfig& config, const SessionOptions& options,
                                                          uint64_t seed, int n_seqs) {
  auto r = std::make_unique<CudaRunner>(config, options, n_seqs);
  r->randomize(seed);
  return r;
}

double cuda_gemm_tflops(int rows, int cols, int n, int iters) {
  CUMULUS_CHECK(rows >= 1 && cols >= 1 && n >= 1 && iters >= 1, "cuda_gemm_tflops: rows={} cols={} n={} iters={}",
                rows, cols, n, iters);
  cuda::Stream stream;
  const cudaStream_t st = cuda::as_stream(stream.handle());
  cublasHandle_t h = nullptr;
  CUMULUS_CUBLAS_CHECK(cublasCreate(&h));
  struct Destroy {
    cublasHandle_t h;
    ~Destroy() { cublasDestroy(h); }
  } destroy{h};
  CUMULUS_CUBLAS_CHECK(cublasSetStream(h, st));
  DeviceBuffer ws(size_t{32} << 20);
  CUMULUS_CUBLAS_CHECK(cublasSetWorkspace(h, ws.data(), ws.size()));
  DeviceBuffer w(static_cast<size_t>(rows) * cols * sizeof(__half)), x(static_cast<size_t>(n) * cols * sizeof(__half)),
      y(static_cast<size_t>(n) * rows * sizeof(float));
  cuda::model::fill_uniform(w.as<__half>(), static_cast<size_t>(rows) * cols, 0.05f, 1, st);
  cuda::model::fill_uniform(x.as<__half>(), static_cast<size_t>(n) * cols, 1.0f, 2, st);
  const float alpha = 1.0f, beta = 0.0f;
  cuda::EventTimer t;
  std::vector<double> ms;
  for (int i = 0; i < iters + 2; ++i) {
    t.start(stream.handle());
    CUMULUS_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &alpha, w.data(), CUDA_R_16F, cols,
                                      x.data(), CUDA_R_16F, cols, &beta, y.data(), CUDA_R_32F, rows, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
    t.stop(stream.handle());
    if (i >= 2) ms.push_back(t.elapsed_ms());
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  return 2.0 * rows * cols * static_cast<double>(n) / (med * 1e-3) / 1e12;
}

double cuda_copy_gbps(size_t bytes) {
  CUMULUS_CHECK(bytes >= (size_t{1} << 20), "cuda_copy_gbps: bytes={} must be at least 1 MiB", bytes);
  cuda::Stream st;
  DeviceBuffer a(bytes), b(bytes);
  cuda::memset_async(a.data(), 1, bytes, st.handle());
  cuda::EventTimer t;
  std::vector<double> g;
  for (int i = 0; i < 23; ++i) {
    t.start(st.handle());
    cuda::memcpy_device_async(b.data(), a.data(), bytes, st.handle());
    t.stop(st.handle());
    const double ms = t.elapsed_ms();
    if (i >= 3) g.push_back(2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
  }
  std::sort(g.begin(), g.end());
  return g[g.size() / 2];
}

std::string cuda_device_summary() {
  if (!cuda::device_available()) return "no CUDA device available";
  const cuda::DeviceInfo d = cuda::device_info();
  return fmt::format("{} (sm_{}{}, {} SMs, {})", d.name, d.cc_major, d.cc_minor, d.sm_count, gib(d.memory_bytes));
}

}  // namespace cumulus
