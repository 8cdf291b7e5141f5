#pragma once
// ReleasePlan: with sharded parameters (dist/param_shards.h, D45), where in the trace each group of
// remote chunks is given up after its forward uses, and how far this iteration has released.
//
// From a trace (the same on every rank, so every rank releases at the same points): a group is given
// up at the first position after its last forward use when its next use (in backward) is at least
// `reshard_min_gap` positions later; it is fetched again ahead of that use like a prefetch. A group
// with no later use is kept (its gradients land in its chunks at the end of backward, which would fetch
// it again just for that). The plan is made when first needed and again after invalidate() (a new
// trace, new chunk maps, another RemoteChunks). Releases follow a trace only once the caller confirmed
// it the same on every rank (allow(), per trace version).
//
// Contract: not thread-safe (the Scheduler calls it with its mutex held). Positions are trace positions;
// ChunkIds are the parameter store's.
#include <cstdint>
#include <vector>

#include "access_trace.h"
#include "remote_chunks.h"

namespace ferry {

class ReleasePlan {
 public:
  // `reshard_after_forward` false: nothing is ever released (SchedulerOptions).
  ReleasePlan(bool reshard_after_forward, int64_t reshard_min_gap)
      : reshard_after_forward_(reshard_after_forward), min_gap_(reshard_min_gap) {}

  // The plan is made again when next needed.
  void invalidate() { planned_ = false; }
  // Releases may follow the trace of version `trace_version` (the same on every rank), or, `allow`
  // false, no trace.
  void allow(int64_t trace_version, bool allow) { allowed_for_ = allow ? trace_version : -1; }
  bool allowed(int64_t trace_version) const { return allowed_for_ == trace_version; }
  // An iteration begins: nothing released in it yet.
  void begin_iteration() { released_upto_ = 0; }
  // Gives up (remote.release) the groups planned at the positions up to `position` (and at most the
  // trace's end) that this iteration has not released yet; plans first if needed. `num_chunks`: of the
  // parameter store.
  void release_until(int64_t position, const AccessTrace& trace, int64_t num_chunks, RemoteChunks& remote);
  // The groups (each named by its first member) given up at each position [0, trace size]; made if needed.
  const std::vector<std::vector<ChunkId>>& plan(const AccessTrace& trace, int64_t num_chunks, RemoteChunks& remote);

 private:
  void make_plan(const AccessTrace& trace, int64_t num_chunks, RemoteChunks& remote);

  bool reshard_after_forward_;
  int64_t min_gap_;
  std::vector<std::vector<ChunkId>> release_at_;  // per position: the groups given up there
  bool planned_ = false;
  int64_t released_upto_ = 0;  // positions whose releases were made this iteration
  int64_t allowed_for_ = -1;   // the trace version confirmed the same on every rank
};

}  // namespace ferry
