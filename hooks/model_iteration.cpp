// ChunkedModel: one iteration (see chunked_model.h). forward() and backward() bracket it through the
// phase state machine (transition(): ModelPhase's one table); the interceptor's hooks turn parameter
// uses into the scheduler's pre/post use (or, outside the scopes, into checks); autograd's
// post-accumulate-grad hooks land gradients in the sink (and the parameters' slots); the iteration's
// end settles the chunks and, after the warm-up, repacks them.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/full_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <exception>
#include <string>
#include <vector>

#include "../common/event_trace.h"
#include "../common/logging.h"
#include "chunked_model.h"
#include "param_use_recorder.h"

namespace ferry {
namespace {

bool legal(ModelPhase from, ModelPhase to) {
  using P = ModelPhase;
  switch (from) {
    case P::kIdle: return to == P::kForward;
    case P::kForward: return to == P::kForwardDone || to == P::kIdle;
    case P::kForwardDone: return to == P::kBackward || to == P::kIdle || to == P::kForward;
    case P::kBackward: return to == P::kIdle;
  }
  return false;
}

// How many ChunkedModel::backward() calls are running in this process (Note [A backward not through
// model.backward()]).
std::atomic<int> g_model_backwards{0};

struct CountedModelBackward {
  CountedModelBackward() { g_model_backwards.fetch_add(1); }
  ~CountedModelBackward() { g_model_backwards.fetch_sub(1); }
  CountedModelBackward(const CountedModelBackward&) = delete;
  CountedModelBackward& operator=(const CountedModelBackward&) = delete;
};

// Note [Ops outside the scopes] (interceptor.h): one hazard, counted while `held`; while held, this thread
// (the one that drives the model) watches, also when asked again.
void hold_hazard(bool& held, bool hold) {
  if (hold != held) {
    held = hold;
    if (hold) {
      outside_hazard_begin();
    } else {
      outside_hazard_end();
    }
  }
  if (hold) watch_outside_uses();
}

}  // namespace

const char* to_string(ModelPhase phase) {
  switch (phase) {
    case ModelPhase::kIdle: return "idle";
    case ModelPhase::kForward: return "forward";
    case ModelPhase::kForwardDone: return "forward done";
    case ModelPhase::kBackward: return "backward";
  }
  return "?";
}

void ChunkedModel::transition(ModelPhase to) {
  const ModelPhase from = phase_.load();
  TORCH_CHECK(legal(from, to), "ferry: ChunkedModel cannot go from ", to_string(from), " to ", to_string(to),
              to == ModelPhase::kBackward ? " (call backward() once after each forward())" : "");
  phase_.store(to);
  hold_forward_done_hazard(to == ModelPhase::kForwardDone && training_forward_ && chunks_.bound());
}

// While chunks may be given up (sharded parameters), an op between iterations on the driving thread is
// checked first (before_outside_use), never run on a storage with no memory.
void ChunkedModel::hold_remote_hazard(bool hold) { hold_hazard(remote_hazard_, hold); }

// Note [Between forward and backward] (below).
void ChunkedModel::hold_forward_done_hazard(bool hold) { hold_hazard(forward_done_hazard_, hold); }

// ---------------------------------------------------------------------------------------------------
// forward() and backward()

void ChunkedModel::begin_forward() {
  TORCH_CHECK(chunks_.bound(), "ferry: this ChunkedModel was materialized; wrap the module again");
  // Note [A backward not through model.backward()]: a refused backward ends its iteration, aborted.
  const bool refused = backward_refused_.exchange(false);
  const bool continued = !refused && phase_.load() == ModelPhase::kForwardDone && training_forward_ &&
                         outputs_.graph_awaits_backward(table_.params());
  if (phase_.load() == ModelPhase::kForwardDone && !continued) {
    transition(ModelPhase::kIdle);  // the previous forward had no backward (evaluation)
    finish_iteration(/*aborted=*/refused, /*forward_only=*/!refused);
  }
  check_module_parameters("forward()");  // Note [The module's parameters]
  take_writes("forward()");              // Note [Writes to parameters]
  check_trainable();
  check_activation_plan();
  transition(ModelPhase::kForward);
  if (continued) return;  // Note [Several forwards]: the same iteration, its forward marked from its start
  outputs_.clear();
  scheduler_->begin_iteration();
  activations_.begin_forward();
  in_iteration_ = true;
  training_forward_ = false;
  timer_.forward_begins();
}

void ChunkedModel::end_forward() {
  // Note [Between forward and backward]: only a forward that built a graph waits for a backward; an
  // evaluation forward continuing a training iteration (Note [Several forwards]) leaves it waiting.
  training_forward_ = training_forward_ || c10::GradMode::is_enabled();
  take_writes("the end of forward()");  // a write inside forward (Note [Writes to parameters])
  transition(ModelPhase::kForwardDone);
  timer_.forward_ends();
  // After an evaluation, ops run unseen, as between iterations: every parameter must be readable now,
  // not when end_iteration() or the next forward settles (D35, D59: on CUDA a chunk evicted late in
  // the forward has no memory until its copy is done).
  if (!training_forward_) chunks_.store().settle();
}

void ChunkedModel::backward(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "ferry: backward() needs a defined scalar loss, got ",
              loss.defined() ? loss.sizes().vec() : std::vector<int64_t>{});
  take_writes("backward()");  // a write between forward() and backward() (Note [Writes to parameters])
  transition(ModelPhase::kBackward);
  slots_.set_backward_failed(false);
  backward_refused_ = false;  // this backward is the iteration's own
  scheduler_->begin_backward();
  trace::Span span("model", "backward");
  timer_.backward_begins();
  try {
    InterceptionScope scope;
    CountedModelBackward counted;  // Note [A backward not through model.backward()]
    if (loss_scale_ == 1.0) {
      loss.backward();
    } else {
      loss.backward(at::full_like(loss, loss_scale_));
    }
    // Autograd has queued its last kernel (and synchronised its streams with this one).
    timer_.backward_queued();
  } catch (...) {
    slots_.set_backward_failed(true);
    if (grad_sink_) {
      try {
        grad_sink_->backward_finished(/*aborted=*/true);
      } catch (const std::exception& e) {
        log::error("ferry: after a failed backward, the gradient sink failed too: ", e.what());
      }
    }
    abort_iteration();
    throw;
  }
  if (grad_sink_) {
    try {
      grad_sink_->backward_finished(/*aborted=*/false);
    } catch (...) {
      slots_.set_backward_failed(true);
      abort_iteration();
      throw;
    }
  }
  timer_.backward_ends();
  transition(ModelPhase::kIdle);
  finish_iteration(false);
}

