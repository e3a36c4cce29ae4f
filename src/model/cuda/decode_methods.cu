// The registry's decode methods on the GPU (decode_methods.h). Each GPU pipeline takes the
// CPU method's parameters under the same names; where the GPU pipeline implements less
// (docs/cuda.md "Decode methods in the model runtime"), a non-default value of that
// parameter is refused rather than ignored.
#include <fmt/format.h>

#include "core/check.h"
#include "cumulus/kernels/cuda.h"
#include "decode_methods.h"
#include "core/cuda/cuda_util.cuh"

namespace cumulus::cuda::model {
namespace {

// A method runs on the GPU through its own pipeline (MethodInfo::gpu, attached by
// cuda::registry_with_gpu) or through its SelectPolicy.
bool on_gpu(const MethodInfo& m) { return m.gpu.make != nullptr || m.make_policy != nullptr; }

}  // namespace

bool cuda_decode_method_supported(const Registry& registry, const std::string& method) {
  const MethodInfo* m = registry.find_if_known(method);
  return m != nullptr && on_gpu(*m);
}

std::string cuda_decode_method_names(const Registry& registry) {
  std::string s;
  for (const MethodInfo& m : registry.list())
    if (on_gpu(m)) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

void cuda_decode_method_check(const Registry& registry, const std::string& method,
                              const std::map<std::string, std::string>& params, const Shape& shape) {
  const MethodInfo& info = registry.find(method);  // unknown: Error listing the known ones
  CUMULUS_CHECK(info.make_decode != nullptr, "--device cuda: '{}' is not a decode method", method);
  CUMULUS_CHECK(on_gpu(info), "--device cuda: decode method '{}' is not yet on cuda (on cuda: {})", method,
                cuda_decode_method_names(registry));
  CUMULUS_CHECK(info.gpu.any_head_dim || head_dim_supported_cuda(shape.head_dim),
                "--device cuda: decode method '{}' needs head_dim 64, 128 or 256 on the GPU, not {}", method,
                shape.head_dim);
  (void)registry.make(method, shape, params);  // the CPU method's checks of every value
  if (info.gpu.check != nullptr) info.gpu.check(shape, registry.parse(method, params));
}

CudaDecodePlan cuda_decode_plan(const Registry& registry, const std::string& method,
                                const std::map<std::string, std::string>& params) {
  CudaDecodePlan plan;
  const MethodInfo& info = registry.find(method);
  if (info.gpu.reindex_interval != nullptr) plan.recluster_interval = info.gpu.reindex_interval(registry.parse(method, params));
  return plan;
}

size_t cuda_decoder_bytes(const Registry& registry, const std::string& method,
                          const std::map<std::string, std::string>& params, const DeviceKvView& kv,
                          const Shape& shape) {
  // The layers that get a decoder, and one of them to measure.
  int layers = shape.n_layers, measured = shape.n_layers - 1;
  if (const MethodInfo& m = registry.find(method); m.gpu.make == nullptr && m.make_policy != nullptr) {
    const std::shared_ptr<const SelectPolicy> policy = m.make_policy(shape, registry.parse(method, params));
    layers = 0;
    for (int l = shape.n_layers - 1; l >= 0; --l) {
      if (policy->dense_layer(l)) continue;
      ++layers;
      measured = l;
    }
  }
  if (layers == 0) return 0;
  size_t free0 = 0, free1 = 0, total = 0;
  CUMULUS_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
  const std::unique_ptr<SparseDecoder> d = make_cuda_decoder(registry, method, params, kv, shape, measured);
  if (d == nullptr) return 0;  // dense attention: no decoder
  CUMULUS_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
  return free0 > free1 ? (free0 - free1) * layers : 0;
}

std::unique_ptr<SparseDecoder> make_cuda_decoder(const Registry& registry, const std::string& method,
                                                 const std::map<std::string, std::string>& params,
                                                 const DeviceKvView& kv, const Shape& shape, int layer) {
  const MethodInfo& info = registry.find(method);
  if (info.gpu.make != nullptr) return info.gpu.make(kv, shape, layer, registry.parse(method, params));
  if (info.make_policy != nullptr) {
    std::shared_ptr<const SelectPolicy> policy = registry.make_policy(method, shape, params);
    if (policy->dense_layer(layer)) return nullptr;
    return make_ops_gpu(kv, shape.group(), method, policy_step(std::move(policy), layer));
  }
  CUMULUS_FAIL("--device cuda: decode method '{}' is not yet on cuda (on cuda: {})", method,
               cuda_decode_method_names(registry));
}

std::unique_ptr<SparseDecoder> make_policy_decoder(const Registry& registry, const std::string& method,
                                                   const std::map<std::string, std::string>& params,
                                                   const DeviceKvView& kv, const Shape& shape, int layer,
                                                   const AttentionPlanOptions& plan) {
  return make_ops_gpu(kv, shape.group(), method, policy_step(registry.make_policy(method, shape, params), layer), plan);
}

}  // namespace cumulus::cuda::model
