// cumulus command line: bench | eval | generate | info | methods | trace.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "cli.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/simd.h"

int main(int argc, char** argv) {
  CLI::App app{"cumulus: adaptive sparse attention for long-context LLM inference"};
  app.require_subcommand(1);
  cumulus::cli::add_methods_command(app);
  cumulus::cli::add_bench_command(app);
  cumulus::cli::add_generate_command(app);
  cumulus::cli::add_eval_command(app);
  cumulus::cli::add_info_command(app);
  cumulus::cli::add_trace_command(app);
  cumulus::cli::options_numbers_decimal(app);
  // CLI11 answers an unknown first word with "A subcommand is required"; name it instead.
  if (argc > 1 && argv[1][0] != '-') {
    std::string known;
    bool found = false;
    for (const CLI::App* sub : app.get_subcommands({})) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      found = found || sub->get_name() == argv[1];
    }
    if (!found) {
      fmt::print(stderr, "error: unknown subcommand '{}' (known: {}; see --help)\n", argv[1], known);
      return 1;
    }
  }
  try {
    // CUMULUS_SIMD caps the CPU kernels' SIMD target (kernels/simd.h) before any runs.
    cumulus::cpu::simd_select_from_env();
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const cumulus::Error& e) {
    // The message names the option, file or value; the library function that found it is
    // shown only with CUMULUS_DEBUG set (e.g. "error: file_check_input: ...").
    const char* debug = std::getenv("CUMULUS_DEBUG");
    fmt::print(stderr, "error: {}\n", debug != nullptr && *debug != '\0' ? std::string(e.what()) : e.message());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
