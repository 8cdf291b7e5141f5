// OutOfMemoryError: a c10::OutOfMemoryError (code catching torch's OOM catches it), whose message names
// the tier, what the bytes were for, the needed bytes, the budget, the used, in-compute and evictable
// bytes and what to try; the smallest workable device budget when the chunks in COMPUTE and the request
// cannot fit together. The shortfall is kept as given.
#include <gtest/gtest.h>

#include <string>

#include "../../chunk/out_of_memory.h"
#include "../../common/config.h"

namespace ferry {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TierShortfall device_shortfall() {
  TierShortfall s;
  s.tier = Tier::kDevice;
  s.needed = 3 * kMiB;
  s.budget = 8 * kMiB;
  s.used = 7 * kMiB;
  s.in_compute = 2 * kMiB;
  s.evictable = 1 * kMiB + 512 * 1024;
  s.what = "chunk 3 (param, bfloat16)";
  return s;
}

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

TEST(OutOfMemoryError, IsTorchsOutOfMemoryErrorAndKeepsTheShortfall) {
  const TierShortfall s = device_shortfall();
  try {
    throw OutOfMemoryError(s);
  } catch (const c10::OutOfMemoryError& e) {  // as torch's own OOM is caught
    const auto* ours = dynamic_cast<const OutOfMemoryError*>(&e);
    ASSERT_NE(ours, nullptr);
    EXPECT_EQ(ours->shortfall().tier, Tier::kDevice);
    EXPECT_EQ(ours->shortfall().needed, s.needed);
    EXPECT_EQ(ours->shortfall().budget, s.budget);
    EXPECT_EQ(ours->shortfall().used, s.used);
    EXPECT_EQ(ours->shortfall().in_compute, s.in_compute);
    EXPECT_EQ(ours->shortfall().evictable, s.evictable);
    EXPECT_EQ(ours->shortfall().what, s.what);
  } catch (...) {
    FAIL() << "not a c10::OutOfMemoryError";
  }
  EXPECT_THROW(throw OutOfMemoryError(s), c10::Error) << "and so a c10::Error";
}

TEST(OutOfMemoryError, TheMessageNamesEveryNumber) {
  const TierShortfall s = device_shortfall();
  const std::string msg = OutOfMemoryError(s).what_without_backtrace();
  EXPECT_TRUE(has(msg, "out of device chunk memory")) << msg;
  EXPECT_TRUE(has(msg, "chunk 3 (param, bfloat16) needs 3.0 MiB")) << msg;
  EXPECT_TRUE(has(msg, "the device budget is 8.0 MiB")) << msg;
  EXPECT_TRUE(has(msg, "with 7.0 MiB used")) << msg;
  EXPECT_TRUE(has(msg, "2.0 MiB in COMPUTE (cannot move)")) << msg;
  EXPECT_TRUE(has(msg, "1.5 MiB evictable")) << msg;
  EXPECT_TRUE(has(msg, "Raise device_budget, lower chunk_size_bytes")) << msg;
  // 2 MiB in COMPUTE + 3 MiB needed fit in 8 MiB: no "smallest budget" line.
  EXPECT_FALSE(has(msg, "This op needs at least")) << msg;
  EXPECT_FALSE(has(msg, "host_budget")) << msg;
}

// When the chunks in COMPUTE and the request exceed the budget together, no eviction can help: the
// message says the smallest budget this op can run with (in_compute + needed).
TEST(OutOfMemoryError, NamesTheSmallestWorkableDeviceBudget) {
  TierShortfall s = device_shortfall();
  s.in_compute = 6 * kMiB;
  s.evictable = 0;
  const std::string msg = OutOfMemoryError(s).what_without_backtrace();
  EXPECT_TRUE(has(msg, "This op needs at least 9.0 MiB of chunks on the device at once (6.0 MiB in COMPUTE + 3.0 MiB)"))
      << msg;
  EXPECT_TRUE(has(msg, "0 B evictable")) << msg;
  // Exactly at the budget it fits: no such line.
  s.in_compute = 5 * kMiB;
  EXPECT_FALSE(has(OutOfMemoryError(s).what_without_backtrace(), "This op needs at least"));
}

TEST(OutOfMemoryError, TheHostTierSaysWhatToTryThere) {
  TierShortfall s;
  s.tier = Tier::kHost;
  s.needed = 4096;
  s.budget = 8192;
  s.used = 8000;
  s.in_compute = 0;
  s.evictable = 0;
  s.what = "chunk 0 (master, float)";
  const std::string msg = OutOfMemoryError(s).what_without_backtrace();
  EXPECT_TRUE(has(msg, "out of host chunk memory")) << msg;
  EXPECT_TRUE(has(msg, "needs " + format_bytes(4096))) << msg;
  EXPECT_TRUE(has(msg, "the host budget is " + format_bytes(8192))) << msg;
  EXPECT_TRUE(has(msg, "with " + format_bytes(8000) + " used")) << msg;
  EXPECT_TRUE(has(msg, "Raise host_budget, or keep more chunks on the device")) << msg;
  EXPECT_FALSE(has(msg, "device_budget")) << msg;
  EXPECT_FALSE(has(msg, "This op needs at least")) << "a device-only hint: " << msg;
}

}  // namespace
}  // namespace ferry
