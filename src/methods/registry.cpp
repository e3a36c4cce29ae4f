// The method registry: names, kinds, typed parameters with defaults, and factories.
#include "cumulus/methods/registry.h"

#include <charconv>
#include <cmath>
#include <mutex>

#include "core/check.h"

namespace cumulus {

namespace {

const ParamSpec* find_spec(const MethodInfo& m, const std::string& key) {
  for (const auto& p : m.params)
    if (p.name == key) return &p;
  return nullptr;
}

double parse_number(const MethodInfo& m, const ParamSpec& p, const std::string& value) {
  double x = 0;
  const char* b = value.data();
  const char* e = b + value.size();
  if (p.type == ParamType::kInt) {
    long long v = 0;
    auto r = std::from_chars(b, e, v);
    CUMULUS_CHECK(r.ec == std::errc() && r.ptr == e, "method '{}': parameter {}='{}' is not an integer", m.name,
                  p.name, value);
    x = static_cast<double>(v);
  } else {
    auto r = std::from_chars(b, e, x);
    CUMULUS_CHECK(r.ec != std::errc::result_out_of_range || r.ptr != e,
                  "method '{}': parameter {}='{}' is beyond what a double holds (its magnitude must be 0 or between "
                  "about 1e-308 and 1e308)",
                  m.name, p.name, value);
    CUMULUS_CHECK(r.ec == std::errc() && r.ptr == e && std::isfinite(x),
                  "method '{}': parameter {}='{}' is not a finite number", m.name, p.name, value);
  }
  const bool low_ok = p.min_exclusive ? x > p.min : x >= p.min;
  CUMULUS_CHECK(low_ok && x <= p.max, "method '{}': parameter {}={} must be in {}{}, {}]", m.name, p.name, value,
                p.min_exclusive ? "(" : "[", p.min, p.max);
  return x;
}

void check_value(const MethodInfo& m, const ParamSpec& p, const std::string& value) {
  switch (p.type) {
    case ParamType::kInt:
    case ParamType::kDouble: parse_number(m, p, value); break;
    case ParamType::kBool:
      CUMULUS_CHECK(value == "true" || value == "false" || value == "1" || value == "0",
                    "method '{}': parameter {}='{}' must be true or false", m.name, p.name, value);
      break;
    case ParamType::kString: break;
  }
}

}  // namespace

const char* method_kind_name(MethodKind kind) {
  switch (kind) {
    case MethodKind::decode: return "decode";
    case MethodKind::prefill: return "prefill";
    case MethodKind::decode_and_prefill: return "decode, prefill";
  }
  return "?";
}

int Params::get_int(const std::string& name) const {
  auto it = values_.find(name);
  CUMULUS_CHECK(it != values_.end(), "no parameter '{}'", name);
  return std::stoi(it->second);
}

double Params::get_double(const std::string& name) const {
  auto it = values_.find(name);
  CUMULUS_CHECK(it != values_.end(), "no parameter '{}'", name);
  return std::stod(it->second);
}

bool Params::get_bool(const std::string& name) const {
  auto it = values_.find(name);
  CUMULUS_CHECK(it != values_.end(), "no parameter '{}'", name);
  return it->second == "true" || it->second == "1";
}

const std::string& Params::get_string(const std::string& name) const {
  auto it = values_.find(name);
  CUMULUS_CHECK(it != values_.end(), "no parameter '{}'", name);
  return it->second;
}

void Registry::add(MethodInfo info) {
  for (const auto& m : methods_) CUMULUS_CHECK(m.name != info.name, "method '{}' registered twice", info.name);
  for (const auto& p : info.params) check_value(info, p, p.default_value);
  const bool decodes = info.make_decode != nullptr || info.make_policy != nullptr;
  CUMULUS_CHECK(decodes == method_kind_decodes(info.kind) &&
                    (info.make_prefill != nullptr) == (info.kind != MethodKind::decode),
                "method '{}': kind {} does not match its factories (decode: {}, prefill: {})", info.name,
                method_kind_name(info.kind), decodes, info.make_prefill != nullptr);
  for (const std::string* key : {&info.target_param, &info.budget_param})
    CUMULUS_CHECK(key->empty() || find_spec(info, *key) != nullptr, "method '{}': no parameter '{}' to target",
                  info.name, *key);
  if (info.make_policy != nullptr && info.make_decode == nullptr) {
    info.make_decode = [make = info.make_policy, name = info.name](const Shape& s, const Params& p) {
      return make_policy_method(s, name, make(s, p));
    };
  }
  methods_.push_back(std::move(info));
}

bool Registry::attach_gpu(const std::string& name, GpuPipeline gpu) {
  CUMULUS_CHECK(gpu.make != nullptr, "method '{}': a GPU pipeline needs its factory", name);
  for (auto& m : methods_) {
    if (m.name != name) continue;
    CUMULUS_CHECK(method_kind_decodes(m.kind), "method '{}' is a prefill method: no decode pipeline to attach", name);
    m.gpu = std::move(gpu);
    return true;
  }
  return false;
}

const MethodInfo* Registry::find_if_known(const std::string& name) const {
  for (const auto& m : methods_)
    if (m.name == name) return &m;
  return nullptr;
}

const MethodInfo& Registry::find(const std::string& name) const {
  if (const MethodInfo* m = find_if_known(name)) return *m;
  std::string known;
  for (const auto& m : methods_) known += (known.empty() ? "" : ", ") + m.name;
  CUMULUS_FAIL("method='{}' is unknown (known: {})", name, known);
}

Params Registry::parse(const std::string& name, const std::map<std::string, std::string>& overrides) const {
  const MethodInfo& m = find(name);
  Params out;
  for (const auto& p : m.params) out.values_[p.name] = p.default_value;
  for (const auto& [key, value] : overrides) {
    const ParamSpec* p = find_spec(m, key);
    if (p == nullptr) {
      std::string known;
      for (const auto& q : m.params) known += (known.empty() ? "" : ", ") + q.name;
      CUMULUS_FAIL("method '{}' has no parameter '{}' (it has: {})", name, key, known.empty() ? "none" : known);
    }
    check_value(m, *p, value);
    out.values_[key] = value;
  }
  return out;
}

std::unique_ptr<DecodeMethod> Registry::make(const std::string& name, const Shape& shape,
                                             const std::map<std::string, std::string>& overrides) const {
  shape.validate();
  const MethodInfo& m = find(name);
  CUMULUS_CHECK(m.make_decode != nullptr, "method '{}' is a {} method, not a decode method", name,
                method_kind_name(m.kind));
  return m.make_decode(shape, parse(name, overrides));
}

std::shared_ptr<const SelectPolicy> Registry::make_policy(const std::string& name, const Shape& shape,
                                                          const std::map<std::string, std::string>& overrides) const {
  const MethodInfo& m = find(name);
  CUMULUS_CHECK(m.make_policy != nullptr, "method '{}' is not defined over the selection ops (methods/policy.h)", name);
  shape.validate();
  return m.make_policy(shape, parse(name, overrides));
}

std::unique_ptr<PrefillMethod> Registry::make_prefill(const std::string& name, const Shape& shape,
                                                      const std::map<std::string, std::string>& overrides) const {
  shape.validate();
  const MethodInfo& m = find(name);
  CUMULUS_CHECK(m.make_prefill != nullptr, "method '{}' is a {} method, not a prefill method", name,
                method_kind_name(m.kind));
  return m.make_prefill(shape, parse(name, overrides));
}

const Registry& Registry::builtin() {
  static const Registry registry = [] {
    Registry r;
    register_dense(r);
    register_oracle_topk(r);
    register_oracle_topp(r);
    register_streaming(r);
    register_quest(r);
    register_tactic(r);
    register_psa(r);
    register_lfps(r);
    register_sketch_topp(r);
    register_flexprefill(r);
    return r;
  }();
  return registry;
}

}  // namespace cumulus
