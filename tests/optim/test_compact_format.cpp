// HybridAdam with the compact state format (HybridAdamOptions::state_format, Note [The compact state
// format] in cpu_adam/compact_state.h) on the simulated device, budgets forcing evictions and the state
// split between device and host:
//  - every step equals the fp64 Adam step from the step's own (decoded) state within the format's
//    written error bound: the master within one bf16 ulp (stochastic rounding), exp_avg within 2^-4 of
//    itself plus 2^-17 of its tensor's largest, sqrt(exp_avg_sq) within 2^-5 plus 2^-17;
//  - the state takes the bytes the format says, by role, and the device accountant counts them;
//  - a checkpoint of compact state loads back to the same bits; into fp32 state as the decoded values;
//    fp32 state into compact as the format encodes it;
//  - fp16 with loss scaling (an overflow skips the step and backs the scale off) and a layer frozen for
//    some steps (its state untouched, its step count lagging) within the same bound;
//  - an fp16 compute copy is its bf16 master's value from the start and after a write, so that a layer
//    frozen from the start resumes from a checkpoint bit for bit;
//  - an fp32 compute copy is refused, naming the precision.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../../cpu_adam/compact_state.h"
#include "../cpu_adam/adam_reference.h"
#include "hybrid_adam_fixtures.h"
#include "same_state.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures

// Budget: `param_chunks` bf16 parameter chunks plus `state_groups` compact state groups (4 B per element
// of a chunk of kChunk / 2 elements, and the scales).
int64_t compact_budget(int64_t param_chunks, int64_t state_groups) {
  return param_chunks * kChunk + state_groups * (2 * kChunk + 4096);
}

HybridAdamOptions compact_split_state(bool accumulate = false) {
  HybridAdamOptions o = split_state(accumulate).with_state_format(StateFormat::kCompact);
  o.loss_scaler.initial_scale = 1024;  // fp16: a scale the tiny model's gradients do not overflow at
  o.loss_scaler.hysteresis = 1;        // back off at the first overflow
  return o;
}

struct PreStep {
  std::vector<torch::Tensor> master, exp_avg, exp_avg_sq, grad;
};

PreStep snapshot(HybridAdam& adam, ChunkedModel& model) {
  PreStep s;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    s.master.push_back(adam.master(p));
    s.exp_avg.push_back(adam.exp_avg(p));
    s.exp_avg_sq.push_back(adam.exp_avg_sq(p));
    s.grad.push_back(adam.grad(p));
  }
  return s;
}

