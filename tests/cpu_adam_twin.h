#pragma once
// The optimizer of a wrapped model's unwrapped twin: ferry's CpuAdam over the twin's parameters, one
// group, each parameter updated on its own tensors and skipped without a gradient, with the bias
// corrections of its own step count (torch's per-parameter `step`), as HybridAdam updates it (D62). The
// same kernel on the same values, so a HybridAdam over the twin's copy must give the same bits (D30).
#include <torch/torch.h>

#include <vector>

#include "../common/config.h"
#include "../cpu_adam/cpu_adam.h"

namespace ferry::test {

class CpuAdamTwin {
 public:
  CpuAdamTwin(torch::nn::Module& twin, const AdamOptions& options, const Config& config)
      : adam_(options, CpuAdamConfig::from(config)) {
    for (auto& p : twin.parameters()) state_.push_back({p, torch::zeros_like(p), torch::zeros_like(p), 0});
  }
  // Drops every .grad (before the twin's backward).
  void zero_grad() {
    for (auto& s : state_) s.param.mutable_grad().reset();
  }
  // One step over every parameter that has a gradient.
  void step() {
    for (auto& s : state_) {
      const torch::Tensor& grad = s.param.grad();
      if (!grad.defined()) continue;
      const CpuAdam::FrozenGroup own{adam_.options(0), ++s.step};
      const torch::Tensor param = s.param.detach();
      TORCH_CHECK(param.is_contiguous() && grad.is_contiguous(), "CpuAdamTwin: expected contiguous tensors");
      AdamSpan span;
      span.param = param.data_ptr<float>();
      span.grad = grad.data_ptr();
      span.grad_dtype = grad.scalar_type();
      span.exp_avg = s.exp_avg.data_ptr<float>();
      span.exp_avg_sq = s.exp_avg_sq.data_ptr<float>();
      span.numel = param.numel();
      adam_.update(own, span);
    }
  }

 private:
  struct State {
    torch::Tensor param, exp_avg, exp_avg_sq;
    int64_t step = 0;  // this parameter's updates
  };
  CpuAdam adam_;
  std::vector<State> state_;
};

}  // namespace ferry::test
