// TraceAlignment (scheduler/trace_alignment.h): uses aligned against a trace by hand-made examples
// (skips, long ones, another order, nearest positions, unforeseen uses, repeated uses), the merged
// trace with its backward start, non-model bytes and parameters in use, the positions backward passes
// over, skips said ahead, and a property test over random departures from random traces.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "../../scheduler/trace_alignment.h"

namespace ferry {
namespace {

// A trace of `forward` then `backward` uses (chunk = param + 100, non-model bytes = 10 x position).
AccessTrace make_trace(const std::vector<TensorId>& forward, const std::vector<TensorId>& backward = {}) {
  AccessTrace t;
  for (TensorId p : forward) t.record(p, p + 100, 10 * t.size());
  if (!backward.empty()) t.mark_backward_start();
  for (TensorId p : backward) t.record(p, p + 100, 10 * t.size());
  return t;
}

std::vector<int64_t> align_all(TraceAlignment& a, const std::vector<TensorId>& uses) {
  std::vector<int64_t> at;
  for (TensorId p : uses) at.push_back(a.align(p, p + 100));
  return at;
}

TEST(TraceAlignment, SkippedUsesMoveTheCursorPastThem) {
  const AccessTrace t = make_trace({0, 1, 2, 3, 4, 5});
  TraceAlignment a(t);
  EXPECT_EQ(align_all(a, {0, 1, 4, 5}), (std::vector<int64_t>{0, 1, 4, 5}));
  EXPECT_EQ(a.cursor(), 6);
  EXPECT_EQ(a.matched(), 4);
  EXPECT_EQ(a.skipped(), 2);
  EXPECT_EQ(a.unforeseen(), 0);
  EXPECT_FALSE(a.used(2));
  EXPECT_TRUE(a.used(4));
}

TEST(TraceAlignment, UsesInAnotherOrderMatchBehindTheCursor) {
  const AccessTrace t = make_trace({0, 1, 2, 3});
  TraceAlignment a(t);
  // 2 is ahead (1 skipped for now); 1 is then behind, unused: the cursor goes back to just after it;
  // 2 is used already, so 3 is found ahead of it.
  EXPECT_EQ(align_all(a, {0, 2, 1, 3}), (std::vector<int64_t>{0, 2, 1, 3}));
  EXPECT_EQ(a.skipped(), 0);
  EXPECT_EQ(a.unforeseen(), 0);
}

TEST(TraceAlignment, ARepeatedUseMatchesItsNextOccurrenceAndOneTooManyIsUnforeseen) {
  // A tied parameter (0) used at the start and the end of forward.
  const AccessTrace t = make_trace({0, 1, 0});
  TraceAlignment a(t);
  EXPECT_EQ(align_all(a, {0, 1, 0, 0}), (std::vector<int64_t>{0, 1, 2, -1}));
  EXPECT_EQ(a.unforeseen(), 1);
}

TEST(TraceAlignment, ALongSkipMatchesHoweverFarAndTheNearestPositionWins) {
  // Forward 0..299, backward 299..0: an early exit after 0 goes straight to the backward of 0.
  std::vector<TensorId> forward(300);
  for (int i = 0; i < 300; ++i) forward[i] = i;
  const AccessTrace t = make_trace(forward, std::vector<TensorId>(forward.rbegin(), forward.rend()));
  TraceAlignment exit(t);
  EXPECT_EQ(exit.align(0, 100), 0);
  EXPECT_EQ(exit.align(0, 100), 599) << "598 positions skipped";
  EXPECT_EQ(exit.unforeseen(), 0);
  // Swapped neighbours (5 before 4) in forward: 4 is found just behind the cursor, not at its backward
  // use 590 far ahead.
  TraceAlignment swapped(t);
  EXPECT_EQ(align_all(swapped, {0, 1, 2, 3, 5, 4, 6}), (std::vector<int64_t>{0, 1, 2, 3, 5, 4, 6}));
  // At equal distance ahead wins: trace 7 8 7, cursor after the 8 used first.
  const AccessTrace tie = make_trace({7, 8, 7});
  TraceAlignment a(tie);
  EXPECT_EQ(a.align(8, 108), 1);
  EXPECT_EQ(a.align(7, 107), 2) << "ahead (distance 0) before behind (distance 2)";
}

TEST(TraceAlignment, UnforeseenUsesAreMergedBeforeThePositionExpectedWhenTheyCame) {
  // Forward 0 1, backward 1 0; the iteration adds 9 in forward (after 0) and 8 in backward (after 1).
  const AccessTrace t = make_trace({0, 1}, {1, 0});
  TraceAlignment a(t);
  EXPECT_EQ(align_all(a, {0, 9, 7, 1}), (std::vector<int64_t>{0, -1, -1, 1}));
  EXPECT_EQ(a.cursor(), 2) << "an unforeseen use leaves the cursor";
  a.begin_backward();
  EXPECT_EQ(align_all(a, {1, 8, 0}), (std::vector<int64_t>{2, -1, 3}));
  EXPECT_EQ(a.unforeseen(), 3);
  const TraceAlignment::Merged m = a.merged_trace(std::vector<char>(4, 1));
  const AccessTrace& n = *m.trace;
  EXPECT_EQ(n.tensors(), (std::vector<TensorId>{0, 9, 7, 1, 1, 8, 0}));
  EXPECT_EQ(n.chunks(), (std::vector<ChunkId>{100, 109, 107, 101, 101, 108, 100}));
  EXPECT_EQ(m.origin, (std::vector<int64_t>{0, -1, -1, 1, 2, -1, 3}));
  EXPECT_EQ(n.backward_start(), 4);
  // Inserted: the larger of the neighbours' non-model bytes (old positions 0 and 1: 0 and 10; 2 and 3:
  // 20 and 30).
  std::vector<int64_t> non_model;
  for (int64_t p = 0; p < n.size(); ++p) non_model.push_back(n.non_model_at(p));
  EXPECT_EQ(non_model, (std::vector<int64_t>{0, 10, 10, 10, 20, 30, 30}));
}

TEST(TraceAlignment, AMergedUseKeepsTheParametersInUseBesideIt) {
  // Kept positions keep theirs; an unforeseen use gets those it came with, itself left out (a parameter
  // in use twice at once is in the list it is given), so the reference pins their chunks at it (D104).
  AccessTrace t;
  t.record(0, 100, 0);
  t.record(1, 101, 0, {0});
  TraceAlignment a(t);
  EXPECT_EQ(a.align(0, 100), 0);
  EXPECT_EQ(a.align(9, 109, {0, 9}), -1);
  EXPECT_EQ(a.align(1, 101, {0}), 1);
  const TraceAlignment::Merged m = a.merged_trace({1, 1});
  const AccessTrace& n = *m.trace;
  ASSERT_EQ(n.tensors(), (std::vector<TensorId>{0, 9, 1}));
  EXPECT_TRUE(n.in_use_at(0).empty());
  EXPECT_EQ(n.in_use_at(1), (std::vector<TensorId>{0}));
  EXPECT_EQ(n.in_use_at(2), (std::vector<TensorId>{0}));
}

TEST(TraceAlignment, KeepDropsPositionsAndABackwardUseBeforeTheOldStartMarksIt) {
  const AccessTrace t = make_trace({0, 1, 2}, {2, 1});
  TraceAlignment a(t);
  align_all(a, {0, 1, 2});
  a.begin_backward();
  EXPECT_EQ(a.align(5, 105), -1) << "an unforeseen backward use before the old backward start's use";
  align_all(a, {2, 1});
  const TraceAlignment::Merged m = a.merged_trace({1, 0, 1, 1, 0});
  EXPECT_EQ(m.trace->tensors(), (std::vector<TensorId>{0, 2, 5, 2}));
  EXPECT_EQ(m.origin, (std::vector<int64_t>{0, 2, -1, 3}));
  EXPECT_EQ(m.trace->backward_start(), 2);
  // Nothing kept, nothing inserted: an empty trace; a forward-only trace stays without a backward.
  const AccessTrace f = make_trace({0, 1});
  TraceAlignment b(f);
  b.align(3, 103);
  const TraceAlignment::Merged e = b.merged_trace({0, 0});
  EXPECT_EQ(e.trace->tensors(), (std::vector<TensorId>{3}));
  EXPECT_EQ(e.trace->backward_start(), e.trace->size());
}

TEST(TraceAlignment, BackwardPassesOverTheParametersForwardDidNotUse) {
  // Forward 0 1 2 0 (0 tied), backward 0 2 1 0: this forward skips 1 and adds 7.
  const AccessTrace t = make_trace({0, 1, 2, 0}, {0, 2, 1, 0});
  TraceAlignment a(t);
  align_all(a, {0, 7, 2, 0});
  const std::shared_ptr<const std::vector<char>> over = a.begin_backward();
  ASSERT_NE(over, nullptr);
  EXPECT_EQ(*over, (std::vector<char>{0, 0, 0, 0, 0, 0, 1, 0}));
  EXPECT_EQ(a.align(1, 101), 6) << "a passed-over position can still match";
  // Nothing skipped: nothing passed over.
  TraceAlignment b(t);
  align_all(b, {0, 1, 2, 0});
  EXPECT_EQ(b.begin_backward(), nullptr);
}

// Note [Skips said ahead]: forward 0 1 2 3, backward 3 2 1 0. The model says, before its first use,
// that it will skip 1 and 2: their positions are passed over, forward and backward, at once.
TEST(TraceAlignment, ASkipSaidAheadPassesItsPositionsOverForwardAndBackward) {
  const AccessTrace t = make_trace({0, 1, 2, 3}, {3, 2, 1, 0});
  TraceAlignment a(t);
  EXPECT_EQ(a.pass_over({}), nullptr) << "nothing said, nothing passed over";
  const std::shared_ptr<const std::vector<char>> first = a.pass_over({1, 1});
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(*first, (std::vector<char>{0, 1, 0, 0, 0, 0, 1, 0}));
  const std::shared_ptr<const std::vector<char>> both = a.pass_over({2, 1});
  EXPECT_EQ(*both, (std::vector<char>{0, 1, 1, 0, 0, 1, 1, 0}));
  EXPECT_EQ(*first, (std::vector<char>{0, 1, 0, 0, 0, 0, 1, 0})) << "the vector handed out before is not changed";
  EXPECT_EQ(a.hinted(), 4) << "1 said three times counts once";
  EXPECT_EQ(a.pass_over({2}), both) << "nothing new: the same vector";
  align_all(a, {0, 3});
  EXPECT_EQ(a.hints_broken(), 0);
  const std::shared_ptr<const std::vector<char>> backward = a.begin_backward();
  ASSERT_NE(backward, nullptr);
  EXPECT_EQ(*backward, (std::vector<char>{0, 0, 0, 0, 0, 1, 1, 0})) << "backward's own: forward skipped 1 and 2";
  EXPECT_EQ(a.pass_over({3}), backward) << "ignored in backward";
}

// A hint the iteration proves wrong changes no use: the position still matches (counted broken), and
// backward's passed-over positions come from what forward used, not from the hint. A hint for a
// parameter used already in this iteration is ignored: its backward comes.
TEST(TraceAlignment, AWrongSkipSaidAheadStillMatchesAndBackwardFollowsTheUses) {
  const AccessTrace t = make_trace({0, 1, 2, 3}, {3, 2, 1, 0});
  TraceAlignment a(t);
  a.align(0, 100);
  EXPECT_EQ(a.pass_over({0}), nullptr) << "0 was used: its backward comes";
  ASSERT_NE(a.pass_over({1}), nullptr);
  EXPECT_EQ(align_all(a, {1, 2, 3}), (std::vector<int64_t>{1, 2, 3})) << "the hinted position still matches";
  EXPECT_EQ(a.hints_broken(), 1);
  EXPECT_EQ(a.begin_backward(), nullptr) << "forward used all its trace: nothing is passed over";
  EXPECT_EQ(a.passed_over(), nullptr) << "the hint is gone with it";
  EXPECT_EQ(align_all(a, {3, 2, 1, 0}), (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_EQ(a.hints_broken(), 2) << "1's backward position was hinted too";
}

// Random traces (a forward of distinct parameters, some used twice like tied weights, and its reverse
// as backward), each departed from at random: runs of uses dropped (a skipped layer), parameters the
// trace lacks inserted, neighbours swapped. Checked against what the definitions say: the matched
// positions are distinct and hold the used parameters; matched + skipped = the trace's size; every
// use is either matched or unforeseen; the merged trace (all kept) holds the trace's positions in their
// order and the unforeseen uses; and aligning the same uses against the merged trace again finds none
// unforeseen.
TEST(TraceAlignment, RandomDeparturesFromRandomTraces) {
  std::mt19937 rng(20261201);
  int merged_checked = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int params = 2 + static_cast<int>(rng() % 40);
    std::vector<TensorId> forward;
    for (int p = 0; p < params; ++p) {
      forward.push_back(p);
      if (rng() % 8 == 0) forward.push_back(static_cast<TensorId>(rng() % (p + 1)));  // tied
    }
    std::vector<TensorId> backward(forward.rbegin(), forward.rend());
    const AccessTrace t = make_trace(forward, backward);
    std::vector<TensorId> uses(t.tensors());
    const int edits = static_cast<int>(rng() % 6);
    for (int e = 0; e < edits && !uses.empty(); ++e) {
      const size_t at = rng() % uses.size();
      switch (rng() % 3) {
        case 0:  // drop a run
          uses.erase(uses.begin() + at, uses.begin() + std::min(uses.size(), at + 1 + rng() % 6));
          break;
        case 1:  // a parameter the trace lacks
          uses.insert(uses.begin() + at, static_cast<TensorId>(1000 + rng() % 5));
          break;
        default:  // swap neighbours
          if (at + 1 < uses.size()) std::swap(uses[at], uses[at + 1]);
      }
    }
    TraceAlignment a(t);
    std::vector<int64_t> at = align_all(a, uses);
    std::vector<char> seen(t.size(), 0);
    int64_t unforeseen = 0;
    for (size_t i = 0; i < uses.size(); ++i) {
      if (at[i] < 0) {
        ++unforeseen;
        continue;
      }
      ASSERT_LT(at[i], t.size());
      ASSERT_FALSE(seen[at[i]]) << "position " << at[i] << " matched twice";
      seen[at[i]] = 1;
      ASSERT_EQ(t.tensor_at(at[i]), uses[i]);
      ASSERT_TRUE(a.used(at[i]));
    }
    ASSERT_EQ(unforeseen, a.unforeseen());
    ASSERT_EQ(a.matched() + a.skipped(), t.size());
    ASSERT_EQ(static_cast<int64_t>(uses.size()), a.matched() + a.unforeseen());
    const TraceAlignment::Merged m = a.merged_trace(std::vector<char>(t.size(), 1));
    ASSERT_EQ(m.trace->size(), t.size() + a.unforeseen());
    std::vector<int64_t> old_positions;
    for (int64_t o : m.origin) {
      if (o >= 0) old_positions.push_back(o);
    }
    std::vector<int64_t> all(t.size());
    for (int64_t q = 0; q < t.size(); ++q) all[q] = q;
    ASSERT_EQ(old_positions, all) << "the old positions keep their order";
    for (size_t i = 0; i < m.origin.size(); ++i) {
      if (m.origin[i] >= 0) {
        ASSERT_EQ(m.trace->tensor_at(static_cast<int64_t>(i)), t.tensor_at(m.origin[i]));
      }
    }
    if (a.unforeseen() > 0) {
      TraceAlignment again(*m.trace);
      align_all(again, uses);
      EXPECT_EQ(again.unforeseen(), 0) << "the merged trace lacks a use of the iteration it merged";
      ++merged_checked;
    }
  }
  EXPECT_GT(merged_checked, 500) << "the random departures should often add uses";
}

}  // namespace
}  // namespace ferry
