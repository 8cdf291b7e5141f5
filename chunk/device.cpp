// The simulated device, the factory, and the device budget (see device.h). The CUDA device is in
// device_cuda.cpp (CUDA builds only).
#include "device.h"

#include <algorithm>

#include <c10/util/Exception.h>

#include "../common/gpu_info.h"

namespace ferry {
namespace {

// The device tier in host memory from the CPU allocator: same API and budgets, copies are synchronous.
class SimulatedDevice final : public Device {
 public:
  const char* name() const override { return "simulated"; }
  c10::Device torch_device() const override { return c10::Device(c10::kCPU); }
  std::unique_ptr<CopyEngine> make_copy_engine() const override { return make_simulated_copy_engine(); }
  int64_t default_capacity_bytes(int64_t budget_bytes, bool counts_host_memory) const override {
    return counts_host_memory ? budget_bytes : 0;
  }
  int64_t allocated_bytes() const override { return -1; }
  void synchronize() const override {}
  const char* collective_backend() const override { return "gloo"; }
  c10::Device bind_local_rank(int /*local_rank*/, bool /*may_share*/) const override {
    return c10::Device(c10::kCPU);
  }
};

}  // namespace

std::shared_ptr<const Device> make_simulated_device() { return std::make_shared<SimulatedDevice>(); }

DeviceKind resolve_device_kind(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto: return cuda_available() ? DeviceKind::kCuda : DeviceKind::kSimulated;
    case DeviceKind::kCuda:
    case DeviceKind::kSimulated: return kind;
  }
  return kind;
}

std::shared_ptr<const Device> make_device(DeviceKind kind) {
  switch (resolve_device_kind(kind)) {
    case DeviceKind::kSimulated: return make_simulated_device();
    case DeviceKind::kCuda:
#ifdef FERRY_WITH_CUDA
      TORCH_CHECK(cuda_available(), "ferry: device=cuda was asked for, but no CUDA GPU is available "
                  "(use device=auto or device=simulated)");
      return make_cuda_device();
#else
      TORCH_CHECK(false, "ferry: device=cuda was asked for, but this ferry was built without CUDA");
#endif
    case DeviceKind::kAuto: break;
  }
  TORCH_INTERNAL_ASSERT(false, "unresolved device kind");
}

DeviceBudget DeviceBudget::of(const Config& config, const Device& device, bool counts_host_memory) {
  // Config::validate() checked the user's numbers; the device's own capacity is >= 0 by its contract.
  DeviceBudget b;
  b.budget_bytes = config.device_budget_bytes;
  b.capacity_bytes = config.device_capacity_bytes != 0
                         ? config.device_capacity_bytes
                         : device.default_capacity_bytes(config.device_budget_bytes, counts_host_memory);
  TORCH_INTERNAL_ASSERT(b.budget_bytes >= 0 && b.capacity_bytes >= 0, "device budget ", b.budget_bytes,
                        ", capacity ", b.capacity_bytes);
  return b;
}

int64_t default_gpu_capacity_bytes(int64_t total_bytes) {
  return total_bytes - std::max<int64_t>(int64_t{2} << 30, total_bytes / 20);
}

}  // namespace ferry
