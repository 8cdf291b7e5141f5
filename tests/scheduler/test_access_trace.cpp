// AccessTrace: what record() keeps, backward_start (unset: size()), clear(), first_use_order,
// non_model_at / non_model_peak windows, run_end, and next_use against a brute-force scan of the
// sequence (wrapping into the next iteration) on random traces, before and after remap_chunks;
// belady_moves against the fewest moves per iteration in the long run, found exhaustively.
// (Hand-computed cases of next_use and belady_moves are in test_scheduler.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <bitset>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../scheduler/access_trace.h"

namespace ferry {
namespace {

// The definition, by scanning: the first q >= position using `chunk`; else its first use + size();
// kNever if the trace never uses it.
int64_t next_use_by_scan(const std::vector<ChunkId>& chunks, ChunkId chunk, int64_t position) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  for (int64_t q = std::max<int64_t>(position, 0); q < n; ++q) {
    if (chunks[q] == chunk) return q;
  }
  for (int64_t q = 0; q < n; ++q) {
    if (chunks[q] == chunk) return q + n;
  }
  return AccessTrace::kNever;
}

TEST(AccessTrace, RecordKeepsTensorChunkAndNonModelBytes) {
  AccessTrace t;
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.size(), 0);
  EXPECT_EQ(t.backward_start(), 0) << "unset: size()";
  t.record(5, 1, 100);
  t.record(6, 1, 300);
  t.record(2, 0, 200);
  EXPECT_FALSE(t.empty());
  EXPECT_EQ(t.size(), 3);
  EXPECT_EQ(t.tensor_at(0), 5);
  EXPECT_EQ(t.chunk_at(2), 0);
  EXPECT_EQ(t.non_model_at(1), 300);
  EXPECT_EQ(t.tensors(), (std::vector<TensorId>{5, 6, 2}));
  EXPECT_EQ(t.chunks(), (std::vector<ChunkId>{1, 1, 0}));
  EXPECT_EQ(t.backward_start(), 3) << "a forward-only iteration: backward starts at the end";
}

// The tensors in use with a use (D104), and after finalize their chunks: each once, the use's own chunk
// and tensors the trace has no use of (no chunk known) left out; a remap moves them with the tensors.
TEST(AccessTrace, TheTensorsInUseWithAUseArePinnedByTheirChunks) {
  AccessTrace t;
  t.record(0, 0, 0);
  t.record(1, 1, 0, {0});        // tensor 0 (chunk 0) still in use
  t.record(2, 1, 0, {0, 1, 9});  // chunk 0; tensor 1 is in chunk 1, this use's own; 9 is never used
  t.record(3, 2, 0, {2, 1});     // both in chunk 1: once
  t.finalize(3);
  EXPECT_TRUE(t.in_use_at(0).empty());
  EXPECT_EQ(t.in_use_at(2), (std::vector<TensorId>{0, 1, 9}));
  auto pinned = [&](int64_t p) {
    const AccessTrace::ChunkRange r = t.pinned_at(p);
    return std::vector<ChunkId>(r.begin(), r.end());
  };
  EXPECT_TRUE(pinned(0).empty());
  EXPECT_EQ(pinned(1), (std::vector<ChunkId>{0}));
  EXPECT_EQ(pinned(2), (std::vector<ChunkId>{0}));
  EXPECT_EQ(pinned(3), (std::vector<ChunkId>{1}));
  t.remap_chunks({1, 0, 2, 2});  // tensor 0 -> chunk 1, 1 -> 0, 2 and 3 -> 2
  t.finalize(3);
  EXPECT_EQ(pinned(1), (std::vector<ChunkId>{1}));
  EXPECT_EQ(pinned(2), (std::vector<ChunkId>{1, 0}));
  EXPECT_EQ(pinned(3), (std::vector<ChunkId>{0})) << "tensor 2 is now in the use's own chunk";
  t.clear();
  t.record(4, 0, 0);
  t.finalize(1);
  EXPECT_TRUE(t.in_use_at(0).empty()) << "clear() forgets them";
  EXPECT_TRUE(t.pinned_at(0).empty());
}

