#pragma once
// RemoteChunks: parameter chunks that another rank owns (data parallelism with sharded parameters; the
// implementation is dist/param_shards.h). Between its uses such a chunk has no payload in this process;
// the scheduler fetches it before a use (pre_use) and, while it follows the trace, starts fetching the
// next ones as it prefetches moves. The scheduler names no communication type: it only asks these.
//
// Contract: fetch() and prefetch() are collectives. Every rank calls them for the same chunks in the
// same order, which holds when every rank uses the parameters in the same order (the rule of every
// data-parallel engine: DDP, FSDP); an implementation detects a mismatch and fails rather than mixing
// up chunks. Thread-safe.
#include <vector>

#include "../chunk/role.h"

namespace ferry {

class RemoteChunks {
 public:
  virtual ~RemoteChunks() = default;
  // Whether `chunk` (a ChunkId of the parameter store) must be fetched before a use: its group of chunks is
  // not gathered here now. The same answer on every rank, also for the chunk a rank owns itself.
  virtual bool remote(ChunkId chunk) const = 0;
  // Makes `chunk` present (a payload, its tensors HOLD), waiting for a fetch prefetch() started.
  virtual void fetch(ChunkId chunk) = 0;
  // Starts fetching `chunk` if it is remote and not on its way; returns at once.
  virtual void prefetch(ChunkId chunk) = 0;
  // The chunks fetched and released together with `chunk` (its group, itself included), in order.
  virtual std::vector<ChunkId> group(ChunkId chunk) const = 0;
  // Gives up the payloads of the chunks of `chunk`'s group that this rank does not own, between two uses
  // of the group (after its forward uses, when its next use is far): it becomes remote. Every rank calls
  // it at the same point. A member with a tensor in COMPUTE keeps its payload (the next fetch rewrites it).
  virtual void release(ChunkId chunk) = 0;
  // Whether any chunk is remote now; fetch_all() makes every chunk present (between iterations).
  virtual bool any_remote() const = 0;
  virtual void fetch_all() = 0;
  // Gives up the payloads of the chunks this rank does not own (between iterations).
  virtual void release_all() = 0;
};

}  // namespace ferry