// Every step against the fp64 step from its own decoded state (the bound in the file comment). With
// `freeze_fc0`, fc0 is frozen for steps 3..5 (its state untouched, its step count lagging, D62); in
// fp16 the gradients carry the loss scale (the reference divides it out: r.loss_scale) and the compute
// copy is the master's value in fp16.
void expect_steps_within_the_bound(Precision precision, bool freeze_fc0) {
  auto [ref, net] = twins(3);
  ChunkedModel model(net.ptr(), sim_config(compact_budget(2, 2), precision));
  HybridAdam adam(model, compact_split_state());
  ASSERT_EQ(adam.state_format(), StateFormat::kCompact);
  ASSERT_EQ(adam.num_state_roles(), 4);
  int64_t evictions = 0, device_chunks = 0, host_chunks = 0;
  for (int step = 0; step < 12; ++step) {
    const std::string when = "step " + std::to_string(step);
    const bool frozen = freeze_fc0 && step >= 3 && step < 6;
    for (auto& p : net->fc[0]->parameters()) p.set_requires_grad(!frozen);
    model.backward(forward_loss(model, net, batch(step)));
    const PreStep pre = snapshot(adam, model);
    const StepResult r = adam.step();
    ASSERT_TRUE(r.applied) << when;
    device_chunks += r.device_chunks;
    host_chunks += r.host_chunks;
    evictions += model.last_iteration().evictions;
    for (int64_t p = 0; p < model.num_params(); ++p) {
      const std::string what = when + ": " + model.param_name(p);
      // The compute copy is the master's value (bf16: its bits; fp16: rounded).
      EXPECT_TRUE(torch::equal(model.param_values(p).to(torch::kFloat),
                               adam.master(p).to(model.compute_dtype()).to(torch::kFloat)))
          << what;
      if (frozen && model.param_name(p).rfind("fc0.", 0) == 0) {  // no gradient: nothing changes
        EXPECT_TRUE(torch::equal(adam.master(p), pre.master[p])) << what;
        EXPECT_TRUE(torch::equal(adam.exp_avg_sq(p), pre.exp_avg_sq[p])) << what;
        continue;
      }
      const AdamStepFp64 ref64 = adam_step_fp64(pre.master[p], pre.grad[p], pre.exp_avg[p], pre.exp_avg_sq[p],
                                                adam.group_options(adam.group_of(p)), adam.param_step_count(p),
                                                r.clip_coef / r.loss_scale);
      // The master: stochastic rounding to bf16 is within one ulp of bf16 (<= 2^-7 |p|), of a value
      // within the fp32 bound of the exact step.
      const auto master = adam.master(p).to(torch::kDouble);
      const auto master_tol = std::ldexp(1.0, -7) * ref64.param.abs() + 2 * ref64.param_tol + 1e-30;
      EXPECT_LE(excess(master, ref64.param, master_tol), 1.0) << what << ": master";
      // exp_avg: a 3-bit mantissa against its block's max (<= the tensor's max) rounds to nearest.
      const auto m = adam.exp_avg(p).to(torch::kDouble);
      const double m_max = ref64.exp_avg.abs().max().item<double>();
      const auto m_tol = std::ldexp(1.0, -4) * ref64.exp_avg.abs() + std::ldexp(1.0, -17) * m_max +
                         2 * ref64.exp_avg_tol + 1e-30;
      EXPECT_LE(excess(m, ref64.exp_avg, m_tol), 1.0) << what << ": exp_avg";
      // sqrt(exp_avg_sq): a 4-bit mantissa, likewise.
      const auto u = adam.exp_avg_sq(p).to(torch::kDouble).sqrt();
      const auto u64 = ref64.exp_avg_sq.sqrt();
      const double u_max = u64.max().item<double>();
      const auto u_tol = (std::ldexp(1.0, -5) + 1e-5) * u64 + std::ldexp(1.0, -17) * u_max + 1e-30;
      EXPECT_LE(excess(u, u64, u_tol), 1.0) << what << ": sqrt(exp_avg_sq)";
      // A positive second moment never decodes as zero (no update divided by eps alone).
      EXPECT_EQ((ref64.exp_avg_sq.gt(0) & adam.exp_avg_sq(p).eq(0)).sum().item<int64_t>(), 0) << what;
    }
    adam.zero_grad();
  }
  EXPECT_GT(device_chunks, 0) << "some state must be updated on the device";
  EXPECT_GT(host_chunks, 0) << "some state must be updated on the host";
  EXPECT_GT(evictions, 10) << "the budget must force evictions (" << model.layout().num_chunks() << " chunks)";
  if (freeze_fc0) {
    for (int64_t p = 0; p < model.num_params(); ++p) {
      const bool fc0 = model.param_name(p).rfind("fc0.", 0) == 0;
      EXPECT_EQ(adam.param_step_count(p), fc0 ? 9 : 12) << model.param_name(p);
    }
  }
}

TEST(CompactFormat, EveryStepIsTheFp64StepWithinTheFormatsBound) {
  expect_steps_within_the_bound(Precision::kBf16, /*freeze_fc0=*/false);
}

TEST(CompactFormat, Fp16WithLossScalingStaysWithinTheBound) {
  expect_steps_within_the_bound(Precision::kFp16, /*freeze_fc0=*/false);
}

TEST(CompactFormat, ALayerFrozenForSomeStepsKeepsItsStateAndLagsItsCount) {
  expect_steps_within_the_bound(Precision::kBf16, /*freeze_fc0=*/true);
}

// fp16 loss scaling with compact state: an overflow skips the step (state and compute copies as they
// were) and backs the scale off, wherever the state lives.
TEST(CompactFormat, AnFp16OverflowSkipsTheStepAndBacksOff) {
  auto [ref, net] = twins(9);
  ChunkedModel model(net.ptr(), sim_config(compact_budget(2, 2), Precision::kFp16));
  HybridAdam adam(model, compact_split_state());
  train_steps(model, net, adam, 0, 3);
  const double scale = adam.loss_scale();
  model.backward(model.forward([&net = net] {
    const Batch b = batch(3);
    return lm_loss(net, b.idx, b.target) * std::numeric_limits<float>::infinity();
  }));
  const PreStep pre = snapshot(adam, model);
  const StepResult r = adam.step();
  EXPECT_FALSE(r.applied);
  EXPECT_TRUE(r.overflow);
  EXPECT_EQ(adam.loss_scale(), scale / 2) << "backed off";
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), pre.master[p])) << model.param_name(p);
    EXPECT_TRUE(torch::equal(adam.exp_avg(p), pre.exp_avg[p])) << model.param_name(p);
    EXPECT_TRUE(torch::equal(model.param_values(p).to(torch::kFloat),
                             adam.master(p).to(torch::kHalf).to(torch::kFloat)))
        << model.param_name(p);
  }
  adam.zero_grad();
  train_steps(model, net, adam, 4, 2);
}

