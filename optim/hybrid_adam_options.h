#pragma once
// What HybridAdam is told (HybridAdamOptions) and what a step reports (StepResult).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../cpu_adam/adam_options.h"
#include "../dist/communicator.h"
#include "loss_scaler.h"

namespace ferry {

// How the optimizer state is stored (Note [The compact state format], cpu_adam/compact_state.h).
//  kFp32: fp32 master, exp_avg, exp_avg_sq (12 B per parameter beside the compute copy): exact Adam.
//  kCompact: bf16 master with stochastic rounding, 8-bit blockwise moments (4.03 B per parameter);
//            needs a bf16 or fp16 compute copy (Config::precision).
enum class StateFormat { kFp32, kCompact };
const char* to_string(StateFormat format);
// "fp32" or "compact"; anything else fails, naming what was given.
StateFormat state_format_from_string(const std::string& name);

// Parameters whose (name, tensor) `match` returns true go into a group with `options`.
struct ParamGroupRule {
  std::function<bool(const std::string& name, const at::Tensor& param)> match;
  AdamOptions options;
};

struct HybridAdamOptions {
  HybridAdamOptions() = default;
  // One group with `defaults`: HybridAdam(model, ferry::AdamOptions().with_lr(3e-4)).
  HybridAdamOptions(const AdamOptions& defaults) : defaults(defaults) {}  // NOLINT: implicit on purpose

  AdamOptions defaults;                 // group 0: every parameter no rule matched
  std::vector<ParamGroupRule> groups;   // groups 1.. in order; the first matching rule wins
  double max_grad_norm = 0.0;           // global L2 clipping (0: none)
  LossScalerOptions loss_scaler;        // used when the model's precision is fp16
  int64_t device_state_chunks = -1;     // -1: as many as fit after warm-up; else this many (at most all)
  // Keep fp32 gradient chunks that accumulate across backward() calls (micro-batches). Off: gradients
  // live in the parameter chunks (Note [Gradient in the parameter slot]) and cost no memory.
  bool accumulate_grads = false;
  // Data parallelism over the ranks of this communicator (dist::connect; null or world size 1: one
  // process). Note [Sharded optimizer state].
  std::shared_ptr<dist::Communicator> communicator;
  // With N > 1 ranks, shard the parameter chunks too (Note [Sharded parameters], dist/param_shards.h):
  // each rank keeps only the chunks it owns between steps and gathers the others before their use.
  // Off: every rank keeps every parameter chunk, and a step all-gathers the updated values.
  bool shard_params = true;
  // Leave the host updates that run after backward (with clipping or fp16 loss scaling, in step(), and
  // with carry_over_host_updates the eager step's that had not started) running behind the return, in
  // forward order, each chunk's next use waiting for its own (Note [Update behind the next forward]);
  // at N > 1 only with shard_params. Off: step() and backward_step() return with every update written.
  bool update_behind_forward = true;
  // The eager backward_step (no clipping, no loss scaling, N = 1, not accumulating), with
  // update_behind_forward: the host updates that have not started when backward ends are taken back and
  // left running behind the return in forward order (Note [Host updates carried over behind the next
  // forward], optim/engine_step.cpp). Off: the step waits for every host update queued in backward.
  bool carry_over_host_updates = true;
  // Under Config::activations = auto: after the state was placed by the policy and the model planned its
  // activations in the room left (one iteration later), place the state again and plan the activations
  // in one solve, from that iteration's times, at the end of its step (Note [The joint placement],
  // optim/engine.cpp; state may move back to the host). Off (the default): the model's plan stands.
  // Opt-in until measured on a GPU: its first form, solved at the first placement from the warm-up's
  // times, moved all state to the host there (4b: 1.6 s against 0.56 s; D75).
  bool plan_state_with_activations = false;
  // The state's format (above). Checkpoints hold fp32 values either way (the compact state decoded,
  // exactly), so a checkpoint loads into either format.
  StateFormat state_format = StateFormat::kFp32;
  // Host updates at one rank without accumulate_grads: a host-state parameter chunk stays on the device
  // until its update starts, goes to the host then and starts back when it ends, at most this many on
  // the host at once (Note [Round trips through K buffers], optim/round_trips.h), so that the pinned
  // buffers they need are this many chunks' instead of one per host-state chunk (30b: 54 GiB). Bounded
  // where the step is eager (no clipping, no fp16 loss scaling) and the parameter chunks fit the device.
  // 0 (the default): no bound; each such chunk waits on the host from backward to the next forward.
  int64_t round_trip_slots = 0;

