// HybridAdam on a ChunkedModel, on the simulated device with budgets that force evictions every
// iteration and the optimizer state split between device and host: 20 steps equal the unwrapped model
// trained by torch::optim::AdamW; gradient accumulation equals the big batch; clipping equals
// clip_grad_norm_; fp16 overflow skips the step and backs the scale off; save/resume continues
// bit-identically; bad input fails with a clear error and changes nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <thread>

#include "../../chunk/stream_model_engine.h"
#include "../../hooks/checkpoint.h"
#include "../../hooks/chunked_model.h"
#include "../../hooks/interceptor.h"
#include "../../optim/hybrid_adam.h"
#include "../cpu_adam/adam_reference.h"
#include "../cpu_adam_twin.h"
#include "../test_util.h"
#include "same_state.h"

namespace ferry {
namespace {

// A gate for the pipeline test: its backward (reached after the later blocks' gradients have landed,
// before the embedding's) waits until the HybridAdam in g_gate_adam has started a pipelined host job,
// for at most 30 s, and records whether it saw one. Identity otherwise.
std::atomic<HybridAdam*> g_gate_adam{nullptr};
std::atomic<int> g_gate_saw_job{-1};  // -1: the gate did not run
std::atomic<int64_t> g_gate_jobs_before{0};  // jobs started before this backward (the gate waits for more)
struct WaitForHostAdam : torch::autograd::Function<WaitForHostAdam> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    if (HybridAdam* adam = g_gate_adam.load()) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      const int64_t before = g_gate_jobs_before.load();
      while (adam->pipelined_jobs_started() == before && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      g_gate_saw_job = adam->pipelined_jobs_started() > before ? 1 : 0;
    }
    return {g[0]};
  }
};

// A small language model: embedding, two residual MLP blocks with LayerNorm, tied output head.
struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl(int64_t vocab, int64_t d) {
    wte = register_module("wte", torch::nn::Embedding(vocab, d));
    for (int i = 0; i < 2; ++i) {
      ln.push_back(register_module("ln" + std::to_string(i), torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}))));
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(d, 4 * d)));
      out.push_back(register_module("out" + std::to_string(i), torch::nn::Linear(4 * d, d)));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = wte(idx);
    if (gate) x = WaitForHostAdam::apply(x);
    if (after_embedding) x = after_embedding(x);
    for (int i = 0; i < 2; ++i) x = x + out[i](torch::gelu(fc[i](ln[i](x))));
    return torch::matmul(ln_f(x), wte->weight.t());
  }
  torch::nn::Embedding wte{nullptr};
  std::vector<torch::nn::LayerNorm> ln;
  std::vector<torch::nn::Linear> fc, out;
  torch::nn::LayerNorm ln_f{nullptr};
  bool gate = false;  // WaitForHostAdam after the embedding
  std::function<torch::Tensor(const torch::Tensor&)> after_embedding;  // null: none
};
TORCH_MODULE(TinyLm);

constexpr int64_t kVocab = 64, kDim = 32, kChunk = 16 << 10;  // every tensor fits one 16 KiB chunk

torch::Tensor lm_loss(TinyLm& net, const torch::Tensor& idx, const torch::Tensor& target) {
  auto logits = net->forward(idx);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), target.reshape({-1}));
}

struct Batch {
  torch::Tensor idx, target;
};
Batch batch(int64_t step, int64_t b = 4, int64_t t = 8) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto idx = torch::randint(kVocab, {b, t}, gen, torch::kLong);
  return {idx, (idx * 7 + 3) % kVocab};  // a learnable mapping
}

Config sim_config(int64_t budget, Precision precision = Precision::kFp32) {
  Config c;
  c.device = DeviceKind::kSimulated;
  c.chunk_size_bytes = kChunk;
  c.device_budget_bytes = budget;
  c.precision = precision;
  return c;
}

AdamOptions adamw(double lr = 1e-2) {
  AdamOptions o;
  o.lr = lr;
  o.weight_decay = 0.1;
  return o;
}

// torch's AdamW with the same two groups as HybridAdamOptions::no_decay_for_bias_and_norm.
std::unique_ptr<torch::optim::AdamW> reference_adamw(TinyLm& ref, double lr = 1e-2) {
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : ref->parameters()) (p.dim() <= 1 ? no_decay : decay).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(lr).weight_decay(0.1).eps(1e-8)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(lr).weight_decay(0.0).eps(1e-8)));
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(lr));
}

// Tensor-wise relative error max|a - b| / max|b|. (Element-wise ratios are dominated by entries near
// zero, where a few ulps of op-order noise between two correct Adam implementations show up as 1e-5.)
double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const auto a64 = a.to(torch::kDouble), b64 = b.to(torch::kDouble);
  const double scale = std::max(b64.abs().max().item<double>(), 1e-30);
  return (a64 - b64).abs().max().item<double>() / scale;
}

// Budget: `param_chunks` parameter chunks plus `state_chunks` state groups of `roles` fp32 chunks each
// (master, exp_avg, exp_avg_sq; + grad with accumulate_grads).
int64_t budget_for(int64_t param_chunks, int64_t state_chunks, int64_t roles = 3) {
  return (param_chunks + roles * state_chunks) * kChunk;
}

// Every parameter's optimizer state before a step (fp32 copies).
struct PreStep {
  std::vector<torch::Tensor> master, exp_avg, exp_avg_sq, grad;
};
PreStep snapshot(HybridAdam& adam, ChunkedModel& model) {
  PreStep s;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    s.master.push_back(adam.master(p).cpu());
    s.exp_avg.push_back(adam.exp_avg(p).cpu());
    s.exp_avg_sq.push_back(adam.exp_avg_sq(p).cpu());
    s.grad.push_back(adam.grad(p).cpu());
  }
  return s;
}

// The largest number of fp32 terms in one of the sums behind a grad norm (a 16 KiB chunk of fp32, or
// a whole parameter in torch's clip_grad_norm_). Any fp32 summation order of n non-negative terms is
// within (n - 1) u of the exact sum, so a norm (its square root) within n u / 2, plus one rounding.
constexpr int64_t kMaxSumTerms = kChunk / 4;
constexpr double kNormTol = (kMaxSumTerms / 2.0 + 2) * test::kUnitRoundoff;

// ferry's step `r` from state `pre` equals the fp64 Adam step within the fp32 bound (adam_reference.h),
// for every parameter, master and both moments; the reported norm is the fp64 norm of ferry's grads.
void expect_step_matches_fp64(HybridAdam& adam, ChunkedModel& model, const PreStep& pre, const StepResult& r,
                              const std::string& what) {
  double sum_sq = 0;
  for (const auto& g : pre.grad) sum_sq += g.to(torch::kDouble).pow(2).sum().item<double>();
  const double norm64 = std::sqrt(sum_sq) / r.loss_scale;
  EXPECT_LE(std::abs(r.grad_norm - norm64), kNormTol * norm64) << what << ": grad norm";
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const int g = adam.group_of(p);
    const test::AdamStepFp64 ref = test::adam_step_fp64(pre.master[p], pre.grad[p], pre.exp_avg[p], pre.exp_avg_sq[p],
                                                        adam.group_options(g), adam.param_step_count(p),
                                                        r.clip_coef / r.loss_scale);
    EXPECT_LE(test::excess(adam.master(p).cpu(), ref.param, ref.param_tol), 1.0) << what << ": master " << model.param_name(p);
    EXPECT_LE(test::excess(adam.exp_avg(p).cpu(), ref.exp_avg, ref.exp_avg_tol), 1.0) << what << ": exp_avg "
                                                                                     << model.param_name(p);
    EXPECT_LE(test::excess(adam.exp_avg_sq(p).cpu(), ref.exp_avg_sq, ref.exp_avg_sq_tol), 1.0)
        << what << ": exp_avg_sq " << model.param_name(p);
  }
}

// After the first step from the same initial values, ferry's masters equal torch::optim::AdamW's
// parameters. At step 1 Adam's update is lr * g' / (|g'| + eps) exactly (bias corrections cancel), so
// a difference dg' between the two sides' clipped gradients moves it by at most lr |dg'| / (|g'| + eps)
// (first order; x2 for slack), on top of the fp32 bound 16 u (|p| + lr) of each side.
void expect_first_step_matches_torch(HybridAdam& adam, ChunkedModel& model, TinyLm& ref, const PreStep& pre,
                                     const StepResult& r) {
  auto named = ref->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const auto& t = named[model.param_name(p)];
    const auto o = adam.group_options(adam.group_of(p));
    const auto g_ferry = pre.grad[p].to(torch::kDouble) * (r.clip_coef / r.loss_scale);
    const auto g_torch = t.grad().to(torch::kDouble);  // clip_grad_norm_ scaled it in place
    const auto tol = 2 * 16 * test::kUnitRoundoff * (t.detach().to(torch::kDouble).abs() + o.lr) +
                     2 * o.lr * (g_ferry - g_torch).abs() / (g_torch.abs() + o.eps);
    EXPECT_LE(test::excess(adam.master(p).cpu(), t.detach().to(torch::kDouble), tol), 1.0)
        << "first step vs torch::optim::AdamW: " << model.param_name(p);
  }
}

TEST(HybridAdam, TwentyStepsEqualTorchAdamWWithEvictionsAndSplitState) {
  // The first step against torch::optim::AdamW from the same initial values; every step against the
  // fp64 Adam step from ferry's own state (adam_reference.h: why not 20 steps beside torch).
  torch::manual_seed(3);
  TinyLm ref(kVocab, kDim);
  torch::manual_seed(3);
  TinyLm net(kVocab, kDim);
  auto ref_opt = reference_adamw(ref);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  HybridAdam adam(model, options);
  ASSERT_EQ(adam.num_param_groups(), 2);
  int64_t evictions = 0;
  for (int step = 0; step < 20; ++step) {
    const Batch b = batch(step);
    auto loss = model.forward([&] { return lm_loss(net, b.idx, b.target); });
    model.backward(loss);
    const PreStep pre = snapshot(adam, model);
    const StepResult r = adam.step();
    ASSERT_TRUE(r.applied) << "step " << step;
    expect_step_matches_fp64(adam, model, pre, r, "step " + std::to_string(step));
    if (step == 0) {
      auto ref_loss = lm_loss(ref, b.idx, b.target);
      ref_loss.backward();
      ref_opt->step();
      // Same ops on the same values: the losses agree to the rounding of a 32-term mean.
      EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 64 * test::kUnitRoundoff * ref_loss.item<double>());
      expect_first_step_matches_torch(adam, model, ref, pre, r);
    }
    adam.zero_grad();
    if (step > 0) {  // placed after warm-up: 2 state groups on the device, the rest on the host
      EXPECT_EQ(r.device_chunks, 2);
      EXPECT_EQ(r.host_chunks, model.layout().num_chunks() - 2);
      const IterationStats it = model.last_iteration();
      EXPECT_LE(it.device_peak_bytes, 3 * kChunk) << "step " << step;
      evictions += it.evictions;
    }
    for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined()) << "grads go to chunks, not .grad";
  }
  EXPECT_TRUE(adam.placed());
  EXPECT_EQ(adam.device_state_chunks(), 2);
  // Note [Which state goes to the device]: the first layout chunks' state; the host keeps the state
  // of the chunks backward finalizes first.
  for (int64_t c = 0; c < model.layout().num_chunks(); ++c) EXPECT_EQ(adam.state_on_device(c), c < 2) << c;
  // One device accountant for both stores: the state's device bytes are the "other" bytes the
  // parameter chunks' budget leaves room for, every role is named, and the total never passed the budget.
  EXPECT_EQ(model.scheduler().other_device_bytes(), 2 * 3 * kChunk);
  const DeviceAccountant& acc = *model.device_accountant();
  const auto by_role = acc.bytes_by_role();
  const ChunkStoreStats ps = model.store().stats(), ss = adam.state_store().stats();
  for (int role = 0; role < kNumChunkRoles; ++role) {
    EXPECT_EQ(by_role[role], ps.device_bytes_by_role[role] + ss.device_bytes_by_role[role]) << role;
  }
  EXPECT_EQ(by_role[static_cast<int>(ChunkRole::kMaster)], 2 * kChunk);
  EXPECT_EQ(acc.current_bytes(), ps.device.current_bytes + ss.device.current_bytes);
  EXPECT_LE(acc.peak_bytes(), budget_for(3, 2)) << "parameters + device state within the one budget";
  EXPECT_GT(evictions, 19) << "the budget must force evictions every iteration";
  EXPECT_EQ(adam.step_count(0), 20);
  // The compute copies equal the masters (fp32: exactly).
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(model.param_values(p).cpu(), adam.master(p))) << model.param_name(p);
  }
}

// D62: a parameter whose first gradient comes at a later step takes torch's per-parameter step count.
// fc0 is frozen in both runs for 10 steps (torch::optim::AdamW skips it: no .grad; ferry: no landing),
// then unfrozen: its first update is torch's first, lr * g / (|g| + eps) plus the decay, and the fp64
// Adam step with step count 1 (the others' 11). With the group's count for fc0 (the bias corrections of
// step 11) the update is 0.48 of that: both checks fail.
TEST(HybridAdam, AParameterFirstUpdatedLateTakesTorchAdamWsFirstStep) {
  torch::manual_seed(3);
  TinyLm ref(kVocab, kDim);
  torch::manual_seed(3);
  TinyLm net(kVocab, kDim);
  auto set_trainable = [](torch::nn::Module& m, bool on) {
    for (auto& p : m.parameters()) p.set_requires_grad(on);
  };
  set_trainable(*ref->fc[0], false);
  set_trainable(*net->fc[0], false);
  auto ref_opt = reference_adamw(ref);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  HybridAdam adam(model, options);
  std::vector<int64_t> late;  // fc0's parameters
  for (int64_t p = 0; p < model.num_params(); ++p) {
    if (model.param_name(p).rfind("fc0.", 0) == 0) late.push_back(p);
  }
  ASSERT_EQ(late.size(), 2u);
  constexpr int kFrozenSteps = 10;
  for (int step = 0; step <= kFrozenSteps; ++step) {
    if (step == kFrozenSteps) {
      set_trainable(*ref->fc[0], true);
      set_trainable(*net->fc[0], true);
    }
    const Batch b = batch(step);
    model.backward(model.forward([&] { return lm_loss(net, b.idx, b.target); }));
    const PreStep pre = snapshot(adam, model);
    const StepResult r = adam.step();
    ASSERT_TRUE(r.applied) << "step " << step;
    adam.zero_grad();
    ref_opt->zero_grad();
    lm_loss(ref, b.idx, b.target).backward();
    std::vector<torch::Tensor> ref_grad, ref_before;
    auto named = ref->named_parameters();
    for (int64_t p : late) {
      const torch::Tensor& t = named[model.param_name(p)];
      ref_grad.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
      ref_before.push_back(t.detach().clone());
    }
    ref_opt->step();
    if (step < kFrozenSteps) {
      for (int64_t p : late) {
        EXPECT_TRUE(torch::equal(adam.master(p), pre.master[p])) << "frozen " << model.param_name(p) << " changed";
        EXPECT_EQ(adam.param_step_count(p), 0);
      }
      continue;
    }
    // Every parameter had a gradient at this step: each against the fp64 step with its own count.
    expect_step_matches_fp64(adam, model, pre, r, "the step that unfroze fc0");
    for (size_t k = 0; k < late.size(); ++k) {
      const int64_t p = late[k];
      EXPECT_EQ(adam.param_step_count(p), 1) << model.param_name(p);
      ASSERT_TRUE(ref_grad[k].defined());
      ASSERT_TRUE(torch::equal(pre.master[p], ref_before[k])) << "frozen alike on both sides";
      // As expect_first_step_matches_torch: the two sides' gradients differ by what 10 steps of two
      // correct Adams (different op orders) made of the other parameters; step 1 moves by at most
      // lr |dg| / (|g| + eps) for it.
      const auto o = adam.group_options(adam.group_of(p));
      const auto g_ferry = pre.grad[p].to(torch::kDouble);
      const auto g_torch = ref_grad[k].to(torch::kDouble);
      const torch::Tensor after = named[model.param_name(p)].detach().to(torch::kDouble);
      const auto tol = 2 * 16 * test::kUnitRoundoff * (after.abs() + o.lr) +
                       2 * o.lr * (g_ferry - g_torch).abs() / (g_torch.abs() + o.eps);
      EXPECT_LE(test::excess(adam.master(p).cpu(), after, tol), 1.0)
          << "first update of " << model.param_name(p) << " vs torch::optim::AdamW's";
    }
  }
  EXPECT_EQ(adam.step_count(0), kFrozenSteps + 1);
  EXPECT_EQ(adam.param_step_count(0), kFrozenSteps + 1);  // the embedding: a gradient at every step
  const std::string error = test::error_of([&] { adam.param_step_count(model.num_params()); });
  EXPECT_NE(error.find("expected a parameter index in [0, " + std::to_string(model.num_params()) + "), got " +
                       std::to_string(model.num_params())),
            std::string::npos)
      << error;
}

