// The registry's prefill methods on the GPU (prefill_methods.h). Each method's GPU limits are
// its own (GpuPrefill::check, beside its pipeline in src/methods/<name>/<name>.cu); this file
// knows no method by name.
#include <fmt/format.h>

#include "core/check.h"
#include "cumulus/core/error.h"
#include "prefill_methods.h"

namespace cumulus::cuda::model {

std::string cuda_prefill_method_names(const Registry& registry) {
  std::string s;
  for (const MethodInfo& m : registry.list())
    if (m.gpu_prefill.make != nullptr) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

CudaPrefillPlan cuda_prefill_plan(const Registry& registry, const std::string& method,
                                  const std::map<std::string, std::string>& params, const Shape& shape,
                                  int n_threads) {
  const MethodInfo& info = registry.find(method);  // unknown: Error listing the known ones
  CUMULUS_CHECK(info.make_prefill != nullptr, "--device cuda: '{}' is not a prefill method", method);
  CUMULUS_CHECK(info.gpu_prefill.make != nullptr, "--device cuda: prefill method '{}' is not yet on cuda (on cuda: {})",
                method, cuda_prefill_method_names(registry));
  (void)registry.make_prefill(method, shape, params);  // the CPU method's checks of every value
  const Params p = registry.parse(method, params);
  if (info.gpu_prefill.check != nullptr) info.gpu_prefill.check(shape, p);
  CudaPrefillPlan plan;
  plan.attention = info.gpu_prefill.make(shape, p, n_threads);
  return plan;
}

void cuda_prefill_device_check(const CudaPrefillPlan& plan) {
  if (plan.attention) plan.attention->device_check();
}

size_t cuda_prefill_bytes(const CudaPrefillPlan& plan, int n) {
  return plan.attention ? plan.attention->device_bytes(n) : 0;
}

}  // namespace cumulus::cuda::model
