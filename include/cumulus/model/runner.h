// ModelRunner: what a command needs from a model runtime, whichever device runs it — feed a
// prompt, decode one token at a time, restart decoding after the prompt, and the running
// attention summary. The CPU Session (session.h) and the CUDA runtime (cuda_runner.h,
// built with CUMULUS_CUDA=ON) implement it; the CLI picks one by --device.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cumulus/methods/prefill.h"
#include "cumulus/model/session.h"

namespace cumulus {

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // As Session::prefill / decode / restart_decode: logits [vocab] after the last token fed.
  virtual const std::vector<float>& prefill(std::span<const int32_t> tokens) = 0;
  virtual const std::vector<float>& decode(int32_t token) = 0;
  virtual void restart_decode(const std::string& method, const std::map<std::string, std::string>& params = {}) = 0;
  // As Session::build_indexes: the decode method's index over the prompt, built now rather
  // than inside the first decode step (nothing to build for dense attention).
  virtual void build_indexes() {}
  virtual int position() const = 0;
  virtual int capacity() const = 0;
  virtual AttentionSummary summary() const = 0;
  // As Session::last_step: per layer, the last decode step's output and per-head statistics
  // (mass_true and out_err in eval mode, SessionOptions::eval). The CUDA runtime fills
  // them only in eval mode (they cost host copies each step); elsewhere it is empty.
  virtual const std::vector<AttnOutput>& last_step() const = 0;
  virtual PrefillStats prefill_stats() const = 0;
  // "cpu" or the GPU's name ("cuda: NVIDIA H100 80GB HBM3").
  virtual std::string device() const = 0;
  // The CPU session behind this runner (KV snapshots, per-layer stats); nullptr elsewhere.
  virtual Session* session() { return nullptr; }
};

// The CPU runtime: a Session with these options (`weights` must outlive it).
std::unique_ptr<ModelRunner> model_runner_cpu(const ModelWeights& weights, const SessionOptions& options);

}  // namespace cumulus
