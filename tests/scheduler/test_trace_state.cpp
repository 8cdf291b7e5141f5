// TraceState (scheduler/trace_state.h), without a scheduler: warm-up recordings, the trace adopted and
// versioned, following and divergence, the re-trace, evaluation recordings that never replace a
// training trace, and the one repack after the warm-up.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../../scheduler/trace_state.h"

namespace ferry {
namespace {

// One iteration using `params` (chunk = param); returns whether it left a new trace to finalize.
bool run(TraceState& s, const std::vector<int64_t>& params, bool forward_only = false, bool aborted = false) {
  const bool record = s.begin_iteration();
  EXPECT_EQ(record, s.recording() != nullptr);
  for (int64_t p : params) {
    s.use(p, p);
    if (AccessTrace* r = s.recording()) r->record(p, p, 0);
  }
  return s.end_iteration(aborted, forward_only).adopted;
}

TEST(TraceState, RecordsTheWarmupThenFollowsTheLastRecording) {
  TraceState s(/*warmup_iterations=*/2, /*align=*/true);
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

TEST(TraceState, StrictADivergedIterationIsRetracedNextAndTheRepackIsNotWantedAgain) {
  TraceState s(/*warmup_iterations=*/1, /*align=*/false);
  run(s, {0, 1, 2});
  s.repacked();
  EXPECT_FALSE(s.begin_iteration());
  EXPECT_EQ(s.use(0, 0), 0);
  EXPECT_EQ(s.use(2, 2), -1) << "parameter 1 was expected";
  EXPECT_FALSE(s.following()) << "diverged for the rest of the iteration";
  EXPECT_FALSE(s.end_iteration(false, false).adopted) << "it recorded nothing";
  EXPECT_TRUE(run(s, {0, 2})) << "the next one records again";
  EXPECT_EQ(s.trace()->size(), 2);
  EXPECT_EQ(s.trace_version(), 2);
  EXPECT_FALSE(s.repack_wanted()) << "only the warm-up's trace asks for a repack";
  EXPECT_FALSE(s.begin_iteration());
  for (int64_t p : {0, 2}) EXPECT_GE(s.use(p, p), 0);
  EXPECT_EQ(s.use(0, 0), -1) << "past the trace's end";
  EXPECT_FALSE(s.following());
}

TEST(TraceState, AnEvaluationNeverReplacesATrainingTrace) {
  for (const bool align : {false, true}) {
    SCOPED_TRACE(align ? "aligning" : "strict");
    TraceState s(/*warmup_iterations=*/1, align);
    EXPECT_TRUE(run(s, {0}, /*forward_only=*/true)) << "with no other trace, an evaluation's is used";
    EXPECT_TRUE(s.trace_is_forward_only());
    s.repacked();
    // A training iteration gives it up at its first difference (it has a backward), and is traced next.
    EXPECT_FALSE(s.begin_iteration());
    EXPECT_EQ(s.use(0, 0), 0);
    EXPECT_EQ(s.use(1, 1), -1);
    EXPECT_FALSE(s.following());
    s.end_iteration(false, false);
    EXPECT_TRUE(run(s, {0, 1, 1, 0}));
    EXPECT_FALSE(s.trace_is_forward_only());
    const int64_t version = s.trace_version();
    // An evaluation that differs from the training trace (a use it lacks; no backward) changes nothing
    // in it: strict, it gives the trace up and is recorded next, but that recording is not adopted.
    EXPECT_FALSE(s.begin_iteration());
    s.use(0, 0);
    s.use(1, 1);
    s.use(7, 7);
    EXPECT_EQ(s.following(), align);
    EXPECT_FALSE(s.end_iteration(false, /*forward_only=*/true).adopted);
    EXPECT_FALSE(run(s, {0, 1, 7}, /*forward_only=*/true));
    EXPECT_EQ(s.trace_version(), version);
    EXPECT_EQ(s.trace()->size(), 4);
    // Nor do evaluations that leave the backward's positions unused make them stale.
    for (int i = 0; i < 2 * TraceState::kPruneAfter; ++i) EXPECT_FALSE(run(s, {0, 1}, /*forward_only=*/true));
    EXPECT_EQ(s.trace()->size(), 4);
    EXPECT_EQ(s.trace_version(), version);
  }
}

TEST(TraceState, AnAbortedRecordingIsDropped) {
  TraceState s(/*warmup_iterations=*/1, /*align=*/true);
  EXPECT_FALSE(run(s, {0, 1}, false, /*aborted=*/true));
  EXPECT_EQ(s.trace(), nullptr);
  EXPECT_EQ(s.trace_version(), 0);
  EXPECT_EQ(s.iterations(), 1) << "it still counts as an iteration";
  EXPECT_TRUE(s.begin_iteration()) << "recorded again";
}

}  // namespace
}  // namespace ferry
