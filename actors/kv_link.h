// KV handed between GPU processes over a device link (Backend::open_link:
// NCCL send / recv), no CAF: what the kv_sender and kv_receiver actors run
// when both stages' engines are on devices that can link and shared memory
// does not reach (another host, or a device that does not share).
//
// One link per sender / receiver pair, made on the first stream and kept
// for the next ones: the receiver asks for an offer (the block headers, as
// in shared memory), the sender answers with the link's id and queues one
// send of the blocks; the receiver queues one recv into new memory of its
// device and checks every block there. Each end runs its pair's transfers
// in order on a thread of the link's own, so sends and recvs meet in the
// order the pulls were answered. Anything that fails (the offer, the
// link, a checksum) ends that link on both sides and the pull goes to the
// data socket.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "actors/kv_stream.h"
#include "kernels/backend.h"
#include "storage/backend_blocks.h"

namespace cleave {

// How long a link end waits for its peer to join or to meet a send / recv.
constexpr double kKvLinkTimeoutS = 10;

// One end of a device link (rank 0 sends, 1 receives) with the thread that
// runs its transfers in order. The first job opens the link. Destroying it
// aborts the link (blocked calls return) and joins the thread.
class KvLinkEnd {
 public:
  KvLinkEnd(std::shared_ptr<Backend> device, std::string id, int rank, double timeout_s = kKvLinkTimeoutS);
  ~KvLinkEnd();
  KvLinkEnd(const KvLinkEnd&) = delete;
  KvLinkEnd& operator=(const KvLinkEnd&) = delete;
  const std::string& id() const { return id_; }
  // job runs on the link's thread with the open link, or with null and why
  // it did not open (every job after a failed open gets that status).
  void run(std::function<void(DeviceLink* link, const Status& opened)> job);

 private:
  void work();
  std::shared_ptr<Backend> device_;
  std::string id_;
  int rank_;
  double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void(DeviceLink*, const Status&)>> queue_;
  std::unique_ptr<DeviceLink> link_;  // set by the thread once open
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

// The sender's side of one stream: blocks [first, size()) in one send.
Status send_kv_link(DeviceLink& link, const BackendBlocks& blocks, size_t first);

// The receiver's side: the offer checked against the pull (check_kv_offer),
// received into new memory of `device` and every block checked there
// against its header (corruption naming the block). Counts chunks_received
// (one per block), bytes_received, chunks_rejected.
Result<std::shared_ptr<BackendBlocks>> recv_kv_link(DeviceLink& link, const std::shared_ptr<Backend>& device,
                                                    const msg::KvChunk& offer, const msg::KvPull& pull,
                                                    uint64_t max_total_bytes, KvStreamCounters& counters);

}  // namespace cleave
