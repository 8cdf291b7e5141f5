// What a new user of ChunkedModel meets first: a TORCH_MODULE holder wraps as its module does, the
// model says its device (inputs go there), the chunk size is said once, and a program's own
// log::configure() is never overridden by the model's Config (test_log_defaults covers a program that
// never calls it).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../hooks/chunked_model.h"
#include "../test_util.h"

namespace ferry {
namespace {

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(int64_t in, int64_t classes) {
    hidden = register_module("hidden", torch::nn::Linear(in, 32));
    out = register_module("out", torch::nn::Linear(32, classes));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out->forward(torch::relu(hidden->forward(x))); }
  torch::nn::Linear hidden{nullptr}, out{nullptr};
};
TORCH_MODULE(Classifier);

Config simulated() {
  Config c;
  c.device = DeviceKind::kSimulated;
  return c;
}

TEST(ChunkedModelConveniences, ATorchModuleHolderIsWrappedAsItsModule) {
  Classifier net(64, 10);
  ChunkedModel model(net, simulated());
  EXPECT_EQ(model.num_params(), 4);
  EXPECT_EQ(&model.module(), net.ptr().get());
  EXPECT_EQ(model.param_name(0), "hidden.weight");
  // A holder declared const, and options, too.
  const Classifier other(8, 2);
  ChunkedModelOptions options;
  options.repack_after_warmup = false;
  ChunkedModel second(other, simulated(), std::move(options));
  EXPECT_EQ(second.num_params(), 4);
}

TEST(ChunkedModelConveniences, InputsGoToTheModelsDevice) {
  Classifier net(64, 10);
  ChunkedModel model(net, simulated());
  EXPECT_EQ(model.device(), c10::Device(c10::kCPU)) << "the simulated device's memory is the host's";
  EXPECT_EQ(model.device(), model.store().device());
  const torch::Tensor x = torch::randn({4, 64}).to(model.device());
  const torch::Tensor loss = model.forward([&] { return net->forward(x).pow(2).mean(); });
  model.backward(loss);
  EXPECT_EQ(net->hidden->weight.device(), model.device());
}

TEST(ChunkedModelConveniences, TheAutoChunkSizeIsSaidOnce) {
  Classifier net(64, 10);
  test::LogLevelFor info(log::Level::kInfo);
  testing::internal::CaptureStderr();
  {
    ChunkedModel model(net, simulated());  // chunk size auto (Config's default)
    for (int step = 0; step < 2; ++step) {  // the warm-up iteration, its repack, one more
      const torch::Tensor loss = model.forward([&] { return net->forward(torch::randn({2, 64})).sum(); });
      model.backward(loss);
    }
    EXPECT_EQ(model.layout_version(), 2) << "repacked";
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(test::occurrences(err, "ferry: chunk size"), 1u) << err;
  EXPECT_EQ(test::occurrences(err, "ferry: repacked 4 parameters"), 1u) << err;
}

TEST(ChunkedModelConveniences, TheProgramsOwnLogConfigurationWins) {
  ASSERT_TRUE(log::configured()) << "test_main configures the log";
  const log::Level before = log::level();
  Config c = simulated();
  c.log_level = before == log::Level::kTrace ? log::Level::kError : log::Level::kTrace;
  Classifier net(8, 2);
  ChunkedModel model(net, c);
  EXPECT_EQ(log::level(), before) << "the Config's level does not override an explicit configure()";
}

}  // namespace
}  // namespace ferry
