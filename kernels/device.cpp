// make_backend(): the backend a --device value names.
#include <atomic>
#include <mutex>

#include "kernels/backend.h"
#include "kernels/device_testing.h"

namespace cleave {
namespace {

std::mutex stand_in_mu;
std::function<std::unique_ptr<Backend>(int)> stand_in;  // tests: kernels/device_testing.h
std::atomic<bool> fma_matmul{false};                     // tests: kernels/device_testing.h

}  // namespace

void set_cuda_stand_in(std::function<std::unique_ptr<Backend>(int index)> factory) {
  std::lock_guard<std::mutex> lock(stand_in_mu);
  stand_in = std::move(factory);
}

void set_cuda_fma_matmul(bool on) { fma_matmul.store(on); }
bool cuda_fma_matmul() { return fma_matmul.load(); }

Result<std::unique_ptr<Backend>> make_backend(const Device& device, int threads, Compute compute) {
  if (device.kind == Device::Kind::cpu) return make_cpu_backend(threads, detect_isa(), compute);
  if (compute != Compute::int8) {
    {
      std::lock_guard<std::mutex> lock(stand_in_mu);
      if (stand_in) return stand_in(device.index);
    }
    return make_cuda_backend(device.index);
  }
  return Status(Code::unsupported, "device " + device.name() +
                                       ": --compute int8 runs on the CPU backend only (its "
                                       "kernels are AVX2 / AVX-512 VNNI); use --compute exact");
}

Result<Device> device_for(const std::string& device, bool given, const std::string& who) {
  auto d = parse_device(device);
  if (!d.ok()) return Status(d.status().code(), who + ": " + d.status().message());
  if (given && d->kind != Device::Kind::cpu)
    return Status(Code::invalid_argument, who + ": device " + device + " given beside a backend of its own");
  return d;
}

Result<std::shared_ptr<Backend>> backend_for(const Device& device, int threads, Compute compute,
                                             std::shared_ptr<Backend> given, const std::string& who) {
  if (given) return given;
  auto made = make_backend(device, threads, compute);
  if (!made.ok()) return Status(made.status().code(), who + ": " + made.status().message());
  return std::shared_ptr<Backend>(std::move(made.value()));
}

}  // namespace cleave