TEST(CompactFormat, TheStateTakesTheFormatsBytesByRole) {
  auto [ref, net] = twins(4);
  ChunkedModel model(net.ptr(), sim_config(compact_budget(2, 2), Precision::kBf16));
  HybridAdam adam(model, compact_split_state());
  train_steps(model, net, adam, 0, 3);
  const ChunkLayout& layout = model.layout();
  for (int64_t c = 0; c < layout.num_chunks(); ++c) {
    // master 2 B, each moment 1 B per element of the chunk; scales 2 x 4 B per block of each tensor,
    // each tensor's slot 64-byte aligned.
    int64_t scales = 0;
    for (int64_t p : layout.chunks()[c].tensors) {
      scales += (2 * 4 * compact_blocks(layout.slots()[p].numel) + 63) / 64 * 64;
    }
    const int64_t elems = layout.chunks()[c].numel;
    EXPECT_EQ(adam.state_bytes_per_chunk(c), 4 * elems + std::max<int64_t>(scales, 64)) << "chunk " << c;
  }
  // Two groups on the device: the accountant counts their real bytes, the scales under their own role.
  const auto by_role = model.device_accountant()->bytes_by_role();
  EXPECT_EQ(by_role[static_cast<int>(ChunkRole::kMaster)], 2 * (layout.chunks()[0].numel + layout.chunks()[1].numel));
  EXPECT_GT(by_role[static_cast<int>(ChunkRole::kScales)], 0);
}

// D86: the stochastic rounding's bits follow an element by its place in the model, so the chunk size
// (the packing), and with it where each tensor sits in which chunk, changes no bit of compact training;
// nor does where the state lives (half the groups on the device in one run, all on the host in the
// other). Clipped too, for these two packings (their spans give the norm the same partial sums; in
// general the partial sums follow the packing, D85). (With the stream indexed by the chunk as before
// D86 it fails.)
TEST(CompactFormat, TheChunkSizeChangesNoBit) {
  for (const double clip : {0.0, 0.05}) {
    SCOPED_TRACE(clip > 0 ? "clipped" : "not clipped");
    auto [a_net, b_net] = twins(6);
    Config small = sim_config(compact_budget(2, 2), Precision::kBf16);
    Config large = sim_config(0, Precision::kBf16);
    large.chunk_size_bytes = 4 * kChunk;
    ChunkedModel a(a_net.ptr(), small), b(b_net.ptr(), large);
    ASSERT_NE(a.layout().num_chunks(), b.layout().num_chunks());
    HybridAdam a_adam(a, compact_split_state().with_max_grad_norm(clip));
    HybridAdam b_adam(b, compact_split_state().with_max_grad_norm(clip).with_device_state_chunks(0));
    for (int step = 0; step < 4; ++step) {
      const Batch x = batch(step);
      a.backward(forward_loss(a, a_net, x));
      b.backward(forward_loss(b, b_net, x));
      const StepResult ra = a_adam.step(), rb = b_adam.step();
      ASSERT_TRUE(ra.applied && rb.applied);
      EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << step;
      if (clip > 0) {
        EXPECT_LT(ra.clip_coef, 1.0) << "the case needs clipping";
      }
      a_adam.zero_grad();
      b_adam.zero_grad();
      ASSERT_NO_FATAL_FAILURE(expect_same_state(a_adam, b_adam, a, b, "step " + std::to_string(step)));
    }
  }
}

