#pragma once
// A fixed pool of worker threads for data-parallel loops. parallel_for splits [0, n) into contiguous static chunks,
// so every output element is computed by exactly one thread with the same arithmetic order regardless of the
// thread count: results are bit-identical across thread counts.
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dg {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads = 0);  // 0: hardware concurrency (or DIFFGEMMA_THREADS)
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  // fn(begin, end) over disjoint chunks of [0, n); runs on the caller plus the workers. Not reentrant.
  void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk = 1);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0, job_chunks_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

ThreadPool& default_thread_pool();

}  // namespace dg
