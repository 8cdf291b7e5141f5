#pragma once
// WriteWatch: what each parameter's tensor looked like when ferry last bound or checked it (storage,
// offset, version counter), and which parameters were written since (Note [Writes to parameters]).
// ChunkedModel::take_writes acts on what it finds.
//
// Contract: not thread-safe; used by the thread that drives the model, between iterations and at the
// edges of forward() and backward() (never inside them). Indices are ParamTable's.
//
// Note [Writes to parameters]
// Users write parameters: pretrained weights loaded after the optimizer was built (a copy_, or
// torch::load, which gives each parameter the loaded tensor's storage with set_()), a clamp after each
// step (a WGAN critic), a clamp or renormalisation inside forward, an EMA swap. The optimizer keeps
// its own fp32 copy (HybridAdam's masters) and wrote it back at every step, so every such write was
// lost at the next step, silently; torch::load also left the parameter outside its chunk for good.
// ChunkedModel remembers each parameter's storage, offset and version counter (every in-place op on
// the tensor or on a view of it bumps that counter; ferry's own writes go through other tensors of the
// chunk and do not) and looks again where a write can first matter: before forward(), at the end of
// forward() (a write inside it), before backward() (a write between them), when an optimizer
// attaches its state (a write before it was built) and before anything reads the values or the
// optimizer's state (take_writes). A parameter with other storage, offset, dtype or device was
// replaced: its values (converted to the compute dtype) go into its slot and the tensor views its slot
// again (same TensorImpl); a shape that differs is refused. Each
// write is then told to the GradSink (values_written) while every slot holds its value: HybridAdam
// takes a replacement's values whole (full precision: an fp32 checkpoint loaded into a bf16 model
// gives exact masters) and an in-place write element by element, where the slot no longer equals the
// master rounded to the compute dtype (a bf16 element the write left alone keeps its master's low
// bits; a written one gets the written value). Cost when nothing was written: three numbers compared
// per parameter tensor (19 ns each on the 2-core CPU, D60), about four looks per step. Not seen:
// writes that bump no counter (through `.data()` or a raw pointer), on any thread.
// A write after backward() and before the optimizer's step lands in the gradient the slot holds then
// (Note [Gradient in the parameter slot]): the step refuses it, naming the parameter. The model's and
// the optimizer's reads (state_dict(), save(), the masters) take writes in first, so a checkpoint
// written right after a write holds it.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "../common/logging.h"

namespace ferry {

class WriteWatch {
 public:
  // A parameter written since remember().
  struct Written {
    int64_t param = -1;
    // Given other storage, offset, dtype or device, or made non-contiguous (set_(), set_data(),
    // torch::load, module.to(dtype)): its tensor is not its slot any more. Else written in place (its
    // version counter moved).
    bool replaced = false;
  };

  // Remembers what each of `params` looks like now (after binding them, or taking their writes in).
  void remember(const std::vector<at::Tensor>& params);
  // The parameters written since remember(), in index order; a parameter bound as the chunks hold it has
  // `dtype` and `device`.
  std::vector<Written> find(const std::vector<at::Tensor>& params, at::ScalarType dtype,
                            const c10::Device& device) const;
  // Counts a take of writes and says at which level to log it: info the first time, debug after (a
  // loop that writes every step, a torch optimizer over the module's parameters or a WGAN critic's
  // clamp, would otherwise log a line per step).
  log::Level count_take();
  // take_writes() calls that took something in.
  int64_t takes() const { return takes_; }

 private:
  std::vector<const c10::StorageImpl*> storage_;
  std::vector<int64_t> offset_;
  std::vector<int64_t> version_;
  int64_t takes_ = 0;
};

}  // namespace ferry
