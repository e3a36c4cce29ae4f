// Decode attention beyond device memory (benchmark; docs/cuda.md "Host tier"): the
// llama3-8b attention shape (32 layers of 32 query heads over 8 kv heads, head_dim 128, f16
// K/V in pages of 16 tokens) over a two-tier KV page pool (kv/cuda_kv_pool.h) shared by
// every layer, filled from the synthetic workload (docs/workload.md; one layer generated and
// its K/V written to every layer's own pages, each sequence of a batch a copy), with no
// prefill. Tokens are written oldest first, one chunk of 16384 at a time across the layers,
// each chunk a step of the pool's clock, so once the device tier is full the least
// recently written pages go to the host and the newest stay on the device.
//
// Per case (context, batch, device tier size) the same filled pool runs, in this order,
// each once per --stage value (0: host rows read in place; 1: staged, KvPagePool::stage;
// 2, dense only: staged a layer ahead):
//   dense:  every layer attends every token (kernels/cuda.h attention_decode). In place,
//           host pages are read where they are, over PCIe, by the attention kernel; staged,
//           one gather kernel first copies the layer's host pages to the device's staging
//           area at the copy rate; a layer ahead, the next layer's gather runs on a second
//           stream into a second staging area while this layer attends, as offloading
//           engines stream the offloaded K/V in, overlapped.
//   sparse: the method (default sketch_topp) selects from its index on the device and
//           attends its lists (staged: the host rows the lists name are gathered first);
//           after each step the pages it read go to the pool's LRU, which promotes host pages
//           over the least recently used device pages (the moves run on the device after the
//           step's reads).
// The staging areas (one layer's share of the host tier each; two with --stage 2) come out
// of the device tier's memory, in every run of the case.
// A step is every layer of the batch, then the tier's end of step (the page list back to the
// host, the policy, the moves), timed on the wall clock to the device's idle; warm-up steps
// first, then the median of --steps. tok/s = batch / step. The rows give where the pages
// live, the pool's hit rate (distinct pages read that were on the device), the bytes that
// crossed PCIe per step (K/V rows read from host pages plus the moves' bytes) and their rate,
// against the pinned host-to-device copy bandwidth measured in the same run. Attention only:
// the model's weights are not in the step (cuda_model_bench times those).
//
// The device tier is the device's free memory less the decoders' buffers (measured) and a
// margin, capped by --device-kv-gib; --ratios adds cases at --ratio-context and
// --ratio-batch whose device tier is the K/V over each ratio (1: everything on the device),
// for the tier's cost at a context where both fit. Key statistics (quest's page bounds) are
// not kept unless the method needs them (--key-stats).
//
// Usage: cuda_tier_bench [--contexts 131072,524288,1048576] [--ratio-context 131072]
//          [--ratio-batch 4] [--ratios 1,2,4|none] [--layers 32] [--steps 5] [--warmup 2]
//          [--method sketch_topp] [--param KEY=VALUE]... [--device-kv-gib G] [--margin-gib 6]
//          [--key-stats] [--promote-reads 2] [--max-promote 0,-1] [--stage 0,1,2] [--seed 1]
//          [--json PATH]
// --max-promote: the sparse method runs once per value, in order, over the same pool: pages
// promoted per step at most (0: none, every host page read where it is; -1: no limit).
// --trace FILE: real attention instead (a `cumulus trace` file): every recorded layer is a
// layer over the pool, with its own K/V (prompt and decode tokens) and decode queries, step t
// taking the trace's query t mod its steps; batch 1, one case per --ratios value (the
// device tier is the trace's K/V over the ratio), --contexts and --layers unused. Real
// queries of consecutive decode steps are what says whether promotion pays.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "cumulus/core/cuda_runtime.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/core/number.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/eval/trace.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kernels/cuda_decoder.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/kv/cuda_kv_pool.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/cuda_methods.h"
#include "cumulus/methods/registry.h"
#include "cumulus/model/cuda_runner.h"
#include "model/cuda/decode_methods.h"

