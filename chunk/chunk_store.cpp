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
#include "chunk_store.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

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
      engine_(engine ? std::move(engine) : make_copy_engine(options_.device)),
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
// Lookups and accounting (mutex held)

Chunk& ChunkStore::chunk_at(ChunkId id) {
  TORCH_CHECK(id >= 0 && id < static_cast<ChunkId>(chunks_.size()), "ferry: chunk id ", id,
              " out of range [0, ", chunks_.size(), ")");
  return *chunks_[id];
}

const Chunk& ChunkStore::chunk_at(ChunkId id) const {
  return const_cast<ChunkStore*>(this)->chunk_at(id);
}

ChunkStore::Slot& ChunkStore::slot_at(TensorId id) {
  TORCH_CHECK(id >= 0 && id < static_cast<TensorId>(slots_.size()), "ferry: tensor id ", id,
              " out of range [0, ", slots_.size(), ")");
  return slots_[id];
}

const ChunkStore::Slot& ChunkStore::slot_at(TensorId id) const {
  return const_cast<ChunkStore*>(this)->slot_at(id);
}

TierStats& ChunkStore::tier(Tier t) {
  switch (t) {
    case Tier::kDevice: return device_;
    case Tier::kHost: return host_;
  }
  TORCH_INTERNAL_ASSERT(false);
}

void ChunkStore::charge(Tier t, const Chunk& chunk) {
  const int64_t bytes = chunk.nbytes();
  TierStats& s = tier(t);
  s.current_bytes += bytes;
  (t == Tier::kDevice ? device_by_role_ : host_by_role_)[static_cast<int>(chunk.role())] += bytes;
  if (t == Tier::kDevice) accountant_->charge(chunk.role(), bytes);
  TORCH_INTERNAL_ASSERT(s.budget_bytes == 0 || s.current_bytes <= s.budget_bytes, to_string(t),
                        " tier over budget: ", s.current_bytes, " > ", s.budget_bytes);
  s.peak_bytes = std::max(s.peak_bytes, s.current_bytes);
  if (trace::enabled()) trace::counter(options_.name + (t == Tier::kDevice ? " device bytes" : " host bytes"), s.current_bytes);
}

void ChunkStore::discharge(Tier t, const Chunk& chunk) {
  const int64_t bytes = chunk.nbytes();
  TierStats& s = tier(t);
  s.current_bytes -= bytes;
  (t == Tier::kDevice ? device_by_role_ : host_by_role_)[static_cast<int>(chunk.role())] -= bytes;
  if (t == Tier::kDevice) accountant_->discharge(chunk.role(), bytes);
  TORCH_INTERNAL_ASSERT(s.current_bytes >= 0, to_string(t), " tier bytes went negative");
  if (trace::enabled()) trace::counter(options_.name + (t == Tier::kDevice ? " device bytes" : " host bytes"), s.current_bytes);
}

std::string ChunkStore::describe(const Chunk& chunk) const {
  std::ostringstream os;
  os << "chunk " << chunk.id() << " (" << to_string(chunk.role()) << ", " << chunk.dtype() << ", "
     << format_bytes(chunk.nbytes()) << ")";
  return os.str();
}

std::string ChunkStore::describe_incoming(ChunkId incoming) const {
  // A chunk being added is not in chunks_ yet.
  return incoming >= 0 && incoming < static_cast<ChunkId>(chunks_.size()) ? describe(*chunks_[incoming])
                                                                         : std::string("a new chunk");
}

// ---------------------------------------------------------------------------------------------------
// Room in a tier

TierShortfall ChunkStore::shortfall(Tier t, int64_t bytes, ChunkId incoming) const {
  TierShortfall s;
  s.tier = t;
  s.needed = bytes;
  const TierStats& stats = t == Tier::kDevice ? device_ : host_;
  s.budget = stats.budget_bytes;
  s.used = stats.current_bytes;
  if (t == Tier::kDevice) {
    for (const auto& c : chunks_) {
      if (!c->has_device_memory()) continue;
      if (c->state() == ChunkState::kCompute) {
        s.in_compute += c->nbytes();
      } else if (evictable(*c) && c->id() != incoming) {
        s.evictable += c->nbytes();
      }
    }
  }
  s.what = describe_incoming(incoming);
  return s;
}

bool ChunkStore::evictable(const Chunk& chunk) {
  if (chunk.state() == ChunkState::kCompute) return false;
  // A copy in flight that compute has not been ordered after yet (a prefetch just issued, a reversed
  // eviction) is no candidate; one the chunk's use has been ordered after is as good as done
  // (Note [In flight but used]).
  const CopyTicket* ticket = chunk.pending();
  return ticket == nullptr || ticket->ordered_before_compute;
}

