// ChunkStore (see chunk_store.h for the contract).
//
// The algorithm in short:
//  1. Every public method takes the mutex, then reaps copies that completed (their host buffers go).
//  2. A move first makes room in the destination tier (make_room), then allocates there, then starts
//     the copy on the engine; the source payload is freed at once for device->host (the allocator
//     defers reuse, record_stream) and when the copy is known complete for host->device.
//  3. Copies of one engine complete in the order they were started (one copy stream), so a move that
//     reverses a pending one needs no host wait: its copy runs after the pending one on the stream, and
//     its ticket replaces the old ticket.
//  4. make_room(device) asks the policy; make_room(host) can only wait for pending host->device copies.
// This file: the options, building, use, the public moves, views and queries. chunk_store_moves.cpp: the
// tiers' accounting, making room (2, 4) and the copies themselves (2, 3).
#include "chunk_store.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "../common/event_trace.h"
#include "../common/logging.h"

namespace ferry {

ChunkStoreOptions ChunkStoreOptions::from(const Config& config) {
  ChunkStoreOptions options;
  options.device = config.device;
  options.device_budget_bytes = config.device_budget_bytes;
  options.host_budget_bytes = config.host_budget_bytes;
  return options;
}

void ChunkStoreOptions::validate() const {
  TORCH_CHECK(device_budget_bytes >= 0, "ferry: device budget must be >= 0 bytes (0 = no limit), got ",
              device_budget_bytes);
  TORCH_CHECK(host_budget_bytes >= 0, "ferry: host budget must be >= 0 bytes (0 = no limit), got ",
              host_budget_bytes);
  TORCH_CHECK(host_cache_bytes >= 0, "ferry: host cache must be >= 0 bytes, got ", host_cache_bytes);
}

namespace {

ChunkStoreOptions validated(ChunkStoreOptions options) {
  options.validate();
  return options;
}

}  // namespace

ChunkStore::ChunkStore(ChunkStoreOptions options, std::unique_ptr<CopyEngine> engine)
    : options_(validated(std::move(options))),
      engine_(engine ? std::move(engine) : options_.device.make()->make_copy_engine()),
      policy_(options_.policy ? options_.policy : std::make_shared<LruEvictionPolicy>()),
      accountant_(options_.accountant ? options_.accountant : std::make_shared<DeviceAccountant>()),
      host_pool_(engine_->pinned_host() && options_.pin_host_memory, options_.host_cache_bytes) {
  device_.budget_bytes = options_.device_budget_bytes;
  host_.budget_bytes = options_.host_budget_bytes;
  // CPU "device" memory is host memory; CUDA kernels address pinned host memory (unified addressing).
  device_reads_host_ = engine_->device().is_cpu() || (engine_->pinned_host() && options_.pin_host_memory);
  log::debug("chunk store: engine ", engine_->name(), " on ", engine_->device().str(), ", device budget ",
             device_.budget_bytes ? format_bytes(device_.budget_bytes) : "unlimited", ", host budget ",
             host_.budget_bytes ? format_bytes(host_.budget_bytes) : "unlimited", ", policy ",
             policy_->name());
}

ChunkStore::~ChunkStore() {
  try {
    synchronize();
  } catch (const std::exception& e) {
    log::error("chunk store: waiting for pending copies failed: ", e.what());
  }
  // A shared accountant outlives this store: the device bytes it charged leave with it.
  for (int role = 0; role < kNumChunkRoles; ++role) {
    if (device_by_role_[role] > 0) accountant_->discharge(static_cast<ChunkRole>(role), device_by_role_[role]);
  }
}

// ---------------------------------------------------------------------------------------------------
// Building

ChunkId ChunkStore::add_chunk(ChunkRole role, at::ScalarType dtype, int64_t numel, Location initial) {
  const StoreLock lock(mutex_);
  reap_completed();
  const ChunkId id = static_cast<ChunkId>(chunks_.size());
  auto chunk = std::make_unique<Chunk>(id, role, dtype, numel, engine_->device_allocator(),
                                       engine_->device());
  chunks_.push_back(std::move(chunk));
  if (initial != Location::kNone) {
    try {
      fill_zero(*chunks_.back(), initial);
    } catch (...) {
      chunks_.pop_back();  // nothing refers to it yet
      throw;
    }
  }
  return id;
}

TensorId ChunkStore::add_tensor(ChunkId chunk_id, int64_t offset, at::IntArrayRef shape) {
  const StoreLock lock(mutex_);
  Chunk& chunk = chunk_at(chunk_id);
  int64_t numel = 1;
  for (int64_t d : shape) {
    TORCH_CHECK(d >= 0, "ferry: tensor shape ", shape, " has a negative dimension");
    numel *= d;
  }
  TORCH_CHECK(offset >= 0 && offset + numel <= chunk.numel(), "ferry: slot [", offset, ", ", offset + numel,
              ") does not fit in ", describe(chunk), " of ", chunk.numel(), " elements");
  if (numel > 0) {
    for (TensorId other : chunk.tensors()) {
      const Slot& o = slots_[other];
      const bool overlap = o.numel > 0 && offset < o.offset + o.numel && o.offset < offset + numel;
      TORCH_CHECK(!overlap, "ferry: slot [", offset, ", ", offset + numel, ") overlaps tensor ", other,
                  " at [", o.offset, ", ", o.offset + o.numel, ") in ", describe(chunk));
    }
  }
  Slot slot;
  slot.chunk = chunk_id;
  slot.offset = offset;
  slot.numel = numel;
  slot.shape = shape.vec();
  slot.state = chunk.location() == Location::kNone ? TensorState::kFree : TensorState::kHold;
  const TensorId id = static_cast<TensorId>(slots_.size());
  slots_.push_back(std::move(slot));
  chunk.tensors().push_back(id);
  chunk.counts().add(slots_.back().state);
  return id;
}

ChunkStore::RoleChunks ChunkStore::add_layout(ChunkRole role, at::ScalarType dtype, const ChunkLayout& layout,
                                              const std::vector<std::vector<int64_t>>& shapes,
                                              Location initial) {
  check_role_dtype(role, dtype);
  TORCH_CHECK(shapes.size() == layout.slots().size(), "ferry: add_layout needs one shape per packed tensor: "
              "expected ", layout.slots().size(), ", got ", shapes.size());
  for (size_t j = 0; j < shapes.size(); ++j) {
    int64_t numel = 1;
    for (int64_t d : shapes[j]) numel *= d;
    TORCH_CHECK(numel == layout.slots()[j].numel, "ferry: tensor ", j, " has shape ", at::IntArrayRef(shapes[j]),
                " (", numel, " elements) but its slot holds ", layout.slots()[j].numel);
  }
  RoleChunks out;
  for (const ChunkExtent& extent : layout.chunks()) {
    out.chunks.push_back(add_chunk(role, dtype, extent.numel, initial));
  }
  out.tensors.resize(shapes.size());
  for (const ChunkExtent& extent : layout.chunks()) {
    for (int64_t j : extent.tensors) {
      const ferry::Slot& slot_layout = layout.slots()[j];
      out.tensors[j] = add_tensor(out.chunks[slot_layout.chunk], slot_layout.offset, shapes[j]);
    }
  }
  return out;
}

void ChunkStore::bind(TensorId id, at::Tensor& tensor) { bind(id, tensor, tensor.detach()); }

void ChunkStore::bind(TensorId id, at::Tensor& tensor, const at::Tensor& values) {
  const StoreLock lock(mutex_);
  reap_completed();
  Slot& slot = slot_at(id);
  Chunk& chunk = chunk_at(slot.chunk);
  TORCH_CHECK(tensor.defined(), "ferry: bind needs a defined tensor");
  TORCH_CHECK(tensor.layout() == at::kStrided, "ferry: bind needs a dense (strided) tensor, got ", tensor.layout());
  TORCH_CHECK(tensor.sizes() == at::IntArrayRef(slot.shape), "ferry: tensor ", id, " has slot shape ",
              at::IntArrayRef(slot.shape), ", got a tensor of shape ", tensor.sizes());
  TORCH_CHECK(chunk.location() != Location::kNone, "ferry: ", describe(chunk),
              " has no payload (RELEASED); allocate_payload before bind");
  TORCH_CHECK(slot.state != TensorState::kCompute, "ferry: tensor ", id, " is in COMPUTE and cannot be bound");
  TORCH_CHECK(values.sizes() == tensor.sizes(), "ferry: bind values have shape ", values.sizes(),
              ", the tensor has ", tensor.sizes());
  ready_for_use(chunk);
  at::Tensor target = chunk.location() == Location::kDevice
                          ? chunk.device_view(slot.offset, slot.shape)
                          : chunk.host_flat().narrow(0, slot.offset, slot.numel).view(slot.shape);
  target.copy_(values);
  tensor.set_data(chunk.device_view(slot.offset, slot.shape));
}

// ---------------------------------------------------------------------------------------------------
// Use

at::Tensor ChunkStore::access(TensorId id) {
  const StoreLock lock(mutex_);
  reap_completed();
  Slot& slot = slot_at(id);
  Chunk& chunk = chunk_at(slot.chunk);
  TORCH_CHECK(chunk.location() != Location::kNone, "ferry: tensor ", id, " is in ", describe(chunk),
              ", which has no payload (RELEASED)");
  if (slot.compute_uses == 0) check_transition(slot.state, TensorState::kCompute, "tensor");
  if (chunk.location() != Location::kDevice) {
    start_move(chunk, Location::kDevice, /*must=*/true);
  }
  ready_for_use(chunk);
  if (slot.compute_uses == 0) {
    const bool chunk_was_in_compute = chunk.state() == ChunkState::kCompute;
    chunk.counts().move(slot.state, TensorState::kCompute);
    slot.state = TensorState::kCompute;
    if (!chunk_was_in_compute) {
      compute_bytes_ += chunk.nbytes();
      compute_peak_bytes_ = std::max(compute_peak_bytes_, compute_bytes_);
    }
  }
  ++slot.compute_uses;
  chunk.last_use = ++tick_;
  return chunk.device_view(slot.offset, slot.shape);
}

void ChunkStore::release(TensorId id, TensorState after) {
  const StoreLock lock(mutex_);
  Slot& slot = slot_at(id);
  TORCH_CHECK(slot.compute_uses > 0, "ferry: release of tensor ", id, " without a matching access (state ",
              to_string(slot.state), ")");
  if (slot.compute_uses == 1) {
    check_transition(TensorState::kCompute, after, "tensor");
    Chunk& chunk = chunk_at(slot.chunk);
    chunk.counts().move(TensorState::kCompute, after);
    slot.state = after;
    if (chunk.state() != ChunkState::kCompute) compute_bytes_ -= chunk.nbytes();
  }
  --slot.compute_uses;
}

void ChunkStore::set_state(TensorId id, TensorState to) {
  const StoreLock lock(mutex_);
  Slot& slot = slot_at(id);
  TORCH_CHECK(to != TensorState::kCompute && slot.state != TensorState::kCompute,
              "ferry: set_state does not enter or leave COMPUTE (use access/release): tensor ", id, " ",
              to_string(slot.state), " -> ", to_string(to));
  check_transition(slot.state, to, "tensor");
  Chunk& chunk = chunk_at(slot.chunk);
  TORCH_CHECK(to == TensorState::kFree || chunk.location() != Location::kNone, "ferry: tensor ", id,
              " cannot hold data: ", describe(chunk), " has no payload (RELEASED)");
  chunk.counts().move(slot.state, to);
  slot.state = to;
}

// ---------------------------------------------------------------------------------------------------
// Moves

void ChunkStore::move(ChunkId id, Location to) {
  const StoreLock lock(mutex_);
  reap_completed();
  Chunk& chunk = chunk_at(id);
  const bool moves = chunk.location() != to;
  start_move(chunk, to, /*must=*/true);
  if (to == Location::kHost && moves) {
    // Synchronous by contract: a host stall on CUDA even where the simulated engine is done already.
    ++moves_.sync_count;
    finish_pending(chunk, /*block=*/true, Count::kNone);
  } else {
    ready_for_use(chunk);
  }
}

void ChunkStore::move_async(ChunkId id, Location to) {
  const StoreLock lock(mutex_);
  reap_completed();
  start_move(chunk_at(id), to, /*must=*/true);
}

bool ChunkStore::prefetch(ChunkId id) {
  const StoreLock lock(mutex_);
  reap_completed();
  Chunk& chunk = chunk_at(id);
  if (chunk.location() == Location::kDevice) return true;
  if (chunk.location() == Location::kNone) return false;
  const int64_t h2d_before = moves_.h2d_bytes;
  const bool started = start_move(chunk, Location::kDevice, /*must=*/false);
  moves_.prefetch_h2d_bytes += moves_.h2d_bytes - h2d_before;
  return started;
}

void ChunkStore::wait(ChunkId id, WaitFrom from) {
  const StoreLock lock(mutex_);
  finish_pending(chunk_at(id), /*block=*/true, from == WaitFrom::kBackground ? Count::kBackground : Count::kCaller);
}

void ChunkStore::synchronize() {
  const StoreLock lock(mutex_);
  // Newest first: copies complete in issue order (one copy stream), so one wait usually covers the rest.
  const std::vector<ChunkId> pending(pending_.rbegin(), pending_.rend());
  for (ChunkId id : pending) finish_pending(*chunks_[id], /*block=*/true);
}

void ChunkStore::lock_on_host(ChunkId id) {
  const StoreLock lock(mutex_);
  Chunk& chunk = chunk_at(id);
  TORCH_CHECK(chunk.location() == Location::kHost, "ferry: lock_on_host: ", describe(chunk),
              " must be on the host, it is on ", to_string(chunk.location()));
  ++chunk.host_locks;
}

void ChunkStore::unlock_on_host(ChunkId id) {
  const StoreLock lock(mutex_);
  Chunk& chunk = chunk_at(id);
  TORCH_CHECK(chunk.host_locks > 0, "ferry: unlock_on_host: ", describe(chunk), " is not locked");
  --chunk.host_locks;
}

void ChunkStore::bring_to_host_and_lock(ChunkId id, const StreamMark* after) {
  const StoreLock lock(mutex_);
  reap_completed();
  Chunk& chunk = chunk_at(id);
  if (chunk.location() == Location::kDevice) start_move(chunk, Location::kHost, /*must=*/true, after);
  TORCH_CHECK(chunk.location() == Location::kHost, "ferry: bring_to_host_and_lock: ", describe(chunk),
              " must be on the device or the host, it is on ", to_string(chunk.location()));
  ++chunk.host_locks;
}

bool ChunkStore::send_to_host(ChunkId id, const StreamMark* after) {
  const StoreLock lock(mutex_);
  reap_completed();
  Chunk& chunk = chunk_at(id);
  if (chunk.location() == Location::kHost) return true;
  if (chunk.location() != Location::kDevice || chunk.state() == ChunkState::kCompute) return false;
  return start_move(chunk, Location::kHost, /*must=*/false, after);
}

bool ChunkStore::locked_on_host(ChunkId id) const {
  const StoreLock lock(mutex_);
  return chunk_at(id).host_locks > 0;
}

void ChunkStore::release_payload(ChunkId id) {
  const StoreLock lock(mutex_);
  Chunk& chunk = chunk_at(id);
  TORCH_CHECK(chunk.state() == ChunkState::kFree, "ferry: ", describe(chunk),
              " can release its payload only when all its tensors are FREE; it is ", to_string(chunk.state()));
  TORCH_CHECK(chunk.host_locks == 0, "ferry: ", describe(chunk), " is locked on the host; its payload cannot be released");
  finish_pending(chunk, /*block=*/true);
  if (chunk.has_device_memory()) {
    chunk.free_device_memory();
    discharge(Tier::kDevice, chunk);
  }
  if (chunk.has_host_buffer()) {
    at::Tensor buffer = chunk.detach_host_buffer();
    host_pool_.release(buffer);
    discharge(Tier::kHost, chunk);
  }
  chunk.set_location(Location::kNone);
}

void ChunkStore::retire(ChunkId id) {
  {
    const StoreLock lock(mutex_);
    Chunk& chunk = chunk_at(id);
    for (TensorId t : chunk.tensors()) {  // check all before changing any
      TORCH_CHECK(slot_at(t).state != TensorState::kCompute, "ferry: cannot retire ", describe(chunk), ": tensor ",
                  t, " is in COMPUTE");
    }
    for (TensorId t : chunk.tensors()) {
      Slot& slot = slot_at(t);
      if (slot.state == TensorState::kFree) continue;
      check_transition(slot.state, TensorState::kFree, "tensor");
      chunk.counts().move(slot.state, TensorState::kFree);
      slot.state = TensorState::kFree;
    }
  }
  release_payload(id);
}

void ChunkStore::allocate_payload(ChunkId id, Location at, const at::Tensor& bytes) {
  const StoreLock lock(mutex_);
  reap_completed();
  check_new_payload(chunk_at(id), bytes);
  fill_zero(chunk_at(id), at, bytes);
}

bool ChunkStore::try_allocate_payload_on_device(ChunkId id, const at::Tensor& bytes) {
  const StoreLock lock(mutex_);
  reap_completed();
  check_new_payload(chunk_at(id), bytes);
  return fill_zero(chunk_at(id), Location::kDevice, bytes, /*must=*/false);
}

void ChunkStore::check_new_payload(const Chunk& chunk, const at::Tensor& bytes) const {
  TORCH_CHECK(chunk.location() == Location::kNone, "ferry: ", describe(chunk), " already has a payload on the ",
              to_string(chunk.location()));
  TORCH_CHECK(!bytes.defined() || (bytes.scalar_type() == at::kByte && bytes.numel() == chunk.nbytes()),
              "ferry: a new payload of ", describe(chunk), " needs ", chunk.nbytes(), " uint8 values, got ",
              bytes.defined() ? bytes.toString() : "none");
}

// ---------------------------------------------------------------------------------------------------
// Views and queries

at::Tensor ChunkStore::view(TensorId id) {
  const StoreLock lock(mutex_);
  reap_completed();
  const Slot& slot = slot_at(id);
  Chunk& chunk = chunk_at(slot.chunk);
  TORCH_CHECK(chunk.location() != Location::kNone, "ferry: tensor ", id, " is in ", describe(chunk),
              ", which has no payload (RELEASED)");
  ready_for_use(chunk);
  if (chunk.location() == Location::kDevice) return chunk.device_view(slot.offset, slot.shape);
  return chunk.host_flat().narrow(0, slot.offset, slot.numel).view(slot.shape);
}

void ChunkStore::ready_for_caller(ChunkId id) {
  if (StoreLock::held_here()) return;  // re-entered from the store's own copy or fill: its business
  const StoreLock lock(mutex_);
  reap_completed();
  ready_for_use(chunk_at(id));
}

at::Tensor ChunkStore::payload(ChunkId id) {
  const StoreLock lock(mutex_);
  reap_completed();
  Chunk& chunk = chunk_at(id);
  TORCH_CHECK(chunk.location() != Location::kNone, "ferry: ", describe(chunk), " has no payload (RELEASED)");
  ready_for_use(chunk);
  return chunk.location() == Location::kDevice ? chunk.device_flat() : chunk.host_flat();
}

int64_t ChunkStore::device_bytes_elsewhere() const {
  const StoreLock lock(mutex_);
  return accountant_->current_bytes() - device_.current_bytes;
}

int64_t ChunkStore::num_chunks() const {
  const StoreLock lock(mutex_);
  return static_cast<int64_t>(chunks_.size());
}

int64_t ChunkStore::num_tensors() const {
  const StoreLock lock(mutex_);
  return static_cast<int64_t>(slots_.size());
}

Location ChunkStore::location(ChunkId id) const {
  const StoreLock lock(mutex_);
  return chunk_at(id).location();
}

int64_t ChunkStore::storage_holders(ChunkId id) {
  const StoreLock lock(mutex_);
  Chunk& chunk = chunk_at(id);
  finish_pending(chunk, /*block=*/true, Count::kNone);  // a copy in flight holds the buffers it reads and writes
  return chunk.storage_holders();
}

ChunkInfo ChunkStore::chunk_info(ChunkId id) const {
  const StoreLock lock(mutex_);
  const Chunk& c = chunk_at(id);
  ChunkInfo info;
  info.id = c.id();
  info.role = c.role();
  info.dtype = c.dtype();
  info.numel = c.numel();
  info.nbytes = c.nbytes();
  info.location = c.location();
  info.state = c.state();
  info.copy_pending = std::find(pending_.begin(), pending_.end(), id) != pending_.end();
  info.device_data = c.device_data();
  info.tensors = c.tensors();
  return info;
}

TensorInfo ChunkStore::tensor_info(TensorId id) const {
  const StoreLock lock(mutex_);
  const Slot& s = slot_at(id);
  return TensorInfo{id, s.chunk, s.offset, s.numel, s.shape, s.state, s.compute_uses};
}

uint64_t ChunkStore::access_tick() const {
  const StoreLock lock(mutex_);
  return tick_;
}

ChunkStoreStats ChunkStore::stats() const {
  const StoreLock lock(mutex_);
  return ChunkStoreStats{device_,       host_,          moves_,          host_pool_.stats(), compute_bytes_,
                         compute_peak_bytes_, device_by_role_, host_by_role_};
}

void ChunkStore::reset_peak_stats() {
  const StoreLock lock(mutex_);
  device_.peak_bytes = device_.current_bytes;
  host_.peak_bytes = host_.current_bytes;
  compute_peak_bytes_ = compute_bytes_;
}

const char* ChunkStore::engine_name() const { return engine_->name(); }
c10::Device ChunkStore::device() const { return engine_->device(); }
std::unique_ptr<StreamMark> ChunkStore::make_mark() const { return engine_->make_mark(); }
const char* ChunkStore::policy_name() const { return policy_->name(); }

}  // namespace ferry
