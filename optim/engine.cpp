// HybridAdam's engine: construction, and what the model calls during an iteration (engine.h).
#include "engine.h"

#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <utility>

#include "../common/event_trace.h"
#include "../common/logging.h"
#include "../hooks/interceptor.h"
#include "../dist/plan_agreement.h"
#include "../scheduler/joint_placement.h"
#include "rate_probe.h"

namespace ferry::optim {
namespace {

// The model, once it is known that an optimizer may attach to it now.
ChunkedModel& attachable(ChunkedModel& model) {
  const ModelPhase phase = model.phase();
  TORCH_CHECK(phase == ModelPhase::kIdle || phase == ModelPhase::kForwardDone, "ferry: HybridAdam HybridAdam() while "
              "the model is in ", to_string(phase), "; call it between iterations");
  // Before any state is allocated: a second optimizer would double the state's memory, take the
  // gradients from the first (which then failed on an internal assert), and, destroyed, detach the other.
  TORCH_CHECK(model.grad_sink() == nullptr, "ferry: this ChunkedModel has an optimizer attached already; one "
              "HybridAdam per model: destroy the first before constructing another (with a std::unique_ptr, "
              "`adam.reset();` before `adam = std::make_unique<ferry::HybridAdam>(...)`, which builds the new one "
              "before the old one goes). Other options for some parameters are a parameter group "
              "(HybridAdamOptions::with_group)");
  return model;
}

// Adds the option's groups to `adam` and says which one each parameter is in: the first rule that
// matches it, else group 0.
std::vector<int> assign_groups(const ChunkedModel& model, const HybridAdamOptions& options, CpuAdam& adam) {
  for (const auto& rule : options.groups) adam.add_param_group(rule.options);
  std::vector<int> group_of(model.num_params(), 0);
  for (int64_t p = 0; p < model.num_params(); ++p) {
    for (size_t g = 0; g < options.groups.size(); ++g) {
      if (options.groups[g].match(model.param_name(p), model.param(p))) {
        group_of[p] = static_cast<int>(g) + 1;
        break;
      }
    }
  }
  return group_of;
}

// The state chunks, paired with the parameter chunks group by group, belong to the model's chunk layer
// (migrated by its repacks). They get memory one layout chunk at a time as they are filled: the masters
// take over from the parameters' initial fp32 values, each released as soon as it is copied, so the
// fp32 values are never held twice. The moments (and accumulation chunks) start at zero: memory only
// when first touched, so none is spent before the first step, and at N > 1 none for the groups the
// rank will not own (D46).
std::shared_ptr<StateChunks> attach_state(ChunkedModel& model, const HybridAdamOptions& options) {
  if (options.state_format == StateFormat::kCompact) {
    // The compact master is bf16 and the update writes the compute copy from it: a 16-bit copy only
    // (an fp32 compute copy would be finer than the master it is made from).
    TORCH_CHECK(model.compute_dtype() == at::kBFloat16 || model.compute_dtype() == at::kHalf,
                "ferry: HybridAdam: the compact state format needs a bf16 or fp16 compute copy "
                "(Config::precision), got ", model.compute_dtype());
  }
  return model.attach_state(state_role_specs(options.state_format, options.accumulate_grads),
                            [&model](int r, int64_t p, const at::Tensor& slot) {
    if (r != kMasterRole) return;  // moments (and accumulated grads, scales) start at zero
    // The masters start from the values the module built (fp32), not from their rounded compute copy;
    // the compact master is those rounded to nearest.
    const at::Tensor initial = model.initial_value(p);
    slot.copy_(initial.defined() ? initial : model.param_values(p));
    model.release_initial_value(p);
  });
}

Ownership ownership_of(const std::shared_ptr<dist::Communicator>& comm) {
  return comm && comm->world_size() > 1 ? Ownership(comm->world_size(), comm->rank()) : Ownership();
}

std::unique_ptr<PlacementPolicy> policy_for(const HybridAdamOptions& options) {
  return options.device_state_chunks >= 0 ? make_fixed_count_policy(options.device_state_chunks)
                                          : make_first_chunks_first_policy();
}

}  // namespace

Engine::Engine(ChunkedModel& wrapped, HybridAdamOptions options)
    : model_(attachable(wrapped)),
      options_((options.validate(), std::move(options))),
      cpu_adam_(options_.defaults, CpuAdamConfig::from(wrapped.config())),
      scaler_(options_.loss_scaler),
      scaling_(wrapped.compute_dtype() == at::kHalf),
      num_roles_(static_cast<int>(state_role_specs(options_.state_format, options_.accumulate_grads).size())),
      policy_(policy_for(options_)),
      ledger_(assign_groups(wrapped, options_, cpu_adam_)),
      placement_(attach_state(wrapped, options_)),
      ownership_(ownership_of(options_.communicator)),
      jobs_(cpu_adam_),
      updates_(wrapped, cpu_adam_, options_.accumulate_grads, placement_, ledger_, ownership_,
               [this](int64_t c) { return sharded_.reduced(c); }),
      pipeline_(StepParts{wrapped, ledger_, finality_, placement_, updates_, jobs_, ownership_}),
      accumulation_(StepParts{wrapped, ledger_, finality_, placement_, updates_, jobs_, ownership_}, pipeline_),
      sharded_(StepParts{wrapped, ledger_, finality_, placement_, updates_, jobs_, ownership_}, ownership_,
               options_.communicator, options_.accumulate_grads, options_.shard_params, pipeline_) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  model().set_loss_scale(scaling_ ? scaler_.scale() : 1.0);
  // Note [Round trips through K buffers]: at one rank, where the host updates run in the default mode
  // behind the next forward (so that every host update can be a job that brings its chunk).
  if (ownership_.world() == 1 && !options_.accumulate_grads && options_.update_behind_forward) {
    jobs_.set_round_trip_slots(options_.round_trip_slots);
    placement_.set_round_trip_slots(options_.round_trip_slots);  // the host cache: K buffers
  } else if (options_.round_trip_slots > 0) {
    log::warn("ferry: HybridAdam: round_trip_slots is ", options_.round_trip_slots, " but the host updates take no round "
              "trips ", ownership_.world() > 1 ? "across ranks" : options_.accumulate_grads ? "with accumulate_grads"
              : "without update_behind_forward", ": every host-state parameter chunk waits on the host from backward to "
              "the next forward");
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    follow_layout_locked();
    if (sharded_.active()) {
      sharded_.broadcast_initial_values();  // writes every compute copy from the masters
    } else if (master_coarser_than_compute_copy()) {
      updates_.write_back();  // Note [The fp16 compute copy of compact state]
    }
  }
  model().release_initial_values();  // the masters hold them now
  model().set_grad_sink(this);
  model().set_layout_listener(this);
  if (sharded_.active()) model().set_plan_agreement(this);
  log::info("ferry: HybridAdam over ", model().num_params(), " parameters in ", num_param_groups(), " groups, ",
            placement_.num_chunks(), " state chunk groups (",
            options_.state_format == StateFormat::kCompact ? "compact: bf16 master, 8-bit exp_avg and exp_avg_sq"
                                                           : "fp32 master, exp_avg, exp_avg_sq",
            options_.accumulate_grads ? ", grad accumulation" : "; grads in the parameter chunks", "), CPU kernel ",
            to_string(cpu_adam_.isa()), " x", cpu_adam_.threads(), " threads (", to_string(cpu_adam_.split()), " split)",
            scaling_ ? ", fp16 dynamic loss scaling" : "",
            sharded_.active() ? ", rank " + std::to_string(ownership_.rank()) + " of " +
                                    std::to_string(ownership_.world()) + " (state sharded at the first step)"
                              : std::string());
}

