// HybridAdam on a real GPU (built as test_hybrid_adam_gpu, `gpu` label, skipped without one) and on the
// simulated device (built as test_hybrid_adam_devices, `cpu` label: the same step logic, with CPU tensors
// standing in, so a failure there is never hidden by the GPU binary's skip), with a device budget that forces
// evictions every iteration and the optimizer state split between the GPU and the host, so every path
// of a step runs on CUDA streams: gradients leaving per chunk on the copy stream into pinned staging,
// the host Adam on the worker, the updated chunks coming back, fused Adam on the device-resident state.
//  - backward_step(loss) (the per-chunk pipeline) leaves masters, moments and parameters bit-identical
//    to model.backward(loss) + step(), also with global-norm clipping (the two-phase path), also as the
//    last of two accumulated micro-batches;
//  - ten fp32 steps follow the unwrapped model trained by torch::optim::AdamW on the same GPU;
//  - state on the device and state on the host get the same bits (D53), also when a non-finite gradient
//    skips a chunk (D70), and across freezes, writes and learning-rate changes (D60-D62);
//  - ops between steps see the updates left running behind the step (D57).
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "../../hooks/chunked_model.h"
#include "../../optim/hybrid_adam.h"
#include "../test_util.h"
#include "same_state.h"

namespace ferry {
namespace {

struct LmImpl : torch::nn::Module {
  LmImpl(int64_t vocab, int64_t d, int64_t layers) : vocab(vocab) {
    wte = register_module("wte", torch::nn::Embedding(vocab, d));
    for (int64_t i = 0; i < layers; ++i) {
      ln.push_back(register_module("ln" + std::to_string(i), torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}))));
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(d, 4 * d)));
      out.push_back(register_module("out" + std::to_string(i), torch::nn::Linear(4 * d, d)));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& target) {
    auto x = wte(idx);
    for (size_t i = 0; i < fc.size(); ++i) {
      if (static_cast<int64_t>(i) != skip) x = x + out[i](torch::gelu(fc[i](ln[i](x))));
    }
    auto logits = torch::matmul(ln_f(x), wte->weight.t()).to(torch::kFloat);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), target.reshape({-1}));
  }
  int64_t vocab;
  int64_t skip = -1;  // a block the loss leaves out (stochastic depth)
  torch::nn::Embedding wte{nullptr};
  std::vector<torch::nn::LayerNorm> ln;
  std::vector<torch::nn::Linear> fc, out;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Lm);

constexpr int64_t kVocab = 128, kDim = 128, kLayers = 4;
constexpr int64_t kChunk = 4 * kDim * kDim * 4 + (16 << 10);  // about one fp32 MLP weight per chunk

struct Batch {
  torch::Tensor idx, target;
};
Batch batch(int64_t step, DeviceKind device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  auto idx = torch::randint(kVocab, {8, 64}, gen, torch::kLong);
  const auto dev = device == DeviceKind::kCuda ? torch::kCUDA : torch::kCPU;
  return {idx.to(dev), ((idx * 7 + 3) % kVocab).to(dev)};
}

Config device_config(DeviceKind device, Precision precision, int64_t state_roles = 3) {
  Config c;
  c.device = device;
  c.chunk_size_bytes = kChunk;
  // 3 parameter chunks + 2 state groups of 3 (4 with accumulation) fp32 chunks (each twice a bf16
  // chunk's bytes in bf16).
  c.device_budget_bytes = (3 + state_roles * 2 * (precision == Precision::kFp32 ? 1 : 2)) * kChunk;
  c.precision = precision;
  return c;
}

HybridAdamOptions options(double max_grad_norm) {
  AdamOptions o;
  o.lr = 1e-3;
  o.weight_decay = 0.1;
  HybridAdamOptions h = HybridAdamOptions::no_decay_for_bias_and_norm(o);
  h.device_state_chunks = 2;
  h.max_grad_norm = max_grad_norm;
  return h;
}

