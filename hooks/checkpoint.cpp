#include "checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <ATen/SequenceNumber.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "../common/logging.h"
#include "activation_segments.h"
#include "param_use_recorder.h"

namespace ferry {
namespace {

thread_local ParamUseRecorder* innermost_recorder = nullptr;

// How many segments' own autograd::grad calls run on this thread (a nested segment's backward runs on
// the thread of the call that reached it: reentrant backward).
thread_local int segment_grads_running = 0;
struct SegmentGradsRunning {
  SegmentGradsRunning() { ++segment_grads_running; }
  ~SegmentGradsRunning() { --segment_grads_running; }
  SegmentGradsRunning(const SegmentGradsRunning&) = delete;
  SegmentGradsRunning& operator=(const SegmentGradsRunning&) = delete;
};

// Note [The recompute replays the forward's randomness and autocast]
// The recompute must compute what the first run computed. Two thread states decide that besides the
// inputs and parameters, and both differ in backward: the random generators (a dropout mask drawn in
// forward is drawn anew, from where the generator is by then) and autocast (enabled around forward,
// usually not around backward: the recompute ran in fp32 what forward ran in bf16). Both gave wrong
// gradients silently (probed against the unwrapped model: dropout 1.6 off, CPU autocast 7e-3). As
// torch.utils.checkpoint does by default (preserve_rng_state): forward records the CPU generator's
// state and that of each CUDA device generator the inputs are on, and the autocast state of the CPU and
// CUDA; the recompute runs with those states and then gives the generators back the states they had,
// so the recompute draws nothing from the training's random stream either.
struct ForwardContext {
  struct Rng {
    at::Generator generator;
    at::Tensor state;
  };
  struct Autocast {
    c10::DeviceType type;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<Rng> rng;
  std::vector<Autocast> autocast;
  bool autocast_cache = true;

  static at::Tensor state_of(at::Generator& g) {
    const std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state();
  }
  static void set_state(at::Generator& g, const at::Tensor& state) {
    const std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }

  static ForwardContext capture(const std::vector<at::Tensor>& inputs) {
    ForwardContext c;
    auto add = [&](at::Generator g) {
      for (const Rng& r : c.rng) {
        if (r.generator == g) return;
      }
      at::Tensor state = state_of(g);
      c.rng.push_back({std::move(g), std::move(state)});
    };
    add(at::detail::getDefaultCPUGenerator());
    for (const at::Tensor& t : inputs) {
      if (t.defined() && t.is_cuda()) add(at::globalContext().defaultGenerator(t.device()));
    }
    for (const c10::DeviceType type : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
      c.autocast.push_back({type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)});
    }
    c.autocast_cache = at::autocast::is_autocast_cache_enabled();
    return c;
  }
};

// Runs the recompute in the forward's context (RAII): the generators at their forward states and
// autocast as it was; on scope exit, by return or throw, everything as it was before.
class ReplayForward {
 public:
  explicit ReplayForward(const ForwardContext& forward) {
    for (const ForwardContext::Rng& r : forward.rng) {
      at::Generator g = r.generator;
      rng_.push_back({g, ForwardContext::state_of(g)});
      ForwardContext::set_state(g, r.state);
    }
    for (const ForwardContext::Autocast& a : forward.autocast) {
      autocast_.push_back({a.type, at::autocast::is_autocast_enabled(a.type), at::autocast::get_autocast_dtype(a.type)});
      at::autocast::set_autocast_enabled(a.type, a.enabled);
      at::autocast::set_autocast_dtype(a.type, a.dtype);
    }
    cache_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(forward.autocast_cache);
    at::autocast::increment_nesting();  // as torch.autocast's __enter__: the cast cache lives until the exit
  }
  ReplayForward(const ReplayForward&) = delete;
  ReplayForward& operator=(const ReplayForward&) = delete;
  ~ReplayForward() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_cache_enabled(cache_);
    for (const ForwardContext::Autocast& a : autocast_) {
      at::autocast::set_autocast_enabled(a.type, a.enabled);
      at::autocast::set_autocast_dtype(a.type, a.dtype);
    }
    for (ForwardContext::Rng& r : rng_) ForwardContext::set_state(r.generator, r.state);
  }

 private:
  std::vector<ForwardContext::Rng> rng_;
  std::vector<ForwardContext::Autocast> autocast_;
  bool cache_ = true;
};

// fn travels through AutogradContext::saved_data as an opaque capsule; `outs` carries fn's results from
// checkpoint() into forward() (taken there: the graph must not hold its own outputs); `context` is the
// forward's context the recompute replays.
struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(CheckpointFns f) : fn(std::move(f)) {}
  CheckpointFns fn;
  std::vector<at::Tensor> outs;
  ForwardContext context;
  // fn's inputs as the caller gave them: `arity` tensors, of which the defined ones (the Function's
  // inputs: autograd takes no undefined tensor there) sit at `positions`.
  size_t arity = 0;
  std::vector<size_t> positions;
  // The segment as the model's memory plan numbers it (hooks/activation_segments.h): its recompute is
  // measured when the ticket says so.
  ActivationSegments::Ticket ticket;
};

