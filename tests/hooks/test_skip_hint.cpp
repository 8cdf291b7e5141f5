// ferry::will_skip (hooks/skip_hint.h): which parameters a skipped module takes out of a step (its own,
// not those tied to a part outside it, nor those of a block registered twice), the refusal of another
// model's module, and the free function outside any ChunkedModel forward (nothing happens). The
// scheduler's side (what a hint passes over, a wrong hint) is in tests/scheduler; a model that says its
// skips, bit-identical to its unwrapped twin, in tests/hooks/test_chunked_model.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../hooks/param_table.h"
#include "../../hooks/skip_hint.h"
#include "../test_util.h"

namespace ferry {
namespace {

// embed -> a -> shared -> b -> shared -> head, where head's weight is embed's (registered twice, as
// a tied output projection) and `shared` is one block registered under two names.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    embed = register_module("embed", torch::nn::Linear(4, 4));
    a = register_module("a", torch::nn::Linear(4, 4));
    shared = register_module("shared", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
    register_module("shared_again", shared);
    head = register_module("head", std::make_shared<torch::nn::Module>());
    head->register_parameter("weight", embed->weight);
  }
  torch::nn::Linear embed{nullptr}, a{nullptr}, shared{nullptr}, b{nullptr};
  std::shared_ptr<torch::nn::Module> head;
};
TORCH_MODULE(Net);

std::vector<std::string> names_of(const std::vector<int64_t>& indices, const ParamTable& table) {
  std::vector<std::string> names;
  for (int64_t i : indices) names.push_back(table.name(i));
  return names;
}

TEST(SkipHint, AModuleTakesOutItsOwnParametersOnly) {
  Net net;
  const ParamTable table(*net, torch::kFloat);
  EXPECT_EQ(names_of(params_only_in(*net, *net->a, table), table), (std::vector<std::string>{"a.weight", "a.bias"}));
  // embed's weight is the head's too: skipping embed leaves it in the step, and the head alone has nothing.
  EXPECT_EQ(names_of(params_only_in(*net, *net->embed, table), table), (std::vector<std::string>{"embed.bias"}));
  EXPECT_TRUE(params_only_in(*net, *net->head, table).empty());
  // One block under two names runs twice: skipping one of its calls does not take it out.
  EXPECT_TRUE(params_only_in(*net, *net->shared, table).empty());
  // The whole model: every parameter, each once.
  EXPECT_EQ(params_only_in(*net, *net, table).size(), static_cast<size_t>(table.size()));
  // A module without parameters: nothing.
  torch::nn::ReLU relu;
  EXPECT_TRUE(params_only_in(*net, *relu, table).empty());
}

TEST(SkipHint, AnotherModelsModuleIsRefusedNamingItsParameter) {
  Net net, other;
  const ParamTable table(*net, torch::kFloat);
  const std::string message = test::error_of([&] { params_only_in(*net, *other->a, table); });
  EXPECT_NE(message.find("'weight'"), std::string::npos) << message;
  EXPECT_NE(message.find("not one of the wrapped model's"), std::string::npos) << message;
}

// What will_skip reaches: the listener of this thread's innermost Scope, and nothing outside one.
struct Recorder final : SkipListener {
  void will_skip(const torch::nn::Module& module) override { said.push_back(&module); }
  std::vector<const torch::nn::Module*> said;
};

TEST(SkipHint, WillSkipReachesTheInnermostScopeOnItsThreadOnly) {
  Net net;
  ferry::will_skip(*net->a);  // no scope: plain LibTorch, nothing happens
  Recorder outer, inner;
  {
    SkipListener::Scope scope(&outer);
    ferry::will_skip(*net->a);
    {
      SkipListener::Scope nested(&inner);
      ferry::will_skip(*net->b);
    }
    std::thread([&] { ferry::will_skip(*net->b); }).join();  // another thread has no scope
    ferry::will_skip(*net->embed);
  }
  ferry::will_skip(*net->a);
  EXPECT_EQ(outer.said, (std::vector<const torch::nn::Module*>{net->a.get(), net->embed.get()}));
  EXPECT_EQ(inner.said, (std::vector<const torch::nn::Module*>{net->b.get()}));
}

}  // namespace
}  // namespace ferry