TEST(HybridAdam, Bf16MastersStartFromTheOriginalFp32Values) {
  torch::manual_seed(21);
  TinyLm net(kVocab, kDim);
  std::map<std::string, torch::Tensor> original;
  for (const auto& item : net->named_parameters()) original[item.key()] = item.value().detach().clone();
  ChunkedModel model(net.ptr(), sim_config(0, Precision::kBf16));
  EXPECT_TRUE(model.initial_value(0).defined()) << "kept until an optimizer takes them";
  HybridAdam adam(model, HybridAdamOptions{});
  EXPECT_FALSE(model.initial_value(0).defined()) << "released once the masters hold them";
  double rounding = 0;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const auto& want = original.at(model.param_name(p));
    EXPECT_TRUE(torch::equal(adam.master(p), want)) << model.param_name(p) << ": the fp32 master is the original";
    rounding = std::max(rounding, (model.param_values(p).to(torch::kFloat) - want).abs().max().item<double>());
  }
  EXPECT_GT(rounding, 0) << "the bf16 compute copy does round (the test would prove nothing otherwise)";

  // state_dict() gives the fp32 masters; load_state_dict() into another model sets masters exactly and
  // the bf16 parameters to their rounding.
  const NamedTensors sd = adam.state_dict();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_EQ(sd[p].first, model.param_name(p));
    EXPECT_TRUE(torch::equal(sd[p].second, original.at(model.param_name(p)))) << sd[p].first;
  }
  torch::manual_seed(23);
  TinyLm other_net(kVocab, kDim);
  ChunkedModel other(other_net.ptr(), sim_config(0, Precision::kBf16));
  HybridAdam other_adam(other, HybridAdamOptions{});
  other_adam.load_state_dict(sd);
  for (int64_t p = 0; p < other.num_params(); ++p) {
    const auto& want = original.at(other.param_name(p));
    EXPECT_TRUE(torch::equal(other_adam.master(p), want)) << other.param_name(p);
    EXPECT_TRUE(torch::equal(other.param_values(p), want.to(torch::kBFloat16))) << other.param_name(p);
  }
}

TEST(HybridAdam, DefaultsAreTorchAdamW) {
  // HybridAdam(model) with no options takes the step torch::optim::AdamW(params) takes (lr 1e-3,
  // weight decay 1e-2 on every parameter).
  torch::manual_seed(22);
  TinyLm ref(kVocab, kDim);
  torch::manual_seed(22);
  TinyLm net(kVocab, kDim);
  torch::optim::AdamW ref_opt(ref->parameters());
  ChunkedModel model(net.ptr(), sim_config(0));
  HybridAdam adam(model);
  ASSERT_EQ(adam.num_param_groups(), 1);
  EXPECT_EQ(adam.group_options(0).weight_decay, 1e-2);
  const Batch b = batch(0);
  model.backward(model.forward([&] { return lm_loss(net, b.idx, b.target); }));
  const PreStep pre = snapshot(adam, model);
  const StepResult r = adam.step();
  lm_loss(ref, b.idx, b.target).backward();
  ref_opt.step();
  expect_first_step_matches_torch(adam, model, ref, pre, r);
}

TEST(HybridAdam, ChainableOptionsSayTheSameAsFields) {
  const AdamOptions chained = AdamOptions().with_lr(3e-4).with_betas(0.9, 0.95).with_eps(1e-6).with_weight_decay(0.1);
  AdamOptions fields;
  fields.lr = 3e-4;
  fields.beta2 = 0.95;
  fields.eps = 1e-6;
  fields.weight_decay = 0.1;
  EXPECT_EQ(chained.lr, fields.lr);
  EXPECT_EQ(chained.beta1, fields.beta1);
  EXPECT_EQ(chained.beta2, fields.beta2);
  EXPECT_EQ(chained.eps, fields.eps);
  EXPECT_EQ(chained.weight_decay, fields.weight_decay);
  torch::manual_seed(24);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(0));
  HybridAdam one_group(model, AdamOptions().with_lr(1e-2));  // one group, as torch's AdamW(params, lr)
  EXPECT_EQ(one_group.num_param_groups(), 1);
  EXPECT_EQ(one_group.lr(0), 1e-2);
}

TEST(HybridAdam, PlacementFollowsTheMargin) {
  {  // a generous budget: every state group fits beside the parameters
    torch::manual_seed(0);
    TinyLm net(kVocab, kDim);
    ChunkedModel model(net.ptr(), sim_config(budget_for(40, 40)));
    HybridAdam adam(model, HybridAdamOptions{});
    EXPECT_FALSE(adam.placed());
    for (int step = 0; step < 2; ++step) {
      const Batch b = batch(step);
      model.backward(model.forward([&] { return lm_loss(net, b.idx, b.target); }));
      adam.step();
      adam.zero_grad();
    }
    EXPECT_TRUE(adam.placed());
    EXPECT_EQ(adam.device_state_chunks(), model.layout().num_chunks());
  }
  {  // parameters alone do not fit: all state stays on the host
    torch::manual_seed(0);
    TinyLm net(kVocab, kDim);
    ChunkedModel model(net.ptr(), sim_config(budget_for(3, 0)));
    HybridAdam adam(model, HybridAdamOptions{});
    for (int step = 0; step < 2; ++step) {
      const Batch b = batch(step);
      model.backward(model.forward([&] { return lm_loss(net, b.idx, b.target); }));
      const StepResult r = adam.step();
      adam.zero_grad();
      EXPECT_EQ(r.device_chunks, 0);
    }
    EXPECT_TRUE(adam.placed());
    EXPECT_EQ(adam.device_state_chunks(), 0);
  }
}

TEST(HybridAdam, AccumulationEqualsTheBigBatch) {
  torch::manual_seed(5);
  TinyLm big_net(kVocab, kDim);
  torch::manual_seed(5);
  TinyLm micro_net(kVocab, kDim);
  ChunkedModel big(big_net.ptr(), sim_config(budget_for(3, 1, 4)));
  ChunkedModel micro(micro_net.ptr(), sim_config(budget_for(3, 1, 4)));
  HybridAdamOptions options;
  options.defaults = adamw();
  options.accumulate_grads = true;
  options.device_state_chunks = 1;
  HybridAdam big_adam(big, options), micro_adam(micro, options);
  for (int step = 0; step < 3; ++step) {
    const Batch b = batch(step, /*b=*/8);
    big.backward(big.forward([&] { return lm_loss(big_net, b.idx, b.target); }));
    const int n = 4;
    for (int k = 0; k < n; ++k) {
      auto idx = b.idx.narrow(0, 2 * k, 2), target = b.target.narrow(0, 2 * k, 2);
      micro.backward(micro.forward([&] { return lm_loss(micro_net, idx, target) / n; }));
    }
    for (int64_t p = 0; p < big.num_params(); ++p) {
      EXPECT_LE(rel_err(micro_adam.grad(p), big_adam.grad(p)), 1e-5) << "step " << step << " grad of "
                                                                           << big.param_name(p);
    }
    big_adam.step();
    micro_adam.step();
    big_adam.zero_grad();
    micro_adam.zero_grad();
  }
  for (int64_t p = 0; p < big.num_params(); ++p) {
    EXPECT_LE(rel_err(micro_adam.master(p), big_adam.master(p)), 1e-5) << big.param_name(p);
  }
}

// Note [Accumulation per chunk]: micro-batch gradients land in the parameter slots and are emptied
// into the fp32 accumulation chunks chunk by chunk (host-state chunks: one job on CpuAdam's worker
// each, started while backward goes on), with the values given back. The accumulated sums equal, bit
// for bit, the hand-made fp32 sum of each micro-batch's gradients as the default mode lands them (same
// order); evictions every iteration, state split between device and host.
// Options with two state groups on the device; `accumulate`: with fp32 accumulation chunks.
HybridAdamOptions split_state(bool accumulate) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.accumulate_grads = accumulate;
  return options;
}

// Two TinyLms with the same initial values.
std::pair<TinyLm, TinyLm> twins(uint64_t seed) {
  torch::manual_seed(seed);
  TinyLm a(kVocab, kDim);
  torch::manual_seed(seed);
  TinyLm b(kVocab, kDim);
  return {a, b};
}

TEST(HybridAdam, AccumulationEmptiesTheSlotsPerChunkAndSumsExactly) {
  const auto nets = twins(59);
  TinyLm a_net = nets.first, b_net = nets.second;
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 2 * 2), Precision::kBf16));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 2 * 2, 4), Precision::kBf16));
  HybridAdam a_adam(a, split_state(false)), b_adam(b, split_state(true));
  const int64_t n = a.num_params();
  int64_t evictions = 0;
  // Steps 0-2 with one micro-batch each keep a and b bit-identical (the test below shows why) and
  // place the state; step 3 accumulates four micro-batches in b against a's hand-made sums.
  for (int step = 0; step < 4; ++step) {
    const int micro = step < 3 ? 1 : 4;
    std::vector<at::Tensor> sum(n);
    for (int k = 0; k < micro; ++k) {
      const Batch x = batch(10 * step + k);
      a.backward(a.forward([&] { return lm_loss(a_net, x.idx, x.target); }));
      for (int64_t p = 0; p < n; ++p) {
        const at::Tensor g = a_adam.grad(p);  // fp32, widened from the bf16 slot
        sum[p] = sum[p].defined() ? sum[p] + g : g.clone();
      }
      if (micro > 1) a_adam.zero_grad();  // the values come back; a stays where b is
      // From the second micro-batch of a placed run on, b's chunks are emptied during backward: the gate
      // waits in backward (after the later blocks' gradients) until a job has started on the worker.
      const bool gated = step == 3 && k > 0;
      b_net->gate = gated;
      g_gate_adam = gated ? &b_adam : nullptr;
      g_gate_saw_job = -1;
      const int64_t jobs_before = b_adam.pipelined_jobs_started();
      g_gate_jobs_before = jobs_before;
      b.backward(b.forward([&] { return lm_loss(b_net, x.idx, x.target); }));
      b_net->gate = false;
      g_gate_adam = nullptr;
      g_gate_jobs_before = 0;
      EXPECT_FALSE(b.any_grad_in_slot()) << "backward() leaves values in the slots";
      if (step > 0) {  // placed: two state groups on the device, the rest on the host
        EXPECT_EQ(b_adam.pipelined_jobs_started() - jobs_before, b.layout().num_chunks() - 2)
            << "step " << step << ": one accumulation job per host-state chunk, not per parameter";
      }
      if (gated) {
        EXPECT_EQ(g_gate_saw_job.load(), 1) << "no accumulation job started during backward";
      }
      evictions += b.last_iteration().evictions;
      for (int64_t p = 0; p < n; ++p) {
        ASSERT_TRUE(torch::equal(b_adam.grad(p), sum[p]))
            << "step " << step << " micro-batch " << k << ": accumulated gradient of " << a.param_name(p);
        ASSERT_TRUE(torch::equal(b.param_values(p), b_adam.master(p).to(at::kBFloat16)))
            << "step " << step << " micro-batch " << k << ": the value of " << a.param_name(p) << " given back";
      }
    }
    if (step < 3) {
      ASSERT_TRUE(a_adam.step().applied && b_adam.step().applied);
      b_adam.zero_grad();
    }
  }
  EXPECT_GT(evictions, 5);
}

// Gradients in the parameter chunks (the default) and in fp32 accumulation chunks give the same bits
// (bf16 gradients widen to fp32 exactly): bf16 compute copy, evictions every iteration, state split
// between device and host, no clipping. And the default mode holds no gradient memory.
TEST(HybridAdam, GradsInParamChunksEqualAccumulationChunksBitForBit) {
  const HybridAdamOptions options = split_state(false), accumulate = split_state(true);
  const auto nets = twins(31);
  TinyLm a_net = nets.first, b_net = nets.second;
  // kChunk is 16 KiB of bf16, so a state group (fp32) is 2 x roles x kChunk.
  ChunkedModelOptions no_cache;
  no_cache.host_cache_bytes = 0;  // HybridAdam must raise it for the chunks that travel every step
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 2 * 2), Precision::kBf16), std::move(no_cache));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 2 * 2, 4), Precision::kBf16));
  HybridAdam a_adam(a, options), b_adam(b, accumulate);
  ASSERT_EQ(a_adam.num_state_roles(), 3);
  ASSERT_EQ(b_adam.num_state_roles(), 4);
  int64_t evictions = 0, allocations_after_step_2 = -1;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) allocations_after_step_2 = a.store().stats().host_buffers.allocations;
    const Batch x = batch(step);
    a.backward(a.forward([&] { return lm_loss(a_net, x.idx, x.target); }));
    b.backward(b.forward([&] { return lm_loss(b_net, x.idx, x.target); }));
    for (int64_t p = 0; p < a.num_params(); ++p) {
      ASSERT_TRUE(a.grad_in_slot(p)) << a.param_name(p);
      EXPECT_TRUE(torch::equal(a_adam.grad(p), b_adam.grad(p))) << "step " << step << ": grad of " << a.param_name(p);
    }
    const StepResult ra = a_adam.step(), rb = b_adam.step();
    b_adam.zero_grad();
    ASSERT_TRUE(ra.applied && rb.applied) << "step " << step;
    EXPECT_FALSE(a.any_grad_in_slot()) << "step() gives every slot its value back";
    if (step > 0) {
      EXPECT_EQ(ra.device_chunks, 2);
    }
    evictions += a.last_iteration().evictions;
  }
  EXPECT_GT(evictions, 5);
  // The parameter chunks' trips to the host and back reuse host buffers (pinned on CUDA): no fresh
  // allocation once the run is steady.
  EXPECT_EQ(a.store().stats().host_buffers.allocations, allocations_after_step_2);
  EXPECT_GT(a.store().stats().host_buffers.reuses, 0);
  for (int64_t p = 0; p < a.num_params(); ++p) {
    const auto& name = a.param_name(p);
    EXPECT_TRUE(torch::equal(a_adam.master(p), b_adam.master(p))) << name;
    EXPECT_TRUE(torch::equal(a_adam.exp_avg(p), b_adam.exp_avg(p))) << name;
    EXPECT_TRUE(torch::equal(a_adam.exp_avg_sq(p), b_adam.exp_avg_sq(p))) << name;
    EXPECT_TRUE(torch::equal(a.param_values(p).cpu(), b.param_values(p).cpu())) << name;
  }
  // Bytes: 2 (bf16) + 12 per allocated element, nothing for gradients; 16 with accumulation chunks.
  const int64_t elems = a.layout().allocated_numel();
  auto total = [](const ChunkStoreStats& st) { return st.device.current_bytes + st.host.current_bytes; };
  EXPECT_EQ(total(a.store().stats()), 2 * elems);
  EXPECT_EQ(total(a_adam.state_store().stats()), 12 * elems);
  EXPECT_EQ(total(b_adam.state_store().stats()), 16 * elems);
  // Every byte named by role.
  auto role_bytes = [](const ChunkStoreStats& st, ChunkRole role) {
    return st.device_bytes_by_role[static_cast<int>(role)] + st.host_bytes_by_role[static_cast<int>(role)];
  };
  EXPECT_EQ(role_bytes(a.store().stats(), ChunkRole::kParam), 2 * elems);
  for (ChunkRole role : {ChunkRole::kMaster, ChunkRole::kExpAvg, ChunkRole::kExpAvgSq}) {
    EXPECT_EQ(role_bytes(a_adam.state_store().stats(), role), 4 * elems) << to_string(role);
    EXPECT_EQ(role_bytes(b_adam.state_store().stats(), role), 4 * elems) << to_string(role);
  }
  EXPECT_EQ(role_bytes(a_adam.state_store().stats(), ChunkRole::kGrad), 0) << "no gradient memory";
  EXPECT_EQ(role_bytes(b_adam.state_store().stats(), ChunkRole::kGrad), 4 * elems);
  // Pinned memory only for what moves (D39): the parameter chunks ask for it (granted on CUDA), the
  // optimizer state never does.
  EXPECT_TRUE(a.store().pin_requested());
  EXPECT_FALSE(a_adam.state_store().pin_requested());
  EXPECT_FALSE(a_adam.state_store().pins_host_memory());
  EXPECT_EQ(a_adam.state_store().stats().host_buffers.peak_reserved_bytes > 0, true) << "state is on the host";
}

// Between backward() and step() the parameters' slots hold gradients: a forward fails naming the
// parameter (instead of computing with gradients), state_dict() refuses, zero_grad() restores the
// values, and the model trains on afterwards.
TEST(HybridAdam, UsingTheModelBeforeStepFailsAndZeroGradRestores) {
  torch::manual_seed(37);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2), Precision::kBf16));  // bf16: a group is 2 x 3 chunks
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(1));
  const Batch x = batch(0);
  auto train_step = [&] {
    model.backward(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
    return adam.step();
  };
  ASSERT_TRUE(train_step().applied);  // warm-up, repack, placement
  std::vector<at::Tensor> values;
  for (int64_t p = 0; p < model.num_params(); ++p) values.push_back(model.param_values(p).cpu().clone());
  model.backward(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
  ASSERT_TRUE(model.any_grad_in_slot());
  try {
    model.forward([&] { return lm_loss(net, x.idx, x.target); });
    ADD_FAILURE() << "a forward between backward() and step() must fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds its gradient"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("accumulate_grads"), std::string::npos) << e.what();
  }
  EXPECT_EQ(model.phase(), ModelPhase::kIdle);
  EXPECT_THROW(model.state_dict(), c10::Error);
  adam.zero_grad();
  EXPECT_FALSE(model.any_grad_in_slot());
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(model.param_values(p).cpu(), values[p])) << model.param_name(p);
  }
  EXPECT_THROW(adam.step(), c10::Error) << "zero_grad() discarded the gradients";
  EXPECT_TRUE(train_step().applied);
  EXPECT_EQ(adam.step_count(0), 2);
}

