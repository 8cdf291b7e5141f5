#pragma once
// PipelinedStep: the state of one pipelined backward_step — which layout chunks became final and were
// launched during backward, what their jobs found, which parameters landed late — and the default
// mode's launches (Note [Pipelined step]).
//
// Note [Pipelined step]
// backward_step(loss) runs backward and the optimizer step as one pipeline over the layout chunks.
// A chunk is final in backward when each of its parameters has had the most gradient landings earlier
// backward_steps had, and the most uses earlier backwards had (Note [A chunk final before its last use],
// Note [Expectations only grow]; the first call, and a call right after a repack or placement change,
// only record them and run unpipelined). When a chunk becomes final, on autograd's thread:
//  - host state: its parameter chunk (holding the gradients) starts its move to the host on the copy
//    stream, one transfer per chunk, and is locked there (ChunkStore::lock_on_host); a job on CpuAdam's
//    worker waits for that copy, computes the chunk's gradient norm (eager: taken on the device before
//    the move, Note [Norms before the trip]) and, unless the step needs every gradient first, runs the
//    host Adam, writing the new compute-dtype values over the gradients. The chunk stays on the host
//    until the next forward brings it back (prefetched from the trace).
//  - device state: its parameter chunk is brought to the device if evicted (no host stall), its
//    norm is reduced on the device (no host sync) and the device Adam runs on the compute stream, told
//    to skip by a device flag if the chunk's gradients are not finite.
// The jobs are awaited when backward ends (before the model may repack); in the eager mode those not
// started by then are first taken back (Note [Host updates carried over behind the next forward],
// engine_step.cpp). Then one host sync reads every device norm, chunks that did not become final run
// as step() runs them (a host-state chunk's update may be left running behind the return), and the
// result is reported.
// A gradient that lands after its chunk became final (a layer no earlier backward reached) is taken:
// Note [A gradient after its chunk's update].
// No host synchronization per parameter or per chunk on the training thread: the per-chunk waits
// happen on the worker (ChunkStore's MoveStats count both).
//  - Without clipping and loss scaling ("eager"): the updates are those of backward() + step(), bit for
//    bit (same kernels, same gradients, same order per chunk). A non-finite gradient skips that chunk
//    only (its values are restored from the masters; the others are updated, and the result reports the
//    overflow): all-or-nothing would need every gradient before the first update.
//  - With global-norm clipping or fp16 loss scaling, which need every gradient first: during backward
//    only the transfers and the per-chunk norms run; after backward the norm (one scalar) gives the
//    clip coefficient and the overflow decision, then every chunk is updated as step() would, bit for
//    bit. Cost against eager: the host Adam is no longer hidden behind backward (it runs after it,
//    beside the next forward: Note [Update behind the next forward]), while the gradients' transfers
//    still are.
//
// Note [Norms before the trip]
// A host job's norm was a pass of its own over the chunk's gradients before the update read them again:
// 2 of the 30 bytes per parameter that the host's memory moves for a host-state parameter (fp32 state:
// 28 for the update, 2 for the norm; compact: 12 and 2), in the resource that bounds the 12b and 20b
// steps. In the eager step a chunk that is still on the device when it becomes final (where backward
// left it, unless evicted since) has its norms reduced there first, as a device-state chunk's are
// (ChunkUpdates::device_norms: the host's order of summation, D85), and copied to pinned host
// memory on the same stream before the chunk's own copy to the host is started behind them: once that
// copy has landed, which is what the job waits for, so have the norms. The job then reads its gradients
// once, in the update; the norms serve the step's end too for a job taken back there (Note [Host updates
// carried over behind the next forward]) if the chunk's landed spans are still those they cover. A
// chunk already on the host, the two-phase step and accumulation take the host's norm as before. The
// norms are the host's bits either way (Note [One norm wherever the gradient lives]): a skip, the norm
// the result reports and a clip coefficient are what step() gives. StepResult::host_norm_bytes counts
// what the host still read.
//
// Note [A gradient after its chunk's update]
// A parameter's gradient can land after its chunk became final: a layer that no earlier backward reached
// (skipped in the first steps by stochastic depth, a task head or an expert not used yet), or one more
// contribution than any earlier backward had (Note [Expectations only grow]). This was refused, and the
// step lost: a multi-task model alternating its heads, or stochastic depth skipping a layer in the
// first step, failed at its second backward_step (found by a randomized comparison of backward_step
// against backward() + step()). Now, at N = 1:
//  - two-phase step (clipping, loss scaling): the chunk's job only took its norm, so it is taken again
//    after backward with the late gradient: the chunk counts as not launched, and the step is exactly
//    step()'s;
//  - eager step, a parameter with no gradient yet in this backward: the chunk's job left it alone (it
//    updates only the landed spans). The landing waits for the job, the parameter is marked late, and
//    after backward its spans are updated as a chunk that was not launched is: their own norm and
//    finiteness, then the update where the state lives. Adam is elementwise, so the bits are those of
//    backward() + step() (the norm that the result reports is summed in another order); a non-finite
//    late gradient skips the late spans only, as a non-finite chunk skips its own (Note [Pipelined step]);
//  - a further contribution to a parameter whose update has run is refused, once: the next backwards
//    expect it.
// The late parameters are counted in StepResult::late_params; being late grows the expectations, so a
// parameter is late at most once per requires_grad configuration. At N > 1 a late landing cannot be
// taken (the group's reduce-scatter has left): there a chunk holding a trainable parameter that no
// backward has reached yet is not final early (arm()), so the landing is not late, at the cost of that
// chunk's overlap until the parameter trains (for good if it never does: such a parameter should not
// require grad). requires_grad is the same on every rank (the landings' fingerprint includes it), so
// the groups still complete in the same order everywhere.
//
// Contract: not thread-safe; HybridAdam's engine calls it under its mutex, on autograd's thread during
// backward. A host job writes its chunk's outcome (set before the job is queued, read after it is joined).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "hybrid_adam_options.h"
#include "step_parts.h"