// Note [Checkpoint parameters as inputs]
// A segment's recompute runs in backward, and its nested backward used to accumulate the gradients of
// the parameters fn uses right there (AccumulateGrad inside the nested call). With ferry a gradient
// takes its parameter's place in the chunk (D37), so a parameter in two segments (a block checkpointed
// twice, or one encoder checkpointed in two forwards) was needed by the second recompute after the
// first had landed its gradient: refused. Now, when ChunkedModel records the parameters fn uses
// (ParamUseRecorder, during the first run), they are inputs of this Function: backward computes their
// gradients with autograd::grad, without accumulating, and returns them, so the engine sums every
// contribution and lands each parameter once, after all its segments have recomputed. When the
// recomputed graph reaches a tensor that requires grad and is neither an input nor a recorded
// parameter, autograd::grad would lose its gradient, so the nested backward accumulates as before:
// plain LibTorch (no ChunkedModel records the parameters), or fn captured it (warned once). A segment
// whose graph reaches only its inputs (frozen parameters) takes the autograd::grad path either way.

// Whether every leaf the recomputed graph of `outs` reaches is one whose gradient the Function returns
// (`known`: its inputs and recorded parameters; empty leaves, such as a nested checkpoint's anchor, carry
// no gradient), and every other node was made by the recompute (sequence numbers in [begin, end) on
// this thread). A tensor fn captures instead of taking it as an input fails it: its gradient would be
// lost by autograd::grad, so the nested backward accumulates instead.
// `stops`: the nodes that made the inputs (a recompute that creates a graph runs on the inputs
// themselves, not on detached copies): the recompute's graph ends there. `outs`: the outputs whose
// gradients are pushed through it.
bool recompute_is_closed(const std::vector<at::Tensor>& outs, const std::unordered_set<const c10::TensorImpl*>& known,
                         const std::unordered_set<const torch::autograd::Node*>& stops, uint64_t begin,
                         uint64_t end) {
  std::vector<torch::autograd::Node*> stack;
  for (const at::Tensor& out : outs) stack.push_back(out.grad_fn().get());
  std::unordered_set<const torch::autograd::Node*> seen;
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second || stops.count(node) != 0) continue;
    if (const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      if (acc->variable.numel() != 0 && known.count(acc->variable.unsafeGetTensorImpl()) == 0) return false;
      continue;
    }
    if (node->sequence_nr() < begin || node->sequence_nr() >= end) return false;
    for (const auto& edge : node->next_edges()) stack.push_back(edge.function.get());
  }
  return true;
}

