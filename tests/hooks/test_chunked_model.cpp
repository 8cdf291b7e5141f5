// ChunkedModel on unmodified LibTorch models, on the simulated device with budgets small enough to
// force evictions every iteration: losses and gradients equal the unwrapped model's (same seed, same
// inputs), the chunk budget is never exceeded, and the special cases users hit (tied weights, a
// submodule called twice, frozen and unused parameters, evaluation under NoGradGuard, an exception in
// forward, a budget smaller than one op) behave.
#include <gtest/gtest.h>

#include <sstream>
#include <unistd.h>
#include <sys/stat.h>
#include <fstream>
#include <torch/torch.h>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <chrono>
#include <iostream>
#include <random>
#include <utility>
#include <functional>
#include <thread>

#include "../../chunk/out_of_memory.h"
#include "../../chunk/stream_model_engine.h"
#include "../../common/event_trace.h"
#include "../../hooks/chunked_model.h"
#include "../../hooks/interceptor.h"
#include "../../hooks/skip_hint.h"
#include "../test_util.h"
#include "../trace_check.h"
#include "module_twins.h"

namespace ferry {
namespace {

// ---- models (ordinary torch::nn modules, nothing ferry-specific)

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc = register_module("fc", torch::nn::Linear(d, 4 * d));
    out = register_module("out", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    auto q_k_v = qkv(ln1(x)).chunk(3, -1);
    auto split = [&](torch::Tensor y) { return y.view({b, t, heads, d / heads}).transpose(1, 2); };
    auto q = split(q_k_v[0]), k = split(q_k_v[1]), v = split(q_k_v[2]);
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(d / heads));
    auto mask = torch::ones({t, t}, torch::kBool).triu(1);
    att = att.masked_fill(mask, -1e9).softmax(-1);
    auto y = torch::matmul(att, v).transpose(1, 2).reshape({b, t, d});
    x = x + proj(y);
    return x + out(torch::gelu(fc(ln2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

// GPT-style decoder with the output projection tied to the token embedding.
struct TinyGptImpl : torch::nn::Module {
  TinyGptImpl(int64_t vocab, int64_t d, int64_t layers, int64_t seq) {
    wte = register_module("wte", torch::nn::Embedding(vocab, d));
    wpe = register_module("wpe", torch::nn::Embedding(seq, d));
    for (int64_t i = 0; i < layers; ++i) blocks.push_back(register_module("h" + std::to_string(i), Block(d, 2)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto pos = torch::arange(idx.size(1), torch::kLong);
    auto x = wte(idx) + wpe(pos);
    for (auto& b : blocks) x = b->forward(x);
    return torch::matmul(ln_f(x), wte->weight.t());  // tied output projection
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(TinyGpt);

// The same decoder with LayerDrop (stochastic depth): block i is skipped where skip[i] (the test draws
// it per iteration, the same for both twins), so the parameter uses differ from one iteration to the
// next. With say_skips it tells ferry::will_skip its skips when its forward begins (a no-op unwrapped).
struct LayerDropGptImpl : TinyGptImpl {
  using TinyGptImpl::TinyGptImpl;
  torch::Tensor forward(torch::Tensor idx) {
    for (size_t i = 0; say_skips && i < blocks.size() && i < skip.size(); ++i) {
      if (skip[i]) ferry::will_skip(*blocks[i]);
    }
    auto pos = torch::arange(idx.size(1), torch::kLong);
    auto x = wte(idx) + wpe(pos);
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (i >= skip.size() || !skip[i]) x = blocks[i]->forward(x);
    }
    return torch::matmul(ln_f(x), wte->weight.t());
  }
  std::vector<bool> skip;
  bool say_skips = false;
};
TORCH_MODULE(LayerDropGpt);

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    b1 = register_module("b1", torch::nn::BatchNorm2d(8));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)));
    b2 = register_module("b2", torch::nn::BatchNorm2d(16));
    fc = register_module("fc", torch::nn::Linear(16, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(b1(c1(x)));
    x = torch::max_pool2d(torch::relu(b2(c2(x))), 2);
    return fc(x.mean({2, 3}));
  }
  torch::nn::Conv2d c1{nullptr}, c2{nullptr};
  torch::nn::BatchNorm2d b1{nullptr}, b2{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvNet);

// A submodule called twice, a frozen layer, a layer used only when `use_extra`, and a switch that
// throws in the middle of forward.
struct OddNetImpl : torch::nn::Module {
  OddNetImpl() {
    shared = register_module("shared", torch::nn::Linear(16, 16));
    frozen = register_module("frozen", torch::nn::Linear(16, 16));
    extra = register_module("extra", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 4));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(shared(x));
    x = torch::tanh(frozen(x));
    if (throw_now) throw std::runtime_error("boom in forward");
    x = torch::tanh(shared(x));  // the same weights again
    if (use_extra) x = x + extra(x);
    return head(x);
  }
  bool use_extra = true;
  bool throw_now = false;
  torch::nn::Linear shared{nullptr}, frozen{nullptr}, extra{nullptr}, head{nullptr};
};
TORCH_MODULE(OddNet);

// ---- helpers

using test::expect_close;
using test::largest_chunk_bytes;
using test::tiny_config;

void zero_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.mutable_grad().reset();
  }
}

// One training iteration on both models; compares the loss and every parameter's gradient.
template <class Net, class Loss>
void compare_iteration(Net& ref, Net& net, ChunkedModel& model, Loss loss_of, const std::string& what) {
  zero_grads(*ref);
  zero_grads(*net);
  auto loss_ref = loss_of(ref);
  loss_ref.backward();
  auto loss = model.forward([&] { return loss_of(net); });
  model.backward(loss);
  expect_close(loss, loss_ref, what + " loss");
  auto pr = ref->named_parameters(), pn = net->named_parameters();
  for (const auto& item : pr) expect_close(pn[item.key()].grad(), item.value().grad(), what + " grad of " + item.key());
}

template <class Net>
void expect_same_parameters(Net& ref, Net& net) {
  auto pr = ref->named_parameters(), pn = net->named_parameters();
  for (const auto& item : pr) EXPECT_TRUE(torch::equal(pn[item.key()], item.value())) << item.key();
  auto br = ref->named_buffers(), bn = net->named_buffers();
  for (const auto& item : br) expect_close(bn[item.key()], item.value(), "buffer " + item.key());
}

// The next-token loss of a TinyGpt on one fixed batch (seed 42): the same inputs for the reference and
// the wrapped model.
auto tiny_gpt_loss(int64_t V, int64_t T) {
  return [V, T](TinyGpt& m) {
    torch::manual_seed(42);
    auto idx = torch::randint(0, V, {2, T}, torch::kLong);
    auto logits = m->forward(idx);
    return torch::nn::functional::cross_entropy(logits.view({-1, V}), idx.view({-1}));
  };
}

// A TinyGpt (V 64, D 32, 2 layers, T 8) wrapped in 8 KiB chunks under a budget of 3 of its largest
// (evictions every iteration), beside its unwrapped twin with the same initial values.
struct EvictedGpt {
  static constexpr int64_t V = 64, D = 32, L = 2, T = 8, kChunk = 8 << 10;
  explicit EvictedGpt(uint64_t seed, ChunkedModelOptions options = {})
      : ref(seeded(seed)), net(seeded(seed)), budget(3 * largest_chunk_bytes(*net, kChunk)),
        model(net.ptr(), tiny_config(kChunk, budget), std::move(options)) {}
  static TinyGpt seeded(uint64_t seed) {
    torch::manual_seed(seed);
    return TinyGpt(V, D, L, T);
  }
  TinyGpt ref, net;
  int64_t budget;
  ChunkedModel model;
};

// Options whose copy engine keeps copies in flight as CUDA's do, the host learning late that they are
// done (chunk/stream_model_engine.h).
ChunkedModelOptions lagging_copies() {
  ChunkedModelOptions options;
  options.copy_engine = [] { return std::make_unique<StreamModelCopyEngine>(); };
  return options;
}

// Where a parameter's chunk is.
Location location_of(ChunkedModel& model, int64_t param) {
  return model.store().location(model.param_chunk(model.layout().slots()[param].chunk));
}

// ---- tests

TEST(ChunkedModel, TinyGptMatchesUnwrappedUnderEvictions) {
  const int64_t V = 64, D = 32, L = 2, T = 8;
  torch::manual_seed(1);
  TinyGpt ref(V, D, L, T);
  torch::manual_seed(1);
  TinyGpt net(V, D, L, T);
  const int64_t chunk = 8 << 10;  // 8 KiB: a dozen chunks
  const int64_t budget = 3 * largest_chunk_bytes(*net, chunk);
  const c10::TensorImpl* wte_impl = net->wte->weight.unsafeGetTensorImpl();
  {
    ChunkedModel model(net.ptr(), tiny_config(chunk, budget));
    EXPECT_EQ(model.num_params(), static_cast<int64_t>(ref->parameters().size()) - 0);
    EXPECT_GT(model.layout().num_chunks(), 6);
    auto loss_of = tiny_gpt_loss(V, T);
    for (int it = 0; it < 4; ++it) {
      compare_iteration(ref, net, model, loss_of, "iteration " + std::to_string(it));
      const auto s = model.last_iteration();
      EXPECT_LE(s.device_peak_bytes, budget);
      EXPECT_GT(s.h2d_bytes, 0) << "the budget should force moves every iteration";
      if (it == 0) {
        EXPECT_TRUE(s.traced);
      }
      if (it >= 1) {
        EXPECT_FALSE(s.traced);
        EXPECT_FALSE(s.diverged);
        EXPECT_GT(s.optimal_bytes, 0);
        EXPECT_GT(s.evictions, 0);
      }
    }
    EXPECT_LE(model.store().stats().device.peak_bytes, budget);
    EXPECT_EQ(net->wte->weight.unsafeGetTensorImpl(), wte_impl) << "identity lost";
  }
  // The destructor materialized the parameters: the module is plain again and unchanged.
  expect_same_parameters(ref, net);
  EXPECT_EQ(net->wte->weight.unsafeGetTensorImpl(), wte_impl);
}

TEST(ChunkedModel, RepackKeepsAFittingModelOnTheDevice) {
  // Note [Repack stays on the device]: the warm-up ran with every chunk on the device, so the repack
  // builds the new chunks there (device copies); the next iteration moves nothing and still matches.
  const int64_t V = 64, D = 32, L = 2, T = 8;
  torch::manual_seed(1);
  TinyGpt ref(V, D, L, T);
  torch::manual_seed(1);
  TinyGpt net(V, D, L, T);
  const int64_t chunk = 8 << 10;
  ChunkedModel model(net.ptr(), tiny_config(chunk, /*device_budget=*/0));
  auto loss_of = tiny_gpt_loss(V, T);
  compare_iteration(ref, net, model, loss_of, "warm-up");
  const int64_t version = model.layout_version();
  ASSERT_GT(model.layout().num_chunks(), 3);
  const ChunkStoreStats repacked = model.store().stats();
  EXPECT_EQ(repacked.host.current_bytes, 0) << "no chunk was built on the host";
  EXPECT_EQ(repacked.host_buffers.allocations, 0) << "no host buffer was taken for a chunk on the device";
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_EQ(model.store().location(model.param_chunk(model.layout().slots()[p].chunk)), Location::kDevice) << p;
  }
  compare_iteration(ref, net, model, loss_of, "after the repack");
  EXPECT_EQ(model.layout_version(), version) << "one repack";
  EXPECT_EQ(model.last_iteration().h2d_bytes, 0) << "the repacked chunks were already on the device";
}

TEST(ChunkedModel, ConvNetWithBatchNormMatches) {
  torch::manual_seed(2);
  ConvNet ref;
  torch::manual_seed(2);
  ConvNet net;
  const int64_t chunk = 4 << 10;
  const int64_t budget = 2 * largest_chunk_bytes(*net, chunk);
  {
    ChunkedModel model(net.ptr(), tiny_config(chunk, budget));
    auto loss_of = [&](ConvNet& m) {
      torch::manual_seed(7);
      auto x = torch::randn({4, 3, 8, 8});
      return m->forward(x).pow(2).mean();
    };
    for (int it = 0; it < 3; ++it) {
      compare_iteration(ref, net, model, loss_of, "iteration " + std::to_string(it));
      EXPECT_LE(model.last_iteration().device_peak_bytes, budget);
    }
  }
  expect_same_parameters(ref, net);  // running stats of BatchNorm included
}

// LayerDrop on 6 blocks, each skipped with probability 1/4 per iteration, under a budget of 4 chunks
// and copies that lag as CUDA's do: every iteration's loss and gradients equal the unwrapped twin's,
// and after the warm-up no iteration gives the trace up or re-traces; the trace is followed and
// prefetched from in every one (D98). The same draws under the strict rule (align_to_trace false:
// give up at the first difference, re-trace the next) leave the uses waiting for more bytes. And
// aligned with the skips said ahead (ferry::will_skip, D107): the same values, fewer bytes moved in.
TEST(ChunkedModel, LayerDropMatchesUnwrappedAndKeepsFollowingTheTrace) {
  const int64_t V = 64, D = 32, L = 6, T = 8, chunk = 8 << 10;
  std::mt19937 rng(5);
  std::vector<std::vector<bool>> skips(14, std::vector<bool>(L, false));
  int64_t skipped_blocks = 0;
  for (size_t it = 1; it < skips.size(); ++it) {
    for (int64_t b = 0; b < L; ++b) skipped_blocks += (skips[it][b] = rng() % 4 == 0) ? 1 : 0;
  }
  ASSERT_GT(skipped_blocks, 10);
  struct Totals {
    int64_t demand = 0, gave_up_or_traced = 0, moved = 0, hinted = 0, broken = 0;
  };
  auto train = [&](bool align, bool say_skips = false) {
    torch::manual_seed(11);
    LayerDropGpt ref(V, D, L, T);
    torch::manual_seed(11);
    LayerDropGpt net(V, D, L, T);
    ref->say_skips = net->say_skips = say_skips;
    const int64_t budget = 4 * largest_chunk_bytes(*net, chunk);
    ChunkedModelOptions options = lagging_copies();
    options.scheduler.align_to_trace = align;
    ChunkedModel model(net.ptr(), tiny_config(chunk, budget), std::move(options));
    auto loss_of = [&](LayerDropGpt& m) {
      torch::manual_seed(42);
      auto idx = torch::randint(0, V, {2, T}, torch::kLong);
      return torch::nn::functional::cross_entropy(m->forward(idx).view({-1, V}), idx.view({-1}));
    };
    Totals t;
    if (say_skips) trace::start();  // each hint is an instant event there
    for (size_t it = 0; it < skips.size(); ++it) {
      const std::string what =
          std::string(align ? say_skips ? "said ahead" : "aligned" : "strict") + " iteration " + std::to_string(it);
      ref->skip = net->skip = skips[it];
      compare_iteration(ref, net, model, loss_of, what);
      const IterationStats s = model.last_iteration();
      EXPECT_LE(s.device_peak_bytes, budget) << what;
      if (it < 2) continue;  // the warm-up, and the first iteration after the repack
      t.demand += s.demand_h2d_bytes();
      t.gave_up_or_traced += (s.diverged || s.traced) ? 1 : 0;
      t.moved += s.h2d_bytes;
      t.hinted += s.trace_hinted;
      t.broken += s.trace_hints_broken;
      if (align) {
        EXPECT_FALSE(s.diverged) << what;
        EXPECT_FALSE(s.traced) << what;
        EXPECT_GT(s.prefetched_bytes, 0) << what;
      }
    }
    if (say_skips) {
      trace::stop();
      // One per block said skipped, in every iteration, naming the block's first parameter (h<i>.ln1.weight)
      // and its 12 parameters.
      EXPECT_EQ(test::check_trace("hints = [e for e in ev if e['ph'] == 'i' and e['name'] == 'will_skip']\n"
                                  "assert len(hints) == " + std::to_string(skipped_blocks) + ", len(hints)\n"
                                  "assert all(e['args']['first'].startswith('h') for e in hints), hints[:3]\n"
                                  "assert all(e['args']['params'] == 12 for e in hints), hints[:3]\n"),
                0);
    }
    return t;
  };
  const Totals strict = train(false), aligned = train(true), said = train(true, true);
  EXPECT_GT(strict.gave_up_or_traced, 6) << "the strict rule gives the trace up or re-traces in most iterations";
  EXPECT_EQ(aligned.gave_up_or_traced, 0);
  EXPECT_EQ(said.gave_up_or_traced, 0);
  EXPECT_LT(aligned.demand, strict.demand) << "bytes the uses waited for";
  EXPECT_EQ(aligned.hinted, 0);
  EXPECT_GT(said.hinted, 0);
  EXPECT_EQ(said.broken, 0);
  EXPECT_LT(said.moved, aligned.moved) << "no prefetch of a block said skipped";
  std::cout << "LayerDrop GPT, 12 iterations: host->device bytes the uses waited for: strict " << strict.demand
            << ", aligned " << aligned.demand << ", skips said ahead " << said.demand << "; moved in: strict "
            << strict.moved << ", aligned " << aligned.moved << ", said ahead " << said.moved << "\n";
}

TEST(ChunkedModel, SharedFrozenUnusedAndDivergence) {
  torch::manual_seed(3);
  OddNet ref;
  torch::manual_seed(3);
  OddNet net;
  const int64_t chunk = 4 << 10;  // the smallest chunk Config allows: a few weights per chunk
  const int64_t budget = 2 * largest_chunk_bytes(*net, chunk);
  ChunkedModel model(net.ptr(), tiny_config(chunk, budget));
  auto loss_of = [&](OddNet& m) {
    torch::manual_seed(9);
    return m->forward(torch::randn({3, 16})).sum();
  };
  compare_iteration(ref, net, model, loss_of, "warm-up");
  EXPECT_FALSE(net->frozen->weight.grad().defined());
  // `extra` unused from now on: its uses in the trace are skipped, and dropped from it after
  // TraceState::kPruneAfter iterations without them (D98).
  ref->use_extra = net->use_extra = false;
  for (int i = 1; i <= TraceState::kPruneAfter; ++i) {
    compare_iteration(ref, net, model, loss_of, "without extra " + std::to_string(i));
    const IterationStats s = model.last_iteration();
    EXPECT_FALSE(s.diverged);
    EXPECT_FALSE(s.traced);
    EXPECT_GT(s.trace_skipped, 0);
    EXPECT_EQ(s.trace_merged, i == TraceState::kPruneAfter) << "iteration " << i << " without extra";
    EXPECT_FALSE(net->extra->weight.grad().defined());
  }
  compare_iteration(ref, net, model, loss_of, "following the trace without extra");
  EXPECT_EQ(model.last_iteration().trace_skipped, 0);
  // Used again: its uses are unforeseen once, and merged back.
  ref->use_extra = net->use_extra = true;
  compare_iteration(ref, net, model, loss_of, "with extra again");
  EXPECT_GT(model.last_iteration().trace_unforeseen, 0);
  EXPECT_TRUE(model.last_iteration().trace_merged);
  compare_iteration(ref, net, model, loss_of, "following");
  EXPECT_FALSE(model.last_iteration().traced);
  EXPECT_FALSE(model.last_iteration().diverged);
  EXPECT_EQ(model.last_iteration().trace_unforeseen + model.last_iteration().trace_skipped, 0);
  EXPECT_LE(model.store().stats().device.peak_bytes, budget);
}

TEST(ChunkedModel, EvaluationUnderNoGrad) {
  torch::manual_seed(4);
  OddNet ref;
  torch::manual_seed(4);
  OddNet net;
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, 2 * largest_chunk_bytes(*net, 4 << 10)));
  auto x = torch::randn({5, 16});
  torch::NoGradGuard no_grad;
  for (int i = 0; i < 3; ++i) {
    auto y = model.forward([&] { return net->forward(x); });
    expect_close(y, ref->forward(x), "eval output");
    EXPECT_FALSE(y.requires_grad());
  }
  model.end_iteration();
  EXPECT_EQ(model.phase(), ModelPhase::kIdle);
}

