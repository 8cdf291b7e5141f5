// PipelinedStep (optim/pipelined_step.h, Note [Pipelined step]) through HybridAdam::backward_step: each
// chunk's work starts during backward once the chunk is final, and the result is bit-identical to
// backward() + step() (eager, two-phase with clipping or fp16 loss scaling), under forced evictions with
// the state split between device and host; with a frozen layer backward goes through (Note [A chunk final
// before its last use]), with layers skipped or used more often than before (Note [Expectations only
// grow]), with gradients after their chunk's update (Note [A gradient after its chunk's update]) and
// backwards that throw; one host sync per step and no extra transfer.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <future>
#include <limits>
#include <memory>
#include <string>

#include "../../chunk/stream_model_engine.h"
#include "four_layers.h"
#include "hybrid_adam_fixtures.h"
#include "pipeline_vs_step.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures

TEST(PipelinedStep, BackwardStepOverlapsAndIsBitIdentical) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.carry_over_host_updates = false;  // the jobs during backward are what is tested
  options.device_state_chunks = 2;
  options.accumulate_grads = true;
  LmTwins t(twins(21), sim_config(budget_for(3, 2, 4)), options);  // a: backward() + step(); b: backward_step()
  for (int step = 0; step < 6; ++step) {
    const Batch x = batch(step);
    t.a.backward(forward_loss(t.a, t.a_net, x));
    const StepResult p = t.a_adam.step();
    t.a_adam.zero_grad();
    const StepResult o = t.b_adam.backward_step(forward_loss(t.b, t.b_net, x));
    t.b_adam.zero_grad();
    ASSERT_TRUE(p.applied && o.applied) << "step " << step;
    if (step == 0) {
      EXPECT_EQ(o.overlapped_chunks, 0) << "the first call only records the landings";
    } else {
      EXPECT_GT(o.overlapped_chunks, 0) << "step " << step << ": host updates should start during backward";
      EXPECT_EQ(o.device_chunks, 2);
    }
    EXPECT_NEAR(o.grad_norm, p.grad_norm, 1e-9 * p.grad_norm);
  }
  EXPECT_EQ(t.b_adam.step_count(0), 6);
  // Masters, moments and parameters, bit for bit.
  expect_same_state(t.a_adam, t.b_adam, t.a, t.b, "after 6 steps");
}

TEST(PipelinedStep, EqualsBackwardThenStepBitForBit) { expect_pipeline_equals_step({}); }

TEST(PipelinedStep, WithClippingEqualsBackwardThenStep) {
  expect_pipeline_equals_step({Precision::kBf16, 0.05});
}

TEST(PipelinedStep, WithFp16LossScalingEqualsBackwardThenStep) {
  expect_pipeline_equals_step({Precision::kFp16, 0.0, 1, 262144.0, /*min_overflows=*/1});
}

