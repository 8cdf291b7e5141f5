// ParamTable (hooks/param_table.h) on plain modules: what it takes (tied parameters once, in order), what
// it refuses, and the check that the module still has exactly its parameters (Note [The module's
// parameters]).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../hooks/interceptor.h"
#include "../../hooks/param_table.h"
#include "../test_util.h"

namespace ferry {
namespace {

// A table and a head that shares it (tied), plus the head's bias.
struct Tied : torch::nn::Module {
  Tied() {
    table = register_parameter("table", torch::randn({10, 4}));
    head = register_module("head", std::make_shared<torch::nn::Module>());
    head->register_parameter("weight", table);  // tied: one parameter
    head->register_parameter("bias", torch::zeros({10}));
  }
  at::Tensor table;
  std::shared_ptr<torch::nn::Module> head;
};

TEST(ParamTable, TakesEachParameterOnceInRegistrationOrder) {
  auto m = std::make_shared<Tied>();
  const ParamTable table(*m, at::kFloat);
  ASSERT_EQ(table.size(), 2);
  EXPECT_EQ(table.name(0), "table");
  EXPECT_EQ(table.name(1), "head.bias");
  EXPECT_EQ(table.shapes()[0], (std::vector<int64_t>{10, 4}));
  EXPECT_EQ(table.numels(), (std::vector<int64_t>{40, 10}));
  EXPECT_TRUE(table.param(0).is_same(m->table));
  EXPECT_EQ(table.index_of(m->head->named_parameters()["weight"].unsafeGetTensorImpl()), 0) << "the tied one";
  EXPECT_EQ(table.index_of(m->head->named_parameters()["bias"].unsafeGetTensorImpl()), 1);
  const at::Tensor other = torch::zeros({3});
  EXPECT_EQ(table.index_of(other.unsafeGetTensorImpl()), -1);
}

TEST(ParamTable, RefusesWhatItCannotHold) {
  torch::nn::Module empty;
  EXPECT_NE(test::error_of([&] { ParamTable(empty, at::kFloat); }).find("no parameters to manage"), std::string::npos);
  torch::nn::Module ints;
  ints.register_parameter("index", torch::zeros({4}, torch::kLong), /*requires_grad=*/false);
  const std::string e = test::error_of([&] { ParamTable(ints, at::kFloat); });
  EXPECT_NE(e.find("parameter index must be a dense floating-point tensor"), std::string::npos) << e;
  EXPECT_NE(e.find("belongs in a buffer"), std::string::npos) << e;
}

struct Listener final : UseListener {
  void pre_use(int64_t) override {}
  void post_use(int64_t) override {}
};

TEST(ParamTable, RefusesAParameterAnotherModelHolds) {
  torch::nn::Linear linear(4, 4);
  Listener listener;
  const c10::StorageImpl* storage = linear->weight.storage().unsafeGetStorageImpl();
  register_storage(storage, &listener, {{0, 16, 0}});
  const std::string e = test::error_of([&] { ParamTable(*linear, at::kFloat); });
  unregister_storage(storage);
  EXPECT_NE(e.find("parameter weight is held by another ChunkedModel already"), std::string::npos) << e;
  EXPECT_NO_THROW(ParamTable(*linear, at::kFloat));
}

TEST(ParamTable, TheModuleMustKeepExactlyItsParameters) {
  auto m = std::make_shared<Tied>();
  const ParamTable table(*m, at::kFloat);
  EXPECT_NO_THROW(table.check_module(*m, "forward()"));
  m->register_module("adapter", torch::nn::Linear(4, 4));
  std::string e = test::error_of([&] { table.check_module(*m, "forward()"); });
  EXPECT_NE(e.find("forward(): the module's parameters are not the ones ChunkedModel wrapped"), std::string::npos) << e;
  EXPECT_NE(e.find("it has adapter.weight, adapter.bias, registered after it was wrapped"), std::string::npos) << e;
  auto n = std::make_shared<Tied>();
  const ParamTable table_n(*n, at::kFloat);
  auto fresh = std::make_shared<torch::nn::Module>();  // a new head, untied
  fresh->register_parameter("weight", torch::zeros({10, 4}));
  fresh->register_parameter("bias", torch::zeros({10}));
  n->head = n->replace_module("head", fresh);
  e = test::error_of([&] { table_n.check_module(*n, "forward()"); });
  EXPECT_NE(e.find("it has head.weight, head.bias, registered after it was wrapped; it no longer has head.bias "
                   "(replaced or removed after it was wrapped)"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace ferry
