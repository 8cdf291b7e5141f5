// Round trips (optim/round_trips.h, Note [Round trips through K buffers]) through HostJobs, on a
// ChunkStore of the simulated device whose copies stay pending until waited for (the stream-model
// engine, as on a CUDA copy stream): the chunk stays on the device until its job starts, is on the host
// and locked while the job runs, and starts back when it ends; at most K chunks' host buffers are held
// at once, whatever the number of jobs queued (and without the bound all of them are); the next trip's
// chunk is sent ahead where a slot is free; cancel_queued() takes a trip back without moving its chunk
// (one sent ahead starts back); a job that throws still sends its chunk back; bad slot counts are refused.
// Through HybridAdam::backward_step (one rank, eager, the state on the host, room for every parameter
// chunk on the device): the same bits as backward() + step() with 1 and 2 slots, the jobs run in backward
// or carried over behind the next forward, and at most K parameter chunks on the host at once, where the
// unbounded step holds every host-state chunk's; with clipping and fp16 loss scaling backward_step equals
// step() with the same slots, both bounded; where the parameter chunks do not fit the device the step
// stages the host-state chunks on the host as before (correct, not bounded). Both state formats (the
// compact one, D76, is what the bound is for); a checkpoint saved with every host job carried over
// resumes with the same bits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../chunk/chunk_store.h"
#include "../../chunk/stream_model_engine.h"
#include "../../cpu_adam/cpu_adam.h"
#include "../../optim/host_jobs.h"
#include "../../optim/hybrid_adam_options.h"
#include "../test_util.h"
#include "hybrid_adam_fixtures.h"
#include "same_state.h"

namespace ferry::optim {
namespace {

constexpr int64_t kNumel = 64;
constexpr int64_t kBytes = kNumel * 4;

struct Fixture {
  CpuAdam worker;
  HostJobs jobs{worker};
  ChunkStore store{[] {
                     ChunkStoreOptions o;
                     o.device = DeviceKind::kSimulated;
                     return o;
                   }(),
                   std::make_unique<StreamModelCopyEngine>()};
  std::vector<ChunkId> ids;

