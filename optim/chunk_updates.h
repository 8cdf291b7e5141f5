#pragma once
// ChunkUpdates: how one layout chunk's state is updated, wherever it lives. The spans of its landed
// gradients (GradLedger) become CpuAdam spans over the fp32 master and moments and the gradients; the
// host runs CpuAdam on them, the device runs device_adam_update on them (the same per-element function,
// so the same bits: D53); norms are taken the same way on either side. The new compute-dtype value is
// written in the update's own pass where it can be: over the gradient it replaces in the parameter slot
// (default mode), or into the parameter chunk (accumulation mode, where that chunk is beside the state:
// the chunk is then marked written and the write-back after the step skips it).
//
// Contract: not thread-safe; called under HybridAdam's mutex, except run_host/adam_spans/host_norm/
// restore_values, which host jobs call on CpuAdam's worker (they read only what they are given, the
// group options, and write only the spans' memory).
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>
#include <variant>
#include <vector>

#include "../common/exact_sum.h"
#include "../cpu_adam/cpu_adam.h"
#include "../hooks/chunked_model.h"
#include "grad_ledger.h"
#include "ownership.h"
#include "state_placement.h"

namespace ferry::optim {

// One run of one update: over fp32 state (a Span's elements) or compact state (one tensor's: the
// compact blocks are per tensor, Note [The compact state format]).
using StateSpan = std::variant<AdamSpan, CompactAdamSpan>;

// A chunk's landed gradients, as taken by its norm.
struct ChunkOutcome {
  ExactSum sum_sq;     // of the chunk's landed gradients as landed, one term per parameter (D87)
  bool finite = true;  // every gradient finite, and sum_sq too (an overflowing norm is non-finite)
};

// The step's squared norm and every chunk's finiteness.
struct ChunkNorms {
  ExactSum sum_sq;          // every landed gradient's term (late parts too), exactly (D87)
  std::vector<char> finite; // per layout chunk
  // Eager backward_step, per layout chunk: its late part's (Note [A gradient after its chunk's update]),
  // apart from the part its job updated; empty when no chunk has one.
  std::vector<char> late_finite;
  double total_sq = 0.0;    // sum_sq, rounded once (finish_norms)
  bool all_finite = true;
  int64_t syncs = 0;  // host syncs it took (reading device norms): 0 or 1
};

class ChunkUpdates {
 public:
  // `reduced(c)`: at N > 1 with accumulation, chunk c's gradients summed over the ranks during a step
  // (undefined otherwise: this rank's accumulation chunk holds them).
  ChunkUpdates(ChunkedModel& model, CpuAdam& adam, bool accumulate_grads, StatePlacement& placement,
               GradLedger& ledger, const Ownership& ownership, std::function<at::Tensor(int64_t)> reduced);

  // Where chunk c's gradients are: the fp32 accumulation chunk (or the sums over ranks), or (default
  // mode) the parameter chunk.
  at::Tensor grad_payload(int64_t chunk);
  // CpuAdam spans over a chunk's `state` (host_state's, with the moments) and `grads` for `spans`
  // (default mode: the new value is written over each grad; accumulation mode: into `lowp`, a 16-bit
  // parameter chunk payload, when given): one per span over fp32 state, one per tensor over compact.
  std::vector<std::pair<Span, StateSpan>> adam_spans(const std::vector<Span>& spans, const HostState& state,
                                                     const at::Tensor& grads, const at::Tensor& lowp = {}) const;
  // Runs CpuAdam over `spans` (each with its group's options and its own step count, D62; `frozen`: the
  // groups as a step froze them, for an update that runs after the step returned). Default mode with an
  // fp32 compute copy: the master is the value, copied over the gradient after.
  void run_host(const std::vector<std::pair<Span, StateSpan>>& spans, const UpdateOptions& options,
                const std::vector<CpuAdam::FrozenGroup>* frozen = nullptr) const;
  // The options and step count span `s` is updated with: its group's (as `frozen` froze them, or now),
  // the step count lessened by the span's lag (D62).
  CpuAdam::FrozenGroup update_group(const Span& s, const std::vector<CpuAdam::FrozenGroup>* frozen) const;