TEST(ChunkedModel, ExceptionInForwardLeavesTheModelUsable) {
  torch::manual_seed(5);
  OddNet ref;
  torch::manual_seed(5);
  OddNet net;
  const int64_t budget = 2 * largest_chunk_bytes(*net, 4 << 10);
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, budget));
  auto loss_of = [&](OddNet& m) {
    torch::manual_seed(11);
    return m->forward(torch::randn({3, 16})).sum();
  };
  compare_iteration(ref, net, model, loss_of, "before");
  net->throw_now = true;
  EXPECT_THROW(model.forward([&] { return loss_of(net); }), std::runtime_error);
  EXPECT_EQ(model.phase(), ModelPhase::kIdle);
  EXPECT_TRUE(model.last_iteration().aborted);
  for (TensorId t = 0; t < model.store().num_tensors(); ++t) {
    EXPECT_NE(model.store().tensor_info(t).state, TensorState::kCompute) << "tensor " << t << " left in COMPUTE";
  }
  net->throw_now = false;
  compare_iteration(ref, net, model, loss_of, "after");
  compare_iteration(ref, net, model, loss_of, "after, again");
}

TEST(ChunkedModel, BudgetBelowOneOpIsAClearOutOfMemoryError) {
  torch::manual_seed(6);
  OddNet net;
  // One byte less than the largest chunk: the first op using it cannot run.
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, largest_chunk_bytes(*net, 4 << 10) - 1));
  try {
    model.forward([&] { return net->forward(torch::randn({2, 16})); });
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("out of device chunk memory"), std::string::npos) << e.what();
    const std::string need = "This op needs at least " + format_bytes(largest_chunk_bytes(*net, 4 << 10));
    EXPECT_NE(std::string(e.what()).find(need), std::string::npos) << "names the smallest workable budget: " << e.what();
  }
  EXPECT_EQ(model.phase(), ModelPhase::kIdle);
}

