#pragma once
// ChunkedModel: runs an existing, unmodified torch::nn::Module on chunks.
//
//   auto net = std::make_shared<MyNet>(...);                 // any module, unchanged
//   ferry::ChunkedModel model(net, config);                  // parameters move into chunks
//   auto loss = model.forward([&] { return criterion(net->forward(x), y); });
//   model.backward(loss);
//
// On construction every parameter (tied ones once) is packed into parameter chunks in registration
// order and bound to its slot (same TensorImpl for life, dtype = config.precision, on the device:
// CUDA or the simulated device); buffers are moved to the device as plain tensors. Inside forward()
// and backward() every op that touches a parameter goes through the scheduler's pre/post-use hooks
// (hooks/interceptor.h). After the warm-up iteration the parameters are repacked in the order of
// first use, and the scheduler follows the trace (OPT eviction, prefetch).
//
// Contract
//  - Between iterations the module is an ordinary module: any op may read or write its parameters
//    (off the device their storage aliases the host payload, chunk/chunk.h); a write, in place or by
//    new storage (torch::load), is taken in before the next use, into the optimizer's masters too
//    (Note [Writes to parameters]). An update the optimizer
//    left running behind its step (Note [Update behind the next forward], optim/hybrid_adam.h) may
//    still write a chunk then: ops on the thread that ran the step wait for it (Note [Ops outside the
//    scopes], hooks/interceptor.h); other threads, and reads that are no op (data_ptr()), call the
//    optimizer's synchronize() first. With sharded parameters (N > 1) a chunk another rank owns has no
//    memory here between its uses: an op on the driving thread fails naming state_dict() (never a
//    crash); other threads must not touch it. param_values() and state_dict() always wait.
//  - Between forward() (under grad mode) and backward() an op on the thread that ran forward() and uses
//    a parameter is a use as inside forward(): traced, its chunk brought to the device (at N > 1
//    gathered: every rank runs it, as it runs forward), inputs cast to the compute dtype (Note [Between
//    forward and backward]): a loss term such as `loss + 1e-4 * net->fc->weight.pow(2).sum()` after
//    forward() trains as in the unwrapped model. After a forward under NoGradGuard (an evaluation) ops
//    are as between iterations. Other threads must not touch parameters inside an iteration.
//  - Gradients: without a GradSink, .grad tensors are made by autograd as usual (device tensors, not
//    chunked). With one (HybridAdam installs itself), each parameter's gradient is taken as soon as
//    autograd has accumulated it (a post-accumulate-grad hook) and .grad is reset, so no device
//    gradient outlives its parameter's last use in backward. Where it goes is the sink's choice
//    (GradSink::grads_into_param_slots): handed to the sink, or written into the parameter's own slot
//    of its parameter chunk (Note [Gradient in the parameter slot]). With a sink, a backward of this
//    iteration's graph must be backward()'s: a bare `loss.backward()` after a training forward is
//    refused at its first gradient, before anything lands (Note [A backward not through
//    model.backward()]); another model's backward() reaching this one's parameters is not.
//  - An exception thrown inside forward()/backward() propagates; every parameter use it interrupted is
//    released, the iteration is dropped from tracing, and the model stays usable.
//  - Several forward() calls may come before one backward() (two views of a batch, a loss over two
//    passes): while a graph of this iteration's forwards still reaches a parameter (its gradient
//    accumulator), or the node of a tensor forward() returned is alive and not yet backwarded (a frozen
//    model's graph), the next forward() continues the iteration (Note [Several forwards]); otherwise it
//    ends the last one as an evaluation.
//  - A parameter is in one ChunkedModel at a time: wrapping a module twice, or a submodule and its
//    parent, is refused at construction, naming the parameter.
//  - Not for concurrent forward() calls on one ChunkedModel.
#include <torch/nn/module.h>

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../chunk/chunk_store.h"
#include "../chunk/layout.h"
#include "../chunk/state_chunks.h"
#include "../common/config.h"
#include "../common/event_trace.h"
#include "../common/safetensors.h"
#include "../scheduler/scheduler.h"
#include "interceptor.h"

