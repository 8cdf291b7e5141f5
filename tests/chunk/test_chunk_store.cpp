// ChunkStore on the simulated device: binding keeps tensor identity, views alias chunk memory, round
// trips preserve bytes, budgets force evictions, COMPUTE chunks never move, out-of-memory and bad
// input give clear errors; the moves a round trip's job makes (bring_to_host_and_lock, send_to_host).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "../../chunk/chunk_store.h"
#include "../../chunk/stream_model_engine.h"
#include "../test_util.h"

namespace ferry {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

ChunkStoreOptions simulated(int64_t device_budget = 0, int64_t host_budget = 0) {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  o.device_budget_bytes = device_budget;
  o.host_budget_bytes = host_budget;
  return o;
}

using test::error_of;

TEST(ChunkStore, BindKeepsIdentityAndAliasesChunkMemory) {
  ChunkStore store(simulated());
  torch::manual_seed(0);
  std::vector<torch::Tensor> params = {torch::randn({3, 5}), torch::randn({7}), torch::randn({2, 2, 2})};
  std::vector<torch::Tensor> originals;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> numels;
  for (auto& p : params) {
    originals.push_back(p.clone());
    shapes.push_back(p.sizes().vec());
    numels.push_back(p.numel());
  }
  PackOptions pack;
  pack.chunk_numel = 32;
  pack.align_numel = 16;
  const auto layout = ChunkLayout::pack(numels, {}, pack);
  const auto role = store.add_layout(ChunkRole::kParam, at::kFloat, layout, shapes, Location::kDevice);
  ASSERT_EQ(role.chunks.size(), 2u);  // 15 -> [0,15), 7 -> [16,23); 8 does not fit in 9 left

  for (size_t i = 0; i < params.size(); ++i) {
    const c10::TensorImpl* impl = params[i].unsafeGetTensorImpl();
    store.bind(role.tensors[i], params[i]);
    EXPECT_EQ(params[i].unsafeGetTensorImpl(), impl) << "bind must keep the TensorImpl";
    EXPECT_TRUE(torch::equal(params[i], originals[i]));
  }
  // A write through a parameter is visible in the chunk payload, and the other way round.
  params[1].fill_(42.0f);
  const auto chunk0 = store.payload(role.chunks[0]);
  EXPECT_EQ(chunk0[16].item<float>(), 42.0f);
  EXPECT_EQ(chunk0[22].item<float>(), 42.0f);
  EXPECT_EQ(chunk0[15].item<float>(), 0.0f);  // alignment gap stays zero
  chunk0[0] = -1.0f;
  EXPECT_EQ(params[0][0][0].item<float>(), -1.0f);
  EXPECT_EQ(store.view(role.tensors[2]).data_ptr(), params[2].data_ptr());

  // Round trip: off the device the parameter's storage aliases the host payload (no device memory,
  // no budget), so the tensor still reads and writes the chunk's true bytes; back on the device it
  // holds the same values, written while on the host included.
  const auto before = params[0].clone();
  store.move(role.chunks[0], Location::kHost);
  EXPECT_EQ(store.location(role.chunks[0]), Location::kHost);
  EXPECT_EQ(params[0].storage().data(), store.payload(role.chunks[0]).data_ptr()) << "aliases the host payload";
  EXPECT_TRUE(torch::equal(params[0], before)) << "readable off the device";
  store.view(role.tensors[1]).fill_(7.0f);  // host view
  EXPECT_TRUE(torch::equal(params[1], torch::full({7}, 7.0f)));
  params[1].add_(1.0f);                     // written through the parameter while on the host
  store.move(role.chunks[0], Location::kDevice);
  EXPECT_NE(params[0].storage().data(), nullptr);
  EXPECT_TRUE(torch::equal(params[0], before));
  EXPECT_TRUE(torch::equal(params[1], torch::full({7}, 8.0f)));
  EXPECT_EQ(params[0].unsafeGetTensorImpl()->storage().nbytes(), 32u * 4u);
}

TEST(ChunkStore, RetireFreesAHeldChunkButNotOneInCompute) {
  ChunkStore store(simulated());
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kHost);
  const TensorId a = store.add_tensor(c, 0, {16});
  const TensorId b = store.add_tensor(c, 16, {16});
  store.access(b);
  EXPECT_THROW(store.retire(c), c10::Error) << "a tensor in COMPUTE";
  EXPECT_EQ(store.location(c), Location::kDevice);
  EXPECT_EQ(store.tensor_info(a).state, TensorState::kHold) << "nothing changed";
  store.release(b, TensorState::kHold);
  store.access(a);
  store.release(a, TensorState::kHoldAfterFwd);
  store.retire(c);
  EXPECT_EQ(store.location(c), Location::kNone);
  EXPECT_EQ(store.tensor_info(a).state, TensorState::kFree);
  EXPECT_EQ(store.tensor_info(b).state, TensorState::kFree);
  EXPECT_EQ(store.stats().device.current_bytes + store.stats().host.current_bytes, 0);
}

