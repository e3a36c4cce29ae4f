// Per-target helper of the Highway kernels (attention, scoring, prefill): lanes
// [j, j + Lanes(d)) of one K or V row stored as kT (f32, f16 or bf16), widened to float32
// with PromoteTo as they load. Included by each kernel file after hwy/foreach_target.h, so
// it is compiled once per SIMD target (the guard toggles with HWY_TARGET_TOGGLE).
#if defined(CUMULUS_KERNELS_CPU_ROW_LOAD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef CUMULUS_KERNELS_CPU_ROW_LOAD_INL_H_
#undef CUMULUS_KERNELS_CPU_ROW_LOAD_INL_H_
#else
#define CUMULUS_KERNELS_CPU_ROW_LOAD_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>

#include "cumulus/core/dtype.h"

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {

template <DType kT, class D>
HWY_INLINE hwy::HWY_NAMESPACE::Vec<D> load_row(D d, const void* row, size_t j) {
  namespace hn = hwy::HWY_NAMESPACE;
  if constexpr (kT == DType::f32) {
    return hn::LoadU(d, static_cast<const float*>(row) + j);
  } else if constexpr (kT == DType::f16) {
    const hn::Rebind<hwy::float16_t, D> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, static_cast<const hwy::float16_t*>(row) + j));
  } else {
    const hn::Rebind<hwy::bfloat16_t, D> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, static_cast<const hwy::bfloat16_t*>(row) + j));
  }
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // CUMULUS_KERNELS_CPU_ROW_LOAD_INL_H_ toggle
