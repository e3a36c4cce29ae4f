// flexprefill on the GPU (FlexPrefill, "Query-Aware Sparse Pattern Determination" and
// "Cumulative-Attention Based Index Selection"; the CPU method is flexprefill.cpp): per layer
// of the prompt, the probe on the device (FlexPrefillProbe), the CPU method's block selection
// on the host (flexprefill::select_head through cuda::flexprefill_select), the block-sparse
// kernel (attention_prefill_block_sparse). Its parameters are the CPU method's, read by the
// same struct (FlexPrefillOptions, methods/flexprefill.h); what the GPU kernels cannot
// take (docs/cuda.md "Model runtime", docs/methods.md "flexprefill") is refused with the value
// rather than changed.
#include <chrono>
#include <memory>

#include "core/check.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_prefill.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/flexprefill.h"
#include "kernels/cuda/cuda_internal.cuh"

namespace cumulus::cuda {
namespace {

// The GPU's limits (the CPU method's own checks have run): head_dim 64, 128 or 256; the whole
// prompt in one forward pass (chunk=0); block_size a multiple of 64 (the kernel's key tile).
void flexprefill_gpu_check(const Shape& shape, const Params& params) {
  const FlexPrefillOptions o = options_read<FlexPrefillOptions>(params);
  CUMULUS_CHECK(head_dim_supported_cuda(shape.head_dim),
                "--device cuda: prefill method 'flexprefill' needs head_dim 64, 128 or 256 on the GPU, not {}",
                shape.head_dim);
  CUMULUS_CHECK(o.chunk == 0,
                "--device cuda: flexprefill chunk={} is not on cuda (the GPU prefills the whole prompt in one forward "
                "pass: chunk=0)",
                o.chunk);
  const int b = o.config.block_size;
  CUMULUS_CHECK(b % 64 == 0,
                "--device cuda: flexprefill block_size={} is not on cuda (the GPU's block-sparse kernel takes "
                "multiples of 64)",
                b);
}

class FlexPrefillGpu final : public PrefillAttention {
 public:
  FlexPrefillGpu(const Shape& shape, const flexprefill::Config& cfg, int n_threads)
      : shape_(shape), cfg_(cfg), n_threads_(n_threads) {}

  size_t device_bytes(int n) const override {
    // The probe, and the layout at its largest: every causal block of every query head (int32
    // entries and offsets).
    const size_t nb = (n + cfg_.block_size - 1) / cfg_.block_size, nq = shape_.n_q_heads;
    return FlexPrefillProbe::device_bytes(n, shape_.n_q_heads, shape_.n_kv_heads, shape_.head_dim, cfg_.block_size) +
           4 * (nq * nb * (nb + 1) / 2 + nq * nb + 1);
  }

  void device_check() const override {
    // The probe holds min(block_size, n) rows in shared memory: a block_size whose full rows do
    // not fit is refused whatever the prompt's length.
    const int b = cfg_.block_size, max_rows = FlexPrefillProbe::max_rows(shape_.head_dim);
    CUMULUS_CHECK(b <= max_rows,
                  "--device cuda: flexprefill block_size={} is not on this GPU (its probe keeps block_size rows of "
                  "head_dim {} in shared memory: at most {} rows fit)",
                  b, shape_.head_dim, max_rows);
  }

  void begin(int n) override {
    if (!pool_) pool_ = std::make_unique<ThreadPool>(n_threads_);
    probe_ = std::make_unique<FlexPrefillProbe>(n, shape_.n_q_heads, shape_.n_kv_heads, shape_.head_dim,
                                                cfg_.block_size);
  }

  // Waits for the stream: the selection needs the probe, the statistics the kernel's time.
  void attend(const DevicePrefillArgs& a, void* stream, PrefillStats& stats) override {
    using clock = std::chrono::steady_clock;
    const cudaStream_t st = as_stream(stream);
    const flexprefill::Geometry g{0, a.n, cfg_.block_size};
    CUMULUS_CUDA_CHECK(cudaStreamSynchronize(st));  // the layer's products and RoPE: the clock times the selection
    const auto t0 = clock::now();
    // Every causal block without a probe (gamma = 1, a short prompt, a budget covering all):
    // flexprefill_select reads nothing of the probe then.
    if (!flexprefill::selects_everything(cfg_, g)) {
      probe_->run(a, stream);
      probe_->download(stream);
    }
    std::vector<flexprefill::HeadSelection> heads;
    const BlockSparseLayout layout = flexprefill_select(cfg_, *probe_, *pool_, &heads);
    const DeviceBlockLayout device_layout = DeviceBlockLayout::upload(layout, a.n);
    const auto t1 = clock::now();
    attention_prefill_block_sparse(a, device_layout, stream);
    CUMULUS_CUDA_CHECK(cudaStreamSynchronize(st));  // the kernel's time, and device_layout outlives it
    const auto t2 = clock::now();
    flexprefill_stats_add(stats, g, layout, heads);
    stats.select_seconds += std::chrono::duration<double>(t1 - t0).count();
    stats.attention_seconds += std::chrono::duration<double>(t2 - t1).count();
  }

  void end() override { probe_.reset(); }

 private:
  Shape shape_;
  flexprefill::Config cfg_;
  int n_threads_ = 1;
  std::unique_ptr<ThreadPool> pool_;         // the host selection's threads
  std::unique_ptr<FlexPrefillProbe> probe_;  // for the prompt being prefilled
};

}  // namespace

void attach_flexprefill_gpu(Registry& r) {
  r.attach_gpu_prefill("flexprefill",
                       {.make = [](const Shape& shape, const Params& p, int n_threads) -> std::unique_ptr<PrefillAttention> {
                          return std::make_unique<FlexPrefillGpu>(shape, options_read<FlexPrefillOptions>(p).config, n_threads);
                        },
                        .check = flexprefill_gpu_check});
}

}  // namespace cumulus::cuda
