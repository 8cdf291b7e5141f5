#include "ferry/chunk/copy_engine.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "ferry/common/event_trace.h"
#include "ferry/common/gpu_info.h"

namespace ferry {
namespace {

class DoneTicket final : public CopyTicket {
 public:
  bool done() override { return true; }
  void wait() override {}
  void order_before_compute() override {}
};

// The host clock: the device's where work is done when the call that queued it returns.
class HostClockMark final : public StreamMark {
 public:
  void record() override { ns_ = trace::now_ns(); }
  bool recorded() const override { return ns_ >= 0; }
  double seconds_since(const StreamMark& earlier) const override {
    const auto* e = dynamic_cast<const HostClockMark*>(&earlier);
    TORCH_CHECK(e != nullptr, "ferry: StreamMark::seconds_since: the earlier mark is of another device's kind");
    TORCH_CHECK(recorded() && e->recorded(), "ferry: StreamMark::seconds_since: both marks must be recorded first");
    return static_cast<double>(ns_ - e->ns_) * 1e-9;
  }

 private:
  int64_t ns_ = -1;
};

class SimulatedCopyEngine final : public CopyEngine {
 public:
  const char* name() const override { return "simulated"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  c10::Allocator* device_allocator() const override { return c10::GetCPUAllocator(); }
  bool pinned_host() const override { return false; }
  std::unique_ptr<CopyTicket> copy(const at::Tensor& dst, const at::Tensor& src) override {
    TORCH_INTERNAL_ASSERT(dst.numel() == src.numel() && dst.scalar_type() == src.scalar_type());
    dst.copy_(src);
    return std::make_unique<DoneTicket>();
  }
};

}  // namespace

std::unique_ptr<StreamMark> CopyEngine::make_mark() const { return std::make_unique<HostClockMark>(); }

std::unique_ptr<CopyEngine> make_simulated_copy_engine() { return std::make_unique<SimulatedCopyEngine>(); }

DeviceKind resolve_device_kind(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto: return cuda_available() ? DeviceKind::kCuda : DeviceKind::kSimulated;
    case DeviceKind::kCuda:
    case DeviceKind::kSimulated: return kind;
  }
  return kind;
}

std::unique_ptr<CopyEngine> make_copy_engine(DeviceKind kind) {
  switch (resolve_device_kind(kind)) {
    case DeviceKind::kSimulated: return make_simulated_copy_engine();
    case DeviceKind::kCuda:
#ifdef FERRY_WITH_CUDA
      TORCH_CHECK(cuda_available(), "ferry: device=cuda was asked for, but no CUDA GPU is available "
                  "(use device=auto or device=simulated)");
      return make_cuda_copy_engine();
#else
      TORCH_CHECK(false, "ferry: device=cuda was asked for, but this ferry was built without CUDA");
#endif
    case DeviceKind::kAuto: break;
  }
  TORCH_INTERNAL_ASSERT(false, "unresolved device kind");
}

}  // namespace ferry
