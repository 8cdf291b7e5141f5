#pragma once
// ChunkedModel: runs an existing, unmodified torch::nn::Module on chunks.
//
//   ferry::Config config = ferry::Config::from_args(argc, argv);  // --device, --device-budget, --log-level ...
//   auto net = std::make_shared<MyNet>(...);                 // any module, unchanged (or a TORCH_MODULE holder)
//   ferry::ChunkedModel model(net, config);                  // parameters move into chunks
//   auto loss = model.forward([&] { return criterion(net->forward(x.to(model.device())), y); });
//   model.backward(loss);
//
// The constructor applies config.log_level and config.rank to ferry's log unless the program called
// ferry::log::configure() itself (log::configure_default, common/logging.h).
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
//    left running behind its step (Note [Update behind the next forward], optim/deferred_updates.h) may
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
//
// Built from objects that each own their state, each in its own header with its contract: the module's
// parameters (param_table.h), the chunks they are bound to and the repack (param_chunks.h), the
// writes the user made to them (write_watch.h), the slots that hold gradients (grad_slots.h), the
// outputs of this iteration's forwards (forward_outputs.h) and the phases' device times
// (phase_timer.h). The phase state machine is ChunkedModel's own (ModelPhase: one checked transition).
// chunked_model.cpp: construction, the model between iterations; model_iteration.cpp: an iteration
// (forward, backward, the use hooks, the gradient landing, its end and the repack).
//
// Where the model's Notes are: [Gradient in the parameter slot] grad_slots.h; [Writes to parameters]
// write_watch.h; [The module's parameters] param_table.h; [Several forwards] forward_outputs.h;
// [A repack waits for held views] param_chunks.cpp; [Between forward and backward] and [A backward not
// through model.backward()] model_iteration.cpp.
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../chunk/chunk_store.h"
#include "../chunk/device.h"
#include "../chunk/layout.h"
#include "../chunk/state_chunks.h"
#include "../common/config.h"
#include "../common/event_trace.h"
#include "../common/safetensors.h"
#include "../scheduler/joint_placement.h"
#include "../scheduler/scheduler.h"
#include "activation_segments.h"
#include "forward_outputs.h"
#include "grad_slots.h"
#include "interceptor.h"
#include "model_listeners.h"
#include "param_chunks.h"
#include "param_table.h"
#include "phase_timer.h"
#include "skip_hint.h"
#include "write_watch.h"

