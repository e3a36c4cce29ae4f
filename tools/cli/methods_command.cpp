// `cumulus methods`: prints the registry (name, kind: decode and/or prefill, paper, parameters
// with their defaults, types, ranges or choices, and help). Parameters go to `generate
// --param` (decode) or `--prefill-param` (prefill).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cli.h"
#include "cumulus/methods/registry.h"

namespace cumulus::cli {
namespace {

const char* param_type_name(ParamType type) {
  switch (type) {
    case ParamType::kInt: return "int";
    case ParamType::kDouble: return "float";
    case ParamType::kBool: return "bool";
    case ParamType::kString: return "string";
    case ParamType::kChoice: return "choice";
  }
  return "?";
}

// One bound of a number parameter: an integer parameter's as an integer, "inf" beyond
// +-1e300 (the spec's "unbounded").
std::string param_bound_text(ParamType type, double v) {
  if (std::fabs(v) >= 1e300) return v < 0 ? "-inf" : "inf";
  return type == ParamType::kInt ? fmt::format("{}", static_cast<int64_t>(v)) : fmt::format("{}", v);
}

// What a parameter may be: "(0, 1]" (each bracket inclusive or exclusive), "fit|cluster_optimal"
// for a choice, "true|false" for a bool, "" for a free string.
std::string param_values_text(const ParamSpec& p) {
  switch (p.type) {
    case ParamType::kInt:
    case ParamType::kDouble:
      return fmt::format("{}{}, {}{}", p.min_exclusive ? "(" : "[", param_bound_text(p.type, p.min),
                         param_bound_text(p.type, p.max), p.max_exclusive ? ")" : "]");
    case ParamType::kBool: return "true|false";
    case ParamType::kString: return "";
    case ParamType::kChoice: {
      std::string s;
      for (const std::string& c : p.choices) s += (s.empty() ? "" : "|") + c;
      return s;
    }
  }
  return "";
}

}  // namespace

void add_methods_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("methods", "List the attention methods and their parameters");
  cmd->callback([] {
    // Columns as wide as their widest entry over every method: flag key=default, type, values.
    const auto param_flag = [](const MethodInfo& m, const ParamSpec& p) {
      return fmt::format("{} {}={}", m.make_decode ? "--param" : "--prefill-param", p.name, p.default_value);
    };
    size_t w_key = 0, w_values = 0;
    for (const auto& m : Registry::builtin().list())
      for (const auto& p : m.params) {
        w_key = std::max(w_key, param_flag(m, p).size());
        w_values = std::max(w_values, param_values_text(p).size());
      }
    for (const auto& m : Registry::builtin().list()) {
      fmt::print("{:<12} {:<15} {}\n", m.name, method_kind_name(m.kind), m.summary);
      fmt::print("{:<12} {:<15} paper: {}\n", "", "", m.paper);
      for (const auto& p : m.params)
        fmt::print("{:<14}{:<{}}  {:<6} {:<{}}  {}\n", "", param_flag(m, p), w_key, param_type_name(p.type),
                   param_values_text(p), w_values, p.help);
    }
  });
}

}  // namespace cumulus::cli
