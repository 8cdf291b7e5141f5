// dist::connect and the c10d communicator in one process (a group of one), built twice:
//  - test_process_group (label cpu): Gloo on CPU tensors; NCCL refused on the simulated device;
//  - test_process_group_gpu (label gpu, FERRY_TEST_NCCL): NCCL on this GPU's tensors and on CPU tensors,
//    which it stages through the GPU and must write back.
// At world size 1 every collective's output equals its input, so each output starts as garbage: an
// output the backend wrote somewhere else (a staging copy never copied back) fails.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "../../common/config.h"
#include "../../dist/process_group.h"
#include "../test_util.h"
#include "free_port.h"

namespace ferry {
namespace {

#ifdef FERRY_TEST_NCCL
constexpr const char* kBackend = "nccl";
#define FERRY_REQUIRE_BACKEND() FERRY_REQUIRE_GPU()
#else
constexpr const char* kBackend = "gloo";
#define FERRY_REQUIRE_BACKEND()                                             \
  do {                                                                      \
    if (!dist::have_gloo()) GTEST_SKIP() << "ferry was built without Gloo"; \
  } while (0)
#endif

Config alone(const std::string& backend) {
  Config c;
  c.world_size = 1;
  c.rank = 0;
  c.master_addr = "127.0.0.1";
  c.master_port = test::free_port();
  c.dist_backend = backend;
  c.dist_timeout_s = 30;
  c.device = backend == "nccl" ? DeviceKind::kCuda : DeviceKind::kSimulated;
  return c;
}

// The devices whose tensors the backend is handed: the CPU always; NCCL also its GPU.
std::vector<c10::Device> devices() {
  std::vector<c10::Device> d{c10::Device(c10::kCPU)};
  if (std::string(kBackend) == "nccl") d.emplace_back(c10::kCUDA, 0);
  return d;
}

at::Tensor ramp(int64_t n, at::ScalarType dtype, const c10::Device& device) {
  return at::arange(n, at::TensorOptions().dtype(at::kFloat)).mul_(0.5).sub_(3).to(device, dtype);
}

TEST(ProcessGroup, WorldSizeOneIsNoGroupUnlessAskedFor) {
  Config c = alone(kBackend);
  EXPECT_EQ(dist::connect(c), nullptr);
}

TEST(ProcessGroup, SeveralTasksInASlurmBatchScriptAreRefusedBeforeAnyWait) {
  Config c = alone(kBackend);
  c.world_size = 2;
  c.launcher = Launcher::kSlurmBatch;
  const std::string e = test::error_of([&] { dist::connect(c); });
  EXPECT_NE(e.find("SLURM gave this job 2 tasks (SLURM_NTASKS), but this process was not started by srun"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("or pass --world-size=1 to run it alone"), std::string::npos) << e;
}

TEST(ProcessGroup, AGroupOfOneRunsEveryCollectiveAndWritesTheOutputs) {
  FERRY_REQUIRE_BACKEND();
  const std::shared_ptr<dist::Communicator> comm = dist::connect(alone(kBackend), /*even_alone=*/true);
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(comm->backend(), kBackend);
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->rank(), 0);
  for (const c10::Device& device : devices()) {
    SCOPED_TRACE(device.str());
    EXPECT_TRUE(comm->device_ok(device));
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(c10::toString(dtype));
      const at::Tensor in = ramp(1000, dtype, device);
      at::Tensor reduced = in.clone();
      comm->all_reduce(reduced, dist::ReduceOp::kSum);
      EXPECT_TRUE(at::equal(reduced.cpu(), in.cpu()));
      comm->all_reduce(reduced, dist::ReduceOp::kMax);
      EXPECT_TRUE(at::equal(reduced.cpu(), in.cpu()));
      at::Tensor cast = in.clone();
      comm->broadcast(cast, 0);
      EXPECT_TRUE(at::equal(cast.cpu(), in.cpu()));

      at::Tensor gathered = at::full_like(in, 7);
      comm->all_gather(gathered, in);
      EXPECT_TRUE(at::equal(gathered.cpu(), in.cpu()));
      at::Tensor scattered = at::full_like(in, 7);
      comm->reduce_scatter(scattered, in);
      EXPECT_TRUE(at::equal(scattered.cpu(), in.cpu()));

      at::Tensor gathered_async = at::full_like(in, 7), scattered_async = at::full_like(in, 7);
      std::unique_ptr<dist::Pending> g = comm->all_gather_async(gathered_async, in);
      std::unique_ptr<dist::Pending> r = comm->reduce_scatter_async(scattered_async, in);
      r->wait();
      g->wait();
      EXPECT_TRUE(at::equal(gathered_async.cpu(), in.cpu()));
      EXPECT_TRUE(at::equal(scattered_async.cpu(), in.cpu()));
    }
  }
  comm->barrier();
  const dist::CommStats s = comm->stats();
  // 7 per dtype and device, the barrier above and connect's own.
  EXPECT_EQ(s.collectives, static_cast<int64_t>(devices().size()) * 2 * 7 + 2);
  EXPECT_EQ(s.ring_bytes_sent, 0);  // a group of one sends nothing
  EXPECT_GT(s.all_gather_bytes, 0);
}

// Note [A collective lets go of its tensors]: once a blocking Gloo collective returns, the backend
// holds nothing of its tensor (its worker used to, a moment after the wait returned, so a reference
// count taken right after, the warm-up repack's, could see it). Many rounds, so a worker slow to let
// go shows. Gloo only: the wait is not taken for NCCL, so the NCCL binary does not hold this test (a
// skipped case there made ctest report the whole binary as skipped although its NCCL cases ran and
// passed, seen on the H100).
#ifndef FERRY_TEST_NCCL
TEST(ProcessGroup, ABlockingCollectiveLetsGoOfItsTensorWhenItReturns) {
  FERRY_REQUIRE_BACKEND();
  const std::shared_ptr<dist::Communicator> comm = dist::connect(alone(kBackend), /*even_alone=*/true);
  ASSERT_NE(comm, nullptr);
  for (const c10::Device& device : devices()) {
    SCOPED_TRACE(device.str());
    at::Tensor t = ramp(1000, at::kFloat, device);
    int held = 0;
    for (int round = 0; round < 1000; ++round) {
      comm->broadcast(t, 0);
      held += t.use_count() > 1;
      comm->all_reduce(t, dist::ReduceOp::kMax);
      held += t.use_count() > 1;
    }
    EXPECT_EQ(held, 0) << "rounds after which the backend still held the tensor";
  }
}
#endif

TEST(ProcessGroup, MismatchedSizesFailNamingBoth) {
  FERRY_REQUIRE_BACKEND();
  const std::shared_ptr<dist::Communicator> comm = dist::connect(alone(kBackend), /*even_alone=*/true);
  const c10::Device device = devices().back();
  at::Tensor out = at::zeros({10}, at::TensorOptions().device(device));
  const std::string e = test::error_of([&] { comm->all_gather(out, at::zeros({9}, out.options())); });
  EXPECT_NE(e.find("all_gather needs an output of world size (1) x the input's elements"), std::string::npos) << e;
  EXPECT_NE(e.find("got input 9 Float"), std::string::npos) << e;
}

#ifndef FERRY_TEST_NCCL
TEST(ProcessGroup, NcclOnTheSimulatedDeviceFailsNamingWhy) {
  Config c = alone("nccl");
  c.device = DeviceKind::kSimulated;
  const std::string e = test::error_of([&] { dist::connect(c, /*even_alone=*/true); });
  if (dist::have_nccl()) {
    EXPECT_NE(e.find("dist-backend 'nccl' needs the chunks on CUDA devices, but this run's device is simulated"),
              std::string::npos)
        << e;
  } else {
    EXPECT_NE(e.find("dist-backend 'nccl' is not built into this ferry"), std::string::npos) << e;
  }
}

TEST(ProcessGroup, AutoPicksGlooForTheSimulatedDevice) {
  FERRY_REQUIRE_BACKEND();
  const std::shared_ptr<dist::Communicator> comm = dist::connect(alone("auto"), /*even_alone=*/true);
  EXPECT_EQ(comm->backend(), "gloo");
  EXPECT_FALSE(comm->device_ok(c10::Device(c10::kCUDA, 0)));
}
#else
TEST(ProcessGroup, AutoPicksNcclForCudaChunks) {
  FERRY_REQUIRE_GPU();
  Config c = alone("auto");
  c.device = DeviceKind::kCuda;
  const std::shared_ptr<dist::Communicator> comm = dist::connect(c, /*even_alone=*/true);
  EXPECT_EQ(comm->backend(), "nccl");
}

// srun --gpus-per-task=1 leaves each task one GPU, device 0, whatever its local rank; without the rule
// local rank N would need GPU N and fail ("one rank per GPU").
TEST(ProcessGroup, AProcessLeftOneGpuBindsItWhateverItsLocalRank) {
  FERRY_REQUIRE_GPU();
  Config c = alone("nccl");
  c.local_rank = static_cast<int>(torch::cuda::device_count()) + 3;
  c.visible_gpus = 1;
  const std::shared_ptr<dist::Communicator> comm = dist::connect(c, /*even_alone=*/true);
  ASSERT_NE(comm, nullptr);
  EXPECT_TRUE(comm->device_ok(c10::Device(c10::kCUDA, 0)));
}
#endif

}  // namespace
}  // namespace ferry
