// HybridAdam's engine: step() and backward_step() (engine.h).
//
// A step (step()):
//  1. Per chunk, the grad norm and finiteness (device: one reduction each, one host sync for all;
//     host: CpuAdam::grad_norm_sq). A non-finite grad anywhere, or a chunk's norm that overflows (D70),
//     skips the step: nothing is written, the loss scaler (fp16) backs off, step counts stay.
//  2. coef = clip coefficient (max_grad_norm / (norm + 1e-6), at most 1, as clip_grad_norm_) / loss scale.
//  3. Each group's step count advances; every parameter that received a gradient since the last
//     step is updated with it scaled by coef (one that received none is left alone, as torch's
//     optimizers skip a parameter whose .grad is undefined), with the bias corrections of its own
//     step count, its number of updates (D62).
//  4. The updated fp32 masters are written into the parameter chunks in the compute dtype, by the
//     update in its own pass (host or device kernel; with accumulate_grads where the parameter chunk is
//     where the state is, else by a copy after it).
//     Host updates may still run when step() returns: Note [Update behind the next forward].
//  Without accumulate_grads, the parameter chunk of a host-state chunk moves to the host for the
//  update and that of a device-state chunk to the device (each where its state is).
// backward_step() runs the same updates as a pipeline over the chunks during backward (Note [Pipelined
// step]), with micro-batches (Note [Accumulation per chunk]) or across ranks (Note [Sharded optimizer
// state]); what is left after backward runs here as step() runs it.
#include <ATen/ops/all.h>
#include <ATen/ops/isfinite.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "../common/event_trace.h"
#include "../common/logging.h"
#include "../hooks/interceptor.h"
#include "../scheduler/scheduler.h"
#include "engine.h"

namespace ferry::optim {
namespace {

using trace::now_ns;

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "(not a std::exception)";
  }
}

}  // namespace

StepResult Engine::step() {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  settle("step()");
  std::lock_guard<std::mutex> lock(mutex_);
  StepResult result = step_locked();
  result.host_norm_bytes = updates_.take_host_norm_bytes();
  place_jointly_if_due_locked();
  tell_round_trips_locked();
  return result;
}

StepResult Engine::step_locked() {
  sync_layout_locked();
  if (sharded_.active()) return dist_step_locked();
  TORCH_CHECK(ledger_.any(), "ferry: HybridAdam::step() found no gradients since the last zero_grad(); call "
                             "model.backward(loss) first");
  place_locked();
  StepResult result;
  result.loss_scale = loss_scale();

  trace::Span step_span("adam", "adam.step");
  stage_param_chunks_locked();
  // 1. Norms and finiteness, one host sync for all device chunks.
  const int64_t t0 = now_ns();
  const ChunkNorms norms = grad_norms_locked();
  for (int64_t c = 0; c < placement_.num_chunks(); ++c) {
    (placement_.on_device(c) ? result.device_chunks : result.host_chunks) += 1;
  }
  result.device_syncs = norms.syncs;
  result.norm_ns = now_ns() - t0;
  trace::complete("adam", "adam.grad_norm", t0, t0 + result.norm_ns);
  return apply_locked(norms, result);
}

