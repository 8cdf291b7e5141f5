// ferry::checkpoint: gradients with checkpointed blocks equal plain ones, unwrapped and inside a
// ChunkedModel whose budget forces the recompute to bring evicted chunks back, with dropout and under
// autocast too; and the checkpointed forward keeps fewer tensors alive.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <set>
#include <string>
#include <utility>

#include "../../hooks/checkpoint.h"
#include "../../hooks/chunked_model.h"
#include "../test_util.h"

namespace ferry {
namespace {

struct MlpStackImpl : torch::nn::Module {
  explicit MlpStackImpl(int64_t d) {
    for (int i = 0; i < 4; ++i) {
      ln.push_back(register_module("ln" + std::to_string(i), torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}))));
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(d, 2 * d)));
      out.push_back(register_module("out" + std::to_string(i), torch::nn::Linear(2 * d, d)));
    }
  }
  torch::Tensor block(int i, const torch::Tensor& x) {
    torch::Tensor h = torch::gelu(fc[i](ln[i](x)));
    if (dropout > 0) h = torch::dropout(h, dropout, is_training());
    const torch::Tensor y = out[i](h);
    return x + (gain.defined() ? y * gain : y);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < 4; ++i) {
      if (use_checkpoint) {
        x = checkpoint([this, i](const std::vector<at::Tensor>& in) { return block(i, in[0]); }, {x});
      } else {
        x = block(i, x);
      }
    }
    return x.pow(2).mean();
  }
  bool use_checkpoint = false;
  double dropout = 0;
  torch::Tensor gain;  // defined: a tensor every block captures (not a parameter, not an input)
  std::vector<torch::nn::LayerNorm> ln;
  std::vector<torch::nn::Linear> fc, out;
};
TORCH_MODULE(MlpStack);

// A plain MlpStack and its checkpointed twin, with the same initial values.
std::pair<MlpStack, MlpStack> twins(uint64_t seed) {
  torch::manual_seed(seed);
  MlpStack plain(16);
  torch::manual_seed(seed);
  MlpStack ckpt(16);
  ckpt->use_checkpoint = true;
  return {plain, ckpt};
}

// The simulated device, 4 KiB chunks, this device budget (0: none).
Config simulated(int64_t budget) {
  Config c;
  c.device = DeviceKind::kSimulated;
  c.chunk_size_bytes = 4 << 10;
  c.device_budget_bytes = budget;
  return c;
}

void expect_same_grads(MlpStack& a, MlpStack& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& item : pa) {
    ASSERT_TRUE(pb[item.key()].grad().defined()) << item.key();
    EXPECT_TRUE(torch::allclose(pb[item.key()].grad(), item.value().grad(), 1e-6, 1e-7)) << item.key();
  }
}

TEST(Checkpoint, GradsEqualPlainUnwrapped) {
  const auto pair = twins(1);
  MlpStack plain = pair.first, ckpt = pair.second;
  auto x = torch::randn({4, 8, 16});
  auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
  plain->forward(x1).backward();
  ckpt->forward(x2).backward();
  expect_same_grads(plain, ckpt);
  EXPECT_TRUE(torch::allclose(x1.grad(), x2.grad(), 1e-6, 1e-7)) << "input grads flow through";
}

TEST(Checkpoint, GradsEqualPlainInsideChunkedModelUnderEvictions) {
  const auto pair = twins(2);
  MlpStack plain = pair.first, ckpt = pair.second;
  ChunkedModel model(ckpt.ptr(), simulated(3 * (4 << 10)));
  auto x = torch::randn({4, 8, 16});
  for (int it = 0; it < 3; ++it) {  // warm-up, then the trace (which includes the recompute) is followed
    for (auto& p : plain->parameters()) p.mutable_grad().reset();
    for (auto& p : ckpt->parameters()) p.mutable_grad().reset();
    auto ref = plain->forward(x);
    ref.backward();
    auto loss = model.forward([&] { return ckpt->forward(x); });
    model.backward(loss);
    EXPECT_TRUE(torch::allclose(loss, ref, 1e-6, 1e-7));
    const IterationStats stats = model.last_iteration();
    EXPECT_GT(stats.evictions, 0) << "the budget must force the recompute to bring chunks back";
    EXPECT_FALSE(stats.diverged) << "iteration " << it;
    expect_same_grads(plain, ckpt);
  }
}