// A parameter that gets no gradient is not updated (as torch's optimizers skip an undefined .grad),
// not even by weight decay: a frozen LayerNorm keeps its values bit for bit.
TEST(HybridAdam, ParametersWithoutGradientsAreNotUpdated) {
  for (bool accumulate : {false, true}) {
    torch::manual_seed(41);
    TinyLm net(kVocab, kDim);
    net->ln_f->weight.set_requires_grad(false);
    net->ln_f->bias.set_requires_grad(false);
    const at::Tensor frozen = net->ln_f->weight.detach().clone();
    ChunkedModel model(net.ptr(), sim_config(budget_for(3, 1, accumulate ? 4 : 3)));
    HybridAdam adam(model, HybridAdamOptions(adamw()).with_accumulate_grads(accumulate).with_device_state_chunks(1));
    const int64_t frozen_param = test::param_index(model, "ln_f.weight");
    ASSERT_GE(frozen_param, 0);
    const at::Tensor other_before = adam.master(0);
    for (int step = 0; step < 3; ++step) {
      const Batch x = batch(step);
      model.backward(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
      ASSERT_TRUE(adam.step().applied);
      adam.zero_grad();
    }
    EXPECT_TRUE(torch::equal(adam.master(frozen_param), frozen)) << "accumulate " << accumulate;
    EXPECT_TRUE(torch::equal(model.param_values(frozen_param).cpu(), frozen)) << "accumulate " << accumulate;
    EXPECT_FALSE(torch::equal(adam.master(0), other_before)) << "the others train";
  }
}

TEST(HybridAdam, ClippingMatchesClipGradNorm) {
  // Every step: the norm is the fp64 norm of the landed grads, the coefficient is clip_grad_norm_'s,
  // and the update is the fp64 Adam step with the grads scaled by it. The first step also against
  // torch's clip_grad_norm_ + AdamW from the same initial values.
  torch::manual_seed(7);
  TinyLm ref(kVocab, kDim);
  torch::manual_seed(7);
  TinyLm net(kVocab, kDim);
  auto ref_opt = reference_adamw(ref);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 1)));
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.max_grad_norm = 0.05;
  options.device_state_chunks = 1;
  HybridAdam adam(model, options);
  for (int step = 0; step < 5; ++step) {
    const Batch b = batch(step);
    model.backward(model.forward([&] { return lm_loss(net, b.idx, b.target); }));
    const PreStep pre = snapshot(adam, model);
    const StepResult r = adam.step();
    ASSERT_TRUE(r.applied);
    EXPECT_LT(r.clip_coef, 1.0) << "the threshold must actually clip";
    EXPECT_EQ(r.clip_coef, std::min(1.0, 0.05 / (r.grad_norm + 1e-6))) << "clip_grad_norm_'s coefficient";
    expect_step_matches_fp64(adam, model, pre, r, "clipped step " + std::to_string(step));
    if (step == 0) {
      ref_opt->zero_grad();
      lm_loss(ref, b.idx, b.target).backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.05);
      ref_opt->step();
      // Both norms are fp32 sums over the same gradients in different orders (kNormTol each).
      EXPECT_LE(std::abs(r.grad_norm - ref_norm), 2 * kNormTol * ref_norm);
      expect_first_step_matches_torch(adam, model, ref, pre, r);
    }
    adam.zero_grad();
  }
}

TEST(HybridAdam, Fp16OverflowSkipsTheStepAndBacksOff) {
  torch::manual_seed(9);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(0, Precision::kFp16));
  HybridAdamOptions options;
  options.defaults = adamw();
  options.loss_scaler.initial_scale = 1e30;  // fp16 gradients overflow for sure
  options.loss_scaler.hysteresis = 2;
  options.loss_scaler.min_scale = 1.0;
  HybridAdam adam(model, options);
  ASSERT_TRUE(adam.uses_loss_scaling());
  const at::Tensor master_before = adam.master(0), param_before = model.param_values(0).clone();
  const Batch b = batch(0);
  auto run = [&] {
    model.backward(model.forward([&] { return lm_loss(net, b.idx, b.target); }));
    const StepResult r = adam.step();
    adam.zero_grad();
    return r;
  };
  StepResult r = run();
  EXPECT_TRUE(r.overflow);
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(adam.loss_scale(), 1e30) << "hysteresis 2: the first overflow does not back off";
  r = run();
  EXPECT_TRUE(r.overflow);
  EXPECT_EQ(adam.loss_scale(), 0.5e30);
  EXPECT_EQ(model.loss_scale(), 0.5e30) << "the model's backward uses the new scale";
  EXPECT_EQ(adam.step_count(0), 0);
  EXPECT_TRUE(torch::equal(adam.master(0), master_before));
  EXPECT_TRUE(torch::equal(model.param_values(0), param_before));
  // A sane scale trains: the update is applied and the gradients were unscaled.
  HybridAdamOptions sane = options;
  sane.loss_scaler.initial_scale = 1024;
  torch::manual_seed(9);
  TinyLm net2(kVocab, kDim);
  ChunkedModel model2(net2.ptr(), sim_config(0, Precision::kFp16));
  HybridAdam adam2(model2, sane);
  model2.backward(model2.forward([&] { return lm_loss(net2, b.idx, b.target); }));
  const StepResult ok = adam2.step();
  EXPECT_TRUE(ok.applied);
  EXPECT_EQ(ok.loss_scale, 1024);
  EXPECT_GT(ok.grad_norm, 0.01);
  EXPECT_LT(ok.grad_norm, 100.0) << "the loss scale must be divided out";
}

TEST(LossScaler, GrowsBacksOffAndKeepsHysteresis) {
  LossScalerOptions o;
  o.initial_scale = 8;
  o.growth_interval = 3;
  o.hysteresis = 2;
  o.min_scale = 2;
  DynamicLossScaler s(o);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 8);
  s.update(false);
  EXPECT_EQ(s.scale(), 16);
  s.update(true);  // hysteresis: tolerated
  EXPECT_EQ(s.scale(), 16);
  s.update(true);
  EXPECT_EQ(s.scale(), 8);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 4);
  for (int i = 0; i < 4; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 2) << "never below min_scale";
  EXPECT_EQ(s.state().overflows, 8);
  LossScalerOptions bad = o;
  bad.backoff_factor = 1.5;
  EXPECT_THROW(DynamicLossScaler{bad}, c10::Error);
}

// Runs `steps` training steps on (model, adam).
void train(ChunkedModel& model, TinyLm& net, HybridAdam& adam, int first, int steps) {
  for (int step = first; step < first + steps; ++step) {
    const Batch b = batch(step);
    model.backward(model.forward([&] { return lm_loss(net, b.idx, b.target); }));
    ASSERT_TRUE(adam.step().applied);
    adam.zero_grad();
  }
}

// POSIX only: std::filesystem from libtorch.so crashes (ARCHITECTURE D21).
std::string temp_dir(const std::string& name) {
  std::string templ = "/tmp/ferry_test_" + name + "_XXXXXX";
  TORCH_CHECK(::mkdtemp(templ.data()), "mkdtemp failed");
  return templ + "/ckpt";
}
// Every file in the directory (test_hybrid_adam_io.cpp tests the format; here only its clean-up).
std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') names.push_back(dir + "/" + e->d_name);
    }
    ::closedir(d);
  }
  return names;
}
void remove_checkpoint(const std::string& dir) {
  for (const auto& f : files_in(dir)) ::unlink(f.c_str());
  ::rmdir(dir.c_str());
  ::rmdir(dir.substr(0, dir.rfind('/')).c_str());
}

TEST(HybridAdam, SaveResumeIsBitIdentical) {
  const std::string dir = temp_dir("resume");
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  torch::manual_seed(11);
  TinyLm straight_net(kVocab, kDim);
  ChunkedModel straight(straight_net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam straight_adam(straight, options);
  train(straight, straight_net, straight_adam, 0, 5);
  straight_adam.save(dir);
  train(straight, straight_net, straight_adam, 5, 5);

  torch::manual_seed(12);  // different initial values: everything must come from the checkpoint
  TinyLm resumed_net(kVocab, kDim);
  ChunkedModel resumed(resumed_net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam resumed_adam(resumed, options);
  resumed_adam.load(dir);
  EXPECT_EQ(resumed_adam.step_count(0), 5);
  train(resumed, resumed_net, resumed_adam, 5, 5);
  EXPECT_EQ(resumed_adam.step_count(1), 10);
  for (int64_t p = 0; p < straight.num_params(); ++p) {
    const auto& name = straight.param_name(p);
    EXPECT_TRUE(torch::equal(resumed_adam.master(p), straight_adam.master(p))) << name;
    EXPECT_TRUE(torch::equal(resumed_adam.exp_avg(p), straight_adam.exp_avg(p))) << name;
    EXPECT_TRUE(torch::equal(resumed_adam.exp_avg_sq(p), straight_adam.exp_avg_sq(p))) << name;
    EXPECT_TRUE(torch::equal(resumed.param_values(p), straight.param_values(p))) << name;
  }
  remove_checkpoint(dir);
}

TEST(HybridAdam, BackwardStepOverlapsAndIsBitIdentical) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.accumulate_grads = true;
  torch::manual_seed(21);
  TinyLm plain_net(kVocab, kDim);
  torch::manual_seed(21);
  TinyLm overlap_net(kVocab, kDim);
  ChunkedModel plain(plain_net.ptr(), sim_config(budget_for(3, 2, 4)));
  ChunkedModel overlap(overlap_net.ptr(), sim_config(budget_for(3, 2, 4)));
  HybridAdam plain_adam(plain, options), overlap_adam(overlap, options);
  for (int step = 0; step < 6; ++step) {
    const Batch b = batch(step);
    plain.backward(plain.forward([&] { return lm_loss(plain_net, b.idx, b.target); }));
    const StepResult p = plain_adam.step();
    plain_adam.zero_grad();
    const StepResult o =
        overlap_adam.backward_step(overlap.forward([&] { return lm_loss(overlap_net, b.idx, b.target); }));
    overlap_adam.zero_grad();
    ASSERT_TRUE(p.applied && o.applied) << "step " << step;
    if (step == 0) {
      EXPECT_EQ(o.overlapped_chunks, 0) << "the first call only records the landings";
    } else {
      EXPECT_GT(o.overlapped_chunks, 0) << "step " << step << ": host updates should start during backward";
      EXPECT_EQ(o.device_chunks, 2);
    }
    EXPECT_NEAR(o.grad_norm, p.grad_norm, 1e-9 * p.grad_norm);
  }
  EXPECT_EQ(overlap_adam.step_count(0), 6);
  for (int64_t q = 0; q < plain.num_params(); ++q) {
    const auto& name = plain.param_name(q);
    EXPECT_TRUE(torch::equal(overlap_adam.master(q), plain_adam.master(q))) << name;
    EXPECT_TRUE(torch::equal(overlap_adam.exp_avg_sq(q), plain_adam.exp_avg_sq(q))) << name;
    EXPECT_TRUE(torch::equal(overlap.param_values(q), plain.param_values(q))) << name;
  }
}

// Note [Pipelined step]: backward_step(loss) (pipelined from its second call) leaves masters, moments
// and parameters bit-identical to backward() + step(), under forced evictions with the state split
// between device and host; eager without clipping, two-phase with clipping or fp16 loss scaling; with
// micro-batches (accumulate_grads), backward_step is the last micro-batch's backward + step().
struct PipelineCase {
  Precision precision = Precision::kBf16;
  double max_grad_norm = 0.0;
  int micro_batches = 1;               // > 1: accumulate_grads
  double initial_scale = 65536.0;      // fp16 loss scaling
  int64_t min_overflows = 0;           // skipped steps the case must see
};
void expect_pipeline_equals_step(const PipelineCase& pc) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.max_grad_norm = pc.max_grad_norm;
  options.accumulate_grads = pc.micro_batches > 1;
  options.loss_scaler.initial_scale = pc.initial_scale;
  options.loss_scaler.hysteresis = 1;
  const int64_t roles = options.accumulate_grads ? 4 : 3;
  torch::manual_seed(41);
  TinyLm a_net(kVocab, kDim);
  torch::manual_seed(41);
  TinyLm b_net(kVocab, kDim);
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 2 * 2, roles), pc.precision));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 2 * 2, roles), pc.precision));
  HybridAdam a_adam(a, options), b_adam(b, options);
  int64_t evictions = 0, applied = 0, clipped = 0, overflows = 0;
  for (int step = 0; step < 8; ++step) {
    for (int k = 0; k + 1 < pc.micro_batches; ++k) {
      const Batch x = batch(100 * step + k);
      a.backward(a.forward([&] { return lm_loss(a_net, x.idx, x.target) / pc.micro_batches; }));
      b.backward(b.forward([&] { return lm_loss(b_net, x.idx, x.target) / pc.micro_batches; }));
    }
    const Batch x = batch(100 * step + pc.micro_batches - 1);
    a.backward(a.forward([&] { return lm_loss(a_net, x.idx, x.target) / pc.micro_batches; }));
    const StepResult ra = a_adam.step();
    const StepResult rb =
        b_adam.backward_step(b.forward([&] { return lm_loss(b_net, x.idx, x.target) / pc.micro_batches; }));
    a_adam.zero_grad();
    b_adam.zero_grad();
    ASSERT_EQ(ra.applied, rb.applied) << "step " << step;
    EXPECT_EQ(ra.overflow, rb.overflow) << "step " << step;
    EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << step << ": the same norms summed in the same order";
    EXPECT_EQ(ra.clip_coef, rb.clip_coef) << "step " << step;
    EXPECT_EQ(ra.loss_scale, rb.loss_scale) << "step " << step;
    EXPECT_EQ(rb.device_syncs, 1) << "step " << step << ": one read of the device norms";
    if (step == 0) {
      EXPECT_EQ(rb.overlapped_chunks, 0) << "the first call records the landings";
    } else {
      EXPECT_GT(rb.overlapped_chunks, 0) << "step " << step << ": chunks should start during backward";
      EXPECT_EQ(rb.device_chunks, 2);
    }
    EXPECT_FALSE(b.any_grad_in_slot()) << "step " << step;
    if (options.accumulate_grads && ra.applied) {
      // The updates wrote the new 16-bit values themselves: no host chunk needed the copy after them
      // (a device chunk's parameter chunk may have been evicted from beside its state).
      EXPECT_LE(ra.written_back_chunks, ra.device_chunks) << "step " << step;
      EXPECT_LE(rb.written_back_chunks, rb.device_chunks) << "step " << step;
    }
    applied += ra.applied;
    overflows += ra.overflow;
    clipped += ra.clip_coef < 1.0;
    evictions += b.last_iteration().evictions;
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "step " + std::to_string(step)));
  }
  EXPECT_GT(applied, 2);
  EXPECT_GE(overflows, pc.min_overflows) << "the overflow path must be exercised";
  if (pc.max_grad_norm > 0) {
    EXPECT_GT(clipped, 2) << "the clipping path must be exercised";
  }
  EXPECT_GE(evictions, 5) << "evictions in every pipelined step";
  EXPECT_EQ(a_adam.step_count(0), b_adam.step_count(0));
}

TEST(HybridAdam, PipelinedStepEqualsBackwardThenStepBitForBit) { expect_pipeline_equals_step({}); }

TEST(HybridAdam, PipelinedStepWithClippingEqualsBackwardThenStep) {
  expect_pipeline_equals_step({Precision::kBf16, 0.05});
}

TEST(HybridAdam, PipelinedStepWithFp16LossScalingEqualsBackwardThenStep) {
  expect_pipeline_equals_step({Precision::kFp16, 0.0, 1, 262144.0, /*min_overflows=*/1});
}

TEST(HybridAdam, AccumulatedPipelinedStepEqualsBackwardThenStepBitForBit) {
  expect_pipeline_equals_step({Precision::kBf16, 0.0, 3});
}

TEST(HybridAdam, AccumulatedPipelinedStepWithClippingEqualsBackwardThenStep) {
  expect_pipeline_equals_step({Precision::kBf16, 0.05, 3});
}

TEST(HybridAdam, AccumulatedPipelinedStepWithFp16LossScalingEqualsBackwardThenStep) {
  expect_pipeline_equals_step({Precision::kFp16, 1.0, 3, 262144.0, /*min_overflows=*/1});
}

// Identity whose backward throws while g_fail_backward is set: a backward that fails part-way.
std::atomic<bool> g_fail_backward{false};
struct FailInBackward : torch::autograd::Function<FailInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    TORCH_CHECK(!g_fail_backward.load(), "ferry test: this backward fails on purpose");
    return {g[0]};
  }
};

// Four 40 x 40 layers with tanh between: in fp32 and kChunk chunks, {l0, l1} and {l2, l3}. With
// fail_after = i, a FailInBackward follows layer i; l2 is applied l2_times times.
struct FourLayersImpl : torch::nn::Module {
  explicit FourLayersImpl(int fail_after = -1) : fail_after(fail_after) {
    for (int i = 0; i < 4; ++i) l.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(40, 40)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < 4; ++i) {
      for (int k = 0; k < (i == 2 ? l2_times : 1); ++k) x = torch::tanh(l[i]->forward(x));
      if (i == fail_after) x = FailInBackward::apply(x);
    }
    return x;
  }
  int fail_after;
  int l2_times = 1;  // how many times forward applies l2 (its weight's uses in backward)
  std::vector<torch::nn::Linear> l;
};
TORCH_MODULE(FourLayers);

