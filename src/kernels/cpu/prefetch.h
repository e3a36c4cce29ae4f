// Software prefetch for the CPU attention kernels, which stream K/V rows from memory.
//
// prefetch_l2 asks for the line into L2 (x86: prefetcht1), not into L1 (prefetcht0, which
// hwy::Prefetch issues). A prefetch into L1 holds one of the core's L1 miss buffers until
// the line arrives from DRAM; Zen 4 has about two dozen of them, so L1 prefetches alone
// cap one core at roughly 24 lines per DRAM latency (~11 GB/s here) and the kernel's own
// loads queue behind them. A prefetch into L2 is tracked by L2's larger miss queue; the
// kernel's later load then finds the line in L2 (~15 cycles). Measured on Zen 4 (2 vCPUs,
// `attention_bench --threads 2 --tokens 32768`, same run): dense f16 decode 6.36 -> 4.16
// ms per step, sparse over 2048 random tokens per kv head 0.708 -> 0.483 ms
// (docs/lab/performance-log.md). The quantised GEMV keeps hwy::Prefetch: its
// row-group prefetches were no faster into L2 and the Q8_0 head slower (gemv_bench).
#pragma once

#include <hwy/base.h>

namespace cumulus::cpu {

// HWY_INLINE (always_inline): the callers are compiled once per SIMD target, and GCC does
// not inline a plain inline function into them on its own; a call in the PV loop spills
// every vector register (all caller-saved) and made the step twice as slow.
HWY_INLINE void prefetch_l2(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, /*rw=*/0, /*locality=*/2);  // x86: prefetcht1; Arm: PLDL2KEEP
#else
  (void)p;
#endif
}

}  // namespace cumulus::cpu
