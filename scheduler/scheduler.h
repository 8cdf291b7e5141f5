#pragma once
// Scheduler: turns parameter uses into chunk moves. It records the access order in warm-up
// iterations, then follows it: OPT eviction over the trace, prefetch of the next chunks on the copy
// stream, a per-moment device budget that leaves room for the non-model memory seen at that moment,
// and a re-trace when the run stops matching the trace.
//
// Iterations
//  - An iteration is one forward (+ backward); begin_iteration/end_iteration bracket it.
//  - The first `warmup_iterations` record the trace with LRU eviction; the trace is then finalized
//    and end_iteration() says the layout should be repacked in first-use order (the caller does it and
//    calls relayout()).
//  - Afterwards every pre_use compares the parameter with the trace at the current position. On a
//    mismatch (a branch taken differently, a parameter unused this time) the scheduler warns once,
//    switches to LRU for the rest of the iteration and records the next iteration as a new trace.
//
// Parameters are named by their index in the model (stable across repacks); `tensor_of_param` and
// `chunk_of_param` map them into the current ChunkStore.
//
// Contract: pre_use/post_use may be called from autograd's threads; all methods take the scheduler's
// mutex. A ChunkStore error (OutOfMemoryError) propagates out of pre_use with nothing half-done for
// that parameter.
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "../chunk/chunk_store.h"
#include "access_trace.h"
#include "memory_probe.h"
#include "opt_policy.h"
#include "remote_chunks.h"

namespace ferry {

struct SchedulerOptions {
  int warmup_iterations = 1;      // iterations recorded before the trace is used (>= 1)
  int prefetch_depth = 2;         // distinct chunks ahead to start moving in (0: no prefetch)
  int64_t prefetch_window = 256;  // trace positions searched for them
  int64_t non_model_window = 4;   // positions ahead whose non-model peak the budget reserves
  int64_t device_budget_bytes = 0;    // device bytes for chunks of every store: parameters + state (0: no limit)
  // The device's memory for chunks and non-model memory (activations, temporaries) together; while the
  // trace is followed, the chunk budget at each moment is also capped at capacity - other stores' device bytes -
  // the non-model peak recorded a few positions ahead. 0: unknown, the chunk budget alone limits.
  int64_t device_capacity_bytes = 0;
  // Sharded parameters (set_remote): give a group of remote chunks up after its last forward use when its
  // next use (in backward) is at least `reshard_min_gap` trace positions later, and fetch it again
  // ahead of that use: the compute copy a rank holds stays near the groups in use, for one more
  // all-gather of those groups per step. Off (or a nearer next use): kept until the step releases it.
  bool reshard_after_forward = true;
  int64_t reshard_min_gap = 16;
  void validate() const;
};

// Counters of one iteration (sums of bytes unless a count).
struct IterationStats {
  int64_t index = 0;
  bool traced = false;      // this iteration recorded the trace (warm-up or re-trace)
  bool diverged = false;    // it stopped matching the trace
  bool aborted = false;     // an exception ended it
  int64_t accesses = 0;     // pre-use events (count)
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  int64_t evictions = 0;    // count
  int64_t prefetches = 0;   // prefetch moves started (count)
  int64_t wait_ns = 0;      // host time blocked on copies
  int64_t device_peak_bytes = 0;  // chunk bytes on the device, peak
  // The largest set of chunk bytes one op needed on the device at once: the smallest device budget
  // this iteration could have run with at this chunk size (ChunkStoreStats::compute_peak_bytes).
  int64_t working_set_peak_bytes = 0;
  bool forward_only = false;      // no backward in this iteration (evaluation)
  int64_t optimal_bytes = -1;     // Belady moves of the trace at this budget (-1: no trace yet)
  double moved_over_optimal() const;
};

class Scheduler {
 public:
  Scheduler(ChunkStore& store, std::shared_ptr<OptEvictionPolicy> policy, std::unique_ptr<MemoryProbe> probe,
            SchedulerOptions options, std::vector<TensorId> tensor_of_param, std::vector<ChunkId> chunk_of_param);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Sharded parameters (null: none): a remote chunk is fetched before its use, and fetched ahead of it
  // like a prefetched move while the trace is followed. Between iterations.
  void set_remote(std::shared_ptr<RemoteChunks> remote);
  // Forward releases (reshard_after_forward) follow the trace, so they need the same trace on every rank:
  // the caller (HybridAdam, with a collective between steps) confirms it per trace version. Until then
  // (and for any later trace until confirmed) sharded groups are kept from their first use to the step.
  int64_t trace_version() const;  // incremented whenever a newly recorded trace is adopted
  void allow_forward_releases(int64_t trace_version, bool allow);