// One op that needs several chunks at once (torch::nn::LSTM runs as one at::lstm over all its
// weights): the iteration reports that working set, and a budget below it fails naming it.
TEST(ChunkedModel, WorkingSetOfTheLargestOpIsReportedAndNamed) {
  torch::manual_seed(8);
  torch::nn::LSTM lstm(torch::nn::LSTMOptions(16, 32).num_layers(2));
  const int64_t chunk = 4 << 10;
  ChunkedModel fits(lstm.ptr(), tiny_config(chunk, 0));
  const auto x = torch::randn({5, 3, 16});
  fits.backward(fits.forward([&] { return std::get<0>(lstm->forward(x)).sum(); }));
  const int64_t working_set = fits.last_iteration().working_set_peak_bytes;
  EXPECT_GE(working_set, 2 * chunk) << "at::lstm uses every weight at once";
  fits.materialize();

  torch::manual_seed(8);
  torch::nn::LSTM small(torch::nn::LSTMOptions(16, 32).num_layers(2));
  ChunkedModel model(small.ptr(), tiny_config(chunk, working_set - 1));
  try {
    model.forward([&] { return std::get<0>(small->forward(x)).sum(); });
    FAIL() << "expected OutOfMemoryError below the working set";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("This op needs at least"), std::string::npos) << e.what();
  }
}

// An evaluation before the first training step: its forward-only trace is used until a training
// iteration is traced, and a forward-only iteration never replaces a training trace afterwards.
TEST(ChunkedModel, ForwardOnlyFirstIterationIsHandledOnPurpose) {
  torch::manual_seed(4);
  OddNet net;
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, 2 * largest_chunk_bytes(*net, 4 << 10)));
  const auto x = torch::randn({5, 16});
  auto eval = [&] {
    torch::NoGradGuard no_grad;
    model.forward([&] { return net->forward(x); });
    model.end_iteration();
  };
  auto train = [&] {
    model.backward(model.forward([&] { return net->forward(x).sum(); }));
    zero_grads(*net);
    return model.last_iteration();
  };
  eval();
  EXPECT_TRUE(model.last_iteration().forward_only);
  EXPECT_TRUE(model.scheduler().trace_is_forward_only());
  train();  // reaches backward, which the forward-only trace lacks: the next iteration re-traces
  IterationStats s = train();
  EXPECT_TRUE(s.traced);
  EXPECT_FALSE(model.scheduler().trace_is_forward_only());
  eval();   // follows the training trace's forward; not recorded over it
  EXPECT_FALSE(model.last_iteration().traced);
  EXPECT_FALSE(model.scheduler().trace_is_forward_only());
  s = train();
  EXPECT_FALSE(s.traced);
  EXPECT_FALSE(s.diverged) << "the training trace is still followed after an evaluation";
}

// Note [Several forwards]: two forward() calls on two batches, an evaluation forward between them,
// then one backward() of the combined loss: the loss and every gradient equal the unwrapped model's,
// bit for bit, from the warm-up (whose repack used to move the parameters under the first graph: a raw
// storage error) to the steady state, under evictions; the scheduler sees one iteration per backward()
// and follows its trace once traced.
TEST(ChunkedModel, SeveralForwardsBeforeOneBackwardMatchTheUnwrappedModel) {
  EvictedGpt g(21);
  constexpr int64_t V = EvictedGpt::V, T = EvictedGpt::T;
  auto loss_of = [](TinyGpt& m, const torch::Tensor& idx) {
    return torch::nn::functional::cross_entropy(m->forward(idx).view({-1, V}), idx.view({-1}));
  };
  const int64_t first = g.model.scheduler().iterations();
  for (int it = 0; it < 4; ++it) {
    torch::manual_seed(100 + it);
    const auto a = torch::randint(0, V, {2, T}, torch::kLong), b = torch::randint(0, V, {2, T}, torch::kLong);
    zero_grads(*g.ref);
    zero_grads(*g.net);
    const auto ref_a = loss_of(g.ref, a);  // in this order, as the forwards run
    const auto loss_ref = ref_a + 0.5 * loss_of(g.ref, b);
    loss_ref.backward();
    const auto la = g.model.forward([&] { return loss_of(g.net, a); });
    {
      torch::NoGradGuard no_grad;
      g.model.forward([&] { return g.net->forward(b); });  // an evaluation between them joins too
    }
    const auto lb = g.model.forward([&] { return loss_of(g.net, b); });
    const auto loss = la + 0.5 * lb;
    g.model.backward(loss);
    const std::string what = "iteration " + std::to_string(it);
    EXPECT_TRUE(torch::equal(loss, loss_ref)) << what << " loss";
    auto pr = g.ref->named_parameters(), pn = g.net->named_parameters();
    for (const auto& item : pr) {
      EXPECT_TRUE(torch::equal(pn[item.key()].grad(), item.value().grad())) << what << " grad of " << item.key();
    }
    EXPECT_EQ(g.model.scheduler().iterations(), first + it + 1) << what << ": one iteration per backward()";
    const IterationStats s = g.model.last_iteration();
    EXPECT_FALSE(s.forward_only) << what;
    EXPECT_GT(s.evictions, 0) << what << ": the budget forces evictions";
    if (it >= 2) {
      EXPECT_FALSE(s.traced) << what;
      EXPECT_FALSE(s.diverged) << what << ": the trace holds all three forwards and the backward";
    }
  }
}

// A forward under grad mode whose graph is gone before the next forward() (a validation loop that
// forgot NoGradGuard) ends its iteration there, as an evaluation: each is an iteration of its own, and
// the training iteration after them follows the trace.
TEST(ChunkedModel, AForwardWhoseGraphIsGoneEndsItsIterationAtTheNextForward) {
  EvictedGpt g(22);
  const auto loss_of = tiny_gpt_loss(EvictedGpt::V, EvictedGpt::T);
  for (int it = 0; it < 2; ++it) compare_iteration(g.ref, g.net, g.model, loss_of, "training " + std::to_string(it));
  const int64_t before = g.model.scheduler().iterations();
  for (int v = 0; v < 3; ++v) {
    const auto out = g.model.forward([&] { return loss_of(g.net); });
    EXPECT_TRUE(out.requires_grad());
    EXPECT_EQ(g.model.scheduler().iterations(), before + v) << "validation " << v;
  }  // each output (and its graph) is dropped here
  compare_iteration(g.ref, g.net, g.model, loss_of, "training after validation");
  EXPECT_EQ(g.model.scheduler().iterations(), before + 4) << "three validation iterations and one training";
  EXPECT_FALSE(g.model.last_iteration().diverged);
}

// Note [A repack waits for held views]: views of parameters the user keeps (a detach() kept for
// logging, a slice) share their chunks' memory. The warm-up's repack used to free that memory under
// them (the next read of the detach(): a segmentation fault). Now it waits until every such view is
// gone: meanwhile they read the parameters' values and training follows the unwrapped model; then it
// runs, and the scheduler follows its trace.
TEST(ChunkedModel, ARepackWaitsForViewsOfParametersHeldOutside) {
  EvictedGpt g(23);
  const auto loss_of = tiny_gpt_loss(EvictedGpt::V, EvictedGpt::T);
  auto params = g.net->named_parameters();
  const std::string first = params.keys().front(), last = params.keys().back();
  torch::Tensor kept = params[first].detach();
  torch::Tensor slice = params[last].narrow(0, 0, 1);
  int64_t it = 0;
  auto train = [&](const std::string& what) {
    compare_iteration(g.ref, g.net, g.model, loss_of, what + ", iteration " + std::to_string(it));
    ++it;
  };
  for (int k = 0; k < 3; ++k) {
    train("two views held");
    EXPECT_FALSE(g.model.layout_final()) << "iteration " << it - 1;
    EXPECT_TRUE(torch::equal(kept, params[first])) << "iteration " << it - 1;
    EXPECT_TRUE(torch::equal(slice, params[last].narrow(0, 0, 1))) << "iteration " << it - 1;
  }
  EXPECT_EQ(g.model.repack_waits(), 3);
  kept = torch::Tensor();
  train("the slice held");
  EXPECT_FALSE(g.model.layout_final());
  EXPECT_TRUE(torch::equal(slice, params[last].narrow(0, 0, 1)));
  slice = torch::Tensor();
  train("no view held");
  EXPECT_TRUE(g.model.layout_final()) << "the repack ran once the views were gone";
  EXPECT_EQ(g.model.repack_waits(), 4);
  EXPECT_GT(g.model.last_repack_seconds(), 0);
  for (int k = 0; k < 2; ++k) {
    train("after the repack");
    EXPECT_FALSE(g.model.last_iteration().diverged) << "iteration " << it - 1;
  }
}

