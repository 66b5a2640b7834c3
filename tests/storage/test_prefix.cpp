// Prefix keys and the prefix index: what changes a key, the partial last
// block, longest-prefix matching on shared and diverging prompts, the index's
// references, and a pinned key value.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "storage/block_pool.h"
#include "storage/prefix.h"

using namespace cleave;

namespace {

constexpr uint64_t kModelFp = 0x1234'5678'9abc'def0ull;

KvLayout test_layout() {
  KvLayout l;
  l.k_type = l.v_type = DType::F32;
  l.tokens_per_block = 16;
  l.n_layers = 2;
  l.n_kv_heads = 2;
  l.head_dim = 8;
  return l;
}

std::vector<int32_t> iota_tokens(int n, int32_t start = 1) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

struct Fixture {
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<PrefixIndex> index;
  explicit Fixture(int32_t n_blocks = 16) {
    auto p = BlockPool::create(n_blocks, 16);
    REQUIRE(p.ok());
    pool = std::move(p).value();
    auto i = PrefixIndex::create(*pool, kModelFp, test_layout());
    REQUIRE(i.ok());
    index = std::move(i).value();
  }
  // A sequence holding tokens, published to the index.
  SequenceBlocks cache(const std::vector<int32_t>& tokens) {
    SequenceBlocks s(*pool);
    auto g = s.append_tokens(int32_t(tokens.size()));
    REQUIRE(g.ok());
    REQUIRE_FALSE(g->no_room);
    REQUIRE(index->publish(tokens.data(), s).ok());
    return s;
  }
};

}  // namespace

TEST_CASE("prefix keys: same input gives the same key, each field changes it") {
  const KvLayout layout = test_layout();
  const auto t = iota_tokens(16);
  const BlockKey root{0, 0};
  const BlockKey k = block_key(root, t.data(), 16, kModelFp, layout);
  CHECK(k == block_key(root, t.data(), 16, kModelFp, layout));
  CHECK_FALSE(k == root);

  SUBCASE("any one token") {
    for (int i = 0; i < 16; ++i) {
      auto u = t;
      u[size_t(i)] += 1;
      CHECK_FALSE(block_key(root, u.data(), 16, kModelFp, layout) == k);
    }
  }
  SUBCASE("the parent, in either half") {
    CHECK_FALSE(block_key(BlockKey{1, 0}, t.data(), 16, kModelFp, layout) == k);
    CHECK_FALSE(block_key(BlockKey{0, 1}, t.data(), 16, kModelFp, layout) == k);
    CHECK_FALSE(block_key(k, t.data(), 16, kModelFp, layout) == k);
  }
  SUBCASE("the model fingerprint") {
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp + 1, layout) == k);
  }
  SUBCASE("each layout field") {
    KvLayout l = layout;
    l.n_layers = 3;
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp, l) == k);
    l = layout;
    l.n_kv_heads = 4;
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp, l) == k);
    l = layout;
    l.head_dim = 16;
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp, l) == k);
    l = layout;
    l.tokens_per_block = 32;
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp, l) == k);
    l = layout;
    l.k_type = DType::F16;
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp, l) == k);
    l = layout;
    l.v_type = DType::F16;
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp, l) == k);
    const BlockKey kf16 = block_key(root, t.data(), 16, kModelFp, l);
    l.k_type = DType::F16;
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp, l) == kf16);
    l.k_type = l.v_type = DType::Q8_0;
    CHECK_FALSE(block_key(root, t.data(), 16, kModelFp, l) == k);
  }
  SUBCASE("the token count") {
    CHECK_FALSE(block_key(root, t.data(), 15, kModelFp, layout) == k);
  }
}

TEST_CASE("prefix keys: large blocks (past the inline hash buffer) are keyed the same way") {
  KvLayout l = test_layout();
  l.tokens_per_block = 300;
  const auto t = iota_tokens(600);
  const BlockKey k = block_key(BlockKey{0, 0}, t.data(), 300, kModelFp, l);
  CHECK(k == block_key(BlockKey{0, 0}, t.data(), 300, kModelFp, l));
  CHECK_FALSE(k == block_key(BlockKey{0, 0}, t.data(), 299, kModelFp, l));
  auto u = t;
  u[299] = 0;
  CHECK_FALSE(k == block_key(BlockKey{0, 0}, u.data(), 300, kModelFp, l));
  const auto chain = chain_keys(t.data(), 600, kModelFp, l);
  REQUIRE(chain.size() == 2);
  CHECK(chain[0] == k);
  CHECK(chain[1] == block_key(k, t.data() + 300, 300, kModelFp, l));
}