namespace ferry {

struct ChunkedModelOptions {
  SchedulerOptions scheduler;           // device_budget_bytes is taken from the Config
  bool repack_after_warmup = true;      // repack parameters in first-use order after warm-up
  std::unique_ptr<MemoryProbe> probe;   // null: the device's own probe
  // Simulated device only: count the host memory forward/backward allocate beside the chunks
  // (activations) as non-model device memory, as the CUDA allocator's stats do on a GPU
  // (make_heap_probe). Off by default: the simulated device's budget then covers chunks only.
  bool measure_host_non_model = false;
  int64_t host_cache_bytes = int64_t{256} << 20;
  // Makes the copy engine of each parameter store (null: make_copy_engine(config.device)). Tests pass
  // an engine whose copies stay pending, as CUDA's do.
  std::function<std::unique_ptr<CopyEngine>()> copy_engine;
};

// Note [Gradient in the parameter slot]
// Once autograd has accumulated a parameter's gradient, backward does not read that parameter again
// (every op that uses it and needs its gradient has run), and its value is not needed until the
// optimizer writes the updated one. So the gradient (same dtype, same size) can take the value's
// place in the parameter chunk: no gradient memory at all beside the parameters and the optimizer
// state, and the gradient travels with its chunk (an evicted chunk carries its gradients to the host,
// where the host Adam reads them). PatrickStar and Gemini do the same. The model then marks the
// parameter: a use of it (a forward before the optimizer step) fails with a clear error instead of
// computing with a gradient, and state_dict() refuses. The optimizer writes the values back and calls
// clear_grad_slots(). Gradient accumulation over micro-batches needs the values between backward
// passes, so it keeps separate fp32 gradient memory (HybridAdamOptions::accumulate_grads), into which
// the optimizer empties the slots chunk by chunk during backward and gives the values back
// (Note [Accumulation per chunk], optim/hybrid_adam.h).

// Note [Writes to parameters]
// Users write parameters: pretrained weights loaded after the optimizer was built (a copy_, or
// torch::load, which gives each parameter the loaded tensor's storage with set_()), a clamp after each
// step (a WGAN critic), a clamp or renormalisation inside forward, an EMA swap. The optimizer keeps
// its own fp32 copy (HybridAdam's masters) and wrote it back at every step, so every such write was
// lost at the next step, silently; torch::load also left the parameter outside its chunk for good.
// ChunkedModel remembers each parameter's storage, offset and version counter (every in-place op on
// the tensor or on a view of it bumps that counter; ferry's own writes go through other tensors of the
// chunk and do not) and looks again where a write can first matter: before forward(), at the end of
// forward() (a write inside it), before backward() (a write between them), when an optimizer
// attaches its state (a write before it was built) and before anything reads the values or the
// optimizer's state (take_writes). A parameter with other storage, offset, dtype or device was
// replaced: its values (converted to the compute dtype) go into its slot and the tensor views its slot
// again (same TensorImpl); a shape that differs is refused. Each
// write is then told to the GradSink (values_written) while every slot holds its value: HybridAdam
// takes a replacement's values whole (full precision: an fp32 checkpoint loaded into a bf16 model
// gives exact masters) and an in-place write element by element, where the slot no longer equals the
// master rounded to the compute dtype (a bf16 element the write left alone keeps its master's low
// bits; a written one gets the written value). Cost when nothing was written: three numbers compared
// per parameter tensor (19 ns each on the 2-core CPU, D60), about four looks per step. Not seen:
// writes that bump no counter (through `.data()` or a raw pointer), on any thread.
// A write after backward() and before the optimizer's step lands in the gradient the slot holds then
// (Note [Gradient in the parameter slot]): the step refuses it, naming the parameter. The model's and
// the optimizer's reads (state_dict(), save(), the masters) take writes in first, so a checkpoint
// written right after a write holds it.

// Note [The module's parameters]
// ChunkedModel takes the module's parameters when it wraps it. A submodule or parameter registered
// afterwards (an adapter, a new head, replace_module) was not in any chunk: on the simulated device it
// ran, got its .grad from autograd every step and was never updated, silently (on CUDA it would have
// stayed in host memory). So before each forward the model walks the module's parameters and compares
// them, by tensor identity, with those it wrapped (check_module_parameters): one it does not hold, or
// one it holds that the module no longer has, is refused, naming it. Cost: the module's parameters()
// and a binary search per parameter tensor, before each forward (370 ns per tensor on the 2-core
// CPU, bench_gpt's "check_parameters_us", D63). A parameter given another dtype (module.to(dtype), or torch::load of
// another precision) is taken in at the compute dtype (Note [Writes to parameters]), with a warning
// that says so: the compute dtype is Config::precision's.

// A parameter the user wrote since the model last looked (Note [Writes to parameters]): in place, its
// slot now holding what was written (`replacement` undefined); or by giving the tensor other storage
// (`set_()`, `set_data()`, torch::load), `replacement` then being that tensor, as given (any floating
// dtype, its full precision), the slot holding it in the compute dtype.
struct WrittenParam {
  int64_t param = -1;
  at::Tensor replacement;
};

// Receives each parameter's gradient during backward (on autograd's thread), already multiplied by the
// loss scale. The tensor is only valid during the call. For one landing the calls come in this order:
// before_landing, (the model writes the slot), land_grad, (the model releases the slot), after_landing.
class GradSink {
 public:
  virtual ~GradSink() = default;
  // false: land_grad gets autograd's gradient (compute dtype, on the device). true: the model first
  // writes it into the parameter's slot (Note [Gradient in the parameter slot]; a second gradient of
  // the same parameter in one backward is added there) and land_grad gets the slot.
  virtual bool grads_into_param_slots() const { return false; }
  // Before anything is written: may refuse the gradient by throwing (backward then fails).
  virtual void before_landing(int64_t /*param*/) {}
  virtual void land_grad(int64_t param, const at::Tensor& grad) = 0;
  // After the landing, with the parameter's chunk no longer held: the sink may move it.
  virtual void after_landing(int64_t /*param*/) {}
  // After an op inside this model's backward used the parameter (its chunk no longer held). A chunk may
  // still be used after all its gradients landed (a frozen layer the gradient flows through to
  // trainable ones below it): a sink that moves or locks a chunk once its gradients are final must wait
  // for its last use too.
  virtual void used_in_backward(int64_t /*param*/) {}
  // backward() has run to its end (`aborted`: it threw), before the model ends the iteration (which
  // may repack the chunks): work the sink started on the chunks during backward must be done on return.
  virtual void backward_finished(bool /*aborted*/) {}
  // Updates the sink left running on parameter chunks when its step returned (Note [Update behind the
  // next forward], optim/hybrid_adam.h). await_param(p) returns once p's chunk holds its new values,
  // await_params() once every chunk does; either rethrows an error such an update threw. The model
  // calls await_param before every use of a parameter, and await_params before anything else reads,
  // writes or moves the parameters (param_values, state_dict, load_state_dict, materialize, the end of
  // an iteration, where the warm-up repack runs). Both must be cheap when nothing is running.
  virtual void await_param(int64_t /*param*/) {}
  virtual void await_params() {}
  // Parameters the user wrote (Note [Writes to parameters]), told before the model uses them again and
  // while every slot holds its value: an optimizer whose own copy of the values is the truth (fp32
  // masters) takes the writes into it, so that its next update starts from what was written.
  virtual void values_written(const std::vector<WrittenParam>& /*written*/) {}
  // Some parameter's requires_grad changed since the last forward (a layer frozen or unfrozen during
  // fine-tuning), told before the next one: gradients land from every parameter that requires grad
  // when its backward runs, so what a step receives changes.
  virtual void trainable_changed() {}
  // The model is being destroyed with this sink still attached (an optimizer declared before its model
  // outlives it), after await_params(): the sink must never call the model again.
  virtual void model_gone() {}
};

// Told when the parameters have been repacked into a new layout: between iterations, at the end of
// the iteration that finished the warm-up, before the model is used again. Whoever mirrors the layout
// (HybridAdam's optimizer state) migrates to it there, with fill_layout (chunk/repack.h).
class LayoutListener {
 public:
  virtual ~LayoutListener() = default;
  virtual void layout_changed() = 0;
};

// The last iteration's phases on the device's own clock (ChunkedModel::last_phase_seconds); -1: the
// phase did not run to its end.
struct PhaseSeconds {
  double forward = -1;
  double backward = -1;
};

// Where a ChunkedModel is in its iteration; changed only by ChunkedModel::transition().
enum class ModelPhase { kIdle, kForward, kForwardDone, kBackward };
const char* to_string(ModelPhase phase);

class ChunkedModel final : private UseListener {
 public:
  ChunkedModel(std::shared_ptr<torch::nn::Module> module, const Config& config, ChunkedModelOptions options = {});
  // Materializes the parameters as plain device tensors (so the module stays usable) and unregisters.
  ~ChunkedModel() override;
  ChunkedModel(const ChunkedModel&) = delete;
  ChunkedModel& operator=(const ChunkedModel&) = delete;

