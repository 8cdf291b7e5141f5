// dist/plan_agreement.h without a group: the encoding whose element-wise maximum over ranks is the
// agreed input. Checked: one rank's input comes back as it went; the maximum of several is the
// pessimistic combination (smallest room, largest bytes and times, unmeasured anywhere unmeasured,
// backward at least the agreed recomputes); bad input is refused. The collectives themselves run in
// tests/dist/test_dist.cpp (Dist.TheActivationPlanIsTheSameOnEveryRank).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "../../dist/plan_agreement.h"
#include "../test_util.h"

namespace ferry {
namespace {

using dist::decode_max;
using dist::encode_for_max;
using test::error_of;

MemoryPlanInput input_of(int64_t room, double forward, double backward, std::vector<SegmentCost> segments) {
  MemoryPlanInput in;
  in.room_bytes = room;
  in.forward_s = forward;
  in.backward_s = backward;
  in.segments = std::move(segments);
  return in;
}

// What every rank gets: the maximum over the ranks' encodings (the all-reduce).
MemoryPlanInput agreed(const std::vector<MemoryPlanInput>& ranks) {
  at::Tensor m = encode_for_max(ranks[0]);
  for (size_t r = 1; r < ranks.size(); ++r) m = at::maximum(m, encode_for_max(ranks[r]));
  return decode_max(m);
}

TEST(PlanAgreement, OneRanksInputComesBackAsItWent) {
  const MemoryPlanInput in = input_of(123456789012, 0.25, 0.75, {{1 << 20, 0.1}, {-1, 0.0}, {0, 0.05}, {(int64_t{1} << 40) + 3, 0.2}});
  const MemoryPlanInput out = agreed({in});
  EXPECT_EQ(out.room_bytes, in.room_bytes);
  EXPECT_EQ(out.forward_s, in.forward_s);
  EXPECT_EQ(out.backward_s, in.backward_s);
  ASSERT_EQ(out.segments.size(), in.segments.size());
  for (size_t k = 0; k < in.segments.size(); ++k) {
    EXPECT_EQ(out.segments[k].saved_bytes, in.segments[k].saved_bytes) << k;
    EXPECT_EQ(out.segments[k].recompute_s, in.segments[k].recompute_s) << k;
  }
  EXPECT_EQ(agreed({input_of(-1, 0, 0, {})}).room_bytes, -1) << "no limit stays no limit";
  EXPECT_EQ(agreed({input_of(0, 0, 0, {})}).room_bytes, 0) << "no room stays no room";
}

TEST(PlanAgreement, RanksAgreeOnThePessimisticInput) {
  const MemoryPlanInput a = input_of(-1, 0.5, 1.0, {{100, 0.3}, {200, 0.1}, {-1, 0.0}});
  const MemoryPlanInput b = input_of(4096, 0.2, 0.5, {{300, 0.1}, {-1, 0.0}, {50, 0.2}});
  const MemoryPlanInput c = input_of(8192, 0.1, 0.5, {{10, 0.4}, {20, 0.05}, {60, 0.01}});
  for (const auto& order : std::vector<std::vector<MemoryPlanInput>>{{a, b, c}, {c, b, a}, {b, a, c}}) {
    const MemoryPlanInput m = agreed(order);
    EXPECT_EQ(m.room_bytes, 4096) << "the smallest room; no limit on one rank limits nothing";
    EXPECT_EQ(m.forward_s, 0.5);
    ASSERT_EQ(m.segments.size(), 3u);
    EXPECT_EQ(m.segments[0].saved_bytes, 300);
    EXPECT_EQ(m.segments[0].recompute_s, 0.4);
    EXPECT_EQ(m.segments[1].saved_bytes, -1) << "unmeasured on one rank: recomputed on all";
    EXPECT_EQ(m.segments[2].saved_bytes, -1);
    // The slowest backward (1.0 s) covers the agreed recomputes (0.4 of the measured one).
    EXPECT_EQ(m.backward_s, 1.0);
    m.validate();
  }
  // Backward at least the sum of the slowest recomputes, which may come from different ranks.
  const MemoryPlanInput x = input_of(0, 0, 0.5, {{1, 0.5}, {1, 0.0}});
  const MemoryPlanInput y = input_of(0, 0, 0.5, {{1, 0.0}, {1, 0.5}});
  const MemoryPlanInput m = agreed({x, y});
  EXPECT_DOUBLE_EQ(m.backward_s, 1.0);
  m.validate();
}

TEST(PlanAgreement, BadInputIsRefused) {
  MemoryPlanInput with_groups = input_of(0, 0, 0, {});
  with_groups.groups.push_back(GroupCost{});
  EXPECT_NE(error_of([&] { encode_for_max(with_groups); }).find("without state groups"), std::string::npos);
  EXPECT_NE(error_of([&] { encode_for_max(input_of(0, -1, 0, {})); }).find("must be >= 0"), std::string::npos);
  EXPECT_NE(error_of([&] { decode_max(at::zeros({6}, at::kDouble)); }).find("1-d double tensor"), std::string::npos);
  EXPECT_NE(error_of([&] { decode_max(at::zeros({5}, at::kFloat)); }).find("1-d double tensor"), std::string::npos);
  at::Tensor lying = encode_for_max(input_of(0, 0, 0, {{1, 0}}));
  lying[4] = 7;
  EXPECT_NE(error_of([&] { decode_max(lying); }).find("says 7 segments and holds 1"), std::string::npos);
}

}  // namespace
}  // namespace ferry