// Note [A repack waits for held views]: what ChunkedModel compares with its parameter count. Each
// bound tensor holds the chunk's storage once, however many handles to it are kept; every view of it
// (a detach(), a transpose, a store view) is one more while it lives, on the device or off it, and so
// is a handle to a flat payload; a view of the flat host payload counts twice (it holds it as base).
TEST(ChunkStore, StorageHoldersCountsTheBoundTensorsAndEveryViewKept) {
  ChunkStore store(simulated());
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 64, Location::kDevice);
  const TensorId a = store.add_tensor(c, 0, {4, 4});
  const TensorId b = store.add_tensor(c, 16, {8});
  EXPECT_EQ(store.storage_holders(c), 0) << "nothing bound";
  torch::Tensor wa = torch::randn({4, 4}), wb = torch::randn({8});
  store.bind(a, wa);
  store.bind(b, wb);
  EXPECT_EQ(store.storage_holders(c), 2) << "the two bound tensors";
  {
    const torch::Tensor handle = wa;  // the same TensorImpl: not a view
    EXPECT_EQ(store.storage_holders(c), 2);
    const torch::Tensor kept = wa.detach(), transposed = wa.t(), slot = store.view(b);
    EXPECT_EQ(store.storage_holders(c), 5);
    store.move(c, Location::kHost);
    EXPECT_EQ(store.storage_holders(c), 5) << "off the device the views still hold the same storage";
    {
      const torch::Tensor host_view = store.view(a), host_payload = store.payload(c);
      EXPECT_EQ(store.storage_holders(c), 8) << "views of the host buffer count too, the flat payload too";
    }
    EXPECT_EQ(store.storage_holders(c), 5);
    store.move(c, Location::kDevice);
  }
  EXPECT_EQ(store.storage_holders(c), 2) << "the views are gone";
  {
    const torch::Tensor device_payload = store.payload(c);
    EXPECT_EQ(store.storage_holders(c), 3) << "the flat device payload";
  }
  wb = torch::Tensor();
  EXPECT_EQ(store.storage_holders(c), 1);
  EXPECT_THROW(store.storage_holders(c + 1), c10::Error) << "no such chunk";
}

TEST(ChunkStore, RoundTripsPreserveBytesForEveryDtype) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    ChunkStore store(simulated());
    const ChunkId c = store.add_chunk(ChunkRole::kParam, dtype, 1000, Location::kHost);
    const TensorId t = store.add_tensor(c, 0, {1000});
    // Every bit pattern class: random bits, including NaN payloads and subnormals.
    auto bits = torch::randint(0, 1 << 15, {1000}, torch::kInt16);
    auto payload = store.payload(c);
    auto raw = payload.view(dtype == at::kFloat ? at::kInt : at::kShort);
    if (dtype == at::kFloat) {
      raw.copy_(torch::randint(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                               {1000}, torch::kInt32));
    } else {
      raw.copy_(bits);
    }
    const auto expected = raw.clone();
    for (int i = 0; i < 3; ++i) {
      store.move(c, Location::kDevice);
      store.move(c, Location::kHost);
    }
    EXPECT_TRUE(torch::equal(store.view(t).view(expected.scalar_type()), expected)) << dtype;
  }
  for (auto role : {ChunkRole::kMaster, ChunkRole::kExpAvg, ChunkRole::kExpAvgSq, ChunkRole::kGrad}) {
    ChunkStore store(simulated());
    const ChunkId c = store.add_chunk(role, at::kFloat, 64, Location::kDevice);
    store.payload(c).copy_(torch::arange(64, torch::kFloat));
    store.move(c, Location::kHost);
    store.move(c, Location::kDevice);
    EXPECT_TRUE(torch::equal(store.payload(c), torch::arange(64, torch::kFloat))) << to_string(role);
  }
}

TEST(ChunkStore, BindKeepsAutogradWorkingAcrossMoves) {
  ChunkStore store(simulated());
  auto w = torch::randn({4, 4}, torch::requires_grad());
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 16, Location::kDevice);
  const TensorId t = store.add_tensor(c, 0, {4, 4});
  store.bind(t, w);
  EXPECT_TRUE(w.requires_grad());
  auto x = torch::randn({2, 4});
  auto y1 = torch::mm(x, w).sum();
  y1.backward();
  const auto g1 = w.grad().clone();
  const auto accumulator = torch::autograd::impl::grad_accumulator(w);
  store.move(c, Location::kHost);
  store.move(c, Location::kDevice);
  EXPECT_EQ(torch::autograd::impl::grad_accumulator(w), accumulator) << "grad accumulator was reset";
  torch::mm(x, w).sum().backward();
  EXPECT_TRUE(torch::allclose(w.grad(), 2 * g1));  // accumulated into the same .grad
}