TEST(AccessTrace, BackwardStartIsTheNextPositionRecordedAndClearResetsIt) {
  AccessTrace t;
  t.record(0, 0, 0);
  t.record(1, 1, 0);
  t.mark_backward_start();
  EXPECT_EQ(t.backward_start(), 2);
  t.record(1, 1, 0);
  t.record(0, 0, 0);
  EXPECT_EQ(t.backward_start(), 2) << "the first use in backward, not the end";
  t.clear();
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.backward_start(), 0) << "cleared: unset again";
  t.record(3, 0, 0);
  EXPECT_EQ(t.backward_start(), 1);
  t.finalize(1);
  EXPECT_EQ(t.next_use(0, 0), 0);
  EXPECT_EQ(t.next_use(0, 1), 1) << "the next iteration's first use";
}

TEST(AccessTrace, FirstUseOrderListsEachTensorOnceInOrderOfFirstUse) {
  AccessTrace t;
  for (TensorId id : {4, 1, 4, 0, 1, 9, 2, -1}) t.record(id, 0, 0);
  EXPECT_EQ(t.first_use_order(5), (std::vector<TensorId>{4, 1, 0, 2})) << "9 and -1 are out of range; 3 unused";
  EXPECT_EQ(t.first_use_order(10), (std::vector<TensorId>{4, 1, 0, 9, 2}));
  EXPECT_TRUE(t.first_use_order(0).empty());
}

TEST(AccessTrace, NonModelPeakIsTheLargestInTheWindowClippedToTheTrace) {
  AccessTrace t;
  const std::vector<int64_t> non_model = {5, 1, 9, 3, 7, 2};
  for (size_t i = 0; i < non_model.size(); ++i) t.record(0, 0, non_model[i]);
  for (int64_t p = -2; p < 8; ++p) {
    for (int64_t w = 0; w < 9; ++w) {
      int64_t want = 0;
      for (int64_t q = std::max<int64_t>(p, 0); q < std::min<int64_t>(p + w, 6); ++q) want = std::max(want, non_model[q]);
      EXPECT_EQ(t.non_model_peak(p, w), want) << "position " << p << " window " << w;
    }
  }
}

// next_use and run_end on random traces against their definitions by scanning.
TEST(AccessTrace, NextUseAndRunEndEqualTheirDefinitionsOnRandomTraces) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int num_chunks = 1 + static_cast<int>(rng() % 6);
    const int length = 1 + static_cast<int>(rng() % 30);
    std::vector<ChunkId> chunks;
    AccessTrace t;
    for (int i = 0; i < length; ++i) {
      // Chunks 0 .. num_chunks - 1, the last one never used (kNever), runs of repeats now and then.
      const ChunkId c = (!chunks.empty() && rng() % 3 == 0) ? chunks.back()
                                                            : static_cast<ChunkId>(rng() % std::max(1, num_chunks - 1));
      chunks.push_back(c);
      t.record(i, c, 0);
    }
    t.finalize(num_chunks + 1);
    SCOPED_TRACE("trial " + std::to_string(trial));
    for (ChunkId c = -1; c <= num_chunks + 1; ++c) {
      for (int64_t p = 0; p <= length; ++p) {
        const int64_t want = c < 0 || c > num_chunks ? AccessTrace::kNever : next_use_by_scan(chunks, c, p);
        ASSERT_EQ(t.next_use(c, p), want) << "chunk " << c << " at " << p;
      }
    }
    for (int64_t p = 0; p < length; ++p) {
      int64_t end = p + 1;
      while (end < length && chunks[end] == chunks[p]) ++end;
      ASSERT_EQ(t.run_end(p), end) << "position " << p;
    }
  }
}