// fp32 values as the compact format stores them: encoded and decoded again (compact_state.h).
torch::Tensor as_compact(const torch::Tensor& master, const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq,
                         int role) {
  const int64_t n = master.numel();
  auto m16 = torch::empty({n}, torch::kBFloat16);
  auto mq = torch::empty({n}, torch::kByte), uq = torch::empty({n}, torch::kByte);
  auto scales = torch::empty({2 * compact_blocks(n)}, torch::kFloat);
  CompactAdamSpan s;
  s.master = reinterpret_cast<uint16_t*>(m16.data_ptr());
  s.exp_avg = mq.data_ptr<uint8_t>();
  s.exp_avg_sq = uq.data_ptr<uint8_t>();
  s.exp_avg_scale = scales.data_ptr<float>();
  s.exp_avg_sq_scale = s.exp_avg_scale + compact_blocks(n);
  s.numel = n;
  const auto m = master.contiguous(), a = exp_avg.contiguous(), v = exp_avg_sq.contiguous();
  compact_from_fp32(s, m.data_ptr<float>(), a.data_ptr<float>(), v.data_ptr<float>());
  auto out = torch::empty({n}, torch::kFloat);
  compact_to_fp32(s, role == 0 ? out.data_ptr<float>() : nullptr, role == 1 ? out.data_ptr<float>() : nullptr,
                  role == 2 ? out.data_ptr<float>() : nullptr);
  return out.view(master.sizes());
}

TEST(CompactFormat, CheckpointsHoldTheStateExactlyAndConvertBetweenFormats) {
  const std::string dir = temp_dir("compact_ckpt"), fp32_dir = temp_dir("compact_ckpt_fp32");
  auto [ref, net] = twins(5);
  ChunkedModel model(net.ptr(), sim_config(compact_budget(2, 2), Precision::kBf16));
  HybridAdam adam(model, compact_split_state());
  train_steps(model, net, adam, 0, 4);
  adam.save(dir);
  // Into compact state: the same bits (decoded values and compute copies equal), and it trains on
  // identically.
  auto [r2, net2] = twins(6);
  ChunkedModel m2(net2.ptr(), sim_config(compact_budget(2, 2), Precision::kBf16));
  HybridAdam a2(m2, compact_split_state());
  a2.load(dir);
  // Into fp32 state: the decoded values.
  auto [r3, net3] = twins(7);
  ChunkedModel m3(net3.ptr(), sim_config(budget_for(2, 4), Precision::kBf16));
  HybridAdam a3(m3, split_state(false));
  a3.load(dir);
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const std::string& name = model.param_name(p);
    ASSERT_TRUE(torch::equal(adam.master(p), a2.master(p))) << name;
    ASSERT_TRUE(torch::equal(adam.exp_avg(p), a2.exp_avg(p))) << name;
    ASSERT_TRUE(torch::equal(adam.exp_avg_sq(p), a2.exp_avg_sq(p))) << name;
    ASSERT_TRUE(torch::equal(model.param_values(p), m2.param_values(p))) << name;
    ASSERT_TRUE(torch::equal(adam.master(p), a3.master(p).cpu())) << "fp32: " << name;
    ASSERT_TRUE(torch::equal(adam.exp_avg(p), a3.exp_avg(p).cpu())) << "fp32: " << name;
    ASSERT_TRUE(torch::equal(adam.exp_avg_sq(p), a3.exp_avg_sq(p).cpu())) << "fp32: " << name;
  }
  train_steps(model, net, adam, 4, 2);
  train_steps(m2, net2, a2, 4, 2);
  for (int64_t p = 0; p < model.num_params(); ++p) {
    ASSERT_TRUE(torch::equal(adam.master(p), a2.master(p))) << "after resuming: " << model.param_name(p);
    ASSERT_TRUE(torch::equal(adam.exp_avg_sq(p), a2.exp_avg_sq(p))) << "after resuming: " << model.param_name(p);
  }
  // fp32 state (trained on, so its values are no longer the format's) into compact: encoded.
  train_steps(m3, net3, a3, 4, 2);
  a3.save(fp32_dir);
  auto [r4, net4] = twins(8);
  ChunkedModel m4(net4.ptr(), sim_config(compact_budget(2, 2), Precision::kBf16));
  HybridAdam a4(m4, compact_split_state());
  a4.load(fp32_dir);
  int64_t rounded = 0;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const std::string& name = model.param_name(p);
    const auto master = a3.master(p).cpu(), m = a3.exp_avg(p).cpu(), v = a3.exp_avg_sq(p).cpu();
    EXPECT_TRUE(torch::equal(a4.master(p), as_compact(master, m, v, 0))) << name;
    EXPECT_TRUE(torch::equal(a4.exp_avg(p), as_compact(master, m, v, 1))) << name;
    EXPECT_TRUE(torch::equal(a4.exp_avg_sq(p), as_compact(master, m, v, 2))) << name;
    rounded += a4.master(p).ne(master).sum().item<int64_t>();
  }
  EXPECT_GT(rounded, 0) << "the fp32 masters must have needed rounding (else the test shows nothing)";
  remove_checkpoint(dir);
  remove_checkpoint(fp32_dir);
}

