// streaming: StreamingLLM (Xiao et al., 2023) — the first `sinks` tokens (attention sinks)
// plus the most recent `window` tokens, the same set for every head. A fixed-budget
// baseline: it makes no claim about the mass of its set (mass_claimed = NaN). Defined once
// over the selection ops (methods/policy.h).
#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

class Streaming final : public SelectPolicy {
 public:
  Streaming(int sinks, int window) : sinks_(sinks), window_(window) {}
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
         .params = {{.name = "sinks",
                     .type = ParamType::kInt,
                     .default_value = "4",
                     .help = "initial tokens always kept (the paper uses 4)",
                     .min = 0,
                     .max = 1 << 30},
                    {.name = "window",
                     .type = ParamType::kInt,
                     .default_value = "2044",
                     .help = "most recent tokens kept (default: 2048-token budget with 4 sinks)",
                     .min = 1,
                     .max = 1 << 30}},
         .make_policy = [](const Shape&, const Params& p) {
           return std::make_shared<Streaming>(p.get_int("sinks"), p.get_int("window"));
         },
         .budget_param = "window",
         .color = "#b07aa1"});
}

}  // namespace cumulus
