// HybridAdam across ranks: Note [Sharded optimizer state] (sharded_step.h), D44.
#include "sharded_step.h"

#include <ATen/ops/all.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "../common/config.h"
#include "../common/event_trace.h"
#include "../common/logging.h"

namespace ferry::optim {
namespace {

using trace::now_ns;

// FNV-1a over 64-bit values: what the ranks compare with one all-reduce (same_on_every_rank) to learn
// whether their layouts, landings or traces agree. A double holds 52 of its bits exactly.
class Fingerprint {
 public:
  void mix(int64_t v) { h_ = (h_ ^ static_cast<uint64_t>(v)) * 1099511628211ull; }
  double value() const { return static_cast<double>(h_ >> 12); }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

}  // namespace

ShardedStep::ShardedStep(const StepParts& parts, Ownership& ownership, std::shared_ptr<dist::Communicator> comm,
                         bool accumulate_grads, bool shard_params, PipelinedStep& pipeline)
    : parts_(parts),
      ownership_(ownership),
      comm_(std::move(comm)),
      accumulate_(accumulate_grads),
      shard_params_(shard_params),
      pipeline_(pipeline) {
  TORCH_INTERNAL_ASSERT(!comm_ || comm_->world_size() == ownership_.world(), "the ownership's world is not the "
                        "communicator's");
}

void ShardedStep::check_same_layout() {
  // The ranks must agree on the layout chunk for chunk, slot for slot: every collective pairs them.
  const ChunkLayout& layout = parts_.model.layout();
  Fingerprint f;
  f.mix(layout.num_chunks());
  for (const ChunkExtent& e : layout.chunks()) f.mix(e.numel);
  for (const Slot& s : layout.slots()) {
    f.mix(s.chunk);
    f.mix(s.offset);
    f.mix(s.numel);
  }
  f.mix(static_cast<int64_t>(parts_.model.compute_dtype()));
  TORCH_CHECK(same_on_every_rank(f.value()), "ferry: rank ", ownership_.rank(), ": the ranks' chunk "
              "layouts differ (", layout.num_chunks(), " chunks of ", format_bytes(parts_.model.chunk_size_bytes()),
              " in ", c10::toString(parts_.model.compute_dtype()), " here); data parallelism needs the same model, "
              "precision, chunk size and call order on every rank");
}

void ShardedStep::broadcast_initial_values() {
  // Rank 0's starting point everywhere: its masters (fp32 or compact bf16, on the host until placement), then the
  // parameter chunks from them, as a step writes them.
  check_same_layout();
  for (int64_t c = 0; c < num_chunks(); ++c) {
    at::Tensor master = parts_.placement.payload(kMasterRole, c);
    TORCH_INTERNAL_ASSERT(comm_->device_ok(master.device()), "the masters are on the host before placement");
    comm_->broadcast(master, 0);
  }
  parts_.updates.write_back();
}

void ShardedStep::shard(std::function<void(int64_t)> await_chunk) {
  if (!active() || ownership_.sharded()) return;
  TORCH_INTERNAL_ASSERT(!parts_.placement.placed(), "placement comes after sharding");
  const int world = ownership_.world(), rank = ownership_.rank();
  // Every rank answers together: a rank whose repack waits (Note [A repack waits for held views]) must
  // not leave the others in the next collective.
  const bool final = parts_.model.layout_final();
  const bool all_final = same_on_every_rank(final ? 1.0 : 0.0) && final;
  TORCH_CHECK(all_final, "ferry: rank ", rank, ": the first optimizer step at world size ", world,
              " came before the warm-up repack ", final ? "of another rank" : "here", " (warmup_iterations > 1, or "
              "a repack waiting for views of parameters held outside ferry, said in the log); the state and "
              "parameters are sharded by the final layout: run the warm-up iterations first, or use "
              "warmup_iterations = 1");
  check_same_layout();  // again: the warm-up repacked in call order
  // Accumulation chunks stay on every rank; the compact format's scales go with the codes.
  std::vector<int> roles{kMasterRole, kExpAvgRole, kExpAvgSqRole};
  if (parts_.placement.compact()) roles.push_back(parts_.placement.scales_role());
  int64_t held = 0, bytes = 0;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (c % world == rank) {
      ++held;
      bytes += parts_.placement.group_bytes(c);
    } else {
      parts_.placement.state().drop(c, roles);
    }
  }
  ownership_.mark_sharded();
  log::info("ferry: rank ", rank, " of ", world, " holds the optimizer state of ", held, " of ", num_chunks(),
            " chunk groups (", format_bytes(bytes), ")");
  if (!shard_params_) return;
  // Note [Sharded parameters]: from the reduce-scatter of this step on, the other ranks' chunks go.
  std::vector<ChunkId> chunks(num_chunks());
  for (int64_t c = 0; c < num_chunks(); ++c) chunks[c] = parts_.model.param_chunk(c);
  param_shards_ = std::make_shared<dist::ParamShards>(parts_.model.store(), std::move(chunks), comm_);
  // An owned chunk's update may run behind the step (Note [Update behind the next forward]): a gather
  // sends it only once written. The guard takes only DeferredUpdates' lock (HybridAdam calls ParamShards
  // under its own mutex, so the guard must not take that).
  param_shards_->set_send_guard(std::move(await_chunk));
  parts_.model.set_remote_chunks(param_shards_);
  log::info("ferry: rank ", rank, " shards the parameter chunks too: it keeps ", held, " of ", num_chunks(),
            " between steps and gathers the others, group by group, before their use");
}

std::pair<ExactSum, std::vector<int64_t>> ShardedStep::sum_over_ranks(const ExactSum& sum,
                                                                      const std::vector<int64_t>& counts) {
  std::vector<int64_t> words = sum.words();
  words.insert(words.end(), counts.begin(), counts.end());
  at::Tensor t = at::tensor(words, at::kLong);
  comm_->all_reduce(t, dist::ReduceOp::kSum);
  const int64_t* v = t.data_ptr<int64_t>();
  return {ExactSum::from_words(std::vector<int64_t>(v, v + ExactSum::kWords)),
          std::vector<int64_t>(v + ExactSum::kWords, v + words.size())};
}

bool ShardedStep::same_on_every_rank(double value) {
  at::Tensor range = at::tensor({value, -value}, at::kDouble);
  comm_->all_reduce(range, dist::ReduceOp::kMax);
  return range[0].item<double>() == -range[1].item<double>();
}

std::vector<double> ShardedStep::sum_over_ranks(const std::vector<double>& values) {
  at::Tensor t = at::tensor(values, at::kDouble);
  comm_->all_reduce(t, dist::ReduceOp::kSum);
  const double* v = t.data_ptr<double>();
  return std::vector<double>(v, v + values.size());
}

ShardedStep::OwnedSpans ShardedStep::owned_spans(int64_t c, const at::Tensor& counts) const {
  // counts[i]: how many ranks landed a gradient for the chunk's i-th tensor (the reduce-scatter's sum of
  // each rank's 0/1 flags). Landed somewhere: updated, in runs of one param group and lag, as
  // GradLedger::spans.
  const ChunkLayout& layout = parts_.model.layout();
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
    const int g = parts_.ledger.group_of(tensors[i]);
    const int64_t lag = parts_.ledger.lag(tensors[i]);
    if (open && out.landed.back().group == g && out.landed.back().lag == lag) {
      out.landed.back().end = slot.offset + slot.numel;
    } else {
      out.landed.push_back({g, slot.offset, slot.offset + slot.numel, lag});
    }
    open = true;
  }
  return out;
}

