#pragma once
// Which chunks leave a tier when room is needed: the policy interface, and LRU.
//
// The ChunkStore (mechanism) asks the policy only when a tier's budget would be exceeded, with the
// candidates it may legally move (resident in that tier, not in COMPUTE, not being moved unless a use
// has been ordered after the copy: Note [In flight but used], chunk_store.h), the chunks that stay in the
// tier without being candidates, and the bytes it needs. The policy returns chunks to move out, in
// order; the store moves them until enough is free.
// The scheduler (scheduler/) adds OPT/Belady from the traced access order; LRU here needs no trace.
//
// Contract: choose() must return only candidates' ids, without repeats; it may return more than
// needed (the store stops early) but returning too little is treated as "cannot make room". Policies
// are called with the store's mutex held: they must not call back into the store.
#include <cstdint>
#include <vector>

#include "role.h"

namespace ferry {

struct EvictionCandidate {
  ChunkId chunk = -1;
  int64_t bytes = 0;      // bytes its payload takes in the tier
  uint64_t last_use = 0;  // access tick of its last access (0: never accessed)
};

struct EvictionRequest {
  Tier tier = Tier::kDevice;
  int64_t bytes_needed = 0;  // at least this many bytes must leave the tier
  ChunkId incoming = -1;     // the chunk room is made for (-1: none)
  uint64_t now = 0;          // the store's access tick (one per access() call)
  bool demand = false;       // the incoming chunk is needed now (access, move), not prefetched
  std::vector<EvictionCandidate> candidates;
  // The chunks with memory in the tier that are no candidates (in COMPUTE, a copy in so far unused), the
  // incoming one left out: they stay for now, and a policy that decides for a later moment (OPT's
  // prefetch guard, D104) must weigh them as resident then too.
  std::vector<ChunkId> held;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual const char* name() const = 0;
  virtual std::vector<ChunkId> choose(const EvictionRequest& request) = 0;
};

// Least recently used first (ties: lower chunk id first).
class LruEvictionPolicy final : public EvictionPolicy {
 public:
  const char* name() const override { return "lru"; }
  std::vector<ChunkId> choose(const EvictionRequest& request) override;
};

}  // namespace ferry