TEST(ChunkStore, BudgetForcesLruEvictionsAndStats) {
  const int64_t chunk_bytes = 1024 * 4;
  ChunkStore store(simulated(/*device=*/2 * chunk_bytes));
  std::vector<TensorId> tensors;
  for (int i = 0; i < 3; ++i) {
    const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 1024, Location::kHost);
    tensors.push_back(store.add_tensor(c, 0, {1024}));
    store.view(tensors.back()).fill_(static_cast<float>(i));
  }
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 3; ++i) {
      const auto v = store.access(tensors[i]);
      EXPECT_EQ(v[5].item<float>(), static_cast<float>(i));
      store.release(tensors[i], TensorState::kHoldAfterFwd);
      store.set_state(tensors[i], TensorState::kHold);
      EXPECT_LE(store.stats().device.current_bytes, 2 * chunk_bytes);
    }
  }
  // LRU over 0,1,2,0,1,2 with room for two: every access after the first two misses.
  EXPECT_EQ(store.chunk_info(0).location, Location::kHost);
  EXPECT_EQ(store.chunk_info(1).location, Location::kDevice);
  EXPECT_EQ(store.chunk_info(2).location, Location::kDevice);
  const auto stats = store.stats();
  EXPECT_EQ(stats.moves.h2d_count, 6);
  EXPECT_EQ(stats.moves.h2d_bytes, 6 * chunk_bytes);
  EXPECT_EQ(stats.moves.evictions, 4);
  EXPECT_EQ(stats.moves.d2h_count, 4);
  EXPECT_EQ(stats.device.peak_bytes, 2 * chunk_bytes);
  EXPECT_EQ(stats.host.peak_bytes, 3 * chunk_bytes);
  EXPECT_EQ(store.access_tick(), 6u);
  store.reset_peak_stats();
  EXPECT_EQ(store.stats().device.peak_bytes, 2 * chunk_bytes);
}

TEST(ChunkStore, ComputeChunksNeverMoveAndOomNamesTheNumbers) {
  ChunkStore store(simulated(/*device=*/2 * kMiB));
  const ChunkId a = store.add_chunk(ChunkRole::kParam, at::kFloat, kMiB / 4, Location::kDevice);
  const ChunkId b = store.add_chunk(ChunkRole::kParam, at::kFloat, kMiB / 4, Location::kDevice);
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, kMiB / 4, Location::kHost);
  const TensorId ta = store.add_tensor(a, 0, {16});
  const TensorId tb = store.add_tensor(b, 0, {16});
  const TensorId tc = store.add_tensor(c, 0, {16});
  store.access(ta);
  store.access(tb);
  EXPECT_ERROR_HAS(store.move(a, Location::kHost), "is in COMPUTE and cannot move");
  try {
    store.access(tc);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("out of device chunk memory: chunk 2 (param, Float, 1.0 MiB) needs 1.0 MiB, but the "
                       "device budget is 2.0 MiB with 2.0 MiB used, of which 2.0 MiB in COMPUTE (cannot move) "
                       "and 0 B evictable"),
              std::string::npos)
        << msg;
    EXPECT_EQ(e.shortfall().in_compute, 2 * kMiB);
  }
  // Nothing changed: the failed access left c on the host, its tensor in HOLD.
  EXPECT_EQ(store.chunk_info(c).location, Location::kHost);
  EXPECT_EQ(store.tensor_info(tc).state, TensorState::kHold);
  EXPECT_EQ(store.chunk_info(a).state, ChunkState::kCompute);
  // Catchable as torch's own OOM.
  EXPECT_THROW(store.access(tc), c10::OutOfMemoryError);
  // Releasing one makes it evictable.
  store.release(ta, TensorState::kHoldAfterFwd);
  store.access(tc);
  EXPECT_EQ(store.chunk_info(a).location, Location::kHost);
  EXPECT_EQ(store.chunk_info(b).location, Location::kDevice);
  EXPECT_FALSE(store.prefetch(a)) << "no room: b and c in COMPUTE";
  store.release(tb, TensorState::kHoldAfterFwd);
  EXPECT_TRUE(store.prefetch(a));
  EXPECT_EQ(store.chunk_info(b).location, Location::kHost);
}

// A gathered chunk lands on the device only if room can be made there as a prefetch makes it: never
// by moving a chunk in COMPUTE, never with an OutOfMemoryError; the caller puts it on the host then.
TEST(ChunkStore, TryAllocatePayloadOnDeviceMakesRoomLikeAPrefetchOrDeclines) {
  ChunkStore store(simulated(/*device=*/2 * kMiB));
  const ChunkId a = store.add_chunk(ChunkRole::kParam, at::kFloat, kMiB / 4, Location::kDevice);
  const ChunkId b = store.add_chunk(ChunkRole::kParam, at::kFloat, kMiB / 4, Location::kDevice);
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, kMiB / 4, Location::kNone);
  const TensorId ta = store.add_tensor(a, 0, {16});
  const TensorId tb = store.add_tensor(b, 0, {16});
  store.add_tensor(c, 0, {16});
  const torch::Tensor values = torch::arange(kMiB / 4, torch::kFloat);
  store.access(ta);
  store.access(tb);
  EXPECT_FALSE(store.try_allocate_payload_on_device(c, values.view(torch::kUInt8))) << "a and b are in COMPUTE";
  EXPECT_EQ(store.chunk_info(c).location, Location::kNone);
  EXPECT_EQ(store.stats().device.current_bytes, 2 * kMiB);
  EXPECT_ERROR_HAS(store.try_allocate_payload_on_device(c, torch::zeros({7}, torch::kUInt8)), "uint8 values");
  store.release(ta, TensorState::kHoldAfterFwd);
  EXPECT_TRUE(store.try_allocate_payload_on_device(c, values.view(torch::kUInt8)));
  EXPECT_EQ(store.chunk_info(c).location, Location::kDevice);
  EXPECT_EQ(store.chunk_info(a).location, Location::kHost) << "a, no longer in use, made the room";
  EXPECT_TRUE(torch::equal(store.payload(c), values));
  EXPECT_EQ(store.chunk_info(c).state, ChunkState::kFree) << "its tensors stay FREE until the caller says";
  EXPECT_ERROR_HAS(store.try_allocate_payload_on_device(c), "already has a payload");
}

