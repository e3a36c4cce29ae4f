// The registry's GPU pipelines (methods/cuda_methods.h registry_with_gpu): each fused
// method's .cu attaches its own, and each prefill method's .cu its prefill attention; dense
// attention is the runtime's own kernels (no decoder, no prefill attention).
// Methods without a pipeline run on the GPU through their SelectPolicy, if they have one.
#include "cumulus/methods/cuda_methods.h"

namespace cumulus::cuda {

Registry registry_with_gpu(const Registry& base) {
  Registry r = base;
  r.attach_gpu(kDenseMethod, {.make = [](const DeviceKvView&, const Shape&, int, const Params&)
                                  -> std::unique_ptr<SparseDecoder> { return nullptr; },
                              .any_head_dim = true});
  attach_tactic_gpu(r);
  attach_psa_gpu(r);
  attach_lfps_gpu(r);
  attach_sketch_topp_gpu(r);
  r.attach_gpu_prefill(kDenseMethod, {.make = [](const Shape&, const Params&, int)
                                          -> std::unique_ptr<PrefillAttention> { return nullptr; }});
  attach_flexprefill_gpu(r);
  return r;
}

}  // namespace cumulus::cuda