using namespace cumulus;
using json = nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kChunk = 16384;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int parse_int(const std::string& s, const std::string& flag) {
  int64_t v = 0;
  const std::string err = number_parse_int(s, INT32_MIN, INT32_MAX, &v);
  CUMULUS_CHECK(err.empty(), "{}: '{}' {}", flag, s, err);
  return static_cast<int>(v);
}

double parse_double(const std::string& s, const std::string& flag) {
  double v = 0;
  const std::string err = number_parse_double(s, &v);
  CUMULUS_CHECK(err.empty(), "{}: '{}' {}", flag, s, err);
  return v;
}

std::vector<int> int_list(const std::string& flag, const std::string& s) {
  std::vector<int> v;
  if (s == "none") return v;
  size_t b = 0;
  while (b <= s.size()) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    v.push_back(parse_int(s.substr(b, e - b), flag));
    b = e + 1;
  }
  return v;
}

struct Options {
  std::vector<int> contexts{131072, 524288, 1048576};
  int ratio_context = 131072, ratio_batch = 4;
  std::vector<int> ratios{1, 2, 4};
  int layers = 32, steps = 5, warmup = 2;
  std::string method = "sketch_topp";
  std::map<std::string, std::string> params;
  double device_kv_gib = 0, margin_gib = 6;
  bool key_stats = false;
  int promote_reads = 2;
  std::vector<int> max_promote{0, -1};
  std::vector<int> stage{0, 1, 2};
  uint64_t seed = 1;
  std::string trace;
  std::string json_path;
};

// One generated layer of the workload: K/V as stored (f16) and the decode queries.
struct Workload {
  SyntheticOptions so;
  KvCache kv;
  SyntheticWorkload w;
};

struct Case {
  int context = 0, batch = 1;
  int64_t device_pages_cap = 0;  // 0: what the device has room for
  std::string label;
};

class Runner {
 public:
  Runner(const Options& o, ThreadPool& tp, double h2d, double copy)
      : o_(o), tp_(tp), reg_(cuda::registry_with_gpu(Registry::builtin())), h2d_(h2d), copy_(copy) {
    shape_ = shape_preset("llama3-8b", o.layers);
  }
  // Real attention from a trace (--trace): its records are the layers.
  void set_trace(const TraceFile& t) {
    trace_ = &t;
    shape_ = Shape{static_cast<int>(t.layers.size()), t.n_q_heads, t.n_kv_heads, t.head_dim};
    for (size_t i = 0; i < t.layers.size(); ++i) trace_kv_.push_back(t.cache(static_cast<int>(i)));
  }
  const Shape& shape() const { return shape_; }

  const Workload& workload(int n) {
    if (wl_ == nullptr || wl_->so.n_tokens != n) {
      wl_.reset();
      SyntheticOptions so;
      so.shape = shape_preset("llama3-8b");
      so.n_tokens = n;
      so.n_steps = 16;
      so.seed = o_.seed;
      const auto t0 = Clock::now();
      wl_ = std::make_unique<Workload>(Workload{so, KvCache(so.shape, KvCacheOptions{16, DType::f16, n}), {}});
      wl_->w = synthetic_generate(so, wl_->kv, tp_);
      fmt::print("context {}: synthetic workload generated in {:.1f} s\n", n, seconds_since(t0));
    }
    return *wl_;
  }

