#pragma once
// What the ranks of a data-parallel run agree on before each makes the same activation plan
// (Note [An activation plan agreed across ranks]).
//
// Note [An activation plan agreed across ranks]
// Under activations=auto every rank measures its own segments, and a rank that kept a segment another
// recomputes would use the segment's parameters in backward at other moments: its scheduler's trace,
// and with it the order of its groups' gathers (collectives), would differ from the others'. So the
// ranks plan at the same moment from the same numbers, and each solves the same deterministic problem
// (scheduler/memory_plan.h) into the same plan:
//  - when: at the end of every training iteration each rank votes (vote_on_plan, one all-reduce of
//    four numbers): it is ready (its layout is final, its warm-up over) and whether it wants a plan
//    (none yet, or its inputs grew or shrank: hooks/activation_segments.h). A plan is made when every
//    rank is ready and one wants it, on every rank, so a shape that changed on one rank re-plans all;
//    ranks whose forwards ran different counts of segments make no new plan (warned: they could not
//    agree on what a plan is about) and keep the one they have (none yet: every segment recomputed);
//  - from what: agree_plan_input, one all-reduce (max) over every number of the input, taken
//    pessimistically: the smallest room, the largest saved bytes and recompute per segment, the
//    slowest forward and backward, a segment unmeasured anywhere unmeasured. The plan then fits every
//    rank's device and predicts the slowest rank's step, which is the step a data-parallel run takes.
// Cost: one all-reduce of 4 doubles per training iteration (and one of 5 + 3 per segment at a plan),
// from the training thread at the end of backward, where the step's own collectives are many chunk-
// sized ones (a latency, not a bandwidth, cost; not measured apart). A segment whose inputs grow inside a forward on one rank still recomputes there at once
// (memory first; hooks/activation_segments.h) before the vote re-plans every rank: that one backward
// then uses the segment's parameters in its recompute too, the same groups in the same order.
#include <cstdint>

#include "../scheduler/memory_plan.h"
#include "communicator.h"

namespace ferry::dist {

struct PlanVote {
  bool ready = false;    // this rank could plan now
  bool wanted = false;   // this rank wants a plan
  int64_t segments = 0;  // the checkpoint segments of its last forward
};

struct PlanVotes {
  bool all_ready = false;
  bool any_wanted = false;
  int64_t min_segments = 0, max_segments = 0;
  bool same_segments() const { return min_segments == max_segments; }
  // Whether every rank makes a plan now.
  bool plan() const { return all_ready && any_wanted && same_segments(); }
};

// Every rank's vote, combined; the same on every rank. A collective.
PlanVotes vote_on_plan(Communicator& comm, const PlanVote& mine);

// The input every rank solves (the note's pessimistic combination); the same on every rank. A
// collective: every rank passes the same number of segments (vote_on_plan checked it) and no state
// groups (the state's placement is decided per rank, Note [The joint placement], optim/engine.cpp).
MemoryPlanInput agree_plan_input(Communicator& comm, const MemoryPlanInput& mine);

// The two halves of agree_plan_input around its all-reduce, for the tests: an input as numbers whose
// element-wise maximum over ranks is the agreed input's encoding, and back.
at::Tensor encode_for_max(const MemoryPlanInput& input);
MemoryPlanInput decode_max(const at::Tensor& encoded);

}  // namespace ferry::dist
