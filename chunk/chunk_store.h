#pragma once
// ChunkStore: the chunks of one process, their tensor slots, the two memory tiers with their budgets,
// and the moves between them.
//
// How it works
//  - Chunks are created per role (add_chunk, or add_layout for a whole ChunkLayout); tensor slots are
//    added into them (add_tensor). bind() makes an existing tensor (a model parameter) a view of its
//    slot, keeping its TensorImpl (see Note [Chunk identity] in chunk.h).
//  - access(t) is the pre-use hook: it makes t's chunk resident on the device (making room by asking
//    the eviction policy which chunks to move to the host), orders the compute stream after any copy
//    still filling it, and puts t in COMPUTE. release(t, after) is the post-use hook. Nested accesses
//    of one tensor are counted; its state changes on the first access and the last release.
//  - Moves: move() is synchronous for the host (the payload is usable on return); move_async() and
//    prefetch() only start the copy, on the engine's copy stream. A device->host move frees the device
//    memory at once (the CUDA allocator will not reuse it before the copy is done: record_stream); a
//    host->device move keeps the host buffer until the copy is known complete, then frees it.
//  - Budgets: a tier's bytes are the sum of its chunks' payload sizes (device: allocated storages; host:
//    host buffers, including those still read by a pending copy). A budget of 0 means no limit. Making
//    room on the device asks the EvictionPolicy with the legal candidates: resident on the device, not
//    in COMPUTE, no copy pending that compute has not been ordered after (Note [In flight but used]).
//    The host tier has no lower tier: making room there only waits for
//    pending host->device copies, whose host buffers then go. If room cannot be made: OutOfMemoryError.
//
// Invariants (checked; the property test drives random sequences against them)
//  - A tier's bytes never exceed its budget.
//  - A chunk with a tensor in COMPUTE never moves and is never evicted.
//  - A payload is only read or written by ferry after the copy that fills it completed (host) or is
//    ordered before the reader (device compute stream).
//
// Note [In flight but used]
// On CUDA the host runs ahead of the GPU, and it learns that a copy is done only by querying its event.
// A chunk's host->device copy that a use has ordered the compute stream after (access) is, for the
// host, still pending until a later poll sees its event, which can be much later: the copy stream
// waits for the compute enqueued before each copy (CudaCopyEngine), and the host is ahead of that. Such a chunk used to be no eviction
// candidate, so under a tight budget the host waited for those copies before it could make room (a
// sync that drains the queue of launched kernels; the stream-model engine, stream_model_engine.h, counts
// them on the CPU). It is now a candidate like a chunk whose copy is known done: its eviction's device->host copy
// runs after the host->device one on the copy stream and after the compute that used it, and reuses
// the host buffer the first copy read. Only a copy no use has ordered after yet (a prefetch just
// issued; a chunk brought back before its eviction finished) stays out: evicting it would undo work
// the policy has not seen used.
//
// Contract: all public methods take the store's mutex, so the store may be used from autograd's
// threads; the eviction policy is called with it held. Tensors bound with bind() may outlive the store
// (they keep their storage alive), but then no longer move.
#include <ATen/core/Tensor.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../common/config.h"
#include "chunk.h"
#include "copy_engine.h"
#include "device.h"
#include "device_accountant.h"
#include "eviction_policy.h"
#include "host_buffer.h"
#include "layout.h"
#include "out_of_memory.h"

namespace ferry {

// A ChunkStore's lock, and which threads are inside an operation of a store: its copies and fills run
// ops on the chunks' tensors with it held, which an interceptor of ops (hooks/interceptor.h) may see
// and call back into the store for (ready_for_caller); those calls must not take the lock again.
// Every op the store runs on a chunk runs under this lock: the copy engines are called only from
// inside store operations, and the stream-model engine's queue (which runs on whichever thread waits
// for it, under the queue's own mutex) copies with memcpy, not an op, so nothing is dispatched, and
// nothing re-enters the store, while that mutex is held.
class StoreLock {
 public:
  explicit StoreLock(std::mutex& m) : lock_(m) { ++depth(); }
  ~StoreLock() { --depth(); }
  StoreLock(const StoreLock&) = delete;
  StoreLock& operator=(const StoreLock&) = delete;
  static bool held_here() { return depth() > 0; }

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  std::lock_guard<std::mutex> lock_;
};

struct ChunkStoreOptions {
  // The device tier's device: a kind (made into a Device when the store is built) or a Device object
  // (chunk/device.h), shared with other stores.
  DeviceSpec device;
  int64_t device_budget_bytes = 0;             // 0 = no limit
  int64_t host_budget_bytes = 0;               // 0 = no limit
  int64_t host_cache_bytes = int64_t{256} << 20;  // freed host buffers kept for reuse, at most
  bool pin_host_memory = true;                 // page-lock host payloads when the device is CUDA
  std::shared_ptr<EvictionPolicy> policy;      // null: LRU
  // Charged with this store's device bytes, shared with other stores (null: the store makes its own).
  std::shared_ptr<DeviceAccountant> accountant;
  std::string name = "chunks";                 // in trace counters ("<name> device bytes")