// Note [The recompute replays the forward's randomness and autocast]: a dropout inside a checkpointed
// block drew a new mask in the recompute, so the gradients were those of another network (probed:
// 1.6 off). Now the recompute starts the generator where the first run did, and gives it back its
// state after, so the training's random stream is the plain model's too. Inside a ChunkedModel under
// evictions: the same gradients, and the same next random number, as the plain model.
TEST(Checkpoint, ADropoutDrawsTheSameMaskInTheRecompute) {
  auto pair = twins(4);
  MlpStack plain = pair.first, ckpt = pair.second;
  plain->dropout = ckpt->dropout = 0.3;
  ChunkedModel model(ckpt.ptr(), simulated(3 * (4 << 10)));
  const auto x = torch::randn({4, 8, 16});
  for (int it = 0; it < 3; ++it) {
    for (auto& p : plain->parameters()) p.mutable_grad().reset();
    for (auto& p : ckpt->parameters()) p.mutable_grad().reset();
    torch::manual_seed(100 + it);
    auto ref = plain->forward(x);
    ref.backward();
    const torch::Tensor next_ref = torch::rand({4});
    torch::manual_seed(100 + it);
    auto loss = model.forward([&] { return ckpt->forward(x); });
    model.backward(loss);
    const torch::Tensor next = torch::rand({4});
    EXPECT_TRUE(torch::equal(loss, ref)) << "iteration " << it;
    expect_same_grads(plain, ckpt);
    EXPECT_TRUE(torch::equal(next, next_ref)) << "iteration " << it << ": the recompute drew from the stream";
  }
}

// The same Note: a forward under autocast (CPU, bf16) whose backward runs outside it, as torch
// recommends. The recompute ran in fp32 what the first run ran in bf16 (probed: 7e-3 off). Now it runs
// under the forward's autocast state, and the caller's state is as it was after backward.
TEST(Checkpoint, TheRecomputeRunsUnderTheForwardsAutocast) {
  auto pair = twins(5);
  MlpStack plain = pair.first, ckpt = pair.second;
  const auto x = torch::randn({4, 8, 16});
  auto forward_autocast = [](MlpStack& m, const torch::Tensor& in) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    torch::Tensor loss = m->forward(in);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    return loss;
  };
  const torch::Tensor ref = forward_autocast(plain, x);
  ref.backward();
  const torch::Tensor loss = forward_autocast(ckpt, x);
  loss.backward();
  EXPECT_TRUE(torch::equal(loss, ref));
  auto pa = plain->named_parameters(), pb = ckpt->named_parameters();
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::equal(pb[item.key()].grad(), item.value().grad())) << item.key();
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "the caller's autocast state, after backward";
}

