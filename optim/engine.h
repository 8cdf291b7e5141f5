#pragma once
// The machinery behind HybridAdam (optim/hybrid_adam.h): what the model calls during an iteration (its
// GradSink, LayoutListener and, at N > 1, PlanAgreement) and the steps, orchestrated over the objects that own the state:
//
//   GradLedger       which parameters hold a gradient for the next step; their lags (D62)
//   ChunkFinality    when a chunk is final in a backward (landings, uses, expectations)
//   StatePlacement   the optimizer state chunks and where each group lives (PlacementPolicy)
//   ChunkUpdates     how a chunk is updated and normed, on the host or the device
//   HostJobs         the work queued on CpuAdam's worker during a backward
//   DeferredUpdates  the host updates left running behind a step (Note [Update behind the next forward])
//   PipelinedStep    one pipelined backward_step's launches and outcomes (Note [Pipelined step])
//   SlotAccumulation micro-batches (Note [Accumulation per chunk])
//   ShardedStep      N > 1 ranks (Note [Sharded optimizer state])
//   checkpoint files (checkpoint_files.h), CpuAdam (the kernels), DynamicLossScaler
//
// Its own data are the model, the options, the kernels, the loss scaler and one mutex: every call the
// model makes during backward (on autograd's thread) and every public call between iterations takes
// it, so the objects above need no lock of their own (DeferredUpdates, which updates wait on from other
// threads, has one, taken last). Files: engine.cpp (construction, the model's calls), engine_step.cpp
// (step() and backward_step()), engine_state.cpp (views, weights, checkpoints, zero_grad()).
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../cpu_adam/cpu_adam.h"
#include "../hooks/chunked_model.h"
#include "../scheduler/joint_solves.h"
#include "../scheduler/placement_policy.h"
#include "chunk_finality.h"
#include "chunk_updates.h"
#include "deferred_updates.h"
#include "grad_ledger.h"
#include "host_jobs.h"
#include "hybrid_adam_options.h"
#include "loss_scaler.h"
#include "ownership.h"
#include "pipelined_step.h"
#include "sharded_step.h"
#include "slot_accumulation.h"
#include "state_placement.h"

namespace ferry::optim {

class Engine final : private GradSink, private LayoutListener, private PlanAgreement {
 public:
  Engine(ChunkedModel& model, HybridAdamOptions options);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // HybridAdam's API (optim/hybrid_adam.h says what each does).
  StepResult step();
  StepResult backward_step(const at::Tensor& loss);
  void zero_grad();
  void synchronize() { await_params(); }
  std::future<void> run_on_worker(std::function<void()> job) { return cpu_adam_.run_async(std::move(job)); }
  int64_t pipelined_jobs_started() const { return jobs_.started(); }
  RoundTrips::Stats round_trip_stats() const { return jobs_.round_trip_stats(); }
  JointRates joint_rates() const;
  int64_t values_from_owners() const;
  std::shared_ptr<const dist::ParamShards> param_shards() const { return sharded_.param_shards(); }

  int num_param_groups() const { return cpu_adam_.num_param_groups(); }
  int group_of(int64_t param) const { return ledger_.group_of(param); }
  const AdamOptions& group_options(int group) const { return cpu_adam_.options(group); }
  void set_lr(int group, double lr);
  void set_lr(double lr);
  int64_t step_count(int group) const { return cpu_adam_.step_count(group); }
  int64_t param_step_count(int64_t param) const;
  double loss_scale() const { return scaling_ ? scaler_.scale() : 1.0; }
  const DynamicLossScaler& loss_scaler() const { return scaler_; }
  bool uses_loss_scaling() const { return scaling_; }

  bool placed() const;
  int64_t device_state_chunks() const;
  bool state_on_device(int64_t layout_chunk) const;
  int64_t state_bytes_per_chunk(int64_t layout_chunk) const { return placement_.group_bytes(layout_chunk); }
  int num_state_roles() const { return num_roles_; }
  StateFormat state_format() const { return options_.state_format; }
  at::Tensor state_view(int role, int64_t param);
  at::Tensor grad(int64_t param);
  ChunkStore& state_store() { return placement_.state().store(); }
  int64_t last_migration_peak_bytes() const { return placement_.state().last_migration_peak_bytes(); }

  void save(const std::string& dir);
  void load(const std::string& dir);
  bool grads_pending() const;
  NamedTensors state_dict();
  void load_state_dict(const NamedTensors& values, const ValueLoaded& loaded = {});

 private:
  // GradSink (hooks/chunked_model.h): the landing protocol, on autograd's thread. Slots in every mode;
  // with accumulate_grads they are emptied per chunk into the fp32 accumulation chunks.
  bool grads_into_param_slots() const override { return true; }
  void before_landing(int64_t param) override;
  void land_grad(int64_t param, const at::Tensor& grad) override;
  void after_landing(int64_t param) override;
  void used_in_backward(int64_t param) override;
  void backward_finished(bool aborted) override;
  void await_param(int64_t param) override;
  void await_params() override { deferred_.settle(); }
  // Note [Writes to parameters] (hooks/write_watch.h): the masters take what the user wrote.
  void values_written(const std::vector<WrittenParam>& written) override;
  // A parameter was frozen or unfrozen: the next backward_step() counts the landings anew (unpipelined
  // once, as the first one is) instead of expecting the old ones.
  void trainable_changed() override;
  void backward_uses_changed() override;
  void model_gone() override;  // the model was destroyed first: every call is refused from now on
  // LayoutListener: the model was repacked and migrated the state with it; placement starts over.
  void layout_changed() override;
  // PlanAgreement at N > 1 (dist/plan_agreement.h, over the step's communicator; no lock: it reads
  // nothing of this object's state).
  bool plan_now(bool ready, bool wanted, int64_t segments) override;
  MemoryPlanInput agree(const MemoryPlanInput& mine) override;

