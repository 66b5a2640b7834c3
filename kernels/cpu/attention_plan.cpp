#include "kernels/cpu/attention_plan.h"

#include <algorithm>

namespace cleave::cpu {

void AttentionPlan::plan(const AttnRow* rows, int64_t n, int32_t block_size, int32_t n_kv, int32_t n_heads,
                         int32_t head_dim, int threads, int64_t min_parallel_work) {
  // Rows of one sequence (one block table) next to each other whose
  // positions fall in one block make a group: the kernel runs them
  // together, sharing each block's loads (a prefill's rows).
  first_.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0 && rows[i].block_table == rows[i - 1].block_table &&
        rows[i].pos / block_size == rows[first_.back()].pos / block_size && i - first_.back() < kAttnGroupRows)
      continue;
    first_.push_back(i);
  }
  const int64_t ngroups = int64_t(first_.size());
  first_.push_back(n);
  pos_.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) pos_[size_t(i)] = rows[i].pos;
  // Decode rows (about one row a group) with groups enough to keep every
  // thread busy: a task is a whole group, its heads' KV read as one run
  // per block. Otherwise a task is one kv head of a group: a prefill's
  // groups share each block's loads over their rows already, and its few
  // groups of growing work (8 for 128 rows) split over the threads evenly
  // only in smaller pieces.
  const bool decode_rows = n <= 2 * ngroups;
  hpt_ = decode_rows && ngroups >= 4 * int64_t(threads) ? n_kv : 1;
  tpr_ = n_kv / hpt_;
  max_rows_ = 1;
  work_.assign(size_t(ngroups), 0);
  int64_t work = 0;
  for (int64_t g = 0; g < ngroups; ++g) {
    max_rows_ = std::max<int32_t>(max_rows_, int32_t(end(g) - first(g)));
    int64_t w = 0;
    for (int64_t i = first(g); i < end(g); ++i) w += int64_t(rows[i].pos + 1);
    work_[size_t(g)] = w * n_heads * head_dim * 2;
    work += work_[size_t(g)];
  }
  bounds_.clear();
  if (work < min_parallel_work || threads == 1) return;
  // A row's work grows with its position (a prefill's last row attends
  // 128 times what its first does): equal counts of rows per thread left
  // one thread with three times the other's work at 2 threads. The
  // threads get contiguous task ranges of equal work instead.
  const int64_t tasks = ngroups * tpr_;
  bounds_.assign(size_t(threads) + 1, tasks);
  bounds_[0] = 0;
  int64_t done = 0;
  int next = 1;
  for (int64_t task = 0; task < tasks && next < threads; ++task) {
    while (next < threads && done * threads >= work * next) bounds_[size_t(next++)] = task;
    done += work_[size_t(task / tpr_)] / tpr_;
  }
}

}  // namespace cleave::cpu