// Note [A backward that creates a graph through a checkpoint]: a gradient penalty (the input gradient,
// made with create_graph, in the loss) through four checkpointed blocks inside a ChunkedModel under
// evictions. The segments' gradients used to carry no graph, so the penalty lost every term through
// them (0.36 off). Now the same loss and gradients as the plain model, whose earlier blocks' terms
// reach them through the later blocks' inputs.
TEST(Checkpoint, AGradientPenaltyThroughSegmentsMatchesThePlainModel) {
  auto pair = twins(6);
  MlpStack plain = pair.first, ckpt = pair.second;
  ChunkedModel model(ckpt.ptr(), simulated(3 * (4 << 10)));
  auto penalized = [](MlpStack& m, const torch::Tensor& x) {
    const torch::Tensor xi = x.clone().requires_grad_(true);
    const torch::Tensor d = m->forward(xi);
    const torch::Tensor g = torch::autograd::grad({d}, {xi}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return d + 10 * g.pow(2).sum();
  };
  const auto x = torch::randn({4, 8, 16});
  for (int it = 0; it < 3; ++it) {
    for (auto& p : plain->parameters()) p.mutable_grad().reset();
    for (auto& p : ckpt->parameters()) p.mutable_grad().reset();
    const torch::Tensor ref = penalized(plain, x);
    ref.backward();
    const torch::Tensor loss = model.forward([&] { return penalized(ckpt, x); });
    model.backward(loss);
    EXPECT_TRUE(torch::allclose(loss, ref, 1e-6, 1e-7)) << "iteration " << it;
    expect_same_grads(plain, ckpt);
    EXPECT_GT(model.last_iteration().evictions, 0) << "iteration " << it;
  }
}

// The same Note, where the segment's gradients come from a nested backward (no ChunkedModel records
// its parameters): a backward that creates a graph through it, and autograd::grad() through it, are
// refused, naming the remedy, before anything is accumulated (they used to give a penalty 4 off, and
// to accumulate the parameters' gradients into .grad where the caller asked for the input's only). A
// plain backward through it still works.
TEST(Checkpoint, WithoutRecordedParametersADifferentiatedOrSelectiveBackwardIsRefused) {
  auto pair = twins(7);
  MlpStack plain = pair.first, ckpt = pair.second;
  const torch::Tensor xi = torch::randn({4, 8, 16}).requires_grad_(true);
  const std::string penalty = test::error_of([&] {
    (void)torch::autograd::grad({ckpt->forward(xi)}, {xi}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  });
  EXPECT_NE(penalty.find("ferry::checkpoint: a backward that creates a graph (create_graph, as a gradient "
                         "penalty's) through a checkpointed segment needs the segment's parameters recorded"),
            std::string::npos)
      << penalty;
  EXPECT_NE(penalty.find("no parameters were recorded (no ChunkedModel)"), std::string::npos) << penalty;
  const std::string selective = test::error_of([&] { (void)torch::autograd::grad({ckpt->forward(xi)}, {xi}); });
  EXPECT_NE(selective.find("ferry::checkpoint: autograd::grad() (or a backward given `inputs`) through a "
                           "checkpointed segment"),
            std::string::npos)
      << selective;
  for (const auto& p : ckpt->parameters()) EXPECT_FALSE(p.grad().defined()) << "nothing accumulated";
  EXPECT_FALSE(xi.grad().defined());
  ckpt->forward(xi).backward();
  plain->forward(xi.detach()).backward();
  expect_same_grads(plain, ckpt);
}

// A block with several outputs (the second overload): its hidden state, an auxiliary loss (a mixture
// of experts' balance loss), an output the loss does not use and an integer one (argmax indices, which
// need no gradient). Inside a ChunkedModel under evictions and unwrapped: the loss and the gradients
// of the plain stack.
TEST(Checkpoint, ABlockWithSeveralOutputsMatchesThePlainModel) {
  auto run = [](MlpStack& m, torch::Tensor x, bool use_checkpoint) {
    torch::Tensor aux = torch::zeros({});
    for (int i = 0; i < 4; ++i) {
      auto body = [&m, i](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
        const torch::Tensor h = m->block(i, in[0]);
        return {h, h.pow(2).mean(), h.sum(-1), h.argmax(-1)};
      };
      const std::vector<at::Tensor> outs = use_checkpoint ? checkpoint(body, {x}) : body({x});
      EXPECT_EQ(outs.size(), 4u);
      EXPECT_FALSE(outs[3].requires_grad()) << "an integer output";
      x = outs[0];
      aux = aux + 0.1 * outs[1];
    }
    return x.pow(2).mean() + aux;
  };
  for (const bool wrapped : {true, false}) {
    auto pair = twins(9);
    MlpStack plain = pair.first, ckpt = pair.second;
    std::unique_ptr<ChunkedModel> model;
    if (wrapped) model = std::make_unique<ChunkedModel>(ckpt.ptr(), simulated(3 * (4 << 10)));
    const auto x = torch::randn({4, 8, 16});
    for (int it = 0; it < 2; ++it) {
      const std::string what = std::string(wrapped ? "wrapped" : "unwrapped") + ", iteration " + std::to_string(it);
      for (auto& p : plain->parameters()) p.mutable_grad().reset();
      for (auto& p : ckpt->parameters()) p.mutable_grad().reset();
      const torch::Tensor ref = run(plain, x, false);
      ref.backward();
      torch::Tensor loss;
      if (wrapped) {
        loss = model->forward([&] { return run(ckpt, x, true); });
        model->backward(loss);
      } else {
        loss = run(ckpt, x, true);
        loss.backward();
      }
      EXPECT_TRUE(torch::allclose(loss, ref, 1e-6, 1e-7)) << what;
      expect_same_grads(plain, ckpt);
    }
  }
}

// A frozen stack (a perceptual loss's feature network) needs no recorded parameters: its recomputed
// graph reaches only the inputs, so autograd::grad through it, and its second order, work unwrapped
// and equal the plain stack's.
TEST(Checkpoint, AFrozenSegmentServesAutogradGradWithoutAChunkedModel) {
  auto pair = twins(8);
  MlpStack plain = pair.first, ckpt = pair.second;
  for (auto* m : {&plain, &ckpt}) {
    for (auto& p : (*m)->parameters()) p.set_requires_grad(false);
  }
  const torch::Tensor xi = torch::randn({4, 8, 16}).requires_grad_(true);
  auto second_order = [&](MlpStack& m) {
    const torch::Tensor g = torch::autograd::grad({m->forward(xi)}, {xi}, {}, /*retain_graph=*/true,
                                                  /*create_graph=*/true)[0];
    return std::make_pair(g, torch::autograd::grad({g.pow(2).sum()}, {xi})[0]);
  };
  const auto ref = second_order(plain);
  std::pair<torch::Tensor, torch::Tensor> got;
  ASSERT_NO_THROW(got = second_order(ckpt));
  EXPECT_TRUE(torch::allclose(got.first, ref.first, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(got.second, ref.second, 1e-6, 1e-7));
}

// Note [Checkpoint parameters as inputs]: a block that captures a tensor requiring grad (neither an
// input nor a wrapped parameter) must not lose its gradient: the segment falls back to the nested
// backward, says so once, and every gradient, the captured tensor's too, equals the plain model's.
TEST(Checkpoint, ACapturedTensorStillGetsItsGradientInsideChunkedModel) {
  const auto pair = twins(4);
  MlpStack plain = pair.first, ckpt = pair.second;
  plain->gain = torch::full({16}, 0.5).requires_grad_(true);
  ckpt->gain = torch::full({16}, 0.5).requires_grad_(true);
  ChunkedModel model(ckpt.ptr(), simulated(0));
  const auto x = torch::randn({4, 8, 16});
  plain->forward(x).backward();
  testing::internal::CaptureStderr();
  model.backward(model.forward([&] { return ckpt->forward(x); }));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("ferry::checkpoint: the segment uses a tensor that requires grad and is neither among its "
                     "inputs nor a wrapped module's parameter"),
            std::string::npos)
      << err;
  expect_same_grads(plain, ckpt);
  ASSERT_TRUE(ckpt->gain.grad().defined());
  EXPECT_TRUE(torch::allclose(ckpt->gain.grad(), plain->gain.grad(), 1e-6, 1e-7));
}

TEST(Checkpoint, WithoutGradModeIsAPlainCall) {
  torch::NoGradGuard no_grad;
  auto x = torch::randn({3});
  auto y = checkpoint([](const std::vector<at::Tensor>& in) { return in[0] * 2; }, {x});
  EXPECT_TRUE(torch::equal(y, x * 2));
  EXPECT_FALSE(y.requires_grad());
  EXPECT_THROW(checkpoint(CheckpointFn(), {x}), c10::Error);
  EXPECT_THROW(checkpoint(CheckpointFns(), {x}), c10::Error);
}

// An undefined input (an optional mask or bias not given) reaches fn undefined in the first run and in
// the recompute, at its place; it used to fail in autograd with a raw "tensor does not have a device".
// The same input twice, and one that needs no gradient, beside it. Wrapped and unwrapped: the
// gradients of the plain computation.
TEST(Checkpoint, AnUndefinedInputReachesFnUndefinedAtItsPlace) {
  for (const bool wrapped : {false, true}) {
    SCOPED_TRACE(wrapped ? "wrapped" : "unwrapped");
    torch::manual_seed(3);
    torch::nn::Linear ref(8, 8);
    torch::manual_seed(3);
    torch::nn::Linear net(8, 8);
    std::unique_ptr<ChunkedModel> model;
    if (wrapped) model = std::make_unique<ChunkedModel>(net.ptr(), simulated(0));
    const torch::Tensor x = torch::randn({2, 8}, torch::requires_grad()), mask = torch::rand({2, 8});
    const torch::Tensor x_ref = x.detach().clone().requires_grad_(true);
    (ref(x_ref) * ref(x_ref) * mask).sum().backward();
    int undefined_seen = 0;
    auto body = [&](const std::vector<at::Tensor>& in) {
      EXPECT_EQ(in.size(), 4u);
      undefined_seen += !in[2].defined();
      return (net(in[0]) * net(in[1]) * in[3]).sum();
    };
    auto run = [&] { return checkpoint(body, {x, x, torch::Tensor(), mask}); };
    if (wrapped) {
      model->backward(model->forward(run));
    } else {
      run().backward();
    }
    EXPECT_EQ(undefined_seen, 2) << "the first run and the recompute";
    EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-6, 1e-7));
    EXPECT_TRUE(torch::allclose(net->weight.grad(), ref->weight.grad(), 1e-6, 1e-7));
    EXPECT_TRUE(torch::allclose(net->bias.grad(), ref->bias.grad(), 1e-6, 1e-7));
  }
}