// Two Lms with the same initial values.
std::pair<Lm, Lm> twins(uint64_t seed) {
  torch::manual_seed(seed);
  Lm a(kVocab, kDim, kLayers);
  torch::manual_seed(seed);
  Lm b(kVocab, kDim, kLayers);
  return {a, b};
}

// Twin Lms (bf16, no device budget) with their HybridAdams: `a` keeps all its optimizer state on the
// device, `b` all on the host, so the placement is their only difference (D53).
struct DeviceAndHostState {
  DeviceAndHostState(DeviceKind device, uint64_t seed, const HybridAdamOptions& o)
      : a_net(seeded(seed)), b_net(seeded(seed)), a(a_net.ptr(), config(device)),
        b(b_net.ptr(), config(device)), chunks(a.layout().num_chunks()),
        a_adam(a, HybridAdamOptions(o).with_device_state_chunks(chunks)),
        b_adam(b, HybridAdamOptions(o).with_device_state_chunks(0)) {}
  static Lm seeded(uint64_t seed) {
    torch::manual_seed(seed);
    return Lm(kVocab, kDim, kLayers);
  }
  static Config config(DeviceKind device) {
    Config c = device_config(device, Precision::kBf16);
    c.device_budget_bytes = 0;  // no limit: the placement is the only difference
    return c;
  }
  Lm a_net, b_net;
  ChunkedModel a, b;
  int64_t chunks;
  HybridAdam a_adam, b_adam;
};

class HybridAdamOnDevice : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda) FERRY_REQUIRE_GPU();
  }
};

// Also pins down the staging order of the step (Note in stage_param_chunks_locked): with device-bound
// chunks staged first, the eviction policy evicted one staged a moment before, and on CUDA the device
// norms met a gradient on the host.
// With micro_batches > 1 (accumulate_grads), backward_step is the last micro-batch's backward + step().
void expect_pipeline_equals_step(DeviceKind device, double max_grad_norm, int micro_batches = 1,
                                 StateFormat format = StateFormat::kFp32) {
  HybridAdamOptions o = options(max_grad_norm);
  o.accumulate_grads = micro_batches > 1;
  o.state_format = format;
  const int64_t roles = o.accumulate_grads ? 4 : 3;
  const auto nets = twins(11);
  Lm a_net = nets.first, b_net = nets.second;
  Config config = device_config(device, Precision::kBf16, roles);
  if (format == StateFormat::kCompact) {  // 3 parameter chunks + 2 compact groups (4 B per element, scales)
    config.device_budget_bytes = (3 + 2 * 2) * kChunk + 2 * (16 << 10) + (o.accumulate_grads ? 2 * 2 * kChunk : 0);
  }
  ChunkedModel a(a_net.ptr(), config);
  ChunkedModel b(b_net.ptr(), config);
  HybridAdam a_adam(a, o), b_adam(b, o);
  int64_t evictions = 0, overlapped = 0, host_chunks = 0, clipped = 0;
  for (int step = 0; step < 5; ++step) {
    for (int k = 0; k + 1 < micro_batches; ++k) {
      const Batch x = batch(100 * step + k, device);
      a.backward(a.forward([&] { return a_net->loss(x.idx, x.target) / micro_batches; }));
      b.backward(b.forward([&] { return b_net->loss(x.idx, x.target) / micro_batches; }));
    }
    const Batch x = batch(100 * step + micro_batches - 1, device);
    a.backward(a.forward([&] { return a_net->loss(x.idx, x.target) / micro_batches; }));
    const StepResult ra = a_adam.step();
    const StepResult rb =
        b_adam.backward_step(b.forward([&] { return b_net->loss(x.idx, x.target) / micro_batches; }));
    a_adam.zero_grad();
    b_adam.zero_grad();
    ASSERT_TRUE(ra.applied && rb.applied) << "step " << step;
    // Note [Norms before the trip]: the host-state chunks' norms taken on the device, step()'s on the
    // host: the same bits (D85).
    EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << step;
    EXPECT_EQ(ra.clip_coef, rb.clip_coef) << "step " << step;
    EXPECT_LE(rb.device_syncs, 1) << "step " << step << ": no per-parameter synchronisation";
    evictions += b.last_iteration().evictions;
    overlapped += rb.overlapped_chunks;
    host_chunks += rb.host_chunks;
    clipped += rb.clip_coef < 1.0;
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "step " + std::to_string(step)));
  }
  // Note [A repack waits for held views]: nothing of ferry's own (copies, host jobs, device updates)
  // holds a chunk's memory at the warm-up's end, on this device too, so the repack ran at once.
  EXPECT_TRUE(a.layout_final() && b.layout_final());
  EXPECT_EQ(a.repack_waits() + b.repack_waits(), 0);
  EXPECT_GT(evictions, 4) << "the budget must force evictions";
  EXPECT_GT(host_chunks, 4) << "some state must live on the host";
  EXPECT_GT(overlapped, 0) << "chunks should start their update during backward";
  if (max_grad_norm > 0) {
    EXPECT_GT(clipped, 0) << "the clipping path must be exercised";
  }
}

