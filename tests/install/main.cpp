// A user's program against the installed package: a small cache of random keys and values,
// the built-in dense method and top-p oracle built by name from the registry, one decode step
// each in eval mode. Exits non-zero when a result is off. Built against a CUDA build
// (CONSUMER_CUDA), it also names the GPU the runtime would use, or why there is none.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/method.h"
#include "cumulus/methods/registry.h"
#ifdef CONSUMER_CUDA
#include "cumulus/model/cuda_runner.h"
#endif

int main() {
  using namespace cumulus;
  const Shape shape{.n_layers = 1, .n_q_heads = 4, .n_kv_heads = 2, .head_dim = 64};
  const int n = 100;
  KvCache kv(shape);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::vector<float> k(static_cast<size_t>(n) * shape.n_kv_heads * shape.head_dim), v(k.size());
  std::vector<float> q(static_cast<size_t>(shape.n_q_heads) * shape.head_dim);
  for (float& x : k) x = dist(rng);
  for (float& x : v) x = dist(rng);
  for (float& x : q) x = dist(rng);
  kv.append(0, k.data(), v.data(), n);

  ThreadPool pool(1);
  const DecodeContext ctx{.pool = &pool, .eval = true};
  int failures = 0;
  for (const char* name : {"dense", "oracle_topp"}) {
    auto method = Registry::builtin().make(name, shape);
    method->on_prefill(0, kv, ctx);
    AttnOutput out;
    decode_step(*method, 0, q.data(), kv, ctx, out);
    for (const StepStats& s : out.stats) {
      const bool ok = std::isfinite(s.out_err) && s.mass_true > 0.5 && s.tokens_attended > 0;
      if (!ok) ++failures;
      std::printf("%s: tokens %d, true mass %.4f, error %.2e%s\n", name, s.tokens_attended, s.mass_true, s.out_err,
                  ok ? "" : "  <- wrong");
    }
  }
  try {
    Registry::builtin().make("no_such_method", shape);
    ++failures;
  } catch (const Error& e) {
    std::printf("unknown method: %s\n", e.what());
  }
#ifdef CONSUMER_CUDA
  const std::string device = cuda_device_summary();
  if (device.empty()) ++failures;
  std::printf("cuda device: %s\n", device.c_str());
#endif
  return failures == 0 ? 0 : 1;
}
