// hooks/weight_source.h: published weights into a plain LibTorch module. A module's values written as
// bf16, fp16 and fp32 safetensors load into a differently initialised twin (up-cast exactly); a
// Hugging Face folder with one file or with shards and an index loads the same; names map through a
// table. Refused, with every problem in one error and nothing changed: missing and unexpected tensors
// (strict), shapes, a dtype the module cannot take, two file tensors for one parameter; an index that
// names a missing shard, a shard without the tensor the index puts there, a shard holding one it does
// not list. Not strict: the missing keep their values, the unexpected are ignored.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "../../hooks/weight_source.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    up = register_module("up", torch::nn::Linear(4, 8));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    down = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(8, 3).bias(false)));
    count = register_buffer("count", torch::zeros({2}, torch::kLong));
  }
  torch::nn::Linear up{nullptr}, down{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::Tensor count;
};
TORCH_MODULE(Net);

std::string temp_dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "ferry_ws_" + std::to_string(::getpid()) + "_" + name;
  ::mkdir(d.c_str(), 0755);
  return d;
}

// The module's parameters (as `dtype`) and buffers, by name.
NamedTensors values_of(Net& net, at::ScalarType dtype) {
  NamedTensors out;
  for (const auto& p : net->named_parameters()) out.emplace_back(p.key(), p.value().detach().to(dtype));
  for (const auto& b : net->named_buffers()) out.emplace_back(b.key(), b.value().clone());
  return out;
}

void expect_loaded(Net& net, const NamedTensors& values) {
  std::map<std::string, at::Tensor> mine;
  for (const auto& p : net->named_parameters()) mine[p.key()] = p.value();
  for (const auto& b : net->named_buffers()) mine[b.key()] = b.value();
  for (const auto& [name, v] : values) {
    ASSERT_TRUE(mine.count(name)) << name;
    EXPECT_TRUE(torch::equal(mine[name], v.to(mine[name].scalar_type()))) << name;
  }
}

TEST(WeightSource, LoadsFilesOfEveryFloatDtypeIntoAPlainModule) {
  torch::manual_seed(1);
  Net source;
  source->count.fill_(7);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    const std::string path = temp_dir("dtypes") + "/w.safetensors";
    const NamedTensors values = values_of(source, dtype);
    write_safetensors(path, values);
    torch::manual_seed(2);
    Net target;
    const WeightLoadPlan plan = load_safetensors(*target, path);
    EXPECT_TRUE(plan.missing.empty() && plan.unexpected.empty());
    EXPECT_GT(plan.bytes, 0);
    expect_loaded(target, values);  // bf16/fp16 values up-cast exactly into fp32 parameters
    EXPECT_EQ(target->count[0].item<int64_t>(), 7);
  }
}

TEST(WeightSource, AFolderWithOneFileOrShardsAndAnIndexLoadsTheSame) {
  torch::manual_seed(3);
  Net source;
  const NamedTensors values = values_of(source, at::kBFloat16);
  const std::string single = temp_dir("single");
  write_safetensors(single + "/model.safetensors", values);
  Net a;
  load_safetensors(*a, single);
  expect_loaded(a, values);

  const std::string sharded = temp_dir("sharded");
  NamedTensors first(values.begin(), values.begin() + 3), second(values.begin() + 3, values.end());
  write_safetensors(sharded + "/model-00001-of-00002.safetensors", first);
  write_safetensors(sharded + "/model-00002-of-00002.safetensors", second);
  std::ofstream index(sharded + "/model.safetensors.index.json");
  index << "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {";
  for (size_t k = 0; k < values.size(); ++k) {
    index << (k ? ", " : "") << "\"" << values[k].first << "\": \"model-0000" << (k < 3 ? 1 : 2) << "-of-00002.safetensors\"";
  }
  index << "}}";
  index.close();
  const WeightSource ws = WeightSource::open(sharded);
  EXPECT_EQ(ws.files().size(), 2u);
  EXPECT_EQ(ws.names().size(), values.size());
  Net b;
  load_safetensors(*b, sharded);
  expect_loaded(b, values);
}

