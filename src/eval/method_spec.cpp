// Method entries, parameter overrides and sweeps from command-line text (method_spec.h).
#include "cumulus/eval/method_spec.h"

#include <algorithm>
#include <limits>

#include "core/check.h"
#include "cumulus/core/number.h"
#include "cumulus/methods/registry.h"

namespace cumulus {
namespace {

bool declares(const std::string& method, const std::string& key) {
  const MethodInfo& info = Registry::builtin().find(method);
  return std::any_of(info.params.begin(), info.params.end(), [&](const ParamSpec& p) { return p.name == key; });
}

struct Override {
  std::string target;  // label or method name; "" = every entry declaring the key
  std::string key, value;
};

// "key=value" or "X.key=value". The target is split off at the first '.' before the '=';
// parameter names have no dots, values may (0.9).
Override override_parse(const std::string& text, const char* option) {
  const size_t eq = text.find('=');
  CUMULUS_CHECK(eq != std::string::npos && eq > 0, "{} '{}' must be key=value or method.key=value", option, text);
  Override o;
  std::string key = text.substr(0, eq);
  o.value = text.substr(eq + 1);
  const size_t dot = key.find('.');
  if (dot != std::string::npos) {
    o.target = key.substr(0, dot);
    key = key.substr(dot + 1);
  }
  CUMULUS_CHECK(!key.empty() && (dot == std::string::npos || !o.target.empty()), "{} '{}': empty method or key",
                option, text);
  o.key = key;
  return o;
}

// Indices of the entries an override applies to: those labelled X and those running method
// X; without X, every entry declaring the key. Throws when none does.
std::vector<size_t> override_targets(const std::vector<MethodSpec>& entries, const Override& o, const std::string& text,
                                     const char* option) {
  std::vector<size_t> out;
  if (!o.target.empty()) {
    for (size_t i = 0; i < entries.size(); ++i)
      if (entries[i].label == o.target || entries[i].method == o.target) out.push_back(i);
    CUMULUS_CHECK(!out.empty(), "{} '{}': '{}' is neither a selected label nor a selected method", option, text,
                  o.target);
    for (size_t i : out)
      CUMULUS_CHECK(declares(entries[i].method, o.key), "{} '{}': method {} has no parameter '{}'", option, text,
                    entries[i].method, o.key);
  } else {
    for (size_t i = 0; i < entries.size(); ++i)
      if (declares(entries[i].method, o.key)) out.push_back(i);
    CUMULUS_CHECK(!out.empty(), "{} '{}': no selected method has parameter '{}'", option, text, o.key);
  }
  return out;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  while (true) {
    const size_t e = s.find(',', b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

}  // namespace

std::map<std::string, std::string> key_values_parse(const std::vector<std::string>& items, const char* option) {
  std::map<std::string, std::string> out;
  for (const auto& p : items) {
    const size_t eq = p.find('=');
    CUMULUS_CHECK(eq != std::string::npos && eq > 0, "{} '{}' must be key=value", option, p);
    const auto [it, fresh] = out.emplace(p.substr(0, eq), p.substr(eq + 1));
    CUMULUS_CHECK(fresh, "{} '{}': key '{}' is given twice", option, p, it->first);
  }
  return out;
}

void prefill_spec_check(const std::string& method, const std::map<std::string, std::string>& params,
                        const Shape* shape) {
  const MethodInfo& info = Registry::builtin().find(method);
  CUMULUS_CHECK(info.make_prefill != nullptr, "--prefill {}: a {} method, not a prefill method", method,
                method_kind_name(info.kind));
  Registry::builtin().check(method, params, shape);
}

void method_specs_check(const std::vector<MethodSpec>& specs, const Shape& shape) {
  for (const MethodSpec& s : specs) Registry::builtin().check(s.method, s.params, &shape);
}

std::string method_budget_warning(const MethodSpec& spec, int64_t context) {
  const MethodInfo& m = Registry::builtin().find(spec.method);
  if (m.budget_param.empty()) return "";
  const Params p = Registry::builtin().parse(spec.method, spec.params);
  const int64_t budget = p.get_int(m.budget_param);
  if (budget < context) return "";
  return fmt::format("warning: {}: {}={} covers the whole {}-token context, so it attends every token (dense "
                     "attention under another name); give a smaller {}",
                     spec.label, m.budget_param, budget, context, m.budget_param);
}

std::string params_text(const std::map<std::string, std::string>& params) {
  std::string s;
  for (const auto& [k, v] : params) s += (s.empty() ? "" : " ") + k + "=" + v;
  return s;
}

std::vector<MethodSpec> method_specs_parse(const std::vector<std::string>& entries,
                                           const std::vector<std::string>& params,
                                           const std::vector<std::string>& sweeps) {
  CUMULUS_CHECK(!entries.empty(), "no method selected");
  // Entries are split at commas here, so an empty name ("dense," or "a,,b") is refused
  // (CLI11's own splitting drops it).
  std::vector<std::string> names;
  for (const auto& e : entries)
    for (const auto& name : split_commas(e)) {
      CUMULUS_CHECK(!name.empty(), "--method '{}': empty method name in the list", e);
      names.push_back(name);
    }
  std::vector<MethodSpec> base;
  for (const auto& e : names) {
    const size_t eq = e.find('=');
    MethodSpec s;
    s.method = eq == std::string::npos ? e : e.substr(eq + 1);
    s.label = eq == std::string::npos ? e : e.substr(0, eq);
    CUMULUS_CHECK(!s.label.empty() && !s.method.empty(), "--method entry '{}' must be method or label=method", e);
    CUMULUS_CHECK(s.label.find_first_of(" .,") == std::string::npos,
                  "--method entry '{}': a label may not contain spaces, dots or commas", e);
    const MethodInfo& info = Registry::builtin().find(s.method);  // throws, listing the known names
    CUMULUS_CHECK(info.make_decode != nullptr, "--method entry '{}': {} is a {} method, not a decode method", e,
                  s.method, method_kind_name(info.kind));
    for (const auto& b : base) CUMULUS_CHECK(b.label != s.label, "--method: label '{}' is given twice", s.label);
    s.curve = s.label;
    base.push_back(std::move(s));
  }
  // Which --param set each (entry, key): a second one for the same pair is an Error, not a
  // silent "last one wins".
  std::vector<std::map<std::string, std::string>> set_by(base.size());
  for (const auto& p : params) {
    const Override o = override_parse(p, "--param");
    for (size_t i : override_targets(base, o, p, "--param")) {
      const auto [it, fresh] = set_by[i].emplace(o.key, p);
      CUMULUS_CHECK(fresh, "--param '{}': {}'s parameter '{}' is already set by --param '{}'", p, base[i].label, o.key,
                    it->second);
      base[i].params[o.key] = o.value;
    }
  }
  // Sweeps: per entry, the list of (key, values) in the order given.
  std::vector<std::vector<std::pair<std::string, std::vector<std::string>>>> entry_sweeps(base.size());
  for (const auto& s : sweeps) {
    const Override o = override_parse(s, "--sweep");
    const std::vector<std::string> values = split_commas(o.value);
    for (size_t a = 0; a < values.size(); ++a) {
      CUMULUS_CHECK(!values[a].empty(), "--sweep '{}': empty value in the list", s);
      for (size_t b = 0; b < a; ++b) {
        double x = 0, y = 0;
        const bool same = values[a] == values[b] || (number_parse_double(values[a], &x).empty() &&
                                                     number_parse_double(values[b], &y).empty() && x == y);
        CUMULUS_CHECK(!same, "--sweep '{}': values '{}' and '{}' are the same value (it would run twice)", s,
                      values[b], values[a]);
      }
    }
    for (size_t i : override_targets(base, o, s, "--sweep")) {
      const auto set = set_by[i].find(o.key);
      CUMULUS_CHECK(set == set_by[i].end(), "--sweep '{}' and --param '{}' both set {}'s parameter '{}': drop one",
                    s, set == set_by[i].end() ? "" : set->second, base[i].label, o.key);
      for (const auto& [k, vs] : entry_sweeps[i])
        CUMULUS_CHECK(k != o.key, "--sweep '{}': {} already sweeps '{}'", s, base[i].label, k);
      entry_sweeps[i].emplace_back(o.key, values);
    }
  }
  std::vector<MethodSpec> out;
  for (size_t i = 0; i < base.size(); ++i) {
    std::vector<MethodSpec> variants{base[i]};
    for (const auto& [key, values] : entry_sweeps[i]) {
      std::vector<MethodSpec> next;
      for (const auto& v : variants)
        for (const auto& value : values) {
          MethodSpec s = v;
          s.params[key] = value;
          s.label += " " + key + "=" + value;
          next.push_back(std::move(s));
        }
      variants = std::move(next);
    }
    // Check every variant now, as its constructor would, so a typo fails before any model work.
    for (const auto& v : variants) Registry::builtin().check(v.method, v.params);
    out.insert(out.end(), variants.begin(), variants.end());
  }
  return out;
}

double method_target(const std::string& method, const std::map<std::string, std::string>& resolved) {
  const std::string& key = Registry::builtin().find(method).target_param;
  if (key.empty()) return std::numeric_limits<double>::quiet_NaN();
  return std::stod(resolved.at(key));
}

}  // namespace cumulus
