#pragma once
// The model and data of the data-parallel tests: the worker (dist_worker.cpp) trains it through ferry,
// and test_dist.cpp builds the same module unwrapped as a reference that is not ferry.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "../../hooks/checkpoint.h"
#include "../../hooks/skip_hint.h"

namespace ferry::test {

constexpr int64_t kVocab = 32, kDim = 16, kSeq = 8;

struct SmallLmImpl : torch::nn::Module {
  SmallLmImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    up = register_module("up", torch::nn::Linear(kDim, 4 * kDim));
    down = register_module("down", torch::nn::Linear(4 * kDim, kDim));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
    spare = register_parameter("spare", torch::randn({kDim}));  // never used: no rank lands a gradient
  }
  // frozen: the MLP gets no gradient from these rows (its output is detached). checkpointed: the MLP
  // runs as two ferry::checkpoint segments (up + gelu, down), the activation plan's candidates.
  // skip_mlp: the MLP does not run (a block LayerDrop skips); say_skip: said ahead (ferry::will_skip).
  torch::Tensor forward(const torch::Tensor& idx, bool frozen = false) {
    if (skip_mlp && say_skip) {
      ferry::will_skip(*up);
      ferry::will_skip(*down);
    }
    auto x = emb(idx);
    if (use_spare) x = x + spare;
    if (skip_mlp) return head(norm(x));
    torch::Tensor mlp;
    if (checkpointed) {
      auto h = ferry::checkpoint([this](const std::vector<at::Tensor>& in) { return torch::gelu(up(in[0])); }, {x});
      mlp = ferry::checkpoint([this](const std::vector<at::Tensor>& in) { return down(in[0]); }, {h});
    } else {
      mlp = down(torch::gelu(up(x)));
    }
    x = x + (frozen ? mlp.detach() : mlp);
    return head(norm(x));
  }
  bool use_spare = false;
  bool checkpointed = false;
  bool skip_mlp = false, say_skip = false;
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr}, head{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::Tensor spare;
};
TORCH_MODULE(SmallLm);

// The initial values every rank trains from: rank 0's (each rank builds its module from seed 7 + rank,
// on purpose, and ferry makes rank 0's values win).
constexpr uint64_t kRank0Seed = 7;

// The global batch of step `step` (B rows of kSeq tokens) and its targets: rank r of N takes rows
// [r B/N, (r+1) B/N).
struct Batch {
  torch::Tensor idx, target;
};
inline Batch global_batch(int step, int64_t batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  const torch::Tensor idx = torch::randint(kVocab, {batch, kSeq}, gen, torch::kLong);
  return {idx, (idx * 5 + 1) % kVocab};
}

// The mean cross-entropy of the rows `idx` (as the worker computes it with emulate-world 1).
inline torch::Tensor lm_loss(SmallLm& net, const torch::Tensor& idx, const torch::Tensor& target, bool frozen = false) {
  return torch::nn::functional::cross_entropy(net->forward(idx, frozen).reshape({-1, kVocab}), target.reshape({-1}));
}

}  // namespace ferry::test
