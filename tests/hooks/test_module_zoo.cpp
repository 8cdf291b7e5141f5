// Stock LibTorch modules that test_chunked_model.cpp's models do not use, each wrapped unmodified in a
// ChunkedModel on the simulated device under a budget of two of its largest chunks (evictions every
// iteration), against its unwrapped twin: the same loss and gradients for three iterations (the warm-up
// that traces, the repack, and a steady one), and the parameters given back unchanged at the end.
// Each one reaches its weights differently: sliced views (MultiheadAttention's packed projection), one
// op over every weight (GRU), a parameter read once per time step (RNNCell), a parameter list indexed
// in forward, an elementwise parameter (PReLU), bags and transposed convolutions, and writes inside
// forward (Embedding's max_norm, a user's clamp). Each also trains under HybridAdam, bit-identical to
// the twin under ferry's CpuAdam.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "../../chunk/stream_model_engine.h"
#include "../../hooks/chunked_model.h"
#include "../../optim/hybrid_adam.h"
#include "../cpu_adam_twin.h"
#include "module_twins.h"

namespace ferry {
namespace {

using test::expect_close;
using test::largest_chunk_bytes;

// Builds the module from a seed; the loss of one iteration on fixed inputs.
using Make = std::function<std::shared_ptr<torch::nn::Module>()>;
using Loss = std::function<torch::Tensor(torch::nn::Module&)>;

// Twin modules from one seed; ferry's under evictions; three iterations compared, then the values given
// back. Between iterations a plain SGD update goes to both (in place, under NoGradGuard: ops on ferry's
// parameters outside its scopes, D57). With `lagging`, ferry's copies stay in flight as on a CUDA copy
// stream, the host learning late that they are done (chunk/stream_model_engine.h).
void check_module_once(const std::string& name, const Make& make, const Loss& loss_of, int64_t chunk, bool lagging) {
  SCOPED_TRACE(name + (lagging ? " (copies in flight)" : " (synchronous copies)"));
  torch::manual_seed(5);
  std::shared_ptr<torch::nn::Module> ref = make();
  torch::manual_seed(5);
  std::shared_ptr<torch::nn::Module> net = make();
  // The smallest budget the model's largest op can run with (one op may need several chunks at once:
  // GRU's), found on a third twin, and at least two of the largest chunks.
  int64_t budget = 2 * largest_chunk_bytes(*net, chunk);
  {
    torch::manual_seed(5);
    std::shared_ptr<torch::nn::Module> probe = make();
    ChunkedModel probing(probe, test::tiny_config(chunk, 0));
    probing.backward(probing.forward([&] { return loss_of(*probe); }));
    budget = std::max(budget, probing.last_iteration().working_set_peak_bytes);
  }
  {
    ChunkedModelOptions options;
    if (lagging) options.copy_engine = [] { return std::make_unique<StreamModelCopyEngine>(); };
    ChunkedModel model(net, test::tiny_config(chunk, budget), std::move(options));
    int64_t total = 0;
    for (int64_t c = 0; c < model.layout().num_chunks(); ++c) {
      total += model.store().chunk_info(model.param_chunk(c)).nbytes;
    }
    ASSERT_LT(budget, total) << "the test needs evictions: a larger model or a smaller chunk";
    for (int it = 0; it < 3; ++it) {
      const std::string what = name + " iteration " + std::to_string(it);
      for (auto* m : {ref.get(), net.get()}) {
        for (auto& p : m->parameters()) {
          if (p.grad().defined()) p.mutable_grad().reset();
        }
      }
      torch::manual_seed(100 + it);
      const torch::Tensor loss_ref = loss_of(*ref);
      loss_ref.backward();
      torch::manual_seed(100 + it);
      const torch::Tensor loss = model.forward([&] { return loss_of(*net); });
      model.backward(loss);
      expect_close(loss, loss_ref, what + " loss");
      const auto pr = ref->named_parameters(), pn = net->named_parameters();
      for (const auto& item : pr) expect_close(pn[item.key()].grad(), item.value().grad(), what + " grad of " + item.key());
      if (it >= 1) {
        EXPECT_GT(model.last_iteration().evictions, 0) << what;
      }
      EXPECT_LE(model.store().stats().device.peak_bytes, budget) << what;
      torch::NoGradGuard no_grad;
      for (auto* m : {ref.get(), net.get()}) {
        for (auto& p : m->parameters()) {
          if (p.grad().defined()) p.sub_(p.grad(), 0.1);
        }
      }
    }
  }
  const auto pr = ref->named_parameters(), pn = net->named_parameters();
  for (const auto& item : pr) expect_close(pn[item.key()], item.value(), name + " value of " + item.key());
}

// Trained by HybridAdam's pipelined step (backward_step: gradients in the parameter slots, each chunk
// updated as soon as its gradients are final, state split between the device and the host) against
// the unwrapped twin updated by ferry's CpuAdam, parameter by parameter: the same kernel on the same
// values, so every loss and every final value must be the same bits (D30). Four steps: the warm-up,
// the repack and placement, and two pipelined ones.
void check_module_trained(const std::string& name, const Make& make, const Loss& loss_of, int64_t chunk) {
  SCOPED_TRACE(name + " (HybridAdam)");
  torch::manual_seed(5);
  std::shared_ptr<torch::nn::Module> ref = make();
  torch::manual_seed(5);
  std::shared_ptr<torch::nn::Module> net = make();
  Config config = test::tiny_config(chunk, 0);
  config.precision = Precision::kFp32;
  AdamOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  test::CpuAdamTwin ref_adam(*ref, o, config);
  ChunkedModel model(net, config);
  HybridAdamOptions options(o);
  options.device_state_chunks = model.layout().num_chunks() / 2;  // the rest on the host
  HybridAdam adam(model, options);
  for (int step = 0; step < 4; ++step) {
    ref_adam.zero_grad();
    torch::manual_seed(100 + step);
    const torch::Tensor loss_ref = loss_of(*ref);
    loss_ref.backward();
    ref_adam.step();
    torch::manual_seed(100 + step);
    const torch::Tensor loss = model.forward([&] { return loss_of(*net); });
    adam.backward_step(loss);
    EXPECT_TRUE(torch::equal(loss, loss_ref)) << name << " step " << step << ": " << loss.item<double>() << " vs "
                                              << loss_ref.item<double>();
  }
  EXPECT_GT(adam.device_state_chunks(), 0);
  EXPECT_LT(adam.device_state_chunks(), model.layout().num_chunks());
  const auto pr = ref->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), pr[model.param_name(p)])) << name << " master of " << model.param_name(p);
  }
}