namespace ferry::optim {

class PipelinedStep {
 public:
  // How the steps of this backward run: updates during backward (eager), only norms during it and the
  // updates after the global norm (two-phase: clipping, loss scaling), or eager with each group's
  // reduce-scatter started when its chunks are final (across ranks, Note [Sharded optimizer state]).
  enum class Kind { kTwoPhase, kEager, kAcrossRanks };

  explicit PipelinedStep(const StepParts& parts) : parts_(parts) {}

  // A backward_step completed since the expectations last started over (the next one may pipeline).
  bool has_history() const { return history_; }
  void learned() { history_ = true; }
  void forget() { history_ = false; }

  // Starts a backward_step's counts (finality: this backward's landings forgotten; `armed`: counting
  // down, and at N > 1 a chunk with a trainable parameter no backward reached held back); forgets what
  // the last one launched.
  void arm(bool armed);
  // The pipeline runs in this backward: outcomes and device norms for every chunk. `cancellable`: the
  // eager host jobs may be taken back at backward's end, not started yet, and carried over behind the
  // next forward (Note [Host updates carried over behind the next forward], optim/engine_step.cpp).
  void start(Kind kind, bool cancellable = false);
  // Backward is over (or failed): no more launches; the kind stays for the step's end.
  void stop() { active_ = false; }
  bool active() const { return active_; }
  bool eager() const { return kind_ != Kind::kTwoPhase; }
  bool across_ranks() const { return kind_ == Kind::kAcrossRanks; }

  // Chunk c is final in the default mode: its norm (and, eager, its update) starts now, where its state is.
  void launch(int64_t chunk);
  // Note [A gradient after its chunk's update]: lets `param`'s landing into launched chunk c proceed
  // (after c's job) or refuses it; before the landing. `accumulation`: the chunk's job is an
  // accumulation's (Note [Accumulation per chunk]). Returns whether the chunk's slots must be emptied
  // again when backward ends (an accumulation chunk that takes a late landing).
  bool late_landing(int64_t param, int64_t chunk, bool accumulation);

