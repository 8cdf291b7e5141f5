// Randomized property test of the ChunkStore: random access/release/move/prefetch/view sequences under
// random budgets, on the synchronous simulated engine and on the stream-model engine
// (chunk/stream_model_engine.h; its host seeing completions as they run, or late, as CUDA's does).
// After every operation: no budget is exceeded; the tiers' bytes equal the chunks' locations exactly
// (the host's: the chunks on the host plus the buffers of host->device copies in flight), and the host
// tier equals the host pool's buffers in use; no chunk in COMPUTE has moved; chunk states agree with a
// reference model. Every few operations (and at the end) every tensor holds exactly the values the
// model says.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <random>

#include "../../chunk/chunk_store.h"
#include "../../chunk/stream_model_engine.h"

namespace ferry {
namespace {

struct Model {
  std::vector<float> value;       // per tensor: every element equals this
  std::vector<int> uses;          // per tensor: accesses not yet released
  std::vector<ChunkId> chunk_of;  // per tensor
};

void check_invariants(ChunkStore& store, const Model& model, int64_t device_budget, int64_t host_budget,
                      const std::map<ChunkId, const void*>& compute_ptrs) {
  const auto stats = store.stats();
  if (device_budget) {
    ASSERT_LE(stats.device.current_bytes, device_budget);
  }
  if (host_budget) {
    ASSERT_LE(stats.host.current_bytes, host_budget);
  }
  int64_t on_device = 0, on_host = 0, arriving = 0;
  for (ChunkId c = 0; c < store.num_chunks(); ++c) {
    const auto info = store.chunk_info(c);
    if (info.location == Location::kDevice) on_device += info.nbytes;
    if (info.location == Location::kHost) on_host += info.nbytes;
    // On the device with a copy still pending: a host->device copy whose source, the chunk's host
    // buffer, stays charged to the host tier until the store sees the copy complete.
    if (info.location == Location::kDevice && info.copy_pending) arriving += info.nbytes;
    bool computing = false;
    for (TensorId t : info.tensors) computing |= model.uses[t] > 0;
    ASSERT_EQ(info.state == ChunkState::kCompute, computing) << "chunk " << c;
    if (computing) {
      ASSERT_EQ(info.location, Location::kDevice) << "chunk " << c;
    }
  }
  ASSERT_EQ(stats.device.current_bytes, on_device);
  // Exact: a host payload (or buffer of a copy) the store keeps charged after its chunk left the host
  // fails here, and so does one it dropped from the tier while the chunk is still there.
  ASSERT_EQ(stats.host.current_bytes, on_host + arriving)
      << on_host << " B of chunks on the host, " << arriving << " B of host->device copies in flight";
  // Every byte of the host tier is a buffer handed out by the store's pool and not given back, and the
  // other way round (released buffers are cached apart, in host_buffers.cached_bytes): a host buffer
  // that left the tier's count without going back to the pool is a leak.
  ASSERT_EQ(stats.host_buffers.in_use_bytes, stats.host.current_bytes);
  int64_t device_roles = 0, host_roles = 0;  // the breakdown by role adds up to the tiers
  for (int r = 0; r < kNumChunkRoles; ++r) device_roles += stats.device_bytes_by_role[r], host_roles += stats.host_bytes_by_role[r];
  ASSERT_EQ(device_roles, stats.device.current_bytes);
  ASSERT_EQ(host_roles, stats.host.current_bytes);
  for (const auto& [chunk, ptr] : compute_ptrs) {
    // Still resident at the same device memory: it did not move, not even there and back.
    const auto info = store.chunk_info(chunk);
    ASSERT_EQ(info.location, Location::kDevice);
    ASSERT_EQ(info.device_data, ptr) << "chunk " << chunk << " moved while in COMPUTE";
  }
}

void check_values(ChunkStore& store, const Model& model) {
  for (TensorId t = 0; t < store.num_tensors(); ++t) {
    const auto v = store.view(t);
    ASSERT_TRUE(torch::all(v == model.value[t]).item<bool>())
        << "tensor " << t << " expected " << model.value[t] << ", got " << v.flatten()[0].item<float>();
  }
}

enum class Engine { kSimulated, kDeferredInOrder, kDeferredHostLags };

void run(uint64_t seed, Engine kind) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };

  const int num_chunks = static_cast<int>(pick(3, 8));
  std::vector<int64_t> numels(num_chunks);
  int64_t total = 0, largest = 0;
  for (auto& n : numels) {
    n = 64 * pick(1, 8);
    total += n * 4;
    largest = std::max(largest, n * 4);
  }
  const int64_t device_budget = pick(largest, total);
  const int64_t host_choice = pick(0, 2);
  const int64_t host_budget = host_choice == 0 ? 0 : host_choice == 1 ? total : pick(largest, total);

  ChunkStoreOptions options;
  options.device = DeviceKind::kSimulated;
  options.device_budget_bytes = device_budget;
  options.host_budget_bytes = host_budget;
  std::unique_ptr<CopyEngine> engine;
  if (kind != Engine::kSimulated) {
    engine = std::make_unique<StreamModelCopyEngine>(
        StreamModelOptions{/*host_lags=*/kind == Engine::kDeferredHostLags, /*poll_one_in=*/8, /*seed=*/seed});
  }
  ChunkStore store(options, std::move(engine));