// ---------------------------------------------------------------------------------------------------
// The iteration's end

void ChunkedModel::end_iteration() {
  if (phase_.load() != ModelPhase::kForwardDone) return;
  const bool refused = backward_refused_.exchange(false);  // Note [A backward not through model.backward()]
  transition(ModelPhase::kIdle);
  finish_iteration(/*aborted=*/refused, /*forward_only=*/!refused);
}

void ChunkedModel::abort_iteration() {
  if (phase_.load() != ModelPhase::kIdle) transition(ModelPhase::kIdle);
  finish_iteration(true);
}

void ChunkedModel::finish_iteration(bool aborted, bool forward_only) {
  if (!in_iteration_) return;
  in_iteration_ = false;
  outputs_.clear();
  // Chunks this iteration did not use may still be updated by the optimizer: done before the store
  // settles and the repack reads them. If one of those updates failed, the iteration still ends (as an
  // aborted one: no repack over a half-written chunk), and the error follows unless one already does.
  std::exception_ptr update_error;
  if (grad_sink_) {
    try {
      grad_sink_->await_params();
    } catch (...) {
      update_error = std::current_exception();
    }
  }
  const bool thrown = aborted;
  aborted = aborted || update_error != nullptr;
  scheduler_->end_iteration(aborted, forward_only);
  // An evaluation forward left no gradients in the groups it gathered: every rank gives them up now.
  if (chunks_.remote() && forward_only && !aborted) chunks_.remote()->release_all();
  chunks_.store().settle();  // idle: every parameter readable, its chunk on the device or aliased on the host
  if (remote_hazard_) watch_outside_uses();  // this thread drives the model (Note [Ops outside the scopes])
  if (!aborted && !forward_only && chunks_.any_initial_values()) {
    log::debug("ferry: releasing the parameters' initial values (an optimizer attached from now on starts its "
               "fp32 masters from the ", compute_dtype(), " compute copy)");
    release_initial_values();
  }
  if (!aborted) repack_if_wanted();
  if (!aborted && !forward_only) plan_activations_if_wanted();
  if (update_error && !thrown) std::rethrow_exception(update_error);
}

