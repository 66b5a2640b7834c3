// KvPoolIndex on tables: which stores hold a leading run of a request's keys.
#include <doctest/doctest.h>

#include <vector>

#include "storage/kv_pool_index.h"

using namespace cleave;

namespace {
std::vector<BlockKey> keys(uint64_t first, int n) {
  std::vector<BlockKey> out;
  for (int i = 0; i < n; ++i) out.push_back(BlockKey{first + uint64_t(i), 7});
  return out;
}
std::vector<BlockKey> slice(const std::vector<BlockKey>& k, size_t from, size_t to) {
  return {k.begin() + long(from), k.begin() + long(to)};
}
}  // namespace

TEST_CASE("kv pool index: leading runs per holder, longest first, ties by name") {
  KvPoolIndex index;
  const auto k = keys(100, 6);
  index.add("b", slice(k, 0, 6));
  index.add("a", slice(k, 0, 3));
  index.add("c", slice(k, 1, 6));  // lacks the first block: no leading run
  index.add("d", slice(k, 0, 3));
  using Runs = std::vector<std::pair<std::string, int32_t>>;
  CHECK(index.leading_runs(k) == Runs{{"b", 6}, {"a", 3}, {"d", 3}});
  CHECK(index.leading_run("c", k) == 0);
  CHECK(index.leading_run("b", slice(k, 2, 6)) == 4);
  CHECK(index.leading_run("nobody", k) == 0);
  CHECK(index.blocks() == 6);
  CHECK(index.held_by("b") == 6);
  // A gap ends the run: b drops block 2.
  const BlockKey gone[] = {k[2]};
  index.remove("b", gone);
  CHECK(index.leading_runs(k) == Runs{{"a", 3}, {"d", 3}, {"b", 2}});
  // Adding twice counts once.
  index.add("a", slice(k, 0, 3));
  CHECK(index.held_by("a") == 3);
}

TEST_CASE("kv pool index: a dropped holder leaves, reset replaces what it held") {
  KvPoolIndex index;
  const auto k = keys(1, 4);
  index.add("a", k);
  index.add("b", slice(k, 0, 2));
  index.drop("a");
  CHECK(index.leading_run("a", k) == 0);
  CHECK(index.held_by("a") == 0);
  CHECK(index.holders() == std::vector<std::string>{"b"});
  CHECK(index.blocks() == 2);  // blocks nobody holds are gone
  // A store that comes back announces what survived on its disk.
  index.reset("a", slice(k, 0, 1));
  CHECK(index.leading_run("a", k) == 1);
  index.reset("a", slice(k, 0, 3));
  CHECK(index.leading_run("a", k) == 3);
  CHECK(index.held_by("a") == 3);
  index.reset("b", {});
  CHECK(index.holders() == std::vector<std::string>{"a"});
  // Removing what a holder does not hold, or an unknown holder, is a no-op.
  index.remove("zz", k);
  const BlockKey other[] = {BlockKey{999, 1}};
  index.remove("a", other);
  CHECK(index.held_by("a") == 3);
}