Engine::~Engine() {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  // The model may keep the shards (its remote chunks) beyond this object: their guard waits on it.
  if (sharded_.param_shards()) sharded_.param_shards()->set_send_guard(nullptr);
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    deferred_.settle();  // the jobs use this object
  } catch (const std::exception& e) {
    log::error("ferry: an update HybridAdam left running failed: ", e.what());
  }
  if (model_gone_.load()) return;  // destroyed first: nothing of it to detach from
  try {
    // Between forward() and backward() too (an evaluation forward not ended): the model must not call
    // this object once it is gone.
    if (model().phase() == ModelPhase::kIdle || model().phase() == ModelPhase::kForwardDone) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (ledger_.any()) discard_grads_locked();  // the parameters get their values back
      }
      if (model().grad_sink() == this) {
        model().set_grad_sink(nullptr);
        model().set_loss_scale(1.0);
      }
      if (model().layout_listener() == this) model().set_layout_listener(nullptr);
      if (model().plan_agreement() == this) model().set_plan_agreement(nullptr);
    }
  } catch (const std::exception& e) {
    log::error("ferry: HybridAdam could not detach from the model: ", e.what());
  }
}

ChunkedModel& Engine::model() const {
  TORCH_CHECK(!model_gone_.load(std::memory_order_relaxed), "ferry: HybridAdam used after its ChunkedModel was "
              "destroyed: destroy the optimizer before its model (declare it after the model)");
  return model_;
}

