// Device links between GPUs through NCCL (Backend::new_link_id / open_link
// of the CUDA backend): a communicator of two ranks per link, made
// non-blocking so that a peer that never joins, or stops midway, fails the
// call at its timeout instead of hanging it (the communicator is then
// aborted). Ids read "nccl:" and the 128-byte ncclUniqueId in hex. Built
// without NCCL (its header or library not found), both answer unsupported.
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace cleave::cuda {

Result<std::string> nccl_link_id();
Result<std::unique_ptr<DeviceLink>> nccl_open_link(int device, const std::string& id, int rank, double timeout_s);

}  // namespace cleave::cuda
