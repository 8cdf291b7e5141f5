// gtest main for every ferry test binary: logs at FERRY_LOG_LEVEL (default warn) so test output stays
// readable.
#include <gtest/gtest.h>

#include "../common/config.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto env = ferry::read_environment();
  if (!env.count("FERRY_LOG_LEVEL")) env["FERRY_LOG_LEVEL"] = "warn";
  const ferry::Config config = ferry::Config::from_env(env);
  ferry::log::configure(config.log_level, config.rank);
  return RUN_ALL_TESTS();
}