TEST(WeightSource, NamesMapThroughATable) {
  torch::manual_seed(4);
  Net source;
  NamedTensors renamed;
  for (const auto& [name, v] : values_of(source, at::kFloat)) renamed.emplace_back("model." + name, v);
  renamed.emplace_back("model.rotary.inv_freq", torch::ones({4}));
  const std::string path = temp_dir("rename") + "/w.safetensors";
  write_safetensors(path, renamed);
  WeightLoadOptions o;
  o.rename = [](const std::string& n) {
    if (n == "model.rotary.inv_freq") return std::string();  // skipped
    return n.substr(6);
  };
  Net target;
  const WeightLoadPlan plan = load_safetensors(*target, path, o);
  EXPECT_EQ(plan.skipped, std::vector<std::string>{"model.rotary.inv_freq"});
  expect_loaded(target, values_of(source, at::kFloat));
  // Two file names for one parameter.
  o.rename = name_table({{"model.up.weight", "up.weight"}, {"model.down.weight", "up.weight"}}, false);
  const std::string e = error_of([&] { load_safetensors(*target, path, o); });
  EXPECT_NE(e.find("two file tensors for one destination (1): model.up.weight and model.down.weight (both as "
                   "up.weight)"), std::string::npos) << e;
}

TEST(WeightSource, ProblemsAreReportedTogetherAndNothingIsLoaded) {
  torch::manual_seed(5);
  Net source;
  NamedTensors values = values_of(source, at::kFloat);
  NamedTensors bad;
  for (auto& [name, v] : values) {
    if (name == "norm.bias") continue;                                        // missing
    if (name == "up.bias") v = torch::zeros({9});                             // shape
    if (name == "down.weight") v = torch::zeros({3, 8}, torch::kInt);         // dtype
    bad.emplace_back(name, v);
  }
  bad.emplace_back("extra.weight", torch::zeros({1}));                        // unexpected
  const std::string path = temp_dir("bad") + "/w.safetensors";
  write_safetensors(path, bad);
  torch::manual_seed(6);
  Net target;
  const NamedTensors before = values_of(target, at::kFloat);
  const std::string e = error_of([&] { load_safetensors(*target, path); });
  for (const char* part : {"nothing was loaded", "shapes that differ (1): up.bias: the file's [9], module",
                           "dtypes the destination cannot take (1): down.weight: the file's Int into Float",
                           "missing from the file (the model has them) (1): norm.bias",
                           "unexpected (the file has them, the model does not) (1): extra.weight", path.c_str()}) {
    EXPECT_NE(e.find(part), std::string::npos) << part << "\n" << e;
  }
  expect_loaded(target, before);  // unchanged
  // Not strict: the missing keep their values, the unexpected are ignored; shapes and dtypes still fail.
  NamedTensors partial;
  for (const auto& [name, v] : values) {
    if (name != "norm.bias" && name != "up.bias" && name != "down.weight") partial.emplace_back(name, v);
  }
  partial.emplace_back("extra.weight", torch::zeros({1}));
  write_safetensors(path, partial);
  WeightLoadOptions loose;
  loose.strict = false;
  const WeightLoadPlan plan = load_safetensors(*target, path, loose);
  EXPECT_EQ(plan.missing.size(), 3u);
  EXPECT_EQ(plan.unexpected, std::vector<std::string>{"extra.weight"});
  EXPECT_TRUE(torch::equal(target->norm->bias, before[3].second)) << before[3].first;
}

TEST(WeightSource, BadFoldersAndIndexesFailNamingTheFile) {
  torch::manual_seed(7);
  Net source;
  const NamedTensors values = values_of(source, at::kFloat);
  const std::string dir = temp_dir("badindex");
  write_safetensors(dir + "/a.safetensors", {values[0], values[1]});
  auto index_with = [&](const std::string& map) {
    std::ofstream(dir + "/model.safetensors.index.json") << "{\"weight_map\": {" << map << "}}";
  };
  index_with("\"up.weight\": \"a.safetensors\", \"up.bias\": \"a.safetensors\", \"norm.weight\": \"b.safetensors\"");
  EXPECT_NE(error_of([&] { WeightSource::open(dir); }).find("names shard b.safetensors (for 'norm.weight'), which is not in"),
            std::string::npos);
  index_with("\"up.weight\": \"a.safetensors\", \"up.bias\": \"a.safetensors\", \"norm.weight\": \"a.safetensors\"");
  EXPECT_NE(error_of([&] { WeightSource::open(dir); }).find("puts norm.weight in a.safetensors, which does not hold it"),
            std::string::npos);
  index_with("\"up.weight\": \"a.safetensors\"");
  EXPECT_NE(error_of([&] { WeightSource::open(dir); }).find("holds up.bias, which"), std::string::npos);
  index_with("\"up.weight\": \"../a.safetensors\"");
  EXPECT_NE(error_of([&] { WeightSource::open(dir); }).find("expected a file name inside the folder"), std::string::npos);
  EXPECT_NE(error_of([&] { WeightSource::open(temp_dir("empty")); }).find("has neither model.safetensors.index.json"),
            std::string::npos);
  EXPECT_NE(error_of([&] { WeightSource::open(dir + "/nope"); }).find("no safetensors file or model folder"),
            std::string::npos);
}

}  // namespace
}  // namespace ferry