void Engine::model_gone() {
  if (sharded_.param_shards()) sharded_.param_shards()->set_send_guard(nullptr);
  model_gone_ = true;
}

void Engine::check_idle(const char* what) const {
  TORCH_CHECK(!model_gone_.load(), "ferry: HybridAdam ", what, " after its ChunkedModel was destroyed: destroy the "
              "optimizer before its model (declare it after the model)");
  const ModelPhase phase = model().phase();
  TORCH_CHECK(phase == ModelPhase::kIdle || phase == ModelPhase::kForwardDone, "ferry: HybridAdam ", what,
              " while the model is in ", to_string(phase), "; call it between iterations");
}

void Engine::settle(const char* what) {
  check_idle(what);
  await_params();
  model().take_writes(what);  // Note [Writes to parameters]: what was written is in the masters first
}

std::function<bool(int64_t)> Engine::owned_fn() const {
  return [this](int64_t c) { return ownership_.owned(c); };
}

// ---- the layout and the placement ------------------------------------------------------------------

void Engine::follow_layout_locked() {
  // The model waits for updates left running before it ends an iteration, where it repacks.
  TORCH_INTERNAL_ASSERT(!deferred_.pending(), "a layout change with host updates still running");
  jobs_.forget_returns();  // the old store waited for its copies as it went
  placement_.follow_layout(model().layout_version(), model().layout().num_chunks());
  finality_.follow_layout(model().num_params());  // per parameter: kept across a repack
}

void Engine::layout_changed() {
  // The model migrated the state with the parameters (StateChunks, in the same repack); placement
  // starts over for the new layout.
  std::lock_guard<std::mutex> lock(mutex_);
  follow_layout_locked();
}

void Engine::sync_layout_locked() const {
  // The model announces every repack (layout_changed): the state always mirrors its layout.
  TORCH_INTERNAL_ASSERT(placement_.layout_version() == model().layout_version(), "HybridAdam missed a repack of "
                        "the model");
}

// Note [The joint placement]
// Opt-in (HybridAdamOptions::plan_state_with_activations). Under activations=auto (D75) the state is
// first placed by the policy at the first step after the warm-up, and the model plans its activations
// in the room the state left at the end of the next iteration, which recomputed and measured every
// checkpoint segment (Note [When the activation plan is made]). At the end of the third iteration that
// plan shaped (steady times: the measuring iteration synchronises the device around every recompute,
// which at 6b on one H100 made backward 0.735 s against 0.62 s steady, and a longer backward hides more
// host work; the first under a new plan re-traces and ran backward 0.05 s short on an H200, and the
// second may still run its host updates apart: JointSolves settles both), the memory plan (scheduler/memory_plan.h) decides again, in
// one solve, how many state groups go to the device and which segments keep their activations in the
// room left after every parameter chunk (its backward "with every recompute" being that iteration's,
// given back the recomputes its plan skipped, less its device updates), weighing the host
// updates the device state saves (at rates measured then: optim/rate_probe.h, and the host Adam's
// below) against the recompute the kept activations save; the state is placed again
// (StatePlacement::replace: groups may go back to the host) and the model applies the segments' half,
// replacing its own plan, and re-traces. With a fixed
// count of device groups (device_state_chunks) or at world size > 1 (where the ranks agree on the plan,
// dist/plan_agreement.h, and each places its own state) the model's plan stands. It runs at the end of
// that step (step() or backward_step()), after its updates, the model idle; the host updates it left
// running are waited for first. The host Adam's rate is the one its updates reached in the iteration
// before (HostJobs::take_work_times, taken at every step's end), not the probe's alone: beside the GPU's
// work and the other threads they run slower (on one H100 at 102-116 GB/s inside a 12b step where the
// probe reads 143; on the 2-core VM, where the "device" is the CPU too, at a third), and a plan made at
// the probe's rate counted updates hidden that were not (6b: 0.917 s against 0.836 s predicted). Where
// none ran (the policy put every group on the device) the first solve has only the probe's rate. Either
// way the rate is checked in the new placement's own steps, and the solve runs again at the measured
// rate where the probe's was used or the measured one is more than 5% lower, at most three solves in a
// layout (scheduler/joint_solves.h, Note [Checking the host rate under the plan's own placement]; D90):
// each further solve weighs the same segments and forward, backward as the last iteration ran it, and
// its placement moves only the groups whose place changed. Why not at the first
// placement, as until 2026-11-27: the only phase times at hand there are the warm-up's (first touches,
// LRU, every segment synchronised), 25x the steady forward at 4b on one H100, so every host update
// looked hidden behind them and all state went to the host (4b 1.6 s against 0.56 s).
void Engine::place_locked() {
  if (placement_.placed()) return;
  placement_.place(model(), *policy_, ownership_, !options_.accumulate_grads, sharded_.param_shards() != nullptr);
  if (!placement_.placed()) return;
  jobs_.take_work_times();  // the warm-up's host updates: no measure of the steps to come
  solves_.reset();          // a new layout: the joint placement starts over
}