at::Tensor ShardedStep::comm_payload(int64_t c) {
  ChunkStore& params = parts_.model.store();
  const ChunkId pc = parts_.model.param_chunk(c);
  at::Tensor payload = params.payload(pc);
  if (!comm_->device_ok(payload.device())) {  // Gloo on CUDA: the chunk is staged on the host
    params.move(pc, Location::kHost);
    payload = params.payload(pc);
  }
  return payload;
}

ShardedStep::GroupBuffer ShardedStep::pack_group(int64_t group) {
  // Member k of the group at [k seg, (k + 1) seg): this rank's gradients of chunk first + k (its landed
  // slots; zeros elsewhere: in default mode those slots hold parameter values, which must not be
  // summed), then one 0/1 per tensor of the chunk (landed here). Summed over ranks, the owner gets the
  // gradients and, per tensor, how many ranks landed one: the union it must update.
  const int world = ownership_.world();
  const int64_t n = num_chunks(), first = group * world, last = std::min(n, first + world);
  GroupBuffer b;
  int64_t flags = 0;
  for (int64_t c = first; c < last; ++c) {
    b.cap = std::max(b.cap, parts_.model.layout().chunks()[c].numel);
    flags = std::max<int64_t>(flags, static_cast<int64_t>(parts_.model.layout().chunks()[c].tensors.size()));
  }
  b.seg = b.cap + flags;
  const at::ScalarType dtype = accumulate_ ? at::kFloat : parts_.model.compute_dtype();
  b.flat = at::zeros({world * b.seg}, at::TensorOptions().dtype(dtype).device(comm_buffer_device()));
  for (int64_t c = first; c < last; ++c) {
    at::Tensor member = b.flat.slice(0, (c - first) * b.seg, (c - first + 1) * b.seg);
    if (!accumulate_ && parts_.model.store().location(parts_.model.param_chunk(c)) == Location::kNone) {
      continue;  // a sharded chunk not fetched this iteration: nothing of it was used, nothing landed (zeros)
    }
    const at::Tensor src = accumulate_ ? parts_.placement.payload(kGradRole, c) : comm_payload(c);
    at::Tensor values = member.slice(0, 0, src.numel());
    values.copy_(src);
    if (!accumulate_) {
      for (const Span& s : parts_.ledger.slot_ranges(parts_.model.layout(), c, false)) values.slice(0, s.begin, s.end).zero_();
    }
    const std::vector<int64_t>& tensors = parts_.model.layout().chunks()[c].tensors;
    at::Tensor mine = at::empty({static_cast<int64_t>(tensors.size())}, at::kFloat);
    for (size_t i = 0; i < tensors.size(); ++i) mine.data_ptr<float>()[i] = parts_.ledger.landed(tensors[i]) ? 1.0f : 0.0f;
    member.slice(0, b.cap, b.cap + mine.numel()).copy_(mine);
  }
  return b;
}

