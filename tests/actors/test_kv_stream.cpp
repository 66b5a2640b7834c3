// The KV stream protocol without actors: blocks cut into layer-major chunks
// come back bit for bit whatever the chunk size, each chunk survives its
// codec round trip under the limits, and bad chunks (checksum, order,
// offset, sizes, another request) get typed errors.
#include <doctest/doctest.h>

#include <cstring>

#include "actors/kv_stream.h"
#include "schema/codec.h"
#include "tests/actors/kv_records.h"

using namespace cleave;
using cleave::test::make_records;
using cleave::test::small_layout;

namespace {

// Every chunk of a writer, through the codec, into an assembler.
Result<std::vector<BlockRecord>> stream(const KvStreamWriter& w, uint64_t id, int32_t first) {
  KvStreamAssembler a(id, first, uint64_t(1) << 30);
  for (uint32_t i = 0; i < w.n_chunks(); ++i) {
    auto c = codec::decode_as<msg::KvChunk>(codec::encode(w.chunk(i)));
    if (!c.ok()) return c.status();
    Status st = a.add(*c);
    if (!st.ok()) return st;
  }
  return a.take();
}

}  // namespace

TEST_CASE("kv stream: blocks come back bit for bit for every chunk size") {
  auto records = make_records(5);
  const size_t block_bytes = small_layout().block_bytes();
  for (uint32_t chunk : {64u, 100u, 384u, 1000u, uint32_t(block_bytes), 1u << 20}) {
    for (int32_t first : {0, 2, 4}) {
      CAPTURE(chunk);
      CAPTURE(first);
      KvStreamWriter w(42, records, first, chunk);
      CHECK(w.total_bytes() == block_bytes * size_t(5 - first));
      CHECK(w.n_chunks() == (w.total_bytes() + chunk - 1) / chunk);
      auto got = stream(w, 42, first);
      REQUIRE_MESSAGE(got.ok(), got.status().to_string());
      REQUIRE(got->size() == size_t(5 - first));
      for (size_t b = 0; b < got->size(); ++b) {
        const BlockRecord& want = (*records)[size_t(first) + b];
        CHECK((*got)[b].header.key == want.header.key);
        CHECK((*got)[b].header.n_tokens == want.header.n_tokens);
        CHECK((*got)[b].bytes == want.bytes);
        CHECK(verify((*got)[b], 1234, small_layout()).ok());
      }
    }
  }
}

TEST_CASE("kv stream: reused buffers (never zero-filled) still give the sent blocks") {
  BlockBufferPool pool(uint64_t(1) << 30);
  const size_t block_bytes = small_layout().block_bytes();
  auto first = make_records(4);
  // Other bytes, same layout: a reused buffer still holds the first stream's.
  auto second = std::make_shared<std::vector<BlockRecord>>(*make_records(4));
  for (BlockRecord& r : *second) {
    for (size_t i = 0; i < r.bytes.size(); i += 3) r.bytes[i] ^= 0x5a;
    seal(r);
  }
  auto run = [&](std::shared_ptr<const std::vector<BlockRecord>> records, uint32_t chunk) {
    KvStreamWriter w(7, records, 0, chunk);
    KvStreamAssembler a(7, 0, uint64_t(1) << 30, &pool);
    for (uint32_t i = 0; i < w.n_chunks(); ++i) REQUIRE(a.add(w.chunk(i)).ok());
    auto got = a.take();
    REQUIRE_MESSAGE(got.ok(), got.status().to_string());
    REQUIRE(got->size() == records->size());
    for (size_t b = 0; b < got->size(); ++b) CHECK((*got)[b].bytes == (*records)[b].bytes);
    return std::move(got.value());
  };
  auto got = run(first, 100);
  CHECK(pool.reused() == 0);
  pool.release(got);
  CHECK(got.empty());
  CHECK(pool.kept_bytes() == 4 * block_bytes);
  auto again = run(second, 100);
  CHECK(pool.reused() == 4);
  CHECK(pool.kept_bytes() == 0);
  pool.release(again);
  // A stream that fails (or is never taken) gives its buffers back.
  {
    KvStreamWriter w(8, first, 0, 256);
    KvStreamAssembler a(8, 0, uint64_t(1) << 30, &pool);
    REQUIRE(a.add(w.chunk(0)).ok());
    CHECK(pool.kept_bytes() == 0);  // all four taken by the stream
  }
  CHECK(pool.kept_bytes() == 4 * block_bytes);
}

TEST_CASE("kv stream: the buffer pool keeps no more than its bound, by size") {
  const size_t block_bytes = small_layout().block_bytes();
  BlockBufferPool pool(3 * block_bytes);
  auto records = std::vector<BlockRecord>(*make_records(5));
  pool.release(records);
  CHECK(records.empty());
  CHECK(pool.kept_bytes() == 3 * block_bytes);  // two freed
  std::vector<uint8_t> other = pool.acquire(block_bytes + 1);  // no kept buffer of that size
  CHECK(other.size() == block_bytes + 1);
  CHECK(pool.reused() == 0);
  std::vector<uint8_t> kept = pool.acquire(block_bytes);
  CHECK(kept.size() == block_bytes);
  CHECK(pool.reused() == 1);
  CHECK(pool.kept_bytes() == 2 * block_bytes);
}

