// DynamicLossScaler: the state machine of its header comment, step by step against sequences written by
// hand from its formulas (overflow: skipped += 1, hysteresis_left -= 1, back off at 0 and refill,
// clean_steps = 0; clean: clean_steps += 1, grow at growth_interval and refill hysteresis), the floor at
// min_scale, a growth that would overflow the double kept finite; validate() and set_state() refusing
// each bad value naming it; a state set for resuming continues as the original run.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../../optim/loss_scaler.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// One update and the state the header's formulas give after it.
struct Step {
  bool overflow;
  double scale;
  int64_t clean_steps;
  int hysteresis_left;
  int64_t overflows;
};

void run_and_check(DynamicLossScaler& s, const std::vector<Step>& steps) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& want = steps[i];
    s.update(want.overflow);
    const LossScalerState& got = s.state();
    SCOPED_TRACE("update " + std::to_string(i) + (want.overflow ? " (overflow)" : " (clean)"));
    EXPECT_EQ(got.scale, want.scale);
    EXPECT_EQ(s.scale(), want.scale);
    EXPECT_EQ(got.clean_steps, want.clean_steps);
    EXPECT_EQ(got.hysteresis_left, want.hysteresis_left);
    EXPECT_EQ(got.overflows, want.overflows);
  }
}

// Options with every field given: initial scale, growth, backoff, growth interval, hysteresis, floor.
LossScalerOptions options_of(double initial, double growth, double backoff, int64_t interval, int hysteresis,
                             double min_scale) {
  return LossScalerOptions{initial, growth, backoff, interval, hysteresis, min_scale};  // the fields in order
}

LossScalerOptions small_options() { return options_of(1024, 2, 0.5, 3, 2, 256); }

TEST(DynamicLossScaler, StartsAtTheInitialScaleWithFullHysteresis) {
  const DynamicLossScaler d;  // the defaults
  EXPECT_EQ(d.scale(), 65536.0);
  EXPECT_EQ(d.state().clean_steps, 0);
  EXPECT_EQ(d.state().hysteresis_left, 2);
  EXPECT_EQ(d.state().overflows, 0);
  const DynamicLossScaler s(small_options());
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.state().hysteresis_left, 2);
  EXPECT_EQ(s.options().growth_interval, 3);
}

// Written by hand from the header, options: initial 1024, growth x2 every 3 clean steps, backoff x0.5
// after 2 overflows, floor 256.
TEST(DynamicLossScaler, FollowsTheHeadersStateMachine) {
  DynamicLossScaler s(small_options());
  run_and_check(s, {
                       // overflow, scale, clean_steps, hysteresis_left, overflows
                       {false, 1024, 1, 2, 0},
                       {false, 1024, 2, 2, 0},
                       {true, 1024, 0, 1, 1},   // the first overflow is tolerated; the clean run restarts
                       {false, 1024, 1, 1, 1},  // a clean step does not refill the hysteresis...
                       {false, 1024, 2, 1, 1},
                       {false, 2048, 0, 2, 1},  // ...a growth does: 3 clean steps in a row
                       {true, 2048, 0, 1, 2},
                       {true, 1024, 0, 2, 3},   // the second overflow since the growth: back off, refill
                       {true, 1024, 0, 1, 4},
                       {false, 1024, 1, 1, 4},  // a clean step between two overflows...
                       {true, 512, 0, 2, 5},    // ...does not reset the count of overflows
                       {true, 512, 0, 1, 6},
                       {true, 256, 0, 2, 7},    // 512 x 0.5 = 256, the floor exactly
                       {true, 256, 0, 1, 8},
                       {true, 256, 0, 2, 9},    // max(128, 256): stays at the floor
                       {false, 256, 1, 2, 9},
                       {false, 256, 2, 2, 9},
                       {false, 512, 0, 2, 9},   // grows from the floor
                   });
}

// hysteresis 1 backs off at every overflow; growth_interval 1 grows at every clean step.
TEST(DynamicLossScaler, HysteresisOneAndGrowthIntervalOne) {
  DynamicLossScaler s(options_of(/*initial=*/8, /*growth=*/4, /*backoff=*/0.25, /*interval=*/1, /*hysteresis=*/1,
                                 /*min_scale=*/1));
  run_and_check(s, {
                       {false, 32, 0, 1, 0},
                       {false, 128, 0, 1, 0},
                       {true, 32, 0, 1, 1},
                       {true, 8, 0, 1, 2},
                       {true, 2, 0, 1, 3},
                       {true, 1, 0, 1, 4},  // 0.5 floored at 1
                       {false, 4, 0, 1, 4},
                   });
}

// A growth past the largest double keeps the scale it had (and still counts as a growth for the
// counters): the scale is never infinite.
TEST(DynamicLossScaler, AGrowthPastTheLargestDoubleKeepsTheScale) {
  LossScalerOptions o;
  o.initial_scale = std::numeric_limits<double>::max() / 1.5;
  o.growth_interval = 1;
  DynamicLossScaler s(o);
  s.update(false);
  EXPECT_TRUE(std::isfinite(s.scale()));
  EXPECT_EQ(s.scale(), o.initial_scale);
  EXPECT_EQ(s.state().clean_steps, 0);
  s.update(true);
  EXPECT_EQ(s.state().hysteresis_left, 1);
}

