// The module cumulus._cumulus: the exception every bad input raises, the array checks the
// bindings share, the registry as cumulus.methods(), and the build's facts (SIMD target,
// CUDA). The engine is model.cpp, the methods on arrays decoder.cpp.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "binding.h"
#include "cumulus/kernels/simd.h"
#include "cumulus/methods/registry.h"

namespace cumulus::python {

std::string dtype_text(const AnyArray& a) {
  const nb::dlpack::dtype t = a.dtype();
  using C = nb::dlpack::dtype_code;
  const char* code = nullptr;
  if (t.code == uint8_t(C::Bool)) return "bool";
  if (t.code == uint8_t(C::Int)) code = "int";
  if (t.code == uint8_t(C::UInt)) code = "uint";
  if (t.code == uint8_t(C::Float)) code = "float";
  if (t.code == uint8_t(C::Bfloat)) code = "bfloat";
  if (t.code == uint8_t(C::Complex)) code = "complex";
  if (code == nullptr) return fmt::format("DLPack type code {} of {} bits", t.code, t.bits);
  return fmt::format("{}{}{}", code, t.bits, t.lanes == 1 ? std::string() : fmt::format("x{}", t.lanes));
}

std::string shape_text(const AnyArray& a) {
  std::vector<int64_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<int64_t>(a.shape(i));
  return fmt::format("[{}]", fmt::join(s, ", "));
}

std::string device_text(const AnyArray& a) {
  const int t = a.device_type();
  if (t == nb::device::cpu::value) return "cpu";
  if (t == nb::device::cuda::value) return fmt::format("cuda:{}", a.device_id());
  if (t == nb::device::cuda_host::value) return "cuda_host";
  if (t == nb::device::cuda_managed::value) return fmt::format("cuda_managed:{}", a.device_id());
  return fmt::format("dlpack device type {}", t);
}

bool is_float32(const AnyArray& a) { return a.dtype() == nb::dtype<float>(); }

void array_check(const char* where, const char* name, const AnyArray& a, const std::vector<int64_t>& shape,
                 int32_t device_type) {
  if (a.device_type() != device_type) {
    if (device_type == nb::device::cpu::value)
      fail(where, "{} is on {}: this object works on cpu arrays (numpy, torch CPU tensors)", name, device_text(a));
    fail(where, "{} is on {}: this Decoder works on cuda tensors", name, device_text(a));
  }
  bool shape_ok = a.ndim() == shape.size();
  for (size_t i = 0; shape_ok && i < shape.size(); ++i)
    shape_ok = shape[i] < 0 ? a.shape(i) >= 1 : static_cast<int64_t>(a.shape(i)) == shape[i];
  if (!shape_ok) {
    std::vector<std::string> want;
    for (int64_t s : shape) want.push_back(s < 0 ? "n" : std::to_string(s));
    fail(where, "{} has shape {}: expected [{}]", name, shape_text(a), fmt::join(want, ", "));
  }
  // C order: each dimension's stride (in elements) is the product of the extents after it;
  // an extent-1 dimension may have any stride (torch gives such dimensions arbitrary ones).
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) {
      std::vector<int64_t> strides(a.ndim());
      for (size_t j = 0; j < a.ndim(); ++j) strides[j] = a.stride(j);
      fail(where, "{} is not C-contiguous (shape {}, strides [{}] in elements): pass a contiguous array "
                  "(numpy.ascontiguousarray, tensor.contiguous())",
           name, shape_text(a), fmt::join(strides, ", "));
    }
    expect *= static_cast<int64_t>(a.shape(i));
  }
}

void device_check(const char* where, const std::string& device) {
  if (device != "cpu" && device != "cuda") fail(where, "device='{}' must be 'cpu' or 'cuda'", device);
#ifndef CUMULUS_HAVE_CUDA
  if (device == "cuda")
    fail(where, "device='cuda': this build of cumulus has no CUDA backend (pip install . -C "
                "cmake.define.CUMULUS_CUDA=ON)");
#endif
}

std::map<std::string, std::string> param_strings(const char* where, const nb::dict& params) {
  std::map<std::string, std::string> out;
  for (auto [key, value] : params) {
    if (!nb::isinstance<nb::str>(key)) fail(where, "parameter name {} is not a string", nb::repr(key).c_str());
    const std::string k = nb::cast<std::string>(key);
    std::string v;
    if (nb::isinstance<nb::bool_>(value)) {
      v = nb::cast<bool>(value) ? "true" : "false";
    } else if (nb::isinstance<nb::int_>(value) || nb::isinstance<nb::float_>(value) ||
               nb::isinstance<nb::str>(value)) {
      v = nb::cast<std::string>(nb::str(value));
    } else {
      fail(where, "parameter {}={}: expected a number, a bool or a string", k, nb::repr(value).c_str());
    }
    out[k] = v;
  }
  return out;
}

int default_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  return std::clamp(n > 0 ? n : static_cast<int>(std::thread::hardware_concurrency()), 1, 256);
}

