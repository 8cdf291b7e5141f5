#include "ferry/scheduler/memory_probe.h"

#ifdef FERRY_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace ferry {
namespace {

class UnknownProbe final : public MemoryProbe {
 public:
  const char* name() const override { return "none"; }
  int64_t device_allocated_bytes() override { return -1; }
};

#ifdef FERRY_WITH_CUDA
class CudaProbe final : public MemoryProbe {
 public:
  const char* name() const override { return "cuda-caching-allocator"; }
  int64_t device_allocated_bytes() override {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
};
#endif

class FunctionProbe final : public MemoryProbe {
 public:
  explicit FunctionProbe(std::function<int64_t()> fn) : fn_(std::move(fn)) {}
  const char* name() const override { return "function"; }
  int64_t device_allocated_bytes() override { return fn_(); }

 private:
  std::function<int64_t()> fn_;
};

}  // namespace

std::unique_ptr<MemoryProbe> make_memory_probe(DeviceKind resolved_kind) {
#ifdef FERRY_WITH_CUDA
  if (resolved_kind == DeviceKind::kCuda) return std::make_unique<CudaProbe>();
#endif
  return std::make_unique<UnknownProbe>();
}

std::unique_ptr<MemoryProbe> make_function_probe(std::function<int64_t()> fn) {
  return std::make_unique<FunctionProbe>(std::move(fn));
}

}  // namespace ferry
