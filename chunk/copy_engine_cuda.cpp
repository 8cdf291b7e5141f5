// The CUDA copy engine (see copy_engine.h). Compiled only in CUDA builds of ferry.
#ifdef FERRY_WITH_CUDA
#include <ATen/Context.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "copy_engine.h"

namespace ferry {
namespace {

class CudaTicket final : public CopyTicket {
 public:
  CudaTicket(at::Tensor dst, at::Tensor src, c10::DeviceIndex device)
      : dst_(std::move(dst)), src_(std::move(src)), device_(device) {}
  at::cuda::CUDAEvent& event() { return event_; }
  bool done() override { return event_.query(); }
  void wait() override { event_.synchronize(); }
  void order_before_compute() override { event_.block(c10::cuda::getCurrentCUDAStream(device_)); }

 private:
  at::cuda::CUDAEvent event_;  // recorded on the copy stream after the copy
  at::Tensor dst_, src_;       // kept alive until the ticket goes
  c10::DeviceIndex device_;
};

// A timing event on the current stream (StreamMark); cudaEventElapsedTime resolves about 0.5 us.
class CudaMark final : public StreamMark {
 public:
  explicit CudaMark(c10::DeviceIndex device) : device_(device), event_(cudaEventDefault) {}
  void record() override { event_.record(c10::cuda::getCurrentCUDAStream(device_)); }
  bool recorded() const override { return event_.isCreated(); }  // created by its first record
  // Makes `stream` wait (on the GPU) for the work before this mark.
  void block(const c10::cuda::CUDAStream& stream) const {
    TORCH_CHECK(recorded(), "ferry: CopyEngine::copy_after: the mark was never recorded");
    event_.block(stream);
  }
  c10::DeviceIndex device() const { return device_; }
  double seconds_since(const StreamMark& earlier) const override {
    const auto* e = dynamic_cast<const CudaMark*>(&earlier);
    TORCH_CHECK(e != nullptr, "ferry: StreamMark::seconds_since: the earlier mark is of another device's kind");
    TORCH_CHECK(recorded() && e->recorded(), "ferry: StreamMark::seconds_since: both marks must be recorded first");
    TORCH_CHECK(e->device_ == device_, "ferry: StreamMark::seconds_since: marks on cuda:", int(e->device_),
                " and cuda:", int(device_));
    e->event_.synchronize();
    event_.synchronize();
    return static_cast<double>(e->event_.elapsed_time(event_)) * 1e-3;
  }

 private:
  c10::DeviceIndex device_;
  mutable at::cuda::CUDAEvent event_;  // with timing (the default CUDAEvent has none); block() is not const
};

// CUDA's lazy initialisation (the caching allocator's per-device state among it) runs on the first
// CUDA tensor op; a ChunkStore may allocate device memory through the caching allocator before any op
// ran ("Allocator not initialized for device", an internal assert, seen on an H100). So the engine,
// created before the store's first allocation, initialises CUDA itself.
c10::DeviceIndex initialized_current_device() {
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return c10::cuda::current_device();
}

class CudaCopyEngine final : public CopyEngine {
 public:
  CudaCopyEngine()
      : device_(initialized_current_device()),
        copy_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_)) {}

  const char* name() const override { return "cuda"; }
  c10::Device device() const override { return c10::Device(c10::kCUDA, device_); }
  c10::Allocator* device_allocator() const override { return c10::cuda::CUDACachingAllocator::get(); }
  bool pinned_host() const override { return true; }

  std::unique_ptr<CopyTicket> copy(const at::Tensor& dst, const at::Tensor& src, CopyTiming timing) override {
    c10::cuda::CUDAGuard device_guard(device_);
    // The copy must see everything the compute stream wrote so far.
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device_));
    ready.block(copy_stream_);
    return issue(dst, src, timing);
  }

  std::unique_ptr<CopyTicket> copy_after(const at::Tensor& dst, const at::Tensor& src, CopyTiming timing,
                                         const StreamMark& after) override {
    const auto* mark = dynamic_cast<const CudaMark*>(&after);
    TORCH_CHECK(mark != nullptr, "ferry: CopyEngine::copy_after: the mark is not a CUDA one");
    TORCH_CHECK(mark->device() == device_, "ferry: CopyEngine::copy_after: a mark on cuda:", int(mark->device()),
                " for a copy on cuda:", int(device_));
    c10::cuda::CUDAGuard device_guard(device_);
    mark->block(copy_stream_);  // what was written before the mark, not what was queued since
    return issue(dst, src, timing);
  }

  std::unique_ptr<StreamMark> make_mark() const override { return std::make_unique<CudaMark>(device_); }

 private:
  // The copy on the copy stream, which was made to wait for what it must see.
  std::unique_ptr<CopyTicket> issue(const at::Tensor& dst, const at::Tensor& src, CopyTiming timing) {
    TORCH_INTERNAL_ASSERT(dst.numel() == src.numel() && dst.scalar_type() == src.scalar_type());
    auto ticket = std::make_unique<CudaTicket>(dst, src, device_);
    {
      c10::cuda::CUDAStreamGuard stream_guard(copy_stream_);  // marks record on the current stream: this one
      if (timing == CopyTiming::kTimed) {
        ticket->started = make_mark();
        ticket->finished = make_mark();
        ticket->started->record();  // reached once the copies before and the compute it waits for are done
      }
      dst.copy_(src, /*non_blocking=*/true);
      if (ticket->finished) ticket->finished->record();
    }
    // Device memory now has a use on the copy stream: keep the allocator from reusing it early.
    if (dst.is_cuda()) dst.record_stream(copy_stream_);
    if (src.is_cuda()) src.record_stream(copy_stream_);
    ticket->event().record(copy_stream_);
    return ticket;
  }

  c10::DeviceIndex device_;
  c10::cuda::CUDAStream copy_stream_;
};

}  // namespace

std::unique_ptr<CopyEngine> make_cuda_copy_engine() { return std::make_unique<CudaCopyEngine>(); }

}  // namespace ferry
#endif  // FERRY_WITH_CUDA
