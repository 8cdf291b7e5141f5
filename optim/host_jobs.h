#pragma once
// HostJobs: the work HybridAdam queues on CpuAdam's worker during a backward, one job per layout chunk
// (a chunk's host Adam, its norm, or emptying its slots into the accumulation chunk), and the mechanism
// that runs such a job on a parameter chunk: the chunk moves to the host on the copy stream (one
// transfer), is locked there, and the job runs once the copy has landed; the chunk is unlocked when the
// job ends, whatever happens.
//
// A job may instead take its chunk on a round trip (Trip::kRoundTrip, with round trip slots set): the
// chunk stays where it is until the job starts, moves to the host then, and starts back to the device
// when the job ends, at most `slots` such chunks on the host at once (Note [Round trips through K
// buffers], optim/round_trips.h).
//
// Contract: put/wait/join and the rest are called under HybridAdam's mutex; in_backward() and
// started() are atomic, read without it (a parameter use inside backward asks in_backward() first).
// A job's error surfaces where the jobs are joined (join()), also when another job superseded it.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "../chunk/chunk_store.h"
#include "../cpu_adam/cpu_adam.h"
#include "round_trips.h"

namespace ferry::optim {

// How a job's parameter chunk travels (HostJobs::launch).
enum class Trip {
  kStay,       // to the host when the job is launched, and there until something else moves it
  kRoundTrip,  // where round trip slots are set: to the host when the job starts, back when it ends
};

class HostJobs {
 public:
  explicit HostJobs(CpuAdam& worker) : worker_(worker) {}

  // Round trips through at most `slots` host buffers (0: none; Trip::kRoundTrip jobs then stay, as
  // kStay). Not while jobs are queued.
  void set_round_trip_slots(int64_t slots);
  // Whether Trip::kRoundTrip jobs take round trips.
  bool round_trips() const { return trips_ != nullptr; }
  // Their counts (slots 0 and all zero without them).
  RoundTrips::Stats round_trip_stats() const { return trips_ ? trips_->stats() : RoundTrips::Stats{}; }
  // After a repack: the old store's returns are forgotten (RoundTrips::forget_returns).
  void forget_returns() {
    if (trips_) trips_->forget_returns();
  }

  // Queues `work(grads)` on the worker, to run once parameter chunk `pc` (layout chunk `chunk`) is on the
  // host: its move is started here (one transfer on the copy stream), and the chunk is locked on the
  // host until the job has ended. `grads`: the chunk's host payload. `background_write`: the job writes
  // parameters after the step returns (Note [Ops outside the scopes], hooks/interceptor.h): ops between
  // iterations wait for it. `what` names the job in the event trace.
  // `trip`: kRoundTrip (with slots set) instead leaves the chunk where it is until the job starts.
  std::future<void> launch(ChunkStore& params, ChunkId pc, int64_t chunk, const char* what,
                           std::function<void(const at::Tensor& grads)> work, bool background_write = false,
                           Trip trip = Trip::kStay);
  // launch() and put() in one, for a job that cancel_queued() may take back before it starts (Note
  // [Host updates carried over behind the next forward], optim/engine_step.cpp).
  void launch_cancellable(ChunkStore& params, ChunkId pc, int64_t chunk, const char* what,
                          std::function<void(const at::Tensor& grads)> work, Trip trip = Trip::kStay);
  // Takes back every cancellable job of this backward that has not started: it will not run (the worker
  // skips it), its chunk is unlocked and its copy to the host waited for (a round trip's never moved:
  // it is where it was), and it is forgotten. Returns those chunks, ascending. A job that started runs
  // to its end.
  std::vector<int64_t> cancel_queued();
  // Whether a cancellable job of this backward has not started yet (the engine waits for the device to
  // finish backward before cancel_queued() only then: Note [Host updates carried over behind the next
  // forward]).
  bool any_queued() const;

  // Backward's jobs, per layout chunk. reset(): none, room for `num_chunks`.
  void reset(int64_t num_chunks);
  // `uses_wait`: a use of the chunk's parameters later in this backward waits for the job (Note [A chunk
  // final before its last use]); not for an owner's job across ranks, which waits for the ranks' sums.
  void put(int64_t chunk, std::future<void> job, bool uses_wait = true);
  bool has(int64_t chunk) const {
    return chunk < static_cast<int64_t>(jobs_.size()) && jobs_[chunk].done.valid();
  }
  // Waits for chunk `chunk`'s job (its error surfaces at join()).
  void wait(int64_t chunk);
  // Chunk `chunk`'s job ends before the chunk is worked on again (a later job replaces it); its error
  // is kept for join().
  void supersede(int64_t chunk);
  // Waits for the job and returns its error (null: none), taking it out.
  std::exception_ptr take(int64_t chunk);
  // Waits for every job and forgets them; the first error any of them threw (a superseded one's first).
  std::exception_ptr join();
  // Waits for every job without taking them (their errors surface at join()).
  void wait_all();
  // Forgets every job and error (after a failed backward has dealt with them).
  void drop();
  // Whether a job of this backward that uses wait for may be queued (atomic).
  bool in_backward() const { return in_backward_.load(); }
  // Jobs that have started running since construction (tests, reports).
  int64_t started() const { return started_.load(); }

  // The worker's time in jobs' work (from their chunk on the host to the work's end), per layout chunk,
  // summed since the last take_work_times(): what a chunk's host update takes inside the steps, beside
  // the GPU's work and the other threads (the joint placement's host-Adam rate, Note [The joint
  // placement] in engine.cpp). Jobs that threw or were taken back are not counted.
  struct WorkTimes {
    std::vector<int64_t> ns;    // per layout chunk
    std::vector<int64_t> jobs;  // per layout chunk: how many jobs the time is of
  };
  WorkTimes take_work_times();

 private:
  // Who runs a cancellable job, decided once: the worker when it starts it, or cancel_queued() before.
  struct Claim {
    enum State : int { kQueued, kStarted, kCancelled };
    std::atomic<int> state{kQueued};
    ChunkStore* store = nullptr;
    ChunkId pc{};
    std::shared_ptr<RoundTrips::Trip> trip;  // a round trip's (null: the chunk was moved and locked at launch)
  };
  std::future<void> queue(ChunkStore& params, ChunkId pc, int64_t chunk, const char* what,
                          std::function<void(const at::Tensor& grads)> work, bool background_write,
                          std::shared_ptr<Claim> claim, Trip trip);

  // A layout chunk's job of this backward: its future, and its claim if cancel_queued() may take it back.
  struct Job {
    std::future<void> done;
    std::shared_ptr<Claim> claim;
  };

  CpuAdam& worker_;
  std::unique_ptr<RoundTrips> trips_;  // null: no round trips
  std::vector<Job> jobs_;  // per layout chunk
  std::exception_ptr superseded_error_;  // of a job superseded in jobs_
  std::atomic<bool> in_backward_{false};
  std::atomic<int64_t> started_{0};
  std::mutex work_mutex_;  // the worker records, the engine takes
  WorkTimes work_;
};

}  // namespace ferry::optim
