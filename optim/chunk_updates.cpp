#include "chunk_updates.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "../common/event_trace.h"
#include "../cpu_adam/device_adam.h"
#include "../cpu_adam/device_norm.h"

namespace ferry::optim {

ChunkUpdates::ChunkUpdates(ChunkedModel& model, CpuAdam& adam, bool accumulate_grads, StatePlacement& placement,
                           GradLedger& ledger, const Ownership& ownership, std::function<at::Tensor(int64_t)> reduced)
    : model_(model),
      adam_(adam),
      accumulate_(accumulate_grads),
      placement_(placement),
      ledger_(ledger),
      ownership_(ownership),
      reduced_(std::move(reduced)) {}

at::Tensor ChunkUpdates::grad_payload(int64_t c) {
  if (accumulate_) {
    // A data-parallel step reads the gradients summed over ranks; the accumulation chunk keeps this rank's.
    if (reduced_) {
      at::Tensor sums = reduced_(c);
      if (sums.defined()) return sums;
    }
    return placement_.payload(kGradRole, c);
  }
  return model_.store().payload(model_.param_chunk(c));
}

std::vector<std::pair<Span, StateSpan>> ChunkUpdates::adam_spans(const std::vector<Span>& landed, const HostState& state,
                                                                 const at::Tensor& grads, const at::Tensor& lowp) const {
  const at::ScalarType grad_dtype = grads.scalar_type();
  const int64_t grad_elem = static_cast<int64_t>(c10::elementSize(grad_dtype));
  char* g = static_cast<char*>(grads.data_ptr());
  // Default mode: the grads are in the parameter chunk (on the host now); the kernel writes the new
  // bf16/fp16 value over each grad it has read, in the same pass (fp32: copied after the update).
  // Accumulation mode: into `lowp` (the parameter chunk, where lowp_target found it), if given.
  const bool in_place_lowp = !accumulate_ && grad_dtype != at::kFloat;
  TORCH_INTERNAL_ASSERT(!lowp.defined() || (accumulate_ && lowp.scalar_type() != at::kFloat));
  char* lowp_base = in_place_lowp ? g : (lowp.defined() ? static_cast<char*>(lowp.data_ptr()) : nullptr);
  const at::ScalarType lowp_dtype = in_place_lowp ? grad_dtype : (lowp.defined() ? lowp.scalar_type() : at::kFloat);
  const int64_t lowp_elem = static_cast<int64_t>(c10::elementSize(lowp_dtype));
  std::vector<std::pair<Span, StateSpan>> spans;
  if (state.compact()) {
    TORCH_INTERNAL_ASSERT(state.master16 && state.exp_avg8 && state.exp_avg_sq8, "compact spans without the state");
    // The compact blocks are per tensor: one span per tensor (a span covers whole slots).
    auto piece = state.pieces.begin();
    for (const Span& s : landed) {
      while (piece != state.pieces.end() && piece->begin < s.begin) ++piece;
      for (; piece != state.pieces.end() && piece->begin < s.end; ++piece) {
        TORCH_INTERNAL_ASSERT(piece->begin + piece->numel <= s.end, "a span ending inside a tensor");
        CompactAdamSpan c;
        c.master = state.master16 + piece->begin;
        c.grad = g + piece->begin * grad_elem;
        c.grad_dtype = grad_dtype;
        c.exp_avg = state.exp_avg8 + piece->begin;
        c.exp_avg_scale = piece->exp_avg_scale;
        c.exp_avg_sq = state.exp_avg_sq8 + piece->begin;
        c.exp_avg_sq_scale = piece->exp_avg_sq_scale;
        if (lowp_base != nullptr) {
          c.param_lowp = lowp_base + piece->begin * lowp_elem;
          c.lowp_dtype = lowp_dtype;
        }
        c.numel = piece->numel;
        c.element_offset = piece->stream_offset;
        spans.emplace_back(s, c);
      }
    }
    return spans;
  }
  TORCH_INTERNAL_ASSERT(state.master && state.exp_avg && state.exp_avg_sq, "fp32 spans without the state");
  for (const Span& s : landed) {
    AdamSpan span;
    span.param = state.master + s.begin;
    span.grad = g + s.begin * grad_elem;
    span.grad_dtype = grad_dtype;
    span.exp_avg = state.exp_avg + s.begin;
    span.exp_avg_sq = state.exp_avg_sq + s.begin;
    span.numel = s.end - s.begin;
    if (lowp_base != nullptr) {
      span.param_lowp = lowp_base + s.begin * lowp_elem;
      span.lowp_dtype = lowp_dtype;
    }
    spans.emplace_back(s, span);
  }
  return spans;
}

CpuAdam::FrozenGroup ChunkUpdates::update_group(const Span& s, const std::vector<CpuAdam::FrozenGroup>* frozen) const {
  CpuAdam::FrozenGroup f = frozen != nullptr ? (*frozen)[s.group] : adam_.freeze(s.group);
  f.step -= s.lag;
  TORCH_INTERNAL_ASSERT(f.step >= 1, "a span of group ", s.group, " with lag ", s.lag, " at group step ", f.step + s.lag);
  return f;
}

void ChunkUpdates::run_host(const std::vector<std::pair<Span, StateSpan>>& spans, const UpdateOptions& options,
                            const std::vector<CpuAdam::FrozenGroup>* frozen) const {
  for (const auto& [s, state_span] : spans) {
    if (const auto* compact = std::get_if<CompactAdamSpan>(&state_span)) {
      // The compute copy is 16-bit (the format needs it): written in the update's pass, or after it.
      adam_.update(update_group(s, frozen), *compact, options);
      continue;
    }
    const AdamSpan& span = std::get<AdamSpan>(state_span);
    adam_.update(update_group(s, frozen), span, options);
    if (!accumulate_ && !span.param_lowp) {  // fp32 compute copy: the master is the value
      std::memcpy(const_cast<void*>(span.grad), span.param, static_cast<size_t>(span.numel) * sizeof(float));
    }
  }
}

at::Tensor ChunkUpdates::lowp_target(int64_t c) {
  if (!accumulate_ || ownership_.world() > 1) return {};
  ChunkStore& params = model_.store();
  const ChunkId pc = model_.param_chunk(c);
  if (params.location(pc) != (placement_.on_device(c) ? Location::kDevice : Location::kHost)) return {};
  at::Tensor payload = params.payload(pc);  // waits for a copy into the host; orders the stream after one into the device
  if (payload.scalar_type() == at::kFloat) return {};
  mark_written(c);
  return payload;
}

void ChunkUpdates::mark_written(int64_t chunk) {
  TORCH_INTERNAL_ASSERT(chunk < static_cast<int64_t>(written_.size()), "the written marks are not armed");
  written_[chunk] = 1;
}

std::vector<std::pair<Span, StateSpan>> ChunkUpdates::spans_of(int64_t c, const std::vector<char>* only) {
  return adam_spans(ledger_.spans(model_.layout(), c, only),
                    placement_.host_state(c, /*held=*/true, /*moments=*/true, model_.layout()), grad_payload(c),
                    lowp_target(c));
}

void ChunkUpdates::host_update(int64_t c, const UpdateOptions& options, const std::vector<char>* only) {
  trace::Span span("adam", trace::enabled() ? "host adam chunk " + std::to_string(c) : std::string());
  run_host(spans_of(c, only), options);
}

void ChunkUpdates::device_update(int64_t c, double grad_scale, const at::Tensor& found_inf,
                                 const std::vector<char>* only) {
  trace::Span span("adam", trace::enabled() ? "device adam chunk " + std::to_string(c) : std::string());
  const HostState state = placement_.host_state(c, /*held=*/true, /*moments=*/true, model_.layout());
  const at::Tensor& p = state.master_tensor;
  const at::Tensor g = grad_payload(c);
  // On CUDA the kernel would fault on a host gradient; the simulated device would not notice, so the
  // invariant is checked here for both.
  TORCH_CHECK(accumulate_ || model_.store().location(model_.param_chunk(c)) == Location::kDevice,
              "ferry: HybridAdam: the device update of state chunk ", c, " found its parameter chunk (holding the "
              "gradients) on the host; it must be staged on the device first (internal error)");
  // The spans the host update would get (adam_spans): in the default mode the new bf16/fp16 value is
  // written over the gradient in the same pass; an fp32 compute copy is the master, copied after.
  for (const auto& [landed, state_span] : adam_spans(ledger_.spans(model_.layout(), c, only), state, g, lowp_target(c))) {
    if (const auto* compact = std::get_if<CompactAdamSpan>(&state_span)) {
      device_adam_update(adam_, update_group(landed, nullptr), *compact, grad_scale, p.device(), found_inf);
      continue;
    }
    const AdamSpan& s = std::get<AdamSpan>(state_span);
    device_adam_update(adam_, update_group(landed, nullptr), s, grad_scale, p.device(), found_inf);
    if (!accumulate_ && !s.param_lowp) {
      const int64_t begin = s.param - p.data_ptr<float>();
      g.slice(0, begin, begin + s.numel).copy_(p.slice(0, begin, begin + s.numel));
    }
  }
}

// Note [One term per parameter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// D85 made a run of gradients sum to the same bits wherever it is. What a run is must not depend on
// the layout either: a span merges the slots of neighbours in one chunk, so its blocks of 1,024 would
// straddle parameters differently for another chunk size, and summing the runs' totals in fp64 in
// chunk order would group them differently. So a norm's term is one parameter's gradient (its slot,
// from its first element, in D85's order), and the terms are totalled exactly (ExactSum), which no
// order or grouping of them changes: by chunk, by thread, on the device or the host, over the ranks.
// The step's norm is then a function of the parameters' gradients alone (D87).
std::vector<std::pair<int64_t, int64_t>> ChunkUpdates::norm_terms(int64_t chunk, const std::vector<Span>& spans) const {
  const ChunkLayout& layout = model_.layout();
  std::vector<std::pair<int64_t, int64_t>> out;
  size_t k = 0;
  size_t begun = 0, ended = 0;  // spans whose first and last elements are a slot's: whole slots (and gaps)
  for (int64_t t : layout.chunks()[chunk].tensors) {  // in packing order: offsets rise, as the spans' do
    const Slot& slot = layout.slots()[t];
    if (slot.numel == 0) continue;
    while (k < spans.size() && spans[k].end <= slot.offset) ++k;
    if (k == spans.size()) break;
    if (spans[k].begin <= slot.offset && slot.offset + slot.numel <= spans[k].end) {
      out.emplace_back(slot.offset, slot.offset + slot.numel);
      begun += spans[k].begin == slot.offset;
      ended += spans[k].end == slot.offset + slot.numel;
    }
  }
  TORCH_INTERNAL_ASSERT(begun == spans.size() && ended == spans.size(), "of the ", spans.size(), " spans of chunk ",
                        chunk, ", ", begun, " begin and ", ended, " end at a slot's bounds");
  return out;
}

ChunkOutcome ChunkUpdates::host_norm(int64_t chunk, const at::Tensor& grads, const std::vector<Span>& spans) const {
  ChunkOutcome out;
  const int64_t elem = static_cast<int64_t>(grads.element_size());
  const char* base = static_cast<const char*>(grads.data_ptr());
  int64_t bytes = 0;
  for (const auto& [begin, end] : norm_terms(chunk, spans)) {
    const GradNorm norm = adam_.grad_norm_sq(base + begin * elem, grads.scalar_type(), end - begin);
    out.sum_sq.add(norm.sum_sq);
    out.finite = out.finite && !norm.nonfinite;
    bytes += (end - begin) * elem;
  }
  host_norm_bytes_ += bytes;
  // A norm that overflows counts as non-finite, as the device's does (D70): a chunk is then skipped
  // wherever its state lives, and the step's report agrees with what was updated.
  out.finite = out.finite && std::isfinite(out.sum_sq.value());
  return out;
}

at::Tensor ChunkUpdates::device_norms(int64_t chunk, const at::Tensor& grads, const std::vector<Span>& spans) const {
  if (spans.empty()) return {};
  return device_grad_norms_sq(adam_, grads, norm_terms(chunk, spans));
}

at::Tensor ChunkUpdates::norms_before_the_trip(int64_t chunk, const at::Tensor& grads,
                                               const std::vector<Span>& spans) const {
  const at::Tensor norms = device_norms(chunk, grads, spans);
  if (!norms.defined() || !norms.is_cuda()) return norms;
  at::Tensor host = at::empty(norms.sizes(), norms.options().device(at::kCPU).pinned_memory(true));
  host.copy_(norms, /*non_blocking=*/true);
  return host;
}

ChunkOutcome ChunkUpdates::outcome_of(const at::Tensor& trip_norms) {
  ChunkOutcome out;
  const at::Tensor t = trip_norms.contiguous();
  const double* v = t.data_ptr<double>();
  for (int64_t k = 0; k < t.numel(); ++k) {
    out.finite = out.finite && std::isfinite(v[k]);
    out.sum_sq.add(v[k]);
  }
  out.finite = out.finite && std::isfinite(out.sum_sq.value());
  return out;
}

void ChunkUpdates::finish_norms(const std::vector<at::Tensor>& device_norms, const std::vector<int64_t>& device_index,
                                ChunkNorms& norms) {
  int64_t syncs = 0;
  const int64_t n = static_cast<int64_t>(norms.finite.size());
  if (!device_norms.empty()) {  // one host sync for every device chunk
    const at::Tensor all = at::cat(device_norms).to(at::kCPU, at::kDouble);
    syncs = 1;
    const double* v = all.data_ptr<double>();
    for (size_t k = 0; k < device_index.size(); ++k) {
      const bool late_part = device_index[k] >= n;  // n + c: chunk c's late part
      const int64_t c = late_part ? device_index[k] - n : device_index[k];
      std::vector<char>& finite = late_part ? norms.late_finite : norms.finite;
      for (const double* end = v + device_norms[k].numel(); v < end; ++v) {
        finite[c] = finite[c] && std::isfinite(*v);
        norms.sum_sq.add(*v);
      }
    }
  }
  norms.all_finite = true;
  for (int64_t c = 0; c < n; ++c) {
    norms.all_finite = norms.all_finite && norms.finite[c];
    if (!norms.late_finite.empty()) norms.all_finite = norms.all_finite && norms.late_finite[c];
  }
  norms.total_sq = norms.sum_sq.value();
  norms.all_finite = norms.all_finite && std::isfinite(norms.total_sq);
  norms.syncs = syncs;
}

void ChunkUpdates::restore_values(const at::Tensor& param, const at::Tensor& master, const std::vector<Span>& spans) {
  for (const Span& sp : spans) param.slice(0, sp.begin, sp.end).copy_(master.slice(0, sp.begin, sp.end));
}

int64_t ChunkUpdates::write_back(bool after_update) {
  int64_t copied = 0;
  for (int64_t c = 0; c < placement_.num_chunks(); ++c) {
    if (!ownership_.owned(c)) continue;  // sharded: the gather brings the owner's values
    // The update wrote the new compute-dtype values in its own pass (lowp_target).
    if (after_update && static_cast<int64_t>(written_.size()) > c && written_[c]) continue;
    model_.store().payload(model_.param_chunk(c)).copy_(placement_.payload(kMasterRole, c));
    ++copied;
  }
  written_.clear();
  return copied;
}

}  // namespace ferry::optim
