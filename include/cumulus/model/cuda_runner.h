// The model runtime on the GPU (src/model/cuda, docs/cuda.md "Model runtime"): a Llama
// forward pass with the weights on the device in f16, cuBLAS for the products, the KV cache
// of every layer in a DeviceKvCache filled on the device, and decode attention through the
// session's decode method: dense, a fused GPU pipeline (sketch_topp, tactic, psa;
// methods/cuda_methods.h) or a method defined over the selection ops (quest, oracle_topp,
// oracle_topk, streaming; methods/policy.h), built from the registry's parameters
// (src/model/cuda/decode_methods.h), and prefill attention dense or a prefill method's own
// (MethodInfo::gpu_prefill: flexprefill; src/model/cuda/prefill_methods.h; prefill_stats()
// as the CPU method's). In eval mode
// (SessionOptions::eval) each step also runs the dense pass and fills last_step() with each
// head's true mass, as the CPU does. Built only with
// CUMULUS_CUDA=ON (the library cumulus_model_cuda); plain C++, no CUDA type in sight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>
#include <string>

#include "cumulus/model/model_weights.h"
#include "cumulus/kv/cuda_kv_pool.h"
#include "cumulus/model/runner.h"
#include "cumulus/model/session.h"

namespace cumulus {

// Device memory a CUDA runner of this model and these options needs: weights (f16), the KV
// cache of every layer for the context (SessionOptions::max_tokens, 0 = the model's), and
// the scratch of a prefill chunk (flexprefill: of the whole context, and its probe).
// n_seqs sequences (model_runner_cuda_random's batch) hold a cache each.
size_t cuda_runner_bytes(const ModelConfig& config, const SessionOptions& options, int n_seqs = 1);

// Throws Error naming the reason when a CUDA runner cannot run this model with these options:
// a prefill method without a GPU prefill (MethodInfo::gpu_prefill: dense, flexprefill), or a
// flexprefill value the GPU cannot honour (chunk other than 0, block_size not a multiple of 64 or too large for the probe's
// shared memory, head_dim other than 64/128/256; checked first, before the device is
// touched, but for the shared memory); no CUDA device; an architecture or feature not on the
// GPU yet (gemma3); a decode method not on the GPU or a parameter value its GPU pipeline does
// not implement ("not yet on cuda"); eval mode with more than one sequence; a KV dtype other
// than f16/bf16; or a context whose memory (cuda_runner_bytes, plus the decode method's
// buffers, measured by making one layer's decoder) exceeds the device's free memory (the
// error gives both). Reads no weights: commands call it before loading the model.
void cuda_runner_check(const ModelConfig& config, const SessionOptions& options, int n_seqs = 1);

// The CUDA runner's extras for benchmarks (bench/cuda_model_bench.cpp).
class CudaModelRunner : public ModelRunner {
 public:
  // Takes the place of a prefill: every layer's cache gets n tokens of random K/V for every
  // sequence (appended on the device in chunks, as a prefill appends them); the logits stay
  // unset. Position 0 only.
  virtual void fill_random_context(int n, uint64_t seed) = 0;
  // One decode step of every sequence of the batch: tokens [n_seqs] in, the greedy next
  // token of each out (argmax on the device; only n_seqs ids come back). A CUDA graph as
  // decode(). decode() itself needs a batch of one.
  virtual std::vector<int32_t> decode_batch(std::span<const int32_t> tokens) = 0;
  virtual int n_seqs() const = 0;
  // Bytes of the weights a decode step reads (every layer matrix and the classifier) and of
  // K/V per cached token (all layers).
  virtual size_t decode_weight_bytes() const = 0;
  virtual size_t kv_bytes_per_token() const = 0;
  // The host tier's sums over decode steps (SessionOptions::device_kv_gib; zeros without it).
  virtual cuda::TierStats tier_totals() const = 0;
};

// The decode methods the CUDA runner runs for this model at their defaults: "dense" and the
// registry's methods whose GPU decoder (methods/cuda_methods.h, methods/policy.h) takes the model's shape
// (head_dim 64/128/256; sketch_topp's group), in the registry's order.
std::vector<std::string> cuda_runner_methods(const ModelConfig& config);

// The runner (cuda_runner_check first). Matrices of any storage (F32, F16, BF16, the block
// formats) are dequantised on the host and converted to f16; nothing of `weights` is kept.
std::unique_ptr<CudaModelRunner> model_runner_cuda(const ModelWeights& weights, const SessionOptions& options);
// A runner of `config` with random f16 weights made on the device (uniform, variance
// 1 / cols per matrix; norms 1) for a batch of n_seqs sequences: benchmarks of models too
// large to hold on the host.
std::unique_ptr<CudaModelRunner> model_runner_cuda_random(const ModelConfig& config, const SessionOptions& options,
                                                          uint64_t seed, int n_seqs = 1);

// cuBLAS's rate on the runner's product, y [n][rows] f32 = x [n][cols] f16 W^T (W f16
// [rows][cols]), in TFLOP/s (2 rows cols n per product): the median of `iters` timed
// products after 2 warm-ups, on random data (benchmarks: the GEMM rate a prefill is judged
// against).
double cuda_gemm_tflops(int rows, int cols, int n, int iters = 10);

// Device-to-device copy bandwidth in GB/s, read + write bytes counted: the median of 20
// copies of `bytes` after 3 warm-ups (benchmarks: the bandwidth a decode step is judged
// against).
double cuda_copy_gbps(size_t bytes = size_t{1} << 30);

// "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.2 GiB)" or the reason there is none.
std::string cuda_device_summary();

}  // namespace cumulus
