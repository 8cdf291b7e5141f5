#include "joint_solves.h"

#include <c10/util/Exception.h>

namespace ferry {

void JointSolves::Options::validate() const {
  TORCH_CHECK(tolerance >= 0.0 && tolerance < 1.0, "JointSolves: tolerance must be in [0, 1), got ", tolerance);
  TORCH_CHECK(max_solves >= 1, "JointSolves: max_solves must be at least 1, got ", max_solves);
  TORCH_CHECK(settle_iterations >= 0, "JointSolves: settle_iterations must be >= 0, got ", settle_iterations);
}

JointSolves::JointSolves(Options options) : options_(options) {
  options_.validate();
  settle_left_ = options_.settle_iterations;
}

const char* to_string(JointSolves::State state) {
  switch (state) {
    case JointSolves::State::kUnsolved:
      return "unsolved";
    case JointSolves::State::kChecking:
      return "checking";
    case JointSolves::State::kSettled:
      return "settled";
  }
  return "?";
}

void JointSolves::transition(State to) {
  // unsolved -> checking | settled (solved); checking -> checking (solved again) | settled; any ->
  // unsolved (reset).
  const bool ok = to == State::kUnsolved || (state_ == State::kUnsolved && to != State::kUnsolved) ||
                  (state_ == State::kChecking && to != State::kUnsolved);
  TORCH_CHECK(ok, "JointSolves: no transition from ", to_string(state_), " to ", to_string(to));
  state_ = to;
}

bool JointSolves::may_solve() const {
  return (state_ == State::kUnsolved || state_ == State::kChecking) && settle_left_ == 0;
}

JointSolves::Decision JointSolves::decide(double in_steps) {
  TORCH_CHECK(in_steps >= 0.0, "JointSolves: a rate must be >= 0, got ", in_steps);
  TORCH_CHECK(!solve_pending_, "JointSolves: decide() again before solved() reported the solve it asked for");
  if (state_ == State::kSettled) {
    if (in_steps > 0) rate_under_plan_ = in_steps;
    return {};
  }
  if (settle_left_ > 0) {  // Note [Checking the host rate under the plan's own placement]
    --settle_left_;
    return {};
  }
  if (state_ == State::kUnsolved) {
    solve_pending_ = true;
    return {true, in_steps};
  }
  if (in_steps <= 0) {  // nothing ran on the host under a placement that hosts state: nothing to check
    transition(State::kSettled);
    return {};
  }
  rate_under_plan_ = in_steps;
  if (used_from_probe_ || in_steps < (1.0 - options_.tolerance) * used_rate_) {
    solve_pending_ = true;
    return {true, in_steps};
  }
  transition(State::kSettled);
  return {};
}

void JointSolves::solved(double host_rate, bool from_probe, bool hosts_state) {
  TORCH_CHECK(solve_pending_, "JointSolves: solved() without a decision to solve (state ", to_string(state_), ")");
  solve_pending_ = false;
  TORCH_CHECK(host_rate > 0.0, "JointSolves: a solve's host rate must be > 0, got ", host_rate);
  ++solves_;
  used_rate_ = host_rate;
  used_from_probe_ = from_probe;
  rate_under_plan_ = 0;
  settle_left_ = options_.settle_iterations;
  transition(hosts_state && solves_ < options_.max_solves ? State::kChecking : State::kSettled);
}

void JointSolves::failed() {
  TORCH_CHECK(solve_pending_, "JointSolves: failed() without a decision to solve (state ", to_string(state_), ")");
  solve_pending_ = false;
  transition(State::kSettled);
}

void JointSolves::reset() {
  transition(State::kUnsolved);
  solves_ = 0;
  solve_pending_ = false;
  settle_left_ = options_.settle_iterations;
  used_rate_ = 0;
  used_from_probe_ = false;
  rate_under_plan_ = 0;
}

}  // namespace ferry