void ChunkStore::evict_for_locked(int64_t bytes, ChunkId incoming, bool must) {
  const TierStats& s = device_;
  if (s.budget_bytes == 0 || s.current_bytes + bytes <= s.budget_bytes) return;
  EvictionRequest request;
  request.tier = Tier::kDevice;
  request.bytes_needed = s.current_bytes + bytes - s.budget_bytes;
  request.incoming = incoming;
  request.now = tick_;
  request.demand = must;
  int64_t candidate_bytes = 0;
  for (const auto& c : chunks_) {
    if (!c->has_device_memory() || !evictable(*c) || c->id() == incoming) continue;
    request.candidates.push_back({c->id(), c->nbytes(), c->last_use});
    candidate_bytes += c->nbytes();
  }
  if (candidate_bytes < request.bytes_needed) return;
  const std::vector<ChunkId> victims = policy_->choose(request);
  std::unordered_set<ChunkId> allowed, seen;
  for (const auto& c : request.candidates) allowed.insert(c.chunk);
  int64_t offered = 0;
  for (ChunkId v : victims) {
    TORCH_CHECK(allowed.count(v) && seen.insert(v).second, "ferry: eviction policy ", policy_->name(),
                " returned chunk ", v, ", which is not a candidate or is repeated");
    offered += chunks_[v]->nbytes();
  }
  // Too little offered (a policy may refuse, e.g. for a prefetch): move nothing.
  if (offered < request.bytes_needed) return;
  for (ChunkId v : victims) {
    if (s.current_bytes + bytes <= s.budget_bytes) break;
    if (!start_move(*chunks_[v], Location::kHost, must)) return;
    ++moves_.evictions;
    if (trace::enabled()) {
      trace::instant("evict", "evict chunk " + std::to_string(v),
                     "\"bytes\": " + std::to_string(chunks_[v]->nbytes()) + ", \"for\": " + std::to_string(incoming));
    }
    log::trace("chunk store: evicted ", describe(*chunks_[v]), " for ", describe_incoming(incoming));
  }
}

bool ChunkStore::make_room(Tier t, int64_t bytes, ChunkId incoming, bool must) {
  const TierStats& s = tier(t);
  auto fits = [&] { return s.budget_bytes == 0 || s.current_bytes + bytes <= s.budget_bytes; };
  if (fits()) return true;
  reap_completed();
  if (t == Tier::kHost) {
    // No lower tier: only host buffers still read by host->device copies can go.
    const std::vector<ChunkId> pending = pending_;
    for (ChunkId id : pending) {
      if (fits()) break;
      Chunk& c = *chunks_[id];
      if (c.location() == Location::kDevice && c.has_host_buffer()) finish_pending(c, /*block=*/true);
    }
  } else {
    evict_for_locked(bytes, incoming, must);
    if (!fits() && must) {
      // Chunks whose copy is still in flight and not yet used are no candidates (a prefetch just
      // issued, a reversed eviction). When only they stand between us and an OutOfMemoryError, wait
      // for their copies (the host waits; counted in wait_ns) and choose again: on CUDA copies finish,
      // while the synchronous simulated engine never gets here.
      bool waited = false;
      const std::vector<ChunkId> pending = pending_;
      for (ChunkId id : pending) {
        Chunk& c = *chunks_[id];
        if (c.location() == Location::kDevice && c.state() != ChunkState::kCompute && !evictable(c) &&
            id != incoming) {
          finish_pending(c, /*block=*/true);
          waited = true;
        }
      }
      if (waited) evict_for_locked(bytes, incoming, must);
    }
  }
  if (fits()) return true;
  if (must) throw OutOfMemoryError(shortfall(t, bytes, incoming));
  return false;
}

void ChunkStore::set_device_budget(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(bytes >= 0, "ferry: device budget must be >= 0 bytes (0 = no limit), got ", bytes);
  reap_completed();
  const int64_t old = device_.budget_bytes;
  device_.budget_bytes = bytes;
  if (bytes == 0 || device_.current_bytes <= bytes) return;
  try {
    make_room(Tier::kDevice, 0, -1, /*must=*/true);
  } catch (...) {
    device_.budget_bytes = old;
    throw;
  }
}

// ---------------------------------------------------------------------------------------------------
// Copies