// Note [A chunk final before its last use]: l2 frozen, l0 and l1 trained, so backward carries the
// gradient through l2's weight after l3's gradients, the only ones l2's chunk gets, have landed. The
// chunk went to the host for its update (or its accumulation) at that landing and l2's use failed,
// "locked on the host": every backward_step after the first, and every accumulating backward. Now,
// under evictions, with the state on the host or partly on the device, with and without two
// micro-batches, backward_step equals backward() + step() bit for bit and still starts chunks during
// backward.
TEST(PipelinedStep, AFrozenLayerBackwardGoesThroughTrainsPipelined) {
  for (const int micro : {1, 2}) {
    for (const int64_t device_state : {int64_t{0}, int64_t{1}}) {
      const std::string what = std::to_string(micro) + " micro-batch(es), " + std::to_string(device_state) +
                               " state chunk(s) on the device";
      HybridAdamOptions options(adamw());
      options.carry_over_host_updates = false;  // the jobs during backward are what is tested
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
TEST(PipelinedStep, MoreUsesThanTheLastBackwardWaitForTheChunksUpdate) {
  HybridAdamOptions options(adamw());
  options.carry_over_host_updates = false;  // the jobs during backward are what is tested
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
TEST(PipelinedStep, ALayerSkippedInSomeStepsTrainsPipelined) {
  for (const int micro : {1, 2}) {
    const std::string what = std::to_string(micro) + " micro-batch(es)";
    HybridAdamOptions options(adamw());
    options.carry_over_host_updates = false;  // the jobs during backward are what is tested
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

// A backward_step whose backward throws after a late gradient landed (Note [A gradient after its
// chunk's update]): l2, skipped in the first steps, is used at step 3, so its gradients land after its
// chunk-mate l3's update had started; then backward fails below l1. The late parameters were not
// updated: they keep their gradients for zero_grad(), which gives them their values back, and their
// step counts stay; l3's update stands, as documented. Training goes on, l2 pipelined.
TEST(PipelinedStep, ABackwardThatThrowsAfterALateGradientLeavesItUntouched) {
  LateL2 t(67, /*fail_after=*/0);
  ASSERT_TRUE(t.l2 >= 0 && t.l3 >= 0);
  for (int step = 0; step < 7; ++step) {
    const LateL2::Before s = t.begin(step, 500 + step);
    g_fail_backward = step == 3;
    StepResult r;
    const std::string error = test::error_of([&] { r = t.backward_step(s.x); });
    g_fail_backward = false;
    if (step == 3) {
      EXPECT_NE(error.find("fails on purpose"), std::string::npos) << error;
      EXPECT_EQ(t.model.phase(), ModelPhase::kIdle);
      t.adam.zero_grad();
      EXPECT_FALSE(t.model.any_grad_in_slot()) << s.when;
      EXPECT_TRUE(torch::equal(t.adam.master(t.l2), s.l2_master)) << "the late parameter was not updated";
      EXPECT_TRUE(torch::equal(t.model.param_values(t.l2), s.l2_master)) << "and has its value back, not its gradient";
      EXPECT_EQ(t.adam.param_step_count(t.l2), 0);
      EXPECT_EQ(t.adam.param_step_count(t.l3), s.l3_count + 1) << "l3's update had started: it stands";
      continue;
    }
    ASSERT_EQ(error, "(no error)") << s.when;
    EXPECT_TRUE(r.applied) << s.when;
    EXPECT_EQ(r.late_params, 0) << s.when << ": l2 landed late at step 3, and is expected since";
    if (step > 3) {
      EXPECT_GT(r.overlapped_chunks, 0) << s.when;
    }
  }
  EXPECT_EQ(t.adam.param_step_count(t.l2), 3) << "trained at steps 4 to 6";
}

// A non-finite late gradient (Note [A gradient after its chunk's update]) skips the late spans only, as
// a non-finite chunk in the eager step skips itself: l2, first used at step 3 with a NaN gradient, keeps
// its values and its step count; its chunk-mate l3, updated during backward, keeps its update; the
// step reports the overflow, and l2 trains from step 4 on.
TEST(PipelinedStep, ANonFiniteLateGradientSkipsOnlyTheLateSpans) {
  bool poison = false;
  LateL2 t(71, /*fail_after=*/-1, [&poison](FourLayers& net) {
    net->l[2]->weight.register_hook([&poison](const torch::Tensor& g) { return poison ? torch::full_like(g, NAN) : g; });
  });
  ASSERT_TRUE(t.l2 >= 0 && t.l3 >= 0);
  for (int step = 0; step < 6; ++step) {
    const LateL2::Before s = t.begin(step, 600 + step);
    poison = step == 3;
    const StepResult r = t.backward_step(s.x);
    EXPECT_EQ(r.overflow, step == 3) << s.when;
    if (step != 3) continue;
    EXPECT_EQ(r.late_params, 2) << "l2's weight and bias";
    EXPECT_TRUE(torch::equal(t.adam.master(t.l2), s.l2_master)) << "the late spans were skipped";
    EXPECT_TRUE(torch::equal(t.model.param_values(t.l2), s.l2_master)) << "and have their values back";
    EXPECT_EQ(t.adam.param_step_count(t.l2), 0);
    EXPECT_EQ(t.adam.param_step_count(t.l3), s.l3_count + 1) << "l3's update ran during backward";
  }
  EXPECT_EQ(t.adam.param_step_count(t.l2), 2) << "trained at steps 4 and 5";
  for (int64_t p = 0; p < t.model.num_params(); ++p) {
    EXPECT_TRUE(torch::isfinite(t.model.param_values(p)).all().item<bool>()) << t.model.param_name(p);
  }
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
  options.carry_over_host_updates = false;  // the jobs during backward are what is tested
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
    auto loss = forward_loss(model, net, x);
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

TEST(PipelinedStep, SyncsOnceAndMovesWholeChunks) {
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

// Note [Norms before the trip]: with every host-state chunk still on the device when it is final, the
// eager pipelined step takes their norms there, so the host reads each gradient once, in the update
// (host_norm_bytes 0), where backward() + step() reads them twice; the same bits. Jobs that run in
// backward use them (without the carry-over, which lets backward's end take back the jobs not started),
// and so does the step's end for those taken back and carried over behind the next forward (the worker
// held until backward_step returns: all of them). Skips by those norms are
// compared with the device's in HybridAdamOnDevice.ANonFiniteGradientSkipsItsChunkWhereverItsStateLives.
TEST(PipelinedStep, NormsBeforeTheTripSpareTheHostItsNormPass) {
  for (const bool stall : {false, true}) {
    SCOPED_TRACE(stall ? "worker held: every job taken back" : "no carry-over: every job runs");
    HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
    options.device_state_chunks = 0;
    options.carry_over_host_updates = stall;  // without it the jobs cannot be taken back: they run
    torch::manual_seed(53);
    TinyLm a_net(kVocab, kDim);
    torch::manual_seed(53);
    TinyLm b_net(kVocab, kDim);
    // Room for every parameter chunk: nothing is evicted, so every chunk is on the device when final.
    ChunkedModel a(a_net.ptr(), sim_config(budget_for(16, 0), Precision::kBf16));
    ChunkedModel b(b_net.ptr(), sim_config(budget_for(16, 0), Precision::kBf16));
    HybridAdam a_adam(a, options), b_adam(b, options);
    int64_t host_bytes = 0, carried = 0, overlapped = 0;
    for (int step = 0; step < 6; ++step) {
      const std::string when = "step " + std::to_string(step);
      const Batch x = batch(step);
      a.backward(forward_loss(a, a_net, x));
      const StepResult ra = a_adam.step();
      const StepResult rb = with_worker_held(b_adam, stall, [&] { return b_adam.backward_step(forward_loss(b, b_net, x)); });
      a_adam.zero_grad();
      b_adam.zero_grad();
      ASSERT_TRUE(ra.applied && rb.applied) << when;
      ASSERT_GE(ra.host_chunks, 3) << when;
      EXPECT_GT(ra.host_norm_bytes, 0) << when << ": step() reads the gradients for their norms";
      if (step > 0) {
        EXPECT_EQ(rb.host_norm_bytes, 0) << when << ": the pipeline took every host chunk's norm on the device";
        EXPECT_EQ(ra.grad_norm, rb.grad_norm) << when << ": the device's norms are the host's bits (D85)";
        host_bytes += ra.host_norm_bytes;
        carried += rb.deferred_chunks;
        overlapped += rb.overlapped_chunks;
      }
      ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, when));
    }
    if (stall) {
      EXPECT_GT(carried, 0) << "jobs must be taken back for that path to be tested";
    } else {
      EXPECT_GT(overlapped, 0) << "jobs must run for that path to be tested";
    }
    std::printf("%s: over 5 steps step() read %lld gradient bytes for norms, backward_step 0 (%lld jobs ran in "
                "backward, %lld carried over)\n",
                stall ? "worker held" : "no carry-over", static_cast<long long>(host_bytes),
                static_cast<long long>(overlapped), static_cast<long long>(carried));
  }
}

// The host Adam of a chunk whose gradients are final starts while backward goes on: the gate after the
// embedding blocks backward until a pipelined job has started (the later blocks' chunks are final by
// then). Without the pipeline it would wait its 30 s and record that it saw none.
TEST(PipelinedStep, HostAdamStartsBeforeBackwardEnds) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.carry_over_host_updates = false;  // the jobs during backward are what is tested
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
    const StepResult r = adam.backward_step(forward_loss(model, net, x));
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
TEST(PipelinedStep, TakesAGradientItsChunkDidNotExpect) {
  for (const bool accumulate : {false, true}) {
    for (const int64_t device_chunks : {int64_t{0}, int64_t{-1}}) {
      for (const double clip : {0.0, 0.05}) {
        const std::string what = std::string(accumulate ? "accumulate_grads" : "default mode") +
                                 (device_chunks == 0 ? ", host state" : ", device state") +
                                 (clip > 0 ? ", two-phase (clipping)" : ", eager");
        HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
        options.carry_over_host_updates = false;  // the jobs during backward are what is tested
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
            a.backward(forward_loss(a, a_net, x, micro));
            const torch::Tensor loss = forward_loss(b, b_net, x, micro);
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

TEST(PipelinedStep, RefusesASecondContributionAfterTheUpdate) {
  HybridAdamOptions options(adamw());
  options.carry_over_host_updates = false;  // the jobs during backward are what is tested
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

}  // namespace
}  // namespace ferry
