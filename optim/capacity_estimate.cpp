#include "capacity_estimate.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "../chunk/layout.h"
#include "../chunk/state_chunks.h"
#include "../scheduler/placement_policy.h"
#include "state_roles.h"

namespace ferry {

double CapacityEstimate::state_bytes_per_param() const {
  return params > 0 ? static_cast<double>(state_bytes) / static_cast<double>(params) : 0.0;
}

std::string CapacityEstimate::to_json() const {
  std::ostringstream o;
  o << "{\"params\": " << params << ", \"chunk_bytes\": " << chunk_bytes << ", \"num_chunks\": " << num_chunks
    << ", \"param_bytes\": " << param_bytes << ", \"state_bytes\": " << state_bytes
    << ", \"state_bytes_per_param\": " << state_bytes_per_param() << ", \"device_state_groups\": " << device_state_groups
    << ", \"device_state_bytes\": " << device_state_bytes << ", \"device_param_bytes\": " << device_param_bytes
    << ", \"device_bytes\": " << device_bytes() << ", \"host_param_bytes\": " << host_param_bytes
    << ", \"host_state_bytes\": " << host_state_bytes << ", \"round_trip_bytes\": " << round_trip_bytes
    << ", \"round_trip_slots\": " << round_trip_slots
    << ", \"host_bytes\": " << host_bytes() << "}";
  return o.str();
}

CapacityEstimate estimate_capacity(const CapacityQuery& q) {
  TORCH_CHECK(!q.param_numels.empty(), "ferry: estimate_capacity: expected the parameters' element counts, got none");
  for (size_t i = 0; i < q.param_numels.size(); ++i) {
    TORCH_CHECK(q.param_numels[i] > 0, "ferry: estimate_capacity: parameter ", i, " has ", q.param_numels[i],
                " elements; expected > 0");
  }
  TORCH_CHECK(q.device_room_bytes > 0, "ferry: estimate_capacity: expected the device's room for chunks in bytes "
              "(> 0), got ", q.device_room_bytes);
  TORCH_CHECK(q.compute_dtype == at::kBFloat16 || q.compute_dtype == at::kHalf || q.compute_dtype == at::kFloat,
              "ferry: estimate_capacity: the compute dtype must be bf16, fp16 or fp32, got ", q.compute_dtype);
  TORCH_CHECK(q.state_format != StateFormat::kCompact || q.compute_dtype != at::kFloat,
              "ferry: estimate_capacity: the compact state needs a 16-bit compute copy (bf16 or fp16), got fp32 "
              "(HybridAdam refuses it: its bf16 master would be coarser than the copy made from it)");
  TORCH_CHECK(q.chunk_bytes >= 0, "ferry: estimate_capacity: chunk_bytes must be >= 0 (0: auto), got ", q.chunk_bytes);
  TORCH_CHECK(q.round_trip_slots >= 0, "ferry: estimate_capacity: round_trip_slots must be >= 0 (0: no bound), got ",
              q.round_trip_slots);

  const int64_t elem = static_cast<int64_t>(c10::elementSize(q.compute_dtype));
  CapacityEstimate e;
  e.chunk_bytes = q.chunk_bytes > 0 ? q.chunk_bytes
                                    : auto_chunk_size(q.param_numels, {}, elem, auto_chunk_cap_bytes(q.device_room_bytes))
                                          .chunk_bytes;
  const ChunkLayout layout = ChunkLayout::pack(q.param_numels, {}, PackOptions::from_bytes(e.chunk_bytes, q.compute_dtype));
  const std::vector<int64_t> state =
      StateChunks::group_bytes_for(layout, optim::state_role_specs(q.state_format, q.accumulate_grads));

  PlacementInput input;
  input.room_bytes = q.device_room_bytes;
  input.params_travel = !q.accumulate_grads;
  for (int64_t g = 0; g < layout.num_chunks(); ++g) {
    const int64_t param = layout.chunks()[g].numel * elem;
    input.groups.push_back({param, state[g], /*held=*/true});
    e.param_bytes += param;
    e.state_bytes += state[g];
  }
  for (const int64_t n : q.param_numels) e.params += n;
  e.num_chunks = layout.num_chunks();

  const Placement placement = make_first_chunks_first_policy()->place(input);
  e.device_state_groups = placement.count();
  e.device_state_bytes = placement.device_bytes;
  e.host_state_bytes = e.state_bytes - e.device_state_bytes;
  // A parameter chunk's payload is in one place at a time: the device keeps what its room holds beside
  // the device state, the host the rest.
  e.host_param_bytes = std::max<int64_t>(0, e.param_bytes - (q.device_room_bytes - e.device_state_bytes));
  e.device_param_bytes = e.param_bytes - e.host_param_bytes;
  e.round_trip_slots = q.accumulate_grads ? 0 : q.round_trip_slots;  // HybridAdam bounds only the default mode's
  input.round_trip_slots = e.round_trip_slots;
  e.round_trip_bytes = host_cache_bytes_for(input, placement);
  return e;
}

}  // namespace ferry
