// ChunkStore on a real GPU: exact-size pinned host payloads, round trips and parameter identity on
// CUDA, and a host->device chunk copy on the copy stream overlapping a kernel on the compute stream,
// measured with CUDA events. Skipped without a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <iostream>

#include "../../chunk/chunk_store.h"
#include "../test_util.h"

#ifdef FERRY_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace ferry {
namespace {

#ifdef FERRY_WITH_CUDA
ChunkStoreOptions cuda_options(int64_t device_budget = 0) {
  ChunkStoreOptions o;
  o.device = DeviceKind::kCuda;
  o.device_budget_bytes = device_budget;
  return o;
}

TEST(ChunkStoreGpu, PinnedRoundTripPreservesBytes) {
  FERRY_REQUIRE_GPU();
  ChunkStore store(cuda_options());
  EXPECT_STREQ(store.engine_name(), "cuda");
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const int64_t numel = (int64_t{3} << 20) + 17;  // not a power of two: the buffer is exact-size
    const ChunkId c = store.add_chunk(ChunkRole::kParam, dtype, numel, Location::kHost);
    auto host = store.payload(c);
    EXPECT_TRUE(at::detail::getCUDAHooks().isPinnedPtr(host.data_ptr())) << "host payload is not pinned";
    EXPECT_EQ(host.storage().nbytes(), static_cast<size_t>(host.nbytes())) << "not exact-size";
    auto raw = host.view(dtype == at::kFloat ? at::kInt : at::kShort);
    raw.copy_(torch::randint(-30000, 30000, {numel}, raw.options()));
    const auto expected = raw.clone();
    for (int i = 0; i < 3; ++i) {
      store.move(c, Location::kDevice);
      EXPECT_TRUE(store.payload(c).is_cuda());
      store.move(c, Location::kHost);
    }
    EXPECT_TRUE(torch::equal(store.payload(c).view(raw.scalar_type()), expected)) << dtype;
  }
}

TEST(ChunkStoreGpu, BoundParameterKeepsIdentityOnCuda) {
  FERRY_REQUIRE_GPU();
  ChunkStore store(cuda_options());
  auto w = torch::randn({64, 64});  // created on the CPU, as an unmodified model would be
  const auto w_bf16 = w.to(torch::kBFloat16);
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kBFloat16, 64 * 64, Location::kDevice);
  const TensorId t = store.add_tensor(c, 0, {64, 64});
  const c10::TensorImpl* impl = w.unsafeGetTensorImpl();
  store.bind(t, w);
  EXPECT_EQ(w.unsafeGetTensorImpl(), impl);
  EXPECT_TRUE(w.is_cuda());
  EXPECT_EQ(w.scalar_type(), at::kBFloat16);
  store.move(c, Location::kHost);
  // Off the device the CUDA tensor aliases the pinned host payload (unified addressing), so ops on it
  // outside ferry's hooks read the true bytes.
  EXPECT_EQ(w.storage().data(), store.payload(c).data_ptr());
  EXPECT_TRUE(torch::equal(w.cpu(), w_bf16)) << "a copy from the aliased pinned payload";
  EXPECT_TRUE(torch::equal((w * 1).cpu(), w_bf16)) << "a CUDA kernel reading the aliased pinned payload";
  store.access(t);
  EXPECT_TRUE(torch::equal(w.cpu(), w_bf16));
  store.release(t, TensorState::kHold);
}

