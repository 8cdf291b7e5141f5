// StateChunks (chunk/state_chunks.h): a group per layout chunk with one fp32 chunk per role; built with
// initial values, migrated to a layout in another order with every value kept, groups moved as units
// and charged to a shared device accountant by role.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

#include "ferry/chunk/state_chunks.h"

namespace ferry {
namespace {

TEST(StateChunks, BuildsMigratesAndMovesGroups) {
  const std::vector<int64_t> numels = {100, 60, 200, 30, 90, 150};
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t n : numels) shapes.push_back({n});
  std::vector<int64_t> order(numels.size());
  std::iota(order.begin(), order.end(), 0);
  PackOptions pack;
  pack.chunk_numel = 256;
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
  EXPECT_THROW(StateChunks(options, {}), c10::Error);
}

}  // namespace
}  // namespace ferry
