// The prefill methods of the CUDA runtime: dense (attention_prefill_dense)
// and flexprefill (FlexPrefillProbe on the device, the CPU method's block selection on the
// host, attention_prefill_block_sparse), read from the registry's name and parameters as the
// CPU Session reads them (methods/flexprefill.h), so `--prefill flexprefill
// --prefill-param gamma=0.95` means the same on either device. Checked before any work: an
// unknown method or parameter, a bad value (the CPU method's own checks run), a method not on
// the GPU, or a value the GPU cannot honour is an Error naming it.
#pragma once

#include <cstddef>
#include <map>
#include <string>

#include "cumulus/core/shape.h"
#include "cumulus/methods/registry.h"
#include "cumulus/kernels/flexprefill_select.h"

namespace cumulus::cuda::model {

struct CudaPrefillPlan {
  bool flexprefill = false;    // else dense
  flexprefill::Config config;  // flexprefill's selection
};

// Throws Error as above (the GPU's limits: head_dim 64, 128 or 256; block_size a multiple of
// 64; chunk=0, the whole prompt in one forward pass). Touches no device.
CudaPrefillPlan cuda_prefill_plan(const Registry& registry, const std::string& method,
                                  const std::map<std::string, std::string>& params, const Shape& shape);
// Throws Error when flexprefill's probe rows (block_size of them) do not fit the current
// device's shared memory, naming block_size and the most rows that fit.
void cuda_prefill_device_check(const CudaPrefillPlan& plan, const Shape& shape);
// Device memory a prefill of n tokens needs besides the runner's scratch (flexprefill's probe
// and the largest block layout; 0 for dense).
size_t cuda_prefill_bytes(const CudaPrefillPlan& plan, const Shape& shape, int n);

}  // namespace cumulus::cuda::model
