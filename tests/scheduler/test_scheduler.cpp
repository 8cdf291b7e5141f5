// The access trace, OPT eviction and the Belady move count against hand-computed examples, and the
// scheduler's warm-up / follow / diverge / re-trace cycle and per-moment budget on the simulated device.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../chunk/stream_model_engine.h"
#include "../../scheduler/access_trace.h"
#include "../../scheduler/opt_policy.h"
#include "../../scheduler/scheduler.h"

namespace ferry {
namespace {

AccessTrace make_trace(const std::vector<ChunkId>& chunks) {
  AccessTrace t;
  for (ChunkId c : chunks) t.record(c, c, 0);  // tensor i lives in chunk i
  return t;
}

TEST(AccessTrace, NextUseAndFirstUseOrder) {
  AccessTrace t = make_trace({2, 0, 2, 1, 0});
  t.finalize(3);
  EXPECT_EQ(t.next_use(2, 0), 0);
  EXPECT_EQ(t.next_use(2, 1), 2);
  EXPECT_EQ(t.next_use(2, 3), 5);  // not again in this iteration: position 0 of the next one
  EXPECT_EQ(t.next_use(0, 2), 4);
  EXPECT_EQ(t.next_use(7, 0), AccessTrace::kNever);
  EXPECT_EQ(t.first_use_order(4), (std::vector<TensorId>{2, 0, 1}));  // tensor 3 never used
  AccessTrace runs = make_trace({2, 2, 0, 0, 0, 1, 1});
  runs.finalize(3);
  std::vector<int64_t> ends;
  for (int64_t p = 0; p < runs.size(); ++p) ends.push_back(runs.run_end(p));
  EXPECT_EQ(ends, (std::vector<int64_t>{2, 2, 5, 5, 5, 7, 7}));
}

TEST(Belady, HandComputedMoves) {
  // Chunks of 100 B, room for two, one iteration uses 0 1 2, from an empty device:
  //   iteration 1: 0 in, 1 in; 2 misses with {0, 1} resident: next uses 0 -> 3, 1 -> 4: evict 1.
  //   iteration 2 (positions 3-5), {0, 2} on entry: 0 hits; 1 misses: next uses 0 -> 6 (the iteration
  //   after), 2 -> 5: evict 0 (in 100, out 100); 2 hits.
  //   iteration 3, {1, 2} on entry: 0 misses (1 -> 7, 2 -> 8): evict 2; 1 hits; 2 misses (0 -> 9,
  //   1 -> 10): evict 1. In 200, out 200, and {0, 2} again on entry to iteration 4.
  // The long run is iterations 2 and 3 over and over: 150 in and 150 out per iteration (the second
  // iteration's 100 alone was the count until 2026-12-03). LRU would miss all three accesses of every
  // iteration.
  AccessTrace t = make_trace({0, 1, 2});
  const MoveCount m = belady_moves(t, {100, 100, 100}, 200);
  EXPECT_EQ(m.h2d_bytes, 150);
  EXPECT_EQ(m.d2h_bytes, 150);
  // Four in turn with room for two: 8 of every 12 uses miss (a cycle of three iterations), 266.67 B in
  // per iteration, to the byte 267.
  EXPECT_EQ(belady_moves(make_trace({0, 1, 2, 3}), {100, 100, 100, 100}, 200).h2d_bytes, 267);
  EXPECT_EQ(belady_moves(t, {100, 100, 100}, 0).total(), 0);    // no limit: nothing moves in steady state
  EXPECT_EQ(belady_moves(t, {100, 100, 100}, 300).total(), 0);  // everything fits
}

TEST(Belady, RoundTripsLeaveAfterTheirLastUseAndFreeTheirRoom) {
  // Chunks of 100 B; forward 0 1 2, backward 2 1 0 (positions 0-5).
  AccessTrace t = make_trace({0, 1, 2, 2, 1, 0});
  const std::vector<int64_t> bytes = {100, 100, 100};
  // Room for two, no round trips. Steady state (positions 6-11, {0, 1} resident on entry): 2 misses at
  // 8 (next uses 0 -> 11, 1 -> 10): 0 out; 0 misses at 11 (1 -> 13, 2 -> 14): 2 out. 2 in, 2 out.
  MoveCount m = belady_moves(t, bytes, 200);
  EXPECT_EQ(m.h2d_bytes, 200);
  EXPECT_EQ(m.d2h_bytes, 200);
  // Chunks 1 and 2 updated on the host: each leaves after its last use (2 at 9, 1 at 10) and comes back
  // at its first (1 at 7, 2 at 8). Entering with {0}: 1 in at 7; 2 misses at 8 with {0, 1} (0 -> 11,
  // 1 -> 10): 0 out, 2 in; 2 leaves at 9, 1 at 10; 0 in at 11, in the room they left. In: 1, 2, 0;
  // out: 0, 2, 1.
  m = belady_moves(t, bytes, 200, {0, 1, 1});
  EXPECT_EQ(m.h2d_bytes, 300);
  EXPECT_EQ(m.d2h_bytes, 300);
  // Without a limit only the round trips move: 1 and 2 in and out once each.
  m = belady_moves(t, bytes, 0, {0, 1, 1});
  EXPECT_EQ(m.h2d_bytes, 200);
  EXPECT_EQ(m.d2h_bytes, 200);
  // A chunk used once is in for that use only.
  m = belady_moves(make_trace({0, 1, 0}), {100, 100}, 0, {0, 1});
  EXPECT_EQ(m.total(), 200);
  EXPECT_THROW(belady_moves(t, bytes, 200, {1, 1}), c10::Error) << "one flag per chunk";
}

TEST(OptEvictionPolicy, FurthestNextUseAndPrefetchGuard) {
  auto trace = std::make_shared<AccessTrace>(make_trace({0, 1, 2, 3, 3, 1, 0, 2}));
  trace->finalize(4);
  OptEvictionPolicy opt;
  opt.set_trace(trace);
  opt.set_position(3);  // using chunk 3 (next again at 4); next uses: 0 at 6, 1 at 5, 2 at 7
  EvictionRequest r;
  r.bytes_needed = 100;
  r.incoming = 3;
  r.candidates = {{0, 100, 1}, {1, 100, 2}, {2, 100, 3}};
  EXPECT_EQ(opt.choose(r), (std::vector<ChunkId>{2}));
  r.bytes_needed = 200;
  EXPECT_EQ(opt.choose(r), (std::vector<ChunkId>{2, 0}));
  // Prefetch of chunk 0 (needed at 6) from position 3: at 6 Belady would evict chunk 1 (used at 5, next
  // after 6 at 13) over chunk 3 (11) and chunk 2 (7), and chunk 1 cannot go now: nothing may go.
  r.incoming = 0;
  r.candidates = {{1, 100, 2}, {2, 100, 3}};
  EXPECT_TRUE(opt.choose(r).empty());
  // Same at position 4 (chunk 3's last use this iteration, next at 11) without chunk 1 resident: at 6
  // Belady compares chunk 3 (11) and chunk 2 (7) -> chunk 3, which is pinned now: nothing may go.
  opt.set_position(4);
  r.candidates = {{2, 100, 3}};
  EXPECT_TRUE(opt.choose(r).empty());
  // Prefetch of chunk 2 (needed at 7) from position 5 (chunk 1, next after 7 at 9): chunk 0 is needed
  // at 6, chunk 3 next at 11 -> chunk 3 is Belady's victim at 7 and may go now.
  opt.set_position(5);
  r.incoming = 2;
  r.candidates = {{0, 100, 1}, {3, 100, 4}};
  EXPECT_EQ(opt.choose(r), (std::vector<ChunkId>{3}));
  opt.set_position(3);
  // Prefetch of chunk 1 (next use 5) from position 2 (chunk 2, next again at 7): the guard is 7, so
  // nothing may go although chunk 0 (next use 6) is used after chunk 1.
  opt.set_position(2);
  r.incoming = 1;
  r.bytes_needed = 100;
  r.candidates = {{0, 100, 1}};
  EXPECT_TRUE(opt.choose(r).empty());
  opt.set_position(-1);  // off the trace: LRU
  r.candidates = {{1, 100, 2}, {0, 100, 3}};
  EXPECT_EQ(opt.choose(r), (std::vector<ChunkId>{1}));
}

struct Fixture {
  // `chunks` chunks of 100 B, parameter i alone in chunk i.
  explicit Fixture(int64_t budget, std::function<int64_t()> probe = nullptr, int64_t capacity = 0, int chunks = 4,
                   bool align = true, int prefetch_depth = 1, bool stream_copies = false, bool measure_floor = false) {
    ChunkStoreOptions o;
    o.device = DeviceKind::kSimulated;
    o.device_budget_bytes = budget;
    policy = std::make_shared<OptEvictionPolicy>();
    o.policy = policy;
    // stream_copies: the stream-model engine, where a prefetch stays in flight until a use waits for it.
    store = stream_copies ? std::make_unique<ChunkStore>(o, std::make_unique<StreamModelCopyEngine>())
                          : std::make_unique<ChunkStore>(o);
    std::vector<ChunkId> chunk_ids;
    for (int i = 0; i < chunks; ++i) {
      chunk_ids.push_back(store->add_chunk(ChunkRole::kParam, at::kFloat, 25, Location::kHost));  // 100 B
      tensors.push_back(store->add_tensor(chunk_ids.back(), 0, {25}));
    }
    SchedulerOptions so;
    so.align_to_trace = align;
    so.device_budget_bytes = budget;
    so.device_capacity_bytes = capacity;
    so.prefetch_depth = prefetch_depth;
    so.measure_iteration_floor = measure_floor;
    auto p = probe ? make_function_probe(probe) : make_memory_probe(DeviceKind::kSimulated);
    scheduler = std::make_unique<Scheduler>(*store, policy, std::move(p), so, tensors, chunk_ids);
  }
  // After the warm-up: the repack it asks for, onto the same layout.
  void relayout() { scheduler->relayout(*store, tensors, tensors); }
  void run(const std::vector<int64_t>& params) {
    scheduler->begin_iteration();
    for (int64_t p : params) {
      scheduler->pre_use(p);
      scheduler->post_use(p, TensorState::kHoldAfterFwd);
    }
    last = scheduler->end_iteration();
  }
  std::shared_ptr<OptEvictionPolicy> policy;
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<Scheduler> scheduler;
  std::vector<TensorId> tensors;  // = chunk ids
  IterationStats last;
};

TEST(Scheduler, StrictWarmupThenFollowThenRetrace) {
  Fixture f(/*budget=*/300, nullptr, 0, /*chunks=*/4, /*align=*/false);
  const std::vector<int64_t> order = {0, 1, 2, 3, 3, 2, 1, 0};  // forward, then backward
  f.run(order);
  EXPECT_TRUE(f.last.traced);
  EXPECT_EQ(f.last.optimal_bytes, -1);
  const int64_t lru_moves = f.last.h2d_bytes + f.last.d2h_bytes;  // LRU from cold
  EXPECT_TRUE(f.scheduler->repack_wanted());
  f.scheduler->relayout(*f.store, {0, 1, 2, 3}, {0, 1, 2, 3});
  EXPECT_FALSE(f.scheduler->repack_wanted());
  for (int i = 0; i < 3; ++i) {
    f.run(order);
    EXPECT_FALSE(f.last.traced);
    EXPECT_FALSE(f.last.diverged);
    EXPECT_LE(f.last.device_peak_bytes, 300);
    EXPECT_EQ(f.last.optimal_bytes, belady_moves(*f.scheduler->trace(), {100, 100, 100, 100}, 300).total());
    const int64_t moved = f.last.h2d_bytes + f.last.d2h_bytes;
    EXPECT_LT(moved, lru_moves) << "iteration " << i;
    EXPECT_LE(f.last.moved_over_optimal(), 1.5) << "iteration " << i << " moved " << moved;
  }
  f.run({0, 1, 3});  // diverges at position 2
  EXPECT_TRUE(f.last.diverged);
  f.run({0, 1, 3});  // re-traced
  EXPECT_TRUE(f.last.traced);
  f.run({0, 1, 3});  // follows the new trace
  EXPECT_FALSE(f.last.traced);
  EXPECT_FALSE(f.last.diverged);
  // Every tensor is back in HOLD at the end of an iteration.
  for (TensorId t = 0; t < 4; ++t) EXPECT_EQ(f.store->tensor_info(t).state, TensorState::kHold);
}

TEST(Scheduler, TheStepsRoundTripsAreInTheReferenceAndInTheMeter) {
  // Chunks 0 and 1 updated on the host: after each iteration the "step" sends them to the host. The
  // reference counts their round trips once told (set_round_trips), the meter the step's moves out,
  // and OPT gives chunk 1 up first once its last use (6) is behind: at 7 chunk 0 comes in in its room,
  // Belady's choice (before, OPT kept 1 for the next forward and gave up 3, which then came back).
  // With prefetch: a prefetch of 0 issued at 6 finds 1 in use and waits for its room, rather than
  // push out 3 (until 2026-12-02 it took 3: moved / optimal 1.33; Note [The step's round trips in the
  // reference]).
  for (int depth : {0, 1, 2}) {
    SCOPED_TRACE("prefetch depth " + std::to_string(depth));
    Fixture f(/*budget=*/300, nullptr, 0, 4, true, /*prefetch_depth=*/depth);
    const std::vector<int64_t> order = {0, 1, 2, 3, 3, 2, 1, 0};
    auto step = [&] {
      for (ChunkId c : {0, 1}) {
        if (f.store->location(c) == Location::kDevice) f.store->move(c, Location::kHost);
      }
    };
    f.run(order);
    f.relayout();
    step();
    f.run(order);
    step();
    const int64_t trace_alone = belady_moves(*f.scheduler->trace(), {100, 100, 100, 100}, 300).total();
    EXPECT_EQ(f.last.optimal_bytes, trace_alone);
    f.scheduler->set_round_trips({1, 1, 0, 0});
    const int64_t with_trips = belady_moves(*f.scheduler->trace(), {100, 100, 100, 100}, 300, {1, 1, 0, 0}).total();
    EXPECT_GT(with_trips, trace_alone);
    f.run(order);  // from the device the last iteration left, chosen without the flags
    step();
    EXPECT_EQ(f.last.optimal_bytes, with_trips) << "from the iteration after it was told";
    EXPECT_EQ(f.last.between_d2h_bytes, 200) << "the step sent 0 and 1 to the host";
    for (int i = 0; i < 3; ++i) {
      f.run(order);
      step();
      SCOPED_TRACE("iteration " + std::to_string(i));
      EXPECT_EQ(f.last.optimal_bytes, with_trips);
      EXPECT_EQ(f.last.between_d2h_bytes, 100) << "the step sent 0 to the host; OPT had sent 1 at 7";
      EXPECT_DOUBLE_EQ(f.last.moved_over_optimal(), 1.0)
          << "moved " << f.last.h2d_bytes << " + " << f.last.d2h_bytes << " + " << f.last.between_d2h_bytes;
    }
    f.relayout();  // new chunks: the flags were of the old ones
    f.run(order);
    EXPECT_EQ(f.last.optimal_bytes, trace_alone);
    EXPECT_EQ(f.last.between_d2h_bytes, 0) << "a repack starts the meter's gap over";
  }
}

// The run against the reference on random traces (D104): chunks of one size, a budget of a few, uses
// that overlap (each parameter still in use when the next one is: a weight and its bias in two chunks)
// or not, prefetch depth 1 or 2, copies done when issued or left in flight as on a CUDA stream, chunks
// sent to the host after each iteration (round trips) or not. Over many iterations the run moves what
// the reference says is the fewest: the difference stays within what the iterations before the
// reference's cycle and one cycle's phase can add (within one budget's bytes over 48 iterations; seen:
// a tenth of it), not growing with the iterations.
// Before D104 the reference left out the chunks in use with a use (so it was below what any run
// moves where uses overlap), took one iteration for the long run, and the prefetch guard left out the
// chunks in flight: without any one of the three, 24 to 29 of these trials fail, by up to 64 budgets.
TEST(Scheduler, OnRandomTracesTheRunMovesWhatTheReferenceCounts) {
  std::mt19937_64 rng(7);
  int checked = 0, overlapping = 0, longer_cycles = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int chunks = 3 + static_cast<int>(rng() % 5);
    const int length = 4 + static_cast<int>(rng() % 12);
    const bool overlap = rng() % 2 == 0;
    // Overlapping: a parameter in use while the next one is, so never the same one twice in a row
    // (nor the last and the first: the next iteration's first use follows the last).
    std::vector<int64_t> order;
    for (int i = 0; i < length; ++i) {
      int64_t p = static_cast<int64_t>(rng() % chunks);
      while (overlap && ((i > 0 && p == order.back()) || (i == length - 1 && p == order.front()))) {
        p = static_cast<int64_t>(rng() % chunks);
      }
      order.push_back(p);
    }
    const int64_t budget = 100 * (3 + static_cast<int64_t>(rng() % (chunks - 2)));
    const int depth = 1 + static_cast<int>(rng() % 2);
    const bool stream = rng() % 2 == 0;
    std::vector<char> trips(chunks, 0);
    const bool with_trips = rng() % 2 == 0;
    if (with_trips) {
      for (auto& t : trips) t = rng() % 2 == 0;
    }
    Fixture f(budget, nullptr, 0, chunks, true, depth, stream, /*measure_floor=*/true);
    auto run = [&] {
      f.scheduler->begin_iteration();
      int64_t in_use = -1;
      for (int64_t p : order) {
        f.scheduler->pre_use(p);
        if (in_use >= 0) f.scheduler->post_use(in_use, TensorState::kHoldAfterFwd);
        in_use = p;
        if (!overlap) {
          f.scheduler->post_use(p, TensorState::kHoldAfterFwd);
          in_use = -1;
        }
      }
      if (in_use >= 0) f.scheduler->post_use(in_use, TensorState::kHoldAfterFwd);
      f.last = f.scheduler->end_iteration();
      for (ChunkId c = 0; c < chunks; ++c) {  // the step
        if (trips[c] && f.store->location(c) == Location::kDevice) f.store->move(c, Location::kHost);
      }
    };
    run();
    f.relayout();
    if (with_trips) f.scheduler->set_round_trips(trips);
    for (int i = 0; i < 4; ++i) run();  // the reference from the next iteration on, and settling
    int64_t moved = 0, optimal = 0, floor = 0;
    for (int i = 0; i < 48; ++i) {
      run();
      moved += f.last.moved_bytes();
      optimal += f.last.optimal_bytes;
      floor += f.last.floor_bytes;
      ASSERT_LE(f.last.device_peak_bytes, budget);
      // No schedule of this iteration's uses from where it began moves less; its round trips are in
      // the next one's moves (between the two).
      if (!with_trips) ASSERT_LE(f.last.floor_bytes, f.last.moved_bytes()) << "iteration " << i;
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ": budget " + std::to_string(budget) + ", depth " +
                 std::to_string(depth) + (overlap ? ", overlapping" : "") + (stream ? ", stream copies" : "") +
                 (with_trips ? ", round trips" : ""));
    ASSERT_LE(std::abs(moved - optimal), budget) << "moved " << moved << ", the reference " << optimal;
    ASSERT_LE(floor, moved + 100 * chunks) << "the iterations' own floors: the round trips one iteration apart";
    ASSERT_GE(floor, 0);
    ++checked;
    overlapping += overlap ? 1 : 0;
    if (f.last.optimal_bytes % 200 != 0) ++longer_cycles;  // in and out: a whole chunk each per iteration
  }
  EXPECT_EQ(checked, 400);
  EXPECT_GT(overlapping, 150);
  EXPECT_GT(longer_cycles, 10);
}

TEST(Scheduler, ASkippedParameterKeepsTheTraceItsPrefetchesAndIsDroppedWhenItStaysUnused) {
  Fixture f(/*budget=*/300);
  const std::vector<int64_t> full = {0, 1, 2, 3, 3, 2, 1, 0}, without_2 = {0, 1, 3, 3, 1, 0};
  f.run(full);
  f.relayout();
  const int64_t version = f.scheduler->trace_version();
  for (int i = 1; i <= TraceState::kPruneAfter; ++i) {
    SCOPED_TRACE("iteration " + std::to_string(i) + " without parameter 2");
    f.run(without_2);
    EXPECT_FALSE(f.last.traced);
    EXPECT_FALSE(f.last.diverged);
    EXPECT_EQ(f.last.trace_unforeseen, 0);
    EXPECT_LE(f.last.device_peak_bytes, 300);
    EXPECT_EQ(f.last.trace_merged, i == TraceState::kPruneAfter) << "dropped after " << TraceState::kPruneAfter;
    EXPECT_EQ(f.last.trace_skipped, 2);
  }
  EXPECT_EQ(f.scheduler->trace()->tensors(), (std::vector<TensorId>(without_2.begin(), without_2.end())));
  EXPECT_EQ(f.scheduler->trace_version(), version + 1);
  f.run(without_2);
  EXPECT_EQ(f.last.trace_skipped, 0);
  EXPECT_GT(f.last.prefetches, 0);
  // Used again: served on demand once, merged back where it was.
  f.run(full);
  EXPECT_FALSE(f.last.diverged);
  EXPECT_EQ(f.last.trace_unforeseen, 2);
  EXPECT_TRUE(f.last.trace_merged);
  EXPECT_EQ(f.scheduler->trace()->tensors(), (std::vector<TensorId>(full.begin(), full.end())));
  f.run(full);
  EXPECT_EQ(f.last.trace_unforeseen, 0);
  EXPECT_FALSE(f.last.trace_merged);
  for (TensorId t = 0; t < 4; ++t) EXPECT_EQ(f.store->tensor_info(t).state, TensorState::kHold);
}

TEST(Scheduler, ADifferentProgramGivesTheTraceUpAndIsRetraced) {
  // 20 chunks; a trace over 0..19, then iterations that run 0..19 three times (the same parameters in
  // another program: a loop): the second and third passes' uses find no position left, pile up past
  // max(16, 20 / 4), the iteration goes LRU and the next records.
  Fixture f(/*budget=*/500, nullptr, 0, /*chunks=*/20);
  std::vector<int64_t> first, thrice;
  for (int i = 0; i < 20; ++i) first.push_back(i);
  for (int pass = 0; pass < 3; ++pass) thrice.insert(thrice.end(), first.begin(), first.end());
  f.run(first);
  f.relayout();
  f.run(thrice);
  EXPECT_TRUE(f.last.diverged);
  EXPECT_FALSE(f.last.trace_merged);
  f.run(thrice);
  EXPECT_TRUE(f.last.traced);
  f.run(thrice);
  EXPECT_FALSE(f.last.traced);
  EXPECT_FALSE(f.last.diverged);
  EXPECT_EQ(f.last.trace_unforeseen + f.last.trace_skipped, 0);
}

// D108: uses of parameters the trace never had (a part the recorded step skipped: LayerDrop in the
// warm-up or in a step re-traced for a new activation plan) are merged, never given up for, however
// many: recording afresh would serve them no better, and the next iteration follows them. A trace over
// 0..19, then iterations over 20..39 only (before D108 the first of them gave the trace up and the
// next recorded afresh, following nothing).
TEST(Scheduler, UsesOfParametersTheTraceNeverHadAreMergedNotGivenUpFor) {
  Fixture f(/*budget=*/500, nullptr, 0, /*chunks=*/40);
  std::vector<int64_t> first, second;
  for (int i = 0; i < 20; ++i) first.push_back(i), second.push_back(20 + i);
  f.run(first);
  f.relayout();
  f.run(second);
  EXPECT_FALSE(f.last.diverged);
  EXPECT_EQ(f.last.trace_unforeseen, 20);
  EXPECT_TRUE(f.last.trace_merged);
  f.run(second);
  EXPECT_FALSE(f.last.traced);
  EXPECT_EQ(f.last.trace_unforeseen, 0);
  EXPECT_EQ(f.last.trace_skipped, 20) << "followed: the merged trace holds both programs";
  for (int64_t i = 0; i < TraceState::kPruneAfter; ++i) f.run(second);
  EXPECT_FALSE(f.last.diverged);
  EXPECT_EQ(f.last.trace_skipped, 0);
  EXPECT_EQ(f.scheduler->trace()->tensors(), (std::vector<TensorId>(second.begin(), second.end())))
      << "the old program's positions pruned";
}

// LayerDrop on 8 layers (one chunk each) with room for 3: every iteration skips each layer with
// probability 1/4 (forward and backward), the same draws for a strict and an aligning scheduler. The
// strict one gives the trace up in (nearly) every iteration and re-traces the next, without prefetch in
// either; the aligning one keeps following, prefetches in every iteration, and waits for fewer moves.
TEST(Scheduler, OptReachesBeladyOnACycle) {
  // 0 1 2 repeated with room for two: Belady misses every other access; LRU misses every access.
  Fixture f(/*budget=*/200);
  const std::vector<int64_t> order = {0, 1, 2, 0, 1, 2};
  f.run(order);
  f.scheduler->relayout(*f.store, {0, 1, 2, 3}, {0, 1, 2, 3});
  for (int i = 0; i < 2; ++i) {
    f.run(order);
    EXPECT_EQ(f.last.h2d_bytes, 300);
    EXPECT_EQ(f.last.h2d_bytes + f.last.d2h_bytes, f.last.optimal_bytes);
  }
}

TEST(Scheduler, PrefetchBringsTheNextChunkEarly) {
  // Room for three of four chunks, forward then backward: during the forward, a chunk used only at the
  // end of the backward can make room for the next forward chunk ahead of its use.
  Fixture f(/*budget=*/300);
  const std::vector<int64_t> order = {0, 1, 2, 3, 3, 2, 1, 0};
  f.run(order);
  f.scheduler->relayout(*f.store, {0, 1, 2, 3}, {0, 1, 2, 3});
  f.run(order);
  EXPECT_GT(f.last.prefetches, 0);
}

// Runs `params` as one iteration; returns the chunk bytes on the device while parameter 1 is in use.
int64_t run_recording_peak_at_1(Fixture& f, int64_t& current_param, const std::vector<int64_t>& params) {
  f.scheduler->begin_iteration();
  int64_t peak_during_1 = 0;
  for (int64_t p : params) {
    current_param = p;
    f.scheduler->pre_use(p);
    if (p == 1) peak_during_1 = f.store->stats().device.current_bytes;
    f.scheduler->post_use(p, TensorState::kHoldAfterFwd);
  }
  f.last = f.scheduler->end_iteration();
  return peak_during_1;
}

TEST(Scheduler, PerMomentBudgetLeavesRoomForNonModelMemory) {
  // A device of 400 B; the probe reports 150 B of non-model memory while parameter 1 is used (warm-up
  // records it), so when following the trace only 400 - 150 = 250 B are left for chunks around it.
  int64_t current_param = -1;
  Fixture* fp = nullptr;
  Fixture f(/*budget=*/0, [&] {
    const int64_t chunks = fp ? fp->store->stats().device.current_bytes : 0;
    return chunks + (current_param == 1 ? 150 : 0);
  }, /*capacity=*/400);
  fp = &f;
  EXPECT_EQ(run_recording_peak_at_1(f, current_param, {0, 2, 3, 1}), 400);  // warm-up: no reserve known yet
  f.scheduler->relayout(*f.store, {0, 1, 2, 3}, {0, 1, 2, 3});
  EXPECT_LE(run_recording_peak_at_1(f, current_param, {0, 2, 3, 1}), 250);  // following: the reserve applies
  EXPECT_FALSE(f.last.diverged);
  EXPECT_EQ(f.scheduler->device_room_bytes(), 250);
}

// An iteration's own floor takes the room of its roomiest moment: no schedule had more, so none moves
// less. Five chunks on a device of 500 B, 300 B of non-model memory while parameter 2 is used: the
// moments around it leave room for two chunks, the last ones for all five. Taken at the tightest
// moment instead (room for two), the floor of five chunks used in turn is above what the run moves.
TEST(Scheduler, TheIterationFloorHasTheRoomOfItsRoomiestMoment) {
  int64_t current_param = -1;
  Fixture* fp = nullptr;
  Fixture f(/*budget=*/0, [&] {
    const int64_t chunks = fp ? fp->store->stats().device.current_bytes : 0;
    return chunks + (current_param == 2 ? 300 : 0);
  }, /*capacity=*/500, /*chunks=*/5, true, 1, false, /*measure_floor=*/true);
  fp = &f;
  run_recording_peak_at_1(f, current_param, {0, 1, 2, 3, 4});
  f.relayout();
  int64_t moved = 0, floor = 0;
  for (int i = 0; i < 6; ++i) {
    run_recording_peak_at_1(f, current_param, {0, 1, 2, 3, 4});
    ASSERT_FALSE(f.last.diverged);
    ASSERT_GE(f.last.floor_bytes, 0);
    EXPECT_LE(f.last.floor_bytes, f.last.moved_bytes()) << "iteration " << i;
    moved += f.last.moved_bytes();
    floor += f.last.floor_bytes;
  }
  EXPECT_GT(moved, 0) << "the tight moments make the run move";
  EXPECT_LT(floor, moved);
}

TEST(Scheduler, DeviceBudgetIsForChunksWhateverTheNonModelMemory) {
  // A device budget of N bytes means N bytes for chunks: non-model memory larger than the budget (an
  // unwrapped reference model on the same GPU, say) does not shrink it when the capacity has room
  // (on an H100 it turned the budget into 1 B).
  int64_t current_param = -1;
  Fixture* fp = nullptr;
  Fixture f(/*budget=*/300, [&] {
    const int64_t chunks = fp ? fp->store->stats().device.current_bytes : 0;
    return chunks + 10'000;
  }, /*capacity=*/1'000'000);
  fp = &f;
  run_recording_peak_at_1(f, current_param, {0, 1, 2, 3});
  f.scheduler->relayout(*f.store, {0, 1, 2, 3}, {0, 1, 2, 3});
  run_recording_peak_at_1(f, current_param, {0, 1, 2, 3});
  EXPECT_EQ(f.store->stats().device.budget_bytes, 300);
  EXPECT_EQ(f.last.device_peak_bytes, 300);
  EXPECT_EQ(f.scheduler->device_room_bytes(), 300);
}

TEST(Scheduler, CapacityShortOfOneChunkKeepsRoomForOneChunk) {
  // Non-model memory that leaves less than one chunk of the capacity: the budget stays at the largest
  // chunk (the op must run), never a meaningless 1 B; the warning names the numbers.
  int64_t current_param = -1;
  Fixture* fp = nullptr;
  Fixture f(/*budget=*/0, [&] {
    const int64_t chunks = fp ? fp->store->stats().device.current_bytes : 0;
    return chunks + 1'000;
  }, /*capacity=*/1'050);
  fp = &f;
  run_recording_peak_at_1(f, current_param, {0, 1, 2, 3});
  f.scheduler->relayout(*f.store, {0, 1, 2, 3}, {0, 1, 2, 3});
  f.scheduler->begin_iteration();
  for (int64_t p : {0, 1, 2, 3}) {
    current_param = p;
    ASSERT_NO_THROW(f.scheduler->pre_use(p));
    EXPECT_EQ(f.store->stats().device.budget_bytes, 100) << "the largest chunk, at parameter " << p;
    EXPECT_EQ(f.store->stats().device.current_bytes, 100) << "one 100 B chunk at a time";
    f.scheduler->post_use(p, TensorState::kHoldAfterFwd);
  }
  f.scheduler->end_iteration();
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

TEST(SchedulerOptions, BadValuesAreRejected) {
  SchedulerOptions o;
  o.warmup_iterations = 0;
  EXPECT_THROW(o.validate(), c10::Error);
  o = SchedulerOptions{};
  o.prefetch_depth = -1;
  EXPECT_THROW(o.validate(), c10::Error);
  o = SchedulerOptions{};
  o.device_budget_bytes = -1;
  EXPECT_THROW(o.validate(), c10::Error);
  o = SchedulerOptions{};
  o.device_capacity_bytes = -1;
  EXPECT_THROW(o.validate(), c10::Error);
  o = SchedulerOptions{};
  o.reshard_min_gap = -1;
  EXPECT_THROW(o.validate(), c10::Error);
  EXPECT_NO_THROW(SchedulerOptions{}.validate());
}

// Sharded parameters through the scheduler, with a stand-in for dist::ParamShards: groups {0, 1} and
// {2, 3}, none owned here; what it is asked, in order.
struct FakeRemote final : RemoteChunks {
  // Groups of two chunks over the store's `chunks` chunks.
  explicit FakeRemote(ChunkStore& store, int chunks = 4) : store(store), present(static_cast<size_t>(chunks / 2), true) {}
  static int64_t group_of(ChunkId c) { return c / 2; }
  bool remote(ChunkId c) const override { return !present[group_of(c)]; }
  void fetch(ChunkId c) override {
    const int64_t g = group_of(c);
    if (present[g]) return;
    log.push_back("fetch " + std::to_string(g));
    for (ChunkId m : group(c)) {
      if (store.location(m) == Location::kNone) store.allocate_payload(m, Location::kHost);
      for (TensorId t : store.chunk_info(m).tensors) store.set_state(t, TensorState::kHold);
    }
    present[g] = true;
  }
  void prefetch(ChunkId c) override { log.push_back("prefetch " + std::to_string(group_of(c))); }
  std::vector<ChunkId> group(ChunkId c) const override { return {group_of(c) * 2, group_of(c) * 2 + 1}; }
  void release(ChunkId c) override {
    log.push_back("release " + std::to_string(group_of(c)));
    for (ChunkId m : group(c)) {  // a group not gathered (skipped) has nothing to give up, as in ParamShards
      if (store.location(m) != Location::kNone) store.retire(m);
    }
    present[group_of(c)] = false;
  }
  bool any_remote() const override { return std::find(present.begin(), present.end(), false) != present.end(); }
  void fetch_all() override {
    for (size_t g = 0; g < present.size(); ++g) fetch(static_cast<ChunkId>(2 * g));
  }
  void release_all() override {
    for (size_t g = 0; g < present.size(); ++g) {
      for (ChunkId m : group(static_cast<ChunkId>(2 * g))) {
        if (store.location(m) != Location::kNone) store.retire(m);
      }
      present[g] = false;
    }
  }
  int64_t count(const std::string& entry) const { return std::count(log.begin(), log.end(), entry); }
  ChunkStore& store;
  std::vector<bool> present;
  std::vector<std::string> log;
};

// One iteration: forward over `fwd`, then backward over `bwd`.
// `will_skip`: said to the scheduler when the iteration begins (Scheduler::will_not_use).
void run_with_backward(Fixture& f, const std::vector<int64_t>& fwd, const std::vector<int64_t>& bwd,
                       const std::vector<int64_t>& will_skip = {}) {
  f.scheduler->begin_iteration();
  f.scheduler->will_not_use(will_skip);
  for (int64_t p : fwd) {
    f.scheduler->pre_use(p);
    f.scheduler->post_use(p, TensorState::kHoldAfterFwd);
  }
  f.scheduler->begin_backward();
  for (int64_t p : bwd) {
    f.scheduler->pre_use(p);
    f.scheduler->post_use(p, TensorState::kHoldAfterBwd);
  }
  f.last = f.scheduler->end_iteration();
}

TEST(Scheduler, RemoteGroupsAreFetchedBeforeUsePrefetchedAndGivenUpAfterForward) {
  Fixture f(/*budget=*/0);
  const std::vector<int64_t> fwd = {0, 1, 2, 3}, bwd = {3, 2, 1, 0};
  run_with_backward(f, fwd, bwd);  // warm-up: the trace, with where backward starts
  f.scheduler->relayout(*f.store, {0, 1, 2, 3}, {0, 1, 2, 3});
  EXPECT_EQ(f.scheduler->trace()->backward_start(), 4);
  auto remote = std::make_shared<FakeRemote>(*f.store);
  f.scheduler->set_remote(remote);
  remote->release_all();
  // Not confirmed the same on every rank: fetched before use, the next group ahead, nothing given up.
  run_with_backward(f, fwd, bwd);
  EXPECT_EQ(remote->log, (std::vector<std::string>{"fetch 0", "prefetch 1", "fetch 1"}));
  // Confirmed (reshard_min_gap 16 by default): the gap from forward to backward is too short here.
  f.scheduler->allow_forward_releases(f.scheduler->trace_version(), true);
  remote->release_all();
  remote->log.clear();
  run_with_backward(f, fwd, bwd);
  EXPECT_EQ(remote->log, (std::vector<std::string>{"fetch 0", "prefetch 1", "fetch 1"}));
}

TEST(Scheduler, RemoteGroupsWithAFarNextUseAreGivenUpAfterForwardAndFetchedAgain) {
  Fixture f(/*budget=*/0);
  // Rebuilt with reshard_min_gap 1: group 0's next use (position 6) is 4 after its forward (ends at
  // 1); group 1's (position 4) directly follows its forward: kept. Strict, so that each changed order
  // below gives the trace up and the next iteration records a new one (aligned, a new trace comes
  // from a merge: ShardedRunsAlignSkipsSaidAheadAreNotGatheredAndAMergedTraceWaitsForConfirmation).
  SchedulerOptions so;
  so.align_to_trace = false;
  so.prefetch_depth = 1;
  so.reshard_min_gap = 1;
  f.scheduler = std::make_unique<Scheduler>(*f.store, f.policy, make_memory_probe(DeviceKind::kSimulated), so,
                                            std::vector<TensorId>{0, 1, 2, 3}, std::vector<ChunkId>{0, 1, 2, 3});
  const std::vector<int64_t> fwd = {0, 1, 2, 3}, bwd = {3, 2, 1, 0};
  run_with_backward(f, fwd, bwd);
  f.scheduler->relayout(*f.store, {0, 1, 2, 3}, {0, 1, 2, 3});
  auto remote = std::make_shared<FakeRemote>(*f.store);
  f.scheduler->set_remote(remote);
  f.scheduler->allow_forward_releases(f.scheduler->trace_version(), true);
  remote->release_all();
  run_with_backward(f, fwd, bwd);
  EXPECT_EQ(remote->log, (std::vector<std::string>{"fetch 0", "prefetch 1", "release 0", "fetch 1", "prefetch 0",
                                                   "fetch 0"}));
  // A newer trace is not confirmed yet: nothing is given up until it is.
  run_with_backward(f, {0, 1, 3}, {3, 1, 0});  // diverges: re-traced next
  run_with_backward(f, {0, 1, 3}, {3, 1, 0});
  remote->release_all();
  remote->log.clear();
  run_with_backward(f, {0, 1, 3}, {3, 1, 0});
  EXPECT_EQ(std::count(remote->log.begin(), remote->log.end(), "release 0"), 0) << "released on an unconfirmed trace";
  f.scheduler->allow_forward_releases(f.scheduler->trace_version(), true);
  remote->release_all();
  remote->log.clear();
  run_with_backward(f, {0, 1, 3}, {3, 1, 0});
  EXPECT_EQ(std::count(remote->log.begin(), remote->log.end(), "release 0"), 1);
  // Groups not used again after forward keep their chunks (their gradients land there).
  run_with_backward(f, {1, 0, 3}, {3});  // diverges
  run_with_backward(f, {1, 0, 3}, {3});  // re-traced
  f.scheduler->allow_forward_releases(f.scheduler->trace_version(), true);
  remote->release_all();
  remote->log.clear();
  run_with_backward(f, {1, 0, 3}, {3});
  ASSERT_FALSE(f.last.diverged);
  EXPECT_EQ(std::count(remote->log.begin(), remote->log.end(), "release 0"), 0);
}

// D108: with sharded parameters the trace is followed aligning, as in one process. Three groups of two
// chunks; the middle one (a block) is skipped in forward and backward. Learnt as it comes, the skip
// keeps the following going (the strict rule gives the trace up), but the skipped group is prefetched
// (a gather that every rank makes, then given up unclaimed) and the group after it is gathered only
// when its use comes. Said ahead, the block is not gathered at all and the group after it is, ahead. Every skipped iteration releases group 0 after forward as the confirmed trace says.
// After TraceState::kPruneAfter iterations without the block its positions are dropped: a merged trace,
// a new version, on which nothing is given up until the ranks confirm it.
TEST(Scheduler, ShardedRunsAlignSkipsSaidAheadAreNotGatheredAndAMergedTraceWaitsForConfirmation) {
  Fixture f(/*budget=*/0, nullptr, 0, /*chunks=*/6);
  SchedulerOptions so;
  so.prefetch_depth = 1;
  so.reshard_min_gap = 1;
  f.scheduler = std::make_unique<Scheduler>(*f.store, f.policy, make_memory_probe(DeviceKind::kSimulated), so,
                                            f.tensors, f.tensors);
  const std::vector<int64_t> fwd = {0, 1, 2, 3, 4, 5}, bwd = {5, 4, 3, 2, 1, 0};
  const std::vector<int64_t> fwd_skip = {0, 1, 4, 5}, bwd_skip = {5, 4, 1, 0}, block = {2, 3};
  run_with_backward(f, fwd, bwd);
  f.relayout();
  auto remote = std::make_shared<FakeRemote>(*f.store, 6);
  f.scheduler->set_remote(remote);
  f.scheduler->allow_forward_releases(f.scheduler->trace_version(), true);
  const int64_t version = f.scheduler->trace_version();
  auto iteration = [&](const std::vector<int64_t>& forward, const std::vector<int64_t>& backward,
                       const std::vector<int64_t>& said = {}) {
    remote->release_all();
    remote->log.clear();
    run_with_backward(f, forward, backward, said);
  };
  iteration(fwd, bwd);  // exactly the trace
  EXPECT_EQ(remote->count("fetch 1"), 2) << "forward and, given up after it, backward";
  // Learnt: followed on, the block's group prefetched once (at its forward place) and never fetched.
  iteration(fwd_skip, bwd_skip);
  EXPECT_FALSE(f.last.diverged);
  EXPECT_FALSE(f.last.traced);
  EXPECT_GT(f.last.trace_skipped, 0);
  EXPECT_EQ(remote->count("prefetch 1"), 1);
  EXPECT_EQ(remote->count("fetch 1"), 0);
  EXPECT_EQ(remote->count("release 0"), 1) << "the confirmed trace's release after forward";
  EXPECT_EQ(remote->count("prefetch 2"), 0) << "the group after the block: its gather waited for";
  EXPECT_EQ(remote->count("fetch 2"), 1);
  // Said ahead: no gather of the block at all.
  iteration(fwd_skip, bwd_skip, block);
  EXPECT_FALSE(f.last.diverged);
  EXPECT_GT(f.last.trace_hinted, 0);
  EXPECT_EQ(f.last.trace_hints_broken, 0);
  EXPECT_EQ(remote->count("prefetch 1") + remote->count("fetch 1"), 0);
  EXPECT_EQ(remote->log, (std::vector<std::string>{"fetch 0", "prefetch 2", "release 0", "release 1", "fetch 2",
                                                   "prefetch 0", "fetch 0"}))
      << "the group after the block gathered ahead; the block's given up unused, as every rank does";
  EXPECT_EQ(remote->count("release 0"), 1);
  EXPECT_EQ(f.scheduler->trace_version(), version) << "skips change no trace";
  // Strict, the first skip gives the trace up.
  {
    Fixture strict(/*budget=*/0, nullptr, 0, /*chunks=*/6, /*align=*/false);
    run_with_backward(strict, fwd, bwd);
    strict.relayout();
    strict.scheduler->set_remote(std::make_shared<FakeRemote>(*strict.store, 6));
    run_with_backward(strict, fwd_skip, bwd_skip, block);
    EXPECT_TRUE(strict.last.diverged);
    EXPECT_EQ(strict.last.trace_hinted, 0) << "a hint is not taken where the rule is strict";
  }
  // Two more iterations without the block: its positions, unused for kPruneAfter, are dropped.
  for (int i = 0; i < 2; ++i) iteration(fwd_skip, bwd_skip, block);
  ASSERT_EQ(TraceState::kPruneAfter, 4);
  EXPECT_TRUE(f.last.trace_merged);
  EXPECT_EQ(f.scheduler->trace_version(), version + 1);
  EXPECT_EQ(f.scheduler->trace()->size(), 8);
  iteration(fwd_skip, bwd_skip);
  EXPECT_EQ(f.last.trace_skipped, 0) << "the merged trace is the block-less order";
  EXPECT_EQ(remote->count("release 0"), 0) << "released on a trace the ranks have not confirmed";
  f.scheduler->allow_forward_releases(f.scheduler->trace_version(), true);
  iteration(fwd_skip, bwd_skip);
  EXPECT_EQ(remote->count("release 0"), 1);
}

// LayerDrop on 24 layers (one chunk each) with room for 14: every iteration skips each layer with
// probability 1/10, in forward and backward, with the same draws for a strict and an aligning
// scheduler. The strict one gives the trace up in most iterations and re-traces the next, with no
// prefetch in either; the aligning one keeps following, prefetches in every iteration, and its uses
// wait for far fewer moves. What it pays: prefetches of layers the iteration then skips (moved bytes,
// bounded here). Without the backward's passed-over positions (TraceAlignment::begin_backward) it
// waited for 7,400 B and moved 74,900 B, failing the first bound. Run on both engines: with stream
// copies a skipped layer's prefetch stays in flight until a later wait, and when such a held copy
// bounded every prefetch (D104 before D105) the aligned uses waited for 16,900 B against 4,500 B now,
// failing the same bound. The numbers are printed; docs/ARCHITECTURE.md D98 and D105 cite them.
TEST(Scheduler, LayerDropAlignedWaitsForFewerMovesThanRetracing) {
  constexpr int kLayers = 24, kRoom = 14, kIterations = 40;
  std::mt19937 rng(7);
  std::vector<std::vector<int64_t>> forwards;
  for (int it = 0; it < kIterations; ++it) {
    std::vector<int64_t> layers;
    for (int64_t l = 0; l < kLayers; ++l) {
      if (it == 0 || rng() % 10 != 0) layers.push_back(l);  // the warm-up uses every layer
    }
    forwards.push_back(layers);
  }
  struct Totals {
    int64_t demand = 0, moved = 0, diverged_or_traced = 0, without_prefetch = 0;
    int64_t both_ways = 0, floor = 0;  // moved_bytes() and the iterations' own floors, summed
  };
  auto train = [&](bool align, bool stream = false) {
    Fixture f(/*budget=*/kRoom * 100, nullptr, 0, kLayers, align, 1, stream, /*measure_floor=*/true);
    Totals t;
    for (int it = 0; it < kIterations; ++it) {
      const std::vector<int64_t>& fwd = forwards[it];
      run_with_backward(f, fwd, std::vector<int64_t>(fwd.rbegin(), fwd.rend()));
      if (it == 0) f.relayout();
      if (it < 2) continue;  // the warm-up, and the first iteration to follow from a cold device
      EXPECT_LE(f.last.device_peak_bytes, kRoom * 100);
      t.demand += f.last.demand_h2d_bytes();
      t.moved += f.last.h2d_bytes;
      t.diverged_or_traced += (f.last.diverged || f.last.traced) ? 1 : 0;
      t.without_prefetch += f.last.prefetched_bytes == 0 ? 1 : 0;
      EXPECT_LE(f.last.floor_bytes, f.last.moved_bytes()) << "iteration " << it;
      t.both_ways += f.last.moved_bytes();
      t.floor += f.last.floor_bytes;
    }
    return t;
  };
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream copies" : "synchronous copies");
    const Totals strict = train(false, stream), aligned = train(true, stream);
    EXPECT_GT(strict.diverged_or_traced, kIterations / 2) << "the strict scheduler re-traces most iterations";
    EXPECT_EQ(aligned.diverged_or_traced, 0);
    EXPECT_EQ(aligned.without_prefetch, 0);
    EXPECT_LT(aligned.demand * 10, strict.demand);
    EXPECT_LT(aligned.moved, strict.moved * 5 / 4) << "prefetches of skipped layers, bounded";
    std::cout << "LayerDrop (24 layers, room for 14, p = 0.1), 38 iterations, " << (stream ? "stream" : "synchronous")
              << " copies: host->device bytes a use waited for: strict " << strict.demand << ", aligned "
              << aligned.demand << "; host->device bytes moved: strict " << strict.moved << ", aligned "
              << aligned.moved << "; iterations that gave the trace up or re-traced: strict "
              << strict.diverged_or_traced << ", aligned " << aligned.diverged_or_traced
              << "; moved both ways over the iterations' own floors: strict " << strict.both_ways << " / "
              << strict.floor << ", aligned " << aligned.both_ways << " / " << aligned.floor << "\n";
  }
}

// The same LayerDrop, aligning, with each iteration's skips said when it begins (Note [Skips said
// ahead]) against learnt as they come: the hinted run prefetches no chunk of a skipped layer, so it
// moves fewer bytes (here exactly its iterations' own floors), and its uses wait for no more. A
// wrong hint (every layer said skipped, then all used) gives up nothing: the trace is followed, every
// use matches, and each is counted broken.
TEST(Scheduler, LayerDropSkipsSaidAheadMoveNearerTheFloor) {
  constexpr int kLayers = 24, kRoom = 14, kIterations = 40;
  std::mt19937 rng(7);
  std::vector<std::vector<int64_t>> forwards, skips;
  for (int it = 0; it < kIterations; ++it) {
    std::vector<int64_t> layers, skipped;
    for (int64_t l = 0; l < kLayers; ++l) (it == 0 || rng() % 10 != 0 ? layers : skipped).push_back(l);
    forwards.push_back(layers);
    skips.push_back(skipped);
  }
  struct Totals {
    int64_t demand = 0, moved = 0, both_ways = 0, floor = 0, hinted = 0, broken = 0;
  };
  auto train = [&](bool hint, bool stream) {
    Fixture f(/*budget=*/kRoom * 100, nullptr, 0, kLayers, /*align=*/true, 1, stream, /*measure_floor=*/true);
    Totals t;
    for (int it = 0; it < kIterations; ++it) {
      const std::vector<int64_t>& fwd = forwards[it];
      run_with_backward(f, fwd, std::vector<int64_t>(fwd.rbegin(), fwd.rend()),
                        hint ? skips[it] : std::vector<int64_t>{});
      if (it == 0) f.relayout();
      if (it < 2) continue;
      EXPECT_LE(f.last.device_peak_bytes, kRoom * 100);
      EXPECT_FALSE(f.last.diverged || f.last.traced) << "iteration " << it;
      EXPECT_LE(f.last.floor_bytes, f.last.moved_bytes()) << "iteration " << it;
      t.demand += f.last.demand_h2d_bytes();
      t.moved += f.last.h2d_bytes;
      t.both_ways += f.last.moved_bytes();
      t.floor += f.last.floor_bytes;
      t.hinted += f.last.trace_hinted;
      t.broken += f.last.trace_hints_broken;
    }
    return t;
  };
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream copies" : "synchronous copies");
    const Totals learnt = train(false, stream), said = train(true, stream);
    EXPECT_EQ(learnt.hinted, 0);
    EXPECT_GT(said.hinted, 0);
    EXPECT_EQ(said.broken, 0);
    EXPECT_LT(said.moved, learnt.moved);
    EXPECT_LT(said.both_ways * learnt.floor, learnt.both_ways * said.floor) << "moved over floor, nearer 1";
    EXPECT_EQ(said.both_ways, said.floor) << "here the floor itself (123,200 B on both engines)";
    EXPECT_LE(said.demand, learnt.demand);
    std::cout << "LayerDrop (24 layers, room for 14, p = 0.1), 38 iterations, " << (stream ? "stream" : "synchronous")
              << " copies, aligned: host->device bytes moved: skips learnt " << learnt.moved << ", said ahead "
              << said.moved << "; a use waited for: " << learnt.demand << ", " << said.demand
              << "; moved both ways over the iterations' own floors: " << learnt.both_ways << " / " << learnt.floor
              << ", " << said.both_ways << " / " << said.floor << "\n";
  }
  // Every layer said skipped, then all used.
  Fixture f(/*budget=*/kRoom * 100, nullptr, 0, kLayers, /*align=*/true, 1, false, /*measure_floor=*/true);
  std::vector<int64_t> all(kLayers);
  std::iota(all.begin(), all.end(), 0);
  const std::vector<int64_t> backward(all.rbegin(), all.rend());
  run_with_backward(f, all, backward);
  f.relayout();
  run_with_backward(f, all, backward, all);
  EXPECT_FALSE(f.last.diverged || f.last.traced);
  EXPECT_EQ(f.last.trace_skipped + f.last.trace_unforeseen, 0);
  EXPECT_EQ(f.last.trace_hints_broken, 2 * kLayers);
  EXPECT_THROW(f.scheduler->will_not_use({kLayers}), c10::Error) << "an index out of range";
}

}  // namespace
}  // namespace ferry