// Note [The fp16 compute copy of compact state] (optim/engine.cpp): under an fp16 compute copy every
// parameter's slot is its bf16 master's value from the start and after a write, not only after its first
// update, so that a parameter no update touched (here fc0's bias, frozen from the start; every parameter
// before the first step) resumes from a checkpoint with the values the run that saved it computed with.
// Before, the slot kept the module's fp16 rounding, finer than the master, and load() wrote it from the
// master: the resumed run's forward differed (test_mechanism_combinations found it).
TEST(CompactFormat, AnFp16ComputeCopyIsItsMastersValueFromTheStartSoAFrozenLayerResumes) {
  const std::string dir = temp_dir("compact_fp16_frozen");
  auto [ref, net] = twins(9);
  net->fc[0]->bias.set_requires_grad(false);
  ChunkedModel model(net.ptr(), sim_config(compact_budget(2, 2), Precision::kFp16));
  HybridAdam adam(model, compact_split_state());
  const auto expect_slots_are_masters = [&](ChunkedModel& m, HybridAdam& a, const std::string& when) {
    for (int64_t p = 0; p < m.num_params(); ++p) {
      EXPECT_TRUE(torch::equal(m.param_values(p).cpu(), a.master(p).to(torch::kHalf).cpu()))
          << when << ": " << m.param_name(p);
    }
  };
  expect_slots_are_masters(model, adam, "built");
  // The module's own fp16 rounding of the initial values differs from the master's in some elements:
  // else this test shows nothing.
  int64_t finer = 0;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    if (model.param_name(p) != "fc0.bias") continue;
    finer = ref->fc[0]->bias.to(torch::kHalf).ne(model.param_values(p).cpu()).sum().item<int64_t>();
  }
  EXPECT_GT(finer, 0) << "fp16 of the initial values must differ from fp16 of their bf16 masters somewhere";
  {
    torch::NoGradGuard no_grad;
    net->fc[1]->bias.mul_(1.0009765625);  // an in-place write the master rounds to bf16
  }
  expect_slots_are_masters(model, adam, "after a write");
  for (int step = 0; step < 3; ++step) {
    model.backward(forward_loss(model, net, batch(step)));
    adam.step();
    adam.zero_grad();
  }
  adam.save(dir);
  auto [r2, net2] = twins(10);
  net2->fc[0]->bias.set_requires_grad(false);
  ChunkedModel m2(net2.ptr(), sim_config(compact_budget(2, 2), Precision::kFp16));
  HybridAdam a2(m2, compact_split_state());
  a2.load(dir);
  for (int64_t p = 0; p < model.num_params(); ++p) {
    ASSERT_TRUE(torch::equal(model.param_values(p).cpu(), m2.param_values(p).cpu())) << "loaded: " << model.param_name(p);
  }
  for (int step = 3; step < 6; ++step) {
    const auto x = batch(step);
    const torch::Tensor l1 = forward_loss(model, net, x), l2 = forward_loss(m2, net2, x);
    ASSERT_TRUE(torch::equal(l1.detach(), l2.detach())) << "step " << step << ": the resumed forward differs";
    model.backward(l1);
    m2.backward(l2);
    adam.step();
    a2.step();
    adam.zero_grad();
    a2.zero_grad();
  }
  ASSERT_NO_FATAL_FAILURE(expect_same_state(adam, a2, model, m2, "after resuming"));
  expect_slots_are_masters(m2, a2, "after resuming");
  remove_checkpoint(dir);
}

TEST(CompactFormat, AnFp32ComputeCopyIsRefused) {
  auto [ref, net] = twins(8);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2), Precision::kFp32));
  try {
    HybridAdam adam(model, compact_split_state());
    FAIL() << "expected a refusal";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a bf16 or fp16 compute copy"), std::string::npos) << e.what();
  }
  EXPECT_THROW(state_format_from_string("int8"), c10::Error);
  EXPECT_EQ(state_format_from_string("compact"), StateFormat::kCompact);
}

}  // namespace
}  // namespace ferry
