// The access trace, OPT eviction and the Belady move count against hand-computed examples, and the
// scheduler's warm-up / follow / diverge / re-trace cycle and per-moment budget on the simulated device.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

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
  // Chunks of 100 B, room for two, one iteration uses 0 1 2; counted: the second of two iterations.
  //   iteration 1: 0 in, 1 in; 2 misses with {0, 1} resident: next uses 0 -> 3, 1 -> 4: evict 1.
  //   iteration 2 (positions 3-5): 0 hits; 1 misses with {0, 2}: next uses 0 -> 6 (the iteration
  //   after), 2 -> 5: evict 0 (in 100, out 100); 2 hits.
  // LRU would miss all three accesses of every iteration.
  AccessTrace t = make_trace({0, 1, 2});
  const MoveCount m = belady_moves(t, {100, 100, 100}, 200);
  EXPECT_EQ(m.h2d_bytes, 100);
  EXPECT_EQ(m.d2h_bytes, 100);
  EXPECT_EQ(belady_moves(t, {100, 100, 100}, 0).total(), 0);    // no limit: nothing moves in steady state
  EXPECT_EQ(belady_moves(t, {100, 100, 100}, 300).total(), 0);  // everything fits
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
  explicit Fixture(int64_t budget, std::function<int64_t()> probe = nullptr, int64_t capacity = 0) {
    ChunkStoreOptions o;
    o.device = DeviceKind::kSimulated;
    o.device_budget_bytes = budget;
    policy = std::make_shared<OptEvictionPolicy>();
    o.policy = policy;
    store = std::make_unique<ChunkStore>(o);
    std::vector<TensorId> tensors;
    std::vector<ChunkId> chunks;
    for (int i = 0; i < 4; ++i) {
      chunks.push_back(store->add_chunk(ChunkRole::kParam, at::kFloat, 25, Location::kHost));  // 100 B
      tensors.push_back(store->add_tensor(chunks.back(), 0, {25}));
    }
    SchedulerOptions so;
    so.device_budget_bytes = budget;
    so.device_capacity_bytes = capacity;
    so.prefetch_depth = 1;
    auto p = probe ? make_function_probe(probe) : make_memory_probe(DeviceKind::kSimulated);
    scheduler = std::make_unique<Scheduler>(*store, policy, std::move(p), so, tensors, chunks);
  }
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
  IterationStats last;
};

TEST(Scheduler, WarmupThenFollowThenRetrace) {
  Fixture f(/*budget=*/300);
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
  explicit FakeRemote(ChunkStore& store) : store(store) {}
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
    for (ChunkId m : group(c)) store.retire(m);
    present[group_of(c)] = false;
  }
  bool any_remote() const override { return !present[0] || !present[1]; }
  void fetch_all() override { fetch(0), fetch(2); }
  void release_all() override {
    for (ChunkId c : {0, 2}) {
      for (ChunkId m : group(c)) {
        if (store.location(m) != Location::kNone) store.retire(m);
      }
      present[group_of(c)] = false;
    }
  }
  ChunkStore& store;
  bool present[2] = {true, true};
  std::vector<std::string> log;
};

// One iteration: forward over `fwd`, then backward over `bwd`.
void run_with_backward(Fixture& f, const std::vector<int64_t>& fwd, const std::vector<int64_t>& bwd) {
  f.scheduler->begin_iteration();
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
  // 1); group 1's (position 4) directly follows its forward: kept.
  SchedulerOptions so;
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

}  // namespace
}  // namespace ferry