  // device (its kind) and budgets from ferry's Config.
  static ChunkStoreOptions from(const Config& config);
  // Checked once, by the ChunkStore's constructor: a standalone store is a public entry point.
  void validate() const;
};

// Sums of bytes, not counts, unless the name says count.
struct TierStats {
  int64_t budget_bytes = 0;   // 0 = no limit
  int64_t current_bytes = 0;  // payload bytes in the tier now
  int64_t peak_bytes = 0;     // max of current_bytes since construction or reset_peak_stats()
};

struct MoveStats {
  int64_t h2d_count = 0;      // host->device moves started
  int64_t h2d_bytes = 0;
  // ... of them, moved by prefetch() ahead of a use; the rest were moved for a use that needed them then
  // (on a GPU: a copy the use waits for, unless it was ready in time).
  int64_t prefetch_h2d_bytes = 0;
  int64_t d2h_count = 0;      // device->host moves started
  int64_t d2h_bytes = 0;
  int64_t evictions = 0;      // device->host moves chosen by the eviction policy (count)
  int64_t wait_count = 0;     // times the host blocked on a pending copy
  int64_t wait_ns = 0;        // total host time blocked on pending copies
  // Host synchronizations of the calling (training) thread: the points where it needed a copy
  // complete before going on, whatever the engine (a synchronous move to the host counts even where the
  // simulated engine had finished it): what costs a host stall on CUDA. Waits by the optimizer's
  // worker thread (wait(id, WaitFrom::kBackground)) are counted apart: they stall no training thread.
  int64_t sync_count = 0;
  int64_t background_sync_count = 0;
};

// Who waits for a copy (ChunkStore::wait): the training thread, or a background worker.
enum class WaitFrom { kCaller, kBackground };

struct ChunkStoreStats {
  TierStats device;
  TierStats host;
  MoveStats moves;
  HostBufferStats host_buffers;
  // Bytes of the chunks with a tensor in COMPUTE now, and the peak since reset_peak_stats(): the largest
  // set of chunks one op (with its nested uses) needed at once, i.e. the smallest device budget for it.
  int64_t compute_bytes = 0;
  int64_t compute_peak_bytes = 0;
  // The tiers' current bytes split by chunk role (index: ChunkRole), so every byte per parameter has a
  // name: compute copy, fp32 master, exp_avg, exp_avg_sq, gradient accumulation.
  std::array<int64_t, kNumChunkRoles> device_bytes_by_role{};
  std::array<int64_t, kNumChunkRoles> host_bytes_by_role{};
};

struct ChunkInfo {
  ChunkId id = -1;
  ChunkRole role = ChunkRole::kParam;
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;
  int64_t nbytes = 0;
  Location location = Location::kNone;
  ChunkState state = ChunkState::kReleased;
  bool copy_pending = false;
  const void* device_data = nullptr;  // the device memory it has now (null: none); for tests, reports
  std::vector<TensorId> tensors;
};

struct TensorInfo {
  TensorId id = -1;
  ChunkId chunk = -1;
  int64_t offset = 0;  // elements
  int64_t numel = 0;
  std::vector<int64_t> shape;
  TensorState state = TensorState::kFree;
  int compute_uses = 0;  // nested accesses not yet released
};

class ChunkStore {
 public:
  // `engine` null: the device's own (Device::make_copy_engine).
  explicit ChunkStore(ChunkStoreOptions options, std::unique_ptr<CopyEngine> engine = nullptr);
  // Waits for every pending copy.
  ~ChunkStore();
  ChunkStore(const ChunkStore&) = delete;
  ChunkStore& operator=(const ChunkStore&) = delete;