void ShardedStep::reduce_grads() {
  trace::Span span("adam", "adam.reduce_scatter_grads");
  const int64_t n = num_chunks();
  if (accumulate_) reduced_.assign(n, at::Tensor());
  for (int64_t g = 0; g * ownership_.world() < n; ++g) {
    GroupBuffer b = pack_group(g);
    at::Tensor out = at::empty({b.seg}, b.flat.options());
    comm_->reduce_scatter(out, b.flat);
    const int64_t own = g * ownership_.world() + ownership_.rank();
    if (own >= n) continue;
    receive_owned(own, out, b.cap);
  }
}

at::Tensor ShardedStep::reduced(int64_t chunk) const {
  return static_cast<int64_t>(reduced_.size()) > chunk ? reduced_[chunk] : at::Tensor();
}

void ShardedStep::take_union(int64_t c, const at::Tensor& counts) {
  // counts[i] sums 0/1 flags in the compute dtype: exact up to 256 ranks in bf16 (2048 in fp16), and
  // never 0 once a rank sent 1, which is all that is read.
  const std::vector<int64_t>& tensors = parts_.model.layout().chunks()[c].tensors;
  const at::Tensor n = counts.to(at::kCPU, at::kFloat);  // the flags, read here (on the device: one small copy)
  for (size_t i = 0; i < tensors.size(); ++i) parts_.ledger.set_landed(tensors[i], n.data_ptr<float>()[i] != 0.0f);
}

