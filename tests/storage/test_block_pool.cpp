// BlockPool and SequenceBlocks: allocation to exhaustion, refcounts under
// fork/release, copy-on-write, all-or-nothing growth, and rejected ids.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "storage/block_pool.h"

using namespace cleave;

namespace {

std::unique_ptr<BlockPool> make_pool(int32_t n, int32_t tpb = 16) {
  auto r = BlockPool::create(n, tpb);
  REQUIRE(r.ok());
  return std::move(r).value();
}

int32_t refs(const BlockPool& pool, int32_t id) {
  auto r = pool.refcount(id);
  REQUIRE(r.ok());
  return *r;
}

}  // namespace

TEST_CASE("block pool: zero or negative sizes are invalid_argument") {
  CHECK(BlockPool::create(0, 16).status().code() == Code::invalid_argument);
  CHECK(BlockPool::create(-3, 16).status().code() == Code::invalid_argument);
  CHECK(BlockPool::create(4, 0).status().code() == Code::invalid_argument);
}

TEST_CASE("block pool: allocation to exhaustion answers no room, release restores it") {
  auto pool = make_pool(4);
  CHECK(pool->free_count() == 4);
  CHECK(pool->can_allocate(4));
  CHECK_FALSE(pool->can_allocate(5));
  std::vector<int32_t> ids;
  for (int i = 0; i < 4; ++i) {
    auto id = pool->allocate();
    REQUIRE(id.has_value());
    CHECK(refs(*pool, *id) == 1);
    ids.push_back(*id);
  }
  CHECK(ids == std::vector<int32_t>{0, 1, 2, 3});
  CHECK(pool->free_count() == 0);
  CHECK_FALSE(pool->can_allocate(1));
  CHECK_FALSE(pool->allocate().has_value());
  CHECK_FALSE(pool->allocate_n(1).has_value());

  REQUIRE(pool->release(ids[2]).ok());
  CHECK(pool->free_count() == 1);
  CHECK(refs(*pool, ids[2]) == 0);
  auto again = pool->allocate();
  REQUIRE(again.has_value());
  CHECK(*again == ids[2]);

  for (int32_t id : ids) REQUIRE(pool->release(id).ok());
  CHECK(pool->free_count() == 4);
  // allocate_n is all or nothing.
  CHECK_FALSE(pool->allocate_n(5).has_value());
  CHECK(pool->free_count() == 4);
  auto four = pool->allocate_n(4);
  REQUIRE(four.has_value());
  CHECK(four->size() == 4);
  CHECK(pool->free_count() == 0);
}

TEST_CASE("block pool: unknown and freed ids are invalid_argument, never UB") {
  auto pool = make_pool(2);
  for (int32_t bad : {-1, 2, 1000}) {
    CHECK(pool->retain(bad).code() == Code::invalid_argument);
    CHECK(pool->release(bad).code() == Code::invalid_argument);
    CHECK(pool->refcount(bad).status().code() == Code::invalid_argument);
    CHECK_FALSE(pool->is_allocated(bad));
  }
  // Never allocated.
  CHECK(pool->retain(0).code() == Code::invalid_argument);
  CHECK(pool->release(0).code() == Code::invalid_argument);
  // Freed: a double release is rejected and the free list stays intact.
  auto id = pool->allocate();
  REQUIRE(id.has_value());
  REQUIRE(pool->release(*id).ok());
  CHECK(pool->release(*id).code() == Code::invalid_argument);
  CHECK(pool->retain(*id).code() == Code::invalid_argument);
  CHECK(pool->free_count() == 2);
}

TEST_CASE("sequence blocks: fork shares blocks, releases count down to free") {
  auto pool = make_pool(8, 4);
  SequenceBlocks a(*pool);
  auto g = a.append_tokens(10);  // 3 blocks: 4 + 4 + 2
  REQUIRE(g.ok());
  CHECK_FALSE(g->no_room);
  CHECK(g->blocks_needed == 3);
  CHECK(a.n_blocks() == 3);
  CHECK(a.n_tokens() == 10);
  CHECK(pool->free_count() == 5);
  {
    SequenceBlocks b = a.fork();
    CHECK(b.blocks() == a.blocks());
    CHECK(b.n_tokens() == 10);
    for (int32_t id : a.blocks()) CHECK(refs(*pool, id) == 2);
    CHECK(pool->free_count() == 5);
    SequenceBlocks c = b.fork();
    for (int32_t id : a.blocks()) CHECK(refs(*pool, id) == 3);
  }  // b and c release
  for (int32_t id : a.blocks()) CHECK(refs(*pool, id) == 1);
  const auto ids = a.blocks();
  a.clear();
  CHECK(a.n_blocks() == 0);
  CHECK(a.n_tokens() == 0);
  for (int32_t id : ids) CHECK(refs(*pool, id) == 0);
  CHECK(pool->free_count() == 8);
}

TEST_CASE("sequence blocks: copy-on-write gives a distinct block and keeps the other's") {
  auto pool = make_pool(8, 4);
  SequenceBlocks a(*pool);
  REQUIRE(a.append_tokens(8).ok());  // 2 full blocks
  SequenceBlocks b = a.fork();
  const auto shared = a.blocks();

  auto g = b.ensure_writable(1);
  REQUIRE(g.ok());
  CHECK_FALSE(g->no_room);
  REQUIRE(g->copy.has_value());
  CHECK(g->copy->src == shared[1]);
  CHECK(g->copy->dst != shared[1]);
  CHECK(b.blocks()[1] == g->copy->dst);
  CHECK(b.blocks()[0] == shared[0]);
  CHECK(a.blocks() == shared);  // the other sequence keeps its block
  CHECK(refs(*pool, shared[1]) == 1);
  CHECK(refs(*pool, g->copy->dst) == 1);
  CHECK(refs(*pool, shared[0]) == 2);

  // Exclusive now: nothing to copy.
  auto again = b.ensure_writable(1);
  REQUIRE(again.ok());
  CHECK_FALSE(again->copy.has_value());
  CHECK(again->blocks_needed == 0);
  auto mine = a.ensure_writable(1);
  REQUIRE(mine.ok());
  CHECK_FALSE(mine->copy.has_value());

  CHECK(b.ensure_writable(2).status().code() == Code::invalid_argument);
  CHECK(b.ensure_writable(-1).status().code() == Code::invalid_argument);
}

