#include "memory_probe.h"

#include <c10/util/Exception.h>

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

// Asks the device (chunk/device.h): -1 where it cannot tell.
class DeviceProbe final : public MemoryProbe {
 public:
  explicit DeviceProbe(std::shared_ptr<const Device> device) : device_(std::move(device)) {
    TORCH_CHECK(device_ != nullptr, "ferry: a device memory probe needs a device, got none");
  }
  const char* name() const override { return device_->name(); }
  int64_t device_allocated_bytes() override { return device_->allocated_bytes(); }

 private:
  std::shared_ptr<const Device> device_;
};

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

std::unique_ptr<MemoryProbe> make_memory_probe(const DeviceSpec& device) {
  return std::make_unique<DeviceProbe>(device.make());
}

std::unique_ptr<MemoryProbe> make_function_probe(std::function<int64_t()> fn) {
  return std::make_unique<FunctionProbe>(std::move(fn));
}

std::unique_ptr<MemoryProbe> make_heap_probe(std::function<int64_t()> ferry_bytes) {
  return std::make_unique<HeapProbe>(std::move(ferry_bytes));
}

}  // namespace ferry
