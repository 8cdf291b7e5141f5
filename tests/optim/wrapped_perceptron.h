#pragma once
// Test fixture: a three-layer perceptron (a GAN's generator or discriminator, an encoder) wrapped in a
// ChunkedModel with its HybridAdam under evictions, beside its unwrapped twin stepped by ferry's kernel.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../../hooks/checkpoint.h"
#include "hybrid_adam_fixtures.h"

namespace ferry::test {

// A three-layer perceptron (a GAN's generator or discriminator).
struct PerceptronImpl : torch::nn::Module {
  PerceptronImpl(int64_t in, int64_t hidden, int64_t out) {
    a = register_module("a", torch::nn::Linear(in, hidden));
    b = register_module("b", torch::nn::Linear(hidden, hidden));
    c = register_module("c", torch::nn::Linear(hidden, out));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto first = [this](const std::vector<at::Tensor>& in) { return torch::tanh(b(torch::tanh(a(in[0])))); };
    return c(checkpointed ? checkpoint(first, {x}) : first({x}));
  }
  bool checkpointed = false;  // its first two layers in a ferry::checkpoint segment
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Perceptron);

// For Perceptrons with a 40 x 40 layer: 8 KiB chunks, two per model (that layer with one neighbour),
// a device budget of one: every forward and backward evicts.
inline Config perceptron_config() {
  Config config = sim_config(8 << 10);
  config.chunk_size_bytes = 8 << 10;
  return config;
}

// A Perceptron wrapped in a ChunkedModel with its HybridAdam (AdamW, lr 1e-3) under `config`
// (perceptron_config()'s evictions unless told), beside its unwrapped twin stepped by ferry's kernel.
struct WrappedPerceptron {
  WrappedPerceptron(uint64_t seed, int64_t in, int64_t hidden, int64_t out, const Config& config = perceptron_config())
      : config(config),
        ref(seeded(seed, in, hidden, out)),
        net(seeded(seed, in, hidden, out)),
        model(net.ptr(), config),
        adam(model, adamw(1e-3)),
        twin(*ref, adamw(1e-3), config) {}
  static Perceptron seeded(uint64_t seed, int64_t in, int64_t hidden, int64_t out) {
    torch::manual_seed(seed);
    return Perceptron(in, hidden, out);
  }
  // Every master equals the twin's parameter, bit for bit.
  void expect_masters_as_twin(const std::string& what) { expect_masters_as(adam, model, *ref, what); }
  const Config config;
  Perceptron ref, net;
  ChunkedModel model;
  HybridAdam adam;
  test::CpuAdamTwin twin;
};

}  // namespace ferry::test
