// `cumulus methods`: prints the registry (name, kind: decode and/or prefill, paper, parameters
// with defaults). Parameters go to `generate --param` (decode) or `--prefill-param` (prefill).
#include <fmt/format.h>

#include "cli.h"
#include "cumulus/methods/registry.h"

namespace cumulus::cli {

void add_methods_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("methods", "List the attention methods and their parameters");
  cmd->callback([] {
    for (const auto& m : Registry::builtin().list()) {
      fmt::print("{:<12} {:<15} {}\n", m.name, method_kind_name(m.kind), m.summary);
      fmt::print("{:<12} {:<15} paper: {}\n", "", "", m.paper);
      const char* flag = m.make_decode ? "--param" : "--prefill-param";
      for (const auto& p : m.params)
        fmt::print("{:<14}{} {:<20} {}\n", "", flag, fmt::format("{}={}", p.name, p.default_value), p.help);
    }
  });
}

}  // namespace cumulus::cli
