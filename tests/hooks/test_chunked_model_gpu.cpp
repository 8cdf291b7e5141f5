// ChunkedModel on a real GPU (`gpu` label; skipped without one): a bf16 model under a budget that
// forces evictions computes what the same bf16 model computes unwrapped on the GPU, and prefetching on
// the copy stream runs copies beside compute (read from the device's timeline in the event trace),
// and ops between forward() and backward() are uses there too; a checkpointed stack with dropout under
// CUDA autocast recomputes what its forward computed (the CUDA generator and autocast replayed).
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/autocast_mode.h>

#include "../../chunk/copy_engine.h"
#include "../../chunk/device.h"
#include "../../common/event_trace.h"
#include "../../hooks/checkpoint.h"
#include "../../hooks/chunked_model.h"
#include "../test_util.h"
#include "../trace_spans.h"

namespace ferry {
namespace {

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t d, int64_t layers) {
    for (int64_t i = 0; i < layers; ++i) {
      ln.push_back(register_module("ln" + std::to_string(i), torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}))));
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(d, d)));
    }
  }
  torch::Tensor block(size_t i, const torch::Tensor& x) {
    torch::Tensor h = torch::gelu(fc[i](ln[i](x)));
    if (dropout > 0) h = torch::dropout(h, dropout, is_training());
    return x + h;
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < fc.size(); ++i) {
      if (checkpointed) {
        x = checkpoint([this, i](const std::vector<at::Tensor>& in) { return block(i, in[0]); }, {x});
      } else {
        x = block(i, x);
      }
    }
    return x.to(torch::kFloat).pow(2).mean();
  }
  bool checkpointed = false;
  double dropout = 0;
  std::vector<torch::nn::LayerNorm> ln;
  std::vector<torch::nn::Linear> fc;
};
TORCH_MODULE(Stack);

Config cuda_config(int64_t chunk, int64_t budget, Precision precision) {
  Config c;
  c.device = DeviceKind::kCuda;
  c.chunk_size_bytes = chunk;
  c.device_budget_bytes = budget;
  c.precision = precision;
  return c;
}

// Two Stacks with the same initial values: a bf16 reference on the GPU and one to wrap.
std::pair<Stack, Stack> stack_twins(uint64_t seed, int64_t d, int64_t layers) {
  torch::manual_seed(seed);
  Stack ref(d, layers);
  ref->to(torch::kCUDA, torch::kBFloat16);
  torch::manual_seed(seed);
  Stack net(d, layers);
  return {ref, net};
}

// Every gradient of the wrapped model is bf16 and close to the unwrapped bf16 model's.
void expect_bf16_grads_close(Stack& ref, Stack& net) {
  auto pr = ref->named_parameters(), pn = net->named_parameters();
  for (const auto& item : pr) {
    const auto& g = pn[item.key()].grad();
    ASSERT_TRUE(g.defined()) << item.key();
    EXPECT_EQ(g.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::allclose(g.to(torch::kFloat), item.value().grad().to(torch::kFloat), 2e-2, 1e-3))
        << item.key() << " max diff " << (g.to(torch::kFloat) - item.value().grad().to(torch::kFloat)).abs().max().item<float>();
  }
}

// A bf16 Stack (d 256, 6 layers) wrapped with about one Linear weight (bf16) per chunk under a budget of
// 3 chunks (evictions every iteration), beside its unwrapped bf16 twin, and an input on the GPU.
struct EvictedStack {
  static constexpr int64_t d = 256, layers = 6, chunk = d * d * 2 + 4096;
  explicit EvictedStack(uint64_t seed)
      : twins(stack_twins(seed, d, layers)),
        model(twins.second.ptr(), cuda_config(chunk, 3 * chunk, Precision::kBf16)),
        x(torch::randn({8, 32, d}, torch::device(torch::kCUDA).dtype(torch::kBFloat16))) {}
  std::pair<Stack, Stack> twins;  // the reference, the wrapped one
  ChunkedModel model;
  torch::Tensor x;
};

TEST(ChunkedModelGpu, Bf16MatchesTheUnwrappedBf16ModelUnderEvictions) {
  FERRY_REQUIRE_GPU();
  EvictedStack stack(1);
  Stack ref = stack.twins.first, net = stack.twins.second;
  ChunkedModel& model = stack.model;
  const auto& x = stack.x;
  const int64_t chunk = EvictedStack::chunk;
  int64_t evictions = 0;
  for (int it = 0; it < 3; ++it) {
    for (auto& p : ref->parameters()) p.mutable_grad().reset();
    for (auto& p : net->parameters()) p.mutable_grad().reset();
    auto ref_loss = ref->forward(x);
    ref_loss.backward();
    auto loss = model.forward([&] { return net->forward(x); });
    model.backward(loss);
    EXPECT_TRUE(torch::allclose(loss, ref_loss, 1e-2, 1e-3)) << loss.item<float>() << " vs " << ref_loss.item<float>();
    ASSERT_NO_FATAL_FAILURE(expect_bf16_grads_close(ref, net));
    const IterationStats s = model.last_iteration();
    EXPECT_LE(s.device_peak_bytes, 3 * chunk);
    evictions += s.evictions;
  }
  EXPECT_GT(evictions, 0);
  // Note [A repack waits for held views]: no copy of the copy stream holds a chunk at the warm-up's end.
  EXPECT_TRUE(model.layout_final());
  EXPECT_EQ(model.repack_waits(), 0);
}

