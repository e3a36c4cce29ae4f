// The CPU Session behind the ModelRunner interface (runner.h): every call forwards to it, so
// the CPU hot path is Session's own.
#include "cumulus/model/runner.h"

namespace cumulus {
namespace {

class CpuRunner final : public ModelRunner {
 public:
  CpuRunner(const ModelWeights& w, const SessionOptions& o) : s_(w, o) {}
  const std::vector<float>& prefill(std::span<const int32_t> tokens) override { return s_.prefill(tokens); }
  const std::vector<float>& decode(int32_t token) override { return s_.decode(token); }
  void build_indexes() override { s_.build_indexes(); }
  void restart_decode(const std::string& method, const std::map<std::string, std::string>& params) override {
    s_.restart_decode(method, params);
  }
  int position() const override { return s_.position(); }
  int capacity() const override { return s_.capacity(); }
  AttentionSummary summary() const override { return s_.summary(); }
  const std::vector<AttnOutput>& last_step() const override { return s_.last_step(); }
  PrefillStats prefill_stats() const override { return s_.prefill_method().stats(); }
  std::string device() const override { return "cpu"; }
  Session* session() override { return &s_; }

 private:
  Session s_;
};

}  // namespace

std::unique_ptr<ModelRunner> model_runner_cpu(const ModelWeights& weights, const SessionOptions& options) {
  return std::make_unique<CpuRunner>(weights, options);
}

}  // namespace cumulus