bool ChunkStore::start_move(Chunk& chunk, Location to, bool must) {
  if (chunk.location() == to) return true;
  TORCH_CHECK(to != Location::kNone, "ferry: a chunk moves to the device or the host; use "
              "release_payload() to drop it");
  TORCH_CHECK(chunk.location() != Location::kNone, "ferry: ", describe(chunk),
              " has no payload (RELEASED) to move");
  TORCH_CHECK(chunk.state() != ChunkState::kCompute, "ferry: ", describe(chunk),
              " is in COMPUTE and cannot move");
  if (to == Location::kDevice && chunk.host_locks > 0) {
    TORCH_CHECK(!must, "ferry: ", describe(chunk), " is locked on the host (the optimizer is updating it there, "
                "Note [Pipelined step] in optim/hybrid_adam.h) and cannot move to the device now: a parameter "
                "of it is used after its gradient was final, or before the update a step left running behind it "
                "has finished (Note [Update behind the next forward])");
    return false;
  }
  const int64_t n = chunk.nbytes();
  const bool tracing = trace::enabled();
  const std::string what = tracing ? std::string(to == Location::kDevice ? "h2d" : "d2h") + " chunk " + std::to_string(chunk.id()) : std::string();
  trace::Span span("move", what);
  if (tracing) span.set_args(copy_args(chunk));
  // Timed on the device's clock while tracing (two events per copy on CUDA), up to a bound; copies an
  // earlier recording kept (trace_copies not called for it) make room first.
  if (tracing && !timed_copies_.empty() && timed_copies_.front().recording != trace::recording()) {
    const int64_t now = trace::recording();
    timed_copies_.erase(std::remove_if(timed_copies_.begin(), timed_copies_.end(),
                                       [now](const TimedCopy& t) { return t.recording != now; }),
                        timed_copies_.end());
  }
  const CopyTiming timing = tracing && timed_copies_.size() + pending_.size() < kMaxTimedCopies ? CopyTiming::kTimed
                                                                                                : CopyTiming::kUntimed;
  // A copy still in flight is superseded by the new one (which runs after it on the copy stream); the
  // trace keeps it.
  auto supersede = [&] {
    if (chunk.pending()) keep_for_trace(chunk, *chunk.pending());
  };
  if (to == Location::kDevice) {
    if (!give_device_memory(chunk, must)) return false;
    // Runs after any pending device->host copy into the host buffer (same copy stream).
    supersede();
    chunk.pending() = engine_->copy(chunk.device_flat(), chunk.host_flat(), timing);
    chunk.set_location(Location::kDevice);
    ++moves_.h2d_count;
    moves_.h2d_bytes += n;
  } else {
    if (!chunk.has_host_buffer() && !give_host_buffer(chunk, must)) return false;
    // A host buffer still attached is the source of a pending host->device copy: this copy runs after
    // it on the copy stream, so it may overwrite it.
    supersede();
    chunk.pending() = engine_->copy(chunk.host_flat(), chunk.device_flat(), timing);
    chunk.free_device_memory();
    discharge(Tier::kDevice, chunk);
    chunk.set_location(Location::kHost);
    ++moves_.d2h_count;
    moves_.d2h_bytes += n;
  }
  if (tracing) {
    chunk.pending()->issued_ns = trace::now_ns();
    chunk.pending()->trace_recording = trace::recording();
    chunk.pending()->trace_name = what;
  }
  if (std::find(pending_.begin(), pending_.end(), chunk.id()) == pending_.end()) {
    pending_.push_back(chunk.id());
  }
  finish_pending(chunk, /*block=*/false);  // the simulated engine is done already
  return true;
}

bool ChunkStore::give_device_memory(Chunk& chunk, bool must) {
  if (!make_room(Tier::kDevice, chunk.nbytes(), chunk.id(), must)) return false;
  chunk.allocate_device_memory();
  charge(Tier::kDevice, chunk);
  return true;
}

bool ChunkStore::give_host_buffer(Chunk& chunk, bool must) {
  if (!make_room(Tier::kHost, chunk.nbytes(), chunk.id(), must)) return false;
  chunk.attach_host_buffer(host_pool_.acquire(chunk.nbytes()));
  charge(Tier::kHost, chunk);
  return true;
}