StepResult Engine::dist_step_locked() {
  trace::Span step_span("adam", "adam.dist_step");
  sharded_.shard([this](int64_t c) { deferred_.await_chunk(c); });
  place_locked();
  StepResult result;
  result.loss_scale = loss_scale();
  int64_t comm_ns = 0;
  int64_t t0 = now_ns();
  // 1. Every rank's gradients summed into their owners' chunks, with the union of the landed sets.
  sharded_.reduce_grads();
  if (sharded_.param_shards()) sharded_.param_shards()->release_all();  // their gradients are with the owners now
  comm_ns += now_ns() - t0;
  // 2. The owned chunks to their state's tier; their norms, totalled over the ranks.
  stage_param_chunks_locked();
  t0 = now_ns();
  ChunkNorms norms = grad_norms_locked();
  result.device_syncs = norms.syncs;
  int64_t landed = 0;
  for (int64_t c = 0; c < placement_.num_chunks(); ++c) {
    if (!ownership_.owned(c)) continue;
    for (int64_t p : model().layout().chunks()[c].tensors) landed += ledger_.landed(p);
  }
  const int64_t tn = now_ns();
  const auto [sum_sq, counts] = sharded_.sum_over_ranks(norms.sum_sq, {norms.all_finite ? 0 : 1, landed});
  comm_ns += now_ns() - tn;
  norms.sum_sq = sum_sq;
  norms.total_sq = sum_sq.value();
  norms.all_finite = counts[0] == 0 && std::isfinite(norms.total_sq);
  result.norm_ns = now_ns() - t0;
  if (counts[1] == 0) {  // the same on every rank: all fail together
    if (!sharded_.param_shards()) sharded_.gather_params();  // slots of this rank's own landings (if any) get values back
    ledger_.clear();
    model().clear_grad_slots();
    TORCH_CHECK(false, "ferry: HybridAdam::step() found no gradients since the last zero_grad() on any rank; call "
                       "model.backward(loss) first");
  }
  ledger_.mark_any();
  for (int64_t c = 0; c < placement_.num_chunks(); ++c) {
    if (ownership_.owned(c)) (placement_.on_device(c) ? result.device_chunks : result.host_chunks) += 1;
  }
  // 3. The owners update (or, on overflow, restore) their chunks; 4. everyone gets the new values.
  result = apply_locked(norms, result);
  sharded_.clear_reduced();
  sharded_.agree_on_trace();
  t0 = now_ns();
  if (!sharded_.param_shards()) sharded_.gather_params();  // sharded parameters: fetched at their next use instead
  comm_ns += now_ns() - t0;
  result.comm_ns = comm_ns;
  return result;
}

ChunkNorms Engine::grad_norms_locked(bool pipelined) {
  const int64_t n = placement_.num_chunks();
  const ChunkLayout& layout = model().layout();
  ChunkNorms norms;
  norms.finite.assign(n, 1);
  std::vector<at::Tensor> device;
  std::vector<int64_t> device_index;
  const bool any_late = pipelined && pipeline_.any_late();
  if (any_late) norms.late_finite.assign(n, 1);
  const std::vector<char>* late = &pipeline_.late_mask();
  for (int64_t c = 0; c < n; ++c) {
    const bool done = pipelined && pipeline_.launched(c);  // computed during backward
    if (!ownership_.owned(c)) continue;                     // its owner's norm comes with the all-reduce
    // Chunk c's terms taken on the device (index n + c: its late part), read with the others at the end.
    auto on_the_device = [&](at::Tensor d, int64_t index) {
      if (!d.defined()) return;
      device.push_back(std::move(d));
      device_index.push_back(index);
    };
    if (placement_.on_device(c)) {
      on_the_device(done ? std::move(pipeline_.device_norms(c))
                         : updates_.device_norms(c, updates_.grad_payload(c), ledger_.spans(layout, c)),
                    c);
      if (done && pipeline_.has_late(c)) {  // Note [A gradient after its chunk's update]: the late part's own
        on_the_device(updates_.device_norms(c, updates_.grad_payload(c), ledger_.spans(layout, c, late)), n + c);
      }
    } else {
      // Note [Round trips through K buffers]: a host-state chunk left on the device has its norms taken
      // there, with the device chunks' (the two-phase step's at its launch).
      if (done && pipeline_.device_norms(c).defined()) {
        on_the_device(std::move(pipeline_.device_norms(c)), c);
        continue;
      }
      ChunkOutcome o;
      if (done) {
        o = pipeline_.outcome(c);
      } else {
        const std::vector<Span> spans = ledger_.spans(layout, c);
        // A job taken back at backward's end: its norms were taken before its trip (Note [Norms before the trip]).
        const std::optional<ChunkOutcome> trip = pipelined ? pipeline_.trip_outcome(c, spans) : std::nullopt;
        if (!trip && jobs_.round_trips() && model().store().location(model().param_chunk(c)) == Location::kDevice) {
          on_the_device(updates_.device_norms(c, updates_.grad_payload(c), spans), c);
          continue;
        }
        o = trip ? *trip : updates_.host_norm(c, updates_.grad_payload(c), spans);
      }
      norms.sum_sq.add(o.sum_sq);
      norms.finite[c] = o.finite;
      if (done && pipeline_.has_late(c)) {
        const ChunkOutcome late_part = updates_.host_norm(c, updates_.grad_payload(c), ledger_.spans(layout, c, late));
        norms.sum_sq.add(late_part.sum_sq);
        norms.late_finite[c] = late_part.finite;
      }
    }
  }
  if (pipelined) pipeline_.clear_device_norms();
  ChunkUpdates::finish_norms(device, device_index, norms);
  return norms;
}