// Layers of LayerNorm + Linear + gelu, each followed by a part without parameters (a mixing of the
// tokens: batched matmuls and a softmax, `mix_rounds` times): it waits for no copy, so between two marks
// on the compute stream around it (when `marks` is set) the device computes while the copy stream is
// free to copy.
struct MixedStackImpl : torch::nn::Module {
  MixedStackImpl(int64_t d, int64_t layers) : d(d) {
    for (int64_t i = 0; i < layers; ++i) {
      ln.push_back(register_module("ln" + std::to_string(i), torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}))));
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(d, d)));
    }
  }
  torch::Tensor mix(torch::Tensor x) const {
    for (int k = 0; k < mix_rounds; ++k) {
      const torch::Tensor a = torch::softmax(torch::matmul(x, x.transpose(1, 2)) / std::sqrt(double(d)), -1);
      x = x + 1e-3 * torch::matmul(a, x);
    }
    return x;
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < fc.size(); ++i) {
      x = x + torch::gelu(fc[i](ln[i](x)));
      if (!marks) {
        x = mix(x);
        continue;
      }
      auto begin = marker->make_mark(), end = marker->make_mark();
      begin->record();
      x = mix(x);
      end->record();
      marks->emplace_back(std::move(begin), std::move(end));
    }
    return x.pow(2).mean();
  }
  int64_t d;
  int mix_rounds = 8;
  std::vector<torch::nn::LayerNorm> ln;
  std::vector<torch::nn::Linear> fc;
  const CopyEngine* marker = nullptr;  // makes the marks (a CUDA engine: events on the current stream)
  std::vector<std::pair<std::unique_ptr<StreamMark>, std::unique_ptr<StreamMark>>>* marks = nullptr;
};
TORCH_MODULE(MixedStack);

// One iteration after warm-up at the given prefetch depth, as the device ran it: its forward and
// backward (track "device") and the chunk copies (track "copy stream"), written by trace_last_phases,
// and the parameter-free compute of every layer's forward (track "compute"), placed on the host's clock
// by an anchor of the test's own (marks of one device compare across streams: one clock).
struct TracedIteration {
  std::vector<test::TraceSpan> phases, h2d, copies, compute;
  IterationStats stats;
};

TracedIteration traced_iteration(int prefetch_depth) {
  const int64_t d = 2048, layers = 8;
  torch::manual_seed(2);
  MixedStack net(d, layers);
  const int64_t chunk = d * d * 4 + (64 << 10);  // one fp32 weight per chunk
  ChunkedModelOptions options;
  options.scheduler.prefetch_depth = prefetch_depth;
  ChunkedModel model(net.ptr(), cuda_config(chunk, 3 * chunk, Precision::kFp32), std::move(options));
  // Few tokens: the copies (8 fp32 weights of 16 MiB in, per pass) take longer than the compute, so
  // whether they run beside it shows.
  auto x = torch::randn({2, 256, d}, torch::kCUDA);
  auto step = [&] {
    auto loss = model.forward([&] { return net->forward(x); });
    model.backward(loss);
    for (auto& p : net->parameters()) p.mutable_grad().reset();
  };
  for (int it = 0; it < 3; ++it) step();  // warm-up and the repack, then one iteration following the trace
  const auto engine = make_device(DeviceKind::kCuda)->make_copy_engine();
  std::vector<std::pair<std::unique_ptr<StreamMark>, std::unique_ptr<StreamMark>>> marks;
  net->marker = engine.get();
  net->marks = &marks;
  torch::cuda::synchronize();
  trace::start();
  step();
  torch::cuda::synchronize();
  model.trace_last_phases();
  {
    const ClockAnchor anchor(engine->make_mark());
    for (const auto& [begin, end] : marks) {
      trace::complete_on("compute", "test", "mix", anchor.host_ns(*begin), anchor.host_ns(*end));
    }
  }
  trace::stop();
  net->marks = nullptr;
  const std::vector<test::TraceSpan> spans = test::trace_spans(trace::chrome_json());
  TracedIteration t;
  t.phases = test::spans_on(spans, "device");
  t.h2d = test::spans_on(spans, "copy stream", "h2d");
  t.copies = test::spans_on(spans, "copy stream");
  t.compute = test::spans_on(spans, "compute");
  t.stats = model.last_iteration();
  return t;
}

