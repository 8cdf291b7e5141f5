// D99: the auto chunk size leaves the device's room sixteen chunks; D100: a gradient's landing is a use
// of its chunk; D101: the step's round trips are in the reference. A narrow GPT of the example, every
// block a ferry::checkpoint segment, trained with HybridAdam on the simulated device with copies that
// lag as CUDA's, in a budget of four chunks of the size auto picked before D99 (a quarter of the model
// at most, whatever the budget).
//  - D100: a segment's gradients land after its whole backward (its recompute's autograd::grad returns
//    them together), and the landings used to reach the store past the scheduler: OPT had given the
//    chunks of the block's last ops up for the next forward and the prefetch had filled the room, so a
//    landing brought its chunk back on demand. Now the trace has the landings, and backward waits for
//    nothing, as without an optimizer (no landings then: the gradients stay in .grad).
//  - D99: with the size auto picks now the same budget holds sixteen chunks or more, and the forward's
//    first use after the step (whose update sent its chunk to the host) waits for one smaller chunk.
//  - D101: what moved beyond the trace's Belady count was the step's round trips; the reference counts
//    them now, and what moved equals it.
// The chunk size changes no bit of training (Invariants: where a chunk is changes no bit), so the
// losses of the two sizes are equal.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
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
  bool optimizer = true;    // HybridAdam; else model.backward() alone, the gradients left in .grad
  std::vector<double> losses;
  // Over the measured steps: moved in, moved in for a use that needed the chunk then (in backward alone).
  int64_t h2d_bytes = 0, demand_bytes = 0, backward_demand_bytes = 0;
  int64_t chosen_chunk_bytes = 0;
  int64_t trace_size = 0;  // uses in the trace after the last step
  int64_t num_params = 0;
  int64_t layout_bytes = 0;  // the parameter chunks' bytes, packing waste included
  // Over the measured steps: the least and the most of moved / optimal (Belady with the step's round
  // trips, D101), and the bytes the step moved between two iterations.
  double least_over_optimal = 1e9, most_over_optimal = 0;
  int64_t between_bytes = 0;
};

int64_t demand_bytes(const ChunkStoreStats& s) { return s.moves.h2d_bytes - s.moves.prefetch_h2d_bytes; }

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
  std::unique_ptr<HybridAdam> adam;
  if (run.optimizer) adam = std::make_unique<HybridAdam>(model, HybridAdamOptions().with_update_behind_forward(false));
  for (int step = 0; step < kWarmup + kSteps; ++step) {
    torch::manual_seed(100 + step);
    const at::Tensor tokens = torch::randint(0, gc.vocab, {4, 65}, torch::kLong);
    const at::Tensor x = tokens.slice(1, 0, 64), y = tokens.slice(1, 1, 65);
    at::Tensor loss = model.forward([&] { return gpt::GptImpl::loss(net->forward(x), y); });
    const int64_t demand_before_backward = demand_bytes(model.store().stats());
    model.backward(loss);
    const int64_t backward_demand = demand_bytes(model.store().stats()) - demand_before_backward;
    if (adam) {
      adam->step();
      adam->zero_grad();
    } else {
      net->zero_grad();
    }
    run.losses.push_back(loss.item<double>());
    const IterationStats s = model.last_iteration();
    EXPECT_LE(s.device_peak_bytes, budget) << "step " << step;
    if (step < kWarmup) continue;
    run.h2d_bytes += s.h2d_bytes;
    run.demand_bytes += s.demand_h2d_bytes();
    run.backward_demand_bytes += backward_demand;
    run.least_over_optimal = std::min(run.least_over_optimal, s.moved_over_optimal());
    run.most_over_optimal = std::max(run.most_over_optimal, s.moved_over_optimal());
    run.between_bytes += s.between_h2d_bytes + s.between_d2h_bytes;
  }
  run.trace_size = model.scheduler().trace()->size();
  run.num_params = model.num_params();
  for (ChunkId c = 0; c < model.store().num_chunks(); ++c) {
    const ChunkInfo info = model.store().chunk_info(c);
    if (info.role == ChunkRole::kParam) run.layout_bytes += info.nbytes;
  }
}

// The narrow GPT: narrow and deep, as the small preset (whose bench_layer_drop run found both) but
// smaller: a block's largest matrix is 1/50 of the model, the chunk auto picked without a cap about 1/16.
gpt::GptConfig narrow_gpt() {
  gpt::GptConfig gc;
  gc.vocab = 256;
  gc.seq = 64;
  gc.hidden = 64;
  gc.layers = 12;
  gc.heads = 4;
  return gc;
}

// The size auto picked before D99 and a budget of four of its chunks.
struct OldSize {
  int64_t chunk_bytes = 0, budget = 0;
};
OldSize old_size(const gpt::GptConfig& gc) {
  OldSize o;
  o.chunk_bytes = auto_chunk_size(gc.param_numels(), {}, 4).chunk_bytes;  // no cap: before D99
  gpt::Gpt probe(gc);
  o.budget = 4 * test::largest_chunk_bytes(*probe, o.chunk_bytes);
  return o;
}

