// STUB: `cumulus bench`
#include "cli.h"
namespace cumulus::cli {
void add_bench_command(CLI::App& app) { app.add_subcommand("bench", "Benchmark methods on a synthetic workload"); }
}  // namespace cumulus::cli
