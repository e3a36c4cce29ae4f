// alloc_large (core/buffer.h): huge-page-backed storage for large arrays.
#include "cumulus/core/buffer.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace cumulus {

void* alloc_large(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t rounded = bytes == 0 ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = nullptr;
  if (posix_memalign(&p, bytes < kHuge ? kAlignment : kHuge, rounded) != 0 || p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Only the whole 2 MiB pages: the tail stays in 4 KiB pages, so no memory is spent past
  // `bytes`. Advice only: where the kernel has no transparent huge pages the call fails and
  // the memory stays in 4 KiB pages, which is correct, only slower.
  if (bytes >= kHuge) (void)madvise(p, bytes / kHuge * kHuge, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace cumulus