void ChunkedModel::repack_if_wanted() {
  if (!scheduler_->repack_wanted()) return;
  if (options_.repack_after_warmup && chunks_.repack_waits_for_views()) return;  // Note [A repack waits for held views]
  if (options_.repack_after_warmup) {
    std::vector<int64_t> order = scheduler_->trace()->first_use_order(num_params());
    std::vector<char> used(num_params(), 0);
    for (int64_t p : order) used[p] = 1;
    for (int64_t p = 0; p < num_params(); ++p) {
      if (!used[p]) order.push_back(p);  // never used: at the end
    }
    chunks_.repack(order, scheduler_->device_room_bytes());
    watch_.remember(table_.params());  // Note [Writes to parameters]: bound anew
  }
  scheduler_->relayout(chunks_.store(), chunks_.tensor_of_param(), chunks_.chunk_of_param());
  if (options_.repack_after_warmup && layout_listener_) layout_listener_->layout_changed();
}

// ---------------------------------------------------------------------------------------------------
// The use hooks

// Note [Between forward and backward]
// A loss term computed after forward() (`loss + 1e-4 * w.pow(2).sum()`), a parameter logged between
// forward() and backward(): ops outside ferry's scopes, inside an iteration. They used to run on the
// storage as they found it: on the host alias or, on CUDA, a chunk whose eviction copy was still in
// flight (no memory), and nothing traced them. While the model is between forward() and backward()
// (after a forward under grad mode: one under NoGradGuard, an evaluation, waits for no backward, and
// ops after it are as between iterations, D35 and D57, also where the thread watches for another
// hazard) it holds an outside-use hazard and the thread that ran forward() watches (Note [Ops outside
// the scopes], interceptor.h); an op there that uses a parameter is a use like those inside forward():
// pre_use brings the chunk to the device (at N > 1 gathers it: every rank must run the op, as every
// rank runs forward), the trace records it (the warm-up iteration's trace has it too), inputs are cast
// to the compute dtype, and post_use holds the chunk after forward. The hazard ends when the model
// leaves that phase (backward(), end_iteration(), the next forward()) or is materialized. Cost: while
// it lasts, every op of that thread goes through the fallback (a registry lookup per tensor argument,
// about 0.3 us: D57's measurement). A pre_use that reaches the model between iterations (a key an
// autograd worker inherited from a watching thread) is an op outside the scopes: checked, not used.
ChunkedModel::Outside ChunkedModel::before_outside_use(int64_t param) {
  const ModelPhase phase = phase_.load();
  if (phase == ModelPhase::kForwardDone && forward_done_hazard_) {
    // The user's ops are uses; ferry's own (an optimizer call's copies) run on what the store holds.
    return in_own_ops() ? Outside::kChecked : Outside::kUse;
  }
  // Inside forward() or backward() but outside their scope, the driving thread runs only ferry's own ops
  // (begin_forward before the scope, backward_finished's moves after it): the store's business, where a
  // chunk on its way (no memory yet) is no error.
  if (phase == ModelPhase::kForward || phase == ModelPhase::kBackward) return Outside::kChecked;
  // Between iterations, and after an evaluation forward (no backward comes): as between iterations.
  check_outside_use(param);
  return Outside::kChecked;
}

