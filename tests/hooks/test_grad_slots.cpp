// GradSlots (hooks/grad_slots.h): which slots hold gradients, and which parameters changed requires_grad.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../hooks/grad_slots.h"

namespace ferry {
namespace {

TEST(GradSlots, MarksAndClearsEachSlotOnce) {
  GradSlots slots(4);
  EXPECT_FALSE(slots.any());
  EXPECT_EQ(slots.first(), -1);
  EXPECT_TRUE(slots.mark(2));
  EXPECT_FALSE(slots.mark(2)) << "a second gradient is added in the slot: not counted again";
  EXPECT_TRUE(slots.mark(1));
  EXPECT_EQ(slots.count(), 2);
  EXPECT_EQ(slots.first(), 1);
  EXPECT_TRUE(slots.holds_grad(2));
  EXPECT_FALSE(slots.holds_grad(0));
  slots.clear(1);
  slots.clear(1);
  slots.clear(0);
  EXPECT_EQ(slots.count(), 1);
  EXPECT_EQ(slots.first(), 2);
  slots.clear_all();
  EXPECT_FALSE(slots.any());
  EXPECT_FALSE(slots.holds_grad(2));
  EXPECT_FALSE(slots.backward_failed());
  slots.set_backward_failed(true);
  EXPECT_TRUE(slots.backward_failed());
}

TEST(GradSlots, TellsWhichParametersChangedRequiresGrad) {
  std::vector<at::Tensor> params = {torch::zeros({2}).requires_grad_(), torch::zeros({2}).requires_grad_(),
                                    torch::zeros({2})};
  GradSlots slots(3);
  slots.remember_trainable(params);
  EXPECT_TRUE(slots.trainable(0));
  EXPECT_FALSE(slots.trainable(2));
  EXPECT_EQ(slots.trainable_changed(params).count, 0);
  params[1].requires_grad_(false);
  params[2].requires_grad_(true);
  const GradSlots::Changed changed = slots.trainable_changed(params);
  EXPECT_EQ(changed.count, 2);
  EXPECT_EQ(changed.first, 1);
  EXPECT_FALSE(slots.trainable(1));
  EXPECT_EQ(slots.trainable_changed(params).count, 0) << "remembered";
}

}  // namespace
}  // namespace ferry
