#pragma once
// RoundTrips: the gate that bounds how many parameter chunks the host updates keep on the host at once
// (HybridAdamOptions::round_trip_slots), used by HostJobs for the jobs that take their chunk on a round
// trip.
//
// Note [Round trips through K buffers]
// Unbounded (the default), a host-state parameter chunk moves to the host when it becomes final in
// backward (its gradients down, its new values written over them by the host Adam) and stays there
// until the next forward prefetches it: every such chunk holds a pinned host buffer at once, 54 GiB at
// 30b beside 108 GiB of compact state (D76) on a 117 GiB host. A round trip instead:
//  - leaves the chunk on the device when it becomes final (a mark is recorded on the compute stream
//    then: the point after which its gradients are written);
//  - moves it to the host when its job starts on the worker (the worker runs jobs in order), the copy
//    ordered after that mark (CopyEngine::copy_after), not after the work queued since, which by then
//    may be the next forward's;
//  - starts its way back to the device as soon as the job has ended (ChunkStore::prefetch), and its
//    host buffer goes back to the store's cache once that copy has landed.
// A slot is a chunk of a round trip on the host: the one a job works on, one sent ahead, and those on
// their way back. A job waits for slots before its chunk moves: at most K are held, so that the pinned
// buffers the round trips need are K chunks', not one per host-state chunk. While a job runs, the next
// queued trip's chunk is sent ahead (where a slot is free), so that its copy overlaps this job's Adam.
// A return that finds no room on the device leaves the chunk on the host as before (counted in
// Stats::left_on_host) and frees its slot: the gate never blocks the worker on something only the next
// forward would do, and the bound holds where the parameter chunks fit on the device, which is the case
// it is for (30b: 56 of 62 GiB of chunk room).
// When no trip is queued or running, every return issued has landed (the last job waits for them on the
// worker), so that nothing refers to a store between steps but what forget_returns() clears.
//
// Contract: queue() and cancel() on the thread that launches the jobs (under HybridAdam's mutex),
// begin() and end() on CpuAdam's worker, in the order the trips were queued; thread-safe between them.
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>

#include "../chunk/chunk_store.h"

namespace ferry::optim {

class RoundTrips {
 public:
  // `slots` >= 1: the parameter chunks round trips may hold on the host at once.
  explicit RoundTrips(int64_t slots);
  RoundTrips(const RoundTrips&) = delete;
  RoundTrips& operator=(const RoundTrips&) = delete;

  struct Trip;
  // Records the point after the work queued so far on the caller's current stream (the chunk's last
  // writes) and puts the trip at the end of the queue. The chunk is not moved here.
  std::shared_ptr<Trip> queue(ChunkStore& store, ChunkId chunk);
  // Takes the trip out of the queue before its job began; a chunk sent ahead for it starts its way back.
  void cancel(const std::shared_ptr<Trip>& trip);
  // The worker, as the trip's job starts: waits for a slot (the oldest returns to land), brings the chunk
  // to the host and locks it there (ChunkStore::bring_to_host_and_lock), and sends the next queued
  // trip's chunk ahead where a slot is free. On return the chunk is on the host (its copy maybe
  // pending: wait for it) and locked. Throws as bring_to_host_and_lock throws; the trip then holds nothing.
  void begin(const std::shared_ptr<Trip>& trip);
  // The worker, as the job ends (whatever it did): unlocks the chunk and starts its way back.
  void end(const std::shared_ptr<Trip>& trip);
  // After a repack (whose old store waited for its copies when it went): the returns recorded are
  // forgotten. Not while trips run.
  void forget_returns();

  struct Stats {
    int64_t slots = 0;
    int64_t trips = 0;         // jobs begun
    int64_t sent_ahead = 0;    // chunks sent to the host while the job before theirs ran
    int64_t left_on_host = 0;  // returns that found no room on the device
    int64_t peak_held = 0;     // most slots held at once (<= slots)
  };
  Stats stats() const;
  int64_t slots() const { return slots_; }

 private:
  struct Held {
    ChunkStore* store;
    ChunkId chunk;
  };
  // Mutex held: the slots in use.
  int64_t held_locked() const;
  void note_held_locked();
  // Waits (mutex released while waiting) until returning_ has at most `at_most` entries, oldest first.
  void wait_returns_locked(std::unique_lock<std::mutex>& lock, size_t at_most);

  const int64_t slots_;
  mutable std::mutex mutex_;
  std::deque<std::shared_ptr<Trip>> queued_;  // in job order
  std::shared_ptr<Trip> current_;             // the trip whose job runs
  std::shared_ptr<Trip> ahead_;               // queued_'s front, its chunk sent to the host already
  std::deque<Held> returning_;                // chunks on their way back to the device, oldest first
  Stats stats_;
};

}  // namespace ferry::optim
