// The decode methods of the CUDA runtime: the registry's methods whose GPU
// pipelines exist (methods/cuda_methods.h) and those defined once over the selection ops
// (methods/policy.h, run by cuda::make_ops_gpu), built from the registry's parameters, so a name
// and its key=value parameters mean the same on either device. Checked before any work: an
// unknown method or parameter, a bad value (the CPU method's own checks run), a method not
// on the GPU, or a parameter value the GPU pipeline does not implement is an Error naming it.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "cumulus/core/shape.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/registry.h"

namespace cumulus::cuda::model {

// The decode methods the CUDA runtime runs: "dense", the fused GPU pipelines, and every
// method of `registry` defined once over the selection ops (MethodInfo::make_policy).
std::string cuda_decode_method_names(const Registry& registry);
bool cuda_decode_method_supported(const Registry& registry, const std::string& method);

// Throws Error as above. `shape` is the model's (the CPU method is constructed once to run
// its parameter checks).
void cuda_decode_method_check(const Registry& registry, const std::string& method,
                              const std::map<std::string, std::string>& params, const Shape& shape);

// What a method needs from the runtime besides its decoder.
struct CudaDecodePlan {
  int recluster_interval = 0;  // tactic: decoded tokens after which the cache is clustered again (0: never)
};
CudaDecodePlan cuda_decode_plan(const Registry& registry, const std::string& method,
                                const std::map<std::string, std::string>& params);

// Device memory the method's decoders take in a model of n_layers layers whose caches are
// like `kv` (every sequence at the view's max_tokens): measured, by making the decoder of
// the last layer over `kv` and reading the device's free memory before and after (the
// pipelines size their buffers at construction), times the layers that get one (a policy's
// dense layers, as quest's dense_layers, get none); 0 for dense.
size_t cuda_decoder_bytes(const Registry& registry, const std::string& method,
                          const std::map<std::string, std::string>& params, const cuda::DeviceKvView& kv,
                          const Shape& shape);

// The decoder of one layer of a model of `shape` (nullptr: dense attention, for "dense" and
// a policy's dense layers, as quest's dense_layers).
std::unique_ptr<cuda::SparseDecoder> make_cuda_decoder(const Registry& registry, const std::string& method,
                                                       const std::map<std::string, std::string>& params,
                                                       const cuda::DeviceKvView& kv, const Shape& shape, int layer);

// The GPU decoder of a method defined over the selection ops (MethodInfo::make_policy), for
// one layer, with its registry parameters (Error for another method): cuda::make_ops_gpu
// running the policy's step. Benchmarks and tests pass their own attention plan options.
std::unique_ptr<cuda::SparseDecoder> make_policy_decoder(const Registry& registry, const std::string& method,
                                                         const std::map<std::string, std::string>& params,
                                                         const cuda::DeviceKvView& kv, const Shape& shape, int layer,
                                                         const cuda::AttentionPlanOptions& plan = {});

}  // namespace cumulus::cuda::model
