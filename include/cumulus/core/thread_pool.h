// A fixed pool of worker threads. parallel_for(n, fn) runs fn(task, worker) for every
// task in [0, n); the caller's thread takes part as worker 0.
//
// Latency: a decode step of the model runtime issues ~200 parallel_for calls of 10-100 us
// each, so waking a sleeping worker (a futex round trip, ~10 us here) would cost a large
// share of the step. Idle workers therefore spin on the job counter for up to kSpinUs
// before sleeping on the condition variable, and the caller spins likewise while the
// last tasks finish. All shared state still changes under the mutex; spinning only reads
// the two atomic counters to skip the sleep.
//
// Determinism: the pool decides only WHO runs a task, never how work is split. Kernels
// split work into tasks whose count depends on the problem size alone and merge partial
// results in task order, so results are bit-identical for any number of threads.
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
  void run_tasks(int worker);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  int64_t next_task_ = 0;
  std::atomic<int64_t> done_tasks_{0};    // written under mu_, read while spinning
  std::atomic<uint64_t> generation_{0};   // written under mu_, read while spinning
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace cumulus
