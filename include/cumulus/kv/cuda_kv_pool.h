// The KV page pool of the GPU runtime, in two tiers (src/kv/cuda/kv_pool.cu, library
// cumulus_kv_cuda; docs/cuda.md "Host tier"): device memory and pinned host memory behind one
// range of device addresses per array, so that every kernel reads a page wherever it lives
// (a host page over PCIe, as mapped pinned memory is read) and a page's tier changes where
// its bytes are, never what a kernel computes from them. Slots [0, device_pages) are device
// memory, [device_pages, device_pages + host_pages) host memory, and K and V have
// stage_sets x stage_pages more device slots after those, where stage() copies the host rows
// a layer's attention reads (a staged table points at them; no cache's own table does). One pool
// serves every layer and sequence (Progressive Sparse Attention's unified block pool):
// DeviceKvCache::create over a pool takes its pages from it. Recency lives on the device: each slot keeps the last
// step that read or placed its page. After each decode step, the host pages read in this
// step and the one before (promote_reads 2; every host page read, 1) are promoted over the
// least recently used device pages, which go to the host (Progressive Sparse Attention's LRU
// eviction; ties go to the lower slot); TierSlots (kv/tier_slots.h) pairs them, and the
// moves run on the device in one kernel, ordered on the step's stream after every read of
// the step. Plain C++: no CUDA header. Built only with CUMULUS_CUDA=ON.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cumulus/core/cuda_runtime.h"
#include "cumulus/core/dtype.h"
#include "cumulus/kv/tier_slots.h"

namespace cumulus::cuda {

// The pool's arrays as kernels address them (K, V, kmin, kmax, kmean).
struct KvPoolArrays {
  char* base[5];
  int bytes[5];  // per page, multiples of 16; 0 for an array the pool does not keep
};

struct KvPoolOptions {
  int head_dim = 128;
  DType dtype = DType::f16;
  int page_size = 16;
  int64_t device_pages = 0;  // rounded down to the mapping granularity (device_pages_granule)
  int64_t host_pages = 0;    // 0: no host tier; rounded up to the granularity
  int64_t max_promote = -1;  // pages promoted per step at most (< 0: as many as have slots)
  // Reads that promote a host page: 2, read in two steps running (a page read once, as most
  // of a sparse step's tail is, stays where it is read over PCIe); 1, its first read (plain
  // LRU, which moves every page a step reads).
  int promote_reads = 2;
  // Keep each page's key min, max and mean (kmin, kmax, kmean; quest and psa score pages by
  // them). false: K and V alone, 16% less memory at head_dim 128; the views' statistics are
  // null, and a decoder that needs them refuses the view.
  bool key_stats = true;
  // Device slots for staging (stage()): a layer's attention reads the host rows its lists
  // name from copies here, gathered over PCIe by one kernel at the copy rate, instead of
  // reading them in place (ours). 0: none, host rows are read in place. Rounded up to the
  // mapping granularity of the K and V arrays; the area follows the host tier's slots.
  int64_t stage_pages = 0;
  // Staging areas of stage_pages each (1 or 2): with 2, stage() of one layer (into one set,
  // on a copy stream) can run while the attention of the layer before reads the other set,
  // as offloading engines stream a layer ahead.
  int stage_sets = 1;
};

// One step's tier work, and the sums over steps.
struct TierStats {
  int64_t steps = 0;
  int64_t hits = 0, misses = 0;  // distinct pages read per step on the device, on the host
  int64_t promoted = 0, demoted = 0;  // pages moved to the device, and from it to make room
  int64_t host_rows = 0;      // K/V rows the step's lists read from host pages (over PCIe)
  int64_t moved_bytes = 0;    // bytes the moves copied across PCIe (both directions)
  int64_t staged_rows = 0;    // K/V rows stage() copied from host pages to the staging area
  int64_t unstaged_pages = 0; // host pages stage() found no staging slot for (read in place)
  double wait_ms = 0;         // end_step()'s wait for the step's work and its counts
  double plan_ms = 0;         // then its host time: candidates, victims, the moves' launch
  double hit_rate() const { return hits + misses > 0 ? static_cast<double>(hits) / (hits + misses) : 1.0; }
  TierStats& operator+=(const TierStats& o) {
    steps += o.steps;
    hits += o.hits;
    misses += o.misses;
    promoted += o.promoted;
    demoted += o.demoted;
    host_rows += o.host_rows;
    moved_bytes += o.moved_bytes;
    staged_rows += o.staged_rows;
    unstaged_pages += o.unstaged_pages;
    wait_ms += o.wait_ms;
    plan_ms += o.plan_ms;
    return *this;
  }
};

class KvPagePool {
 public:
  // Allocates both tiers (the host tier pinned and mapped for the device) and zeroes them.
  // Throws Error for bad options, DeviceMemoryError when the device tier does not fit, and
  // Error naming the size when the host tier cannot be pinned or this driver cannot map host
  // memory into device addresses.
  static std::shared_ptr<KvPagePool> create(const KvPoolOptions& options);
  // Bytes one page occupies: its K and V rows and, with key_stats, its key min, max and mean.
  static size_t page_bytes(int head_dim, DType dtype, int page_size, bool key_stats = true);
  // Device bytes the pool keeps besides its device tier: each slot's epoch, the candidates,
  // the victims' sort (memory checks).
  static size_t overhead_bytes(int64_t device_pages, int64_t host_pages);
  // The page count device_pages is rounded to (every array's device part a whole number of
  // mapping granules); needs a device.
  static int64_t device_pages_granule(int head_dim, DType dtype, int page_size, bool key_stats = true);

