// `cumulus methods`: prints the registry (name, kind, paper, parameters with defaults).
#include <fmt/format.h>

#include "cli.h"
#include "cumulus/methods/registry.h"

namespace cumulus::cli {

void add_methods_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("methods", "List the attention methods and their parameters");
  cmd->callback([] {
    for (const auto& m : Registry::builtin().list()) {
      fmt::print("{:<12} {:<8} {}\n", m.name, m.kind, m.summary);
      fmt::print("{:<12} {:<8} paper: {}\n", "", "", m.paper);
      for (const auto& p : m.params) fmt::print("{:<14}--param {}={:<10} {}\n", "", p.name, p.default_value, p.help);
    }
  });
}

}  // namespace cumulus::cli
