#include "kernels/thread_pool.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CLEAVE_CPU_RELAX() _mm_pause()
#else
#define CLEAVE_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace cleave {

namespace {

void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

using Clock = std::chrono::steady_clock;

}  // namespace

ThreadPool::ThreadPool(int threads, int spin_us)
    : threads_(threads < 1 ? 1 : threads), spin_us_(spin_us < 0 ? 0 : spin_us) {
  // Every range claimed by job 0: nothing to claim until run() starts job 1.
  claimed_ = std::make_unique<std::atomic<uint32_t>[]>(size_t(threads_));
  for (int r = 0; r < threads_; ++r) claimed_[size_t(r)].store(0, std::memory_order_relaxed);
  workers_.reserve(static_cast<size_t>(threads_ - 1));
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

ThreadPool::~ThreadPool() {
  if (workers_.empty()) return;
  stop_.store(true, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&generation_);
  for (auto& t : workers_) t.join();
}

bool ThreadPool::claim(int r, uint32_t job) {
  std::atomic<uint32_t>& c = claimed_[size_t(r)];
  uint32_t v = c.load(std::memory_order_acquire);
  // v newer than job: a later job's claim, seen by a thread still on this
  // one (its job is over). v == job: taken. Older: free in this job, which
  // cannot end before range r is done, so its fields are still good.
  while (int32_t(job - v) > 0) {
    if (c.compare_exchange_weak(v, job, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
  }
  return false;
}

void ThreadPool::drain(int self) {
  const uint32_t job = job_.load(std::memory_order_acquire);
  for (int i = 0; i < threads_; ++i) {
    const int r = i == 0 ? self : (i <= self ? i - 1 : i);  // self first, then the rest in order
    if (!claim(r, job)) continue;
    int64_t b, e;
    split(n_tasks_, r, threads_, &b, &e);
    if (b < e) fn_(ctx_, b, e, r);
    done_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::run(int64_t n_tasks, TaskFn fn, void* ctx) {
  if (n_tasks <= 0) return;
  if (threads_ == 1 || n_tasks == 1) {
    fn(ctx, 0, n_tasks, 0);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  n_tasks_ = n_tasks;
  done_.store(0, std::memory_order_relaxed);
  job_.store(job_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  // seq_cst pairs with the workers' sleepers_ increment then generation_ load:
  // either we see a sleeper and wake it, or it sees the new generation.
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation_);

  drain(0);  // our range, and any range no worker has picked up yet

  int spins = 0;
  while (done_.load(std::memory_order_acquire) != threads_) {
    CLEAVE_CPU_RELAX();
    if (++spins > 20000) std::this_thread::yield();
  }
}

void ThreadPool::worker_main(int self) {
  uint32_t seen = 0;  // the generation at construction (run() may start before we do)
  for (;;) {
    uint32_t g = generation_.load(std::memory_order_acquire);
    if (g == seen && spin_us_ > 0) {
      const auto deadline = Clock::now() + std::chrono::microseconds(spin_us_);
      for (int it = 0;; ++it) {
        CLEAVE_CPU_RELAX();
        g = generation_.load(std::memory_order_acquire);
        if (g != seen) break;
        if ((it & 63) == 63 && Clock::now() > deadline) break;
      }
    }
    if (g == seen) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      while ((g = generation_.load(std::memory_order_seq_cst)) == seen) futex_wait(&generation_, seen);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    seen = g;
    if (stop_.load(std::memory_order_relaxed)) return;
    drain(self);
  }
}

}  // namespace cleave