void check_module(const std::string& name, const Make& make, const Loss& loss_of, int64_t chunk = 4 << 10) {
  check_module_once(name, make, loss_of, chunk, /*lagging=*/false);
  check_module_once(name, make, loss_of, chunk, /*lagging=*/true);
  check_module_trained(name, make, loss_of, chunk);
}

struct AttentionImpl : torch::nn::Module {
  AttentionImpl() {
    mha = register_module("mha", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(32, 4)));
    up = register_module("up", torch::nn::Linear(32, 128));
    down = register_module("down", torch::nn::Linear(128, 32));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // (L, N, E)
    auto [attended, weights] = mha(x, x, x);
    return down(torch::gelu(up(attended))).pow(2).mean() + weights.mean();
  }
  torch::nn::MultiheadAttention mha{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(Attention);

TEST(ModuleZoo, MultiheadAttentionSlicesItsPackedProjection) {
  check_module(
      "MultiheadAttention", [] { return Attention().ptr(); },
      [](torch::nn::Module& m) { return dynamic_cast<AttentionImpl&>(m).forward(torch::randn({6, 3, 32})); });
}

struct TaggerImpl : torch::nn::Module {
  TaggerImpl() {
    gru = register_module("gru", torch::nn::GRU(torch::nn::GRUOptions(8, 16).num_layers(2).bidirectional(true)));
    head = register_module("head", torch::nn::Linear(32, 96));
    out = register_module("out", torch::nn::Linear(96, 32));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(torch::relu(head(std::get<0>(gru(x))))); }
  torch::nn::GRU gru{nullptr};
  torch::nn::Linear head{nullptr}, out{nullptr};
};
TORCH_MODULE(Tagger);

TEST(ModuleZoo, BidirectionalGruRunsOneOpOverEveryWeight) {
  check_module(
      "GRU", [] { return Tagger().ptr(); },
      [](torch::nn::Module& m) { return dynamic_cast<TaggerImpl&>(m).forward(torch::randn({5, 3, 8})).tanh().sum(); });
}

struct RecurrentImpl : torch::nn::Module {
  RecurrentImpl() {
    cell = register_module("cell", torch::nn::RNNCell(torch::nn::RNNCellOptions(16, 64)));
    head = register_module("head", torch::nn::Linear(64, 64));
    out = register_module("out", torch::nn::Linear(64, 3));
    scales = register_parameter("scales", torch::ones({4, 64}));
  }
  torch::Tensor forward(const torch::Tensor& seq) {  // (T, N, 16): the cell's weights read T times
    torch::Tensor h = torch::zeros({seq.size(1), 64});
    for (int64_t t = 0; t < seq.size(0); ++t) h = cell(seq[t], h) * scales[t % 4];
    return out(torch::relu(head(h)));
  }
  torch::nn::RNNCell cell{nullptr};
  torch::nn::Linear head{nullptr}, out{nullptr};
  torch::Tensor scales;
};
TORCH_MODULE(Recurrent);

TEST(ModuleZoo, RnnCellReadOncePerStepAndAnIndexedParameter) {
  check_module(
      "RNNCell", [] { return Recurrent().ptr(); },
      [](torch::nn::Module& m) {
        auto& r = dynamic_cast<RecurrentImpl&>(m);
        return torch::nn::functional::cross_entropy(r.forward(torch::randn({7, 4, 16})), torch::randint(0, 3, {4}));
      });
}

struct ConvStackImpl : torch::nn::Module {
  ConvStackImpl() {
    down = register_module("down", torch::nn::Conv1d(torch::nn::Conv1dOptions(8, 64, 3).stride(2).padding(1)));
    norm = register_module("norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(4, 64)));
    act = register_module("act", torch::nn::PReLU(torch::nn::PReLUOptions().num_parameters(64)));
    up = register_module("up",
                         torch::nn::ConvTranspose1d(torch::nn::ConvTranspose1dOptions(64, 8, 4).stride(2).padding(1)));
    mix = register_module("mix", torch::nn::Bilinear(torch::nn::BilinearOptions(8, 8, 16)));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // (N, 8, L)
    torch::Tensor y = up(act(norm(down(x))));
    const torch::Tensor a = y.transpose(1, 2), b = x.transpose(1, 2);
    return mix(a.contiguous(), b.contiguous());
  }
  torch::nn::Conv1d down{nullptr};
  torch::nn::GroupNorm norm{nullptr};
  torch::nn::PReLU act{nullptr};
  torch::nn::ConvTranspose1d up{nullptr};
  torch::nn::Bilinear mix{nullptr};
};
TORCH_MODULE(ConvStack);

TEST(ModuleZoo, TransposedConvGroupNormPreluBilinear) {
  check_module(
      "ConvStack", [] { return ConvStack().ptr(); },
      [](torch::nn::Module& m) { return dynamic_cast<ConvStackImpl&>(m).forward(torch::randn({2, 8, 12})).pow(2).mean(); });
}

struct BagsImpl : torch::nn::Module {
  BagsImpl() {
    bag = register_module("bag", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(200, 16).mode(torch::kMean)));
    head = register_module("head", torch::nn::Linear(16, 200));
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& offsets) { return head(bag(ids, offsets)); }
  torch::nn::EmbeddingBag bag{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Bags);

TEST(ModuleZoo, EmbeddingBagWithOffsets) {
  check_module(
      "EmbeddingBag", [] { return Bags().ptr(); },
      [](torch::nn::Module& m) {
        const auto ids = torch::randint(0, 200, {20}, torch::kLong);
        const auto offsets = torch::tensor({0, 3, 9, 15}, torch::kLong);
        return torch::nn::functional::cross_entropy(dynamic_cast<BagsImpl&>(m).forward(ids, offsets),
                                                    torch::randint(0, 200, {4}, torch::kLong));
      });
}

// Embedding(max_norm) renormalises the rows it looks up in place, inside forward, under no_grad: a
// write by torch itself (Note [Writes to parameters]).
struct RenormedImpl : torch::nn::Module {
  RenormedImpl() {
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(200, 16).max_norm(1.0)));
    head = register_module("head", torch::nn::Linear(16, 200));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(emb(ids)); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Renormed);

TEST(ModuleZoo, EmbeddingWithMaxNormRenormalisesInPlace) {
  check_module(
      "Embedding(max_norm)", [] { return Renormed().ptr(); },
      [](torch::nn::Module& m) {
        const auto ids = torch::randint(0, 200, {4, 6}, torch::kLong);
        return torch::nn::functional::cross_entropy(dynamic_cast<RenormedImpl&>(m).forward(ids).reshape({-1, 200}),
                                                    torch::randint(0, 200, {24}, torch::kLong));
      });
}

TEST(ModuleZoo, TransformerEncoderLayers) {
  check_module(
      "TransformerEncoder",
      [] {
        torch::nn::TransformerEncoderLayer layer(
            torch::nn::TransformerEncoderLayerOptions(32, 4).dim_feedforward(64).dropout(0.0));
        return torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(layer, 2)).ptr();
      },
      [](torch::nn::Module& m) {
        auto& enc = dynamic_cast<torch::nn::TransformerEncoderImpl&>(m);
        return enc.forward(torch::randn({5, 2, 32})).pow(2).mean();
      });
}

