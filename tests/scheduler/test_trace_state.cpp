// TraceState (scheduler/trace_state.h), without a scheduler: warm-up recordings, the trace adopted and
// versioned, following and divergence, the re-trace, evaluation recordings that never replace a
// training trace, and the one repack after the warm-up.
#include <gtest/gtest.h>

#include <vector>

#include "../../scheduler/trace_state.h"

namespace ferry {
namespace {

// One iteration using `params` (chunk = param); returns whether its recording completed a trace.
bool run(TraceState& s, const std::vector<int64_t>& params, bool forward_only = false, bool aborted = false) {
  const bool record = s.begin_iteration();
  EXPECT_EQ(record, s.recording() != nullptr);
  for (int64_t p : params) {
    const int64_t position = s.next_position();
    if (s.following()) s.matches(position, p);
    if (AccessTrace* r = s.recording()) r->record(p, p, 0);
  }
  return s.end_iteration(aborted, forward_only);
}

TEST(TraceState, RecordsTheWarmupThenFollowsTheLastRecording) {
  TraceState s(/*warmup_iterations=*/2);
  EXPECT_EQ(s.trace(), nullptr);
  EXPECT_FALSE(run(s, {0, 1, 2})) << "the first of two warm-ups: not complete";
  EXPECT_EQ(s.trace(), nullptr);
  EXPECT_FALSE(s.repack_wanted());
  EXPECT_TRUE(run(s, {0, 1, 2})) << "the second completes the trace";
  ASSERT_NE(s.trace(), nullptr);
  EXPECT_EQ(s.trace()->size(), 3);
  EXPECT_EQ(s.trace_version(), 2) << "each adopted recording is a version";
  EXPECT_TRUE(s.repack_wanted());
  s.repacked();
  EXPECT_FALSE(s.repack_wanted());
  EXPECT_FALSE(s.begin_iteration()) << "now it follows";
  EXPECT_TRUE(s.following());
  EXPECT_EQ(s.iterations(), 2);
}

TEST(TraceState, ADivergedIterationIsRetracedNextAndTheRepackIsNotWantedAgain) {
  TraceState s(/*warmup_iterations=*/1);
  run(s, {0, 1, 2});
  s.repacked();
  EXPECT_FALSE(s.begin_iteration());
  EXPECT_TRUE(s.matches(s.next_position(), 0));
  EXPECT_FALSE(s.matches(s.next_position(), 2)) << "parameter 1 was expected";
  EXPECT_FALSE(s.following()) << "diverged for the rest of the iteration";
  EXPECT_FALSE(s.end_iteration(false, false)) << "it recorded nothing";
  EXPECT_TRUE(run(s, {0, 2})) << "the next one records again";
  EXPECT_EQ(s.trace()->size(), 2);
  EXPECT_EQ(s.trace_version(), 2);
  EXPECT_FALSE(s.repack_wanted()) << "only the warm-up's trace asks for a repack";
  EXPECT_FALSE(s.begin_iteration());
  for (int64_t p : {0, 2}) EXPECT_TRUE(s.matches(s.next_position(), p));
  EXPECT_FALSE(s.matches(s.next_position(), 0)) << "past the trace's end";
}

TEST(TraceState, AnEvaluationNeverReplacesATrainingTrace) {
  TraceState s(/*warmup_iterations=*/1);
  EXPECT_TRUE(run(s, {0}, /*forward_only=*/true)) << "with no other trace, an evaluation's is used";
  EXPECT_TRUE(s.trace_is_forward_only());
  s.repacked();
  // A training iteration diverges from it (it has a backward), and is traced next.
  EXPECT_FALSE(s.begin_iteration());
  s.matches(s.next_position(), 0);
  EXPECT_FALSE(s.matches(s.next_position(), 1));
  s.end_iteration(false, false);
  EXPECT_TRUE(run(s, {0, 1, 1, 0}));
  EXPECT_FALSE(s.trace_is_forward_only());
  const int64_t version = s.trace_version();
  // An evaluation that diverges from the training trace is re-recorded, but not adopted.
  EXPECT_FALSE(s.begin_iteration());
  s.matches(s.next_position(), 0);
  s.matches(s.next_position(), 1);
  s.matches(s.next_position(), 7);
  s.end_iteration(false, /*forward_only=*/true);
  EXPECT_FALSE(run(s, {0, 1, 7}, /*forward_only=*/true));
  EXPECT_EQ(s.trace_version(), version);
  EXPECT_EQ(s.trace()->size(), 4);
}

TEST(TraceState, AnAbortedRecordingIsDropped) {
  TraceState s(/*warmup_iterations=*/1);
  EXPECT_FALSE(run(s, {0, 1}, false, /*aborted=*/true));
  EXPECT_EQ(s.trace(), nullptr);
  EXPECT_EQ(s.trace_version(), 0);
  EXPECT_EQ(s.iterations(), 1) << "it still counts as an iteration";
  EXPECT_TRUE(s.begin_iteration()) << "recorded again";
}

}  // namespace
}  // namespace ferry
