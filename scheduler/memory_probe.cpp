#include "memory_probe.h"

#ifdef FERRY_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <malloc.h>

#include <algorithm>

namespace ferry {

int64_t MemoryProbe::non_model_bytes(int64_t chunk_device_bytes) {
  const int64_t allocated = device_allocated_bytes();
  if (allocated < 0) return 0;
  return std::max<int64_t>(0, allocated - chunk_device_bytes);
}

namespace {

class HeapProbe final : public MemoryProbe {
 public:
  explicit HeapProbe(std::function<int64_t()> ferry_bytes) : ferry_bytes_(std::move(ferry_bytes)) {}
  const char* name() const override { return "glibc-heap-growth"; }
  int64_t device_allocated_bytes() override { return -1; }  // no absolute number; see non_model_bytes
  void begin_iteration() override {
    base_heap_ = host_heap_in_use_bytes();
    base_ferry_ = ferry_bytes_();
  }
  int64_t non_model_bytes(int64_t) override {
    return std::max<int64_t>(0, (host_heap_in_use_bytes() - base_heap_) - (ferry_bytes_() - base_ferry_));
  }

 private:
  std::function<int64_t()> ferry_bytes_;
  int64_t base_heap_ = 0, base_ferry_ = 0;
};

class UnknownProbe final : public MemoryProbe {
 public:
  const char* name() const override { return "none"; }
  int64_t device_allocated_bytes() override { return -1; }
};

#ifdef FERRY_WITH_CUDA
class CudaProbe final : public MemoryProbe {
 public:
  // getDeviceStats asserts if CUDA was not initialised yet (see copy_engine_cuda.cpp).
  CudaProbe() { at::globalContext().lazyInitDevice(c10::DeviceType::CUDA); }
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

int64_t host_heap_in_use_bytes() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

std::unique_ptr<MemoryProbe> make_memory_probe(DeviceKind resolved_kind) {
#ifdef FERRY_WITH_CUDA
  if (resolved_kind == DeviceKind::kCuda) return std::make_unique<CudaProbe>();
#endif
  return std::make_unique<UnknownProbe>();
}

std::unique_ptr<MemoryProbe> make_function_probe(std::function<int64_t()> fn) {
  return std::make_unique<FunctionProbe>(std::move(fn));
}

std::unique_ptr<MemoryProbe> make_heap_probe(std::function<int64_t()> ferry_bytes) {
  return std::make_unique<HeapProbe>(std::move(ferry_bytes));
}

}  // namespace ferry
