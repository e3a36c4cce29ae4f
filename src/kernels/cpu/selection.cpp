// STUB
#include "cumulus/kernels/selection.h"
#include "cumulus/core/error.h"
namespace cumulus::cpu {
void select_topk(const float*, int, int, std::vector<int32_t>&) { CUMULUS_FAIL("not implemented"); }
int select_cumulative_prefix(const float*, int, double) { CUMULUS_FAIL("not implemented"); }
void select_top_mass(const float*, int, double, std::vector<int32_t>&) { CUMULUS_FAIL("not implemented"); }
}  // namespace cumulus::cpu
