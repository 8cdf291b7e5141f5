#include <gtest/gtest.h>

#include "../../common/env_report.h"
#include "../test_util.h"

namespace ferry {
namespace {

TEST(EnvReportGpu, SeesTheDevice) {
  FERRY_REQUIRE_GPU();
  const EnvReport r = collect_env_report();
  EXPECT_GE(r.gpu_count, 1);
  EXPECT_FALSE(r.gpu_name.empty());
  EXPECT_GT(r.gpu_memory_bytes, int64_t{1} << 30);
  EXPECT_FALSE(r.nccl.empty()) << "torch_cuda should have loaded NCCL";
}

}  // namespace
}  // namespace ferry