// Note [A backward that creates a graph through a checkpoint]
// A gradient penalty differentiates a gradient: autograd::grad(..., create_graph) through the segment,
// then a backward through that gradient's graph. The segment's backward used to compute its gradients
// without a graph (and on detached copies of the inputs), so the penalty's gradient lost every term
// through the segment, silently (probed against the plain model: 0.36 off inside a ChunkedModel, and 4
// off unwrapped, where the nested backward also accumulated the first gradient's parameter terms into
// .grad). Now, under create_graph, the recompute runs on the inputs themselves and autograd::grad
// creates the graph, so the gradients are differentiable back to the parameters and to whatever made
// the inputs; the walk of recompute_is_closed stops at the inputs' nodes. The nested-backward path
// (no recorded parameters: no ChunkedModel, or fn captures a tensor) cannot do that, nor serve an
// autograd::grad() of the caller without accumulating into .grad: both are refused, naming the remedy
// (torch's reentrant checkpoint refuses autograd.grad() alike).

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `anchor`: an empty tensor that requires grad, so the output has a grad_fn even when nothing else
  // requires grad. `params`: the trainable parameters fn used (none recorded without a ChunkedModel).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<FnHolder> holder, const at::Tensor& anchor,
                                                at::TensorList input_list, at::TensorList param_list) {
    (void)anchor;
    const std::vector<at::Tensor> inputs = input_list.vec();
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    std::vector<int64_t> needs_grad;
    for (const auto& t : inputs) needs_grad.push_back(t.requires_grad());  // all defined (FnHolder::positions)
    ctx->saved_data["needs_grad"] = needs_grad;
    std::vector<at::Tensor> saved = inputs;
    saved.insert(saved.end(), param_list.begin(), param_list.end());
    ctx->save_for_backward(saved);
    torch::autograd::variable_list outs = std::move(holder->outs);
    holder->outs.clear();
    ctx->saved_data["num_outputs"] = static_cast<int64_t>(outs.size());
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    const auto needs_grad = ctx->saved_data["needs_grad"].toIntVector();
    const size_t num_inputs = holder->positions.size();  // the Function's inputs: fn's defined ones
    const auto saved = ctx->get_saved_variables();
    // Note [A backward that creates a graph through a checkpoint]: the engine runs a backward under
    // grad mode exactly when it creates a graph (create_graph).
    const bool create_graph = at::GradMode::is_enabled();
    std::vector<at::Tensor> inputs;
    std::unordered_set<const torch::autograd::Node*> stops;  // where the recompute's graph ends
    for (size_t i = 0; i < num_inputs; ++i) {
      if (create_graph) {  // the inputs themselves: the gradients' graph must reach what made them
        inputs.push_back(saved[i]);
        if (saved[i].grad_fn()) stops.insert(saved[i].grad_fn().get());
        continue;
      }
      at::Tensor t = saved[i].detach();
      if (needs_grad[i]) t.requires_grad_(true);
      inputs.push_back(t);
    }
    const std::vector<at::Tensor> params(saved.begin() + static_cast<std::ptrdiff_t>(num_inputs), saved.end());
    std::vector<at::Tensor> recomputed;
    const uint64_t begin = at::sequence_number::peek();
    {
      const ReplayForward replay(holder->context);  // Note [The recompute replays the forward's randomness ...]
      at::AutoGradMode grad_on(true);
      std::vector<at::Tensor> call(holder->arity);  // undefined where the caller gave undefined
      for (size_t k = 0; k < inputs.size(); ++k) call[holder->positions[k]] = inputs[k];
      const ActivationSegments::Inside inside;
      const ActivationSegments::Ticket& ticket = holder->ticket;
      recomputed = ticket.segments != nullptr
                       ? ticket.segments->run_measured(ticket.measure, ticket.index, [&] { return holder->fn(call); })
                       : holder->fn(call);
    }
    const uint64_t end = at::sequence_number::peek();
    const auto num_outputs = static_cast<size_t>(ctx->saved_data["num_outputs"].toInt());
    TORCH_CHECK(recomputed.size() == num_outputs, "ferry::checkpoint: fn returned ", recomputed.size(),
                " tensors in the recompute and ", num_outputs, " in the first run; it must compute the same both times");
    // The outputs whose gradients go back through the segment: those that require grad and got one.
    std::vector<at::Tensor> outs, out_grads;
    for (size_t i = 0; i < num_outputs; ++i) {
      if (recomputed[i].defined() && recomputed[i].requires_grad() && grad_outputs[i].defined()) {
        outs.push_back(recomputed[i]);
        out_grads.push_back(grad_outputs[i]);
      }
    }
    torch::autograd::variable_list grads(2 + inputs.size() + params.size());  // holder, anchor, inputs, params
    if (outs.empty()) return grads;  // nothing flows back through the segment
    // Closed: every leaf the recompute reaches is an input or a recorded parameter (a frozen segment
    // with no recorded parameter too); plain LibTorch's trainable parameters are not recorded.
    std::unordered_set<const c10::TensorImpl*> known;
    for (const auto& t : inputs) known.insert(t.unsafeGetTensorImpl());
    for (const auto& p : params) known.insert(p.unsafeGetTensorImpl());
    const bool closed = recompute_is_closed(outs, known, stops, begin, end);
    static std::atomic<bool> warned{false};
    if (!closed && !params.empty() && !warned.exchange(true)) {  // inside a ChunkedModel: a captured tensor
      log::warn("ferry::checkpoint: the segment uses a tensor that requires grad and is neither among its "
                "inputs nor a wrapped module's parameter; its gradients (the parameters' too) are accumulated "
                "by a nested backward, so a parameter in two such segments of one backward is refused. Pass "
                "such tensors in checkpoint's inputs");
    }
    if (!closed) {  // Note [Checkpoint parameters as inputs]: no parameters recorded, or a captured tensor
      // Note [A backward that creates a graph through a checkpoint]: the nested backward would
      // accumulate gradients the caller did not ask for, or lose the graph the caller asked for.
      // An enclosing segment's autograd::grad (below) is ferry's own: nested, this one accumulates as
      // it always did, and the enclosing one returns nothing for those parameters.
      const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
      const bool caller_asked = exec_info != nullptr && !exec_info->empty() && segment_grads_running == 0;
      TORCH_CHECK(!create_graph && !caller_asked, "ferry::checkpoint: ",
                  create_graph ? "a backward that creates a graph (create_graph, as a gradient penalty's)"
                               : "autograd::grad() (or a backward given `inputs`)",
                  " through a checkpointed segment needs the segment's parameters recorded, i.e. the segment "
                  "inside a ChunkedModel's forward, with every tensor that requires grad and is not a "
                  "parameter of the wrapped module passed in checkpoint's inputs; here ",
                  params.empty() ? "no parameters were recorded (no ChunkedModel)" : "fn captures a tensor that "
                  "requires grad",
                  ". Its nested backward would accumulate the parameters' gradients into .grad");
      torch::autograd::backward(outs, out_grads);
      for (size_t i = 0; i < inputs.size(); ++i) {  // detached copies: their .grad is this backward's
        if (needs_grad[i]) grads[2 + i] = inputs[i].grad();
      }
      return grads;  // the parameters' were accumulated
    }
    // The gradients of the inputs that need one and of the trainable parameters, not accumulated.
    std::vector<at::Tensor> wrt;
    std::vector<int64_t> slot;  // index into grads of each entry of wrt
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (needs_grad[i]) {
        wrt.push_back(inputs[i]);
        slot.push_back(static_cast<int64_t>(2 + i));
      }
    }
    for (size_t k = 0; k < params.size(); ++k) {
      if (params[k].requires_grad()) {
        wrt.push_back(params[k]);
        slot.push_back(static_cast<int64_t>(2 + inputs.size() + k));
      }
    }
    if (!wrt.empty()) {
      const SegmentGradsRunning running;
      const torch::autograd::variable_list g = torch::autograd::grad(outs, wrt, out_grads,
                                                                     /*retain_graph=*/create_graph,
                                                                     /*create_graph=*/create_graph,
                                                                     /*allow_unused=*/true);
      for (size_t j = 0; j < g.size(); ++j) grads[static_cast<size_t>(slot[j])] = g[j];
    }
    return grads;
  }
};

}  // namespace

