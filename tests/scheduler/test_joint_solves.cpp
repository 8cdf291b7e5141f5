// JointSolves (scheduler/joint_solves.h): the first decision after the settle iterations solves (at the
// rate measured in the steps, or the probe's where none); after a solve that hosts state the settle iterations' rates are not taken,
// then a rate more than the tolerance below the one used solves again at the measured rate, one at or
// above it (or within the tolerance) settles; a solve made at the probe's rate is redone at the measured
// one either way; the solves are bounded; a placement with nothing on the host settles at once; reset
// starts over; bad options and out-of-order calls are refused.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include "../../scheduler/joint_solves.h"

namespace ferry {
namespace {

using State = JointSolves::State;

JointSolves::Options no_settling() {
  JointSolves::Options o;
  o.settle_iterations = 0;
  return o;
}

TEST(JointSolves, TheFirstSolveWaitsForSettledIterationsUnderTheModelsPlan) {
  JointSolves a;  // settle_iterations = 2 by default
  EXPECT_FALSE(a.may_solve());
  EXPECT_FALSE(a.decide(300e9).solve) << "the first iteration under the model's plan re-traces";
  EXPECT_FALSE(a.decide(300e9).solve);
  EXPECT_TRUE(a.may_solve());
  const JointSolves::Decision d = a.decide(150e9);
  EXPECT_TRUE(d.solve);
  EXPECT_EQ(d.host_rate, 150e9) << "the settled iteration's rate, not the ones before";
}

TEST(JointSolves, TheFirstDecisionSolvesAtTheRateInTheStepsOrAsksForTheProbe) {
  JointSolves a(no_settling());
  EXPECT_TRUE(a.may_solve());
  JointSolves::Decision d = a.decide(150e9);
  EXPECT_TRUE(d.solve);
  EXPECT_EQ(d.host_rate, 150e9);
  JointSolves b(no_settling());
  d = b.decide(0);
  EXPECT_TRUE(d.solve);
  EXPECT_EQ(d.host_rate, 0) << "no host update ran: the engine's probe gives the rate";
}

TEST(JointSolves, TheSettleIterationsRatesAreNotTaken) {
  JointSolves s;  // settle_iterations = 2 by default
  s.decide(0);
  s.decide(0);
  ASSERT_TRUE(s.decide(168e9).solve);
  s.solved(168e9, false, true);
  EXPECT_EQ(s.state(), State::kChecking);
  EXPECT_FALSE(s.may_solve());
  EXPECT_FALSE(s.decide(200e9).solve) << "the new placement's first iteration";
  EXPECT_FALSE(s.decide(50e9).solve) << "its second: a slow rate there does not count either";
  EXPECT_EQ(s.rate_under_plan(), 0);
  EXPECT_TRUE(s.may_solve());
  const JointSolves::Decision d = s.decide(120e9);  // the H200's 6b case: 168 used, ~120 under the plan
  EXPECT_TRUE(d.solve);
  EXPECT_EQ(d.host_rate, 120e9);
  EXPECT_EQ(s.rate_under_plan(), 120e9);
}

TEST(JointSolves, ARateWithinTheToleranceOrAboveSettles) {
  for (const double measured : {0.96 * 100e9, 100e9, 180e9}) {
    JointSolves s(no_settling());
    ASSERT_TRUE(s.decide(100e9).solve);
    s.solved(100e9, false, true);
    EXPECT_FALSE(s.decide(measured).solve) << measured;
    EXPECT_EQ(s.state(), State::kSettled) << measured;
    EXPECT_EQ(s.solves(), 1);
    EXPECT_EQ(s.rate_under_plan(), measured);
    EXPECT_FALSE(s.may_solve());
    EXPECT_FALSE(s.decide(10e9).solve) << "settled: never again in this layout";
    EXPECT_EQ(s.rate_under_plan(), 10e9) << "the rate under the plan is still reported";
    EXPECT_FALSE(s.decide(0).solve);
    EXPECT_EQ(s.rate_under_plan(), 10e9) << "a step without host updates leaves it";
  }
  JointSolves s(no_settling());
  s.decide(100e9);
  s.solved(100e9, false, true);
  EXPECT_TRUE(s.decide(0.94 * 100e9).solve) << "just beyond the tolerance";
}

TEST(JointSolves, AProbesRateIsRedoneAtTheMeasuredOneEitherWay) {
  for (const double measured : {50e9, 300e9}) {
    JointSolves s(no_settling());
    ASSERT_EQ(s.decide(0).host_rate, 0);
    s.solved(130e9, /*from_probe=*/true, true);
    const JointSolves::Decision d = s.decide(measured);
    EXPECT_TRUE(d.solve) << measured;
    EXPECT_EQ(d.host_rate, measured);
    s.solved(measured, false, true);
    EXPECT_FALSE(s.decide(measured).solve) << "now measured in the steps: it stands";
    EXPECT_EQ(s.solves(), 2);
  }
}

TEST(JointSolves, TheSolvesAreBoundedAndTheirRatesFall) {
  JointSolves s(no_settling());
  double rate = 200e9;
  s.decide(rate);
  s.solved(rate, false, true);
  int64_t solves = 1;
  for (int k = 0; k < 10; ++k) {
    rate *= 0.5;  // every placement slower than the one before
    const JointSolves::Decision d = s.decide(rate);
    if (!d.solve) break;
    EXPECT_EQ(d.host_rate, rate);
    s.solved(d.host_rate, false, true);
    ++solves;
  }
  EXPECT_EQ(solves, s.options().max_solves);
  EXPECT_EQ(s.solves(), 3);
  EXPECT_EQ(s.state(), State::kSettled);
}

TEST(JointSolves, NothingOnTheHostOrNothingMeasuredSettles) {
  JointSolves a(no_settling());
  a.decide(0);
  a.solved(130e9, true, /*hosts_state=*/false);
  EXPECT_EQ(a.state(), State::kSettled) << "every group on the device: no host rate matters";
  JointSolves b(no_settling());
  b.decide(100e9);
  b.solved(100e9, false, true);
  EXPECT_FALSE(b.decide(0).solve);
  EXPECT_EQ(b.state(), State::kSettled) << "state on the host but no update ran: nothing to check";
}

TEST(JointSolves, ResetStartsOver) {
  JointSolves s(no_settling());
  s.decide(100e9);
  s.solved(100e9, false, true);
  s.decide(100e9);
  ASSERT_EQ(s.state(), State::kSettled);
  s.reset();
  EXPECT_EQ(s.state(), State::kUnsolved);
  EXPECT_EQ(s.solves(), 0);
  EXPECT_EQ(s.rate_under_plan(), 0);
  EXPECT_TRUE(s.decide(80e9).solve);
  JointSolves t;  // with settling: a new layout settles again before its first solve
  t.decide(0);
  t.decide(0);
  t.decide(100e9);
  t.solved(100e9, false, false);
  t.reset();
  EXPECT_FALSE(t.may_solve());
  EXPECT_FALSE(t.decide(80e9).solve);
}

TEST(JointSolves, BadOptionsAndCallsOutOfOrderAreRefused) {
  JointSolves::Options o;
  o.tolerance = 1.0;
  EXPECT_THROW(JointSolves{o}, c10::Error);
  o = {};
  o.tolerance = -0.1;
  EXPECT_THROW(JointSolves{o}, c10::Error);
  o = {};
  o.max_solves = 0;
  EXPECT_THROW(JointSolves{o}, c10::Error);
  o = {};
  o.settle_iterations = -1;
  EXPECT_THROW(JointSolves{o}, c10::Error);
  JointSolves s(no_settling());
  EXPECT_THROW(s.decide(-1.0), c10::Error);
  EXPECT_THROW(s.solved(0.0, false, true), c10::Error) << "a solve needs a rate";
  JointSolves settling;
  EXPECT_THROW(settling.solved(100e9, false, true), c10::Error) << "while settling: no decision to solve";
  ASSERT_TRUE(s.decide(100e9).solve);
  EXPECT_THROW(s.decide(100e9), c10::Error) << "a solve asked for and not reported";
  s.solved(100e9, false, true);
  EXPECT_THROW(s.solved(100e9, false, true), c10::Error) << "reported twice";
  EXPECT_THROW(s.failed(), c10::Error) << "no solve asked for";
  JointSolves f(no_settling());
  ASSERT_TRUE(f.decide(100e9).solve);
  f.failed();
  EXPECT_EQ(f.state(), State::kSettled) << "a solve that threw is not retried every step";
  EXPECT_FALSE(f.decide(50e9).solve);
}

}  // namespace
}  // namespace ferry
