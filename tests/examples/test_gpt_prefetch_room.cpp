// D99: the auto chunk size leaves the device's room sixteen chunks. A narrow GPT of the example,
// every block a ferry::checkpoint segment, trained with HybridAdam on the simulated device with copies
// that lag as CUDA's, in a budget of four chunks of the size auto picked before D99 (a quarter of the
// model at most, whatever the budget): there the prefetch has little room ahead of the chunks in use.
// With the size auto picks now the same budget holds sixteen chunks or more, and the uses wait for a
// small part of what they waited for. The chunk size changes no bit of training (Invariants: where a
// chunk is changes no bit), so the losses of the two runs are equal.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "../../chunk/layout.h"
#include "../../chunk/stream_model_engine.h"
#include "../../examples/gpt/gpt.h"
#include "../../hooks/checkpoint.h"
#include "../../hooks/chunked_model.h"
#include "../../optim/hybrid_adam.h"
#include "../hooks/module_twins.h"

namespace ferry {
namespace {

struct TrainingRun {
  int64_t chunk_bytes = 0;  // the compute copy's; 0: auto
  std::vector<double> losses;
  int64_t h2d_bytes = 0, demand_bytes = 0;  // over the measured steps
  int64_t chosen_chunk_bytes = 0;
};

constexpr int kWarmup = 3, kSteps = 4;

void train(const gpt::GptConfig& gc, int64_t budget, TrainingRun& run) {
  torch::manual_seed(1);
  auto net = std::make_shared<gpt::GptImpl>(gc);
  net->run_block = [](gpt::Block& b, const torch::Tensor& x) {
    return checkpoint([b](const std::vector<at::Tensor>& in) mutable { return b->forward(in[0]); }, {x});
  };
  Config config;
  config.device = DeviceKind::kSimulated;
  config.chunk_size_bytes = run.chunk_bytes;
  config.device_budget_bytes = budget;
  ChunkedModelOptions options;
  options.copy_engine = [] { return std::make_unique<StreamModelCopyEngine>(); };
  ChunkedModel model(net, config, std::move(options));
  run.chosen_chunk_bytes = model.chunk_size_bytes();
  // Backward, then the step with every host update done when it returns: the moves are then the same in
  // every run (the pipelined step's depend on when the host updates finish).
  HybridAdam adam(model, HybridAdamOptions().with_update_behind_forward(false));
  for (int step = 0; step < kWarmup + kSteps; ++step) {
    torch::manual_seed(100 + step);
    const at::Tensor tokens = torch::randint(0, gc.vocab, {4, 65}, torch::kLong);
    const at::Tensor x = tokens.slice(1, 0, 64), y = tokens.slice(1, 1, 65);
    at::Tensor loss = model.forward([&] { return gpt::GptImpl::loss(net->forward(x), y); });
    model.backward(loss);
    adam.step();
    adam.zero_grad();
    run.losses.push_back(loss.item<double>());
    const IterationStats s = model.last_iteration();
    EXPECT_LE(s.device_peak_bytes, budget) << "step " << step;
    if (step < kWarmup) continue;
    run.h2d_bytes += s.h2d_bytes;
    run.demand_bytes += s.demand_h2d_bytes();
  }
}

TEST(GptPrefetchRoom, TheAutoChunkSizeLeavesABudgetOfFourOldChunksRoomToPrefetch) {
  // Narrow and deep, as the small preset (whose bench_layer_drop run found this) but smaller: a
  // block's largest matrix is 1/50 of the model, the chunk auto picked without a cap about 1/16.
  gpt::GptConfig gc;
  gc.vocab = 256;
  gc.seq = 64;
  gc.hidden = 64;
  gc.layers = 12;
  gc.heads = 4;
  const std::vector<int64_t> numels = gc.param_numels();
  const int64_t old_auto = auto_chunk_size(numels, {}, 4).chunk_bytes;  // no cap: before D99
  gpt::Gpt probe(gc);
  const int64_t budget = 4 * test::largest_chunk_bytes(*probe, old_auto);
  ASSERT_LT(auto_chunk_cap_bytes(budget), old_auto) << "the cap binds at this budget";

  TrainingRun capped, old;
  old.chunk_bytes = old_auto;
  train(gc, budget, capped);
  train(gc, budget, old);
  std::cout << "GPT of 12 narrow blocks in a budget of " << budget << " B, " << kSteps << " steps: auto chunk "
            << capped.chosen_chunk_bytes << " B moved in " << capped.h2d_bytes << " B, waited for "
            << capped.demand_bytes << " B; the old auto size " << old.chosen_chunk_bytes << " B moved in "
            << old.h2d_bytes << " B, waited for " << old.demand_bytes << " B\n";
  EXPECT_LE(capped.chosen_chunk_bytes, budget / kAutoChunksInRoom);
  EXPECT_EQ(old.chosen_chunk_bytes, old_auto);
  ASSERT_EQ(capped.losses.size(), old.losses.size());
  for (size_t i = 0; i < old.losses.size(); ++i) EXPECT_EQ(capped.losses[i], old.losses[i]) << "step " << i;
  ASSERT_GT(old.demand_bytes * 20, old.h2d_bytes) << "the old size: the uses wait (the case this test is for)";
  EXPECT_LT(capped.demand_bytes * 4, old.demand_bytes) << "the capped size: they wait for under a quarter of that";
  EXPECT_LT(capped.h2d_bytes * 10, old.h2d_bytes * 11) << "for at most a tenth more bytes moved in";
}

}  // namespace
}  // namespace ferry