TEST(ChunkStore, HostBudgetOutOfMemory) {
  ChunkStore store(simulated(/*device=*/0, /*host=*/4096));
  const ChunkId a = store.add_chunk(ChunkRole::kMaster, at::kFloat, 1024, Location::kHost);
  const ChunkId b = store.add_chunk(ChunkRole::kMaster, at::kFloat, 1024, Location::kDevice);
  EXPECT_ERROR_HAS(store.move(b, Location::kHost), "out of host chunk memory: chunk 1 (master, Float, 4.0 KiB) "
                                                   "needs 4.0 KiB, but the host budget is 4.0 KiB with 4.0 KiB used");
  EXPECT_EQ(store.chunk_info(b).location, Location::kDevice);
  store.move(a, Location::kDevice);
  store.move(b, Location::kHost);
  EXPECT_EQ(store.stats().host.current_bytes, 4096);
  EXPECT_THROW(store.add_chunk(ChunkRole::kMaster, at::kFloat, 1024, Location::kHost), OutOfMemoryError);
  EXPECT_EQ(store.num_chunks(), 2) << "a failed add_chunk leaves no chunk behind";
}

TEST(ChunkStore, StatesThroughTheStore) {
  ChunkStore store(simulated());
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 64, Location::kHost);
  const TensorId t0 = store.add_tensor(c, 0, {16});
  const TensorId t1 = store.add_tensor(c, 16, {16});
  EXPECT_EQ(store.chunk_info(c).state, ChunkState::kHold);
  // Nested accesses (a tied weight used twice in one op): the state changes once each way.
  store.access(t0);
  store.access(t0);
  EXPECT_EQ(store.tensor_info(t0).compute_uses, 2);
  store.release(t0, TensorState::kHoldAfterFwd);
  EXPECT_EQ(store.tensor_info(t0).state, TensorState::kCompute);
  store.release(t0, TensorState::kHoldAfterFwd);
  EXPECT_EQ(store.tensor_info(t0).state, TensorState::kHoldAfterFwd);
  EXPECT_EQ(store.chunk_info(c).state, ChunkState::kHold);  // t1 still HOLD
  store.access(t1);
  store.release(t1, TensorState::kHoldAfterFwd);
  EXPECT_EQ(store.chunk_info(c).state, ChunkState::kHoldAfterFwd);

  EXPECT_ERROR_HAS(store.release(t0, TensorState::kHold), "without a matching access");
  EXPECT_ERROR_HAS(store.set_state(t0, TensorState::kCompute), "does not enter or leave COMPUTE");
  store.set_state(t0, TensorState::kHoldAfterBwd);
  EXPECT_ERROR_HAS(store.set_state(t0, TensorState::kHoldAfterFwd),
                   "illegal state transition of tensor: HOLD_AFTER_BWD -> HOLD_AFTER_FWD");
  store.access(t1);
  EXPECT_ERROR_HAS(store.release(t1, TensorState::kFree), "COMPUTE -> FREE");
  EXPECT_EQ(store.tensor_info(t1).state, TensorState::kCompute) << "a refused release changes nothing";
  store.release(t1, TensorState::kHold);

  // Payload release needs every tensor FREE; allocate gives zeros.
  EXPECT_ERROR_HAS(store.release_payload(c), "only when all its tensors are FREE");
  store.view(t0).fill_(3.0f);
  store.set_state(t0, TensorState::kFree);
  store.set_state(t1, TensorState::kFree);
  store.release_payload(c);
  EXPECT_EQ(store.chunk_info(c).state, ChunkState::kReleased);
  EXPECT_EQ(store.stats().host.current_bytes, 0);
  EXPECT_ERROR_HAS(store.access(t0), "no payload (RELEASED)");
  EXPECT_ERROR_HAS(store.set_state(t0, TensorState::kHold), "cannot hold data");
  store.allocate_payload(c, Location::kDevice);
  EXPECT_EQ(store.chunk_info(c).state, ChunkState::kFree);
  store.access(t0);  // FREE -> COMPUTE: an op produces it
  EXPECT_TRUE(torch::equal(store.view(t0), torch::zeros({16})));
  store.release(t0, TensorState::kHoldAfterBwd);
  // A payload given its bytes at once (a gathered chunk): exactly the chunk's bytes, written as given.
  store.set_state(t0, TensorState::kFree);
  store.release_payload(c);
  const int64_t nbytes = store.chunk_info(c).nbytes;
  EXPECT_ERROR_HAS(store.allocate_payload(c, Location::kHost, torch::zeros({nbytes - 1}, torch::kUInt8)),
                   "uint8 values");
  EXPECT_EQ(store.chunk_info(c).location, Location::kNone) << "a refused payload allocates nothing";
  const torch::Tensor values = torch::arange(nbytes / 4, torch::kFloat);
  store.allocate_payload(c, Location::kHost, values.view(torch::kUInt8));
  EXPECT_TRUE(torch::equal(store.payload(c).cpu(), values));
}

