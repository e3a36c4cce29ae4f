// tactic's GPU selection paths side by side (llm.c's dev/cuda habit: the variants, their
// reference, their validation and their timing in one program). make_tactic_gpu picks its
// ranking and its marks by size (src/methods/tactic/tactic.cu): the bucket ranking up to 8192
// clusters per kv head, else a radix sort and a positions kernel; the marks by token range
// where the group's start positions fit in shared memory and a CTA walks at most 4 tiles,
// else by ranked cluster (shared-memory slices, else global atomics). This program forces
// each path (tactic_gpu_paths.h) on the synthetic workload in the llama3-8b shape, checks
// that its lists are the library's (the path make_tactic_gpu picks: every path gives the
// same lists) and its claims within 1e-5, and times select() alone: CUDA graph replays
// after a 256 MiB L2 flush, median of --iters. The twin tests (tests/cuda) hold the library
// to the CPU method.
//
// Usage: tactic_paths [--contexts 32768,131072] [--batches 1,16] [--iters 30] [--p 0.9]
//          [--slices 4,8,16]
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/cuda_methods.h"
#include "core/check.h"
#include "dev_util.h"
#include "cumulus/core/error.h"
#include "methods/tactic/tactic_gpu_paths.h"

namespace cumulus::cuda {
namespace {

using dev::ints;
using dev::median;



// The lists of the decoder's last select(): per (sequence, kv head), sorted token indices.
std::vector<std::vector<int32_t>> lists_of(const SparseDecoder& m, int n_lists) {
  const int stride = m.list_stride();
  std::vector<int32_t> len(n_lists), idx(static_cast<size_t>(n_lists) * stride);
  memcpy_to_host(len.data(), m.list_len(), len.size() * sizeof(int32_t));
  memcpy_to_host(idx.data(), m.list_idx(), idx.size() * sizeof(int32_t));
  std::vector<std::vector<int32_t>> r(n_lists);
  for (int l = 0; l < n_lists; ++l)
    r[l].assign(idx.begin() + static_cast<size_t>(l) * stride, idx.begin() + static_cast<size_t>(l) * stride + len[l]);
  return r;
}

struct Path {
  std::string name;
  TacticGpuPaths paths;
};

int run(int argc, char** argv) {
  std::vector<int> contexts{32768, 131072}, batches{1, 16}, slices{4, 8, 16};
  int iters = 30;
  double p = 0.9;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    CUMULUS_CHECK(i + 1 < argc, "option {} needs a value", a);
    const std::string v = argv[++i];
    if (a == "--contexts") contexts = ints(a, v);
    else if (a == "--batches") batches = ints(a, v);
    else if (a == "--slices") slices = ints(a, v);
    else if (a == "--iters") iters = dev::positive_int(a, v);
    else if (a == "--p") p = dev::real(a, v);
    else CUMULUS_FAIL("unknown option '{}'", a);
  }
  CUMULUS_CHECK(iters >= 1 && p > 0 && p <= 1, "--iters={} must be >= 1 and --p={} in (0, 1]", iters, p);
  if (!device_available()) {
    fmt::print(stderr, "tactic_paths: no CUDA device\n");
    return 1;
  }
  std::vector<Path> paths = {{"bucket, token marks", {true, 0, true}},
                             {"bucket, cluster marks", {true, 0, false}},
                             {"radix sort, global marks", {false, 0, false}}};
  for (int s : slices) paths.push_back({fmt::format("bucket, cluster marks /{}", s), {true, s, false}});
  fmt::print("device: {}; tactic p={}, llama3-8b shape, f16\n", device_info().name, p);
  Stream st;
  DeviceBuffer flush(size_t{256} << 20);
  ThreadPool pool(0);
  for (int n : contexts) {
    SyntheticOptions so;
    so.shape = shape_preset("llama3-8b");
    so.n_tokens = n;
    so.n_steps = 1;
    KvCache kv(so.shape, KvCacheOptions{16, DType::f16, n});
    const SyntheticWorkload w = synthetic_generate(so, kv, pool);
    std::vector<PagedHeadView> views;
    for (int h = 0; h < so.shape.n_kv_heads; ++h) views.push_back(kv.view(0, h));
    const int nq = so.shape.n_q_heads, d = so.shape.head_dim, group = so.shape.group();
    for (int b : batches) {
      DeviceKvCache dev = DeviceKvCache::upload_replicated(views, b);
      std::vector<float> qh;
      for (int i = 0; i < b; ++i) qh.insert(qh.end(), w.query(0, 0), w.query(0, 0) + static_cast<size_t>(nq) * d);
      DeviceBuffer q = to_device(qh);
      const int n_lists = b * so.shape.n_kv_heads;
      TacticGpuOptions o;
      o.p = p;
      auto select_us = [&](SparseDecoder& m) {
        Graph g = Graph::capture(st.handle(), [&] { m.select(q.as<float>(), st.handle()); });
        EventTimer t;
        for (int i = 0; i < 5; ++i) g.launch(st.handle());
        std::vector<double> us;
        for (int i = 0; i < iters; ++i) {
          memset_async(flush.data(), i & 0xff, flush.size(), st.handle());
          t.start(st.handle());
          g.launch(st.handle());
          t.stop(st.handle());
          us.push_back(1e3 * t.elapsed_ms());
        }
        return median(us);
      };
      // The library's choice: the reference lists and claims.
      std::unique_ptr<SparseDecoder> lib = make_tactic_gpu(dev.view(), group, o);
      lib->prefill(st.handle());
      lib->select(q.as<float>(), st.handle());
      lib->check(st.handle());
      const auto ref_lists = lists_of(*lib, n_lists);
      const SparseStepStats ref_stats = lib->stats(st.handle());
      const double lib_us = select_us(*lib);
      double tokens = 0;
      for (const auto& l : ref_lists) tokens += static_cast<double>(l.size()) / n / n_lists;
      fmt::print("context {} batch {}: library select {:8.1f} us, {:.2f}% of tokens attended\n", n, b, lib_us,
                 100 * tokens);
      for (const Path& path : paths) {
        try {
          std::unique_ptr<SparseDecoder> m = make_tactic_gpu_paths(dev.view(), group, o, path.paths);
          m->prefill(st.handle());
          m->select(q.as<float>(), st.handle());
          m->check(st.handle());
          const auto lists = lists_of(*m, n_lists);
          const SparseStepStats stats = m->stats(st.handle());
          int same = 0;
          for (int l = 0; l < n_lists; ++l) same += lists[l] == ref_lists[l];
          double dclaim = 0;
          for (size_t i = 0; i < stats.claimed.size(); ++i)
            dclaim = std::max(dclaim, std::fabs(static_cast<double>(stats.claimed[i]) - ref_stats.claimed[i]));
          const bool valid = same == n_lists && dclaim <= 1e-5;
          const double us = select_us(*m);
          fmt::print("  {:<30} select {:8.1f} us (x{:.3f} the library's)  lists equal {}/{}, max |claim diff| "
                     "{:.1e}{}\n",
                     path.name, us, lib_us / us, same, n_lists, dclaim, valid ? "" : "  INVALID");
        } catch (const std::exception& e) {
          fmt::print("  {:<30} error: {}\n", path.name, e.what());
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace cumulus::cuda

int main(int argc, char** argv) {
  return cumulus::cuda::dev::main_of("tactic_paths", cumulus::cuda::run, argc, argv);
}
