// The CPU backend's own persistent worker threads.
//
// parallel_for(n_tasks, fn) splits [0, n_tasks) into `threads()` contiguous
// ranges (static partitioning: range t is [n*t/T, n*(t+1)/T)) and calls
// fn(begin, end, t) once for each non-empty range t. Thread t (the caller
// is 0, worker i is i) claims range t first, so a range of rows written in
// one region is usually read by the same core in the next (the CPU backend
// splits a prefill's matmuls and row ops by the same rows); then it claims
// whatever range is left, so a worker that is asleep or descheduled (the
// machine is shared) never holds the region up. The partition, and so every
// result, is the same either way; t identifies the range (use it to pick
// per-range scratch), not the OS thread.
//
// Latency: workers spin on a generation counter for a short while after each
// region before sleeping on a futex, so back-to-back regions (batch-1 decode
// issues ~150 per token) cost a few microseconds each. Nothing is allocated
// per call. One caller at a time: parallel_for is not reentrant and must not be
// called concurrently on the same pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace cleave {

class ThreadPool {
 public:
  using TaskFn = void (*)(void* ctx, int64_t begin, int64_t end, int thread);

  // threads >= 1: the calling thread plus threads - 1 workers.
  // spin_us: how long an idle worker polls before it sleeps.
  explicit ThreadPool(int threads, int spin_us = 50);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }

  // Type-erased entry point; fn(ctx, begin, end, thread).
  void run(int64_t n_tasks, TaskFn fn, void* ctx);

  // fn(int64_t begin, int64_t end, int thread). fn is borrowed, not copied.
  template <class F>
  void parallel_for(int64_t n_tasks, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run(
        n_tasks,
        [](void* c, int64_t b, int64_t e, int t) { (*static_cast<Fn*>(c))(b, e, t); },
        const_cast<void*>(static_cast<const void*>(&fn)));
  }

  // Task range [begin, end) of thread t when n tasks are split over T threads.
  static void split(int64_t n, int t, int T, int64_t* begin, int64_t* end) {
    *begin = n * t / T;
    *end = n * (t + 1) / T;
  }

 private:
  void worker_main(int self);
  // Claim and run ranges of the current job until none is left: range self
  // first, then the others in order.
  void drain(int self);
  // Claims range r of job `job` (claimed_[r] holds the last job that claimed
  // it; job numbers only grow, so an older one means unclaimed).
  bool claim(int r, uint32_t job);

  int threads_;
  int spin_us_;
  std::vector<std::thread> workers_;

  // The current job, published by bumping generation_.
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<bool> stop_{false};

  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int32_t> sleepers_{0};
  // The current job's number, stored after its fields (release).
  alignas(64) std::atomic<uint32_t> job_{0};
  std::unique_ptr<std::atomic<uint32_t>[]> claimed_;  // per range: the last job that claimed it
  alignas(64) std::atomic<int32_t> done_{0};  // ranges finished in the current job
};

}  // namespace cleave
