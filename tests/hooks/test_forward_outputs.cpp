// ForwardOutputs (hooks/forward_outputs.h) on plain autograd graphs: a graph awaits a backward while a
// watched output is alive and not backwarded, or while a parameter's gradient accumulator is alive and
// no watched output was backwarded (Note [Several forwards]).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>
#include <utility>

#include "../../hooks/forward_outputs.h"

namespace ferry {
namespace {

TEST(ForwardOutputs, AnOutputAwaitsItsBackwardUntilOneThatFreesTheGraphRan) {
  const at::Tensor w = torch::ones({3}).requires_grad_();
  ForwardOutputs outputs;
  at::Tensor loss = (w * 2).sum();
  outputs.note(loss);
  EXPECT_EQ(outputs.size(), 1u);
  EXPECT_TRUE(outputs.graph_awaits_backward({w}));
  loss.backward(/*gradient=*/{}, /*retain_graph=*/true);
  EXPECT_TRUE(outputs.graph_awaits_backward({w})) << "a backward that keeps the graph leaves it to a later one";
  loss.backward();
  EXPECT_FALSE(outputs.graph_awaits_backward({w})) << "backwarded: the held loss awaits nothing";
  outputs.clear();
  EXPECT_EQ(outputs.size(), 0u);
}

TEST(ForwardOutputs, TensorsAreFoundInVectorsPairsAndTuplesOnceEach) {
  const at::Tensor w = torch::ones({3}).requires_grad_();
  ForwardOutputs outputs;
  const at::Tensor a = w * 2, b = w + 1;
  outputs.note(std::make_tuple(std::make_pair(a, a), std::vector<at::Tensor>{b}, 7));
  EXPECT_EQ(outputs.size(), 2u) << "a returned twice is one node; the int is not looked into";
  outputs.note(w);
  EXPECT_EQ(outputs.size(), 2u) << "a leaf has no node";
  {
    at::NoGradGuard no_grad;
    outputs.note(w * 3);
  }
  EXPECT_EQ(outputs.size(), 2u) << "nothing under NoGradGuard";
}

TEST(ForwardOutputs, WithoutOutputsTheParametersAccumulatorsTell) {
  const at::Tensor w = torch::ones({3}).requires_grad_();
  const at::Tensor frozen = torch::ones({3});
  ForwardOutputs outputs;
  {
    const at::Tensor hidden = (w * 2).sum();  // returned inside a struct: not watched
    EXPECT_TRUE(outputs.graph_awaits_backward({w})) << "the graph holds w's accumulator";
    EXPECT_FALSE(outputs.graph_awaits_backward({frozen}));
  }
  EXPECT_FALSE(outputs.graph_awaits_backward({w})) << "the graph is gone";
  // An output that was dropped unbackwarded awaits nothing either.
  outputs.note((w * 2).sum());
  EXPECT_FALSE(outputs.graph_awaits_backward({w}));
}

}  // namespace
}  // namespace ferry
