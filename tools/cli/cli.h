// Subcommand registration for the cumulus CLI; one file per subcommand. Each subcommand's
// callback throws cumulus::Error on bad input; main prints it and exits 1.
#pragma once

#include <CLI/CLI.hpp>
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cumulus/core/number.h"
#include "cumulus/eval/bench.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/runner.h"

namespace cumulus::cli {

void add_methods_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_trace_command(CLI::App& app);

// --weights NAME of generate and eval: compact (keep the block formats of kernels/gemv.h quantised) or f32.
WeightStorage weight_storage_from_name(const std::string& name);
// --prefill-param key=value (repeatable) of generate and eval; a key given twice is an
// Error; the registry checks the keys.
std::map<std::string, std::string> prefill_param_map(const std::vector<std::string>& params);

// --device cpu|cuda (device.cpp). device_check throws Error naming the reason a device
// cannot run this model with these options (no CUDA build, no GPU, not enough device
// memory, a method not on the GPU yet) before anything is loaded; runner_make makes the
// runtime; device_line says what `info` prints for the GPU.
void device_check(const std::string& device, const ModelConfig& config, const SessionOptions& options);
std::unique_ptr<ModelRunner> runner_make(const std::string& device, const ModelWeights& weights,
                                         const SessionOptions& options);
std::string device_line();
// The decode methods --device cuda runs for this model (dense and the GPU pipelines that take
// its shape); an Error naming the reason in a build without CUDA.
std::vector<std::string> device_decode_methods(const std::string& device, const ModelConfig& config);
// `cumulus bench` on `device`: bench_run (cpu) or bench_run_cuda (cuda, eval/cuda_bench.h),
// the same report; an Error naming the reason for cuda in a build without CUDA.
BenchReport bench_run_device(const std::string& device, const BenchOptions& options, std::FILE* log);

// Integers on the command line: decimal only, never clamped (core/number.h), in [lo, hi].
// A transform: it rewrites the value in plain decimal ("010" -> "10") for CLI11, whose own
// conversion reads "010" as octal and "0x10" as hex.
inline CLI::Validator decimal_range(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        int64_t v = 0;
        const std::string err = number_parse_int(s, lo, hi, &v);
        if (!err.empty()) return "'" + s + "' " + err;
        s = std::to_string(v);
        return "";
      },
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

// Every number option of app's subcommands read as core/number.h reads numbers, before
// CLI11 converts it: integer options (all `int` here; uint64_t seeds) through
// decimal_range or seed_check, floating-point options refused when not a finite decimal
// number or when they overflow or underflow. Call once, after the subcommands are added.
void options_numbers_decimal(CLI::App& app);

// A comma-separated list option (repeatable; items in order): CLI11's delimiter drops empty
// items ("1,,2", "1,"), so the items are split here and an empty one is an error naming the
// option and the value; int and double items are read as options_numbers_decimal reads
// numbers (which leaves these options alone: their type names hold a comma). The help shows
// the target's value as the default.
inline constexpr const char* kListInt = "INT,...";
inline constexpr const char* kListFloat = "FLOAT,...";
inline constexpr const char* kListText = "TEXT,...";
CLI::Option* list_option(CLI::App* cmd, const std::string& name, std::vector<int>* target, const std::string& help);
CLI::Option* list_option(CLI::App* cmd, const std::string& name, std::vector<double>* target, const std::string& help);
CLI::Option* list_option(CLI::App* cmd, const std::string& name, std::vector<std::string>* target,
                         const std::string& help);

// --threads takes one range in every subcommand.
inline constexpr int kThreadsMax = 256;
inline CLI::Validator threads_range() { return decimal_range(1, kThreadsMax); }

// --threads' default: the CPUs this process may run on (its affinity mask, which taskset and
// container CPU sets narrow), at most kThreadsMax.
inline int default_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  return std::clamp(n > 0 ? n : static_cast<int>(std::thread::hardware_concurrency()), 1, kThreadsMax);
}

// --seed: a decimal integer in [0, 2^64) (CLI11 alone would wrap -1 to 2^64 - 1 and clamp
// 2^64 to 2^64 - 1).
inline CLI::Validator seed_check() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        const std::string err = number_parse_uint(s, UINT64_MAX, &v);
        if (!err.empty()) return "'" + s + "' " + err;
        s = std::to_string(v);
        return "";
      },
      "SEED");
}

}  // namespace cumulus::cli
