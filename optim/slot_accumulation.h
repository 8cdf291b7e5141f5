#pragma once
// SlotAccumulation: gradient accumulation over micro-batches (HybridAdamOptions::accumulate_grads).
// Gradients land in the parameter slots as in the default mode (Note [Gradient in the parameter slot]);
// when a chunk is final in a backward (ChunkFinality), its slots are emptied into the chunk's fp32
// accumulation chunk and get their values back.
//
// Note [Accumulation per chunk]
// With accumulate_grads on one process, a micro-batch's gradients land in the parameter slots as in
// the default mode (Note [Gradient in the parameter slot]). When a layout chunk has had as many
// landings and uses as earlier backwards (the first backward: when it ends; Note [Expectations only
// grow]), its slots are emptied into the chunk's fp32 accumulation chunk and get their values back,
// round(master) (the invariant between steps): for device-state chunks with two ops on the compute
// stream; for host-state chunks by one transfer of the whole chunk to the host on the copy stream and an
// add on CpuAdam's worker, while backward goes on. The per-parameter add it replaces copied each
// gradient to the host synchronously on autograd's thread. backward() waits for the last jobs before it
// returns, so the next forward reads values; backward_step of the last micro-batch runs each host
// chunk's norm and update in the job of its add, the update writing the new values into the slots (with
// clipping or loss scaling: the norm only, the update waiting for the global norm).
// A landing a chunk did not have in the previous backward, after it was emptied, waits for its job
// and the chunk is emptied again at the end (under backward_step once the update started: a parameter
// the update left alone is updated after backward, Note [A gradient after its chunk's update]; a norm
// taken already is taken again by the step). A gradient that reached its parameter twice in one
// backward is summed in the slot in the compute dtype, as in the default mode.
// At N > 1 the same, with one difference: a chunk another rank owns has no master here, so its slots
// cannot get their values back. They are emptied into this rank's accumulation chunk (which every rank
// keeps for every chunk: its own micro-batches) and left holding gradients, and when backward ends the
// values come back from their owners, the same way on every rank whatever it landed (collectives pair
// up): sharded parameters (ParamShards) give every gathered group up, so the next use gathers it again;
// replicated ones are all-gathered at once. (backward_step skips that: its step writes new values.)
// Cost against the per-parameter add it replaces (one synchronous device->host copy per gradient on
// autograd's thread): every micro-batch but the one the step follows gathers the parameters once more,
// (N-1)/N x the parameter bytes per rank, in either mode (sharded: the next forward gathers every
// group, where before a group kept from backward was still there).
//
// Contract: not thread-safe; HybridAdam's engine calls it under its mutex, on autograd's thread during
// backward.
#include <cstdint>
#include <vector>

#include "pipelined_step.h"
#include "step_parts.h"

namespace ferry::optim {

class SlotAccumulation {
 public:
  SlotAccumulation(const StepParts& parts, PipelinedStep& pipeline) : parts_(parts), pipeline_(pipeline) {}

  // Whether this backward counts chunks down (armed at its first landing).
  bool armed() const { return armed_; }
  // A gradient of `param` is about to land in its slot (chunk `chunk`); may refuse it (throws).
  void before_landing(int64_t param, int64_t chunk);
  // It landed in its slot: the first landing of a backward arms the counting.
  void land(int64_t param);
  // Chunk `chunk` is final in this backward: emptied, and under backward_step of the last micro-batch
  // its norm (and, eager, its update) follows in the same job.
  void consume_final(int64_t chunk);
  // Backward ended (`aborted` or not): the chunks not emptied yet are emptied now; the counting stops.
  // Returns the first error of the accumulation jobs (joined here), or null.
  std::exception_ptr end_backward();

 private:
  // What follows the accumulation under backward_step (the chunk then counts as launched): its norm,
  // into the pipeline's outcomes (host) or device norms (two-phase only), and in the eager step a host
  // chunk's update, in the same job, writing the new values into the slots; a chunk with a non-finite
  // gradient is not updated.
  enum class Then { kNothing, kNorm, kNormAndUpdate };
  // Adds the slot gradients of chunk c into its accumulation chunk and gives the slots their values back
  // (round(master)), on the device for device-state chunks, else on CpuAdam's worker after one transfer
  // of the chunk to the host; clears the model's slot marks. A chunk another rank owns keeps the
  // gradients in its slots (the values come from their owners when backward ends).
  void consume(int64_t chunk, Then then);

  StepParts parts_;
  PipelinedStep& pipeline_;

  bool armed_ = false;
  std::vector<char> in_slot_;   // per parameter: a gradient sits in its slot (this backward)
  std::vector<char> consumed_;  // per layout chunk: its slots were emptied in this backward
};

}  // namespace ferry::optim