  void begin_iteration();
  // The backward pass starts (ChunkedModel::backward): recorded in the trace, so that sharded groups are
  // given up after their forward uses only.
  void begin_backward();
  // Pre-use hook: follows/records the trace, makes the parameter resident (COMPUTE), prefetches.
  void pre_use(int64_t param);
  // Post-use hook: COMPUTE -> `after`.
  void post_use(int64_t param, TensorState after);
  // Ends the iteration: every HOLD_AFTER_* tensor back to HOLD, counters closed. Returns them.
  // `forward_only`: the iteration had no backward (evaluation); its recording becomes the trace only
  // while there is no trace from a training iteration.
  IterationStats end_iteration(bool aborted = false, bool forward_only = false);
  // Whether the current trace came from a forward-only iteration.
  bool trace_is_forward_only() const;
  // Whether the trace was just finalized and the caller should repack (once).
  bool repack_wanted() const;
  // After a repack into `store`: new maps, the trace's chunks rewritten.
  void relayout(ChunkStore& store, std::vector<TensorId> tensor_of_param, std::vector<ChunkId> chunk_of_param);

  // Another store (HybridAdam's optimizer state) is about to put `bytes` more on the device: evicts
  // parameter chunks so that all stores stay within the device budget. Fails, changing nothing, if it
  // would leave less than the largest chunk. Between iterations. The bytes then count through the
  // shared DeviceAccountant: the parameter chunks' budget is device_budget - other_device_bytes().
  void admit_device_bytes(int64_t bytes);
  int64_t other_device_bytes() const;
  // Peak non-model device bytes over the trace (-1: no trace yet).
  int64_t non_model_peak() const;
  // Device bytes for chunks (parameters and device-resident state together) at the trace's worst moment:
  // the device budget, capped at capacity - non-model peak when the capacity is known. 0: no limit.
  int64_t device_room_bytes() const;

  bool following_trace() const;
  std::shared_ptr<const AccessTrace> trace() const;
  IterationStats last_iteration() const;
  int64_t iterations() const;

 private:
  void finalize_trace_locked();
  // Sharded parameters: release_at_[q]: a chunk of each group given up at position q (the first use after
  // the group's forward uses), from the trace; built when first needed.
  void plan_releases_locked();
  void release_until_locked(int64_t position);
  void prefetch_locked(int64_t position);
  void apply_budget_locked(int64_t position);
  int64_t non_model_now_locked();
  int64_t chunk_budget_locked() const;  // device budget minus other stores' device bytes (0: no limit)
  // The chunk budget at a moment with `non_model` bytes of non-model memory (-1: unknown): the chunk
  // budget, capped by the capacity's room; never below the largest chunk. 0: no limit.
  int64_t moment_budget_locked(int64_t non_model);
  // Gives the store `bytes` as its device budget unless it has it already (tracked in store_budget_:
  // the scheduler is the only one that changes the budget of its store).
  void set_store_budget_locked(int64_t bytes);
  int64_t trace_non_model_peak_locked() const;  // max non-model bytes over the trace (0: no trace)

  mutable std::mutex mutex_;
  ChunkStore* store_;
  std::shared_ptr<OptEvictionPolicy> policy_;
  std::unique_ptr<MemoryProbe> probe_;
  std::shared_ptr<RemoteChunks> remote_;
  std::vector<std::vector<ChunkId>> release_at_;
  bool releases_planned_ = false;
  int64_t trace_version_ = 0;
  int64_t releases_allowed_for_ = -1;  // the trace version confirmed the same on every rank
  int64_t released_upto_ = 0;  // positions whose releases were made this iteration
  SchedulerOptions options_;
  std::vector<TensorId> tensor_of_param_;
  std::vector<ChunkId> chunk_of_param_;

  std::shared_ptr<AccessTrace> trace_;      // finalized trace in use (null before warm-up ends)
  std::shared_ptr<AccessTrace> recording_;  // trace being recorded this iteration (null if following)
  int64_t position_ = 0;
  int64_t iteration_ = 0;
  int warmups_done_ = 0;
  bool retrace_next_ = false;
  bool repack_wanted_ = false;
  bool in_iteration_ = false;
  bool diverged_ = false;
  int64_t optimal_bytes_ = -1;
  int64_t optimal_for_others_ = -1;  // other stores' device bytes optimal_bytes_ was computed with
  bool trace_forward_only_ = false;
  int64_t largest_chunk_bytes_ = 0;
  int64_t store_budget_ = 0;  // the device budget the store has now  // of the store's chunks: the floor of every moment's budget
  IterationStats current_;
  IterationStats last_;
  ChunkStoreStats at_begin_;
};

}  // namespace ferry
