#include "cumulus/core/thread_pool.h"

#include <algorithm>
#include <chrono>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cumulus/core/error.h"

namespace cumulus {
namespace {

// How long an idle worker (or the waiting caller) spins before sleeping.
constexpr double kSpinUs = 100.0;

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins until done() holds or kSpinUs passed; true when done() held.
template <class Done>
bool spin_until(Done done) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if (i % 64 == 0 &&
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() > kSpinUs)
      return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads == 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CUMULUS_CHECK(n_threads >= 1 && n_threads <= 1024, "n_threads={} must be in [1, 1024] (0 = all cores)",
                n_threads);
  for (int w = 1; w < n_threads; ++w) workers_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_tasks(int worker) {
  for (;;) {
    int64_t task;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_task_ >= n_tasks_) return;
      task = next_task_++;
    }
    try {
      (*fn_)(task, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = ++done_tasks_ == n_tasks_;
    }
    if (last) cv_done_.notify_all();
  }
}

void ThreadPool::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_tasks(worker);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_tasks_ = n;
    next_task_ = 0;
    done_tasks_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  cv_start_.notify_all();
  run_tasks(0);
  spin_until([&] { return done_tasks_.load(std::memory_order_acquire) == n; });
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_done_.wait(lock, [&] { return done_tasks_ == n_tasks_; });
    n_tasks_ = 0;
    fn_ = nullptr;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace cumulus