  // ---- building
  // A chunk of `numel` elements. `initial` kNone: RELEASED; kDevice/kHost: a zero-filled payload there
  // (room is made as for a move).
  ChunkId add_chunk(ChunkRole role, at::ScalarType dtype, int64_t numel, Location initial);
  // A slot of prod(shape) elements at `offset` (elements) of `chunk`; it must lie inside the chunk and
  // not overlap another slot. State HOLD if the chunk has a payload, else FREE.
  TensorId add_tensor(ChunkId chunk, int64_t offset, at::IntArrayRef shape);
  struct RoleChunks {
    std::vector<ChunkId> chunks;    // layout chunk i -> chunks[i]
    std::vector<TensorId> tensors;  // layout tensor j -> tensors[j]
  };
  // One chunk per layout chunk and one slot per tensor (shapes[j] has layout.slots()[j].numel
  // elements), in role `role`.
  RoleChunks add_layout(ChunkRole role, at::ScalarType dtype, const ChunkLayout& layout,
                        const std::vector<std::vector<int64_t>>& shapes, Location initial);
  // Copies `tensor`'s values into its slot (converting to the chunk's dtype), then makes `tensor` a
  // view of the slot in the chunk's device storage (Tensor::set_data: same TensorImpl, autograd
  // metadata kept). Its shape must match the slot's; the chunk must have a payload. Call before the
  // tensor is used in any autograd graph: if its dtype or device change here, autograd resets its
  // grad accumulator.
  void bind(TensorId id, at::Tensor& tensor);
  // The same with the slot's values taken from `values` (same shape, any dtype/device), for tensors
  // whose own memory is not readable now (rebinding into a new store).
  void bind(TensorId id, at::Tensor& tensor, const at::Tensor& values);

  // ---- use
  // Pre-use hook (see the file comment). Returns the tensor's device view.
  at::Tensor access(TensorId id);
  // Post-use hook: the last release moves the tensor COMPUTE -> `after`.
  void release(TensorId id, TensorState after);
  // Any legal transition that neither enters nor leaves COMPUTE (those are access/release).
  void set_state(TensorId id, TensorState to);

  // ---- moves
  // Moves the chunk's payload to `to` (kDevice or kHost) and waits until it is usable there: on the
  // host, the copy has completed; on the device, the caller's stream is ordered after it.
  void move(ChunkId id, Location to);
  // Starts the move; returns at once. Fails like move() if room cannot be made.
  void move_async(ChunkId id, Location to);
  // Starts a move to the device if room can be made; returns whether it started (or the chunk is
  // already there). Never throws OutOfMemoryError.
  bool prefetch(ChunkId id);
  // Blocks until the copy filling the chunk's payload, if any, has completed. `from` only says which
  // counter (MoveStats::sync_count or background_sync_count) a blocking wait goes to.
  void wait(ChunkId id, WaitFrom from = WaitFrom::kCaller);
  // Host lock: keeps a chunk on the host while another thread reads and writes its host payload (the
  // optimizer's host Adam during backward). While locked (counted; lock and unlock in pairs): a move to
  // the device fails (access(), move(), move_async() throw, naming the chunk; prefetch() returns
  // false), and its payload cannot be released. The chunk must be on the host (a copy into it may still
  // be pending: the locker waits for it).
  void lock_on_host(ChunkId id);
  void unlock_on_host(ChunkId id);
  // For a job on the chunk's host payload started later than the compute that wrote the chunk (a round
  // trip, Note [Round trips through K buffers] in optim/round_trips.h): moves the chunk to the host if
  // it is on the device, the copy ordered after `after` (a recorded mark of this store's engine,
  // CopyEngine::copy_after; null: after the caller's current stream), and locks it there in the same
  // step, so that no other thread moves it back between the two. Fails as move_async() and
  // lock_on_host() fail (a chunk in COMPUTE or without payload, no room on the host).
  void bring_to_host_and_lock(ChunkId id, const StreamMark* after);
  // Starts the chunk's move to the host, ordered as above, where it may go now: on the device, not in
  // COMPUTE, room on the host. Returns whether it is on the host now (or on its way). Never throws
  // OutOfMemoryError.
  bool send_to_host(ChunkId id, const StreamMark* after);
  bool locked_on_host(ChunkId id) const;
  // Blocks until every pending copy has completed.
  void synchronize();
  // Blocks until the pending copies into host payloads (evictions) have completed, so that every
  // chunk off the device is readable through its tensors (Note [Chunk identity]). ChunkedModel calls
  // it when an iteration ends.
  void settle();
  // Frees the payload; every tensor of the chunk must be FREE. The chunk becomes RELEASED.
  void release_payload(ChunkId id);
  // For a chunk whose tensors have moved to another store (a repack): sets its tensors FREE (none
  // may be in COMPUTE) and frees its payload.
  void retire(ChunkId id);
  // Gives a RELEASED chunk a payload at `at` (kDevice or kHost): zero-filled, or a copy of `bytes` (a
  // uint8 tensor of exactly the chunk's bytes, on any device, written in the same pass: no zero-fill
  // first). Its tensors stay FREE.
  void allocate_payload(ChunkId id, Location at, const at::Tensor& bytes = {});
  // The same on the device if room can be made there as a prefetch makes it (evicting by policy, never
  // throwing OutOfMemoryError); returns false, the chunk still RELEASED, if not.
  bool try_allocate_payload_on_device(ChunkId id, const at::Tensor& bytes = {});

