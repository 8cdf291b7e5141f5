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
// its state bytes s_g and its update time on the host h_g (host Adam plus the parameter chunk's round
// trip) and on the device d_g. Then
//     B(K) = B - sum_{k in K} r_k                           (a kept segment is not recomputed)
//     H(m) = sum of h_g over held groups past the first m   (host updates)
//     D(m) = sum of d_g over the first m held groups         (device updates, on the GPU's stream)
//     W(K) = B(K) (+ F when host updates may run behind the next forward)
//     T(K, m) = F + B(K) + D(m) + max(0, H(m) - W(K))        (host work hides behind the window)
// subject to sum_{k in K} a_k + sum_{first m} s_g <= room. For a fixed m, T is non-decreasing in B(K),
// so the best K for that m is the one that saves the most recompute within room - S(m): a 0/1
// knapsack, the same for every m except for its capacity.
//
// Solver. The exact one builds the Pareto front of the segments (kept bytes against saved seconds:
// every set no other set beats on both) once, then for every m takes the front's best entry within
// its capacity: optimal for the model, O(n * front) time; identical segments (a transformer's blocks)
// keep the front at n + 1 entries. Beyond `max_front` entries (many distinct costs) the bounded
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
  double host_s = 0;        // its update on the host: host Adam and the parameter chunk's round trip
  double device_s = 0;      // its update on the device
  bool held = true;         // this process holds its state (sharded: this rank owns it)
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
  double recompute_s = 0;            // the recompute left in backward
  double bound_s = 0;                // a lower bound on the optimum's T (== predicted_step_s when exact)
  bool exact = true;                 // the exact solver answered (else the bounded heuristic)
  int64_t kept() const;
  std::string solver() const { return exact ? "exact (Pareto front)" : "greedy + best single (>= 1/2 of the saving)"; }
};

struct MemoryPlanOptions {
  int64_t max_front = int64_t{1} << 14;  // Pareto entries before the heuristic takes over
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
