// KV over shared memory between processes on one host (actors/kv_shared.h,
// the CPU backend's memfd regions, kernels/cpu/shared_memory.h): a forked
// process maps the sender's region and gets the blocks bit for bit; bad
// handles, offers that disagree with the pull and corrupt blocks are typed
// errors; regions are freed on release, expiry and with their owner. A
// backend whose memory the host does not read checks the blocks with its
// own checksum op (here the CUDA checksum's code built for the host).
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "actors/kv_shared.h"
#include "tests/actors/device_like_backend.h"
#include "tests/actors/kv_records.h"
#include "tests/model/model_fixtures.h"

using namespace cleave;
using cleave::test::DeviceLike;
using cleave::test::make_records;

namespace {

msg::KvPull pull_of(uint64_t id, int32_t first) {
  msg::KvPull p;
  p.request_id = id;
  p.first_block = first;
  p.chunk_bytes = 4096;
  p.window = 1;
  return p;
}

bool same(const std::vector<BlockRecord>& got, const std::vector<BlockRecord>& want, size_t first) {
  if (got.size() != want.size() - first) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    const BlockRecord& a = got[i];
    const BlockRecord& b = want[first + i];
    if (a.bytes != b.bytes || !(a.header.key == b.header.key) || a.header.checksum != b.header.checksum ||
        a.header.n_tokens != b.header.n_tokens || !(a.header.layout == b.header.layout))
      return false;
  }
  return true;
}

// Runs fn in a forked child; its exit status (0 = passed).
template <class Fn>
int in_child(Fn fn) {
  const pid_t pid = fork();
  if (pid == 0) _exit(fn());
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

}  // namespace

TEST_CASE("kv shared: another process maps the region and gets the blocks bit for bit") {
  auto records = make_records(5);
  KvSharedOffers offers(std::shared_ptr<Backend>(make_cpu_backend(1)));
  msg::KvChunk offer;
  auto handle = offers.offer(7, *records, 2, offer);
  REQUIRE(handle.ok());
  CHECK(handle->rfind("memfd:", 0) == 0);
  CHECK(offer.request_id == 7);
  CHECK(offer.first_block == 2);
  CHECK(offer.headers.size() == 3);
  CHECK(offer.total_bytes == 3 * records->front().bytes.size());
  CHECK(offers.size() == 1);
  const int rc = in_child([&] {
    KvSharedMappings maps(std::shared_ptr<Backend>(make_cpu_backend(1)));
    KvStreamCounters counters;
    auto got = fetch_kv_shared(maps, handle.value(), offer, pull_of(7, 2), uint64_t(1) << 30, counters);
    if (!got.ok()) return 1;
    if (!same(got.value(), *records, 2)) return 2;
    if (counters.chunks_received != 3 || counters.bytes_received != offer.total_bytes) return 3;
    return 0;
  });
  CHECK(rc == 0);
  // Released: kept for the next offer that fits, which reuses its pages.
  int32_t blocks = 0;
  uint64_t bytes = 0;
  CHECK(offers.release(7, &blocks, &bytes));
  CHECK(blocks == 3);
  CHECK(bytes == offer.total_bytes);
  CHECK_FALSE(offers.release(7));
  CHECK(offers.size() == 0);
  CHECK(offers.kept() == 1);
  msg::KvChunk smaller;
  auto again = offers.offer(8, *records, 3, smaller);  // 2 blocks fit the 3-block region
  REQUIRE(again.ok());
  CHECK(*again == *handle);
  CHECK(offers.reused() == 1);
  CHECK(offers.kept() == 0);
  KvSharedMappings maps(std::shared_ptr<Backend>(make_cpu_backend(1)));
  KvStreamCounters counters;
  auto got = fetch_kv_shared(maps, *again, smaller, pull_of(8, 3), uint64_t(1) << 30, counters);
  REQUIRE(got.ok());
  CHECK(same(got.value(), *records, 3));
  // A larger offer than any kept region gets a new one.
  msg::KvChunk larger;
  offers.release(8);
  auto bigger = offers.offer(9, *records, 0, larger);
  REQUIRE(bigger.ok());
  CHECK(*bigger != *handle);
  CHECK(offers.reused() == 1);
}