// What fn returns is checked: at least one tensor, every one defined, and as many in the recompute as
// in the first run; each refusal says which.
TEST(Checkpoint, FunctionsThatReturnTheWrongTensorsAreRefused) {
  const auto x = torch::randn({3}, torch::requires_grad());
  const std::string none = test::error_of([&] {
    (void)checkpoint([](const std::vector<at::Tensor>&) { return std::vector<at::Tensor>{}; }, {x});
  });
  EXPECT_NE(none.find("ferry: checkpoint: fn returned no tensor"), std::string::npos) << none;
  const std::string undefined = test::error_of([&] {
    (void)checkpoint([](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0] * 2, {}}; }, {x});
  });
  EXPECT_NE(undefined.find("ferry: checkpoint: fn returned an undefined tensor (output 1 of 2)"), std::string::npos)
      << undefined;
  int calls = 0;
  const std::vector<at::Tensor> outs = checkpoint(
      [&calls](const std::vector<at::Tensor>& in) {
        return ++calls == 1 ? std::vector<at::Tensor>{in[0] * 2, in[0] * 3} : std::vector<at::Tensor>{in[0] * 2};
      },
      {x});
  const std::string changed = test::error_of([&] { (outs[0] + outs[1]).sum().backward(); });
  EXPECT_NE(changed.find("ferry::checkpoint: fn returned 1 tensors in the recompute and 2 in the first run"),
            std::string::npos)
      << changed;
}

int64_t graph_nodes(const torch::Tensor& root) {
  int64_t nodes = 0;
  std::vector<torch::autograd::Node*> stack{root.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n).second) continue;
    ++nodes;
    for (const auto& e : n->next_edges()) stack.push_back(e.function.get());
  }
  return nodes;
}

TEST(Checkpoint, KeepsOnlyTheBlockInputs) {
  // What a checkpointed forward keeps for backward: one node per block holding its input, instead of
  // every LayerNorm/Linear/GELU node with its saved activations.
  torch::manual_seed(3);
  MlpStack net(16);
  auto x = torch::randn({4, 8, 16}, torch::requires_grad());
  const int64_t plain = graph_nodes(net->forward(x));
  net->use_checkpoint = true;
  const int64_t ckpt = graph_nodes(net->forward(x));
  // 4 checkpoint nodes + their 4 anchors' accumulators + pow + mean + x's accumulator.
  EXPECT_EQ(ckpt, 4 + 4 + 2 + 1);
  EXPECT_GE(plain, 4 * 8) << "each plain block keeps its ops (and their activations)";
}

}  // namespace
}  // namespace ferry
