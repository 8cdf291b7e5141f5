#include "ferry/scheduler/opt_policy.h"

#include <algorithm>

namespace ferry {

void OptEvictionPolicy::set_trace(std::shared_ptr<const AccessTrace> trace) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_ = std::move(trace);
}

void OptEvictionPolicy::set_position(int64_t position) {
  std::lock_guard<std::mutex> lock(mutex_);
  position_ = position;
}

std::vector<ChunkId> OptEvictionPolicy::choose(const EvictionRequest& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!trace_ || position_ < 0) return lru_.choose(request);
  const int64_t incoming_next = request.incoming >= 0 ? trace_->next_use(request.incoming, position_) : position_;
  // A prefetch runs while the current position's chunk is in COMPUTE and cannot be chosen; Belady
  // might prefer it a moment later. So a prefetch may only push out chunks used after both the
  // incoming chunk and the current chunk's next use; otherwise it waits for the demand access.
  int64_t threshold = incoming_next;
  if (incoming_next > position_ && position_ < trace_->size()) {
    threshold = std::max(threshold, trace_->next_use(trace_->chunk_at(position_), position_ + 1));
  }
  struct Ranked {
    int64_t next;
    EvictionCandidate candidate;
  };
  std::vector<Ranked> ranked;
  for (const auto& c : request.candidates) {
    const int64_t next = trace_->next_use(c.chunk, position_);
    // A prefetch must not push out a chunk needed before the one it brings in.
    if (incoming_next > position_ && next <= threshold) continue;
    ranked.push_back({next, c});
  }
  std::sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
    if (a.next != b.next) return a.next > b.next;
    return a.candidate.last_use != b.candidate.last_use ? a.candidate.last_use < b.candidate.last_use
                                                        : a.candidate.chunk < b.candidate.chunk;
  });
  std::vector<ChunkId> victims;
  int64_t freed = 0;
  for (const auto& r : ranked) {
    if (freed >= request.bytes_needed) break;
    victims.push_back(r.candidate.chunk);
    freed += r.candidate.bytes;
  }
  return victims;
}

}  // namespace ferry