void Engine::stage_param_chunks_locked(bool skip_launched) {
  if (options_.accumulate_grads) return;
  trace::Span span("adam", "adam.stage_param_chunks");
  ChunkStore& params = model().store();
  const int64_t n = placement_.num_chunks();
  auto skipped = [&](int64_t c) {
    return (skip_launched && pipeline_.launched(c) && !pipeline_.has_late(c)) || !ownership_.owned(c);
  };
  // Note [Round trips through K buffers]: a host-state chunk stays where it is, its norms are taken
  // there and its update's job brings it; but for the late part of a chunk whose job ran in backward,
  // updated on this thread.
  auto stays = [&](int64_t c) {
    const bool late_part = skip_launched && pipeline_.launched(c) && pipeline_.has_late(c);
    return !placement_.on_device(c) && !late_part;
  };
  // Host-bound chunks first: they must leave anyway, and the room they free is what the device-bound
  // ones are moved into. (Device-bound first let the eviction policy, which knows nothing of the step,
  // evict a device-bound chunk staged a moment before to make room for the next one: seen on a GPU,
  // where the device norms then met a gradient on the host.)
  auto stage = [&](bool round_trips) {
    for (int pass = 0; pass < 2; ++pass) {
      const bool device = pass == 1;
      for (int64_t c = 0; c < n; ++c) {
        if (placement_.on_device(c) != device || skipped(c) || (round_trips && stays(c))) continue;
        const Location want = device ? Location::kDevice : Location::kHost;
        if (params.location(model().param_chunk(c)) != want) params.move(model().param_chunk(c), want);
      }
    }
  };
  auto staged = [&] {
    for (int64_t c = 0; c < n; ++c) {
      if (placement_.on_device(c) && !skipped(c) && params.location(model().param_chunk(c)) != Location::kDevice) {
        return false;
      }
    }
    return true;
  };
  stage(jobs_.round_trips());
  if (jobs_.round_trips() && !staged()) {
    // The parameter chunks do not all fit the device (the premise of the bound): the host-state ones
    // leave first, as without round trips, and their updates' jobs find them on the host.
    log::debug("ferry: HybridAdam: the device holds fewer parameter chunks than the step needs; the host-state ones "
               "are staged on the host");
    stage(false);
  }
  const int64_t on_device = placement_.num_on_device();
  for (int64_t c = 0; c < n; ++c) {
    if (!placement_.on_device(c) || skipped(c)) continue;
    TORCH_CHECK(params.location(model().param_chunk(c)) == Location::kDevice, "ferry: HybridAdam: the parameter chunk of "
                "state chunk ", c, " (state on the device) was evicted while the step staged the others: the device "
                "budget's parameter region holds fewer chunks than the ", on_device, " whose state is on the device. "
                "Lower HybridAdamOptions::device_state_chunks or raise the device budget.");
  }
}