// With positions passed over in this iteration: the first q >= position not passed over, else the
// chunk's first use in the next iteration (which passes over nothing); from a position in the next
// iteration the mask does not apply.
TEST(AccessTrace, NextUseSkipsPassedOverPositionsOfThisIterationOnly) {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 200; ++trial) {
    const int num_chunks = 1 + static_cast<int>(rng() % 5);
    const int length = 1 + static_cast<int>(rng() % 30);
    std::vector<ChunkId> chunks;
    std::vector<char> over(length, 0);
    AccessTrace t;
    for (int i = 0; i < length; ++i) {
      chunks.push_back(static_cast<ChunkId>(rng() % num_chunks));
      over[i] = rng() % 3 == 0 ? 1 : 0;
      t.record(i, chunks.back(), 0);
    }
    t.finalize(num_chunks);
    SCOPED_TRACE("trial " + std::to_string(trial));
    for (ChunkId c = 0; c < num_chunks; ++c) {
      for (int64_t p = 0; p <= 2 * length; ++p) {
        int64_t want = next_use_by_scan(chunks, c, p >= length ? p - length : p);
        if (p >= length && want != AccessTrace::kNever) want += length;
        if (p < length) {
          want = AccessTrace::kNever;
          for (int64_t q = p; q < length && want == AccessTrace::kNever; ++q) {
            if (chunks[q] == c && !over[q]) want = q;
          }
          if (want == AccessTrace::kNever) {
            for (int64_t q = 0; q < length && want == AccessTrace::kNever; ++q) {
              if (chunks[q] == c) want = q + length;
            }
          }
        }
        ASSERT_EQ(t.next_use(c, p, &over), want) << "chunk " << c << " at " << p;
      }
    }
  }
}

// The header: next_use is "the first position q >= position" with iterations repeating. For a position
// past the trace's end (in the next iteration; OptEvictionPolicy asks for them when a prefetch's
// incoming chunk is next used there) it answered the chunk's first use + size() even when that was
// before the position (found by this test, 2026-11-26; what it cost: test_opt_policy.cpp,
// APrefetchIntoTheNextIterationFollowsBeladyThere).
TEST(AccessTrace, NextUseFromAPositionInTheNextIterationIsNotBeforeIt) {
  AccessTrace t;
  for (ChunkId c : {0, 1, 0, 1}) t.record(c, c, 0);
  t.finalize(2);
  EXPECT_EQ(t.next_use(0, 4), 4);
  EXPECT_EQ(t.next_use(0, 5), 6) << "position 5 is position 1 of the next iteration: chunk 0 next at its 2";
  EXPECT_EQ(t.next_use(1, 6), 7);
}

// Never is never: next_use from kNever (OptEvictionPolicy asked it, for a prefetch whose incoming chunk
// is next used "never", until 2026-12-02: UBSan's signed overflow in CI) or from just below it answers
// kNever, not a position past what int64_t holds.
TEST(AccessTrace, NextUseFromNeverIsNever) {
  AccessTrace t;
  for (ChunkId c : {0, 1, 0, 1}) t.record(c, c, 0);
  t.finalize(2);
  EXPECT_EQ(t.next_use(1, AccessTrace::kNever), AccessTrace::kNever);
  EXPECT_EQ(t.next_use(0, AccessTrace::kNever), AccessTrace::kNever) << "its iteration after's first use";
  EXPECT_EQ(t.next_use(0, AccessTrace::kNever - 1), AccessTrace::kNever);
  EXPECT_EQ(t.next_use(1, AccessTrace::kNever - 8), AccessTrace::kNever - 8)
      << "two iterations below the edge a position still answers (there, position 3 of its iteration)";
  EXPECT_EQ(t.next_use(1, 1000), 1001);
}

// After a repack the tensors live in other chunks: remap_chunks rewrites every position's chunk from
// its tensor, and after finalize() next_use answers for the new chunks.
TEST(AccessTrace, RemapChunksFollowsTheTensorsIntoTheirNewChunks) {
  AccessTrace t;
  // tensors 0..3 in chunks 0, 0, 1, 1
  const std::vector<TensorId> tensors = {0, 2, 1, 3, 2, 0};
  const std::vector<ChunkId> old_chunk = {0, 0, 1, 1};
  for (TensorId id : tensors) t.record(id, old_chunk[id], 0);
  t.finalize(2);
  EXPECT_EQ(t.next_use(1, 0), 1);
  // Repacked: tensor 0 -> chunk 2, 1 -> chunk 0, 2 -> chunk 1, 3 -> chunk 0.
  const std::vector<ChunkId> new_chunk = {2, 0, 1, 0};
  t.remap_chunks(new_chunk);
  t.finalize(3);
  std::vector<ChunkId> want;
  for (TensorId id : tensors) want.push_back(new_chunk[id]);
  EXPECT_EQ(t.chunks(), want);
  EXPECT_EQ(t.tensors(), tensors) << "the tensors stay";
  for (ChunkId c = 0; c < 3; ++c) {
    for (int64_t p = 0; p <= t.size(); ++p) EXPECT_EQ(t.next_use(c, p), next_use_by_scan(want, c, p)) << c << " " << p;
  }
  EXPECT_EQ(t.run_end(2), 4) << "positions 2 and 3 (tensors 1 and 3) now share chunk 0";
}