void Engine::place_jointly_if_due_locked() {
  if (!options_.plan_state_with_activations) return;
  ChunkedModel& m = model();
  // A whole iteration has run under the model's current plan: its times are steady ones.
  const int64_t plans = m.activations().plans();
  const bool steady = plans > 0 && plans == plans_seen_;
  plans_seen_ = plans;
  const bool eligible = m.activations().policy() == ActivationPolicy::kAuto &&
                        options_.device_state_chunks < 0 && !sharded_.active() && placement_.placed() && steady &&
                        m.phase() == ModelPhase::kIdle;
  if (!eligible) {
    jobs_.take_work_times();  // each decision weighs the iteration before it alone
    return;
  }
  // When to solve and at which host rate: scheduler/joint_solves.h (Note [Checking the host rate under
  // the plan's own placement]). Only where it may ask for a solve are the running host updates settled
  // first (no host update may run on a group that moves; their times count below).
  if (solves_.may_solve()) deferred_.settle();
  const double in_steps = host_adam_rate_in_steps_locked();
  const JointSolves::Decision decision = solves_.decide(in_steps);
  if (!decision.solve) return;
  try {
    const bool first = solves_.solves() == 0;
    UpdateRates rates;
    double alone = 0;
    if (first) {
      const Device& device = m.device_object();
      rates = measure_update_rates(cpu_adam_, device, device.torch_device().is_cuda(), m.chunk_size_bytes());
      alone = rates.host_adam_bytes_per_s;
    } else {
      rates = joint_rates_.used;
      alone = joint_rates_.host_adam_alone_bytes_per_s;
    }
    const bool from_probe = decision.host_rate <= 0;
    if (!from_probe) rates.host_adam_bytes_per_s = decision.host_rate;
    const ActivationCosts costs = steady_costs_locked(rates);
    log::info("ferry: measured for the joint placement", first ? "" : " (again, from its own placement's steps)",
              ": host Adam ", alone / 1e9, " GB/s alone",
              !from_probe ? ", " + std::to_string(decision.host_rate / 1e9) + " GB/s in the steps " +
                                (first ? "since the state was placed" : "under the last joint placement") + " (used)"
                          : std::string(", no host update in the steps since the state was placed"),
              first ? "" : "; the last solve used " + std::to_string(joint_rates_.used.host_adam_bytes_per_s / 1e9) + " GB/s",
              "; host<->device copies ", rates.copy_bytes_per_s / 1e9, " GB/s, device ", rates.device_bytes_per_s / 1e9,
              " GB/s; backward with every recompute ", costs.backward_s, " s in the last iteration's terms (",
              m.activations().plan_input().backward_s, " s measured recomputing)");
    const JointPlacementPolicy policy(costs, rates);
    const bool params_travel = !options_.accumulate_grads, remote_params = sharded_.param_shards() != nullptr;
    placement_.replace(m, policy, ownership_, params_travel, remote_params);
    if (policy.planned()) m.apply_activation_plan(policy.plan(), policy.plan_input());
    plans_seen_ = m.activations().plans();  // the next decision waits for an iteration under this plan
    solves_.solved(rates.host_adam_bytes_per_s, from_probe, placement_.num_on_device() < placement_.num_chunks());
    joint_rates_ = JointRates{rates, alone, in_steps};  // joint_rates() adds what solves_ keeps
  } catch (...) {
    solves_.failed();  // not retried at every step; the error is the step's
    throw;
  }
}

