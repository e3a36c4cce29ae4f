// Shared pieces of the Python module (python/src): the checks every array argument passes
// before any work, the errors they raise, and the registration functions of each file.
//
// Errors: bad input raises cumulus.Error (a ValueError) whose text is cumulus::Error::what(),
// "where: message"; `where` names the Python call ("Decoder.append"), the message the
// argument and its value, as the C++ library's own errors do.
#pragma once

#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cumulus/core/error.h"

namespace cumulus::python {

namespace nb = nanobind;

// Any array: numpy, torch or anything else that speaks DLPack or the buffer protocol, of any
// dtype, device and shape (read-only arrays too); array_check says what is wrong with it.
using AnyArray = nb::ndarray<nb::ro>;

template <typename... Args>
[[noreturn]] void fail(const char* where, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(where, fmt::format(format, std::forward<Args>(args)...));
}

// "float32", "float16", "bfloat16", "int64", ...: an array's dtype as numpy and torch name it.
std::string dtype_text(const AnyArray& a);
// "[2, 3, 64]"
std::string shape_text(const AnyArray& a);
// "cpu", "cuda:0", ...
std::string device_text(const AnyArray& a);
bool is_float32(const AnyArray& a);

// Checks that `a` (the argument `name` of the call `where`) is on the CPU, C-contiguous
// (dimensions of extent 1 may have any stride) and of rank `ndim` with `shape` (a -1 extent
// takes any size >= 1); raises cumulus.Error naming the argument and the value otherwise.
// A Decoder layer's decode steps summed since it was made (Decoder.totals): per sequence-step
// the tokens attended summed over query heads, the claims of heads that make one and their
// count, the share of the dense K/V bytes read (selection included), and (eval) the true mass
// of the attended sets and their count.
struct StepTotals {
  double steps = 0, tokens = 0, claimed = 0, claimed_n = 0, kv_share = 0, true_mass = 0, true_n = 0;
};

// device_type: nb::device::cpu::value, or nb::device::cuda::value for the CUDA Decoder.
void array_check(const char* where, const char* name, const AnyArray& a, const std::vector<int64_t>& shape,
                 int32_t device_type = nb::device::cpu::value);

// Python keyword arguments of a method's parameters (p=0.9, stop="certified") as the
// registry's key=value strings: bools "true"/"false", numbers and strings as Python's str().
std::map<std::string, std::string> param_strings(const char* where, const nb::dict& params);

// device is "cpu" or "cuda", and "cuda" only in a build with the CUDA backend.
void device_check(const char* where, const std::string& device);

// The machine's CPUs as the CLI counts them (this process's affinity mask), at most 256.
int default_threads();

void bind_methods(nb::module_& m);
void bind_model(nb::module_& m);
void bind_decoder(nb::module_& m);

}  // namespace cumulus::python
