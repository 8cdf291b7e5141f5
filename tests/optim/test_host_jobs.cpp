// HostJobs (optim/host_jobs.h) alone, on CpuAdam's worker: join() returns the first error, a superseded
// job's included; take(), wait(), wait_all() and drop(); only jobs that uses wait for put in_backward();
// and launch() on a ChunkStore of the simulated device whose copies stay pending until waited for: the
// chunk moves to the host in one transfer, the job runs on its bytes once the copy has landed (waited for
// on the worker, not the caller), the chunk is locked on the host while the job runs and unlocked after,
// also when the job throws; started() counts the jobs that ran; cancel_queued() takes back the jobs not
// started; take_work_times() counts each chunk's work, not its wait in the queue, and forgets on taking.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../../chunk/chunk_store.h"
#include "../../chunk/stream_model_engine.h"
#include "../../cpu_adam/cpu_adam.h"
#include "../../hooks/interceptor.h"
#include "../../optim/host_jobs.h"
#include "../test_util.h"

namespace ferry::optim {
namespace {

std::future<void> done() {
  std::promise<void> p;
  p.set_value();
  return p.get_future();
}
std::future<void> failed(const std::string& what) {
  std::promise<void> p;
  p.set_exception(std::make_exception_ptr(std::runtime_error(what)));
  return p.get_future();
}
// The message of `error`, or "(none)".
std::string message(const std::exception_ptr& error) {
  if (!error) return "(none)";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
}

TEST(HostJobs, JoinReturnsTheFirstErrorASupersededJobsIncluded) {
  CpuAdam worker;
  HostJobs jobs(worker);
  jobs.reset(3);
  jobs.put(0, failed("superseded"));
  jobs.supersede(0);  // chunk 0 is worked on again: its first job ends, its error kept
  EXPECT_FALSE(jobs.has(0));
  jobs.put(0, done());
  jobs.put(1, failed("chunk 1"));
  jobs.put(2, failed("chunk 2"));
  EXPECT_EQ(message(jobs.join()), "superseded");
  for (int64_t c = 0; c < 3; ++c) EXPECT_FALSE(jobs.has(c)) << c;
  EXPECT_EQ(message(jobs.join()), "(none)") << "join() forgot every job and error";
  // Without a superseded error: the first in chunk order.
  jobs.reset(3);
  jobs.put(2, failed("chunk 2"));
  jobs.put(1, failed("chunk 1"));
  jobs.put(0, done());
  EXPECT_EQ(message(jobs.join()), "chunk 1");
  // Of two superseded jobs that failed, the first one's.
  jobs.reset(2);
  jobs.put(1, failed("first"));
  jobs.supersede(1);
  jobs.put(1, failed("second"));
  jobs.supersede(1);
  EXPECT_EQ(message(jobs.join()), "first");
}

TEST(HostJobs, TakeWaitAndDrop) {
  CpuAdam worker;
  HostJobs jobs(worker);
  jobs.reset(2);
  EXPECT_EQ(message(jobs.take(1)), "(none)") << "no job for chunk 1";
  EXPECT_EQ(message(jobs.take(7)), "(none)") << "past the chunks";
  jobs.put(1, failed("chunk 1"));
  jobs.wait(1);
  EXPECT_TRUE(jobs.has(1)) << "wait() leaves the job for take() or join()";
  EXPECT_EQ(message(jobs.take(1)), "chunk 1");
  EXPECT_FALSE(jobs.has(1));
  EXPECT_EQ(message(jobs.take(1)), "(none)");
  jobs.put(4, failed("chunk 4"));  // past reset()'s room: it grows
  EXPECT_TRUE(jobs.has(4));
  jobs.wait_all();
  EXPECT_TRUE(jobs.has(4)) << "wait_all() takes nothing";
  jobs.put(0, failed("superseded"));
  jobs.supersede(0);
  jobs.drop();  // a failed backward dealt with them
  EXPECT_FALSE(jobs.has(4));
  EXPECT_FALSE(jobs.in_backward());
  EXPECT_EQ(message(jobs.join()), "(none)") << "drop() forgot the jobs and the superseded error";
}

TEST(HostJobs, OnlyJobsThatUsesWaitForAreInBackward) {
  CpuAdam worker;
  HostJobs jobs(worker);
  jobs.reset(2);
  EXPECT_FALSE(jobs.in_backward());
  jobs.put(0, done(), /*uses_wait=*/false);  // an owner's job across ranks
  EXPECT_FALSE(jobs.in_backward());
  jobs.put(1, done());
  EXPECT_TRUE(jobs.in_backward());
  EXPECT_EQ(message(jobs.join()), "(none)");
  EXPECT_FALSE(jobs.in_backward()) << "join() ends the backward's jobs";
  EXPECT_EQ(jobs.started(), 0) << "started() counts launched jobs that ran, not put()";
}

ChunkStoreOptions simulated() {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  return o;
}

// Four float chunks of 64 elements on the simulated device (their copies pending until waited for), and
// jobs on a worker of their own, room for four.
struct FourChunks {
  CpuAdam worker;
  HostJobs jobs{worker};
  ChunkStore store{simulated(), std::make_unique<StreamModelCopyEngine>()};
  std::vector<ChunkId> ids;
  FourChunks() {
    for (int k = 0; k < 4; ++k) ids.push_back(store.add_chunk(ChunkRole::kParam, at::kFloat, 64, Location::kDevice));
    jobs.reset(4);
  }
};

// A job that stops at its start until the test lets it go: what the chunk's store says while it runs.
TEST(HostJobs, LaunchLocksTheChunkOnTheHostWhileTheJobRuns) {
  CpuAdam worker;
  HostJobs jobs(worker);
  ChunkStore store(simulated(), std::make_unique<StreamModelCopyEngine>());
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 64, Location::kDevice);
  const torch::Tensor values = torch::arange(64, torch::kFloat);
  store.payload(c).copy_(values);
  const MoveStats before = store.stats().moves;
  std::promise<void> running, go;
  std::shared_future<void> let_go = go.get_future().share();
  bool locked_in_job = false;
  Location where = Location::kNone;
  torch::Tensor seen;
  std::future<void> job = jobs.launch(store, c, /*chunk=*/0, "test job ", [&](const at::Tensor& bytes) {
    locked_in_job = store.locked_on_host(c);
    where = store.location(c);
    seen = bytes.clone();
    running.set_value();
    let_go.wait();
    bytes.add_(1);
  });
  running.get_future().wait();
  EXPECT_TRUE(store.locked_on_host(c));
  const std::string err = test::error_of([&] { store.move(c, Location::kDevice); });
  EXPECT_NE(err.find("locked on the host"), std::string::npos) << err;
  EXPECT_EQ(jobs.started(), 1);
  go.set_value();
  job.get();
  EXPECT_FALSE(store.locked_on_host(c)) << "unlocked when the job ended";
  EXPECT_TRUE(locked_in_job);
  EXPECT_EQ(where, Location::kHost);
  EXPECT_TRUE(torch::equal(seen, values)) << "the job ran on the chunk's bytes once the copy had landed";
  EXPECT_TRUE(torch::equal(store.payload(c), values + 1)) << "and wrote them in place";
  const MoveStats after = store.stats().moves;
  EXPECT_EQ(after.d2h_count - before.d2h_count, 1) << "one transfer";
  EXPECT_EQ(after.background_sync_count - before.background_sync_count, 1) << "the worker waited for the copy";
  EXPECT_EQ(after.sync_count, before.sync_count) << "the caller never blocked on it";
  EXPECT_EQ(store.location(c), Location::kHost);
}

TEST(HostJobs, LaunchUnlocksTheChunkWhenTheJobThrows) {
  CpuAdam worker;
  HostJobs jobs(worker);
  ChunkStore store(simulated(), std::make_unique<StreamModelCopyEngine>());
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 64, Location::kHost);  // no move needed
  const MoveStats before = store.stats().moves;
  int64_t hazards_in_job = -1;
  std::future<void> job = jobs.launch(
      store, c, /*chunk=*/3, "failing job ",
      [&](const at::Tensor&) {
        hazards_in_job = outside_hazards();
        throw std::runtime_error("the job failed on purpose");
      },
      /*background_write=*/true);
  EXPECT_THROW(job.get(), std::runtime_error);
  EXPECT_FALSE(store.locked_on_host(c));
  EXPECT_EQ(jobs.started(), 1);
  EXPECT_GT(hazards_in_job, 0) << "a background write is announced while it runs";
  EXPECT_EQ(outside_hazards(), 0) << "and over when it ended, failed or not";
  EXPECT_EQ(store.stats().moves.d2h_count, before.d2h_count) << "already on the host: nothing moved";
  // The chunk can be worked on again.
  jobs.reset(4);
  jobs.put(3, jobs.launch(store, c, 3, "second job ", [](const at::Tensor& bytes) { bytes.fill_(7); }));
  EXPECT_EQ(message(jobs.join()), "(none)");
  EXPECT_EQ(jobs.started(), 2);
  EXPECT_TRUE(torch::equal(store.payload(c), torch::full({64}, 7.0f)));
}