  ~KvPagePool();
  KvPagePool(const KvPagePool&) = delete;
  KvPagePool& operator=(const KvPagePool&) = delete;

  const KvPoolOptions& options() const { return o_; }  // device_pages, host_pages as rounded
  // Arrays as DeviceKvView reads them ([slot][page_size][head_dim]; [slot][head_dim]).
  void* k() const { return arr_[0].va; }
  void* v() const { return arr_[1].va; }
  // Null without key_stats.
  float* kmin() const { return static_cast<float*>(arr_[2].va); }
  float* kmax() const { return static_cast<float*>(arr_[3].va); }
  float* kmean() const { return static_cast<float*>(arr_[4].va); }
  size_t device_bytes() const;  // the device tier and the staging area
  size_t host_bytes() const;
  int64_t free_device_pages() const { return slots_.free_device(); }
  int64_t free_host_pages() const { return slots_.free_host(); }
  const TierSlots& slots() const { return slots_; }
  // Tests: each slot's epoch (the step that last read or placed its page; 0x7fffffff: free),
  // and the k least recently used device pages now (read before the current step), oldest
  // first, ties to the lower slot. Synchronous.
  std::vector<int32_t> device_epochs() const;
  std::vector<int32_t> victims(int64_t k);
  uint64_t step() const { return time_; }

  // ---- placement (DeviceKvCache over a pool) ----
  // n new pages for the page-table entries given (device pointers into a page table, and the
  // host copies of the same entries): each gets a slot (TierSlots::place: a free device slot,
  // else one whose least recently used page moves to a free host slot, else a free host slot),
  // written to its host entry; demoted pages move on the device, with both copies of their
  // entries, before this returns. The caller uploads its new entries.
  // Throws Error, before any change, when the pool has fewer than n free slots.
  void allocate(int n, int32_t* const* device_entries, int32_t* const* host_entries);
  // The pages in these slots are gone: their bytes are zeroed (free slots hold zeros, as
  // padding rows of a partial page must read) and the slots freed. Synchronous.
  void release(const std::vector<int32_t>& slots);