// What users' training code does to weights inside forward: clamps one in place under NoGradGuard (a
// WGAN critic's clipping), reads another through detach() for a norm that scales the output (weight
// normalisation done by hand), and adds an L2 penalty over every parameter to the loss.
struct HabitsImpl : torch::nn::Module {
  HabitsImpl() {
    a = register_module("a", torch::nn::Linear(32, 32));
    b = register_module("b", torch::nn::Linear(32, 32));
    d = register_module("d", torch::nn::Linear(32, 32));
    c = register_module("c", torch::nn::Linear(32, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    {
      torch::NoGradGuard no_grad;
      b->weight.clamp_(-0.05, 0.05);
    }
    const torch::Tensor scale = 1.0 / (c->weight.detach().norm() + 1.0);
    torch::Tensor y = c(d(torch::tanh(b(torch::relu(a(x)))))) * scale;
    torch::Tensor l2 = torch::zeros({});
    for (const auto& p : parameters()) l2 = l2 + p.pow(2).sum();
    return y.pow(2).mean() + 1e-3 * l2;
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, d{nullptr}, c{nullptr};
};
TORCH_MODULE(Habits);

TEST(ModuleZoo, InPlaceClampDetachedNormAndAnL2PenaltyInForward) {
  check_module(
      "Habits", [] { return Habits().ptr(); },
      [](torch::nn::Module& m) { return dynamic_cast<HabitsImpl&>(m).forward(torch::randn({4, 32})); });
}

}  // namespace
}  // namespace ferry
