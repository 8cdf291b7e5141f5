#pragma once
// Chunk: one flat buffer of one dtype and one role, with up to two payloads (device, host), the
// tensor slots packed in it, and its state derived from theirs. Mechanism only: budgets, moves and
// eviction are ChunkStore's.
//
// Identity (Note [Chunk identity]). Every chunk owns one resizable device storage for life. Tensors
// bound to the chunk (the model's parameters) are views of that storage, so they keep their
// TensorImpl, dtype and device for life, and autograd keeps their grad accumulators. When the chunk
// leaves the device the storage gives its memory back (its DataPtr swapped for a null one and its size
// set to 0, as FSDP2's untyped_storage().resize_(0)); every view sees that. Once the host payload is
// complete (no copy pending into it), the storage *aliases* it (a non-owning DataPtr to the host buffer,
// still of the chunk's device type), when the device can address host memory: the simulated device
// always, CUDA when the buffer is pinned (on a unified-address system a cudaHostAlloc pointer is valid
// in kernels). So an op outside ferry's hooks (logging a weight, torch::save, an eval forward) reads
// and writes the chunk's true bytes, at host-memory speed, instead of a null pointer. Only while a
// device->host copy is in flight (inside an iteration; ChunkedModel settles them when it goes idle), or
// with pageable buffers on CUDA, is a view unbacked: torch's kernels do not check, so the hooks make
// a chunk resident before any op of theirs uses it. When the chunk comes back, the same storage gets
// fresh memory from the device allocator. The host payload is a separate, exact-size buffer (pinned
// when the device is CUDA) from a HostBufferPool.
//
// Contract: not thread-safe (ChunkStore serializes). Payload views (device_flat(), host_flat(),
// device_view()) must only be read or written while the payload exists and no copy is pending on it.
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "copy_engine.h"
#include "role.h"
#include "state.h"

namespace ferry {

class Chunk {
 public:
  // A chunk with no payload (RELEASED). `allocator` serves its device storage; `device` is where it is.
  Chunk(ChunkId id, ChunkRole role, at::ScalarType dtype, int64_t numel, c10::Allocator* allocator,
        c10::Device device);
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  ChunkId id() const { return id_; }
  ChunkRole role() const { return role_; }
  at::ScalarType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  int64_t nbytes() const { return nbytes_; }

  // Where the payload is, as far as users are concerned; a copy into it may still be pending.
  Location location() const { return location_; }
  void set_location(Location location) { location_ = location; }
  ChunkState state() const { return derive_chunk_state(location_ != Location::kNone, counts_); }

  // Device payload: allocate (contents undefined) or release the storage's memory. An alias of the
  // host buffer is not device memory.
  bool has_device_memory() const;
  const void* device_data() const { return device_storage_.data(); }
  void allocate_device_memory();
  void free_device_memory();
  // Flat (numel,) view of the device storage; valid to touch only while it has memory.
  const at::Tensor& device_flat() const { return device_flat_; }
  // A view of [offset, offset + prod(shape)) of the device storage with `shape`, valid whether or not
  // the storage has memory now (it follows the storage).
  at::Tensor device_view(int64_t offset, at::IntArrayRef shape) const;
  // References to its memory held outside this Chunk: one per tensor bound to its device storage (the
  // parameters), one per view of either payload anyone keeps (a graph's saved `weight.t()`, a user's
  // `weight.detach()`, a host view of optimizer state) and one per handle to a flat payload
  // (payload() hands out the flat tensor itself); a view of a flat payload counts twice (it holds the
  // flat tensor as its base too). So it equals the number of bound tensors exactly when nothing else
  // can reach the memory. Nothing may, when the chunk goes (a repack frees it and hands its host
  // buffer on for reuse).
  int64_t storage_holders() const;

  // Host payload: a uint8 buffer of exactly nbytes(), or undefined.
  bool has_host_buffer() const { return host_bytes_.defined(); }
  void attach_host_buffer(at::Tensor bytes);
  at::Tensor detach_host_buffer();
  const at::Tensor& host_flat() const { return host_flat_; }
  // Points the device storage at the host buffer (no device memory; see Note [Chunk identity]). Needs
  // a host buffer whose contents are complete and no device memory; undone by allocate_device_memory()
  // and detach_host_buffer().
  void alias_host_buffer();
  bool aliases_host_buffer() const { return aliasing_host_; }

  // The copy that fills the current payload, if one may still be running. While a host->device copy
  // is pending, the chunk keeps its host buffer (the copy reads it); the store frees it afterwards.
  std::unique_ptr<CopyTicket>& pending() { return pending_; }
  const CopyTicket* pending() const { return pending_.get(); }

  // Slots: tensor ids packed in this chunk, and how many are in each state.
  std::vector<TensorId>& tensors() { return tensors_; }
  const std::vector<TensorId>& tensors() const { return tensors_; }
  TensorStateCounts& counts() { return counts_; }
  const TensorStateCounts& counts() const { return counts_; }

  // Access tick of the last access of any of its tensors (0: never).
  uint64_t last_use = 0;
  // Host locks held (ChunkStore::lock_on_host): while > 0 the chunk stays on the host.
  int host_locks = 0;

 private:
  void clear_storage();  // null DataPtr, 0 bytes, no alias

  const ChunkId id_;
  const ChunkRole role_;
  const at::ScalarType dtype_;
  const int64_t numel_;
  const int64_t nbytes_;
  c10::Allocator* const allocator_;
  const c10::Device device_;
  Location location_ = Location::kNone;
  c10::Storage device_storage_;
  bool aliasing_host_ = false;
  at::Tensor device_flat_;
  at::Tensor host_bytes_;
  at::Tensor host_flat_;
  std::unique_ptr<CopyTicket> pending_;
  std::vector<TensorId> tensors_;
  TensorStateCounts counts_;
};

}  // namespace ferry
