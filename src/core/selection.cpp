#include "cumulus/core/selection.h"

#include <algorithm>

namespace cumulus {

void selection_normalize(std::vector<int32_t>& idx) {
  std::sort(idx.begin(), idx.end());
  idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
}

}  // namespace cumulus