  // Runs fn() with parameter interception on; returns what it returns.
  template <class F>
  auto forward(F&& fn) -> decltype(fn()) {
    trace::Span span("model", "forward");  // spans the device marks begin_forward/end_forward record
    begin_forward();
    try {
      InterceptionScope scope;
      auto out = fn();
      note_outputs(out);  // Note [Several forwards]
      end_forward();
      return out;
    } catch (...) {
      abort_iteration();
      throw;
    }
  }
  // (loss * loss_scale()).backward() with interception on, then ends the iteration. `loss` must be
  // a scalar.
  void backward(const at::Tensor& loss);
  // The factor backward() multiplies the loss by (fp16 loss scaling; HybridAdam sets it). > 0.
  void set_loss_scale(double scale);
  double loss_scale() const { return loss_scale_; }
  // Routes gradients to `sink` (null: back to autograd's .grad). Not inside an iteration (null also
  // between forward() and backward(): an optimizer destroyed there detaches). One sink at a time: a
  // second while one is set is refused (its gradients would never reach the first).
  void set_grad_sink(GradSink* sink);
  GradSink* grad_sink() const { return grad_sink_; }
  // Sharded parameters (dist/param_shards.h; HybridAdam installs them at world size > 1; null: none).
  // Once the layout is final (layout_final()); between iterations. While any chunk is remote,
  // state_dict(), load_state_dict() and materialize() fetch every chunk first: collectives then, called
  // by every rank; the destructor does not (the other ranks may be gone): parameters of chunks that are
  // remote then are left empty (0 elements; any use fails), said in the log.
  void set_remote_chunks(std::shared_ptr<RemoteChunks> remote);
  const std::shared_ptr<RemoteChunks>& remote_chunks() const { return remote_; }
  // No repack is to come: the warm-up ended and its repack ran (or repacking is off). A repack waits
  // while views of parameter chunk memory are held outside ferry (Note [A repack waits for held views]).
  bool layout_final() const {
    return !options_.repack_after_warmup || (scheduler_->trace() != nullptr && !scheduler_->repack_wanted());
  }
  // The one listener told of repacks (null: none). Not inside an iteration.
  void set_layout_listener(LayoutListener* listener);
  LayoutListener* layout_listener() const { return layout_listener_; }
  // Ends an iteration that had no backward (evaluation); forward() also does it implicitly when no graph
  // of that iteration's forwards is left (Note [Several forwards]). A forward
  // under NoGradGuard already settled the chunks (every parameter readable, D59); this ends its
  // iteration (the scheduler's, and at N > 1 gives up the groups it gathered).
  void end_iteration();
  // Gives every parameter plain device memory again and detaches it from ferry (the destructor).
  // Refused while a gradient sink (an optimizer) is attached: destroy it first.
  void materialize();

