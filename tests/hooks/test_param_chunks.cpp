// ParamChunks (hooks/param_chunks.h) on the simulated device, without a ChunkedModel: the first build
// binds the parameters and registers their storages, a repack moves them into a new layout with the
// optimizer state following, a view held outside ferry makes the repack wait, and unbind gives the
// parameters plain memory back.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../hooks/param_chunks.h"
#include "../test_util.h"

namespace ferry {
namespace {

struct Listener final : UseListener {
  void pre_use(int64_t) override {}
  void post_use(int64_t) override {}
};

struct Net : torch::nn::Module {
  Net() {
    a = register_module("a", torch::nn::Linear(32, 32));
    b = register_module("b", torch::nn::Linear(32, 32));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

ParamChunksOptions small_chunks() {
  ParamChunksOptions o;
  o.chunk_size_bytes = 4096;  // a weight's (32 x 32 fp32): several chunks
  return o;
}

TEST(ParamChunks, TheFirstBuildBindsTheParametersAndRegistersTheirStorages) {
  auto net = std::make_shared<Net>();
  const at::Tensor before = net->a->weight.detach().clone();
  const c10::TensorImpl* impl = net->a->weight.unsafeGetTensorImpl();
  const ParamTable table(*net, at::kFloat);
  Listener listener;
  const int64_t registered = registered_storages();
  {
    ParamChunks chunks(table, &listener, make_simulated_device(), at::kFloat, small_chunks());
    EXPECT_EQ(chunks.layout_version(), 1);
    EXPECT_EQ(chunks.store().num_tensors(), table.size());
    EXPECT_GT(registered_storages(), registered);
    EXPECT_TRUE(storage_registered(net->a->weight.storage().unsafeGetStorageImpl()));
    EXPECT_EQ(net->a->weight.unsafeGetTensorImpl(), impl) << "the same TensorImpl, viewing its slot";
    EXPECT_TRUE(torch::equal(chunks.store().view(chunks.tensor_of(0)), before));
    EXPECT_TRUE(torch::equal(net->a->weight.detach(), before));
    EXPECT_FALSE(chunks.any_initial_values()) << "fp32 holds the values exactly";
    EXPECT_EQ(chunks.store().stats().device.budget_bytes, 0);
  }
  EXPECT_EQ(registered_storages(), registered) << "unregistered with the chunks";
}

TEST(ParamChunks, ARepackMovesParametersAndStateIntoTheNewOrder) {
  auto net = std::make_shared<Net>();
  const ParamTable table(*net, at::kFloat);
  Listener listener;
  ParamChunks chunks(table, &listener, make_simulated_device(), at::kFloat, small_chunks());
  const std::shared_ptr<StateChunks> state = chunks.attach_state(
      {ChunkRole::kMaster}, [&](int, int64_t p, const at::Tensor& slot) { slot.copy_(table.param(p).detach()); }, {});
  const at::Tensor b_weight = net->b->weight.detach().clone();
  EXPECT_FALSE(chunks.repack_waits_for_views());
  chunks.repack({3, 2, 1, 0}, /*device_room_bytes=*/0);
  EXPECT_EQ(chunks.layout_version(), 2);
  EXPECT_GE(chunks.layout().num_chunks(), 2);
  EXPECT_EQ(chunks.chunk_of(3), chunks.param_chunk(0)) << "b.bias is packed first now";
  EXPECT_TRUE(torch::equal(net->b->weight.detach(), b_weight)) << "values kept";
  EXPECT_TRUE(torch::equal(state->view(0, 2), b_weight)) << "the state followed, slot by slot";
  EXPECT_EQ(chunks.repack_stats().waits, 0);
  EXPECT_GT(chunks.repack_stats().peak_bytes, 0);
}

TEST(ParamChunks, AViewHeldOutsideMakesTheRepackWait) {
  auto net = std::make_shared<Net>();
  const ParamTable table(*net, at::kFloat);
  Listener listener;
  ParamChunks chunks(table, &listener, make_simulated_device(), at::kFloat, small_chunks());
  {
    const at::Tensor kept = net->a->weight.detach();  // a second holder of the chunk's storage
    test::LogLevelFor quiet(log::Level::kError);
    EXPECT_TRUE(chunks.repack_waits_for_views());
    EXPECT_TRUE(chunks.repack_waits_for_views());
  }
  EXPECT_EQ(chunks.repack_stats().waits, 2);
  EXPECT_FALSE(chunks.repack_waits_for_views()) << "the view is gone";
}

TEST(ParamChunks, LowerPrecisionKeepsTheInitialValuesAndUnbindGivesPlainMemory) {
  auto net = std::make_shared<Net>();
  const at::Tensor fp32 = net->a->weight.detach().clone();
  const ParamTable table(*net, at::kBFloat16);
  Listener listener;
  ParamChunks chunks(table, &listener, make_simulated_device(), at::kBFloat16, small_chunks());
  EXPECT_TRUE(chunks.any_initial_values());
  EXPECT_TRUE(torch::equal(chunks.initial_value(0), fp32));
  EXPECT_EQ(net->a->weight.scalar_type(), at::kBFloat16);
  chunks.release_initial_value(0);
  EXPECT_FALSE(chunks.initial_value(0).defined());
  chunks.release_initial_values();
  EXPECT_FALSE(chunks.any_initial_values());
  chunks.unbind();
  EXPECT_FALSE(chunks.bound());
  EXPECT_FALSE(storage_registered(net->a->weight.storage().unsafeGetStorageImpl()));
  EXPECT_TRUE(torch::equal(net->a->weight.detach(), fp32.to(at::kBFloat16)));
  net->a->weight.detach().add_(1);  // its own memory now: the chunk does not see it
  EXPECT_FALSE(torch::equal(chunks.store().view(chunks.tensor_of(0)), net->a->weight.detach()));
}

}  // namespace
}  // namespace ferry
