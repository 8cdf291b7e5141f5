// device_adam_update (D53) against CpuAdam::update on host copies of the same arrays: every grad dtype,
// every low-precision copy (also written over the gradient, as HybridAdam does), Adam and AdamW with and
// without decay, lengths that leave partial blocks and several grid-stride turns. Built twice: as
// test_device_adam_gpu (`gpu` label, skipped without a GPU) it checks the CUDA kernel bit for bit
// against the CPU kernel; as test_device_adam on the simulated device it checks the wrapper (found_inf,
// argument checks) with the CPU kernel on both sides.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "../../cpu_adam/cpu_adam.h"
#include "../../cpu_adam/device_adam.h"
#include "../test_util.h"
#include "device_under_test.h"

namespace ferry {
namespace {

struct Case {
  at::ScalarType grad;
  at::ScalarType lowp;  // Undefined: none
  bool lowp_over_grad;  // the copy replaces the gradient (HybridAdam's default mode)
  AdamMode mode;
  double weight_decay;
};

std::string name(const Case& c) {
  return std::string(c10::toString(c.grad)) + " grad, lowp " +
         (c.lowp == at::ScalarType::Undefined ? "none" : c10::toString(c.lowp)) +
         (c.lowp_over_grad ? " over the grad" : "") + (c.mode == AdamMode::kAdamW ? ", AdamW" : ", Adam") +
         " wd " + std::to_string(c.weight_decay);
}

using test::device_under_test;

struct Arrays {
  torch::Tensor p, g, m, v, lowp;
};

Arrays make_arrays(const Case& c, int64_t n, int seed) {
  torch::manual_seed(seed);
  Arrays a;
  a.p = torch::randn({n});
  a.g = (torch::randn({n}) * 3).to(c.grad);
  a.m = torch::randn({n}) * 0.1;
  a.v = torch::rand({n}) * 0.01;
  if (c.lowp != at::ScalarType::Undefined && !c.lowp_over_grad) a.lowp = torch::zeros({n}, c.lowp);
  return a;
}

Arrays to(const Arrays& a, at::Device d) {
  return {a.p.to(d, false, true), a.g.to(d, false, true), a.m.to(d, false, true), a.v.to(d, false, true),
          a.lowp.defined() ? a.lowp.to(d, false, true) : torch::Tensor()};
}

AdamSpan span_of(const Arrays& a, const Case& c) {
  AdamSpan s{a.p.data_ptr<float>(), a.g.data_ptr(), a.g.scalar_type(), a.m.data_ptr<float>(),
             a.v.data_ptr<float>(), nullptr, at::ScalarType::Undefined, a.p.numel()};
  if (c.lowp != at::ScalarType::Undefined) {
    s.param_lowp = c.lowp_over_grad ? a.g.data_ptr() : a.lowp.data_ptr();
    s.lowp_dtype = c.lowp;
  }
  return s;
}

void expect_equal(const Arrays& host, const Arrays& dev, const std::string& what) {
  EXPECT_TRUE(torch::equal(host.p, dev.p.cpu())) << what << ": master";
  EXPECT_TRUE(torch::equal(host.g, dev.g.cpu())) << what << ": grad (or the copy written over it)";
  EXPECT_TRUE(torch::equal(host.m, dev.m.cpu())) << what << ": exp_avg";
  EXPECT_TRUE(torch::equal(host.v, dev.v.cpu())) << what << ": exp_avg_sq";
  if (host.lowp.defined()) {
    EXPECT_TRUE(torch::equal(host.lowp, dev.lowp.cpu())) << what << ": lowp copy";
  }
}

std::unique_ptr<CpuAdam> make_adam(const Case& c) {
  auto adam = std::make_unique<CpuAdam>(AdamOptions().with_lr(1e-2).with_mode(c.mode).with_weight_decay(c.weight_decay));
  for (int i = 0; i < 3; ++i) adam->advance_step(0);  // bias corrections of step 3
  return adam;
}

class DeviceAdam : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef FERRY_TEST_ON_CUDA
    FERRY_REQUIRE_GPU();
#endif
  }
};

