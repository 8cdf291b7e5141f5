#include "host_jobs.h"

#include <string>
#include <utility>

#include "../common/event_trace.h"
#include "../common/logging.h"
#include "../hooks/interceptor.h"

namespace ferry::optim {

void HostJobs::set_round_trip_slots(int64_t slots) {
  TORCH_CHECK(slots >= 0, "ferry: HostJobs: round trip slots must be >= 0 (0: none), got ", slots);
  if (slots == (trips_ ? trips_->slots() : 0)) return;
  trips_ = slots > 0 ? std::make_unique<RoundTrips>(slots) : nullptr;
}

std::future<void> HostJobs::launch(ChunkStore& params, ChunkId pc, int64_t chunk, const char* what,
                                   std::function<void(const at::Tensor& grads)> work, bool background_write,
                                   Trip trip) {
  return queue(params, pc, chunk, what, std::move(work), background_write, nullptr, trip);
}

void HostJobs::launch_cancellable(ChunkStore& params, ChunkId pc, int64_t chunk, const char* what,
                                  std::function<void(const at::Tensor& grads)> work, Trip trip) {
  auto claim = std::make_shared<Claim>();
  claim->store = &params;
  claim->pc = pc;
  put(chunk, queue(params, pc, chunk, what, std::move(work), /*background_write=*/false, claim, trip));
  jobs_[chunk].claim = std::move(claim);
}

bool HostJobs::any_queued() const {
  for (const Job& job : jobs_) {
    if (job.claim && job.claim->state.load() == Claim::kQueued) return true;
  }
  return false;
}

std::vector<int64_t> HostJobs::cancel_queued() {
  std::vector<int64_t> cancelled;
  for (size_t c = 0; c < jobs_.size(); ++c) {
    Job& job = jobs_[c];
    if (!job.claim) continue;
    int queued = Claim::kQueued;
    if (job.claim->state.compare_exchange_strong(queued, Claim::kCancelled)) {
      // The worker will skip the job: its lock and its copy are this thread's to settle (a round trip's
      // chunk was neither moved nor locked).
      if (job.claim->trip) {
        trips_->cancel(job.claim->trip);
      } else {
        job.claim->store->unlock_on_host(job.claim->pc);
        job.claim->store->wait(job.claim->pc);
      }
      job.done = std::future<void>();  // never made ready before the worker pops it: not waited for
      cancelled.push_back(static_cast<int64_t>(c));
    }
    job.claim.reset();
  }
  return cancelled;
}

std::future<void> HostJobs::queue(ChunkStore& params, ChunkId pc, int64_t chunk, const char* what,
                                  std::function<void(const at::Tensor& grads)> work, bool background_write,
                                  std::shared_ptr<Claim> claim, Trip trip) {
  // A round trip leaves the chunk where it is: its job brings it (Note [Round trips through K buffers]).
  std::shared_ptr<RoundTrips::Trip> round_trip;
  if (trip == Trip::kRoundTrip && trips_) {
    round_trip = trips_->queue(params, pc);
    if (claim) claim->trip = round_trip;
  } else {
    if (params.location(pc) != Location::kHost) params.move_async(pc, Location::kHost);  // one transfer
    params.lock_on_host(pc);
  }
  // Note [Ops outside the scopes] (hooks/interceptor.h): announced before the job is queued, over when it is
  // (failed or not), so that ops between iterations wait for it.
  if (background_write) outside_hazard_begin();
  try {
    return worker_.run_async([this, chunk, pc, store = &params, what, work = std::move(work), background_write,
                              claim = std::move(claim), round_trip] {
      if (claim) {  // cancel_queued() took it back first: it unlocked the chunk (or took its trip back)
        int queued = Claim::kQueued;
        if (!claim->state.compare_exchange_strong(queued, Claim::kStarted)) return;
      }
      struct Finished {  // last: the chunk is unlocked when the write is announced over
        bool announce;
        ~Finished() {
          if (announce) outside_hazard_end();
        }
      } finished{background_write};
      if (round_trip) trips_->begin(round_trip);  // the chunk on the host and locked, or it threw
      struct Unlock {  // a round trip's also starts back to the device
        ChunkStore* store;
        ChunkId id;
        RoundTrips* trips;
        const std::shared_ptr<RoundTrips::Trip>& trip;
        ~Unlock() {
          try {
            if (trip) {
              trips->end(trip);
            } else {
              store->unlock_on_host(id);
            }
          } catch (const std::exception& e) {
            log::error("ferry: HybridAdam could not unlock chunk ", id, ": ", e.what());
          }
        }
      } unlock{store, pc, trips_.get(), round_trip};
      ++started_;
      trace::Span span("adam", trace::enabled() ? what + std::to_string(chunk) : std::string());
      store->wait(pc, WaitFrom::kBackground);  // its gradients' copy to the host
      const int64_t t0 = trace::now_ns();
      work(store->payload(pc));
      const int64_t ns = trace::now_ns() - t0;
      const std::lock_guard<std::mutex> lock(work_mutex_);
      if (static_cast<int64_t>(work_.ns.size()) <= chunk) {
        work_.ns.resize(chunk + 1, 0);
        work_.jobs.resize(chunk + 1, 0);
      }
      work_.ns[chunk] += ns;
      ++work_.jobs[chunk];
    });
  } catch (...) {
    if (background_write) outside_hazard_end();
    if (round_trip) {
      trips_->cancel(round_trip);
    } else {
      params.unlock_on_host(pc);
    }
    throw;
  }
}

HostJobs::WorkTimes HostJobs::take_work_times() {
  const std::lock_guard<std::mutex> lock(work_mutex_);
  return std::exchange(work_, WorkTimes{});
}

void HostJobs::reset(int64_t num_chunks) {
  jobs_.clear();
  jobs_.resize(num_chunks);
}

void HostJobs::put(int64_t chunk, std::future<void> job, bool uses_wait) {
  if (static_cast<int64_t>(jobs_.size()) <= chunk) jobs_.resize(chunk + 1);
  jobs_[chunk] = Job{std::move(job), nullptr};
  if (uses_wait) in_backward_.store(true);
}

void HostJobs::wait(int64_t chunk) {
  if (has(chunk)) jobs_[chunk].done.wait();
}

void HostJobs::supersede(int64_t chunk) {
  if (std::exception_ptr error = take(chunk); error && !superseded_error_) superseded_error_ = error;
}

std::exception_ptr HostJobs::take(int64_t chunk) {
  if (!has(chunk)) return nullptr;
  try {
    jobs_[chunk].done.get();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

std::exception_ptr HostJobs::join() {
  std::exception_ptr error = std::exchange(superseded_error_, nullptr);
  for (Job& job : jobs_) {
    if (!job.done.valid()) continue;
    try {
      job.done.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  jobs_.clear();
  in_backward_.store(false);
  return error;
}

void HostJobs::wait_all() {
  for (Job& job : jobs_) {
    if (job.done.valid()) job.done.wait();
  }
}

void HostJobs::drop() {
  jobs_.clear();
  superseded_error_ = nullptr;
  in_backward_.store(false);
}

}  // namespace ferry::optim
