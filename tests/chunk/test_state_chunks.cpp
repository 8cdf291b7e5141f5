// StateChunks (chunk/state_chunks.h): a group per layout chunk with one fp32 chunk per role; built with
// initial values, migrated to a layout in another order with every value kept, groups moved as units
// and charged to a shared device accountant by role.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

#include "../../chunk/state_chunks.h"
#include "../test_util.h"

namespace ferry {
namespace {

struct Tensors {
  std::vector<int64_t> numels;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> order;  // packing order: as given
  PackOptions pack;
};
Tensors tensors_of(std::vector<int64_t> numels) {
  Tensors t;
  t.numels = std::move(numels);
  for (int64_t n : t.numels) t.shapes.push_back({n});
  t.order.resize(t.numels.size());
  std::iota(t.order.begin(), t.order.end(), 0);
  t.pack.chunk_numel = 256;
  return t;
}

TEST(StateChunks, BuildsMigratesAndMovesGroups) {
  Tensors t = tensors_of({100, 60, 200, 30, 90, 150});
  const std::vector<int64_t>& numels = t.numels;
  const auto& shapes = t.shapes;
  auto& order = t.order;
  const PackOptions& pack = t.pack;
  const ChunkLayout a = ChunkLayout::pack(numels, order, pack);
  auto accountant = std::make_shared<DeviceAccountant>();
  ChunkStoreOptions options;
  options.device = DeviceKind::kSimulated;
  options.accountant = accountant;
  StateChunks state(options, {ChunkRole::kMaster, ChunkRole::kExpAvg});
  state.build(a, shapes, [&](int r, int64_t j, const at::Tensor& slot) {
    if (r == 0) slot.fill_(static_cast<double>(j) + 0.25);
  });
  ASSERT_EQ(state.num_groups(), a.num_chunks());
  EXPECT_EQ(state.group_bytes(0), 2 * a.chunks()[0].numel * 4);
  for (int64_t j = 0; j < static_cast<int64_t>(numels.size()); ++j) {
    EXPECT_TRUE(torch::equal(state.view(0, j), torch::full({numels[j]}, j + 0.25))) << j;
    EXPECT_TRUE(torch::equal(state.view(1, j), torch::zeros({numels[j]}))) << "other roles start at zero";
  }
  state.move_group(1, Location::kDevice);
  EXPECT_EQ(accountant->current_bytes(), state.group_bytes(1));
  EXPECT_EQ(accountant->bytes_by_role()[static_cast<int>(ChunkRole::kExpAvg)], a.chunks()[1].numel * 4);
  std::reverse(order.begin(), order.end());
  const ChunkLayout b = ChunkLayout::pack(numels, order, pack);
  state.build(b, shapes);  // a repack: the values migrate; the old store's device group goes with it
  EXPECT_EQ(accountant->current_bytes(), 0);
  EXPECT_GT(state.last_migration_peak_bytes(), 0);
  for (int64_t j = 0; j < static_cast<int64_t>(numels.size()); ++j) {
    EXPECT_TRUE(torch::equal(state.view(0, j), torch::full({numels[j]}, j + 0.25))) << j;
    EXPECT_EQ(state.store().tensor_info(state.tensor(0, j)).chunk, state.chunk(0, b.slots()[j].chunk))
        << "tensor " << j << " sits in its new layout chunk's group";
  }
  EXPECT_THROW(StateChunks(options, std::vector<ChunkRole>{}), c10::Error);
}

TEST(StateChunks, DroppedRolesFreeTheirMemoryAndRefuseUseAndRepack) {
  // Sharding across ranks: a group whose state another rank holds drops it.
  const Tensors t = tensors_of({100, 60, 200, 30});
  const std::vector<int64_t>& numels = t.numels;
  const auto& shapes = t.shapes;
  const ChunkLayout layout = ChunkLayout::pack(numels, t.order, t.pack);
  ASSERT_GE(layout.num_chunks(), 2);
  ChunkStoreOptions options;
  options.device = DeviceKind::kSimulated;
  StateChunks state(options, {ChunkRole::kMaster, ChunkRole::kExpAvg, ChunkRole::kGrad});
  state.build(layout, shapes, [&](int r, int64_t j, const at::Tensor& slot) { slot.fill_(static_cast<double>(j)); });
  const int64_t before = state.store().stats().host.current_bytes;
  const int64_t group0 = state.group_bytes(0);
  state.drop(0, {0, 1});  // master and exp_avg go; the gradient role stays
  EXPECT_FALSE(state.held(0, 0));
  EXPECT_TRUE(state.held(2, 0));
  EXPECT_TRUE(state.any_dropped());
  EXPECT_EQ(state.group_bytes(0), group0 / 3) << "only the held role counts";
  EXPECT_EQ(state.store().stats().host.current_bytes, before - 2 * group0 / 3) << "the payloads are freed";
  const int64_t in_group0 = layout.chunks()[0].tensors[0];
  EXPECT_NE(test::error_of([&] { state.view(0, in_group0); }).find("of chunk group 0 is held by another rank"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { state.move_group(0, Location::kDevice); }).find("held by another rank"),
            std::string::npos);
  EXPECT_TRUE(torch::equal(state.view(2, in_group0), torch::full({numels[in_group0]}, in_group0 * 1.0)));
  const int64_t in_group1 = layout.chunks()[1].tensors[0];
  EXPECT_TRUE(torch::equal(state.view(0, in_group1), torch::full({numels[in_group1]}, in_group1 * 1.0)));
  EXPECT_NE(test::error_of([&] { state.build(layout, shapes); }).find("repacked after the optimizer state was sharded"),
            std::string::npos);
}

// D46: the moments start at zero, so their chunks get memory only when first touched; placed on the
// device they are made there (no copy of zeros); a rank that drops them before never allocates them;
// a repack keeps an untouched role untouched and migrates a touched one.
TEST(StateChunks, ZeroRolesGetMemoryOnlyWhenFirstTouched) {
  Tensors t = tensors_of({100, 60, 200, 30, 90, 150});
  const ChunkLayout a = ChunkLayout::pack(t.numels, t.order, t.pack);
  ASSERT_GE(a.num_chunks(), 3);
  auto accountant = std::make_shared<DeviceAccountant>();
  ChunkStoreOptions options;
  options.device = DeviceKind::kSimulated;
  options.accountant = accountant;
  StateChunks state(options, {ChunkRole::kMaster, ChunkRole::kExpAvg, ChunkRole::kExpAvgSq}, {1, 2});
  state.build(a, t.shapes, [&](int r, int64_t j, const at::Tensor& slot) {
    ASSERT_EQ(r, 0) << "only the master role is filled";
    slot.fill_(static_cast<double>(j) + 0.5);
  });
  auto host_bytes = [&] { return state.store().stats().host.current_bytes; };
  int64_t masters = 0;
  for (const ChunkExtent& e : a.chunks()) masters += e.numel * 4;
  EXPECT_EQ(host_bytes(), masters) << "the moments have no memory yet";
  for (int64_t g = 0; g < a.num_chunks(); ++g) EXPECT_FALSE(state.allocated(1, g));
  EXPECT_EQ(state.group_bytes(0), 3 * a.chunks()[0].numel * 4) << "placement plans with the full size";
  // Touched: zeros, on the host.
  EXPECT_TRUE(torch::equal(state.view(1, 0), torch::zeros({t.numels[0]})));
  EXPECT_TRUE(state.allocated(1, a.slots()[0].chunk));
  EXPECT_EQ(host_bytes(), masters + a.chunks()[a.slots()[0].chunk].numel * 4);
  // Placed on the device: made there, nothing copied.
  const int64_t g = a.num_chunks() - 1;
  state.move_group(g, Location::kDevice);
  EXPECT_EQ(state.store().stats().moves.h2d_count, 1) << "only the master moved";
  EXPECT_EQ(accountant->bytes_by_role()[static_cast<int>(ChunkRole::kExpAvgSq)], a.chunks()[g].numel * 4);
  EXPECT_TRUE(torch::equal(state.payload(2, g).cpu(), torch::zeros({a.chunks()[g].numel})));
  // Dropped before being touched: nothing to free, and views refuse.
  const int64_t before = host_bytes();
  state.drop(1, {1, 2});
  EXPECT_EQ(host_bytes(), before);
  EXPECT_THROW(state.payload(1, 1), c10::Error);
}

TEST(StateChunks, ARepackKeepsUntouchedZeroRolesUntouchedAndMigratesTouchedOnes) {
  Tensors t = tensors_of({100, 60, 200, 30, 90, 150});
  const ChunkLayout a = ChunkLayout::pack(t.numels, t.order, t.pack);
  ChunkStoreOptions options;
  options.device = DeviceKind::kSimulated;
  StateChunks state(options, {ChunkRole::kMaster, ChunkRole::kExpAvg, ChunkRole::kExpAvgSq}, {1, 2});
  state.build(a, t.shapes, [&](int, int64_t j, const at::Tensor& slot) { slot.fill_(static_cast<double>(j)); });
  state.view(1, 2).fill_(7.0);  // exp_avg touched in one group; exp_avg_sq never
  std::reverse(t.order.begin(), t.order.end());
  const ChunkLayout b = ChunkLayout::pack(t.numels, t.order, t.pack);
  state.build(b, t.shapes);
  for (int64_t g = 0; g < b.num_chunks(); ++g) {
    EXPECT_TRUE(state.allocated(1, g)) << "a touched role is migrated whole";
    EXPECT_FALSE(state.allocated(2, g)) << "an untouched role stays without memory";
  }
  for (int64_t j = 0; j < static_cast<int64_t>(t.numels.size()); ++j) {
    EXPECT_TRUE(torch::equal(state.view(0, j), torch::full({t.numels[j]}, static_cast<double>(j)))) << j;
    EXPECT_TRUE(torch::equal(state.view(1, j), torch::full({t.numels[j]}, j == 2 ? 7.0 : 0.0))) << j;
    EXPECT_TRUE(torch::equal(state.view(2, j), torch::zeros({t.numels[j]}))) << j;
  }
}

// The compact format's roles (cpu_adam/compact_state.h): a bf16 master, uint8 moment codes and fp32
// per-block scales in a derived layout. Every role has its dtype and shape; a group's bytes are its real
// bytes and equal the on-paper count; initial values, a repack and moves keep every role's values with
// its tensor, the scales included.
TEST(StateChunks, RolesOfTheirOwnDtypeAndBlockedRolesKeepTheirValues) {
  Tensors t = tensors_of({100, 60, 200, 30, 0, 300, 90});  // 300 > 256: a dedicated chunk; 0: an empty slot
  const ChunkLayout a = ChunkLayout::pack(t.numels, t.order, t.pack);
  const std::vector<StateRoleSpec> specs = {{ChunkRole::kMaster, at::kBFloat16},
                                            {ChunkRole::kExpAvg, at::kByte, /*zero=*/true},
                                            {ChunkRole::kExpAvgSq, at::kByte, /*zero=*/true},
                                            {ChunkRole::kScales, at::kFloat, false, /*block=*/64, /*per_block=*/2}};
  auto accountant = std::make_shared<DeviceAccountant>();
  ChunkStoreOptions options;
  options.device = DeviceKind::kSimulated;
  options.accountant = accountant;
  StateChunks state(options, specs);
  auto blocks = [](int64_t n) { return (n + 63) / 64; };
  state.build(a, t.shapes, [&](int r, int64_t j, const at::Tensor& slot) {
    if (r == 0) slot.fill_(static_cast<double>(j) + 0.5);
    if (r == 3) slot.copy_(torch::arange(slot.numel(), torch::kFloat) + 1000 * j);
  });
  const std::vector<int64_t> paper = StateChunks::group_bytes_for(a, specs);
  ASSERT_EQ(static_cast<int64_t>(paper.size()), a.num_chunks());
  for (int64_t g = 0; g < a.num_chunks(); ++g) {
    EXPECT_EQ(state.group_bytes(g), paper[g]) << "group " << g << ": built and on paper";
    // master 2 B + two codes 1 B each per element of the parameter chunk, plus the scales chunk.
    EXPECT_GE(paper[g], 4 * a.chunks()[g].numel);
    EXPECT_LT(paper[g], 4 * a.chunks()[g].numel + 8 * (a.chunks()[g].numel / 64 + 16 * 8)) << g;
  }
  auto check = [&](const char* when) {
    for (int64_t j = 0; j < static_cast<int64_t>(t.numels.size()); ++j) {
      const int64_t n = t.numels[j];
      EXPECT_EQ(state.view(0, j).scalar_type(), at::kBFloat16);
      EXPECT_TRUE(torch::equal(state.view(0, j), torch::full({n}, j + 0.5, torch::kBFloat16))) << when << " " << j;
      EXPECT_EQ(state.view(1, j).scalar_type(), at::kByte);
      EXPECT_TRUE(torch::equal(state.view(2, j), torch::zeros({n}, torch::kByte))) << when << " " << j;
      const at::Tensor scales = state.view(3, j);
      ASSERT_EQ(scales.sizes(), at::IntArrayRef({2 * blocks(n)})) << when << " " << j;
      EXPECT_TRUE(torch::equal(scales, torch::arange(2 * blocks(n), torch::kFloat) + 1000 * j)) << when << " " << j;
    }
  };
  check("built");
  state.view(1, 2).fill_(7);  // touches exp_avg's group of tensor 2: it gets memory and migrates
  state.move_group(a.slots()[5].chunk, Location::kDevice);
  EXPECT_EQ(accountant->bytes_by_role()[static_cast<int>(ChunkRole::kScales)],
            state.store().chunk_info(state.chunk(3, a.slots()[5].chunk)).nbytes);
  check("moved");
  std::reverse(t.order.begin(), t.order.end());
  const ChunkLayout b = ChunkLayout::pack(t.numels, t.order, t.pack);
  state.build(b, t.shapes);
  check("repacked");
  EXPECT_TRUE(torch::equal(state.view(1, 2), torch::full({200}, 7, torch::kByte)));
  for (int64_t j = 0; j < static_cast<int64_t>(t.numels.size()); ++j) {
    EXPECT_EQ(state.store().tensor_info(state.tensor(3, j)).chunk, state.chunk(3, b.slots()[j].chunk))
        << "tensor " << j << "'s scales sit in its new group";
  }
  EXPECT_ERROR_HAS(StateChunks(options, {{ChunkRole::kExpAvg, at::kHalf}}), "exp_avg chunks hold float or uint8");
  EXPECT_ERROR_HAS(StateChunks(options, {{ChunkRole::kScales, at::kFloat, false, 64, 0}}),
                   "needs block and per_block both 0");
}

}  // namespace
}  // namespace ferry
