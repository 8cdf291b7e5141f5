// CopyEngine's simulated engine and the clock marks: a copy is done when copy() returns (the bytes are
// there, the ticket is done, waits are no-ops); an untimed copy has no marks, a timed one has a start
// and a finish on the host's clock that bracket the copy inside the call; marks refuse to compare when
// unrecorded or of another kind; ClockAnchor places marks on the host's clock, both where the device's
// clock is the host's and, through its wait, where it is not (a fake device clock with an offset).
// Which engine a device makes: test_device.cpp.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <string>
#include <thread>

#include "../../chunk/copy_engine.h"
#include "../../common/event_trace.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

TEST(SimulatedCopyEngine, DescribesItsDevice) {
  const auto engine = make_simulated_copy_engine();
  ASSERT_NE(engine, nullptr);
  EXPECT_STREQ(engine->name(), "simulated");
  EXPECT_EQ(engine->device(), c10::Device(c10::kCPU));
  EXPECT_EQ(engine->device_allocator(), c10::GetCPUAllocator());
  EXPECT_FALSE(engine->pinned_host()) << "the simulated device pins nothing";
  EXPECT_STREQ(make_simulated_copy_engine()->name(), "simulated");
}

TEST(SimulatedCopyEngine, ACopyIsDoneWhenCopyReturns) {
  const auto engine = make_simulated_copy_engine();
  torch::manual_seed(0);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kByte}) {
    const torch::Tensor src = torch::randint(0, 100, {1000}).to(dtype);
    torch::Tensor dst = torch::zeros({1000}, dtype);
    auto ticket = engine->copy(dst, src, CopyTiming::kUntimed);
    ASSERT_NE(ticket, nullptr);
    EXPECT_TRUE(torch::equal(dst, src)) << "the bytes are there on return, before any wait";
    EXPECT_TRUE(ticket->done());
    ticket->wait();
    ticket->order_before_compute();
    EXPECT_TRUE(ticket->done());
    EXPECT_EQ(ticket->started, nullptr) << "untimed: no marks";
    EXPECT_EQ(ticket->finished, nullptr);
    EXPECT_FALSE(ticket->ordered_before_compute) << "the store's flag, not the engine's";
    EXPECT_EQ(ticket->issued_ns, 0);
  }
  // The engine checks its own preconditions (same numel and dtype) as invariants.
  torch::Tensor short_dst = torch::zeros({10});
  EXPECT_THROW(engine->copy(short_dst, torch::ones({11}), CopyTiming::kUntimed), c10::Error);
  torch::Tensor int_dst = torch::zeros({10}, torch::kInt);
  EXPECT_THROW(engine->copy(int_dst, torch::ones({10}), CopyTiming::kUntimed), c10::Error);
}

TEST(SimulatedCopyEngine, ATimedCopyIsBracketedByItsMarksOnTheHostClock) {
  const auto engine = make_simulated_copy_engine();
  const torch::Tensor src = torch::randn({1 << 20});
  torch::Tensor dst = torch::empty({1 << 20});
  const int64_t before = trace::now_ns();
  auto ticket = engine->copy(dst, src, CopyTiming::kTimed);
  const int64_t after = trace::now_ns();
  EXPECT_TRUE(torch::equal(dst, src));
  ASSERT_NE(ticket->started, nullptr);
  ASSERT_NE(ticket->finished, nullptr);
  ASSERT_TRUE(ticket->started->recorded());
  ASSERT_TRUE(ticket->finished->recorded());
  const int64_t s = ticket->started->host_clock_ns(), f = ticket->finished->host_clock_ns();
  EXPECT_LE(before, s);
  EXPECT_LE(s, f);
  EXPECT_LE(f, after) << "the copy ran inside the call";
  EXPECT_DOUBLE_EQ(ticket->finished->seconds_since(*ticket->started), (f - s) * 1e-9);
  EXPECT_GT(f - s, 0) << "copying 4 MiB takes time";
}