// Whether the copies hide behind compute, read from the device's own timeline (CUDA events) rather than
// from two timing means. With prefetch depth 2 a chunk's copy is issued a use or two ahead: the copy
// stream starts it as soon as the compute queued before it has run, and the device computes the next
// layers meanwhile, so copies run beside compute that does not wait for them. Without prefetch each copy
// is issued at its use and first waits for all compute queued before it (CudaCopyEngine), and that
// compute then waits for the copy (ready_for_use): no compute without parameters runs beside a copy.
TEST(ChunkedModelGpu, PrefetchOverlapsCopiesWithCompute) {
  FERRY_REQUIRE_GPU();
  const TracedIteration with = traced_iteration(2);
  const TracedIteration without = traced_iteration(0);
  auto report = [](const char* what, const TracedIteration& t) {
    double compute = 0;
    for (const auto& c : t.compute) compute += c.duration_us();
    double phases_h2d = 0;
    for (const auto& c : t.h2d) {
      for (const auto& p : t.phases) phases_h2d += test::overlap_us(c, p);
    }
    std::cout << "[ measured ] " << what << ": " << t.h2d.size() << " h2d of " << t.copies.size() << " copies, "
              << t.stats.prefetches << " prefetches; h2d inside forward/backward " << phases_h2d * 1e-3
              << " ms; parameter-free compute " << compute * 1e-3 << " ms in " << t.compute.size()
              << " parts, of it beside a copy " << test::covered_us(t.compute, t.copies) * 1e-3 << " ms\n";
  };
  report("prefetch depth 2", with);
  report("prefetch depth 0", without);
  EXPECT_GT(with.stats.prefetches, 0);
  EXPECT_EQ(without.stats.prefetches, 0);
  EXPECT_EQ(with.stats.h2d_bytes, without.stats.h2d_bytes) << "prefetch changes when chunks move, not how much (OPT)";
  ASSERT_EQ(with.phases.size(), 2u) << "forward and backward on the device's track";
  ASSERT_FALSE(with.h2d.empty()) << "the budget forces host->device copies every iteration";
  ASSERT_EQ(with.compute.size(), 8u) << "one parameter-free part per layer";
  // Some host->device copy ran while the device was in forward or backward...
  bool h2d_in_a_phase = false;
  for (const auto& c : with.h2d) {
    for (const auto& p : with.phases) h2d_in_a_phase |= test::overlap_us(c, p) > 0;
  }
  EXPECT_TRUE(h2d_in_a_phase);
  // ...and copies ran beside compute that waits for none of them: a quarter of the parameter-free
  // compute at least (the iteration is copy-bound, so nearly all of it; the anchors place marks to
  // microseconds, the parts take about 100 us each). Without prefetch nothing is asserted: its numbers
  // are printed (about 0 expected).
  double compute = 0;
  for (const auto& c : with.compute) compute += c.duration_us();
  EXPECT_GE(test::covered_us(with.compute, with.copies), 0.25 * compute)
      << "with prefetch, copies should run while the device computes";
}

// Note [Between forward and backward] where it matters: on CUDA a chunk evicted at the end of forward
// may still be on its way to the host (its storage has no memory until the copy completes, D35). A loss
// term on the first layer's weight added after forward() and a weight read there are uses: the chunk is
// brought back, and the gradients are the unwrapped model's.
TEST(ChunkedModelGpu, OpsBetweenForwardAndBackwardAreUses) {
  FERRY_REQUIRE_GPU();
  EvictedStack stack(2);
  Stack ref = stack.twins.first, net = stack.twins.second;
  ChunkedModel& model = stack.model;
  const auto& x = stack.x;
  const int64_t chunk = EvictedStack::chunk;
  auto penalty = [](Stack& m) { return 1e-3 * m->fc[0]->weight.to(torch::kFloat).pow(2).sum(); };
  for (int it = 0; it < 3; ++it) {
    for (auto& p : ref->parameters()) p.mutable_grad().reset();
    for (auto& p : net->parameters()) p.mutable_grad().reset();
    auto ref_loss = ref->forward(x) + penalty(ref);
    ref_loss.backward();
    auto loss = model.forward([&] { return net->forward(x); }) + penalty(net);
    EXPECT_TRUE(torch::equal(net->fc[1]->weight.cpu(), ref->fc[1]->weight.cpu())) << "a read between forward and backward";
    model.backward(loss);
    EXPECT_TRUE(torch::allclose(loss, ref_loss, 1e-2, 1e-3)) << loss.item<float>() << " vs " << ref_loss.item<float>();
    ASSERT_NO_FATAL_FAILURE(expect_bf16_grads_close(ref, net));
    if (it >= 1) {
      EXPECT_FALSE(model.last_iteration().diverged) << "iteration " << it;
    }
    EXPECT_LE(model.last_iteration().device_peak_bytes, 3 * chunk);
  }
}

