// InitScope: inside it the default dtype is the compute dtype (parameters of a module built there are
// created in it; Precision maps to bf16/fp16/fp32), scopes nest and each restores what it found,
// tensors that name fp32 are not affected, other dtypes are refused naming them and change nothing.
// Note [Parallel initializers] (interceptor.h): the scope's random initializers follow
// torch::manual_seed and not the thread count (a whole module built with 1 thread equals the same
// built with several, in fp32 and bf16), keep their distributions, and parallel_init = false keeps
// torch's own serial stream. (Construction memory inside a scope is in test_construction.cpp.)
#include <c10/core/DefaultDtype.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../../hooks/init_scope.h"
#include "../../hooks/interceptor.h"
#include "../test_util.h"

namespace ferry {
namespace {

at::ScalarType default_dtype() { return c10::typeMetaToScalarType(c10::get_default_dtype()); }

TEST(InitScope, ParametersAreCreatedInTheComputeDtype) {
  ASSERT_EQ(default_dtype(), at::kFloat);
  struct Case {
    Precision precision;
    at::ScalarType dtype;
  };
  for (const Case& c : {Case{Precision::kBf16, at::kBFloat16}, Case{Precision::kFp16, at::kHalf},
                        Case{Precision::kFp32, at::kFloat}}) {
    SCOPED_TRACE(to_string(c.precision));
    torch::nn::Linear linear{nullptr};
    torch::nn::Embedding embedding{nullptr};
    {
      InitScope scope(c.precision);
      EXPECT_EQ(default_dtype(), c.dtype);
      EXPECT_EQ(torch::empty({3}).scalar_type(), c.dtype);
      EXPECT_EQ(torch::randn({3}).scalar_type(), c.dtype);
      linear = torch::nn::Linear(16, 8);
      embedding = torch::nn::Embedding(32, 16);
    }
    EXPECT_EQ(default_dtype(), at::kFloat) << "restored when the scope ends";
    for (const auto& p : linear->parameters()) EXPECT_EQ(p.scalar_type(), c.dtype);
    EXPECT_EQ(embedding->weight.scalar_type(), c.dtype);
    EXPECT_TRUE(torch::isfinite(linear->weight.to(at::kFloat)).all().item<bool>());
  }
  // The ScalarType constructor too.
  {
    InitScope scope(at::kHalf);
    EXPECT_EQ(default_dtype(), at::kHalf);
  }
  EXPECT_EQ(default_dtype(), at::kFloat);
}

TEST(InitScope, ScopesNestAndEachRestoresWhatItFound) {
  {
    InitScope outer(at::kBFloat16);
    {
      InitScope inner(at::kHalf, /*parallel_init=*/false);
      EXPECT_EQ(default_dtype(), at::kHalf);
      {
        InitScope innermost(at::kFloat);
        EXPECT_EQ(default_dtype(), at::kFloat);
      }
      EXPECT_EQ(default_dtype(), at::kHalf);
    }
    EXPECT_EQ(default_dtype(), at::kBFloat16);
  }
  EXPECT_EQ(default_dtype(), at::kFloat);
  // A scope opened where the default is not fp32 restores that default, not fp32.
  c10::set_default_dtype(caffe2::TypeMeta::Make<double>());
  {
    InitScope scope(at::kBFloat16);
    EXPECT_EQ(default_dtype(), at::kBFloat16);
  }
  EXPECT_EQ(default_dtype(), at::kDouble);
  c10::set_default_dtype(caffe2::TypeMeta::Make<float>());
}

// Tensors and modules that name fp32 explicitly keep it.
TEST(InitScope, TensorsThatNameFp32AreNotAffected) {
  struct Fp32HeadImpl : torch::nn::Module {
    Fp32HeadImpl() {
      scale = register_parameter("scale", torch::ones({4}, torch::kFloat));
      proj = register_module("proj", torch::nn::Linear(4, 4));
    }
    torch::Tensor scale;
    torch::nn::Linear proj{nullptr};
  };
  std::shared_ptr<Fp32HeadImpl> head;
  {
    InitScope scope(Precision::kBf16);
    EXPECT_EQ(torch::zeros({2}, torch::kFloat).scalar_type(), at::kFloat);
    EXPECT_EQ(torch::arange(4, torch::kLong).scalar_type(), at::kLong) << "integer tensors are not the default dtype";
    head = std::make_shared<Fp32HeadImpl>();
  }
  EXPECT_EQ(head->scale.scalar_type(), at::kFloat);
  EXPECT_EQ(head->proj->weight.scalar_type(), at::kBFloat16) << "what did not name a dtype took the scope's";
}

TEST(InitScope, OtherDtypesAreRefusedNamingThemAndChangeNothing) {
  for (const at::ScalarType bad : {at::kLong, at::kDouble, at::kInt, at::kBool}) {
    const std::string msg = test::error_of([&] { InitScope scope(bad); });
    EXPECT_NE(msg.find("InitScope builds parameters in fp32, bf16 or fp16, got " + std::string(c10::toString(bad))),
              std::string::npos)
        << msg;
    EXPECT_EQ(default_dtype(), at::kFloat) << "a refused scope leaves the default dtype alone";
  }
}

// A whole module (Linear's kaiming_uniform_, Embedding's normal_, large enough to be filled in
// parallel) built under one seed with 1 thread equals the same built with several threads, bit for bit,
// in fp32 and in bf16.
std::vector<at::Tensor> build_module(at::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  InitScope scope(dtype);
  torch::nn::Sequential net(torch::nn::Embedding(4096, 512), torch::nn::Linear(512, 4096), torch::nn::Linear(4096, 512));
  std::vector<at::Tensor> values;
  for (const auto& p : net->parameters()) values.push_back(p.detach().clone());
  return values;
}

TEST(InitScope, AWholeModuleIsTheSameWithOneThreadAsWithMany) {
  const int threads = at::get_num_threads();
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const int64_t before = parallel_init_elements();
    at::set_num_threads(1);
    const std::vector<at::Tensor> one = build_module(dtype, 41);
    at::set_num_threads(std::max(4, threads));
    const std::vector<at::Tensor> many = build_module(dtype, 41);
    at::set_num_threads(threads);
    EXPECT_GE(parallel_init_elements() - before, 2 * 3 * (int64_t{1} << 21)) << "the large tensors were filled in parallel";
    ASSERT_EQ(one.size(), many.size());
    for (size_t i = 0; i < one.size(); ++i) {
      EXPECT_EQ(one[i].scalar_type(), dtype);
      EXPECT_TRUE(torch::equal(one[i], many[i])) << "parameter " << i << " depends on the thread count";
    }
    const std::vector<at::Tensor> other_seed = build_module(dtype, 42);
    EXPECT_FALSE(torch::equal(one[0], other_seed[0])) << "another seed, other values";
  }
}

// parallel_init = false in bf16: exactly what torch's own initializers give with bf16 as the default.
TEST(InitScope, WithoutParallelInitItIsTorchsOwnStreamInTheScopesDtype) {
  torch::manual_seed(12);
  c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(at::kBFloat16));
  torch::nn::Linear plain(1024, 2048);
  c10::set_default_dtype(caffe2::TypeMeta::Make<float>());
  torch::manual_seed(12);
  torch::nn::Linear scoped{nullptr};
  {
    InitScope scope(at::kBFloat16, /*parallel_init=*/false);
    scoped = torch::nn::Linear(1024, 2048);
  }
  EXPECT_TRUE(torch::equal(plain->weight, scoped->weight));
  EXPECT_TRUE(torch::equal(plain->bias, scoped->bias));
}