// Note [Several forwards], a graph through frozen parameters only: a frozen wrapped feature network
// as a perceptual loss, run on the generated output and on the target before one backward (the
// target's pass under grad mode or NoGradGuard). Its parameters have no gradient accumulators, so the
// second forward used to end the first one's iteration; in the warm-up the repack then moved every
// parameter and the backward met a saved weight view with no storage ("setStorage ... out of bounds").
// Now the first forward's output node keeps the iteration open until a backward ran through it. The
// generator's gradients equal the unwrapped pair's bit for bit, under evictions, whether the backward
// is the feature network's backward() or the user's own (the loss held past the next forward), and
// the feature network sees one iteration per step and follows its trace. The same once the feature
// network is trainable without a gradient sink (its .grad as torch makes them): the held loss keeps
// its accumulators alive, and the backward that ran through the returned node still ends the step.
// A forward returning a struct is not watched: each forward is an iteration of its own, and the
// warm-up's repack waits for the first graph's saved views (Note [A repack waits for held views]).
TEST(ChunkedModel, AFrozenModelRunTwiceBeforeOneBackwardMatchesTheUnwrappedModel) {
  struct Features {
    torch::Tensor value;
  };
  auto features = [](bool trainable) {
    torch::manual_seed(31);
    auto f = torch::nn::Sequential(torch::nn::Linear(16, 40), torch::nn::Tanh(), torch::nn::Linear(40, 40),
                                   torch::nn::Tanh(), torch::nn::Linear(40, 40), torch::nn::Tanh(),
                                   torch::nn::Linear(40, 8));
    for (auto& p : f->parameters()) p.set_requires_grad(trainable);
    return f;
  };
  for (const int mode : {0, 1, 2, 3}) {
    const bool own_backward = mode == 1, trainable = mode == 2, in_struct = mode == 3;
    const std::string how = own_backward ? "features.backward(loss)"
                            : trainable  ? "loss.backward(), trainable, no sink"
                            : in_struct  ? "loss.backward(), forward returns a struct"
                                         : "loss.backward()";
    auto ref_f = features(trainable), f = features(trainable);
    torch::manual_seed(32);
    torch::nn::Linear ref_g(16, 16);
    torch::manual_seed(32);
    torch::nn::Linear g(16, 16);
    ChunkedModel model(f.ptr(), tiny_config(4 << 10, 2 * largest_chunk_bytes(*f, 4 << 10)));
    torch::Tensor loss;  // held past the next step's forwards, as a logging loop would
    constexpr int kSteps = 5;
    for (int step = 0; step < kSteps; ++step) {
      const std::string when = how + ", step " + std::to_string(step);
      torch::manual_seed(40 + step);
      const auto x = torch::randn({4, 16}), target = torch::randn({4, 16});
      const bool target_no_grad = !trainable && step % 2 == 1;  // trainable: one access order, traced
      ref_g->zero_grad();
      {
        const torch::Tensor a = ref_f->forward(ref_g->forward(x));
        torch::Tensor b;
        if (target_no_grad) {
          torch::NoGradGuard no_grad;
          b = ref_f->forward(target);
        } else {
          b = ref_f->forward(target);
        }
        torch::mse_loss(a, b).backward();
      }
      g->zero_grad();
      const torch::Tensor y = g->forward(x);
      const torch::Tensor a = in_struct ? model.forward([&] { return Features{f->forward(y)}; }).value
                                        : model.forward([&] { return f->forward(y); });
      torch::Tensor b;
      if (target_no_grad) {
        torch::NoGradGuard no_grad;
        b = model.forward([&] { return f->forward(target); });
      } else {
        b = in_struct ? model.forward([&] { return Features{f->forward(target)}; }).value
                      : model.forward([&] { return f->forward(target); });
      }
      loss = torch::mse_loss(a, b);
      ASSERT_NO_THROW(own_backward ? model.backward(loss) : loss.backward()) << when;
      EXPECT_TRUE(torch::equal(g->weight.grad(), ref_g->weight.grad())) << when;
      EXPECT_TRUE(torch::equal(g->bias.grad(), ref_g->bias.grad())) << when;
      if (step >= 2 && !in_struct) {
        EXPECT_FALSE(model.last_iteration().diverged) << when;
      }
      if (in_struct && step == 0) {
        EXPECT_FALSE(model.layout_final()) << when << ": the repack waits for the first graph's saved views";
      }
    }
    model.end_iteration();
    if (in_struct) {
      EXPECT_EQ(model.scheduler().iterations(), 2 * kSteps) << how << ": an iteration per forward";
      EXPECT_EQ(model.repack_waits(), 1) << how;
    } else {
      EXPECT_EQ(model.scheduler().iterations(), kSteps) << how << ": one iteration per step, two forwards each";
      EXPECT_EQ(model.repack_waits(), 0) << how;
    }
    EXPECT_TRUE(model.layout_final()) << how << ": the warm-up's repack ran";
  }
}

// bf16 compute with float inputs and no hand casts: the same result, bit for bit, as the unwrapped bf16
// model fed inputs cast by hand; the input's gradient comes back in its own dtype. The same for a loss
// term added after forward() (an op between forward and backward is a use, cast as inside forward).
Config with_precision(Config c, Precision precision) {
  c.precision = precision;
  return c;
}

// model.backward(loss) backpropagates loss * loss_scale (fp16), as torch's GradScaler does: the
// gradient of an input that requires grad (an adversarial example's) is scaled too, which the README
// tells users to divide out: bit for bit the unwrapped model's gradient of the scaled loss (the
// unscaled one differs in the low bits where fp16 underflows, as the scale is there to avoid).
TEST(ChunkedModel, TheLossScaleScalesAnInputsGradientToo) {
  auto make = [] {
    torch::manual_seed(13);
    return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  };
  auto ref = make(), net = make();
  ref->to(torch::kHalf);
  ChunkedModel model(net.ptr(), with_precision(tiny_config(4 << 10, 0), Precision::kFp16));
  model.set_loss_scale(8);
  const auto x = torch::randn({2, 8}, torch::requires_grad());
  const auto x_ref = x.detach().clone().requires_grad_(true);
  (ref->forward(x_ref.to(torch::kHalf)).to(torch::kFloat).pow(2).sum() * 8).backward();
  model.backward(model.forward([&] { return net->forward(x).to(torch::kFloat).pow(2).sum(); }));
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(torch::equal(x.grad(), x_ref.grad())) << x.grad() << x_ref.grad();
}

TEST(ChunkedModel, Bf16AcceptsFloatInputsWithoutHandCasts) {
  auto make = [] {
    torch::manual_seed(12);
    return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})),
                                 torch::nn::GELU(), torch::nn::Linear(32, 4));
  };
  auto ref = make(), net = make();
  ref->to(torch::kBFloat16);
  ChunkedModel model(net.ptr(), with_precision(tiny_config(4 << 10, 0), Precision::kBf16));
  const auto x = torch::randn({6, 16}, torch::requires_grad());
  // From the third iteration on, a loss term after forward() (Note [Between forward and backward]): an
  // fp32 tensor meets the head's weight there too, and is cast as inside forward().
  const auto scale = torch::full({4, 32}, 0.5);
  auto head_weight = [](torch::nn::Sequential& m) { return m->named_parameters()["3.weight"]; };
  for (int it = 0; it < 4; ++it) {
    const bool term = it >= 2;
    const auto y = model.forward([&] { return net->forward(x); });
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(y, ref->forward(x.detach().to(torch::kBFloat16)))) << "iteration " << it;
    auto loss = y.to(torch::kFloat).pow(2).sum();
    if (term) {
      const auto t = (head_weight(net) * scale).sum();
      EXPECT_EQ(t.scalar_type(), torch::kBFloat16) << "the fp32 factor is cast, as inside forward()";
      loss = loss + t.to(torch::kFloat);
    }
    model.backward(loss);
    ASSERT_TRUE(x.grad().defined());
    EXPECT_EQ(x.grad().scalar_type(), torch::kFloat) << "the cast is part of the graph";
    // Backward ops are not cast (LayerNorm's backward takes its fp32 mean/rstd): gradients are the
    // reference's, bit for bit.
    const auto xr = x.detach().to(torch::kBFloat16).requires_grad_();
    auto ref_loss = ref->forward(xr).to(torch::kFloat).pow(2).sum();
    if (term) ref_loss = ref_loss + (head_weight(ref) * scale.to(torch::kBFloat16)).sum().to(torch::kFloat);
    ref_loss.backward();
    auto ref_params = ref->named_parameters();
    for (const auto& item : net->named_parameters()) {
      EXPECT_TRUE(torch::equal(item.value().grad(), ref_params[item.key()].grad())) << item.key();
    }
    EXPECT_TRUE(torch::equal(x.grad(), xr.grad().to(torch::kFloat)));
    x.mutable_grad().reset();
    zero_grads(*net);
    zero_grads(*ref);
  }
}

// An op that takes its tensors as a list (cat, stack) with a bf16 parameter among fp32 tensors: the
// fp32 ones are cast as a user would cast them by hand, so the result is bf16 as the reference's (torch
// alone would promote the list to fp32), and the gradient reaching the fp32 input goes through the cast.
struct ListOfTensorsImpl : torch::nn::Module {
  ListOfTensorsImpl() {
    torch::manual_seed(31);
    rows = register_parameter("rows", torch::randn({3, 8}));
    proj = register_module("proj", torch::nn::Linear(8, 8));
  }
  // x: (2, 8) and z: (3, 8), fp32; x is used once, so its gradient has one term (no sum whose rounding
  // would differ between bf16 and fp32).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& z) {
    const auto joined = torch::cat({x, rows}, 0);     // (5, 8)
    const auto stacked = torch::stack({z, rows}, 0);  // (2, 3, 8)
    return proj->forward(joined).sum(0) + stacked.sum(std::vector<int64_t>{0, 1});
  }
  torch::Tensor rows;
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(ListOfTensors);

