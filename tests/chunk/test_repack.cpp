// fill_layout (chunk/repack.h): a first build and a repack of two roles into a layout in another
// order keep every value, retire every old chunk, and hold at most a few chunks beyond the old store
// (not a second copy); a new chunk whose values are all on the device is built there while the device
// has room, never by evicting; bad input is refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>
#include <set>

#include "../../chunk/chunk_store.h"
#include "../../chunk/device_accountant.h"
#include "../../chunk/repack.h"

namespace ferry {
namespace {

ChunkStoreOptions simulated() {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  return o;
}

constexpr int kRoles = 2;
const std::vector<int64_t> kNumels = {100, 60, 200, 30, 90, 150, 40, 120};

at::Tensor value_of(int role, int64_t tensor) {
  return torch::arange(kNumels[tensor], torch::kFloat) + 1000.0 * static_cast<double>(tensor) + 0.5 * role;
}

struct Built {
  std::unique_ptr<ChunkStore> store;
  ChunkLayout layout;
  std::vector<ChunkStore::RoleChunks> roles;
  int64_t peak = 0;
};

Built build(const std::vector<int64_t>& order, Built* from, const ChunkStoreOptions& options = simulated(),
            const FillPlacement& placement = {}) {
  Built b;
  PackOptions pack;
  pack.chunk_numel = 256;
  b.layout = ChunkLayout::pack(kNumels, order, pack);
  b.store = std::make_unique<ChunkStore>(options);
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t n : kNumels) shapes.push_back({n});
  std::vector<std::vector<TensorId>> from_tensors;
  for (int r = 0; r < kRoles; ++r) {
    b.roles.push_back(b.store->add_layout(r == 0 ? ChunkRole::kParam : ChunkRole::kMaster, at::kFloat, b.layout,
                                          shapes, Location::kNone));
    if (from) from_tensors.push_back(from->roles[r].tensors);
  }
  ChunkStore& to = *b.store;
  b.peak = fill_layout(to, b.layout, b.roles, from ? from->store.get() : nullptr, from_tensors,
                       [&](int r, int64_t j, TensorId slot) {
                         to.set_state(slot, TensorState::kHold);
                         to.view(slot).copy_(from ? from->store->view(from->roles[r].tensors[j]) : value_of(r, j));
                       }, placement);
  return b;
}

TEST(Repack, FillsMigratesAndRetiresChunkByChunk) {
  std::vector<int64_t> order(kNumels.size());
  std::iota(order.begin(), order.end(), 0);
  Built a = build(order, nullptr);
  EXPECT_EQ(a.peak, 0) << "a first build has no old store";
  const int64_t a_bytes = a.store->stats().host.current_bytes;
  ASSERT_GT(a.layout.num_chunks(), 3);
  std::reverse(order.begin(), order.end());
  Built b = build(order, &a);
  for (int r = 0; r < kRoles; ++r) {
    for (int64_t j = 0; j < static_cast<int64_t>(kNumels.size()); ++j) {
      EXPECT_TRUE(torch::equal(b.store->view(b.roles[r].tensors[j]), value_of(r, j))) << "role " << r << " tensor " << j;
    }
  }
  EXPECT_EQ(a.store->stats().host.current_bytes, 0) << "every old chunk retired";
  for (ChunkId c = 0; c < a.store->num_chunks(); ++c) EXPECT_EQ(a.store->location(c), Location::kNone);
  // The reversed order is the worst case for freeing early; still far below two full copies.
  const int64_t chunk_bytes = 256 * 4;
  EXPECT_LE(b.peak, a_bytes + kRoles * 2 * chunk_bytes) << "a repack holds about a chunk per role extra";
  EXPECT_LT(b.peak, 2 * a_bytes);
}

TEST(Repack, NewChunksReuseTheOldChunksHostMemory) {
  // Note [Repack reuses memory]: each retired old chunk's host buffer goes to the new store, and the next
  // new chunk of its size takes it instead of fresh memory; the caches are set back afterwards, even
  // where the new store keeps nothing (host_cache_bytes 0).
  std::vector<int64_t> order(kNumels.size());
  std::iota(order.begin(), order.end(), 0);
  Built a = build(order, nullptr);
  const int64_t a_cache = a.store->host_cache_bytes();
  ChunkStoreOptions no_cache = simulated();
  no_cache.host_cache_bytes = 0;
  // The same order: old chunk i is emptied into new chunk i, so only the first new chunk of each role
  // needs fresh memory.
  Built b = build(order, &a, no_cache);
  const int64_t chunks = b.layout.num_chunks() * kRoles;
  const HostBufferStats same = b.store->stats().host_buffers;
  EXPECT_EQ(same.allocations, kRoles) << "fresh buffers";
  EXPECT_EQ(same.reuses, chunks - kRoles);
  EXPECT_EQ(same.cached_bytes, 0) << "the new store keeps nothing once the repack is over";
  EXPECT_EQ(b.store->host_cache_bytes(), 0);
  EXPECT_EQ(a.store->host_cache_bytes(), a_cache);
  // The reversed order frees old chunks late; some new chunks still reuse, and every value arrives.
  std::reverse(order.begin(), order.end());
  Built c = build(order, &b);
  const HostBufferStats reversed = c.store->stats().host_buffers;
  EXPECT_GT(reversed.reuses, 0);
  EXPECT_EQ(reversed.allocations + reversed.reuses, chunks);
  for (int r = 0; r < kRoles; ++r) {
    for (int64_t j = 0; j < static_cast<int64_t>(kNumels.size()); ++j) {
      EXPECT_TRUE(torch::equal(c.store->view(c.roles[r].tensors[j]), value_of(r, j))) << "role " << r << " tensor " << j;
    }
  }
  EXPECT_EQ(b.store->host_cache_bytes(), 0);
}

void expect_values(const Built& b) {
  for (int r = 0; r < kRoles; ++r) {
    for (int64_t j = 0; j < static_cast<int64_t>(kNumels.size()); ++j) {
      EXPECT_TRUE(torch::equal(b.store->view(b.roles[r].tensors[j]), value_of(r, j))) << "role " << r << " tensor " << j;
    }
  }
}

TEST(Repack, NewChunksStayOnTheDeviceWhereTheirValuesAreAndThereIsRoom) {
  // Note [Repack stays on the device]. Old chunks 0 and 1 of each role are on the (simulated) device,
  // the rest on the host; the new order mixes them, so some new chunks draw only on device chunks,
  // some only on host chunks and some on both.
  auto accountant = std::make_shared<DeviceAccountant>();
  ChunkStoreOptions options = simulated();
  options.accountant = accountant;
  std::vector<int64_t> order(kNumels.size());
  std::iota(order.begin(), order.end(), 0);
  const std::vector<int64_t> mixed = {0, 4, 1, 2, 3, 5, 6, 7};
  auto old_store = [&] {
    Built a = build(order, nullptr, options);
    for (int r = 0; r < kRoles; ++r) {
      for (int64_t i : {0, 1}) a.store->move(a.roles[r].chunks[i], Location::kDevice);
    }
    return a;
  };
  // Where each new chunk's values are: all on the device (1), none (0) or some (-1).
  auto sources = [&](const Built& a, const ChunkLayout& next, int r, int64_t i) {
    int on = 0, off = 0;
    for (int64_t j : next.chunks()[i].tensors) {
      (a.store->location(a.store->tensor_info(a.roles[r].tensors[j]).chunk) == Location::kDevice ? on : off) += 1;
    }
    return off == 0 ? 1 : on == 0 ? 0 : -1;
  };

  {  // Unlimited room: exactly the chunks whose values are all on the device are built there.
    Built a = old_store();
    const int64_t old_device = accountant->current_bytes();
    std::vector<std::vector<int>> where(kRoles);
    PackOptions pack;
    pack.chunk_numel = 256;
    const ChunkLayout next = ChunkLayout::pack(kNumels, mixed, pack);
    // The new layout's chunks, classified against the old store before the repack drains it.
    for (int r = 0; r < kRoles; ++r) {
      for (int64_t i = 0; i < next.num_chunks(); ++i) where[r].push_back(sources(a, next, r, i));
    }
    std::set<int> kinds(where[0].begin(), where[0].end());
    ASSERT_EQ(kinds, (std::set<int>{-1, 0, 1})) << "the test needs all three kinds of new chunk";
    accountant->reset_peak();
    FillPlacement keep;
    keep.keep_on_device = true;
    Built b = build(mixed, &a, options, keep);
    expect_values(b);
    for (int r = 0; r < kRoles; ++r) {
      for (int64_t i = 0; i < b.layout.num_chunks(); ++i) {
        EXPECT_EQ(b.store->location(b.roles[r].chunks[i]), where[r][i] == 1 ? Location::kDevice : Location::kHost)
            << "role " << r << " chunk " << i << " (sources " << where[r][i] << ")";
      }
    }
    EXPECT_EQ(a.store->stats().device.current_bytes, 0) << "every old chunk retired";
    EXPECT_EQ(b.store->stats().moves.h2d_count + b.store->stats().moves.d2h_count, 0) << "built in place, no moves";
    EXPECT_GT(accountant->peak_bytes(), old_device) << "device chunks were built beside the old ones";
  }
  {  // The default places every new chunk on the host, as a first build does.
    Built a = old_store();
    Built b = build(mixed, &a, options);
    expect_values(b);
    EXPECT_EQ(b.store->stats().device.current_bytes, 0);
  }
  {  // Room for one chunk beyond the old device chunks: the device never holds more, nothing is evicted
    // for it, and the chunks that do not fit go to the host.
    Built a = old_store();
    const int64_t room = accountant->current_bytes() + 256 * 4;
    accountant->reset_peak();
    FillPlacement tight;
    tight.keep_on_device = true;
    tight.device_room_bytes = room;
    Built b = build(mixed, &a, options, tight);
    expect_values(b);
    EXPECT_LE(accountant->peak_bytes(), room);
    EXPECT_GT(b.store->stats().device.current_bytes, 0) << "some chunk still fitted";
    EXPECT_EQ(b.store->stats().moves.evictions, 0);
    EXPECT_EQ(a.store->stats().moves.evictions, 0);
  }
  {  // The new store's own budget holds too: a chunk it cannot take without evicting goes to the host.
    Built a = old_store();
    ChunkStoreOptions budgeted = options;
    budgeted.device_budget_bytes = 256 * 4;
    FillPlacement keep;
    keep.keep_on_device = true;
    Built b = build(mixed, &a, budgeted, keep);
    expect_values(b);
    EXPECT_LE(b.store->stats().device.peak_bytes, 256 * 4);
    EXPECT_EQ(b.store->stats().moves.evictions, 0);
  }
}

TEST(Repack, BadInputIsRefused) {
  std::vector<int64_t> order(kNumels.size());
  std::iota(order.begin(), order.end(), 0);
  Built a = build(order, nullptr);
  ChunkStore to(simulated());
  PackOptions pack;
  pack.chunk_numel = 256;
  const ChunkLayout layout = ChunkLayout::pack(kNumels, order, pack);
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t n : kNumels) shapes.push_back({n});
  const auto role = to.add_layout(ChunkRole::kParam, at::kFloat, layout, shapes, Location::kNone);
  try {
    fill_layout(to, layout, {role}, a.store.get(), {}, [](int, int64_t, TensorId) {});
    ADD_FAILURE() << "a migration without its source slots must fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 roles to fill but 0 to migrate from"), std::string::npos) << e.what();
  }
  // A source tensor in COMPUTE cannot be retired: the repack fails rather than pull memory from under it.
  a.store->access(a.roles[0].tensors[0]);
  ChunkStore to2(simulated());
  const auto role2 = to2.add_layout(ChunkRole::kParam, at::kFloat, layout, shapes, Location::kNone);
  EXPECT_THROW(fill_layout(to2, layout, {role2}, a.store.get(), {a.roles[0].tensors},
                           [&](int, int64_t j, TensorId slot) {
                             to2.set_state(slot, TensorState::kHold);
                             to2.view(slot).copy_(a.store->view(a.roles[0].tensors[j]));
                           }),
               c10::Error);
  a.store->release(a.roles[0].tensors[0], TensorState::kHold);
}

}  // namespace
}  // namespace ferry
