#pragma once
// MomentBudget: the parameter chunks' device budget at each moment of an iteration, from the model's
// DeviceBudget (chunk/device.h: the budget of every store sharing the device accountant, and the
// device's capacity for chunks and non-model memory together).
//
//  - The chunk budget: the device budget minus what the other stores (device-resident optimizer state)
//    hold there now; 0 when there is no budget.
//  - At a moment with a known non-model peak ahead (while the trace is followed): also capped at
//    capacity - other stores' bytes - that peak, never below the largest chunk (said once in the log:
//    the device may then run out of memory).
//  - The room a repack may build chunks in on the device (device_room_bytes): the budget, capped at
//    capacity - the trace's non-model peak.
//  - Admitting another store's bytes (optimizer state placed on the device): the budget left must hold
//    the largest chunk.
// It also gives the store its budget (only when it changes: the per-use path makes no store call
// otherwise; the scheduler is the only one that changes its store's budget) and keeps the Belady
// reference of the trace at this budget (optimal_bytes, recomputed when other stores' bytes change).
//
// Contract: not thread-safe (the Scheduler calls it with its mutex held). Bytes throughout; "others"
// are ChunkStore::device_bytes_elsewhere() of the store passed in.
#include <cstdint>

#include "../chunk/chunk_store.h"
#include "../chunk/device.h"

namespace ferry {

class MomentBudget {
 public:
  // `store_budget_bytes`: the budget the parameter store has now.
  MomentBudget(DeviceBudget budget, int64_t store_budget_bytes);

  const DeviceBudget& device_budget() const { return budget_; }
  // The device budget minus the other stores' device bytes, at least 1 (0: no limit).
  int64_t chunk_budget(const ChunkStore& store) const;
  // The chunk budget at a moment with `non_model` bytes of non-model memory (-1: unknown), capped by
  // the capacity's room, never below the largest chunk. 0: no limit.
  int64_t at_moment(int64_t non_model, const ChunkStore& store) const;
  // Device bytes for chunks of every store at the moment of the trace's worst non-model peak: the
  // budget, capped at capacity - `non_model_peak` when the capacity is known. 0: no limit.
  int64_t room_at_worst(int64_t non_model_peak) const;
  // The parameter store's budget once another store puts `bytes` more on the device; fails, naming
  // the numbers, when that leaves less than the largest chunk. 0 when there is no budget.
  int64_t admitting(int64_t bytes, const ChunkStore& store) const;

  // Gives `store` `bytes` as its device budget unless it has it already (evicting by policy down to
  // it; on OutOfMemoryError the store keeps its budget and so does this record).
  void apply(ChunkStore& store, int64_t bytes);
  // The store was replaced (a repack): its budget is `bytes`.
  void store_replaced(int64_t store_budget_bytes) { store_budget_ = store_budget_bytes; }
  int64_t store_budget() const { return store_budget_; }
  // Of the store's chunks: the floor of every moment's budget. Set when a trace is finalized.
  void set_largest_chunk(int64_t bytes) { largest_chunk_bytes_ = bytes; }
  int64_t largest_chunk() const { return largest_chunk_bytes_; }

  // Belady moves of the trace at this budget (-1: no trace yet), computed with `others` device bytes
  // of the other stores; stale once they hold another amount.
  void set_optimal(int64_t bytes, int64_t others) {
    optimal_bytes_ = bytes;
    optimal_for_others_ = others;
  }
  int64_t optimal_bytes() const { return optimal_bytes_; }
  bool optimal_stale(int64_t others) const { return others != optimal_for_others_; }

 private:
  DeviceBudget budget_;
  int64_t store_budget_ = 0;  // the device budget the store has now
  int64_t largest_chunk_bytes_ = 0;
  int64_t optimal_bytes_ = -1;
  int64_t optimal_for_others_ = -1;  // other stores' device bytes optimal_bytes_ was computed with
};

}  // namespace ferry