TEST(ChunkedModel, Bf16CastsFloatTensorsInAListWithAParameter) {
  ListOfTensors ref, net;
  ref->to(torch::kBFloat16);
  ChunkedModel model(net.ptr(), with_precision(tiny_config(4 << 10, 0), Precision::kBf16));
  torch::manual_seed(32);
  const auto x = torch::randn({2, 8}, torch::requires_grad());
  const auto z = torch::randn({3, 8});
  for (int it = 0; it < 3; ++it) {  // the warm-up, the repack, a planned iteration
    const auto y = model.forward([&] { return net->forward(x, z); });
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16) << "iteration " << it << ": the list was not cast";
    const auto xr = x.detach().to(torch::kBFloat16).requires_grad_();
    const auto y_ref = ref->forward(xr, z.to(torch::kBFloat16));
    EXPECT_TRUE(torch::equal(y, y_ref)) << "iteration " << it;
    model.backward(y.to(torch::kFloat).pow(2).sum());
    y_ref.to(torch::kFloat).pow(2).sum().backward();
    ASSERT_TRUE(x.grad().defined());
    EXPECT_EQ(x.grad().scalar_type(), torch::kFloat) << "the casts are part of the graph";
    EXPECT_TRUE(torch::equal(x.grad(), xr.grad().to(torch::kFloat))) << "iteration " << it;
    auto ref_params = ref->named_parameters();
    for (const auto& item : net->named_parameters()) {
      EXPECT_TRUE(torch::equal(item.value().grad(), ref_params[item.key()].grad())) << item.key() << ", iteration " << it;
    }
    x.mutable_grad().reset();
    zero_grads(*net);
    zero_grads(*ref);
  }
}

// Between iterations every parameter is readable and writable by any op, evicted or not: logging a
// weight, its norm, an eval forward outside model.forward(), torch::save of the module (these crashed:
// a null storage, "out of bounds for storage of size 0").
TEST(ChunkedModel, ParametersAreUsableOutsideFerrysScopes) {
  EvictedGpt gpt(9);
  const int64_t V = EvictedGpt::V, T = EvictedGpt::T;
  TinyGpt ref = gpt.ref, net = gpt.net;
  ChunkedModel& model = gpt.model;
  const auto idx = torch::randint(V, {2, T}, torch::kLong);
  for (int it = 0; it < 3; ++it) {
    model.backward(model.forward([&] { return net->forward(idx).pow(2).mean(); }));
    zero_grads(*net);
  }
  int64_t on_host = 0;
  for (int64_t c = 0; c < model.layout().num_chunks(); ++c) {
    on_host += model.store().location(model.param_chunk(c)) == Location::kHost;
  }
  ASSERT_GT(on_host, 0) << "the test needs evicted parameters";
  auto ref_params = ref->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const auto& w = model.param(p);
    EXPECT_TRUE(torch::equal(w, ref_params[model.param_name(p)])) << model.param_name(p);
    EXPECT_EQ(w.norm().item<float>(), ref_params[model.param_name(p)].norm().item<float>());
  }
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(net->forward(idx), ref->forward(idx))) << "an eval forward outside model.forward()";
  }
  std::stringstream archive;
  torch::save(net, archive);
  torch::manual_seed(123);
  TinyGpt loaded(V, EvictedGpt::D, EvictedGpt::L, T);
  torch::load(loaded, archive);
  auto loaded_params = loaded->named_parameters();
  for (const auto& item : ref_params) EXPECT_TRUE(torch::equal(loaded_params[item.key()], item.value())) << item.key();
  // A write between iterations is what the next iteration uses.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.mul_(0.5);
    for (auto& p : ref->parameters()) p.mul_(0.5);
  }
  EXPECT_TRUE(torch::equal(model.forward([&] { return net->forward(idx); }), ref->forward(idx)));
  model.end_iteration();
}

// Note [Ops outside the scopes]: while a hazard is on (here one opened as an optimizer's update left
// behind its step opens it) an op between iterations on a parameter whose chunk is on its way to the
// device, the copy still queued (as such an update sends its chunk up when it ends; on CUDA a copy on
// the copy stream), must see the bytes the copy brings, not the fresh device memory they are coming to.
// Before, the check of such ops waited for the chunk's update only: the op read and wrote memory the
// copy later overwrote (a write lost: found under load by test_mechanism_combinations, in 3 of 150 runs
// of one case, while another chunk's update still ran). Every parameter is read, then halved.
TEST(ChunkedModel, AnOpBetweenIterationsSeesTheBytesOfACopyStillOnItsWay) {
  EvictedGpt gpt(10, lagging_copies());
  TinyGpt ref = gpt.ref, net = gpt.net;
  ChunkedModel& model = gpt.model;
  const auto idx = torch::randint(EvictedGpt::V, {2, EvictedGpt::T}, torch::kLong);
  for (int it = 0; it < 2; ++it) {
    model.backward(model.forward([&] { return net->forward(idx).pow(2).mean(); }));
    zero_grads(*net);
  }
  // One chunk on the host at a time, then started towards the device: its copy stays queued until
  // something waits for it or orders compute after it.
  auto ref_params = ref->named_parameters();
  int64_t started = 0;
  outside_hazard_begin();
  struct End {
    ~End() { outside_hazard_end(); }
  } end;
  watch_outside_uses();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const ChunkId c = model.param_chunk(model.layout().slots()[p].chunk);
    if (model.store().location(c) == Location::kDevice) model.store().move(c, Location::kHost);
    model.store().move_async(c, Location::kDevice);
    started += model.store().chunk_info(c).copy_pending;
    const auto& w = model.param(p);
    EXPECT_TRUE(torch::equal(w.clone(), ref_params[model.param_name(p)])) << model.param_name(p) << ": read";
    {
      torch::NoGradGuard no_grad;
      model.param(p).mul_(0.5);
      ref_params[model.param_name(p)].mul_(0.5);
    }
    model.store().synchronize();  // every queued copy runs: a write they land over is lost
    EXPECT_TRUE(torch::equal(model.param_values(p).cpu(), ref_params[model.param_name(p)])) << model.param_name(p)
                                                                                            << ": written";
  }
  EXPECT_GT(started, 0) << "the test needs copies still on their way";
}

// An evaluation forward (under NoGradGuard) waits for no backward, so ops after it run unseen, as
// between iterations (Note [Between forward and backward]); the model must then be readable everywhere,
// as an idle one is (D35), before end_iteration() or the next forward settles the iteration. On a copy
// engine whose copies stay pending, as CUDA's do, a chunk evicted during that forward had no memory
// until then: a null storage (on CUDA, an illegal address in the next kernel that reads it).
// Note [Writes to parameters]: torch::load into the wrapped module gives every parameter the loaded
// tensor's storage (set_); the next forward puts the values into their slots and the parameters back
// into their chunks, which keep moving under the budget. Before, each parameter stayed on the loaded
// storage for good, outside ferry: its slot kept the old values.
TEST(ChunkedModel, TorchLoadIntoTheWrappedModuleIsTakenIn) {
  EvictedGpt g(31);
  auto loss_of = tiny_gpt_loss(EvictedGpt::V, EvictedGpt::T);
  compare_iteration(g.ref, g.net, g.model, loss_of, "before the load");
  std::stringstream archive;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : g.ref->parameters()) p.mul_(0.5).add_(0.01);
    torch::save(g.ref, archive);
  }
  torch::load(g.net, archive);
  for (int it = 0; it < 3; ++it) {
    compare_iteration(g.ref, g.net, g.model, loss_of, "after the load, iteration " + std::to_string(it));
    EXPECT_GT(g.model.last_iteration().evictions, 0);
  }
  auto pr = g.ref->named_parameters(), pn = g.net->named_parameters();
  for (int64_t p = 0; p < g.model.num_params(); ++p) {
    const std::string& name = g.model.param_name(p);
    EXPECT_TRUE(torch::equal(g.model.param_values(p), pr[name])) << name << ": its slot holds the loaded values";
    EXPECT_EQ(pn[name].data_ptr(), g.model.param_values(p).data_ptr()) << name << " views its slot";
  }
}