  json run(const Case& c) {
    const Workload* wl = trace_ != nullptr ? nullptr : &workload(c.context);
    const int n = c.context, b = c.batch, L = shape_.n_layers, nkv = shape_.n_kv_heads, d = shape_.head_dim;
    // Layer l's K/V (the synthetic workload: one generated layer for all).
    auto source = [&](int l) -> const KvCache& { return trace_ != nullptr ? trace_kv_[l] : wl->kv; };
    const int64_t pages_per_layer = static_cast<int64_t>(b) * nkv * ((n + 15) / 16);
    const int64_t total = pages_per_layer * L;
    const size_t page_bytes = cuda::KvPagePool::page_bytes(d, DType::f16, 16, o_.key_stats);
    // The decoders' buffers, measured over a view of this case's shape.
    size_t dec_bytes = 0;
    {
      cuda::DeviceKvCache probe = cuda::DeviceKvCache::create(b, nkv, d, DType::f16, 16, n, 1);
      dec_bytes = cuda::model::cuda_decoder_bytes(reg_, o_.method, o_.params, probe.view(), shape_);
    }
    const size_t free_b = cuda::device_free_bytes();
    const double room = static_cast<double>(free_b) - static_cast<double>(dec_bytes) - o_.margin_gib * kGiB;
    int64_t dev_pages = std::max<int64_t>(0, static_cast<int64_t>(room / page_bytes));
    if (o_.device_kv_gib > 0) dev_pages = std::min<int64_t>(dev_pages, static_cast<int64_t>(o_.device_kv_gib * kGiB / page_bytes));
    const int64_t granule = cuda::KvPagePool::device_pages_granule(d, DType::f16, 16, o_.key_stats);
    // A cap of the whole K/V (ratio 1) is every page on the device: whole granules, rounded up
    // (the pool rounds its device tier down).
    if (c.device_pages_cap > 0)
      dev_pages = std::min(dev_pages, c.device_pages_cap >= total ? (total + granule - 1) / granule * granule
                                                                  : c.device_pages_cap);
    dev_pages = std::min(dev_pages, (total + granule - 1) / granule * granule);
    int64_t host_pages = std::max<int64_t>(0, total - dev_pages / granule * granule);
    // The staging area, one layer's share of the host tier, out of the device tier's bytes.
    int64_t stage_pages = 0;
    const int stage_sets = std::find(o_.stage.begin(), o_.stage.end(), 2) != o_.stage.end() ? 2 : 1;
    if (host_pages > 0 && *std::max_element(o_.stage.begin(), o_.stage.end()) > 0) {
      stage_pages = (host_pages + L - 1) / L;
      const size_t kv_page = cuda::KvPagePool::page_bytes(d, DType::f16, 16, false);
      dev_pages -= static_cast<int64_t>((stage_sets * stage_pages * kv_page + page_bytes - 1) / page_bytes);
      host_pages = std::max<int64_t>(0, total - dev_pages / granule * granule);
      stage_pages = (host_pages + L - 1) / L;
    }
    json row = {{"case", c.label}, {"context", n}, {"batch", b}, {"layers", L}, {"pages", total},
                {"kv_gib", total * page_bytes / kGiB}, {"decoder_gib", dec_bytes / kGiB}};
    cuda::KvPoolOptions po;
    po.head_dim = d;
    po.dtype = DType::f16;
    po.page_size = 16;
    po.device_pages = dev_pages;
    po.host_pages = host_pages;
    po.key_stats = o_.key_stats;
    po.promote_reads = o_.promote_reads;
    po.max_promote = o_.max_promote.front();
    po.stage_pages = stage_pages;
    po.stage_sets = stage_sets;
    std::shared_ptr<cuda::KvPagePool> pool;
    auto t0 = Clock::now();
    try {
      pool = cuda::KvPagePool::create(po);
    } catch (const Error& e) {
      fmt::print("{:<10} {:>8} {:>5}  not run: {}\n", c.label, n, b, e.what());
      row["skipped"] = e.what();
      return row;
    }
    const double pool_s = seconds_since(t0);
    row["device_tier_gib"] = pool->device_bytes() / kGiB;
    row["host_tier_gib"] = pool->host_bytes() / kGiB;
    row["stage_pages"] = pool->stage_pages();
    row["pool_create_s"] = pool_s;
    // Fill, oldest tokens first, a chunk across every layer per clock step.
    std::vector<cuda::DeviceKvCache> caches;
    for (int l = 0; l < L; ++l) caches.push_back(cuda::DeviceKvCache::create(pool, b, nkv, n));
    pool->reserve_stage(caches[0].view());
    t0 = Clock::now();
    {
      std::vector<float> kh, vh;
      for (int t0k = 0; t0k < n; t0k += kChunk) {
        const int m = std::min(kChunk, n - t0k);
        const size_t per_seq = static_cast<size_t>(m) * nkv * d;
        kh.resize(per_seq * b);
        vh.resize(per_seq * b);
        cuda::DeviceBuffer kd, vd;
        for (int l = 0; l < L; ++l) {
          if (l == 0 || trace_ != nullptr) {  // the synthetic layer once, each traced layer its own
            for (int i = 0; i < m; ++i)
              for (int h = 0; h < nkv; ++h) {
                const PagedHeadView v = source(l).view(0, h);
                float* kr = kh.data() + (static_cast<size_t>(i) * nkv + h) * d;
                float* vr = vh.data() + (static_cast<size_t>(i) * nkv + h) * d;
                convert_to_f32(v.key(t0k + i), DType::f16, kr, d);
                convert_to_f32(v.value(t0k + i), DType::f16, vr, d);
              }
            for (int s = 1; s < b; ++s) {
              std::copy(kh.begin(), kh.begin() + per_seq, kh.begin() + s * per_seq);
              std::copy(vh.begin(), vh.begin() + per_seq, vh.begin() + s * per_seq);
            }
            kd = cuda::to_device(kh);
            vd = cuda::to_device(vh);
          }
          for (int s = 0; s < b; ++s) caches[l].reserve(s, t0k + m);
          caches[l].append(kd.as<float>(), vd.as<float>(), m);
        }
        pool->end_step();  // the chunk is one step of the pool's clock
      }
      cuda::device_synchronize();
    }
    pool->reset_totals();
    row["fill_s"] = seconds_since(t0);
    // Queries [step][layer][sequence]: sequence s at step t takes the workload's query
    // (t + s) mod 16 in every layer; a trace's layer l its own query t mod its steps.
    const int n_steps = o_.warmup + o_.steps;
    const size_t q_step = static_cast<size_t>(b) * shape_.n_q_heads * d;
    const size_t q_head = static_cast<size_t>(shape_.n_q_heads) * d;
    std::vector<float> qh(q_step * n_steps * L);
    for (int t = 0; t < n_steps; ++t)
      for (int l = 0; l < L; ++l)
        for (int s = 0; s < b; ++s)
          std::copy_n(trace_ != nullptr ? trace_->q[l].data() + (t % trace_->steps) * q_head
                                        : wl->w.query(0, (t + s) % 16),
                      q_head, qh.data() + (static_cast<size_t>(t) * L + l) * q_step + s * q_head);
    const cuda::DeviceBuffer qd = cuda::to_device(qh);
    cuda::DeviceBuffer out(q_step * sizeof(float)), lse(static_cast<size_t>(b) * shape_.n_q_heads * sizeof(float));
    const double row_bytes = 2.0 * d * 2;  // a K and a V row, f16
    // Where a step's time goes: one more step after the timed ones, each phase of each layer
    // between events (the phases then do not overlap), summed over the layers.
    std::map<std::string, double>* phase_ms = nullptr;
    cuda::EventTimer timer;
    auto phase = [&](const char* name, auto&& fn) {
      if (phase_ms == nullptr) return fn();
      timer.start();
      fn();
      timer.stop();
      (*phase_ms)[name] += timer.elapsed_ms();
    };
    auto run_steps = [&](const std::string& what, auto&& layer_step) {
      std::vector<double> ms;
      cuda::TierStats sum;
      std::map<std::string, double> phases;
      for (int t = 0; t <= n_steps; ++t) {
        if (t == n_steps) {  // the phases' step, the last query again
          phase_ms = &phases;
          for (int l = 0; l < L; ++l) layer_step(l, qd.as<float>() + (static_cast<size_t>(t - 1) * L + l) * q_step);
          pool->end_step();
          cuda::device_synchronize();
          phase_ms = nullptr;
          break;
        }
        cuda::device_synchronize();
        const auto ts = Clock::now();
        for (int l = 0; l < L; ++l) layer_step(l, qd.as<float>() + (static_cast<size_t>(t) * L + l) * q_step);
        const cuda::TierStats st = pool->end_step();
        cuda::device_synchronize();
        const double step_ms = 1e3 * seconds_since(ts);
        if (t < o_.warmup) continue;
        ms.push_back(step_ms);
        sum += st;
      }
      const double step = median(ms), k = static_cast<double>(o_.steps);
      // The fastest this step's K/V reads could be: host rows at the pinned copy rate, device
      // pages at the device copy rate (dense: every page; a floor for offloaded dense).
      const double floor_ms = 1e3 * (sum.host_rows * row_bytes / k / (h2d_ * 1e9) +
                                     sum.hits * 16.0 * row_bytes / k / (copy_ * 1e9));
      const double pcie = (sum.host_rows * row_bytes + static_cast<double>(sum.moved_bytes)) / k;
      json r = {{"method", what},
                {"ms_per_step", step},
                {"ms_samples", ms},
                {"tokens_per_s", 1e3 * b / step},
                {"hit_rate", sum.hit_rate()},
                {"pages_read_per_step", (sum.hits + sum.misses) / k},
                {"host_pages_read_per_step", sum.misses / k},
                {"promoted_per_step", sum.promoted / k},
                {"pcie_bytes_per_step", pcie},
                {"host_row_bytes_per_step", sum.host_rows * row_bytes / k},
                {"moved_bytes_per_step", sum.moved_bytes / k},
                {"pcie_gbps", pcie / (step * 1e6)},
                {"plan_ms_per_step", sum.plan_ms / k},
                {"staged_rows_per_step", sum.staged_rows / k},
                {"unstaged_pages_per_step", sum.unstaged_pages / k},
                {"wait_ms_per_step", sum.wait_ms / k},
                {"kv_floor_ms", floor_ms},
                {"phase_ms", phases}};
      fmt::print("{:<10} {:>8} {:>5} {:<24} {:>7.1f} {:>7.1f} {:>10.3f} {:>8.2f} {:>7.1f}% {:>9.0f} {:>8.3f} {:>7.1f} "
                 "{:>8.3f} {:>9.3f}\n",
                 c.label, n, b, what, pool->device_bytes() / kGiB, pool->host_bytes() / kGiB, step, 1e3 * b / step,
                 100 * sum.hit_rate(), (sum.hits + sum.misses) / k, pcie / 1e9, pcie / (step * 1e6), sum.plan_ms / k,
                 floor_ms);
      std::string ph;
      for (const auto& [name, v] : phases) ph += fmt::format(" {} {:.2f}", name, v);
      fmt::print("{:<10} {:>8} {:>5} {:<24} phases (ms, one step, each alone):{}\n", c.label, n, b, what, ph);
      return r;
    };
    json methods = json::array();
    // Dense, every page every step.
    const bool staging = pool->stage_pages() > 0;
    auto label = [&](std::string what, int st) {
      return st == 2 ? what + "/ahead" : st == 1 ? what + "/staged" : what;
    };
    // A layer ahead: layer l + 1's gather on the copy stream into set (l + 1) % 2, after the
    // attention that last read that set; layer l's attention after its own gather.
    cuda::Stream copy;
    cuda::Event ready[2], done[2];
    const int32_t* ahead_table[2] = {nullptr, nullptr};
    auto stage_ahead = [&](int layer) {
      const int set = layer % 2;
      done[set].wait(copy.handle());
      ahead_table[set] = pool->stage(caches[layer].view(), nullptr, nullptr, 0, copy.handle(), set);
      ready[set].record(copy.handle());
    };
    for (const int st : o_.stage) {
      if (st && !staging) continue;  // nothing on the host
      std::vector<std::unique_ptr<cuda::AttentionPlan>> plans;
      for (int l = 0; l < L; ++l) plans.push_back(std::make_unique<cuda::AttentionPlan>(caches[l].view(), shape_.group()));
      methods.push_back(run_steps(label("dense", st), [&](int l, const float* q) {
        cuda::DeviceDecodeArgs a;
        a.kv = caches[l].view();
        if (st == 1) phase("stage", [&] { a.kv.page_table = pool->stage(a.kv, nullptr, nullptr, 0); });
        if (st == 2) {
          if (l == 0) {  // the previous step's attention is done with both sets
            done[0].record();
            done[1].record();
            stage_ahead(0);
          }
          if (l + 1 < L) stage_ahead(l + 1);
          ready[l % 2].wait();
          a.kv.page_table = ahead_table[l % 2];
        }
        a.group = shape_.group();
        a.scale = 1.0f / std::sqrt(static_cast<float>(d));
        a.q = q;
        a.out = out.as<float>();
        a.lse = lse.as<float>();
        phase("attend", [&] { cuda::attention_decode(a, *plans[l]); });
        if (st == 2) done[l % 2].record();
        phase("mark", [&] { pool->mark(caches[l].view(), nullptr, nullptr, 0); });
      }));
      methods.back()["staged"] = st != 0;
    }
    // The sparse method, its index built first (timed apart).
    if (o_.method != kDenseMethod) {
      std::vector<std::unique_ptr<cuda::SparseDecoder>> decs;
      t0 = Clock::now();
      for (int l = 0; l < L; ++l) {
        decs.push_back(cuda::model::make_cuda_decoder(reg_, o_.method, o_.params, caches[l].view(), shape_, l));
        CUMULUS_CHECK(decs.back() != nullptr, "--method {}: no GPU decoder", o_.method);
        decs.back()->prefill();
      }
      cuda::device_synchronize();
      row["index_s"] = seconds_since(t0);
      for (const int sg : o_.stage) {
        if ((sg && !staging) || sg == 2) continue;  // a layer ahead: dense alone (a sparse layer's pages follow its query)
        for (const int mp : o_.max_promote) {
          pool->set_max_promote(mp);
          methods.push_back(run_steps(label(fmt::format("{}/p{}", o_.method, mp), sg), [&](int l, const float* q) {
            cuda::SparseDecoder& dec = *decs[l];
            phase("select", [&] { dec.select(q); });
            phase("stage", [&] {
              dec.set_attend_page_table(sg ? pool->stage(caches[l].view(), dec.dense_step() ? nullptr : dec.list_idx(),
                                                         dec.list_len(), dec.list_stride())
                                           : nullptr);
            });
            phase("attend", [&] { dec.attend(q, out.as<float>(), nullptr); });
            phase("mark", [&] {
              pool->mark(caches[l].view(), dec.dense_step() ? nullptr : dec.list_idx(), dec.list_len(),
                         dec.list_stride());
            });
          }));
          methods.back()["max_promote"] = mp;
          methods.back()["staged"] = sg != 0;
          const cuda::SparseStepStats st = decs[0]->stats();
          double tok = 0;
          for (int x : st.tokens) tok += x;
          methods.back()["kv_share_layer0"] = tok / (static_cast<double>(st.tokens.size()) * n);
        }
      }
    }
    row["methods"] = methods;
    return row;
  }