// cost[s][t]: the fewest moves (in + out) of one pass over `seq` that starts with the chunks in set s
// resident (a bit per chunk) and ends with those in t, with room for `room` chunks of `bytes` each,
// chunks flagged in `trips` leaving after their last use or pin in it: exhaustively, independent of
// Belady (dynamic programming over the resident sets, position by position: a use of a chunk not
// resident brings it in, pushing out any one resident chunk not pinned when the room is full).
std::vector<std::vector<double>> one_pass_costs(const std::vector<ChunkId>& seq,
                                                const std::vector<std::vector<ChunkId>>& pins,
                                                const std::vector<char>& trips, int chunks, int room, int64_t bytes) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const int states = 1 << chunks;
  const int64_t n = static_cast<int64_t>(seq.size());
  // A round trip's chunk leaves after the last position it is used or pinned at.
  std::vector<int64_t> last_need(chunks, -1);
  for (int64_t p = 0; p < n; ++p) {
    if (trips[seq[p]]) last_need[seq[p]] = p;
    for (ChunkId c : pins[p]) {
      if (trips[c]) last_need[c] = p;
    }
  }
  auto size_of = [](int s) { return static_cast<int>(std::bitset<32>(static_cast<unsigned>(s)).count()); };
  std::vector<std::vector<double>> cost(states, std::vector<double>(states, kInf));
  for (int start = 0; start < states; ++start) {
    std::vector<double> best(states, kInf);
    best[start] = 0;
    for (int64_t p = 0; p < n; ++p) {
      const int c = static_cast<int>(seq[p]);
      const int bit = 1 << c;
      int pinned = 0, leaving = 0;
      for (ChunkId x : pins[p]) pinned |= 1 << x;
      for (int x = 0; x < chunks; ++x) {
        if (last_need[x] == p) leaving |= 1 << x;
      }
      std::vector<double> next(states, kInf);
      // After the use: the leaving chunks go, each resident one a move out.
      auto relax = [&](int t, double v) {
        const int gone = t & leaving;
        next[t & ~gone] = std::min(next[t & ~gone], v + bytes * size_of(gone));
      };
      for (int s = 0; s < states; ++s) {
        if (best[s] == kInf) continue;
        if (s & bit) {
          relax(s, best[s]);
        } else if (size_of(s) < room) {
          relax(s | bit, best[s] + bytes);
        } else {
          for (int v = 0; v < chunks; ++v) {
            if (!(s & (1 << v)) || (pinned & (1 << v))) continue;
            relax((s & ~(1 << v)) | bit, best[s] + 2 * bytes);
          }
        }
      }
      best = std::move(next);
    }
    cost[start] = best;
  }
  return cost;
}