// A ChunkedModel without HybridAdam keeps gradients in .grad, so a torch optimizer over the module's
// parameters trains it (with an LR schedule): its in-place updates are writes, taken in before the next
// forward (Note [Writes to parameters]). Under evictions, bit-identical to the unwrapped twin stepped
// by the same optimizer. A write every step is logged once at info, not once per step.
TEST(ChunkedModel, ATorchOptimizerOverTheModulesParametersTrainsAsTheTwin) {
  EvictedGpt g(37);
  auto loss_of = tiny_gpt_loss(EvictedGpt::V, EvictedGpt::T);
  torch::optim::AdamW ref_opt(g.ref->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(g.net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::StepLR ref_lr(ref_opt, 2, 0.5), lr(opt, 2, 0.5);
  const test::LogLevelFor info(log::Level::kInfo);
  testing::internal::CaptureStderr();
  for (int it = 0; it < 5; ++it) {
    const std::string what = "step " + std::to_string(it);
    compare_iteration(g.ref, g.net, g.model, loss_of, what);
    EXPECT_GT(g.model.last_iteration().evictions, 0) << what;
    ref_opt.step();
    opt.step();
    ref_lr.step();
    lr.step();
    expect_same_parameters(g.ref, g.net);
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(test::occurrences(log, "parameter(s) written"), 1u) << log;
  EXPECT_NE(log.find("later writes: at debug level"), std::string::npos) << log;
}

// A parameter given a tensor of another shape (torch::load of another model's checkpoint) cannot go
// back into its slot: the next forward refuses, naming it and both shapes, and changes nothing; given
// its shape back, the model runs on.
TEST(ChunkedModel, AReplacementOfAnotherShapeIsRefusedNamingIt) {
  EvictedGpt g(33);
  auto loss_of = tiny_gpt_loss(EvictedGpt::V, EvictedGpt::T);
  compare_iteration(g.ref, g.net, g.model, loss_of, "before");
  const at::Tensor kept = g.net->wte->weight.detach().clone();
  g.net->wte->weight.set_data(torch::zeros({3, 5}));
  const std::string error = test::error_of([&] { g.model.forward([&] { return loss_of(g.net); }); });
  EXPECT_NE(error.find("parameter wte.weight was given a tensor of shape [3, 5]"), std::string::npos) << error;
  EXPECT_NE(error.find("its shape is [64, 32]"), std::string::npos) << error;
  EXPECT_EQ(g.model.phase(), ModelPhase::kIdle);
  g.net->wte->weight.set_data(kept);  // its own shape again: taken in at the next forward
  compare_iteration(g.ref, g.net, g.model, loss_of, "after");
}

// Note [The module's parameters]: a submodule registered after wrapping (an adapter, a new head) was in
// no chunk and was never trained: autograd gave it a .grad every step, silently. The next forward
// refuses, naming its parameters, and changes nothing.
TEST(ChunkedModel, AParameterRegisteredAfterWrappingIsRefusedNamingIt) {
  EvictedGpt g(35);
  auto loss_of = tiny_gpt_loss(EvictedGpt::V, EvictedGpt::T);
  compare_iteration(g.ref, g.net, g.model, loss_of, "before");
  g.net->register_module("adapter", torch::nn::Linear(EvictedGpt::D, EvictedGpt::D));
  const std::string error = test::error_of([&] { g.model.forward([&] { return loss_of(g.net); }); });
  EXPECT_NE(error.find("forward(): the module's parameters are not the ones ChunkedModel wrapped"), std::string::npos)
      << error;
  EXPECT_NE(error.find("it has adapter.weight, adapter.bias, registered after it was wrapped"), std::string::npos)
      << error;
  EXPECT_EQ(error.find("no longer has"), std::string::npos) << error;
  EXPECT_EQ(g.model.phase(), ModelPhase::kIdle);
}

// A submodule replaced after wrapping (replace_module): the new parameters were never in a chunk and
// the old ones are no longer used. Refused, naming both; with the wrapped submodule back, the model
// runs on as its twin.
TEST(ChunkedModel, ASubmoduleReplacedAfterWrappingIsRefusedNamingBoth) {
  EvictedGpt g(36);
  auto loss_of = tiny_gpt_loss(EvictedGpt::V, EvictedGpt::T);
  compare_iteration(g.ref, g.net, g.model, loss_of, "before");
  const torch::nn::LayerNorm wrapped = g.net->ln_f;
  g.net->ln_f = g.net->replace_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({EvictedGpt::D})));
  const std::string error = test::error_of([&] { g.model.forward([&] { return loss_of(g.net); }); });
  EXPECT_NE(error.find("it has ln_f.weight, ln_f.bias, registered after it was wrapped; it no longer has ln_f.weight, "
                       "ln_f.bias (replaced or removed after it was wrapped)"),
            std::string::npos)
      << error;
  EXPECT_EQ(g.model.phase(), ModelPhase::kIdle);
  g.net->ln_f = g.net->replace_module("ln_f", wrapped);
  compare_iteration(g.ref, g.net, g.model, loss_of, "with the wrapped ln_f back");
}

// module.to(dtype) after wrapping gives every parameter a tensor of that dtype (set_data): taken in at
// the compute dtype (Note [Writes to parameters]), with a warning that says the parameters stay in it;
// the values are the module's (fp32 -> fp64 -> fp32 is exact), so the model runs on as its twin.
TEST(ChunkedModel, ModuleToAnotherDtypeIsTakenInAtTheComputeDtypeWithAWarning) {
  EvictedGpt g(37);
  auto loss_of = tiny_gpt_loss(EvictedGpt::V, EvictedGpt::T);
  compare_iteration(g.ref, g.net, g.model, loss_of, "before");
  g.net->to(torch::kDouble);
  testing::internal::CaptureStderr();
  const torch::Tensor loss = g.model.forward([&] { return loss_of(g.net); });
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("forward(): " + std::to_string(g.model.num_params()) + " parameter(s) were given tensors of "
                     "another dtype (wte.weight: Double; module.to(dtype)"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("the parameters stay Float"), std::string::npos) << err;
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
  g.model.backward(loss);
  for (const auto& p : g.net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  compare_iteration(g.ref, g.net, g.model, loss_of, "after to(kDouble)");
}

// A float64 parameter (a learned temperature kept in double) is held at the compute dtype, and an
// optimizer's master in float32: wrapping says so, naming it, instead of training it at less precision
// without a word. A module without one wraps silently.
TEST(ChunkedModel, AFloat64ParameterIsHeldAtTheComputeDtypeWithAWarning) {
  auto net = std::make_shared<torch::nn::Module>();
  net->register_module("fc", torch::nn::Linear(4, 4));
  testing::internal::CaptureStderr();
  { ChunkedModel plain(net, tiny_config(4 << 10, 0)); }
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("float64"), std::string::npos) << err;
  net->register_parameter("temperature", torch::ones({1}, torch::kDouble));
  testing::internal::CaptureStderr();
  ChunkedModel model(net, tiny_config(4 << 10, 0));
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("1 parameter(s) are float64 (temperature first); ferry holds them at Float"), std::string::npos)
      << err;
  EXPECT_NE(err.find("they train in float32, not float64"), std::string::npos) << err;
  EXPECT_EQ(net->named_parameters()["temperature"].scalar_type(), torch::kFloat);
}

TEST(ChunkedModel, AnEvaluationForwardLeavesEveryParameterReadable) {
  EvictedGpt gpt(11, lagging_copies());
  const int64_t V = EvictedGpt::V, T = EvictedGpt::T;
  TinyGpt ref = gpt.ref, net = gpt.net;
  ChunkedModel& model = gpt.model;
  const auto idx = torch::randint(V, {2, T}, torch::kLong);
  model.backward(model.forward([&] { return net->forward(idx).pow(2).mean(); }));  // the warm-up
  zero_grads(*net);
  auto ref_params = ref->named_parameters();
  for (int it = 0; it < 2; ++it) {
    torch::NoGradGuard no_grad;
    const int64_t evictions_before = model.store().stats().moves.d2h_count;
    const auto y = model.forward([&] { return net->forward(idx); });
    ASSERT_GT(model.store().stats().moves.d2h_count, evictions_before) << "the test needs evictions in the forward";
    EXPECT_EQ(model.phase(), ModelPhase::kForwardDone);
    for (int64_t p = 0; p < model.num_params(); ++p) {
      const auto& w = model.param(p);
      ASSERT_TRUE(w.storage().data() != nullptr && w.storage().nbytes() > 0)
          << model.param_name(p) << " has no memory after evaluation forward " << it;
      EXPECT_TRUE(torch::equal(w, ref_params[model.param_name(p)])) << model.param_name(p);
    }
    EXPECT_TRUE(torch::equal(y, ref->forward(idx))) << "evaluation " << it;
  }
  model.end_iteration();
}

// Note [Between forward and backward]: a loss term added after forward() (an L2 penalty on the tied
// embedding and on the first block's MLP weight) and a weight read between forward() and backward() are
// uses, as inside forward(): the losses and gradients equal the unwrapped model's, an evicted chunk
// comes to the device for the op (before, the op read the host alias; on CUDA a chunk whose eviction
// copy was in flight had no memory), the trace holds those uses (no iteration after the warm-up
// diverges), and once the iteration is over the same op is a plain op again, as it is after an
// evaluation forward (no backward comes), also while the thread watches for another hazard.
TEST(ChunkedModel, OpsBetweenForwardAndBackwardAreUses) {
  EvictedGpt gpt(5, lagging_copies());
  const int64_t V = EvictedGpt::V, T = EvictedGpt::T;
  TinyGpt ref = gpt.ref, net = gpt.net;
  ChunkedModel& model = gpt.model;
  auto loss_of = tiny_gpt_loss(V, T);
  auto penalty = [](TinyGpt& m) { return 1e-3 * (m->wte->weight.pow(2).sum() + m->blocks[0]->fc->weight.pow(2).sum()); };
  int64_t fc0 = -1;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    if (model.param_name(p) == "h0.fc.weight") fc0 = p;
  }
  ASSERT_GE(fc0, 0);
  auto fc0_location = [&] { return location_of(model, fc0); };
  int64_t evicted = 0, brought = 0;
  for (int it = 0; it < 4; ++it) {
    zero_grads(*ref);
    zero_grads(*net);
    const auto ref_loss = loss_of(ref) + penalty(ref);
    ref_loss.backward();
    auto loss = model.forward([&] { return loss_of(net); });
    const bool was_evicted = fc0_location() != Location::kDevice;
    loss = loss + penalty(net);
    evicted += was_evicted;
    brought += was_evicted && fc0_location() == Location::kDevice;
    EXPECT_EQ(net->blocks[1]->proj->weight.norm().item<float>(), ref->blocks[1]->proj->weight.norm().item<float>());
    model.backward(loss);
    const std::string what = "iteration " + std::to_string(it);
    expect_close(loss, ref_loss, what + " loss");
    auto pr = ref->named_parameters(), pn = net->named_parameters();
    for (const auto& item : pr) expect_close(pn[item.key()].grad(), item.value().grad(), what + " grad of " + item.key());
    const IterationStats s = model.last_iteration();
    if (it >= 1) {
      EXPECT_FALSE(s.diverged) << what;
    }
    EXPECT_LE(s.device_peak_bytes, gpt.budget) << what;
  }
  ASSERT_GT(evicted, 0) << "the test needs h0.fc.weight's chunk evicted by the end of forward at least once";
  EXPECT_EQ(brought, evicted) << "the loss term's op should bring the chunk to the device";
  // Between iterations the same op is a plain op again: it moves nothing.
  const Location before = fc0_location();
  (void)penalty(net).item<double>();
  EXPECT_EQ(fc0_location(), before);
  // After a forward under NoGradGuard (an evaluation) no backward comes: the op is as between
  // iterations, also while the thread watches for another hazard (an update left running, sharding):
  // not a use the trace lacks.
  outside_hazard_begin();
  watch_outside_uses();
  {
    torch::NoGradGuard no_grad;
    (void)model.forward([&] { return loss_of(net); });
  }
  (void)net->wpe->weight.sum().item<double>();  // the trace has the penalty's uses here, not this one
  model.end_iteration();
  outside_hazard_end();
  EXPECT_FALSE(model.last_iteration().diverged) << "the evaluation's iteration";
}

// A key an autograd worker inherited from a watching thread (a plain backward started while updates
// left running behind a step still run: on CUDA its device thread gets the key) reaches pre_use
// between iterations. It is an op outside the scopes there, checked and not a use: before, it brought
// the chunk to the device and recorded an access outside any iteration.
TEST(ChunkedModel, AnInheritedKeyBetweenIterationsIsNoUse) {
  EvictedGpt gpt(6);
  const int64_t V = EvictedGpt::V, T = EvictedGpt::T;
  TinyGpt ref = gpt.ref, net = gpt.net;
  ChunkedModel& model = gpt.model;
  auto loss_of = tiny_gpt_loss(V, T);
  for (int it = 0; it < 2; ++it) compare_iteration(ref, net, model, loss_of, "iteration " + std::to_string(it));
  std::vector<int64_t> evicted;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    if (location_of(model, p) == Location::kHost) evicted.push_back(p);
  }
  ASSERT_FALSE(evicted.empty()) << "the test needs evicted parameters";
  auto ref_params = ref->named_parameters();
  std::thread([&] {
    c10::impl::tls_set_dispatch_key_included(kInterceptKey, true);  // as autograd's workers get it
    for (int64_t p : evicted) {
      EXPECT_TRUE(torch::equal(model.param(p) * 2, ref_params[model.param_name(p)] * 2)) << model.param_name(p);
    }
    c10::impl::tls_set_dispatch_key_included(kInterceptKey, false);
  }).join();
  for (int64_t p : evicted) {
    EXPECT_EQ(location_of(model, p), Location::kHost) << model.param_name(p) << ": moved by an op between iterations";
  }
  compare_iteration(ref, net, model, loss_of, "iteration 2");
  EXPECT_FALSE(model.last_iteration().diverged);
}

