#pragma once
// JointSolves: when the joint placement of state and activations (scheduler/joint_placement.h) solves,
// and at which host-Adam rate. Policy only: the engine reports the rate its host updates reached in
// the steps since the last decision, and does the solving (Note [The joint placement], optim/engine.cpp).
//
// Note [Checking the host rate under the plan's own placement]
// The memory plan weighs each host update at one rate, measured in the steps before the solve. Those
// steps ran another placement: on the H200 at 6b the solve saw 168 GB/s in steps that updated 11 groups
// on the host, and put 38 there; that step then ran at its own placement's host-memory floor (0.99x
// of 0.767 s at the 119 GB/s probe's rate), a tie with all-recompute, where the plan had predicted
// 0.595 s: with more groups on the host their updates and their chunks' copies share the host's memory
// bandwidth, and each update runs slower. So a placement's rate is checked in its own steps: after a
// solve that leaves state on the host, the next decision compares the rate measured under it with the
// rate the solve used, and solves again at the measured rate where it is more than `tolerance` below
// (a plan that counted too much host work hidden), or where the solve had only the probe's rate (no host
// update had run before it). A rate at or above the one used settles the plan: a faster host would
// only hide more, and solving again on it could undo the correction that slowed it (the rates used
// therefore fall from one solve to the next; the number of solves is bounded by `max_solves`).
// The first `settle_iterations` iterations after a solve are not measured: the same H200 log shows the
// new placement's first iteration re-tracing with its parameter chunks not yet travelling (1.6 GiB
// moved against 10.7 steady) and the second running its host updates after backward (2.0 s), alone
// and so faster than in a steady step; the third was steady. Nor are the first iterations under the
// model's own plan, before the first solve, which weighs the backward of the iteration before it: the
// first under a new plan re-traces, and its backward on the device ran 0.05-0.06 s short of a steady
// one there (0.542 s with 2 segments kept against 0.59-0.61 s steady with none in the all-recompute
// run; 0.429 s against 0.48 s steady after the joint placement), moving less than a steady one (1.6
// GiB against 3.1 and 10.7): a backward too short by as much is a window too short for host updates.
// Why 5%: the traced call's 33 updates under a placement of 35 host groups averaged 133 GB/s, with a
// standard error of 2.5% (each 14% from the mean), against 147 GB/s used: a 9.4% fall, enough to move
// the plan (test_memory_plan.cpp). Beyond 5% is two standard errors there; a plan redone for noise
// costs one placement move and errs on the safe side (a lower rate puts more state on the device),
// where a rate left too high leaves the step bound by the host.
//
// Contract: not thread-safe (the engine calls it under its mutex). Per layout: reset(), then at each
// due point (an iteration under the current plan has run) decide(); where it says to solve, the engine
// solves and reports solved(). may_solve() says beforehand whether decide() can ask for a solve (the
// engine settles its running host updates only then).
#include <cstdint>

namespace ferry {

class JointSolves {
 public:
  struct Options {
    double tolerance = 0.05;  // solve again where the measured rate is below (1 - tolerance) x the used
    int64_t max_solves = 3;   // in one layout: the first and at most two corrections
    int64_t settle_iterations = 2;  // due points after a solve whose rate is not taken (the note)
    void validate() const;    // tolerance in [0, 1), max_solves >= 1, settle_iterations >= 0
  };
  enum class State {
    kUnsolved,  // no joint solve yet in this layout (the first settles too)
    kChecking,  // solved, its state partly on the host: the next decision checks the rate under it
    kSettled,   // no further solve in this layout
  };

  JointSolves() : JointSolves(Options{}) {}
  explicit JointSolves(Options options);

  struct Decision {
    bool solve = false;
    // The host-Adam rate to solve with; 0: none measured in the steps, the engine's probe gives it.
    double host_rate = 0;
  };
  // Whether the next decide() may ask for a solve (not while settling).
  bool may_solve() const;
  // At a due point: `in_steps` is the rate the host updates reached in the steps since the last
  // decision (0: none ran).
  Decision decide(double in_steps);
  // The engine solved as decide() said, at `host_rate` (the probe's where `from_probe`), and the new
  // placement `hosts_state` (some group left on the host).
  void solved(double host_rate, bool from_probe, bool hosts_state);
  // The solve decide() asked for threw: no further solve in this layout (the state stays where the
  // last placement put it; the error is the caller's to report).
  void failed();
  // A new layout: solving starts over.
  void reset();

  State state() const { return state_; }
  int64_t solves() const { return solves_; }
  // The host Adam's rate in the last measured steps under the last solve's placement (0: none yet).
  double rate_under_plan() const { return rate_under_plan_; }
  const Options& options() const { return options_; }

 private:
  void transition(State to);

  Options options_;
  State state_ = State::kUnsolved;
  int64_t solves_ = 0;
  int64_t settle_left_ = 0;
  bool solve_pending_ = false;  // decide() asked for a solve that solved() has not reported
  double used_rate_ = 0;
  bool used_from_probe_ = false;
  double rate_under_plan_ = 0;
};

const char* to_string(JointSolves::State state);

}  // namespace ferry