// The fewest moves (in + out) per iteration, in the long run, of `seq` repeated with room for `room`
// chunks of `bytes` each, chunks flagged in `trips` leaving after their last use in each iteration:
// exhaustively, independent of Belady. A node is the set of chunks resident when an iteration begins;
// an edge S -> T costs the fewest moves of one iteration that starts with S and ends with T
// (one_pass_costs). The long run is the cycle of least mean cost reachable from the empty device
// (Karp's algorithm).
double fewest_moves_per_iteration(const std::vector<ChunkId>& seq, const std::vector<std::vector<ChunkId>>& pins,
                                  const std::vector<char>& trips, int chunks, int room, int64_t bytes) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const int states = 1 << chunks;
  const std::vector<std::vector<double>> cost = one_pass_costs(seq, pins, trips, chunks, room, bytes);
  // Karp: d[k][v], the least cost of k iterations from the empty device to v.
  std::vector<std::vector<double>> d(states + 1, std::vector<double>(states, kInf));
  d[0][0] = 0;
  for (int k = 1; k <= states; ++k) {
    for (int u = 0; u < states; ++u) {
      if (d[k - 1][u] == kInf) continue;
      for (int v = 0; v < states; ++v) d[k][v] = std::min(d[k][v], d[k - 1][u] + cost[u][v]);
    }
  }
  double mean = kInf;
  for (int v = 0; v < states; ++v) {
    if (d[states][v] == kInf) continue;
    double worst = -kInf;
    for (int k = 0; k < states; ++k) {
      if (d[k][v] != kInf) worst = std::max(worst, (d[states][v] - d[k][v]) / (states - k));
    }
    mean = std::min(mean, worst);
  }
  return mean;
}

// A random case for the Belady tests: 2-5 chunks, `min_length` + [0, `spread`) uses, room for fewer
// chunks than there are; in odd trials pins (the tensor used at q, tensor q in chunk seq[q], held
// through the next 0-2 uses, as long as the pinned chunks leave a victim when the room is full); in
// every third trial round trips (`given`: the flags passed on, empty otherwise).
struct RandomCase {
  int chunks = 0, room = 0;
  std::vector<ChunkId> seq;
  std::vector<std::vector<ChunkId>> pins;
  std::vector<char> trips, given;
  AccessTrace trace;
};

RandomCase draw_case(std::mt19937_64& rng, int trial, int min_length, int spread) {
  RandomCase c;
  c.chunks = 2 + static_cast<int>(rng() % 4);
  const int length = min_length + static_cast<int>(rng() % spread);
  c.room = 1 + static_cast<int>(rng() % (c.chunks - 1));
  for (int i = 0; i < length; ++i) c.seq.push_back(static_cast<ChunkId>(rng() % c.chunks));
  std::vector<std::vector<TensorId>> in_use(length);
  c.pins.resize(length);
  if (trial % 2 == 1) {
    for (int q = 0; q < length; ++q) {
      const int hold = static_cast<int>(rng() % 3);
      for (int p = q + 1; p <= std::min(length - 1, q + hold); ++p) {
        std::vector<ChunkId> more = c.pins[p];
        if (c.seq[q] != c.seq[p] && std::find(more.begin(), more.end(), c.seq[q]) == more.end()) {
          more.push_back(c.seq[q]);
        }
        if (static_cast<int>(more.size()) >= c.room) continue;
        in_use[p].push_back(q);
        c.pins[p] = more;
      }
    }
  }
  for (int i = 0; i < length; ++i) c.trace.record(i, c.seq[i], 0, in_use[i]);
  c.trips.assign(c.chunks, 0);
  if (trial % 3 == 0) {
    for (auto& f : c.trips) f = rng() % 3 == 0;
    c.given = c.trips;
  }
  return c;
}

// With chunks of one size Belady is optimal over every prefix, so its long-run count is the fewest
// moves per iteration there are; with pins (chunks in use with a use, held from one of their uses on)
// too, none of them a victim. Random traces, rooms, pins and round trips; the cycles longer than one
// iteration (a mean that is no whole number of chunks) must be drawn, since there the second
// iteration's count alone (the reference until 2026-12-03) is off, and so must the pins that change
// the count.
TEST(Belady, TheLongRunCountIsTheFewestMovesPerIteration) {
  std::mt19937_64 rng(12);
  int longer_cycles = 0, pins_counted = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const RandomCase c = draw_case(rng, trial, 2, 11);
    const int chunks = c.chunks, room = c.room, length = static_cast<int>(c.seq.size());
    const std::vector<ChunkId>& seq = c.seq;
    const std::vector<std::vector<ChunkId>>& pins = c.pins;
    const std::vector<char>& trips = c.trips;
    const MoveCount m = belady_moves(c.trace, std::vector<int64_t>(chunks, 100), 100 * room, c.given);
    const double fewest = fewest_moves_per_iteration(seq, pins, trips, chunks, room, 100);
    std::vector<std::vector<ChunkId>> no_pins(length);
    if (std::abs(fewest_moves_per_iteration(seq, no_pins, trips, chunks, room, 100) - fewest) > 1.0) ++pins_counted;
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + std::to_string(chunks) + " chunks, room " +
                 std::to_string(room) + ", " + std::to_string(length) + " uses");
    // Each direction's mean is rounded to the byte.
    ASSERT_NEAR(static_cast<double>(m.total()), fewest, 1.0);
    if (m.h2d_bytes % 100 != 0) ++longer_cycles;
  }
  EXPECT_GT(longer_cycles, 20);
  EXPECT_GT(pins_counted, 20);
}