void ChunkStore::finish_pending(Chunk& chunk, bool block, Count count) {
  auto& ticket = chunk.pending();
  if (!ticket) return;
  if (!ticket->done()) {
    if (!block) return;
    if (count == Count::kCaller) ++moves_.sync_count;
    if (count == Count::kBackground) ++moves_.background_sync_count;
    const auto start = std::chrono::steady_clock::now();
    trace::Span span("wait", "wait chunk " + std::to_string(chunk.id()));
    ticket->wait();
    moves_.wait_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
            .count();
    ++moves_.wait_count;
  }
  keep_for_trace(chunk, *ticket);
  ticket.reset();
  pending_.erase(std::remove(pending_.begin(), pending_.end(), chunk.id()), pending_.end());
  if (chunk.location() == Location::kDevice && chunk.has_host_buffer()) {
    at::Tensor buffer = chunk.detach_host_buffer();
    host_pool_.release(buffer);
    discharge(Tier::kHost, chunk);
  }
  alias_if_possible(chunk);
}

std::string ChunkStore::copy_args(const Chunk& chunk) const {
  return "\"bytes\": " + std::to_string(chunk.nbytes()) + ", \"role\": \"" + to_string(chunk.role()) + "\"";
}

void ChunkStore::keep_for_trace(const Chunk& chunk, CopyTicket& ticket) {
  if (!ticket.issued_ns || !trace::enabled() || ticket.trace_recording != trace::recording()) return;
  if (ticket.finished) {  // written by trace_copies, which places the device's clock on the host's
    timed_copies_.push_back(TimedCopy{ticket.trace_name, copy_args(chunk), ticket.trace_recording,
                                      std::move(ticket.started), std::move(ticket.finished)});
  } else {
    trace::complete("copy", ticket.trace_name + " in flight", ticket.issued_ns, trace::now_ns(), copy_args(chunk));
  }
  ticket.issued_ns = 0;  // kept once
}

void ChunkStore::trace_copies(const ClockAnchor& anchor) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (ChunkId c : pending_) {  // still in flight: their marks are reached when they are done
    Chunk& chunk = chunk_at(c);
    if (chunk.pending() && chunk.pending()->finished) keep_for_trace(chunk, *chunk.pending());
  }
  for (const TimedCopy& copy : timed_copies_) {
    if (!trace::enabled() || copy.recording != trace::recording()) continue;  // another recording's
    trace::complete_on("copy stream", "link", copy.name, anchor.host_ns(*copy.started),
                       anchor.host_ns(*copy.finished), copy.args);
  }
  timed_copies_.clear();
}

void ChunkStore::alias_if_possible(Chunk& chunk) {
  if (chunk.location() == Location::kHost && chunk.has_host_buffer() && !chunk.pending() &&
      !chunk.aliases_host_buffer() && !chunk.has_device_memory() && device_reads_host_) {
    chunk.alias_host_buffer();
  }
}

void ChunkStore::settle() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Newest first: copies complete in issue order (one copy stream), so one wait usually covers the rest.
  const std::vector<ChunkId> pending(pending_.rbegin(), pending_.rend());
  for (ChunkId id : pending) {
    if (chunks_[id]->location() == Location::kHost) finish_pending(*chunks_[id], /*block=*/true);
  }
}

void ChunkStore::reap_completed() {
  const std::vector<ChunkId> pending = pending_;
  for (ChunkId id : pending) finish_pending(*chunks_[id], /*block=*/false);
}

void ChunkStore::ready_for_use(Chunk& chunk) {
  if (!chunk.pending()) return;
  switch (chunk.location()) {
    case Location::kHost: finish_pending(chunk, /*block=*/true); return;
    case Location::kDevice:
      chunk.pending()->order_before_compute();
      chunk.pending()->ordered_before_compute = true;
      return;
    case Location::kNone: return;
  }
}

bool ChunkStore::fill_zero(Chunk& chunk, Location at, const at::Tensor& bytes, bool must) {
  TORCH_INTERNAL_ASSERT(chunk.location() == Location::kNone);
  auto fill = [&](const at::Tensor& flat) {
    if (bytes.defined()) {
      flat.view(at::kByte).copy_(bytes);
    } else {
      flat.zero_();
    }
  };
  switch (at) {
    case Location::kDevice:
      if (!give_device_memory(chunk, must)) return false;
      fill(chunk.device_flat());
      break;
    case Location::kHost:
      if (!give_host_buffer(chunk, must)) return false;
      fill(chunk.host_flat());
      break;
    case Location::kNone: TORCH_CHECK(false, "ferry: a payload goes to the device or the host, not none");
  }
  chunk.set_location(at);
  alias_if_possible(chunk);
  return true;
}

// ---------------------------------------------------------------------------------------------------
// Building

ChunkId ChunkStore::add_chunk(ChunkRole role, at::ScalarType dtype, int64_t numel, Location initial) {
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
  reap_completed();
  start_move(chunk_at(id), to, /*must=*/true);
}

