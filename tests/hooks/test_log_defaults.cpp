// A program that never calls ferry::log::configure(): the ChunkedModel's Config sets the log's level
// and rank (--log-level and FERRY_LOG_LEVEL work), until the program configures the log itself, which
// then wins. Its own main(): test_main configures the log before every test, which is what this
// must run without.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../hooks/chunked_model.h"

namespace ferry {
namespace {

Config simulated(log::Level level) {
  Config c;
  c.device = DeviceKind::kSimulated;
  c.log_level = level;
  return c;
}

TEST(LogDefaults, TheModelsConfigSetsTheLogUntilTheProgramDoes) {
  ASSERT_FALSE(log::configured());
  ASSERT_EQ(log::level(), log::Level::kInfo) << "the log's default before anything configures it";
  torch::nn::Linear net(4, 4);
  {
    ChunkedModel model(net, simulated(log::Level::kError));
    EXPECT_EQ(log::level(), log::Level::kError) << "the model's Config applied";
  }
  {
    ChunkedModel model(net, simulated(log::Level::kWarn));
    EXPECT_EQ(log::level(), log::Level::kWarn) << "each model's, while the program configures nothing";
  }
  log::configure(log::Level::kError, 0);
  EXPECT_FALSE(log::configure_default(log::Level::kTrace, 0));
  {
    ChunkedModel model(net, simulated(log::Level::kDebug));
    EXPECT_EQ(log::level(), log::Level::kError) << "the program's configure() wins";
  }
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
