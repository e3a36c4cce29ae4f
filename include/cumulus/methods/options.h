// A method's options as one struct: each field's key, range and help are written once,
// beside its default, in the struct's `fields` member template:
//
//   struct QuestOptions {
//     int budget = 2048;
//     template <class F> void fields(F& f) {
//       f.number(budget, "budget", ParamRange::closed(1, 1 << 30), "token budget per query head");
//     }
//     void check() const;                // optional: relations between fields
//     void check(const Shape&) const;    // optional: relations with the model's shape
//   };
//
// options_params<O>() generates the registry's parameter list from it (the defaults are a
// default-constructed O's fields), options_read<O>(params) reads checked key=value
// parameters into an O, and options_check<O>() is the registry's check of a parameter set:
// keys, values and ranges (Registry::parse), then the relations, before any work.
#pragma once

#include <charconv>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "cumulus/core/shape.h"

namespace cumulus {

// Bounds of a number parameter, each inclusive or exclusive.
struct ParamRange {
  double min = -1e300;
  double max = 1e300;
  bool min_exclusive = false;
  bool max_exclusive = false;
  static constexpr ParamRange closed(double lo, double hi) { return {lo, hi, false, false}; }      // [lo, hi]
  static constexpr ParamRange left_open(double lo, double hi) { return {lo, hi, true, false}; }   // (lo, hi]
  static constexpr ParamRange right_open(double lo, double hi) { return {lo, hi, false, true}; }  // [lo, hi)
};

// kChoice: one of `choices`, the field an enum or bool whose value is the name's index.
enum class ParamType { kInt, kDouble, kBool, kString, kChoice };

struct ParamSpec {
  std::string name;
  ParamType type = ParamType::kDouble;
  std::string default_value;
  std::string help;
  double min = -1e300;  // range for numbers, inclusive unless marked exclusive
  double max = 1e300;
  bool min_exclusive = false;  // e.g. P in (0, 1]
  bool max_exclusive = false;  // e.g. a decay in [0, 1)
  std::vector<std::string> choices = {};  // kChoice: the names allowed
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

namespace options_detail {

template <class T>
std::string number_text(T v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that reads back as v
  return std::string(buf, r.ptr);
}

// Appends one ParamSpec per field, its default the field's value.
struct SpecWriter {
  std::vector<ParamSpec>* out;
  template <class T>
  void number(T& field, const char* key, ParamRange r, const char* help) {
    static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, "a number field is an integer or a float");
    out->push_back({.name = key,
                    .type = std::is_floating_point_v<T> ? ParamType::kDouble : ParamType::kInt,
                    .default_value = number_text(field),
                    .help = help,
                    .min = r.min,
                    .max = r.max,
                    .min_exclusive = r.min_exclusive,
                    .max_exclusive = r.max_exclusive});
  }
  template <class E>
  void choice(E& field, const char* key, std::initializer_list<const char*> names, const char* help) {
    ParamSpec s;
    s.name = key;
    s.type = ParamType::kChoice;
    s.help = help;
    for (const char* n : names) s.choices.push_back(n);
    s.default_value = s.choices.at(static_cast<size_t>(field));
    out->push_back(std::move(s));
  }
};

// Sets each field from checked parameters.
struct Reader {
  const Params* p;
  template <class T>
  void number(T& field, const char* key, ParamRange, const char*) {
    if constexpr (std::is_floating_point_v<T>)
      field = static_cast<T>(p->get_double(key));
    else
      field = static_cast<T>(p->get_int(key));
  }
  template <class E>
  void choice(E& field, const char* key, std::initializer_list<const char*> names, const char*) {
    const std::string& v = p->get_string(key);
    size_t i = 0;
    for (const char* n : names) {
      if (v == n) field = static_cast<E>(i);
      ++i;
    }
  }
};

}  // namespace options_detail

// The registry's parameter list of O: one ParamSpec per field, in `fields` order.
template <class O>
std::vector<ParamSpec> options_params() {
  std::vector<ParamSpec> out;
  O defaults{};
  options_detail::SpecWriter w{&out};
  defaults.fields(w);
  return out;
}

// Checked parameters (Registry::parse) read into an O; its relations checked (O::check(),
// an Error naming the fields) when it has them.
template <class O>
void options_read(const Params& p, O& o) {
  options_detail::Reader r{&p};
  o.fields(r);
  if constexpr (requires(const O& x) { x.check(); }) o.check();
}
// The same into a fresh O. The form above fills a struct derived from the options (the GPU
// pipelines' TacticGpuOptions), leaving its own fields as they are.
template <class O>
O options_read(const Params& p) {
  O o{};
  options_read(p, o);
  return o;
}

// MethodInfo::check for O: the relations between its fields and, given a shape, those
// with the model (O::check(const Shape&)).
template <class O>
std::function<void(const Params&, const Shape*)> options_check() {
  return [](const Params& p, const Shape* shape) {
    const O o = options_read<O>(p);
    if constexpr (requires(const O& x, const Shape& s) { x.check(s); })
      if (shape != nullptr) o.check(*shape);
  };
}

}  // namespace cumulus
