#pragma once
// Test fixture: the comparison of backward_step(loss) with backward() + step() on twin TinyLms, shared by
// the pipelined step's tests (one micro-batch) and accumulation's (several).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "hybrid_adam_fixtures.h"

namespace ferry::test {

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

inline void expect_pipeline_equals_step(const PipelineCase& pc) {
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
  // Eager (no clipping, no loss scaling) in the default mode: the host jobs take no norm pass.
  const bool eager_trip = pc.max_grad_norm == 0.0 && pc.precision != Precision::kFp16 && pc.micro_batches == 1;
  for (int step = 0; step < 8; ++step) {
    for (int k = 0; k + 1 < pc.micro_batches; ++k) {
      const Batch x = batch(100 * step + k);
      a.backward(forward_loss(a, a_net, x, pc.micro_batches));
      b.backward(forward_loss(b, b_net, x, pc.micro_batches));
    }
    const Batch x = batch(100 * step + pc.micro_batches - 1);
    a.backward(forward_loss(a, a_net, x, pc.micro_batches));
    const StepResult ra = a_adam.step();
    const StepResult rb =
        b_adam.backward_step(forward_loss(b, b_net, x, pc.micro_batches));
    a_adam.zero_grad();
    b_adam.zero_grad();
    ASSERT_EQ(ra.applied, rb.applied) << "step " << step;
    EXPECT_EQ(ra.overflow, rb.overflow) << "step " << step;
    if (eager_trip && step > 0) {
      // Note [Norms before the trip]: the host-state chunks' norms taken on the device in fp32, not by
      // the host: the report agrees to fp32's accumulation, and the host took no norm pass of its own.
      // Both sides sum fp32 squares of a few thousand values per span in a tree or in blocks (relative
      // error ~log2(n) 2^-24 each, ~1e-6; 1.5e-6 seen), whatever the ISA's block width: 1e-5 is 10x that.
      EXPECT_NEAR(ra.grad_norm, rb.grad_norm, 1e-5 * ra.grad_norm) << "step " << step;
      EXPECT_GT(ra.host_norm_bytes, 0) << "step " << step << ": step() takes the host chunks' norms on the host";
      EXPECT_LT(rb.host_norm_bytes, ra.host_norm_bytes) << "step " << step;
    } else {
      EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << step << ": the same norms summed in the same order";
    }
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

}  // namespace ferry::test