ParamUseRecorder::ParamUseRecorder() : outer_(innermost_recorder) { innermost_recorder = this; }

ParamUseRecorder::~ParamUseRecorder() {
  innermost_recorder = outer_;
  if (outer_ != nullptr) {
    for (const auto& p : params_) outer_->add(p);
  }
}

void ParamUseRecorder::record(const at::Tensor& param) {
  if (innermost_recorder != nullptr) innermost_recorder->add(param);
}

void ParamUseRecorder::add(const at::Tensor& param) {
  if (seen_.insert(param.unsafeGetTensorImpl()).second) params_.push_back(param);
}

std::vector<at::Tensor> checkpoint(CheckpointFns fn, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(fn, "ferry: checkpoint needs a function");
  if (!at::GradMode::is_enabled()) return fn(inputs);
  int64_t input_numel = 0;
  for (const at::Tensor& t : inputs) input_numel += t.defined() ? t.numel() : 0;
  const ActivationSegments::Ticket ticket = ActivationSegments::ticket(input_numel);
  if (ticket.keep) {  // the memory plan keeps this segment's activations: it runs as if not checkpointed
    const ActivationSegments::Inside inside;
    return fn(inputs);
  }
  auto holder = c10::make_intrusive<FnHolder>(std::move(fn));
  holder->ticket = ticket;
  holder->context = ForwardContext::capture(inputs);
  holder->arity = inputs.size();
  std::vector<at::Tensor> present;  // the defined inputs: the Function's own
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    present.push_back(inputs[i]);
    holder->positions.push_back(i);
  }
  std::vector<at::Tensor> params;  // Note [Checkpoint parameters as inputs]
  {
    const ParamUseRecorder recorder;
    at::NoGradGuard no_grad;
    const ActivationSegments::Inside inside;
    holder->outs = holder->fn(inputs);
    for (const auto& p : recorder.params()) {
      if (p.requires_grad()) params.push_back(p);
    }
  }
  TORCH_CHECK(!holder->outs.empty(), "ferry: checkpoint: fn returned no tensor");
  for (size_t i = 0; i < holder->outs.size(); ++i) {
    TORCH_CHECK(holder->outs[i].defined(), "ferry: checkpoint: fn returned an undefined tensor (output ", i, " of ",
                holder->outs.size(), ")");
  }
  const at::Tensor anchor = at::empty({0}).requires_grad_(true);
  return CheckpointFunction::apply(holder, anchor, at::TensorList(present), at::TensorList(params));
}

at::Tensor checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(fn, "ferry: checkpoint needs a function");
  return checkpoint(CheckpointFns([fn = std::move(fn)](const std::vector<at::Tensor>& in) {
                      return std::vector<at::Tensor>{fn(in)};
                    }),
                    inputs)[0];
}

}  // namespace ferry