 private:
  const Options& o_;
  ThreadPool& tp_;
  Registry reg_;
  Shape shape_;
  const TraceFile* trace_ = nullptr;
  std::vector<KvCache> trace_kv_;
  double h2d_, copy_;
  std::unique_ptr<Workload> wl_;
};

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      CUMULUS_CHECK(i + 1 < argc, "{} needs a value", a);
      return argv[++i];
    };
    if (a == "--contexts") o.contexts = int_list(a, next());
    else if (a == "--ratio-context") o.ratio_context = parse_int(next(), a);
    else if (a == "--ratio-batch") o.ratio_batch = parse_int(next(), a);
    else if (a == "--ratios") o.ratios = int_list(a, next());
    else if (a == "--layers") o.layers = parse_int(next(), a);
    else if (a == "--steps") o.steps = parse_int(next(), a);
    else if (a == "--warmup") o.warmup = parse_int(next(), a);
    else if (a == "--method") o.method = next();
    else if (a == "--param") {
      const std::string kv = next();
      const size_t eq = kv.find('=');
      CUMULUS_CHECK(eq != std::string::npos && eq > 0, "--param '{}' is not KEY=VALUE", kv);
      o.params[kv.substr(0, eq)] = kv.substr(eq + 1);
    } else if (a == "--device-kv-gib") o.device_kv_gib = parse_double(next(), a);
    else if (a == "--margin-gib") o.margin_gib = parse_double(next(), a);
    else if (a == "--key-stats") o.key_stats = true;
    else if (a == "--promote-reads") o.promote_reads = parse_int(next(), a);
    else if (a == "--max-promote") o.max_promote = int_list(a, next());
    else if (a == "--stage") o.stage = int_list(a, next());
    else if (a == "--seed") o.seed = static_cast<uint64_t>(parse_int(next(), a));
    else if (a == "--json") o.json_path = next();
    else if (a == "--trace") o.trace = next();
    else CUMULUS_FAIL("unknown argument '{}' (see the usage at the top of bench/cuda_tier_bench.cpp)", a);
  }
  for (int n : o.contexts) CUMULUS_CHECK(n >= 16 && n <= (1 << 20), "--contexts: {} must be in [16, 1048576]", n);
  CUMULUS_CHECK(o.ratio_context >= 16 && o.ratio_context <= (1 << 20), "--ratio-context={} must be in [16, 1048576]",
                o.ratio_context);
  CUMULUS_CHECK(o.ratio_batch >= 1, "--ratio-batch={} must be >= 1", o.ratio_batch);
  for (int r : o.ratios) CUMULUS_CHECK(r >= 1, "--ratios: {} must be >= 1", r);
  CUMULUS_CHECK(o.layers >= 1 && o.steps >= 1 && o.warmup >= 0, "--layers={}, --steps={} must be >= 1, --warmup={} >= 0",
                o.layers, o.steps, o.warmup);
  CUMULUS_CHECK(o.promote_reads == 1 || o.promote_reads == 2, "--promote-reads={} must be 1 or 2", o.promote_reads);
  CUMULUS_CHECK(!o.max_promote.empty(), "--max-promote needs at least one value");
  for (int m : o.max_promote) CUMULUS_CHECK(m >= -1, "--max-promote: {} must be >= -1", m);
  CUMULUS_CHECK(!o.stage.empty(), "--stage needs at least one value");
  for (int v : o.stage) CUMULUS_CHECK(v >= 0 && v <= 2, "--stage: {} must be 0, 1 or 2", v);
  CUMULUS_CHECK(o.device_kv_gib >= 0 && o.margin_gib >= 0, "--device-kv-gib={} and --margin-gib={} must be >= 0",
                o.device_kv_gib, o.margin_gib);
  // A trace is read whole before any device work (trace_read checks its header and sizes).
  TraceFile trace;
  if (!o.trace.empty()) {
    trace = trace_read(o.trace);
    CUMULUS_CHECK(!o.ratios.empty(), "--trace runs one case per --ratios value; --ratios is none");
  }
  const Shape shape = o.trace.empty()
                          ? shape_preset("llama3-8b", o.layers)
                          : Shape{static_cast<int>(trace.layers.size()), trace.n_q_heads, trace.n_kv_heads, trace.head_dim};
  {
    const Registry reg = cuda::registry_with_gpu(Registry::builtin());
    if (o.method != kDenseMethod) cuda::model::cuda_decode_method_check(reg, o.method, o.params, shape);
  }
  if (!cuda::device_available()) {
    std::fprintf(stderr, "cuda_tier_bench: no CUDA device\n");
    return 1;
  }
  const std::string dev = cuda_device_summary();
  const double copy = cuda_copy_gbps();
  const double h2d = cuda::host_to_device_gbps(size_t{1} << 30);
  if (o.trace.empty()) {
    fmt::print("device: {}\nllama3-8b attention shape, {} layers, f16 K/V in pages of 16 tokens, method {}\n", dev,
               o.layers, o.method);
  } else {
    fmt::print("device: {}\ntrace {}: {} layers of {} query / {} kv heads, head_dim {}, {} tokens ({} + {} steps), f16 "
               "K/V in pages of 16 tokens, method {}\n",
               dev, o.trace, shape.n_layers, shape.n_q_heads, shape.n_kv_heads, shape.head_dim, trace.n_tokens,
               trace.prompt_tokens, trace.steps, o.method);
  }
  fmt::print("device-to-device copy: {:.0f} GB/s (read + write); pinned host-to-device copy: {:.1f} GB/s (median of 5 "
             "x 1 GiB)\n\n",
             copy, h2d);
  fmt::print("{:<10} {:>8} {:>5} {:<24} {:>7} {:>7} {:>10} {:>8} {:>8} {:>9} {:>8} {:>7} {:>8} {:>9}\n", "case",
             "context", "batch", "method", "dev GiB", "hostGiB", "ms/step", "tok/s", "hit", "pages", "PCIe GB", "GB/s",
             "plan ms", "KVfloor");
  ThreadPool tp(0);
  Runner runner(o, tp, h2d, copy);
  if (!o.trace.empty()) runner.set_trace(trace);
  json report = {{"device", dev},          {"copy_gbps", copy},     {"h2d_gbps", h2d},
                 {"layers", o.layers},     {"method", o.method},    {"params", o.params},
                 {"steps", o.steps},       {"warmup", o.warmup},    {"key_stats", o.key_stats},
                 {"promote_reads", o.promote_reads}, {"max_promote", o.max_promote}, {"stage", o.stage},
                 {"runs", json::array()}};
  if (!o.trace.empty()) {
    report["trace"] = o.trace;
    const int64_t pages = static_cast<int64_t>(shape.n_kv_heads) * ((trace.n_tokens + 15) / 16) * shape.n_layers;
    for (int r : o.ratios)
      report["runs"].push_back(runner.run({trace.n_tokens, 1, (pages + r - 1) / r, fmt::format("trace {}x", r)}));
  } else {
    for (int n : o.contexts) report["runs"].push_back(runner.run({n, 1, 0, "batch1"}));
  }
  if (!o.ratios.empty() && o.trace.empty()) {
    const int64_t pages = static_cast<int64_t>(o.ratio_batch) * 8 * ((o.ratio_context + 15) / 16) * o.layers;
    for (int r : o.ratios)
      report["runs"].push_back(
          runner.run({o.ratio_context, o.ratio_batch, (pages + r - 1) / r, fmt::format("kv={}x", r)}));
  }
  fmt::print("\nms/step: median of {} steps after {} warm-up steps, every layer then the tier's end of step, wall clock "
             "to an idle device; hit: distinct pages read that were on the device; pages: distinct pages read per "
             "step; PCIe GB: K/V rows read from host pages plus the bytes the moves copied, per step; GB/s: that over "
             "the step; plan ms: the tier's host work at the end of the step, once the step's counts are back "
             "(candidates, victims, the moves' launch); KVfloor: the step's K/V reads at the copy rates (host rows at "
             "the pinned host-to-device rate, device pages at the device copy rate), a floor for dense with offload. "
             "Attention only, no weights.\n",
             o.steps, o.warmup);
  if (!o.json_path.empty()) std::ofstream(o.json_path) << report.dump(2) << "\n";
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