namespace ferry {

// Called with a value load_state_dict has written where it belongs (and no longer reads).
using ValueLoaded = std::function<void(const at::Tensor& value)>;

struct ChunkedModelOptions {
  // The budget and capacity are the DeviceBudget's, made of the Config (chunk/device.h): any given here
  // are replaced.
  SchedulerOptions scheduler;
  bool repack_after_warmup = true;      // repack parameters in first-use order after warm-up
  std::unique_ptr<MemoryProbe> probe;   // null: the device's own probe
  // Simulated device only: count the host memory forward/backward allocate beside the chunks
  // (activations) as non-model device memory, as the CUDA allocator's stats do on a GPU
  // (make_heap_probe). Off by default: the simulated device's budget then covers chunks only.
  bool measure_host_non_model = false;
  int64_t host_cache_bytes = int64_t{256} << 20;
  // Makes the copy engine of each parameter store (null: the device's own). Tests pass
  // an engine whose copies stay pending, as CUDA's do.
  std::function<std::unique_ptr<CopyEngine>()> copy_engine;
};

// Where a ChunkedModel is in its iteration; changed only by ChunkedModel::transition().
enum class ModelPhase { kIdle, kForward, kForwardDone, kBackward };
const char* to_string(ModelPhase phase);

class ChunkedModel final : private UseListener, private SkipListener {
 public:
  ChunkedModel(std::shared_ptr<torch::nn::Module> module, const Config& config, ChunkedModelOptions options = {});
  // A TORCH_MODULE holder (`Classifier net(64, 10); ferry::ChunkedModel model(net, config);`): wraps the
  // module it holds.
  template <class M>
  ChunkedModel(const torch::nn::ModuleHolder<M>& holder, const Config& config, ChunkedModelOptions options = {})
      : ChunkedModel(std::shared_ptr<torch::nn::Module>(holder.ptr()), config, std::move(options)) {}
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
      ActivationSegments::Scope segments(&activations_);  // ferry::checkpoint asks it what to do
      SkipListener::Scope skips(this);                    // ferry::will_skip reaches will_skip()
      auto out = fn();
      outputs_.note(out);  // Note [Several forwards]
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
  const std::shared_ptr<RemoteChunks>& remote_chunks() const { return chunks_.remote(); }
  // No repack is to come: the warm-up ended and its repack ran (or repacking is off). A repack waits
  // while views of parameter chunk memory are held outside ferry (Note [A repack waits for held views]).
  bool layout_final() const {
    return !options_.repack_after_warmup || (scheduler_->trace() != nullptr && !scheduler_->repack_wanted());
  }
  // The one listener told of repacks (null: none). Not inside an iteration.
  void set_layout_listener(LayoutListener* listener);
  LayoutListener* layout_listener() const { return layout_listener_; }
  // What makes the ranks plan their activations alike at world size > 1 (null: none, and auto then
  // recomputes every segment there). HybridAdam sets itself. Not inside an iteration.
  void set_plan_agreement(PlanAgreement* agreement);
  PlanAgreement* plan_agreement() const { return plan_agreement_; }
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
  // overwrite the parameters at the next step. `loaded(value)`, if given, is called once each value is
  // in place (parameters in order, then buffers): a loader reading from a mapping drops its pages there.
  // Parameters are written in order; `also(p, value)` (HybridAdam's masters) runs right after parameter
  // p's write, before `loaded`.
  void load_state_dict(const NamedTensors& values, const ValueLoaded& loaded = {},
                       const std::function<void(int64_t param, const at::Tensor& value)>& also = {});
  // state_dict() as a safetensors file a Python user loads with safetensors.torch.load_file.
  void export_safetensors(const std::string& path) { write_safetensors(path, state_dict(), {{"format", "pt"}}); }

