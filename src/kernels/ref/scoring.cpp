// STUB
#include "cumulus/kernels/scoring.h"
#include "cumulus/core/error.h"
namespace cumulus::ref {
void page_score_bound(const PagedHeadView&, const float*, float*) { CUMULUS_FAIL("not implemented"); }
void page_score_mean(const PagedHeadView&, const float*, float*) { CUMULUS_FAIL("not implemented"); }
void token_score(const PagedHeadView&, const float*, int, const int32_t*, int, float*) { CUMULUS_FAIL("not implemented"); }
}  // namespace cumulus::ref
