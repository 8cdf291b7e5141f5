#pragma once
// The memory plan: which checkpointed segments keep their activations and how many optimizer state
// groups live on the device, decided together from measured costs, to minimise the predicted step time
// within the device's room. Policy only: numbers in, decisions out (the model applies the segments'
// decisions, hooks/activation_segments.h; the state placement the groups', optim/state_placement.h).
//
// Note [The step-time model of the memory plan]
// A plan is a set K of kept segments and a count m of state groups on the device (the first m groups
// this process holds, in layout order: Note [Which state goes to the device]). Measured with every
// segment recomputed: forward F and backward B (B includes every recompute); per segment k its saved
// activations a_k (bytes it would keep from forward to its backward) and recompute time r_k; per group g
// its state bytes s_g, its parameters' bytes p_g, its update's time on the host h_g (the host Adam's
// work) and on the device d_g, and t_g one way of its parameter chunk's trip between device and host
// (0 where it does not travel). Then
//     B(K) = B - sum_{k in K} r_k                          (a kept segment is not recomputed)
//     D(m) = sum of d_g over the first m held groups        (device updates, on the GPU's stream)
//     E    = B(K) + D(m)                                     (backward's end, the device updates in it)
// and the host updates of the other held groups on a timeline (revised 2026-11-28 from
// F + B(K) + D(m) + max(0, H(m) - W(K)), which counted every host update as hidden wherever the window
// had room for their sum: Note [The timeline of the host updates] in memory_plan.cpp). A group's share
// of forward and of backward is its share of the parameter bytes (equal shares when none is given):
// forward reaches group g at F x (share of the groups before g); backward, in reverse, finishes g at
// B(K) x (share of g and the groups after it). Group g's update can start t_g after that, on one host
// worker, one group at a time, in the order the groups finish. With host updates behind the next forward
// (host_behind_forward; Note [Host updates carried over behind the next forward]) those not started
// by E (the device's end of backward, where the engine takes them back: D89) are taken back and run in
// layout order after the one running; the next forward starts at E, and
// waits at each host group for its update and the trip back (done + t_g). Otherwise the step waits at
// its end for every host update. T(K, m) is when that forward ends (or F + max(E, the last host
// update's end)); the GPU's wait for the host is T - F - E.
// subject to sum_{k in K} a_k + sum_{first m} s_g <= room. Waiting at the step's end, T is
// non-decreasing in B(K) for a fixed m (a shorter backward only releases the host updates earlier), so
// the best K for that m saves the most recompute within room - S(m): a 0/1 knapsack, the same for every
// m except for its capacity. With the carry-over T may dip as B(K) grows (which updates have started at
// backward's end decides the order of the rest: a list schedule's anomaly), so every Pareto set is
// weighed.
//
// Solver. The exact one builds the Pareto front of the segments (kept bytes against saved seconds:
// every set no other set beats on both) once, then for every m takes the front's best entry within
// its capacity (with the carry-over: weighs each entry within it): O(n * front) time plus the weighing;
// identical segments (a transformer's blocks) keep the front at n + 1 entries, every set's saving. It
// is the model's optimum (`exact`) when waiting at the step's end or for identical segments; otherwise
// the best Pareto set per m, which a set off the front may beat by such a dip (bound_s: the GPU's own
// work at the front's largest saving). Beyond `max_front` entries (many distinct costs) the bounded
// heuristic takes over: per m, the better of greedy by saved seconds per byte and the best single
// segment, which saves at least half of the optimum's saving (the classic knapsack bound); the plan
// reports a lower bound on the optimal step time from the fractional relaxation (bound_s), so the gap
// is stated, not assumed.
#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

struct SegmentCost {
  int64_t saved_bytes = -1;  // activations kept from forward to backward if not recomputed (-1: not measured)
  double recompute_s = 0;    // the recompute's time in backward
};

struct GroupCost {
  int64_t state_bytes = 0;  // this process's optimizer state of the group (device bytes if placed there)
  double host_s = 0;        // its update on the host: the host Adam's work
  double device_s = 0;      // its update on the device
  bool held = true;         // this process holds its state (sharded: this rank owns it)
  int64_t param_bytes = 0;  // its parameters: its share of forward and backward (all 0: equal shares)
  double trip_s = 0;        // one way of its parameter chunk's trip to the host and back (0: it stays)
};

struct MemoryPlanInput {
  std::vector<SegmentCost> segments;  // in forward order; unmeasured ones are always recomputed
  std::vector<GroupCost> groups;      // in layout order
  // Device bytes for kept activations and device-resident state together, beyond the parameter chunks
  // and the non-model peak measured with every segment recomputed. -1: no limit.
  int64_t room_bytes = -1;
  double forward_s = 0;
  double backward_s = 0;               // with every segment recomputed
  bool host_behind_forward = false;    // host updates may run behind the next forward (the window grows)
  // Checked by plan_memory(): non-negative times and bytes, backward_s >= the recomputes' sum.
  void validate() const;
};

struct MemoryPlan {
  std::vector<char> keep;            // per segment: 1 keeps its activations, 0 recomputes them
  int64_t groups_on_device = 0;      // the first this many held groups
  int64_t kept_bytes = 0;            // sum of a_k over kept segments
  int64_t state_device_bytes = 0;    // sum of s_g over the groups on the device
  double predicted_step_s = 0;       // T(K, m)
  double host_wait_s = 0;            // of it, the GPU waiting for host updates: T - F - B(K) - D(m)
  double recompute_s = 0;            // the recompute left in backward
  double bound_s = 0;                // a lower bound on the optimum's T (== predicted_step_s when exact)
  bool pareto = true;                // the Pareto front answered (else the bounded heuristic)
  bool exact = true;                 // the model's optimum, proven (== bound_s)
  int64_t kept() const;
  std::string solver() const {
    return exact ? "exact (Pareto front)"
                 : pareto ? "best Pareto set per device count (carried-over updates)"
                          : "greedy + best single (>= 1/2 of the saving)";
  }
};

struct MemoryPlanOptions {
  int64_t max_front = int64_t{1} << 14;  // Pareto entries before the heuristic takes over
  // Step times weighed at most (front entries x device counts) where every entry is weighed (carried-
  // over host updates: Note [The timeline of the host updates]); beyond, each count's largest saving.
  int64_t max_weighed = int64_t{1} << 18;
};

// The plan minimising the modelled step time (Note [The step-time model of the memory plan]).
MemoryPlan plan_memory(const MemoryPlanInput& input, const MemoryPlanOptions& options = {});
// T(K, m) of the note for `keep` and `groups_on_device` (capacity not checked); the tests' brute force
// and the plan's report use it.
double predicted_step_s(const MemoryPlanInput& input, const std::vector<char>& keep, int64_t groups_on_device);
// The bytes a plan puts on the device: kept activations plus the state of the first `groups_on_device`
// held groups.
int64_t planned_device_bytes(const MemoryPlanInput& input, const std::vector<char>& keep, int64_t groups_on_device);

}  // namespace ferry
