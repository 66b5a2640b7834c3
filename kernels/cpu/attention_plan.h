// How the CPU backend splits one attention call: rows into groups the
// kernel runs together, groups into tasks, tasks into a contiguous range per
// thread of about equal work. Plain data, no kernels: the backend runs the
// plan, tests/kernels/test_attention_plan.cpp checks it on tables. No split
// changes a row's bits (the kernel's operations per query do not depend on
// which rows or heads share its call).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"

namespace cleave::cpu {

// Most rows of one sequence the kernel runs together (their scores and
// outputs stay in the scratch and registers of one call).
constexpr int64_t kAttnGroupRows = 16;

class AttentionPlan {
 public:
  // n rows over a cache of block_size positions a block, n_kv kv heads
  // and n_heads query heads of head_dim, for `threads` threads; below
  // min_parallel_work multiply-adds (or on one thread) it stays serial.
  void plan(const AttnRow* rows, int64_t n, int32_t block_size, int32_t n_kv, int32_t n_heads,
            int32_t head_dim, int threads, int64_t min_parallel_work);

  int64_t groups() const { return int64_t(first_.size()) - 1; }
  // Group g's first row, and one past its last.
  int64_t first(int64_t g) const { return first_[size_t(g)]; }
  int64_t end(int64_t g) const { return first_[size_t(g) + 1]; }
  // The rows' positions, in row order (the kernel reads a group's run of them).
  const int32_t* positions() const { return pos_.data(); }
  // Kv heads a task covers (all of a group's, or one), and tasks per group.
  int32_t heads_per_task() const { return hpt_; }
  int32_t tasks_per_group() const { return tpr_; }
  int64_t tasks() const { return groups() * tpr_; }
  // The most rows in a group (the kernel's scratch is sized by it).
  int32_t max_rows() const { return max_rows_; }
  // Whether to run over the threads; then thread t takes tasks
  // [bounds(t), bounds(t + 1)).
  bool parallel() const { return !bounds_.empty(); }
  int64_t bounds(int t) const { return bounds_[size_t(t)]; }
  // Multiply-adds of group g (positions attended x heads x head_dim x 2).
  int64_t group_work(int64_t g) const { return work_[size_t(g)]; }

 private:
  std::vector<int64_t> first_;  // each group's first row, then n
  std::vector<int32_t> pos_;
  std::vector<int64_t> work_;
  std::vector<int64_t> bounds_;  // empty: serial
  int32_t hpt_ = 1, tpr_ = 1, max_rows_ = 1;
};

}  // namespace cleave::cpu
