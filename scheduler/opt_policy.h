#pragma once
// OPT (Belady) eviction over a recorded trace: move out the chunk whose next use is furthest away.
//
// The scheduler tells the policy where in the trace the model is (set_position) before every access.
// For a demand access every candidate may go; for a prefetch (the incoming chunk's next use lies in
// the future) only candidates used after both the incoming chunk and the next use of the chunk at the
// current position may go: a prefetch never evicts a chunk needed sooner than the one it brings in,
// nor makes a choice Belady would not make once the current chunk leaves COMPUTE. Without a trace (or once the run diverged from it) it falls
// back to LRU.
//
// A chunk that leaves the device at the step whatever the policy does (set_round_trips: its update
// runs on the host, Note [The step's round trips in the reference]) is, once its last use in this
// iteration is behind, never used again here: it goes before any chunk that will still be on the
// device for its next use, as Belady's count with those departures (belady_moves) has it.
//
// Contract: set_trace/set_position and choose() may be called from different threads (hooks run on
// autograd's threads); they are serialized by the policy's mutex.
#include <memory>
#include <mutex>
#include <vector>

#include "../chunk/eviction_policy.h"
#include "access_trace.h"

namespace ferry {

class OptEvictionPolicy final : public EvictionPolicy {
 public:
  const char* name() const override { return "opt"; }
  std::vector<ChunkId> choose(const EvictionRequest& request) override;

  // The trace to plan with (finalized); null: LRU.
  void set_trace(std::shared_ptr<const AccessTrace> trace);
  // The position of the access about to happen; -1: not following the trace (LRU).
  void set_position(int64_t position);
  // This iteration's trace positions known not to come (null: none): never a chunk's next use.
  void set_passed_over(std::shared_ptr<const std::vector<char>> passed_over);
  // The chunks that leave the device after their last use in each iteration (one entry per chunk;
  // empty: none).
  void set_round_trips(std::vector<char> round_trips);

 private:
  std::mutex mutex_;
  std::shared_ptr<const AccessTrace> trace_;
  int64_t position_ = -1;
  std::shared_ptr<const std::vector<char>> passed_over_;
  std::vector<char> round_trips_;
  LruEvictionPolicy lru_;
};

}  // namespace ferry
