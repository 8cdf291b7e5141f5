#pragma once
// HybridAdam: Adam/AdamW over a ChunkedModel's parameters with the optimizer state in chunks, each
// chunk updated where it lives — on the device (device_adam_update) or on the host (CpuAdam), by the
// same per-element function, so with the same bits (D53).
//
//   ferry::ChunkedModel model(net, config);
//   ferry::HybridAdam adam(model);   // as torch::optim::AdamW(params): lr 1e-3, weight decay 1e-2 on all
//   // or, GPT-style, no decay for biases and norm weights:
//   //   ferry::HybridAdam adam(model, ferry::HybridAdamOptions::no_decay_for_bias_and_norm(
//   //       ferry::AdamOptions().with_lr(3e-4).with_weight_decay(0.1)));
//   for (...) {
//     auto loss = model.forward([&] { return criterion(net->forward(x), y); });
//     adam.backward_step(loss);          // backward + step, pipelined per chunk (Note [Pipelined step])
//   }
// or, unpipelined, as with torch's optimizers:
//     model.backward(loss);              // each grad lands in its parameter's chunk slot; .grad stays undefined
//     adam.step();                       // clip, unscale, update, write compute-dtype params back
//     adam.zero_grad();                  // (a no-op after step() unless accumulate_grads)
//
// State: per layout chunk of the model, a group of three fp32 chunks mirroring it (master params,
// exp_avg and exp_avg_sq), living together on the device or the host (optim/state_placement.h). Gradients
// cost no memory of their own: each lands in its parameter's slot of the parameter chunk once autograd
// has accumulated it (Note [Gradient in the parameter slot], hooks/grad_slots.h), travels with that
// chunk, is read there by the update, which writes the new compute-dtype value into the same place.
// Bytes per parameter, host and device together: compute copy 2 (bf16/fp16) or 4 (fp32) + 12 of state,
// plus packing waste. With accumulate_grads (micro-batches), a fourth fp32 chunk per layout chunk
// accumulates the gradients across backward passes instead (+4 B/param), and the parameters keep their
// values between backward passes (Note [Accumulation per chunk]).
//
// Placement: until the model's warm-up has finished, all state is on the host. At the first step after
// it, a PlacementPolicy (scheduler/placement_policy.h) decides from the room the trace leaves chunks at
// its worst moment: by default as many state groups as fit beside every parameter chunk go to the device,
// the first layout chunks first (Note [Which state goes to the device]); the scheduler evicts parameter
// chunks to make that room, and the state store charges the model's DeviceAccountant, so parameters +
// state stay within the one device budget (0: no limit, everything on the device).
// `device_state_chunks` fixes the count. What a step does: optim/engine_step.cpp; its machinery and the
// objects it is built from: optim/engine.h.
//
// Contract
//  - One HybridAdam per model, constructed between iterations and destroyed before the model (declare it
//    after the model): a model destroyed first tells it, and it refuses every call from then on.
//  - step(), zero_grad(), save(), load() and the state views are for between iterations (the model
//    idle); gradients land during backward on autograd's thread.
//  - step() needs gradients landed since the last step/zero_grad(); otherwise it fails and changes
//    nothing.
//  - Without accumulate_grads (the default), step() consumes the gradients (applied or skipped, the
//    parameters hold their values again afterwards), and the model must not be used between
//    backward() and step() (it fails, naming the parameter). zero_grad() discards unconsumed ones.
//  - With accumulate_grads, gradients accumulate across backward() calls until zero_grad() (scale each
//    micro-batch's loss by 1/N yourself), and step() leaves them as they were landed.
//  - step() and backward_step() may return with host updates still running (Note [Update behind the
//    next forward]); everything that reads parameters or state through ferry waits for them, as do
//    ops on the calling thread, and synchronize() does explicitly: another thread that reads the
//    parameters, or a read that is no op (data_ptr()), calls it first. fork() only after synchronize().
//  - The model's parameters must not be changed by others while a HybridAdam holds it other than by
//    writes it sees (Note [Writes to parameters]): the masters are the truth, and every step overwrites
//    the parameter chunks from them.
//  - At N > 1 ranks (HybridAdamOptions::communicator) the state is sharded (Note [Sharded optimizer
//    state]): step(), backward_step(), zero_grad(), save(), load() and state_dict() are collectives.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>

#include "../chunk/chunk_store.h"
#include "../cpu_adam/adam_options.h"
#include "../dist/param_shards.h"
#include "../hooks/chunked_model.h"
#include "hybrid_adam_options.h"
#include "loss_scaler.h"
#include "round_trips.h"

namespace ferry {

namespace optim {
class Engine;
}

class HybridAdam final {
 public:
  HybridAdam(ChunkedModel& model, HybridAdamOptions options = {});
  ~HybridAdam();
  HybridAdam(const HybridAdam&) = delete;
  HybridAdam& operator=(const HybridAdam&) = delete;

