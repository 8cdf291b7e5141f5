// WriteWatch (hooks/write_watch.h) on plain tensors: in-place writes by their version counter, and
// replacements by storage, offset, dtype, device or layout (Note [Writes to parameters]).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../hooks/write_watch.h"

namespace ferry {
namespace {

TEST(WriteWatch, FindsInPlaceWritesAndReplacementsSinceItLooked) {
  std::vector<at::Tensor> params = {torch::zeros({4}), torch::zeros({2, 2}), torch::zeros({3})};
  WriteWatch watch;
  watch.remember(params);
  const c10::Device cpu(c10::kCPU);
  EXPECT_TRUE(watch.find(params, at::kFloat, cpu).empty()) << "nothing written";
  {
    at::NoGradGuard no_grad;
    params[1].view({4}).narrow(0, 1, 1).fill_(2.0f);  // through a view: the counter is shared
    params[2].set_data(torch::ones({3}));               // other storage
  }
  auto found = watch.find(params, at::kFloat, cpu);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].param, 1);
  EXPECT_FALSE(found[0].replaced);
  EXPECT_EQ(found[1].param, 2);
  EXPECT_TRUE(found[1].replaced);
  watch.remember(params);
  EXPECT_TRUE(watch.find(params, at::kFloat, cpu).empty()) << "taken in: remembered as they are now";
  params[0].set_data(torch::zeros({4}, torch::kDouble));
  found = watch.find(params, at::kFloat, cpu);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_TRUE(found[0].replaced) << "another dtype";
  watch.remember(params);
  EXPECT_EQ(watch.find(params, at::kFloat, cpu).size(), 1u) << "still not the chunks' dtype";
}

TEST(WriteWatch, ANonContiguousViewOfItsOwnStorageIsAReplacement) {
  std::vector<at::Tensor> params = {torch::zeros({2, 2})};
  WriteWatch watch;
  watch.remember(params);
  params[0].set_data(params[0].t());  // same storage, offset and version
  const auto found = watch.find(params, at::kFloat, c10::Device(c10::kCPU));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_TRUE(found[0].replaced) << "a transposed view is not its slot";
  std::vector<at::Tensor> fresh = {torch::zeros({3})};
  watch.remember(fresh);
  EXPECT_EQ(watch.find(fresh, at::kFloat, c10::Device(c10::kCUDA, 0)).size(), 1u) << "not on the chunks' device";
}

TEST(WriteWatch, TheFirstTakeIsSaidAtInfoTheRestAtDebug) {
  WriteWatch watch;
  EXPECT_EQ(watch.count_take(), log::Level::kInfo);
  EXPECT_EQ(watch.count_take(), log::Level::kDebug);
  EXPECT_EQ(watch.count_take(), log::Level::kDebug);
  EXPECT_EQ(watch.takes(), 3);
}

}  // namespace
}  // namespace ferry