  // Released host buffers kept for reuse, at most (ChunkStoreOptions::host_cache_bytes); trims now if
  // lower. HybridAdam raises it to the parameter chunks that travel to the host every step, so that
  // their pinned buffers are reused instead of allocated and freed (cudaFreeHost synchronizes).
  void set_host_cache_bytes(int64_t bytes) { host_pool_.set_max_cached_bytes(bytes); }
  int64_t host_cache_bytes() const { return host_pool_.max_cached_bytes(); }
  // Moves the released host buffers this store keeps into `to`'s cache (kept there up to its limit),
  // where both pin alike; returns the bytes moved. A repack's old store hands its freed chunks to the
  // new one, whose chunks then reuse that memory instead of faulting in fresh pages (fill_layout).
  int64_t give_cached_host_buffers(ChunkStore& to) { return host_pool_.give_cached_to(to.host_pool_); }

  // Changes the device budget (0: no limit), evicting by policy down to it; on OutOfMemoryError the
  // old budget stays. The scheduler uses it for the per-moment budget.
  void set_device_budget(int64_t bytes);

  // ---- views
  // The tensor's slot in the chunk's current payload (device or host), with its shape. Waits for a
  // pending copy into the host; orders the caller's stream after one into the device.
  at::Tensor view(TensorId id);
  // The same for ops that reach the payload through the chunk's own tensors (a user's op on a parameter
  // between iterations): the payload they alias usable by the caller's stream. Nothing for a chunk with
  // no payload, and nothing when this thread is inside an operation of a store already (its own copies
  // and fills, which an interceptor may see as ops on the chunk: the store orders those itself).
  void ready_for_caller(ChunkId id);
  // The chunk's whole current payload, flat, under the same rules.
  at::Tensor payload(ChunkId id);

  // ---- queries
  // The accountant this store charges, and the device bytes charged to it by the other stores that
  // share it (optimizer state beside parameter chunks).
  const DeviceAccountant& device_accountant() const { return *accountant_; }
  int64_t device_bytes_elsewhere() const;
  int64_t num_chunks() const;
  int64_t num_tensors() const;
  // Where the chunk's payload is (cheap; chunk_info copies the tensor list).
  Location location(ChunkId id) const;
  ChunkInfo chunk_info(ChunkId id) const;
  // Chunk::storage_holders(): the tensors bound to the chunk and the views of its memory anyone keeps
  // (a view of a flat payload counts twice). Waits for a copy still filling the chunk first (its
  // ticket holds the buffers).
  int64_t storage_holders(ChunkId id);
  TensorInfo tensor_info(TensorId id) const;
  uint64_t access_tick() const;  // number of access() calls so far
  ChunkStoreStats stats() const;
  void reset_peak_stats();
  const char* engine_name() const;
  c10::Device device() const;
  // A mark on the engine's device clock (CopyEngine::make_mark).
  std::unique_ptr<StreamMark> make_mark() const;
  // Writes the copies issued while this event-trace recording was on into it, as the copy stream ran
  // them (CopyTicket::started/finished, placed on the host's clock by `anchor`): track "copy stream",
  // category "link", one span per copy, args bytes and role. Copies still in flight are waited for.
  // Engines that cannot time copies leave their in-flight intervals instead (category "copy"), written
  // as each completes. Call once the recording's copies were issued, before trace::stop().
  void trace_copies(const ClockAnchor& anchor);
  const char* policy_name() const;
  // Whether host payloads are page-locked: requested by ChunkStoreOptions::pin_host_memory, and done
  // only where the engine's device is CUDA (the simulated device pins nothing).
  bool pin_requested() const { return options_.pin_host_memory; }
  bool pins_host_memory() const { return host_pool_.pinned(); }

