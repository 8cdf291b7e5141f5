#include "ferry/hooks/checkpoint.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>

namespace ferry {
namespace {

// fn travels through AutogradContext::saved_data as an opaque capsule.
struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(CheckpointFn f) : fn(std::move(f)) {}
  CheckpointFn fn;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `anchor`: an empty tensor that requires grad, so the output has a grad_fn even when no input
  // requires grad (the parameters fn uses are not inputs of this Function).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<FnHolder> holder,
                            const at::Tensor& anchor, at::TensorList input_list) {
    (void)anchor;
    const std::vector<at::Tensor> inputs = input_list.vec();
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    std::vector<int64_t> needs_grad;
    for (const auto& t : inputs) needs_grad.push_back(t.defined() && t.requires_grad());
    ctx->saved_data["needs_grad"] = needs_grad;
    ctx->save_for_backward(inputs);
    at::Tensor out;
    {
      at::NoGradGuard no_grad;
      out = holder->fn(inputs);
    }
    TORCH_CHECK(out.defined(), "ferry: checkpoint: fn returned an undefined tensor");
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    const auto needs_grad = ctx->saved_data["needs_grad"].toIntVector();
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor t = saved[i].defined() ? saved[i].detach() : saved[i];
      if (t.defined() && needs_grad[i]) t.requires_grad_(true);
      inputs.push_back(t);
    }
    at::Tensor out;
    {
      at::AutoGradMode grad_on(true);
      out = holder->fn(inputs);
    }
    if (out.requires_grad()) torch::autograd::backward({out}, {grad_outputs[0]});
    torch::autograd::variable_list grads;
    grads.emplace_back();  // for the holder
    grads.emplace_back();  // for the anchor
    for (size_t i = 0; i < inputs.size(); ++i) {
      grads.push_back(inputs[i].defined() && needs_grad[i] ? inputs[i].grad() : at::Tensor());
    }
    return grads;
  }
};

}  // namespace

at::Tensor checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(fn, "ferry: checkpoint needs a function");
  if (!at::GradMode::is_enabled()) return fn(inputs);
  const at::Tensor anchor = at::empty({0}).requires_grad_(true);
  return CheckpointFunction::apply(c10::make_intrusive<FnHolder>(std::move(fn)), anchor, at::TensorList(inputs));
}

}  // namespace ferry
