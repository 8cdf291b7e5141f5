// HybridAdam against torch::optim::AdamW, at the level of its API: on a ChunkedModel on the simulated
// device with budgets that force evictions every iteration and the optimizer state split between device
// and host, 20 steps equal the unwrapped model trained by torch's AdamW (the first step) and the fp64
// Adam step (every step); a parameter first updated late takes torch's first step; the defaults are
// torch's AdamW; bf16 masters start from the fp32 originals; parameters without gradients are not
// updated; clipping equals clip_grad_norm_; fp16 overflow skips the step and backs the scale off; one
// optimizer per model, and one that outlives its model refuses every call; bad input fails with a clear
// error and changes nothing. The objects behind it have their own files (optim/engine.h lists them).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../../common/exact_sum.h"
#include "../../common/safetensors_file.h"
#include "../../cpu_adam/cpu_adam.h"
#include "../cpu_adam/adam_reference.h"
#include "hybrid_adam_fixtures.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures

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

// The step's gradient norm as D87 defines it, from the gradients alone: one term per parameter, each
// summed in D85's order (CpuAdam::grad_norm_sq), totalled exactly, its square root.
double norm_of_terms(const std::vector<torch::Tensor>& grads) {
  const CpuAdam one_order;
  ExactSum total;
  for (const torch::Tensor& g : grads) total.add(one_order.grad_norm_sq(g.contiguous()).sum_sq);
  return std::sqrt(total.value());
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
  auto [ref, net] = twins(3);
  auto ref_opt = reference_adamw(ref);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam adam(model, split_state(/*accumulate=*/false));
  ASSERT_EQ(adam.num_param_groups(), 2);
  int64_t evictions = 0;
  for (int step = 0; step < 20; ++step) {
    const Batch b = batch(step);
    auto loss = forward_loss(model, net, b);
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
  auto [ref, net] = twins(3);
  auto set_trainable = [](torch::nn::Module& m, bool on) {
    for (auto& p : m.parameters()) p.set_requires_grad(on);
  };
  set_trainable(*ref->fc[0], false);
  set_trainable(*net->fc[0], false);
  auto ref_opt = reference_adamw(ref);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam adam(model, split_state(/*accumulate=*/false));
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
    model.backward(forward_loss(model, net, b));
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
  // export_safetensors() writes the same fp32 masters, by name, for Python (read back here).
  const std::string dir = temp_dir("export");
  const std::string file = dir.substr(0, dir.rfind('/')) + "/model.safetensors";
  adam.export_safetensors(file);
  {
    const auto exported = SafetensorsFile::open(file);
    EXPECT_EQ(exported->entries().size(), sd.size());
    for (const auto& [name, value] : sd) {
      ASSERT_NE(exported->find(name), nullptr) << name;
      const at::Tensor t = exported->tensor(name);
      EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
      EXPECT_TRUE(torch::equal(t, value)) << name;
    }
  }
  ::unlink(file.c_str());
  remove_checkpoint(dir);

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
  model.backward(forward_loss(model, net, b));
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
      model.backward(forward_loss(model, net, x));
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
  auto [ref, net] = twins(7);
  auto ref_opt = reference_adamw(ref);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 1)));
  HybridAdam adam(model, HybridAdamOptions::no_decay_for_bias_and_norm(adamw())
                             .with_max_grad_norm(0.05)
                             .with_device_state_chunks(1));
  for (int step = 0; step < 5; ++step) {
    const Batch b = batch(step);
    model.backward(forward_loss(model, net, b));
    const PreStep pre = snapshot(adam, model);
    const StepResult r = adam.step();
    ASSERT_TRUE(r.applied);
    EXPECT_LT(r.clip_coef, 1.0) << "the threshold must actually clip";
    EXPECT_EQ(r.clip_coef, std::min(1.0, 0.05 / (r.grad_norm + 1e-6))) << "clip_grad_norm_'s coefficient";
    const double want = norm_of_terms(pre.grad);
    EXPECT_EQ(std::memcmp(&r.grad_norm, &want, sizeof(double)), 0)
        << "step " << step << ": " << r.grad_norm << " vs the exact total of the parameters' terms " << want;
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

// A clipped run: every step's reported norm and the masters after the last.
struct ClippedRun {
  std::vector<double> norms;
  std::vector<at::Tensor> masters;
  int64_t chunks = 0;
};

// `steps` steps of `net` wrapped with `config`, clipping at 0.05 (which must clip); `before_step(k)`
// runs before step k's forward.
ClippedRun train_clipped(TinyLm net, const Config& config, HybridAdamOptions options, int steps,
                         const std::function<void(int)>& before_step = {}) {
  ChunkedModel model(net.ptr(), config);
  HybridAdam adam(model, options.with_max_grad_norm(0.05));
  ClippedRun r;
  r.chunks = model.layout().num_chunks();
  for (int step = 0; step < steps; ++step) {
    if (before_step) before_step(step);
    model.backward(forward_loss(model, net, batch(step)));
    const StepResult s = adam.step();
    EXPECT_TRUE(s.applied);
    EXPECT_LT(s.clip_coef, 1.0) << "the threshold must actually clip";
    r.norms.push_back(s.grad_norm);
    adam.zero_grad();
  }
  for (int64_t i = 0; i < model.num_params(); ++i) r.masters.push_back(adam.master(i));
  return r;
}

void expect_same_bits(const ClippedRun& a, const ClippedRun& b, const std::string& where) {
  for (size_t k = 0; k < a.norms.size(); ++k) {
    EXPECT_EQ(std::memcmp(&a.norms[k], &b.norms[k], sizeof(double)), 0)
        << where << ", step " << k + 1 << ": " << a.norms[k] << " vs " << b.norms[k];
  }
  ASSERT_EQ(a.masters.size(), b.masters.size());
  for (size_t i = 0; i < a.masters.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.masters[i], b.masters[i])) << where << ", parameter " << i;
  }
}