TEST_CASE("kv shared: a handle that is malformed, of another size or of a reused descriptor is refused") {
  auto cpu = make_cpu_backend(1);
  for (const char* bad : {"", "memfd:", "memfd:1:2:3:4", "memfd:1:2:3:4:5:6", "memfd:-1:2:3:4:16",
                          "memfd:1: 2:3:4:16", "memfd:1:2:3:4:16x", "shm:1:2:3:4:16", "memfd:+1:2:3:4:16"}) {
    auto r = cpu->open_shared(bad, 16);
    CHECK_MESSAGE(r.status().code() == Code::invalid_argument, bad);
  }
  auto region = cpu->alloc_shared(4096);
  REQUIRE(region.ok());
  CHECK(cpu->open_shared(region->handle, 8192).status().code() == Code::invalid_argument);  // more than it has
  CHECK(cpu->open_shared(region->handle, 0).status().code() == Code::invalid_argument);
  auto prefix = cpu->open_shared(region->handle, 100);  // the first 100 bytes
  REQUIRE(prefix.ok());
  cpu->close_shared(prefix.value(), 100);
  auto mapped = cpu->open_shared(region->handle, 4096);
  REQUIRE(mapped.ok());
  static_cast<uint8_t*>(region->data)[100] = 42;
  CHECK(static_cast<const uint8_t*>(mapped.value())[100] == 42);  // the same pages
  cpu->close_shared(mapped.value(), 4096);
  const std::string old = region->handle;
  cpu->free_shared(region.value());
  // The descriptor number is taken again by another region: its inode differs.
  auto other = cpu->alloc_shared(4096);
  REQUIRE(other.ok());
  auto stale = cpu->open_shared(old, 4096);
  CHECK(stale.status().code() == Code::not_found);
  cpu->free_shared(other.value());
  CHECK(cpu->alloc_shared(0).status().code() == Code::invalid_argument);
}

TEST_CASE("kv shared: an offer that disagrees with the pull or a corrupt block is a typed error") {
  auto records = make_records(4);
  KvSharedMappings maps(std::shared_ptr<Backend>(make_cpu_backend(1)));
  KvSharedOffers offers(std::shared_ptr<Backend>(make_cpu_backend(1)));
  msg::KvChunk offer;
  auto handle = offers.offer(3, *records, 0, offer);
  REQUIRE(handle.ok());
  const uint64_t big = uint64_t(1) << 30;
  KvStreamCounters c;
  CHECK(fetch_kv_shared(maps, *handle, offer, pull_of(4, 0), big, c).status().code() == Code::invalid_argument);
  CHECK(fetch_kv_shared(maps, *handle, offer, pull_of(3, 1), big, c).status().code() == Code::invalid_argument);
  CHECK(fetch_kv_shared(maps, *handle, offer, pull_of(3, 0), offer.total_bytes - 1, c).status().code() ==
        Code::invalid_argument);
  msg::KvChunk wrong = offer;
  wrong.total_bytes += 1;
  CHECK(fetch_kv_shared(maps, *handle, wrong, pull_of(3, 0), big, c).status().code() == Code::invalid_argument);
  wrong = offer;
  wrong.headers[1].layout.n_layers += 1;
  CHECK(fetch_kv_shared(maps, *handle, wrong, pull_of(3, 0), big, c).status().code() == Code::invalid_argument);
  wrong = offer;
  wrong.headers.clear();
  CHECK(fetch_kv_shared(maps, *handle, wrong, pull_of(3, 0), big, c).status().code() == Code::invalid_argument);
  CHECK(c.chunks_received == 0);

  // A bit flipped in block 2 of the region after the copy: caught, named.
  msg::KvChunk corrupt_offer;
  auto corrupt = offers.offer(5, *records, 0, corrupt_offer, /*corrupt_block=*/2);
  REQUIRE(corrupt.ok());
  auto got = fetch_kv_shared(maps, *corrupt, corrupt_offer, pull_of(5, 0), big, c);
  CHECK(got.status().code() == Code::corruption);
  CHECK(got.status().message().find("block 2 (key " + (*records)[2].header.key.hex()) != std::string::npos);
  CHECK(c.chunks_rejected == 1);
  // The good region still reads back.
  auto good = fetch_kv_shared(maps, *handle, offer, pull_of(3, 0), big, c);
  REQUIRE(good.ok());
  CHECK(same(good.value(), *records, 0));
}

