// streaming: StreamingLLM (Xiao et al., 2023) — the first `sinks` tokens (attention sinks)
// plus the most recent `window` tokens, the same set for every head. A fixed-budget
// baseline: it makes no claim about the mass of its set (mass_claimed = NaN). Defined once
// over the selection ops (methods/policy.h).
#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

struct StreamingOptions {
  int sinks = 4;
  int window = 2044;

  template <class F>
  void fields(F& f) {
    f.number(sinks, "sinks", ParamRange::closed(0, 1 << 30), "initial tokens always kept (the paper uses 4)");
    f.number(window, "window", ParamRange::closed(1, 1 << 30),
             "most recent tokens kept (default: 2048-token budget with 4 sinks)");
  }
};

class Streaming final : public SelectPolicy {
 public:
  explicit Streaming(const StreamingOptions& o) : sinks_(o.sinks), window_(o.window) {}
  void select(int, SelectOps& ops) const override { ops.mark_ends(sinks_, window_); }

 private:
  int sinks_, window_;
};

}  // namespace

void register_streaming(Registry& r) {
  r.add({.name = "streaming",
         .kind = MethodKind::decode,
         .paper = "StreamingLLM (Xiao et al., ICLR 2024): attention sinks + recent window",
         .summary = "first `sinks` tokens + last `window` tokens (no mass claim)",
         .params = options_params<StreamingOptions>(),
         .make_policy = [](const Shape&, const Params& p) {
           return std::make_shared<Streaming>(options_read<StreamingOptions>(p));
         },
         .budget_param = "window",
         .budget_extra_param = "sinks",
         .color = "#b07aa1"});
}

}  // namespace cumulus