  torch::nn::Module& module() { return *module_; }
  ChunkStore& store() { return chunks_.store(); }
  // The device the chunks' device tier lives on (cuda:N, or cpu for the simulated device): where the
  // module's buffers are and where inputs go, `x.to(model.device())`.
  c10::Device device() const { return chunks_.store().device(); }
  // The optimizer state that mirrors the parameter chunks, group by group (chunk/state_chunks.h): made
  // here, so that it shares the device accountant and is migrated by the same repack as the parameters
  // (before the LayoutListener hears of it) for as long as the caller holds it. Its store never pins host
  // memory and has no budget of its own (the optimizer places groups; Scheduler::admit_device_bytes
  // makes room). Between iterations. init: as StateChunks::build's.
  // zero_roles: as StateChunks' (roles that start at zero, allocated when first touched).
  std::shared_ptr<StateChunks> attach_state(std::vector<ChunkRole> roles, const StateChunks::Init& init,
                                            std::vector<int> zero_roles = {});
  // The same with each role's dtype and shape (StateRoleSpec: the compact format's roles).
  std::shared_ptr<StateChunks> attach_state(std::vector<StateRoleSpec> roles, const StateChunks::Init& init);
  // The device accountant of the parameter chunks, for every store that shares the device budget with
  // them (HybridAdam's optimizer state charges it too): total and by role.
  const std::shared_ptr<DeviceAccountant>& device_accountant() const { return chunks_.accountant(); }
  Scheduler& scheduler() { return *scheduler_; }
  const ChunkLayout& layout() const { return chunks_.layout(); }
  // Bytes of a regular parameter chunk (the configured size, or the auto choice).
  int64_t chunk_size_bytes() const {
    return layout().options().chunk_numel * static_cast<int64_t>(c10::elementSize(compute_dtype()));
  }
  int64_t num_params() const { return table_.size(); }
  // Parameter index -> the tensor (as registered in the module; tied parameters once).
  const at::Tensor& param(int64_t index) const { return table_.param(index); }
  const std::string& param_name(int64_t index) const { return table_.name(index); }
  const std::vector<std::vector<int64_t>>& param_shapes() const { return table_.shapes(); }
  at::ScalarType compute_dtype() const { return chunks_.dtype(); }
  const Config& config() const { return config_; }
  // The parameter's slot in its chunk, wherever that is now (device or host); between iterations. It
  // holds the parameter's gradient instead while grad_in_slot(index). Fails for a parameter whose chunk
  // is remote (another rank's, not fetched now).
  at::Tensor param_values(int64_t index);
  // Whether the parameter's slot holds its gradient (Note [Gradient in the parameter slot]).
  bool grad_in_slot(int64_t index) const { return slots_.holds_grad(index); }
  bool any_grad_in_slot() const { return slots_.any(); }
  // The optimizer has written every parameter's value back into its slot; between iterations.
  void clear_grad_slots();
  // The same for one parameter; also during backward, by a gradient sink that gave the slot its value
  // back (on autograd's thread, or in backward_finished). Not during a forward.
  void clear_grad_slot(int64_t index);
  // layout().chunks()[i] -> the ChunkId in store().
  ChunkId param_chunk(int64_t layout_chunk) const { return chunks_.param_chunk(layout_chunk); }
  // Incremented by every (re)pack; who mirrors the layout compares it.
  int64_t layout_version() const { return chunks_.layout_version(); }
  // The parameter's value before it was cast into the compute dtype (fp32, as the module built it), or
  // an undefined tensor when the compute copy holds it exactly (fp32) or it was released. Kept until
  // release_initial_values() or the end of the first training iteration, so that an optimizer
  // attached before training starts its fp32 masters from the unrounded values.
  // Undefined also once the parameter was written (Note [Writes to parameters]): the write is its value.
  at::Tensor initial_value(int64_t index) const { return chunks_.initial_value(index); }
  void release_initial_values() { chunks_.release_initial_values(); }
  void release_initial_value(int64_t index) { chunks_.release_initial_value(index); }
  // Peak payload bytes of the old and new stores together during the last repack (tests, reports).
  int64_t last_repack_peak_bytes() const { return chunks_.repack_stats().peak_bytes; }
  // Iteration ends at which the wanted warm-up repack waited for views of parameter chunk memory held
  // outside ferry (Note [A repack waits for held views]; reports, tests).
  int64_t repack_waits() const { return chunks_.repack_stats().waits; }
  // Wall time of the last repack: the parameter chunks and every attached state store's migration
  // (reports; 0 before the first).
  double last_repack_seconds() const { return chunks_.repack_stats().seconds; }
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
  // The ferry::checkpoint segments of the last forward, their measured costs and the plan that applies
  // (Config::activations; hooks/activation_segments.h).
  const ActivationSegments& activations() const { return activations_; }
  // Applies an activation plan made from activations().costs() (activations=auto; HybridAdam's joint
  // placement makes one, scheduler/joint_placement.h): the next iteration runs it and records a new
  // trace if it changes what backward does. Logs the plan's table. Between iterations.
  void apply_activation_plan(const MemoryPlan& plan, const MemoryPlanInput& input);
  // What a plan is made from: the segments' measured costs and the last iteration's forward and backward
  // (backward at least the recomputes it included). Between iterations.
  ActivationCosts activation_costs() const;
  // The device object the chunks live on (chunk/device.h).
  const Device& device_object() const { return *device_; }
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
  // model_iteration.cpp: the use hooks (hooks/interceptor.h).
  void pre_use(int64_t param) override;
  void post_use(int64_t param) override;
  Outside before_outside_use(int64_t param) override;  // Note [Ops outside the scopes] (interceptor.h)
  // ferry::will_skip inside forward(): the module's own parameters to the scheduler (hooks/skip_hint.h).
  void will_skip(const torch::nn::Module& module) override;
  // Between iterations: waits for `param`'s chunk's update; fails if its storage has no memory here.
  void check_outside_use(int64_t param);
  // pre_use found `param`'s slot holding its gradient: fails saying why and what to do.
  void refuse_use_of_grad_slot(int64_t param) const;
  // Holds one outside-use hazard while chunks may be given up (remote chunks), and makes this thread
  // watch; `hold` again: watch again (the thread that ends iterations drives the model).
  void hold_remote_hazard(bool hold);
  // Holds one outside-use hazard while the model is between forward() and backward(), and makes this
  // thread watch: its ops on parameters then are uses (Note [Between forward and backward]).
  void hold_forward_done_hazard(bool hold);
  // The one place phase_ changes: checks the transition (ModelPhase's table) and holds or lets go the
  // forward-done hazard with it.
  void transition(ModelPhase to);
  void begin_forward();
  void end_forward();
  void abort_iteration();
  void finish_iteration(bool aborted, bool forward_only = false);
  // The warm-up's repack, when the scheduler wants it and no view outside ferry holds chunk memory
  // (Note [A repack waits for held views]), then the scheduler's and the listener's relayout.
  void repack_if_wanted();
  // activations=auto: after an iteration that measured every segment, once the optimizer state is
  // placed (an iteration after the warm-up), plans which segments keep their activations within the
  // room the device has left, and re-traces when that changes what backward does (chunked_model.cpp).
  void plan_activations_if_wanted();
  // Autograd accumulated `param`'s gradient into `variable`'s .grad: hands it to the sink (GradLandingHook).
  friend struct GradLandingHook;
  void land_grad(int64_t param, const at::Tensor& variable);
  // chunked_model.cpp: between iterations.
  // Gradient hooks on every parameter (`on`) or none; remembers which require grad.
  void install_grad_hooks(bool on);
  // Tells the gradient sink when a parameter's requires_grad changed since the last look.
  void check_trainable();
  // Tells the gradient sink when the activation plan changed what backward recomputes since the last look.
  void check_activation_plan();
  void check_no_grad_in_slots(const char* what) const;
  void materialize(bool fetch_remote);

