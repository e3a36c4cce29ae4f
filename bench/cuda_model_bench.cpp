// End-to-end decode speed of the GPU model runtime (issue 16, benchmark): a llama3-8b-shaped
// model (32 layers, 32 query heads over 8 kv heads, head_dim 128, dim 4096, ffn 14336, vocab
// 128256, untied head) with random f16 weights made on the device, dense attention, the
// cache filled with random K/V to each context (no prefill: fill_random_context), then
// greedy decode steps timed one by one (each step waits for its logits, as `cumulus
// generate` does). Against the floor: (weight bytes + K/V bytes read per step) / the
// device-to-device copy bandwidth (read + write) measured in the same run. Batch 1 only: the
// runner holds one sequence (batch > 1 is listed as not run). Prints a table, writes JSON.
//   cuda_model_bench [--contexts 8192,32768,131072] [--steps 20] [--json PATH] [--layers N]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/model/cuda_runner.h"

using namespace cumulus;
using json = nlohmann::json;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Device-to-device copy of 1 GiB, read + write bytes counted, median of 20 after 3 warm-ups.
double copy_gbps() {
  const size_t bytes = size_t{1} << 30;
  cuda::Stream st;
  cuda::DeviceBuffer a(bytes), b(bytes);
  cuda::memset_async(a.data(), 1, bytes, st.handle());
  cuda::EventTimer t;
  std::vector<double> g;
  for (int i = 0; i < 23; ++i) {
    t.start(st.handle());
    cuda::memcpy_device_async(b.data(), a.data(), bytes, st.handle());
    t.stop(st.handle());
    const double ms = t.elapsed_ms();
    if (i >= 3) g.push_back(2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  return median(g);
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  size_t b = 0;
  while (b < s.size()) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    v.push_back(std::stoi(s.substr(b, e - b)));
    b = e + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<int> contexts{8192, 32768, 131072};
  int steps = 20, layers = 32;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      CUMULUS_CHECK(i + 1 < argc, "{} needs a value", a);
      return argv[++i];
    };
    if (a == "--contexts") contexts = parse_list(next());
    else if (a == "--steps") steps = std::stoi(next());
    else if (a == "--layers") layers = std::stoi(next());
    else if (a == "--json") json_path = next();
    else CUMULUS_FAIL("unknown argument '{}' (--contexts, --steps, --layers, --json)", a);
  }
  CUMULUS_CHECK(steps >= 1 && layers >= 1, "--steps={} and --layers={} must be >= 1", steps, layers);
  if (!cuda::device_available()) {
    std::fprintf(stderr, "cuda_model_bench: no CUDA device\n");
    return 1;
  }
  ModelConfig c;
  c.architecture = "llama";
  c.n_layers = layers;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.rope_dim = 128;
  c.dim = 4096;
  c.hidden_dim = 14336;
  c.vocab_size = 128256;
  c.rope_theta = 500000.0f;
  c.tied_output = false;
  const std::string dev = cuda_device_summary();
  const double bw = copy_gbps();
  fmt::print("device: {}\nllama3-8b shape, {} layers, random f16 weights, dense, kv f16, batch 1\n", dev, layers);
  fmt::print("device-to-device copy: {:.0f} GB/s (read + write, median of 20 x 1 GiB)\n\n", bw);
  fmt::print("{:>8} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8}\n", "context", "batch", "ms/step", "tok/s",
             "GB/step", "floor ms", "floor t/s", "of floor");
  json report = {{"device", dev}, {"copy_gbps", bw}, {"layers", layers}, {"steps", steps}, {"runs", json::array()}};
  for (int ctx : contexts) {
    SessionOptions o;
    o.max_tokens = ctx + steps + 4;
    c.context_length = o.max_tokens;
    try {
      cuda_runner_check(c, o);
    } catch (const Error& e) {
      fmt::print("{:>8} {:>6}  does not fit: {}\n", ctx, 1, e.what());
      report["runs"].push_back({{"context", ctx}, {"batch", 1}, {"skipped", e.what()}});
      continue;
    }
    auto r = model_runner_cuda_random(c, o, 1234);
    r->fill_random_context(ctx, 99);
    int32_t tok = 1;
    for (int i = 0; i < 3; ++i) tok = static_cast<int32_t>(r->decode(tok)[0] > 0 ? 2 : 3);  // warm-up
    std::vector<double> ms;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<float>& logits = r->decode(tok);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      tok = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    }
    const double step = median(ms);
    // Bytes a step reads: every weight matrix and the classifier, and K/V at the mean depth.
    const double depth = ctx + 3 + 0.5 * (steps + 1);
    const double bytes = static_cast<double>(r->decode_weight_bytes()) + depth * r->kv_bytes_per_token();
    const double floor_ms = bytes / (bw * 1e9) * 1e3;
    fmt::print("{:>8} {:>6} {:>10.3f} {:>10.1f} {:>10.2f} {:>10.3f} {:>10.1f} {:>7.1f}%\n", ctx, 1, step, 1e3 / step,
               bytes / 1e9, floor_ms, 1e3 / floor_ms, 100 * floor_ms / step);
    report["runs"].push_back({{"context", ctx},
                              {"batch", 1},
                              {"ms_per_step_median", step},
                              {"ms_samples", ms},
                              {"tokens_per_s", 1e3 / step},
                              {"bytes_per_step", bytes},
                              {"weight_bytes", r->decode_weight_bytes()},
                              {"kv_bytes_per_token", r->kv_bytes_per_token()},
                              {"floor_ms", floor_ms},
                              {"pct_of_floor", 100 * floor_ms / step}});
  }
  for (int b : {4, 16})
    for (int ctx : contexts) {
      fmt::print("{:>8} {:>6}  not run: the runner holds one sequence (batched decode not built yet)\n", ctx, b);
      report["runs"].push_back({{"context", ctx}, {"batch", b}, {"skipped", "batched decode not built yet"}});
    }
  fmt::print("\nms/step: median of {} greedy decode steps (wall clock, each waits for its logits); floor: (weight "
             "bytes + K/V bytes at the mean depth) / copy bandwidth\n",
             steps);
  if (!json_path.empty()) std::ofstream(json_path) << report.dump(2) << "\n";
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