// state_dict() holds every parameter and buffer (BatchNorm statistics included); load_state_dict() of it
// into another wrapped model gives the same outputs, and bad input (a missing, unknown or misshapen
// entry) changes nothing. The safetensors export reads back in Python, value for value.
TEST(ChunkedModel, StateDictRoundTripsAndExportsForPython) {
  torch::manual_seed(31);
  ConvNet net;
  const int64_t chunk = 4 << 10;
  ChunkedModel model(net.ptr(), tiny_config(chunk, 2 * largest_chunk_bytes(*net, chunk)));
  const auto x = torch::randn({2, 3, 8, 8});
  for (int it = 0; it < 2; ++it) {
    model.backward(model.forward([&] { return net->forward(x).sum(); }));
    zero_grads(*net);
  }
  const NamedTensors sd = model.state_dict();
  EXPECT_EQ(sd.size(), net->named_parameters().size() + net->named_buffers().size());
  torch::manual_seed(32);
  ConvNet other_net;
  ChunkedModel other(other_net.ptr(), tiny_config(chunk, 2 * largest_chunk_bytes(*other_net, chunk)));
  const NamedTensors before = other.state_dict();
  auto unchanged = [&] {
    const NamedTensors now = other.state_dict();
    for (size_t i = 0; i < now.size(); ++i) {
      if (!torch::equal(now[i].second, before[i].second)) return false;
    }
    return true;
  };
  NamedTensors missing(sd.begin() + 1, sd.end());
  EXPECT_NE(test::error_of([&] { other.load_state_dict(missing); }).find("is missing"), std::string::npos);
  NamedTensors unknown = sd;
  unknown.emplace_back("no.such.weight", torch::zeros({1}));
  EXPECT_NE(test::error_of([&] { other.load_state_dict(unknown); }).find("is not a parameter or buffer"),
            std::string::npos);
  NamedTensors misshapen = sd;
  misshapen.back().second = torch::zeros({7});
  EXPECT_NE(test::error_of([&] { other.load_state_dict(misshapen); }).find("has shape"), std::string::npos);
  EXPECT_TRUE(unchanged()) << "a failed load changes nothing";
  other.load_state_dict(sd);
  {
    torch::NoGradGuard no_grad;
    net->eval();
    other_net->eval();
    EXPECT_TRUE(torch::equal(model.forward([&] { return net->forward(x); }),
                             other.forward([&] { return other_net->forward(x); })));
    model.end_iteration();
    other.end_iteration();
  }

  // The export, read back by the torch wheel's python3 (by the format, and by safetensors if installed).
  const std::string dir = "/tmp/ferry_sd_" + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  model.export_safetensors(dir + "/model.safetensors");
  const std::string script = dir + "/read.py";
  std::ofstream(script) << R"PY(
import json, struct, sys, torch
path, out = sys.argv[1], sys.argv[2]
data = open(path, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
assert header.pop("__metadata__") == {"format": "pt"}
dtypes = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
tensors = {}
for name, info in header.items():
    b, e = info["data_offsets"]
    raw = bytearray(data[8 + n + b: 8 + n + e])
    t = torch.frombuffer(raw, dtype=dtypes[info["dtype"]]) if raw else torch.empty(0, dtype=dtypes[info["dtype"]])
    tensors[name] = t.reshape(info["shape"])
try:
    from safetensors.torch import load_file
    other = load_file(path)
    assert all(torch.equal(other[k], v) for k, v in tensors.items())
except ImportError:
    pass
torch.save(tensors, out)
)PY";
  const std::string cmd = std::string(FERRY_TEST_PYTHON) + " " + script + " " + dir + "/model.safetensors " + dir +
                          "/model.pt 2>" + dir + "/err.txt";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(dir + "/model.pt", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::Dict<c10::IValue, c10::IValue> loaded = torch::pickle_load(bytes).toGenericDict();
  EXPECT_EQ(loaded.size(), sd.size());
  for (const auto& [name, t] : sd) {
    ASSERT_TRUE(loaded.contains(name)) << name;
    EXPECT_TRUE(torch::equal(loaded.at(name).toTensor(), t)) << name;
  }
  for (const char* f : {"model.safetensors", "read.py", "model.pt", "err.txt"}) ::unlink((dir + "/" + f).c_str());
  ::rmdir(dir.c_str());
}

// A module with an empty parameter (numel 0) and a 0-dim one. An op on the empty one reads no memory and
// is no use: its offset used to fall into the range of the parameter packed after it, so the warm-up
// traced a use the repacked layout did not have, and the next iteration diverged. Now every iteration
// has the same uses, none diverges, and the gradients equal the unwrapped module's.
struct EmptyParamNetImpl : torch::nn::Module {
  EmptyParamNetImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    scale = register_parameter("scale", torch::tensor(1.5));
    empty = register_parameter("empty", torch::empty({0}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return (fc(x) * scale + empty.sum()).pow(2).sum(); }
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale, empty;
};
TORCH_MODULE(EmptyParamNet);

TEST(ChunkedModel, AnEmptyParameterIsNoUseAndTheTraceHolds) {
  torch::manual_seed(9);
  EmptyParamNet ref;
  torch::manual_seed(9);
  EmptyParamNet net;
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, 0));
  const auto x = torch::randn({2, 8});
  int64_t accesses = -1;
  for (int it = 0; it < 4; ++it) {
    compare_iteration(ref, net, model, [&](EmptyParamNet& m) { return m->forward(x); }, "iteration " + std::to_string(it));
    const IterationStats s = model.last_iteration();
    EXPECT_FALSE(s.diverged) << "iteration " << it;
    if (accesses >= 0) {
      EXPECT_EQ(s.accesses, accesses) << "iteration " << it;
    }
    accesses = s.accesses;
  }
}

// A gradient sink that counts what lands.
struct CountingSink final : GradSink {
  void land_grad(int64_t, const at::Tensor&) override { ++landed; }
  int64_t landed = 0;
};

// One gradient sink at a time: a second is refused while one is set (its gradients would never reach
// the first); the same one again is no change, and after null another attaches.
TEST(ChunkedModel, OneGradientSinkAtATime) {
  torch::manual_seed(8);
  OddNet net;
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, 0));
  CountingSink first, second;
  model.set_grad_sink(&first);
  model.set_grad_sink(&first);
  EXPECT_EQ(test::error_of([&] { model.set_grad_sink(&second); }),
            "ferry: set_grad_sink(): the model's gradients go to another sink already; set null first");
  const auto x = torch::randn({2, 16});
  model.backward(model.forward([&] { return net->forward(x).sum(); }));
  EXPECT_EQ(first.landed, 6) << "shared, extra and head: weight and bias each (frozen lands none)";
  EXPECT_EQ(second.landed, 0);
  model.set_grad_sink(nullptr);
  model.set_grad_sink(&second);
  model.backward(model.forward([&] { return net->forward(x).sum(); }));
  EXPECT_EQ(second.landed, 6);
  model.set_grad_sink(nullptr);
}

// Note [A backward not through model.backward()]: `loss.backward()` after a training forward is
// refused at the first gradient, before the sink hears of it, and the iteration ends as an aborted one
// at the next forward even while the refused graph is alive. Another model's backward() that reaches
// this one (a GAN's generator through its discriminator) still lands its gradients.
TEST(ChunkedModel, ABareLossBackwardAfterATrainingForwardIsRefused) {
  torch::manual_seed(12);
  OddNet net;
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, 0));
  CountingSink sink;
  model.set_grad_sink(&sink);
  const auto x = torch::randn({2, 16});
  const torch::Tensor slipped = model.forward([&] { return net->forward(x).sum(); });
  const std::string err = test::error_of([&] { slipped.backward(); });
  EXPECT_NE(err.find("got a gradient from a backward that did not go through model.backward(): call "
                     "model.backward(loss) (or adam.backward_step(loss)) instead of loss.backward()"),
            std::string::npos)
      << err;
  EXPECT_EQ(sink.landed, 0);
  for (int64_t p = 0; p < model.num_params(); ++p) EXPECT_FALSE(model.grad_in_slot(p)) << model.param_name(p);
  for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  const int64_t iterations = model.scheduler().iterations();
  model.backward(model.forward([&] { return net->forward(x).sum(); }));
  EXPECT_EQ(sink.landed, 6) << "shared, extra and head: weight and bias each";
  EXPECT_EQ(model.scheduler().iterations(), iterations + 2)
      << "the refused iteration ended (aborted) at the next forward instead of continuing, then that one";
  model.clear_grad_slots();

  torch::manual_seed(13);
  torch::nn::Linear other(4, 4);
  ChunkedModel other_model(other.ptr(), tiny_config(4 << 10, 0));
  const torch::Tensor through = model.forward([&] { return net->forward(x); });
  other_model.backward(other_model.forward([&] { return other->forward(through).sum(); }));
  EXPECT_EQ(sink.landed, 12) << "another model's backward() reaches this one";
  model.end_iteration();
  model.clear_grad_slots();
  model.set_grad_sink(nullptr);
}