TEST_CASE("kv shared: a backend whose memory the host does not read checks blocks with its checksum op") {
  auto records = make_records(3);
  auto device = std::make_shared<DeviceLike>();
  KvSharedOffers offers(device);
  KvSharedMappings maps(device);
  msg::KvChunk offer, corrupt_offer;
  auto handle = offers.offer(1, *records, 0, offer);
  auto corrupt = offers.offer(2, *records, 0, corrupt_offer, 0);
  REQUIRE(handle.ok());
  REQUIRE(corrupt.ok());
  KvStreamCounters c;
  auto got = fetch_kv_shared(maps, *handle, offer, pull_of(1, 0), uint64_t(1) << 30, c);
  REQUIRE(got.ok());
  CHECK(same(got.value(), *records, 0));
  CHECK(device->checksum_calls == 1);
  auto bad = fetch_kv_shared(maps, *corrupt, corrupt_offer, pull_of(2, 0), uint64_t(1) << 30, c);
  CHECK(bad.status().code() == Code::corruption);
  CHECK(device->checksum_calls == 2);
}

TEST_CASE("kv shared: blocks in backend memory reach another process's backend memory, never through the host") {
  auto records = make_records(4);
  const size_t bb = records->front().bytes.size();
  auto device = std::make_shared<DeviceLike>();
  // The sender's blocks in its "device" memory, as an engine's
  // export_blocks_to leaves them: blocks 1..3.
  void* blocks = device->alloc(3 * bb);
  std::vector<BlockHeader> headers;
  for (size_t i = 1; i < 4; ++i) {
    device->upload(static_cast<uint8_t*>(blocks) + (i - 1) * bb, (*records)[i].bytes.data(), bb);
    headers.push_back((*records)[i].header);
  }
  device->uploads = 0;
  KvSharedOffers offers(device);
  msg::KvChunk offer;
  auto handle = offers.offer_from(3, blocks, headers, 1, offer);
  REQUIRE(handle.ok());
  CHECK(device->uploads == 0);
  CHECK(device->downloads == 0);
  CHECK(offer.first_block == 1);
  CHECK(offer.total_bytes == 3 * bb);
  CHECK(offer.headers.size() == 3);
  const int rc = in_child([&] {
    auto dev = std::make_shared<DeviceLike>();
    KvSharedMappings maps(dev);
    KvStreamCounters counters;
    void* dst = dev->alloc(3 * bb);
    auto got = fetch_kv_shared_to(maps, handle.value(), offer, pull_of(3, 1), uint64_t(1) << 30, counters, dst);
    if (!got.ok()) return 1;
    if (got->size() != 3 || dev->uploads != 0 || dev->downloads != 0) return 2;
    if (dev->checksum_calls != 1) return 3;  // checked where the bytes landed
    for (size_t i = 0; i < 3; ++i)
      if (std::memcmp(static_cast<uint8_t*>(dst) + i * bb, (*records)[i + 1].bytes.data(), bb) != 0) return 4;
    if (counters.chunks_received != 3 || counters.bytes_received != 3 * bb) return 5;
    return 0;
  });
  CHECK(rc == 0);
  // A flipped bit is corruption naming the block; a pull that disagrees is
  // refused before anything is copied.
  msg::KvChunk bad_offer;
  auto bad = offers.offer_from(4, blocks, headers, 1, bad_offer, 1);
  REQUIRE(bad.ok());
  KvSharedMappings maps(device);
  KvStreamCounters c;
  void* dst = device->alloc(3 * bb);
  auto got = fetch_kv_shared_to(maps, *bad, bad_offer, pull_of(4, 1), uint64_t(1) << 30, c, dst);
  CHECK(got.status().code() == Code::corruption);
  CHECK(got.status().message().find("block 2") != std::string::npos);
  CHECK(c.chunks_rejected == 1);
  CHECK(fetch_kv_shared_to(maps, *handle, offer, pull_of(3, 0), uint64_t(1) << 30, c, dst).status().code() ==
        Code::invalid_argument);
  CHECK(fetch_kv_shared_to(maps, *handle, offer, pull_of(3, 1), uint64_t(1) << 30, c, nullptr).status().code() ==
        Code::invalid_argument);
  CHECK(offers.offer_from(5, blocks, {}, 1, bad_offer).status().code() == Code::invalid_argument);
  std::vector<BlockHeader> mixed = headers;
  mixed[1].layout.head_dim *= 2;
  CHECK(offers.offer_from(5, blocks, mixed, 1, bad_offer).status().code() == Code::invalid_argument);
  device->free(dst);
  device->free(blocks);
}