// Two FourLayers with the same values, each under evictions with its HybridAdam: `a` steps by
// backward() + step(), `b` by backward_step() (Note [Pipelined step]). step() runs one step of both over
// `micro` micro-batches of four rows of x each, and checks that both were applied and that b's did not
// throw.
struct FourLayerTwins {
  FourLayerTwins(uint64_t seed, bool freeze_l2, const HybridAdamOptions& options)
      : a_net(seeded(seed, freeze_l2)), b_net(seeded(seed, freeze_l2)),
        a(a_net.ptr(), config(options)), b(b_net.ptr(), config(options)), a_adam(a, options), b_adam(b, options) {}
  static FourLayers seeded(uint64_t seed, bool freeze_l2) {
    torch::manual_seed(seed);
    FourLayers net;
    for (auto& p : net->l[2]->parameters()) p.set_requires_grad(!freeze_l2);
    return net;
  }
  static Config config(const HybridAdamOptions& o) {  // one parameter chunk beside the device state
    return sim_config(budget_for(1, o.device_state_chunks, o.accumulate_grads ? 4 : 3), Precision::kFp32);
  }
  void step(const torch::Tensor& x, int micro, const std::string& when, StepResult* rb) {
    auto loss_of = [&](FourLayers& net, int k) { return net->forward(x.slice(0, 4 * k, 4 * k + 4)).pow(2).mean() / micro; };
    for (int k = 0; k + 1 < micro; ++k) {
      a.backward(a.forward([&] { return loss_of(a_net, k); }));
      b.backward(b.forward([&] { return loss_of(b_net, k); }));
    }
    a.backward(a.forward([&] { return loss_of(a_net, micro - 1); }));
    ASSERT_TRUE(a_adam.step().applied) << when;
    ASSERT_EQ(test::error_of([&] { *rb = b_adam.backward_step(b.forward([&] { return loss_of(b_net, micro - 1); })); }),
              "(no error)") << when;
    ASSERT_TRUE(rb->applied) << when;
    a_adam.zero_grad();
    b_adam.zero_grad();
  }
  FourLayers a_net, b_net;
  ChunkedModel a, b;
  HybridAdam a_adam, b_adam;
};

// Note [A chunk final before its last use]: l2 frozen, l0 and l1 trained, so backward carries the
// gradient through l2's weight after l3's gradients, the only ones l2's chunk gets, have landed. The
// chunk went to the host for its update (or its accumulation) at that landing and l2's use failed,
// "locked on the host": every backward_step after the first, and every accumulating backward. Now,
// under evictions, with the state on the host or partly on the device, with and without two
// micro-batches, backward_step equals backward() + step() bit for bit and still starts chunks during
// backward.
TEST(HybridAdam, AFrozenLayerBackwardGoesThroughTrainsPipelined) {
  for (const int micro : {1, 2}) {
    for (const int64_t device_state : {int64_t{0}, int64_t{1}}) {
      const std::string what = std::to_string(micro) + " micro-batch(es), " + std::to_string(device_state) +
                               " state chunk(s) on the device";
      HybridAdamOptions options(adamw());
      options.device_state_chunks = device_state;
      options.accumulate_grads = micro > 1;
      FourLayerTwins t(43, /*freeze_l2=*/true, options);
      int64_t overlapped = 0, evictions = 0;
      for (int step = 0; step < 6; ++step) {
        const std::string when = what + ", step " + std::to_string(step);
        torch::manual_seed(300 + step);
        StepResult rb;
        ASSERT_NO_FATAL_FAILURE(t.step(torch::randn({micro * 4, 40}), micro, when, &rb));
        overlapped += rb.overlapped_chunks;
        evictions += t.b.last_iteration().evictions;
        ASSERT_NO_FATAL_FAILURE(test::expect_same_state(t.a_adam, t.b_adam, t.a, t.b, when));
      }
      const auto& slots = t.b.layout().slots();
      ASSERT_EQ(slots[4].chunk, slots[6].chunk) << "l2 and l3 share a chunk";
      ASSERT_NE(slots[2].chunk, slots[4].chunk) << "l1 is in another one";
      EXPECT_GT(overlapped, 0) << what << ": chunks should still start during backward";
      EXPECT_GT(evictions, 0) << what;
      EXPECT_EQ(t.b_adam.param_step_count(4), 0) << what << ": l2 is frozen";
      EXPECT_EQ(t.b_adam.param_step_count(0), 6) << what;
    }
  }
}

// Note [A chunk final before its last use], when the uses change: l2 frozen and applied once a step,
// then twice (a loop whose length varies, as an RNN's does), then once again. The step where its
// weight is used more often than before found its chunk final after the first use, gone to the host
// for l3's update: the second use now waits for that update (its value is not one the update writes),
// then the counts know two. backward_step equals backward() + step() bit for bit throughout.
TEST(HybridAdam, MoreUsesThanTheLastBackwardWaitForTheChunksUpdate) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 0;
  FourLayerTwins t(53, /*freeze_l2=*/true, options);
  const int times[] = {1, 1, 1, 2, 2, 1, 2};
  for (int step = 0; step < 7; ++step) {
    const std::string when = "step " + std::to_string(step);
    t.a_net->l2_times = t.b_net->l2_times = times[step];
    torch::manual_seed(500 + step);
    StepResult rb;
    ASSERT_NO_FATAL_FAILURE(t.step(torch::randn({4, 40}), 1, when, &rb));
    if (step >= 2) {
      EXPECT_GT(rb.overlapped_chunks, 0) << when;
    }
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(t.a_adam, t.b_adam, t.a, t.b, when));
  }
}

// Note [Expectations only grow]: a layer skipped in some steps (stochastic depth, l2_times = 0), with
// and without accumulation. The counts of the last backward alone made a skipped step's successor
// expect nothing of l2: its chunk was final at l3's landing, and l2's gradient was refused ("after its
// chunk's update had started"), in every step after, since a refused step taught nothing. Expectations
// now only grow: a step without l2 leaves its chunk to backward's end, and backward_step equals
// backward() + step() bit for bit throughout.
TEST(HybridAdam, ALayerSkippedInSomeStepsTrainsPipelined) {
  for (const int micro : {1, 2}) {
    const std::string what = std::to_string(micro) + " micro-batch(es)";
    HybridAdamOptions options(adamw());
    options.device_state_chunks = 0;
    options.accumulate_grads = micro > 1;
    FourLayerTwins t(59, /*freeze_l2=*/false, options);
    const int times[] = {1, 1, 1, 0, 1, 0, 0, 1};
    for (int step = 0; step < 8; ++step) {
      const std::string when = what + ", step " + std::to_string(step);
      t.a_net->l2_times = t.b_net->l2_times = times[step];
      torch::manual_seed(600 + step);
      StepResult rb;
      ASSERT_NO_FATAL_FAILURE(t.step(torch::randn({4 * micro, 40}), micro, when, &rb));
      ASSERT_NO_FATAL_FAILURE(test::expect_same_state(t.a_adam, t.b_adam, t.a, t.b, when));
    }
    EXPECT_EQ(t.b_adam.param_step_count(4), 5) << what << ": l2 had a gradient in five of eight steps";
  }
}

// A micro-batch's backward that fails part-way, after l3's gradients landed and before l2's (they share
// a chunk), discarded by zero_grad(), the step going on with its last micro-batch in backward_step. The
// failed backward's landings used to become what the next one expects, so there the chunk was final
// after l3's landing alone: its update started during backward and l2's gradient was refused. Now its
// counts only add to the expectations (Note [Expectations only grow]), and every step runs pipelined.
TEST(HybridAdam, AFailedMicroBatchBackwardLeavesTheNextBackwardStepPipelined) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 0;
  options.accumulate_grads = true;
  torch::manual_seed(47);
  FourLayers net(/*fail_after=*/2);
  ChunkedModel model(net.ptr(), sim_config(budget_for(1, 0, 4), Precision::kFp32));
  HybridAdam adam(model, options);
  for (int step = 0; step < 6; ++step) {
    const std::string when = "step " + std::to_string(step);
    torch::manual_seed(400 + step);
    const torch::Tensor x = torch::randn({8, 40});
    g_fail_backward = step == 3;
    const std::string failed = test::error_of(
        [&] { model.backward(model.forward([&] { return net->forward(x.slice(0, 0, 4)).pow(2).mean() / 2; })); });
    g_fail_backward = false;
    if (step == 3) {
      EXPECT_NE(failed.find("fails on purpose"), std::string::npos) << failed;
      adam.zero_grad();  // the gradients that landed before it are discarded
    } else {
      ASSERT_EQ(failed, "(no error)") << when;
    }
    StepResult r;
    ASSERT_EQ(test::error_of([&] {
      r = adam.backward_step(model.forward([&] { return net->forward(x.slice(0, 4, 8)).pow(2).mean() / 2; }));
    }), "(no error)") << when;
    adam.zero_grad();
    ASSERT_TRUE(r.applied) << when;
    if (step > 1) {
      EXPECT_GT(r.overlapped_chunks, 0) << when;
    }
  }
}

// A backward_step whose backward throws after a late gradient landed (Note [A gradient after its
// chunk's update]): l2, skipped in the first steps, is used at step 3, so its gradients land after its
// chunk-mate l3's update had started; then backward fails below l1. The late parameters were not
// updated: they keep their gradients for zero_grad(), which gives them their values back, and their
// step counts stay; l3's update stands, as documented. Training goes on, l2 pipelined.
TEST(HybridAdam, ABackwardThatThrowsAfterALateGradientLeavesItUntouched) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 0;
  torch::manual_seed(67);
  FourLayers net(/*fail_after=*/0);
  ChunkedModel model(net.ptr(), sim_config(budget_for(1, 0), Precision::kFp32));
  HybridAdam adam(model, options);
  const int64_t l2 = test::param_index(model, "l2.weight"), l3 = test::param_index(model, "l3.weight");
  ASSERT_GE(l2, 0);
  ASSERT_GE(l3, 0);
  for (int step = 0; step < 7; ++step) {
    const std::string when = "step " + std::to_string(step);
    torch::manual_seed(500 + step);
    const torch::Tensor x = torch::randn({4, 40});
    net->l2_times = step < 3 ? 0 : 1;
    g_fail_backward = step == 3;
    const torch::Tensor l2_before = adam.master(l2).clone();
    const int64_t l3_count = adam.param_step_count(l3);
    StepResult r;
    const std::string error =
        test::error_of([&] { r = adam.backward_step(model.forward([&] { return net->forward(x).pow(2).mean(); })); });
    g_fail_backward = false;
    if (step == 3) {
      EXPECT_NE(error.find("fails on purpose"), std::string::npos) << error;
      EXPECT_EQ(model.phase(), ModelPhase::kIdle);
      adam.zero_grad();
      EXPECT_FALSE(model.any_grad_in_slot()) << when;
      EXPECT_TRUE(torch::equal(adam.master(l2), l2_before)) << "the late parameter was not updated";
      EXPECT_TRUE(torch::equal(model.param_values(l2), l2_before)) << "and has its value back, not its gradient";
      EXPECT_EQ(adam.param_step_count(l2), 0);
      EXPECT_EQ(adam.param_step_count(l3), l3_count + 1) << "l3's update had started: it stands";
      continue;
    }
    ASSERT_EQ(error, "(no error)") << when;
    EXPECT_TRUE(r.applied) << when;
    EXPECT_EQ(r.late_params, 0) << when << ": l2 landed late at step 3, and is expected since";
    if (step > 3) {
      EXPECT_GT(r.overlapped_chunks, 0) << when;
    }
  }
  EXPECT_EQ(adam.param_step_count(l2), 3) << "trained at steps 4 to 6";
}

// A non-finite late gradient (Note [A gradient after its chunk's update]) skips the late spans only, as
// a non-finite chunk in the eager step skips itself: l2, first used at step 3 with a NaN gradient, keeps
// its values and its step count; its chunk-mate l3, updated during backward, keeps its update; the
// step reports the overflow, and l2 trains from step 4 on.
TEST(HybridAdam, ANonFiniteLateGradientSkipsOnlyTheLateSpans) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 0;
  torch::manual_seed(71);
  FourLayers net;
  bool poison = false;
  net->l[2]->weight.register_hook([&poison](const torch::Tensor& g) { return poison ? torch::full_like(g, NAN) : g; });
  ChunkedModel model(net.ptr(), sim_config(budget_for(1, 0), Precision::kFp32));
  HybridAdam adam(model, options);
  const int64_t l2 = test::param_index(model, "l2.weight"), l3 = test::param_index(model, "l3.weight");
  ASSERT_GE(l2, 0);
  ASSERT_GE(l3, 0);
  for (int step = 0; step < 6; ++step) {
    const std::string when = "step " + std::to_string(step);
    torch::manual_seed(600 + step);
    const torch::Tensor x = torch::randn({4, 40});
    net->l2_times = step < 3 ? 0 : 1;
    poison = step == 3;
    const torch::Tensor l2_before = adam.master(l2).clone();
    const int64_t l3_count = adam.param_step_count(l3);
    const StepResult r = adam.backward_step(model.forward([&] { return net->forward(x).pow(2).mean(); }));
    EXPECT_EQ(r.overflow, step == 3) << when;
    if (step != 3) continue;
    EXPECT_EQ(r.late_params, 2) << "l2's weight and bias";
    EXPECT_TRUE(torch::equal(adam.master(l2), l2_before)) << "the late spans were skipped";
    EXPECT_TRUE(torch::equal(model.param_values(l2), l2_before)) << "and have their values back";
    EXPECT_EQ(adam.param_step_count(l2), 0);
    EXPECT_EQ(adam.param_step_count(l3), l3_count + 1) << "l3's update ran during backward";
  }
  EXPECT_EQ(adam.param_step_count(l2), 2) << "trained at steps 4 and 5";
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::isfinite(model.param_values(p)).all().item<bool>()) << model.param_name(p);
  }
}

// Note [Update behind the next forward]: with update_behind_forward (b) the host updates after
// backward are left running and the next forward waits for each chunk's own; against the same training
// with it off (a), every loss (each computed by a forward that waited), master, moment and parameter is
// bit-identical, although the lr changes right after every step (the queued updates keep the one they
// were queued with). Forced evictions, state split between device and host, clipping; the two-phase
// backward_step and backward() + step(), with and without micro-batches (whose zero_grad() queues
// behind the updates).
struct BehindCase {
  Precision precision = Precision::kBf16;
  int micro_batches = 1;
  bool unpipelined = false;
  int64_t param_chunks = 3, state_chunks = 4;  // the device budget, in chunks (budget_for)
  // b's copies stay pending until waited for or polled, as CUDA's do (the test engine supports one
  // instance at a time: a's copies stay synchronous).
  bool pending_copies = false;
};
void expect_update_behind_forward_exact(const BehindCase& bc) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.max_grad_norm = 0.05;
  options.accumulate_grads = bc.micro_batches > 1;
  const int64_t roles = options.accumulate_grads ? 4 : 3;
  torch::manual_seed(43);
  TinyLm a_net(kVocab, kDim);
  torch::manual_seed(43);
  TinyLm b_net(kVocab, kDim);
  ChunkedModelOptions b_options;
  if (bc.pending_copies) {
    b_options.copy_engine = [] {
      return std::make_unique<StreamModelCopyEngine>(StreamModelOptions{/*host_lags=*/true, /*poll_one_in=*/3, /*seed=*/5});
    };
  }
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(bc.param_chunks, bc.state_chunks, roles), bc.precision));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(bc.param_chunks, bc.state_chunks, roles), bc.precision),
                 std::move(b_options));
  HybridAdam a_adam(a, HybridAdamOptions(options).with_update_behind_forward(false));
  HybridAdam b_adam(b, HybridAdamOptions(options).with_update_behind_forward(true));
  int64_t deferred = 0, evictions = 0, clipped = 0;
  for (int step = 0; step < 8; ++step) {
    auto run = [&](ChunkedModel& m, TinyLm& net, HybridAdam& adam) {
      StepResult r;
      torch::Tensor loss_sum;
      for (int k = 0; k < bc.micro_batches; ++k) {
        const Batch x = batch(100 * step + k);
        torch::Tensor loss = m.forward([&] { return lm_loss(net, x.idx, x.target) / bc.micro_batches; });
        loss_sum = loss_sum.defined() ? loss_sum + loss.detach() : loss.detach();
        if (k + 1 < bc.micro_batches) {
          m.backward(loss);
        } else if (bc.unpipelined) {
          m.backward(loss);
          r = adam.step();
        } else {
          r = adam.backward_step(loss);
        }
      }
      adam.set_lr(1e-2 / (step + 2));  // at once: b's updates of this step are still queued or running
      adam.zero_grad();
      return std::make_pair(r, loss_sum);
    };
    const auto [ra, la] = run(a, a_net, a_adam);
    const auto [rb, lb] = run(b, b_net, b_adam);
    const std::string when = "step " + std::to_string(step);
    ASSERT_TRUE(torch::equal(la, lb)) << when << ": the forward read every parameter after its update";
    ASSERT_EQ(ra.applied, rb.applied) << when;
    EXPECT_EQ(ra.grad_norm, rb.grad_norm) << when;
    EXPECT_EQ(ra.deferred_chunks, 0) << when;
    if (!options.accumulate_grads && rb.applied) {
      EXPECT_EQ(rb.deferred_chunks, rb.host_chunks) << when << ": every host chunk is staged on the host";
    }
    EXPECT_LE(rb.deferred_chunks, rb.host_chunks) << when;
    deferred += rb.deferred_chunks;
    clipped += rb.clip_coef < 1.0;
    evictions += b.last_iteration().evictions;
  }
  // An evaluation forward right after the last step waits as a training one does.
  const Batch x = batch(999);
  const torch::Tensor ya = a.forward([&] { return a_net->forward(x.idx); });
  const torch::Tensor yb = b.forward([&] { return b_net->forward(x.idx); });
  a.end_iteration();
  b.end_iteration();
  EXPECT_TRUE(torch::equal(ya, yb));
  ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 8 steps"));
  EXPECT_GE(deferred, 8) << "host updates must be left running";
  EXPECT_GT(clipped, 2) << "the clipping path must be exercised";
  EXPECT_GE(evictions, 5);
  EXPECT_EQ(a_adam.step_count(0), b_adam.step_count(0));
}