  // `defaults` for matrices; biases and norm weights (tensors of dim <= 1) in group 1 without decay.
  static HybridAdamOptions no_decay_for_bias_and_norm(const AdamOptions& defaults);
  // Chainable setters.
  HybridAdamOptions& with_group(std::function<bool(const std::string&, const at::Tensor&)> match,
                                const AdamOptions& options) {
    groups.push_back({std::move(match), options});
    return *this;
  }
  HybridAdamOptions& with_max_grad_norm(double v) { max_grad_norm = v; return *this; }
  HybridAdamOptions& with_loss_scaler(const LossScalerOptions& v) { loss_scaler = v; return *this; }
  HybridAdamOptions& with_device_state_chunks(int64_t n) { device_state_chunks = n; return *this; }
  HybridAdamOptions& with_accumulate_grads(bool v = true) { accumulate_grads = v; return *this; }
  HybridAdamOptions& with_shard_params(bool v = true) { shard_params = v; return *this; }
  HybridAdamOptions& with_update_behind_forward(bool v = true) { update_behind_forward = v; return *this; }
  HybridAdamOptions& with_carry_over_host_updates(bool v = true) { carry_over_host_updates = v; return *this; }
  HybridAdamOptions& with_plan_state_with_activations(bool v = true) { plan_state_with_activations = v; return *this; }
  HybridAdamOptions& with_state_format(StateFormat v) { state_format = v; return *this; }
  HybridAdamOptions& with_round_trip_slots(int64_t v) { round_trip_slots = v; return *this; }
  void validate() const;
};

// What one step did (step() or backward_step()). Times are nanoseconds of the calling thread.
struct StepResult {
  bool applied = false;     // the update was written
  bool overflow = false;    // a non-finite gradient skipped it
  double grad_norm = 0.0;   // global L2 norm of the (unscaled, unclipped) gradients; inf/NaN on overflow
  double clip_coef = 1.0;   // factor the gradients were clipped by
  double loss_scale = 1.0;  // the scale the gradients of this step carried
  int64_t device_chunks = 0;  // layout chunks updated on the device (count)
  int64_t host_chunks = 0;    // ... on the host (count)
  int64_t norm_ns = 0, device_update_ns = 0, host_update_ns = 0, writeback_ns = 0;
  // accumulate_grads: layout chunks whose new values were copied from the masters after the update
  // (a parameter chunk away from its state, or fp32 compute); the update wrote the others' itself.
  int64_t written_back_chunks = 0;
  int64_t overlapped_chunks = 0;  // backward_step: chunks whose update (or norm) started during backward
  // backward_step without clipping or loss scaling: parameters whose first gradient of this backward
  // landed after their chunk's update had started (a layer no earlier backward reached); updated after
  // backward (Note [A gradient after its chunk's update]).
  int64_t late_params = 0;
  // Host-state chunks whose update was still queued or running when the call returned (Note [Update
  // behind the next forward]); the next use of each waits for its own.
  int64_t deferred_chunks = 0;
  // Host synchronizations by the optimizer on the calling thread (reading device norms): at most 1.
  int64_t device_syncs = 0;
  int64_t comm_ns = 0;  // data parallelism: time in collectives (reduce-scatter, norm, all-gather)
  // Gradient bytes the host read to take norms, a pass of its own before the update reads them again;
  // backward_step leaves out the chunks whose norms were taken on the device before their trip to the
  // host (Note [Norms before the trip], optim/pipelined_step.h).
  int64_t host_norm_bytes = 0;
};

}  // namespace ferry