TEST_CASE("kv shared: an engine's KV through a region in backend memory: export_blocks_to, offer, fetch, import_blocks_from") {
  using namespace cleave::fixtures;
  const std::string path = model_path(small_dense(), "dense-f32");
  EngineOptions o;
  o.threads = 1;
  o.block_size = 8;
  auto src = make_engine(path, o);
  const auto prompt = prompt_of(29, 5);
  const int32_t V = src->config().n_vocab;
  const int32_t a = *src->open_sequence();
  std::vector<float> lg(static_cast<size_t>(V));
  REQUIRE(src->forward({{a, prompt.data(), 29}}, lg.data()).ok());
  std::shared_ptr<Backend> be(make_cpu_backend(1));  // the engine's memory is the host's here
  const size_t bb = src->kv_layout().block_bytes();
  void* out = be->alloc(4 * bb);
  std::vector<BlockHeader> headers;
  REQUIRE(src->export_blocks_to(a, 0, out, headers).ok());
  KvSharedOffers offers(be);
  msg::KvChunk offer;
  auto handle = offers.offer_from(11, out, headers, 0, offer);
  REQUIRE(handle.ok());
  // The decoder's side in another process: fetched into its backend memory
  // and imported from there; it decodes on with the prefill engine's bits.
  const int32_t next = 9;
  std::vector<float> want(static_cast<size_t>(V));
  REQUIRE(src->forward({{a, &next, 1}}, want.data()).ok());
  const int rc = in_child([&] {
    auto dst = make_engine(path, o);
    std::shared_ptr<Backend> dbe(make_cpu_backend(1));
    KvSharedMappings maps(dbe);
    KvStreamCounters counters;
    void* in = dbe->alloc(4 * bb);
    auto got = fetch_kv_shared_to(maps, handle.value(), offer, pull_of(11, 0), uint64_t(1) << 30, counters, in);
    if (!got.ok()) return 1;
    const int32_t b = *dst->open_sequence();
    if (!dst->import_blocks_from(b, prompt.data(), 29, got.value(), in).ok()) return 2;
    std::vector<float> lg2(static_cast<size_t>(V));
    if (!dst->forward({{b, &next, 1}}, lg2.data()).ok()) return 3;
    return std::memcmp(lg2.data(), want.data(), lg2.size() * sizeof(float)) == 0 ? 0 : 4;
  });
  CHECK(rc == 0);
  be->free(out);
}