TEST(HybridAdam, UpdateBehindForwardIsBitIdenticalInTheTwoPhaseStep) { expect_update_behind_forward_exact({}); }

TEST(HybridAdam, UpdateBehindForwardIsBitIdenticalInBackwardThenStep) {
  expect_update_behind_forward_exact({Precision::kBf16, 1, /*unpipelined=*/true});
}

TEST(HybridAdam, UpdateBehindForwardIsBitIdenticalWithMicroBatches) {
  expect_update_behind_forward_exact({Precision::kBf16, 3});
}

// The same with b's copies pending until waited for or polled (StreamModelCopyEngine, polled at random),
// as CUDA's are: the moves of the next forward, prefetches of chunks whose update has just unlocked
// them among them, complete only when something waits or orders compute after them.
TEST(HybridAdam, UpdateBehindForwardIsBitIdenticalWithPendingCopies) {
  for (const bool unpipelined : {false, true}) {
    for (const int micro_batches : {1, 2}) {
      BehindCase c;
      c.pending_copies = true;
      c.unpipelined = unpipelined;
      c.micro_batches = micro_batches;
      SCOPED_TRACE(std::string(unpipelined ? "backward() + step()" : "backward_step") + ", " +
                   std::to_string(micro_batches) + " micro-batch(es)");
      expect_update_behind_forward_exact(c);
    }
  }
}

TEST(HybridAdam, UpdateBehindForwardIsBitIdenticalWithMicroBatchesInFp32) {
  expect_update_behind_forward_exact({Precision::kFp32, 2, /*unpipelined=*/true, /*param_chunks=*/2,
                                      /*state_chunks=*/2});
}

// Note [Ops outside the scopes] (hooks/interceptor.h): between iterations the wrapped module is an ordinary
// module, also while step()'s host updates are still running (b). Right after step() returns, with
// every update held back on the worker by a 100 ms job queued ahead of them, ops on this thread read
// the new values (the parameters, an eval forward outside model.forward()), and a write of theirs is
// not overwritten by the update (it is what the next forward uses); torch::save, which reads CPU
// storages without an op, saves them after synchronize(). Against the same training with the updates
// on the calling thread (a), every value, output and loss is bit-identical. The thread stops watching
// at its first op once the updates are done.
TEST(HybridAdam, OpsBetweenStepsWaitForTheUpdatesLeftRunning) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.max_grad_norm = 0.05;
  const auto nets = twins(47);
  TinyLm a_net = nets.first, b_net = nets.second;
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 4), Precision::kBf16));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 4), Precision::kBf16));
  HybridAdam a_adam(a, HybridAdamOptions(options).with_update_behind_forward(false));
  HybridAdam b_adam(b, HybridAdamOptions(options).with_update_behind_forward(true));
  auto a_params = a_net->named_parameters(), b_params = b_net->named_parameters();
  const int64_t outside_before = interception_counters().outside_uses;
  int64_t deferred = 0, evictions = 0;
  for (int step = 0; step < 8; ++step) {
    const std::string when = "step " + std::to_string(step);
    const Batch x = batch(step);
    auto train = [&](ChunkedModel& m, TinyLm& net, HybridAdam& adam, bool stall) {
      const torch::Tensor loss = m.forward([&] { return lm_loss(net, x.idx, x.target); });
      m.backward(loss);
      if (stall) adam.run_on_worker([] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); });
      const StepResult r = adam.step();
      return std::make_pair(r, loss.detach());
    };
    const auto [ra, la] = train(a, a_net, a_adam, false);
    const auto [rb, lb] = train(b, b_net, b_adam, true);
    ASSERT_TRUE(torch::equal(la, lb)) << when << ": the loss";
    EXPECT_EQ(ra.deferred_chunks, 0) << when;
    deferred += rb.deferred_chunks;
    evictions += b.last_iteration().evictions;
    if (rb.deferred_chunks > 0) {
      EXPECT_TRUE(watching_outside_uses()) << when << ": the updates are still held back";
      EXPECT_GT(outside_hazards(), 0) << when;
    }
    torch::NoGradGuard no_grad;
    switch (step % 4) {
      case 0:  // read every parameter by ops: the values the update writes
        for (const auto& item : a_params) {
          EXPECT_TRUE(torch::equal(b_params[item.key()].clone(), item.value())) << when << ": " << item.key();
        }
        break;
      case 1: {  // an eval forward outside model.forward()
        const Batch e = batch(500 + step);
        EXPECT_TRUE(torch::equal(b_net->forward(e.idx), a_net->forward(e.idx))) << when << ": eval forward";
        break;
      }
      case 2: {  // torch::save of the module, after synchronize(): it copies CPU storages' bytes without an
                 // op, so on the simulated device it is not watched (without the call it saved gradients)
        std::stringstream archive;
        b_adam.synchronize();
        torch::save(b_net, archive);
        TinyLm loaded(kVocab, kDim);
        loaded->to(torch::kBFloat16);  // the compute dtype the archive holds
        torch::load(loaded, archive);
        auto loaded_params = loaded->named_parameters();
        for (const auto& item : a_params) {
          EXPECT_TRUE(torch::equal(loaded_params[item.key()], item.value())) << when << ": saved " << item.key();
        }
        break;
      }
      default:  // write every parameter: the next forward uses what was written
        for (auto& p : a_net->parameters()) p.mul_(0.5);
        for (auto& p : b_net->parameters()) p.mul_(0.5);
    }
    a_adam.zero_grad();
    b_adam.zero_grad();
  }
  // After every update is done, the next op ends the watch; later ops outside scopes are not seen.
  b_adam.synchronize();
  EXPECT_EQ(outside_hazards(), 0);
  (void)torch::ones({1}).sum();
  EXPECT_FALSE(watching_outside_uses());
  const int64_t ops = interception_counters().ops;
  (void)torch::ones({1}).sum();
  EXPECT_EQ(interception_counters().ops, ops) << "an op outside ferry's scopes, no longer watched";
  EXPECT_GE(deferred, 6) << "host updates must be left running";
  EXPECT_GE(evictions, 3);
  EXPECT_GT(interception_counters().outside_uses, outside_before) << "ops waited for the updates";
  // The last step's write and everything before it: the same state.
  const Batch x = batch(99);
  EXPECT_TRUE(torch::equal(a.forward([&] { return lm_loss(a_net, x.idx, x.target); }),
                           b.forward([&] { return lm_loss(b_net, x.idx, x.target); })));
  a.end_iteration();
  b.end_iteration();
  ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 8 steps"));
}

// Note [Writes to parameters] (hooks/chunked_model.h): what users write into parameters reaches the
// masters, so the next step updates from it, as torch's optimizers do. The unwrapped twin gets the same
// writes and is updated by ferry's CpuAdam parameter by parameter (the same kernel on the same values:
// bit-identical, D30). Writes: before the optimizer exists (pretrained weights loaded late), in place on
// every parameter, a copy_ into one, new storage for one (set_, as torch::load does), and a clamp inside
// forward; the step is the pipelined one, state split and evictions every step. Before the masters took
// writes, the first write was lost at the next step and every later loss differed.
TEST(HybridAdam, WritesToParametersReachTheMasters) {
  const auto nets = twins(71);
  TinyLm ref = nets.first, net = nets.second;
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  auto write = [](TinyLm& m, int kind, int step) {
    torch::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    switch (kind) {
      case 0:
        for (auto& p : m->parameters()) p.mul_(0.9);
        break;
      case 1:
        m->fc[0]->weight.copy_(torch::randn(m->fc[0]->weight.sizes(), gen) * 0.05);
        break;
      default:  // new storage, as torch::load gives it
        m->out[1]->weight.set_(torch::randn(m->out[1]->weight.sizes(), gen) * 0.05);
    }
  };
  write(ref, 0, -1);  // before HybridAdam is built: its masters start from these values
  write(net, 0, -1);
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 2;
  HybridAdam adam(model, options);
  test::CpuAdamTwin ref_adam(*ref, adamw(), model.config());
  // A clamp inside forward, in both (a WGAN critic's weight clipping).
  for (TinyLm* m : {&ref, &net}) {
    TinyLm& mm = *m;
    mm->after_embedding = [&mm](const torch::Tensor& x) {
      torch::NoGradGuard no_grad;
      mm->out[0]->bias.clamp_(-0.01, 0.01);
      return x;
    };
  }
  int64_t evictions = 0;
  for (int step = 0; step < 6; ++step) {
    const Batch x = batch(step);
    ref_adam.zero_grad();
    const torch::Tensor loss_ref = lm_loss(ref, x.idx, x.target);
    loss_ref.backward();
    ref_adam.step();
    const torch::Tensor loss = model.forward([&] { return lm_loss(net, x.idx, x.target); });
    adam.backward_step(loss);
    evictions += model.last_iteration().evictions;
    ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step << ": " << loss.item<double>() << " vs "
                                              << loss_ref.item<double>();
    write(ref, step % 3, step);
    write(net, step % 3, step);
  }
  EXPECT_GT(evictions, 0);
  // The last writes (new storage for out1.weight), taken in by one more step.
  const Batch x = batch(99);
  ref_adam.zero_grad();
  const torch::Tensor loss = model.forward([&] { return lm_loss(net, x.idx, x.target); });
  adam.backward_step(loss);
  const torch::Tensor loss_ref = lm_loss(ref, x.idx, x.target);
  EXPECT_TRUE(torch::equal(loss, loss_ref)) << "after the last writes";
  loss_ref.backward();
  ref_adam.step();
  const auto pr = ref->named_parameters(), pn = net->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const std::string& name = model.param_name(p);
    EXPECT_TRUE(torch::equal(adam.master(p), pr[name])) << "master of " << name;
    EXPECT_TRUE(torch::equal(pn[name], pr[name])) << name;
    EXPECT_EQ(pn[name].data_ptr(), model.param_values(p).data_ptr()) << name << " views its slot";
  }
}

// In bf16 the masters have bits the compute copy lacks: an in-place write takes over the elements it
// changed and leaves the others' masters alone; new storage of another dtype (an fp32 tensor given by
// set_data, as torch::load does from another device) gives the masters its values exactly, and the
// parameter its rounding, in its chunk again.
TEST(HybridAdam, Bf16WritesKeepTheBitsTheyDoNotTouch) {
  const auto nets = twins(73);
  TinyLm net = nets.second;
  ChunkedModel model(net.ptr(), sim_config(0, Precision::kBf16));
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(1));
  for (int step = 0; step < 2; ++step) {
    const Batch x = batch(step);
    adam.backward_step(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
  }
  const int64_t fc = test::param_index(model, "fc0.weight"), out = test::param_index(model, "out0.weight");
  ASSERT_GE(fc, 0);
  ASSERT_GE(out, 0);
  const torch::Tensor fc_before = adam.master(fc);
  ASSERT_FALSE(torch::equal(fc_before, fc_before.to(torch::kBFloat16).to(torch::kFloat)))
      << "the masters must have bits below bf16 for the test to mean anything";
  const torch::Tensor loaded = torch::randn(net->out[0]->weight.sizes()) * 0.05;  // fp32
  {
    torch::NoGradGuard no_grad;
    net->fc[0]->weight[0].fill_(0.5);       // in place, through a view: one row
    net->out[0]->weight.set_data(loaded.clone());  // new storage and dtype (torch::load across devices)
  }
  {
    torch::NoGradGuard no_grad;  // an evaluation forward: the writes are taken in before it
    const Batch x = batch(50);
    model.forward([&] { return lm_loss(net, x.idx, x.target); });
    model.end_iteration();
  }
  const torch::Tensor fc_after = adam.master(fc);
  EXPECT_TRUE(torch::equal(fc_after[0], torch::full_like(fc_after[0], 0.5))) << "the written row";
  EXPECT_TRUE(torch::equal(fc_after.slice(0, 1), fc_before.slice(0, 1))) << "the other rows keep their masters' bits";
  EXPECT_TRUE(torch::equal(adam.master(out), loaded)) << "an fp32 replacement gives exact masters";
  EXPECT_EQ(net->out[0]->weight.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(net->out[0]->weight, loaded.to(torch::kBFloat16)));
  EXPECT_EQ(net->out[0]->weight.data_ptr(), model.param_values(out).data_ptr()) << "back in its chunk";
  // Training goes on from there.
  const Batch x = batch(3);
  const StepResult r = adam.backward_step(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
  EXPECT_TRUE(r.applied);
}

// Fine-tuning freezes and unfreezes layers while the optimizer is attached. An unfrozen parameter's
// gradients used to stay in autograd's .grad (no landing hook: hooks went only on parameters that
// required grad when the optimizer attached), so it was never updated and its .grad grew every step;
// and a parameter frozen after attaching kept a hook that outlived the model. Against the unwrapped
// twin under ferry's CpuAdam (which, as HybridAdam, skips a parameter without a gradient and takes the
// bias corrections from its own step count, D62): every loss and final master bit-identical, no .grad
// left anywhere, and after the model is gone the module trains plainly with its hooks removed.
TEST(HybridAdam, FreezingAndUnfreezingDuringTrainingAsTheUnwrappedTwin) {
  const auto nets = twins(77);
  TinyLm ref = nets.first, net = nets.second;
  auto set_trainable = [](torch::nn::Module& m, bool on) {
    for (auto& p : m.parameters()) p.set_requires_grad(on);
  };
  // Frozen at first: fc0, and out1, whose chunk it shares with ln_f, which lands before it in backward
  // (so with the old expectations that chunk's update would start before out1's gradient lands).
  for (torch::nn::Module* m : {ref->fc[0].get(), net->fc[0].get(), ref->out[1].get(), net->out[1].get()}) {
    set_trainable(*m, false);
  }
  {
    ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
    HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(2));
    test::CpuAdamTwin ref_adam(*ref, adamw(), model.config());
    for (int step = 0; step < 7; ++step) {
      if (step == 2) {  // unfreeze both
        for (torch::nn::Module* m : {ref->fc[0].get(), net->fc[0].get(), ref->out[1].get(), net->out[1].get()}) {
          set_trainable(*m, true);
        }
      }
      if (step == 4) {  // freeze another
        set_trainable(*ref->ln_f, false);
        set_trainable(*net->ln_f, false);
      }
      const Batch x = batch(step);
      ref_adam.zero_grad();
      const torch::Tensor loss_ref = lm_loss(ref, x.idx, x.target);
      loss_ref.backward();
      ref_adam.step();
      const torch::Tensor loss = model.forward([&] { return lm_loss(net, x.idx, x.target); });
      adam.backward_step(loss);
      ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step;
      for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined()) << "step " << step << ": a .grad left";
    }
    const auto pr = ref->named_parameters();
    for (int64_t p = 0; p < model.num_params(); ++p) {
      EXPECT_TRUE(torch::equal(adam.master(p), pr[model.param_name(p)])) << "master of " << model.param_name(p);
    }
  }
  // The model and its optimizer are gone: ln_f, frozen since they attached, trains plainly (a hook left
  // on it would call the destroyed model).
  set_trainable(*net->ln_f, true);
  const Batch x = batch(9);
  lm_loss(net, x.idx, x.target).backward();
  EXPECT_TRUE(net->ln_f->weight.grad().defined());
}

// Note [Several forwards] (hooks/chunked_model.cpp) with the optimizer attached: two forward() calls on
// two batches per step, one backward of their mean, stepped by backward_step (the pipelined step) and by
// backward() + step() on alternate steps, under evictions with host and device state: bit-identical to
// the unwrapped twin from the warm-up on.
TEST(HybridAdam, SeveralForwardsPerStepAsTheUnwrappedTwin) {
  const auto nets = twins(78);
  TinyLm ref = nets.first, net = nets.second;
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(2));
  test::CpuAdamTwin ref_adam(*ref, adamw(), model.config());
  for (int step = 0; step < 5; ++step) {
    const Batch x = batch(2 * step), y = batch(2 * step + 1);
    ref_adam.zero_grad();
    const torch::Tensor ref_x = lm_loss(ref, x.idx, x.target);  // in this order, as the two forwards run
    const torch::Tensor ref_y = lm_loss(ref, y.idx, y.target);
    const torch::Tensor loss_ref = (ref_x + ref_y) / 2;
    loss_ref.backward();
    ref_adam.step();
    const torch::Tensor lx = model.forward([&] { return lm_loss(net, x.idx, x.target); });
    const torch::Tensor ly = model.forward([&] { return lm_loss(net, y.idx, y.target); });
    const torch::Tensor loss = (lx + ly) / 2;
    if (step % 2 == 0) {
      adam.backward_step(loss);
    } else {
      model.backward(loss);
      adam.step();
      adam.zero_grad();
    }
    ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step;
    if (step > 0) {  // once the state is placed
      EXPECT_GT(model.last_iteration().evictions, 0) << "step " << step;
    }
  }
  const auto pr = ref->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), pr[model.param_name(p)])) << "master of " << model.param_name(p);
  }
}