// Note [Parallel initializers]: inside an InitScope, nn::Linear's kaiming_uniform_ and a model's
// normal_ run on every core, follow torch::manual_seed, do not depend on the thread count, keep their
// distributions; small tensors, explicit generators and parallel_init = false keep torch's own stream.
at::Tensor linear_weight_in_scope(at::ScalarType dtype, uint64_t seed, bool parallel = true) {
  torch::manual_seed(seed);
  InitScope scope(dtype, parallel);
  torch::nn::Linear l(1024, 2048);  // 2^21 weights, two blocks: replaced; 2048 biases: torch's own
  return l->weight.detach().clone();
}

TEST(InitScope, ParallelInitializersFollowTheSeedNotTheThreadCount) {
  const int threads = at::get_num_threads();
  const int64_t before = parallel_init_elements();
  at::set_num_threads(1);
  const at::Tensor one = linear_weight_in_scope(at::kBFloat16, 5);
  at::set_num_threads(std::max(2, threads));
  const at::Tensor many = linear_weight_in_scope(at::kBFloat16, 5);
  at::set_num_threads(threads);
  EXPECT_EQ(parallel_init_elements() - before, 2 * (1 << 21)) << "the weights were filled in parallel";
  EXPECT_TRUE(torch::equal(one, many)) << "values must not depend on the thread count";
  EXPECT_FALSE(torch::equal(one, linear_weight_in_scope(at::kBFloat16, 6))) << "another seed, other values";
  // kaiming_uniform_(a = sqrt(5)) on fan_in 1024: U(-1/32, 1/32).
  const double bound = 1.0 / 32.0;
  const at::Tensor w = linear_weight_in_scope(at::kFloat, 7).to(at::kDouble);
  EXPECT_LE(w.abs().max().item<double>(), bound);
  EXPECT_NEAR(w.mean().item<double>(), 0.0, 0.01 * bound);
  EXPECT_NEAR(w.std().item<double>(), bound / std::sqrt(3.0), 0.01 * bound);
  EXPECT_GT(w.abs().max().item<double>(), 0.99 * bound);
  // normal_ (the GPT example's init) in bf16: N(0, 0.02).
  {
    torch::manual_seed(8);
    InitScope scope(at::kBFloat16);
    at::Tensor t = torch::empty({1 << 20});
    t.normal_(0.0, 0.02);
    const at::Tensor d = t.to(at::kDouble);
    EXPECT_NEAR(d.mean().item<double>(), 0.0, 1e-4);
    EXPECT_NEAR(d.std().item<double>(), 0.02, 2e-4);
  }
  EXPECT_EQ(parallel_init_elements() - before, 4 * (1 << 21) + (1 << 20)) << "four weights and one normal_";
}

TEST(InitScope, ParallelInitializersKeepTorchsStreamWhereAsked) {
  const int64_t before = parallel_init_elements();
  torch::manual_seed(9);
  torch::nn::Linear plain(1024, 2048);
  EXPECT_TRUE(torch::equal(plain->weight.detach(), linear_weight_in_scope(at::kFloat, 9, /*parallel=*/false)))
      << "parallel_init = false: torch's serial stream";
  {
    InitScope scope(at::kFloat);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    at::Tensor mine = torch::empty({1 << 17});
    mine.uniform_(0.0, 1.0, gen);  // an explicit generator: its own stream
    auto gen2 = at::make_generator<at::CPUGeneratorImpl>(3);
    EXPECT_TRUE(torch::equal(mine, torch::empty({1 << 17}, at::kFloat).uniform_(0.0, 1.0, gen2)));
    at::Tensor leaf = torch::empty({1 << 17}).requires_grad_();
    EXPECT_THROW(leaf.uniform_(), c10::Error) << "autograd's in-place-on-leaf error is kept";
  }
  EXPECT_EQ(parallel_init_elements(), before) << "nothing was replaced";
}

}  // namespace
}  // namespace ferry
