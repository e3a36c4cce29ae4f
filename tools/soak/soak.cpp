// cumulus_soak: a bounded soak of the model runtime, run by CI. On a small real
// model (stories260K by default) it checks what a long-running server depends on:
//
//   1. determinism: every decode method (fixed budgets at 64 tokens), greedy from one
//      prompt to the context limit, at 1, 2 and 3 threads; the logits of every step must
//      be bit-identical across thread counts (compared by a 64-bit FNV-1a hash of every
//      logits vector and the token sequence);
//      one decode past the limit must be a clean Error;
//   2. endurance: one session per method, prefilled once, then restart_decode cycles, each
//      decoding to the context limit, until --seconds have passed; resident memory (RSS,
//      /proc/self/statm) after the first cycle of every method is the baseline, and its
//      growth by the end must stay under --rss-slack-mib (the KV cache and method state
//      are allocated in the first cycles; later cycles must not grow).
//
// Prints one line per check and the figures (decode steps, steps/s, RSS), and exits 1 on
// any failure. Usage: cumulus_soak [--model M] [--tokenizer T] [--seconds S]
//                                  [--rss-slack-mib N] [--json PATH]
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cumulus/kernels/simd.h"
#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/eval/tasks.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/sampler.h"
#include "cumulus/model/session.h"

namespace cumulus {
namespace {

struct SoakOptions {
  std::string model = "../shared/data/models/stories260K/stories260K.bin";
  std::string tokenizer;
  double seconds = 60;
  double rss_slack_mib = 4;
  std::string json;
};

double rss_mib() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
};

std::vector<std::string> decode_methods() {
  std::vector<std::string> out;
  for (const auto& m : Registry::builtin().list())
    if (m.make_decode != nullptr) out.push_back(m.name);
  return out;
}

std::vector<int32_t> soak_prompt(const LoadedModel& m, int n) {
  std::vector<int32_t> p = m.tokenizer->encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
      "friends. One day, she saw a big red ball under a tree and ran to get it.",
      true);
  const std::vector<int32_t> base = p;
  while (static_cast<int>(p.size()) < n) p.insert(p.end(), base.begin() + 1, base.end());
  p.resize(static_cast<size_t>(n));
  return p;
}

// Fixed budgets well under the small model's context, so the sparse paths run (at their
// defaults quest, streaming and oracle_topk would cover all 512 tokens and equal dense, and
// sketch_topp's cost rule would attend densely).
std::map<std::string, std::string> soak_params(const std::string& method) {
  const MethodInfo& m = Registry::builtin().find(method);
  if (!m.budget_param.empty()) return {{m.budget_param, "64"}};
  // A method with a cost rule attends densely up to min_context tokens (sketch_topp's 1024):
  // 0 runs its selection here.
  for (const ParamSpec& p : m.params)
    if (p.name == "min_context") return {{"min_context", "0"}};
  return {};
}

SessionOptions session_options(const std::string& method, int threads, int keep_queries) {
  SessionOptions so;
  so.method = method;
  so.params = soak_params(method);
  so.n_threads = threads;
  so.keep_prompt_queries = keep_queries;
  return so;
}

// Greedy decode from the prompt's logits to the context limit; hashes every logits vector
// and token. Returns the number of decode steps.
int64_t decode_to_limit(Session& s, const std::vector<float>& prompt_logits, Fnv& hash) {
  Sampler greedy({});
  const std::vector<float>* logits = &prompt_logits;
  int64_t steps = 0;
  while (s.position() < s.capacity()) {
    hash.add(logits->data(), logits->size() * sizeof(float));
    const int32_t next = greedy.sample(*logits);
    hash.add(&next, sizeof(next));
    logits = &s.decode(next);
    ++steps;
  }
  hash.add(logits->data(), logits->size() * sizeof(float));
  return steps;
}