  Model model;
  for (int c = 0; c < num_chunks; ++c) {
    const ChunkId id = store.add_chunk(ChunkRole::kParam, at::kFloat, numels[c], Location::kNone);
    try {
      store.allocate_payload(id, Location::kHost);
    } catch (const OutOfMemoryError&) {
      try {
        store.allocate_payload(id, Location::kDevice);  // host full: start on the device
      } catch (const OutOfMemoryError&) {
        continue;  // no room anywhere: the chunk stays RELEASED, without tensors
      }
    }
    const int parts = static_cast<int>(pick(1, 3));
    const int64_t each = numels[c] / parts;
    for (int p = 0; p < parts; ++p) {
      const TensorId t = store.add_tensor(id, p * each, {each});
      store.set_state(t, TensorState::kFree);
      store.set_state(t, TensorState::kHold);
      store.view(t).fill_(static_cast<float>(t));
      model.value.push_back(static_cast<float>(t));
      model.uses.push_back(0);
      model.chunk_of.push_back(id);
    }
  }
  const int64_t num_tensors = store.num_tensors();
  std::map<ChunkId, const void*> compute_ptrs;
  auto refresh_compute_ptrs = [&] {
    compute_ptrs.clear();
    for (TensorId t = 0; t < num_tensors; ++t) {
      if (model.uses[t] > 0) compute_ptrs[model.chunk_of[t]] = store.chunk_info(model.chunk_of[t]).device_data;
    }
  };
  const TensorState afters[] = {TensorState::kHold, TensorState::kHoldAfterFwd, TensorState::kHoldAfterBwd};
  int ooms = 0;
  for (int step = 0; step < 400; ++step) {
    const TensorId t = pick(0, num_tensors - 1);
    const ChunkId c = pick(0, num_chunks - 1);
    const bool chunk_computing = store.chunk_info(c).state == ChunkState::kCompute;
    switch (pick(0, 6)) {
      case 0:
      case 1: {  // pre-use hook; sometimes the op writes the tensor
        try {
          const auto v = store.access(t);
          ++model.uses[t];
          ASSERT_TRUE(torch::all(v == model.value[t]).item<bool>()) << "access saw stale data, tensor " << t;
          if (pick(0, 1)) {
            model.value[t] += 1000.0f;
            v.fill_(model.value[t]);
          }
        } catch (const OutOfMemoryError& e) {
          ++ooms;
          ASSERT_GT(e.shortfall().needed, 0);
        }
        break;
      }
      case 2: {  // post-use hook of some tensor in COMPUTE
        for (TensorId u = 0; u < num_tensors; ++u) {
          if (model.uses[u] > 0) {
            store.release(u, afters[pick(0, 2)]);
            --model.uses[u];
            break;
          }
        }
        break;
      }
      case 3: {  // explicit move, sync or async
        const Location to = pick(0, 1) ? Location::kDevice : Location::kHost;
        const bool async = pick(0, 1);
        try {
          async ? store.move_async(c, to) : store.move(c, to);
          ASSERT_TRUE(!chunk_computing || to == Location::kDevice) << "a COMPUTE chunk moved off the device";
        } catch (const OutOfMemoryError&) {
          ++ooms;
        } catch (const c10::Error& e) {
          const std::string msg = e.what_without_backtrace();
          const bool released = store.chunk_info(c).state == ChunkState::kReleased;
          ASSERT_TRUE(chunk_computing || released) << msg;
          ASSERT_NE(msg.find(released ? "no payload" : "is in COMPUTE"), std::string::npos) << msg;
        }
        break;
      }
      case 4:
        store.prefetch(c);
        break;
      case 5: {  // read (and sometimes write) through a view wherever the payload is
        const auto v = store.view(t);
        ASSERT_TRUE(torch::all(v == model.value[t]).item<bool>()) << "view saw stale data, tensor " << t;
        if (model.uses[t] == 0 && pick(0, 1)) {
          model.value[t] -= 1.0f;
          v.fill_(model.value[t]);
        }
        break;
      }
      case 6: {  // end-of-phase state reset
        const auto state = store.tensor_info(t).state;
        if (state == TensorState::kHoldAfterFwd || state == TensorState::kHoldAfterBwd) {
          store.set_state(t, TensorState::kHold);
        }
        break;
      }
    }
    // COMPUTE chunks recorded before this step must not have moved during it.
    ASSERT_NO_FATAL_FAILURE(check_invariants(store, model, device_budget, host_budget, compute_ptrs));
    refresh_compute_ptrs();
    if (step % 25 == 0) {
      ASSERT_NO_FATAL_FAILURE(check_values(store, model));
    }
  }
  for (TensorId t = 0; t < num_tensors; ++t) {
    while (model.uses[t] > 0) {
      store.release(t, TensorState::kHold);
      --model.uses[t];
    }
  }
  store.synchronize();
  ASSERT_NO_FATAL_FAILURE(check_values(store, model));
  const auto stats = store.stats();
  ::testing::Test::RecordProperty("ooms", ooms);
  EXPECT_GT(stats.moves.h2d_count + stats.moves.d2h_count, 0);
}

TEST(ChunkStoreProperty, SimulatedEngine) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    ASSERT_NO_FATAL_FAILURE(run(seed, Engine::kSimulated));
  }
}

TEST(ChunkStoreProperty, DeferredCopiesLikeAStream) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    ASSERT_NO_FATAL_FAILURE(run(seed, Engine::kDeferredInOrder));
  }
}

// As CUDA's host sees them: a copy is known done only once it or a later one was waited for, so chunks
// whose copy a use was ordered after are evicted while still pending (Note [In flight but used]).
TEST(ChunkStoreProperty, DeferredCopiesTheHostSeesLate) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    ASSERT_NO_FATAL_FAILURE(run(seed, Engine::kDeferredHostLags));
  }
}

}  // namespace
}  // namespace ferry