  // The module's parameters (tied ones once, in the compute dtype, as the chunks hold them) and
  // floating/integer buffers by name, as CPU copies, in named_parameters() then named_buffers() order.
  // Between iterations. With a HybridAdam attached, HybridAdam::state_dict() gives the fp32 masters.
  NamedTensors state_dict();
  // Writes `values` into the parameters' chunks and the buffers (any dtype/device; cast). Every name
  // must be present with its shape, and no other: all is checked before anything is written. Between
  // iterations. With a HybridAdam attached use HybridAdam::load_state_dict, or its masters would
  // overwrite the parameters at the next step.
  void load_state_dict(const NamedTensors& values);
  // state_dict() as a safetensors file a Python user loads with safetensors.torch.load_file.
  void export_safetensors(const std::string& path) { write_safetensors(path, state_dict(), {{"format", "pt"}}); }

  torch::nn::Module& module() { return *module_; }
  ChunkStore& store() { return *store_; }
  // The optimizer state that mirrors the parameter chunks, group by group (chunk/state_chunks.h): made
  // here, so that it shares the device accountant and is migrated by the same repack as the parameters
  // (before the LayoutListener hears of it) for as long as the caller holds it. Its store never pins host
  // memory and has no budget of its own (the optimizer places groups; Scheduler::admit_device_bytes
  // makes room). Between iterations. init: as StateChunks::build's.
  // zero_roles: as StateChunks' (roles that start at zero, allocated when first touched).
  std::shared_ptr<StateChunks> attach_state(std::vector<ChunkRole> roles, const StateChunks::Init& init,
                                            std::vector<int> zero_roles = {});
  // The device accountant of the parameter chunks, for every store that shares the device budget with
  // them (HybridAdam's optimizer state charges it too): total and by role.
  const std::shared_ptr<DeviceAccountant>& device_accountant() const { return accountant_; }
  Scheduler& scheduler() { return *scheduler_; }
  const ChunkLayout& layout() const { return layout_; }
  // Bytes of a regular parameter chunk (the configured size, or the auto choice).
  int64_t chunk_size_bytes() const {
    return layout_.options().chunk_numel * static_cast<int64_t>(c10::elementSize(dtype_));
  }
  int64_t num_params() const { return static_cast<int64_t>(params_.size()); }
  // Parameter index -> the tensor (as registered in the module; tied parameters once).
  const at::Tensor& param(int64_t index) const { return params_[index]; }
  const std::string& param_name(int64_t index) const { return names_[index]; }
  const std::vector<std::vector<int64_t>>& param_shapes() const { return shapes_; }
  at::ScalarType compute_dtype() const { return dtype_; }
  const Config& config() const { return config_; }
  // The parameter's slot in its chunk, wherever that is now (device or host); between iterations. It
  // holds the parameter's gradient instead while grad_in_slot(index). Fails for a parameter whose chunk
  // is remote (another rank's, not fetched now).
  at::Tensor param_values(int64_t index);
  // Whether the parameter's slot holds its gradient (Note [Gradient in the parameter slot]).
  bool grad_in_slot(int64_t index) const { return grad_in_slot_[index] != 0; }
  bool any_grad_in_slot() const { return grads_in_slots_ > 0; }
  // The optimizer has written every parameter's value back into its slot; between iterations.
  void clear_grad_slots();
  // The same for one parameter; also during backward, by a gradient sink that gave the slot its value
  // back (on autograd's thread, or in backward_finished). Not during a forward.
  void clear_grad_slot(int64_t index);
  // layout().chunks()[i] -> the ChunkId in store().
  ChunkId param_chunk(int64_t layout_chunk) const { return param_chunks_[layout_chunk]; }
  // Incremented by every (re)pack; who mirrors the layout compares it.
  int64_t layout_version() const { return layout_version_; }
  // The parameter's value before it was cast into the compute dtype (fp32, as the module built it), or
  // an undefined tensor when the compute copy holds it exactly (fp32) or it was released. Kept until
  // release_initial_values() or the end of the first training iteration, so that an optimizer
  // attached before training starts its fp32 masters from the unrounded values.
  // Undefined also once the parameter was written (Note [Writes to parameters]): the write is its value.
  at::Tensor initial_value(int64_t index) const {
    return index < static_cast<int64_t>(initial_values_.size()) ? initial_values_[index] : at::Tensor();
  }
  void release_initial_values() { initial_values_.clear(); initial_values_.shrink_to_fit(); }
  void release_initial_value(int64_t index) {
    if (index < static_cast<int64_t>(initial_values_.size())) initial_values_[index] = at::Tensor();
  }
  // Peak payload bytes of the old and new stores together during the last repack (tests, reports).
  int64_t last_repack_peak_bytes() const { return repack_peak_bytes_; }
  // Iteration ends at which the wanted warm-up repack waited for views of parameter chunk memory held
  // outside ferry (Note [A repack waits for held views]; reports, tests).
  int64_t repack_waits() const { return repack_waits_; }
  // Wall time of the last repack: the parameter chunks and every attached state store's migration
  // (reports; 0 before the first).
  double last_repack_seconds() const { return repack_seconds_; }
  IterationStats last_iteration() const { return scheduler_->last_iteration(); }
  // The last finished iteration's forward() and backward() as the device ran them (CopyEngine's
  // StreamMark): each from when the device reached the phase's first work to when it finished the
  // last work the phase queued on the caller's stream; backward's includes what the gradient sink
  // queued there during it (HybridAdam's per-chunk device updates), not its host work after it. On a
  // GPU the host's clock cannot split a step this way: backward() returns while its kernels still run.
  // Between iterations; blocks until that work has run (cheap after a synchronisation).
  PhaseSeconds last_phase_seconds() const;
  // While the event trace records: adds those phases to it, as the device ran them, on a track of their
  // own ("device") beside the host's "model" spans, placed on the host's clock through a mark recorded
  // now and waited for (ClockAnchor); and the recording's chunk copies, of the parameters' store and
  // of every attached state's, as the copy stream ran them (ChunkStore::trace_copies, track "copy
  // stream"). Between iterations; blocks until the work has run. A no-op when not recording.
  void trace_last_phases() const;
  ModelPhase phase() const { return phase_.load(); }
  // Note [Writes to parameters]: takes in what was written into the parameters since ferry last looked
  // (`where` names the caller in messages). ChunkedModel calls it before forward(), at its end, before
  // backward(), state_dict(), load_state_dict(), materialize() and attach_state(); HybridAdam before
  // its steps and its reads of the state. Not inside forward() or backward(). Fails, naming the
  // parameter, for a write into a slot that holds a gradient (after backward(), before the step) or a
  // replacement of another shape.
  void take_writes(const char* where);
  // Note [The module's parameters]: fails, naming them, if the module has a parameter this model does
  // not hold or lacks one it holds. ChunkedModel calls it before each forward().
  void check_module_parameters(const char* where) const;

