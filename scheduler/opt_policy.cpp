#include "opt_policy.h"

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

void OptEvictionPolicy::set_passed_over(std::shared_ptr<const std::vector<char>> passed_over) {
  std::lock_guard<std::mutex> lock(mutex_);
  passed_over_ = std::move(passed_over);
}

void OptEvictionPolicy::set_round_trips(std::vector<char> round_trips) {
  std::lock_guard<std::mutex> lock(mutex_);
  round_trips_ = std::move(round_trips);
}

std::vector<ChunkId> OptEvictionPolicy::choose(const EvictionRequest& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!trace_ || position_ < 0) return lru_.choose(request);
  const std::vector<char>* over = passed_over_.get();
  const int64_t n = trace_->size();
  auto next_use = [&](ChunkId chunk, int64_t from) {
    const int64_t next = trace_->next_use(chunk, from, over);
    // Past its last use in the iteration of `from`, a round-tripping chunk leaves at the step anyway.
    const bool trips = chunk >= 0 && chunk < static_cast<ChunkId>(round_trips_.size()) && round_trips_[chunk] != 0;
    return trips && n > 0 && next != AccessTrace::kNever && next >= (from / n + 1) * n ? AccessTrace::kNever : next;
  };
  // A demand access needs its chunk now, wherever the trace next uses it (a gradient landing after the
  // parameter's last traced use): Belady over the candidates as they are.
  const int64_t incoming_next =
      request.incoming >= 0 && !request.demand ? next_use(request.incoming, position_) : position_;
  // A prefetch decides now what Belady would decide when the incoming chunk is needed (at
  // incoming_next). Then Belady compares every resident chunk by its next use *after that moment*,
  // including the current chunk (in COMPUTE now, so not a candidate), the chunks the store holds without
  // offering them (request.held: in COMPUTE beside it, a prefetch still in flight; before D104 they were
  // left out, and a prefetch pushed out a chunk Belady keeps at incoming_next while it takes one of
  // those) and the chunks used before that moment (which the prefetch must not push out). If one of
  // those would be Belady's victim, any victim chosen now is wrong: the prefetch waits for the demand
  // access. So a prefetch may only push out chunks used after all of those.
  // One of those next used "never" after incoming_next (a round trip's chunk with no use left in its
  // iteration, above) has left the device by then or is Belady's first victim there: the room the
  // incoming chunk takes is its room, and any chunk pushed out now is a move Belady would not make (its
  // trip out and back; before 2026-12-02 such a chunk bounded nothing, and a prefetch issued during a
  // round trip's last use pushed out a chunk that stays: D101's 1.33x). The threshold is then kNever:
  // the prefetch waits, and the next use's prefetch finds that chunk gone or a candidate.
  // An incoming chunk next used "never" (a round trip's chunk with no use left in this iteration, or
  // one the trace does not have) is needed after every candidate's next use: such a prefetch pushes
  // nothing out (the threshold stays kNever: AccessTrace::next_use answers kNever after kNever).
  // Waiting is right only for a held chunk that becomes a candidate before the incoming chunk is
  // needed, so that a later use's prefetch finds its room: one in use beside this use (pinned at it),
  // or one the trace uses before incoming_next. A held chunk that is neither is a copy whose use did not
  // come (a block the step skipped, D98): the store learns that copy is done only from a later wait,
  // so waiting for its room makes the prefetch the demand access it was to avoid (D105: 2-8x the bytes
  // a use waited for under LayerDrop). It bounds nothing; the prefetch takes Belady's choice among the
  // candidates, as before D104.
  int64_t threshold = incoming_next;
  auto bound = [&](int64_t next) { threshold = std::max(threshold, next); };
  if (incoming_next > position_ && position_ < trace_->size()) {
    bound(next_use(trace_->chunk_at(position_), incoming_next));
    const AccessTrace::ChunkRange beside = trace_->pinned_at(position_);
    for (ChunkId h : request.held) {
      const bool in_use = std::find(beside.begin(), beside.end(), h) != beside.end();
      if (!in_use && next_use(h, position_) > incoming_next) continue;  // a copy whose use did not come
      bound(next_use(h, incoming_next));
    }
    for (const auto& c : request.candidates) {
      if (next_use(c.chunk, position_) < incoming_next) bound(next_use(c.chunk, incoming_next));
    }
  }
  struct Ranked {
    int64_t next;
    EvictionCandidate candidate;
  };
  std::vector<Ranked> ranked;
  for (const auto& c : request.candidates) {
    const int64_t next = next_use(c.chunk, position_);
    // A prefetch must not push out a chunk needed before the one it brings in, nor one Belady would
    // keep at incoming_next. A chunk never used again (here) may always go, for an incoming chunk that is
    // used: it ties with whatever set the threshold to kNever.
    const bool never_again = next == AccessTrace::kNever && incoming_next != AccessTrace::kNever;
    if (incoming_next > position_ && next <= threshold && !never_again) continue;
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