TEST(ChunkStore, BadInputIsRejected) {
  ChunkStore store(simulated());
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kHalf, 64, Location::kDevice);
  store.add_tensor(c, 0, {4, 4});
  EXPECT_ERROR_HAS(store.add_tensor(c, 8, {16}), "overlaps tensor 0 at [0, 16)");
  EXPECT_ERROR_HAS(store.add_tensor(c, 60, {8}), "does not fit in chunk 0");
  EXPECT_ERROR_HAS(store.add_tensor(c, 16, {-1}), "negative dimension");
  EXPECT_ERROR_HAS(store.add_tensor(7, 0, {1}), "chunk id 7 out of range");
  EXPECT_ERROR_HAS(store.access(5), "tensor id 5 out of range");
  EXPECT_ERROR_HAS(store.add_chunk(ChunkRole::kExpAvg, at::kHalf, 64, Location::kHost),
                   "exp_avg chunks hold float or uint8 codes (the compact state format), got Half");
  EXPECT_ERROR_HAS(store.add_chunk(ChunkRole::kMaster, at::kHalf, 64, Location::kHost),
                   "master chunks hold float or bfloat16 (the compact state format), got Half");
  EXPECT_ERROR_HAS(store.add_chunk(ChunkRole::kScales, at::kByte, 64, Location::kHost), "scales chunks hold float");
  EXPECT_ERROR_HAS(store.add_chunk(ChunkRole::kParam, at::kInt, 64, Location::kHost),
                   "param chunks hold float, bfloat16 or half");
  EXPECT_ERROR_HAS(store.add_chunk(ChunkRole::kParam, at::kHalf, 0, Location::kHost), "at least one element");
  auto wrong = torch::zeros({16});
  EXPECT_ERROR_HAS(store.bind(0, wrong), "has slot shape [4, 4], got a tensor of shape [16]");
  EXPECT_ERROR_HAS(store.move(c, Location::kNone), "use release_payload()");
  EXPECT_ERROR_HAS(store.set_device_budget(-5), "device budget must be >= 0 bytes");
  ChunkStoreOptions bad = simulated();
  bad.device_budget_bytes = -1;
  EXPECT_ERROR_HAS(ChunkStore store2(bad), "device budget must be >= 0");
  ChunkStoreOptions cuda = simulated();
  cuda.device = DeviceKind::kCuda;
  if (!torch::cuda::is_available()) {
    EXPECT_ERROR_HAS(ChunkStore store3(cuda), "no CUDA GPU is available");
  }
}

// A policy that answers with a chunk it was not offered is a bug in the policy: refuse it.
class RoguePolicy final : public EvictionPolicy {
 public:
  const char* name() const override { return "rogue"; }
  std::vector<ChunkId> choose(const EvictionRequest&) override { return {99}; }
};

TEST(ChunkStore, PolicyAnswersAreChecked) {
  ChunkStoreOptions o = simulated(/*device=*/4096);
  o.policy = std::make_shared<RoguePolicy>();
  ChunkStore store(o);
  store.add_chunk(ChunkRole::kParam, at::kFloat, 1024, Location::kDevice);
  const ChunkId b = store.add_chunk(ChunkRole::kParam, at::kFloat, 1024, Location::kHost);
  EXPECT_ERROR_HAS(store.move(b, Location::kDevice), "eviction policy rogue returned chunk 99");
  EXPECT_EQ(store.chunk_info(b).location, Location::kHost);
}

// Pending copies: with a copy engine that defers copies like a stream, a chunk evicted and brought
// back before its copy ran, reversed moves, and host views all see the right bytes.
TEST(ChunkStore, PendingCopiesAreOrderedAndWaitedFor) {
  auto engine = std::make_unique<StreamModelCopyEngine>();
  ChunkStore store(simulated(), std::move(engine));
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kHost);
  const TensorId t = store.add_tensor(c, 0, {256});
  store.view(t).copy_(torch::arange(256, torch::kFloat));
  const int64_t copies_before = StreamModelCopyEngine::copies_run();
  store.move_async(c, Location::kDevice);
  store.move_async(c, Location::kHost);    // reverses before the first copy ran
  store.move_async(c, Location::kDevice);  // and again
  EXPECT_TRUE(store.chunk_info(c).copy_pending);
  EXPECT_EQ(StreamModelCopyEngine::copies_run(), copies_before);
  const auto v = store.access(t);          // orders "compute" after the copies
  EXPECT_TRUE(torch::equal(v, torch::arange(256, torch::kFloat)));
  v.mul_(2);
  store.release(t, TensorState::kHold);
  store.move_async(c, Location::kHost);
  EXPECT_TRUE(store.chunk_info(c).copy_pending);
  EXPECT_TRUE(torch::equal(store.view(t), 2 * torch::arange(256, torch::kFloat)));  // waits on the host
  EXPECT_EQ(store.stats().moves.wait_count, 1);
  store.synchronize();
  EXPECT_FALSE(store.chunk_info(c).copy_pending);
  EXPECT_EQ(store.stats().host.current_bytes, 1024);
  EXPECT_EQ(store.stats().device.current_bytes, 0);
}