 private:
  void pre_use(int64_t param) override;
  void post_use(int64_t param) override;
  Outside before_outside_use(int64_t param) override;  // Note [Ops outside the scopes] (interceptor.h)
  // Between iterations: waits for `param`'s chunk's update; fails if its storage has no memory here.
  void check_outside_use(int64_t param);
  // Holds one outside-use hazard while chunks may be given up (remote chunks), and makes this thread
  // watch; `hold` again: watch again (the thread that ends iterations drives the model).
  void hold_remote_hazard(bool hold);
  // Holds one outside-use hazard while the model is between forward() and backward(), and makes this
  // thread watch: its ops on parameters then are uses (Note [Between forward and backward]).
  void hold_forward_done_hazard(bool hold);
  void transition(ModelPhase to);
  void begin_forward();
  void end_forward();
  // Some graph built by this iteration's forwards can still reach a parameter (its gradient
  // accumulator, which only graphs hold, is alive) or a saved view of one (the node of a forward's
  // output is alive and no backward ran through it): a backward may follow (Note [Several forwards]).
  bool graph_awaits_backward() const;
  // The autograd nodes of what forward() returned (tensors, alone or in a vector, pair or tuple),
  // watched by graph_awaits_backward(); anything else returned is not looked into.
  void note_output(const at::Tensor& out);
  void note_outputs(const at::Tensor& out) { note_output(out); }
  void note_outputs(const std::vector<at::Tensor>& out) {
    for (const at::Tensor& t : out) note_output(t);
  }
  template <class A, class B>
  void note_outputs(const std::pair<A, B>& out) {
    note_outputs(out.first);
    note_outputs(out.second);
  }
  template <class... T>
  void note_outputs(const std::tuple<T...>& out) {
    std::apply([this](const auto&... t) { (note_outputs(t), ...); }, out);
  }
  template <class T>
  void note_outputs(const T&) {}
  void abort_iteration();
  void finish_iteration(bool aborted, bool forward_only = false);
  // Packs params in `order` into a fresh store and binds them (values from the old store if any).
  void build(const std::vector<int64_t>& order);
  // References to parameter and state chunk memory held outside ferry (beyond the parameters
  // themselves), over every chunk (ChunkStore::storage_holders); `example` gets a parameter of a
  // parameter chunk that has some.
  int64_t views_held_outside(int64_t* example);
  void register_storages();
  void unregister_storages();
  // Note [Writes to parameters]: what each parameter's tensor looks like now that ferry has bound or
  // checked it (storage, offset, version counter).
  void remember_bindings();
  void install_grad_hooks(bool on);
  // Tells the gradient sink when a parameter's requires_grad changed since the last look.
  void check_trainable();
  friend struct GradLandingHook;
  void land_grad(int64_t param, const at::Tensor& variable);
  void check_no_grad_in_slots(const char* what) const;
  // pre_use found `param`'s slot holding its gradient: fails saying why and what to do.
  void refuse_use_of_grad_slot(int64_t param) const;
  void materialize(bool fetch_remote);

