// ForwardOutputs (see forward_outputs.h).
#include "forward_outputs.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace ferry {
namespace {

// Marks that a backward that frees the graph ran through a forward's output node (Note [Several
// forwards]). One that keeps it (autograd::grad with create_graph for a gradient penalty, or
// retain_graph) leaves the graph to a later backward: not marked.
struct BackwardRanHook final : torch::autograd::FunctionPreHook {
  explicit BackwardRanHook(std::shared_ptr<std::atomic<bool>> ran) : ran(std::move(ran)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!torch::autograd::get_current_graph_task_keep_graph()) ran->store(true);
    return grads;
  }
  std::shared_ptr<std::atomic<bool>> ran;
};

}  // namespace

void ForwardOutputs::note(const at::Tensor& out) {
  if (!c10::GradMode::is_enabled() || !out.defined()) return;
  const std::shared_ptr<torch::autograd::Node> node = out.grad_fn();
  if (!node) return;  // a leaf or no graph: nothing saved for a backward
  for (const Output& o : outputs_) {
    if (o.node.lock() == node) return;  // returned twice (a pair of one tensor)
  }
  auto ran = std::make_shared<std::atomic<bool>>(false);
  node->add_pre_hook(std::make_unique<BackwardRanHook>(ran));
  outputs_.push_back({node, std::move(ran)});
}

bool ForwardOutputs::graph_awaits_backward(const std::vector<at::Tensor>& params) const {
  bool ran = false;
  for (const Output& o : outputs_) {
    if (o.ran->load()) {
      ran = true;
    } else if (!o.node.expired()) {
      return true;
    }
  }
  // A backward ran through this iteration's graph: the accumulators a held loss keeps alive await none.
  if (ran) return false;
  for (const auto& p : params) {
    if (p.requires_grad() && torch::autograd::impl::try_get_grad_accumulator(p)) return true;
  }
  return false;
}

}  // namespace ferry
