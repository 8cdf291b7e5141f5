#pragma once
// Test fixture: FourLayers, four 40 x 40 layers whose backward can fail part-way or use a layer a varying
// number of times, and FourLayerTwins, two of them under evictions, one stepped by backward() + step(),
// the other by backward_step(): the models of the pipelined step's tests (Note [A chunk final before its
// last use], Note [Expectations only grow]) and of accumulation's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <functional>
#include <vector>

#include "hybrid_adam_fixtures.h"

namespace ferry::test {

// Identity whose backward throws while g_fail_backward is set: a backward that fails part-way.
inline std::atomic<bool> g_fail_backward{false};
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

// One FourLayers under evictions with its HybridAdam, the state on the host, in which l2 is skipped in
// steps 0-2 and used from step 3 on, so that its gradients first land after its chunk-mate l3's update
// has started (Note [A gradient after its chunk's update]). `prepare` runs on the module before it is
// wrapped (a hook on a weight).
struct LateL2 {
  LateL2(uint64_t seed, int fail_after, const std::function<void(FourLayers&)>& prepare = nullptr)
      : net(made(seed, fail_after, prepare)),
        model(net.ptr(), FourLayerTwins::config(options())),
        adam(model, options()),
        l2(param_index(model, "l2.weight")),
        l3(param_index(model, "l3.weight")) {}
  static HybridAdamOptions options() {  // the jobs during backward are what is tested
    return HybridAdamOptions(adamw()).with_device_state_chunks(0).with_carry_over_host_updates(false);
  }
  static FourLayers made(uint64_t seed, int fail_after, const std::function<void(FourLayers&)>& prepare) {
    torch::manual_seed(seed);
    FourLayers n(fail_after);
    if (prepare) prepare(n);
    return n;
  }
  // Step `step` begins: l2 used from step 3 on, the input drawn after torch::manual_seed(seed); what l2's
  // master and l3's step count were before it.
  struct Before {
    std::string when;
    torch::Tensor x, l2_master;
    int64_t l3_count;
  };
  Before begin(int step, uint64_t seed) {
    net->l2_times = step < 3 ? 0 : 1;
    torch::manual_seed(seed);
    torch::Tensor x = torch::randn({4, 40});
    return {"step " + std::to_string(step), x, adam.master(l2).clone(), adam.param_step_count(l3)};
  }
  StepResult backward_step(const torch::Tensor& x) {
    return adam.backward_step(model.forward([&] { return net->forward(x).pow(2).mean(); }));
  }
  FourLayers net;
  ChunkedModel model;
  HybridAdam adam;
  int64_t l2, l3;  // l2's and l3's weights
};

}  // namespace ferry::test
