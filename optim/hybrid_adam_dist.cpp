// HybridAdam across ranks: Note [Sharded optimizer state] (optim/hybrid_adam.h), D44.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../common/event_trace.h"
#include "../common/logging.h"
#include "hybrid_adam.h"

namespace ferry {
namespace {

using trace::now_ns;

// FNV-1a over 64-bit values: what the ranks compare with one all-reduce (same_on_every_rank_locked) to
// learn whether their layouts, landings or traces agree. A double holds 52 of its bits exactly.
class Fingerprint {
 public:
  void mix(int64_t v) { h_ = (h_ ^ static_cast<uint64_t>(v)) * 1099511628211ull; }
  double value() const { return static_cast<double>(h_ >> 12); }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

}  // namespace

void HybridAdam::check_same_layout_locked() {
  // The ranks must agree on the layout chunk for chunk, slot for slot: every collective pairs them.
  const ChunkLayout& layout = model().layout();
  Fingerprint f;
  f.mix(layout.num_chunks());
  for (const ChunkExtent& e : layout.chunks()) f.mix(e.numel);
  for (const Slot& s : layout.slots()) {
    f.mix(s.chunk);
    f.mix(s.offset);
    f.mix(s.numel);
  }
  f.mix(static_cast<int64_t>(model().compute_dtype()));
  TORCH_CHECK(same_on_every_rank_locked(f.value()), "ferry: rank ", rank_, ": the ranks' chunk "
              "layouts differ (", layout.num_chunks(), " chunks of ", format_bytes(model().chunk_size_bytes()),
              " in ", c10::toString(model().compute_dtype()), " here); data parallelism needs the same model, "
              "precision, chunk size and call order on every rank");
}

void HybridAdam::broadcast_initial_values_locked() {
  // Rank 0's starting point everywhere: its masters (fp32, held on the host until placement), then the
  // parameter chunks from them, as a step writes them.
  check_same_layout_locked();
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
  // Every rank answers together: a rank whose repack waits (Note [A repack waits for held views]) must
  // not leave the others in the next collective.
  const bool final = model().layout_final();
  const bool all_final = same_on_every_rank_locked(final ? 1.0 : 0.0) && final;
  TORCH_CHECK(all_final, "ferry: rank ", rank_, ": the first optimizer step at world size ", world_,
              " came before the warm-up repack ", final ? "of another rank" : "here", " (warmup_iterations > 1, or "
              "a repack waiting for views of parameters held outside ferry, said in the log); the state and "
              "parameters are sharded by the final layout: run the warm-up iterations first, or use "
              "warmup_iterations = 1");
  check_same_layout_locked();  // again: the warm-up repacked in call order
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
  if (options_.shard_params) {
    // Note [Sharded parameters]: from the reduce-scatter of this step on, the other ranks' chunks go.
    std::vector<ChunkId> chunks(num_chunks());
    for (int64_t c = 0; c < num_chunks(); ++c) chunks[c] = model().param_chunk(c);
    param_shards_ = std::make_shared<dist::ParamShards>(model().store(), std::move(chunks), comm_);
    // An owned chunk's update may run behind the step (Note [Update behind the next forward]): a gather
    // sends it only once written. await_chunk takes only deferred_mutex_ (this object calls ParamShards
    // under mutex_, so the guard must not take that).
    param_shards_->set_send_guard([this](int64_t c) { await_chunk(c); });
    model().set_remote_chunks(param_shards_);
    log::info("ferry: rank ", rank_, " shards the parameter chunks too: it keeps ", held, " of ", num_chunks(),
              " between steps and gathers the others, group by group, before their use");
  }
}

bool HybridAdam::same_on_every_rank_locked(double value) {
  at::Tensor range = at::tensor({value, -value}, at::kDouble);
  comm_->all_reduce(range, dist::ReduceOp::kMax);
  return range[0].item<double>() == -range[1].item<double>();
}

std::vector<HybridAdam::Span> HybridAdam::slot_ranges_locked(int64_t c, const std::vector<char>& mask,
                                                              bool want) const {
  const ChunkLayout& layout = model().layout();
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

HybridAdam::OwnedSpans HybridAdam::owned_spans(int64_t c, const at::Tensor& counts) const {
  // counts[i]: how many ranks landed a gradient for the chunk's i-th tensor (the reduce-scatter's sum of
  // each rank's 0/1 flags). Landed somewhere: updated, in runs of one param group and lag, as
  // landed_spans_locked.
  const ChunkLayout& layout = model().layout();
  const at::Tensor n = counts.to(at::kCPU, at::kFloat);  // the flags, read here (on the device: one small copy)
  const float* k = n.data_ptr<float>();
  OwnedSpans out;
  const std::vector<int64_t>& tensors = layout.chunks()[c].tensors;
  bool open = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Slot& slot = layout.slots()[tensors[i]];
    if (slot.numel == 0) continue;
    if (k[i] == 0.0f) {
      open = false;
      if (!out.unlanded.empty() && out.unlanded.back().end == slot.offset) {
        out.unlanded.back().end = slot.offset + slot.numel;
      } else {
        out.unlanded.push_back({0, slot.offset, slot.offset + slot.numel});
      }
      continue;
    }
    const int g = group_of_param_[tensors[i]];
    const int64_t lag = lag_[tensors[i]];
    if (open && out.landed.back().group == g && out.landed.back().lag == lag) {
      out.landed.back().end = slot.offset + slot.numel;
    } else {
      out.landed.push_back({g, slot.offset, slot.offset + slot.numel, lag});
    }
    open = true;
  }
  return out;
}

at::Tensor HybridAdam::comm_payload_locked(int64_t c) {
  ChunkStore& params = model().store();
  const ChunkId pc = model().param_chunk(c);
  at::Tensor payload = params.payload(pc);
  if (!comm_->device_ok(payload.device())) {  // Gloo on CUDA: the chunk is staged on the host
    params.move(pc, Location::kHost);
    payload = params.payload(pc);
  }
  return payload;
}

HybridAdam::GroupBuffer HybridAdam::pack_group_locked(int64_t group) {
  // Member k of the group at [k seg, (k + 1) seg): this rank's gradients of chunk first + k (its landed
  // slots; zeros elsewhere: in default mode those slots hold parameter values, which must not be
  // summed), then one 0/1 per tensor of the chunk (landed here). Summed over ranks, the owner gets the
  // gradients and, per tensor, how many ranks landed one: the union it must update.
  const int64_t n = num_chunks(), first = group * world_, last = std::min(n, first + world_);
  const bool accumulate = options_.accumulate_grads;
  GroupBuffer b;
  int64_t flags = 0;
  for (int64_t c = first; c < last; ++c) {
    b.cap = std::max(b.cap, model().layout().chunks()[c].numel);
    flags = std::max<int64_t>(flags, static_cast<int64_t>(model().layout().chunks()[c].tensors.size()));
  }
  b.seg = b.cap + flags;
  const at::ScalarType dtype = accumulate ? at::kFloat : model().compute_dtype();
  b.flat = at::zeros({world_ * b.seg}, at::TensorOptions().dtype(dtype).device(comm_buffer_device()));
  for (int64_t c = first; c < last; ++c) {
    at::Tensor member = b.flat.slice(0, (c - first) * b.seg, (c - first + 1) * b.seg);
    if (!accumulate && model().store().location(model().param_chunk(c)) == Location::kNone) {
      continue;  // a sharded chunk not fetched this iteration: nothing of it was used, nothing landed (zeros)
    }
    const at::Tensor src = accumulate ? state_->payload(kGradRole, c) : comm_payload_locked(c);
    at::Tensor values = member.slice(0, 0, src.numel());
    values.copy_(src);
    if (!accumulate) {
      for (const Span& s : slot_ranges_locked(c, landed_, false)) values.slice(0, s.begin, s.end).zero_();
    }
    const std::vector<int64_t>& tensors = model().layout().chunks()[c].tensors;
    at::Tensor mine = at::empty({static_cast<int64_t>(tensors.size())}, at::kFloat);
    for (size_t i = 0; i < tensors.size(); ++i) mine.data_ptr<float>()[i] = landed_[tensors[i]] ? 1.0f : 0.0f;
    member.slice(0, b.cap, b.cap + mine.numel()).copy_(mine);
  }
  return b;
}

void HybridAdam::reduce_grads_locked() {
  trace::Span span("adam", "adam.reduce_scatter_grads");
  const int64_t n = num_chunks();
  if (options_.accumulate_grads) reduced_grads_.assign(n, at::Tensor());
  for (int64_t g = 0; g * world_ < n; ++g) {
    GroupBuffer b = pack_group_locked(g);
    at::Tensor out = at::empty({b.seg}, b.flat.options());
    comm_->reduce_scatter(out, b.flat);
    const int64_t own = g * world_ + rank_;
    if (own >= n) continue;
    receive_owned_locked(own, out, b.cap);
  }
}

void HybridAdam::take_union_locked(int64_t c, const at::Tensor& counts) {
  // counts[i] sums 0/1 flags in the compute dtype: exact up to 256 ranks in bf16 (2048 in fp16), and
  // never 0 once a rank sent 1, which is all that is read.
  const std::vector<int64_t>& tensors = model().layout().chunks()[c].tensors;
  const at::Tensor n = counts.to(at::kCPU, at::kFloat);  // the flags, read here (on the device: one small copy)
  for (size_t i = 0; i < tensors.size(); ++i) landed_[tensors[i]] = n.data_ptr<float>()[i] != 0.0f;
}

void HybridAdam::receive_owned_locked(int64_t c, const at::Tensor& out, int64_t cap) {
  // The landed set of the owned chunk becomes the union over ranks.
  const int64_t tensors = static_cast<int64_t>(model().layout().chunks()[c].tensors.size());
  const OwnedSpans spans = owned_spans(c, out.slice(0, cap, cap + tensors));
  take_union_locked(c, out.slice(0, cap, cap + tensors));
  const int64_t numel = model().layout().chunks()[c].numel;
  if (options_.accumulate_grads) {  // read where the chunk's state is (the host Adam reads host memory)
    reduced_grads_[c] = out.slice(0, 0, numel).to(state_->payload(kGradRole, c).device());
    return;
  }
  // Summed gradients in the slots that received one on any rank; the others get their values back.
  at::Tensor payload = comm_payload_locked(c);
  payload.copy_(out.slice(0, 0, numel));
  restore_values(payload, state_->payload(kMasterRole, c), spans.unlanded);
}

void HybridAdam::gather_groups_locked(at::ScalarType dtype, const std::function<at::Tensor(int64_t)>& local,
                                      const std::function<void(int64_t, const at::Tensor&)>& got) {
  const int64_t n = num_chunks();
  for (int64_t first = 0; first < n; first += world_) {
    const int64_t last = std::min(n, first + world_);
    int64_t cap = 0;
    for (int64_t c = first; c < last; ++c) cap = std::max(cap, model().layout().chunks()[c].numel);
    at::Tensor mine = at::zeros({cap}, at::TensorOptions().dtype(dtype));
    const int64_t own = first + rank_;
    if (own < last) {
      const at::Tensor values = local(own);
      mine.slice(0, 0, values.numel()).copy_(values);
    }
    at::Tensor all = at::empty({world_ * cap}, mine.options());
    comm_->all_gather(all, mine);
    for (int64_t c = first; c < last; ++c) {
      got(c, all.slice(0, (c - first) * cap, (c - first) * cap + model().layout().chunks()[c].numel));
    }
  }
}

void HybridAdam::gather_params_locked() {
  trace::Span span("adam", "adam.all_gather_params");
  ChunkStore& params = model().store();
  const at::ScalarType dtype = model().compute_dtype();
  gather_groups_locked(
      dtype, [&](int64_t c) { return params.payload(model().param_chunk(c)); },
      [&](int64_t c, const at::Tensor& values) {
        if (owned(c)) return;  // the owner has them
        params.payload(model().param_chunk(c)).copy_(values);
      });
}

c10::Device HybridAdam::comm_buffer_device() const {
  // The chunks' device where the backend serves it (NCCL on CUDA, Gloo on the simulated device): the
  // gradients are packed and reduced there, and only an owner's host-state chunk crosses to the host.
  // Else (Gloo on CUDA) the host.
  const c10::Device device = model().store().device();
  return comm_->device_ok(device) ? device : c10::Device(c10::kCPU);
}

// Note [Accumulation per chunk], at N > 1.
void HybridAdam::values_from_owners_locked() {
  trace::Span span("adam", "adam.values_from_owners");
  if (param_shards_) {
    param_shards_->release_all();  // local: the next use of each group gathers it (a collective then)
  } else {
    gather_params_locked();
  }
  ++values_from_owners_;
}

StepResult HybridAdam::dist_step_locked() {
  trace::Span step_span("adam", "adam.dist_step");
  shard_locked();
  place_locked();
  StepResult result;
  result.loss_scale = loss_scale();
  int64_t comm_ns = 0;
  int64_t t0 = now_ns();
  // 1. Every rank's gradients summed into their owners' chunks, with the union of the landed sets.
  reduce_grads_locked();
  if (param_shards_) param_shards_->release_all();  // their gradients are with the owners now
  comm_ns += now_ns() - t0;
  // 2. The owned chunks to their state's tier; their norms, totalled over the ranks.
  stage_param_chunks_locked();
  t0 = now_ns();
  ChunkNorms norms = grad_norms_locked();
  result.device_syncs = norms.syncs;
  int64_t landed = 0;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (!owned(c)) continue;
    for (int64_t p : model().layout().chunks()[c].tensors) landed += landed_[p];
  }
  const int64_t tn = now_ns();
  at::Tensor totals = at::tensor({norms.total_sq, norms.all_finite ? 0.0 : 1.0, static_cast<double>(landed)},
                                 at::kDouble);
  comm_->all_reduce(totals, dist::ReduceOp::kSum);
  comm_ns += now_ns() - tn;
  norms.total_sq = totals[0].item<double>();
  norms.all_finite = totals[1].item<double>() == 0.0 && std::isfinite(norms.total_sq);
  result.norm_ns = now_ns() - t0;
  if (totals[2].item<double>() == 0.0) {  // the same on every rank: all fail together
    if (!param_shards_) gather_params_locked();  // slots of this rank's own landings (if any) get values back
    std::fill(landed_.begin(), landed_.end(), 0);
    grads_landed_ = false;
    model().clear_grad_slots();
    TORCH_CHECK(false, "ferry: HybridAdam::step() found no gradients since the last zero_grad() on any rank; call "
                       "model.backward(loss) first");
  }
  grads_landed_ = true;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (owned(c)) (on_device_[c] ? result.device_chunks : result.host_chunks) += 1;
  }
  // 3. The owners update (or, on overflow, restore) their chunks; 4. everyone gets the new values.
  result = apply_locked(norms, result);
  reduced_grads_.clear();
  agree_on_trace_locked();
  t0 = now_ns();
  if (!param_shards_) gather_params_locked();  // sharded parameters: fetched at their next use instead
  comm_ns += now_ns() - t0;
  result.comm_ns = comm_ns;
  return result;
}

