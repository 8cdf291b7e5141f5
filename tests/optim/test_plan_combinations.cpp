// The activation plan and the joint placement change no bit, in any combination (a property test; D92).
//
// Issue 47's "exact": auto gives the bits of all-recompute and of keep. test_joint_step shows it for a
// few hand-picked runs; here the activation policy (recompute, keep, auto, auto with the joint
// placement of state) is drawn together with the room it plans in (capacity, budget), where the state
// goes (device state chunks), the step (backward_step or backward + step, updates behind forward),
// clipping and the compute dtype, and the run meets what a training loop does to a plan: an evaluation
// forward (no grad, eval mode: no dropout) between steps, and a batch of another shape from some step
// on (a new plan, with hysteresis). Every run is compared with a reference of the same semantics
// (compute dtype, clipping, batches, the evaluation) under recompute with room for everything: every
// loss, every reported gradient norm (D85: the same bits wherever it was taken) and in the end every
// weight, bit for bit. Runs are sequential, each from the same seeds: dropout draws from the global
// generator, and the recompute replays its forward's draws (D68). A failure prints the seed and draw.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../../hooks/chunked_model.h"
#include "../../optim/hybrid_adam.h"
#include "../hooks/checkpointed_blocks.h"
#include "../seeds.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::Blocks;

struct Draw {
  // Semantics: the same in the run and its reference.
  Precision precision = Precision::kFp32;
  double max_grad_norm = 0;
  int eval_at = -1;       // an evaluation forward before this step (-1: none)
  int reshape_at = -1;    // from this step on, batches of 12 rows instead of 8 (-1: never)
  // What must not change the bits.
  ActivationPolicy policy = ActivationPolicy::kRecompute;
  bool joint = false;     // plan_state_with_activations
  int64_t capacity = 0;   // 0: unknown
  int64_t budget = 1 << 20;
  int64_t device_state_chunks = -1;
  bool pipelined = false;
  bool behind_forward = true;
};

std::string describe(const Draw& d) {
  std::ostringstream o;
  o << to_string(d.precision) << " compute, clipping at " << d.max_grad_norm << ", evaluation before step "
    << d.eval_at << ", reshaped from step " << d.reshape_at << "; activations " << to_string(d.policy)
    << (d.joint ? " with the joint placement" : "") << ", capacity " << d.capacity << " B, budget " << d.budget
    << " B, device_state_chunks " << d.device_state_chunks << (d.pipelined ? ", backward_step" : ", backward + step")
    << ", behind forward " << d.behind_forward;
  return o.str();
}

Draw draw(int seed) {
  std::mt19937 rng(static_cast<uint32_t>(104729 * seed + 3));
  Draw d;
  d.precision = rng() % 2 ? Precision::kBf16 : Precision::kFp32;
  d.max_grad_norm = rng() % 3 == 0 ? 0.05 : 0.0;
  d.eval_at = rng() % 2 ? static_cast<int>(rng() % 8) : -1;
  d.reshape_at = rng() % 2 ? 3 + static_cast<int>(rng() % 6) : -1;
  const ActivationPolicy policies[] = {ActivationPolicy::kRecompute, ActivationPolicy::kKeep, ActivationPolicy::kAuto,
                                       ActivationPolicy::kAuto};
  d.policy = policies[rng() % 4];
  d.joint = d.policy == ActivationPolicy::kAuto && rng() % 2;
  const int64_t capacities[] = {0, 160 << 10, 256 << 10, 1 << 20};
  d.capacity = capacities[rng() % 4];
  d.budget = rng() % 2 ? 256 << 10 : 1 << 20;
  const int64_t counts[] = {-1, -1, 0, 2};
  d.device_state_chunks = counts[rng() % 4];
  d.pipelined = rng() % 2;
  d.behind_forward = rng() % 2;
  return d;
}

struct Trained {
  std::vector<double> losses, grad_norms;
  NamedTensors weights;
  int64_t plans = 0, kept = 0;
};

constexpr int kSteps = 10;

Trained train(const Draw& d) {
  torch::manual_seed(11);
  Blocks net(32);
  Config config = test::blocks_config(d.policy, d.capacity, d.budget);
  config.precision = d.precision;
  config.validate();
  ChunkedModel model(net, config);
  HybridAdamOptions options;
  options.device_state_chunks = d.device_state_chunks;
  options.plan_state_with_activations = d.joint;
  options.update_behind_forward = d.behind_forward;
  options.max_grad_norm = d.max_grad_norm;
  HybridAdam adam(model, options);
  Trained t;
  torch::manual_seed(12);
  for (int step = 0; step < kSteps; ++step) {
    if (step == d.eval_at) {
      torch::NoGradGuard no_grad;
      net->eval();
      const torch::Tensor x = torch::randn({8, 32});
      t.losses.push_back(model.forward([&] { return net->forward(x); }).item<double>());
      net->train();
    }
    const int64_t rows = d.reshape_at >= 0 && step >= d.reshape_at ? 12 : 8;
    const torch::Tensor x = torch::randn({rows, 32});
    const torch::Tensor loss = model.forward([&] { return net->forward(x); });
    StepResult r;
    if (d.pipelined) {
      r = adam.backward_step(loss);
    } else {
      model.backward(loss);
      r = adam.step();
    }
    EXPECT_TRUE(r.applied) << "step " << step;
    t.grad_norms.push_back(r.grad_norm);
    t.losses.push_back(loss.item<double>());
    adam.zero_grad();
  }
  t.weights = adam.state_dict();
  t.plans = model.activations().plans();
  t.kept = model.activations().plan().kept();
  return t;
}

class PlanCombinations : public ::testing::TestWithParam<int> {};

TEST_P(PlanCombinations, ChangeNoBitAgainstRecomputeWithRoomForEverything) {
  const Draw d = draw(GetParam());
  const std::string drawn = "case " + std::to_string(GetParam()) + ": " + describe(d);
  std::printf("%s\n", drawn.c_str());
  std::fflush(stdout);
  SCOPED_TRACE(drawn);
  Draw none = d;  // the reference: recompute, room for everything, the state where the policy puts it
  none.policy = ActivationPolicy::kRecompute;
  none.joint = false;
  none.capacity = 0;
  none.budget = 1 << 20;
  none.device_state_chunks = -1;
  none.pipelined = false;
  none.behind_forward = false;
  const Trained want = train(none);
  const Trained got = train(d);
  std::printf("  plans %lld, segments kept %lld\n", static_cast<long long>(got.plans), static_cast<long long>(got.kept));
  ASSERT_EQ(want.losses, got.losses);
  ASSERT_EQ(want.grad_norms, got.grad_norms);
  ASSERT_EQ(want.weights.size(), got.weights.size());
  for (size_t k = 0; k < want.weights.size(); ++k) {
    EXPECT_TRUE(torch::equal(want.weights[k].second, got.weights[k].second)) << want.weights[k].first;
  }
  if (d.policy == ActivationPolicy::kAuto) {
    EXPECT_GT(got.plans, 0) << "auto plans after its measuring iteration";
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, PlanCombinations, ferry::test::seeds(32));

}  // namespace
}  // namespace ferry