TEST_CASE("kv shared: a receiver keeps its mappings for the next streams in a region") {
  auto records = make_records(4);
  const size_t bb = records->front().bytes.size();
  KvSharedOffers offers(std::shared_ptr<Backend>(make_cpu_backend(1)));
  KvSharedMappings maps(std::shared_ptr<Backend>(make_cpu_backend(1)), /*max_bytes=*/4 * bb);
  KvStreamCounters c;
  msg::KvChunk offer;
  auto h = offers.offer(1, *records, 2, offer);  // a 2-block region
  REQUIRE(h.ok());
  REQUIRE(fetch_kv_shared(maps, *h, offer, pull_of(1, 2), uint64_t(1) << 30, c).ok());
  CHECK(maps.size() == 1);
  CHECK(maps.hits() == 0);
  offers.release(1);
  auto h2 = offers.offer(2, *records, 3, offer);  // reuses the region with other bytes
  REQUIRE(h2.ok());
  CHECK(*h2 == *h);
  auto got = fetch_kv_shared(maps, *h2, offer, pull_of(2, 3), uint64_t(1) << 30, c);
  REQUIRE(got.ok());
  CHECK(same(got.value(), *records, 3));  // the new bytes through the kept mapping
  CHECK(maps.hits() == 1);
  // A mapping held by a reader outlives its eviction.
  auto held = maps.map(*h2, bb);
  REQUIRE(held.ok());
  msg::KvChunk big;
  auto h3 = offers.offer(3, *records, 0, big);  // 4 blocks: evicts the 2-block mapping
  REQUIRE(h3.ok());
  REQUIRE(fetch_kv_shared(maps, *h3, big, pull_of(3, 0), uint64_t(1) << 30, c).ok());
  CHECK(maps.size() == 1);
  CHECK(static_cast<const uint8_t*>(held.value().get())[0] == (*records)[3].bytes[0]);
  auto part = maps.map(*h3, bb);  // within the kept 4-block mapping
  REQUIRE(part.ok());
  CHECK(maps.hits() == 3);
  // A kept mapping shorter than asked for is made again, longer.
  KvSharedMappings fresh(std::shared_ptr<Backend>(make_cpu_backend(1)));
  REQUIRE(fresh.map(*h3, bb).ok());
  auto whole = fresh.map(*h3, 4 * bb);
  REQUIRE(whole.ok());
  CHECK(fresh.hits() == 0);
  CHECK(fresh.size() == 1);
  CHECK(static_cast<const uint8_t*>(whole.value().get())[3 * bb + 5] == (*records)[3].bytes[5]);
}

TEST_CASE("kv shared: offers are replaced, expire, and refuse what they cannot share") {
  auto records = make_records(3);
  auto cpu = std::shared_ptr<Backend>(make_cpu_backend(1));
  std::string first_handle, second;
  {
    KvSharedOffers offers(cpu);
    msg::KvChunk offer;
    auto h1 = offers.offer(9, *records, 0, offer);
    REQUIRE(h1.ok());
    first_handle = *h1;
    auto h2 = offers.offer(9, *records, 1, offer);  // replaces the first, in its region
    REQUIRE(h2.ok());
    CHECK(offers.size() == 1);
    CHECK(*h2 == first_handle);
    CHECK(offers.reused() == 1);
    CHECK(offers.expire(std::chrono::hours(1)) == 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(offers.expire(std::chrono::milliseconds(1)) == 1);
    CHECK(offers.size() == 0);
    // Expired regions are freed, not kept: a late receiver may still read them.
    CHECK(offers.kept() == 0);
    CHECK(cpu->open_shared(first_handle, 100).status().code() == Code::not_found);
    CHECK(offers.offer(10, *records, 3, offer).status().code() == Code::invalid_argument);
    CHECK(offers.offer(10, *records, -1, offer).status().code() == Code::invalid_argument);
    auto live = offers.offer(11, *records, 0, offer);
    REQUIRE(live.ok());
    first_handle = *live;
    auto kept = offers.offer(12, *records, 0, offer);
    REQUIRE(kept.ok());
    second = *kept;
    offers.release(12);
    CHECK(offers.kept() == 1);
  }
  // Freed with the offers that held them, live or kept.
  CHECK(cpu->open_shared(first_handle, 100).status().code() == Code::not_found);
  CHECK(cpu->open_shared(second, 100).status().code() == Code::not_found);

  auto no_share = std::make_shared<DeviceLike>();
  no_share->shareable = false;
  KvSharedOffers none(no_share);
  msg::KvChunk offer;
  CHECK(none.offer(1, *records, 0, offer).status().code() == Code::unsupported);
  CHECK_FALSE(kv_host_identity().empty());
  CHECK(kv_host_identity() == kv_host_identity());
}
