#pragma once
// DeviceAccountant: the device bytes of every chunk store that shares it (the parameter chunks and the
// optimizer state), in total and by chunk role. Each ChunkStore charges it when a payload gets device
// memory and discharges it when the memory goes; whoever budgets the device (the scheduler) reads the
// total and the bytes of the stores other than its own, instead of being told them by hand.
//
// Contract: thread-safe (a mutex); charges and discharges come in pairs per payload.
#include <array>
#include <cstdint>
#include <mutex>

#include "role.h"

namespace ferry {

class DeviceAccountant {
 public:
  void charge(ChunkRole role, int64_t bytes);
  void discharge(ChunkRole role, int64_t bytes);
  int64_t current_bytes() const;
  int64_t peak_bytes() const;  // since construction or reset_peak()
  void reset_peak();
  std::array<int64_t, kNumChunkRoles> bytes_by_role() const;

 private:
  mutable std::mutex mutex_;
  int64_t current_ = 0, peak_ = 0;
  std::array<int64_t, kNumChunkRoles> by_role_{};
};

}  // namespace ferry