TEST_CASE("prefix keys: pinned regression value") {
  // Computed once with this implementation (XXH3_128bits, seed 0, over
  // parent lo/hi, the tokens, the model fingerprint and the layout
  // fingerprint, little-endian) and pinned here. Keys name blocks on disk
  // (tier 2) and across processes, so a change in the hash input or its byte
  // order must break this test rather than silently orphan every cached block.
  // Input: tokens 1..16, root parent, model fingerprint 0x123456789abcdef0,
  // layout {F32, 16 tokens per block, 2 layers, 2 kv heads, head_dim 8}.
  const auto t = iota_tokens(16);
  const BlockKey k = block_key(BlockKey{0, 0}, t.data(), 16, kModelFp, test_layout());
  CHECK(k.hex() == std::string("8276ac0db1d283d6d21ad11eb255fd14"));
}

TEST_CASE("prefix keys: chains cover full blocks only") {
  const KvLayout layout = test_layout();
  const auto t = iota_tokens(48);
  const auto k40 = chain_keys(t.data(), 40, kModelFp, layout);
  CHECK(k40.size() == 2);
  const auto k48 = chain_keys(t.data(), 48, kModelFp, layout);
  REQUIRE(k48.size() == 3);
  CHECK(k48[0] == k40[0]);
  CHECK(k48[1] == k40[1]);
  CHECK(k48[0] == block_key(BlockKey{0, 0}, t.data(), 16, kModelFp, layout));
  CHECK(k48[1] == block_key(k48[0], t.data() + 16, 16, kModelFp, layout));
  CHECK(k48[2] == block_key(k48[1], t.data() + 32, 16, kModelFp, layout));
  CHECK(chain_keys(t.data(), 15, kModelFp, layout).empty());
  CHECK(chain_keys(t.data(), 0, kModelFp, layout).empty());
  // Same block content at a different position: a different key (the chain).
  const std::vector<int32_t> rep(32, 7);
  const auto kr = chain_keys(rep.data(), 32, kModelFp, layout);
  REQUIRE(kr.size() == 2);
  CHECK_FALSE(kr[0] == kr[1]);
}

TEST_CASE("prefix index: rejects a layout that does not fit the pool") {
  auto pool = BlockPool::create(4, 16);
  REQUIRE(pool.ok());
  KvLayout l = test_layout();
  l.tokens_per_block = 8;
  CHECK(PrefixIndex::create(**pool, kModelFp, l).status().code() == Code::invalid_argument);
  l = test_layout();
  l.head_dim = 0;
  CHECK(PrefixIndex::create(**pool, kModelFp, l).status().code() == Code::invalid_argument);
}

TEST_CASE("prefix index: longest prefix on shared, diverging and partial prompts") {
  Fixture f;
  const auto cached_tokens = iota_tokens(48);
  SequenceBlocks cached = f.cache(cached_tokens);
  CHECK(f.index->size() == 3);

  SUBCASE("identical prompt, fully cached: 48 matched, 47 usable") {
    const auto m = f.index->longest_prefix(cached_tokens.data(), 48);
    CHECK(m.n_blocks == 3);
    CHECK(m.n_tokens == 48);
    CHECK(m.block_ids == cached.blocks());
    CHECK(m.usable_tokens(48) == 47);
  }
  SUBCASE("a longer prompt sharing the first 48 tokens") {
    auto p = iota_tokens(60);
    p[50] = -5;
    const auto m = f.index->longest_prefix(p.data(), 60);
    CHECK(m.n_blocks == 3);
    CHECK(m.usable_tokens(60) == 48);
  }
  SUBCASE("a 40-token prompt matches at most 2 blocks") {
    const auto m = f.index->longest_prefix(cached_tokens.data(), 40);
    CHECK(m.n_blocks == 2);
    CHECK(m.n_tokens == 32);
    CHECK(m.usable_tokens(40) == 32);
  }
  SUBCASE("divergence in the middle of block 2 matches 1 block") {
    auto p = cached_tokens;
    p[16 + 8] = 9999;
    const auto m = f.index->longest_prefix(p.data(), 48);
    CHECK(m.n_blocks == 1);
    CHECK(m.n_tokens == 16);
    REQUIRE(m.block_ids.size() == 1);
    CHECK(m.block_ids[0] == cached.blocks()[0]);
  }
  SUBCASE("divergence in block 1 only still breaks the chain for the later blocks") {
    auto p = cached_tokens;
    p[3] = 9999;
    const auto m = f.index->longest_prefix(p.data(), 48);
    CHECK(m.n_blocks == 0);
    CHECK(m.block_ids.empty());
    CHECK(m.usable_tokens(48) == 0);
  }
  SUBCASE("short and empty prompts") {
    CHECK(f.index->longest_prefix(cached_tokens.data(), 15).n_blocks == 0);
    const auto m = f.index->longest_prefix(cached_tokens.data(), 0);
    CHECK(m.n_blocks == 0);
    CHECK(m.usable_tokens(0) == 0);
  }
}

