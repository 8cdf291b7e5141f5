// Any configuration trains the same bits or is refused clearly (a property test; D92).
//
// Per seed a Config (chunk size, device budget and capacity, host budget, CPU Adam threads, kernel and
// split) and HybridAdam's options (device state chunks, round-trip slots, the step mode) are drawn over
// their edges: budgets smaller than a chunk or than the model, a capacity below the budget, chunk sizes
// that do not divide anything, kernels this CPU may lack. Three steps are trained. Either every step
// gives the bits of the reference (the same semantics: precision, state format, micro-batches, clipping;
// the default configuration), or a c10::Error from ferry refuses the configuration, naming what it
// needs, and is not an internal assertion. Never a crash, a hang or other bits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <sstream>
#include <string>

#include "../../common/cpu_features.h"
#include "../seeds.h"
#include "hybrid_adam_fixtures.h"
#include "same_state.h"

namespace ferry::test {
namespace {

struct Drawn {
  // Semantics, shared with the reference.
  Precision precision = Precision::kBf16;
  StateFormat format = StateFormat::kFp32;
  bool accumulate = false;  // two micro-batches
  double max_grad_norm = 0;
  // What must not change the bits.
  int64_t chunk = 0, budget = 0, capacity = 0, host_budget = 0;
  int threads = 0;
  std::string isa = "auto";
  CpuSplit split = CpuSplit::kDynamic;
  int64_t device_state_chunks = -1, round_trip_slots = 0;
  bool pipelined = false;
};

std::string describe(const Drawn& d) {
  std::ostringstream o;
  o << to_string(d.precision) << " compute, " << to_string(d.format) << " state, accumulate " << d.accumulate
    << ", clipping " << d.max_grad_norm << "; chunk " << d.chunk << " B, device budget " << d.budget
    << " B, capacity " << d.capacity << " B, host budget " << d.host_budget << " B, " << d.threads << " thread(s), isa "
    << d.isa << ", " << to_string(d.split) << " split, device_state_chunks " << d.device_state_chunks << ", "
    << d.round_trip_slots << " slot(s), " << (d.pipelined ? "backward_step" : "backward + step");
  return o.str();
}

Drawn draw(int seed) {
  std::mt19937 rng(static_cast<uint32_t>(6151 * seed + 29));
  const auto any = [&](auto... v) {
    const std::common_type_t<decltype(v)...> values[] = {v...};
    return values[rng() % sizeof...(v)];
  };
  Drawn d;
  d.precision = any(Precision::kFp32, Precision::kBf16, Precision::kFp16);
  d.format = d.precision != Precision::kFp32 && rng() % 2 ? StateFormat::kCompact : StateFormat::kFp32;
  d.accumulate = rng() % 3 == 0;
  d.max_grad_norm = rng() % 3 == 0 ? 0.05 : 0.0;
  d.chunk = any(int64_t{0}, int64_t{4} << 10, int64_t{16} << 10, int64_t{12345}, int64_t{64} << 10, int64_t{1} << 20);
  d.budget = any(int64_t{0}, int64_t{8} << 10, int64_t{48} << 10, int64_t{96} << 10, int64_t{256} << 10,
                 int64_t{4} << 20);
  d.capacity = any(int64_t{0}, int64_t{0}, d.budget / 2, d.budget, d.budget + (int64_t{64} << 10));
  d.host_budget = any(int64_t{0}, int64_t{0}, int64_t{16} << 10, int64_t{1} << 20);
  d.threads = any(0, 1, 3);
  d.isa = any(std::string("auto"), std::string("scalar"), std::string("avx2"), std::string("avx512"),
              std::string("avx512_bf16"));
  d.split = rng() % 2 ? CpuSplit::kStatic : CpuSplit::kDynamic;
  d.device_state_chunks = any(int64_t{-1}, int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{3}, int64_t{100});
  d.round_trip_slots = any(int64_t{0}, int64_t{0}, int64_t{1}, int64_t{4});
  d.pipelined = rng() % 2;
  return d;
}

Config config_of(const Drawn& d) {
  Config c;
  c.device = DeviceKind::kSimulated;
  c.precision = d.precision;
  c.chunk_size_bytes = d.chunk;
  c.device_budget_bytes = d.budget;
  c.device_capacity_bytes = d.capacity;
  c.host_budget_bytes = d.host_budget;
  c.cpu_threads = d.threads;
  c.cpu_isa = d.isa;
  c.cpu_split = d.split;
  return c;
}

HybridAdamOptions options_of(const Drawn& d) {
  HybridAdamOptions o = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  o.state_format = d.format;
  o.accumulate_grads = d.accumulate;
  o.max_grad_norm = d.max_grad_norm;
  o.device_state_chunks = d.device_state_chunks;
  o.round_trip_slots = d.round_trip_slots;
  return o;
}

// The model and its optimizer; built in the constructor, which may refuse.
struct Configured {
  Configured(const Drawn& d, const Config& config)
      : drawn(d), net([] {
          torch::manual_seed(71);
          return TinyLm(kVocab, kDim);
        }()),
        model(net.ptr(), config),
        adam(model, options_of(d)) {}
  torch::Tensor step(int step) {
    const int parts = drawn.accumulate ? 2 : 1;
    for (int k = 0; k + 1 < parts; ++k) model.backward(forward_loss(model, net, batch(10 * step + k), parts));
    const torch::Tensor loss = forward_loss(model, net, batch(10 * step + parts - 1), parts);
    const torch::Tensor seen = loss.detach().clone();
    if (drawn.pipelined) {
      adam.backward_step(loss);
    } else {
      model.backward(loss);
      adam.step();
    }
    adam.zero_grad();
    return seen;
  }
  Drawn drawn;
  TinyLm net;
  ChunkedModel model;
  HybridAdam adam;
};

class ConfigSpace : public ::testing::TestWithParam<int> {};

TEST_P(ConfigSpace, TrainsTheReferencesBitsOrIsRefusedClearly) {
  const Drawn d = draw(GetParam());
  const std::string drawn = "case " + std::to_string(GetParam()) + ": " + describe(d);
  std::printf("%s\n", drawn.c_str());
  SCOPED_TRACE(drawn);
  Drawn plain = d;  // the reference: the default configuration, the same semantics
  plain.chunk = 16 << 10;
  plain.budget = plain.capacity = plain.host_budget = 0;
  plain.threads = 0;
  plain.isa = "auto";
  plain.split = CpuSplit::kDynamic;
  plain.device_state_chunks = -1;
  plain.round_trip_slots = 0;
  plain.pipelined = false;
  Config plain_config = config_of(plain);
  plain_config.validate();
  Configured reference(plain, plain_config);
  std::unique_ptr<Configured> run;
  int step = 0;
  try {
    const Config config = config_of(d);
    config.validate();
    run = std::make_unique<Configured>(d, config);
    for (; step < 3; ++step) {
      const torch::Tensor want = reference.step(step), got = run->step(step);
      ASSERT_TRUE(torch::equal(want, got)) << "step " << step << ": the forward saw other parameters";
    }
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    std::printf("  refused at step %d: %s\n", step, what.substr(0, 300).c_str());
    EXPECT_EQ(what.find("INTERNAL ASSERT"), std::string::npos) << "a refusal, not a broken invariant: " << what;
    EXPECT_EQ(what.rfind("ferry", 0), 0u) << "ferry's refusal, saying what it needs: " << what;
    return;
  }
  reference.adam.synchronize();
  run->adam.synchronize();
  ASSERT_NO_FATAL_FAILURE(expect_same_state(reference.adam, run->adam, reference.model, run->model, "the end"));
}

INSTANTIATE_TEST_SUITE_P(Seeds, ConfigSpace, ferry::test::seeds(120));

}  // namespace
}  // namespace ferry::test