  // Chunk c updated on the host / on the device now, over its landed spans (`only`: of those parameters
  // only, GradLedger::spans). Device: `found_inf` (a device flag, optional) nonzero skips the update and
  // gives the slots their values back (round(master); device_adam.h).
  void host_update(int64_t chunk, const UpdateOptions& options, const std::vector<char>* only = nullptr);
  void device_update(int64_t chunk, double grad_scale, const at::Tensor& found_inf = {},
                     const std::vector<char>* only = nullptr);

  // Squared norms of `grads` (chunk `chunk`'s, as laid out) over `spans`, one term per parameter (each
  // span's slots apart: Note [One term per parameter]): on the host (CpuAdam::grad_norm_sq), or as a
  // device tensor (device_grad_norms_sq: a 1-D Double, one term per parameter, inf/NaN where a gradient
  // is; undefined when `spans` is empty). Both sum a term in one order (D85): the same bits either side.
  ChunkOutcome host_norm(int64_t chunk, const at::Tensor& grads, const std::vector<Span>& spans) const;
  at::Tensor device_norms(int64_t chunk, const at::Tensor& grads, const std::vector<Span>& spans) const;
  // Note [Norms before the trip]: the device norms of a chunk's gradients taken before it leaves for the
  // host, on their way there: one double per parameter in host memory. On CUDA they are copied in the
  // current stream's order, so they are read after the chunk's own copy to the host, started after this
  // call from the same stream, has landed (a host job's gradients); at once on the simulated device.
  at::Tensor norms_before_the_trip(int64_t chunk, const at::Tensor& grads, const std::vector<Span>& spans) const;
  // What those norms say, as finish_norms() reads device norms.
  static ChunkOutcome outcome_of(const at::Tensor& trip_norms);
  // Gradient bytes host_norm() has read since the last take (host jobs add theirs on the worker).
  int64_t take_host_norm_bytes() { return host_norm_bytes_.exchange(0); }
  // Reads the device norms (one host sync, if any) into `norms` (device_index[k]: the chunk of the terms
  // in device_norms[k], each a device_norms() tensor; n + c: chunk c's late part), then totals.
  static void finish_norms(const std::vector<at::Tensor>& device_norms, const std::vector<int64_t>& device_index,
                           ChunkNorms& norms);
  // Writes the masters of `spans` into the parameter chunk payload `param` (gives landed slots their values back).
  static void restore_values(const at::Tensor& param, const at::Tensor& master, const std::vector<Span>& spans);

  // Accumulation mode: which chunks' new compute-dtype values the update wrote itself (write_back skips
  // them). arm_written: none yet, for `num_chunks`; clear_written: forget.
  void arm_written(int64_t num_chunks) { written_.assign(num_chunks, 0); }
  void mark_written(int64_t chunk);
  void unmark_written(int64_t chunk) { written_[chunk] = 0; }
  void clear_written() { written_.clear(); }
  // The masters into the parameter chunks in the compute dtype (owned chunks; `after_update`: except
  // those the update wrote); clears the marks. Returns the chunks copied.
  int64_t write_back(bool after_update = false);

 private:
  // Accumulation mode at N = 1: layout chunk c's parameter chunk payload when it is where c's state is
  // and 16-bit, so that the update writes the new values in its own pass (marked written); else undefined.
  at::Tensor lowp_target(int64_t chunk);
  std::vector<std::pair<Span, StateSpan>> spans_of(int64_t chunk, const std::vector<char>* only);
  // The ranges a norm takes apart: each parameter's slot in `spans` of chunk `chunk`.
  std::vector<std::pair<int64_t, int64_t>> norm_terms(int64_t chunk, const std::vector<Span>& spans) const;

  ChunkedModel& model_;
  CpuAdam& adam_;
  const bool accumulate_;
  StatePlacement& placement_;
  GradLedger& ledger_;
  const Ownership& ownership_;
  std::function<at::Tensor(int64_t)> reduced_;
  std::vector<char> written_;  // per layout chunk (accumulation mode)
  mutable std::atomic<int64_t> host_norm_bytes_{0};
};

}  // namespace ferry::optim