TEST_P(HybridAdamOnDevice, PipelinedStepEqualsBackwardThenStepBitForBit) { expect_pipeline_equals_step(GetParam(), 0.0); }

TEST_P(HybridAdamOnDevice, PipelinedStepWithClippingEqualsBackwardThenStep) {
  expect_pipeline_equals_step(GetParam(), 0.05);
}

TEST_P(HybridAdamOnDevice, AccumulatedPipelinedStepWithClippingEqualsBackwardThenStep) {
  expect_pipeline_equals_step(GetParam(), 0.05, /*micro_batches=*/2);
}

// The compact state format (Note [The compact state format]) through the same paths: its host and
// device updates, per tensor, in backward_step's pipeline and after backward().
TEST_P(HybridAdamOnDevice, CompactStatePipelinedStepEqualsBackwardThenStepBitForBit) {
  expect_pipeline_equals_step(GetParam(), 0.0, 1, StateFormat::kCompact);
}

TEST_P(HybridAdamOnDevice, CompactStateAccumulatedPipelinedStepWithClippingEqualsBackwardThenStep) {
  expect_pipeline_equals_step(GetParam(), 0.05, /*micro_batches=*/2, StateFormat::kCompact);
}

TEST_P(HybridAdamOnDevice, TenFp32StepsFollowTorchAdamWOnTheSameDevice) {
  const DeviceKind device = GetParam();
  torch::manual_seed(12);
  Lm ref(kVocab, kDim, kLayers);
  if (device == DeviceKind::kCuda) ref->to(torch::kCUDA);
  torch::manual_seed(12);
  Lm net(kVocab, kDim, kLayers);
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : ref->parameters()) (p.dim() <= 1 ? no_decay : decay).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-3).weight_decay(0.1)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-3).weight_decay(0.0)));
  torch::optim::AdamW ref_opt(groups, torch::optim::AdamWOptions(1e-3));
  ChunkedModel model(net.ptr(), device_config(device, Precision::kFp32));
  HybridAdam adam(model, options(0.0));
  for (int step = 0; step < 10; ++step) {
    const Batch x = batch(step, device);
    ref_opt.zero_grad();
    auto ref_loss = ref->loss(x.idx, x.target);
    ref_loss.backward();
    ref_opt.step();
    const StepResult r = adam.backward_step(model.forward([&] { return net->loss(x.idx, x.target); }));
    ASSERT_TRUE(r.applied);
    EXPECT_NEAR(r.loss_scale, 1.0, 0.0);
  }
  // Two correct AdamW implementations (ferry's host/device kernels, torch's) differ by op order: a few
  // ulps per step, amplified a little by ten steps of training. Tensor-wise relative error.
  auto named = ref->named_parameters();
  double worst = 0;
  std::string worst_name;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const auto mine = model.param_values(p).cpu().to(torch::kDouble);
    const auto theirs = named[model.param_name(p)].detach().cpu().to(torch::kDouble);
    const double err = (mine - theirs).abs().max().item<double>() / std::max(theirs.abs().max().item<double>(), 1e-30);
    if (err > worst) worst = err, worst_name = model.param_name(p);
  }
  std::cout << "[ measured ] largest relative difference ferry vs torch AdamW after 10 steps: " << worst << " ("
            << worst_name << ")\n";
  EXPECT_LT(worst, 1e-4) << worst_name;
}