// A mark of another device's kind: its own clock, the host's plus `offset_ns`, and no host clock.
class OffsetClockMark final : public StreamMark {
 public:
  explicit OffsetClockMark(int64_t offset_ns) : offset_ns_(offset_ns) {}
  void record() override { ns_ = trace::now_ns() + offset_ns_; }
  bool recorded() const override { return ns_ >= 0; }
  double seconds_since(const StreamMark& earlier) const override {
    const auto& e = dynamic_cast<const OffsetClockMark&>(earlier);
    ++waits;
    return static_cast<double>(ns_ - e.ns_) * 1e-9;
  }
  mutable int waits = 0;

 private:
  int64_t offset_ns_;
  int64_t ns_ = -1;
};

TEST(StreamMark, HostClockMarksRefuseUnrecordedOrForeignMarks) {
  const auto engine = make_simulated_copy_engine();
  auto a = engine->make_mark(), b = engine->make_mark();
  EXPECT_FALSE(a->recorded());
  EXPECT_EQ(a->host_clock_ns(), -1) << "unrecorded";
  EXPECT_ERROR_HAS((void)b->seconds_since(*a), "both marks must be recorded first");
  a->record();
  EXPECT_ERROR_HAS((void)b->seconds_since(*a), "both marks must be recorded first");
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  b->record();
  EXPECT_GE(b->seconds_since(*a), 0.002);
  EXPECT_LE(a->seconds_since(*b), -0.002) << "signed: earlier minus later";
  const OffsetClockMark foreign(0);
  EXPECT_ERROR_HAS((void)b->seconds_since(foreign), "the earlier mark is of another device's kind");
  // record() again moves the mark.
  const int64_t first = a->host_clock_ns();
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  a->record();
  EXPECT_GT(a->host_clock_ns(), first);
}

// Where the device's clock is not the host's (host_clock_ns() == -1), the anchor waits for its mark
// and takes the host's clock then: a mark of that device, before or after the anchor, lands on the
// host's clock where it was recorded (to the anchor's wake-up, here the duration of a call), although
// the device's clock is a second off.
TEST(ClockAnchor, PlacesAnotherClocksMarksOnTheHostClockThroughItsWait) {
  constexpr int64_t kOffset = 1'000'000'000;  // the device's clock reads one second ahead
  const auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(3)); };
  OffsetClockMark before(kOffset);
  const int64_t before_lo = trace::now_ns();
  before.record();
  const int64_t before_hi = trace::now_ns();
  pause();
  auto anchor_mark = std::make_unique<OffsetClockMark>(kOffset);
  const OffsetClockMark* anchor_view = anchor_mark.get();
  const int64_t anchor_lo = trace::now_ns();
  const ClockAnchor anchor(std::move(anchor_mark));
  const int64_t anchor_hi = trace::now_ns();
  EXPECT_GE(anchor_view->waits, 1) << "the anchor waited for its mark";
  pause();
  OffsetClockMark after(kOffset);
  const int64_t after_lo = trace::now_ns();
  after.record();
  const int64_t after_hi = trace::now_ns();
  // The anchor's own error: the host's clock was read after its wait returned, within [lo, hi].
  const int64_t slack = anchor_hi - anchor_lo;
  const int64_t b = anchor.host_ns(before), a = anchor.host_ns(after);
  EXPECT_GE(b, before_lo - slack);
  EXPECT_LE(b, before_hi + slack);
  EXPECT_GE(a, after_lo - slack);
  EXPECT_LE(a, after_hi + slack);
  EXPECT_LT(b, a);
  EXPECT_LT(std::abs(a - after_lo), kOffset / 2) << "placed on the host's clock, not the device's";
}

TEST(ClockAnchor, NeedsAMark) { EXPECT_ERROR_HAS(ClockAnchor(nullptr), "ClockAnchor needs a mark, got none"); }

}  // namespace
}  // namespace ferry