StepResult Engine::apply_locked(const ChunkNorms& norms, StepResult result) {
  const int64_t n = placement_.num_chunks();
  updates_.arm_written(n);
  int64_t t0 = now_ns();
  if (!norms.all_finite) {
    result.overflow = true;
    result.grad_norm = std::numeric_limits<double>::infinity();
    if (scaling_) {
      scaler_.update(true);
      model().set_loss_scale(scaler_.scale());
      log::info("ferry: non-finite gradient at loss scale ", result.loss_scale, ": step skipped, scale now ",
                scaler_.scale());
    } else {
      log::warn("ferry: non-finite gradient (or a gradient norm that overflows): step skipped (the parameters "
                "and optimizer state are unchanged)");
    }
    if (!options_.accumulate_grads) discard_grads_locked();  // consumed: the slots get their values back
    return result;
  }
  // Data parallelism: the gradients are sums over the ranks; their mean is the concatenated batch's.
  const double world = static_cast<double>(ownership_.world());
  result.grad_norm = std::sqrt(norms.total_sq) / (result.loss_scale * world);
  if (options_.max_grad_norm > 0) {
    result.clip_coef = std::min(1.0, options_.max_grad_norm / (result.grad_norm + 1e-6));
  }
  const double grad_scale = result.clip_coef / (result.loss_scale * world);

  // 2. Update: device chunks with the device kernel, host chunks with CpuAdam.
  for (int g = 0; g < num_param_groups(); ++g) cpu_adam_.advance_step(g);
  t0 = now_ns();
  for (int64_t c = 0; c < n; ++c) {
    if (placement_.on_device(c) && ownership_.owned(c)) updates_.device_update(c, grad_scale);
  }
  result.device_update_ns = now_ns() - t0;
  trace::complete("adam", "adam.device_update", t0, t0 + result.device_update_ns,
                  "\"chunks\": " + std::to_string(result.device_chunks));
  t0 = now_ns();
  UpdateOptions update_options;
  update_options.grad_scale = grad_scale;
  update_options.grads_checked = true;
  // Note [Update behind the next forward]: the host updates queued in forward order (layout order),
  // each group's options and step count frozen now. At N > 1 only where the next use gathers the new
  // values (sharded parameters, whose gathers wait for them); else the step's own gather reads them.
  const FrozenGroups frozen = frozen_groups_locked();
  for (int64_t c = 0; c < n; ++c) {
    if (placement_.on_device(c) || !ownership_.owned(c)) continue;
    if (frozen && defer_host_update_locked(c, update_options, frozen)) {
      ++result.deferred_chunks;
    } else {
      updates_.host_update(c, update_options);
    }
  }
  result.host_update_ns = now_ns() - t0;  // on this thread: queueing only, for the chunks left running
  trace::complete("adam", "adam.host_update", t0, t0 + result.host_update_ns,
                  "\"chunks\": " + std::to_string(result.host_chunks));

  // The spans above (those left running too) took their lags already.
  ledger_.count_missed_steps(model().layout(), owned_fn(), nullptr, nullptr, nullptr);
  finish_values_locked(result);
  if (scaling_) {
    scaler_.update(false);
    model().set_loss_scale(scaler_.scale());
  }
  // The updates left running write the parameters: ops on this thread that use them wait for them
  // (Note [Ops outside the scopes]). Last, so that the step's own ops above are not watched.
  if (result.deferred_chunks > 0) watch_outside_uses();
  result.applied = true;
  return result;
}

Engine::FrozenGroups Engine::frozen_groups_locked() const {
  if (!options_.update_behind_forward || !(ownership_.world() == 1 || sharded_.param_shards())) return nullptr;
  auto groups = std::make_shared<std::vector<CpuAdam::FrozenGroup>>();
  for (int g = 0; g < num_param_groups(); ++g) groups->push_back(cpu_adam_.freeze(g));
  return groups;
}

bool Engine::defer_host_update_locked(int64_t c, const UpdateOptions& options, const FrozenGroups& frozen) {
  ChunkStore& params = model().store();
  const ChunkId pc = model().param_chunk(c);
  // Default mode: staged on the host with the gradients, or where it is for a round trip (Note [Round
  // trips through K buffers]: the job brings it). With accumulate_grads where the scheduler left it: a
  // parameter chunk on the device keeps the update here and the copy after it (write_back).
  const bool round_trip = jobs_.round_trips();  // never with accumulate_grads (the constructor)
  const Location where = params.location(pc);
  if (where != Location::kHost && !(round_trip && where == Location::kDevice)) return false;
  std::vector<Span> spans = ledger_.spans(model().layout(), c);
  if (spans.empty()) return false;
  at::Tensor acc;  // accumulate_grads: the gradients; the job writes the new values into the parameter chunk
  if (options_.accumulate_grads) {
    acc = updates_.grad_payload(c);  // at N > 1 the sums over the ranks (a tensor of their own)
    updates_.mark_written(c);
  }
  const HostState state = placement_.host_state(c, /*held=*/true, /*moments=*/true, model().layout());
  deferred_.put(c, jobs_.launch(
                       params, pc, c, "deferred host adam chunk ",
                       [this, spans = std::move(spans), options, frozen, acc, state](const at::Tensor& g) {
                         if (!acc.defined()) {  // default mode: the new values over the gradients
                           updates_.run_host(updates_.adam_spans(spans, state, g),
                                             options, frozen.get());
                           return;
                         }
                         const bool lowp = g.scalar_type() != at::kFloat;
                         updates_.run_host(updates_.adam_spans(spans, state,
                                                               acc, lowp ? g : at::Tensor()),
                                           options, frozen.get());
                         // fp32 compute: the master is the value, as the write-back copies it
                         if (!lowp) g.copy_(state.master_tensor);
                       },
                       /*background_write=*/true, round_trip ? Trip::kRoundTrip : Trip::kStay));
  return true;
}

