#include "kernels/cuda/nccl_link.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ipc.h"

#if CLEAVE_HAVE_NCCL
#include <nccl.h>
#endif

namespace cleave::cuda {

#if CLEAVE_HAVE_NCCL
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

Status nccl_error(const char* what, ncclResult_t r) {
  return Status(Code::unavailable, std::string("nccl link: ") + what + ": " + ncclGetErrorString(r));
}

class NcclLink final : public DeviceLink {
 public:
  NcclLink(int device, ncclComm_t comm, cudaStream_t stream, int rank, double timeout_s)
      : device_(device), comm_(comm), stream_(stream), peer_(1 - rank), timeout_s_(timeout_s) {}
  ~NcclLink() override {
    cudaSetDevice(device_);
    ncclCommAbort(comm_);  // frees it whatever state it is in, peers or not
    cudaStreamDestroy(stream_);
  }
  Status send(const void* data, size_t bytes) override {
    CLEAVE_CUDA_CHECK(cudaSetDevice(device_));
    return finish("send", ncclSend(data, bytes, ncclUint8, peer_, comm_, stream_));
  }
  Status recv(void* data, size_t bytes) override {
    CLEAVE_CUDA_CHECK(cudaSetDevice(device_));
    return finish("recv", ncclRecv(data, bytes, ncclUint8, peer_, comm_, stream_));
  }
  void abort() override { aborted_ = true; }

 private:
  // Waits for the enqueued call, then for the stream: the peer's side must
  // run too. Past the timeout, or once aborted, the link is broken.
  Status finish(const char* what, ncclResult_t r) {
    if (broken_) return Status(Code::aborted, std::string("nccl link: ") + what + " on a broken link");
    const auto deadline = after(timeout_s_);
    while (r == ncclInProgress) {
      if (Status st = waited(what, deadline); !st.ok()) return st;
      ncclCommGetAsyncError(comm_, &r);
    }
    if (r != ncclSuccess) return broke(nccl_error(what, r));
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady) CLEAVE_CUDA_CHECK(q);
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) return broke(nccl_error(what, async));
      if (Status st = waited(what, deadline); !st.ok()) return st;
    }
  }
  Status waited(const char* what, Clock::time_point deadline) {
    if (aborted_) return broke(Status(Code::aborted, std::string("nccl link: ") + what + " aborted"));
    if (Clock::now() > deadline)
      return broke(Status(Code::timed_out, std::string("nccl link: ") + what + ": the peer did not answer within " +
                                               std::to_string(timeout_s_) + " s"));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    return Status::Ok();
  }
  Status broke(Status why) {
    broken_ = true;
    return why;
  }

  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  int peer_;
  double timeout_s_;
  std::atomic<bool> aborted_{false};
  bool broken_ = false;
};

}  // namespace

Result<std::string> nccl_link_id() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return nccl_error("unique id", r);
  return "nccl:" + to_hex(&id, sizeof id);
}

Result<std::unique_ptr<DeviceLink>> nccl_open_link(int device, const std::string& id, int rank, double timeout_s) {
  ncclUniqueId uid;
  if (id.rfind("nccl:", 0) != 0 || !from_hex(id.substr(5), &uid, sizeof uid))
    return Status(Code::invalid_argument, "nccl link: a malformed id");
  if (rank != 0 && rank != 1) return Status(Code::invalid_argument, "nccl link: rank " + std::to_string(rank));
  CLEAVE_CUDA_CHECK(cudaSetDevice(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // a peer that never joins fails the open at its timeout
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, 2, uid, rank, &config);
  const auto deadline = after(timeout_s);
  while (r == ncclInProgress) {
    if (Clock::now() > deadline) {
      ncclCommAbort(comm);
      return Status(Code::timed_out, "nccl link: the peer did not join within " + std::to_string(timeout_s) + " s");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    ncclCommGetAsyncError(comm, &r);
  }
  if (r != ncclSuccess) {
    if (comm) ncclCommAbort(comm);
    return nccl_error("open", r);
  }
  cudaStream_t stream = nullptr;
  CLEAVE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::unique_ptr<DeviceLink>(new NcclLink(device, comm, stream, rank, timeout_s));
}

#else

Result<std::string> nccl_link_id() {
  return Status(Code::unsupported, "nccl link: cleave was built without NCCL");
}

Result<std::unique_ptr<DeviceLink>> nccl_open_link(int, const std::string&, int, double) {
  return Status(Code::unsupported, "nccl link: cleave was built without NCCL");
}

#endif

}  // namespace cleave::cuda
