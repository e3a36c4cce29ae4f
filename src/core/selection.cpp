#include "cumulus/core/selection.h"

#include <algorithm>
#include <bit>
#include <cstdint>

namespace cumulus {

void selection_normalize(std::vector<int32_t>& idx) {
  // A union of a group's lists is thousands of indices within a cache of tens of
  // thousands of tokens: marking them in a bitmap over their range and reading the bits
  // back in order is O(size + range / 64), against O(size log size) for a sort (Tactic's
  // decode step spent a fifth of its time sorting unions). Sparse or tiny lists sort.
  if (idx.size() >= 64) {
    const auto [lo_it, hi_it] = std::minmax_element(idx.begin(), idx.end());
    const int64_t lo = *lo_it;
    const uint64_t range = static_cast<uint64_t>(static_cast<int64_t>(*hi_it) - lo) + 1;
    if (range / 64 <= 4 * idx.size()) {
      thread_local std::vector<uint64_t> bits;
      bits.assign(range / 64 + 1, 0);
      for (int32_t x : idx) {
        const uint64_t off = static_cast<uint64_t>(x - lo);
        bits[off >> 6] |= uint64_t{1} << (off & 63);
      }
      idx.clear();
      for (size_t w = 0; w < bits.size(); ++w)
        for (uint64_t word = bits[w]; word != 0; word &= word - 1)
          idx.push_back(static_cast<int32_t>(lo + static_cast<int64_t>(w * 64) + std::countr_zero(word)));
      return;
    }
  }
  std::sort(idx.begin(), idx.end());
  idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
}

}  // namespace cumulus