// cancel_queued() (Note [Host updates carried over behind the next forward], optim/engine_step.cpp): with
// the worker held by a job the test lets go, the job that has started runs to its end and keeps its
// chunk locked until then; the queued ones are taken back at once: their chunks unlocked, their copies
// to the host landed, their work never run (also after the worker reaches them), and they are forgotten.
TEST(HostJobs, CancelQueuedTakesBackTheJobsNotStarted) {
  CpuAdam worker;
  HostJobs jobs(worker);
  ChunkStore store(simulated(), std::make_unique<StreamModelCopyEngine>());
  std::vector<ChunkId> ids;
  for (int k = 0; k < 4; ++k) {
    ids.push_back(store.add_chunk(ChunkRole::kParam, at::kFloat, 64, Location::kDevice));
    store.payload(ids.back()).fill_(static_cast<float>(k));
  }
  jobs.reset(4);
  std::promise<void> running, go;
  std::shared_future<void> let_go = go.get_future().share();
  std::atomic<int> ran{0};
  jobs.launch_cancellable(store, ids[0], 0, "held job ", [&](const at::Tensor& bytes) {
    running.set_value();
    let_go.wait();
    bytes.add_(10);
    ++ran;
  });
  running.get_future().wait();  // chunk 0's job has started
  for (int k = 3; k >= 1; --k) {  // queued behind it, in backward's order
    jobs.launch_cancellable(store, ids[k], k, "queued job ", [&](const at::Tensor& bytes) {
      bytes.add_(10);
      ++ran;
    });
  }
  EXPECT_EQ(jobs.cancel_queued(), (std::vector<int64_t>{1, 2, 3}));
  for (int k = 1; k < 4; ++k) {
    EXPECT_FALSE(jobs.has(k)) << k;
    EXPECT_FALSE(store.locked_on_host(ids[k])) << "taken back: unlocked at once";
    EXPECT_EQ(store.location(ids[k]), Location::kHost);
    EXPECT_TRUE(torch::equal(store.payload(ids[k]), torch::full({64}, static_cast<float>(k)))) << "its copy landed";
  }
  EXPECT_TRUE(jobs.has(0));
  EXPECT_TRUE(store.locked_on_host(ids[0])) << "the started job keeps its chunk";
  EXPECT_TRUE(jobs.cancel_queued().empty()) << "nothing is taken back twice";
  go.set_value();
  EXPECT_EQ(message(jobs.join()), "(none)");
  worker.run_async([] {}).get();  // the worker has passed the skipped jobs
  EXPECT_EQ(ran.load(), 1) << "the taken-back jobs never ran";
  EXPECT_EQ(jobs.started(), 1);
  EXPECT_FALSE(store.locked_on_host(ids[0]));
  EXPECT_TRUE(torch::equal(store.payload(ids[0]), torch::full({64}, 10.0f)));
  for (int k = 1; k < 4; ++k) {
    EXPECT_FALSE(store.locked_on_host(ids[k])) << "the skipped job did not unlock it a second time";
    EXPECT_TRUE(torch::equal(store.payload(ids[k]), torch::full({64}, static_cast<float>(k))));
  }
}