void Engine::finish_values_locked(StepResult& result) {
  // The parameters in the compute dtype: the default mode's updates wrote them over the gradients; with
  // accumulate_grads, where the parameter chunk was beside the state (the others are copied now).
  const int64_t t0 = now_ns();
  if (options_.accumulate_grads) {
    result.written_back_chunks = updates_.write_back(/*after_update=*/true);
  } else {
    note_landed_chunks_locked();
    model().clear_grad_slots();
    ledger_.clear();
  }
  result.writeback_ns = now_ns() - t0;
  trace::complete("adam", "adam.writeback", t0, t0 + result.writeback_ns);
}

// Note [The step's round trips in the reference]
// A parameter chunk whose update runs on the host goes there once per step, after its last use in
// backward (with its gradients: in the pipeline at its last landing, else in the step), and comes back
// for its first use in the next forward, whatever the budget: a round trip no eviction order avoids.
// The scheduler is told which chunks those are, from the landings the step applied and where their
// state is at the step's end (a joint placement may have just moved it). Its OPT policy then gives
// such a chunk up first once its last use is behind (it is leaving anyway; before, OPT kept it for the
// next forward and gave up a chunk that would have stayed), its Belady reference counts the trips
// (scheduler/access_trace.h), and its meter the step's moves between two iterations
// (IterationStats::between_*): moved / optimal is 1 where eviction and prefetch did as well as Belady
// could with this placement (D101). A chunk updated on the device has no trip: where the step (not the
// pipeline) runs its update it may bring the chunk back to the device, and that move is the
// unpipelined step's excess over the reference. Not told: with accumulate_grads (the gradients go to
// the accumulation chunks each micro-batch, the update once per step) and across ranks (the owner's
// update, the others' chunks released): the reference there stays the trace's alone.
void Engine::note_landed_chunks_locked() {
  const ChunkLayout& layout = model().layout();
  landed_chunks_.assign(static_cast<size_t>(layout.num_chunks()), 0);
  for (int64_t p = 0; p < ledger_.num_params(); ++p) {
    const Slot& slot = layout.slots()[p];
    if (ledger_.landed(p) && slot.numel > 0) landed_chunks_[slot.chunk] = 1;
  }
}

void Engine::tell_round_trips_locked() {
  if (options_.accumulate_grads || ownership_.world() > 1 || !placement_.placed()) return;
  ChunkedModel& m = model();
  if (static_cast<int64_t>(landed_chunks_.size()) != placement_.num_chunks()) return;  // of another layout
  std::vector<char> trips(static_cast<size_t>(m.store().num_chunks()), 0);
  for (int64_t c = 0; c < placement_.num_chunks(); ++c) {
    if (landed_chunks_[c] && !placement_.on_device(c)) trips[m.param_chunk(c)] = 1;
  }
  m.scheduler().set_round_trips(std::move(trips));
}

void Engine::discard_grads_locked() {
  const int64_t n = placement_.num_chunks();
  if (!options_.accumulate_grads) {
    // The slots of landed parameters hold gradients: give them their values (the masters) back.
    ChunkStore& params = model().store();
    for (int64_t c = 0; c < n; ++c) {
      const std::vector<Span> spans = ledger_.spans(model().layout(), c);
      if (spans.empty() || !ownership_.owned(c)) continue;  // sharded: the owners' values come with the next gather
      ChunkUpdates::restore_values(params.payload(model().param_chunk(c)), placement_.payload(kMasterRole, c), spans);
    }
    model().clear_grad_slots();
  } else {
    for (int64_t c = 0; c < n; ++c) {
      at::Tensor acc = placement_.payload(kGradRole, c);
      if (deferred_.has(c)) {
        // Note [Update behind the next forward]: the update still running reads this sum; the zeroing
        // queues behind it on the same worker (where the next accumulation into the chunk queues too).
        deferred_.put_zeroing(cpu_adam_.run_async([acc] { acc.zero_(); }));
      } else {
        acc.zero_();
      }
    }
  }
  ledger_.clear();
}