// One optimizer per model. A second HybridAdam (a second optimizer, or a std::unique_ptr reassigned,
// which builds the new one before the old one goes) used to take the gradients from the first, which
// then failed on an internal assert, and destroyed, detached the new one. It is refused before it
// allocates anything; the first trains on as its twin; once it is gone a new one attaches and trains as
// a fresh twin does.
TEST(HybridAdam, ASecondOptimizerOnTheSameModelIsRefusedAndTheFirstTrainsOn) {
  const auto nets = twins(79);
  TinyLm ref = nets.first, net = nets.second;
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  auto adam = std::make_unique<HybridAdam>(model, HybridAdamOptions(adamw()));
  auto ref_adam = std::make_unique<test::CpuAdamTwin>(*ref, adamw(), model.config());
  auto same_step = [&](int step) {
    const Batch x = batch(step);
    ref_adam->zero_grad();
    const torch::Tensor loss_ref = lm_loss(ref, x.idx, x.target);
    loss_ref.backward();
    ref_adam->step();
    const torch::Tensor loss = model.forward([&] { return lm_loss(net, x.idx, x.target); });
    adam->backward_step(loss);
    return torch::equal(loss, loss_ref);
  };
  EXPECT_TRUE(same_step(0));
  const std::string err = test::error_of([&] { adam = std::make_unique<HybridAdam>(model, HybridAdamOptions(adamw(1e-3))); });
  EXPECT_NE(err.find("ferry: this ChunkedModel has an optimizer attached already; one HybridAdam per model"),
            std::string::npos) << err;
  EXPECT_NE(err.find("`adam.reset();` before"), std::string::npos) << err;
  for (int step = 1; step < 3; ++step) EXPECT_TRUE(same_step(step)) << "step " << step;
  adam.reset();
  ref_adam.reset();
  adam = std::make_unique<HybridAdam>(model, HybridAdamOptions(adamw()));
  ref_adam = std::make_unique<test::CpuAdamTwin>(*ref, adamw(), model.config());
  for (int step = 3; step < 6; ++step) EXPECT_TRUE(same_step(step)) << "step " << step;
  const auto pr = ref->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam->master(p), pr[model.param_name(p)])) << "master of " << model.param_name(p);
    EXPECT_EQ(adam->param_step_count(p), 3) << model.param_name(p) << ": the new optimizer counts from 0";
  }
}

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
Config perceptron_config() {
  Config config = sim_config(8 << 10);
  config.chunk_size_bytes = 8 << 10;
  return config;
}

// A Perceptron wrapped in a ChunkedModel with its HybridAdam (AdamW, lr 1e-3) under
// perceptron_config()'s evictions, beside its unwrapped twin stepped by ferry's kernel.
struct WrappedPerceptron {
  WrappedPerceptron(uint64_t seed, int64_t in, int64_t hidden, int64_t out)
      : ref(seeded(seed, in, hidden, out)),
        net(seeded(seed, in, hidden, out)),
        model(net.ptr(), config),
        adam(model, adamw(1e-3)),
        twin(*ref, adamw(1e-3), config) {}
  static Perceptron seeded(uint64_t seed, int64_t in, int64_t hidden, int64_t out) {
    torch::manual_seed(seed);
    return Perceptron(in, hidden, out);
  }
  // Every master equals the twin's parameter, bit for bit.
  void expect_masters_as_twin(const std::string& what) {
    const auto named = ref->named_parameters();
    for (int64_t p = 0; p < model.num_params(); ++p) {
      EXPECT_TRUE(torch::equal(adam.master(p), named[model.param_name(p)])) << what << ": master of "
                                                                           << model.param_name(p);
    }
  }
  const Config config = perceptron_config();
  Perceptron ref, net;
  ChunkedModel model;
  HybridAdam adam;
  test::CpuAdamTwin twin;
};

// Two wrapped models whose graphs cross, as a GAN trains them: the discriminator's step on real and
// generated (detached) samples, then the generator's step through the discriminator, whose forward
// waits for no backward of its own (its gradients land in its slots from the generator's backward and
// are discarded, as optimizer.zero_grad() does; or it is frozen for that step). Each under evictions,
// with its own HybridAdam: bit-identical to the unwrapped twins.
TEST(HybridAdam, TwoWrappedModelsTrainAsAGanAsTheirTwins) {
  for (const bool freeze_d : {false, true}) {
    WrappedPerceptron gen(1, 8, 40, 16), dis(2, 16, 40, 1);
    auto bce = [](const torch::Tensor& logits, float target) {
      return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, target));
    };
    auto set_trainable = [](torch::nn::Module& m, bool on) {
      for (auto& p : m.parameters()) p.set_requires_grad(on);
    };
    for (int step = 0; step < 4; ++step) {
      const std::string what = std::string(freeze_d ? "frozen" : "discarded") + " D, step " + std::to_string(step);
      torch::manual_seed(100 + step);
      const torch::Tensor z = torch::randn({4, 8}), real = torch::randn({4, 16});
      dis.twin.zero_grad();
      const torch::Tensor ref_real = dis.ref->forward(real);  // in the order the wrapped step runs them
      const torch::Tensor loss_d_ref = bce(ref_real, 1) + bce(dis.ref->forward(gen.ref->forward(z).detach()), 0);
      loss_d_ref.backward();
      dis.twin.step();
      gen.twin.zero_grad();
      if (freeze_d) set_trainable(*dis.ref, false);
      const torch::Tensor loss_g_ref = bce(dis.ref->forward(gen.ref->forward(z)), 1);
      loss_g_ref.backward();
      gen.twin.step();
      set_trainable(*dis.ref, true);

      torch::Tensor fake;
      {
        torch::NoGradGuard no_grad;
        fake = gen.model.forward([&] { return gen.net->forward(z); });
        gen.model.end_iteration();
      }
      const torch::Tensor loss_d = dis.model.forward([&] {
        const torch::Tensor on_real = dis.net->forward(real);
        return bce(on_real, 1) + bce(dis.net->forward(fake), 0);
      });
      dis.adam.backward_step(loss_d);
      if (freeze_d) set_trainable(*dis.net, false);
      const torch::Tensor generated = gen.model.forward([&] { return gen.net->forward(z); });
      const torch::Tensor loss_g = dis.model.forward([&] { return bce(dis.net->forward(generated), 1); });
      gen.model.backward(loss_g);
      gen.adam.step();
      if (!freeze_d) dis.adam.zero_grad();
      set_trainable(*dis.net, true);
      ASSERT_TRUE(torch::equal(loss_d, loss_d_ref)) << what;
      ASSERT_TRUE(torch::equal(loss_g, loss_g_ref)) << what;
    }
    for (WrappedPerceptron* w : {&gen, &dis}) {
      w->expect_masters_as_twin(freeze_d ? "frozen D" : "discarded D");
      EXPECT_GT(w->model.last_iteration().evictions, 0) << "the budget forces evictions";
    }
  }
}

// One encoder checkpointed in two forwards before one backward: its parameters are in two
// ferry::checkpoint segments. The second segment's nested backward used to land their gradients in
// their slots before the first segment's recompute needed the values (refused). Now each segment hands
// its parameters' gradients to the outer backward (Note [Checkpoint parameters as inputs]), which lands
// each once: bit-identical to the twin without checkpointing, under evictions, with backward_step.
TEST(HybridAdam, AnEncoderCheckpointedInTwoForwardsTrainsAsTheTwin) {
  torch::manual_seed(2);
  Perceptron ref(16, 40, 4);
  torch::manual_seed(2);
  Perceptron net(16, 40, 4);
  Config config = sim_config(8 << 10);  // 8 KiB chunks, two of them, a budget of one
  config.chunk_size_bytes = 8 << 10;
  ChunkedModel model(net.ptr(), config);
  HybridAdam adam(model, adamw(1e-3));
  test::CpuAdamTwin twin(*ref, adamw(1e-3), model.config());
  auto checkpointed = [&](const torch::Tensor& x) {
    return checkpoint([&](const std::vector<at::Tensor>& in) { return net->forward(in[0]); }, {x}).pow(2).sum();
  };
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(20 + step);
    const torch::Tensor x1 = torch::randn({4, 16}), x2 = torch::randn({4, 16});
    twin.zero_grad();
    const torch::Tensor ref_a = ref->forward(x1).pow(2).sum();
    const torch::Tensor loss_ref = ref_a + ref->forward(x2).pow(2).sum();
    loss_ref.backward();
    twin.step();
    const torch::Tensor a = model.forward([&] { return checkpointed(x1); });
    const torch::Tensor b = model.forward([&] { return checkpointed(x2); });
    const torch::Tensor loss = a + b;
    adam.backward_step(loss);
    ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step;
    EXPECT_GT(model.last_iteration().evictions, 0) << "step " << step;
  }
  const auto pr = ref->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), pr[model.param_name(p)])) << "master of " << model.param_name(p);
  }
}

// An activation checkpoint of the user's own, reentrant as ferry's used to be: backward recomputes the
// perceptron and runs a nested backward, which accumulates the parameters' gradients there.
struct ReentrantCheckpoint : torch::autograd::Function<ReentrantCheckpoint> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, PerceptronImpl* net) {
    ctx->saved_data["net"] = reinterpret_cast<int64_t>(net);
    ctx->save_for_backward({x});
    return net->forward(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto* net = reinterpret_cast<PerceptronImpl*>(ctx->saved_data["net"].toInt());
    const torch::Tensor x = ctx->get_saved_variables()[0].detach();
    torch::Tensor out;
    {
      at::AutoGradMode grad_on(true);
      out = net->forward(x);
    }
    torch::autograd::backward({out}, {grad_out[0]});
    return {torch::Tensor(), torch::Tensor()};
  }
};

// Such a checkpoint in two forwards: the first segment's recompute meets parameters whose gradients the
// second segment's nested backward landed. Refused naming the cause and ferry::checkpoint; nothing is
// lost: after zero_grad() training goes on (with ferry::checkpoint) bit-identical to the twin.
TEST(HybridAdam, AParameterUsedAfterANestedBackwardLandedItsGradientIsRefused) {
  torch::manual_seed(3);
  Perceptron ref(16, 40, 4);
  torch::manual_seed(3);
  Perceptron net(16, 40, 4);
  ChunkedModel model(net.ptr(), sim_config(0));
  HybridAdam adam(model, adamw(1e-3));
  test::CpuAdamTwin twin(*ref, adamw(1e-3), model.config());
  torch::manual_seed(30);
  const torch::Tensor x1 = torch::randn({4, 16}), x2 = torch::randn({4, 16});
  const std::string err = test::error_of([&] {
    // Inputs that require grad, so the node's output does (the parameters are not its inputs).
    const torch::Tensor in1 = x1.clone().requires_grad_(true), in2 = x2.clone().requires_grad_(true);
    const torch::Tensor a = model.forward([&] { return ReentrantCheckpoint::apply(in1, net.get()).pow(2).sum(); });
    const torch::Tensor b = model.forward([&] { return ReentrantCheckpoint::apply(in2, net.get()).pow(2).sum(); });
    adam.backward_step(a + b);
  });
  EXPECT_NE(err.find("its chunk slot holds its gradient, which landed earlier in this backward"), std::string::npos)
      << err;
  EXPECT_NE(err.find("a nested backward accumulated it (an activation checkpoint of one's own"), std::string::npos)
      << err;
  adam.zero_grad();
  for (int step = 0; step < 3; ++step) {
    twin.zero_grad();
    const torch::Tensor ref_a = ref->forward(x1).pow(2).sum();
    const torch::Tensor loss_ref = ref_a + ref->forward(x2).pow(2).sum();
    loss_ref.backward();
    twin.step();
    auto checkpointed = [&](const torch::Tensor& x) {
      return checkpoint([&](const std::vector<at::Tensor>& in) { return net->forward(in[0]); }, {x}).pow(2).sum();
    };
    const torch::Tensor a = model.forward([&] { return checkpointed(x1); });
    const torch::Tensor b = model.forward([&] { return checkpointed(x2); });
    const torch::Tensor loss = a + b;
    adam.backward_step(loss);
    ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step;
  }
  const auto pr = ref->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), pr[model.param_name(p)])) << "master of " << model.param_name(p);
  }
}

// A bag of words whose embedding may give sparse gradients (nn::EmbeddingOptions::sparse).
struct BagOfWordsImpl : torch::nn::Module {
  explicit BagOfWordsImpl(bool sparse) {
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(kVocab, kDim).sparse(sparse)));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor loss(const Batch& x) {
    return torch::nn::functional::cross_entropy(head(emb(x.idx)).reshape({-1, kVocab}), x.target.reshape({-1}));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(BagOfWords);

// Sparse gradients, which no Adam takes (torch's refuses them too), fail the backward naming the
// parameter and the remedy; nothing is updated; the next forward names zero_grad() as the way to drop
// what landed before the failure, and after it, with the embedding dense, training goes on
// bit-identical to the twin that was dense from the start (the refused gradient used to stay in .grad,
// where autograd summed it into the next backward's: the first step then differed by 7e-6).
TEST(HybridAdam, ASparseGradientIsRefusedNamingTheRemedyAndNothingChanges) {
  torch::manual_seed(5);
  BagOfWords ref(/*sparse=*/false);
  torch::manual_seed(5);
  BagOfWords net(/*sparse=*/true);
  ChunkedModel model(net.ptr(), sim_config(budget_for(1, 1)));
  HybridAdam adam(model, adamw());
  test::CpuAdamTwin ref_adam(*ref, adamw(), model.config());
  const std::string err = test::error_of([&] { adam.backward_step(model.forward([&] { return net->loss(batch(0)); })); });
  EXPECT_NE(err.find("parameter emb.weight got a Sparse one"), std::string::npos) << err;
  EXPECT_NE(err.find("build it with sparse(false)"), std::string::npos) << err;
  net->emb->options.sparse(false);
  // The head's gradient had landed in its slot before the embedding's was refused.
  const std::string again = test::error_of([&] { model.forward([&] { return net->loss(batch(0)); }); });
  EXPECT_NE(again.find("parameter head.weight is used, but its chunk slot holds its gradient since its backward "
                       "(Note [Gradient in the parameter slot]), which failed: the optimizer's zero_grad() discards"),
            std::string::npos)
      << again;
  adam.zero_grad();
  for (int step = 0; step < 3; ++step) {
    ref_adam.zero_grad();
    const torch::Tensor loss_ref = ref->loss(batch(step));
    loss_ref.backward();
    ref_adam.step();
    const torch::Tensor loss = model.forward([&] { return net->loss(batch(step)); });
    adam.backward_step(loss);
    ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step;
  }
  const auto pr = ref->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), pr[model.param_name(p)])) << "master of " << model.param_name(p);
  }
  EXPECT_EQ(adam.param_step_count(0), 3) << "the refused step counted no update";
}

// An encoder and a decoder wrapped each in its own ChunkedModel with its own HybridAdam, trained on
// one joint loss backwarded through either model's backward(): the other model's gradients land from
// that backward (not refused, D66), both steps apply them, and the other model's iteration ends at its
// next forward (Note [Several forwards]: a backward that freed the graph ran through its output).
// Under evictions, bit-identical to the unwrapped pair.
TEST(HybridAdam, TwoWrappedHalvesTrainOnOneJointBackwardAsTheirTwins) {
  for (const bool through_decoder : {true, false}) {
    const std::string how = through_decoder ? "decoder.backward(loss)" : "encoder.backward(loss)";
    WrappedPerceptron enc(3, 16, 40, 8), dec(4, 8, 40, 16);
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(300 + step);
      const torch::Tensor x = torch::randn({4, 16});
      enc.twin.zero_grad();
      dec.twin.zero_grad();
      torch::mse_loss(dec.ref->forward(enc.ref->forward(x)), x).backward();
      enc.twin.step();
      dec.twin.step();
      const torch::Tensor z = enc.model.forward([&] { return enc.net->forward(x); });
      const torch::Tensor y = dec.model.forward([&] { return dec.net->forward(z); });
      const torch::Tensor loss = torch::mse_loss(y, x);
      (through_decoder ? dec.model : enc.model).backward(loss);
      enc.adam.step();
      dec.adam.step();
      enc.adam.zero_grad();
      dec.adam.zero_grad();
    }
    enc.model.end_iteration();
    dec.model.end_iteration();
    EXPECT_EQ(enc.model.scheduler().iterations(), 4) << how;
    EXPECT_EQ(dec.model.scheduler().iterations(), 4) << how;
    enc.expect_masters_as_twin(how);
    dec.expect_masters_as_twin(how);
  }
}

// A WGAN-GP critic computes its gradient penalty first: a forward on the interpolates, then
// autograd::grad with create_graph through that forward's output, then the forwards on real and
// generated samples, then one backward. The penalty's backward runs through the first forward's
// output node but keeps the graph, so the iteration must go on (Note [Several forwards]: only a
// backward that frees the graph counts); counting it ended the iteration at the next forward, and
// the warm-up's repack broke the final backward ("setStorage ... out of bounds"). Under evictions,
// bit-identical to the twin, one iteration per step. The same with the critic's first two layers
// checkpointed (D69: the penalty's gradient goes through the segment's recompute, made with a graph).
TEST(HybridAdam, AGradientPenaltyBeforeMoreForwardsTrainsAsTheTwin) {
  auto critic_loss = [](const std::function<torch::Tensor(const torch::Tensor&)>& score, int step) {
    torch::manual_seed(200 + step);
    const torch::Tensor real = torch::randn({4, 16}), fake = torch::randn({4, 16});
    const torch::Tensor mixed = (0.3 * real + 0.7 * fake).requires_grad_();
    const torch::Tensor d_mixed = score(mixed);
    const torch::Tensor g = torch::autograd::grad({d_mixed.sum()}, {mixed}, {}, /*retain_graph=*/true,
                                                  /*create_graph=*/true)[0];
    const torch::Tensor penalty = (g.norm(2, 1) - 1).pow(2).mean();
    const torch::Tensor d_real = score(real);
    const torch::Tensor d_fake = score(fake);
    return d_fake.mean() - d_real.mean() + 10 * penalty;
  };
  for (const bool checkpointed : {false, true}) {
    const std::string how = checkpointed ? "checkpointed" : "plain";
    WrappedPerceptron critic(2, 16, 40, 1);
    critic.net->checkpointed = checkpointed;
    for (int step = 0; step < 4; ++step) {
      critic.twin.zero_grad();
      critic_loss([&](const torch::Tensor& x) { return critic.ref->forward(x); }, step).backward();
      critic.twin.step();
      const auto wrapped = [&](const torch::Tensor& x) {
        return critic.model.forward([&] { return critic.net->forward(x); });
      };
      const torch::Tensor loss = critic_loss(wrapped, step);
      ASSERT_NO_THROW(critic.model.backward(loss)) << how << ", step " << step;
      critic.adam.step();
      EXPECT_EQ(critic.model.scheduler().iterations(), step + 1) << how << ": one iteration per step, three forwards";
    }
    EXPECT_TRUE(critic.model.layout_final()) << how << ": the warm-up's repack ran";
    critic.expect_masters_as_twin("critic, " + how);
  }
}