// D53: the update of a chunk is the same function wherever its state lives, so the placement (a memory
// decision) changes no bit. All state on the device against all on the host; on CUDA this is the GPU
// kernel against the CPU kernel. With clipping too: the norms are summed in one order on either side
// (D85), so the clip coefficient is the same bits.
void expect_device_state_equals_host_state(DeviceKind device, const HybridAdamOptions& o) {
  DeviceAndHostState t(device, 13, o);
  Lm &a_net = t.a_net, &b_net = t.b_net;  // (structured bindings cannot be captured in C++17)
  ChunkedModel &a = t.a, &b = t.b;
  HybridAdam &a_adam = t.a_adam, &b_adam = t.b_adam;
  const int64_t chunks = t.chunks;
  for (int step = 0; step < 4; ++step) {
    const Batch x = batch(step, device);
    const StepResult ra = a_adam.backward_step(a.forward([&] { return a_net->loss(x.idx, x.target); }));
    const StepResult rb = b_adam.backward_step(b.forward([&] { return b_net->loss(x.idx, x.target); }));
    ASSERT_TRUE(ra.applied && rb.applied) << "step " << step;
    EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << step;
    if (o.max_grad_norm > 0.0) {
      EXPECT_LT(ra.clip_coef, 1.0) << "step " << step << ": the case needs clipping";
    }
    EXPECT_EQ(ra.device_chunks, chunks) << "step " << step;
    EXPECT_EQ(rb.host_chunks, chunks) << "step " << step;
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "step " + std::to_string(step)));
  }
}

TEST_P(HybridAdamOnDevice, StateOnTheDeviceAndOnTheHostGiveTheSameBits) {
  expect_device_state_equals_host_state(GetParam(), options(0.0));
}

TEST_P(HybridAdamOnDevice, StateOnTheDeviceAndOnTheHostGiveTheSameBitsWhenClipped) {
  expect_device_state_equals_host_state(GetParam(), options(0.05));
}

// The same for the compact format: on CUDA the compact kernel (one thread block per block of 256, the
// scales by a reduction) against the CPU kernels, with the model's partial blocks (biases, norms).
TEST_P(HybridAdamOnDevice, CompactStateOnTheDeviceAndOnTheHostGiveTheSameBits) {
  expect_device_state_equals_host_state(GetParam(),
                                        HybridAdamOptions(options(0.0)).with_state_format(StateFormat::kCompact));
}