// Host locks (the pipelined optimizer step): a locked chunk stays on the host (access and moves to the
// device fail naming the lock, prefetch declines, its payload cannot be released) until unlocked.
// Syncs: a synchronous move to the host is one, whatever the engine; a background wait is counted apart.
TEST(ChunkStore, HostLockKeepsAChunkOnTheHostAndSyncsAreCounted) {
  auto engine = std::make_unique<StreamModelCopyEngine>();
  ChunkStore store(simulated(), std::move(engine));
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kDevice);
  const TensorId t = store.add_tensor(c, 0, {256});
  EXPECT_THROW(store.lock_on_host(c), c10::Error) << "only a chunk on the host can be locked there";
  store.move_async(c, Location::kHost);
  store.lock_on_host(c);
  store.lock_on_host(c);  // counted
  EXPECT_TRUE(store.locked_on_host(c));
  store.wait(c, WaitFrom::kBackground);
  EXPECT_EQ(store.stats().moves.background_sync_count, 1);
  EXPECT_EQ(store.stats().moves.sync_count, 0);
  try {
    store.access(t);
    ADD_FAILURE() << "access of a chunk locked on the host must fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("locked on the host"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store.tensor_info(t).state, TensorState::kHold) << "the failed access changed nothing";
  EXPECT_THROW(store.move(c, Location::kDevice), c10::Error);
  EXPECT_FALSE(store.prefetch(c));
  store.set_state(t, TensorState::kFree);
  EXPECT_THROW(store.release_payload(c), c10::Error);
  store.set_state(t, TensorState::kHold);
  store.unlock_on_host(c);
  EXPECT_TRUE(store.locked_on_host(c));
  store.unlock_on_host(c);
  EXPECT_FALSE(store.locked_on_host(c));
  EXPECT_THROW(store.unlock_on_host(c), c10::Error);
  EXPECT_TRUE(store.prefetch(c));
  store.access(t);
  store.release(t, TensorState::kHold);
  store.move(c, Location::kHost);  // synchronous: one sync of the caller
  EXPECT_EQ(store.stats().moves.sync_count, 1);
  EXPECT_EQ(store.location(c), Location::kHost);
}

// The moves a round trip's job makes (optim/round_trips.h): bring_to_host_and_lock moves a chunk on the
// device to the host after a mark and locks it in one step (counted as lock_on_host is; on the host
// already: no move), refuses a chunk without payload or in COMPUTE; send_to_host starts the move where
// it may and says no, never throwing, where it may not.
TEST(ChunkStore, BringToHostAndLockAndSendToHost) {
  ChunkStore store(simulated(), std::make_unique<StreamModelCopyEngine>());
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kDevice);
  const TensorId t = store.add_tensor(c, 0, {256});
  store.payload(c).copy_(torch::arange(256, torch::kFloat));
  std::unique_ptr<StreamMark> mark = store.make_mark();
  mark->record();
  store.bring_to_host_and_lock(c, mark.get());
  EXPECT_EQ(store.location(c), Location::kHost);
  EXPECT_TRUE(store.locked_on_host(c));
  EXPECT_EQ(store.stats().moves.d2h_count, 1);
  store.bring_to_host_and_lock(c, nullptr);  // there already: a second lock, no move
  EXPECT_EQ(store.stats().moves.d2h_count, 1);
  store.wait(c, WaitFrom::kBackground);
  EXPECT_TRUE(torch::equal(store.payload(c), torch::arange(256, torch::kFloat))) << "the bytes crossed after the mark";
  store.unlock_on_host(c);
  EXPECT_TRUE(store.locked_on_host(c));
  store.unlock_on_host(c);
  EXPECT_TRUE(store.send_to_host(c, nullptr)) << "on the host already";
  EXPECT_TRUE(store.prefetch(c));
  store.access(t);  // in COMPUTE: neither may move it
  EXPECT_FALSE(store.send_to_host(c, mark.get()));
  EXPECT_NE(error_of([&] { store.bring_to_host_and_lock(c, mark.get()); }).find("COMPUTE"), std::string::npos);
  EXPECT_FALSE(store.locked_on_host(c)) << "the failed call locked nothing";
  store.release(t, TensorState::kHold);
  EXPECT_TRUE(store.send_to_host(c, mark.get()));
  EXPECT_EQ(store.location(c), Location::kHost);
  EXPECT_FALSE(store.locked_on_host(c)) << "send_to_host does not lock";
  const ChunkId released = store.add_chunk(ChunkRole::kParam, at::kFloat, 64, Location::kNone);
  EXPECT_FALSE(store.send_to_host(released, nullptr));
  EXPECT_NE(error_of([&] { store.bring_to_host_and_lock(released, nullptr); }).find("must be on the device or the host"), std::string::npos);
}