TEST_F(DeviceAdam, GivesTheBitsOfCpuAdamForEveryDtypeAndMode) {
  std::vector<Case> cases;
  for (at::ScalarType grad : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (at::ScalarType lowp : {at::ScalarType::Undefined, at::kBFloat16, at::kHalf}) {
      for (bool over : {false, true}) {
        if (over && (lowp == at::ScalarType::Undefined || lowp != grad)) continue;  // only a same-size copy
        for (AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam}) {
          for (double wd : {0.0, 0.1}) cases.push_back({grad, lowp, over, mode, wd});
        }
      }
    }
  }
  ASSERT_EQ(cases.size(), 3u * 3u * 4u + 2u * 4u);
  int seed = 0;
  for (const Case& c : cases) {
    // 37: one partial block; 1,000,003: several turns of the grid-stride loop on any GPU.
    for (int64_t n : {int64_t{37}, int64_t{1000003}}) {
      const std::string what = name(c) + ", " + std::to_string(n) + " elements";
      const Arrays host = make_arrays(c, n, ++seed);
      const Arrays dev = to(host, device_under_test());
      const auto host_adam = make_adam(c), dev_adam = make_adam(c);
      ASSERT_TRUE(host_adam->update(0, span_of(host, c), UpdateOptions{0.5, true}).applied) << what;
      device_adam_update(*dev_adam, 0, span_of(dev, c), 0.5, device_under_test());
      expect_equal(host, dev, what);
      if (::testing::Test::HasFailure()) return;  // one case's report is enough
    }
  }
}

// A set found_inf skips the update: master and moments stay, and the low-precision copy gets the
// master's value, rounded. HybridAdam writes that copy over the gradient: after a skipped update the slot
// must hold the parameter again, not the non-finite gradient (seen: NaN parameters after one NaN
// gradient in backward_step with device-resident state, and every later step skipped).
TEST_F(DeviceAdam, AFoundInfSkipsTheUpdateAndGivesTheCopyTheMastersValue) {
  for (const Case& c : {Case{at::kBFloat16, at::kBFloat16, true, AdamMode::kAdamW, 0.1},
                        Case{at::kFloat, at::kHalf, false, AdamMode::kAdam, 0.0},
                        Case{at::kFloat, at::ScalarType::Undefined, false, AdamMode::kAdamW, 0.1}}) {
    const std::string what = name(c);
    Arrays before = make_arrays(c, 4099, 7);
    if (c.lowp_over_grad) before.g.index_put_({5}, std::nan(""));  // the skipped update's reason
    const Arrays dev = to(before, device_under_test());
    const auto adam = make_adam(c);
    device_adam_update(*adam, 0, span_of(dev, c), 1.0, device_under_test(),
                       torch::ones({}, torch::TensorOptions(torch::kFloat).device(device_under_test())));
    Arrays expected = before;
    if (c.lowp_over_grad) expected.g = before.p.to(c.lowp);
    if (expected.lowp.defined()) expected.lowp = before.p.to(c.lowp);
    expect_equal(expected, dev, what + ", found_inf = 1");
    if (c.lowp_over_grad) continue;  // the gradient is gone: no update to run
    device_adam_update(*adam, 0, span_of(dev, c), 1.0, device_under_test(),
                       torch::zeros({}, torch::TensorOptions(torch::kFloat).device(device_under_test())));
    EXPECT_FALSE(torch::equal(before.p, dev.p.cpu())) << what << ": found_inf = 0 must update";
  }
}

TEST_F(DeviceAdam, RefusesAFoundInfFlagItCannotRead) {
  const Case c{at::kFloat, at::ScalarType::Undefined, false, AdamMode::kAdamW, 0.0};
  const Arrays dev = to(make_arrays(c, 16, 3), device_under_test());
  const auto adam = make_adam(c);
  const std::string e = test::error_of([&] {
    device_adam_update(*adam, 0, span_of(dev, c), 1.0, device_under_test(),
                       torch::zeros({2}, torch::TensorOptions(torch::kDouble).device(device_under_test())));
  });
  EXPECT_NE(e.find("expected found_inf as one Float"), std::string::npos) << e;
  CpuAdam fresh(AdamOptions{});  // step count 0: the bias corrections would divide by zero
  const std::string e2 = test::error_of([&] { device_adam_update(fresh, 0, span_of(dev, c), 1.0, device_under_test()); });
  EXPECT_NE(e2.find("before advance_step()"), std::string::npos) << e2;
}

}  // namespace
}  // namespace ferry