// D53 under what a training script does between steps: a layer frozen and unfrozen (D61, D62: its
// step count lags), a parameter written in place and one given new storage (D60), the learning rate
// changed. All state on the device against all on the host, in backward() + step() and backward_step,
// with and without accumulation over two micro-batches: the same bits at every step.
TEST_P(HybridAdamOnDevice, StepsBetweenFreezesWritesAndLrChangesGiveTheSameBitsWhereverTheStateLives) {
  const DeviceKind device = GetParam();
  for (const bool pipelined : {false, true}) {
    for (const bool accumulate : {false, true}) {
      const std::string what = std::string(pipelined ? "backward_step" : "backward + step") +
                               (accumulate ? ", two micro-batches" : "");
      DeviceAndHostState t(device, 23, options(0.0).with_accumulate_grads(accumulate));
      Lm &a_net = t.a_net, &b_net = t.b_net;
      ChunkedModel &a = t.a, &b = t.b;
      HybridAdam &a_adam = t.a_adam, &b_adam = t.b_adam;
      const int64_t chunks = t.chunks;
      const int micro = accumulate ? 2 : 1;
      for (int step = 0; step < 8; ++step) {
        const std::string when = what + ", step " + std::to_string(step);
        for (auto [net, adam] : {std::pair<Lm*, HybridAdam*>{&a_net, &a_adam}, {&b_net, &b_adam}}) {
          torch::NoGradGuard no_grad;
          if (step == 2 || step == 4) {
            for (auto& p : (*net)->fc[1]->parameters()) p.set_requires_grad(step == 4);
          }
          if (step == 3) (*net)->out[2]->weight.mul_(0.5);
          if (step == 5) adam->set_lr(0, 3e-4);
          if (step == 6) (*net)->fc[0]->bias.set_data(torch::full_like((*net)->fc[0]->bias, 0.01));
        }
        for (auto [net, model, adam] : {std::tuple<Lm*, ChunkedModel*, HybridAdam*>{&a_net, &a, &a_adam},
                                        {&b_net, &b, &b_adam}}) {
          for (int k = 0; k < micro; ++k) {
            const Batch x = batch(10 * step + k, device);
            const torch::Tensor loss = model->forward([&, net = net] { return (*net)->loss(x.idx, x.target) / micro; });
            if (pipelined && k + 1 == micro) {
              ASSERT_TRUE(adam->backward_step(loss).applied) << when;
            } else {
              model->backward(loss);
            }
          }
          if (!pipelined) {
            ASSERT_TRUE(adam->step().applied) << when;
          }
          adam->zero_grad();
        }
        if (step > 0) {
          ASSERT_EQ(a_adam.device_state_chunks(), chunks) << when;
        }
        ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, when));
        for (int64_t p = 0; p < a.num_params(); ++p) {
          ASSERT_EQ(a_adam.param_step_count(p), b_adam.param_step_count(p)) << when << ": " << a.param_name(p);
        }
      }
      int64_t fc1 = 0;
      while (fc1 < a.num_params() && a.param_name(fc1) != "fc1.weight") ++fc1;
      ASSERT_LT(fc1, a.num_params());
      EXPECT_EQ(a_adam.param_step_count(fc1), 6) << what << ": frozen for two of eight steps";
    }
  }
}

