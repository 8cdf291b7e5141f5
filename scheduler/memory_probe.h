#pragma once
// How much device memory is in use right now, model and non-model together. The scheduler records
// it at every parameter use during warm-up; minus the chunk payloads it is the non-model memory
// (activations, temporaries, workspace) that the per-moment chunk budget leaves room for.
//
// Injectable so the budget logic is tested without a GPU; the device's own probe asks the Device object
// (chunk/device.h), whatever its kind.
#include <cstdint>
#include <functional>
#include <memory>

#include "../chunk/device.h"

namespace ferry {

class MemoryProbe {
 public:
  virtual ~MemoryProbe() = default;
  virtual const char* name() const = 0;
  // Bytes allocated on the device now; -1 when this probe cannot tell (then non-model memory is 0).
  virtual int64_t device_allocated_bytes() = 0;
  // Called by the scheduler when an iteration begins (probes that measure growth take a baseline).
  virtual void begin_iteration() {}
  // Non-model bytes now, given the chunk bytes on the device: by default allocated - chunk bytes.
  virtual int64_t non_model_bytes(int64_t chunk_device_bytes);
};

// The device's own count (Device::allocated_bytes): on CUDA the caching allocator's allocated bytes on
// the current device; the simulated device cannot tell (-1): it does not separate activations from
// other host memory. `device` is shared with the probe (a kind: a Device made now).
std::unique_ptr<MemoryProbe> make_memory_probe(const DeviceSpec& device);
// Bytes of the process heap in use now (glibc mallinfo2: arenas + mmapped blocks), where CPU tensors
// live; about 0 under AddressSanitizer.
int64_t host_heap_in_use_bytes();
// A probe answering with `fn` (tests).
std::unique_ptr<MemoryProbe> make_function_probe(std::function<int64_t()> fn);
// The simulated device's equivalent of the CUDA allocator's count: the growth since the iteration began
// of the process heap in use (glibc mallinfo2: arenas + mmapped blocks, where CPU tensors live), minus
// the growth of ferry's own chunk memory (`ferry_bytes`: chunk payloads and cached host buffers). That
// is what forward/backward allocated beside the chunks: activations, temporaries — what would be on
// the GPU. Other threads' allocations count too; under AddressSanitizer (whose allocator glibc does not
// see) it reports about 0. Approximate by nature; opt-in
// (ChunkedModelOptions::measure_host_non_model), since on the simulated device it makes the device
// budget cover activations as it does on a GPU.
std::unique_ptr<MemoryProbe> make_heap_probe(std::function<int64_t()> ferry_bytes);

}  // namespace ferry