namespace {

// cumulus.methods(): the registry as Python objects.
struct PyParam {
  std::string name, type, help;
  nb::object default_value;
  nb::object min, max;  // None when unbounded
  bool min_exclusive = false;
  bool max_exclusive = false;
  std::vector<std::string> choices;  // type 'choice': the names allowed
};

struct PyMethod {
  std::string name, kind, paper, summary, target_param, budget_param;
  bool decodes = false, prefills = false;
  std::vector<PyParam> params;
};

nb::object typed_value(ParamType type, const std::string& text) {
  switch (type) {
    case ParamType::kInt: return nb::int_(std::stoll(text));
    case ParamType::kDouble: return nb::float_(std::stod(text));
    case ParamType::kBool: return nb::bool_(text == "true" || text == "1");
    case ParamType::kString:
    case ParamType::kChoice: return nb::str(text.c_str());
  }
  return nb::none();
}

const char* type_name(ParamType type) {
  switch (type) {
    case ParamType::kInt: return "int";
    case ParamType::kDouble: return "float";
    case ParamType::kBool: return "bool";
    case ParamType::kString: return "str";
    case ParamType::kChoice: return "choice";
  }
  return "?";
}

nb::object bound(ParamType type, double v) {
  if (std::fabs(v) >= 1e300 || (type != ParamType::kInt && type != ParamType::kDouble)) return nb::none();
  return type == ParamType::kInt ? nb::object(nb::int_(static_cast<long long>(v))) : nb::object(nb::float_(v));
}

std::vector<PyMethod> methods_list() {
  std::vector<PyMethod> out;
  for (const MethodInfo& m : Registry::builtin().list()) {
    PyMethod p{m.name, method_kind_name(m.kind), m.paper, m.summary, m.target_param, m.budget_param,
               method_kind_decodes(m.kind), m.kind != MethodKind::decode, {}};
    for (const ParamSpec& s : m.params)
      p.params.push_back({s.name, type_name(s.type), s.help, typed_value(s.type, s.default_value),
                          bound(s.type, s.min), bound(s.type, s.max), s.min_exclusive, s.max_exclusive, s.choices});
    out.push_back(std::move(p));
  }
  return out;
}

// cumulus.Error (python/cumulus/_errors.py): a ValueError and a RuntimeError, carrying the C++
// error's text and its parts. A strong reference the module never releases (a static nb::object would be destroyed after
// the interpreter).
PyObject* error_type = nullptr;

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    nb::object inst = nb::handle(error_type)(nb::str(e.what()));
    inst.attr("where") = nb::str(e.where().c_str());
    inst.attr("message") = nb::str(e.message().c_str());
    PyErr_SetObject(error_type, inst.ptr());
  }
}

}  // namespace

void bind_methods(nb::module_& m) {
  nb::class_<PyParam>(m, "Param", "A method parameter as the registry declares it (cumulus.methods()).")
      .def_ro("name", &PyParam::name)
      .def_ro("type", &PyParam::type, "'int', 'float', 'bool', 'str' or 'choice' (a str, one of choices)")
      .def_ro("default", &PyParam::default_value, "the paper's default, typed")
      .def_ro("help", &PyParam::help)
      .def_ro("min", &PyParam::min, "inclusive lower bound (exclusive when min_exclusive); None: unbounded")
      .def_ro("max", &PyParam::max, "inclusive upper bound (exclusive when max_exclusive); None: unbounded")
      .def_ro("min_exclusive", &PyParam::min_exclusive)
      .def_ro("max_exclusive", &PyParam::max_exclusive)
      .def_ro("choices", &PyParam::choices, "the names a 'choice' parameter takes (empty otherwise)")
      .def("__repr__", [](const PyParam& p) {
        return fmt::format("Param({}: {} = {})", p.name, p.type, nb::repr(p.default_value).c_str());
      });
  nb::class_<PyMethod>(m, "Method", "A registered method (cumulus.methods()).")
      .def_ro("name", &PyMethod::name)
      .def_ro("kind", &PyMethod::kind, "'decode', 'prefill' or 'decode, prefill'")
      .def_ro("decodes", &PyMethod::decodes, "usable as Model.generate's method and by Decoder")
      .def_ro("prefills", &PyMethod::prefills, "usable as Model.generate's prefill")
      .def_ro("paper", &PyMethod::paper)
      .def_ro("summary", &PyMethod::summary)
      .def_ro("params", &PyMethod::params)
      .def_ro("target_param", &PyMethod::target_param, "the parameter holding the mass it targets ('' if none)")
      .def_ro("budget_param", &PyMethod::budget_param, "the parameter holding its fixed budget ('' if none)")
      .def("__repr__", [](const PyMethod& p) { return fmt::format("Method({}, {})", p.name, p.kind); });
  m.def("methods", &methods_list,
        "Every method of the registry, with its kind, paper, and parameters (type, default, range, help).");
  m.def("simd_target", &cpu::simd_target, "The SIMD target the CPU kernels run (CUMULUS_SIMD caps it).");
#ifdef CUMULUS_HAVE_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}

}  // namespace cumulus::python

NB_MODULE(_cumulus, m) {
  namespace nb = nanobind;
  namespace py = cumulus::python;
  m.doc() = "cumulus: adaptive sparse attention for long-context LLM inference (docs/python.md)";
  // cumulus.Error lives in python/cumulus/_errors.py (typed, documented); the module holds it.
  py::error_type = nb::object(nb::module_::import_("cumulus._errors").attr("Error")).release().ptr();
  m.attr("Error") = nb::handle(py::error_type);
  nb::register_exception_translator(&py::translate_error);
  py::bind_methods(m);
  py::bind_model(m);
  py::bind_decoder(m);
}
