// A fixed pool of worker threads. parallel_for(n, fn) runs fn(task, worker) for every
// task in [0, n); the caller's thread takes part as worker 0.
//
// Latency: a decode step of the model runtime issues ~200 parallel_for calls of 10-100 us
// each, so waking a sleeping worker (a futex round trip, ~10 us here) would cost a large
// share of the step. Idle workers therefore spin on the job counter for up to kSpinUs
// before sleeping on the condition variable, and the caller spins likewise while the
// last tasks finish. Tasks are claimed and counted with atomics, not the mutex (a decode
// step ran ~10^4 tasks when this was measured; two contended lock round trips each cost
// ~1 ms per step): the
// claim counter holds the job's generation in its high 32 bits and the next task in its
// low 32 bits, so a worker still looping after its job ended can never claim a task of the
// next job. The mutex guards the job description (fn, n) and the sleeps.
//
// Determinism: the pool decides only WHO runs a task, never how work is split. Kernels
// split work into tasks whose count depends on the problem size alone and merge partial
// results in task order, so results are bit-identical for any number of threads. The one
// split by thread count, the quantised GEMV's rows (gemv_quant_task_rows), merges nothing:
// each row is computed by the same instructions in whichever task it falls.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cumulus {

class ThreadPool {
 public:
  // n_threads >= 1 (the caller counts as one); 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int n_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Blocks until all n tasks have run. fn must not throw across threads: the first
  // exception is captured and rethrown here after all tasks finished.
  void parallel_for(int64_t n, const std::function<void(int64_t task, int worker)>& fn);

 private:
  void worker_loop(int worker);
  // Claims and runs tasks of the job of generation `gen` (low 32 bits) until none is left.
  void run_tasks(int worker, uint32_t gen, const std::function<void(int64_t, int)>& fn, int64_t n);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<uint64_t> claim_{0};       // (generation << 32) | next task
  std::atomic<int64_t> done_tasks_{0};   // tasks finished in the current job
  std::atomic<uint64_t> generation_{0};  // written under mu_, read while spinning
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace cumulus