// One pass from a given start (an iteration's own floor, IterationFloor): with chunks of one size
// Belady's count is the fewest moves of that sequence from that start, whatever it leaves behind.
// Random sequences, rooms, pins, round trips and start sets (within the room); the start must change
// the count in many trials, or the start set would be going unread.
TEST(Belady, OnePassFromAStartIsTheFewestMovesOfThatSequence) {
  std::mt19937_64 rng(31);
  int start_counted = 0;
  for (int trial = 0; trial < 800; ++trial) {
    const RandomCase c = draw_case(rng, trial, 1, 12);
    const int chunks = c.chunks, room = c.room, length = static_cast<int>(c.seq.size());
    // A start of at most `room` chunks, as a set of bits and as the list belady_moves_from takes.
    int start = 0;
    std::vector<ChunkId> resident;
    for (ChunkId x = 0; x < chunks; ++x) {
      if (static_cast<int>(resident.size()) < room && rng() % 2 == 0) {
        start |= 1 << x;
        resident.push_back(x);
      }
    }
    const std::vector<int64_t> bytes(chunks, 100);
    const MoveCount m = belady_moves_from(c.trace, bytes, 100 * room, resident, c.given);
    const std::vector<std::vector<double>> cost = one_pass_costs(c.seq, c.pins, c.trips, chunks, room, 100);
    const double fewest = *std::min_element(cost[start].begin(), cost[start].end());
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + std::to_string(chunks) + " chunks, room " +
                 std::to_string(room) + ", " + std::to_string(length) + " uses, start " + std::to_string(start));
    ASSERT_EQ(static_cast<double>(m.total()), fewest);
    if (belady_moves_from(c.trace, bytes, 100 * room, {}, c.given).total() != m.total()) ++start_counted;
  }
  EXPECT_GT(start_counted, 100);
}

// A start over the budget (the device held more before the iteration's budget tightened): the first
// use that needs room gives up the chunks needed furthest ahead, all it takes; one already resident
// needs none. Chunk ids the sizes do not cover are refused, naming them.
TEST(Belady, OnePassFromAStartOverTheBudgetGivesUpTheFurthestFirst) {
  AccessTrace t;
  for (TensorId i = 0; i < 4; ++i) t.record(i, std::vector<ChunkId>{3, 0, 3, 1}[i], 0);
  const std::vector<int64_t> bytes{100, 100, 100, 100};
  // {0, 1, 2} resident, room for 2: chunk 3 comes in for the first use, pushing out 2 (never used
  // again) and then 1 (used last): 0 stays for its use.
  const MoveCount m = belady_moves_from(t, bytes, 200, {0, 1, 2});
  EXPECT_EQ(m.h2d_bytes, 200) << "3 at the start, 1 at the end";
  EXPECT_EQ(m.d2h_bytes, 300) << "2 and 1 to make room for 3, then 0 or 3 for 1";
  AccessTrace resident_use;
  resident_use.record(0, 0, 0);
  EXPECT_EQ(belady_moves_from(resident_use, bytes, 100, {0, 1}).total(), 0) << "no room needed";
  EXPECT_THROW(belady_moves_from(t, bytes, 200, {7}), c10::Error);
  AccessTrace bad;
  bad.record(0, 9, 0);
  EXPECT_THROW(belady_moves_from(bad, bytes, 200, {}), c10::Error);
}

}  // namespace
}  // namespace ferry