ActivationCosts Engine::steady_costs_locked(const UpdateRates& rates) {
  // Note [The joint placement]: the segments and forward the model's plan was made from; backward as
  // the last iteration ran it (the plan's kept segments not recomputed, this placement's device updates
  // on the compute stream), given back the recomputes it skipped, less those updates (the plan counts
  // them apart, D(m)).
  ChunkedModel& m = model();
  const MemoryPlanInput& input = m.activations().plan_input();
  const MemoryPlan& plan = m.activations().plan();
  ActivationCosts costs;
  costs.segments = input.segments;
  costs.forward_s = input.forward_s;
  costs.host_behind_forward = options_.update_behind_forward;
  double skipped = 0, recompute = 0;
  for (size_t k = 0; k < input.segments.size(); ++k) {
    if (input.segments[k].saved_bytes < 0) continue;
    recompute += input.segments[k].recompute_s;
    if (k < plan.keep.size() && plan.keep[k] != 0) skipped += input.segments[k].recompute_s;
  }
  double device_updates = 0;
  for (int64_t c = 0; c < placement_.num_chunks(); ++c) {
    if (!placement_.on_device(c)) continue;
    device_updates += update_bytes_locked(c) / rates.device_bytes_per_s;
  }
  const double last = m.last_phase_seconds().backward;
  costs.backward_s = last > 0 ? std::max(recompute, last + skipped - device_updates) : input.backward_s;
  return costs;
}

double Engine::host_adam_rate_in_steps_locked() {
  // Each job moved its group's bytes as Note [The update costs of a state group] counts them.
  const HostJobs::WorkTimes times = jobs_.take_work_times();
  double bytes = 0, seconds = 0;
  for (size_t c = 0; c < times.jobs.size(); ++c) {
    if (times.jobs[c] == 0 || static_cast<int64_t>(c) >= placement_.num_chunks()) continue;
    bytes += static_cast<double>(times.jobs[c]) * update_bytes_locked(static_cast<int64_t>(c));
    seconds += static_cast<double>(times.ns[c]) * 1e-9;
  }
  return seconds > 0 ? bytes / seconds : 0.0;
}

double Engine::update_bytes_locked(int64_t chunk) {
  ChunkedModel& m = model();
  return update_bytes(placement_.group_bytes(chunk), m.store().chunk_info(m.param_chunk(chunk)).nbytes);
}

bool Engine::plan_now(bool ready, bool wanted, int64_t segments) {
  const dist::PlanVotes votes = dist::vote_on_plan(sharded_.comm(), {ready, wanted, segments});
  if (!votes.same_segments()) {
    log::warn_once("activations-auto-segments",
                   "ferry: activations=auto: the ranks' forwards ran from " + std::to_string(votes.min_segments) +
                       " to " + std::to_string(votes.max_segments) +
                       " checkpoint segments, so they cannot agree on a new plan; each keeps the one it has "
                       "(none yet: every segment recomputed) until they run the same count");
  }
  return votes.plan();
}

MemoryPlanInput Engine::agree(const MemoryPlanInput& mine) { return dist::agree_plan_input(sharded_.comm(), mine); }

JointRates Engine::joint_rates() const {
  return locked([&] {
    JointRates r = joint_rates_;
    r.host_adam_under_plan_bytes_per_s = solves_.rate_under_plan();
    r.solves = solves_.solves();
    return r;
  });
}

bool Engine::placed() const {
  return locked([&] { return placement_.placed(); });
}

int64_t Engine::device_state_chunks() const {
  return locked([&] { return placement_.num_on_device(); });
}

bool Engine::state_on_device(int64_t layout_chunk) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(layout_chunk >= 0 && layout_chunk < placement_.num_chunks(), "ferry: layout chunk ", layout_chunk,
              " out of range [0, ", placement_.num_chunks(), ")");
  return placement_.on_device(layout_chunk);
}

// ---- the model's calls during backward (GradSink) --------------------------------------------------

void Engine::before_landing(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t c = model().layout().slots()[param].chunk;
  if (options_.accumulate_grads) {
    accumulation_.before_landing(param, c);
    return;
  }
  if (!pipeline_.active() || !pipeline_.launched(c)) return;
  pipeline_.late_landing(param, c, /*accumulation=*/false);
}