  // Launch bookkeeping, per layout chunk.
  bool launched(int64_t chunk) const { return chunk < static_cast<int64_t>(launched_.size()) && launched_[chunk]; }
  void mark_launched(int64_t chunk) { launched_[chunk] = 1; }
  // Counts as not launched again (its norm is taken after backward instead).
  void unlaunch(int64_t chunk);
  int64_t num_launched() const;
  // A host job's finding (written on the worker, read after the jobs are joined).
  void set_outcome(int64_t chunk, const ChunkOutcome& outcome) { outcomes_[chunk] = outcome; }
  const ChunkOutcome& outcome(int64_t chunk) const { return outcomes_[chunk]; }
  bool has_outcome(int64_t chunk) const { return chunk < static_cast<int64_t>(outcomes_.size()); }
  // Chunk c's terms taken on the device (ChunkUpdates::device_norms; undefined: none).
  void set_device_norms(int64_t chunk, at::Tensor norms) { device_norms_[chunk] = std::move(norms); }
  at::Tensor& device_norms(int64_t chunk) { return device_norms_[chunk]; }
  // Forgets the device norms (once read, or when the step fails).
  void clear_device_norms() {
    device_norms_.clear();
    trip_norms_.clear();
  }
  // Note [Norms before the trip]: the outcome of host-state chunk c's norms as taken on the device when
  // it was launched, if they cover exactly `spans` (its landed spans now: a job taken back at backward's
  // end, whose chunk no gradient reached since); nullopt otherwise.
  std::optional<ChunkOutcome> trip_outcome(int64_t chunk, const std::vector<Span>& spans) const;

  // Late parameters (Note [A gradient after its chunk's update]).
  bool late(int64_t param) const { return param < static_cast<int64_t>(late_.size()) && late_[param]; }
  bool has_late(int64_t chunk) const { return chunk < static_cast<int64_t>(late_chunks_.size()) && late_chunks_[chunk]; }
  bool any_late() const;
  const std::vector<char>& late_mask() const { return late_; }
  // How many, and the first one's name for the log; then forgets them.
  int64_t take_late(int64_t* first);
  void clear_late();

  // After backward: every chunk not launched (and the late part of a launched one) updated where its
  // state lives as step() would, with grad scale 1; a chunk with non-finite gradients is skipped
  // (default mode: its values restored). `defer_host(c)`, where given, may leave a whole host-state
  // chunk's update running behind the call (true: it did; counted in result.deferred_chunks). Adds the
  // times to `result`; returns whether all were finite.
  bool update_unlaunched(const ChunkNorms& norms, bool accumulate_grads, StepResult& result,
                         const std::function<bool(int64_t)>& defer_host = {});

 private:
  StepParts parts_;
  bool history_ = false;
  bool active_ = false;
  Kind kind_ = Kind::kTwoPhase;
  bool cancellable_ = false;
  std::vector<char> launched_;                      // per layout chunk: its host update (or norm) is queued
  std::vector<ChunkOutcome> outcomes_;              // per layout chunk, what its host job found
  std::vector<at::Tensor> device_norms_;            // per layout chunk, its norms taken on the device
  struct TripNorms {
    at::Tensor norms;  // ChunkUpdates::norms_before_the_trip
    std::vector<Span> spans;
  };
  std::vector<TripNorms> trip_norms_;  // per layout chunk: a host-state chunk's, taken at its launch
  // Eager, N = 1: per parameter, its first gradient of this backward landed after its chunk's job had
  // started (so the job left it alone); per layout chunk, whether it has such a parameter.
  std::vector<char> late_, late_chunks_;
  bool told_unreached_ = false;  // N > 1: the log line about parameters no backward reached
};

}  // namespace ferry::optim
