// device_grad_norms_sq (D85) against CpuAdam::grad_norm_sq on host copies of the same gradients, to the
// bit: every gradient dtype, ranges that end inside a row, a block and a grain, several ranges of one
// tensor, an empty one, non-finite gradients. Built twice, as test_device_adam is: as
// test_device_norm_gpu (`gpu` label, skipped without a GPU) it checks the CUDA kernel against the CPU
// kernels; as test_device_norm on the simulated device, the wrapper (ranges, argument checks).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "../../cpu_adam/cpu_adam.h"
#include "../../cpu_adam/device_norm.h"
#include "../../cpu_adam/thread_split.h"
#include "../test_util.h"
#include "device_under_test.h"

namespace ferry {
namespace {

using test::device_under_test;

class DeviceNorm : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef FERRY_TEST_ON_CUDA
    FERRY_REQUIRE_GPU();
#endif
  }
};

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

// What the host gives for each range of `grads` (a CPU tensor).
std::vector<double> on_the_host(const CpuAdam& adam, const torch::Tensor& grads, const Ranges& ranges) {
  std::vector<double> out;
  const char* base = static_cast<const char*>(grads.data_ptr());
  for (const auto& [b, e] : ranges) {
    out.push_back(adam.grad_norm_sq(base + b * grads.element_size(), grads.scalar_type(), e - b).sum_sq);
  }
  return out;
}

void expect_same_bits(const std::vector<double>& want, const torch::Tensor& got, const std::string& what) {
  const torch::Tensor host = got.to(torch::kCPU).contiguous();
  ASSERT_EQ(host.scalar_type(), torch::kDouble) << what;
  ASSERT_EQ(host.numel(), static_cast<int64_t>(want.size())) << what;
  for (size_t k = 0; k < want.size(); ++k) {
    const double g = host.data_ptr<double>()[k];
    const bool same = std::memcmp(&g, &want[k], sizeof(double)) == 0 || (std::isnan(g) && std::isnan(want[k]));
    EXPECT_TRUE(same) << what << ", range " << k << ": " << g << " vs " << want[k];
  }
}

TEST_F(DeviceNorm, GivesTheHostsBitsForEveryRange) {
  CpuAdam adam;
  const int64_t n = 3 * kGrainElements + 2 * 1024 + 37;
  Ranges ranges = {{0, n},       {0, 1},       {5, 5},  {17, 1040},
                   {100, 33000}, {kGrainElements, 2 * kGrainElements + 1}, {n - 15, n}};
  for (int64_t k = 0; k < 70; ++k) ranges.emplace_back(k * 1000, k * 1000 + 1 + k * 37);  // > 64: two launches
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    torch::manual_seed(7);
    // Magnitudes over many binades, so that another order of summation gives other bits.
    const torch::Tensor host = (torch::randn({n}) * torch::exp2(torch::randint(-12, 12, {n}).to(torch::kFloat)))
                                   .to(dtype);
    const torch::Tensor on_device = host.to(device_under_test());
    expect_same_bits(on_the_host(adam, host, ranges), device_grad_norms_sq(adam, on_device, ranges),
                     c10::toString(dtype));
  }
}

TEST_F(DeviceNorm, ANonFiniteGradientMakesItsRangesSumNonFinite) {
  CpuAdam adam;
  const int64_t n = kGrainElements + 500;
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 3e19f}) {
    torch::Tensor host = torch::randn({n});
    host[kGrainElements + 7] = bad;  // in the second grain; 3e19: finite, but its square overflows
    const Ranges ranges = {{0, kGrainElements}, {0, n}, {kGrainElements, n}};
    const torch::Tensor got = device_grad_norms_sq(adam, host.to(device_under_test()), ranges).to(torch::kCPU);
    EXPECT_TRUE(std::isfinite(got[0].item<double>())) << bad;
    EXPECT_FALSE(std::isfinite(got[1].item<double>())) << bad;
    EXPECT_FALSE(std::isfinite(got[2].item<double>())) << bad;
    expect_same_bits(on_the_host(adam, host, ranges), got, "bad " + std::to_string(bad));
  }
}

TEST_F(DeviceNorm, RefusesWhatItCannotSum) {
  CpuAdam adam;
  const torch::Tensor g = torch::zeros({100}, torch::TensorOptions(device_under_test()));
  EXPECT_ERROR_HAS(device_grad_norms_sq(adam, g, {{10, 101}}), "expected a range in [0, 100], got [10, 101)");
  EXPECT_ERROR_HAS(device_grad_norms_sq(adam, g, {{-1, 3}}), "got [-1, 3)");
  EXPECT_ERROR_HAS(device_grad_norms_sq(adam, g.view({10, 10}), {{0, 1}}), "expected a contiguous 1-D tensor");
  EXPECT_ERROR_HAS(device_grad_norms_sq(adam, g.to(torch::kInt), {{0, 1}}), "expected Float, BFloat16 or Half gradients, got Int");
  EXPECT_EQ(device_grad_norms_sq(adam, g, {}).numel(), 0);
}

}  // namespace
}  // namespace ferry
