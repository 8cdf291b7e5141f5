#pragma once
// ShardedStep: HybridAdam across N > 1 ranks (Note [Sharded optimizer state], D44): the ownership of
// chunk groups, the parameter shards, the collectives of a step (gradients reduce-scattered into their
// owners, norms all-reduced, values gathered), and the pipelined step across ranks.
//
// Note [Sharded optimizer state]
// With a communicator of N > 1 ranks (HybridAdamOptions::communicator), every rank runs the same model
// on its own batch, and the optimizer state exists once across the ranks. The layout chunks form
// groups of N consecutive chunks; rank r owns member r of each group (chunk c belongs to rank c mod N).
//  - Construction: rank 0's initial values are broadcast (masters, then the parameter chunks), so every
//    rank starts from the same point.
//  - The first step (after warm-up, when the call-order repack is behind us) shards: a rank frees the
//    master chunks it does not own and never allocates their exp_avg/exp_avg_sq (the moments get memory
//    when first touched, D46; with accumulate_grads, the fp32 gradient chunks stay on every rank: each
//    accumulates its own micro-batches). Ranks check they have the same layout.
//  - A step (step()): per group, one reduce-scatter sums every rank's gradients into the owner's chunk,
//    with one 0/1 per tensor beside them, so the owner also learns which tensors landed on any rank
//    (a rank may not have used one) and updates exactly those; the owner takes the norm of its chunks, one
//    all-reduce totals it (and the non-finite count), so clipping and fp16 overflow decide alike
//    everywhere; the owners update their chunks (gradients scaled by 1/N: the mean over the concatenated
//    batch); the other ranks get the new values by the next gather (sharded parameters, below) or,
//    replicated, by one all-gather per group now. Bytes each rank sends per step: 2 (N-1)/N x the
//    parameter chunk bytes, the ring minimum for a full update of all parameters (+ (N-1)/N x 4 B/param
//    for the reduce-scatter of fp32 accumulation chunks instead; + one more gather of the groups given up
//    after forward).
//  - backward_step() pipelines this (eager: no clipping, loss scaling or accumulation): when all chunks of
//    a group are final in backward, its reduce-scatter starts (async, on Gloo's threads) and the owner's
//    host Adam runs on CpuAdam's worker as soon as the sums arrive, while autograd goes on; device-state
//    chunks follow backward. Groups complete in the same order on every rank only if
//    every rank expects the same landings: checked after each call (one all-reduce of a hash); if not,
//    the next call runs backward + step(). Same sums in the same order as step(): the same result.
//  - Every collective is in the same order on every rank; zero_grad() in default mode must be called by
//    every rank (replicated parameters: it all-gathers the owners' values; sharded: it gives the
//    other ranks' chunks up).
//  - Parameters (shard_params, the default): the compute copy is sharded with the same ownership
//    (Note [Sharded parameters] below); then no all-gather follows the step: the owners write their
//    chunks, the other ranks give theirs up once the gradients are reduced, and fetch them again before
//    their next use. Without shard_params every rank keeps every parameter chunk and a step ends with
//    one all-gather per group.
//  - Memory per rank: 12/N B/param of state; parameter chunks: 1/N between steps (shard_params) or all;
//    collectives stage one group (N chunks) at a time.
//  - Views of state this rank does not hold (master(), exp_avg()...) fail, naming the chunk group;
//    state_dict() gathers the masters. save() at N > 1 (a collective) writes the same checkpoint as one
//    process: every rank writes its own parameters' state at their offsets in the same files, rank 0
//    checks each rank's part by its CRC and publishes the manifest; load() at any world size reads it
//    (every rank must see the directory), each rank taking the state it holds.
//
// Note [Sharded parameters]
// (dist/param_shards.h, D45.) Rank r keeps the parameter chunks of its groups' member r between steps;
// the others are remote (no payload). The first use of a chunk in an iteration makes every rank join one
// all-gather of its group (the scheduler starts it ahead of the use from the trace, like a prefetch), so
// all of a group's chunks land in host payloads on every rank and move to the device as usual; they stay
// (evictable to the host) until the step's reduce-scatter has sent their gradients to the owners, then
// they are given up. Per step each parameter byte is gathered once and reduced once: 2 (N-1)/N x the
// parameter bytes per rank, the floor. The price: during forward and backward a rank holds the whole
// compute copy (on the host beyond the device budget); releasing groups after their last forward use
// would cap that at the groups in use, for one more all-gather per step (D45).
//
// Contract: every method that names a collective is one on every rank, in the same order; not
// thread-safe (HybridAdam's engine calls it under its mutex; a pipelined owner job reads its flight's
// buffers on CpuAdam's worker).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "../dist/communicator.h"
#include "../dist/param_shards.h"
#include "pipelined_step.h"
#include "step_parts.h"

namespace ferry::optim {

class ShardedStep {
 public:
  // `ownership`: the one the parts read (made by the engine from the communicator's world and rank);
  // this marks it sharded at the first step.
  ShardedStep(const StepParts& parts, Ownership& ownership, std::shared_ptr<dist::Communicator> comm,
              bool accumulate_grads, bool shard_params, PipelinedStep& pipeline);

  // N > 1 ranks (else nothing here runs).
  bool active() const { return ownership_.world() > 1; }
  const Ownership& ownership() const { return ownership_; }
  dist::Communicator& comm() { return *comm_; }
  // Null unless the parameters are sharded (shard_params, after the first step).
  const std::shared_ptr<dist::ParamShards>& param_shards() const { return param_shards_; }