  // ---- the tier step ----
  // Records the pages that lists of one layer read, for end_step(): idx [n_seqs][n_kv][stride]
  // sorted token indices with len [n_seqs][n_kv] (SparseDecoder::list_idx, list_len), or
  // idx == nullptr for every cached token of kv. Asynchronous, on `stream`; nothing without
  // a host tier. The step is read on the device, so a mark captured in a CUDA graph
  // replays with the step it runs in.
  void mark(const DeviceKvView& kv, const int32_t* idx, const int32_t* len, int stride, void* stream = nullptr);
  // Ends the step: waits for its counts and candidates (and, to pick victims, for a sort of
  // the device slots by age: a few short copies back), enqueues the moves on `stream` (after
  // the step's reads), and advances the step's clock. Returns this step's numbers (also added
  // to totals()). A page placed in a step counts as read in it.
  TierStats end_step(void* stream = nullptr);

  // ---- staging: host rows read from device memory (ours) ----
  // Sizes the scratch of stage() (each set's) for views of this shape (n_seqs, n_kv_heads,
  // max_pages): call it outside any captured graph, before the first stage(). Nothing
  // without a staging area.
  void reserve_stage(const DeviceKvView& kv);
  // Before one layer's attention: copies the host rows its lists read (idx, len, stride as
  // mark() takes them; idx == nullptr: every page of every sequence) to staging slots, one
  // staging slot per host page read, each row to the same row of its copy, and returns the
  // layer's page table with those pages pointing at their copies. Attention over the
  // returned table reads the same bytes at the same positions, so it computes exactly what
  // it would over kv.page_table, with every row from device memory; host pages beyond the
  // staging area keep their own slots (read in place). Asynchronous, on `stream`, and
  // capturable; the table is valid until the next stage() into the same set (0 or 1 <
  // stage_sets; two stages into different sets may run on different streams at once).
  // Returns kv.page_table itself, enqueuing nothing, without a staging area or a host tier.
  const int32_t* stage(const DeviceKvView& kv, const int32_t* idx, const int32_t* len, int stride,
                       void* stream = nullptr, int set = 0);
  int64_t stage_pages() const { return o_.host_pages > 0 ? o_.stage_pages : 0; }
  const TierStats& totals() const { return totals_; }
  // Changes options().max_promote from the next end_step() on (benchmarks compare policies
  // over one filled pool).
  void set_max_promote(int64_t max_promote) { o_.max_promote = max_promote; }
  void reset_totals() { totals_ = {}; }

 private:
  struct Array {
    void* va = nullptr;
    size_t bytes_per_page = 0, reserved = 0;
    unsigned long long dev_handle = 0, host_handle = 0, stage_handle = 0;
    size_t dev_bytes = 0, host_bytes = 0, stage_bytes = 0;
  };
  using Arrays = KvPoolArrays;
  KvPagePool(const KvPoolOptions& o);
  Arrays arrays() const;
  // Waits for the stream of the last end_step(): placement and release work on the default
  // stream, after the step's moves.
  void wait_last_step();
  // Enqueues the moves on `stream`; returns the bytes they copy across PCIe.
  int64_t apply(const std::vector<PageMove>& moves, void* stream);

  KvPoolOptions o_;
  Array arr_[5];
  TierSlots slots_;
  uint64_t time_ = 1;
  void* last_stream_ = nullptr;
  bool last_stream_set_ = false;
  std::vector<int32_t*> owner_dev_, owner_host_;  // [slot] the page-table entry of its page
  DeviceBuffer epoch_, step_, cands_, counters_, moves_, sort_keys_, sort_vals_, sort_temp_;
  // stage(), per set: the returned table, the pages a list reads, the next staging slot.
  std::vector<DeviceBuffer> staged_table_, touched_;
  DeviceBuffer stage_next_;
  std::vector<int32_t> cands_host_;
  TierStats totals_;
};

}  // namespace cumulus::cuda