TEST(ChunkStoreGpu, CopyOverlapsComputeKernel) {
  FERRY_REQUIRE_GPU();
  ChunkStore store(cuda_options());
  const int64_t numel = int64_t{64} << 20;  // 256 MiB fp32
  const ChunkId c = store.add_chunk(ChunkRole::kMaster, at::kFloat, numel, Location::kHost);
  const TensorId t = store.add_tensor(c, 0, {numel});
  ASSERT_TRUE(at::detail::getCUDAHooks().isPinnedPtr(store.payload(c).data_ptr()))
      << "the copy must come from pinned memory to be asynchronous";
  auto a = torch::randn({2048, 2048}, torch::kCUDA);
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto time_ms = [&](const std::function<void()>& fn) {
    at::cuda::CUDAEvent start(cudaEventDefault), end(cudaEventDefault);
    start.record(stream);
    fn();
    end.record(stream);
    end.synchronize();
    return start.elapsed_time(end);
  };
  auto copy_in = [&] {
    store.move_async(c, Location::kDevice);
    store.access(t);  // orders the compute stream after the copy
    store.release(t, TensorState::kHold);
  };
  // Copy alone (after a warm-up trip).
  copy_in();
  store.move(c, Location::kHost);
  store.synchronize();
  const float copy_ms = time_ms(copy_in);
  store.move(c, Location::kHost);
  store.synchronize();
  // A kernel sequence about as long as the copy, timed after cuBLAS's warm-up (its first call creates
  // the handle and picks the algorithm: timing that one gave 1 mm for a 4.9 ms copy on an H100).
  for (int i = 0; i < 3; ++i) torch::mm(a, a);
  const float one_ms = time_ms([&] {
    for (int i = 0; i < 10; ++i) torch::mm(a, a);
  }) / 10;
  const int reps = std::max(1, static_cast<int>(std::lround(copy_ms / std::max(one_ms, 0.001f))));
  auto compute = [&] {
    for (int i = 0; i < reps; ++i) torch::mm(a, a);
  };
  const float compute_ms = time_ms(compute);
  // Both: the copy starts first (it waits only for work queued before it), the kernels follow on the
  // compute stream, and the compute stream then waits for the copy.
  const float both_ms = time_ms([&] {
    store.move_async(c, Location::kDevice);
    compute();
    store.access(t);
    store.release(t, TensorState::kHold);
  });
  std::cout << "copy " << copy_ms << " ms, compute " << compute_ms << " ms (" << reps << " mm), both "
            << both_ms << " ms\n";
  RecordProperty("copy_ms", std::to_string(copy_ms));
  RecordProperty("compute_ms", std::to_string(compute_ms));
  RecordProperty("both_ms", std::to_string(both_ms));
  EXPECT_GT(compute_ms, 0.5f * copy_ms) << "the kernel sequence must be about as long as the copy";
  // Overlapped, both take about max(copy, compute) ~ (copy + compute) / 2; serialised, their sum.
  EXPECT_LT(both_ms, 0.85f * (copy_ms + compute_ms)) << "the copy did not overlap the kernels";
}
// A mark is timed when the GPU reaches it, not when the host queued it: a kernel that spins ~50 ms
// is queued in microseconds, and the marks around it are ~50 ms apart.
TEST(ChunkStoreGpu, StreamMarksTimeTheDeviceNotTheHost) {
  FERRY_REQUIRE_GPU();
  ChunkStore store(cuda_options());
  auto begin = store.make_mark();
  auto end = store.make_mark();
  at::cuda::sleep(1000);  // the first launch loads the kernel (lazy module loading): not timed
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  begin->record();
  at::cuda::sleep(int64_t{100} * 1000 * 1000);  // 1e8 cycles: 50 ms at 2 GHz, more at lower clocks
  end->record();
  const double queued = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double device = end->seconds_since(*begin);  // waits for the kernel
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RecordProperty("queued_ms", std::to_string(queued * 1e3));
  RecordProperty("device_ms", std::to_string(device * 1e3));
  EXPECT_GE(device, 0.025) << "1e8 cycles take at least 25 ms below 4 GHz";
  EXPECT_LE(device, wall);
  EXPECT_LT(queued, 0.5 * device) << "queueing the kernel took as long as running it: is the launch blocking?";
  const auto host_mark = make_simulated_copy_engine()->make_mark();
  host_mark->record();
  EXPECT_THROW(end->seconds_since(*host_mark), c10::Error) << "marks of two kinds of device";
}
// A timed copy's marks are the copy stream's: it starts once the compute work queued before it is done
// (a 1e8-cycle kernel: at least 25 ms), lasts at least its bytes at 100 GB/s (above any PCIe 5 x16
// link), and the next copy starts after it ends (one FIFO stream). An untimed copy carries no marks.
TEST(ChunkStoreGpu, TimedCopiesCarryTheCopyStreamsInterval) {
  FERRY_REQUIRE_GPU();
  const auto engine = make_cuda_copy_engine();
  const int64_t bytes = int64_t{256} << 20;
  const auto pinned = at::TensorOptions().dtype(at::kByte).pinned_memory(true);
  const at::Tensor host_a = at::ones({bytes}, pinned), host_b = at::ones({bytes}, pinned);
  const at::Tensor dev_a = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(engine->device()));
  const at::Tensor dev_b = at::empty_like(dev_a);
  EXPECT_EQ(engine->copy(dev_a, host_a, CopyTiming::kUntimed)->started, nullptr);
  at::cuda::sleep(1000);  // loads the kernel (lazy module loading)
  torch::cuda::synchronize();
  auto compute_begin = engine->make_mark();
  compute_begin->record();
  at::cuda::sleep(int64_t{100} * 1000 * 1000);
  auto first = engine->copy(dev_a, host_a, CopyTiming::kTimed);
  auto second = engine->copy(dev_b, host_b, CopyTiming::kTimed);
  ASSERT_TRUE(first->started && first->finished && second->started && second->finished);
  second->wait();
  const double waited = first->started->seconds_since(*compute_begin);
  const double took = first->finished->seconds_since(*first->started);
  const double gap = second->started->seconds_since(*first->finished);
  RecordProperty("copy_gbps", std::to_string(bytes / took * 1e-9));
  EXPECT_GE(waited, 0.025) << "the copy waits for the compute work queued before it";
  EXPECT_GE(took, bytes / 100e9);
  EXPECT_LE(took, 1.0);
  EXPECT_GE(gap, 0.0) << "copies on the one copy stream run one after the other";
  EXPECT_TRUE(torch::equal(dev_b.cpu(), host_b));
}
#else
TEST(ChunkStoreGpu, NeedsACudaBuild) { GTEST_SKIP() << "ferry was built without CUDA"; }
#endif

}  // namespace
}  // namespace ferry
