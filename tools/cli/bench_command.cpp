// `cumulus bench`: every decode method on the synthetic workload; accuracy against dense,
// time per decode step and GB/s against the read bandwidth measured in the same run.
// The logic lives in src/eval/bench.cpp and, for --device cuda, src/eval/cuda/bench_cuda.cu
// (through device.cpp's bench_run_device); this file maps options onto BenchOptions.
//
// Output: the table goes to stdout. `--json PATH` also writes the JSON report to PATH;
// `--json -` writes the JSON to stdout instead and moves the table to stderr, so stdout
// stays machine-readable. Progress lines go to stderr.
#include <fmt/format.h>

#include <cstdio>
#include <memory>

#include "core/check.h"
#include "cli.h"
#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/eval/bench.h"

namespace cumulus::cli {

namespace {

struct BenchArgs {
  BenchOptions o;
  std::string dtype = "f16";
  std::vector<std::string> params;  // method.key=value
  std::string json;
  int membw_mib = 1024;
  int evict_mib = -1;  // -1: BenchOptions' default (2 x LLC)
  std::string device = "cpu";
};

// "method.key=value" -> o.params[method][key] = value
void param_add(BenchOptions& o, const std::string& text) {
  const size_t dot = text.find('.');
  const size_t eq = text.find('=');
  CUMULUS_CHECK(dot != std::string::npos && eq != std::string::npos && dot > 0 && eq > dot + 1,
                "--param '{}' must look like method.key=value", text);
  const auto [it, fresh] =
      o.params[text.substr(0, dot)].emplace(text.substr(dot + 1, eq - dot - 1), text.substr(eq + 1));
  CUMULUS_CHECK(fresh, "--param '{}': {}.{} is already set (to {})", text, text.substr(0, dot), it->first, it->second);
}

void bench_command_run(const BenchArgs& a) {
  BenchOptions o = a.o;
  o.dtype = dtype_from_name(a.dtype);
  for (const auto& p : a.params) param_add(o, p);
  CUMULUS_CHECK(a.membw_mib >= 64 && a.membw_mib <= 16384, "--membw-mib={} must be in [64, 16384]", a.membw_mib);
  o.membw_bytes = static_cast<size_t>(a.membw_mib) << 20;
  CUMULUS_CHECK(a.evict_mib >= -1 && a.evict_mib <= 16384, "--evict-mib={} must be in [0, 16384]", a.evict_mib);
  if (a.evict_mib >= 0) o.evict_bytes = static_cast<size_t>(a.evict_mib) << 20;
  // Every option and the output path before the benchmark starts.
  CUMULUS_CHECK(a.device == "cpu" || a.device == "cuda", "--device={} must be cpu or cuda", a.device);
  o.validate();
  if (!a.json.empty() && a.json != "-") file_check_output(a.json, "--json");
  const BenchReport rep = bench_run_device(a.device, o, stderr);
  const std::string table = bench_table(rep);
  if (a.json == "-") {
    fmt::print(stderr, "\n{}", table);
    fmt::print("{}", bench_json(rep));
    return;
  }
  fmt::print("\n{}", table);
  if (!a.json.empty()) {
    file_write_atomic(a.json, bench_json(rep), "--json");
    fmt::print("JSON report: {}\n", a.json);
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  auto* cmd = app.add_subcommand("bench", "Benchmark decode methods on a synthetic workload (docs/workload.md)");
  BenchOptions& o = args->o;
  cmd->add_option("--shape", o.shape, "Attention shape: llama3-8b (32/8 heads, d 128) or smollm2-135m (9/3, d 64)")
      ->capture_default_str();
  cmd->add_option("--context", o.context, "Tokens in the KV cache, 4096..131072")->capture_default_str();
  list_option(cmd, "--methods", &o.methods, "Comma-separated decode methods (default: all; dense always runs)");
  cmd->add_option("--param", args->params, "Method parameter method.key=value (repeatable), e.g. oracle_topk.k=1024");
  cmd->add_option("--dtype", args->dtype, "KV storage dtype: f16, bf16 or f32")->capture_default_str();
  o.threads = default_threads();
  cmd->add_option("--threads", o.threads, "Threads for the methods and the bandwidth probe (default: this machine's CPUs)")
      ->check(threads_range())
      ->capture_default_str();
  cmd->add_option("--steps", o.steps, "Decode steps (queries) per pass")->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "Untimed passes before timing")->capture_default_str();
  cmd->add_option("--repeats", o.repeats, "Timed passes; ms/step is their median")->capture_default_str();
  cmd->add_option("--seed", o.seed, "Workload seed")->check(seed_check())->capture_default_str();
  cmd->add_option("--concentration", o.concentration,
                  "Workload concentration in (0, 16]: higher = fewer tokens hold the mass")
      ->capture_default_str();
  cmd->add_option("--membw-mib", args->membw_mib, "Buffer of the read-bandwidth probe in MiB")->capture_default_str();
  cmd->add_option("--evict-mib", args->evict_mib,
                  "MiB swept before each timed step to start it from cold caches (0: warm; default 2 x LLC, "
                  "64..1024)");
  cmd->add_option("--json", args->json, "Also write the JSON report to this path ('-': JSON to stdout, table to stderr)");
  cmd->add_option("--device", args->device,
                  "cpu, or cuda: the GPU decode methods (dense, sketch_topp, tactic, psa, lfps, quest, oracle_topp, oracle_topk, streaming) on the same "
                  "workload, timed between CUDA events with the L2 flushed, against the copy bandwidth")
      ->capture_default_str();
  cmd->callback([args] { bench_command_run(*args); });
}

}  // namespace cumulus::cli
