// HybridAdam across ranks: Note [Sharded optimizer state] (cpu_adam/hybrid_adam.h), D44.
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ferry/common/event_trace.h"
#include "ferry/common/logging.h"
#include "ferry/cpu_adam/hybrid_adam.h"

namespace ferry {
namespace {

using trace::now_ns;

}  // namespace

void HybridAdam::broadcast_initial_values_locked() {
  // Rank 0's starting point everywhere: its masters (fp32, held on the host until placement), then the
  // parameter chunks from them, as a step writes them.
  for (int64_t c = 0; c < num_chunks(); ++c) {
    at::Tensor master = state_->payload(kMasterRole, c);
    TORCH_INTERNAL_ASSERT(comm_->device_ok(master.device()), "the masters are on the host before placement");
    comm_->broadcast(master, 0);
  }
  write_back_locked();
}

void HybridAdam::shard_locked() {
  if (world_ == 1 || sharded_) return;
  TORCH_INTERNAL_ASSERT(!placed_, "placement comes after sharding");
  // The ranks must agree on the layout chunk for chunk, slot for slot: every collective below pairs them.
  const ChunkLayout& layout = model_.layout();
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](int64_t v) { h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull; };
  mix(layout.num_chunks());
  for (const ChunkExtent& e : layout.chunks()) mix(e.numel);
  for (const Slot& s : layout.slots()) {
    mix(s.chunk);
    mix(s.offset);
    mix(s.numel);
  }
  const double mine = static_cast<double>(h >> 12);  // exact in a double
  at::Tensor range = at::tensor({mine, -mine}, at::kDouble);
  comm_->all_reduce(range, dist::ReduceOp::kMax);
  TORCH_CHECK(range[0].item<double>() == -range[1].item<double>(), "ferry: rank ", rank_, ": the ranks' chunk layouts "
              "differ (same model, chunk size and call order on every rank is needed for data parallelism)");
  std::vector<int> roles{kMasterRole, kExpAvgRole, kExpAvgSqRole};  // accumulation chunks stay on every rank
  int64_t held = 0, bytes = 0;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (c % world_ == rank_) {
      ++held;
      bytes += state_->group_bytes(c);
    } else {
      state_->drop(c, roles);
    }
  }
  sharded_ = true;
  log::info("ferry: rank ", rank_, " of ", world_, " holds the optimizer state of ", held, " of ", num_chunks(),
            " chunk groups (", format_bytes(bytes), ")");
}

std::vector<HybridAdam::Span> HybridAdam::slot_ranges_locked(int64_t c, const std::vector<char>& mask,
                                                              bool want) const {
  const ChunkLayout& layout = model_.layout();
  std::vector<Span> out;
  for (int64_t t : layout.chunks()[c].tensors) {
    const Slot& slot = layout.slots()[t];
    if (slot.numel == 0 || static_cast<bool>(mask[t]) != want) continue;
    if (!out.empty() && out.back().end == slot.offset) {
      out.back().end = slot.offset + slot.numel;
    } else {
      out.push_back({0, slot.offset, slot.offset + slot.numel});
    }
  }
  return out;
}

at::Tensor HybridAdam::comm_payload_locked(int64_t c) {
  ChunkStore& params = model_.store();
  const ChunkId pc = model_.param_chunk(c);
  at::Tensor payload = params.payload(pc);
  if (!comm_->device_ok(payload.device())) {  // Gloo on CUDA: the chunk is staged on the host
    params.move(pc, Location::kHost);
    payload = params.payload(pc);
  }
  return payload;
}

void HybridAdam::reduce_grads_locked(const std::vector<char>& local_landed) {
  trace::Span span("adam", "adam.reduce_scatter_grads");
  const int64_t n = num_chunks();
  const bool accumulate = options_.accumulate_grads;
  if (accumulate) reduced_grads_.assign(n, at::Tensor());
  for (int64_t first = 0; first < n; first += world_) {
    const int64_t last = std::min(n, first + world_);
    int64_t cap = 0;
    for (int64_t c = first; c < last; ++c) cap = std::max(cap, model_.layout().chunks()[c].numel);
    at::Tensor flat;
    for (int64_t c = first; c < last; ++c) {
      // This rank's contribution to chunk c: its landed gradients, zeros in every other slot (default
      // mode: those slots hold parameter values, which must not be summed).
      const at::Tensor src = accumulate ? state_->payload(kGradRole, c) : comm_payload_locked(c);
      if (!flat.defined()) flat = at::zeros({world_ * cap}, src.options().device(at::kCPU));
      at::Tensor dst = flat.slice(0, (c - first) * cap, (c - first) * cap + src.numel());
      dst.copy_(src);
      if (!accumulate) {
        for (const Span& s : slot_ranges_locked(c, local_landed, false)) dst.slice(0, s.begin, s.end).zero_();
      }
    }
    at::Tensor out = at::empty({cap}, flat.options());
    comm_->reduce_scatter(out, flat);
    const int64_t mine = first + rank_;
    if (mine >= last) continue;
    const int64_t numel = model_.layout().chunks()[mine].numel;
    if (accumulate) {
      reduced_grads_[mine] = out.slice(0, 0, numel);
    } else {
      // The owner's chunk: summed gradients in the slots that received one on any rank; the others get
      // their values back from the masters.
      at::Tensor payload = comm_payload_locked(mine);
      payload.copy_(out.slice(0, 0, numel));
      restore_values(payload, state_->payload(kMasterRole, mine), slot_ranges_locked(mine, landed_, false));
    }
  }
}