// Two stores sharing one DeviceAccountant: each store's device bytes are charged to it by role, each
// sees the other's as bytes elsewhere, and a store that goes away discharges what it held.
TEST(ChunkStore, SharedDeviceAccountantCountsEveryStoreByRole) {
  auto accountant = std::make_shared<DeviceAccountant>();
  ChunkStoreOptions o = simulated();
  o.accountant = accountant;
  ChunkStore params(o);
  const ChunkId p = params.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kDevice);
  {
    ChunkStore state(o);
    state.add_chunk(ChunkRole::kMaster, at::kFloat, 512, Location::kDevice);
    const ChunkId h = state.add_chunk(ChunkRole::kExpAvg, at::kFloat, 512, Location::kHost);
    EXPECT_EQ(accountant->current_bytes(), 1024 + 2048);
    EXPECT_EQ(accountant->bytes_by_role()[static_cast<int>(ChunkRole::kParam)], 1024);
    EXPECT_EQ(accountant->bytes_by_role()[static_cast<int>(ChunkRole::kMaster)], 2048);
    EXPECT_EQ(accountant->bytes_by_role()[static_cast<int>(ChunkRole::kExpAvg)], 0) << "host bytes are not charged";
    EXPECT_EQ(params.device_bytes_elsewhere(), 2048);
    EXPECT_EQ(state.device_bytes_elsewhere(), 1024);
    state.move(h, Location::kDevice);
    EXPECT_EQ(params.device_bytes_elsewhere(), 4096);
  }
  EXPECT_EQ(accountant->current_bytes(), 1024) << "the state store discharged its device bytes when it went";
  EXPECT_EQ(accountant->peak_bytes(), 1024 + 4096);
  params.move(p, Location::kHost);
  EXPECT_EQ(accountant->current_bytes(), 0);
}

// While an eviction's copy is in flight the storage has no memory (the host payload is not complete);
// settle() completes such copies, after which the storage aliases the host payload.
TEST(ChunkStore, SettleMakesEvictedChunksReadable) {
  auto engine = std::make_unique<StreamModelCopyEngine>();
  ChunkStore store(simulated(), std::move(engine));
  const ChunkId c = store.add_chunk(ChunkRole::kParam, at::kFloat, 64, Location::kDevice);
  const TensorId t = store.add_tensor(c, 0, {64});
  auto w = torch::zeros({64});
  store.bind(t, w, torch::arange(64, torch::kFloat));
  store.synchronize();
  store.move_async(c, Location::kHost);
  EXPECT_EQ(w.storage().nbytes(), 0u) << "not readable while the copy is in flight";
  store.settle();
  EXPECT_FALSE(store.chunk_info(c).copy_pending);
  EXPECT_TRUE(torch::equal(w, torch::arange(64, torch::kFloat)));
}

// Three 1 KiB chunks on the host, one tensor each, chunk i holding i + 1, in a store whose device
// holds two.
struct ThreeChunks {
  explicit ThreeChunks(std::unique_ptr<CopyEngine> engine) : store(simulated(2 * 1024), std::move(engine)) {
    for (int i = 0; i < 3; ++i) {
      c.push_back(store.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kHost));
      t.push_back(store.add_tensor(c.back(), 0, {256}));
      store.view(t.back()).fill_(static_cast<float>(i + 1));
    }
    store.synchronize();
  }
  ChunkStore store;
  std::vector<ChunkId> c;
  std::vector<TensorId> t;
};

// On CUDA a prefetch returns with its copy in flight, and such a chunk is no eviction candidate. When
// every chunk on the device is in that state, a chunk that must come in waits for those copies and
// then evicts, rather than failing with "0 B evictable" (seen on an H100 in
// ChunkedModelGpu.PrefetchOverlapsCopiesWithCompute). The stream-model engine runs no copy until waited on.
TEST(ChunkStore, AccessWaitsForInFlightCopiesBeforeGivingUp) {
  auto engine = std::make_unique<StreamModelCopyEngine>();
  ThreeChunks three(std::move(engine));
  ChunkStore& store = three.store;
  const std::vector<ChunkId>& c = three.c;
  const std::vector<TensorId>& t = three.t;
  EXPECT_TRUE(store.prefetch(c[0]));
  EXPECT_TRUE(store.prefetch(c[1]));
  EXPECT_TRUE(store.chunk_info(c[0]).copy_pending);
  EXPECT_TRUE(store.chunk_info(c[1]).copy_pending);
  const int64_t copies_before = StreamModelCopyEngine::copies_run();
  const auto v = store.access(t[2]);  // must: waits for the two prefetches, evicts one, brings chunk 2
  EXPECT_GE(StreamModelCopyEngine::copies_run(), copies_before + 2);
  EXPECT_TRUE(torch::equal(v, torch::full({256}, 3.0f)));
  store.release(t[2], TensorState::kHold);
  EXPECT_EQ(store.stats().moves.evictions, 1);
  EXPECT_LE(store.stats().device.current_bytes, 2 * 1024);
  // Nothing was lost: every chunk still holds its values.
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(torch::equal(store.view(t[i]), torch::full({256}, static_cast<float>(i + 1)))) << i;
  }
}