// A view of the optimizer state kept over the warm-up (a report over adam.state_store(); master(p)
// gives a copy): the state migrates in the warm-up's repack, which used to free the view's memory
// under it and hand its host buffer to the new store. The repack waits until it is dropped (Note [A
// repack waits for held views]); meanwhile the view is the state's, and the training is bit-identical
// to the twin before and after the repack.
TEST(HybridAdam, AStateViewKeptOverTheWarmupDelaysTheRepack) {
  WrappedPerceptron w(5, 16, 40, 4);
  torch::Tensor kept = w.adam.state_store().payload(0);
  auto train = [&](int step) {
    torch::manual_seed(300 + step);
    const torch::Tensor x = torch::randn({4, 16}), y = torch::randn({4, 4});
    w.twin.zero_grad();
    torch::mse_loss(w.ref->forward(x), y).backward();
    w.twin.step();
    w.model.backward(w.model.forward([&] { return torch::mse_loss(w.net->forward(x), y); }));
    w.adam.step();
  };
  for (int step = 0; step < 3; ++step) {
    train(step);
    EXPECT_FALSE(w.model.layout_final()) << "step " << step;
    EXPECT_TRUE(torch::equal(kept, w.adam.state_store().payload(0))) << "the kept view is the state, step " << step;
    w.expect_masters_as_twin("view kept, step " + std::to_string(step));
  }
  kept = torch::Tensor();
  train(3);
  EXPECT_TRUE(w.model.layout_final()) << "the repack ran once the view was gone";
  EXPECT_EQ(w.model.repack_waits(), 3);
  train(4);
  w.expect_masters_as_twin("after the repack");
}

// `loss.backward()` in place of `model.backward(loss)` (Note [A backward not through model.backward()],
// hooks/chunked_model.cpp). It used to run: with fp16 the loss scale was never applied, so every
// gradient reached the step 65536 times too small and the iteration never ended. Now it is refused at
// the first gradient, naming the call, before anything lands; the training that follows is
// bit-identical to a twin that never made the slip.
TEST(HybridAdam, ABareLossBackwardIsRefusedAndTrainingGoesOnAsTheTwin) {
  const auto nets = twins(91);
  TinyLm net = nets.first, twin = nets.second;
  ChunkedModel model(net.ptr(), sim_config(budget_for(2, 1), Precision::kFp16));
  ChunkedModel twin_model(twin.ptr(), sim_config(budget_for(2, 1), Precision::kFp16));
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_max_grad_norm(1.0));
  HybridAdam twin_adam(twin_model, HybridAdamOptions(adamw()).with_max_grad_norm(1.0));
  {
    const Batch x = batch(0);
    const torch::Tensor slipped = model.forward([&] { return lm_loss(net, x.idx, x.target); });
    const std::string err = test::error_of([&] { slipped.backward(); });
    EXPECT_NE(err.find("got a gradient from a backward that did not go through model.backward(): call "
                       "model.backward(loss) (or adam.backward_step(loss)) instead of loss.backward()"),
              std::string::npos)
        << err;
    for (int64_t p = 0; p < model.num_params(); ++p) {
      EXPECT_FALSE(model.grad_in_slot(p)) << model.param_name(p) << ": nothing of the refused backward lands";
      EXPECT_FALSE(net->named_parameters()[model.param_name(p)].grad().defined()) << model.param_name(p);
    }
    EXPECT_EQ(test::error_of([&] { adam.step(); }),
              "ferry: HybridAdam::step() found no gradients since the last zero_grad(); call "
              "model.backward(loss) first");
  }
  for (int step = 0; step < 4; ++step) {
    const Batch x = batch(step);
    const torch::Tensor loss = model.forward([&] { return lm_loss(net, x.idx, x.target); });
    const torch::Tensor twin_loss = twin_model.forward([&] { return lm_loss(twin, x.idx, x.target); });
    model.backward(loss);
    twin_model.backward(twin_loss);
    const StepResult r = adam.step();
    const StepResult twin_r = twin_adam.step();
    adam.zero_grad();
    twin_adam.zero_grad();
    ASSERT_TRUE(torch::equal(loss, twin_loss)) << "step " << step;
    EXPECT_EQ(r.grad_norm, twin_r.grad_norm) << "step " << step;
    EXPECT_EQ(r.loss_scale, twin_r.loss_scale) << "step " << step;
  }
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), twin_adam.master(p))) << model.param_name(p);
  }
}

// An optimizer declared before its model outlives it (members destroyed in reverse order). Its
// destructor and every call used to touch the destroyed model; now the model's destructor tells it
// (after its updates are done), the parameters keep the values of the last step, the optimizer refuses
// every call naming the order, and its own destructor is quiet. materialize() with an optimizer
// attached is refused.
TEST(HybridAdam, AnOptimizerThatOutlivesItsModelRefusesEveryCall) {
  const auto nets = twins(93);
  TinyLm net = nets.first, twin = nets.second;
  struct Trainer {
    std::unique_ptr<HybridAdam> adam;  // declared first: destroyed last
    std::unique_ptr<ChunkedModel> model;
  } t;
  t.model = std::make_unique<ChunkedModel>(net.ptr(), sim_config(budget_for(2, 1)));
  t.adam = std::make_unique<HybridAdam>(*t.model, adamw());
  ChunkedModel twin_model(twin.ptr(), sim_config(budget_for(2, 1)));
  HybridAdam twin_adam(twin_model, adamw());
  for (int step = 0; step < 2; ++step) {
    const Batch x = batch(step);
    t.adam->backward_step(t.model->forward([&] { return lm_loss(net, x.idx, x.target); }));
    twin_adam.backward_step(twin_model.forward([&] { return lm_loss(twin, x.idx, x.target); }));
  }
  EXPECT_EQ(test::error_of([&] { t.model->materialize(); }),
            "ferry: materialize() while an optimizer (the model's gradient sink) is attached: destroy it first "
            "(adam.reset()), after adam.save() or adam.state_dict() if you need its fp32 masters");
  t.model.reset();  // the updates left running behind the last step are done first
  EXPECT_EQ(test::error_of([&] { t.adam->step(); }),
            "ferry: HybridAdam step() after its ChunkedModel was destroyed: destroy the optimizer before its model "
            "(declare it after the model)");
  for (const std::string& err : {test::error_of([&] { t.adam->zero_grad(); }),
                                 test::error_of([&] { t.adam->state_dict(); })}) {
    EXPECT_NE(err.find("after its ChunkedModel was destroyed"), std::string::npos) << err;
  }
  const auto values = twin_model.state_dict();  // compute-dtype values, as the parameters hold them
  const auto named = net->named_parameters();
  for (const auto& [name, value] : values) {
    if (!named.contains(name)) continue;  // buffers
    EXPECT_TRUE(torch::equal(named[name].detach().cpu(), value)) << name << " keeps the last step's value";
  }
  t.adam.reset();  // quiet: nothing of the model is touched
}

// After backward() a slot holds its parameter's gradient until step(): a write then goes into the
// gradient, and step() refuses to use it, naming the parameter; zero_grad() discards both.
TEST(HybridAdam, AWriteAfterBackwardIsRefusedByStep) {
  torch::manual_seed(75);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(2));
  const Batch x = batch(0);
  model.backward(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
  {
    torch::NoGradGuard no_grad;
    net->ln_f->weight.mul_(2.0);
  }
  try {
    adam.step();
    FAIL() << "step() must refuse a gradient a write went into";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ln_f.weight was written after backward()"), std::string::npos) << e.what();
  }
  EXPECT_EQ(adam.step_count(0), 0);
  adam.zero_grad();
  model.backward(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
  EXPECT_TRUE(adam.step().applied);
}

// Note [Ops outside the scopes], the key and torch's thread-local state: a plain backward (another
// model's: a teacher, a discriminator, a probe) on the thread that ran step(), while the updates the
// step left running still run. A function in it waits for them (it holds the worker until then), so
// the watch ends inside one of autograd's nodes, which puts the key back when the node ends. With
// nothing holding that key, every later op of the thread went through the fallback as if in a scope:
// reads of parameters between steps ran their pre-use hooks outside any iteration (the scheduler saw
// accesses off its trace), and in a run with ops between forward() and backward() the next step()'s
// own chunk copies did too and failed ("holds its gradient"). Now the thread's ops after it are not
// seen at all, and the losses, the values read and the final state are bit-identical to the same
// training without the plain backward.
std::promise<void>* g_release_worker = nullptr;
HybridAdam* g_sync_adam = nullptr;
int g_hazards_seen = -1;
struct WaitForTheUpdates : torch::autograd::Function<WaitForTheUpdates> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    g_hazards_seen = static_cast<int>(outside_hazards());
    g_release_worker->set_value();
    g_sync_adam->synchronize();
    for (int i = 0; i < 10000 && outside_hazards() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return {g[0] * 2};  // the thread's first op with no hazard left: the watch ends inside this node
  }
};

TEST(HybridAdam, APlainBackwardOnTheStepsThreadLeavesTheModelAlone) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  const auto nets = twins(53);
  TinyLm a_net = nets.first, b_net = nets.second;
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 2)));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam a_adam(a, options), b_adam(b, options);
  torch::manual_seed(54);
  torch::nn::Linear other(8, 8);  // a plain module, trained beside the wrapped one
  int64_t deferred = 0;
  for (int step = 0; step < 6; ++step) {
    const std::string when = "step " + std::to_string(step);
    const Batch x = batch(step);
    auto train = [&](ChunkedModel& m, TinyLm& net, HybridAdam& adam, std::promise<void>* hold) {
      const torch::Tensor loss = m.forward([&] { return lm_loss(net, x.idx, x.target); });
      m.backward(loss);
      std::shared_future<void> released;
      if (hold) {  // the worker waits for the plain backward: the updates queued behind it are still to run
        released = hold->get_future().share();
        adam.run_on_worker([released] { released.wait(); });
      }
      const StepResult r = adam.step();
      adam.zero_grad();
      return std::make_pair(r, loss.detach());
    };
    const auto [ra, la] = train(a, a_net, a_adam, nullptr);
    std::promise<void> hold;
    const auto [rb, lb] = train(b, b_net, b_adam, &hold);
    ASSERT_TRUE(torch::equal(la, lb)) << when << ": the loss";
    deferred += rb.deferred_chunks;
    // The plain model's training step on the same thread.
    g_release_worker = &hold;
    g_sync_adam = &b_adam;
    g_hazards_seen = -1;
    const torch::Tensor in = torch::randn({4, 8}, torch::requires_grad());
    WaitForTheUpdates::apply(other->forward(in)).pow(2).sum().backward();
    if (g_hazards_seen < 0) hold.set_value();  // the function did not run: never leave the worker waiting
    g_release_worker = nullptr;
    if (rb.deferred_chunks > 0) {
      EXPECT_GT(g_hazards_seen, 0) << when << ": the updates must still run then";
    }
    EXPECT_EQ(outside_hazards(), 0) << when;
    other->zero_grad();
    // Reads between steps, on the same thread: plain ops, not seen at all (the key is off).
    auto a_params = a_net->named_parameters(), b_params = b_net->named_parameters();
    const int64_t ops = interception_counters().ops;
    for (const auto& item : a_params) {
      EXPECT_TRUE(torch::equal(b_params[item.key()].clone(), item.value())) << when << ": " << item.key();
    }
    EXPECT_EQ(interception_counters().ops, ops) << when << ": the thread's ops went through the fallback";
  }
  EXPECT_GT(deferred, 0) << "the steps should leave host updates running";
  ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 6 steps"));
}

// Note [Between forward and backward]: between forward() and backward() the thread that ran forward()
// watches, and its ops on parameters are uses; ferry's own calls there are not (OwnOps). The common
// `loss = forward; opt.zero_grad(); loss.backward(); opt.step()` order, backward_step() on a forward's
// loss, (with accumulated gradients) the step after a forward under grad mode whose backward never
// comes, and an evaluation forward followed by reads and a checkpoint: the same losses and final state,
// bit for bit, as the same training with those calls between iterations. An optimizer destroyed after
// an evaluation forward detaches from the model (it did not: the model's destructor called the dead
// optimizer; the sanitizer build caught it).
TEST(HybridAdam, OptimizerCallsBetweenForwardAndBackwardAreNotUses) {
  for (bool accumulate : {false, true}) {
    SCOPED_TRACE(accumulate ? "accumulate_grads" : "grads in the slots");
    HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
    options.device_state_chunks = 1;
    options.accumulate_grads = accumulate;
    const auto nets = twins(61);
    TinyLm a_net = nets.first, b_net = nets.second;
    ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 1, accumulate ? 4 : 3)));
    ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 1, accumulate ? 4 : 3)));
    HybridAdam a_adam(a, options), b_adam(b, options);
    const std::string dir = temp_dir("between");
    for (int step = 0; step < 6; ++step) {
      const std::string when = "step " + std::to_string(step);
      const Batch x = batch(step);
      auto loss_a = [&] { return lm_loss(a_net, x.idx, x.target); };
      auto loss_b = [&] { return lm_loss(b_net, x.idx, x.target); };
      // a: every optimizer call between iterations.
      a_adam.zero_grad();
      if (accumulate) a.backward(a.forward(loss_a));  // a first micro-batch
      const torch::Tensor la = a.forward(loss_a);
      if (step % 2 == 0) {
        a.backward(la);
        a_adam.step();
      } else {
        a_adam.backward_step(la);
      }
      // b: zero_grad() and backward_step() between forward() and backward().
      if (accumulate) {
        const torch::Tensor first = b.forward(loss_b);
        b_adam.zero_grad();
        b.backward(first);
      }
      const torch::Tensor lb = b.forward(loss_b);
      if (!accumulate) b_adam.zero_grad();
      if (step % 2 == 0) {
        b.backward(lb);
        // With accumulated gradients (they left the slots): a validation forward under grad mode, as many
        // loops run it, whose backward never comes, then the step: ferry's own ops while the thread watches.
        if (accumulate) (void)b.forward(loss_b);
        const int64_t uses = interception_counters().ops_with_params;
        b_adam.step();  // its chunk copies are ferry's own ops, never uses (they were, without OwnOps)
        EXPECT_EQ(interception_counters().ops_with_params, uses) << when;
      } else {
        b_adam.backward_step(lb);
      }
      ASSERT_TRUE(torch::equal(la, lb)) << when << ": the loss";
      // An evaluation forward, then reads and a checkpoint before the next training forward.
      torch::NoGradGuard no_grad;
      const torch::Tensor ea = a.forward(loss_a);
      a.end_iteration();
      const torch::Tensor eb = b.forward(loss_b);
      EXPECT_TRUE(torch::equal(ea, eb)) << when << ": the evaluation";
      EXPECT_TRUE(torch::equal(b_adam.master(0), a_adam.master(0))) << when;
      EXPECT_TRUE(torch::equal(b.param_values(0).clone(), a.param_values(0))) << when;
      if (step == 3) b_adam.save(dir);
    }
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 6 steps"));
    remove_checkpoint(dir);
  }
}

// A TinyLm with one more parameter, 'extra' (zeros, kDim), added to the embedding's output while
// use_extra is set: a parameter some steps do not train, whose gradient lands last in backward.
TinyLm tiny_lm_with_extra(uint64_t seed, const bool& use_extra) {
  torch::manual_seed(seed);
  TinyLm net(kVocab, kDim);
  torch::Tensor extra = net->register_parameter("extra", torch::zeros({kDim}));
  net->after_embedding = [&use_extra, extra](const torch::Tensor& x) { return use_extra ? x + extra : x; };
  return net;
}

// The two-phase step with micro-batches takes a gradient its chunk did not have in the previous
// backward, after that chunk's norm was taken (nothing irreversible had happened: the step takes the
// norm again), and stays bit-identical to backward() + step(). (PipelinedStepTakesAGradientItsChunkDidNotExpect:
// the default mode, and the eager step.)
TEST(HybridAdam, AccumulatedTwoPhaseStepTakesALateGradient) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.max_grad_norm = 0.05;
  options.accumulate_grads = true;
  bool use_extra = false;
  TinyLm a_net = tiny_lm_with_extra(57, use_extra), b_net = tiny_lm_with_extra(57, use_extra);
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 2 * 2, 4), Precision::kBf16));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 2 * 2, 4), Precision::kBf16));
  HybridAdam a_adam(a, options), b_adam(b, options);
  int64_t overlapped_before = 0;
  for (int step = 0; step < 5; ++step) {
    for (int k = 0; k < 2; ++k) {
      use_extra = step == 4 && k == 1;  // the last micro-batch of the last step only
      const Batch x = batch(10 * step + k);
      auto loss = [&](TinyLm& net) { return lm_loss(net, x.idx, x.target) / 2; };
      a.backward(a.forward([&] { return loss(a_net); }));
      if (k == 0) {
        b.backward(b.forward([&] { return loss(b_net); }));
        continue;
      }
      const StepResult ra = a_adam.step();
      const StepResult rb = b_adam.backward_step(b.forward([&] { return loss(b_net); }));
      a_adam.zero_grad();
      b_adam.zero_grad();
      ASSERT_TRUE(ra.applied && rb.applied) << "step " << step;
      EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << step;
      EXPECT_LT(ra.clip_coef, 1.0) << "step " << step << ": the clipping path";
      if (step == 3) overlapped_before = rb.overlapped_chunks;
      if (step == 4) {
        EXPECT_LT(rb.overlapped_chunks, overlapped_before) << "the late gradient's chunk had its norm taken again";
      }
      ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "step " + std::to_string(step)));
    }
  }
  EXPECT_GT(overlapped_before, 0);
}

