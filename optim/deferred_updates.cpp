#include "deferred_updates.h"

#include <c10/util/Exception.h>

#include <exception>
#include <string>

#include "../common/event_trace.h"
#include "../common/logging.h"

namespace ferry::optim {
namespace {

void log_failure(int64_t chunk) {  // -1: the zeroing of an accumulation chunk
  log::error("ferry: HybridAdam: ", chunk >= 0 ? "the host update of chunk " + std::to_string(chunk)
                                               : std::string("zeroing an accumulation chunk"),
             ", left running behind the step, failed; that chunk's parameters and state may be partly updated");
}

}  // namespace

void DeferredUpdates::put(int64_t chunk, std::future<void> update) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (static_cast<int64_t>(updates_.size()) <= chunk) updates_.resize(chunk + 1);
  TORCH_INTERNAL_ASSERT(!updates_[chunk].valid(), "chunk ", chunk, " has an update left running already");
  updates_[chunk] = std::move(update);
  pending_.store(true);
}

void DeferredUpdates::put_zeroing(std::future<void> zeroing) {
  std::lock_guard<std::mutex> lock(mutex_);
  zeroing_.push_back(std::move(zeroing));
  pending_.store(true);
}

bool DeferredUpdates::has(int64_t chunk) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(updates_.size()) > chunk && updates_[chunk].valid();
}

void DeferredUpdates::await_chunk(int64_t chunk) {
  if (!pending_.load()) return;
  // Held while waiting, so that a concurrent settle() cannot return before this job is done.
  std::lock_guard<std::mutex> lock(mutex_);
  if (chunk >= static_cast<int64_t>(updates_.size()) || !updates_[chunk].valid()) return;
  trace::Span span("adam", trace::enabled() ? "wait for host adam chunk " + std::to_string(chunk) : std::string());
  std::future<void> job = std::move(updates_[chunk]);
  try {
    job.get();
  } catch (...) {
    log_failure(chunk);
    throw;
  }
}

void DeferredUpdates::settle() {
  if (!pending_.load()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  std::exception_ptr error;
  int64_t failed = -1;
  for (size_t c = 0; c < updates_.size(); ++c) {
    if (!updates_[c].valid()) continue;
    try {
      updates_[c].get();
    } catch (...) {
      if (!error) error = std::current_exception(), failed = static_cast<int64_t>(c);
    }
  }
  for (auto& job : zeroing_) {
    try {
      job.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  updates_.clear();
  zeroing_.clear();
  pending_.store(false);
  if (error) {
    log_failure(failed);
    std::rethrow_exception(error);
  }
}

}  // namespace ferry::optim
