#pragma once
// ParamShards: the parameter chunks sharded across the ranks in groups of chunks (Note [Sharded
// parameters], docs/ARCHITECTURE.md D45). The N ranks' chunks form groups of N consecutive layout
// chunks; rank r owns member r of each group (chunk i with i % N == r), the same ownership as the
// optimizer state's (Note [Sharded optimizer state] in optim/sharded_step.h), so a chunk's owner holds
// both its parameters and their optimizer state.
//
//  - An owned chunk always has its payload (on the device or the host, as the scheduler places it): the
//    owner's optimizer writes its updated values there.
//  - A chunk owned by another rank is remote between iterations: no payload, its tensors FREE. Its
//    group is fetched by one all-gather (every rank sends the chunk it owns) before its first use, or
//    earlier when the scheduler prefetches it from the trace; the gather runs asynchronously (Gloo: on
//    its threads; NCCL: on its stream). Where the backend serves the chunks' device (NCCL on CUDA; Gloo
//    on the simulated device), the gather runs there and each received chunk is installed straight into
//    a device payload when the device has room (as a prefetch would make it), else into a host payload;
//    Gloo on CUDA gathers into host payloads. From there the scheduler moves chunks like any other.
//    The gather buffers (N x the largest chunk per group in flight, on the gathering device) are
//    transient and outside the store's budgets.
//  - A group is given up (release()) when the scheduler sees its forward uses are over and its next use
//    is far (SchedulerOptions::reshard_after_forward; fetched again for backward), and once its
//    gradients have been reduce-scattered to their owners: during backward by HybridAdam's pipelined
//    step, else by the step (release_all()). Kept from forward to backward, each parameter byte is
//    gathered once and reduced once per step: 2 (N-1)/N x parameter bytes per rank, the floor; released
//    after forward, it is gathered twice: 3 (N-1)/N, for a compute copy that never exceeds the groups
//    in use (D45).
//  - Each rank's contribution carries the group index; a rank that gathers a different group (the ranks
//    used the parameters in different orders, or said different skips ahead) makes every rank fail
//    naming both groups, instead of mixing up parameters.
//  - Before a gather reads the chunk this rank owns, the send guard (set_send_guard) is called with its
//    layout index and must return once that chunk holds the values to send: HybridAdam's host update of
//    it may still be running behind the step (Note [Update behind the next forward]). A gather is a
//    collective, so it cannot be skipped or postponed on one rank: a prefetch waits for the guard too.
//
// Contract: thread-safe (an internal mutex); fetches are collectives (scheduler/remote_chunks.h). The
// store and the communicator must outlive this object; a gather in flight is waited for on destruction.
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "../chunk/chunk_store.h"
#include "../scheduler/remote_chunks.h"
#include "communicator.h"

namespace ferry::dist {

struct ParamShardStats {
  int64_t gathers = 0;           // group all-gathers (count)
  int64_t prefetched = 0;        // ... of them started by prefetch() (count)
  int64_t waited = 0;            // fetches that found their gather still running (count)
  int64_t wait_ns = 0;           // time blocked on gathers in fetch()
  int64_t gathered_bytes = 0;    // payload bytes received from other ranks (unclaimed ones included)
  // Prefetched gathers that no use claimed before their group was given up (a part the step then
  // skipped), and the bytes they received: sent for nothing.
  int64_t unclaimed = 0;
  int64_t unclaimed_bytes = 0;
  int64_t released_chunks = 0;   // payloads given up (count)
  int64_t landed_on_device = 0;  // gathered chunks installed straight into device payloads (count)
};

class ParamShards final : public RemoteChunks {
 public:
  // chunks[i]: layout chunk i's id in `store`. Every chunk starts present.
  ParamShards(ChunkStore& store, std::vector<ChunkId> chunks, std::shared_ptr<Communicator> comm);
  ~ParamShards() override;
  ParamShards(const ParamShards&) = delete;
  ParamShards& operator=(const ParamShards&) = delete;

  bool remote(ChunkId chunk) const override;
  void fetch(ChunkId chunk) override;
  void prefetch(ChunkId chunk) override;
  std::vector<ChunkId> group(ChunkId chunk) const override;
  void release(ChunkId chunk) override;
  bool any_remote() const override;
  void fetch_all() override;
  void release_all() override;

  // Called (under this object's lock, on the thread that starts a gather) with the layout index of this
  // rank's member of the group before its payload is read; it must not call back into this object.
  // Empty (the default): the owned chunks always hold their values.
  using SendGuard = std::function<void(int64_t index)>;
  void set_send_guard(SendGuard guard);
  // Layout chunk `index` is this rank's.
  bool owned(int64_t index) const { return index % world_ == rank_; }
  int64_t num_groups() const { return (static_cast<int64_t>(chunks_.size()) + world_ - 1) / world_; }
  // Payload bytes of the parameter chunks present here now (owned and fetched).
  int64_t present_bytes() const;
  ParamShardStats stats() const;

 private:
  struct Flight {
    std::unique_ptr<Pending> pending;
    at::Tensor out;  // world x segment bytes
  };
  int64_t group_of(ChunkId chunk) const;
  void start_locked(int64_t group, bool prefetch);
  void fetch_locked(int64_t group);
  void release_group_locked(int64_t group);
  // Fails naming both groups if a rank's part of `out` (a gather of `group`) came from another group.
  void check_group_locked(int64_t group, const at::Tensor& out) const;
  void install_locked(int64_t group, const at::Tensor& out);

  mutable std::mutex mutex_;
  ChunkStore& store_;
  std::vector<ChunkId> chunks_;
  std::vector<int64_t> index_of_;  // ChunkId -> layout index (-1: not a parameter chunk)
  std::shared_ptr<Communicator> comm_;
  int rank_ = 0, world_ = 1;
  int64_t segment_bytes_ = 0;  // of each rank's contribution: the largest chunk + the 8-byte group index
  bool land_on_device_ = false;              // the backend gathers on the chunks' device
  c10::Device buffer_device_{c10::kCPU};     // where the gather buffers live
  std::vector<char> present_;      // per group: every member has its payload here
  std::vector<Flight> flights_;    // per group
  SendGuard send_guard_;
  ParamShardStats stats_;
};

}  // namespace ferry::dist
