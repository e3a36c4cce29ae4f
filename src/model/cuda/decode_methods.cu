// The registry's decode methods on the GPU (decode_methods.h). Each GPU pipeline takes the
// CPU method's parameters under the same names; where the GPU pipeline implements less
// (docs/cuda.md "Decode methods in the model runtime"), a non-default value of that
// parameter is refused rather than ignored.
#include <fmt/format.h>

#include "core/check.h"
#include "cumulus/kernels/cuda.h"
#include "decode_methods.h"
#include "kernels/cuda/cuda_util.cuh"
#include "methods/method_options.h"

namespace cumulus::cuda::model {
namespace {

// The methods with a fused GPU pipeline of their own (methods/cuda_methods.h).
const char* const kFusedMethods[] = {"dense", "sketch_topp", "tactic", "psa", "lfps"};

}  // namespace

bool cuda_decode_method_supported(const Registry& registry, const std::string& method) {
  for (const char* m : kFusedMethods)
    if (method == m) return true;
  for (const MethodInfo& m : registry.list())
    if (m.name == method) return m.make_policy != nullptr;
  return false;
}

std::string cuda_decode_method_names(const Registry& registry) {
  std::string s;
  for (const char* m : kFusedMethods) s += (s.empty() ? "" : ", ") + std::string(m);
  for (const MethodInfo& m : registry.list())
    if (m.make_policy != nullptr) s += ", " + m.name;
  return s;
}

void cuda_decode_method_check(const Registry& registry, const std::string& method,
                              const std::map<std::string, std::string>& params, const Shape& shape) {
  const MethodInfo& info = registry.find(method);  // unknown: Error listing the known ones
  CUMULUS_CHECK(info.make_decode != nullptr, "--device cuda: '{}' is not a decode method", method);
  CUMULUS_CHECK(cuda_decode_method_supported(registry, method),
                "--device cuda: decode method '{}' is not yet on cuda (on cuda: {})", method,
                cuda_decode_method_names(registry));
  CUMULUS_CHECK(method == "dense" || head_dim_supported_cuda(shape.head_dim),
                "--device cuda: decode method '{}' needs head_dim 64, 128 or 256 on the GPU, not {}", method,
                shape.head_dim);
  (void)registry.make(method, shape, params);  // the CPU method's checks of every value
  const Params p = registry.parse(method, params);
  if (method == "sketch_topp") {
    CUMULUS_CHECK(shape.group() <= kSketchToppMaxGroup,
                  "--device cuda: sketch_topp takes at most {} query heads per kv head on the GPU, this model has {}",
                  kSketchToppMaxGroup, shape.group());
  } else if (method == "tactic") {
    CUMULUS_CHECK(p.get_string("mode") == "fit",
                  "--device cuda: tactic mode='{}' is not on cuda (the GPU pipeline implements mode=fit)",
                  p.get_string("mode"));
  } else if (method == "psa") {
    CUMULUS_CHECK(p.get_string("stop") == "estimate",
                  "--device cuda: psa stop='{}' is not on cuda (the GPU pipeline implements stop=estimate)",
                  p.get_string("stop"));
  }
}

CudaDecodePlan cuda_decode_plan(const Registry& registry, const std::string& method,
                                const std::map<std::string, std::string>& params) {
  CudaDecodePlan plan;
  if (method == "dense") return plan;
  const Params p = registry.parse(method, params);
  if (method == "tactic") plan.recluster_interval = p.get_int("recluster_interval");
  return plan;
}

size_t cuda_decoder_bytes(const Registry& registry, const std::string& method,
                          const std::map<std::string, std::string>& params, const DeviceKvView& kv,
                          const Shape& shape) {
  if (method == "dense") return 0;
  // The layers that get a decoder, and one of them to measure.
  int layers = shape.n_layers, measured = shape.n_layers - 1;
  if (const MethodInfo& m = registry.find(method); m.make_policy != nullptr) {
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
  CUMULUS_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
  return free0 > free1 ? (free0 - free1) * layers : 0;
}

std::unique_ptr<SparseDecoder> make_cuda_decoder(const Registry& registry, const std::string& method,
                                                 const std::map<std::string, std::string>& params,
                                                 const DeviceKvView& kv, const Shape& shape, int layer) {
  if (method == "dense") return nullptr;
  const int group = shape.group();
  const Params p = registry.parse(method, params);
  if (method == "sketch_topp") {
    SketchToppGpuOptions o;
    methods::read_sketch_topp_options(p, o);
    o.dense_kv_bytes = static_cast<size_t>(p.get_int("gpu_dense_mib")) << 20;
    return make_sketch_topp_gpu(kv, group, o);
  }
  if (method == "tactic") {
    TacticGpuOptions o;
    methods::read_tactic_options(p, o);
    o.layer = layer;
    return make_tactic_gpu(kv, group, o);
  }
  if (method == "psa") {
    PsaGpuOptions o;
    o.threshold = p.get_double("threshold");
    o.microbatch = p.get_int("microbatch");
    o.criticality = p.get_string("criticality") == "mean" ? PageScoreKind::kMean : PageScoreKind::kBound;
    return make_psa_gpu(kv, group, o);
  }
  if (method == "lfps") return make_lfps_gpu(kv, group, methods::read_lfps_options(p));
  if (registry.find(method).make_policy != nullptr) {
    std::shared_ptr<const SelectPolicy> policy = registry.make_policy(method, shape, params);
    if (policy->dense_layer(layer)) return nullptr;
    return make_ops_gpu(kv, group, method, policy_step(std::move(policy), layer));
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
