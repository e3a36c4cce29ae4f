// cumulus command line: bench | eval | generate | info | methods | trace.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>

#include "cli.h"
#include "cumulus/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"cumulus: adaptive sparse attention for long-context LLM inference"};
  app.require_subcommand(1);
  cumulus::cli::add_methods_command(app);
  cumulus::cli::add_bench_command(app);
  cumulus::cli::add_generate_command(app);
  cumulus::cli::add_eval_command(app);
  cumulus::cli::add_info_command(app);
  cumulus::cli::add_trace_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const cumulus::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
