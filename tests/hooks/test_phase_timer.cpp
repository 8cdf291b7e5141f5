// PhaseTimer (hooks/phase_timer.h) on the simulated device's marks (the host's clock): which phases an
// iteration closed, their seconds, and their spans in the event trace.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "../../common/event_trace.h"
#include "../../hooks/phase_timer.h"

namespace ferry {
namespace {

PhaseTimer simulated_timer() {
  return PhaseTimer([] { return make_simulated_copy_engine()->make_mark(); });
}

void nap() { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }

TEST(PhaseTimer, APhaseCountsOnceItRanToItsEnd) {
  PhaseTimer timer = simulated_timer();
  PhaseSeconds s = timer.seconds();
  EXPECT_EQ(s.forward, -1);
  EXPECT_EQ(s.backward, -1);
  timer.forward_begins();
  nap();
  timer.forward_ends();
  timer.backward_begins();
  nap();
  timer.backward_queued();
  s = timer.seconds();
  EXPECT_GE(s.forward, 0.002);
  EXPECT_EQ(s.backward, -1) << "queued, but the backward did not end (the sink failed, or it threw)";
  timer.backward_ends();
  s = timer.seconds();
  EXPECT_GE(s.backward, 0.002);
  // The next iteration's first forward forgets both until they end again.
  timer.forward_begins();
  s = timer.seconds();
  EXPECT_EQ(s.forward, -1);
  EXPECT_EQ(s.backward, -1);
}

TEST(PhaseTimer, SeveralForwardsAreOnePhaseFromTheFirstStartToTheLastEnd) {
  PhaseTimer timer = simulated_timer();
  timer.forward_begins();
  timer.forward_ends();
  const double first = timer.seconds().forward;
  nap();
  timer.forward_ends();  // a second forward of the same iteration
  EXPECT_GE(timer.seconds().forward, first + 0.002);
}

TEST(PhaseTimer, WritesThePhasesThatRanIntoTheTrace) {
  PhaseTimer timer = simulated_timer();
  timer.forward_begins();
  timer.forward_ends();
  trace::start();
  timer.trace(ClockAnchor(make_simulated_copy_engine()->make_mark()));
  const std::string json = trace::chrome_json();
  trace::stop();
  EXPECT_NE(json.find("\"forward\""), std::string::npos);
  EXPECT_EQ(json.find("\"backward\""), std::string::npos) << "the backward did not run";
}

}  // namespace
}  // namespace ferry