// ---- backward_step ---------------------------------------------------------------------------------

void Engine::check_backward_step_start_locked() const {
  sync_layout_locked();
  TORCH_CHECK(!ledger_.any(), "ferry: HybridAdam::backward_step: gradients of an earlier backward() wait for "
                              "step(); call step() or zero_grad() first");
}

PipelinedStep::Kind Engine::kind_at_one_rank() const {
  return options_.max_grad_norm == 0 && !scaling_ ? PipelinedStep::Kind::kEager : PipelinedStep::Kind::kTwoPhase;
}

void Engine::start_pipeline_locked(PipelinedStep::Kind kind) {
  // Note [Host updates carried over behind the next forward]: at N = 1 in the default mode (across
  // ranks each group's values are gathered by the step itself).
  pipeline_.start(kind, options_.update_behind_forward && options_.carry_over_host_updates &&
                            !options_.accumulate_grads && kind == PipelinedStep::Kind::kEager);
  if (!pipeline_.eager()) return;
  for (int g = 0; g < num_param_groups(); ++g) cpu_adam_.advance_step(g);  // updates start during backward
}

StepResult Engine::backward_step(const at::Tensor& loss) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  if (sharded_.active()) return backward_step_across_ranks(loss);
  return backward_step_at_one_rank(loss);
}

StepResult Engine::backward_step_at_one_rank(const at::Tensor& loss) {
  settle("backward_step()");
  const bool accumulate = options_.accumulate_grads;
  bool pipelined = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (accumulate) {
      sync_layout_locked();  // the earlier micro-batches' gradients are what this call completes
    } else {
      check_backward_step_start_locked();
    }
    place_locked();
    // Pipelined once an earlier call said how many landings to expect and, in the default mode, placed
    // (the trace and the repack are behind us).
    pipelined = pipeline_.has_history() && (accumulate || placement_.placed());
    pipeline_.arm(pipelined);
    if (pipelined) {
      if (accumulate) {
        updates_.arm_written(placement_.num_chunks());
      } else {
        jobs_.reset(placement_.num_chunks());
      }
      start_pipeline_locked(kind_at_one_rank());
    }
  }
  try {
    model().backward(loss);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    abandon_backward_step_locked(pipelined);
    pipeline_.clear_late();
    finality_.learn_landings(/*complete=*/false);
    pipeline_.stop();
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  pipeline_.stop();
  finality_.learn_landings(/*complete=*/true);
  pipeline_.learned();
  // The first calls: nothing to expect yet. Else what the pipeline did not do during backward runs now
  // (with accumulation the chunks final in backward had their accumulations and norms, eager their host
  // updates too, writing the new values into the slots), as step() runs it.
  StepResult result = pipelined ? finish_pipelined_locked() : step_locked();
  result.host_norm_bytes = updates_.take_host_norm_bytes();
  place_jointly_if_due_locked();
  tell_round_trips_locked();
  return result;
}

