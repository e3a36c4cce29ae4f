#include "cumulus/core/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <system_error>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "core/check.h"

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
  workers_.reserve(static_cast<size_t>(n_threads - 1));
  for (int w = 1; w < n_threads; ++w) {
    try {
      workers_.emplace_back([this, w] { worker_loop(w); });
    } catch (const std::system_error& e) {
      // The threads already started wait for work on this pool's condition variable: stop
      // and join them before the pool's members go (destroying the variable under them
      // deadlocks; a joinable std::thread terminates).
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
      }
      cv_start_.notify_all();
      for (auto& t : workers_) t.join();
      CUMULUS_FAIL("cannot start thread {} of {} ({}; a process limit such as `ulimit -u`?): use fewer threads", w + 1,
                   n_threads, e.code().message());
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_tasks(int worker, uint32_t gen, const std::function<void(int64_t, int)>& fn, int64_t n) {
  uint64_t v = claim_.load(std::memory_order_acquire);
  for (;;) {
    if (static_cast<uint32_t>(v >> 32) != gen || static_cast<int64_t>(v & 0xFFFFFFFFu) >= n) return;
    if (!claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    const auto task = static_cast<int64_t>(v & 0xFFFFFFFFu);
    try {
      fn(task, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    if (done_tasks_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      // Under the mutex, so the caller cannot miss it between its check and its wait.
      std::lock_guard<std::mutex> lock(mu_);
      cv_done_.notify_all();
    }
    v = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
    const std::function<void(int64_t, int)>* fn = nullptr;
    int64_t n = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      n = n_tasks_;
    }
    // fn == nullptr: that job already ended (the caller clears it); wait for the next.
    if (fn != nullptr) run_tasks(worker, static_cast<uint32_t>(seen), *fn, n);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  CUMULUS_CHECK(n <= 0x7FFFFFFF, "parallel_for: n={} tasks exceeds 2^31 - 1", n);
  uint32_t gen;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_tasks_ = n;
    done_tasks_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    gen = static_cast<uint32_t>(generation_.load(std::memory_order_relaxed) + 1);
    claim_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_start_.notify_all();
  run_tasks(0, gen, fn, n);
  spin_until([&] { return done_tasks_.load(std::memory_order_acquire) == n; });
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_done_.wait(lock, [&] { return done_tasks_.load(std::memory_order_acquire) == n; });
    n_tasks_ = 0;
    fn_ = nullptr;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace cumulus
