#include "copy_engine.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "../common/event_trace.h"

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
  int64_t host_clock_ns() const override { return ns_; }

 private:
  int64_t ns_ = -1;
};

class SimulatedCopyEngine final : public CopyEngine {
 public:
  const char* name() const override { return "simulated"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  c10::Allocator* device_allocator() const override { return c10::GetCPUAllocator(); }
  bool pinned_host() const override { return false; }
  std::unique_ptr<CopyTicket> copy(const at::Tensor& dst, const at::Tensor& src, CopyTiming timing) override {
    TORCH_INTERNAL_ASSERT(dst.numel() == src.numel() && dst.scalar_type() == src.scalar_type());
    auto ticket = std::make_unique<DoneTicket>();
    if (timing == CopyTiming::kTimed) {  // the copy runs within the call: the host's clock is its clock
      ticket->started = make_mark();
      ticket->finished = make_mark();
      ticket->started->record();
    }
    dst.copy_(src);
    if (ticket->finished) ticket->finished->record();
    return ticket;
  }
};

}  // namespace

std::unique_ptr<StreamMark> CopyEngine::make_mark() const { return std::make_unique<HostClockMark>(); }

ClockAnchor::ClockAnchor(std::unique_ptr<StreamMark> unrecorded) : mark_(std::move(unrecorded)) {
  TORCH_CHECK(mark_ != nullptr, "ferry: ClockAnchor needs a mark, got none");
  mark_->record();
  host_ns_ = mark_->host_clock_ns();
  if (host_ns_ < 0) {
    (void)mark_->seconds_since(*mark_);  // waits for the device to reach it
    host_ns_ = trace::now_ns();
  }
}

int64_t ClockAnchor::host_ns(const StreamMark& mark) const {
  return host_ns_ - std::llround(mark_->seconds_since(mark) * 1e9);
}

std::unique_ptr<CopyEngine> make_simulated_copy_engine() { return std::make_unique<SimulatedCopyEngine>(); }

}  // namespace ferry
