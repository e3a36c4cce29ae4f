// Next-token sampling: greedy (temperature 0), temperature, nucleus (top-p), seeded.
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace cumulus {

struct SamplerOptions {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id on ties)
  float top_p = 1.0f;        // nucleus: smallest set of tokens with probability >= top_p
  uint64_t seed = 0;
};

class Sampler {
 public:
  // Throws Error for temperature < 0 or top_p outside (0, 1].
  explicit Sampler(const SamplerOptions& options);
  // logits [vocab]; NaN logits throw Error naming the id.
  int32_t sample(std::span<const float> logits);

 private:
  SamplerOptions opt_;
  std::mt19937_64 rng_;
};

}  // namespace cumulus