void ShardedStep::receive_owned(int64_t c, const at::Tensor& out, int64_t cap) {
  // The landed set of the owned chunk becomes the union over ranks.
  const int64_t tensors = static_cast<int64_t>(parts_.model.layout().chunks()[c].tensors.size());
  const OwnedSpans spans = owned_spans(c, out.slice(0, cap, cap + tensors));
  take_union(c, out.slice(0, cap, cap + tensors));
  const int64_t numel = parts_.model.layout().chunks()[c].numel;
  if (accumulate_) {  // read where the chunk's state is (the host Adam reads host memory)
    reduced_[c] = out.slice(0, 0, numel).to(parts_.placement.payload(kGradRole, c).device());
    return;
  }
  // Summed gradients in the slots that received one on any rank; the others get their values back.
  at::Tensor payload = comm_payload(c);
  payload.copy_(out.slice(0, 0, numel));
  ChunkUpdates::restore_values(payload, parts_.placement.payload(kMasterRole, c), spans.unlanded);
}

void ShardedStep::gather_groups(at::ScalarType dtype, const std::function<at::Tensor(int64_t)>& local,
                                const std::function<void(int64_t, const at::Tensor&)>& got) {
  const int64_t n = num_chunks();
  const int world = ownership_.world();
  for (int64_t first = 0; first < n; first += world) {
    const int64_t last = std::min(n, first + world);
    int64_t cap = 0;
    for (int64_t c = first; c < last; ++c) cap = std::max(cap, parts_.model.layout().chunks()[c].numel);
    at::Tensor mine = at::zeros({cap}, at::TensorOptions().dtype(dtype));
    const int64_t own = first + ownership_.rank();
    if (own < last) {
      const at::Tensor values = local(own);
      mine.slice(0, 0, values.numel()).copy_(values);
    }
    at::Tensor all = at::empty({world * cap}, mine.options());
    comm_->all_gather(all, mine);
    for (int64_t c = first; c < last; ++c) {
      got(c, all.slice(0, (c - first) * cap, (c - first) * cap + parts_.model.layout().chunks()[c].numel));
    }
  }
}

void ShardedStep::gather_params() {
  trace::Span span("adam", "adam.all_gather_params");
  ChunkStore& params = parts_.model.store();
  gather_groups(
      parts_.model.compute_dtype(), [&](int64_t c) { return params.payload(parts_.model.param_chunk(c)); },
      [&](int64_t c, const at::Tensor& values) {
        if (ownership_.owned(c)) return;  // the owner has them
        params.payload(parts_.model.param_chunk(c)).copy_(values);
      });
}

c10::Device ShardedStep::comm_buffer_device() const {
  // The chunks' device where the backend serves it (NCCL on CUDA, Gloo on the simulated device): the
  // gradients are packed and reduced there, and only an owner's host-state chunk crosses to the host.
  // Else (Gloo on CUDA) the host.
  const c10::Device device = parts_.model.store().device();
  return comm_->device_ok(device) ? device : c10::Device(c10::kCPU);
}

// Note [Accumulation per chunk], at N > 1.
void ShardedStep::values_from_owners() {
  trace::Span span("adam", "adam.values_from_owners");
  if (param_shards_) {
    param_shards_->release_all();  // local: the next use of each group gathers it (a collective then)
  } else {
    gather_params();
  }
  ++values_from_owners_;
}

void ShardedStep::agree_on_trace() {
  // Note [Sharded parameters]: groups given up after forward are fetched again where the trace says, so
  // every rank must follow the same trace. One small collective per step (every rank calls it, whatever
  // its trace) compares them; a rank whose backward differs (a parameter without gradient on some ranks)
  // keeps the groups instead.
  if (!param_shards_) return;
  Scheduler& scheduler = parts_.model.scheduler();
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
  const bool agree = same_on_every_rank(trace_hash_) && trace != nullptr;
  if (agree != (trace_agreed_ == version)) {
    log::info("ferry: rank ", ownership_.rank(), ": the ranks' parameter use orders ", agree ? "agree" : "differ",
              agree ? ": sharded parameter groups are given up after forward and fetched again for backward"
                    : ": sharded parameter groups stay from their first use to the step");
  }
  trace_agreed_ = agree ? version : -1;
  scheduler.allow_forward_releases(version, agree);
}