TEST_CASE("kv stream: chunks run layer by layer over all blocks") {
  auto records = make_records(3);
  const KvLayout layout = small_layout();
  // One chunk per layer part: chunk k is layer k / 3 of block k % 3.
  KvStreamWriter w(1, records, 0, uint32_t(layout.layer_bytes()));
  REQUIRE(w.n_chunks() == 9);
  for (uint32_t k = 0; k < 9; ++k) {
    msg::KvChunk c = w.chunk(k);
    const BlockRecord& r = (*records)[k % 3];
    const size_t at = (k / 3) * layout.layer_bytes();
    REQUIRE(c.data.size() == layout.layer_bytes());
    CHECK(std::memcmp(c.data.data(), r.bytes.data() + at, c.data.size()) == 0);
    CHECK(c.headers.size() == (k == 0 ? 3u : 0u));
  }
}

TEST_CASE("kv stream: bad chunks get typed errors") {
  auto records = make_records(4);
  KvStreamWriter w(9, records, 0, 256);
  REQUIRE(w.n_chunks() > 3);
  auto fresh = [] { return KvStreamAssembler(9, 0, uint64_t(1) << 30); };
  SUBCASE("a flipped bit fails the checksum") {
    auto a = fresh();
    REQUIRE(a.add(w.chunk(0)).ok());
    msg::KvChunk c = w.chunk(1);
    c.data[7] ^= 0x10;
    CHECK(a.add(c).code() == Code::corruption);
    CHECK(a.add(w.chunk(1)).code() == Code::aborted);  // stays failed
  }
  SUBCASE("a skipped or repeated chunk is out of order") {
    auto a = fresh();
    CHECK(a.add(w.chunk(1)).code() == Code::invalid_argument);
    auto b = fresh();
    REQUIRE(b.add(w.chunk(0)).ok());
    CHECK(b.add(w.chunk(0)).code() == Code::invalid_argument);
  }
  SUBCASE("an offset that does not follow is refused") {
    auto a = fresh();
    REQUIRE(a.add(w.chunk(0)).ok());
    msg::KvChunk c = w.chunk(1);
    c.offset += 8;
    CHECK(a.add(c).code() == Code::invalid_argument);
  }
  SUBCASE("sizes that disagree with the headers are refused") {
    auto a = fresh();
    msg::KvChunk c = w.chunk(0);
    c.total_bytes += 64;
    CHECK(a.add(c).code() == Code::invalid_argument);
    auto b = fresh();
    msg::KvChunk no_headers = w.chunk(0);
    no_headers.headers.clear();
    CHECK(b.add(no_headers).code() == Code::invalid_argument);
    KvStreamAssembler small(9, 0, 1024);  // the receiver's bound
    CHECK(small.add(w.chunk(0)).code() == Code::invalid_argument);
  }
  SUBCASE("a chunk of another request is refused") {
    KvStreamAssembler a(10, 0, uint64_t(1) << 30);
    CHECK(a.add(w.chunk(0)).code() == Code::invalid_argument);
  }
  SUBCASE("a block whose bytes do not match its checksum fails take") {
    auto bad = std::make_shared<std::vector<BlockRecord>>(*records);
    (*bad)[2].bytes[5] ^= 1;  // after sealing: the chunk checksums are fine
    KvStreamWriter wb(9, bad, 0, 256);
    auto got = stream(wb, 9, 0);
    CHECK(got.status().code() == Code::corruption);
  }
  SUBCASE("an incomplete stream cannot be taken") {
    auto a = fresh();
    REQUIRE(a.add(w.chunk(0)).ok());
    CHECK_FALSE(a.complete());
    CHECK(a.take().status().code() == Code::aborted);
  }
}

TEST_CASE("kv stream: the codec bounds pulls and chunks") {
  msg::KvPull p;
  p.request_id = 3;
  p.chunk_bytes = 1 << 20;
  p.window = 8;
  CHECK(codec::decode_as<msg::KvPull>(codec::encode(p)).ok());
  for (uint32_t bad : {0u, 63u, codec::kMaxKvChunkBytes + 1}) {
    p.chunk_bytes = bad;
    CHECK(codec::decode_as<msg::KvPull>(codec::encode(p)).status().code() == Code::invalid_argument);
  }
  p.chunk_bytes = 4096;
  for (int32_t bad : {0, -1, codec::kMaxKvWindow + 1}) {
    p.window = bad;
    CHECK(codec::decode_as<msg::KvPull>(codec::encode(p)).status().code() == Code::invalid_argument);
  }
  CHECK(validate_kv_stream_options(16, 8).code() == Code::invalid_argument);
  CHECK(validate_kv_stream_options(4096, 0).code() == Code::invalid_argument);
  CHECK(validate_kv_stream_options(kDefaultKvChunkBytes, kDefaultKvWindow).ok());
  // A chunk whose data runs past the stream it claims is refused at decode.
  msg::KvChunk c = KvStreamWriter(1, make_records(2), 0, 512).chunk(1);
  c.total_bytes = c.offset + c.data.size() - 1;
  CHECK(codec::decode_as<msg::KvChunk>(codec::encode(c)).status().code() == Code::invalid_argument);
  // Bytes of another kind are named.
  auto wrong = codec::decode_as<msg::KvChunk>(codec::encode(p));
  CHECK(wrong.status().code() == Code::invalid_argument);
  CHECK(wrong.status().message().find("KvPull") != std::string::npos);
}