void ChunkedModel::will_skip(const torch::nn::Module& module) {
  if (phase_.load() != ModelPhase::kForward) return;  // forward()'s Scope is open while fn() runs: kForward
  const std::vector<int64_t> params = params_only_in(*module_, module, table_);
  if (trace::enabled()) {  // shown in the trace: which part was said skipped, and how much of it
    trace::instant("model", "will_skip",
                   "\"params\": " + std::to_string(params.size()) +
                       (params.empty() ? std::string() : ", \"first\": \"" + table_.name(params.front()) + "\""));
  }
  scheduler_->will_not_use(params);
}

void ChunkedModel::check_outside_use(int64_t param) {
  // An op between iterations on a parameter chunk that an update left running may still write.
  if (grad_sink_) grad_sink_->await_param(param);
  // And the update may have sent the chunk back to the device (a round trip, optim/round_trips.h), the
  // copy still on its way: the op must see what it brings (as on CUDA, where it runs on the copy stream).
  chunks_.store().ready_for_caller(chunks_.chunk_of(param));
  // A chunk with no memory here (another rank's, given up between its uses): torch's kernels would read
  // a null pointer.
  if (table_.param(param).storage().data() != nullptr) return;
  TORCH_CHECK(!chunks_.remote_param(param), "ferry: an op between iterations uses parameter ", table_.name(param),
              ", which is in a chunk another rank owns (sharded parameters, world size ", config_.world_size,
              "): between steps only its owner holds it. model.state_dict() gathers every parameter (a collective: "
              "every rank calls it); HybridAdamOptions::shard_params = false keeps every chunk on every rank");
  TORCH_CHECK(false, "ferry: an op between iterations uses parameter ", table_.name(param), ", whose chunk has no "
              "memory here now");
}

void ChunkedModel::pre_use(int64_t param) {
  if (phase_.load() == ModelPhase::kIdle) {  // Note [Between forward and backward]: not inside an iteration
    check_outside_use(param);
    return;
  }
  if (grad_sink_) grad_sink_->await_param(param);  // an update left running behind the step writes its chunk
  if (slots_.holds_grad(param)) refuse_use_of_grad_slot(param);
  ParamUseRecorder::record(table_.param(param));  // Note [Checkpoint parameters as inputs] (hooks/checkpoint.cpp)
  scheduler_->pre_use(param);
}

void ChunkedModel::refuse_use_of_grad_slot(int64_t param) const {
  const std::string head = "ferry: parameter " + table_.name(param) + " is used, but its chunk slot holds its gradient";
  // A use inside backward after the landing: a nested backward (an activation checkpoint of the user's
  // own, reentrant as ferry's used to be) accumulated the gradient, and a later recompute uses the value.
  TORCH_CHECK(phase_.load() != ModelPhase::kBackward, head, ", which landed earlier in this backward (Note "
              "[Gradient in the parameter slot]): a nested backward accumulated it (an activation checkpoint of "
              "one's own that recomputes in backward, or a ferry::checkpoint segment that captures a tensor "
              "requiring grad instead of taking it as an input: it warned), and the parameter is used again after; "
              "with ferry a parameter's gradient must land once per backward, after its last use: use "
              "ferry::checkpoint, passing captured tensors in its inputs (docs/ARCHITECTURE.md D64)");
  TORCH_CHECK(!slots_.backward_failed(), head, " since its backward (Note [Gradient in the parameter slot]), which "
              "failed: the optimizer's zero_grad() discards the gradients that landed before it failed (its step() "
              "would apply them: a partial step)");
  TORCH_CHECK(false, head, " since its backward (Note [Gradient in the parameter slot]): call the optimizer's step() "
              "(or zero_grad()) after backward, before the next forward. For gradient accumulation over micro-batches "
              "construct HybridAdam with accumulate_grads = true");
}

