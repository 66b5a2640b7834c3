// KV streams between stages whose engines are on a device (the kv_sender and
// kv_receiver actors given the engine's backend, as stage actors give them
// on a GPU node), across two processes on one host: the prefill's blocks,
// left in its device memory, reach the decoder's device memory through
// shared memory with no host copy on either side, checked where they land;
// where shared memory does not reach, over a device link (NCCL on GPUs,
// loopback TCP in DeviceLike), one per pair, closed on any failure, the
// socket then serving; over the data socket (--kv-transport socket) the
// sender downloads them once per stream and the decoder gets host records.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <future>

#include "actors/kv_link.h"
#include "actors/kv_stream.h"
#include "tests/actors/device_like_backend.h"
#include "tests/actors/kv_records.h"

using namespace cleave;
using cleave::test::DeviceLike;
using cleave::test::make_records;

namespace {

constexpr int kBlocks = 5, kStreams = 2;

// A forked process serving kStreams streams of records' blocks from its
// device memory (kv_sender with the device); its exit status says what its
// device saw: 0 = no upload, `downloads` block downloads and `links` device
// links opened.
struct DeviceSender {
  pid_t pid = -1;
  uint16_t port = 0;
};

struct SenderSetup {
  bool shared_memory = true;     // KvStreamOptions::shared_memory
  bool shareable = true;         // its device shares memory with processes on the host
  bool corrupt_first_send = false;  // a byte of its first link send flipped
  int downloads = 0, links = 0;  // expected
};

DeviceSender start_sender(const SenderSetup& setup) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  DeviceSender s;
  s.pid = fork();
  if (s.pid == 0) {
    ::close(fds[0]);
    auto records = make_records(kBlocks);
    const size_t bb = records->front().bytes.size();
    auto dev = std::make_shared<DeviceLike>();
    dev->shareable = setup.shareable;
    dev->corrupt_next_send = setup.corrupt_first_send;
    auto blocks = BackendBlocks::allocate(dev, kBlocks, bb);
    if (!blocks.ok()) _exit(10);
    for (size_t i = 0; i < size_t(kBlocks); ++i) {
      dev->upload(static_cast<uint8_t*>((*blocks)->data()) + i * bb, (*records)[i].bytes.data(), bb);
      (*blocks)->headers().push_back((*records)[i].header);
    }
    dev->uploads = 0;
    Status st = serve_kv_sender(
        KvOutbox::Kept{nullptr, blocks.value()}, kStreams, "127.0.0.1",
        [&](uint16_t port) {
          if (::write(fds[1], &port, sizeof port) != sizeof port) _exit(11);
        },
        60, setup.shared_memory, dev);
    if (!st.ok()) _exit(12);
    if (dev->uploads != 0) _exit(13);
    if (dev->downloads != setup.downloads) _exit(14);
    if (dev->links_opened != setup.links) _exit(15);
    _exit(0);
  }
  ::close(fds[1]);
  REQUIRE(::read(fds[0], &s.port, sizeof s.port) == sizeof s.port);
  ::close(fds[0]);
  return s;
}

int exit_status(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

// Pulls the sender's kStreams streams into a receiver whose engine is on
// dev (pull_kv_streams, as a stage's receiver), each outcome to sink.
void pull_all(const DeviceSender& sender, bool shared_memory, const std::shared_ptr<DeviceLike>& dev,
              const std::function<void(const KvReceived&)>& sink) {
  int streams = 0;
  auto pulls = pull_kv_streams(
      "127.0.0.1", sender.port, kStreams, 4096, 4,
      [&](const KvReceived& got) {
        ++streams;
        sink(got);
      },
      shared_memory, dev);
  CHECK_MESSAGE(pulls.ok(), pulls.status().to_string());
  CHECK(streams == kStreams);
}

// A stream's KV is make_records(kBlocks)'s, as blocks in dev's memory
// (DeviceLike's memory is the host's underneath: read to compare) or as
// records.
void check_kv(const KvReceived& got, const DeviceLike& dev) {
  const auto want = make_records(kBlocks);
  const size_t bb = want->front().bytes.size();
  REQUIRE(got.size() == size_t(kBlocks));
  if (got.blocks) CHECK(&got.blocks->backend() == &dev);
  for (size_t i = 0; i < size_t(kBlocks); ++i) {
    const BlockHeader& h = got.blocks ? got.blocks->headers()[i] : got.records[i].header;
    const void* bytes = got.blocks ? got.blocks->block(i) : got.records[i].bytes.data();
    CHECK(h.checksum == (*want)[i].header.checksum);
    CHECK(h.key == (*want)[i].header.key);
    CHECK(std::memcmp(bytes, (*want)[i].bytes.data(), bb) == 0);
  }
}

}  // namespace

TEST_CASE("kv streams on devices: one host, device memory to device memory through shared memory, no host copy") {
  DeviceSender sender = start_sender(SenderSetup{});
  auto dev = std::make_shared<DeviceLike>();
  pull_all(sender, true, dev, [&](const KvReceived& got) {
    CHECK(got.records.empty());
    REQUIRE(got.blocks);
    check_kv(got, *dev);
  });
  CHECK(exit_status(sender.pid) == 0);  // its device: offered from, no upload or download
  CHECK(dev->uploads == 0);
  CHECK(dev->downloads == 0);
  CHECK(dev->checksum_calls == kStreams);  // each stream checked where it landed
}

TEST_CASE("kv streams on devices: over the data socket the sender downloads its blocks, the decoder gets records") {
  DeviceSender sender = start_sender(SenderSetup{false, true, false, kStreams * kBlocks, 0});
  auto dev = std::make_shared<DeviceLike>();
  pull_all(sender, false, dev, [&](const KvReceived& got) {
    CHECK_FALSE(got.blocks);
    check_kv(got, *dev);
  });
  CHECK(exit_status(sender.pid) == 0);  // one download per block and stream, no upload
  CHECK(dev->uploads == 0);  // the decoder's engine imports the records itself
}

