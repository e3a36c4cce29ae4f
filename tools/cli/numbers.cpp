// Number options read one way in every subcommand (cli.h: options_numbers_decimal).
#include <climits>
#include <string>

#include "cli.h"
#include "cumulus/core/number.h"

namespace cumulus::cli {
namespace {

// CLI11 names an option's type "INT" (here always `int`), "UINT" (uint64_t seeds) or
// "FLOAT", followed by its validators' descriptions.
CLI::Validator number_transform(const std::string& type) {
  if (type.starts_with("INT")) return decimal_range(INT_MIN, INT_MAX).description("");
  if (type.starts_with("UINT")) return seed_check().description("");
  return CLI::Validator(
      [](std::string& s) -> std::string {
        double v = 0;
        const std::string err = number_parse_double(s, &v);
        return err.empty() ? err : "'" + s + "' " + err;
      },
      "");
}

}  // namespace

void options_numbers_decimal(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands({})) {
    for (CLI::Option* opt : sub->get_options()) {
      const std::string type = opt->get_type_name();
      if (type.find(',') != std::string::npos) continue;  // a list_option reads its own items
      if (type.starts_with("INT") || type.starts_with("UINT") || type.starts_with("FLOAT"))
        opt->transform(number_transform(type));
    }
  }
}

}  // namespace cumulus::cli
