#pragma once
// Device: the one object that knows what the chunks' device tier is (a CUDA GPU or the simulated
// device). Everything above asks it: the chunk store for its copy engine (which says whether to pin
// host memory), the model for the device's capacity, the scheduler's memory probe for the bytes allocated on
// it, the process group for its collectives and for binding a rank to its unit. Nothing above chunk/
// switches on DeviceKind (as in ggml-backend, whose scheduler asks one device object for memory and
// never switches on its kind).
//
// make_device() is the one place a DeviceKind is switched on besides Config's parsing and printing of
// it (and resolve_device_kind, which it uses).
//
// Contract: a Device is immutable once made; every method is const and may be called from any thread.
// Making one is cheap: the CUDA device initialises nothing until a method that needs CUDA is called.
// Owners share it (std::shared_ptr<const Device>): the copy engines it makes do not refer to it.
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

#include "../common/config.h"
#include "copy_engine.h"

namespace ferry {

class Device {
 public:
  // The torch device of device-tier payloads as a copy engine made now would use it: cuda:N (the
  // current CUDA device; a rank binds its own first, bind_local_rank) or cpu (the simulated device).
  virtual c10::Device torch_device() const = 0;
  // "cuda" or "simulated" (Config's names of the kinds), for messages.
  virtual const char* name() const = 0;
  virtual ~Device() = default;
  // A copy engine on this device; each ChunkStore makes its own (CopyEngine is not thread-safe). The
  // engine says whether host payloads should be page-locked (CopyEngine::pinned_host: CUDA's do, the
  // simulated device's do not), so that an engine a test injects answers for itself.
  virtual std::unique_ptr<CopyEngine> make_copy_engine() const = 0;
  // Bytes of this device's memory for chunks and non-model memory together when the user gave no
  // capacity (Config::device_capacity_bytes 0); 0: unknown. CUDA: default_gpu_capacity_bytes (the
  // rest for the CUDA context, cuBLAS workspaces and the caching allocator's fragmentation). The
  // simulated device: unknown, unless `counts_host_memory` (the host memory forward and backward
  // allocate counts as its non-model memory, make_heap_probe): then a simulated GPU of `budget_bytes`.
  virtual int64_t default_capacity_bytes(int64_t budget_bytes, bool counts_host_memory) const = 0;
  // Bytes allocated on the device now, chunks and everything else (the memory probe's source,
  // scheduler/memory_probe.h); -1 where the device cannot tell (the simulated device: its memory is
  // the process's heap, where nothing separates it from other host memory).
  virtual int64_t allocated_bytes() const = 0;
  // Waits until the work queued on the device so far has run (CUDA: every stream of the current
  // device; the simulated device runs it on the caller's thread: nothing to wait for). It stalls the
  // host: for measurements (the activation plan's warm-up timings) and where the host must wait for
  // the device anyway (the eager step's end of backward, D89).
  virtual void synchronize() const = 0;
  // Data parallelism (dist/process_group.h): the c10d backend whose collectives read and write this
  // device's memory in place, the default one for it: "nccl" (CUDA) or "gloo" (the simulated device,
  // whose chunks are host memory).
  virtual const char* collective_backend() const = 0;
  // Makes unit `local_rank` of this device this process's own before anything is placed on it (one
  // rank per GPU: the launcher's LOCAL_RANK) and returns the device collectives run on. CUDA: sets the
  // current CUDA device; when there is no such GPU fails naming how many there are, or, `may_share`
  // (Gloo, which does not mind), takes local_rank modulo their number. The simulated device: cpu,
  // shared by every rank.
  virtual c10::Device bind_local_rank(int local_rank, bool may_share) const = 0;
};

// kSimulated -> the simulated device; kCuda -> the CUDA device (fails without a GPU, or in a build
// without CUDA, naming what to use instead); kAuto -> CUDA when a GPU is present, else simulated.
std::shared_ptr<const Device> make_device(DeviceKind kind);
// kAuto resolved as make_device resolves it.
DeviceKind resolve_device_kind(DeviceKind kind);

// Which device an options struct means: a kind, made into a Device by make_device when the options
// are used (a standalone ChunkStore: `options.device = DeviceKind::kSimulated`), or a Device already
// made, shared (a ChunkedModel passes its own to every store it makes).
class DeviceSpec {
 public:
  DeviceSpec(DeviceKind kind = DeviceKind::kAuto) : kind_(kind) {}  // NOLINT: implicit on purpose
  DeviceSpec(std::shared_ptr<const Device> device) : device_(std::move(device)) {}  // NOLINT
  // The given Device, or a new one of the given kind (fails as make_device does).
  std::shared_ptr<const Device> make() const { return device_ ? device_ : make_device(kind_); }

 private:
  DeviceKind kind_ = DeviceKind::kAuto;
  std::shared_ptr<const Device> device_;
};

// The device budget of a model, made once where its Config meets its Device and passed down as is
// (to the parameter store and the scheduler; the optimizer state's store has none of its own: the
// scheduler admits it). Both in bytes; both >= 0 by construction (of()'s Config was validated).
struct DeviceBudget {
  // Chunk bytes on the device, every store sharing the device accountant together (0: no limit).
  int64_t budget_bytes = 0;
  // Device memory for chunks and non-model memory together (0: unknown): the user's
  // Config::device_capacity_bytes, else Device::default_capacity_bytes.
  int64_t capacity_bytes = 0;

  static DeviceBudget of(const Config& config, const Device& device, bool counts_host_memory);
};

// The devices themselves (make_device chooses): tests and benchmarks that want one kind.
std::shared_ptr<const Device> make_simulated_device();
#ifdef FERRY_WITH_CUDA
std::shared_ptr<const Device> make_cuda_device();  // defined in device_cuda.cpp; needs a GPU
#endif

// The default capacity of a GPU of `total_bytes`: all but max(2 GiB, 5%) of it (an 80 GB H100:
// 75.2 of 79.2 GiB). Measured on the H100 (benchmarks/results/gpt-h100-20261127-145500-*): plans made
// for 75 and 77 GiB peaked at 74.3 and 76.4 GiB allocated and ran; the former default, 90% (71.3 GiB),
// left 4b's plan 7.9 GiB it could have kept activations in (0.568 s against 0.552 s at 75 GiB).
int64_t default_gpu_capacity_bytes(int64_t total_bytes);

}  // namespace ferry