  std::shared_ptr<torch::nn::Module> module_;
  Config config_;
  std::shared_ptr<const Device> device_;  // made once from config_.device; every store of the model shares it
  ChunkedModelOptions options_;
  at::ScalarType dtype_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  // Each parameter's TensorImpl and index, sorted by address (Note [The module's parameters]).
  std::vector<std::pair<const c10::TensorImpl*, int64_t>> impl_index_;
  std::vector<ChunkId> param_chunks_;
  int64_t layout_version_ = 0;
  int64_t repack_peak_bytes_ = 0;
  int64_t repack_waits_ = 0;  // iteration ends at which the wanted repack waited for held views
  double repack_seconds_ = 0;
  double loss_scale_ = 1.0;
  GradSink* grad_sink_ = nullptr;
  LayoutListener* layout_listener_ = nullptr;
  std::vector<char> grad_in_slot_;  // per parameter (Note [Gradient in the parameter slot])
  std::vector<char> trainable_;     // per parameter: requires_grad when last looked (check_trainable)
  int64_t grads_in_slots_ = 0;      // how many are set
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> numels_;
  std::vector<at::Tensor> initial_values_;  // see initial_value()
  // Note [Writes to parameters], per parameter as remember_bindings() saw it.
  std::vector<const c10::StorageImpl*> bound_storage_;
  std::vector<int64_t> bound_offset_;
  std::vector<int64_t> bound_version_;
  int64_t writes_taken_ = 0;  // take_writes() calls that took something in (the first is logged at info)
  ChunkLayout layout_;
  std::shared_ptr<DeviceAccountant> accountant_ = std::make_shared<DeviceAccountant>();
  std::unique_ptr<ChunkStore> store_;
  std::vector<std::weak_ptr<StateChunks>> states_;  // see attach_state()
  std::shared_ptr<OptEvictionPolicy> policy_;
  std::unique_ptr<Scheduler> scheduler_;
  std::shared_ptr<RemoteChunks> remote_;
  bool remote_hazard_ = false;  // hold_remote_hazard
  bool forward_done_hazard_ = false;  // hold_forward_done_hazard
  bool training_forward_ = false;     // a forward of this iteration ran under grad mode (end_forward)
  // Note [Several forwards]: the nodes of this iteration's forward outputs, each with whether a
  // backward has run through it (a pre-hook on the node sets it).
  struct ForwardOutput {
    std::weak_ptr<torch::autograd::Node> node;
    std::shared_ptr<std::atomic<bool>> ran;
  };
  std::vector<ForwardOutput> forward_outputs_;
  bool last_backward_failed_ = false;  // the last backward() threw (pre_use's message then differs)
  // land_grad refused a backward that was not backward()'s (Note [A backward not through
  // model.backward()]); set on autograd's thread: the iteration ends as an aborted one next.
  std::atomic<bool> backward_refused_{false};
  std::vector<TensorId> tensor_of_param_;
  std::vector<ChunkId> chunk_of_param_;
  std::vector<const c10::StorageImpl*> registered_;
  std::atomic<ModelPhase> phase_{ModelPhase::kIdle};
  // last_phase_seconds(): forward begin/end, backward begin/end, and which pairs this iteration closed.
  enum PhaseMark { kForwardBegin, kForwardEnd, kBackwardBegin, kBackwardEnd, kPhaseMarks };
  std::array<std::unique_ptr<StreamMark>, kPhaseMarks> marks_;
  bool forward_marked_ = false, backward_marked_ = false;
  bool in_iteration_ = false;
  bool materialized_ = false;
};

}  // namespace ferry