  // ---- steps ----
  StepResult step();
  // model.backward(loss) and step() in one call, pipelined per chunk (Note [Pipelined step]); the result
  // is bit-identical to backward() + step() where the note says so.
  // With accumulate_grads: backward of the last micro-batch and the step, with the host Adam of each
  // chunk started on the accumulated fp32 gradients as soon as they are final (a non-finite gradient
  // skips that chunk's update only); with clipping or fp16 loss scaling two-phase, as without
  // accumulation: each chunk's norm follows its accumulation during backward, the updates follow the
  // global norm, bit-identical to backward() + step().
  // If backward throws in the eager step, chunks whose update had started stay updated (logged as an
  // error), the others keep their gradients (zero_grad() discards them), and the step count has
  // advanced; in the two-phase step nothing was updated.
  StepResult backward_step(const at::Tensor& loss);
  // Discards the gradients landed since the last step (and zeroes the accumulation chunks; those of
  // chunks whose update is still running behind the step are zeroed after it, on the same worker).
  void zero_grad();
  // Blocks until every update a step left running (Note [Update behind the next forward]) has written
  // its chunk, and rethrows the first error one threw. Every other call here and every read through the
  // model waits by itself; this is for timing a step to its very end, and for before fork() (a child
  // has no worker thread to finish them).
  void synchronize();
  // Queues `job` on the worker that runs the host updates, behind everything queued there so far (FIFO);
  // the updates a later step leaves running queue behind it. For tests and tools: a job that stalls
  // holds those updates back, as a slow host would.
  std::future<void> run_on_worker(std::function<void()> job);
  // Host Adam jobs of the pipeline that have started running, since construction (tests, reports).
  int64_t pipelined_jobs_started() const;
  // The host updates' round trips (HybridAdamOptions::round_trip_slots; slots 0 where there are none):
  // trips taken, chunks sent ahead, returns left on the host for want of device room, most host
  // buffers held at once (Note [Round trips through K buffers]; since construction).
  optim::RoundTrips::Stats round_trip_stats() const;
  // The rates the joint placement weighed (plan_state_with_activations; Note [The joint placement]):
  // all 0 until it has run.
  JointRates joint_rates() const;
  // At N > 1 with accumulate_grads: how many backwards ended by bringing back the values of the chunks
  // other ranks own (Note [Accumulation per chunk]).
  int64_t values_from_owners() const;
  // Data parallelism with sharded parameters (Note [Sharded parameters]): their gathers and releases;
  // null when not sharded (one rank, shard_params off, or before the first step).
  std::shared_ptr<const dist::ParamShards> param_shards() const;

  // ---- groups, learning rate, step counts ----
  int num_param_groups() const;
  int group_of(int64_t param) const;
  const AdamOptions& group_options(int group) const;
  double lr(int group = 0) const { return group_options(group).lr; }
  void set_lr(int group, double lr);
  void set_lr(double lr);  // every group
  // The group's step count: how many steps were applied (the count a schedule follows, and what a run
  // resumed from a checkpoint uses to skip the data it has seen).
  int64_t step_count(int group = 0) const;
  // How many updates parameter `param` has had, torch's per-parameter `step`: a step updates only the
  // parameters that got a gradient, and the bias corrections of each follow its own count (D62). Equal
  // to the group's count for a parameter that had a gradient at every step. At N > 1 on the rank that
  // owns the parameter's state (every rank before the state is sharded).
  int64_t param_step_count(int64_t param) const;
  double loss_scale() const;
  const DynamicLossScaler& loss_scaler() const;
  bool uses_loss_scaling() const;

  // ---- where the state is ----
  // Placement: whether it was decided (after warm-up), and how many layout chunks are on the device.
  bool placed() const;
  int64_t device_state_chunks() const;
  // Whether layout chunk `layout_chunk`'s state is on the device (false before placement).
  bool state_on_device(int64_t layout_chunk) const;
  int64_t state_bytes_per_chunk(int64_t layout_chunk) const;
  // State chunks per layout chunk: 3 (master, exp_avg, exp_avg_sq), 4 with accumulate_grads; the
  // compact format one more (the moments' scales).
  int num_state_roles() const;
  // The state format (HybridAdamOptions::state_format).
  StateFormat state_format() const;
  // Copies of one parameter's state as fp32, wherever it lives (tests, reports); between iterations.
  // fp32 state: on its device; the compact format: decoded, on the CPU.
  at::Tensor master(int64_t param);
  at::Tensor exp_avg(int64_t param);
  at::Tensor exp_avg_sq(int64_t param);
  at::Tensor grad(int64_t param);  // fp32; zeros when none landed since the last step/zero_grad()
  ChunkStore& state_store();
  // Peak payload bytes of the old and new state stores together during the last migration to a
  // repacked layout (tests, reports).
  int64_t last_migration_peak_bytes() const;

  // ---- checkpoints and weights ----
  // Save/resume the full training state into/from directory `dir` (optim/checkpoint_files.h; format and
  // guarantees: docs/CHECKPOINT.md): fp32 masters and moments, step counts, lr and options per group,
  // loss scaler, a CRC-32C per file. save() is atomic and durable and refuses non-finite state; load()
  // checks the whole checkpoint first and changes nothing if any check fails. Gradients are not saved:
  // save() with gradients that no step() or zero_grad() has consumed yet (grads_pending()) says so in
  // the log, since a run resumed from it starts without them.
  void save(const std::string& dir);
  void load(const std::string& dir);
  // Whether gradients landed since the last step() or zero_grad() (what a save would not hold).
  bool grads_pending() const;
  // Fails now (creating `dir` if needed) if a checkpoint could not be written into `dir`: call it
  // before a long run that saves at the end.
  static void check_save_target(const std::string& dir);
  // The model's state_dict() with every parameter as its fp32 master (the truth while training).
  NamedTensors state_dict();
  // Loads weights (not optimizer state): the model's parameters and buffers as
  // ChunkedModel::load_state_dict checks them, and the fp32 masters from the same values (exact when
  // they are fp32); moments and step counts stay. Between iterations. `loaded` as
  // ChunkedModel::load_state_dict's: called once a value is in its chunk and its master.
  void load_state_dict(const NamedTensors& values, const ValueLoaded& loaded = {});
  // state_dict() as a safetensors file (fp32 weights) a Python user loads with safetensors.torch.
  void export_safetensors(const std::string& path);

 private:
  std::unique_ptr<optim::Engine> engine_;
};

}  // namespace ferry
