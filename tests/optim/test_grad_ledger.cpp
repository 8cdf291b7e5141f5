// GradLedger (optim/grad_ledger.h) alone, over a ChunkLayout packed by hand: the spans a chunk's update
// covers (landed slots merged while consecutive, of one group and one lag; zero-element slots skipped;
// the `only` filter), slot_ranges (merged only while adjacent), count_missed_steps with the updated and
// late masks and the ownership test (D62), and the landings' forget/recount/clear. Every expectation is
// computed by hand from the layout below; the spans of random ledgers are checked against the
// invariants the header states, element by element.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../../chunk/layout.h"
#include "../../optim/grad_ledger.h"
#include "../test_util.h"

namespace ferry::optim {

// gtest prints a Span that differs (Span's own operator== compares them).
void PrintTo(const Span& s, std::ostream* os) {
  *os << "{group " << s.group << ", [" << s.begin << ", " << s.end << "), lag " << s.lag << "}";
}

namespace {

// Eight tensors packed into 16-element chunks aligned to 4 (worked out by hand from ChunkLayout::pack):
//   chunk 0: t0 [0, 4), t1 [4, 7), t2 [8, 8) (no elements), t3 [8, 13)
//   chunk 1: t4 [0, 2), t5 [4, 10)
//   chunk 2: t6 [0, 20) (dedicated: larger than a chunk)
//   chunk 3: t7 [0, 3)
// Groups: t2 and t5 in group 1, the others in group 0.
ChunkLayout hand_layout() {
  PackOptions o;
  o.chunk_numel = 16;
  o.align_numel = 4;
  return ChunkLayout::pack({4, 3, 0, 5, 2, 6, 20, 3}, {}, o);
}
const std::vector<int> kGroups = {0, 0, 1, 0, 0, 1, 0, 0};

GradLedger all_landed() {
  GradLedger ledger(kGroups);
  for (int64_t p = 0; p < ledger.num_params(); ++p) ledger.land(p);
  return ledger;
}

TEST(GradLedger, TheHandLayoutIsAsWorkedOut) {
  const ChunkLayout layout = hand_layout();
  ASSERT_EQ(layout.num_chunks(), 4);
  const std::vector<std::vector<int64_t>> slots = {{0, 0, 4}, {0, 4, 3}, {0, 8, 0}, {0, 8, 5},
                                                   {1, 0, 2}, {1, 4, 6}, {2, 0, 20}, {3, 0, 3}};
  for (size_t t = 0; t < slots.size(); ++t) {
    const Slot& s = layout.slots()[t];
    EXPECT_EQ((std::vector<int64_t>{s.chunk, s.offset, s.numel}), slots[t]) << "t" << t;
  }
}

TEST(GradLedger, SpansMergeConsecutiveLandedSlotsOfOneGroupAndLag) {
  const ChunkLayout layout = hand_layout();
  GradLedger ledger = all_landed();
  // t0, t1 and t3 merge across t1's alignment gap; t2 (group 1, no elements) neither splits nor shows.
  EXPECT_EQ(ledger.spans(layout, 0), (std::vector<Span>{{0, 0, 13, 0}}));
  EXPECT_EQ(ledger.spans(layout, 1), (std::vector<Span>{{0, 0, 2, 0}, {1, 4, 10, 0}})) << "two groups";
  EXPECT_EQ(ledger.spans(layout, 2), (std::vector<Span>{{0, 0, 20, 0}}));
  // A lag apart splits: t1 one step behind.
  ledger.set_lags({0, 1, 0, 0, 0, 0, 0, 0});
  EXPECT_EQ(ledger.spans(layout, 0), (std::vector<Span>{{0, 0, 4, 0}, {0, 4, 7, 1}, {0, 8, 13, 0}}));
  // t3 as far behind as t1: they merge, t0 stands apart.
  ledger.set_lags({0, 1, 0, 1, 0, 0, 0, 0});
  EXPECT_EQ(ledger.spans(layout, 0), (std::vector<Span>{{0, 0, 4, 0}, {0, 4, 13, 1}}));
  // A slot without a landing ends a span: t1 missing splits t0 from t3.
  GradLedger holes(kGroups);
  for (int64_t p : {0, 3, 5}) holes.land(p);
  EXPECT_EQ(holes.spans(layout, 0), (std::vector<Span>{{0, 0, 4, 0}, {0, 8, 13, 0}}));
  EXPECT_EQ(holes.spans(layout, 1), (std::vector<Span>{{1, 4, 10, 0}}));
  EXPECT_TRUE(holes.spans(layout, 3).empty()) << "nothing landed in chunk 3";
}

TEST(GradLedger, OnlyKeepsTheMarkedParameters) {
  const ChunkLayout layout = hand_layout();
  const GradLedger ledger = all_landed();
  // Shorter than the parameter count: the parameters past its end are not marked.
  const std::vector<char> only = {0, 1, 1, 1};
  EXPECT_EQ(ledger.spans(layout, 0, &only), (std::vector<Span>{{0, 4, 13, 0}}));
  EXPECT_TRUE(ledger.spans(layout, 1, &only).empty());
  const std::vector<char> late_t5 = {0, 0, 0, 0, 0, 1, 0, 0};
  EXPECT_EQ(ledger.spans(layout, 1, &late_t5), (std::vector<Span>{{1, 4, 10, 0}}));
  // A marked parameter that did not land is not in a span either.
  GradLedger t0_only(kGroups);
  t0_only.land(0);
  EXPECT_TRUE(t0_only.spans(layout, 0, &only).empty());
}

TEST(GradLedger, SlotRangesMergeOnlyAdjacentSlots) {
  const ChunkLayout layout = hand_layout();
  const GradLedger ledger = all_landed();
  // t0 and t1 touch; t3 starts after t1's gap. Group and lag are not theirs: 0.
  EXPECT_EQ(ledger.slot_ranges(layout, 0, true), (std::vector<Span>{{0, 0, 7, 0}, {0, 8, 13, 0}}));
  EXPECT_EQ(ledger.slot_ranges(layout, 1, true), (std::vector<Span>{{0, 0, 2, 0}, {0, 4, 10, 0}}));
  EXPECT_TRUE(ledger.slot_ranges(layout, 0, false).empty());
  GradLedger some(kGroups);
  some.land(0);
  EXPECT_EQ(some.slot_ranges(layout, 0, true), (std::vector<Span>{{0, 0, 4, 0}}));
  EXPECT_EQ(some.slot_ranges(layout, 0, false), (std::vector<Span>{{0, 4, 7, 0}, {0, 8, 13, 0}}));
}

// The header's rule, one case at a time (lags start at 0; the expected lags written out by hand).
TEST(GradLedger, CountMissedStepsFollowsTheUpdatedAndLateMasks) {
  const ChunkLayout layout = hand_layout();
  const auto every = [](int64_t) { return true; };
  const auto landed_ledger = [] {
    GradLedger ledger(kGroups);
    for (int64_t p : {0, 1, 4, 6}) ledger.land(p);
    return ledger;
  };
  {  // every chunk updated: the parameters without a landing fall behind (t2 too, with no elements)
    GradLedger ledger = landed_ledger();
    ledger.count_missed_steps(layout, every, nullptr, nullptr, nullptr);
    EXPECT_EQ(ledger.lags(), (std::vector<int64_t>{0, 0, 1, 1, 0, 1, 0, 1}));
    ledger.count_missed_steps(layout, every, nullptr, nullptr, nullptr);  // one more step: they add up
    EXPECT_EQ(ledger.lags(), (std::vector<int64_t>{0, 0, 2, 2, 0, 2, 0, 2}));
  }
  {  // chunk 1 not updated: t4 landed but falls behind
    GradLedger ledger = landed_ledger();
    const std::vector<char> updated = {1, 0, 1, 1};
    ledger.count_missed_steps(layout, every, &updated, nullptr, nullptr);
    EXPECT_EQ(ledger.lags(), (std::vector<int64_t>{0, 0, 1, 1, 1, 1, 0, 1}));
  }
  {  // t1 late: its chunk's late update decides, whatever its update did
    const std::vector<char> late = {0, 1, 0, 0, 0, 0, 0, 0};
    const std::vector<char> late_done = {1, 0, 0, 0}, late_not_done = {0, 1, 1, 1}, none;
    const std::vector<std::pair<const std::vector<char>*, int64_t>> cases = {
        {&late_done, 0}, {&late_not_done, 1}, {&none, 1}, {nullptr, 1}};
    for (const auto& [late_updated, t1_lag] : cases) {
      GradLedger ledger = landed_ledger();
      ledger.count_missed_steps(layout, every, nullptr, late_updated, &late);
      EXPECT_EQ(ledger.lags(), (std::vector<int64_t>{0, t1_lag, 1, 1, 0, 1, 0, 1}))
          << (late_updated == nullptr ? std::string("null") : std::to_string(late_updated->size()) + " entries");
    }
  }
  {  // chunk 1 owned by another rank: its parameters keep their lags, landed or not
    GradLedger ledger = landed_ledger();
    ledger.count_missed_steps(layout, [](int64_t c) { return c != 1; }, nullptr, nullptr, nullptr);
    EXPECT_EQ(ledger.lags(), (std::vector<int64_t>{0, 0, 1, 1, 0, 0, 0, 1}));
  }
  GradLedger ledger(kGroups);
  EXPECT_THROW(ledger.set_lags({0, 1}), c10::Error) << "lags for another parameter count";
}

TEST(GradLedger, ForgetRecountAndClear) {
  GradLedger ledger(kGroups);
  EXPECT_FALSE(ledger.any());
  ledger.land(0);
  ledger.land(3);
  EXPECT_TRUE(ledger.any());
  EXPECT_EQ(ledger.landed_mask(), (std::vector<char>{1, 0, 0, 1, 0, 0, 0, 0}));
  ledger.forget(0);
  ledger.recount();
  EXPECT_FALSE(ledger.landed(0));
  EXPECT_TRUE(ledger.any()) << "t3 is left";
  ledger.forget(3);
  ledger.recount();
  EXPECT_FALSE(ledger.any());
  ledger.set_landed(5, true);  // landed on some rank
  EXPECT_TRUE(ledger.landed(5));
  ledger.set_landed(5, false);
  EXPECT_FALSE(ledger.landed(5));
  ledger.mark_any();
  EXPECT_TRUE(ledger.any()) << "a step is due although nothing landed here";
  ledger.land(7);
  ledger.clear();
  EXPECT_FALSE(ledger.any());
  EXPECT_EQ(ledger.landed_mask(), std::vector<char>(8, 0));
  EXPECT_EQ(ledger.group_of(5), 1);
  EXPECT_EQ(ledger.num_params(), 8);
}

// Random layouts, groups, lags, landings and filters: every span satisfies what the header says of the
// spans, checked element by element (not by a second implementation): sorted and disjoint; each landed,
// marked slot with elements lies inside a span of its group and lag; no element of another slot with
// elements lies in one; a span begins and ends at such slots' edges; and two spans of one group and lag
// in a row have a slot with elements between them that is not landed or not marked (else they merge).
TEST(GradLedger, RandomSpansKeepTheHeadersInvariants) {
  std::mt19937 rng(62);
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  for (int round = 0; round < 300; ++round) {
    const int64_t n = 1 + pick(12);
    std::vector<int64_t> numels(n);
    std::vector<int> groups(n);
    std::vector<int64_t> lags(n);
    std::vector<char> only(n);
    for (int64_t t = 0; t < n; ++t) {
      numels[t] = pick(4) == 0 ? 0 : 1 + pick(9);
      groups[t] = pick(2);
      lags[t] = pick(2);
      only[t] = pick(4) != 0;
    }
    PackOptions o;
    o.chunk_numel = 16;
    o.align_numel = 1 << pick(3);
    const ChunkLayout layout = ChunkLayout::pack(numels, {}, o);
    GradLedger ledger(groups);
    ledger.set_lags(lags);
    for (int64_t t = 0; t < n; ++t) {
      if (pick(3) != 0) ledger.land(t);
    }
    for (const bool filtered : {false, true}) {
      const auto wanted = [&](int64_t t) { return ledger.landed(t) && (!filtered || only[t]); };
      for (int64_t c = 0; c < layout.num_chunks(); ++c) {
        const std::vector<Span> spans = ledger.spans(layout, c, filtered ? &only : nullptr);
        SCOPED_TRACE("round " + std::to_string(round) + ", chunk " + std::to_string(c) +
                     (filtered ? ", filtered" : ""));
        std::vector<int> span_at(layout.chunks()[c].numel, -1);  // per element: the span covering it
        for (size_t i = 0; i < spans.size(); ++i) {
          ASSERT_LT(spans[i].begin, spans[i].end);
          if (i > 0) {
            ASSERT_LE(spans[i - 1].end, spans[i].begin) << "sorted, disjoint";
          }
          for (int64_t e = spans[i].begin; e < spans[i].end; ++e) span_at[e] = static_cast<int>(i);
        }
        std::vector<char> starts(span_at.size() + 1, 0), ends(span_at.size() + 1, 0);
        int last_span = -1;  // the span of the last wanted slot seen, while no unwanted one came after
        for (int64_t t : layout.chunks()[c].tensors) {
          const Slot& s = layout.slots()[t];
          if (s.numel == 0) continue;
          if (!wanted(t)) {
            for (int64_t e = s.offset; e < s.offset + s.numel; ++e) EXPECT_EQ(span_at[e], -1) << "t" << t;
            last_span = -1;
            continue;
          }
          const int at = span_at[s.offset];
          ASSERT_GE(at, 0) << "t" << t << " landed but in no span";
          EXPECT_EQ(spans[at].group, groups[t]) << "t" << t;
          EXPECT_EQ(spans[at].lag, lags[t]) << "t" << t;
          for (int64_t e = s.offset; e < s.offset + s.numel; ++e) EXPECT_EQ(span_at[e], at) << "t" << t;
          if (last_span >= 0 && last_span != at) {
            EXPECT_FALSE(spans[last_span].group == spans[at].group && spans[last_span].lag == spans[at].lag)
                << "t" << t << ": two spans in a row that should have merged";
          }
          starts[s.offset] = 1;
          ends[s.offset + s.numel] = 1;
          last_span = at;
        }
        for (const Span& s : spans) {
          EXPECT_TRUE(starts[s.begin]) << "a span begins at a landed slot";
          EXPECT_TRUE(ends[s.end]) << "a span ends at a landed slot's end";
        }
      }
    }
  }
}

}  // namespace
}  // namespace ferry::optim