TEST_CASE("sequence blocks: copy-on-write with no room changes nothing") {
  auto pool = make_pool(2, 4);
  SequenceBlocks a(*pool);
  REQUIRE(a.append_tokens(8).ok());
  SequenceBlocks b = a.fork();
  auto g = b.ensure_writable(0);
  REQUIRE(g.ok());
  CHECK(g->no_room);
  CHECK(g->blocks_needed == 1);
  CHECK_FALSE(g->copy.has_value());
  CHECK(b.blocks() == a.blocks());
  CHECK(refs(*pool, a.blocks()[0]) == 2);
}

TEST_CASE("sequence blocks: appending to a shared partial block copies it first") {
  auto pool = make_pool(6, 4);
  SequenceBlocks a(*pool);
  REQUIRE(a.append_tokens(6).ok());  // block 0 full, block 1 holds 2 tokens
  SequenceBlocks b = a.fork();
  CHECK(b.blocks_needed(1) == 1);  // the copy of the shared tail
  CHECK(b.blocks_needed(3) == 2);  // the copy plus one new block
  auto g = b.append_tokens(3);
  REQUIRE(g.ok());
  CHECK_FALSE(g->no_room);
  CHECK(g->blocks_needed == 2);
  REQUIRE(g->copy.has_value());
  CHECK(g->copy->src == a.blocks()[1]);
  CHECK(b.n_tokens() == 9);
  CHECK(b.n_blocks() == 3);
  CHECK(b.blocks()[0] == a.blocks()[0]);
  CHECK(b.blocks()[1] == g->copy->dst);
  // a's tail is its own again: appending needs no copy.
  CHECK(a.blocks_needed(1) == 0);
  auto ga = a.append_tokens(1);
  REQUIRE(ga.ok());
  CHECK_FALSE(ga->copy.has_value());
  CHECK(a.n_blocks() == 2);
}

TEST_CASE("sequence blocks: append_tokens is all or nothing") {
  auto pool = make_pool(3, 4);
  SequenceBlocks a(*pool);
  REQUIRE(a.append_tokens(5).ok());  // 2 blocks
  CHECK(pool->free_count() == 1);
  const auto before = a.blocks();

  auto g = a.append_tokens(8);  // needs 13 tokens -> 4 blocks -> 2 more; 1 free
  REQUIRE(g.ok());
  CHECK(g->no_room);
  CHECK(g->blocks_needed == 2);
  CHECK(a.blocks() == before);
  CHECK(a.n_tokens() == 5);
  CHECK(pool->free_count() == 1);

  // Filling the partial block needs nothing new.
  auto fill = a.append_tokens(3);
  REQUIRE(fill.ok());
  CHECK_FALSE(fill->no_room);
  CHECK(fill->blocks_needed == 0);
  CHECK(a.n_blocks() == 2);
  auto zero = a.append_tokens(0);
  REQUIRE(zero.ok());
  CHECK(zero->blocks_needed == 0);
  CHECK(a.append_tokens(-1).status().code() == Code::invalid_argument);
  CHECK(a.n_tokens() == 8);

  // A shared partial tail with no room for its copy: nothing changes either.
  auto pool2 = make_pool(1, 4);
  SequenceBlocks s(*pool2);
  REQUIRE(s.append_tokens(2).ok());
  SequenceBlocks t = s.fork();
  auto gt = t.append_tokens(1);
  REQUIRE(gt.ok());
  CHECK(gt->no_room);
  CHECK(t.n_tokens() == 2);
  CHECK(t.blocks() == s.blocks());
  CHECK(refs(*pool2, s.blocks()[0]) == 2);
}

TEST_CASE("sequence blocks: from_shared validates ids and counts, retains on success") {
  auto pool = make_pool(4, 4);
  SequenceBlocks owner(*pool);
  REQUIRE(owner.append_tokens(8).ok());
  const auto ids = owner.blocks();
  CHECK(SequenceBlocks::from_shared(*pool, ids, 9).status().code() == Code::invalid_argument);
  CHECK(SequenceBlocks::from_shared(*pool, ids, 4).status().code() == Code::invalid_argument);
  CHECK(SequenceBlocks::from_shared(*pool, {ids[0], 3}, 8).status().code() ==
        Code::invalid_argument);  // 3 is free
  CHECK(SequenceBlocks::from_shared(*pool, {ids[0], 99}, 8).status().code() ==
        Code::invalid_argument);
  CHECK(refs(*pool, ids[0]) == 1);  // nothing retained by the failures
  auto s = SequenceBlocks::from_shared(*pool, ids, 7);
  REQUIRE(s.ok());
  CHECK(s->n_tokens() == 7);
  CHECK(refs(*pool, ids[0]) == 2);
  CHECK(refs(*pool, ids[1]) == 2);
  // Moving keeps exactly one set of references.
  SequenceBlocks moved = std::move(s).value();
  CHECK(refs(*pool, ids[1]) == 2);
  moved.clear();
  CHECK(refs(*pool, ids[1]) == 1);
}