// The engine's end of backward (Note [Host updates carried over behind the next forward]): where
// any_queued(), it waits for the device before cancel_queued(), while the worker goes on taking jobs in
// the order they were queued (backward's): a job that starts during that wait runs, the rest are taken
// back. With no job queued, no wait (every job has started).
TEST(HostJobs, CancelQueuedAfterTheDeviceWaitTakesBackWhatHasNotStarted) {
  FourChunks f;
  CpuAdam& worker = f.worker;
  HostJobs& jobs = f.jobs;
  ChunkStore& store = f.store;
  const std::vector<ChunkId>& ids = f.ids;
  std::promise<void> running, go, third_started;
  std::shared_future<void> let_go = go.get_future().share(), release_third;
  std::promise<void> third_go;
  release_third = third_go.get_future().share();
  std::atomic<int> ran{0};
  jobs.launch_cancellable(store, ids[0], 0, "held job ", [&](const at::Tensor&) {
    running.set_value();
    let_go.wait();
    ++ran;
  });
  running.get_future().wait();
  jobs.launch_cancellable(store, ids[3], 3, "next job ", [&](const at::Tensor&) {
    third_started.set_value();
    release_third.wait();
    ++ran;
  });
  for (int k = 2; k >= 1; --k) {
    jobs.launch_cancellable(store, ids[k], k, "queued job ", [&](const at::Tensor&) { ++ran; });
  }
  EXPECT_TRUE(jobs.any_queued());
  int waits = 0;
  const auto device_end = [&] {  // as the engine does it
    if (!jobs.any_queued()) return;
    ++waits;
    go.set_value();                     // the device's tail: the worker moves on
    third_started.get_future().wait();  // to the next job in backward's order
  };
  device_end();
  const std::vector<int64_t> taken = jobs.cancel_queued();
  EXPECT_EQ(waits, 1);
  EXPECT_EQ(taken, (std::vector<int64_t>{1, 2})) << "chunk 3's job started during the wait: it runs";
  EXPECT_FALSE(jobs.any_queued());
  EXPECT_TRUE(jobs.has(3));
  third_go.set_value();
  EXPECT_EQ(message(jobs.join()), "(none)");
  worker.run_async([] {}).get();
  EXPECT_EQ(ran.load(), 2);
  EXPECT_EQ(jobs.started(), 2);
  // Nothing queued: no wait.
  jobs.reset(4);
  jobs.launch_cancellable(store, ids[1], 1, "quick ", [](const at::Tensor&) {});
  worker.run_async([] {}).get();  // it has run
  EXPECT_FALSE(jobs.any_queued());
  device_end();
  EXPECT_TRUE(jobs.cancel_queued().empty());
  EXPECT_EQ(waits, 1) << "every job had started: the wait is not taken";
  EXPECT_EQ(message(jobs.join()), "(none)");
}