// ---- the pipelined step across ranks --------------------------------------------------------------

void HybridAdam::agree_on_trace_locked() {
  // Note [Sharded parameters]: groups given up after forward are fetched again where the trace says, so
  // every rank must follow the same trace. One small collective per step (every rank calls it, whatever
  // its trace) compares them; a rank whose backward differs (a parameter without gradient on some ranks)
  // keeps the groups instead.
  if (!param_shards_) return;
  Scheduler& scheduler = model().scheduler();
  const std::shared_ptr<const AccessTrace> trace = scheduler.trace();
  const int64_t version = scheduler.trace_version();
  if (version != hashed_trace_version_) {
    Fingerprint f;
    if (trace) {
      f.mix(trace->size());
      f.mix(trace->backward_start());
      for (TensorId t : trace->tensors()) f.mix(t);
    }
    trace_hash_ = f.value();
    hashed_trace_version_ = version;
  }
  const bool agree = same_on_every_rank_locked(trace_hash_) && trace != nullptr;
  if (agree != (trace_agreed_ == version)) {
    log::info("ferry: rank ", rank_, ": the ranks' parameter use orders ", agree ? "agree" : "differ",
              agree ? ": sharded parameter groups are given up after forward and fetched again for backward"
                    : ": sharded parameter groups stay from their first use to the step");
  }
  trace_agreed_ = agree ? version : -1;
  scheduler.allow_forward_releases(version, agree);
}