TEST_CASE("prefix index: a fully cached prompt reruns its last token by copy-on-write") {
  Fixture f;
  const auto tokens = iota_tokens(48);
  SequenceBlocks first = f.cache(tokens);
  const auto m = f.index->longest_prefix(tokens.data(), 48);
  const int32_t usable = m.usable_tokens(48);
  REQUIRE(usable == 47);
  auto s = SequenceBlocks::from_shared(*f.pool, m.block_ids, usable);
  REQUIRE(s.ok());
  auto g = s->append_tokens(1);  // the last token, recomputed for its logits
  REQUIRE(g.ok());
  REQUIRE(g->copy.has_value());
  CHECK(g->copy->src == m.block_ids[2]);
  CHECK(s->blocks()[2] != m.block_ids[2]);
  CHECK(s->n_tokens() == 48);
  CHECK(f.index->find(m.keys[2]) == m.block_ids[2]);  // the cached block is untouched
}

TEST_CASE("prefix index: holds references, first publisher wins, erase evicts") {
  Fixture f(8);
  const auto tokens = iota_tokens(40);  // 2 full blocks + 8 tokens
  std::vector<int32_t> ids;
  std::vector<BlockKey> keys = chain_keys(tokens.data(), 40, kModelFp, test_layout());
  {
    SequenceBlocks s = f.cache(tokens);
    ids = s.blocks();
    CHECK(f.index->size() == 2);  // the partial block is never published
    CHECK(*f.pool->refcount(ids[0]) == 2);
    CHECK(*f.pool->refcount(ids[1]) == 2);
    CHECK(*f.pool->refcount(ids[2]) == 1);
  }
  // The sequence is gone; the index alone keeps the two full blocks.
  CHECK(*f.pool->refcount(ids[0]) == 1);
  CHECK(*f.pool->refcount(ids[1]) == 1);
  CHECK(*f.pool->refcount(ids[2]) == 0);
  CHECK(f.pool->free_count() == 6);

  // A second writer with its own copy of block 0: the first one wins.
  auto other = f.pool->allocate();
  REQUIRE(other.has_value());
  auto won = f.index->insert(keys[0], *other);
  REQUIRE(won.ok());
  CHECK(*won == ids[0]);
  CHECK(*f.pool->refcount(*other) == 1);  // not retained by the index
  REQUIRE(f.pool->release(*other).ok());

  // Publishing again adds nothing.
  {
    SequenceBlocks s = f.cache(tokens);
    CHECK(f.index->size() == 2);
  }

  CHECK(f.index->insert(BlockKey{5, 5}, 7).status().code() == Code::invalid_argument);
  CHECK(f.index->insert(BlockKey{5, 5}, -1).status().code() == Code::invalid_argument);

  REQUIRE(f.index->erase(keys[1]).ok());
  CHECK(*f.pool->refcount(ids[1]) == 0);
  CHECK(f.index->erase(keys[1]).code() == Code::not_found);
  const auto m = f.index->longest_prefix(tokens.data(), 40);
  CHECK(m.n_blocks == 1);
  CHECK(f.pool->free_count() == 7);
}

TEST_CASE("prefix keys: spans key the blocks they overlap and leave the others plain") {
  const KvLayout layout = test_layout();
  const auto t = iota_tokens(48);
  const BlockKey image_a{11, 12}, image_b{21, 22};
  // Positions [20, 36): blocks 1 and 2 of three.
  const std::vector<KeySpan> a{{20, 16, image_a}}, b{{20, 16, image_b}};
  const auto plain = chain_keys(t.data(), 48, kModelFp, layout);
  const auto with_a = chain_keys(t.data(), 48, kModelFp, layout, a);
  const auto with_b = chain_keys(t.data(), 48, kModelFp, layout, b);
  REQUIRE(with_a.size() == 3);
  CHECK(with_a[0] == plain[0]);
  for (size_t i = 1; i < 3; ++i) {
    CHECK_FALSE(with_a[i] == plain[i]);
    CHECK_FALSE(with_a[i] == with_b[i]);
  }
  CHECK(chain_keys(t.data(), 48, kModelFp, layout, a) == with_a);  // deterministic
  // The position and length are hashed too: the same content elsewhere is another key.
  const std::vector<KeySpan> moved{{21, 15, image_a}};
  CHECK_FALSE(chain_keys(t.data(), 48, kModelFp, layout, moved)[1] == with_a[1]);
  // A span wholly after a block leaves that block's key plain, even when it starts right after.
  const std::vector<KeySpan> later{{32, 4, image_a}};
  const auto k_later = chain_keys(t.data(), 48, kModelFp, layout, later);
  CHECK(k_later[1] == plain[1]);
  CHECK_FALSE(k_later[2] == plain[2]);

  // The index walks the spanned chain: only the same image matches past the text.
  Fixture f;
  auto s = SequenceBlocks(*f.pool);
  REQUIRE(s.append_tokens(48).ok());
  for (size_t i = 0; i < 3; ++i) REQUIRE(f.index->insert(with_a[i], s.blocks()[i]).ok());
  CHECK(f.index->longest_prefix(t.data(), 48, a).n_blocks == 3);
  CHECK(f.index->longest_prefix(t.data(), 48, b).n_blocks == 1);  // the text-only block
  CHECK(f.index->longest_prefix(t.data(), 48).n_blocks == 1);
}
