#include "util/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <string>

namespace dg {

static int default_thread_count() {
  if (const char* env = std::getenv("DIFFGEMMA_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = default_thread_count();
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

static void run_chunk(const std::function<void(size_t, size_t)>& fn, size_t n, size_t chunks, size_t c) {
  size_t begin = n * c / chunks, end = n * (c + 1) / chunks;
  if (begin < end) fn(begin, end);
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk) {
  if (n == 0) return;
  size_t chunks = std::min<size_t>(size_t(size()), std::max<size_t>(1, n / std::max<size_t>(1, min_chunk)));
  if (chunks <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_chunks_ = chunks;
    pending_ = int(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  run_chunk(fn, n, chunks, 0);
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(size_t, size_t)>* job;
    size_t n, chunks;
    {
      std::unique_lock lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      chunks = job_chunks_;
    }
    if (size_t(index) < chunks) run_chunk(*job, n, chunks, size_t(index));
    {
      std::lock_guard lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

ThreadPool& default_thread_pool() {
  static ThreadPool pool;
  return pool;
}

}  // namespace dg
