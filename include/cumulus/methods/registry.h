// Method registry: every method registers its name, kind, paper and typed parameters with
// the paper's defaults. `cumulus methods` prints it; the CLI and harness build methods by
// name with key=value parameters checked against the spec.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cumulus/core/shape.h"
#include "cumulus/methods/method.h"
#include "cumulus/methods/policy.h"
#include "cumulus/methods/prefill.h"

namespace cumulus {

enum class ParamType { kInt, kDouble, kBool, kString };

struct ParamSpec {
  std::string name;
  ParamType type = ParamType::kDouble;
  std::string default_value;
  std::string help;
  double min = -1e300;  // inclusive range for numbers
  double max = 1e300;
  bool min_exclusive = false;  // e.g. P in (0, 1]
};

// Parameter values after validation against the spec (defaults filled in).
class Params {
 public:
  int get_int(const std::string& name) const;
  double get_double(const std::string& name) const;
  bool get_bool(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;
  const std::map<std::string, std::string>& values() const { return values_; }

 private:
  friend class Registry;
  std::map<std::string, std::string> values_;
};

struct MethodInfo {
  std::string name;
  std::string kind;   // "decode", "prefill" or "decode, prefill" (dense)
  std::string paper;  // where it comes from
  std::string summary;
  std::vector<ParamSpec> params;
  std::function<std::unique_ptr<DecodeMethod>(const Shape&, const Params&)> make_decode = nullptr;    // decode
  std::function<std::unique_ptr<PrefillMethod>(const Shape&, const Params&)> make_prefill = nullptr;  // prefill
  // A decode method defined once over the selection ops (methods/policy.h): every backend
  // runs this definition, and make_decode, when not set, is its CPU adapter.
  std::function<std::shared_ptr<const SelectPolicy>(const Shape&, const Params&)> make_policy = nullptr;
  // The parameter holding the attention mass the method targets ("p", PSA's "threshold");
  // empty for methods that target none (fixed budgets). Evaluation reports "reached P"
  // against it.
  std::string target_param = {};
};

class Registry {
 public:
  // The registry with every built-in method.
  static const Registry& builtin();

  void add(MethodInfo info);
  const MethodInfo& find(const std::string& name) const;  // throws Error listing known names
  const std::vector<MethodInfo>& list() const { return methods_; }

  // Validates key=value overrides against the spec (unknown key, bad number, out of
  // range: Error naming method, key and value) and fills in defaults.
  Params parse(const std::string& name, const std::map<std::string, std::string>& overrides) const;
  std::unique_ptr<DecodeMethod> make(const std::string& name, const Shape& shape,
                                     const std::map<std::string, std::string>& overrides = {}) const;
  // The policy of a method defined once over the selection ops (Error for any other).
  std::shared_ptr<const SelectPolicy> make_policy(const std::string& name, const Shape& shape,
                                                  const std::map<std::string, std::string>& overrides = {}) const;
  // The same for prefill methods (Error for a method without a prefill factory).
  std::unique_ptr<PrefillMethod> make_prefill(const std::string& name, const Shape& shape,
                                              const std::map<std::string, std::string>& overrides = {}) const;

 private:
  std::vector<MethodInfo> methods_;
};

// Each method file defines one of these; registry.cpp calls them all (explicit calls, so
// no static-initialisation order or dead-stripping surprises).
void register_dense(Registry& r);
void register_oracle_topk(Registry& r);
void register_oracle_topp(Registry& r);
void register_streaming(Registry& r);
void register_quest(Registry& r);
// Seed methods (issue 4): src/methods/{tactic,psa,lfps}.cpp.
void register_tactic(Registry& r);
void register_sketch_topp(Registry& r);
void register_psa(Registry& r);
void register_lfps(Registry& r);
// Prefill methods (issue 7): src/methods/flexprefill.cpp (dense registers both kinds).
void register_flexprefill(Registry& r);

}  // namespace cumulus