TEST(HybridAdam, ClippingGivesTheSameBitsWhateverTheCpuThreadsAndKernel) {
  // The host's gradient norm is summed per fixed grain of 32K elements (cpu_adam/thread_split.h), each
  // in one order whatever the vector width (D85), so the clipping coefficient, and every update after
  // it, is the same to the bit on 1 thread or 3, split dynamically or statically, with the scalar, AVX2
  // or AVX-512 kernel: a run resumed on a machine with other cores goes on as it would have. Host state
  // only (the host's norm decides), and tensors of several grains (fc: 128 x 512).
  auto run = [&](int threads, CpuSplit split, CpuIsa isa) {
    torch::manual_seed(17);
    Config config = sim_config(0);
    config.chunk_size_bytes = 0;  // auto: the 256 KiB tensors need chunks of their own size
    config.cpu_threads = threads;
    config.cpu_split = split;
    config.cpu_isa = to_string(isa);
    return train_clipped(TinyLm(kVocab, 128), config,
                         HybridAdamOptions::no_decay_for_bias_and_norm(adamw()).with_device_state_chunks(0), 3);
  };
  struct Other {
    int threads;
    CpuSplit split;
    CpuIsa isa;
  };
  std::vector<Other> others = {{3, CpuSplit::kDynamic, CpuIsa::kScalar}, {3, CpuSplit::kStatic, CpuIsa::kScalar}};
  for (const CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (cpu_supports(isa)) others.push_back({2, CpuSplit::kDynamic, isa});
  }
  const ClippedRun one = run(1, CpuSplit::kStatic, CpuIsa::kScalar);
  for (const auto& [threads, split, isa] : others) {
    const std::string where = std::to_string(threads) + " threads, " + to_string(split) + ", " + to_string(isa);
    expect_same_bits(one, run(threads, split, isa), where);
  }
}

TEST(HybridAdam, ClippingGivesTheSameBitsWhateverTheChunkSize) {
  // A norm's terms are the parameters' gradients, each summed from its own first element, and their
  // total is exact (D87), so how the parameters are cut into chunks, which neighbours a span merges,
  // whether a neighbour landed, and how many chunks the device holds, change no bit of a clipped run.
  // One param group (spans merge every landed neighbour), fp32 and bf16, fc1 frozen in one step (its
  // neighbours' spans then split around it); chunks from a tensor's size to the whole model's.
  auto run = [](Precision precision, int64_t chunk_bytes, int64_t budget) {
    torch::manual_seed(23);
    TinyLm net(kVocab, kDim);
    Config config = sim_config(budget, precision);
    config.chunk_size_bytes = chunk_bytes;
    config.validate();
    return train_clipped(net, config, HybridAdamOptions(adamw()), 4,
                         [&](int step) { net->fc[1]->weight.requires_grad_(step != 2); });
  };
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    const ClippedRun small = run(precision, kChunk, 0);
    for (const auto& [chunk_bytes, budget] : std::vector<std::pair<int64_t, int64_t>>{
             {2 * kChunk, 0}, {8 * kChunk, 0}, {64 * kChunk, 0}, {4 * kChunk, budget_for(2, 1) * 4}}) {
      const ClippedRun other = run(precision, chunk_bytes, budget);
      const std::string where = std::string(to_string(precision)) + ", chunks of " + std::to_string(chunk_bytes) +
                                " B, budget " + std::to_string(budget);
      ASSERT_NE(small.chunks, other.chunks) << where;
      expect_same_bits(small, other, where);
    }
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
    model.backward(forward_loss(model, net, b));
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
  model2.backward(forward_loss(model2, net2, b));
  const StepResult ok = adam2.step();
  EXPECT_TRUE(ok.applied);
  EXPECT_EQ(ok.loss_scale, 1024);
  EXPECT_GT(ok.grad_norm, 0.01);
  EXPECT_LT(ok.grad_norm, 100.0) << "the loss scale must be divided out";
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
    const torch::Tensor loss = forward_loss(model, net, x);
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
    twin_adam.backward_step(forward_loss(twin_model, twin, x));
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
  const std::string no_backward = test::error_of([&] { adam.step(); });  // before any backward
  EXPECT_NE(no_backward.find("no gradients"), std::string::npos) << no_backward;
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
  const std::string other_shape = test::error_of([&] { adam.load(dir); });
  EXPECT_NE(other_shape.find("this model has"), std::string::npos) << other_shape;
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
