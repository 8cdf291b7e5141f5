#include "device_accountant.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ferry {

void DeviceAccountant::charge(ChunkRole role, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  current_ += bytes;
  by_role_[static_cast<int>(role)] += bytes;
  peak_ = std::max(peak_, current_);
}

void DeviceAccountant::discharge(ChunkRole role, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  current_ -= bytes;
  by_role_[static_cast<int>(role)] -= bytes;
  TORCH_INTERNAL_ASSERT(current_ >= 0 && by_role_[static_cast<int>(role)] >= 0, "device accountant went negative");
}

int64_t DeviceAccountant::current_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_;
}

int64_t DeviceAccountant::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void DeviceAccountant::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = current_;
}

std::array<int64_t, kNumChunkRoles> DeviceAccountant::bytes_by_role() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return by_role_;
}

}  // namespace ferry
