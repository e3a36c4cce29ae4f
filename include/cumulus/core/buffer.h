// Aligned storage. 64-byte alignment keeps every row start on a cache line and satisfies
// the widest SIMD loads (AVX-512).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace cumulus {

inline constexpr size_t kAlignment = 64;

template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) noexcept {}
  T* allocate(size_t n) {
    size_t bytes = (n * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, bytes == 0 ? kAlignment : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) noexcept { std::free(p); }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const noexcept { return true; }
};

template <class T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

// Storage for large read-mostly arrays (the KV cache's page slabs): from 2 MiB up, 2 MiB
// aligned and its whole 2 MiB pages advised as transparent huge pages on Linux
// (MADV_HUGEPAGE; kernels whose THP mode is "madvise" use them only when asked), so
// reading scattered rows walks far fewer page-table entries; the partial last 2 MiB stays
// in 4 KiB pages (no memory past `bytes`). Below 2 MiB: 64-byte aligned.
// Release with std::free. Measured on a Zen 3 with the sparse decode kernel (2048 random
// tokens of 32K per kv head): 11-17% less time per step than 4 KiB pages (docs/lab/performance-log.md).
// Throws std::bad_alloc.
void* alloc_large(size_t bytes);

// std::vector storage through alloc_large: large read-mostly arrays that a decode step
// streams through (the quantised weights, model/weight_matrix.h).
template <class T>
struct LargeAllocator {
  using value_type = T;
  LargeAllocator() = default;
  template <class U>
  LargeAllocator(const LargeAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(alloc_large(n * sizeof(T))); }
  void deallocate(T* p, size_t) noexcept { std::free(p); }
  template <class U>
  bool operator==(const LargeAllocator<U>&) const noexcept { return true; }
};

template <class T>
using LargeVector = std::vector<T, LargeAllocator<T>>;

}  // namespace cumulus
