#pragma once
// StreamModelCopyEngine: the simulated device with copies that behave like a CUDA copy stream, so that
// what only a GPU shows about pending copies can be run, counted and tested on a CPU.
//
// The simulated engine (copy_engine.h) copies synchronously: every copy is done when copy() returns,
// so the ChunkStore's pending-copy paths never run, and a count of host waits on it is 0 whatever the
// code does. This engine queues each copy on one process-wide stream instead and runs the queue in
// order, up to a copy, only when the host waits for that copy or orders compute after it (the CPU's
// "compute" runs at once, so it needs the bytes then). Device memory comes from an allocator whose
// frees wait while copies are queued, as record_stream makes the CUDA caching allocator wait.
//
// What the host knows (StreamModelOptions::host_lags, on by default): a CUDA host learns that a copy is
// done only from its event, and it runs ahead of the GPU, so a copy that compute was ordered after is
// still "not yet" to it until a later query. Here the host knows a copy is done once it waited for it
// or for a later one (one stream: completion in order), or on a lucky poll (tests). Off, a copy is
// known done as soon as it has run. Counting host waits on this engine (bench_gpt's syncs_per_step,
// with --copies=stream) is therefore an upper bound of CUDA's: a CUDA poll may find a copy done that
// this engine only sees done when waited for.
//
// One stream per process, as one device: any number of engines (a model's store, a repack's new store,
// a second model) share it, so memory freed by one is not reused while another's copy still reads it.
// Timing: copies run on the host's thread that waits, so times on this engine are not a GPU's; its
// marks read the host clock (CopyEngine's default).
//
// Contract: thread-safe (the optimizer's worker waits for copies while the training thread queues
// others and frees device memory). The destructor runs every queued copy.
#include <cstdint>
#include <memory>
#include <random>

#include "copy_engine.h"

namespace ferry {

struct StreamModelOptions {
  bool host_lags = true;  // the host knows a copy is done only once it waited for it or a later one
  int poll_one_in = 0;    // a poll of a copy the host does not know done waits for it one time in N (0: never)
  uint64_t seed = 0;      // of those polls' choice
};

class StreamModelCopyEngine final : public CopyEngine {
 public:
  explicit StreamModelCopyEngine(StreamModelOptions options = {});
  ~StreamModelCopyEngine() override;

  const char* name() const override { return "simulated-stream"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  c10::Allocator* device_allocator() const override;
  bool pinned_host() const override { return false; }
  // Queued; untimed whatever `timing` asks (the ticket's started/finished stay null).
  std::unique_ptr<CopyTicket> copy(const at::Tensor& dst, const at::Tensor& src, CopyTiming timing) override;

  // Copies the process's stream has run so far (all engines).
  static int64_t copies_run();

  // For the tickets.
  bool poll(uint64_t seq);

 private:
  StreamModelOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace ferry
