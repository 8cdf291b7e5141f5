// optim/load_weights.h: published weights into a ChunkedModel trained by HybridAdam (bf16 compute
// copies, fp32 masters), and hooks/weight_source.h's ChunkedModel loader without an optimizer. An fp32
// file gives the masters its values exactly and the chunks their bf16 rounding; a bf16 file the
// masters its values up-cast; training goes on from them. Refused loads change neither chunks nor
// masters; a non-strict load keeps the missing parameters' masters; a model built inside InitScope
// gets full-precision masters from an fp32 file.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <string>

#include "../../hooks/init_scope.h"
#include "../../optim/load_weights.h"
#include "hybrid_adam_fixtures.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures

std::string file(const std::string& name) {
  return ::testing::TempDir() + "ferry_lw_" + std::to_string(::getpid()) + "_" + name + ".safetensors";
}

// Random values for every parameter of `model` (as `dtype`), the module's buffers as they are.
NamedTensors random_values(ChunkedModel& model, at::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(static_cast<int64_t>(seed));
  NamedTensors out;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    out.emplace_back(model.param_name(p), torch::randn(model.param_shapes()[p]).to(dtype));
  }
  return out;
}

TEST(LoadWeights, TheMastersGetTheFilesValuesAndTheChunksTheirRounding) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    torch::manual_seed(0);
    TinyLm net(kVocab, kDim);
    ChunkedModel model(net.ptr(), sim_config(budget_for(40, 40), Precision::kBf16));
    HybridAdam adam(model, HybridAdamOptions{});
    const NamedTensors values = random_values(model, dtype, 5);
    const std::string path = file(dtype == at::kFloat ? "f32" : "bf16");
    write_safetensors(path, values);
    const WeightLoadPlan plan = load_safetensors(adam, model, path);
    EXPECT_TRUE(plan.missing.empty());
    for (int64_t p = 0; p < model.num_params(); ++p) {
      const at::Tensor want = values[p].second.to(at::kFloat);
      EXPECT_TRUE(torch::equal(adam.master(p), want)) << model.param_name(p);
      EXPECT_TRUE(torch::equal(model.param_values(p), want.to(at::kBFloat16))) << model.param_name(p);
    }
    for (int step = 0; step < 2; ++step) {  // and it trains from there
      const Batch b = batch(step);
      model.backward(forward_loss(model, net, b));
      EXPECT_TRUE(adam.step().applied);
      adam.zero_grad();
    }
    ::unlink(path.c_str());
  }
}

TEST(LoadWeights, ARefusedLoadChangesNothingAndALooseOneKeepsTheMissing) {
  torch::manual_seed(1);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(40, 40), Precision::kBf16));
  HybridAdam adam(model, HybridAdamOptions{});
  const NamedTensors before = adam.state_dict();
  NamedTensors values = random_values(model, at::kFloat, 6);
  const std::string dropped = values.back().first;
  values.pop_back();
  const std::string path = file("partial");
  write_safetensors(path, values);
  const std::string e = test::error_of([&] { load_safetensors(adam, model, path); });
  EXPECT_NE(e.find("missing from the file (the model has them) (1): " + dropped), std::string::npos) << e;
  const NamedTensors after = adam.state_dict();
  for (size_t k = 0; k < before.size(); ++k) EXPECT_TRUE(torch::equal(before[k].second, after[k].second)) << before[k].first;
  WeightLoadOptions loose;
  loose.strict = false;
  const WeightLoadPlan plan = load_safetensors(adam, model, path, loose);
  EXPECT_EQ(plan.missing, std::vector<std::string>{dropped});
  const NamedTensors loaded = adam.state_dict();
  for (size_t k = 0; k < loaded.size(); ++k) {
    const at::Tensor want = k < values.size() ? values[k].second : before[k].second;
    EXPECT_TRUE(torch::equal(loaded[k].second, want)) << loaded[k].first;
  }
  ::unlink(path.c_str());
}

// A model built inside InitScope (bf16 parameters, no fp32 copy ever) loads an fp32 file: the masters
// get the file's fp32 values, not the bf16 initial ones.
TEST(LoadWeights, AModelBuiltInsideInitScopeLoadsFullPrecisionMasters) {
  const Config config = sim_config(budget_for(40, 40), Precision::kBf16);
  std::shared_ptr<TinyLmImpl> net;
  {
    InitScope scope(at::kBFloat16);
    net = std::make_shared<TinyLmImpl>(kVocab, kDim);
  }
  ChunkedModel model(net, config);
  HybridAdam adam(model, HybridAdamOptions{});
  const NamedTensors values = random_values(model, at::kFloat, 8);
  const std::string path = file("initscope");
  write_safetensors(path, values);
  load_safetensors(adam, model, path);
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), values[p].second)) << model.param_name(p);
  }
  ::unlink(path.c_str());
}

TEST(LoadWeights, AChunkedModelWithoutAnOptimizerLoadsIntoItsChunks) {
  torch::manual_seed(2);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 0), Precision::kBf16));  // evictions
  const NamedTensors values = random_values(model, at::kBFloat16, 7);
  const std::string path = file("plain");
  write_safetensors(path, values);
  load_safetensors(model, path);
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(model.param_values(p), values[p].second)) << model.param_name(p);
  }
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace ferry