void ChunkedModel::post_use(int64_t param) {
  const ModelPhase phase = phase_.load();
  if (phase == ModelPhase::kIdle) return;  // pre_use checked it only
  const bool backward = phase == ModelPhase::kBackward;
  scheduler_->post_use(param, backward ? TensorState::kHoldAfterBwd : TensorState::kHoldAfterFwd);
  // Note [A chunk final before its last use] (optim/chunk_finality.h).
  if (backward && grad_sink_) grad_sink_->used_in_backward(param);
}

// ---------------------------------------------------------------------------------------------------
// Gradients

// Runs after autograd accumulated a parameter's .grad: hands it to the model's sink.
struct GradLandingHook final : torch::autograd::PostAccumulateGradHook {
  GradLandingHook(ChunkedModel* model, int64_t param) : model(model), param(param) {}
  void operator()(const torch::autograd::Variable& tensor) override { model->land_grad(param, tensor); }
  ChunkedModel* model;
  int64_t param;
};

// On every parameter, whether it requires grad now or not: one unfrozen later (requires_grad set
// after the optimizer attached) lands its gradients too, and detaching takes the hook off one frozen
// since (a hook left behind would call this object after it is gone).
void ChunkedModel::install_grad_hooks(bool on) {
  for (int64_t p = 0; p < num_params(); ++p) {
    std::unique_ptr<torch::autograd::PostAccumulateGradHook> hook;
    if (on) hook = std::make_unique<GradLandingHook>(this, p);
    torch::autograd::impl::set_post_acc_grad_hooks(table_.param(p), std::move(hook));
  }
  slots_.remember_trainable(table_.params());
}

