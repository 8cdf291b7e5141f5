#pragma once
// GradSlots: which parameters' chunk slots hold their gradient instead of their value (Note [Gradient
// in the parameter slot]), whether the backward those gradients came from failed, and which
// parameters required grad when the model last looked (what lands: a layer frozen or unfrozen during
// fine-tuning changes it).
//
// Contract: not thread-safe. A slot is marked on autograd's thread during backward (landings of one
// model come one at a time: its post-accumulate-grad hooks) and cleared by the optimizer on that
// thread or between iterations; the model's phases keep those apart. Indices are ParamTable's.
//
// Note [Gradient in the parameter slot]
// Once autograd has accumulated a parameter's gradient, backward does not read that parameter again
// (every op that uses it and needs its gradient has run), and its value is not needed until the
// optimizer writes the updated one. So the gradient (same dtype, same size) can take the value's
// place in the parameter chunk: no gradient memory at all beside the parameters and the optimizer
// state, and the gradient travels with its chunk (an evicted chunk carries its gradients to the host,
// where the host Adam reads them). PatrickStar and Gemini do the same. The model then marks the
// parameter: a use of it (a forward before the optimizer step) fails with a clear error instead of
// computing with a gradient, and state_dict() refuses. The optimizer writes the values back and calls
// clear_grad_slots(). Gradient accumulation over micro-batches needs the values between backward
// passes, so it keeps separate fp32 gradient memory (HybridAdamOptions::accumulate_grads), into which
// the optimizer empties the slots chunk by chunk during backward and gives the values back
// (Note [Accumulation per chunk], optim/slot_accumulation.h).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ferry {

class GradSlots {
 public:
  explicit GradSlots(int64_t num_params) : in_slot_(num_params, 0) {}

  bool holds_grad(int64_t p) const { return in_slot_[p] != 0; }
  bool any() const { return count_ > 0; }
  int64_t count() const { return count_; }
  // The first parameter whose slot holds its gradient, or -1.
  int64_t first() const;
  // `p`'s slot holds its gradient now; false if it did already (a second gradient was added there).
  bool mark(int64_t p);
  void clear(int64_t p);
  void clear_all();

  // Whether the last backward that ran failed: the gradients in the slots are then partial.
  void set_backward_failed(bool failed) { backward_failed_ = failed; }
  bool backward_failed() const { return backward_failed_; }

  // Remembers each of `params`' requires_grad (when the model's gradient hooks are installed).
  void remember_trainable(const std::vector<at::Tensor>& params);
  bool trainable(int64_t p) const { return trainable_[p] != 0; }
  // How many of `params` changed requires_grad since it was remembered, and the first of them (-1: none);
  // remembers the new values.
  struct Changed {
    int64_t count = 0;
    int64_t first = -1;
  };
  Changed trainable_changed(const std::vector<at::Tensor>& params);

 private:
  std::vector<char> in_slot_;  // per parameter
  int64_t count_ = 0;          // how many are set
  bool backward_failed_ = false;
  std::vector<char> trainable_;  // per parameter: requires_grad when last looked
};

}  // namespace ferry
