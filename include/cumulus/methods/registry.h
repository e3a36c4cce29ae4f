// Method registry: every method registers its name, kind, paper and typed parameters with
// the paper's defaults. `cumulus methods` prints it; the CLI and harness build methods by
// name with key=value parameters checked against the spec.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cumulus/core/shape.h"
#include "cumulus/methods/method.h"
#include "cumulus/methods/options.h"
#include "cumulus/methods/policy.h"
#include "cumulus/methods/prefill.h"

namespace cumulus {

namespace cuda {
class SparseDecoder;     // kernels/cuda_decoder.h
struct DeviceKvView;     // kernels/cuda.h
class PrefillAttention;  // methods/cuda_methods.h
}  // namespace cuda

// A method's own GPU pipeline (methods/cuda_methods.h), which its src/methods/<name>/<name>.cu
// attaches (cuda::registry_with_gpu, a CUDA build only). Methods without one run on the GPU
// through their SelectPolicy (make_policy), if they have one.
struct GpuPipeline {
  // The decoder of one layer of a model of `shape`, over that layer's device cache (nullptr:
  // dense attention).
  std::function<std::unique_ptr<cuda::SparseDecoder>(const cuda::DeviceKvView& kv, const Shape& shape, int layer,
                                                     const Params& params)>
      make = nullptr;
  // Refuses, before any work, a shape or parameter value the pipeline does not implement
  // (Error naming it); the CPU method's own checks run besides.
  std::function<void(const Shape& shape, const Params& params)> check = nullptr;
  // Decoded tokens after which the runtime rebuilds the method's index (tactic's
  // re-clustering); 0: never.
  std::function<int(const Params& params)> reindex_interval = nullptr;
  // Takes any head_dim (dense attention); the selection pipelines take 64, 128 or 256.
  bool any_head_dim = false;
};

// A prefill method's attention on the GPU (cuda::PrefillAttention, methods/cuda_methods.h),
// which its .cu attaches (cuda::registry_with_gpu, a CUDA build only); a prefill method
// without one does not run on the GPU.
struct GpuPrefill {
  // The attention of a model of `shape` (nullptr: the runtime's dense kernels); touches no
  // device until a prompt begins.
  std::function<std::unique_ptr<cuda::PrefillAttention>(const Shape& shape, const Params& params, int n_threads)>
      make = nullptr;
  // Refuses, before any work and reading no device, a shape or parameter value the GPU does
  // not implement (Error naming it); the CPU method's own checks run besides.
  std::function<void(const Shape& shape, const Params& params)> check = nullptr;
};

// The reference every comparison is made against: dense attention, a decode and a prefill
// method of the registry. Code outside the registry names it through this constant.
inline constexpr const char* kDenseMethod = "dense";

// What a method does: decode steps, prefill chunks, or both (dense). Registry::add checks it
// against the factories given.
enum class MethodKind { decode, prefill, decode_and_prefill };
const char* method_kind_name(MethodKind kind);  // "decode", "prefill", "decode, prefill"
inline bool method_kind_decodes(MethodKind k) { return k != MethodKind::prefill; }

struct MethodInfo {
  std::string name;
  MethodKind kind = MethodKind::decode;
  std::string paper;  // where it comes from
  std::string summary;
  // Its parameters, generated from its options struct (options_params, methods/options.h).
  std::vector<ParamSpec> params;
  std::function<std::unique_ptr<DecodeMethod>(const Shape&, const Params&)> make_decode = nullptr;    // decode
  std::function<std::unique_ptr<PrefillMethod>(const Shape&, const Params&)> make_prefill = nullptr;  // prefill
  // A decode method defined once over the selection ops (methods/policy.h): every backend
  // runs this definition, and make_decode, when not set, is its CPU adapter.
  std::function<std::shared_ptr<const SelectPolicy>(const Shape&, const Params&)> make_policy = nullptr;
  // What the method's constructor refuses beyond each value's range: relations between
  // parameters (tactic's p1 < p2) and, given the model's shape, those that need it (quest's
  // dense_layers within the model's layers); an Error naming them. Builds nothing
  // (options_check, methods/options.h); nullptr: nothing beyond the ranges.
  std::function<void(const Params&, const Shape*)> check = nullptr;
  // The parameter holding the attention mass the method targets ("p", PSA's "threshold");
  // empty for methods that target none (fixed budgets). Evaluation reports "reached P"
  // against it, and sweeps it over the targets of `eval mass`.
  std::string target_param = {};
  // The parameter holding a fixed-budget method's token budget (quest's and lfps's "budget",
  // oracle_topk's "k", streaming's "window"); empty for adaptive methods. `eval matched`
  // sets it to the adaptive method's budget.
  std::string budget_param = {};
  // The parameter holding tokens a fixed-budget method attends besides its budget
  // (streaming's "sinks", beside its "window"); empty: none. `eval matched` gives
  // budget_param the budget less these.
  std::string budget_extra_param = {};
  // Its colour in the evaluation's plots ("#rrggbb"); empty: the plots' palette picks one
  // no registered method uses.
  std::string color = {};
  // Its fused GPU pipeline, once attached (GpuPipeline above).
  GpuPipeline gpu = {};
  // Its GPU prefill attention, once attached (GpuPrefill above).
  GpuPrefill gpu_prefill = {};
};

class Registry {
 public:
  // The registry with every built-in method.
  static const Registry& builtin();

