// The CPU adapter of a SelectPolicy (methods/policy.h): one step is the policy's ops on the
// CPU backend (kernels/select_ops.h) over this layer's cache, then the sparse kernel over
// the unions they leave.
#include "cumulus/methods/policy.h"

#include "method_util.h"

namespace cumulus {
namespace {

class PolicyMethod final : public DecodeMethod {
 public:
  PolicyMethod(const Shape& shape, std::string name, std::shared_ptr<const SelectPolicy> policy)
      : shape_(shape), name_(std::move(name)), policy_(std::move(policy)), ops_(cpu::make_select_ops()) {}
  std::string name() const override { return name_; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    views_.resize(static_cast<size_t>(shape_.n_kv_heads));
    for (int h = 0; h < shape_.n_kv_heads; ++h) views_[static_cast<size_t>(h)] = kv.view(layer, h);
    ops_->begin({.kv = views_.data(), .n_seqs = 1, .n_kv_heads = shape_.n_kv_heads, .group = shape_.group(), .q = q,
                 .pool = ctx.pool});
    policy_->select(layer, *ops_);
    claims_.resize(static_cast<size_t>(shape_.n_q_heads));
    bytes_.resize(static_cast<size_t>(shape_.n_kv_heads));
    ops_->finish(out.selection.tokens.data(), claims_.data(), bytes_.data());
    for (int h = 0; h < shape_.n_kv_heads; ++h)
      methods::add_kv_head_bytes(shape_, h, bytes_[static_cast<size_t>(h)], out);
    methods::attend_selection(kv, layer, q, ctx, out);
    for (int j = 0; j < shape_.n_q_heads; ++j)
      out.stats[static_cast<size_t>(j)].mass_claimed = claims_[static_cast<size_t>(j)];
  }

 private:
  Shape shape_;
  std::string name_;
  std::shared_ptr<const SelectPolicy> policy_;
  std::unique_ptr<HostSelectOps> ops_;
  std::vector<PagedHeadView> views_;
  std::vector<double> claims_, bytes_;
};

}  // namespace

std::unique_ptr<DecodeMethod> make_policy_method(const Shape& shape, std::string name,
                                                 std::shared_ptr<const SelectPolicy> policy) {
  return std::make_unique<PolicyMethod>(shape, std::move(name), std::move(policy));
}

}  // namespace cumulus
