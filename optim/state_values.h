#pragma once
// StateValues: a state group's roles as fp32 values, one parameter at a time, whatever the state's
// format: the fp32 slots themselves, or the compact format's decoded (Note [The compact state format],
// cpu_adam/compact_state.h) and encoded again. For what reads or writes state values from outside the
// update (HybridAdam's state views and state_dict, the checkpoint files), so that the format stays
// inside the state chunks and the kernels.
//
// Decoding and encoding again gives the compact state's own bits (compact_state.h), so a checkpoint of
// compact state holds it exactly in fp32 and loads back to the same bits. fp32 values written into
// compact state are rounded as the format rounds them (the master to nearest bf16, each block's
// moments to codes against its new maxima).
//
// Contract: between iterations (no update running); not thread-safe. read() copies; write() takes
// values of the slot's element count (any shape), finite (the caller checks).
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../chunk/state_chunks.h"
#include "state_roles.h"

namespace ferry::optim {

class StateValues {
 public:
  explicit StateValues(StateChunks& state);

  StateChunks& state() { return state_; }
  bool compact() const { return is_compact(state_); }
  // Role `role` (kMasterRole, kExpAvgRole, kExpAvgSqRole, kGradRole: not the scales) of parameter
  // `param` as an fp32 CPU tensor of the parameter's shape.
  at::Tensor read(int role, int64_t param);
  // Writes `values` (fp32, CPU or the slot's device) into that role of `param`.
  void write(int role, int64_t param, const at::Tensor& values);

 private:
  StateChunks& state_;
};

}  // namespace ferry::optim