void Engine::abandon_backward_step_locked(bool pipelined) {
  // backward_finished() waited for (accumulation: joined) the jobs.
  const int64_t n = placement_.num_chunks();
  const bool eager = pipelined && pipeline_.eager();
  if (options_.accumulate_grads) {
    if (eager) {
      // A launched host chunk with finite gradients was updated.
      std::vector<char> updated(n, 0);
      for (int64_t c = 0; c < n; ++c) {
        updated[c] = pipeline_.launched(c) && !placement_.on_device(c) && pipeline_.has_outcome(c) &&
                     pipeline_.outcome(c).finite;
      }
      // The step count has advanced; a late parameter was not updated.
      ledger_.count_missed_steps(model().layout(), owned_fn(), &updated, nullptr, &pipeline_.late_mask());
      log::error("ferry: backward_step: backward threw; ", pipeline_.num_launched(), " chunk(s) whose update had ",
                 "started are updated, the others are not, and the step count has advanced");
    }
    pipeline_.clear_device_norms();
    updates_.clear_written();  // the launched chunks' jobs wrote their new values into the slots
    return;
  }
  if (!pipelined) return;
  // Eager: the launched chunks hold new values (or restored ones), not gradients; the others keep their
  // gradients for zero_grad().
  int64_t started = 0;
  std::vector<char> updated(n, 0);  // eager: the launched chunks whose update was applied
  for (int64_t c = 0; c < n; ++c) {
    bool failed = false;
    if (std::exception_ptr error = jobs_.take(c)) {
      failed = true;
      log::error("ferry: backward_step: the host update of chunk ", c, " failed too: ", message_of(error));
    }
    if (!pipeline_.launched(c) || !eager || failed) continue;
    if (!placement_.on_device(c)) {
      updated[c] = pipeline_.outcome(c).finite;
    } else if (pipeline_.device_norms(c).defined()) {  // found_inf decided on the device: read it (an error path)
      updated[c] = at::isfinite(pipeline_.device_norms(c)).all().item<bool>();
    }
  }
  // The step count has advanced; a late parameter (Note [A gradient after its chunk's update]) was not
  // updated, and keeps its gradient for zero_grad().
  if (eager) ledger_.count_missed_steps(model().layout(), owned_fn(), &updated, nullptr, &pipeline_.late_mask());
  for (int64_t c = 0; c < n; ++c) {
    if (!pipeline_.launched(c)) continue;
    ++started;
    if (!eager) continue;
    for (int64_t p : model().layout().chunks()[c].tensors) {
      if (!ledger_.landed(p) || pipeline_.late(p)) continue;
      ledger_.forget(p);
      model().clear_grad_slot(p);
    }
  }
  ledger_.recount();
  jobs_.drop();
  if (eager && started > 0) {
    log::error("ferry: backward_step: backward threw; ", started, " chunk(s) whose update had started are updated, ",
               "the others hold their gradients (zero_grad() discards them), and the step count has advanced");
  }
}

// Note [Host updates carried over behind the next forward]
// In the eager step the host updates run during backward, one job per chunk in the order the chunks
// become final: the reverse of forward's. Where the host Adam is slower than backward (12b on one H100:
// 2.0 s of host Adam against 1.1 s of backward), backward ended with the updates of the chunks forward
// uses first still queued, and the step waited for all of them (0.96 s) before the next forward could
// start. Now, with update_behind_forward (the default), backward's end takes back the jobs that have
// not started (HostJobs::cancel_queued: the worker skips them; a started one runs to its end), and the
// step treats those chunks as not launched: their norms are taken after backward as for any chunk not
// final in backward, and their updates queued in layout order, forward's, behind the call, as the
// two-phase step does (Note [Update behind the next forward]): the next forward waits for each chunk's
// own, so it runs beside them instead of after all of them. Exact: the same kernel, spans, grad scale
// (1) and step count (frozen at the step's end; advanced at its start) as the job would have used. Not
// across ranks (each group's values are gathered by the step itself) nor with accumulate_grads.
// Backward's end is the device's: autograd's thread has queued its last kernel well before the device
// has run it (6b on an H200: 0.40 s against 0.51 s). Taking the jobs back when the thread got there (as
// first done) left the worker idle through the device's tail while 9 jobs whose gradients were on the
// host already waited for the step's return, and the next forward waited for them one by one (D88's
// trace: 0.12 s of waits). So where a job could still be taken back, backward_finished first
// waits for the device (Device::synchronize; the step waited for it before returning anyway, for the
// gradients' copies or the norms taken on the device), the worker taking jobs in backward's order
// meanwhile: what the memory plan's timeline assumes (the jobs not started by E, Note [The timeline of
// the host updates], scheduler/memory_plan.cpp). No wait where every job has started by the thread's end.
StepResult Engine::finish_pipelined_locked() {
  trace::Span step_span("adam", "adam.finish_pipelined_step");
  sync_layout_locked();  // the layout cannot change under a pipelined step
  StepResult result;
  result.loss_scale = loss_scale();
  if (std::exception_ptr error = jobs_.join()) std::rethrow_exception(error);
  result.overlapped_chunks = pipeline_.num_launched();
  for (int64_t c = 0; c < placement_.num_chunks(); ++c) {
    (placement_.on_device(c) ? result.device_chunks : result.host_chunks) += 1;
  }
  const bool eager = pipeline_.eager();
  // Chunks that did not become final during backward: staged now, as step() stages them; the norms of
  // all, summed as step() sums them. Not eager (clipping, loss scaling): the launched chunks only had
  // their norms taken and wait for their update, and the eviction policy may have sent a device-bound
  // one to the host since; they are staged too (seen on a GPU: the fused kernel met a host gradient).
  stage_param_chunks_locked(/*skip_launched=*/eager);
  const int64_t t0 = now_ns();
  const ChunkNorms norms = grad_norms_locked(/*pipelined=*/true);
  result.device_syncs = norms.syncs;
  result.norm_ns = now_ns() - t0;
  if (!eager) return apply_locked(norms, result);  // clipping / loss scaling: every update now

  // Eager: the launched chunks are updated (or restored) already; the others now, the same way, and
  // the late parts of launched ones (Note [A gradient after its chunk's update]); whole host-state
  // chunks behind the call (Note [Host updates carried over behind the next forward]).
  std::function<bool(int64_t)> defer;
  const FrozenGroups frozen = options_.accumulate_grads ? nullptr : frozen_groups_locked();
  if (frozen) {
    defer = [&](int64_t c) {
      return ownership_.owned(c) && defer_host_update_locked(c, UpdateOptions{1.0, /*grads_checked=*/true}, frozen);
    };
  }
  pipeline_.update_unlaunched(norms, options_.accumulate_grads, result, defer);
  // A chunk with a non-finite gradient was not updated.
  ledger_.count_missed_steps(model().layout(), owned_fn(), &norms.finite, &norms.late_finite, &pipeline_.late_mask());
  int64_t first = -1;
  result.late_params = pipeline_.take_late(&first);
  if (result.late_params > 0) {
    log::info("ferry: backward_step: ", result.late_params, " parameter(s) (", model().param_name(first),
              " first) got their first gradient after their chunk's update had started, as no earlier backward "
              "had; updated after backward, and expected from now on");
  }
  finish_values_locked(result);
  result.grad_norm = std::sqrt(norms.total_sq);
  result.overflow = !norms.all_finite;
  result.applied = norms.all_finite;
  if (result.overflow) {
    log::warn("ferry: backward_step: non-finite gradients (or a gradient norm that overflows); those chunks were "
              "not updated, the others were");
  }
  // The updates left running write the parameters: ops on this thread that use them wait for them
  // (Note [Ops outside the scopes]).
  if (result.deferred_chunks > 0) watch_outside_uses();
  return result;
}

