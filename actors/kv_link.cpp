#include "actors/kv_link.h"

#include <vector>

namespace cleave {
namespace {
constexpr const char* kWhat = "KV over a device link";
}

KvLinkEnd::KvLinkEnd(std::shared_ptr<Backend> device, std::string id, int rank, double timeout_s)
    : device_(std::move(device)), id_(std::move(id)), rank_(rank), timeout_s_(timeout_s),
      thread_([this] { work(); }) {}

KvLinkEnd::~KvLinkEnd() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (link_) link_->abort();  // a call blocked on a peer that went away returns now
  }
  cv_.notify_all();
  thread_.join();
}

void KvLinkEnd::run(std::function<void(DeviceLink*, const Status&)> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void KvLinkEnd::work() {
  Status opened;
  bool tried = false;
  DeviceLink* link = nullptr;
  for (;;) {
    std::function<void(DeviceLink*, const Status&)> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) {
        // Jobs still queued hear that the link is gone.
        for (auto& j : queue_) j(nullptr, Status(Code::aborted, std::string(kWhat) + ": the link was closed"));
        queue_.clear();
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    if (!tried) {
      tried = true;
      auto made = device_->open_link(id_, rank_, timeout_s_);
      if (made.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        link_ = std::move(made.value());
        link = link_.get();
        if (stop_) link_->abort();
      } else {
        opened = Status(made.status().code(), std::string(kWhat) + ": " + made.status().message());
      }
    }
    job(link, opened);
  }
}

Status send_kv_link(DeviceLink& link, const BackendBlocks& blocks, size_t first) {
  if (first >= blocks.size())
    return Status(Code::invalid_argument, std::string(kWhat) + ": no blocks from block " + std::to_string(first));
  return link.send(blocks.block(first), (blocks.size() - first) * blocks.block_bytes());
}

Result<std::shared_ptr<BackendBlocks>> recv_kv_link(DeviceLink& link, const std::shared_ptr<Backend>& device,
                                                    const msg::KvChunk& offer, const msg::KvPull& pull,
                                                    uint64_t max_total_bytes, KvStreamCounters& counters) {
  CLEAVE_RETURN_IF_ERROR(check_kv_offer(offer, pull, max_total_bytes, kWhat));
  const size_t n = offer.headers.size(), block_bytes = offer.headers.front().layout.block_bytes();
  auto blocks = BackendBlocks::allocate(device, n, block_bytes);
  if (!blocks.ok()) return blocks.status();
  CLEAVE_RETURN_IF_ERROR(link.recv((*blocks)->data(), size_t(offer.total_bytes)));
  counters.chunks_received += n;
  counters.bytes_received += offer.total_bytes;
  std::vector<uint64_t> sums(n);
  CLEAVE_RETURN_IF_ERROR(checksum_blocks_in_place(*device, (*blocks)->data(), block_bytes, int64_t(n), sums.data()));
  for (size_t i = 0; i < n; ++i)
    if (sums[i] != offer.headers[i].checksum) {
      ++counters.chunks_rejected;
      return kv_offer_mismatch(offer, i, kWhat);
    }
  (*blocks)->headers() = offer.headers;
  return blocks;
}

}  // namespace cleave