void HybridAdam::check_landings_agree_locked() {
  Fingerprint f;
  for (int64_t v : expected_landings_) f.mix(v);
  for (int64_t v : last_uses_) f.mix(v);  // a group is final after its uses too (Note [A chunk final before its last use])
  // A chunk with a trainable parameter never landed is not final early (arm_landing_count_locked).
  for (int64_t p = 0; p < model().num_params(); ++p) f.mix(model().param(p).requires_grad() ? 1 : 0);
  landings_agree_ = same_on_every_rank_locked(f.value());
}

void HybridAdam::chunk_final_across_ranks_locked(int64_t c) {
  // launched_ marks the chunk final (a later gradient for it is refused); its group goes when all are.
  launched_[c] = 1;
  const int64_t group = c / world_, first = group * world_, last = std::min(num_chunks(), first + world_);
  for (int64_t k = first; k < last; ++k) {
    if (!launched_[k]) return;
  }
  launch_group_locked(group);
}

void HybridAdam::launch_group_locked(int64_t group) {
  // Every chunk of the group is final here (or backward is over): the same moment, in the same order,
  // on every rank, since every rank expects the same landings (check_landings_agree_locked).
  GroupFlight& flight = flights_[group];
  TORCH_INTERNAL_ASSERT(!flight.pending, "group launched twice");
  trace::Span span("adam", trace::enabled() ? "reduce_scatter group " + std::to_string(group) : std::string());
  GroupBuffer b = pack_group_locked(group);
  // The gradients travel in b: the other ranks' chunks of the group can go now (Note [Sharded parameters]).
  if (param_shards_) param_shards_->release(model().param_chunk(group * world_));
  flight.cap = b.cap;
  flight.out = at::empty({b.seg}, b.flat.options());
  flight.pending = comm_->reduce_scatter_async(flight.out, b.flat);
  const int64_t c = group * world_ + rank_;
  if (c >= num_chunks() || on_device_[c]) return;  // device-state chunks: updated when backward ends
  // The owner's host-state chunk: its update runs on CpuAdam's worker once the sums are in.
  owner_job_[c] = 1;
  const int64_t numel = model().layout().chunks()[c].numel;
  const int64_t tensors = static_cast<int64_t>(model().layout().chunks()[c].tensors.size());
  if (static_cast<int64_t>(jobs_.size()) < num_chunks()) jobs_.resize(num_chunks());
  jobs_[c] = launch_host_job_locked(c, "pipelined owner adam chunk ",
                         [this, c, flight = &flight, numel, tensors](const at::Tensor& g, float* p, float* m, float* v,
                                                                      const at::Tensor& master) {
                           flight->pending->wait();  // the sums over ranks
                           const OwnedSpans spans =
                               owned_spans(c, flight->out.slice(0, flight->cap, flight->cap + tensors));
                           g.copy_(flight->out.slice(0, 0, numel));
                           restore_values(g, master, spans.unlanded);
                           const ChunkOutcome out = host_norm(g, spans.landed);
                           if (out.finite) {
                             run_host_update(adam_spans(spans.landed, p, m, v, g),
                                             UpdateOptions{1.0 / world_, /*grads_checked=*/true});
                           } else {
                             restore_values(g, master, spans.landed);
                           }
                           outcomes_[c] = out;
                         });
}