  std::shared_ptr<torch::nn::Module> module_;
  Config config_;
  std::shared_ptr<const Device> device_;  // made once from config_.device; every store of the model shares it
  ChunkedModelOptions options_;
  ParamTable table_;       // the parameters wrapped (declared before what refers to it)
  ParamChunks chunks_;     // the chunks they are bound to, the layout, the state stores, the repack
  WriteWatch watch_;       // Note [Writes to parameters]
  GradSlots slots_;        // Note [Gradient in the parameter slot]
  PhaseTimer timer_;       // last_phase_seconds()
  ForwardOutputs outputs_; // Note [Several forwards]
  ActivationSegments activations_;  // Config::activations: the checkpoint segments and their plan
  int64_t told_activation_changes_ = 0;  // activations_.changes() when the sink was last told
  std::unique_ptr<Scheduler> scheduler_;
  double loss_scale_ = 1.0;
  GradSink* grad_sink_ = nullptr;
  LayoutListener* layout_listener_ = nullptr;
  PlanAgreement* plan_agreement_ = nullptr;
  std::atomic<ModelPhase> phase_{ModelPhase::kIdle};
  bool in_iteration_ = false;         // the scheduler's iteration is open (begin_forward .. finish_iteration)
  bool training_forward_ = false;     // a forward of this iteration ran under grad mode (end_forward)
  // land_grad refused a backward that was not backward()'s (Note [A backward not through
  // model.backward()]); set on autograd's thread: the iteration ends as an aborted one next.
  std::atomic<bool> backward_refused_{false};
  bool remote_hazard_ = false;        // hold_remote_hazard
  bool forward_done_hazard_ = false;  // hold_forward_done_hazard
};

}  // namespace ferry