TEST(GptPrefetchRoom, AGradientsLandingIsAUseOfItsChunk) {
  const gpt::GptConfig gc = narrow_gpt();
  const OldSize o = old_size(gc);
  TrainingRun with_adam, alone;
  with_adam.chunk_bytes = alone.chunk_bytes = o.chunk_bytes;
  alone.optimizer = false;
  train(gc, o.budget, with_adam);
  train(gc, o.budget, alone);
  std::cout << "GPT of 12 narrow blocks, " << o.chunk_bytes << " B chunks, 4 in the budget, " << kSteps
            << " steps: with HybridAdam the trace has " << with_adam.trace_size << " uses, backward waited for "
            << with_adam.backward_demand_bytes << " B; model.backward() alone " << alone.trace_size << " uses, "
            << alone.backward_demand_bytes << " B\n";
  // Every parameter lands once per backward (Note [Checkpoint parameters as inputs]): one use each.
  EXPECT_EQ(with_adam.trace_size, alone.trace_size + with_adam.num_params);
  // Without the landings in the trace a landing brought back, on demand, a chunk given up in backward.
  EXPECT_EQ(alone.backward_demand_bytes, 0);
  EXPECT_EQ(with_adam.backward_demand_bytes, 0);
  ASSERT_EQ(with_adam.losses.size(), alone.losses.size());
  EXPECT_EQ(with_adam.losses[0], alone.losses[0]) << "the first forward, before any update";
}

TEST(GptPrefetchRoom, TheStepsRoundTripsAreInTheReference) {
  // D101: the chunks still on the device when backward ends go to the host for their update and come
  // back for the next forward. The reference counts that round trip, the meter the step's moves out:
  // what OPT and the prefetch moved is then Belady's count for this placement (before: 1.11x, the
  // trips alone).
  const gpt::GptConfig gc = narrow_gpt();
  const OldSize o = old_size(gc);
  TrainingRun run;
  run.chunk_bytes = o.chunk_bytes;
  train(gc, o.budget, run);
  std::cout << "moved / optimal over " << kSteps << " steps: " << run.least_over_optimal << " to "
            << run.most_over_optimal << "; the steps moved " << run.between_bytes << " B between iterations\n";
  EXPECT_GT(run.between_bytes, 0) << "the steps' moves out are counted";
  EXPECT_GE(run.least_over_optimal, 0.98);
  EXPECT_LE(run.most_over_optimal, 1.02);
}

TEST(GptPrefetchRoom, TheAutoChunkSizeLeavesABudgetOfFourOldChunksRoomToPrefetch) {
  const gpt::GptConfig gc = narrow_gpt();
  const OldSize o = old_size(gc);
  const int64_t old_auto = o.chunk_bytes, budget = o.budget;
  ASSERT_LT(auto_chunk_cap_bytes(budget), old_auto) << "the cap binds at this budget";

  TrainingRun capped, old;
  old.chunk_bytes = old_auto;
  train(gc, budget, capped);
  train(gc, budget, old);
  std::cout << "GPT of 12 narrow blocks in a budget of " << budget << " B, " << kSteps << " steps: auto chunk "
            << capped.chosen_chunk_bytes << " B (layout " << capped.layout_bytes << " B) moved in " << capped.h2d_bytes
            << " B, waited for " << capped.demand_bytes << " B (in backward " << capped.backward_demand_bytes
            << " B); the old auto size " << old.chosen_chunk_bytes
            << " B (layout " << old.layout_bytes << " B) moved in " << old.h2d_bytes << " B, waited for "
            << old.demand_bytes << " B\n";
  EXPECT_LE(capped.chosen_chunk_bytes, budget / kAutoChunksInRoom);
  EXPECT_EQ(old.chosen_chunk_bytes, old_auto);
  ASSERT_EQ(capped.losses.size(), old.losses.size());
  for (size_t i = 0; i < old.losses.size(); ++i) EXPECT_EQ(capped.losses[i], old.losses[i]) << "step " << i;
  // Since D100 what waits is the forward's first use after the step, whose update sent its chunk to the
  // host: one chunk per step, so the smaller chunk waits for less.
  ASSERT_GT(old.demand_bytes, 0) << "the old size: a use waits (the case this test is for)";
  EXPECT_LT(capped.demand_bytes * 4, old.demand_bytes) << "the capped size: under a quarter of that";
  // The smaller chunks pack less tightly (their layout is larger) and move no more of it per step, within
  // a tenth.
  const double capped_share = static_cast<double>(capped.h2d_bytes) / static_cast<double>(capped.layout_bytes);
  const double old_share = static_cast<double>(old.h2d_bytes) / static_cast<double>(old.layout_bytes);
  EXPECT_LT(capped_share, 1.1 * old_share) << "layouts moved in per step: " << capped_share << " against " << old_share;
}

}  // namespace
}  // namespace ferry