StepResult HybridAdam::finish_dist_pipelined_locked() {
  trace::Span step_span("adam", "adam.finish_dist_pipelined_step");
  StepResult result;
  result.loss_scale = loss_scale();
  const int64_t n = num_chunks();
  const int64_t groups = (n + world_ - 1) / world_;
  for (char l : owner_job_) result.overlapped_chunks += l;  // owned host chunks launched during backward
  // Groups with a chunk that did not become final: now, in index order (the same on every rank).
  for (int64_t g = 0; g < groups; ++g) {
    if (!flights_[g].pending) launch_group_locked(g);
  }
  if (std::exception_ptr error = join_jobs_locked()) {
    for (GroupFlight& f : flights_) f.pending.reset();  // waits
    flights_.clear();
    std::rethrow_exception(error);
  }
  // Device-state owned chunks: their sums, then the device Adam (skipped by a device flag if not finite).
  ChunkNorms norms;
  norms.sum_sq.assign(n, 0.0);
  norms.finite.assign(n, 1);
  std::vector<at::Tensor> device_norms_all;
  std::vector<int64_t> device_index;
  ChunkStore& params = model().store();
  for (int64_t g = 0; g < groups; ++g) {
    GroupFlight& flight = flights_[g];
    const int64_t c = g * world_ + rank_;
    flight.pending->wait();
    if (c >= n) continue;
    const int64_t tensors = static_cast<int64_t>(model().layout().chunks()[c].tensors.size());
    if (!on_device_[c]) {
      // The owner job updated the union of the ranks' landings: so does the count of missed steps.
      take_union_locked(c, flight.out.slice(0, flight.cap, flight.cap + tensors));
      continue;
    }
    const OwnedSpans spans = owned_spans(c, flight.out.slice(0, flight.cap, flight.cap + tensors));
    const ChunkId pc = model().param_chunk(c);
    if (params.location(pc) != Location::kDevice) params.move(pc, Location::kDevice);
    at::Tensor payload = params.payload(pc);
    payload.copy_(flight.out.slice(0, 0, model().layout().chunks()[c].numel));
    restore_values(payload, state_->payload(kMasterRole, c), spans.unlanded);
    take_union_locked(c, flight.out.slice(0, flight.cap, flight.cap + tensors));  // device_update_chunk_locked reads it
    std::vector<at::Tensor> d = device_norms(payload, spans.landed);
    if (!d.empty()) {
      const at::Tensor found_inf = at::logical_not(at::isfinite(at::stack(d)).all()).to(at::kFloat);
      device_update_chunk_locked(c, 1.0 / world_, found_inf);
    }
    for (at::Tensor& t : d) {
      device_norms_all.push_back(std::move(t));
      device_index.push_back(c);
    }
  }
  flights_.clear();
  for (int64_t c = 0; c < n; ++c) {
    if (owner_job_[c]) {
      norms.sum_sq[c] = outcomes_[c].sum_sq;
      norms.finite[c] = outcomes_[c].finite;
    }
    if (owned(c)) (on_device_[c] ? result.device_chunks : result.host_chunks) += 1;
  }
  finish_norms(device_norms_all, device_index, norms);
  result.device_syncs = norms.syncs;
  at::Tensor totals = at::tensor({norms.total_sq, norms.all_finite ? 0.0 : 1.0}, at::kDouble);
  comm_->all_reduce(totals, dist::ReduceOp::kSum);
  agree_on_trace_locked();
  const int64_t t0 = now_ns();
  if (param_shards_) {
    param_shards_->release_all();  // every group's gradients reached its owner
  } else {
    gather_params_locked();
  }
  result.comm_ns = now_ns() - t0;
  count_missed_steps_locked(&norms.finite);  // the owned chunks with a non-finite gradient were not updated
  model().clear_grad_slots();
  std::fill(landed_.begin(), landed_.end(), 0);
  grads_landed_ = false;
  const double total_sq = totals[0].item<double>();
  result.grad_norm = std::sqrt(total_sq) / world_;
  result.overflow = totals[1].item<double>() != 0.0 || !std::isfinite(total_sq);
  result.applied = !result.overflow;
  if (result.overflow) {
    log::warn("ferry: backward_step: non-finite gradients; those chunks were not updated, the others were");
  }
  return result;
}

