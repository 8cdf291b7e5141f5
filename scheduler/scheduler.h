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
//  - Afterwards every pre_use aligns the parameter against the trace (TraceState, Note [A run that
//    departs from its trace]): a use the trace has a little ahead or behind (a layer skipped, uses in
//    another order) keeps OPT and prefetch going from there; a use it lacks is served on demand; the
//    iteration's end merges such departures into the trace. When the uses stop resembling the trace (or,
//    with sharded parameters, at any difference) the scheduler warns once, switches to LRU for the rest
//    of the iteration and records the next iteration as a new trace.
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
#include "iteration_floor.h"
#include "iteration_stats.h"
#include "memory_probe.h"
#include "moment_budget.h"
#include "opt_policy.h"
#include "release_plan.h"
#include "remote_chunks.h"
#include "trace_state.h"

namespace ferry {

struct SchedulerOptions {
  int warmup_iterations = 1;      // iterations recorded before the trace is used (>= 1)
  int prefetch_depth = 2;         // distinct chunks ahead to start moving in (0: no prefetch)
  int64_t prefetch_window = 256;  // trace positions searched for them
  int64_t non_model_window = 4;   // positions ahead whose non-model peak the budget reserves
  // Uses that differ from the trace are aligned against it (Note [A run that departs from its trace]),
  // sharded parameters too (D108). false: strict, any difference gives the trace up for the rest of the
  // iteration and re-traces (as before D98).
  bool align_to_trace = true;
  // The DeviceBudget (chunk/device.h; ChunkedModel sets both from the one it makes of its Config):
  // device bytes for chunks of every store: parameters + state (0: no limit).
  int64_t device_budget_bytes = 0;
  // The device's memory for chunks and non-model memory (activations, temporaries) together; while the
  // trace is followed, the chunk budget at each moment is also capped at capacity - other stores' device bytes -
  // the non-model peak recorded a few positions ahead (MomentBudget). 0: unknown, the chunk budget alone limits.
  int64_t device_capacity_bytes = 0;
  // Sharded parameters (set_remote): give a group of remote chunks up after its last forward use when its
  // next use (in backward) is at least `reshard_min_gap` trace positions later, and fetch it again
  // ahead of that use: the compute copy a rank holds stays near the groups in use, for one more
  // all-gather of those groups per step. Off (or a nearer next use): kept until the step releases it.
  bool reshard_after_forward = true;
  int64_t reshard_min_gap = 16;
  // Measure each iteration's own floor (IterationStats::floor_bytes, IterationFloor): a record of each use
  // and one Belady pass at the iteration's end. A benchmark's measure; off in training.
  bool measure_iteration_floor = false;
  // Checked by the Scheduler's constructor (and by ChunkedModel before it touches the module).
  void validate() const;
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
  // The model says, ahead, that this iteration's forward will not use `params` (indices; a block it
  // skips, ferry::will_skip): while the trace is followed aligning, prefetch and OPT pass their trace
  // positions over, forward and backward (Note [Skips said ahead], trace_alignment.h). A parameter used
  // anyway is served as any use (on demand if its chunk went): a wrong hint costs moves, never a
  // result. Ignored outside an iteration, in backward, while recording or strict, and for a parameter
  // this iteration used already. Fails for an index out of range. With sharded parameters every rank
  // must say the same, at the same point of its uses: prefetches are gathers, collectives (a rank that
  // differs fails at its next gather, ParamShards).
  void will_not_use(const std::vector<int64_t>& params);
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

  // The parameter chunks whose update runs on the host (one entry per chunk; empty: none). Each leaves
  // the device once per iteration after its last use and comes back for its first: the Belady
  // reference (IterationStats::optimal_bytes) counts those round trips from the next iteration on
  // (Note [The step's round trips in the reference]). The optimizer says so after each step; a
  // relayout clears it.
  void set_round_trips(std::vector<char> chunks);

  bool following_trace() const;
  // The caller changed what iterations do (which segments recompute, hence which uses backward makes
  // and the non-model memory at each moment): the next iteration records a new trace. Between iterations.
  void retrace();
  std::shared_ptr<const AccessTrace> trace() const;
  IterationStats last_iteration() const;
  int64_t iterations() const;

 private:
  void finalize_trace_locked();
  void prefetch_locked(int64_t position);
  // Gives the store the chunk budget of the use at `position` (MomentBudget::at_moment); returns it.
  int64_t apply_budget_locked(int64_t position);
  int64_t non_model_now_locked();
  int64_t trace_non_model_peak_locked() const;  // max non-model bytes over the trace (0: no trace)
  // Sharded parameters: gives up the groups planned up to `position` (ReleasePlan), when the trace
  // followed is one every rank confirmed.
  void release_until_locked(int64_t position);

  mutable std::mutex mutex_;
  ChunkStore* store_;
  std::shared_ptr<OptEvictionPolicy> policy_;
  std::unique_ptr<MemoryProbe> probe_;
  std::shared_ptr<RemoteChunks> remote_;
  SchedulerOptions options_;
  std::vector<TensorId> tensor_of_param_;
  std::vector<ChunkId> chunk_of_param_;
  std::vector<char> round_trips_;  // set_round_trips
  bool optimal_stale_ = false;     // round_trips_ changed since the reference was computed
  bool in_iteration_ = false;
  // The parameters between pre_use and post_use (one used twice at once: twice); the trace records
  // them with each use, so the reference keeps their chunks on the device through it (D104).
  std::vector<int64_t> in_use_;
  TraceState trace_;       // the trace through warm-up, following, divergence and re-trace
  MomentBudget budget_;    // the parameter chunks' device budget at each moment
  ReleasePlan releases_;   // sharded parameters: groups given up after their forward uses
  IterationMeter meter_;   // this iteration's counters, and the last one's
  IterationFloor floor_;   // measure_iteration_floor: this iteration's uses, for its own floor
};

}  // namespace ferry
