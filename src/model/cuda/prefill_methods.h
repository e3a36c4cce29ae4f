// The prefill methods of the CUDA runtime: the registry's methods with a GPU prefill
// attention (MethodInfo::gpu_prefill, attached by cuda::registry_with_gpu: dense, the
// runtime's own kernels; flexprefill, src/methods/flexprefill/flexprefill.cu), built from the
// registry's name and parameters as the CPU Session builds them, so `--prefill flexprefill
// --prefill-param gamma=0.95` means the same on either device. Checked before any work: an
// unknown method or parameter, a bad value (the CPU method's own checks run), a method not on
// the GPU, or a value the GPU cannot honour is an Error naming it.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>

#include "cumulus/core/shape.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/registry.h"

namespace cumulus::cuda::model {

// The prefill methods the CUDA runtime runs (those of `registry` with a GPU prefill).
std::string cuda_prefill_method_names(const Registry& registry);

struct CudaPrefillPlan {
  // The method's attention (nullptr: dense, the runtime's kernels, in chunks); when set the
  // runtime prefills the whole prompt in one forward pass from position 0.
  std::unique_ptr<PrefillAttention> attention;
};

// Throws Error as above (`registry` with the GPU prefills attached). Touches no device;
// n_threads: the threads of a method's host work (SessionOptions::n_threads).
CudaPrefillPlan cuda_prefill_plan(const Registry& registry, const std::string& method,
                                  const std::map<std::string, std::string>& params, const Shape& shape,
                                  int n_threads);
// Throws Error when the method's attention does not fit the current device (flexprefill: its
// probe rows in shared memory), naming the value.
void cuda_prefill_device_check(const CudaPrefillPlan& plan);
// Device memory a prefill of n tokens needs besides the runner's scratch (0 for dense).
size_t cuda_prefill_bytes(const CudaPrefillPlan& plan, int n);

}  // namespace cumulus::cuda::model
