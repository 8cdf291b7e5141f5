#pragma once
// StatePlacement: HybridAdam's optimizer state (StateChunks: per layout chunk a group of fp32 chunks —
// master, exp_avg, exp_avg_sq, and with accumulate_grads the accumulated gradient — that the model made
// and migrates with its repacks) and where each group lives. Until the model's warm-up has finished
// all state is on the host; at the first step after it, place() asks a PlacementPolicy (scheduler/
// placement_policy.h) from the room the trace leaves, moves the groups it puts on the device there, and
// sizes the parameter store's pinned host cache for the round trips of the others. A planner may
// decide once more (replace(): the joint placement after a steady iteration, Note [The joint
// placement], optim/engine.cpp). A repack starts it over (follow_layout).
//
// Contract: not thread-safe (HybridAdam's engine calls it under its mutex); the views it hands out
// (payload, view, host_state) are the optimizer's own work's, during backward too.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "../chunk/state_chunks.h"
#include "../hooks/chunked_model.h"
#include "../scheduler/placement_policy.h"
#include "ownership.h"
#include "state_roles.h"

namespace ferry::optim {

// One tensor of a layout chunk in the compact format: its elements [begin, begin + numel) of the chunk
// and its blocks' scales (StateChunks' scales role: exp_avg's, then exp_avg_sq's).
struct CompactPiece {
  int64_t begin = 0, numel = 0;
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  uint64_t stream_offset = 0;  // its first element's index in the rounding stream (Slot::first_element)
};

// A state group's arrays, where the group is (host, or device for a device update), for its update:
// fp32 master, exp_avg, exp_avg_sq, or the compact format's (null where not asked for or not held
// here), and the master as a tensor (undefined where not held: another rank's).
struct HostState {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  at::Tensor master_tensor;  // fp32, or bf16 in the compact format
  // The compact format: bf16 master bits, the moments' codes, per tensor its piece (offset order; with
  // the moments only).
  uint16_t* master16 = nullptr;
  uint8_t* exp_avg8 = nullptr;
  uint8_t* exp_avg_sq8 = nullptr;
  std::vector<CompactPiece> pieces;
  bool compact() const { return master16 != nullptr || exp_avg8 != nullptr; }
};

class StatePlacement {
 public:
  explicit StatePlacement(std::shared_ptr<StateChunks> state);

  StateChunks& state() { return *state_; }
  const StateChunks& state() const { return *state_; }
  at::Tensor payload(int role, int64_t chunk) { return state_->payload(role, chunk); }
  at::Tensor view(int role, int64_t param) { return state_->view(role, param); }
  // Chunk `chunk`'s arrays (of `layout`, the parameters') for its update, host or device: the master if
  // held, the moments (and in the compact format their scales) with `moments`.
  HostState host_state(int64_t chunk, bool held, bool moments, const ChunkLayout& layout);
  // The compact format (the master role is bf16), and its scales role.
  bool compact() const { return is_compact(*state_); }
  int scales_role() const { return optim::scales_role(*state_); }

  // The model's layout (version `layout_version`, `num_chunks` layout chunks) is the state's now: every
  // group on the host's books, placement to be decided again (the old state store's device bytes left
  // with it). Only with no host update running.
  void follow_layout(int64_t layout_version, int64_t num_chunks);
  int64_t layout_version() const { return layout_version_; }
  int64_t num_chunks() const { return static_cast<int64_t>(on_device_.size()); }

  // Decides (once per layout, after a training warm-up, between iterations: the room it reserves may
  // need evictions) and moves: `policy` over the groups `ownership` says this rank holds. `params_travel`
  // and `remote_params` as PlacementInput's. Logs what it placed.
  void place(ChunkedModel& model, const PlacementPolicy& policy, const Ownership& ownership, bool params_travel,
             bool remote_params);
  bool placed() const { return placed_; }
  // Round trips through K buffers (HostJobs::set_round_trip_slots): the host cache place() grows keeps
  // K of the largest parameter chunk at most (PlacementInput::round_trip_slots). 0: none.
  void set_round_trip_slots(int64_t slots) { round_trip_slots_ = slots; }
  // Decides again with `policy` (after place(), in the same layout; between iterations, with no host
  // update running) and moves the groups whose place changed: those leaving the device first, then
  // room for the arriving ones (Scheduler::admit_device_bytes; it throws if they cannot fit, with the
  // leaving ones already on the host: consistent, and the placement is that far), then those. Grows
  // the host cache for the round trips of the groups now on the host.
  void replace(ChunkedModel& model, const PlacementPolicy& policy, const Ownership& ownership, bool params_travel,
               bool remote_params);
  int64_t replacements() const { return replacements_; }  // replace() calls since place()
  bool on_device(int64_t chunk) const { return on_device_[chunk] != 0; }
  int64_t num_on_device() const;
  int64_t group_bytes(int64_t chunk) const { return state_->group_bytes(chunk); }

 private:
  std::shared_ptr<StateChunks> state_;
  int64_t layout_version_ = -1;
  std::vector<char> on_device_;  // per layout chunk
  bool placed_ = false;
  int64_t replacements_ = 0;
  int64_t round_trip_slots_ = 0;
  PlacementInput input_of(ChunkedModel& model, const Ownership& ownership, bool params_travel, bool remote_params,
                          int64_t* held) const;
  void grow_host_cache(ChunkedModel& model, int64_t bytes) const;
};

}  // namespace ferry::optim