void ShardedStep::check_landings_agree(const ChunkFinality& finality) {
  Fingerprint f;
  for (int64_t v : finality.expected_landings()) f.mix(v);
  // A group is final after its uses too (Note [A chunk final before its last use]).
  for (int64_t v : finality.expected_uses()) f.mix(v);
  // A chunk with a trainable parameter never landed is not final early (PipelinedStep::arm).
  for (int64_t p = 0; p < parts_.model.num_params(); ++p) f.mix(parts_.model.param(p).requires_grad() ? 1 : 0);
  landings_agree_ = same_on_every_rank(f.value());
}

void ShardedStep::start_flights() {
  const int64_t n = num_chunks();
  owner_job_.assign(n, 0);
  flights_.clear();
  flights_.resize((n + ownership_.world() - 1) / ownership_.world());
}

void ShardedStep::chunk_final(int64_t c) {
  // The chunk counts as launched (a later gradient for it is refused); its group goes when all are.
  pipeline_.mark_launched(c);
  const int world = ownership_.world();
  const int64_t group = c / world, first = group * world, last = std::min(num_chunks(), first + world);
  for (int64_t k = first; k < last; ++k) {
    if (!pipeline_.launched(k)) return;
  }
  launch_group(group);
}

void ShardedStep::launch_group(int64_t group) {
  // Every chunk of the group is final here (or backward is over): the same moment, in the same order,
  // on every rank, since every rank expects the same landings (check_landings_agree).
  GroupFlight& flight = flights_[group];
  TORCH_INTERNAL_ASSERT(!flight.pending, "group launched twice");
  trace::Span span("adam", trace::enabled() ? "reduce_scatter group " + std::to_string(group) : std::string());
  GroupBuffer b = pack_group(group);
  const int world = ownership_.world();
  // The gradients travel in b: the other ranks' chunks of the group can go now (Note [Sharded parameters]).
  if (param_shards_) param_shards_->release(parts_.model.param_chunk(group * world));
  flight.cap = b.cap;
  flight.out = at::empty({b.seg}, b.flat.options());
  flight.pending = comm_->reduce_scatter_async(flight.out, b.flat);
  const int64_t c = group * world + ownership_.rank();
  if (c >= num_chunks() || parts_.placement.on_device(c)) return;  // device-state chunks: updated when backward ends
  // The owner's host-state chunk: its update runs on CpuAdam's worker once the sums are in.
  owner_job_[c] = 1;
  const int64_t numel = parts_.model.layout().chunks()[c].numel;
  const int64_t tensors = static_cast<int64_t>(parts_.model.layout().chunks()[c].tensors.size());
  const HostState state = parts_.placement.host_state(c, /*held=*/true, /*moments=*/true, parts_.model.layout());
  parts_.jobs.put(c, parts_.jobs.launch(parts_.model.store(), parts_.model.param_chunk(c), c, "pipelined owner adam chunk ",
                            [this, c, flight = &flight, numel, tensors, state, world](const at::Tensor& g) {
                              flight->pending->wait();  // the sums over ranks
                              const OwnedSpans spans =
                                  owned_spans(c, flight->out.slice(0, flight->cap, flight->cap + tensors));
                              g.copy_(flight->out.slice(0, 0, numel));
                              ChunkUpdates::restore_values(g, state.master_tensor, spans.unlanded);
                              const ChunkOutcome out = parts_.updates.host_norm(c, g, spans.landed);
                              if (out.finite) {
                                parts_.updates.run_host(parts_.updates.adam_spans(spans.landed, state, g),
                                                  UpdateOptions{1.0 / world, /*grads_checked=*/true});
                              } else {
                                ChunkUpdates::restore_values(g, state.master_tensor, spans.landed);
                              }
                              pipeline_.set_outcome(c, out);
                            }),
               /*uses_wait=*/false);
}