// A parameter in another ChunkedModel's chunk is refused at construction: the same module wrapped
// twice, a submodule wrapped and then its parent, or the reverse with the parent's chunks evicted. It
// used to run without a word, both models binding, moving and freeing the same tensors. Once the first
// is destroyed (its parameters get plain memory again), wrapping again is fine.
// A parameter ferry cannot hold in a chunk (complex, integer, sparse) is refused at wrapping, naming
// it; an integer one that is not trained (an index table registered as a parameter) gets the remedy:
// a buffer. The module is left as it was.
TEST(ChunkedModel, AParameterThatIsNotDenseFloatingPointIsRefused) {
  for (const auto& [value, hint] :
       std::vector<std::pair<torch::Tensor, bool>>{{torch::randn({4}, torch::kComplexFloat), false},
                                                   {torch::arange(4), true},
                                                   {torch::randn({4}).to_sparse(), false}}) {
    torch::nn::Sequential net(torch::nn::Linear(4, 4));
    net->register_parameter("extra", value, /*requires_grad=*/value.is_complex());
    const std::string err = test::error_of([&] { ChunkedModel model(net.ptr(), tiny_config(4 << 10, 0)); });
    EXPECT_NE(err.find("ferry: parameter extra must be a dense floating-point tensor, got "), std::string::npos)
        << err;
    EXPECT_EQ(err.find("belongs in a buffer: register_buffer") != std::string::npos, hint) << err;
    EXPECT_EQ(net->named_parameters()["extra"].unsafeGetTensorImpl(), value.unsafeGetTensorImpl());
    const torch::Tensor weight = net->named_parameters()["0.weight"];
    EXPECT_TRUE(weight.is_cpu() && weight.storage().nbytes() == 16 * sizeof(float)) << "left in its own memory";
  }
}

TEST(ChunkedModel, AModuleWrappedTwiceIsRefused) {
  auto make = [] {
    torch::manual_seed(14);
    return torch::nn::Sequential(torch::nn::Linear(16, 40), torch::nn::Tanh(), torch::nn::Linear(40, 40),
                                 torch::nn::Tanh(), torch::nn::Linear(40, 8));
  };
  const std::string refusal = "is held by another ChunkedModel already (a module wrapped twice, or a submodule "
                              "wrapped and then its parent): wrap each module once";
  auto ref = make(), net = make();
  const int64_t budget = 2 * largest_chunk_bytes(*net, 4 << 10);
  {
    ChunkedModel first(net.ptr(), tiny_config(4 << 10, budget));
    std::string err = test::error_of([&] { ChunkedModel again(net.ptr(), tiny_config(4 << 10, 0)); });
    EXPECT_NE(err.find("parameter 0.weight " + refusal), std::string::npos) << err;
    for (int it = 0; it < 3; ++it) {  // evictions: some chunks end on the host
      const auto x = torch::randn({4, 16});
      first.backward(first.forward([&] { return net->forward(x).sum(); }));
    }
    err = test::error_of([&] { ChunkedModel inner(net[4], tiny_config(4 << 10, 0)); });
    EXPECT_NE(err.find("parameter weight " + refusal), std::string::npos) << err;
  }
  {
    ChunkedModel inner(net[2], tiny_config(4 << 10, 0));
    const std::string err = test::error_of([&] { ChunkedModel outer(net.ptr(), tiny_config(4 << 10, 0)); });
    EXPECT_NE(err.find("parameter 2.weight " + refusal), std::string::npos) << err;
  }
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, budget));
  for (auto& p : net->parameters()) p.mutable_grad().reset();
  for (auto& p : ref->parameters()) p.mutable_grad().reset();
  torch::manual_seed(15);
  const auto x = torch::randn({4, 16});
  model.backward(model.forward([&] { return net->forward(x).sum(); }));
  ref->forward(x).sum().backward();
  const auto ref_params = ref->named_parameters();
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value().grad(), ref_params[p.key()].grad())) << p.key() << " after wrapping again";
  }
}

TEST(ChunkedModel, BadUse) {
  torch::manual_seed(7);
  OddNet net;
  ChunkedModel model(net.ptr(), tiny_config(4 << 10, 0));
  auto loss = model.forward([&] { return net->forward(torch::randn({2, 16})).sum(); });
  model.backward(loss);
  try {
    model.backward(loss);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot go from idle to backward"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ChunkedModel(nullptr, tiny_config(4 << 10, 0)), c10::Error);
  auto empty = std::make_shared<torch::nn::Module>();
  EXPECT_THROW(ChunkedModel(empty, tiny_config(4 << 10, 0)), c10::Error);
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(128, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 128));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))).sum(); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TwoLayer);

TEST(ChunkedModel, SimulatedDeviceCountsActivationsWhenAsked) {
  const auto x = torch::randn({8192, 128});  // fc1's output and relu's output: 4 MiB each
  for (bool measure : {false, true}) {
    torch::manual_seed(4);
    TwoLayer net;
    ChunkedModelOptions options;
    options.measure_host_non_model = measure;
    ChunkedModel model(net.ptr(), tiny_config(64 << 10, 0), std::move(options));
    model.backward(model.forward([&] { return net->forward(x); }));
    const int64_t peak = model.scheduler().non_model_peak();
    if (!measure) {
      EXPECT_EQ(peak, 0) << "without the heap probe the simulated device reports no non-model memory";
    } else {
      if (!test::kGlibcSeesTheHeap) GTEST_SKIP() << "a sanitizer's allocator is invisible to glibc's mallinfo2";
      EXPECT_GE(peak, 4 << 20) << "fc1's 4 MiB output is alive when fc2's weight is used";
      EXPECT_LE(peak, 256 << 20);
    }
  }
}

// Identity whose backward takes at least 60 ms, or throws.
struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, bool fail) {
    ctx->saved_data["fail"] = fail;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (ctx->saved_data["fail"].toBool()) throw std::runtime_error("injected backward failure");
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    return {grads[0], torch::Tensor()};
  }
};

TEST(ChunkedModel, PhaseSecondsTimeEachPhaseWithinItsCall) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  torch::manual_seed(4);
  TwoLayer net;
  ChunkedModel model(net.ptr(), tiny_config(64 << 10, 192 << 10));  // 3 of its 4 chunks: copies every iteration
  EXPECT_EQ(model.last_phase_seconds().forward, -1) << "no iteration yet";
  const auto x = torch::randn({16, 128});
  auto forward = [&](bool fail) {
    return model.forward([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return SlowBackward::apply(net->forward(x), fail);
    });
  };
  for (int it = 0; it < 2; ++it) {  // the first iteration traces and repacks; the second follows the trace
    auto t0 = Clock::now();
    at::Tensor loss = forward(false);
    const double forward_wall = since(t0);
    t0 = Clock::now();
    model.backward(loss);
    const double backward_wall = since(t0);
    const PhaseSeconds s = model.last_phase_seconds();
    EXPECT_GE(s.forward, 0.020) << "iteration " << it;
    EXPECT_LE(s.forward, forward_wall) << "iteration " << it;
    EXPECT_GE(s.backward, 0.060) << "iteration " << it;
    EXPECT_LE(s.backward, backward_wall) << "iteration " << it;
  }
  // Evaluation: no backward; asked inside the iteration, refused.
  forward(false);
  EXPECT_THROW(model.last_phase_seconds(), c10::Error);
  model.end_iteration();
  PhaseSeconds s = model.last_phase_seconds();
  EXPECT_GE(s.forward, 0.020);
  EXPECT_EQ(s.backward, -1) << "an evaluation forward has no backward";
  // A backward that throws did not run to its end.
  EXPECT_ANY_THROW(model.backward(forward(true)));
  s = model.last_phase_seconds();
  EXPECT_GE(s.forward, 0.020);
  EXPECT_EQ(s.backward, -1) << "an aborted backward";

  // In the event trace, on a "device" track: as long as the phases, in order, each starting inside the
  // host's span of its call, and placed before the call that placed them returned. On the "copy stream"
  // track: the iteration's copies, all of their bytes, each inside the host's move that ran it.
  model.trace_last_phases();  // not recording: nothing
  trace::start();
  model.backward(forward(false));
  s = model.last_phase_seconds();
  const IterationStats moved = model.last_iteration();
  ASSERT_GT(moved.h2d_bytes, 0) << "the budget forces copies";
  model.trace_last_phases();
  trace::instant("test", "placed");
  trace::stop();
  std::ostringstream check;
  check.precision(9);
  check << "d = {e['name']: e for e in track('device')}\n"
        << "h = {e['name']: e for e in ev if e['ph'] == 'X' and e['cat'] == 'model'}\n"
        << "assert abs(d['forward']['dur'] * 1e-6 - " << s.forward << ") < 1e-5, d\n"
        << "assert abs(d['backward']['dur'] * 1e-6 - " << s.backward << ") < 1e-5, d\n"
        << "assert end(d['forward']) <= d['backward']['ts'], d\n"
        << "for n in ('forward', 'backward'): assert h[n]['ts'] <= d[n]['ts'] <= end(h[n]), (n, d[n], h[n])\n"
        << "placed = [e['ts'] for e in ev if e['name'] == 'placed'][0]\n"
        << "assert end(d['backward']) <= placed, (d, placed)\n"
        << "copies = track('copy stream')\n"
        << "moves = [e for e in ev if e['ph'] == 'X' and e['cat'] == 'move']\n"
        << "total = lambda d: sum(e['args']['bytes'] for e in copies if e['name'].startswith(d))\n"
        << "assert total('h2d') == " << moved.h2d_bytes << " and total('d2h') == " << moved.d2h_bytes << ", copies\n"
        << "for c in copies: assert any(m['name'] == c['name'] and m['ts'] <= c['ts'] and end(c) <= end(m) + 1e-3 "
        << "for m in moves), (c, moves)\n";
  EXPECT_EQ(test::check_trace(check.str()), 0) << check.str();
}

// trace_last_phases writes the copies of every attached state's store too (a placement moving the
// optimizer's state to the device), and only while the state is held.
TEST(ChunkedModel, TraceLastPhasesWritesTheStateStoresCopies) {
  torch::manual_seed(4);
  TwoLayer net;
  ChunkedModel model(net.ptr(), tiny_config(64 << 10, 0));
  auto state = model.attach_state({ChunkRole::kMaster}, [](int, int64_t, const at::Tensor& slot) { slot.fill_(1); });
  const auto x = torch::randn({16, 128});
  auto traced_step = [&] {
    trace::start();
    model.backward(model.forward([&] { return net->forward(x); }));
    if (state) state->move_group(0, state->store().location(state->chunk(0, 0)) == Location::kDevice
                                        ? Location::kHost : Location::kDevice);
    model.trace_last_phases();
    trace::stop();
  };
  const std::string roles = "roles = [e['args']['role'] for e in track('copy stream')]\n";
  traced_step();
  EXPECT_EQ(test::check_trace(roles + "assert roles == ['master'], roles\n"), 0);
  state.reset();  // dropped: no longer the model's to trace
  traced_step();
  EXPECT_EQ(test::check_trace(roles + "assert roles == [], roles\n"), 0);
}

}  // namespace
}  // namespace ferry
