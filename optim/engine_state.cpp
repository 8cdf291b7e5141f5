// HybridAdam's engine: the state between iterations — zero_grad(), the views, the weights, the
// checkpoints (engine.h).
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <string>
#include <unordered_map>

#include "../common/logging.h"
#include "../hooks/interceptor.h"
#include "checkpoint_files.h"
#include "engine.h"
#include "state_values.h"

namespace ferry::optim {

void Engine::zero_grad() {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  check_idle("zero_grad()");
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  const bool had = ledger_.any();
  // Note [Update behind the next forward]: updates may still run. With accumulate_grads the zeroing
  // queues behind them (discard_grads_locked), so step(); zero_grad(); keeps the overlap. Default mode:
  // after a step the slots hold values (nothing to restore); gradients of a backward since then are in
  // chunks the forward before it waited for.
  if (!options_.accumulate_grads && had) deferred_.settle();
  discard_grads_locked();
  if (options_.accumulate_grads) return;
  if (sharded_.param_shards()) {
    // The other ranks' chunks (some holding gradients) are given up; the next use fetches the owners' values.
    sharded_.param_shards()->release_all();
  } else if (ownership_.sharded()) {
    // Slots of non-owned chunks that held gradients get their values from the owners: needed if any rank
    // had gradients (a collective decides, so every rank calls zero_grad() and gathers alike).
    if (sharded_.sum_over_ranks({had ? 1.0 : 0.0})[0] != 0.0) sharded_.gather_params();
  }
}

at::Tensor Engine::state_view(int role, int64_t param) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  TORCH_CHECK(param >= 0 && param < model().num_params(), "ferry: parameter index ", param, " out of range [0, ",
              model().num_params(), ")");
  settle("state view");
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  // The compact format's roles decoded to fp32 (on the CPU); fp32 state as it is, where it is.
  if (placement_.compact() && role <= kExpAvgSqRole) return StateValues(placement_.state()).read(role, param);
  return placement_.view(role, param).clone();
}

at::Tensor Engine::grad(int64_t param) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  if (options_.accumulate_grads) return state_view(kGradRole, param);
  TORCH_CHECK(param >= 0 && param < model().num_params(), "ferry: parameter index ", param, " out of range [0, ",
              model().num_params(), ")");
  settle("grad()");
  std::lock_guard<std::mutex> lock(mutex_);
  if (!model().grad_in_slot(param)) return at::zeros(model().param_shapes()[param], at::kFloat);
  return model().param_values(param).to(at::kCPU, at::kFloat, false, /*copy=*/true);
}

NamedTensors Engine::state_dict() {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  NamedTensors out = model().state_dict();  // checks the model is idle
  if (ownership_.sharded()) {  // the masters from their owners (a collective: every rank calls state_dict())
    std::lock_guard<std::mutex> lock(mutex_);
    sharded_.gather_groups(
        placement_.state().spec(kMasterRole).dtype, [&](int64_t c) { return placement_.payload(kMasterRole, c); },
        [&](int64_t c, const at::Tensor& values) {
          for (int64_t p : model().layout().chunks()[c].tensors) {
            const Slot& slot = model().layout().slots()[p];
            out[p].second = values.slice(0, slot.offset, slot.offset + slot.numel)
                                .view(model().param_shapes()[p])
                                .to(at::kFloat, false, /*copy=*/true);
          }
        });
    return out;
  }
  for (int64_t p = 0; p < model().num_params(); ++p) {
    TORCH_INTERNAL_ASSERT(out[p].first == model().param_name(p));
    out[p].second = state_view(kMasterRole, p).to(at::kCPU);
  }
  return out;
}

void Engine::load_state_dict(const NamedTensors& values, const ValueLoaded& loaded) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  settle("load_state_dict()");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    sync_layout_locked();
  }
  // The model checks every name and shape before it writes anything; each master follows its parameter
  // (before `loaded` lets the value go: a load from a mapping reads each tensor's pages once).
  model().load_state_dict(values, loaded, [&](int64_t p, const at::Tensor& value) {
    if (!ownership_.owned(model().layout().slots()[p].chunk)) return;  // sharded: every rank loads the same values
    std::lock_guard<std::mutex> lock(mutex_);
    placement_.view(kMasterRole, p).copy_(value);
  });
  std::lock_guard<std::mutex> lock(mutex_);
  ledger_.clear();  // the model's slots hold values again (it cleared them)
  updates_.write_back();
  if (sharded_.param_shards()) sharded_.param_shards()->release_all();  // the model fetched every chunk to load it
}

void Engine::save(const std::string& dir) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  settle("save()");
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  TORCH_CHECK(!dir.empty(), "ferry: save() needs a directory");
  if (ledger_.any()) {
    log::warn("ferry: save(\"", dir, "\") with gradients that no step() has applied yet: the checkpoint holds the "
              "state before them, and a run resumed from it starts without them (save after step() or "
              "zero_grad() to checkpoint a step boundary)");
  }
  CheckpointCounters counters;
  for (int g = 0; g < num_param_groups(); ++g) {
    counters.options.push_back(cpu_adam_.options(g));
    counters.steps.push_back(cpu_adam_.step_count(g));
  }
  counters.lags = ledger_.lags();
  counters.scaler = scaler_.state();
  StateValues values(placement_.state());
  if (sharded_.active()) {
    save_checkpoint_across_ranks(dir, model(), values, ledger_.groups(), counters, ownership_, sharded_.comm());
  } else {
    save_checkpoint(dir, model(), values, ledger_.groups(), counters);
  }
}

void Engine::load(const std::string& dir) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  settle("load()");
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  StateValues values(placement_.state());
  const CheckpointCounters counters =
      load_checkpoint(dir, model(), values, ledger_.groups(), num_param_groups(),
                      scaling_ ? &scaler_ : nullptr, ownership_, sharded_.active() ? &sharded_.comm() : nullptr);
  for (int g = 0; g < num_param_groups(); ++g) {
    cpu_adam_.set_options(g, counters.options[g]);
    cpu_adam_.set_step_count(g, counters.steps[g]);
  }
  ledger_.set_lags(counters.lags);
  if (scaling_) {
    scaler_.set_state(counters.scaler);
    model().set_loss_scale(scaler_.scale());
  }
  ledger_.clear();  // the write-back below gives every slot its value
  if (options_.accumulate_grads) {
    for (int64_t c = 0; c < placement_.num_chunks(); ++c) placement_.payload(kGradRole, c).zero_();
  }
  model().clear_grad_slots();
  updates_.write_back();
  if (sharded_.param_shards()) {
    sharded_.param_shards()->release_all();  // the other chunks: fetched from their owners at their next use
  } else if (ownership_.sharded()) {
    sharded_.gather_params();  // the other chunks' values from their owners
  }
  log::info("ferry: resumed training state from ", dir, " at step ", cpu_adam_.step_count(0));
}

}  // namespace ferry::optim