int soak_run(const SoakOptions& o) {
  const LoadedModel m = model_load(o.model, o.tokenizer);
  const int ctx = m.weights.config.context_length;
  const std::vector<int32_t> prompt = soak_prompt(m, ctx / 3);
  const std::vector<std::string> methods = decode_methods();
  int keep = 0;
  for (const auto& name : methods)
    keep = std::max(keep,
                    Registry::builtin().make(name, m.weights.config.shape(), soak_params(name))->prompt_queries());
  fmt::print("soak: model {} (context {}), prompt {} tokens, {} decode methods\n", o.model, ctx, prompt.size(),
             methods.size());
  int failures = 0;
  int64_t steps_total = 0;
  nlohmann::json report;
  const auto t0 = std::chrono::steady_clock::now();

  // 1. Bit-identical logits across thread counts, to the context limit.
  for (const auto& name : methods) {
    std::vector<uint64_t> hashes;
    int64_t steps = 0;
    for (int threads : {1, 2, 3}) {
      Session s(m.weights, session_options(name, threads, keep));
      const std::vector<float> first = s.prefill(prompt);
      Fnv h;
      steps = decode_to_limit(s, first, h);
      steps_total += steps;
      hashes.push_back(h.h);
      bool refused = false;
      try {
        s.decode(0);
      } catch (const Error&) {
        refused = true;
      }
      if (!refused) {
        fmt::print("FAIL {}: decode past the context limit ({}) was not refused\n", name, ctx);
        ++failures;
      }
    }
    const bool same = hashes[0] == hashes[1] && hashes[0] == hashes[2];
    fmt::print("{} {:<12} {} steps to the limit; logits hash t1 {:016x} t2 {:016x} t3 {:016x}\n",
               same ? "ok  " : "FAIL", name, steps, hashes[0], hashes[1], hashes[2]);
    failures += !same;
    report["determinism"][name] = {{"steps", steps}, {"identical", same}};
  }

  // 2. restart_decode cycles until the time budget; RSS stays flat after the first cycle
  //    of every method.
  std::vector<std::unique_ptr<Session>> sessions;
  std::vector<std::vector<float>> first_logits;
  for (const auto& name : methods) {
    sessions.push_back(std::make_unique<Session>(m.weights, session_options(name, 2, keep)));
    first_logits.push_back(sessions.back()->prefill(prompt));
  }
  std::vector<uint64_t> reference(methods.size());
  auto cycle = [&](size_t i) {
    Session& s = *sessions[i];
    s.restart_decode(methods[i], soak_params(methods[i]));
    Fnv h;
    steps_total += decode_to_limit(s, first_logits[i], h);
    return h.h;
  };
  for (size_t i = 0; i < methods.size(); ++i) reference[i] = cycle(i);
  const double rss_base = rss_mib();
  int cycles = 1;
  bool drift = false;
  const auto deadline = t0 + std::chrono::duration<double>(o.seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    for (size_t i = 0; i < methods.size(); ++i) {
      const uint64_t h = cycle(i);
      if (h != reference[i]) {
        fmt::print("FAIL {}: restart_decode cycle {} differs from the first (hash {:016x} vs {:016x})\n", methods[i],
                   cycles + 1, h, reference[i]);
        drift = true;
      }
    }
    ++cycles;
    if (drift) break;
  }
  failures += drift;
  const double rss_end = rss_mib();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool flat = rss_end - rss_base <= o.rss_slack_mib;
  failures += !flat;
  fmt::print("{} restart_decode: {} cycles x {} methods, each to the context limit; every cycle identical to the "
             "first: {}\n",
             drift ? "FAIL" : "ok  ", cycles, methods.size(), drift ? "no" : "yes");
  fmt::print("{} RSS after the first cycle {:.1f} MiB, at the end {:.1f} MiB (growth {:+.2f} MiB, allowed {:.1f})\n",
             flat ? "ok  " : "FAIL", rss_base, rss_end, rss_end - rss_base, o.rss_slack_mib);
  fmt::print("soak: {} decode steps in {:.1f} s ({:.0f} steps/s); {}\n", steps_total, seconds, steps_total / seconds,
             failures ? fmt::format("{} FAILURES", failures) : std::string("PASS"));
  if (!o.json.empty()) {
    report["model"] = o.model;
    report["context"] = ctx;
    report["decode_steps"] = steps_total;
    report["seconds"] = seconds;
    report["restart_cycles"] = cycles;
    report["rss_mib_after_first_cycle"] = rss_base;
    report["rss_mib_end"] = rss_end;
    report["failures"] = failures;
    file_write_atomic(o.json, report.dump(2) + "\n", "--json");
  }
  return failures ? 1 : 0;
}

}  // namespace
}  // namespace cumulus

int main(int argc, char** argv) {
  try {
    cumulus::cpu::simd_select_from_env();  // CUMULUS_SIMD caps the SIMD target (kernels/simd.h)
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  cumulus::SoakOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        fmt::print(stderr, "error: {} needs a value\n", a);
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (a == "--model") {
        o.model = value();
      } else if (a == "--tokenizer") {
        o.tokenizer = value();
      } else if (a == "--seconds") {
        o.seconds = std::stod(value());
      } else if (a == "--rss-slack-mib") {
        o.rss_slack_mib = std::stod(value());
      } else if (a == "--json") {
        o.json = value();
      } else {
        fmt::print(stderr, "error: unknown option '{}' (--model, --tokenizer, --seconds, --rss-slack-mib, --json)\n",
                   a);
        return 2;
      }
    } catch (const std::exception&) {
      fmt::print(stderr, "error: {} takes a number\n", a);
      return 2;
    }
  }
  if (!(o.seconds >= 0 && o.seconds <= 3600)) {
    fmt::print(stderr, "error: --seconds={} must be in [0, 3600]\n", o.seconds);
    return 2;
  }
  try {
    if (!o.json.empty()) cumulus::file_check_output(o.json, "--json");
    return cumulus::soak_run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
