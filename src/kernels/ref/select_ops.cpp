// The float64 reference backend of the selection ops (kernels/select_ops.h): the host
// implementation (src/kernels/cpu/select_ops.cpp) over the ref:: scoring and selection
// kernels, its tasks run one after another.
#include "cumulus/kernels/scoring.h"
#include "cumulus/kernels/selection.h"
#include "kernels/host_select_ops.h"

namespace cumulus::ref {

std::unique_ptr<HostSelectOps> make_select_ops() {
  return kernels::make_host_select_ops(
      {.backend = "ref",
       .token_score = &ref::token_score,
       .page_score_bound =
           [](const PagedHeadView& kv, const float* q, int n_q, float* s) {
             for (int j = 0; j < n_q; ++j)
               ref::page_score_bound(kv, q + static_cast<size_t>(j) * kv.head_dim,
                                     s + static_cast<size_t>(j) * kv.n_pages());
           },
       .select_topk = [](const float* s, int n, int k, std::vector<int32_t>& out,
                         SelectWorkspace*) { ref::select_topk(s, n, k, out); },
       .select_top_mass = [](const float* w, int n, double p, std::vector<int32_t>& out,
                             SelectWorkspace*) { ref::select_top_mass(w, n, p, out); },
       .parallel = false});
}

}  // namespace cumulus::ref
