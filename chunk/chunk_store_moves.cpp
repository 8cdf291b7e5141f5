// ChunkStore's tiers and copies (see chunk_store.h for the contract, and the top of chunk_store.cpp for
// the algorithm): what a tier holds (charge, discharge), making room in a tier (eviction by policy, or
// waiting for copies in flight), and the copies themselves (starting a move, completing it, its
// bookkeeping in the event trace). Every function here runs with the store's mutex held, except the
// public ones (set_device_budget, trace_copies, settle), which take it.
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <unordered_set>

#include "../common/event_trace.h"
#include "../common/logging.h"
#include "chunk_store.h"

namespace ferry {

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
    if (!c->has_device_memory() || c->id() == incoming) continue;
    // In COMPUTE, or a copy in so far unused: it stays (a chunk on its way out has no device memory).
    if (!evictable(*c)) {
      request.held.push_back(c->id());
      continue;
    }
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
  const StoreLock lock(mutex_);
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

bool ChunkStore::start_move(Chunk& chunk, Location to, bool must, const StreamMark* after) {
  if (chunk.location() == to) return true;
  TORCH_CHECK(to != Location::kNone, "ferry: a chunk moves to the device or the host; use "
              "release_payload() to drop it");
  TORCH_CHECK(chunk.location() != Location::kNone, "ferry: ", describe(chunk),
              " has no payload (RELEASED) to move");
  TORCH_CHECK(chunk.state() != ChunkState::kCompute, "ferry: ", describe(chunk),
              " is in COMPUTE and cannot move");
  if (to == Location::kDevice && chunk.host_locks > 0) {
    TORCH_CHECK(!must, "ferry: ", describe(chunk), " is locked on the host (the optimizer is updating it there, "
                "Note [Pipelined step] in optim/pipelined_step.h) and cannot move to the device now: a parameter "
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
    chunk.pending() = after ? engine_->copy_after(chunk.device_flat(), chunk.host_flat(), timing, *after)
                            : engine_->copy(chunk.device_flat(), chunk.host_flat(), timing);
    chunk.set_location(Location::kDevice);
    ++moves_.h2d_count;
    moves_.h2d_bytes += n;
  } else {
    if (!chunk.has_host_buffer() && !give_host_buffer(chunk, must)) return false;
    // A host buffer still attached is the source of a pending host->device copy: this copy runs after
    // it on the copy stream, so it may overwrite it.
    supersede();
    chunk.pending() = after ? engine_->copy_after(chunk.host_flat(), chunk.device_flat(), timing, *after)
                            : engine_->copy(chunk.host_flat(), chunk.device_flat(), timing);
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
  const StoreLock lock(mutex_);
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
  const StoreLock lock(mutex_);
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

}  // namespace ferry
