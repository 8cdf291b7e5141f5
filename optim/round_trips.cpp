#include "round_trips.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <utility>

namespace ferry::optim {

struct RoundTrips::Trip {
  ChunkStore* store = nullptr;
  ChunkId chunk = -1;
  std::unique_ptr<StreamMark> final_mark;  // recorded when the chunk became final
};

namespace {
// The worker is not the thread that built the store: the device it moves to and allocates on is set
// here (CUDA's current device is per thread). Nothing to set for the simulated device.
std::optional<c10::Device> cuda_device_of(const ChunkStore& store) {
  const c10::Device device = store.device();
  return device.is_cuda() ? std::make_optional(device) : std::nullopt;
}
}  // namespace

RoundTrips::RoundTrips(int64_t slots) : slots_(slots) {
  TORCH_CHECK(slots >= 1, "ferry: RoundTrips: at least one slot, got ", slots);
  stats_.slots = slots;
}

std::shared_ptr<RoundTrips::Trip> RoundTrips::queue(ChunkStore& store, ChunkId chunk) {
  auto trip = std::make_shared<Trip>();
  trip->store = &store;
  trip->chunk = chunk;
  trip->final_mark = store.make_mark();
  trip->final_mark->record();
  std::lock_guard<std::mutex> lock(mutex_);
  queued_.push_back(trip);
  return trip;
}

void RoundTrips::cancel(const std::shared_ptr<Trip>& trip) {
  std::lock_guard<std::mutex> lock(mutex_);
  queued_.erase(std::remove(queued_.begin(), queued_.end(), trip), queued_.end());
  if (ahead_ != trip) return;
  // Sent ahead: it holds a slot on the host with no job to bring it back; it starts back now.
  ahead_.reset();
  const c10::OptionalDeviceGuard guard(cuda_device_of(*trip->store));
  if (trip->store->prefetch(trip->chunk)) {
    returning_.push_back(Held{trip->store, trip->chunk});
  } else {
    ++stats_.left_on_host;
  }
}

void RoundTrips::begin(const std::shared_ptr<Trip>& trip) {
  const c10::OptionalDeviceGuard guard(cuda_device_of(*trip->store));
  std::unique_lock<std::mutex> lock(mutex_);
  queued_.erase(std::remove(queued_.begin(), queued_.end(), trip), queued_.end());
  if (ahead_ == trip) ahead_.reset();  // its slot becomes the current one's
  TORCH_INTERNAL_ASSERT(!current_ && !ahead_, "round trips begun out of order");
  // A slot for this one: the oldest returns land first.
  wait_returns_locked(lock, static_cast<size_t>(slots_ - 1));
  current_ = trip;
  ++stats_.trips;
  lock.unlock();
  try {
    trip->store->bring_to_host_and_lock(trip->chunk, trip->final_mark.get());
  } catch (...) {
    lock.lock();
    current_.reset();
    throw;
  }
  lock.lock();
  note_held_locked();
  // The next one's copy beside this job's Adam, where a slot is free (it is not locked: a job that finds
  // it moved back moves it again).
  if (!queued_.empty() && held_locked() < slots_) {
    const std::shared_ptr<Trip>& next = queued_.front();
    const c10::OptionalDeviceGuard next_guard(cuda_device_of(*next->store));
    if (next->store->send_to_host(next->chunk, next->final_mark.get())) {
      ahead_ = next;
      ++stats_.sent_ahead;
      note_held_locked();
    }
  }
}

void RoundTrips::end(const std::shared_ptr<Trip>& trip) {
  const c10::OptionalDeviceGuard guard(cuda_device_of(*trip->store));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(current_ == trip, "a round trip ended that had not begun");
    current_.reset();  // first: whatever fails below, the next trip can begin
  }
  trip->store->unlock_on_host(trip->chunk);
  std::unique_lock<std::mutex> lock(mutex_);
  if (trip->store->prefetch(trip->chunk)) {
    returning_.push_back(Held{trip->store, trip->chunk});
  } else {
    ++stats_.left_on_host;  // no room on the device: the next forward brings it, as without the bound
  }
  // Nothing queued: every return lands before the worker is idle (Note [Round trips through K buffers]).
  if (queued_.empty()) wait_returns_locked(lock, 0);
}

void RoundTrips::forget_returns() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(!current_ && queued_.empty(), "forget_returns() while round trips run");
  returning_.clear();
  ahead_.reset();
}

RoundTrips::Stats RoundTrips::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

int64_t RoundTrips::held_locked() const {
  return static_cast<int64_t>(returning_.size()) + (current_ ? 1 : 0) + (ahead_ ? 1 : 0);
}

void RoundTrips::note_held_locked() { stats_.peak_held = std::max(stats_.peak_held, held_locked()); }

void RoundTrips::wait_returns_locked(std::unique_lock<std::mutex>& lock, size_t at_most) {
  while (returning_.size() > at_most) {
    const Held oldest = returning_.front();
    returning_.pop_front();
    lock.unlock();
    oldest.store->wait(oldest.chunk, WaitFrom::kBackground);  // its host buffer goes back to the cache
    lock.lock();
  }
}

}  // namespace ferry::optim
