// tactic's GPU decode step's parameters (src/methods/tactic/tactic.cu has the design):
// every device pointer and size its kernels share, one struct per launch. Not installed.
#pragma once

#include "core/check.h"
#include "cumulus/methods/cuda_methods.h"
#include "kernels/cuda/cuda_internal.cuh"

namespace cumulus::cuda {
namespace {

struct TacticParams {
  DeviceKvView kv;
  int group, n_q, kc_max, max_exact;
  float scale;
  double p, init_ratio, p1, p2;
  int window;
  int sinks, recent;          // TacticGpuOptions: clustered tokens moved to the dense tail
  const float* q;             // [n_seqs][n_q][D]
  const __half* cent;         // [n_lists][kc_max][D]
  const int32_t* csize;       // [n_lists][kc_max]
  const int32_t* cbeg;        // [n_lists][kc_max]
  const int32_t* members;     // [n_lists][max_tokens]
  const int32_t* n_clu;       // [n_lists]
  const int32_t* n_idx;       // [n_lists]
  float* cscore;              // [rows][kc_max]
  int32_t* order;             // [rows][kc_max]
  int32_t* pos;               // [rows][kc_max + 1]
  int32_t* tok;               // [rows][max_exact] pool row (K address) of each exactly scored position
  float* exact;               // [rows][max_exact]
  float2* tail_part;          // [rows][max_exact_ctas] (max, sum) of each CTA's tail tokens
  int max_exact_ctas;
  uint32_t* bits;             // [n_lists][words]
  int words;
  // The marks by token range (tactic_mark_range_kernel): per token of each list its cluster
  // (-1: not in the list) and its index among the cluster's members; the compaction's
  // per-tile counts.
  const int32_t* cid;         // [n_lists][max_tokens]
  const int32_t* midx;        // [n_lists][max_tokens]
  int* counts;                // [n_lists][bitmap_tiles(words)]
  float* claimed;             // [rows]
  int32_t* budget;            // [rows]
  int rank_bins, rank_sz_off;  // the ranking kernel's bins and shared-memory layout
};

}  // namespace
}  // namespace cumulus::cuda
