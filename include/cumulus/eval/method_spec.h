// Which decode methods a run compares, from command-line style text: the entries of
// `--method a,b`, the `--param` overrides and the `--sweep` lists that turn one entry into
// several variants (the points of one curve in the KL-vs-K/V plot). `cumulus generate` and
// `cumulus eval` share this parser.
//
//   entry   "method" or "label=method"          tactic, psa_bound=psa
//   param   "key=value"                          every entry whose method declares key
//           "X.key=value"                        entries labelled X or running method X
//   sweep   "key=v1,v2,..." / "X.key=v1,v2,..."  one variant per value (several sweeps on
//                                                one entry: every combination)
// Every variant is checked as the method's constructor would check it (Registry::check): an
// unknown key, a bad value, a value out of range or a broken relation between values is an
// Error, and so is an override no entry declares, a second --param for the same entry and
// key, a label given twice, and a method that cannot decode. What needs the model's shape
// is method_specs_check's, once its header is read.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "cumulus/core/shape.h"

namespace cumulus {

struct MethodSpec {
  std::string label;   // unique within a run: "tactic", "tactic p=0.7", "psa_bound"
  std::string curve;   // the entry it came from (one curve per entry in plots)
  std::string method;  // registry name
  std::map<std::string, std::string> params;  // overrides (not the defaults)
};

std::vector<MethodSpec> method_specs_parse(const std::vector<std::string>& entries,
                                           const std::vector<std::string>& params = {},
                                           const std::vector<std::string>& sweeps = {});

// The checks of each spec that need the model (MethodInfo::check with its shape, e.g.
// quest's dense_layers within its layers), for the commands to run after reading the
// model's header and before loading its weights.
void method_specs_check(const std::vector<MethodSpec>& specs, const Shape& shape);

// "key=value" items (e.g. --prefill-param) as a map; an item without '=' or a key given
// twice is an Error naming `option`.
std::map<std::string, std::string> key_values_parse(const std::vector<std::string>& items, const char* option);

// A prefill method and its parameters as Session will build them: Error for an unknown
// method, one that cannot prefill, an unknown key, a bad value or a broken relation
// between values (flexprefill's min_budget <= max_budget); given the model's shape, also
// what needs it.
void prefill_spec_check(const std::string& method, const std::map<std::string, std::string>& params,
                        const Shape* shape = nullptr);

// A fixed-budget method (MethodInfo::budget_param) whose budget covers every one of
// `context` tokens attends them all: it runs dense attention under its name. The warning
// for that ("" when the budget is smaller), for the commands to print before the work.
std::string method_budget_warning(const MethodSpec& spec, int64_t context);

// "k1=v1 k2=v2" (sorted by key; "" for none), for labels and tables.
std::string params_text(const std::map<std::string, std::string>& params);

// The attention mass a method targets (its registry entry's target_param, from its
// resolved parameters), NaN for methods that target none.
double method_target(const std::string& method, const std::map<std::string, std::string>& resolved);

}  // namespace cumulus