void Engine::land_grad(int64_t param, const at::Tensor& grad) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  TORCH_CHECK(grad.layout() == at::kStrided, "ferry: HybridAdam needs dense gradients; parameter ",
              model().param_name(param), " got a ", grad.layout(), " one");
  // The model wrote it into the parameter's slot (grads_into_param_slots). With accumulation,
  // after_landing() consumes the chunk when it is final for this backward (Note [Accumulation per chunk]).
  if (options_.accumulate_grads) accumulation_.land(param);
  ledger_.land(param);
  finality_.count_landing(param);
}

void Engine::after_landing(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t c = model().layout().slots()[param].chunk;
  if (options_.accumulate_grads) {
    if (finality_.final_after_landing(param, c)) accumulation_.consume_final(c);
    return;
  }
  if (pipeline_.active() && finality_.final_after_landing(param, c)) chunk_final_locked(c);
}

void Engine::used_in_backward(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  const int64_t c = model().layout().slots()[param].chunk;
  if (options_.accumulate_grads) {
    if (finality_.use(param, c, accumulation_.armed())) accumulation_.consume_final(c);
    return;
  }
  if (finality_.use(param, c, pipeline_.active())) chunk_final_locked(c);
}

void Engine::chunk_final_locked(int64_t c) {
  if (pipeline_.across_ranks()) {
    sharded_.chunk_final(c);
  } else {
    pipeline_.launch(c);
  }
}

void Engine::backward_finished(bool aborted) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Note [A chunk final before its last use]: this backward's uses join what the next ones expect (an
  // aborted one's too: they are a part of what it would have had; Note [Expectations only grow]).
  finality_.end_uses();
  std::exception_ptr error;
  if (options_.accumulate_grads) error = accumulation_.end_backward();
  // Every rank, armed or not (a rank may have landed nothing), whatever its jobs did: the collectives
  // must pair up. An aborted backward too: the other ranks' backwards end here as well (no collective
  // runs inside an accumulating backward), and the next forward needs the values.
  if (options_.accumulate_grads && ownership_.sharded() && ownership_.world() > 1 &&
      (aborted || !sharded_.step_follows_backward())) {
    sharded_.values_from_owners();
  }
  if (error) std::rethrow_exception(error);
  // Note [Host updates carried over behind the next forward] (engine_step.cpp): the host updates not
  // started when the device has finished backward are taken back, to run after it in forward's order
  // behind the step's return. Until then the worker goes on taking them.
  if (!aborted) {
    if (jobs_.any_queued()) {
      trace::Span span("adam", "adam.wait_for_backward_on_device");
      model().device_object().synchronize();
    }
    for (int64_t c : jobs_.cancel_queued()) pipeline_.unlaunch(c);
  }
  // The jobs read and write parameter chunks: done before the model ends the iteration.
  jobs_.wait_all();
}

void Engine::await_param(int64_t param) {
  // Before every use of a parameter: the common case (nothing running) is two atomic loads.
  const bool backward = jobs_.in_backward();
  if (!backward && !deferred_.pending()) return;
  const int64_t c = model().layout().slots()[param].chunk;
  // Note [A chunk final before its last use]: a use the counts did not foresee waits for the chunk's job.
  if (backward) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (jobs_.has(c)) {
      trace::Span span("adam", trace::enabled() ? "use waits for host adam chunk " + std::to_string(c) : std::string());
      jobs_.wait(c);  // its errors surface where the jobs are joined
    }
  }
  // The layout cannot change while updates run (follow_layout_locked asserts it): read without the mutex.
  deferred_.await_chunk(c);
}

// What backwards had no longer says what the next ones will have: learned again from the next, which
// runs unpipelined.
void Engine::trainable_changed() {
  std::lock_guard<std::mutex> lock(mutex_);
  finality_.forget();
  pipeline_.forget();
}

// A kept segment makes no recompute uses in backward: expected uses that only grow (Note [Expectations
// only grow]) would hold each of its chunks to backward's end (4b on one H100: 96 of 193 chunks
// updated after backward, +28 ms a step). As for a change of requires_grad.
void Engine::backward_uses_changed() { trainable_changed(); }