TEST(LossScalerOptions, ValidateRefusesEachBadValueNamingIt) {
  struct Case {
    void (*set)(LossScalerOptions&);
    std::string message;
  };
  const Case cases[] = {
      {[](LossScalerOptions& o) { o.initial_scale = 0; }, "loss scale must be finite and > 0, got 0"},
      {[](LossScalerOptions& o) { o.initial_scale = -4; }, "loss scale must be finite and > 0, got -4"},
      {[](LossScalerOptions& o) { o.initial_scale = kInf; }, "loss scale must be finite and > 0, got inf"},
      {[](LossScalerOptions& o) { o.initial_scale = kNaN; }, "loss scale must be finite and > 0, got nan"},
      {[](LossScalerOptions& o) { o.growth_factor = 1; }, "growth factor must be > 1, got 1"},
      {[](LossScalerOptions& o) { o.growth_factor = kInf; }, "growth factor must be > 1, got inf"},
      {[](LossScalerOptions& o) { o.growth_factor = kNaN; }, "growth factor must be > 1, got nan"},
      {[](LossScalerOptions& o) { o.backoff_factor = 0; }, "backoff factor must be in (0, 1), got 0"},
      {[](LossScalerOptions& o) { o.backoff_factor = 1; }, "backoff factor must be in (0, 1), got 1"},
      {[](LossScalerOptions& o) { o.backoff_factor = 1.5; }, "backoff factor must be in (0, 1), got 1.5"},
      {[](LossScalerOptions& o) { o.backoff_factor = kNaN; }, "backoff factor must be in (0, 1), got nan"},
      {[](LossScalerOptions& o) { o.growth_interval = 0; }, "growth interval must be >= 1, got 0"},
      {[](LossScalerOptions& o) { o.hysteresis = 0; }, "hysteresis must be >= 1, got 0"},
      {[](LossScalerOptions& o) { o.hysteresis = -3; }, "hysteresis must be >= 1, got -3"},
      {[](LossScalerOptions& o) { o.min_scale = 0; }, "minimum loss scale must be in (0, initial scale], got 0"},
      {[](LossScalerOptions& o) { o.min_scale = 65537; }, "minimum loss scale must be in (0, initial scale], got 65537"},
      {[](LossScalerOptions& o) { o.min_scale = kNaN; }, "minimum loss scale must be in (0, initial scale], got nan"},
  };
  for (const Case& c : cases) {
    LossScalerOptions o;
    c.set(o);
    const std::string msg = error_of([&] { o.validate(); });
    EXPECT_NE(msg.find(c.message), std::string::npos) << "expected '" << c.message << "', got '" << msg << "'";
    // The scaler validates what it is given.
    EXPECT_NE(error_of([&] { DynamicLossScaler s(o); }).find(c.message), std::string::npos) << c.message;
  }
  LossScalerOptions edge;
  edge.min_scale = edge.initial_scale;  // (0, initial] includes initial
  EXPECT_EQ(error_of([&] { edge.validate(); }), "(no error)");
}

TEST(DynamicLossScaler, SetStateRefusesEachBadValueAndKeepsTheOldState) {
  DynamicLossScaler s(small_options());
  s.update(true);
  const LossScalerState before = s.state();
  auto with = [&](void (*set)(LossScalerState&)) {
    LossScalerState st = before;
    set(st);
    return error_of([&] { s.set_state(st); });
  };
  auto has = [](const std::string& msg, const std::string& what) { return msg.find(what) != std::string::npos; };
  std::string m;
  EXPECT_TRUE(has(m = with([](LossScalerState& st) { st.scale = 0; }), "loss scale must be finite and > 0, got 0")) << m;
  EXPECT_TRUE(has(m = with([](LossScalerState& st) { st.scale = kInf; }), "got inf")) << m;
  EXPECT_TRUE(has(m = with([](LossScalerState& st) { st.scale = kNaN; }), "got nan")) << m;
  EXPECT_TRUE(has(m = with([](LossScalerState& st) { st.clean_steps = -1; }), "loss scaler counters must be >= 0")) << m;
  EXPECT_TRUE(has(m = with([](LossScalerState& st) { st.overflows = -1; }), "loss scaler counters must be >= 0")) << m;
  EXPECT_TRUE(has(m = with([](LossScalerState& st) { st.hysteresis_left = 0; }), "hysteresis_left must be in [1, 2], got 0"))
      << m;
  EXPECT_TRUE(has(m = with([](LossScalerState& st) { st.hysteresis_left = 3; }), "hysteresis_left must be in [1, 2], got 3"))
      << m;
  EXPECT_EQ(s.state().scale, before.scale) << "a refused state changes nothing";
  EXPECT_EQ(s.state().hysteresis_left, before.hysteresis_left);
  EXPECT_EQ(s.state().overflows, before.overflows);
}

// Resuming: a scaler given another's state goes on exactly as the other does.
TEST(DynamicLossScaler, ASetStateContinuesAsTheOriginal) {
  const std::vector<bool> first = {false, true, false, false, false, true, false};
  const std::vector<bool> then = {true, true, false, false, false, false, true, true, false};
  DynamicLossScaler original(small_options());
  for (bool o : first) original.update(o);
  DynamicLossScaler resumed(small_options());
  resumed.set_state(original.state());
  for (bool o : then) {
    original.update(o);
    resumed.update(o);
    EXPECT_EQ(resumed.state().scale, original.state().scale);
    EXPECT_EQ(resumed.state().clean_steps, original.state().clean_steps);
    EXPECT_EQ(resumed.state().hysteresis_left, original.state().hysteresis_left);
    EXPECT_EQ(resumed.state().overflows, original.state().overflows);
  }
}

}  // namespace
}  // namespace ferry