  ChunkedModel& model() const;  // refuses once the model is gone
  // The compact bf16 master under an fp16 compute copy: the slot is written from the master wherever a
  // value comes in (Note [The fp16 compute copy of compact state], engine.cpp).
  bool master_coarser_than_compute_copy() const;
  // f() under the mutex (the small readers between iterations).
  template <class F>
  auto locked(F&& f) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return f();
  }
  void check_idle(const char* what) const;
  // check_idle, then every update left running written, then the user's writes taken in: every public
  // call that reads or writes state or gradients.
  void settle(const char* what);
  void follow_layout_locked();
  void sync_layout_locked() const;  // asserts the state mirrors the model's layout
  void place_locked();
  // Note [The joint placement], at the end of a step: once, when due.
  void place_jointly_if_due_locked();
  // The host Adam's rate in the host updates since the last call (or the placement): bytes as Note [The
  // update costs of a state group] counts them over the worker's time in them; 0 when none ran.
  double host_adam_rate_in_steps_locked();
  // update_bytes() of layout chunk `chunk`'s group (scheduler/joint_placement.h).
  double update_bytes_locked(int64_t chunk);
  // The joint solve's input from the model's plan and the last iteration's backward (Note [The joint
  // placement]).
  ActivationCosts steady_costs_locked(const UpdateRates& rates);
  // A chunk final in this backward, in the mode this backward runs.
  void chunk_final_locked(int64_t chunk);

  // engine_step.cpp: the unpipelined step and the ends of the pipelined ones.
  StepResult step_locked();
  StepResult dist_step_locked();
  StepResult apply_locked(const ChunkNorms& norms, StepResult result);
  // Every grad chunk's squared norm and finiteness; one host sync for all device chunks. `pipelined`:
  // the chunks launched during backward contribute what was computed then.
  ChunkNorms grad_norms_locked(bool pipelined = false);
  // Default mode: each parameter chunk to its state's tier (skip_launched: not those the pipeline moved).
  void stage_param_chunks_locked(bool skip_launched = false);
  // After the updates: the parameter chunks hold values again; sets writeback_ns and written_back_chunks.
  void finish_values_locked(StepResult& result);
  // Note [The step's round trips in the reference]: the layout chunks this step applied landings to
  // (before the ledger forgets them), and, at the step's end (after a joint placement may have moved
  // state), those of them updated on the host, told to the scheduler.
  void note_landed_chunks_locked();
  void tell_round_trips_locked();
  // Writes the fp32 masters of the landed parameters into their slots (default mode: the gradients
  // there are given up), or zeroes the accumulation chunks; then forgets the landings.
  void discard_grads_locked();
  // Queues layout chunk c's host update (grad scale and group options frozen now) on CpuAdam's worker,
  // its parameter chunk locked on the host until it has written the new values; returns false (nothing
  // queued) where the parameter chunk is not on the host or nothing landed.
  using FrozenGroups = std::shared_ptr<const std::vector<CpuAdam::FrozenGroup>>;
  bool defer_host_update_locked(int64_t chunk, const UpdateOptions& options, const FrozenGroups& frozen);
  // Each group's options and step count frozen now for the updates left running behind the step (null:
  // none may be: update_behind_forward off, or replicated parameters across ranks).
  FrozenGroups frozen_groups_locked() const;
  void check_backward_step_start_locked() const;  // the layout is followed, no gradients wait for step()
  // The kind of pipeline an N = 1 backward_step runs: eager unless clipping or loss scaling need every
  // gradient first (two-phase, Note [Pipelined step]).
  PipelinedStep::Kind kind_at_one_rank() const;
  // The pipeline runs in this backward as `kind`; an eager one advances the groups' step counts now
  // (its updates start during backward).
  void start_pipeline_locked(PipelinedStep::Kind kind);
  // backward_step at N = 1 (default or accumulation mode), and across ranks.
  StepResult backward_step_at_one_rank(const at::Tensor& loss);
  StepResult backward_step_across_ranks(const at::Tensor& loss);
  // A backward_step at N = 1 whose backward threw: what the launched chunks did stays (the step count
  // has advanced in the eager step), the others keep their gradients.
  void abandon_backward_step_locked(bool pipelined);
  // After a pipelined backward (default or accumulation mode): the norms, then every update left (eager)
  // or every update (two-phase), and the values back in the parameter chunks.
  StepResult finish_pipelined_locked();
  std::function<bool(int64_t)> owned_fn() const;

  ChunkedModel& model_;  // through model() only
  std::atomic<bool> model_gone_{false};
  const HybridAdamOptions options_;
  CpuAdam cpu_adam_;
  DynamicLossScaler scaler_;
  const bool scaling_;
  const int num_roles_;
  std::unique_ptr<PlacementPolicy> policy_;
  mutable std::mutex mutex_;

  // Members that refer to earlier ones come after them.
  GradLedger ledger_;
  ChunkFinality finality_;
  StatePlacement placement_;
  Ownership ownership_;
  HostJobs jobs_;
  JointRates joint_rates_;  // of the joint placement, once it has run
  JointSolves solves_;      // when it solves (Note [The joint placement])
  int64_t plans_seen_ = 0;  // the model's plans() at the end of the last step
  std::vector<char> landed_chunks_;  // per layout chunk: the last applied step had a landing in it
  DeferredUpdates deferred_;
  ChunkUpdates updates_;
  PipelinedStep pipeline_;
  SlotAccumulation accumulation_;
  ShardedStep sharded_;
};

}  // namespace ferry::optim
