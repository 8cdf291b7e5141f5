#pragma once
// Four residual blocks, each a ferry::checkpoint segment with dropout: the activation plan's tests
// (tests/hooks/test_activation_segments.cpp, tests/optim/test_joint_placement.cpp).
#include <torch/torch.h>

#include <string>
#include <vector>

#include "../../common/config.h"
#include "../../hooks/checkpoint.h"

namespace ferry::test {

struct BlocksImpl : torch::nn::Module {
  explicit BlocksImpl(int64_t d) {
    for (int i = 0; i < 4; ++i) {
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(d, 2 * d)));
      out.push_back(register_module("out" + std::to_string(i), torch::nn::Linear(2 * d, d)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < 4; ++i) {
      x = checkpoint(
          [this, i](const std::vector<at::Tensor>& in) {
            const torch::Tensor h = torch::dropout(torch::gelu(fc[i](in[0])), 0.1, is_training());
            return in[0] + out[i](h);
          },
          {x});
    }
    return x.pow(2).mean();
  }
  std::vector<torch::nn::Linear> fc, out;
};
TORCH_MODULE(Blocks);

// The simulated device with 8 KiB chunks, `budget` bytes for chunks, `capacity` (0: unknown) and `policy`.
inline Config blocks_config(ActivationPolicy policy, int64_t capacity, int64_t budget) {
  Config c;
  c.device = DeviceKind::kSimulated;
  c.chunk_size_bytes = 8 << 10;
  c.device_budget_bytes = budget;
  c.device_capacity_bytes = capacity;
  c.activations = policy;
  return c;
}

}  // namespace ferry::test
