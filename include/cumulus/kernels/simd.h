// Which SIMD target the CPU kernels run on. Every Highway kernel is compiled once per target
// (scalar emulation, SSE4, AVX2, AVX-512; AVX-512 with VNNI for the quantised GEMV and the
// key sketch) and dispatched at run time to the best one the CPU supports. simd_select
// caps that choice, so one machine can measure and test what a lesser CPU runs: an
// AVX-512 machine with CUMULUS_SIMD=avx2 runs the AVX2 code paths, bit for bit as an
// AVX2-only CPU would (OpenBLAS, which the float32 weights use, picks its own kernels:
// OPENBLAS_CORETYPE=Haswell asks it for the AVX2 ones).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace cumulus::cpu {

// Target names, best first, as simd_select takes them: "avx512vnni" (Highway's AVX3_DL),
// "avx512" (AVX3), "avx2", "sse4", "scalar" (EMU128). Only those compiled into this build.
std::vector<std::string> simd_targets_compiled();

// The subset of simd_targets_compiled() this CPU can run, best first.
std::vector<std::string> simd_targets_supported();

// Caps dispatch at `name` (one of the names above): kernels compiled for it run on it,
// the others on the best lower target. Throws cumulus::Error naming the value when the
// name is unknown, not compiled in, or beyond this CPU. "" or "native" restores the CPU's
// own best. Call it before kernels run on other threads; it is not synchronised with them.
void simd_select(std::string_view name);

// simd_select(getenv("CUMULUS_SIMD")) where the variable is set (else the CPU's best).
// Programs call it first thing; its error says the variable's name and value.
void simd_select_from_env();

// The best target dispatch may use now, e.g. "avx512vnni" or "avx2" (with simd_select's
// cap applied), and a line for reports: "avx2 (CUMULUS_SIMD=avx2; CPU supports avx512vnni)".
std::string simd_target();
std::string simd_target_line();

}  // namespace cumulus::cpu