bool ChunkStore::prefetch(ChunkId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  reap_completed();
  Chunk& chunk = chunk_at(id);
  if (chunk.location() == Location::kDevice) return true;
  if (chunk.location() == Location::kNone) return false;
  return start_move(chunk, Location::kDevice, /*must=*/false);
}

void ChunkStore::wait(ChunkId id, WaitFrom from) {
  std::lock_guard<std::mutex> lock(mutex_);
  finish_pending(chunk_at(id), /*block=*/true, from == WaitFrom::kBackground ? Count::kBackground : Count::kCaller);
}

void ChunkStore::synchronize() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Newest first: copies complete in issue order (one copy stream), so one wait usually covers the rest.
  const std::vector<ChunkId> pending(pending_.rbegin(), pending_.rend());
  for (ChunkId id : pending) finish_pending(*chunks_[id], /*block=*/true);
}

void ChunkStore::lock_on_host(ChunkId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  Chunk& chunk = chunk_at(id);
  TORCH_CHECK(chunk.location() == Location::kHost, "ferry: lock_on_host: ", describe(chunk),
              " must be on the host, it is on ", to_string(chunk.location()));
  ++chunk.host_locks;
}

void ChunkStore::unlock_on_host(ChunkId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  Chunk& chunk = chunk_at(id);
  TORCH_CHECK(chunk.host_locks > 0, "ferry: unlock_on_host: ", describe(chunk), " is not locked");
  --chunk.host_locks;
}

bool ChunkStore::locked_on_host(ChunkId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return chunk_at(id).host_locks > 0;
}

void ChunkStore::release_payload(ChunkId id) {
  std::lock_guard<std::mutex> lock(mutex_);
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
    std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
  reap_completed();
  check_new_payload(chunk_at(id), bytes);
  fill_zero(chunk_at(id), at, bytes);
}

bool ChunkStore::try_allocate_payload_on_device(ChunkId id, const at::Tensor& bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
  reap_completed();
  const Slot& slot = slot_at(id);
  Chunk& chunk = chunk_at(slot.chunk);
  TORCH_CHECK(chunk.location() != Location::kNone, "ferry: tensor ", id, " is in ", describe(chunk),
              ", which has no payload (RELEASED)");
  ready_for_use(chunk);
  if (chunk.location() == Location::kDevice) return chunk.device_view(slot.offset, slot.shape);
  return chunk.host_flat().narrow(0, slot.offset, slot.numel).view(slot.shape);
}

at::Tensor ChunkStore::payload(ChunkId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  reap_completed();
  Chunk& chunk = chunk_at(id);
  TORCH_CHECK(chunk.location() != Location::kNone, "ferry: ", describe(chunk), " has no payload (RELEASED)");
  ready_for_use(chunk);
  return chunk.location() == Location::kDevice ? chunk.device_flat() : chunk.host_flat();
}

int64_t ChunkStore::device_bytes_elsewhere() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return accountant_->current_bytes() - device_.current_bytes;
}

int64_t ChunkStore::num_chunks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(chunks_.size());
}

int64_t ChunkStore::num_tensors() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(slots_.size());
}

Location ChunkStore::location(ChunkId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return chunk_at(id).location();
}

int64_t ChunkStore::storage_holders(ChunkId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  Chunk& chunk = chunk_at(id);
  finish_pending(chunk, /*block=*/true, Count::kNone);  // a copy in flight holds the buffers it reads and writes
  return chunk.storage_holders();
}

ChunkInfo ChunkStore::chunk_info(ChunkId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
  const Slot& s = slot_at(id);
  return TensorInfo{id, s.chunk, s.offset, s.numel, s.shape, s.state, s.compute_uses};
}

uint64_t ChunkStore::access_tick() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tick_;
}

ChunkStoreStats ChunkStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ChunkStoreStats{device_,       host_,          moves_,          host_pool_.stats(), compute_bytes_,
                         compute_peak_bytes_, device_by_role_, host_by_role_};
}

void ChunkStore::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  device_.peak_bytes = device_.current_bytes;
  host_.peak_bytes = host_.current_bytes;
  compute_peak_bytes_ = compute_bytes_;
}

const char* ChunkStore::engine_name() const { return engine_->name(); }
c10::Device ChunkStore::device() const { return engine_->device(); }
std::unique_ptr<StreamMark> ChunkStore::make_mark() const { return engine_->make_mark(); }
const char* ChunkStore::policy_name() const { return policy_->name(); }

}  // namespace ferry
