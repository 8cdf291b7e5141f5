// Config::activations (hooks/activation_segments.h): keep, recompute and auto give the same loss and
// gradients bit for bit, with dropout, under a budget that forces evictions; auto measures every
// segment, plans after the warm-up (no limit: everything measured kept; a room of zero: nothing that
// holds bytes kept), re-traces when the plan changes backward, and falls back to recompute and plans
// again when a segment's inputs grow; plan() refused under another policy.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "../../hooks/checkpoint.h"
#include "../../common/event_trace.h"
#include "../../hooks/chunked_model.h"
#include "checkpointed_blocks.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::Blocks;


// 3 of the chunks: evictions in every iteration.
Config simulated(ActivationPolicy policy, int64_t capacity) { return test::blocks_config(policy, capacity, 24 << 10); }

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<at::Tensor>> grads;  // per iteration, per parameter
};

// `iterations` forward + backward on the same inputs sequence; the module's grads copied after each.
Trained train(ChunkedModel& model, Blocks& net, int iterations, int64_t batch = 8) {
  Trained run;
  torch::manual_seed(99);
  for (int it = 0; it < iterations; ++it) {
    for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
    const torch::Tensor x = torch::randn({batch, 32});
    const torch::Tensor loss = model.forward([&] { return net->forward(x); });
    model.backward(loss);
    run.losses.push_back(loss.item<double>());
    std::vector<at::Tensor> g;
    for (auto& p : net->parameters()) g.push_back(p.grad().clone());
    run.grads.push_back(std::move(g));
  }
  return run;
}

Trained train_with(ActivationPolicy policy, int64_t capacity, int iterations) {
  torch::manual_seed(5);
  Blocks net(32);
  ChunkedModel model(net, simulated(policy, capacity));
  return train(model, net, iterations);
}

void expect_identical(const Trained& a, const Trained& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t it = 0; it < a.losses.size(); ++it) {
    EXPECT_EQ(a.losses[it], b.losses[it]) << what << ", iteration " << it;
    for (size_t k = 0; k < a.grads[it].size(); ++k) {
      EXPECT_TRUE(torch::equal(a.grads[it][k], b.grads[it][k])) << what << ", iteration " << it << ", parameter " << k;
    }
  }
}

TEST(ActivationSegments, EveryPolicyGivesTheSameGradientsBitForBit) {
  const Trained recompute = train_with(ActivationPolicy::kRecompute, 0, 5);
  expect_identical(recompute, train_with(ActivationPolicy::kKeep, 0, 5), "keep");
  expect_identical(recompute, train_with(ActivationPolicy::kAuto, 0, 5), "auto, no limit");
  expect_identical(recompute, train_with(ActivationPolicy::kAuto, 1 << 20, 5), "auto, 1 MiB capacity");
}

TEST(ActivationSegments, AutoWithoutALimitKeepsEverySegmentAfterTheWarmUp) {
  torch::manual_seed(5);
  Blocks net(32);
  ChunkedModel model(net, simulated(ActivationPolicy::kAuto, 0));
  train(model, net, 1);  // the warm-up measures every segment; no optimizer: it plans at its end
  const ActivationSegments& a = model.activations();
  ASSERT_EQ(a.plans(), 1);
  EXPECT_EQ(a.count(), 4);
  EXPECT_EQ(a.keep(), (std::vector<char>{1, 1, 1, 1}));
  EXPECT_EQ(a.plan_input().room_bytes, -1);
  for (const SegmentCost& c : a.plan_input().segments) {
    EXPECT_GE(c.saved_bytes, 0);
    EXPECT_GT(c.recompute_s, 0);
  }
  train(model, net, 3);  // the re-trace, then following it: no new plan
  EXPECT_EQ(a.plans(), 1);
  EXPECT_TRUE(model.scheduler().following_trace());
  EXPECT_NE(a.table().find("4 of 4 segments kept"), std::string::npos) << a.table();
}

TEST(ActivationSegments, AutoKeepsNothingThatHoldsBytesWhenTheRoomIsZero) {
  torch::manual_seed(5);
  Blocks net(32);
  ChunkedModel model(net, simulated(ActivationPolicy::kAuto, 24 << 10));  // capacity = the chunks' budget
  train(model, net, 2);
  const ActivationSegments& a = model.activations();
  ASSERT_EQ(a.plans(), 1);
  EXPECT_EQ(a.plan_input().room_bytes, 0);
  for (size_t k = 0; k < a.keep().size(); ++k) {
    if (a.plan_input().segments[k].saved_bytes > 0) {
      EXPECT_EQ(a.keep()[k], 0) << "segment " << k;
    }
  }
  EXPECT_EQ(a.plan().kept_bytes, 0);
}

TEST(ActivationSegments, GrowingInputsRecomputeAndPlanAgain) {
  torch::manual_seed(5);
  Blocks net(32);
  ChunkedModel model(net, simulated(ActivationPolicy::kAuto, 0));
  train(model, net, 2);
  const ActivationSegments& a = model.activations();
  ASSERT_EQ(a.plans(), 1);
  train(model, net, 1, /*batch=*/16);  // grown: recomputed and measured, planned again at its end
  EXPECT_EQ(a.plans(), 2);
  EXPECT_EQ(a.replans(), 1);
  EXPECT_EQ(a.keep(), (std::vector<char>{1, 1, 1, 1}));
  train(model, net, 1, /*batch=*/12);  // smaller, not below half: the plan stays
  EXPECT_EQ(a.plans(), 2);
}

TEST(ActivationSegments, ThePlanIsInTheEventTrace) {
  torch::manual_seed(5);
  Blocks net(32);
  ChunkedModel model(net, simulated(ActivationPolicy::kAuto, 0));
  trace::start();
  train(model, net, 1);
  trace::stop();
  const std::string json = trace::chrome_json();
  EXPECT_NE(json.find("\"activation plan\""), std::string::npos);
  EXPECT_NE(json.find("\"keep\": \"KKKK\""), std::string::npos) << json.substr(0, 2000);
}

TEST(ActivationSegments, ThePolicyIsParsedAndCheckedOnce) {
  Config c;
  c.set("activations", "auto");
  EXPECT_EQ(c.activations, ActivationPolicy::kAuto);
  c.set("activations", "Keep");
  EXPECT_EQ(c.activations, ActivationPolicy::kKeep);
  EXPECT_ERROR_HAS(c.set("activations", "sometimes"), "expected activations recompute|keep|auto, got 'sometimes'");
  EXPECT_NE(c.to_string().find("activations=keep"), std::string::npos);
}

TEST(ActivationSegments, APlanAppliesBetweenIterationsOnly) {
  torch::manual_seed(5);
  Blocks net(32);
  ChunkedModel model(net, simulated(ActivationPolicy::kAuto, 0));
  train(model, net, 1);
  const MemoryPlan plan = model.activations().plan();
  const MemoryPlanInput input = model.activations().plan_input();
  EXPECT_ERROR_HAS(model.forward([&] {
    model.apply_activation_plan(plan, input);
    return torch::zeros({1});
  }),
                   "applies between iterations; the model is in");
}

TEST(ActivationSegments, APlanAppliesUnderAutoOnly) {
  ActivationSegments s(ActivationPolicy::kRecompute, {});
  EXPECT_ERROR_HAS(s.apply(MemoryPlan{}, MemoryPlanInput{}), "under activations=auto only");
}

}  // namespace
}  // namespace ferry