  // Construction: rank 0's starting point everywhere (its masters, then the parameter chunks from them).
  void broadcast_initial_values();
  // The first step at N > 1: frees the state of chunks other ranks own and, with shard_params, shards
  // the parameter chunks; `await_chunk(c)`: returns once chunk c's update left running has written it
  // (a gather sends it only then). Before placement.
  void shard(std::function<void(int64_t)> await_chunk);
  // One collective: whether `value` is the same on every rank.
  bool same_on_every_rank(double value);
  // One collective: the sums over the ranks of `values`.
  std::vector<double> sum_over_ranks(const std::vector<double>& values);
  // One collective: `sum` over the ranks, exactly (a gradient norm's, D87), and the sums of `counts`.
  std::pair<ExactSum, std::vector<int64_t>> sum_over_ranks(const ExactSum& sum, const std::vector<int64_t>& counts);

  // step(): per group, every rank's gradients summed into the owner's chunk; the landed set of an owned
  // chunk becomes the union over ranks (GradLedger). With accumulation the sums stay apart (reduced()).
  void reduce_grads();
  at::Tensor reduced(int64_t chunk) const;
  void clear_reduced() { reduced_.clear(); }
  // The owners' parameter chunks to every rank (replicated parameters).
  void gather_params();
  // Per group, the owner's chunk of `local(c)` to every rank: got(c, values) for every chunk c.
  void gather_groups(at::ScalarType dtype, const std::function<at::Tensor(int64_t)>& local,
                     const std::function<void(int64_t, const at::Tensor&)>& got);
  // After an accumulating backward: the values of the chunks this rank does not own, from their owners
  // (sharded: every gathered group given up; replicated: one all-gather). A collective.
  void values_from_owners();
  int64_t values_from_owners_count() const { return values_from_owners_; }
  // Sharded parameters: one collective per step; lets the scheduler give groups up after forward only
  // while every rank follows the same trace.
  void agree_on_trace();

  // backward_step: whether the step follows this backward at once (the values need not come back from
  // their owners when backward ends, Note [Accumulation per chunk]).
  void set_step_follows_backward(bool follows) { step_follows_backward_ = follows; }
  bool step_follows_backward() const { return step_follows_backward_; }
  // Whether every rank expects the same landings next backward_step (decided by the last call to
  // check_landings_agree(), a collective over the finality's expectations).
  bool landings_agree() const { return landings_agree_; }
  void check_landings_agree(const ChunkFinality& finality);

  // The pipelined step across ranks (eager only).
  void start_flights();
  // Chunk c is final here: its group's reduce-scatter starts when all of the group's chunks are.
  void chunk_final(int64_t chunk);
  // After backward: the groups not launched, the device-state owned chunks' updates, the norms over
  // ranks, the values (gathered or given up). Reports into a result.
  StepResult finish_pipelined(double loss_scale);
  // After a failed backward: waits for the collectives in flight and forgets them.
  void drop_flights() { flights_.clear(); }

 private:
  // A group's reduce-scatter input: per member chunk, this rank's gradients then its landed flags.
  struct GroupBuffer {
    at::Tensor flat;
    int64_t cap = 0, seg = 0;  // elements of a member's values, and of a member's whole segment
  };
  struct GroupFlight {
    std::unique_ptr<dist::Pending> pending;
    at::Tensor out;  // the owner's member: summed values [0, cap), then per-tensor landed counts
    int64_t cap = 0;
  };
  struct OwnedSpans {
    std::vector<Span> landed, unlanded;
  };
  void check_same_layout();  // a collective; fails clearly if the ranks' layouts differ
  GroupBuffer pack_group(int64_t group);
  // The owned chunk c's spans from the summed flags (counts[i]: ranks that landed its i-th tensor):
  // landed somewhere (by param group and lag, as GradLedger::spans) and landed nowhere. Thread-safe
  // (lags change only between steps, when no job runs).
  OwnedSpans owned_spans(int64_t chunk, const at::Tensor& counts) const;
  void receive_owned(int64_t chunk, const at::Tensor& out, int64_t cap);
  void take_union(int64_t chunk, const at::Tensor& counts);
  at::Tensor comm_payload(int64_t chunk);  // parameter chunk c where the communicator reads it
  c10::Device comm_buffer_device() const;  // where the reduce-scatter buffers of the gradients live
  void launch_group(int64_t group);
  int64_t num_chunks() const { return parts_.placement.num_chunks(); }

  StepParts parts_;
  Ownership& ownership_;
  std::shared_ptr<dist::Communicator> comm_;
  const bool accumulate_;
  const bool shard_params_;
  PipelinedStep& pipeline_;

  std::shared_ptr<dist::ParamShards> param_shards_;  // Note [Sharded parameters] (null: replicated)
  int64_t hashed_trace_version_ = -1, trace_agreed_ = -1;  // agree_on_trace
  double trace_hash_ = 0;
  std::vector<at::Tensor> reduced_;    // accumulation, during a step: per owned chunk, the sums over ranks
  std::vector<GroupFlight> flights_;   // per group, during a pipelined backward_step
  std::vector<char> owner_job_;        // per layout chunk: its owner update runs as a pipeline job
  bool landings_agree_ = false;
  bool step_follows_backward_ = false;
  int64_t values_from_owners_ = 0;     // times the values came back from their owners (tests, reports)
};

}  // namespace ferry::optim