// Note [Writes to parameters] (hooks/write_watch.h). Every slot holds its value here. A replacement
// is taken whole, at its own precision; an in-place write where the slot differs from the master
// rounded to the compute dtype (in fp32, everywhere: the slot is the master's copy). Another rank's
// chunk (sharded state): its owner takes the write, and the values come from it after the step. Where
// the master is coarser than the slot (Note [The fp16 compute copy of compact state]) the slot then
// gets the master's value: the write as the state keeps it.
void Engine::values_written(const std::vector<WrittenParam>& written) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  for (const WrittenParam& w : written) await_param(w.param);  // an update left running writes the master
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  for (const WrittenParam& w : written) {
    if (!ownership_.owned(model().layout().slots()[w.param].chunk)) continue;
    at::Tensor master = placement_.view(kMasterRole, w.param);
    if (w.replacement.defined()) {
      master.copy_(w.replacement);
    } else {
      const at::Tensor value = model().param_values(w.param).to(master.device());
      if (value.scalar_type() == at::kFloat) {
        master.copy_(value);
      } else {
        const at::Tensor changed = value.ne(master.to(value.scalar_type()));
        master.copy_(at::where(changed, value.to(at::kFloat), master));
      }
    }
    // Every rank rounds alike only where every rank holds every master (N = 1, or before sharding).
    if (master_coarser_than_compute_copy() && !ownership_.sharded()) model().param_values(w.param).copy_(master);
  }
}

// Note [The fp16 compute copy of compact state]
// Everywhere else the compute copy is the master rounded to the compute dtype, whatever put a value
// there: the module's initial values (the master takes the fp32 value, the slot its rounding), a write
// (above), load_state_dict() and load() (which write every slot from the masters), an update. The
// compact master is bf16; with an fp16 compute copy (11 significant bits to bf16's 8) the slot of a
// parameter that no update has touched since its value came in would be finer than its master: a
// frozen layer, a layer not used yet, every parameter before the first applied step (fp16 loss
// scaling skips the first ones). Nothing saves such a slot: a checkpoint holds the masters and load()
// writes the slots from them, so a run resumed from it computed with other values than the run that
// saved it (found by the mechanism-combination test, tests/optim/test_mechanism_combinations.cpp: a
// frozen bias, fp16 compute, compact state, one save and load), and one process started from values
// that several ranks do not (their broadcast of the initial masters already wrote the slots from
// them). So here the slot is the master's value from the start and after each write: under the
// compact format every weight is a bf16 value, the fp16 copy holds it (rounded only below fp16's
// normal range, 2^-14, where both formats lose bits). The cost: a frozen or pretrained fp16 weight is
// rounded to bf16 when the optimizer is built, as any weight is at its first update. Not after a
// write once the state is sharded (N > 1, after the first step): only the owner has the master, and
// a slot rounded there alone would leave the ranks computing with different weights; every rank's
// slot keeps the written fp16 value until the parameter's next update (a frozen parameter written
// then resumes from a checkpoint with its master's value).
bool Engine::master_coarser_than_compute_copy() const {
  return options_.state_format == StateFormat::kCompact && model().compute_dtype() == at::kHalf;
}

// ---- options and counts --------------------------------------------------------------------------

void Engine::set_lr(int group, double lr) {
  AdamOptions o = cpu_adam_.options(group);
  o.lr = lr;
  o.validate();
  cpu_adam_.set_options(group, o);
}

void Engine::set_lr(double lr) {
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "ferry: lr must be finite and >= 0, got ", lr);
  for (int g = 0; g < num_param_groups(); ++g) set_lr(g, lr);
}

int64_t Engine::param_step_count(int64_t param) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(param >= 0 && param < model().num_params(), "ferry: HybridAdam::param_step_count: expected a parameter "
              "index in [0, ", model().num_params(), "), got ", param);
  const int64_t c = model().layout().slots()[param].chunk;
  TORCH_CHECK(ownership_.owned(c), "ferry: HybridAdam::param_step_count: the state of ", model().param_name(param),
              " is on rank ", ownership_.owner(c), ", not on rank ", ownership_.rank(), " (ask the rank that owns it)");
  return cpu_adam_.step_count(ledger_.group_of(param)) - ledger_.lag(param);
}

int64_t Engine::values_from_owners() const {
  return locked([&] { return sharded_.values_from_owners_count(); });
}

bool Engine::grads_pending() const {
  return locked([&] { return ledger_.any(); });
}

}  // namespace ferry::optim
