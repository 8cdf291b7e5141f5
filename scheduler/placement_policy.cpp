#include "placement_policy.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "scheduler.h"

namespace ferry {
namespace {

class FirstChunksFirst final : public PlacementPolicy {
 public:
  std::string name() const override { return "first chunks first"; }
  Placement place(const PlacementInput& input) const override {
    const int64_t n = static_cast<int64_t>(input.groups.size());
    Placement out;
    out.on_device.assign(n, 0);
    if (input.room_bytes == 0) {  // no limit: everything held here
      for (int64_t g = 0; g < n; ++g) {
        if (!input.groups[g].held) continue;
        out.on_device[g] = 1;
        out.device_bytes += input.groups[g].state_bytes;
      }
      return out;
    }
    int64_t param_bytes = 0;
    for (const StateGroup& g : input.groups) param_bytes += g.param_bytes;
    out.margin_bytes = input.room_bytes - param_bytes;
    // First layout chunks first; the first held group that does not fit ends it (the state of the last
    // chunks is the host's, Note [Which state goes to the device]).
    for (int64_t g = 0; g < n; ++g) {
      if (!input.groups[g].held) continue;
      if (out.device_bytes + input.groups[g].state_bytes > out.margin_bytes) break;
      out.on_device[g] = 1;
      out.device_bytes += input.groups[g].state_bytes;
    }
    return out;
  }
};

class FixedCount final : public PlacementPolicy {
 public:
  explicit FixedCount(int64_t count) : count_(count) {
    TORCH_CHECK(count >= 0, "ferry: a fixed count of device state groups must be >= 0, got ", count);
  }
  std::string name() const override { return "fixed count " + std::to_string(count_); }
  Placement place(const PlacementInput& input) const override {
    const int64_t n = static_cast<int64_t>(input.groups.size());
    Placement out;
    out.on_device.assign(n, 0);
    int64_t placed = 0;
    for (int64_t g = 0; g < n && placed < count_; ++g) {
      if (!input.groups[g].held) continue;
      out.on_device[g] = 1;
      out.device_bytes += input.groups[g].state_bytes;
      ++placed;
    }
    return out;
  }

 private:
  int64_t count_;
};

}  // namespace

int64_t Placement::count() const { return std::count(on_device.begin(), on_device.end(), 1); }

std::unique_ptr<PlacementPolicy> make_first_chunks_first_policy() { return std::make_unique<FirstChunksFirst>(); }

std::unique_ptr<PlacementPolicy> make_fixed_count_policy(int64_t count) { return std::make_unique<FixedCount>(count); }

int64_t host_cache_bytes_for(const PlacementInput& input, const Placement& placement) {
  if (!input.params_travel) return 0;
  int64_t travelling = 0, largest = 0;
  for (size_t g = 0; g < input.groups.size(); ++g) {
    const StateGroup& group = input.groups[g];
    largest = std::max(largest, group.param_bytes);
    if (!placement.on_device[g] && group.held) travelling += group.param_bytes;
    if (input.remote_params && !group.held) travelling += group.param_bytes;  // fetched into host buffers every step
  }
  if (travelling == 0) return 0;
  const int64_t unbounded = travelling + largest;
  return input.round_trip_slots > 0 ? std::min(unbounded, input.round_trip_slots * largest) : unbounded;
}

Placement decide_state_placement(const Scheduler& scheduler, const PlacementPolicy& policy, PlacementInput input) {
  input.room_bytes = scheduler.device_room_bytes();
  input.non_model_peak_bytes = scheduler.non_model_peak();
  Placement placement = policy.place(input);
  TORCH_INTERNAL_ASSERT(placement.on_device.size() == input.groups.size(), "placement policy ", policy.name(),
                        " answered for ", placement.on_device.size(), " groups, asked for ", input.groups.size());
  placement.host_cache_bytes = host_cache_bytes_for(input, placement);
  return placement;
}

Placement place_state(Scheduler& scheduler, const PlacementPolicy& policy, PlacementInput input) {
  Placement placement = decide_state_placement(scheduler, policy, std::move(input));
  scheduler.admit_device_bytes(placement.device_bytes);  // evicts parameter chunks; throws, changing nothing
  return placement;
}

}  // namespace ferry