// A non-finite gradient in backward_step's eager pipeline skips its chunk (Note [Pipelined step]): the
// chunk's slots, which held the gradients, get the parameters' values back, on the device as on the
// host. Seen before on the simulated device: with the state on the device the skipped chunk kept its
// NaN gradient as the parameter's value, so every later step overflowed (D70). A gradient that is
// finite but whose norm overflows (1e20 per element: its square is not a float) counts as non-finite
// too, on the host as on the device; before, the host job updated such a chunk, the device skipped it,
// and the step reported an overflow either way. All state on the device against all on the host, the
// value injected into one weight's gradient at step 2: the same bits at every step, no non-finite value
// anywhere, and training goes on.
TEST_P(HybridAdamOnDevice, ANonFiniteGradientSkipsItsChunkWhereverItsStateLives) {
  const DeviceKind device = GetParam();
  for (const auto& c : {std::pair{StateFormat::kFp32, double(NAN)}, {StateFormat::kFp32, 1e20},
                        {StateFormat::kCompact, double(NAN)}, {StateFormat::kCompact, 1e20}}) {
    const StateFormat format = c.first;
    const double injected = c.second;  // (structured bindings cannot be captured in C++17)
    const std::string what = std::string(to_string(format)) + " state, gradient " + std::to_string(injected);
    DeviceAndHostState t(device, 19, HybridAdamOptions(options(0.0)).with_state_format(format));
    Lm &a_net = t.a_net, &b_net = t.b_net;
    ChunkedModel &a = t.a, &b = t.b;
    HybridAdam &a_adam = t.a_adam, &b_adam = t.b_adam;
    const int64_t chunks = t.chunks;
    bool poison = false;
    for (Lm* net : {&a_net, &b_net}) {
      (*net)->fc[2]->weight.register_hook(
          [&poison, injected](const torch::Tensor& g) { return poison ? torch::full_like(g, injected) : g; });
    }
    for (int step = 0; step < 5; ++step) {
      const std::string when = what + ", step " + std::to_string(step);
      poison = step == 2;
      const Batch x = batch(step, device);
      const StepResult ra = a_adam.backward_step(a.forward([&] { return a_net->loss(x.idx, x.target); }));
      const StepResult rb = b_adam.backward_step(b.forward([&] { return b_net->loss(x.idx, x.target); }));
      a_adam.zero_grad();
      b_adam.zero_grad();
      EXPECT_EQ(ra.overflow, poison) << when;
      EXPECT_EQ(rb.overflow, poison) << when;
      // Note [Norms before the trip]: the host-state twin's chunks are on the device when final, so their
      // norms (and skips) were taken there, by the jobs or, for those taken back, at the step's end.
      if (step > 0 && device == DeviceKind::kSimulated) {
        EXPECT_EQ(rb.host_norm_bytes, 0) << when;
      }
      if (step < 2) continue;  // placed and pipelined from step 2 on (the first steps trace and place)
      ASSERT_EQ(ra.device_chunks, chunks) << when;
      ASSERT_EQ(rb.host_chunks, chunks) << when;
      ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, when));
      for (int64_t p = 0; p < a.num_params(); ++p) {
        ASSERT_TRUE(torch::isfinite(a.param_values(p)).all().item<bool>()) << when << ": " << a.param_name(p);
        ASSERT_TRUE(torch::isfinite(a_adam.master(p)).all().item<bool>()) << when << ": master " << a.param_name(p);
        ASSERT_TRUE(torch::isfinite(a_adam.exp_avg_sq(p)).all().item<bool>()) << when << ": exp_avg_sq "
                                                                              << a.param_name(p);
      }
    }
    int64_t poisoned = 0;
    while (poisoned < a.num_params() && a.param_name(poisoned) != "fc2.weight") ++poisoned;
    ASSERT_LT(poisoned, a.num_params());
    EXPECT_EQ(a_adam.param_step_count(poisoned), 4) << what << ": its chunk skipped one of five steps";
    EXPECT_EQ(a_adam.param_step_count(0), 5) << what << ": the other chunks were updated";
  }
}

// Note [A gradient after its chunk's update] wherever the state lives: block 2, skipped by the first
// steps (stochastic depth), is used from step 3 on, so its gradients land after its chunk-mates' update
// had started and are updated after backward. All state on the device against all on the host, both
// under the eager backward_step: the same late parameters, the same bits at every step, no refusal.
// (The two-phase step, which takes the chunk's norm again, is compared with backward() + step() in
// PipelinedStepTakesAGradientItsChunkDidNotExpect.)
TEST_P(HybridAdamOnDevice, ALateGradientIsTakenWhereverTheStateLives) {
  const DeviceKind device = GetParam();
  DeviceAndHostState t(device, 29, options(0.0));
  Lm &a_net = t.a_net, &b_net = t.b_net;
  ChunkedModel &a = t.a, &b = t.b;
  HybridAdam &a_adam = t.a_adam, &b_adam = t.b_adam;
  int64_t late = 0;
  for (int step = 0; step < 6; ++step) {
    const std::string when = "step " + std::to_string(step);
    a_net->skip = b_net->skip = step < 3 ? 2 : -1;
    const Batch x = batch(step, device);
    StepResult ra, rb;
    ASSERT_EQ(test::error_of([&] { ra = a_adam.backward_step(a.forward([&] { return a_net->loss(x.idx, x.target); })); }),
              "(no error)") << when;
    ASSERT_EQ(test::error_of([&] { rb = b_adam.backward_step(b.forward([&] { return b_net->loss(x.idx, x.target); })); }),
              "(no error)") << when;
    a_adam.zero_grad();
    b_adam.zero_grad();
    ASSERT_TRUE(ra.applied && rb.applied) << when;
    EXPECT_EQ(ra.late_params, rb.late_params) << when;
    late += ra.late_params;
    if (step < 2) continue;  // placed and pipelined from step 2 on (the first steps trace and place)
    ASSERT_EQ(ra.device_chunks, t.chunks) << when;
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, when));
    for (int64_t p = 0; p < a.num_params(); ++p) {
      ASSERT_EQ(a_adam.param_step_count(p), b_adam.param_step_count(p)) << when << ": " << a.param_name(p);
    }
  }
  EXPECT_GT(late, 0) << "block 2's gradients came after their chunk's update had started";
}

