#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "kernels/thread_pool.h"

using cleave::ThreadPool;

TEST_CASE("thread pool: every task exactly once - contiguous static ranges") {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    CHECK(pool.threads() == threads);
    for (int64_t n : {int64_t(1), int64_t(2), int64_t(3), int64_t(7), int64_t(1000)}) {
      std::vector<std::atomic<int>> hit(static_cast<size_t>(n));
      std::vector<int64_t> begins(static_cast<size_t>(threads), -1), ends(static_cast<size_t>(threads), -1);
      pool.parallel_for(n, [&](int64_t b, int64_t e, int t) {
        begins[t] = b;
        ends[t] = e;
        for (int64_t i = b; i < e; ++i) hit[i].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) CHECK(hit[i].load() == 1);
      if (n >= threads && n > 1) {
        for (int t = 0; t < threads; ++t) {
          int64_t b, e;
          ThreadPool::split(n, t, threads, &b, &e);
          CHECK(begins[t] == b);
          CHECK(ends[t] == e);
        }
      }
    }
  }
}

TEST_CASE("thread pool: many short regions - and regions after the workers slept") {
  ThreadPool pool(2, 20);
  std::atomic<int64_t> sum{0};
  for (int r = 0; r < 20000; ++r) {
    pool.parallel_for(2, [&](int64_t b, int64_t e, int) { sum.fetch_add(e - b); });
  }
  CHECK(sum.load() == 40000);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // workers go to sleep
  for (int r = 0; r < 50; ++r) {
    pool.parallel_for(4, [&](int64_t b, int64_t e, int) { sum.fetch_add(e - b); });
    if (r % 10 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
  }
  CHECK(sum.load() == 40200);
}

TEST_CASE("thread pool: latency of an empty region") {
  ThreadPool pool(2);
  for (int r = 0; r < 1000; ++r) pool.parallel_for(2, [](int64_t, int64_t, int) {});
  const int reps = 20000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) pool.parallel_for(2, [](int64_t, int64_t, int) {});
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
  MESSAGE("empty parallel region, 2 threads: " << us << " us");
  CHECK(us < 1000.0);  // generous: the machine is shared; the real figure is printed
}

TEST_CASE("thread pool: workers take ranges - results never depend on who ran a range") {
  ThreadPool pool(2);
  int on_worker = 0;
  for (int r = 0; r < 20; ++r) {
    std::thread::id who[2];
    pool.parallel_for(2, [&](int64_t, int64_t, int t) {
      who[t] = std::this_thread::get_id();
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(300);
      while (std::chrono::steady_clock::now() < until) {
      }
    });
    if (who[1] != std::this_thread::get_id() || who[0] != std::this_thread::get_id()) ++on_worker;
  }
  CHECK(on_worker > 0);
}
