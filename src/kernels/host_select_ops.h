// The host backends of the selection ops (kernels/select_ops.h): one implementation over
// the scoring and selection kernels of a namespace, which ref/ and cpu/ pass in. Internal
// to the kernels layer.
#pragma once

#include <memory>
#include <vector>

#include "cumulus/kernels/select_ops.h"
#include "cumulus/kernels/selection.h"

namespace cumulus::kernels {

struct HostSelectKernels {
  const char* backend;  // "ref" or "cpu", for error messages
  void (*token_score)(const PagedHeadView& kv, const float* q, int n_q, const int32_t* idx, int n, float* scores);
  void (*page_score_bound)(const PagedHeadView& kv, const float* q, int n_q, float* scores);
  void (*select_topk)(const float* scores, int n, int k, std::vector<int32_t>& out, SelectWorkspace* ws);
  void (*select_top_mass)(const float* weights, int n, double p, std::vector<int32_t>& out, SelectWorkspace* ws);
  bool parallel;  // run the (sequence, kv head) tasks on the batch's pool
};

std::unique_ptr<HostSelectOps> make_host_select_ops(const HostSelectKernels& k);

}  // namespace cumulus::kernels