// Note [Ops outside the scopes] (D57) where the device is real: right after step() returns with its
// host updates held back on the worker (b; a writes them in the step), ops on this thread read the new
// values, and torch::save saves them: on CUDA it copies each storage through an op, which waits (on the
// simulated device it copies CPU bytes directly: synchronize() first, the documented limit). Last in
// the file: on CUDA this is the first run of ops on parameters outside ferry's scopes (D35 included),
// and a crash here spares the results of the tests above.
TEST_P(HybridAdamOnDevice, OpsBetweenStepsSeeTheUpdatesLeftRunning) {
  const DeviceKind device = GetParam();
  const auto nets = twins(17);
  Lm a_net = nets.first, b_net = nets.second;
  ChunkedModel a(a_net.ptr(), device_config(device, Precision::kBf16));
  ChunkedModel b(b_net.ptr(), device_config(device, Precision::kBf16));
  HybridAdam a_adam(a, options(0.05).with_update_behind_forward(false));
  HybridAdam b_adam(b, options(0.05));
  auto a_params = a_net->named_parameters(), b_params = b_net->named_parameters();
  int64_t deferred = 0;
  for (int step = 0; step < 4; ++step) {
    const std::string when = "step " + std::to_string(step);
    const Batch x = batch(step, device);
    a.backward(a.forward([&] { return a_net->loss(x.idx, x.target); }));
    a_adam.step();
    b.backward(b.forward([&] { return b_net->loss(x.idx, x.target); }));
    (void)b_adam.run_on_worker([] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); });
    deferred += b_adam.step().deferred_chunks;
    torch::NoGradGuard no_grad;
    if (step % 2 == 0) {
      for (const auto& item : a_params) {
        EXPECT_TRUE(torch::equal(b_params[item.key()].cpu(), item.value().cpu())) << when << ": " << item.key();
      }
    } else {
      if (device != DeviceKind::kCuda) b_adam.synchronize();
      std::stringstream archive;
      torch::save(b_net, archive);
      Lm loaded(kVocab, kDim, kLayers);
      loaded->to(b_params[0].value().device(), torch::kBFloat16);
      torch::load(loaded, archive);
      auto loaded_params = loaded->named_parameters();
      for (const auto& item : a_params) {
        EXPECT_TRUE(torch::equal(loaded_params[item.key()].cpu(), item.value().cpu())) << when << ": saved " << item.key();
      }
    }
    a_adam.zero_grad();
    b_adam.zero_grad();
  }
  EXPECT_GE(deferred, 4) << "host updates must be left running";
  b_adam.synchronize();
  ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 4 steps"));
}

#ifdef FERRY_TEST_ON_CUDA
INSTANTIATE_TEST_SUITE_P(Cuda, HybridAdamOnDevice, ::testing::Values(DeviceKind::kCuda));
#else
INSTANTIATE_TEST_SUITE_P(Simulated, HybridAdamOnDevice, ::testing::Values(DeviceKind::kSimulated));
#endif

}  // namespace
}  // namespace ferry