StepResult HybridAdam::dist_backward_step(const at::Tensor& loss) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  settle("backward_step()");
  bool pipelined = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (options_.accumulate_grads) {
      sync_layout_locked();  // the earlier micro-batches' gradients are what this call completes
    } else {
      check_backward_step_start_locked();
    }
    // Pipelined once sharded and placed, without clipping, loss scaling or accumulation (eager), when
    // every rank expects the same landings (so groups complete in the same order everywhere).
    pipelined = sharded_ && placed_ && landings_agree_ && !options_.accumulate_grads &&
                options_.max_grad_norm == 0 && !scaling_ &&
                static_cast<int64_t>(expected_landings_.size()) == model().num_params();
    arm_landing_count_locked(pipelined);
    if (pipelined) {
      const int64_t n = num_chunks();
      eager_ = true;
      jobs_.clear();
      jobs_.resize(n);
      outcomes_.assign(n, ChunkOutcome{});
      owner_job_.assign(n, 0);
      flights_.clear();
      flights_.resize((n + world_ - 1) / world_);
      for (int g = 0; g < num_param_groups(); ++g) cpu_adam_.advance_step(g);  // updates start during backward
    }
    dist_pipelined_ = pipelined;
    overlap_active_ = pipelined;
    step_follows_backward_ = true;
  }
  try {
    model().backward(loss);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    step_follows_backward_ = false;
    if (pipelined) {
      if (join_jobs_locked()) log::error("ferry: backward_step: an owner update failed too");
      flights_.clear();  // waits for the collectives in flight
      log::error("ferry: backward_step: backward threw on rank ", rank_, "; the other ranks will fail at their next "
                 "collective");
    }
    overlap_active_ = false;
    dist_pipelined_ = false;
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  overlap_active_ = false;
  dist_pipelined_ = false;
  step_follows_backward_ = false;
  grow_expected_landings_locked(/*complete=*/true);
  StepResult result = pipelined ? finish_dist_pipelined_locked() : step_locked();
  check_landings_agree_locked();  // for the next call
  return result;
}

}  // namespace ferry
