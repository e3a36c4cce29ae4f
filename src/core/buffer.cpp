// alloc_large (core/buffer.h): huge-page-backed storage for large arrays.
#include "cumulus/core/buffer.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace cumulus {

void* alloc_large(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  if (bytes < kHuge) {
    const size_t rounded = bytes == 0 ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, rounded);
  if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Advice only: where the kernel has no transparent huge pages the call fails and the
  // memory stays in 4 KiB pages, which is correct, only slower.
  (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace cumulus
