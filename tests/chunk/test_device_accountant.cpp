// DeviceAccountant: charges and discharges add up by role and in total, the peak follows the total and
// resets to it, an over-discharge (of the total or of one role) is refused as a broken invariant, and
// concurrent charge/discharge pairs from several threads balance to zero.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "../../chunk/device_accountant.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

int64_t role_bytes(const DeviceAccountant& a, ChunkRole role) { return a.bytes_by_role()[static_cast<int>(role)]; }

TEST(DeviceAccountant, StartsEmpty) {
  const DeviceAccountant a;
  EXPECT_EQ(a.current_bytes(), 0);
  EXPECT_EQ(a.peak_bytes(), 0);
  for (int64_t b : a.bytes_by_role()) EXPECT_EQ(b, 0);
}

TEST(DeviceAccountant, ChargesAndDischargesByRoleAndInTotal) {
  DeviceAccountant a;
  a.charge(ChunkRole::kParam, 100);
  a.charge(ChunkRole::kMaster, 400);
  a.charge(ChunkRole::kExpAvg, 400);
  a.charge(ChunkRole::kParam, 50);
  EXPECT_EQ(a.current_bytes(), 950);
  EXPECT_EQ(role_bytes(a, ChunkRole::kParam), 150);
  EXPECT_EQ(role_bytes(a, ChunkRole::kMaster), 400);
  EXPECT_EQ(role_bytes(a, ChunkRole::kExpAvg), 400);
  EXPECT_EQ(role_bytes(a, ChunkRole::kExpAvgSq), 0);
  EXPECT_EQ(role_bytes(a, ChunkRole::kGrad), 0);
  a.discharge(ChunkRole::kMaster, 400);
  a.discharge(ChunkRole::kParam, 100);
  EXPECT_EQ(a.current_bytes(), 450);
  EXPECT_EQ(role_bytes(a, ChunkRole::kParam), 50);
  EXPECT_EQ(role_bytes(a, ChunkRole::kMaster), 0);
  // The roles always add up to the total.
  int64_t sum = 0;
  for (int64_t b : a.bytes_by_role()) sum += b;
  EXPECT_EQ(sum, a.current_bytes());
}

TEST(DeviceAccountant, PeakFollowsTheTotalAndResetsToTheCurrent) {
  DeviceAccountant a;
  a.charge(ChunkRole::kParam, 300);
  a.charge(ChunkRole::kGrad, 200);  // peak 500
  a.discharge(ChunkRole::kParam, 300);
  a.charge(ChunkRole::kExpAvgSq, 100);  // 300: below the peak
  EXPECT_EQ(a.current_bytes(), 300);
  EXPECT_EQ(a.peak_bytes(), 500) << "the peak of the total, not of any role";
  a.reset_peak();
  EXPECT_EQ(a.peak_bytes(), 300) << "reset to the current bytes, not to 0";
  a.discharge(ChunkRole::kGrad, 200);
  EXPECT_EQ(a.peak_bytes(), 300) << "a discharge never lowers the peak";
  a.charge(ChunkRole::kParam, 250);  // 350
  EXPECT_EQ(a.peak_bytes(), 350);
}

// Charges and discharges come in pairs per payload: a discharge without its charge is a broken
// invariant (TORCH_INTERNAL_ASSERT), whether it takes the total or only one role below zero.
TEST(DeviceAccountant, OverDischargeIsABrokenInvariant) {
  {
    DeviceAccountant a;
    a.charge(ChunkRole::kParam, 100);
    const std::string msg = error_of([&] { a.discharge(ChunkRole::kParam, 101); });
    EXPECT_NE(msg.find("device accountant went negative"), std::string::npos) << msg;
    EXPECT_NE(msg.find("INTERNAL ASSERT FAILED"), std::string::npos) << msg;
  }
  {
    DeviceAccountant a;
    a.charge(ChunkRole::kParam, 100);
    // The total stays positive (100 - 50), but no master bytes were ever charged.
    const std::string msg = error_of([&] { a.discharge(ChunkRole::kMaster, 50); });
    EXPECT_NE(msg.find("device accountant went negative"), std::string::npos) << msg;
  }
  {
    DeviceAccountant a;
    EXPECT_NE(error_of([&] { a.discharge(ChunkRole::kGrad, 1); }), "(no error)") << "nothing was charged";
  }
}

// Thread-safe: pairs from several threads balance exactly; the peak is at least one charge and at most
// every thread's charge at once.
TEST(DeviceAccountant, ConcurrentPairsBalance) {
  DeviceAccountant a;
  const int threads = 4, pairs = 20000;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&a, t] {
      const ChunkRole role = static_cast<ChunkRole>(t % kNumChunkRoles);
      for (int i = 0; i < pairs; ++i) {
        a.charge(role, 8);
        a.discharge(role, 8);
      }
    });
  }
  for (auto& th : pool) th.join();
  EXPECT_EQ(a.current_bytes(), 0);
  for (int64_t b : a.bytes_by_role()) EXPECT_EQ(b, 0);
  EXPECT_GE(a.peak_bytes(), 8);
  EXPECT_LE(a.peak_bytes(), 8 * threads);
}

}  // namespace
}  // namespace ferry
