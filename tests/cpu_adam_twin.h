#pragma once
// The optimizer of a wrapped model's unwrapped twin: ferry's CpuAdam over the twin's parameters, one
// group, each parameter updated on its own tensors and skipped without a gradient, as HybridAdam
// updates it (bias corrections from the group's step count). The same kernel on the same values, so a
// HybridAdam over the twin's copy must give the same bits (D30).
#include <torch/torch.h>

#include <vector>

#include "ferry/common/config.h"
#include "ferry/cpu_adam/cpu_adam.h"

namespace ferry::test {

class CpuAdamTwin {
 public:
  CpuAdamTwin(torch::nn::Module& twin, const AdamOptions& options, const Config& config)
      : adam_(options, CpuAdamConfig::from(config)) {
    for (auto& p : twin.parameters()) state_.push_back({p, torch::zeros_like(p), torch::zeros_like(p)});
  }
  // Drops every .grad (before the twin's backward).
  void zero_grad() {
    for (auto& s : state_) s.param.mutable_grad().reset();
  }
  // One step over every parameter that has a gradient.
  void step() {
    adam_.advance_step(0);
    for (auto& s : state_) {
      if (s.param.grad().defined()) adam_.update(0, s.param.detach(), s.param.grad(), s.exp_avg, s.exp_avg_sq);
    }
  }

 private:
  struct State {
    torch::Tensor param, exp_avg, exp_avg_sq;
  };
  CpuAdam adam_;
  std::vector<State> state_;
};

}  // namespace ferry::test