StepResult Engine::backward_step_across_ranks(const at::Tensor& loss) {
  settle("backward_step()");
  bool pipelined = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (options_.accumulate_grads) {
      sync_layout_locked();  // the earlier micro-batches' gradients are what this call completes
    } else {
      check_backward_step_start_locked();
    }
    // Pipelined once sharded and placed, without clipping, loss scaling or accumulation (eager), when
    // every rank expects the same landings (so groups complete in the same order everywhere).
    pipelined = ownership_.sharded() && placement_.placed() && sharded_.landings_agree() &&
                !options_.accumulate_grads && options_.max_grad_norm == 0 && !scaling_ && pipeline_.has_history();
    pipeline_.arm(pipelined);
    if (pipelined) {
      jobs_.reset(placement_.num_chunks());
      sharded_.start_flights();
      start_pipeline_locked(PipelinedStep::Kind::kAcrossRanks);
    }
    sharded_.set_step_follows_backward(true);
  }
  try {
    model().backward(loss);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    sharded_.set_step_follows_backward(false);
    if (pipelined) {
      if (jobs_.join()) log::error("ferry: backward_step: an owner update failed too");
      sharded_.drop_flights();  // waits for the collectives in flight
      log::error("ferry: backward_step: backward threw on rank ", ownership_.rank(), "; the other ranks will fail at "
                 "their next collective");
    }
    pipeline_.stop();
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  pipeline_.stop();
  sharded_.set_step_follows_backward(false);
  finality_.learn_landings(/*complete=*/true);
  pipeline_.learned();
  StepResult result = pipelined ? sharded_.finish_pipelined(loss_scale()) : step_locked();
  result.host_norm_bytes = updates_.take_host_norm_bytes();
  sharded_.check_landings_agree(finality_);  // for the next call
  return result;
}

}  // namespace ferry::optim
