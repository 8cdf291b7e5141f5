#pragma once
// What a model needs of one GPU and its host with ferry, on paper: before building anything, from its
// parameters' sizes alone, where ferry would put every byte of its parameter chunks and optimizer state,
// and so whether a box holds it ("will 20b train on my H100 and 125 GiB of host?").
//
// The model is the one HybridAdam runs (D76's on-paper sums, checked against the H100: the 20b preset
// with compact state is 80.5 GiB of host here, its run's host RSS peak 82.3 GB): the parameters packed
// into chunks of the size ChunkedModel picks (auto_chunk_size, capped for device_room_bytes as D99
// caps it for the budget, unless given); each chunk's state group at its real bytes for the format
// (StateChunks::group_bytes_for: chunk padding and the compact scales in); the default placement
// policy (first chunks first) deciding which groups' state the device's room holds beside every
// parameter chunk; the parameter chunks the room then has no space for on the host;
// and the pinned buffers the host-state groups' parameter round trips keep (host_cache_bytes_for; with
// round_trip_slots, that many of the largest parameter chunk at most: Note [Round trips through K
// buffers], optim/round_trips.h).
// Where the device's room is short of the parameters, a chunk that both lives on the host and travels
// is counted in host_param_bytes and in round_trip_bytes: the host sum is then an upper bound (exact
// where the parameter chunks fit the device, as at 20b and 30b on an H100).
// What it cannot know, the caller gives: the device bytes left for chunks once activations, workspace
// and the CUDA context have theirs (a trace measures that after the warm-up; here it is an assumption).
// Not counted: the host's own use (the OS, libtorch, the CUDA context's pinned staging), and, with
// sharding across ranks, anything but one process holding everything (world size 1).
//
// Contract: pure arithmetic, no allocation of chunk memory; throws c10::Error (TORCH_CHECK) on bad input.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hybrid_adam_options.h"

namespace ferry {

struct CapacityQuery {
  std::vector<int64_t> param_numels;  // every parameter's element count (> 0), in call order where known
  int64_t device_room_bytes = 0;      // device bytes for chunks (> 0): the GPU's memory less the rest
  at::ScalarType compute_dtype = at::kBFloat16;  // the parameter chunks' dtype (Config::precision)
  StateFormat state_format = StateFormat::kFp32;
  bool accumulate_grads = false;  // fp32 gradient accumulation in the state (no parameter round trips)
  int64_t chunk_bytes = 0;        // 0: auto_chunk_size's choice, as ChunkedModel makes it
  int64_t round_trip_slots = 0;   // HybridAdamOptions::round_trip_slots (0: no bound)
};

struct CapacityEstimate {
  int64_t params = 0;
  int64_t chunk_bytes = 0;
  int64_t num_chunks = 0;
  int64_t param_bytes = 0;          // every parameter chunk (the compute copy, padding in)
  int64_t state_bytes = 0;          // every state group, all roles
  int64_t device_state_groups = 0;  // groups whose state the default policy puts on the device
  int64_t device_state_bytes = 0;
  int64_t device_param_bytes = 0;   // parameter chunks the device keeps beside that state
  int64_t host_param_bytes = 0;     // parameter chunks the device has no room for
  int64_t host_state_bytes = 0;
  int64_t round_trip_bytes = 0;     // pinned buffers for the host-state groups' parameter round trips
  int64_t round_trip_slots = 0;     // the query's bound on them (0: none)

  int64_t device_bytes() const { return device_param_bytes + device_state_bytes; }
  int64_t host_bytes() const { return host_param_bytes + host_state_bytes + round_trip_bytes; }
  double state_bytes_per_param() const;  // state only, beyond the compute copy
  // Whether the host's bytes for chunks fit `host_bytes_for_chunks` (the device's fit by construction).
  bool fits_host(int64_t host_bytes_for_chunks) const { return host_bytes() <= host_bytes_for_chunks; }
  // One JSON object, sizes in bytes.
  std::string to_json() const;
};

CapacityEstimate estimate_capacity(const CapacityQuery& query);

}  // namespace ferry