// The joint placement's host-Adam rate in the steps (optim/engine.cpp): per chunk, the work's time from
// its chunk on the host to its end, summed with a count of jobs; a job queued behind a long one is not
// charged its wait; a failed or taken-back job is not counted; taking forgets.
TEST(HostJobs, WorkTimesCountEachChunksWorkNotItsWaitInTheQueue) {
  using std::chrono::milliseconds;
  FourChunks f;
  HostJobs& jobs = f.jobs;
  ChunkStore& store = f.store;
  const std::vector<ChunkId>& ids = f.ids;
  const int64_t slow_ns = 100'000'000;
  jobs.put(0, jobs.launch(store, ids[0], 0, "slow ", [&](const at::Tensor&) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(slow_ns));
  }));
  jobs.put(1, jobs.launch(store, ids[1], 1, "quick ", [](const at::Tensor& bytes) { bytes.add_(1); }));
  jobs.put(2, jobs.launch(store, ids[2], 2, "failing ", [](const at::Tensor&) { throw std::runtime_error("no"); }));
  jobs.launch_cancellable(store, ids[3], 3, "taken back ", [](const at::Tensor&) {});
  jobs.cancel_queued();  // still behind the slow one: taken back
  EXPECT_EQ(message(jobs.join()), "no");
  const HostJobs::WorkTimes t = jobs.take_work_times();
  ASSERT_EQ(t.ns.size(), 2u) << "chunks 2 and 3 recorded nothing";
  EXPECT_EQ(t.jobs, (std::vector<int64_t>{1, 1}));
  EXPECT_GE(t.ns[0], slow_ns);
  EXPECT_LT(t.ns[1], slow_ns / 2) << "chunk 1 waited behind chunk 0 for " << slow_ns / 1e6 << " ms: not its work";
  // Two jobs on one chunk sum; taking forgets.
  jobs.reset(4);
  for (int k = 0; k < 2; ++k) {
    jobs.put(0, jobs.launch(store, ids[0], 0, "again ", [](const at::Tensor&) { std::this_thread::sleep_for(milliseconds(5)); }));
    EXPECT_EQ(message(jobs.join()), "(none)");
  }
  const HostJobs::WorkTimes again = jobs.take_work_times();
  ASSERT_EQ(again.jobs.size(), 1u);
  EXPECT_EQ(again.jobs[0], 2);
  EXPECT_GE(again.ns[0], 10'000'000);
  EXPECT_TRUE(jobs.take_work_times().jobs.empty());
}

}  // namespace
}  // namespace ferry::optim