  explicit Fixture(int64_t chunks) {
    for (int64_t k = 0; k < chunks; ++k) {
      ids.push_back(store.add_chunk(ChunkRole::kParam, at::kFloat, kNumel, Location::kDevice));
      store.payload(ids.back()).fill_(static_cast<float>(k));
    }
    jobs.reset(chunks);
  }
  // Holds the worker until the returned promise is set.
  std::promise<void> hold_worker() {
    std::promise<void> gate;
    worker.run_async([opened = gate.get_future().share()] { opened.wait(); });
    return gate;
  }
};

TEST(RoundTrips, TheChunkLeavesTheDeviceOnlyForItsJob) {
  Fixture f(1);
  f.jobs.set_round_trip_slots(2);
  ASSERT_TRUE(f.jobs.round_trips());
  const ChunkId c = f.ids[0];
  const MoveStats before = f.store.stats().moves;
  std::promise<void> gate = f.hold_worker();
  Location where = Location::kNone;
  bool locked = false;
  torch::Tensor seen;
  f.jobs.put(0, f.jobs.launch(
                    f.store, c, 0, "round trip ",
                    [&](const at::Tensor& bytes) {
                      where = f.store.location(c);
                      locked = f.store.locked_on_host(c);
                      seen = bytes.clone();
                      bytes.add_(1);
                    },
                    /*background_write=*/false, Trip::kRoundTrip));
  EXPECT_EQ(f.store.location(c), Location::kDevice) << "queued: the chunk waits on the device";
  EXPECT_FALSE(f.store.locked_on_host(c));
  EXPECT_EQ(f.store.stats().moves.d2h_count, before.d2h_count) << "nothing moved at launch";
  gate.set_value();
  ASSERT_EQ(f.jobs.join(), nullptr);
  EXPECT_EQ(where, Location::kHost);
  EXPECT_TRUE(locked) << "locked on the host while the job ran";
  EXPECT_TRUE(torch::equal(seen, torch::zeros({kNumel}))) << "the job read the chunk's bytes after the copy landed";
  EXPECT_EQ(f.store.location(c), Location::kDevice) << "sent back when the job ended";
  EXPECT_FALSE(f.store.locked_on_host(c));
  EXPECT_TRUE(torch::equal(f.store.payload(c), torch::ones({kNumel}))) << "with the job's writes";
  const MoveStats after = f.store.stats().moves;
  EXPECT_EQ(after.d2h_count - before.d2h_count, 1);
  EXPECT_EQ(after.h2d_count - before.h2d_count, 1);
  EXPECT_EQ(f.store.stats().host.current_bytes, 0) << "the return landed before the worker went idle: no host buffer held";
  const RoundTrips::Stats s = f.jobs.round_trip_stats();
  EXPECT_EQ(s.slots, 2);
  EXPECT_EQ(s.trips, 1);
  EXPECT_EQ(s.left_on_host, 0);
}

// The bound: 8 jobs queued at once behind a held worker; every job samples the store's host bytes (the
// buffers of the chunks on the host and of the copies still reading them) while it runs.
int64_t peak_host_bytes(int64_t slots, Trip trip, RoundTrips::Stats* stats) {
  constexpr int64_t kChunks = 8;
  Fixture f(kChunks);
  f.jobs.set_round_trip_slots(slots);
  std::promise<void> gate = f.hold_worker();
  std::atomic<int64_t> peak{0};
  for (int64_t k = 0; k < kChunks; ++k) {
    f.jobs.put(k, f.jobs.launch(
                      f.store, f.ids[k], k, "bounded ",
                      [&](const at::Tensor& bytes) {
                        const int64_t now = f.store.stats().host.current_bytes;
                        int64_t seen = peak.load();
                        while (now > seen && !peak.compare_exchange_weak(seen, now)) {
                        }
                        bytes.add_(100);
                      },
                      /*background_write=*/false, trip));
  }
  gate.set_value();
  EXPECT_EQ(f.jobs.join(), nullptr);
  f.store.synchronize();
  for (int64_t k = 0; k < kChunks; ++k) {
    EXPECT_TRUE(torch::equal(f.store.payload(f.ids[k]), torch::full({kNumel}, 100.0f + k))) << "chunk " << k;
    EXPECT_FALSE(f.store.locked_on_host(f.ids[k])) << "chunk " << k;
  }
  if (stats) *stats = f.jobs.round_trip_stats();
  return std::max(peak.load(), f.store.stats().host.peak_bytes);
}

TEST(RoundTrips, AtMostKChunksAreOnTheHostAtOnce) {
  const int64_t unbounded = peak_host_bytes(0, Trip::kRoundTrip, nullptr);
  EXPECT_EQ(unbounded, 8 * kBytes) << "without slots every queued job's chunk waits on the host";
  EXPECT_EQ(peak_host_bytes(3, Trip::kStay, nullptr), 8 * kBytes) << "kStay jobs take no round trip";
  for (const int64_t k : {1, 2, 3}) {
    SCOPED_TRACE("slots " + std::to_string(k));
    RoundTrips::Stats s;
    EXPECT_LE(peak_host_bytes(k, Trip::kRoundTrip, &s), k * kBytes);
    EXPECT_EQ(s.trips, 8);
    EXPECT_LE(s.peak_held, k);
    EXPECT_EQ(s.left_on_host, 0);
    if (k == 1) {
      EXPECT_EQ(s.sent_ahead, 0) << "one slot: the job's own";
    } else {
      EXPECT_GT(s.sent_ahead, 0) << "a free slot carries the next chunk while a job runs";
    }
  }
}

// cancel_queued() while the first trip's job runs: the trips behind it are taken back; the one sent
// ahead starts back to the device, the others never moved; none is locked, and none ran.
TEST(RoundTrips, CancelTakesATripBackWithoutItsJob) {
  Fixture f(4);
  f.jobs.set_round_trip_slots(3);
  std::promise<void> gate = f.hold_worker();
  std::promise<void> running, go;
  std::shared_future<void> let_go = go.get_future().share();
  std::atomic<int> ran{0};
  f.jobs.launch_cancellable(
      f.store, f.ids[0], 0, "held ",
      [&](const at::Tensor& bytes) {
        running.set_value();
        let_go.wait();
        bytes.add_(10);
        ++ran;
      },
      Trip::kRoundTrip);
  for (int64_t k = 1; k < 4; ++k) {
    f.jobs.launch_cancellable(
        f.store, f.ids[k], k, "queued ",
        [&](const at::Tensor& bytes) {
          bytes.add_(10);
          ++ran;
        },
        Trip::kRoundTrip);
  }
  const MoveStats before = f.store.stats().moves;
  gate.set_value();
  running.get_future().wait();
  EXPECT_EQ(f.jobs.round_trip_stats().sent_ahead, 1) << "chunk 1 went ahead while chunk 0's job ran";
  EXPECT_EQ(f.jobs.cancel_queued(), (std::vector<int64_t>{1, 2, 3}));
  for (int64_t k = 1; k < 4; ++k) {
    EXPECT_EQ(f.store.location(f.ids[k]), Location::kDevice) << "chunk " << k << " is on (or on its way to) the device";
    EXPECT_FALSE(f.store.locked_on_host(f.ids[k])) << k;
  }
  go.set_value();
  EXPECT_EQ(f.jobs.join(), nullptr);
  f.worker.run_async([] {}).get();  // the worker has passed the skipped jobs
  EXPECT_EQ(ran.load(), 1);
  const MoveStats after = f.store.stats().moves;
  EXPECT_EQ(after.d2h_count - before.d2h_count, 2) << "chunk 0's trip and chunk 1's ahead; 2 and 3 never moved";
  for (int64_t k = 0; k < 4; ++k) {
    EXPECT_EQ(f.store.location(f.ids[k]), Location::kDevice) << k;
    EXPECT_TRUE(torch::equal(f.store.payload(f.ids[k]), torch::full({kNumel}, k == 0 ? 10.0f : float(k)))) << k;
  }
}

TEST(RoundTrips, AJobThatThrowsStillSendsItsChunkBack) {
  Fixture f(1);
  f.jobs.set_round_trip_slots(1);
  std::future<void> job = f.jobs.launch(
      f.store, f.ids[0], 0, "failing ", [](const at::Tensor&) { throw std::runtime_error("failed on purpose"); },
      /*background_write=*/false, Trip::kRoundTrip);
  EXPECT_THROW(job.get(), std::runtime_error);
  f.worker.run_async([] {}).get();
  EXPECT_FALSE(f.store.locked_on_host(f.ids[0]));
  EXPECT_EQ(f.store.location(f.ids[0]), Location::kDevice);
  EXPECT_EQ(f.jobs.round_trip_stats().trips, 1);
}

TEST(RoundTrips, RefusesANegativeSlotCount) {
  CpuAdam worker;
  HostJobs jobs(worker);
  std::string err = test::error_of([&] { jobs.set_round_trip_slots(-1); });
  EXPECT_NE(err.find("round trip slots must be >= 0"), std::string::npos) << err;
  EXPECT_NE(err.find("got -1"), std::string::npos) << err;
  HybridAdamOptions options;
  options.round_trip_slots = -2;
  err = test::error_of([&] { options.validate(); });
  EXPECT_NE(err.find("round_trip_slots must be >= 0"), std::string::npos) << err;
  jobs.set_round_trip_slots(0);
  EXPECT_FALSE(jobs.round_trips());
  EXPECT_EQ(jobs.round_trip_stats().slots, 0);
}

// backward_step with `slots` against backward() + step() over 6 steps (the first ones unpipelined on
// both sides: they are step()s too). The reference: the unbounded step in the eager case; with clipping
// or fp16 loss scaling, step() with the same slots (so that its host peak is measured too), or the
// unbounded one (`unbounded_reference`): its norms are taken on the host, the bounded step's on the
// device, in one order (D85), so the bits are the same either way. Returns the most parameter-chunk
// bytes the two models' stores held on the host from the second step on.
struct TripCase {
  int64_t slots = 0;
  bool carry_over = false;
  double max_grad_norm = 0.0;
  Precision precision = Precision::kBf16;
  int64_t budget_param_chunks = 16;  // the device budget: room for this many parameter chunks ...
  int64_t device_state_groups = 0;   // ... and this many state groups on the device
  StateFormat format = StateFormat::kFp32;
  bool unbounded_reference = false;
};
struct TripRun {
  int64_t host_peak = 0;  // backward_step's model
  int64_t step_host_peak = 0;  // the reference's (step())
  int64_t chunk_bytes = 0;
  int64_t host_chunks = 0;
  int64_t carried = 0;
  int64_t overflows = 0;
  int64_t evictions = 0;
  RoundTrips::Stats stats;
};
TripRun train_with_round_trips(const TripCase& tc) {
  using namespace test;  // NOLINT: the fixtures
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = tc.device_state_groups;
  options.carry_over_host_updates = tc.carry_over;
  options.round_trip_slots = tc.slots;
  options.max_grad_norm = tc.max_grad_norm;
  options.state_format = tc.format;
  options.loss_scaler.initial_scale = 65536.0;  // fp16: overflows first, then steps
  options.loss_scaler.hysteresis = 1;
  const bool eager = tc.max_grad_norm == 0.0 && tc.precision != Precision::kFp16;
  torch::manual_seed(61);
  TinyLm a_net(kVocab, kDim);
  torch::manual_seed(61);
  TinyLm b_net(kVocab, kDim);
  ChunkedModelOptions lagging;  // copies pending until waited for, as on a CUDA copy stream
  lagging.copy_engine = [] { return std::make_unique<StreamModelCopyEngine>(); };
  // Room for every parameter chunk (the case the bound is for); the state all on the host.
  // A state group of a 16-bit parameter chunk is 3 fp32 chunks of twice its bytes.
  const int64_t budget = budget_for(tc.budget_param_chunks, 2 * tc.device_state_groups);
  ChunkedModel a(a_net.ptr(), sim_config(budget, tc.precision));
  ChunkedModel b(b_net.ptr(), sim_config(budget, tc.precision), std::move(lagging));
  HybridAdam a_adam(a, HybridAdamOptions(options).with_round_trip_slots(eager || tc.unbounded_reference ? 0 : tc.slots)),
      b_adam(b, options);
  TripRun run;
  for (int step = 0; step < 6; ++step) {
    const std::string when = "step " + std::to_string(step);
    const Batch x = batch(step);
    a.store().reset_peak_stats();
    a.backward(forward_loss(a, a_net, x));
    const StepResult ra = a_adam.step();
    a_adam.synchronize();
    b.store().reset_peak_stats();
    // Carry-over: the worker held until backward_step returns, so every job is taken back and carried over.
    const StepResult rb =
        with_worker_held(b_adam, tc.carry_over, [&] { return b_adam.backward_step(forward_loss(b, b_net, x)); });
    b_adam.synchronize();
    a_adam.zero_grad();
    b_adam.zero_grad();
    EXPECT_EQ(ra.applied, rb.applied) << when;
    // The pipeline's norms from the device, the unbounded step()'s from the host: the same bits (D85).
    EXPECT_EQ(ra.grad_norm, rb.grad_norm) << when;
    run.overflows += rb.overflow;
    run.evictions += b.last_iteration().evictions;
    EXPECT_NO_FATAL_FAILURE(expect_same_state(a_adam, b_adam, a, b, when));
    if (step >= 1) {
      run.host_peak = std::max(run.host_peak, b.store().stats().host.peak_bytes);
      run.step_host_peak = std::max(run.step_host_peak, a.store().stats().host.peak_bytes);
      run.host_chunks = rb.host_chunks;
      run.carried += rb.deferred_chunks;
    }
  }
  run.chunk_bytes = b.store().chunk_info(b.param_chunk(0)).nbytes;
  run.stats = b_adam.round_trip_stats();
  return run;
}

// Both state formats: the compact one (D76) is the bound's case (30b), the fp32 one the default.
class RoundTripsByFormat : public ::testing::TestWithParam<StateFormat> {};

TEST_P(RoundTripsByFormat, HybridAdamHoldsAtMostKChunksOnTheHostWithTheSameBits) {
  for (const bool carry_over : {false, true}) {
    SCOPED_TRACE(carry_over ? "jobs carried over behind the next forward" : "jobs in backward");
    TripCase tc;
    tc.carry_over = carry_over;
    tc.format = GetParam();
    const TripRun unbounded = train_with_round_trips(tc);
    ASSERT_GE(unbounded.host_chunks, 3);
    EXPECT_GE(unbounded.host_peak, unbounded.host_chunks * unbounded.chunk_bytes)
        << "without the bound every host-state chunk waits on the host";
    EXPECT_EQ(unbounded.stats.trips, 0);
    for (const int64_t k : {1, 2}) {
      SCOPED_TRACE("slots " + std::to_string(k));
      tc.slots = k;
      const TripRun bounded = train_with_round_trips(tc);
      EXPECT_LE(bounded.host_peak, k * bounded.chunk_bytes);
      EXPECT_GT(bounded.stats.trips, 0);
      EXPECT_LE(bounded.stats.peak_held, k);
      EXPECT_EQ(bounded.stats.left_on_host, 0);
      if (carry_over) {
        EXPECT_GT(bounded.carried, 0) << "the carried-over path must be taken to be tested";
      }
      std::printf("%s state, %s, %lld slot(s): host peak %lld B of parameter chunks (unbounded %lld), %lld trips, %lld sent "
                  "ahead, %lld carried over\n",
                  tc.format == StateFormat::kFp32 ? "fp32" : "compact", carry_over ? "carry-over" : "in backward",
                  static_cast<long long>(k),
                  static_cast<long long>(bounded.host_peak), static_cast<long long>(unbounded.host_peak),
                  static_cast<long long>(bounded.stats.trips), static_cast<long long>(bounded.stats.sent_ahead),
                  static_cast<long long>(bounded.carried));
    }
  }
}

// A checkpoint taken right after a bounded backward_step whose host jobs were all carried over (none had
// run when save() was called: it settles them, their round trips included), loaded into a model and an
// optimizer built afresh from other initial values: the resumed run ends with the bits of the run that
// never stopped, and the run that saved goes on unchanged.
TEST_P(RoundTripsByFormat, ACheckpointTakenWithUpdatesCarriedOverResumesWithTheSameBits) {
  using namespace test;  // NOLINT: the fixtures
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.carry_over_host_updates = true;
  options.round_trip_slots = 2;
  options.state_format = GetParam();
  options.device_state_chunks = 0;  // the state on the host: every chunk's update a round trip
  const int64_t budget = budget_for(16, 0);
  const auto lagging = [] {
    ChunkedModelOptions o;  // copies pending until waited for, as on a CUDA copy stream
    o.copy_engine = [] { return std::make_unique<StreamModelCopyEngine>(); };
    return o;
  };
  auto [a_net, b_net] = twins(61);
  ChunkedModel a(a_net.ptr(), sim_config(budget, Precision::kBf16), lagging());
  ChunkedModel b(b_net.ptr(), sim_config(budget, Precision::kBf16), lagging());
  HybridAdam a_adam(a, options), b_adam(b, options);
  // One step with every host job carried over; returns how many were.
  const auto train = [](ChunkedModel& model, TinyLm& net, HybridAdam& adam, int step) {
    const StepResult r = with_worker_held(adam, true, [&] { return adam.backward_step(forward_loss(model, net, batch(step))); });
    EXPECT_TRUE(r.applied) << "step " << step;
    adam.zero_grad();
    return r.deferred_chunks;
  };
  const std::string dir = temp_dir("round-trips-resume");
  for (int step = 0; step < 3; ++step) {
    train(a, a_net, a_adam, step);
    const int64_t carried = train(b, b_net, b_adam, step);
    if (step == 2) {
      ASSERT_GT(carried, 0) << "the save must find updates carried over";
      b_adam.save(dir);
    }
  }
  torch::manual_seed(62);
  TinyLm c_net(kVocab, kDim);
  ChunkedModel c(c_net.ptr(), sim_config(budget, Precision::kBf16), lagging());
  HybridAdam c_adam(c, options);
  c_adam.load(dir);
  for (int step = 3; step < 6; ++step) {
    train(a, a_net, a_adam, step);
    train(b, b_net, b_adam, step);
    train(c, c_net, c_adam, step);
  }
  a_adam.synchronize();
  b_adam.synchronize();
  c_adam.synchronize();
  ASSERT_NO_FATAL_FAILURE(expect_same_state(a_adam, b_adam, a, b, "the run that saved"));
  ASSERT_NO_FATAL_FAILURE(expect_same_state(a_adam, c_adam, a, c, "the resumed run"));
  EXPECT_GT(c_adam.round_trip_stats().trips, 0);
  remove_checkpoint(dir);
}

INSTANTIATE_TEST_SUITE_P(Formats, RoundTripsByFormat, ::testing::Values(StateFormat::kFp32, StateFormat::kCompact),
                         [](const ::testing::TestParamInfo<StateFormat>& info) {
                           return std::string(info.param == StateFormat::kFp32 ? "Fp32" : "Compact");
                         });

// The two-phase step's cases, 2 slots: clipping; fp16 loss scaling, whose first steps overflow and are
// skipped.
struct NamedTrip {
  const char* name;
  TripCase tc;
};
const NamedTrip kTwoPhaseTrips[] = {{"clipping", {2, false, 0.05, Precision::kBf16}},
                                    {"fp16 loss scaling", {2, false, 0.0, Precision::kFp16}}};

// The two-phase step: the norms on the device, the update's trip the only one; step() bounded too.
TEST(RoundTrips, TheTwoPhaseStepAndStepAreBoundedToo) {
  for (const NamedTrip& n : kTwoPhaseTrips) {
    SCOPED_TRACE(n.name);
    const TripRun unbounded = train_with_round_trips({0, false, n.tc.max_grad_norm, n.tc.precision});
    const TripRun bounded = train_with_round_trips(n.tc);
    ASSERT_GE(bounded.host_chunks, 3);
    EXPECT_GE(unbounded.host_peak, unbounded.host_chunks * unbounded.chunk_bytes);
    EXPECT_GE(unbounded.step_host_peak, unbounded.host_chunks * unbounded.chunk_bytes);
    EXPECT_LE(bounded.host_peak, n.tc.slots * bounded.chunk_bytes) << "backward_step";
    EXPECT_LE(bounded.step_host_peak, n.tc.slots * bounded.chunk_bytes) << "step()";
    EXPECT_GT(bounded.stats.trips, 0);
    if (n.tc.precision == Precision::kFp16) {
      EXPECT_GT(bounded.overflows, 0) << "the skipped steps must be tested";
    }
  }
}

// D85: the bounded two-phase step takes the host-state chunks' norms on the device, the unbounded step()
// on the host; the one order of summation makes the clip coefficient, the overflow decisions and every
// bit the same. (It fails with the device's norm as before D85: the norms differ in their last bits.)
TEST(RoundTrips, BoundedTwoPhaseStepsGiveTheUnboundedStepsBits) {
  for (const NamedTrip& n : kTwoPhaseTrips) {
    SCOPED_TRACE(n.name);
    TripCase tc = n.tc;
    tc.unbounded_reference = true;
    const TripRun bounded = train_with_round_trips(tc);
    EXPECT_GT(bounded.stats.trips, 0);
    EXPECT_LE(bounded.host_peak, tc.slots * bounded.chunk_bytes) << "backward_step";
  }
}

// Where the parameter chunks do not fit the device (room for 3 and 2 state groups; forced evictions), the
// bound cannot hold: the step stages the host-state chunks on the host as without it (else the staging
// of the device-state ones would evict each other), the returns that find no room stay there, and the
// bits are still those of the unbounded step() (eager: no norm reaches the values).
TEST(RoundTrips, WhereTheChunksDoNotFitTheStepStagesAsBefore) {
  TripCase tc;
  tc.slots = 2;
  tc.budget_param_chunks = 3;
  tc.device_state_groups = 2;
  const TripRun run = train_with_round_trips(tc);
  EXPECT_GT(run.evictions, 0) << "the case needs evictions";
  EXPECT_GT(run.stats.trips, 0);
}

}  // namespace
}  // namespace ferry::optim
