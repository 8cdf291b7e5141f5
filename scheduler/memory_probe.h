#pragma once
// How much device memory is in use right now, model and non-model together. The scheduler records
// it at every parameter use during warm-up; minus the chunk payloads it is the non-model memory
// (activations, temporaries, workspace) that the per-moment chunk budget leaves room for.
//
// Injectable so the budget logic is tested without a GPU.
#include <cstdint>
#include <functional>
#include <memory>

#include "ferry/common/config.h"

namespace ferry {

class MemoryProbe {
 public:
  virtual ~MemoryProbe() = default;
  virtual const char* name() const = 0;
  // Bytes allocated on the device now; -1 when this probe cannot tell (then non-model memory is 0).
  virtual int64_t device_allocated_bytes() = 0;
};

// CUDA: the caching allocator's allocated bytes on the current device. Simulated: cannot tell (-1):
// ferry's simulated device does not separate activations from other host memory.
std::unique_ptr<MemoryProbe> make_memory_probe(DeviceKind resolved_kind);
// A probe answering with `fn` (tests).
std::unique_ptr<MemoryProbe> make_function_probe(std::function<int64_t()> fn);

}  // namespace ferry
