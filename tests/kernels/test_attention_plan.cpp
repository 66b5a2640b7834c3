// The CPU backend's split of an attention call (kernels/cpu/attention_plan.h)
// on tables: groups, tasks and each thread's range of work.
#include <doctest/doctest.h>

#include <vector>

#include "kernels/cpu/attention_plan.h"

using cleave::AttnRow;
using cleave::cpu::AttentionPlan;

namespace {

constexpr int32_t kBs = 16, kKv = 4, kHeads = 12, kHd = 64;

// A prompt of n rows at positions [p0, p0 + n) of one sequence.
std::vector<AttnRow> prompt(const int32_t* table, int32_t p0, int32_t n) {
  std::vector<AttnRow> rows;
  for (int32_t i = 0; i < n; ++i) rows.push_back(AttnRow{table, 64, p0 + i});
  return rows;
}

int64_t work_of(const std::vector<AttnRow>& rows, int64_t b, int64_t e) {
  int64_t w = 0;
  for (int64_t i = b; i < e; ++i) w += int64_t(rows[size_t(i)].pos + 1) * kHeads * kHd * 2;
  return w;
}

}  // namespace

TEST_CASE("attention plan: a prefill's rows group by block, at most 16, one kv head a task") {
  const int32_t table[64] = {};
  // 128 rows from position 5: groups cut at absolute blocks (11 rows, then 16s, then 5).
  const auto rows = prompt(table, 5, 128);
  AttentionPlan p;
  p.plan(rows.data(), int64_t(rows.size()), kBs, kKv, kHeads, kHd, 2, 0);
  REQUIRE(p.groups() == 9);
  CHECK(p.first(0) == 0);
  CHECK(p.end(0) == 11);
  for (int64_t g = 1; g < 8; ++g) CHECK(p.end(g) - p.first(g) == 16);
  CHECK(p.end(8) - p.first(8) == 5);
  CHECK(p.max_rows() == 16);
  CHECK(p.heads_per_task() == 1);
  CHECK(p.tasks_per_group() == kKv);
  CHECK(p.tasks() == 9 * kKv);
  for (int64_t i = 0; i < 128; ++i) CHECK(p.positions()[i] == rows[size_t(i)].pos);
  for (int64_t g = 0; g < p.groups(); ++g) CHECK(p.group_work(g) == work_of(rows, p.first(g), p.end(g)));
}

TEST_CASE("attention plan: decode rows of many sequences run whole groups, few run per head") {
  std::vector<std::vector<int32_t>> tables(32, std::vector<int32_t>(64, 0));
  std::vector<AttnRow> rows;
  for (int s = 0; s < 32; ++s) rows.push_back(AttnRow{tables[size_t(s)].data(), 64, 100 + s});
  AttentionPlan p;
  // 32 groups of one row: at least 4 a thread on 2 threads, so whole groups.
  p.plan(rows.data(), 32, kBs, kKv, kHeads, kHd, 2, 0);
  CHECK(p.groups() == 32);
  CHECK(p.heads_per_task() == kKv);
  CHECK(p.tasks() == 32);
  // 8 sequences on 4 threads: too few groups, so one kv head a task.
  p.plan(rows.data(), 8, kBs, kKv, kHeads, kHd, 4, 0);
  CHECK(p.groups() == 8);
  CHECK(p.heads_per_task() == 1);
  CHECK(p.tasks() == 8 * kKv);
  // Rows of one sequence in different blocks never share a group.
  const int32_t table[64] = {};
  const std::vector<AttnRow> two = {AttnRow{table, 64, 15}, AttnRow{table, 64, 16}};
  p.plan(two.data(), 2, kBs, kKv, kHeads, kHd, 1, 0);
  CHECK(p.groups() == 2);
}

TEST_CASE("attention plan: threads get contiguous task ranges of about equal work") {
  const int32_t table[64] = {};
  const auto rows = prompt(table, 0, 128);
  for (int threads : {2, 3, 4}) {
    AttentionPlan p;
    p.plan(rows.data(), 128, kBs, kKv, kHeads, kHd, threads, 0);
    REQUIRE(p.parallel());
    CHECK(p.bounds(0) == 0);
    CHECK(p.bounds(threads) == p.tasks());
    const int64_t total = work_of(rows, 0, 128);
    int64_t max_task = 0;
    for (int64_t g = 0; g < p.groups(); ++g) max_task = std::max(max_task, p.group_work(g) / p.tasks_per_group());
    for (int t = 0; t < threads; ++t) {
      INFO("threads " << threads << " thread " << t);
      REQUIRE(p.bounds(t) <= p.bounds(t + 1));
      int64_t w = 0;
      for (int64_t task = p.bounds(t); task < p.bounds(t + 1); ++task)
        w += p.group_work(task / p.tasks_per_group()) / p.tasks_per_group();
      // Each range is within one task of an equal share (rows' work grows
      // with position: equal row counts would put 3x the work on the last).
      CHECK(w <= total / threads + max_task);
      CHECK(w >= total / threads - max_task);
    }
  }
  // Below the parallel threshold, or on one thread, it stays serial.
  AttentionPlan p;
  p.plan(rows.data(), 128, kBs, kKv, kHeads, kHd, 2, int64_t(1) << 40);
  CHECK_FALSE(p.parallel());
  p.plan(rows.data(), 128, kBs, kKv, kHeads, kHd, 1, 0);
  CHECK_FALSE(p.parallel());
}