void HybridAdam::gather_groups_locked(at::ScalarType dtype, const std::function<at::Tensor(int64_t)>& local,
                                      const std::function<void(int64_t, const at::Tensor&)>& got) {
  const int64_t n = num_chunks();
  for (int64_t first = 0; first < n; first += world_) {
    const int64_t last = std::min(n, first + world_);
    int64_t cap = 0;
    for (int64_t c = first; c < last; ++c) cap = std::max(cap, model_.layout().chunks()[c].numel);
    at::Tensor mine = at::zeros({cap}, at::TensorOptions().dtype(dtype));
    const int64_t own = first + rank_;
    if (own < last) {
      const at::Tensor values = local(own);
      mine.slice(0, 0, values.numel()).copy_(values);
    }
    at::Tensor all = at::empty({world_ * cap}, mine.options());
    comm_->all_gather(all, mine);
    for (int64_t c = first; c < last; ++c) {
      got(c, all.slice(0, (c - first) * cap, (c - first) * cap + model_.layout().chunks()[c].numel));
    }
  }
}

void HybridAdam::gather_params_locked() {
  trace::Span span("adam", "adam.all_gather_params");
  ChunkStore& params = model_.store();
  const at::ScalarType dtype = model_.compute_dtype();
  gather_groups_locked(
      dtype, [&](int64_t c) { return params.payload(model_.param_chunk(c)); },
      [&](int64_t c, const at::Tensor& values) {
        if (owned(c)) return;  // the owner has them
        params.payload(model_.param_chunk(c)).copy_(values);
      });
}

StepResult HybridAdam::dist_step_locked() {
  trace::Span step_span("adam", "adam.dist_step");
  shard_locked();
  place_locked();
  StepResult result;
  result.loss_scale = loss_scale();
  int64_t comm_ns = 0;
  int64_t t0 = now_ns();
  // 1. The parameters that received a gradient on any rank (a rank may have skipped one).
  const std::vector<char> local = landed_;
  const int64_t np = model_.num_params();
  at::Tensor flags = at::empty({np}, at::kFloat);
  float* f = flags.data_ptr<float>();
  for (int64_t p = 0; p < np; ++p) f[p] = landed_[p] ? 1.0f : 0.0f;
  comm_->all_reduce(flags, dist::ReduceOp::kMax);
  bool any = false;
  for (int64_t p = 0; p < np; ++p) {
    landed_[p] = f[p] != 0.0f;
    any = any || landed_[p];
  }
  TORCH_CHECK(any, "ferry: HybridAdam::step() found no gradients since the last zero_grad() on any rank; call "
                   "model.backward(loss) first");
  grads_landed_ = true;
  // 2. Every rank's gradients summed into their owners' chunks.
  reduce_grads_locked(local);
  comm_ns += now_ns() - t0;
  // 3. The owned chunks to their state's tier; their norms, totalled over the ranks.
  stage_param_chunks_locked();
  t0 = now_ns();
  ChunkNorms norms = grad_norms_locked();
  result.device_syncs = norms.syncs;
  const int64_t tn = now_ns();
  at::Tensor totals = at::tensor({norms.total_sq, norms.all_finite ? 0.0 : 1.0}, at::kDouble);
  comm_->all_reduce(totals, dist::ReduceOp::kSum);
  norms.total_sq = totals[0].item<double>();
  norms.all_finite = totals[1].item<double>() == 0.0 && std::isfinite(norms.total_sq);
  comm_ns += now_ns() - tn;
  result.norm_ns = now_ns() - t0;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (owned(c)) (on_device_[c] ? result.device_chunks : result.host_chunks) += 1;
  }
  // 4. The owners update (or, on overflow, restore) their chunks; 5. everyone gets the new values.
  result = apply_locked(norms, result);
  reduced_grads_.clear();
  t0 = now_ns();
  gather_params_locked();
  comm_ns += now_ns() - t0;
  result.comm_ns = comm_ns;
  return result;
}

}  // namespace ferry