TEST_CASE("kv streams on devices: where shared memory does not reach, one device link carries every stream") {
  // A device that does not share memory stands for another host (the
  // netns tests' case): the receiver goes on to the pair's device link.
  DeviceSender sender = start_sender(SenderSetup{true, false, false, 0, 1});
  auto dev = std::make_shared<DeviceLike>();
  pull_all(sender, true, dev, [&](const KvReceived& got) {
    REQUIRE(got.blocks);
    check_kv(got, *dev);
  });
  CHECK(exit_status(sender.pid) == 0);  // no upload or download; one link for both streams
  CHECK(dev->links_opened == 1);
  CHECK(dev->uploads == 0);
  CHECK(dev->downloads == 0);
  CHECK(dev->checksum_calls == kStreams);  // checked in device memory
}

TEST_CASE("kv streams on devices: a corrupt block over the link closes it, the socket serves, the next stream links anew") {
  // The first send flips a byte: the receiver finds the block (corruption),
  // both ends close the link, the stream comes over the socket (the sender
  // downloads its blocks once); the second stream opens a new link.
  DeviceSender sender = start_sender(SenderSetup{true, false, true, kBlocks, 2});
  auto dev = std::make_shared<DeviceLike>();
  std::vector<bool> as_blocks;
  pull_all(sender, true, dev, [&](const KvReceived& got) {
    as_blocks.push_back(bool(got.blocks));
    check_kv(got, *dev);
  });
  CHECK(exit_status(sender.pid) == 0);
  CHECK(as_blocks == std::vector<bool>{false, true});
  CHECK(dev->links_opened == 2);
}

TEST_CASE("kv link ends: a transfer in order, a peer that never joins, a link closed while it waits") {
  auto records = make_records(3);
  const size_t bb = records->front().bytes.size();
  auto dev = std::make_shared<DeviceLike>();
  auto blocks = BackendBlocks::allocate(dev, 3, bb);
  REQUIRE(blocks.ok());
  for (size_t i = 0; i < 3; ++i) {
    dev->upload(static_cast<uint8_t*>((*blocks)->data()) + i * bb, (*records)[i].bytes.data(), bb);
    (*blocks)->headers().push_back((*records)[i].header);
  }
  msg::KvPull pull;
  pull.request_id = 9;
  pull.first_block = 1;
  msg::KvChunk offer;
  offer.request_id = 9;
  offer.first_block = 1;
  offer.headers.assign((*blocks)->headers().begin() + 1, (*blocks)->headers().end());
  offer.total_bytes = 2 * bb;
  KvStreamCounters counters;
  {
    auto id = dev->new_link_id();
    REQUIRE(id.ok());
    KvLinkEnd tx(dev, *id, 0, 5), rx(dev, *id, 1, 5);
    std::promise<Status> sent;
    std::promise<Result<std::shared_ptr<BackendBlocks>>> got;
    tx.run([&](DeviceLink* l, const Status& st) { sent.set_value(l ? send_kv_link(*l, **blocks, 1) : st); });
    rx.run([&](DeviceLink* l, const Status& st) {
      got.set_value(l ? recv_kv_link(*l, dev, offer, pull, uint64_t(1) << 30, counters)
                      : Result<std::shared_ptr<BackendBlocks>>(st));
    });
    CHECK(sent.get_future().get().ok());
    auto r = got.get_future().get();
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    REQUIRE((*r)->size() == 2);
    CHECK(std::memcmp((*r)->data(), (*blocks)->block(1), 2 * bb) == 0);
    CHECK(counters.chunks_received == 2);
    // An offer that disagrees with the pull is refused before any byte.
    msg::KvPull other = pull;
    other.first_block = 0;
    std::promise<Status> refused;
    rx.run([&](DeviceLink* l, const Status&) {
      refused.set_value(recv_kv_link(*l, dev, offer, other, uint64_t(1) << 30, counters).status());
    });
    CHECK(refused.get_future().get().code() == Code::invalid_argument);
  }
  // Nobody joins: the open fails at its timeout, for every queued job.
  {
    auto id = dev->new_link_id();
    REQUIRE(id.ok());
    KvLinkEnd lonely(dev, *id, 0, 0.2);
    std::promise<Status> a, b;
    lonely.run([&](DeviceLink* l, const Status& st) { a.set_value(l ? Status::Ok() : st); });
    lonely.run([&](DeviceLink* l, const Status& st) { b.set_value(l ? Status::Ok() : st); });
    CHECK(a.get_future().get().code() == Code::timed_out);
    CHECK(b.get_future().get().code() == Code::timed_out);
  }
  // A recv waiting on a send that never comes returns when the link closes.
  {
    auto id = dev->new_link_id();
    REQUIRE(id.ok());
    auto tx = std::make_unique<KvLinkEnd>(dev, *id, 0, 30);
    auto rx = std::make_unique<KvLinkEnd>(dev, *id, 1, 30);
    std::promise<void> opened;
    tx->run([&](DeviceLink*, const Status&) { opened.set_value(); });
    std::promise<Status> waited;
    rx->run([&](DeviceLink* l, const Status& st) {
      waited.set_value(l ? recv_kv_link(*l, dev, offer, pull, uint64_t(1) << 30, counters).status() : st);
    });
    opened.get_future().get();
    const auto t0 = std::chrono::steady_clock::now();
    rx.reset();  // aborts the link: the recv returns, the thread joins
    CHECK(waited.get_future().get().code() == Code::aborted);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  }
}
