// ChunkFinality (optim/chunk_finality.h) alone, over a ChunkLayout of two chunks of two parameters each:
// a chunk is final once its parameters have had the landings and uses earlier backwards had (Note [A
// chunk final before its last use]); expectations only grow, by maximum, and an aborted backward's
// landings grow them but do not start them (Note [Expectations only grow]); hold() and forget(); a chunk
// that expects no landing is never final early. Named cases written out by hand, then random backwards
// against a reference that states the rule directly (per parameter counts compared with the maxima of
// earlier backwards), not by counting down as the object does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "../../chunk/layout.h"
#include "../../optim/chunk_finality.h"

namespace ferry::optim {
namespace {

// Four parameters of four elements in chunks of eight: chunk 0 = {p0, p1}, chunk 1 = {p2, p3}.
ChunkLayout two_chunks() {
  PackOptions o;
  o.chunk_numel = 8;
  o.align_numel = 4;
  return ChunkLayout::pack({4, 4, 4, 4}, {}, o);
}

// An event of a backward: a landing or a use of parameter p.
struct Event {
  bool landing;
  int64_t p;
};
Event land(int64_t p) { return {true, p}; }
Event use(int64_t p) { return {false, p}; }

// One backward, as the engine reports it: begun now; a landing is counted and, while counting down, asked
// whether it made its chunk final; a use is counted and asked the same.
struct Backward {
  Backward(ChunkFinality& f, const ChunkLayout& layout, bool count_down = true, bool sized = false)
      : f(f), layout(layout), count_down(count_down) {
    f.begin(layout, count_down, sized);
  }
  bool event(const Event& e) {
    const int64_t chunk = layout.slots()[e.p].chunk;
    if (!e.landing) return f.use(e.p, chunk, count_down);
    f.count_landing(e.p);
    return count_down && f.final_after_landing(e.p, chunk);
  }
  // Per event, whether it made its chunk final.
  std::vector<bool> run(const std::vector<Event>& events) {
    std::vector<bool> finals;
    for (const Event& e : events) finals.push_back(event(e));
    return finals;
  }
  void end(bool complete = true) {
    f.end_uses();
    f.learn_landings(complete);
  }
  ChunkFinality& f;
  const ChunkLayout& layout;
  bool count_down;
};

// A whole backward of `events`: run, then ended (complete, or stopped part-way).
std::vector<bool> backward(ChunkFinality& f, const ChunkLayout& layout, const std::vector<Event>& events,
                           bool complete = true) {
  Backward b(f, layout);
  std::vector<bool> finals = b.run(events);
  b.end(complete);
  return finals;
}
using Finals = std::vector<bool>;
using Counts = std::vector<int64_t>;

TEST(ChunkFinality, AChunkIsFinalAfterTheLandingsAndUsesEarlierBackwardsHad) {
  const ChunkLayout layout = two_chunks();
  ChunkFinality f;
  f.follow_layout(4);
  EXPECT_FALSE(f.has_expectations());
  // A model whose frozen p1 (chunk 0) carries the gradient to p0 after chunk 1's landings.
  const std::vector<Event> frozen_use = {land(3), land(2), use(1), land(0), land(1)};
  EXPECT_EQ(backward(f, layout, frozen_use), Finals(5, false)) << "the first backward knows nothing";
  ASSERT_TRUE(f.has_expectations());
  EXPECT_EQ(f.expected_landings(), (Counts{1, 1, 1, 1}));
  EXPECT_EQ(f.expected_uses(), (Counts{0, 1, 0, 0}));
  // The second: chunk 1 at p2's landing; chunk 0 only at p1's, after the use and p0's landing.
  EXPECT_EQ(backward(f, layout, frozen_use), (Finals{false, true, false, false, true}));
  // Its landings alone would have made chunk 0 final before p1's use: here the use comes last, and a
  // use beyond the expected ones counts nothing (and is expected from now on).
  EXPECT_EQ(backward(f, layout, {land(0), land(1), use(1), use(1)}), (Finals{false, false, true, false}));
  EXPECT_EQ(f.expected_uses(), (Counts{0, 2, 0, 0}));
}

TEST(ChunkFinality, ExpectationsOnlyGrowByMaximum) {
  const ChunkLayout layout = two_chunks();
  ChunkFinality f;
  f.follow_layout(4);
  EXPECT_EQ(backward(f, layout, {land(0), land(0), land(1)}), Finals(3, false));
  // p0 once, p1 twice (its second landing is beyond the expected ones), p2 once: chunk 0 still waits
  // for p0's second.
  EXPECT_EQ(backward(f, layout, {land(0), land(1), land(1), land(2)}), Finals(4, false));
  EXPECT_EQ(f.expected_landings(), (Counts{2, 2, 1, 0}));
  EXPECT_EQ(f.expected(0), 2);
  Backward b(f, layout);
  // Chunk 0 final at the fourth of its four expected landings; chunk 1 expects p2 once and p3 never; a
  // landing beyond the expected ones.
  EXPECT_EQ(b.run({land(1), land(0), land(1), land(0), land(2), land(0)}),
            (Finals{false, false, false, true, true, false}));
  // expect(): a landing no earlier backward had, expected from now on; returns the old expectation.
  EXPECT_EQ(f.expect(3, 2), 0);
  EXPECT_EQ(f.expect(3, 1), 2) << "never shrinks";
  EXPECT_EQ(f.expected(3), 2);
  b.end();
  EXPECT_EQ(f.expected_landings(), (Counts{3, 2, 1, 2})) << "this backward's three of p0 joined";
}

TEST(ChunkFinality, AnAbortedBackwardGrowsExpectationsButDoesNotStartThem) {
  const ChunkLayout layout = two_chunks();
  ChunkFinality f;
  f.follow_layout(4);
  backward(f, layout, {land(3), land(2)}, /*complete=*/false);
  EXPECT_FALSE(f.has_expectations()) << "part of a backward does not say what a whole one has";
  EXPECT_EQ(backward(f, layout, {land(3), land(2), land(1)}), Finals(3, false)) << "still nothing final early";
  EXPECT_EQ(f.expected_landings(), (Counts{0, 1, 1, 1}));
  backward(f, layout, {land(3), land(3)}, /*complete=*/false);  // stopped: what it had joins them
  EXPECT_EQ(f.expected_landings(), (Counts{0, 1, 1, 2}));
  EXPECT_EQ(backward(f, layout, {land(2), land(3), land(3)}), (Finals{false, false, true})) << "p3 twice now";
}

TEST(ChunkFinality, HoldForgetAndChunksExpectingNothing) {
  const ChunkLayout layout = two_chunks();
  ChunkFinality f;
  f.follow_layout(4);
  // Only chunk 1 lands; chunk 0 (frozen) is used twice.
  const std::vector<Event> events = {land(3), use(0), land(2), use(0)};
  EXPECT_EQ(backward(f, layout, events), Finals(4, false));
  EXPECT_EQ(backward(f, layout, events), (Finals{false, false, true, false}))
      << "chunk 1 final at its last landing; chunk 0, which expects no landing, never, whatever its uses";
  {
    Backward held(f, layout);
    f.hold(1);
    EXPECT_EQ(held.run(events), Finals(4, false)) << "held: not final early";
    held.end();
  }
  f.forget();
  EXPECT_FALSE(f.has_expectations());
  EXPECT_EQ(f.expected_uses(), (Counts{0, 0, 0, 0}));
  EXPECT_EQ(backward(f, layout, events), Finals(4, false)) << "after forget(): as the first";
  // `sized`: expectations of zero where there were none; still nothing final early.
  f.forget();
  Backward sized(f, layout, /*count_down=*/true, /*sized=*/true);
  EXPECT_TRUE(f.has_expectations());
  EXPECT_EQ(f.expected_landings(), (Counts{0, 0, 0, 0}));
  EXPECT_EQ(sized.run({land(2), land(3)}), Finals(2, false));
  sized.end();
  // Without counting down, no chunk is final early whatever was expected.
  Backward uncounted(f, layout, /*count_down=*/false);
  EXPECT_EQ(uncounted.run({use(0), land(2), land(3)}), Finals(3, false));
  uncounted.end();
  EXPECT_EQ(f.landings(2), 1);
  Backward next(f, layout);
  EXPECT_EQ(f.landings(2), 0) << "begin() forgot the last backward's landings";
}

// The rule stated directly: after each event, a chunk is complete when it expects a landing, is not
// held, and each of its parameters has had at least the landings and the uses expected of it (the
// maxima over earlier backwards; for uses, those seen since the last end counted). An event reports
// "final" exactly when it makes its chunk complete.
struct Reference {
  explicit Reference(const ChunkLayout& layout) : layout(layout), n(static_cast<int64_t>(layout.slots().size())) {
    uses.assign(n, 0);
    expected_uses.assign(n, 0);
  }
  void begin(bool count_down_now) {
    count_down = count_down_now;
    landings.assign(n, 0);
    held.assign(layout.num_chunks(), 0);
    complete.assign(layout.num_chunks(), 0);
  }
  bool is_complete(int64_t c) const {
    if (!count_down || held[c]) return false;
    int64_t expects = 0;
    for (int64_t p : layout.chunks()[c].tensors) {
      const int64_t want = expected.empty() ? 0 : expected[p];
      expects += want;
      if (landings[p] < want || uses[p] < expected_uses[p]) return false;
    }
    return expects > 0;
  }
  bool event(int64_t p, bool landing) {
    (landing ? landings : uses)[p]++;
    const int64_t c = layout.slots()[p].chunk;
    const bool now = is_complete(c), became = now && !complete[c];
    complete[c] = now;
    return became;
  }
  void end(bool complete_backward) {
    for (int64_t p = 0; p < n; ++p) expected_uses[p] = std::max(expected_uses[p], uses[p]);
    uses.assign(n, 0);
    if (expected.empty()) {
      if (complete_backward) expected = landings;
    } else {
      for (int64_t p = 0; p < n; ++p) expected[p] = std::max(expected[p], landings[p]);
    }
  }
  const ChunkLayout& layout;
  int64_t n;
  bool count_down = false;
  std::vector<int64_t> landings, uses, expected, expected_uses;
  std::vector<char> held, complete;
};

TEST(ChunkFinality, RandomBackwardsFollowTheRule) {
  const ChunkLayout layout = two_chunks();
  std::mt19937 rng(64);
  auto pick = [&](int k) { return static_cast<int>(rng() % k); };
  for (int run = 0; run < 50; ++run) {
    ChunkFinality f;
    f.follow_layout(4);
    Reference ref(layout);
    for (int step = 0; step < 12; ++step) {
      SCOPED_TRACE("run " + std::to_string(run) + ", backward " + std::to_string(step));
      if (pick(10) == 0) {  // requires_grad changed
        f.forget();
        ref.expected.clear();
        ref.expected_uses.assign(4, 0);
      }
      const bool count_down = pick(5) != 0;
      ref.begin(count_down);
      Backward b(f, layout, count_down);
      if (pick(6) == 0) {
        const int64_t c = pick(2);
        f.hold(c);
        ref.held[c] = 1;
      }
      // Each parameter lands and is used 0 to 2 times, in a random order, mostly the same each time.
      std::vector<Event> events;
      for (int64_t p = 0; p < 4; ++p) {
        for (int k = pick(3); k > 0; --k) events.push_back(land(p));
        for (int k = p == 1 ? 1 + pick(2) : pick(2); k > 0; --k) events.push_back(use(p));
      }
      std::shuffle(events.begin(), events.end(), rng);
      const size_t stop = pick(4) == 0 ? static_cast<size_t>(pick(static_cast<int>(events.size()) + 1)) : events.size();
      for (size_t i = 0; i < stop; ++i) {
        const Event& e = events[i];
        EXPECT_EQ(b.event(e), ref.event(e.p, e.landing))
            << "event " << i << ": " << (e.landing ? "landing of p" : "use of p") << e.p;
      }
      const bool complete = stop == events.size();
      b.end(complete);
      ref.end(complete);
      ASSERT_EQ(f.has_expectations(), !ref.expected.empty());
      if (f.has_expectations()) {
        ASSERT_EQ(f.expected_landings(), ref.expected);
      }
      ASSERT_EQ(f.expected_uses(), ref.expected_uses);
    }
  }
}

}  // namespace
}  // namespace ferry::optim