  void add(MethodInfo info);
  // Attaches a GPU pipeline to the method `name`; false (nothing changes) when the registry
  // has no such method.
  bool attach_gpu(const std::string& name, GpuPipeline gpu);
  // The same for a prefill method's GPU attention.
  bool attach_gpu_prefill(const std::string& name, GpuPrefill gpu);
  const MethodInfo& find(const std::string& name) const;  // throws Error listing known names
  const MethodInfo* find_if_known(const std::string& name) const;  // nullptr when unknown
  const std::vector<MethodInfo>& list() const { return methods_; }

  // Validates key=value overrides against the spec (unknown key, bad number, out of
  // range: Error naming method, key and value) and fills in defaults.
  Params parse(const std::string& name, const std::map<std::string, std::string>& overrides) const;
  // Everything the method would refuse in these parameters, before any work: parse, then
  // MethodInfo::check, with the model's shape where one is given (Error naming method, key
  // and value). make, make_policy and make_prefill run the same checks.
  Params check(const std::string& name, const std::map<std::string, std::string>& overrides,
               const Shape* shape = nullptr) const;
  std::unique_ptr<DecodeMethod> make(const std::string& name, const Shape& shape,
                                     const std::map<std::string, std::string>& overrides = {}) const;
  // The policy of a method defined once over the selection ops (Error for any other).
  std::shared_ptr<const SelectPolicy> make_policy(const std::string& name, const Shape& shape,
                                                  const std::map<std::string, std::string>& overrides = {}) const;
  // The same for prefill methods (Error for a method without a prefill factory).
  std::unique_ptr<PrefillMethod> make_prefill(const std::string& name, const Shape& shape,
                                              const std::map<std::string, std::string>& overrides = {}) const;

 private:
  std::vector<MethodInfo> methods_;
};

// Each method file defines one of these; registry.cpp calls them all (explicit calls, so
// no static-initialisation order or dead-stripping surprises).
void register_dense(Registry& r);
void register_oracle_topk(Registry& r);
void register_oracle_topp(Registry& r);
void register_streaming(Registry& r);
void register_quest(Registry& r);
// The papers' methods and ours: src/methods/<name>/<name>.cpp.
void register_tactic(Registry& r);
void register_sketch_topp(Registry& r);
void register_psa(Registry& r);
void register_lfps(Registry& r);
// Prefill methods: src/methods/flexprefill/flexprefill.cpp (dense registers both kinds).
void register_flexprefill(Registry& r);

}  // namespace cumulus
