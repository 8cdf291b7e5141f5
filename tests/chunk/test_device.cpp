// The device object (chunk/device.h): the simulated device's answers, the factory that turns a
// DeviceKind into a Device, the DeviceSpec options carry, and the device budget made from a Config.
// The CUDA device is tested in test_device_gpu.cpp (label gpu).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../chunk/chunk_store.h"
#include "../../chunk/device.h"
#include "../test_util.h"

namespace ferry {
namespace {

TEST(Device, TheSimulatedDeviceIsHostMemoryThatCannotCountItsAllocations) {
  const std::shared_ptr<const Device> d = make_device(DeviceKind::kSimulated);
  EXPECT_STREQ(d->name(), "simulated");
  EXPECT_EQ(d->torch_device(), c10::Device(c10::kCPU));
  EXPECT_EQ(d->allocated_bytes(), -1);
  EXPECT_STREQ(d->collective_backend(), "gloo");
  // Every rank shares the CPU: binding takes nothing, for any local rank.
  EXPECT_EQ(d->bind_local_rank(0, /*may_share=*/false), c10::Device(c10::kCPU));
  EXPECT_EQ(d->bind_local_rank(7, /*may_share=*/false), c10::Device(c10::kCPU));
  const std::unique_ptr<CopyEngine> engine = d->make_copy_engine();
  EXPECT_STREQ(engine->name(), "simulated");
  EXPECT_EQ(engine->device(), d->torch_device());
  EXPECT_FALSE(engine->pinned_host());
}

TEST(Device, TheSimulatedDeviceHasACapacityOnlyWhenItCountsHostMemory) {
  const std::shared_ptr<const Device> d = make_simulated_device();
  EXPECT_EQ(d->default_capacity_bytes(1 << 20, /*counts_host_memory=*/false), 0) << "unknown";
  EXPECT_EQ(d->default_capacity_bytes(1 << 20, /*counts_host_memory=*/true), 1 << 20) << "a GPU of the budget";
  EXPECT_EQ(d->default_capacity_bytes(0, /*counts_host_memory=*/true), 0) << "no budget: unknown";
}

// A GPU's default capacity: all but max(2 GiB, 5%), never a share that leaves a small card nothing.
TEST(Device, AGpusDefaultCapacityLeavesTwoGibibytesOrFivePercent) {
  constexpr int64_t GiB = int64_t{1} << 30;
  const int64_t h100 = 81079LL << 20;  // an 80 GB H100 as CUDA reports it
  EXPECT_EQ(default_gpu_capacity_bytes(h100), h100 - h100 / 20);
  EXPECT_GT(default_gpu_capacity_bytes(h100), 75 * GiB);
  EXPECT_EQ(default_gpu_capacity_bytes(16 * GiB), 14 * GiB);
  EXPECT_EQ(default_gpu_capacity_bytes(24 * GiB), 22 * GiB);
}

TEST(Device, TheFactoryResolvesAutoAsItMakesIt) {
  EXPECT_EQ(resolve_device_kind(DeviceKind::kSimulated), DeviceKind::kSimulated);
  EXPECT_EQ(resolve_device_kind(DeviceKind::kCuda), DeviceKind::kCuda);
  const DeviceKind resolved = resolve_device_kind(DeviceKind::kAuto);
  EXPECT_EQ(resolved, cuda_available() ? DeviceKind::kCuda : DeviceKind::kSimulated);
  if (resolved == DeviceKind::kSimulated) {
    EXPECT_STREQ(make_device(DeviceKind::kAuto)->name(), "simulated");
  }
}

TEST(Device, CudaWithoutAGpuFailsNamingWhatToUse) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is present (test_device_gpu covers it)";
  const std::string e = test::error_of([] { make_device(DeviceKind::kCuda); });
#ifdef FERRY_WITH_CUDA
  EXPECT_NE(e.find("device=cuda was asked for, but no CUDA GPU is available (use device=auto or device=simulated)"),
            std::string::npos)
      << e;
#else
  EXPECT_NE(e.find("built without CUDA"), std::string::npos) << e;
#endif
}

TEST(DeviceSpec, AKindIsMadeWhenUsedAndADeviceIsShared) {
  const DeviceSpec by_kind = DeviceKind::kSimulated;
  const std::shared_ptr<const Device> a = by_kind.make(), b = by_kind.make();
  EXPECT_STREQ(a->name(), "simulated");
  EXPECT_NE(a, b) << "a kind makes a device per use";
  const DeviceSpec shared = a;
  EXPECT_EQ(shared.make(), a) << "a given device is the one used";
  // A kind that cannot be made fails only when used, as a store's construction does.
  if (!cuda_available()) {
    ChunkStoreOptions o;
    EXPECT_NO_THROW(o.device = DeviceKind::kCuda);
    EXPECT_NE(test::error_of([&] { ChunkStore store(o); }).find("no CUDA GPU is available"), std::string::npos);
  }
}

TEST(DeviceSpec, StoresGivenOneDeviceUseIt) {
  ChunkStoreOptions o;
  o.device = make_simulated_device();
  ChunkStore store(o);
  EXPECT_STREQ(store.engine_name(), "simulated");
  EXPECT_EQ(store.device(), c10::Device(c10::kCPU));
  EXPECT_FALSE(store.pins_host_memory());
}

TEST(DeviceBudget, IsTheConfigsBudgetAndTheUsersCapacityOrTheDevicesOwn) {
  const std::shared_ptr<const Device> d = make_simulated_device();
  Config c;
  c.device_budget_bytes = 4 << 20;
  DeviceBudget b = DeviceBudget::of(c, *d, /*counts_host_memory=*/false);
  EXPECT_EQ(b.budget_bytes, 4 << 20);
  EXPECT_EQ(b.capacity_bytes, 0) << "the simulated device's capacity is unknown";
  b = DeviceBudget::of(c, *d, /*counts_host_memory=*/true);
  EXPECT_EQ(b.capacity_bytes, 4 << 20) << "counting host memory: a simulated GPU of the budget";
  c.device_capacity_bytes = 64 << 20;
  b = DeviceBudget::of(c, *d, /*counts_host_memory=*/true);
  EXPECT_EQ(b.capacity_bytes, 64 << 20) << "the user's capacity wins";
  EXPECT_EQ(b.budget_bytes, 4 << 20);
}

}  // namespace
}  // namespace ferry
