#pragma once
// ferry::will_skip(module): a model that knows, when its forward begins, which of its parts this step
// will not run (LayerDrop and stochastic depth draw every block's skip at once; an expert no token was
// routed to) says so, and ferry neither prefetches those parts' chunks nor keeps room for their uses,
// in this forward or its backward (Note [Skips said ahead], scheduler/trace_alignment.h; measured:
// docs/ARCHITECTURE.md D107).
//
//   // in the model's forward, before the blocks run:
//   for (size_t i = 0; i < blocks->size(); ++i) {
//     skip[i] = draw() < layer_drop;
//     if (skip[i]) ferry::will_skip(*blocks[i]);
//   }
//
// Contract
//  - Inside a ChunkedModel's forward, on its thread, it reaches that model; anywhere else (plain
//    LibTorch, a checkpoint's recompute in backward) it does nothing: a model written with it runs
//    unchanged without ferry.
//  - A hint changes where chunks are, never a value: results are bit-identical with and without it. A
//    hint proven wrong (the part runs after all) costs moves (its chunks come on demand), counted in
//    IterationStats::trace_hints_broken. Each hint is an instant event `will_skip` in the event trace.
//  - The earlier the better: prefetches issued before the hint stand. It holds for the rest of the
//    iteration (each forward() of it, and its backward); the next iteration starts without hints.
//  - Acted on while the trace is followed aligning (Scheduler::will_not_use): not while the warm-up
//    records it, nor under SchedulerOptions::align_to_trace = false.
//  - With parameters sharded across ranks (N > 1) every rank must say the same skips at the same point,
//    as it must use the same parameters in the same order (draw them from a seed every rank shares): a
//    skipped part's groups are then gathered by no rank. A rank that says otherwise fails, as every rank
//    does, at the next gather, naming the groups (D108).
//  - A parameter `module` shares with a part of the model outside it (an output projection tied to the
//    embedding; a block registered twice) is left out: that part still uses it.
//  - Fails, naming it, for a parameter of `module` that the model does not hold (another model's block).
#include <torch/nn/module.h>

#include <cstdint>
#include <vector>

#include "param_table.h"

namespace ferry {

void will_skip(const torch::nn::Module& module);

// What will_skip() reaches: the model whose forward runs on this thread, which opens a Scope around it.
class SkipListener {
 public:
  virtual void will_skip(const torch::nn::Module& module) = 0;

  class Scope {
   public:
    explicit Scope(SkipListener* listener);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    SkipListener* outer_;
  };

 protected:
  ~SkipListener() = default;
};

// The indices in `table` (the parameters `root` was wrapped with) of `module`'s parameters that `root`
// registers nowhere outside `module`: those a skipped `module` takes out of the step, in table order.
// Fails naming a parameter of `module` that `table` does not hold.
std::vector<int64_t> params_only_in(const torch::nn::Module& root, const torch::nn::Module& module,
                                    const ParamTable& table);

}  // namespace ferry
