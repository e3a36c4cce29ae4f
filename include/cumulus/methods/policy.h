// Decode methods defined once (DESIGN.md "one engine, two backends"): a method whose
// selection is a composition of the selection ops (kernels/select_ops.h) is written as a
// SelectPolicy, and every backend runs that one definition: the CPU through
// make_policy_method (a DecodeMethod over cpu::make_select_ops), the GPU through
// cuda::make_ops_gpu (the model runtime's src/model/cuda/decode_methods.cu), the float64
// reference through ref::make_select_ops (tests). The registry's entry for such a method
// sets make_policy; its make_decode is then the CPU adapter.
//
// Methods whose GPU step fuses what the ops would separate (tactic, psa, sketch_topp) and
// LFPS keep a CPU DecodeMethod and, on the GPU, a fused pipeline (methods/cuda_methods.h);
// docs/architecture.md says why.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "cumulus/core/shape.h"
#include "cumulus/kernels/select_ops.h"
#include "cumulus/methods/method.h"

namespace cumulus {

class SelectPolicy {
 public:
  virtual ~SelectPolicy() = default;
  // Issues one decode step's ops for `layer`. The ops issued may depend on the layer, not
  // on the data (the GPU sizes and captures a step from one call).
  virtual void select(int layer, SelectOps& ops) const = 0;
  // The layer attends every token (quest's dense_layers): a backend may run its dense
  // kernel instead of select().
  virtual bool dense_layer(int layer) const {
    (void)layer;
    return false;
  }
};

// The CPU DecodeMethod of a policy: select on the CPU ops, then the sparse kernel over the
// unions; each query head's claim is the policy's, and the scoring's bytes are counted.
std::unique_ptr<DecodeMethod> make_policy_method(const Shape& shape, std::string name,
                                                 std::shared_ptr<const SelectPolicy> policy);

// One layer's step as a callable (what cuda::make_ops_gpu takes).
inline std::function<void(SelectOps&)> policy_step(std::shared_ptr<const SelectPolicy> policy, int layer) {
  return [policy = std::move(policy), layer](SelectOps& ops) { policy->select(layer, ops); };
}

}  // namespace cumulus