// D59: after an evaluation forward under evictions, before end_iteration(), every parameter has
// memory (its chunk on the device, or aliased on the host once its eviction's copy is done) and the
// values equal the unwrapped model's. Before the settle in end_forward, a chunk evicted late in the
// forward had a null storage there (reproduced on the CPU by the stream-model engine).
TEST(ChunkedModelGpu, AnEvaluationForwardLeavesEveryParameterReadable) {
  FERRY_REQUIRE_GPU();
  EvictedStack stack(3);
  Stack ref = stack.twins.first, net = stack.twins.second;
  ChunkedModel& model = stack.model;
  const auto& x = stack.x;
  model.backward(model.forward([&] { return net->forward(x); }));  // the warm-up
  for (auto& p : net->parameters()) p.mutable_grad().reset();
  auto ref_params = ref->named_parameters();
  for (int it = 0; it < 2; ++it) {
    torch::NoGradGuard no_grad;
    const auto y = model.forward([&] { return net->forward(x); });
    for (int64_t p = 0; p < model.num_params(); ++p) {
      const auto& w = model.param(p);
      ASSERT_TRUE(w.storage().data() != nullptr) << model.param_name(p) << " has no memory after evaluation " << it;
      EXPECT_TRUE(torch::equal(w.cpu(), ref_params[model.param_name(p)].cpu())) << model.param_name(p);
    }
    const auto y_ref = ref->forward(x);
    EXPECT_TRUE(torch::allclose(y, y_ref, 1e-2, 1e-3)) << y.item<float>() << " vs " << y_ref.item<float>();
  }
  model.end_iteration();
}

// D68 on CUDA: checkpointed blocks with dropout, the forward under CUDA autocast (bf16) and the
// backward outside it, an fp32 model under evictions. The recompute draws the forward's dropout masks
// from the CUDA generator and runs in bf16 again: loss and gradients as the unwrapped model's without
// checkpoints, and the next random number on the GPU the same (the recompute took nothing from it).
TEST(ChunkedModelGpu, ACheckpointedDropoutUnderAutocastMatchesTheUnwrappedModel) {
  FERRY_REQUIRE_GPU();
  constexpr int64_t d = 256, layers = 6, chunk = d * d * 4 + 4096;
  torch::manual_seed(5);
  Stack ref(d, layers);
  ref->to(torch::kCUDA);
  torch::manual_seed(5);
  Stack net(d, layers);
  ref->dropout = net->dropout = 0.2;
  net->checkpointed = true;
  ChunkedModel model(net.ptr(), cuda_config(chunk, 3 * chunk, Precision::kFp32));
  const auto x = torch::randn({8, 32, d}, torch::kCUDA);
  auto under_autocast = [](const std::function<torch::Tensor()>& f) {
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    torch::Tensor loss = f();
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    return loss;
  };
  int64_t evictions = 0;
  for (int it = 0; it < 3; ++it) {
    for (auto& p : ref->parameters()) p.mutable_grad().reset();
    for (auto& p : net->parameters()) p.mutable_grad().reset();
    torch::manual_seed(100 + it);
    const torch::Tensor ref_loss = under_autocast([&] { return ref->forward(x); });
    ref_loss.backward();
    const torch::Tensor next_ref = torch::rand({4}, torch::kCUDA);
    torch::manual_seed(100 + it);
    const torch::Tensor loss = under_autocast([&] { return model.forward([&] { return net->forward(x); }); });
    model.backward(loss);
    const torch::Tensor next = torch::rand({4}, torch::kCUDA);
    EXPECT_TRUE(torch::allclose(loss, ref_loss, 1e-3, 1e-5)) << loss.item<float>() << " vs " << ref_loss.item<float>();
    auto pr = ref->named_parameters(), pn = net->named_parameters();
    for (const auto& item : pr) {
      const auto& g = pn[item.key()].grad();
      ASSERT_TRUE(g.defined()) << item.key();
      EXPECT_TRUE(torch::allclose(g, item.value().grad(), 1e-2, 1e-4))
          << item.key() << " max diff " << (g - item.value().grad()).abs().max().item<float>();
    }
    EXPECT_TRUE(torch::equal(next, next_ref)) << "iteration " << it << ": the recompute drew from the CUDA stream";
    evictions += model.last_iteration().evictions;
  }
  EXPECT_GT(evictions, 0);
}

}  // namespace
}  // namespace ferry
