#include "state_placement.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "../common/config.h"
#include "../cpu_adam/compact_state.h"
#include "../common/logging.h"

namespace ferry::optim {

std::vector<StateRoleSpec> state_role_specs(StateFormat format, bool accumulate_grads) {
  std::vector<StateRoleSpec> roles;
  if (format == StateFormat::kCompact) {
    roles = {{ChunkRole::kMaster, at::kBFloat16, /*zero=*/false},
             {ChunkRole::kExpAvg, at::kByte, /*zero=*/true},
             {ChunkRole::kExpAvgSq, at::kByte, /*zero=*/true}};
  } else {
    roles = {{ChunkRole::kMaster, at::kFloat, /*zero=*/false},
             {ChunkRole::kExpAvg, at::kFloat, /*zero=*/true},
             {ChunkRole::kExpAvgSq, at::kFloat, /*zero=*/true}};
  }
  if (accumulate_grads) roles.push_back({ChunkRole::kGrad, at::kFloat, /*zero=*/true});
  if (format == StateFormat::kCompact) {
    // Two fp32 scales per block: zero with the moments (a zero scale decodes every code as 0).
    roles.push_back({ChunkRole::kScales, at::kFloat, /*zero=*/true, kCompactStateBlock, /*per_block=*/2});
  }
  return roles;
}

StatePlacement::StatePlacement(std::shared_ptr<StateChunks> state) : state_(std::move(state)) {
  TORCH_INTERNAL_ASSERT(state_ != nullptr, "StatePlacement without state");
}

HostState StatePlacement::host_state(int64_t chunk, bool held, bool moments, const ChunkLayout& layout) {
  HostState s;
  TORCH_INTERNAL_ASSERT(held || !moments, "host Adam job for chunk ", chunk, ", not owned here");
  if (held) s.master_tensor = state_->payload(kMasterRole, chunk);
  if (!compact()) {
    if (held) s.master = s.master_tensor.data_ptr<float>();
    if (moments) {
      s.exp_avg = state_->payload(kExpAvgRole, chunk).data_ptr<float>();
      s.exp_avg_sq = state_->payload(kExpAvgSqRole, chunk).data_ptr<float>();
    }
    return s;
  }
  if (held) s.master16 = reinterpret_cast<uint16_t*>(s.master_tensor.data_ptr());
  if (!moments) return s;
  s.exp_avg8 = state_->payload(kExpAvgRole, chunk).data_ptr<uint8_t>();
  s.exp_avg_sq8 = state_->payload(kExpAvgSqRole, chunk).data_ptr<uint8_t>();
  const int sr = scales_role();
  float* scales = state_->payload(sr, chunk).data_ptr<float>();
  for (int64_t p : layout.chunks()[chunk].tensors) {
    const Slot& slot = layout.slots()[p];
    if (slot.numel == 0) continue;
    float* mine = scales + state_->store().tensor_info(state_->tensor(sr, p)).offset;
    // Packing order is offset order (ChunkLayout::pack), which adam_spans walks the pieces in.
    TORCH_INTERNAL_ASSERT(s.pieces.empty() || s.pieces.back().begin < slot.offset, "tensors of chunk ", chunk,
                          " out of offset order");
    // D86: an element's rounding bits follow it, not its place in the layout.
    s.pieces.push_back({slot.offset, slot.numel, mine, mine + compact_blocks(slot.numel),
                        static_cast<uint64_t>(slot.first_element)});
  }
  return s;
}

void StatePlacement::follow_layout(int64_t layout_version, int64_t num_chunks) {
  placed_ = false;  // the old state store's device bytes left with it (discharged from the accountant)
  replacements_ = 0;
  layout_version_ = layout_version;
  on_device_.assign(num_chunks, 0);
}

int64_t StatePlacement::num_on_device() const { return std::count(on_device_.begin(), on_device_.end(), 1); }

PlacementInput StatePlacement::input_of(ChunkedModel& model, const Ownership& ownership, bool params_travel,
                                        bool remote_params, int64_t* held) const {
  PlacementInput input;
  input.params_travel = params_travel;
  input.round_trip_slots = round_trip_slots_;
  input.remote_params = remote_params;
  *held = 0;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    StateGroup g;
    g.param_bytes = model.store().chunk_info(model.param_chunk(c)).nbytes;
    g.held = ownership.owned(c);
    g.state_bytes = g.held ? group_bytes(c) : 0;
    *held += g.held;
    input.groups.push_back(g);
  }
  return input;
}

void StatePlacement::grow_host_cache(ChunkedModel& model, int64_t bytes) const {
  if (bytes > 0) model.store().set_host_cache_bytes(std::max(model.store().host_cache_bytes(), bytes));
}

void StatePlacement::place(ChunkedModel& model, const PlacementPolicy& policy, const Ownership& ownership,
                           bool params_travel, bool remote_params) {
  // A forward-only trace lacks backward's memory; a backward_step whose forward came after the warm-up
  // but before any step (micro-batches, or a discarded first step) is inside one: its step places.
  if (placed_ || !model.scheduler().trace() || model.scheduler().trace_is_forward_only()) return;
  if (model.phase() != ModelPhase::kIdle) return;
  int64_t held = 0;
  const Placement placement =
      place_state(model.scheduler(), policy, input_of(model, ownership, params_travel, remote_params, &held));
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (!placement.on_device[c]) continue;
    state_->move_group(c, Location::kDevice);
    on_device_[c] = 1;
  }
  placed_ = true;
  grow_host_cache(model, placement.host_cache_bytes);
  const int64_t margin = placement.margin_bytes;
  log::info("ferry: HybridAdam placed optimizer state: ", placement.count(), " of ", held, " chunk groups on the device (",
            format_bytes(placement.device_bytes), ")", margin >= 0 ? ", margin after parameters and non-model peak " : "",
            margin >= 0 ? format_bytes(std::max<int64_t>(0, margin)) : std::string());
}

void StatePlacement::replace(ChunkedModel& model, const PlacementPolicy& policy, const Ownership& ownership,
                             bool params_travel, bool remote_params) {
  TORCH_INTERNAL_ASSERT(placed_, "StatePlacement::replace() before place()");
  TORCH_CHECK(model.phase() == ModelPhase::kIdle, "ferry: optimizer state is placed again between iterations; the model is in ",
              to_string(model.phase()));
  ++replacements_;
  int64_t held = 0;
  const Placement placement =
      decide_state_placement(model.scheduler(), policy, input_of(model, ownership, params_travel, remote_params, &held));
  int64_t left = 0, arriving = 0, arriving_bytes = 0;
  for (int64_t c = 0; c < num_chunks(); ++c) {  // out first: their device bytes make the others' room
    if (!on_device_[c] || placement.on_device[c]) continue;
    state_->move_group(c, Location::kHost);
    on_device_[c] = 0;
    ++left;
  }
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (placement.on_device[c] && !on_device_[c]) {
      ++arriving;
      arriving_bytes += group_bytes(c);
    }
  }
  // The parameter store's share of the budget follows the state's (also when state only left).
  model.scheduler().admit_device_bytes(arriving_bytes);
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (!placement.on_device[c] || on_device_[c]) continue;
    state_->move_group(c, Location::kDevice);
    on_device_[c] = 1;
  }
  grow_host_cache(model, placement.host_cache_bytes);
  log::info("ferry: HybridAdam placed optimizer state again (", policy.name(), "): ", num_on_device(), " of ", held,
            " chunk groups on the device (", left, " moved to the host, ", arriving, " to the device)");
}

}  // namespace ferry::optim
