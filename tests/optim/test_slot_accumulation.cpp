// SlotAccumulation (optim/slot_accumulation.h, Note [Accumulation per chunk]) through HybridAdam with
// accumulate_grads: micro-batch gradients land in the parameter slots and are emptied into the fp32
// accumulation chunks chunk by chunk (host-state chunks on CpuAdam's worker, during backward); the sums
// equal the big batch and, bit for bit, the hand-made sums and the default mode's gradients; the
// accumulated backward_step equals backward() + step(); a failed micro-batch and a late gradient leave
// the next steps pipelined and exact.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "four_layers.h"
#include "hybrid_adam_fixtures.h"
#include "pipeline_vs_step.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures

// Tensor-wise relative error max|a - b| / max|b|. (Element-wise ratios are dominated by entries near
// zero, where a few ulps of op-order noise between two correct Adam implementations show up as 1e-5.)
double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const auto a64 = a.to(torch::kDouble), b64 = b.to(torch::kDouble);
  const double scale = std::max(b64.abs().max().item<double>(), 1e-30);
  return (a64 - b64).abs().max().item<double>() / scale;
}

TEST(SlotAccumulation, EqualsTheBigBatch) {
  HybridAdamOptions options;
  options.defaults = adamw();
  options.accumulate_grads = true;
  options.device_state_chunks = 1;
  LmTwins t(twins(5), sim_config(budget_for(3, 1, 4)), options);  // a: the big batch; b: four micro-batches
  for (int step = 0; step < 3; ++step) {
    const Batch x = batch(step, /*b=*/8);
    t.a.backward(forward_loss(t.a, t.a_net, x));
    const int n = 4;
    for (int k = 0; k < n; ++k) {
      auto idx = x.idx.narrow(0, 2 * k, 2), target = x.target.narrow(0, 2 * k, 2);
      t.b.backward(t.b.forward([&] { return lm_loss(t.b_net, idx, target) / n; }));
    }
    for (int64_t p = 0; p < t.a.num_params(); ++p) {
      EXPECT_LE(rel_err(t.b_adam.grad(p), t.a_adam.grad(p)), 1e-5) << "step " << step << " grad of " << t.a.param_name(p);
    }
    t.a_adam.step();
    t.b_adam.step();
    t.zero_grad();
  }
  for (int64_t p = 0; p < t.a.num_params(); ++p) {
    EXPECT_LE(rel_err(t.b_adam.master(p), t.a_adam.master(p)), 1e-5) << t.a.param_name(p);
  }
}