// Host synchronizations and transfers per step, counted on a copy engine whose copies stay pending
// until waited for (as CUDA's do): the pipelined step stalls the training thread O(1) times, the
// unpipelined one once per host-state chunk; the pipeline's per-chunk waits happen on the worker; and
// the pipeline adds no transfer.
struct StepCounts {
  int64_t syncs = 0, background_syncs = 0, transfers = 0, host_chunks = 0, overlapped = 0;
};
StepCounts steady_step_counts(bool pipelined) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 1;
  torch::manual_seed(43);
  TinyLm net(kVocab, kDim);
  ChunkedModelOptions model_options;
  model_options.copy_engine = [] { return std::make_unique<StreamModelCopyEngine>(); };
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2), Precision::kBf16), std::move(model_options));
  HybridAdam adam(model, options);
  StepCounts counts;
  for (int step = 0; step < 4; ++step) {
    const Batch x = batch(step);
    const MoveStats before = model.store().stats().moves;
    auto loss = model.forward([&] { return lm_loss(net, x.idx, x.target); });
    StepResult r;
    if (pipelined) {
      r = adam.backward_step(loss);
    } else {
      model.backward(loss);
      r = adam.step();
    }
    EXPECT_TRUE(r.applied);
    const MoveStats after = model.store().stats().moves;
    if (step < 3) continue;  // steady state: placed, repacked, pipelined
    counts.syncs = after.sync_count - before.sync_count + r.device_syncs;
    counts.background_syncs = after.background_sync_count - before.background_sync_count;
    counts.transfers = (after.h2d_count - before.h2d_count) + (after.d2h_count - before.d2h_count);
    counts.host_chunks = r.host_chunks;
    counts.overlapped = r.overlapped_chunks;
  }
  return counts;
}

// A backward_step whose forward comes after the warm-up but before any step (here the warm-up's
// gradients were discarded; with micro-batches it is the last one's) places the state at its step, not
// inside the iteration (it used to fail: "admit_device_bytes() inside an iteration"), and trains as
// backward() + step().
TEST(HybridAdam, BackwardStepBeforeAnyStepPlacesAtItsStep) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 2;
  torch::manual_seed(43);
  TinyLm a_net(kVocab, kDim);
  torch::manual_seed(43);
  TinyLm b_net(kVocab, kDim);
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 2 * 2), Precision::kBf16));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 2 * 2), Precision::kBf16));
  HybridAdam a_adam(a, options), b_adam(b, options);
  const Batch w = batch(0);
  a.backward(a.forward([&] { return lm_loss(a_net, w.idx, w.target); }));
  a_adam.zero_grad();
  b.backward(b.forward([&] { return lm_loss(b_net, w.idx, w.target); }));
  b_adam.zero_grad();
  EXPECT_EQ(b_adam.device_state_chunks(), 0) << "nothing placed by the warm-up alone";
  for (int step = 1; step < 4; ++step) {
    const Batch x = batch(step);
    a.backward(a.forward([&] { return lm_loss(a_net, x.idx, x.target); }));
    ASSERT_TRUE(a_adam.step().applied);
    ASSERT_TRUE(b_adam.backward_step(b.forward([&] { return lm_loss(b_net, x.idx, x.target); })).applied);
    EXPECT_EQ(b_adam.device_state_chunks(), 2) << "step " << step;
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "step " + std::to_string(step)));
  }
}

TEST(HybridAdam, PipelinedStepSyncsOnceAndMovesWholeChunks) {
  const StepCounts plain = steady_step_counts(false);
  const StepCounts piped = steady_step_counts(true);
  ASSERT_GE(plain.host_chunks, 3);
  // Unpipelined: each host-state chunk's synchronous move to the host stalls the training thread.
  EXPECT_GE(plain.syncs, plain.host_chunks);
  // Pipelined: the end-of-iteration settle and the one read of the device norms, whatever the size.
  EXPECT_LE(piped.syncs, 2) << "syncs per step must not grow with chunks or parameters";
  EXPECT_EQ(piped.overlapped, piped.host_chunks + 1) << "every chunk went through the pipeline";
  EXPECT_GE(piped.background_syncs, 1) << "the worker waits for the gradients' copies";
  EXPECT_LE(piped.transfers, plain.transfers) << "the pipeline moves the same chunks, no more";
  std::printf("steady step: unpipelined %lld syncs, %lld transfers; pipelined %lld syncs (+%lld on the worker), "
              "%lld transfers; %lld host-state chunks\n",
              static_cast<long long>(plain.syncs), static_cast<long long>(plain.transfers),
              static_cast<long long>(piped.syncs), static_cast<long long>(piped.background_syncs),
              static_cast<long long>(piped.transfers), static_cast<long long>(piped.host_chunks));
}

// The host Adam of a chunk whose gradients are final starts while backward goes on: the gate after the
// embedding blocks backward until a pipelined job has started (the later blocks' chunks are final by
// then). Without the pipeline it would wait its 30 s and record that it saw none.
TEST(HybridAdam, PipelinedHostAdamStartsBeforeBackwardEnds) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 0;
  torch::manual_seed(47);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 0), Precision::kBf16));
  HybridAdam adam(model, options);
  for (int step = 0; step < 3; ++step) {
    const Batch x = batch(step);
    net->gate = step == 2;
    g_gate_adam = step == 2 ? &adam : nullptr;
    g_gate_saw_job = -1;
    const StepResult r = adam.backward_step(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
    EXPECT_TRUE(r.applied);
    if (step == 2) {
      EXPECT_EQ(g_gate_saw_job.load(), 1) << "no host Adam job started during backward";
      EXPECT_GT(r.overlapped_chunks, 1);
    }
  }
  g_gate_adam = nullptr;
  net->gate = false;
}

// A gradient that arrives for a chunk whose pipelined update (or norm) has started: a parameter no
// earlier step trained ('extra', used at the start of forward, so its gradient lands at the end of
// backward, after its chunk-mates'), as a task head or an expert used for the first time, or a layer
// that stochastic depth skipped in the first steps. It was refused and the step lost; now it is taken
// (Note [A gradient after its chunk's update]): the eager step updates it after backward (late_params),
// the two-phase one takes its chunk's norm again; either way bit-identical to backward() + step(), and
// once seen it is expected, so it trains pipelined after. Default mode and accumulate_grads (where only
// the last micro-batch can be late: the first one's landings are expected in the last), state on the
// host or all on the device, with and without clipping.
TEST(HybridAdam, PipelinedStepTakesAGradientItsChunkDidNotExpect) {
  for (const bool accumulate : {false, true}) {
    for (const int64_t device_chunks : {int64_t{0}, int64_t{-1}}) {
      for (const double clip : {0.0, 0.05}) {
        const std::string what = std::string(accumulate ? "accumulate_grads" : "default mode") +
                                 (device_chunks == 0 ? ", host state" : ", device state") +
                                 (clip > 0 ? ", two-phase (clipping)" : ", eager");
        HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
        options.device_state_chunks = device_chunks;
        options.accumulate_grads = accumulate;
        options.max_grad_norm = clip;
        bool use_extra = false;
        TinyLm a_net = tiny_lm_with_extra(53, use_extra), b_net = tiny_lm_with_extra(53, use_extra);
        ChunkedModel a(a_net.ptr(), sim_config(0, Precision::kBf16)), b(b_net.ptr(), sim_config(0, Precision::kBf16));
        HybridAdam a_adam(a, options), b_adam(b, options);
        const int micro = accumulate ? 2 : 1;
        for (int step = 0; step < 8; ++step) {
          const std::string when = what + ", step " + std::to_string(step);
          StepResult ra, rb;
          for (int k = 0; k < micro; ++k) {
            // From step 3 on, but not at step 6; at step 3 only in the last micro-batch.
            use_extra = step >= 3 && step != 6 && (step > 3 || k + 1 == micro);
            const Batch x = batch(10 * step + k);
            a.backward(a.forward([&] { return lm_loss(a_net, x.idx, x.target) / micro; }));
            const torch::Tensor loss = b.forward([&] { return lm_loss(b_net, x.idx, x.target) / micro; });
            if (k + 1 < micro) {
              b.backward(loss);
            } else {
              ASSERT_NO_THROW(rb = b_adam.backward_step(loss)) << when;
            }
          }
          ra = a_adam.step();
          a_adam.zero_grad();
          b_adam.zero_grad();
          ASSERT_TRUE(ra.applied && rb.applied) << when;
          if (clip > 0) {
            EXPECT_EQ(ra.grad_norm, rb.grad_norm) << when;
            EXPECT_LT(ra.clip_coef, 1.0) << when << ": the clipping path";
          }
          ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, when));
          for (int64_t p = 0; p < a.num_params(); ++p) {
            ASSERT_EQ(a_adam.param_step_count(p), b_adam.param_step_count(p)) << when << ": " << a.param_name(p);
          }
          // The eager accumulating step updates device-state chunks after backward (nothing launched).
          const bool launches = !(accumulate && device_chunks != 0 && clip == 0);
          EXPECT_EQ(rb.late_params, step == 3 && clip == 0 && launches ? 1 : 0) << when;
          if (step >= 1 && launches) {
            EXPECT_GT(rb.overlapped_chunks, 0) << when;
          }
        }
        const int64_t e = test::param_index(b, "extra");
        ASSERT_GE(e, 0);
        EXPECT_EQ(b_adam.param_step_count(e), 4) << what << ": trained at steps 3, 4, 5 and 7";
      }
    }
  }
}

// A second gradient contribution to a parameter whose chunk's update has run with the first cannot be
// taken (that update used part of the gradient), so it is refused, once, naming it; the next backwards
// expect it. Two contributions land when a custom Function's backward runs a backward of its own
// through the parameter (a reentrant backward): W lands there, which made its one-parameter chunk
// final and updated it, and then again from its use in forward.
torch::Tensor g_nested_weight;
struct NestedBackwardThroughWeight : torch::autograd::Function<NestedBackwardThroughWeight> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& h) { return h.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    torch::AutoGradMode on(true);
    torch::autograd::backward({(g_nested_weight * 0.5).sum()});
    return {g[0]};
  }
};
struct WeightThenHeadImpl : torch::nn::Module {
  WeightThenHeadImpl() {
    w = register_parameter("w", torch::randn({kDim, kDim}) * 0.1);
    head = register_module("head", torch::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::matmul(x, w.t());
    if (nested) {
      g_nested_weight = w;
      h = NestedBackwardThroughWeight::apply(h);
    }
    return head->forward(h).pow(2).mean();
  }
  torch::Tensor w;
  torch::nn::Linear head{nullptr};
  bool nested = false;
};
TORCH_MODULE(WeightThenHead);

TEST(HybridAdam, PipelinedStepRefusesASecondContributionAfterTheUpdate) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 0;
  torch::manual_seed(61);
  WeightThenHead net;
  Config config = sim_config(0);
  config.chunk_size_bytes = kDim * kDim * 4 + 256;  // w alone in its chunk
  ChunkedModel model(net.ptr(), config);
  HybridAdam adam(model, options);
  auto step = [&](int i) {
    torch::manual_seed(100 + i);
    const torch::Tensor x = torch::randn({4, kDim});
    return adam.backward_step(model.forward([&] { return net->forward(x); }));
  };
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(step(i).applied) << "step " << i;
  net->nested = true;
  const std::string error = test::error_of([&] { step(3); });
  EXPECT_NE(error.find("parameter w got gradient contribution 2 after its chunk's update had started"),
            std::string::npos) << error;
  EXPECT_NE(error.find("The next backwards expect it"), std::string::npos) << error;
  EXPECT_EQ(model.phase(), ModelPhase::kIdle);
  adam.zero_grad();
  EXPECT_FALSE(model.any_grad_in_slot());
  const StepResult r = step(4);
  EXPECT_TRUE(r.applied) << "expected now: no refusal";
  EXPECT_GT(r.overlapped_chunks, 0);
  net->nested = false;
  EXPECT_TRUE(step(5).applied) << "one contribution fewer leaves the chunk to backward's end";
  g_nested_weight = torch::Tensor();
}

// Asking for more device-resident state than the one device budget can hold next to a parameter chunk
// fails at placement with the numbers, and changes nothing: no state moved, no step taken.
TEST(HybridAdam, PlacingMoreStateThanTheBudgetFailsClearly) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 1000;  // all of them
  torch::manual_seed(59);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 1)));
  HybridAdam adam(model, options);
  const Batch x = batch(0);
  model.backward(model.forward([&] { return lm_loss(net, x.idx, x.target); }));
  try {
    adam.step();
    ADD_FAILURE() << "placing every state group within a budget for one must fail";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("would leave"), std::string::npos) << what;
    EXPECT_NE(what.find("less than the largest chunk"), std::string::npos) << what;
  }
  EXPECT_FALSE(adam.placed());
  EXPECT_EQ(adam.state_store().stats().device.current_bytes, 0);
  EXPECT_EQ(model.scheduler().other_device_bytes(), 0);
  EXPECT_EQ(adam.step_count(0), 0);
  adam.zero_grad();
}

TEST(HybridAdam, RepackAndMigrationDoNotHoldTwoCopies) {
  // The warm-up repack moves parameters and optimizer state into new chunks; each old chunk goes as
  // soon as it is emptied, so old + new together stay far below two full copies.
  torch::manual_seed(23);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(0));
  HybridAdam adam(model, HybridAdamOptions{});
  const int64_t param_bytes = model.store().stats().host.current_bytes;
  const int64_t state_bytes = adam.state_store().stats().host.current_bytes;
  // The masters; exp_avg and exp_avg_sq start at zero and get memory at the first step (D46).
  ASSERT_EQ(state_bytes, param_bytes) << "masters only: no moments before the first step, no gradient chunks";
  const Batch b = batch(0);
  model.backward(model.forward([&] { return lm_loss(net, b.idx, b.target); }));  // warm-up, then repack
  EXPECT_GT(model.last_repack_peak_bytes(), 0) << "the warm-up must repack";
  EXPECT_LE(model.last_repack_peak_bytes(), param_bytes + 2 * kChunk);
  adam.step();  // migrates the state to the new layout first (the masters: the moments were never touched)
  EXPECT_GT(adam.last_migration_peak_bytes(), 0);
  EXPECT_LE(adam.last_migration_peak_bytes(), state_bytes + 2 * kChunk);
  const ChunkStoreStats st = adam.state_store().stats();
  EXPECT_EQ(st.host.current_bytes + st.device.current_bytes, 3 * param_bytes) << "master, exp_avg, exp_avg_sq";
}

TEST(HybridAdam, BadInputFailsAndChangesNothing) {
  torch::manual_seed(13);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(0));
  AdamOptions bad_lr = adamw();
  bad_lr.lr = -1;
  HybridAdamOptions o1;
  o1.defaults = bad_lr;
  EXPECT_THROW(HybridAdam(model, o1), c10::Error);
  AdamOptions bad_beta = adamw();
  bad_beta.beta2 = 1.0;
  HybridAdamOptions o2;
  o2.defaults = bad_beta;
  EXPECT_THROW(HybridAdam(model, o2), c10::Error);

  HybridAdamOptions good;
  good.defaults = adamw();
  HybridAdam adam(model, good);
  const at::Tensor before = adam.master(0);
  try {
    adam.step();
    ADD_FAILURE() << "step() before any backward must fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no gradients"), std::string::npos) << e.what();
  }
  EXPECT_EQ(adam.step_count(0), 0);
  EXPECT_THROW(adam.set_lr(0, -0.5), c10::Error);
  EXPECT_THROW(adam.set_lr(std::nan("")), c10::Error);
  EXPECT_EQ(adam.lr(0), 1e-2);

  // A checkpoint of another model shape.
  const std::string dir = temp_dir("othershape");
  {
    torch::manual_seed(1);
    TinyLm other_net(kVocab, 2 * kDim);
    ChunkedModel other(other_net.ptr(), sim_config(0));
    HybridAdam other_adam(other, good);
    other_adam.save(dir);
  }
  try {
    adam.load(dir);
    ADD_FAILURE() << "loading another model's checkpoint must fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("this model has"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(adam.master(0), before));
  // A truncated state file.
  adam.save(dir);
  for (const auto& f : files_in(dir)) {
    if (f.find("/exp_avg.") != std::string::npos) {
      ASSERT_EQ(::truncate(f.c_str(), 12), 0);
    }
  }
  EXPECT_THROW(adam.load(dir), c10::Error);
  EXPECT_THROW(adam.load(dir + "/missing"), c10::Error);
  EXPECT_TRUE(torch::equal(adam.master(0), before));
  remove_checkpoint(dir);
}

}  // namespace
}  // namespace ferry
