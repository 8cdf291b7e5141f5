#pragma once
// The example's ResNet (an ordinary torch::nn::Module with BatchNorm) and its synthetic data, shared by
// train_resnet and bench_resnet_plan (benchmarks/resnet). The data: 32x32 RGB images whose class sets
// the frequency of a pattern, plus noise, so the loss falls (no image dataset ships with the machine).
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <utility>
#include <vector>

#include "../../hooks/checkpoint.h"

namespace resnet {

struct BasicBlockImpl : torch::nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride) {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    b1 = register_module("b1", torch::nn::BatchNorm2d(out));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
    b2 = register_module("b2", torch::nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      down = register_module("down", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
      down_bn = register_module("down_bn", torch::nn::BatchNorm2d(out));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::relu(b1(c1(x)));
    y = b2(c2(y));
    return torch::relu(y + (down ? down_bn(down(x)) : x));
  }
  torch::nn::Conv2d c1{nullptr}, c2{nullptr}, down{nullptr};
  torch::nn::BatchNorm2d b1{nullptr}, b2{nullptr}, down_bn{nullptr};
};
TORCH_MODULE(BasicBlock);

struct ResNetImpl : torch::nn::Module {
  explicit ResNetImpl(int64_t classes) {
    stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1).bias(false)));
    stem_bn = register_module("stem_bn", torch::nn::BatchNorm2d(16));
    layers = register_module("layers", torch::nn::Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2),
                                                              BasicBlock(32, 64, 2), BasicBlock(64, 64, 1)));
    fc = register_module("fc", torch::nn::Linear(64, classes));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::relu(stem_bn(stem(x)));
    if (checkpoint_blocks) {  // each block a ferry::checkpoint segment: a candidate of the activation plan
      for (const auto& child : layers->children()) {
        const auto block = std::dynamic_pointer_cast<BasicBlockImpl>(child);
        y = ferry::checkpoint([block](const std::vector<at::Tensor>& in) { return block->forward(in[0]); }, {y});
      }
    } else {
      y = layers->forward(y);
    }
    return fc(y.mean({2, 3}));
  }
  bool checkpoint_blocks = false;
  torch::nn::Conv2d stem{nullptr};
  torch::nn::BatchNorm2d stem_bn{nullptr};
  torch::nn::Sequential layers{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

inline std::pair<torch::Tensor, torch::Tensor> synthetic_batch(int64_t step, int64_t batch, int64_t classes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  auto y = torch::randint(classes, {batch}, gen, torch::kLong);
  auto grid = torch::linspace(0, 2 * M_PI, 32);
  auto freq = (y.to(torch::kFloat) + 1).view({batch, 1, 1, 1});
  auto pattern = torch::sin(freq * grid.view({1, 1, 32, 1})) * torch::cos(freq * grid.view({1, 1, 1, 32}));
  auto x = pattern.expand({batch, 3, 32, 32}) + 0.3 * torch::randn({batch, 3, 32, 32}, gen);
  return {x, y};
}

}  // namespace resnet
