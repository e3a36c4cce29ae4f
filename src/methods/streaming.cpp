// streaming: StreamingLLM (Xiao et al., 2023) — the first `sinks` tokens (attention sinks)
// plus the most recent `window` tokens, the same set for every head. A fixed-budget
// baseline: it makes no claim about the mass of its set (mass_claimed = NaN).
#include <algorithm>

#include "cumulus/core/error.h"
#include "cumulus/methods/registry.h"
#include "method_util.h"

namespace cumulus {
namespace {

class Streaming final : public DecodeMethod {
 public:
  Streaming(const Shape& shape, int sinks, int window) : shape_(shape), sinks_(sinks), window_(window) {}
  std::string name() const override { return "streaming"; }

  void decode(int layer, const float* q, const KvCache& kv, const DecodeContext& ctx, AttnOutput& out) override {
    methods::attn_output_reset(shape_, out);
    const int n = kv.n_tokens(layer);
    const int sink_end = std::min(sinks_, n);
    const int window_begin = std::max(sink_end, n - window_);
    for (auto& t : out.selection.tokens) {
      t.clear();
      for (int i = 0; i < sink_end; ++i) t.push_back(i);
      for (int i = window_begin; i < n; ++i) t.push_back(i);
    }
    methods::attend_selection(kv, layer, q, *ctx.pool, out);
    for (auto& st : out.stats) st.mass_claimed = methods::kNoClaim;
  }

 private:
  Shape shape_;
  int sinks_, window_;
};

}  // namespace

void register_streaming(Registry& r) {
  r.add({.name = "streaming",
         .kind = "decode",
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
         .make_decode = [](const Shape& s, const Params& p) {
           return std::make_unique<Streaming>(s, p.get_int("sinks"), p.get_int("window"));
         }});
}

}  // namespace cumulus
