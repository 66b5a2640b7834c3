// make_backend(): the backend a --device value names.
#include "kernels/backend.h"

namespace cleave {

Result<std::unique_ptr<Backend>> make_backend(const Device& device, int threads, Compute compute) {
  if (device.kind == Device::Kind::cpu) return make_cpu_backend(threads, detect_isa(), compute);
  if (compute != Compute::int8) return make_cuda_backend(device.index);
  return Status(Code::unsupported, "device " + device.name() +
                                       ": --compute int8 runs on the CPU backend only (its "
                                       "kernels are AVX2 / AVX-512 VNNI); use --compute exact");
}

}  // namespace cleave