// Note [In flight but used]: on CUDA the host learns late that a chunk's host->device copy is done,
// although compute was ordered after it at the chunk's use. Such a chunk is evicted like a settled one:
// making room waits for nothing (it used to wait for those copies, a sync per eviction), and what
// compute wrote into the chunk reaches the host (the eviction's copy runs after the first one).
TEST(ChunkStore, AUsedChunkIsEvictedWhileTheHostHasNotSeenItsCopyDone) {
  auto engine = std::make_unique<StreamModelCopyEngine>();
  ThreeChunks three(std::move(engine));
  ChunkStore& store = three.store;
  const std::vector<ChunkId>& c = three.c;
  const std::vector<TensorId>& t = three.t;
  const int64_t waits_before = store.stats().moves.wait_count;
  for (int i = 0; i < 2; ++i) {
    store.access(t[i]).mul_(10);  // compute writes the chunk
    store.release(t[i], TensorState::kHold);
    EXPECT_TRUE(store.chunk_info(c[i]).copy_pending) << "the host has not seen chunk " << i << "'s copy done";
  }
  const auto v = store.access(t[2]);  // must evict one of the two
  EXPECT_TRUE(torch::equal(v, torch::full({256}, 3.0f)));
  store.release(t[2], TensorState::kHold);
  EXPECT_EQ(store.stats().moves.evictions, 1);
  EXPECT_EQ(store.stats().moves.wait_count, waits_before) << "making room waited for a copy a use was ordered after";
  EXPECT_EQ(store.stats().moves.sync_count, 0);
  EXPECT_LE(store.stats().device.current_bytes, 2 * 1024);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(torch::equal(store.view(t[i]), torch::full({256}, (i + 1) * (i < 2 ? 10.0f : 1.0f)))) << i;
  }
}

// What a policy is told (D104): the candidates, and the chunks that stay on the device without being
// candidates: one in COMPUTE, a prefetch in flight no use was ordered after. A chunk on its way to the
// host is neither (its device memory went when its copy was issued).
class RecordingPolicy final : public EvictionPolicy {
 public:
  const char* name() const override { return "recording"; }
  std::vector<ChunkId> choose(const EvictionRequest& request) override {
    requests.push_back(request);
    return lru.choose(request);
  }
  std::vector<EvictionRequest> requests;
  LruEvictionPolicy lru;
};

TEST(ChunkStore, APolicyIsToldTheChunksThatStayWithoutBeingCandidates) {
  auto policy = std::make_shared<RecordingPolicy>();
  ChunkStoreOptions o = simulated(/*device=*/3 * 1024);
  o.policy = policy;
  ChunkStore store(o, std::make_unique<StreamModelCopyEngine>());
  std::vector<ChunkId> c;
  std::vector<TensorId> t;
  for (int i = 0; i < 5; ++i) {
    c.push_back(store.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kHost));
    t.push_back(store.add_tensor(c.back(), 0, {256}));
    store.view(t.back()).fill_(static_cast<float>(i + 1));
  }
  store.synchronize();
  const auto in_use = store.access(t[0]);  // chunk 0: in COMPUTE
  store.access(t[4]);
  store.release(t[4], TensorState::kHold);
  store.move_async(c[4], Location::kHost);  // chunk 4: on its way out
  store.access(t[1]);
  store.release(t[1], TensorState::kHold);  // chunk 1: used, a candidate
  EXPECT_TRUE(store.prefetch(c[2]));        // chunk 2: in flight, unused
  EXPECT_TRUE(policy->requests.empty()) << "three chunks fit";
  const auto v = store.access(t[3]);        // chunk 3 must come in
  ASSERT_EQ(policy->requests.size(), 1u);
  const EvictionRequest& r = policy->requests[0];
  EXPECT_EQ(r.incoming, c[3]);
  EXPECT_TRUE(r.demand);
  ASSERT_EQ(r.candidates.size(), 1u);
  EXPECT_EQ(r.candidates[0].chunk, c[1]);
  EXPECT_EQ(r.held, (std::vector<ChunkId>{c[0], c[2]}));
  EXPECT_TRUE(torch::equal(v, torch::full({256}, 4.0f)));
  store.release(t[3], TensorState::kHold);
  store.release(t[0], TensorState::kHold);
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(torch::equal(store.view(t[i]), torch::full({256}, static_cast<float>(i + 1)))) << i;
  }
}

TEST(StreamMark, TheSimulatedDeviceClockIsTheHostClock) {
  ChunkStore store(simulated());
  auto begin = store.make_mark();
  auto end = store.make_mark();
  EXPECT_FALSE(begin->recorded());
  EXPECT_ERROR_HAS(end->seconds_since(*begin), "both marks must be recorded first");
  const auto t0 = std::chrono::steady_clock::now();
  begin->record();
  std::this_thread::sleep_for(std::chrono::milliseconds(15));
  end->record();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(begin->recorded());
  EXPECT_GE(end->seconds_since(*begin), 0.015);
  EXPECT_LE(end->seconds_since(*begin), wall);
  EXPECT_LE(begin->seconds_since(*end), -0.015) << "signed: from the argument's point to this one";
  begin->record();  // re-recorded: the new point counts
  EXPECT_GE(begin->seconds_since(*end), 0.0);
}

}  // namespace
}  // namespace ferry
