// The registry's prefill methods on the GPU (prefill_methods.h). flexprefill's parameters are
// the CPU method's, read into the same struct (FlexPrefillOptions, methods/flexprefill.h); what the
// GPU kernels cannot take (docs/cuda.md "Model runtime", docs/methods.md "flexprefill") is
// refused with the value rather than changed.
#include <fmt/format.h>

#include "core/check.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_prefill.h"
#include "cumulus/methods/flexprefill.h"
#include "prefill_methods.h"

namespace cumulus::cuda::model {

CudaPrefillPlan cuda_prefill_plan(const Registry& registry, const std::string& method,
                                  const std::map<std::string, std::string>& params, const Shape& shape) {
  const MethodInfo& info = registry.find(method);  // unknown: Error listing the known ones
  CUMULUS_CHECK(info.make_prefill != nullptr, "--device cuda: '{}' is not a prefill method", method);
  CUMULUS_CHECK(method == kDenseMethod || method == "flexprefill",
                "--device cuda: prefill method '{}' is not yet on cuda (on cuda: dense, flexprefill)", method);
  (void)registry.make_prefill(method, shape, params);  // the CPU method's checks of every value
  CudaPrefillPlan plan;
  if (method == kDenseMethod) return plan;
  const FlexPrefillOptions o = options_read<FlexPrefillOptions>(registry.parse(method, params));
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
  plan.flexprefill = true;
  plan.config = o.config;
  return plan;
}

void cuda_prefill_device_check(const CudaPrefillPlan& plan, const Shape& shape) {
  if (!plan.flexprefill) return;
  // The probe holds min(block_size, n) rows in shared memory: a block_size whose full rows do
  // not fit is refused whatever the prompt's length.
  const int b = plan.config.block_size, max_rows = FlexPrefillProbe::max_rows(shape.head_dim);
  CUMULUS_CHECK(b <= max_rows,
                "--device cuda: flexprefill block_size={} is not on this GPU (its probe keeps block_size rows of "
                "head_dim {} in shared memory: at most {} rows fit)",
                b, shape.head_dim, max_rows);
}

size_t cuda_prefill_bytes(const CudaPrefillPlan& plan, const Shape& shape, int n) {
  if (!plan.flexprefill) return 0;
  // The probe, and the layout at its largest: every causal block of every query head (int32
  // entries and offsets).
  const size_t nb = (n + plan.config.block_size - 1) / plan.config.block_size, nq = shape.n_q_heads;
  return FlexPrefillProbe::device_bytes(n, shape.n_q_heads, shape.n_kv_heads, shape.head_dim,
                                        plan.config.block_size) +
         4 * (nq * nb * (nb + 1) / 2 + nq * nb + 1);
}

}  // namespace cumulus::cuda::model
