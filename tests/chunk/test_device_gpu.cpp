// The CUDA device (chunk/device.h) on a real GPU: its torch device, copy engine, capacity, allocated
// bytes as the caching allocator counts them, and binding a local rank. Skipped without a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../chunk/device.h"
#include "../test_util.h"

namespace ferry {
namespace {

#ifdef FERRY_WITH_CUDA
TEST(DeviceGpu, TheCudaDeviceAnswersForTheGpu) {
  FERRY_REQUIRE_GPU();
  const std::shared_ptr<const Device> d = make_device(DeviceKind::kCuda);
  EXPECT_STREQ(d->name(), "cuda");
  EXPECT_TRUE(d->torch_device().is_cuda());
  EXPECT_STREQ(d->collective_backend(), "nccl");
  EXPECT_STREQ(make_device(DeviceKind::kAuto)->name(), "cuda") << "auto is CUDA where a GPU is present";
  const std::unique_ptr<CopyEngine> engine = d->make_copy_engine();
  EXPECT_STREQ(engine->name(), "cuda");
  EXPECT_EQ(engine->device(), d->torch_device());
  EXPECT_TRUE(engine->pinned_host());
  // 90% of the GPU, whatever the budget or host memory.
  const int64_t capacity = query_gpus().total_memory_bytes / 10 * 9;
  EXPECT_EQ(d->default_capacity_bytes(0, false), capacity);
  EXPECT_EQ(d->default_capacity_bytes(1 << 20, true), capacity);
  Config c;
  EXPECT_EQ(DeviceBudget::of(c, *d, /*counts_host_memory=*/true).capacity_bytes, capacity);
}

TEST(DeviceGpu, AllocatedBytesFollowTheCachingAllocator) {
  FERRY_REQUIRE_GPU();
  const std::shared_ptr<const Device> d = make_device(DeviceKind::kCuda);
  const int64_t before = d->allocated_bytes();
  EXPECT_GE(before, 0);
  {
    const at::Tensor t = torch::empty({int64_t{16} << 20}, torch::dtype(torch::kByte).device(d->torch_device()));
    EXPECT_GE(d->allocated_bytes() - before, int64_t{16} << 20);
  }
  EXPECT_EQ(d->allocated_bytes(), before);
}

TEST(DeviceGpu, BindingALocalRankMakesItsGpuCurrent) {
  FERRY_REQUIRE_GPU();
  const std::shared_ptr<const Device> d = make_device(DeviceKind::kCuda);
  const int count = query_gpus().count;
  EXPECT_EQ(d->bind_local_rank(0, /*may_share=*/false), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(d->torch_device(), c10::Device(c10::kCUDA, 0));
  // One more rank than GPUs: shared under Gloo, refused otherwise (NCCL: one rank per GPU).
  EXPECT_EQ(d->bind_local_rank(count, /*may_share=*/true), c10::Device(c10::kCUDA, 0));
  EXPECT_NE(test::error_of([&] { d->bind_local_rank(count, /*may_share=*/false); }).find("one rank per GPU"),
            std::string::npos);
}
#else
TEST(DeviceGpu, NeedsACudaBuild) { GTEST_SKIP() << "ferry was built without CUDA"; }
#endif

}  // namespace
}  // namespace ferry
