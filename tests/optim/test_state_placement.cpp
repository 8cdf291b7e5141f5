// StatePlacement (optim/state_placement.h) through HybridAdam: where the optimizer state goes after the
// warm-up follows the margin the device budget leaves beside the parameter chunks; more than the budget
// fails at placement with the numbers and changes nothing; a backward_step before any step places at its
// step; the warm-up's repack and the state's migration never hold two copies; a state view kept over the
// warm-up delays the repack. (The policy alone: tests/scheduler/test_placement_policy.cpp.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "hybrid_adam_fixtures.h"
#include "wrapped_perceptron.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures

TEST(StatePlacement, FollowsTheMargin) {
  {  // a generous budget: every state group fits beside the parameters
    torch::manual_seed(0);
    TinyLm net(kVocab, kDim);
    ChunkedModel model(net.ptr(), sim_config(budget_for(40, 40)));
    HybridAdam adam(model, HybridAdamOptions{});
    EXPECT_FALSE(adam.placed());
    for (int step = 0; step < 2; ++step) {
      const Batch b = batch(step);
      model.backward(forward_loss(model, net, b));
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
      model.backward(forward_loss(model, net, b));
      const StepResult r = adam.step();
      adam.zero_grad();
      EXPECT_EQ(r.device_chunks, 0);
    }
    EXPECT_TRUE(adam.placed());
    EXPECT_EQ(adam.device_state_chunks(), 0);
  }
}

// Asking for more device-resident state than the one device budget can hold next to a parameter chunk
// fails at placement with the numbers, and changes nothing: no state moved, no step taken.
TEST(StatePlacement, PlacingMoreStateThanTheBudgetFailsClearly) {
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 1000;  // all of them
  torch::manual_seed(59);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 1)));
  HybridAdam adam(model, options);
  const Batch x = batch(0);
  model.backward(forward_loss(model, net, x));
  const std::string what = test::error_of([&] { adam.step(); });  // every state group within a budget for one
  EXPECT_NE(what.find("would leave"), std::string::npos) << what;
  EXPECT_NE(what.find("less than the largest chunk"), std::string::npos) << what;
  EXPECT_FALSE(adam.placed());
  EXPECT_EQ(adam.state_store().stats().device.current_bytes, 0);
  EXPECT_EQ(model.scheduler().other_device_bytes(), 0);
  EXPECT_EQ(adam.step_count(0), 0);
  adam.zero_grad();
}

// A backward_step whose forward comes after the warm-up but before any step (here the warm-up's
// gradients were discarded; with micro-batches it is the last one's) places the state at its step, not
// inside the iteration (it used to fail: "admit_device_bytes() inside an iteration"), and trains as
// backward() + step().
TEST(StatePlacement, BackwardStepBeforeAnyStepPlacesAtItsStep) {
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
  a.backward(forward_loss(a, a_net, w));
  a_adam.zero_grad();
  b.backward(forward_loss(b, b_net, w));
  b_adam.zero_grad();
  EXPECT_EQ(b_adam.device_state_chunks(), 0) << "nothing placed by the warm-up alone";
  for (int step = 1; step < 4; ++step) {
    const Batch x = batch(step);
    a.backward(forward_loss(a, a_net, x));
    ASSERT_TRUE(a_adam.step().applied);
    ASSERT_TRUE(b_adam.backward_step(forward_loss(b, b_net, x)).applied);
    EXPECT_EQ(b_adam.device_state_chunks(), 2) << "step " << step;
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "step " + std::to_string(step)));
  }
}

TEST(StatePlacement, RepackAndMigrationDoNotHoldTwoCopies) {
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
  model.backward(forward_loss(model, net, b));  // warm-up, then repack
  EXPECT_GT(model.last_repack_peak_bytes(), 0) << "the warm-up must repack";
  EXPECT_LE(model.last_repack_peak_bytes(), param_bytes + 2 * kChunk);
  adam.step();  // migrates the state to the new layout first (the masters: the moments were never touched)
  EXPECT_GT(adam.last_migration_peak_bytes(), 0);
  EXPECT_LE(adam.last_migration_peak_bytes(), state_bytes + 2 * kChunk);
  const ChunkStoreStats st = adam.state_store().stats();
  EXPECT_EQ(st.host.current_bytes + st.device.current_bytes, 3 * param_bytes) << "master, exp_avg, exp_avg_sq";
}

// A view of the optimizer state kept over the warm-up (a report over adam.state_store(); master(p)
// gives a copy): the state migrates in the warm-up's repack, which used to free the view's memory
// under it and hand its host buffer to the new store. The repack waits until it is dropped (Note [A
// repack waits for held views]); meanwhile the view is the state's, and the training is bit-identical
// to the twin before and after the repack.
TEST(StatePlacement, AStateViewKeptOverTheWarmupDelaysTheRepack) {
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

}  // namespace
}  // namespace ferry
