// Selection (DESIGN.md "Core types"): per kv head, the sorted unique token indices that
// head's query group attends. All query heads of a GQA group attend over the union of
// what each chose (Tactic section 4.5).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cumulus {

struct Selection {
  std::vector<std::vector<int32_t>> tokens;  // [n_kv_heads][n_selected], sorted ascending, unique

  size_t total() const {
    size_t s = 0;
    for (const auto& t : tokens) s += t.size();
    return s;
  }
};

// Sorts and de-duplicates `idx` in place (union of the group's choices).
void selection_normalize(std::vector<int32_t>& idx);

}  // namespace cumulus