TEST(SlotAccumulation, EmptiesTheSlotsPerChunkAndSumsExactly) {
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
      a.backward(forward_loss(a, a_net, x));
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
      b.backward(forward_loss(b, b_net, x));
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
TEST(SlotAccumulation, GradsInParamChunksEqualAccumulationChunksBitForBit) {
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
    a.backward(forward_loss(a, a_net, x));
    b.backward(forward_loss(b, b_net, x));
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

TEST(SlotAccumulation, AccumulatedPipelinedStepEqualsBackwardThenStepBitForBit) {
  expect_pipeline_equals_step({Precision::kBf16, 0.0, 3});
}

TEST(SlotAccumulation, AccumulatedPipelinedStepWithClippingEqualsBackwardThenStep) {
  expect_pipeline_equals_step({Precision::kBf16, 0.05, 3});
}

TEST(SlotAccumulation, AccumulatedPipelinedStepWithFp16LossScalingEqualsBackwardThenStep) {
  expect_pipeline_equals_step({Precision::kFp16, 1.0, 3, 262144.0, /*min_overflows=*/1});
}

// A micro-batch's backward that fails part-way, after l3's gradients landed and before l2's (they share
// a chunk), discarded by zero_grad(), the step going on with its last micro-batch in backward_step. The
// failed backward's landings used to become what the next one expects, so there the chunk was final
// after l3's landing alone: its update started during backward and l2's gradient was refused. Now its
// counts only add to the expectations (Note [Expectations only grow]), and every step runs pipelined.
TEST(SlotAccumulation, AFailedMicroBatchBackwardLeavesTheNextBackwardStepPipelined) {
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

// The last micro-batch's backward fails inside backward_step (the eager step, accumulation), below l2:
// chunk {l2, l3} was final and its host update had started, chunk {l0, l1} had not. As documented
// (Engine::abandon_backward_step_locked): the started update stands, equal bit for bit to the
// reference's (a twin that stepped by backward() + step() without the failure), and the other chunk
// keeps its values and its parameters' step counts; zero_grad() discards what is left, and training
// goes on pipelined.
TEST(SlotAccumulation, ABackwardStepWhoseLastBackwardFailsKeepsOnlyTheStartedUpdates) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 0;
  options.accumulate_grads = true;
  options.carry_over_host_updates = false;  // the update starts during backward
  auto made = [](int fail_after) {
    torch::manual_seed(53);
    return FourLayers(fail_after);
  };
  FourLayers a_net = made(-1), b_net = made(/*fail_after=*/1);
  const Config config = sim_config(budget_for(1, 0, 4), Precision::kFp32);
  ChunkedModel a(a_net.ptr(), config), b(b_net.ptr(), config);
  HybridAdam a_adam(a, options), b_adam(b, options);
  const int64_t l0 = param_index(b, "l0.weight"), l1 = param_index(b, "l1.bias"), l2 = param_index(b, "l2.weight"),
                l3 = param_index(b, "l3.bias");
  auto loss_of = [](FourLayers& net, const torch::Tensor& x) { return net->forward(x).pow(2).mean() / 2; };
  for (int step = 0; step < 6; ++step) {
    const std::string when = "step " + std::to_string(step);
    torch::manual_seed(700 + step);
    const torch::Tensor x = torch::randn({8, 40});
    const bool fail = step == 3;
    const torch::Tensor l0_before = b_adam.master(l0).clone(), l1_before = b_adam.master(l1).clone();
    const int64_t l0_count = b_adam.param_step_count(l0), l3_count = b_adam.param_step_count(l3);
    a.backward(a.forward([&] { return loss_of(a_net, x.slice(0, 0, 4)); }));
    a.backward(a.forward([&] { return loss_of(a_net, x.slice(0, 4, 8)); }));
    ASSERT_TRUE(a_adam.step().applied) << when;
    a_adam.zero_grad();
    b.backward(b.forward([&] { return loss_of(b_net, x.slice(0, 0, 4)); }));
    StepResult r;
    g_fail_backward = fail;
    const std::string error =
        test::error_of([&] { r = b_adam.backward_step(b.forward([&] { return loss_of(b_net, x.slice(0, 4, 8)); })); });
    g_fail_backward = false;
    b_adam.zero_grad();
    if (!fail) {
      ASSERT_EQ(error, "(no error)") << when;
      ASSERT_TRUE(r.applied) << when;
      if (step > 1) {
        EXPECT_GT(r.overlapped_chunks, 0) << when;
      }
      if (step < 3) {  // equal until the failure
        ASSERT_NO_FATAL_FAILURE(expect_same_state(a_adam, b_adam, a, b, when));
      }
      continue;
    }
    EXPECT_NE(error.find("fails on purpose"), std::string::npos) << error;
    EXPECT_EQ(b.phase(), ModelPhase::kIdle);
    EXPECT_FALSE(b.any_grad_in_slot());
    ASSERT_NE(b.layout().slots()[l0].chunk, b.layout().slots()[l3].chunk) << "the test needs two chunks";
    EXPECT_EQ(b_adam.param_step_count(l3), l3_count + 1) << "l3's update had started: it stands";
    for (const int64_t p : {l2, l3}) {
      EXPECT_TRUE(torch::equal(b_adam.master(p), a_adam.master(p))) << b.param_name(p) << ": the reference's update";
      EXPECT_TRUE(torch::equal(b.param_values(p), a.param_values(p))) << b.param_name(p);
    }
    EXPECT_EQ(b_adam.param_step_count(l0), l0_count) << "l0's update had not started";
    EXPECT_TRUE(torch::equal(b_adam.master(l0), l0_before));
    EXPECT_TRUE(torch::equal(b_adam.master(l1), l1_before));
    EXPECT_TRUE(torch::equal(b.param_values(l0), l0_before)) << "the value, not a gradient";
  }
  for (int64_t p = 0; p < b.num_params(); ++p) {
    EXPECT_TRUE(torch::isfinite(b.param_values(p)).all().item<bool>()) << b.param_name(p);
  }
}

// The two-phase step with micro-batches takes a gradient its chunk did not have in the previous
// backward, after that chunk's norm was taken (nothing irreversible had happened: the step takes the
// norm again), and stays bit-identical to backward() + step(). (PipelinedStepTakesAGradientItsChunkDidNotExpect:
// the default mode, and the eager step.)
TEST(SlotAccumulation, AccumulatedTwoPhaseStepTakesALateGradient) {
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

}  // namespace
}  // namespace ferry
