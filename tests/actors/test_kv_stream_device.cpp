// KV streams between stages whose engines are on a device (the kv_sender and
// kv_receiver actors given the engine's backend, as stage actors give them
// on a GPU node), across two processes on one host: the prefill's blocks,
// left in its device memory, reach the decoder's device memory through
// shared memory with no host copy on either side, checked where they land;
// over the data socket (another host, or --kv-transport socket) the sender
// downloads them once per stream and the decoder gets host records.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

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
// device saw: 0 = no upload, and `downloads` block downloads.
struct DeviceSender {
  pid_t pid = -1;
  uint16_t port = 0;
};

DeviceSender start_sender(bool shared_memory, int downloads) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  DeviceSender s;
  s.pid = fork();
  if (s.pid == 0) {
    ::close(fds[0]);
    auto records = make_records(kBlocks);
    const size_t bb = records->front().bytes.size();
    auto dev = std::make_shared<DeviceLike>();
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
        60, shared_memory, dev);
    if (!st.ok()) _exit(12);
    if (dev->uploads != 0) _exit(13);
    if (dev->downloads != downloads) _exit(14);
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

}  // namespace

TEST_CASE("kv streams on devices: one host, device memory to device memory through shared memory, no host copy") {
  auto want = make_records(kBlocks);
  const size_t bb = want->front().bytes.size();
  DeviceSender sender = start_sender(true, 0);
  auto dev = std::make_shared<DeviceLike>();
  int streams = 0;
  auto pulls = pull_kv_streams(
      "127.0.0.1", sender.port, kStreams, 4096, 4,
      [&](const KvReceived& got) {
        ++streams;
        CHECK(got.records.empty());
        REQUIRE(got.blocks);
        CHECK(&got.blocks->backend() == dev.get());
        REQUIRE(got.blocks->size() == size_t(kBlocks));
        for (size_t i = 0; i < size_t(kBlocks); ++i) {
          CHECK(got.blocks->headers()[i].checksum == (*want)[i].header.checksum);
          CHECK(got.blocks->headers()[i].key == (*want)[i].header.key);
          // DeviceLike's memory is the host's underneath: read to compare.
          CHECK(std::memcmp(got.blocks->block(i), (*want)[i].bytes.data(), bb) == 0);
        }
      },
      true, dev);
  CHECK_MESSAGE(pulls.ok(), pulls.status().to_string());
  CHECK(exit_status(sender.pid) == 0);  // its device: offered from, no upload or download
  CHECK(streams == kStreams);
  CHECK(dev->uploads == 0);
  CHECK(dev->downloads == 0);
  CHECK(dev->checksum_calls == kStreams);  // each stream checked where it landed
}

TEST_CASE("kv streams on devices: over the data socket the sender downloads its blocks, the decoder gets records") {
  auto want = make_records(kBlocks);
  DeviceSender sender = start_sender(false, kStreams * kBlocks);
  auto dev = std::make_shared<DeviceLike>();
  int streams = 0;
  auto pulls = pull_kv_streams(
      "127.0.0.1", sender.port, kStreams, 4096, 4,
      [&](const KvReceived& got) {
        ++streams;
        CHECK_FALSE(got.blocks);
        REQUIRE(got.records.size() == size_t(kBlocks));
        for (size_t i = 0; i < size_t(kBlocks); ++i) {
          CHECK(got.records[i].bytes == (*want)[i].bytes);
          CHECK(got.records[i].header.checksum == (*want)[i].header.checksum);
        }
      },
      false, dev);
  CHECK_MESSAGE(pulls.ok(), pulls.status().to_string());
  CHECK(exit_status(sender.pid) == 0);  // one download per block and stream, no upload
  CHECK(streams == kStreams);
  CHECK(dev->uploads == 0);  // the decoder's engine imports the records itself
}
