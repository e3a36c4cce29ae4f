// Comma-separated list options (cli.h: list_option). CLI11's own delimiter drops empty items,
// so "--lengths 1,,2" ran lengths 1 and 2 and "--lengths 1," ran 1: the items are split here,
// an empty one is refused, and numbers are read as core/number.h reads them.
#include <fmt/format.h>

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "cli.h"
#include "cumulus/core/number.h"

namespace cumulus::cli {
namespace {

// Every comma-separated item of every value given (the option may be repeated or take
// several values), in order; CLI::ValidationError names the option and the value holding an
// empty item.
std::vector<std::string> list_items(const std::string& name, const std::vector<std::string>& values) {
  std::vector<std::string> out;
  for (const std::string& v : values) {
    size_t b = 0;
    while (true) {
      const size_t e = v.find(',', b);
      std::string item = v.substr(b, e == std::string::npos ? std::string::npos : e - b);
      if (item.empty())
        throw CLI::ValidationError(name, "'" + v +
                                             "' has an empty item (a comma with nothing on one side, or an "
                                             "empty value): give one value between every two commas");
      out.push_back(std::move(item));
      if (e == std::string::npos) break;
      b = e + 1;
    }
  }
  return out;
}

template <class T>
std::string list_text(const std::vector<T>& v) {
  std::string s;
  for (const T& x : v) s += (s.empty() ? "" : ",") + fmt::format("{}", x);
  return "[" + s + "]";
}

template <class T, class Parse>
CLI::Option* list_add(CLI::App* cmd, const std::string& name, std::vector<T>* target, const std::string& help,
                      const std::string& type, Parse parse) {
  CLI::Option* opt = cmd->add_option_function<std::vector<std::string>>(
      name,
      [name, target, parse](const std::vector<std::string>& values) {
        std::vector<T> out;
        for (const std::string& item : list_items(name, values)) {
          T x{};
          const std::string err = parse(item, &x);
          if (!err.empty()) throw CLI::ValidationError(name, "'" + item + "' " + err);
          out.push_back(std::move(x));
        }
        *target = std::move(out);
      },
      help);
  opt->type_name(type);
  if (!target->empty()) opt->default_str(list_text(*target));
  return opt;
}

}  // namespace

CLI::Option* list_option(CLI::App* cmd, const std::string& name, std::vector<int>* target, const std::string& help) {
  return list_add(cmd, name, target, help, kListInt, [](const std::string& s, int* out) {
    int64_t v = 0;
    const std::string err = number_parse_int(s, INT_MIN, INT_MAX, &v);
    *out = static_cast<int>(v);
    return err;
  });
}

CLI::Option* list_option(CLI::App* cmd, const std::string& name, std::vector<double>* target, const std::string& help) {
  return list_add(cmd, name, target, help, kListFloat,
                  [](const std::string& s, double* out) { return number_parse_double(s, out); });
}

CLI::Option* list_option(CLI::App* cmd, const std::string& name, std::vector<std::string>* target,
                         const std::string& help) {
  return list_add(cmd, name, target, help, kListText, [](const std::string& s, std::string* out) {
    *out = s;
    return std::string();
  });
}

}  // namespace cumulus::cli
