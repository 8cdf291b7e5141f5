#include "host_jobs.h"

#include <string>
#include <utility>

#include "../common/event_trace.h"
#include "../common/logging.h"
#include "../hooks/interceptor.h"

namespace ferry::optim {

std::future<void> HostJobs::launch(ChunkStore& params, ChunkId pc, int64_t chunk, const char* what,
                                   std::function<void(const at::Tensor& grads)> work, bool background_write) {
  if (params.location(pc) != Location::kHost) params.move_async(pc, Location::kHost);  // one transfer
  params.lock_on_host(pc);
  // Note [Ops outside the scopes] (hooks/interceptor.h): announced before the job is queued, over when it is
  // (failed or not), so that ops between iterations wait for it.
  if (background_write) outside_hazard_begin();
  try {
    return worker_.run_async([this, chunk, pc, store = &params, what, work = std::move(work), background_write] {
      struct Finished {  // last: the chunk is unlocked when the write is announced over
        bool announce;
        ~Finished() {
          if (announce) outside_hazard_end();
        }
      } finished{background_write};
      struct Unlock {
        ChunkStore* store;
        ChunkId id;
        ~Unlock() {
          try {
            store->unlock_on_host(id);
          } catch (const std::exception& e) {
            log::error("ferry: HybridAdam could not unlock chunk ", id, ": ", e.what());
          }
        }
      } unlock{store, pc};
      ++started_;
      trace::Span span("adam", trace::enabled() ? what + std::to_string(chunk) : std::string());
      store->wait(pc, WaitFrom::kBackground);  // its gradients' copy to the host
      work(store->payload(pc));
    });
  } catch (...) {
    if (background_write) outside_hazard_end();
    params.unlock_on_host(pc);
    throw;
  }
}

void HostJobs::reset(int64_t num_chunks) {
  jobs_.clear();
  jobs_.resize(num_chunks);
}

void HostJobs::put(int64_t chunk, std::future<void> job, bool uses_wait) {
  if (static_cast<int64_t>(jobs_.size()) <= chunk) jobs_.resize(chunk + 1);
  jobs_[chunk] = std::move(job);
  if (uses_wait) in_backward_.store(true);
}

void HostJobs::wait(int64_t chunk) {
  if (has(chunk)) jobs_[chunk].wait();
}

void HostJobs::supersede(int64_t chunk) {
  if (std::exception_ptr error = take(chunk); error && !superseded_error_) superseded_error_ = error;
}

std::exception_ptr HostJobs::take(int64_t chunk) {
  if (!has(chunk)) return nullptr;
  try {
    jobs_[chunk].get();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

std::exception_ptr HostJobs::join() {
  std::exception_ptr error = std::exchange(superseded_error_, nullptr);
  for (auto& job : jobs_) {
    if (!job.valid()) continue;
    try {
      job.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  jobs_.clear();
  in_backward_.store(false);
  return error;
}

void HostJobs::wait_all() {
  for (auto& job : jobs_) {
    if (job.valid()) job.wait();
  }
}

void HostJobs::drop() {
  jobs_.clear();
  superseded_error_ = nullptr;
  in_backward_.store(false);
}

}  // namespace ferry::optim