 private:
  struct Slot {
    ChunkId chunk = -1;
    int64_t offset = 0;
    int64_t numel = 0;
    std::vector<int64_t> shape;
    TensorState state = TensorState::kFree;
    int compute_uses = 0;
  };
  // All below: the mutex is held.
  Chunk& chunk_at(ChunkId id);
  const Chunk& chunk_at(ChunkId id) const;
  Slot& slot_at(TensorId id);
  const Slot& slot_at(TensorId id) const;
  TierStats& tier(Tier t);
  void charge(Tier t, const Chunk& chunk);  // its payload's bytes, in the tier and its role's share
  void discharge(Tier t, const Chunk& chunk);
  // Makes room for `bytes` in `t`. Returns false (or throws OutOfMemoryError when `must`) if it can't.
  // A device tier short of room waits for in-flight copies of device chunks before giving up (only
  // when `must`): those chunks are no eviction candidates until their copy is done.
  bool make_room(Tier t, int64_t bytes, ChunkId incoming, bool must);
  // One eviction round on the device tier: asks the policy for victims among the candidates and moves
  // them to the host; moves nothing if the candidates (or the policy's answer) cannot make the room.
  void evict_for_locked(int64_t bytes, ChunkId incoming, bool must);
  // Whether a chunk with device memory may leave the device now (not in COMPUTE; no copy in flight
  // that compute has not been ordered after).
  static bool evictable(const Chunk& chunk);
  TierShortfall shortfall(Tier t, int64_t bytes, ChunkId incoming) const;
  // Starts a move; returns false only when !must and room could not be made.
  // `after`: the copy waits for the work before this mark instead of the caller's current stream.
  bool start_move(Chunk& chunk, Location to, bool must, const StreamMark* after = nullptr);
  // Completes (or, !block, polls) its pending copy; a blocking wait counts as a sync of `from`.
  enum class Count { kCaller, kBackground, kNone };
  void finish_pending(Chunk& chunk, bool block, Count count = Count::kCaller);
  void reap_completed();
  // Trace bookkeeping of a copy that completed (or, from trace_copies, one still in flight): a timed
  // one is kept for trace_copies, an untimed one's in-flight interval is written now. Once per copy.
  void keep_for_trace(const Chunk& chunk, CopyTicket& ticket);
  std::string copy_args(const Chunk& chunk) const;  // a copy's trace args: bytes and role
  // A chunk on the host with a complete payload: its device storage aliases the host buffer.
  void alias_if_possible(Chunk& chunk);
  void ready_for_use(Chunk& chunk);  // host: wait; device: order the caller's stream
  // Or with `bytes`. must = false: returns false, the chunk still without payload, if no room can be made.
  bool fill_zero(Chunk& chunk, Location at, const at::Tensor& bytes = {}, bool must = true);
  void check_new_payload(const Chunk& chunk, const at::Tensor& bytes) const;  // allocate_payload's input
  // Make room, allocate, charge the tier; false (or OutOfMemoryError when `must`) without room.
  bool give_device_memory(Chunk& chunk, bool must);
  bool give_host_buffer(Chunk& chunk, bool must);
  std::string describe(const Chunk& chunk) const;
  std::string describe_incoming(ChunkId incoming) const;

  mutable std::mutex mutex_;
  ChunkStoreOptions options_;
  bool device_reads_host_ = false;  // the device can address host payloads (simulated; CUDA pinned)
  int64_t compute_bytes_ = 0, compute_peak_bytes_ = 0;  // see ChunkStoreStats
  std::unique_ptr<CopyEngine> engine_;
  std::shared_ptr<EvictionPolicy> policy_;
  std::shared_ptr<DeviceAccountant> accountant_;
  HostBufferPool host_pool_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::vector<Slot> slots_;
  std::vector<ChunkId> pending_;  // chunks whose copy may still be running
  // Completed copies timed on the device's clock, kept for trace_copies (only while tracing, at most
  // kMaxTimedCopies: beyond it copies go untimed).
  struct TimedCopy {
    std::string name, args;
    int64_t recording = 0;  // trace::recording() when issued
    std::unique_ptr<StreamMark> started, finished;
  };
  static constexpr size_t kMaxTimedCopies = size_t{1} << 16;
  std::vector<TimedCopy> timed_copies_;
  uint64_t tick_ = 0;
  TierStats device_;
  TierStats host_;
  std::array<int64_t, kNumChunkRoles> device_by_role_{}, host_by_role_{};  // see ChunkStoreStats
  MoveStats moves_;
};

}  // namespace ferry