// Note [A backward not through model.backward()]
// `loss.backward()` where the README says `model.backward(loss)` is the natural slip of a LibTorch user.
// It ran: on the CPU, the ops of that backward count as uses between forward and backward (D58), so
// the gradients came out right, but nothing else that model.backward() does happened. The loss was not
// multiplied by the loss scale, so with fp16 every gradient reached the step 65536 times too small
// (seen: the step's grad_norm 8.7e-6 for 0.57) and the step divided it by the scale again; the
// iteration never ended at backward, so the scheduler traced nothing and never repacked, and a loss
// still held at the next forward kept the iteration open for good (Note [Several forwards]). (Its ops
// did reach the chunks: the training thread watches between forward and backward, and autograd's
// threads inherit the key, Note [Ops outside the scopes].) So a gradient that reaches a parameter after a
// training forward while no model's backward() runs in this process is refused, before it lands, naming
// the call to make. Gradients from another model's backward() are not refused: a GAN's generator
// trains through its discriminator (D64's GAN test), whose gradients its zero_grad() discards. Nor are
// those of a backward between iterations or after an evaluation forward (no iteration awaits a
// backward then; the module is an ordinary module, D35). The check is one atomic load per landing. The
// refused iteration ends, as an aborted one, at the next forward() (which does not continue it even
// while its graph is alive) or end_iteration(): its trace is not kept.
//
// Note [A landing is a use]
// Writing a gradient into its slot needs the chunk on the device, so the landing is a use of the chunk,
// and inside this model's backward it goes through the scheduler as the ops' uses do: the trace records
// it, OPT sees it as the chunk's next use, the prefetch brings an evicted chunk in ahead of it. It used
// to reach the store directly. Where a parameter's last use and its landing are adjacent (no
// checkpointing) that cost nothing, but a ferry::checkpoint segment's gradients land together after its
// whole backward (Note [Checkpoint parameters as inputs], hooks/checkpoint.cpp): meanwhile OPT, to
// which the chunks of the segment's last ops were done until the next forward, had given them up for
// the prefetch of the segments below, and each landing brought its chunk back on demand. The small
// preset, 2 MiB chunks in 8 MiB, every block checkpointed, HybridAdam: 25.2 MB of the 71.3 MB moved in
// per step were waited for, 1.89x the trace's Belady bytes; with the landings traced 2.1 and 46.1 MB,
// 1.22x, as without checkpointing (D100). model.backward() without an optimizer never had it (no grad
// sink: the gradients stay in .grad). A landing outside this model's backward (a backward between
// iterations, D35) has no iteration to be traced in and only needs the chunk, as before.
void ChunkedModel::land_grad(int64_t param, const at::Tensor& variable) {
  if (phase_.load() == ModelPhase::kForwardDone && training_forward_ && g_model_backwards.load() == 0) {
    variable.mutable_grad().reset();  // nothing lands, nothing is left for autograd to add to
    backward_refused_ = true;         // the next forward() or end_iteration() ends the iteration, aborted
    TORCH_CHECK(false, "ferry: parameter ", table_.name(param), " got a gradient from a backward that did not go "
                "through model.backward(): call model.backward(loss) (or adam.backward_step(loss)) instead of "
                "loss.backward(); it applies the loss scale (fp16) and ends the iteration (trace, repack). No "
                "gradient of this backward landed; run forward() again");
  }
  if (!grad_sink_) return;
  // Taken out of .grad before anything can fail: a gradient left there after a refusal (a sparse one,
  // a failed fetch) would be summed into the next backward's by autograd, a failed step's gradient
  // leaking into the next one (seen with a sparse embedding made dense again).
  const at::Tensor grad = variable.grad();
  if (!grad.defined()) return;
  variable.mutable_grad().reset();
  if (!grad_sink_->grads_into_param_slots()) {
    grad_sink_->land_grad(param, grad);
    return;
  }
  // Note [Gradient in the parameter slot]: the gradient is written into the slot on the device, with
  // the chunk held in COMPUTE. The chunk is usually there (the trace has the landing: Note [A landing is
  // a use]); an evicted one is brought back (one chunk transfer, no host stall) rather than given this
  // one gradient by a device->host copy, which would stall the host once per parameter.
  TORCH_CHECK(grad.layout() == at::kStrided, "ferry: gradients must be dense; parameter ", table_.name(param),
              " got a ", grad.layout(), " one (an nn::Embedding built with sparse(true)? Adam, torch's too, takes "
              "dense gradients: build it with sparse(false))");
  grad_sink_->before_landing(param);
  // ferry's own ops here (the copy into the slot, moves the access makes) must not be intercepted.
  c10::impl::ExcludeDispatchKeyGuard no_intercept(kInterceptKey);
  at::NoGradGuard no_grad;
  const TensorId t = chunks_.tensor_of(param);
  ChunkStore& store = chunks_.store();
  // Note [A landing is a use].
  const bool traced = phase_.load() == ModelPhase::kBackward;
  at::Tensor slot;
  if (traced) {
    scheduler_->pre_use(param);  // a remote group is fetched there
    slot = store.view(t);
  } else {
    // A sharded group given up after forward and not used in backward since: fetched for its gradients.
    if (chunks_.remote_param(param)) chunks_.remote()->fetch(chunks_.chunk_of(param));
    slot = store.access(t);
  }
  auto release = [&] {
    if (traced) {
      scheduler_->post_use(param, TensorState::kHoldAfterBwd);
    } else {
      store.release(t, TensorState::kHoldAfterBwd);
    }
  };
  try {
    if (slots_.holds_grad(param)) {
      slot.add_(grad);  // a second accumulation in this backward (the graph reached the parameter twice)
    } else {
      slot.copy_(grad);
      slots_.mark(param);
    }
    grad_sink_->land_grad(param, slot);
  } catch (...) {
    release();
    throw;
  }
  release();
  grad_sink_->after_landing(param);
}

}  // namespace ferry