StepResult ShardedStep::finish_pipelined(double loss_scale) {
  trace::Span step_span("adam", "adam.finish_dist_pipelined_step");
  StepResult result;
  result.loss_scale = loss_scale;
  const int64_t n = num_chunks();
  const int world = ownership_.world();
  const int64_t groups = (n + world - 1) / world;
  for (char l : owner_job_) result.overlapped_chunks += l;  // owned host chunks launched during backward
  // Groups with a chunk that did not become final: now, in index order (the same on every rank).
  for (int64_t g = 0; g < groups; ++g) {
    if (!flights_[g].pending) launch_group(g);
  }
  if (std::exception_ptr error = parts_.jobs.join()) {
    for (GroupFlight& f : flights_) f.pending.reset();  // waits
    flights_.clear();
    std::rethrow_exception(error);
  }
  // Device-state owned chunks: their sums, then the device Adam (skipped by a device flag if not finite).
  ChunkNorms norms;
  norms.finite.assign(n, 1);
  std::vector<at::Tensor> device_norms_all;
  std::vector<int64_t> device_index;
  ChunkStore& params = parts_.model.store();
  for (int64_t g = 0; g < groups; ++g) {
    GroupFlight& flight = flights_[g];
    const int64_t c = g * world + ownership_.rank();
    flight.pending->wait();
    if (c >= n) continue;
    const int64_t tensors = static_cast<int64_t>(parts_.model.layout().chunks()[c].tensors.size());
    if (!parts_.placement.on_device(c)) {
      // The owner job updated the union of the ranks' landings: so does the count of missed steps.
      take_union(c, flight.out.slice(0, flight.cap, flight.cap + tensors));
      continue;
    }
    const OwnedSpans spans = owned_spans(c, flight.out.slice(0, flight.cap, flight.cap + tensors));
    const ChunkId pc = parts_.model.param_chunk(c);
    if (params.location(pc) != Location::kDevice) params.move(pc, Location::kDevice);
    at::Tensor payload = params.payload(pc);
    payload.copy_(flight.out.slice(0, 0, parts_.model.layout().chunks()[c].numel));
    ChunkUpdates::restore_values(payload, parts_.placement.payload(kMasterRole, c), spans.unlanded);
    take_union(c, flight.out.slice(0, flight.cap, flight.cap + tensors));  // the device update reads it
    at::Tensor d = parts_.updates.device_norms(c, payload, spans.landed);
    if (d.defined()) {
      const at::Tensor found_inf = at::logical_not(at::isfinite(d).all()).to(at::kFloat);
      parts_.updates.device_update(c, 1.0 / world, found_inf);
      device_norms_all.push_back(std::move(d));
      device_index.push_back(c);
    }
  }
  flights_.clear();
  for (int64_t c = 0; c < n; ++c) {
    if (owner_job_[c]) {
      norms.sum_sq.add(pipeline_.outcome(c).sum_sq);
      norms.finite[c] = pipeline_.outcome(c).finite;
    }
    if (ownership_.owned(c)) (parts_.placement.on_device(c) ? result.device_chunks : result.host_chunks) += 1;
  }
  ChunkUpdates::finish_norms(device_norms_all, device_index, norms);
  result.device_syncs = norms.syncs;
  const auto [sum_sq, counts] = sum_over_ranks(norms.sum_sq, {norms.all_finite ? 0 : 1});
  agree_on_trace();
  const int64_t t0 = now_ns();
  if (param_shards_) {
    param_shards_->release_all();  // every group's gradients reached its owner
  } else {
    gather_params();
  }
  result.comm_ns = now_ns() - t0;
  // The owned chunks with a non-finite gradient were not updated.
  parts_.ledger.count_missed_steps(parts_.model.layout(), [this](int64_t c) { return ownership_.owned(c); }, &norms.finite,
                             nullptr, nullptr);
  parts_.model.clear_grad_slots();
  parts_.ledger.clear();
  const double total_sq = sum_sq.value();
  result.grad_norm = std::sqrt(total_sq) / world;
  result.overflow = counts[0] != 0 || !std::isfinite(total_sq);
  result.applied = !result.overflow;
  if (result.overflow) {
    log::warn("ferry: backward_step: non-finite gradients; those chunks were not updated, the others were");
  }
  return result;
}

}  // namespace ferry::optim
