#pragma once
// Where each group of optimizer state lives — on the device or on the host — decided once after the
// warm-up, when the trace says how much room chunks have at its worst moment. Policy only: a policy
// answers from numbers (room, bytes by role, measured rates) and never touches a store; place_state()
// makes the room it asks for on the device; the optimizer moves the groups (optim/state_placement.h).
// The seam where planners plug in: the activation plan and compact state add inputs here, not branches
// elsewhere.
//
// Note [Which state goes to the device]
// When only some state chunk groups fit on the device, the ones that go there are the first layout
// chunks (the first used in forward), and the host keeps the state of the last ones. In the
// pipelined step (Note [Pipelined step]) a host-state chunk's work (gradients to the host, host Adam,
// new values back) can start once the chunk is final in backward, and backward finalizes the chunks
// last-first: so the last chunks' host Adam starts with backward and has all of it to run, while the
// first chunks would become final only at its end, leaving their host Adam after it. Measured on the
// H100 at 12b with the opposite choice (2026-11-23, 57 of 181 groups on the device): the host Adam
// could start only after the device chunks' 31% of backward, and backward (2.37 s) ended with it.
// Until 2026-11-23 the choice was the opposite, a rule from the unpipelined step, where the order did
// not matter for the updates.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ferry {

class Scheduler;

// One layout chunk's group: its parameter chunk and its optimizer state.
struct StateGroup {
  int64_t param_bytes = 0;  // the parameter chunk's payload
  int64_t state_bytes = 0;  // the optimizer state this process holds for it (all roles: master, moments, ...)
  bool held = true;         // this process holds its state (sharded state: this rank owns it)
};

struct PlacementInput {
  std::vector<StateGroup> groups;  // in layout order, the order of forward after the warm-up repack
  // Device bytes for chunks (parameters and device-resident state together) at the trace's worst
  // moment: the device budget, capped at capacity - non-model peak when the capacity is known. 0: no
  // limit. place_state() fills it from the scheduler.
  int64_t room_bytes = 0;
  int64_t non_model_peak_bytes = -1;  // activations etc. at the worst moment (-1: unknown)
  // The parameter chunks of host-state groups travel to the host every step (their gradients) and back
  // (their new values): the host cache keeps that many buffers for reuse (default mode; accumulation
  // keeps its gradients in state chunks instead).
  bool params_travel = true;
  // Of those buffers at most this many of the largest parameter chunk (HybridAdamOptions::
  // round_trip_slots, Note [Round trips through K buffers] in optim/round_trips.h); 0: one per chunk.
  int64_t round_trip_slots = 0;
  // Sharded parameters: the chunks of groups not held here are fetched into host buffers every step.
  bool remote_params = false;
  // Measured rates, for planners that weigh host work against transfers (0: not measured).
  double host_adam_bytes_per_s = 0;
  double copy_bytes_per_s = 0;
};

struct Placement {
  std::vector<char> on_device;  // per group
  int64_t device_bytes = 0;     // state bytes placed on the device
  // Room left for state after every parameter chunk (-1: not computed: no limit, or a fixed count).
  int64_t margin_bytes = -1;
  // Host bytes of pinned buffers the parameter chunks' round trips need, so that they allocate
  // nothing per step (0: none needed).
  int64_t host_cache_bytes = 0;
  int64_t count() const;
};

class PlacementPolicy {
 public:
  virtual ~PlacementPolicy() = default;
  virtual std::string name() const = 0;
  // Where each group of `input` lives (on_device, device_bytes, margin_bytes); the host cache is
  // sized by place_state() from the answer.
  virtual Placement place(const PlacementInput& input) const = 0;
};

// The default: groups whose state this process holds go to the device, first layout chunks first
// (Note [Which state goes to the device]), while their state fits in room - every parameter chunk;
// everything when there is no limit.
std::unique_ptr<PlacementPolicy> make_first_chunks_first_policy();
// `count` groups (at most those held), first layout chunks first, whatever the room
// (HybridAdamOptions::device_state_chunks).
std::unique_ptr<PlacementPolicy> make_fixed_count_policy(int64_t count);

// The host buffers the parameter chunks' round trips need under `placement`: every travelling
// parameter chunk plus the largest one (0 when none travels).
int64_t host_cache_bytes_for(const PlacementInput& input, const Placement& placement);

// Decides with `policy` from the room `scheduler` leaves chunks at the trace's worst moment (filled
// into input.room_bytes) and makes that room on the device (Scheduler::admit_device_bytes evicts
// parameter chunks; it throws, changing nothing, if the state would leave less than the largest chunk).
// Between iterations, after the warm-up. The caller moves the groups where the answer says.
Placement place_state(Scheduler& scheduler, const PlacementPolicy& policy, PlacementInput input);
// The decision of place_state() without making room: for a placement made again (state already on the
// device), whose caller moves the leaving groups out first and then admits only the arriving bytes.
Placement decide_state_placement(const Scheduler& scheduler, const PlacementPolicy& policy, PlacementInput input);

}  // namespace ferry
