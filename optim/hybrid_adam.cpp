#include "hybrid_adam.h"

#include <ATen/ops/all.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <unordered_map>
#include <utility>

#include "../chunk/copy_engine.h"
#include "../common/event_trace.h"
#include "../common/logging.h"
#include "../cpu_adam/device_adam.h"
#include "../hooks/interceptor.h"

namespace ferry {
namespace {

constexpr ChunkRole kRoleOf[] = {ChunkRole::kMaster, ChunkRole::kExpAvg, ChunkRole::kExpAvgSq, ChunkRole::kGrad};

using trace::now_ns;

}  // namespace

HybridAdamOptions HybridAdamOptions::no_decay_for_bias_and_norm(const AdamOptions& defaults) {
  HybridAdamOptions o;
  o.defaults = defaults;
  AdamOptions no_decay = defaults;
  no_decay.weight_decay = 0.0;
  o.groups.push_back({[](const std::string&, const at::Tensor& p) { return p.dim() <= 1; }, no_decay});
  return o;
}

void HybridAdamOptions::validate() const {
  defaults.validate();
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(groups[g].match, "ferry: param group rule ", g + 1, " has no match function");
    groups[g].options.validate();
  }
  TORCH_CHECK(std::isfinite(max_grad_norm) && max_grad_norm >= 0, "ferry: max_grad_norm must be finite and >= 0, got ",
              max_grad_norm);
  TORCH_CHECK(device_state_chunks >= -1, "ferry: device_state_chunks must be -1 (auto) or >= 0, got ",
              device_state_chunks);
  loss_scaler.validate();
}

HybridAdam::HybridAdam(ChunkedModel& wrapped, HybridAdamOptions options)
    : model_(wrapped),
      options_((options.validate(), std::move(options))),
      cpu_adam_(options_.defaults, CpuAdamConfig::from(wrapped.config())),
      scaler_(options_.loss_scaler) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  check_idle("HybridAdam()");
  // Before any state is allocated: a second optimizer would double the state's memory, take the
  // gradients from the first (which then failed on an internal assert), and, destroyed, detach the other.
  TORCH_CHECK(model().grad_sink() == nullptr, "ferry: this ChunkedModel has an optimizer attached already; one "
              "HybridAdam per model: destroy the first before constructing another (with a std::unique_ptr, "
              "`adam.reset();` before `adam = std::make_unique<ferry::HybridAdam>(...)`, which builds the new one "
              "before the old one goes). Other options for some parameters are a parameter group "
              "(HybridAdamOptions::with_group)");
  for (const auto& rule : options_.groups) cpu_adam_.add_param_group(rule.options);
  group_of_param_.assign(model().num_params(), 0);
  for (int64_t p = 0; p < model().num_params(); ++p) {
    for (size_t g = 0; g < options_.groups.size(); ++g) {
      if (options_.groups[g].match(model().param_name(p), model().param(p))) {
        group_of_param_[p] = static_cast<int>(g) + 1;
        break;
      }
    }
  }
  scaling_ = model().compute_dtype() == at::kHalf;
  model().set_loss_scale(scaling_ ? scaler_.scale() : 1.0);
  num_roles_ = options_.accumulate_grads ? 4 : 3;
  landed_.assign(model().num_params(), 0);
  lag_.assign(model().num_params(), 0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // The state chunks, paired with the parameter chunks group by group, belong to the model's chunk
    // layer (migrated by its repacks). They get memory one layout chunk at a time as they are filled:
    // the masters take over from the parameters' initial fp32 values, each released as soon as it is
    // copied, so the fp32 values are never held twice.
    std::vector<ChunkRole> roles(kRoleOf, kRoleOf + num_roles_);
    // The moments (and accumulation chunks) start at zero: memory only when first touched, so none is
    // spent before the first step, and at N > 1 none for the groups the rank will not own (D46).
    std::vector<int> zero_roles{kExpAvgRole, kExpAvgSqRole};
    if (options_.accumulate_grads) zero_roles.push_back(kGradRole);
    state_ = model().attach_state(roles, [this](int r, int64_t p, const at::Tensor& slot) {
      if (r != kMasterRole) return;  // moments (and accumulated grads) start at zero
      // The masters start from the values the module built (fp32), not from their rounded compute copy.
      const at::Tensor initial = model().initial_value(p);
      slot.copy_(initial.defined() ? initial : model().param_values(p));
      model().release_initial_value(p);
    }, zero_roles);
    follow_layout_locked();
    comm_ = options_.communicator;
    if (comm_ && comm_->world_size() > 1) {
      world_ = comm_->world_size();
      rank_ = comm_->rank();
      broadcast_initial_values_locked();
    }
  }
  model().release_initial_values();  // the masters hold them now
  model().set_grad_sink(this);
  model().set_layout_listener(this);
  log::info("ferry: HybridAdam over ", model().num_params(), " parameters in ", num_param_groups(), " groups, ",
            num_chunks(), " state chunk groups (fp32 master, exp_avg, exp_avg_sq",
            options_.accumulate_grads ? ", grad accumulation" : "; grads in the parameter chunks", "), CPU kernel ",
            to_string(cpu_adam_.isa()), " x", cpu_adam_.threads(), " threads",
            scaling_ ? ", fp16 dynamic loss scaling" : "",
            world_ > 1 ? ", rank " + std::to_string(rank_) + " of " + std::to_string(world_) + " (state sharded "
                         "at the first step)" : std::string());
}

HybridAdam::~HybridAdam() {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  // The model may keep the shards (its remote chunks) beyond this object: their guard waits on it.
  if (param_shards_) param_shards_->set_send_guard(nullptr);
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    settle_deferred();  // the jobs use this object
  } catch (const std::exception& e) {
    log::error("ferry: an update HybridAdam left running failed: ", e.what());
  }
  if (model_gone_.load()) return;  // destroyed first: nothing of it to detach from
  try {
    // Between forward() and backward() too (an evaluation forward not ended): the model must not call
    // this object once it is gone.
    if (model().phase() == ModelPhase::kIdle || model().phase() == ModelPhase::kForwardDone) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (grads_landed_) discard_grads_locked();  // the parameters get their values back
      }
      if (model().grad_sink() == this) {
        model().set_grad_sink(nullptr);
        model().set_loss_scale(1.0);
      }
      if (model().layout_listener() == this) model().set_layout_listener(nullptr);
    }
  } catch (const std::exception& e) {
    log::error("ferry: HybridAdam could not detach from the model: ", e.what());
  }
}

void HybridAdam::model_gone() {
  if (param_shards_) param_shards_->set_send_guard(nullptr);
  model_gone_ = true;
}

void HybridAdam::check_idle(const char* what) const {
  TORCH_CHECK(!model_gone_.load(), "ferry: HybridAdam ", what, " after its ChunkedModel was destroyed: destroy the "
              "optimizer before its model (declare it after the model)");
  const ModelPhase phase = model().phase();
  TORCH_CHECK(phase == ModelPhase::kIdle || phase == ModelPhase::kForwardDone, "ferry: HybridAdam ", what,
              " while the model is in ", to_string(phase), "; call it between iterations");
}

void HybridAdam::settle(const char* what) {
  check_idle(what);
  await_params();
  model().take_writes(what);  // Note [Writes to parameters]: what was written is in the masters first
}

void HybridAdam::synchronize() { await_params(); }

std::future<void> HybridAdam::run_on_worker(std::function<void()> job) { return cpu_adam_.run_async(std::move(job)); }

// Note [Update behind the next forward] (hybrid_adam.h).
namespace {
void log_deferred_failure(int64_t chunk) {  // -1: the zeroing of an accumulation chunk
  log::error("ferry: HybridAdam: ", chunk >= 0 ? "the host update of chunk " + std::to_string(chunk)
                                               : std::string("zeroing an accumulation chunk"),
             ", left running behind the step, failed; that chunk's parameters and state may be partly updated");
}
}  // namespace

void HybridAdam::settle_deferred() {
  if (!deferred_pending_.load()) return;
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  std::exception_ptr error;
  int64_t failed = -1;
  for (size_t c = 0; c < deferred_.size(); ++c) {
    if (!deferred_[c].valid()) continue;
    try {
      deferred_[c].get();
    } catch (...) {
      if (!error) error = std::current_exception(), failed = static_cast<int64_t>(c);
    }
  }
  for (auto& job : deferred_zeroing_) {
    try {
      job.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  deferred_.clear();
  deferred_zeroing_.clear();
  deferred_pending_.store(false);
  if (error) {
    log_deferred_failure(failed);
    std::rethrow_exception(error);
  }
}

namespace {
// Note [Expectations only grow]
// The pipeline decides that a chunk is final from what earlier backwards had: each parameter's
// landings and uses. Taken from the last backward alone, a model whose backward varies (a layer skipped
// in some steps, stochastic depth; a parameter used only in some) found a chunk final at a step after
// one without that layer, the layer's gradient was refused ("after its chunk's update had started"),
// and every later step failed so: a refused backward taught nothing. Now the expectations only grow:
// each backward's counts are merged in by maximum, an aborted one's too (they are a part of what it
// would have had), and a refused landing is added. A step that lacks what was expected leaves those
// chunks to backward's end (correct, not overlapped); a landing no earlier backward had comes after
// its chunk's update started, once (Note [A gradient after its chunk's update]). A change of
// requires_grad starts the counts anew (trainable_changed).
void grow(std::vector<int64_t>& expected, const std::vector<int64_t>& seen) {
  if (expected.size() != seen.size()) {
    expected = seen;
    return;
  }
  for (size_t i = 0; i < seen.size(); ++i) expected[i] = std::max(expected[i], seen[i]);
}
}  // namespace

void HybridAdam::await_param(int64_t param) {
  // Note [A chunk final before its last use]: a use the counts did not foresee waits for the chunk's job.
  if (backward_jobs_.load()) await_backward_job(model().layout().slots()[param].chunk);
  if (!deferred_pending_.load()) return;  // the common case: no lock
  // The layout cannot change while updates run (follow_layout_locked asserts it): read without mutex_.
  await_chunk(model().layout().slots()[param].chunk);
}

void HybridAdam::grow_expected_landings_locked(bool complete) {
  // A backward that stopped part-way says what it had so far; it does not start the expectations.
  if (!complete && expected_landings_.size() != landings_.size()) return;
  grow(expected_landings_, landings_);
}

void HybridAdam::await_backward_job(int64_t c) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (c >= static_cast<int64_t>(jobs_.size()) || !jobs_[c].valid()) return;
  trace::Span span("adam", trace::enabled() ? "use waits for host adam chunk " + std::to_string(c) : std::string());
  jobs_[c].wait();  // its errors surface where the jobs are joined
}

void HybridAdam::await_chunk(int64_t c) {
  if (!deferred_pending_.load()) return;
  // Held while waiting, so that a concurrent settle_deferred() cannot return before this job is done.
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  if (c >= static_cast<int64_t>(deferred_.size()) || !deferred_[c].valid()) return;
  trace::Span span("adam", trace::enabled() ? "wait for host adam chunk " + std::to_string(c) : std::string());
  std::future<void> job = std::move(deferred_[c]);
  try {
    job.get();
  } catch (...) {
    log_deferred_failure(c);
    throw;
  }
}

void HybridAdam::await_params() { settle_deferred(); }

bool HybridAdam::deferred_update_of(int64_t c) const {
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  return static_cast<int64_t>(deferred_.size()) > c && deferred_[c].valid();
}

bool HybridAdam::defer_host_update_locked(int64_t c, const UpdateOptions& options,
                                          const std::shared_ptr<const std::vector<CpuAdam::FrozenGroup>>& frozen) {
  ChunkStore& params = model().store();
  // Default mode: staged on the host with the gradients. With accumulate_grads where the scheduler left
  // it: a parameter chunk on the device keeps the update here and the copy after it (write_back_locked).
  if (params.location(model().param_chunk(c)) != Location::kHost) return false;
  std::vector<Span> spans = landed_spans_locked(c);
  if (spans.empty()) return false;
  at::Tensor acc;  // accumulate_grads: the gradients; the job writes the new values into the parameter chunk
  if (options_.accumulate_grads) {
    acc = grad_payload_locked(c);  // at N > 1 the sums over the ranks (a tensor of their own)
    lowp_written_[c] = 1;
  }
  std::future<void> job = launch_host_job_locked(
      c, "deferred host adam chunk ",
      [this, spans = std::move(spans), options, frozen, acc](const at::Tensor& g, float* p, float* m, float* v,
                                                             const at::Tensor& master) {
        if (!acc.defined()) {  // default mode: the new values over the gradients (adam_spans)
          run_host_update(adam_spans(spans, p, m, v, g), options, frozen.get());
          return;
        }
        const bool lowp = g.scalar_type() != at::kFloat;
        run_host_update(adam_spans(spans, p, m, v, acc, lowp ? g : at::Tensor()), options, frozen.get());
        if (!lowp) g.copy_(master);  // fp32 compute: the master is the value, as write_back_locked copies it
      },
      /*with_state=*/true, /*background_write=*/true);
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  if (static_cast<int64_t>(deferred_.size()) < num_chunks()) deferred_.resize(num_chunks());
  deferred_[c] = std::move(job);
  deferred_pending_.store(true);
  return true;
}

void HybridAdam::follow_layout_locked() {
  // The model waits for updates left running before it ends an iteration, where it repacks.
  TORCH_INTERNAL_ASSERT(!deferred_pending_.load(), "a layout change with host updates still running");
  placed_ = false;  // the old state store's device bytes left with it (discharged from the accountant)
  layout_version_ = model().layout_version();
  landings_.resize(model().num_params(), 0);  // per parameter: kept across a repack (counted in this backward)
  uses_.resize(model().num_params(), 0);
  last_uses_.resize(model().num_params(), 0);
  on_device_.assign(model().layout().num_chunks(), 0);
}

void HybridAdam::layout_changed() {
  // The model migrated the state with the parameters (StateChunks, in the same repack); placement
  // starts over for the new layout.
  std::lock_guard<std::mutex> lock(mutex_);
  follow_layout_locked();
}

void HybridAdam::sync_layout_locked() {
  // The model announces every repack (layout_changed): the state always mirrors its layout.
  TORCH_INTERNAL_ASSERT(layout_version_ == model().layout_version(), "HybridAdam missed a repack of the model");
}

int64_t HybridAdam::state_bytes_per_chunk(int64_t layout_chunk) const { return state_->group_bytes(layout_chunk); }

int64_t HybridAdam::device_state_chunks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  for (char d : on_device_) n += d;
  return n;
}

bool HybridAdam::state_on_device(int64_t layout_chunk) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(layout_chunk >= 0 && layout_chunk < static_cast<int64_t>(on_device_.size()), "ferry: layout chunk ",
              layout_chunk, " out of range [0, ", on_device_.size(), ")");
  return on_device_[layout_chunk] != 0;
}

// Note [Which state goes to the device]
// When only some state chunk groups fit on the device, the ones that go there are the first layout
// chunks (the first used in forward), and the host keeps the state of the last ones. In the
// pipelined step (Note [Pipelined step]) a host-state chunk's work (gradients to the host, host Adam,
// new values back) can start once the chunk is final in backward, and backward finalizes the chunks
// last-first: so the last chunks' host Adam starts with backward and has all of it to run, while the
// first chunks would become final only at its end, leaving their host Adam after it. Measured on the
// H100 at 12b with the opposite choice (2026-11-23, 57 of 181 groups on the device): the host Adam
// could start only after the device chunks' 31% of backward, and backward (2.37 s) ended with it.
// Until 2026-11-23 the choice was the opposite, a rule from the unpipelined step, where the order did
// not matter for the updates.
void HybridAdam::place_locked() {
  // Decided once, after the warm-up of a training iteration (a forward-only trace lacks backward's memory),
  // between iterations: the device room it reserves may need evictions. A backward_step whose forward
  // came after the warm-up but before any step (micro-batches, or a discarded first step) is inside
  // one: its step places.
  if (placed_ || !model().scheduler().trace() || model().scheduler().trace_is_forward_only()) return;
  if (model().phase() != ModelPhase::kIdle) return;
  const int64_t n = num_chunks();
  // Candidates, first layout chunks first (Note [Which state goes to the device]): with sharded
  // state, the chunks whose state this rank holds.
  std::vector<int64_t> order;
  for (int64_t c = 0; c < n; ++c) {
    if (owned(c)) order.push_back(c);
  }
  const int64_t candidates = static_cast<int64_t>(order.size());
  int64_t count = 0;
  // Room for chunks at the trace's worst moment: the device budget, capped at capacity - non-model
  // peak when the capacity is known (CUDA). 0: no limit.
  const int64_t room = model().scheduler().device_room_bytes();
  int64_t margin = -1;
  if (options_.device_state_chunks >= 0) {
    count = std::min(options_.device_state_chunks, candidates);
  } else if (room == 0) {
    count = candidates;
  } else {
    int64_t param_bytes = 0;
    for (int64_t c = 0; c < n; ++c) param_bytes += model().store().chunk_info(model().param_chunk(c)).nbytes;
    margin = room - param_bytes;
    int64_t used = 0;
    while (count < candidates && used + state_bytes_per_chunk(order[count]) <= margin) {
      used += state_bytes_per_chunk(order[count++]);
    }
  }
  int64_t reserved = 0;
  for (int64_t k = 0; k < count; ++k) reserved += state_bytes_per_chunk(order[k]);
  model().scheduler().admit_device_bytes(reserved);  // evicts parameter chunks; throws, changing nothing, if too much
  for (int64_t k = 0; k < count; ++k) {
    const int64_t c = order[k];
    state_->move_group(c, Location::kDevice);
    on_device_[c] = 1;
  }
  placed_ = true;
  if (!options_.accumulate_grads) {
    // Every step the parameter chunks of host-state chunks travel to the host (their gradients) and
    // back (their new values): keep that many host buffers for reuse, so the round trip allocates
    // nothing (pinned: no cudaHostAlloc/cudaFreeHost per step).
    int64_t travelling = 0, largest = 0;
    for (int64_t c = 0; c < n; ++c) {
      const int64_t bytes = model().store().chunk_info(model().param_chunk(c)).nbytes;
      largest = std::max(largest, bytes);
      if (!on_device_[c] && owned(c)) travelling += bytes;
      if (param_shards_ && !owned(c)) travelling += bytes;  // fetched into host buffers every step
    }
    if (travelling > 0) {
      model().store().set_host_cache_bytes(std::max(model().store().host_cache_bytes(), travelling + largest));
    }
  }
  log::info("ferry: HybridAdam placed optimizer state: ", count, " of ", candidates, " chunk groups on the device (",
            format_bytes(reserved), ")", margin >= 0 ? ", margin after parameters and non-model peak " : "",
            margin >= 0 ? format_bytes(std::max<int64_t>(0, margin)) : std::string());
}

void HybridAdam::land_grad(int64_t param, const at::Tensor& grad) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  TORCH_CHECK(grad.layout() == at::kStrided, "ferry: HybridAdam needs dense gradients; parameter ",
              model().param_name(param), " got a ", grad.layout(), " one");
  // The model wrote it into the parameter's slot (grads_into_param_slots).
  if (slot_accumulation()) {
    // after_landing() consumes the chunk when it is final for this backward (Note [Accumulation per chunk]).
    if (!accum_armed_) arm_accumulation_locked();
    in_slot_[param] = 1;
    ++accum_landings_[param];
  }
  landed_[param] = 1;
  grads_landed_ = true;
  ++landings_[param];
}

std::vector<HybridAdam::Span> HybridAdam::landed_spans_locked(int64_t c, Landed which) const {
  const ChunkLayout& layout = model().layout();
  std::vector<Span> spans;
  bool open = false;  // the last slot seen landed and extends spans.back()
  for (int64_t t : layout.chunks()[c].tensors) {
    const Slot& slot = layout.slots()[t];
    if (slot.numel == 0) continue;
    if (!landed_[t] || (which == Landed::kLate && !late(t))) {
      open = false;
      continue;
    }
    const int g = group_of_param_[t];
    if (open && spans.back().group == g && spans.back().lag == lag_[t]) {
      spans.back().end = slot.offset + slot.numel;
    } else {
      spans.push_back({g, slot.offset, slot.offset + slot.numel, lag_[t]});
    }
    open = true;
  }
  return spans;
}

CpuAdam::FrozenGroup HybridAdam::update_group(const Span& s, const std::vector<CpuAdam::FrozenGroup>* frozen) const {
  CpuAdam::FrozenGroup f = frozen != nullptr ? (*frozen)[s.group] : cpu_adam_.freeze(s.group);
  f.step -= s.lag;
  TORCH_INTERNAL_ASSERT(f.step >= 1, "a span of group ", s.group, " with lag ", s.lag, " at group step ", f.step + s.lag);
  return f;
}

void HybridAdam::count_missed_steps_locked(const std::vector<char>* updated_chunks,
                                           const std::vector<char>* late_updated) {
  const ChunkLayout& layout = model().layout();
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (!owned(c)) continue;
    const bool updated = updated_chunks == nullptr || (*updated_chunks)[c] != 0;
    const bool late_part = late_updated != nullptr && !late_updated->empty() && (*late_updated)[c] != 0;
    for (int64_t t : layout.chunks()[c].tensors) {
      if (!landed_[t] || !(late(t) ? late_part : updated)) ++lag_[t];
    }
  }
}

int64_t HybridAdam::param_step_count(int64_t param) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(param >= 0 && param < model().num_params(), "ferry: HybridAdam::param_step_count: expected a parameter "
              "index in [0, ", model().num_params(), "), got ", param);
  const int64_t c = model().layout().slots()[param].chunk;
  TORCH_CHECK(owned(c), "ferry: HybridAdam::param_step_count: the state of ", model().param_name(param), " is on rank ",
              c % world_, ", not on rank ", rank_, " (ask the rank that owns it)");
  return cpu_adam_.step_count(group_of_param_[param]) - lag_[param];
}

at::Tensor HybridAdam::grad_payload_locked(int64_t c) {
  if (options_.accumulate_grads) {
    // A data-parallel step reads the gradients summed over ranks; the accumulation chunk keeps this rank's.
    if (static_cast<int64_t>(reduced_grads_.size()) > c && reduced_grads_[c].defined()) return reduced_grads_[c];
    return state_->payload(kGradRole, c);
  }
  return model().store().payload(model().param_chunk(c));
}

void HybridAdam::stage_param_chunks_locked(bool skip_launched) {
  if (options_.accumulate_grads) return;
  trace::Span span("adam", "adam.stage_param_chunks");
  ChunkStore& params = model().store();
  // Host-bound chunks first: they must leave anyway, and the room they free is what the device-bound
  // ones are moved into. (Device-bound first let the eviction policy, which knows nothing of the step,
  // evict a device-bound chunk staged a moment before to make room for the next one: seen on a GPU,
  // where the device norms then met a gradient on the host.)
  for (int pass = 0; pass < 2; ++pass) {
    const bool device = pass == 1;
    for (int64_t c = 0; c < num_chunks(); ++c) {
      if (static_cast<bool>(on_device_[c]) != device || (skip_launched && launched_[c] && !has_late(c)) || !owned(c)) {
        continue;
      }
      const Location want = device ? Location::kDevice : Location::kHost;
      if (params.location(model().param_chunk(c)) != want) params.move(model().param_chunk(c), want);
    }
  }
  const int64_t on_device = std::count(on_device_.begin(), on_device_.end(), 1);
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (!on_device_[c] || (skip_launched && launched_[c] && !has_late(c)) || !owned(c)) continue;
    TORCH_CHECK(params.location(model().param_chunk(c)) == Location::kDevice, "ferry: HybridAdam: the parameter chunk of "
                "state chunk ", c, " (state on the device) was evicted while the step staged the others: the device "
                "budget's parameter region holds fewer chunks than the ", on_device, " whose state is on the device. "
                "Lower HybridAdamOptions::device_state_chunks or raise the device budget.");
  }
}

void HybridAdam::discard_grads_locked() {
  if (!options_.accumulate_grads) {
    // The slots of landed parameters hold gradients: give them their values (the masters) back.
    ChunkStore& params = model().store();
    for (int64_t c = 0; c < num_chunks(); ++c) {
      const std::vector<Span> spans = landed_spans_locked(c);
      if (spans.empty() || !owned(c)) continue;  // sharded: the owners' values come with the next gather
      restore_values(params.payload(model().param_chunk(c)), state_->payload(kMasterRole, c), spans);
    }
    model().clear_grad_slots();
  } else {
    for (int64_t c = 0; c < num_chunks(); ++c) {
      at::Tensor acc = state_->payload(kGradRole, c);
      if (deferred_update_of(c)) {
        // Note [Update behind the next forward]: the update still running reads this sum; the zeroing
        // queues behind it on the same worker (where the next accumulation into the chunk queues too).
        std::future<void> zeroing = cpu_adam_.run_async([acc] { acc.zero_(); });
        std::lock_guard<std::mutex> lock(deferred_mutex_);
        deferred_zeroing_.push_back(std::move(zeroing));
      } else {
        acc.zero_();
      }
    }
  }
  std::fill(landed_.begin(), landed_.end(), 0);
  grads_landed_ = false;
}

void HybridAdam::restore_values(const at::Tensor& param, const at::Tensor& master, const std::vector<Span>& spans) {
  for (const Span& sp : spans) param.slice(0, sp.begin, sp.end).copy_(master.slice(0, sp.begin, sp.end));
}

std::vector<std::pair<HybridAdam::Span, AdamSpan>> HybridAdam::adam_spans(const std::vector<Span>& landed, float* p,
                                                                          float* m, float* v, const at::Tensor& grads,
                                                                          const at::Tensor& lowp) const {
  const at::ScalarType grad_dtype = grads.scalar_type();
  const int64_t grad_elem = static_cast<int64_t>(c10::elementSize(grad_dtype));
  char* g = static_cast<char*>(grads.data_ptr());
  // Default mode: the grads are in the parameter chunk (on the host now); the kernel writes the new
  // bf16/fp16 value over each grad it has read, in the same pass (fp32: copied after the update).
  // Accumulation mode: into `lowp` (the parameter chunk, where lowp_target_locked found it), if given.
  const bool in_place_lowp = !options_.accumulate_grads && grad_dtype != at::kFloat;
  TORCH_INTERNAL_ASSERT(!lowp.defined() || (options_.accumulate_grads && lowp.scalar_type() != at::kFloat));
  char* lowp_base = in_place_lowp ? g : (lowp.defined() ? static_cast<char*>(lowp.data_ptr()) : nullptr);
  const at::ScalarType lowp_dtype = in_place_lowp ? grad_dtype : (lowp.defined() ? lowp.scalar_type() : at::kFloat);
  const int64_t lowp_elem = static_cast<int64_t>(c10::elementSize(lowp_dtype));
  std::vector<std::pair<Span, AdamSpan>> spans;
  for (const Span& s : landed) {
    AdamSpan span;
    span.param = p + s.begin;
    span.grad = g + s.begin * grad_elem;
    span.grad_dtype = grad_dtype;
    span.exp_avg = m + s.begin;
    span.exp_avg_sq = v + s.begin;
    span.numel = s.end - s.begin;
    if (lowp_base != nullptr) {
      span.param_lowp = lowp_base + s.begin * lowp_elem;
      span.lowp_dtype = lowp_dtype;
    }
    spans.emplace_back(s, span);
  }
  return spans;
}

at::Tensor HybridAdam::lowp_target_locked(int64_t c) {
  if (!options_.accumulate_grads || world_ > 1) return {};
  ChunkStore& params = model().store();
  const ChunkId pc = model().param_chunk(c);
  if (params.location(pc) != (on_device_[c] ? Location::kDevice : Location::kHost)) return {};
  at::Tensor payload = params.payload(pc);  // waits for a copy into the host; orders the stream after one into the device
  if (payload.scalar_type() == at::kFloat) return {};
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(lowp_written_.size()) == num_chunks(), "lowp_written_ not armed");
  lowp_written_[c] = 1;
  return payload;
}

std::vector<std::pair<HybridAdam::Span, AdamSpan>> HybridAdam::host_spans_locked(int64_t c, Landed which) {
  return adam_spans(landed_spans_locked(c, which), state_->payload(kMasterRole, c).data_ptr<float>(),
                    state_->payload(kExpAvgRole, c).data_ptr<float>(),
                    state_->payload(kExpAvgSqRole, c).data_ptr<float>(), grad_payload_locked(c),
                    lowp_target_locked(c));
}

void HybridAdam::run_host_update(const std::vector<std::pair<Span, AdamSpan>>& spans, const UpdateOptions& options,
                                 const std::vector<CpuAdam::FrozenGroup>* frozen) {
  for (const auto& [s, span] : spans) {
    cpu_adam_.update(update_group(s, frozen), span, options);
    if (!options_.accumulate_grads && !span.param_lowp) {  // fp32 compute copy: the master is the value
      std::memcpy(const_cast<void*>(span.grad), span.param, static_cast<size_t>(span.numel) * sizeof(float));
    }
  }
}

HybridAdam::ChunkOutcome HybridAdam::host_norm(const at::Tensor& grads, const std::vector<Span>& spans) const {
  ChunkOutcome out;
  const int64_t elem = static_cast<int64_t>(grads.element_size());
  const char* base = static_cast<const char*>(grads.data_ptr());
  for (const Span& s : spans) {
    const GradNorm norm = cpu_adam_.grad_norm_sq(base + s.begin * elem, grads.scalar_type(), s.end - s.begin);
    out.sum_sq += norm.sum_sq;
    out.finite = out.finite && !norm.nonfinite;
  }
  // A norm that overflows counts as non-finite, as the device's fp32 norm does (D70): a chunk is then
  // skipped wherever its state lives, and the step's report agrees with what was updated.
  out.finite = out.finite && std::isfinite(out.sum_sq);
  return out;
}

std::vector<at::Tensor> HybridAdam::device_norms(const at::Tensor& grads, const std::vector<Span>& spans) const {
  std::vector<at::Tensor> norms;
  for (const Span& s : spans) {
    // fp32 accumulation whatever the gradients' dtype; inf/NaN if any gradient is.
    norms.push_back(at::linalg_vector_norm(grads.slice(0, s.begin, s.end), 2, c10::nullopt, false, at::kFloat));
  }
  return norms;
}

void HybridAdam::finish_norms(const std::vector<at::Tensor>& device_norms, const std::vector<int64_t>& device_index,
                              ChunkNorms& norms) {
  int64_t syncs = 0;
  const int64_t n = static_cast<int64_t>(norms.sum_sq.size());
  if (!device_norms.empty()) {  // one host sync for every device chunk
    const at::Tensor all = at::stack(device_norms).to(at::kCPU, at::kDouble);
    syncs = 1;
    const double* v = all.data_ptr<double>();
    for (size_t k = 0; k < device_index.size(); ++k) {
      const bool late_part = device_index[k] >= n;  // n + c: chunk c's late part
      const int64_t c = late_part ? device_index[k] - n : device_index[k];
      std::vector<char>& finite = late_part ? norms.late_finite : norms.finite;
      finite[c] = finite[c] && std::isfinite(v[k]);
      (late_part ? norms.late_sum_sq : norms.sum_sq)[c] += v[k] * v[k];
    }
  }
  norms.total_sq = 0.0;
  norms.all_finite = true;
  for (int64_t c = 0; c < n; ++c) {
    norms.all_finite = norms.all_finite && norms.finite[c];
    norms.total_sq += norms.sum_sq[c];
    if (norms.late_sum_sq.empty()) continue;
    norms.all_finite = norms.all_finite && norms.late_finite[c];
    norms.total_sq += norms.late_sum_sq[c];
  }
  norms.all_finite = norms.all_finite && std::isfinite(norms.total_sq);
  norms.syncs = syncs;
}

void HybridAdam::host_update_chunk_locked(int64_t c, const UpdateOptions& update_options, Landed which) {
  trace::Span span("adam", trace::enabled() ? "host adam chunk " + std::to_string(c) : std::string());
  run_host_update(host_spans_locked(c, which), update_options);
}

void HybridAdam::device_update_chunk_locked(int64_t c, double grad_scale, const at::Tensor& found_inf, Landed which) {
  trace::Span span("adam", trace::enabled() ? "device adam chunk " + std::to_string(c) : std::string());
  const at::Tensor p = state_->payload(kMasterRole, c);
  const at::Tensor g = grad_payload_locked(c);
  // On CUDA the kernel would fault on a host gradient; the simulated device would not notice, so the
  // invariant is checked here for both.
  TORCH_CHECK(options_.accumulate_grads || model().store().location(model().param_chunk(c)) == Location::kDevice,
              "ferry: HybridAdam: the device update of state chunk ", c, " found its parameter chunk (holding the "
              "gradients) on the host; it must be staged on the device first (internal error)");
  // The spans the host update would get (adam_spans): in the default mode the new bf16/fp16 value is
  // written over the gradient in the same pass; an fp32 compute copy is the master, copied after.
  for (const auto& [landed, s] : adam_spans(landed_spans_locked(c, which), p.data_ptr<float>(),
                                            state_->payload(kExpAvgRole, c).data_ptr<float>(),
                                            state_->payload(kExpAvgSqRole, c).data_ptr<float>(), g,
                                            lowp_target_locked(c))) {
    device_adam_update(cpu_adam_, update_group(landed, nullptr), s, grad_scale, p.device(), found_inf);
    if (!options_.accumulate_grads && !s.param_lowp) {
      const int64_t begin = s.param - p.data_ptr<float>();
      g.slice(0, begin, begin + s.numel).copy_(p.slice(0, begin, begin + s.numel));
    }
  }
}

// ---- the pipelined step (Note [Pipelined step]) ---------------------------------------------------

void HybridAdam::before_landing(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t c = model().layout().slots()[param].chunk;
  if (slot_accumulation()) {
    if (overlap_active_ && eager_ && launched_[c]) return late_landing_locked(param, c);
    if (accum_armed_ && accum_consumed_[c]) {
      // A landing this backward did not have last time, on a chunk already consumed: its job (which
      // holds the chunk on the host) ends first; the chunk is consumed again when backward ends. In the
      // two-phase step only the chunk's norm was taken: the step takes it again.
      await_superseded_job_locked(c);
      accum_consumed_[c] = 0;
      if (overlap_active_ && launched_[c]) {
        launched_[c] = 0;
        chunk_device_norms_[c].clear();
      }
    }
    return;
  }
  if (!overlap_active_ || options_.accumulate_grads || !launched_[c]) return;
  late_landing_locked(param, c);
}

// Note [A gradient after its chunk's update]
// A parameter's gradient can land after its chunk became final: a layer that no earlier backward reached
// (skipped in the first steps by stochastic depth, a task head or an expert not used yet), or one more
// contribution than any earlier backward had (Note [Expectations only grow]). This was refused, and the
// step lost: a multi-task model alternating its heads, or stochastic depth skipping a layer in the
// first step, failed at its second backward_step (found by a randomized comparison of backward_step
// against backward() + step()). Now, at N = 1:
//  - two-phase step (clipping, loss scaling): the chunk's job only took its norm, so it is taken again
//    after backward with the late gradient: the chunk counts as not launched, and the step is exactly
//    step()'s;
//  - eager step, a parameter with no gradient yet in this backward: the chunk's job left it alone (it
//    updates only the landed spans). The landing waits for the job, the parameter is marked late, and
//    after backward its spans are updated as a chunk that was not launched is: their own norm and
//    finiteness, then the update where the state lives. Adam is elementwise, so the bits are those of
//    backward() + step() (the norm that the result reports is summed in another order); a non-finite
//    late gradient skips the late spans only, as a non-finite chunk skips its own (Note [Pipelined step]);
//  - a further contribution to a parameter whose update has run is refused, once: the next backwards
//    expect it.
// The late parameters are counted in StepResult::late_params; being late grows the expectations, so a
// parameter is late at most once per requires_grad configuration. At N > 1 a late landing cannot be
// taken (the group's reduce-scatter has left): there a chunk holding a trainable parameter that no
// backward has reached yet is not final early (arm_landing_count_locked), so the landing is not late,
// at the cost of that chunk's overlap until the parameter trains (for good if it never does: such a
// parameter should not require grad). requires_grad is the same on every rank (the landings'
// fingerprint includes it), so the groups still complete in the same order everywhere.
void HybridAdam::late_landing_locked(int64_t param, int64_t c) {
  const bool accumulation = slot_accumulation();
  std::vector<int64_t>& expected = accumulation ? accum_expected_ : expected_landings_;
  const int64_t landed = accumulation ? accum_landings_[param] : landings_[param];
  const int64_t saw = expected[param];
  expected[param] = std::max(saw, landed + 1);  // the next backwards expect it (Note [Expectations only grow])
  if (late(param)) return;                     // its update runs after backward: take every contribution
  const bool untouched = !landed_[param];       // no span of the chunk's job holds it
  if (!dist_pipelined_ && (!eager_ || untouched)) {
    if (accumulation) {
      await_superseded_job_locked(c);  // the chunk is consumed again when backward ends
    } else if (static_cast<int64_t>(jobs_.size()) > c && jobs_[c].valid()) {
      jobs_[c].wait();  // its errors surface where the jobs are joined
    }
    if (!eager_) {  // only its norm was taken: taken again after backward
      launched_[c] = 0;
      chunk_device_norms_[c].clear();
      return;
    }
    late_[param] = 1;
    late_chunks_[c] = 1;
    // Accumulation: the slot is consumed again when backward ends (into the accumulation chunk).
    if (accumulation) accum_consumed_[c] = 0;
    return;
  }
  TORCH_CHECK(false, "ferry: HybridAdam::backward_step: parameter ", model().param_name(param), " got gradient "
              "contribution ", landed + 1, " after its chunk's update had started (the backward",
              accumulation ? "s" : "_steps", " before had at most ", saw, "; Note [A gradient after its chunk's "
              "update]). The next backwards expect it",
              accumulation ? "; the gradients of this one that landed wait in their slots (zero_grad() discards them)."
                           : ".");
}

void HybridAdam::after_landing(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (slot_accumulation()) {
    const int64_t c = model().layout().slots()[param].chunk;
    if (accum_landings_[param] > accum_expected_[param] || --accum_remaining_[c] != 0) return;
    consume_final_chunk_locked(c);
    return;
  }
  if (!overlap_active_ || options_.accumulate_grads) return;
  const int64_t c = model().layout().slots()[param].chunk;
  if (landings_[param] <= expected_landings_[param] && --remaining_[c] == 0) launch_chunk_locked(c);
}

void HybridAdam::consume_final_chunk_locked(int64_t c) {
  // backward_step of the last micro-batch: the chunk's norm follows its accumulation, and its host
  // update too unless clipping or loss scaling make the step two-phase.
  consume_slot_grads_locked(c, !overlap_active_ ? AfterAccumulation::kNothing
                               : eager_        ? AfterAccumulation::kNormAndUpdate
                                               : AfterAccumulation::kNorm);
}

// Note [A chunk final before its last use]
// A chunk's gradients can all have landed while backward still needs the chunk: a frozen layer's
// weight, in the chunk of a trainable layer after it, carries the gradient to trainable layers below
// it. Final on its landings alone, the chunk went to the host and was locked there for its update or
// accumulation, and the frozen weight's use failed ("locked on the host"): every backward_step after
// the first, and every accumulating backward, of a model fine-tuned with such a layer. So a chunk is
// final once its parameters have had the landings and the uses (in this model's backward) that earlier
// backwards had (Note [Expectations only grow]); a chunk that expects no landing is never final early,
// as before. A use beyond them (a loop that ran longer) waits for the chunk's job in this backward
// (await_param): the value it reads is not one the job writes, since a parameter is not used after its
// own landing (that is refused, D64). (At N > 1 an owner's job waits for the ranks' sums, and such a use
// still fails on the lock.) A use fewer leaves the chunk to backward's end.
void HybridAdam::used_in_backward(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  if (++uses_[param] > last_uses_[param]) return;
  const int64_t c = model().layout().slots()[param].chunk;
  if (slot_accumulation()) {
    if (accum_armed_ && accum_remaining_[c] > 0 && --accum_remaining_[c] == 0) consume_final_chunk_locked(c);
    return;
  }
  if (!overlap_active_ || options_.accumulate_grads) return;
  if (remaining_[c] > 0 && --remaining_[c] == 0) launch_chunk_locked(c);
}

std::vector<int64_t> HybridAdam::final_counts_locked(const std::vector<int64_t>& landings) const {
  const int64_t n = num_chunks();
  const auto& slots = model().layout().slots();
  std::vector<int64_t> counts(n, 0), uses(n, 0);
  for (int64_t p = 0; p < model().num_params(); ++p) {
    counts[slots[p].chunk] += landings[p];
    uses[slots[p].chunk] += std::max<int64_t>(0, last_uses_[p] - uses_[p]);
  }
  for (int64_t c = 0; c < n; ++c) {
    if (counts[c] > 0) counts[c] += uses[c];
  }
  return counts;
}

void HybridAdam::launch_chunk_locked(int64_t c) {
  if (dist_pipelined_) return chunk_final_across_ranks_locked(c);
  launched_[c] = 1;
  ChunkStore& params = model().store();
  const ChunkId pc = model().param_chunk(c);
  std::vector<Span> spans = landed_spans_locked(c);
  if (on_device_[c]) {
    // No host stall: a move to the device only orders the compute stream after the copy.
    trace::Span span("adam", trace::enabled() ? "pipelined device adam chunk " + std::to_string(c) : std::string());
    if (params.location(pc) != Location::kDevice) params.move(pc, Location::kDevice);
    chunk_device_norms_[c] = device_norms(params.payload(pc), spans);
    if (eager_ && !spans.empty()) {
      const at::Tensor found_inf =
          at::logical_not(at::isfinite(at::stack(chunk_device_norms_[c])).all()).to(at::kFloat);
      device_update_chunk_locked(c, 1.0, found_inf);
    }
    return;
  }
  if (static_cast<int64_t>(jobs_.size()) < num_chunks()) jobs_.resize(num_chunks());
  backward_jobs_.store(true);
  jobs_[c] = launch_host_job_locked(c, "pipelined host adam chunk ",
                         [this, c, spans = std::move(spans), eager = eager_](const at::Tensor& g, float* p, float* m,
                                                                           float* v, const at::Tensor& master) {
                           const ChunkOutcome out = host_norm(g, spans);
                           if (eager) {
                             if (out.finite) {
                               run_host_update(adam_spans(spans, p, m, v, g), UpdateOptions{1.0, /*grads_checked=*/true});
                             } else {
                               restore_values(g, master, spans);
                             }
                           }
                           outcomes_[c] = out;
                         });
}

std::future<void> HybridAdam::launch_host_job_locked(int64_t c, const char* what, HostJob work, bool with_state,
                                                     bool background_write) {
  ChunkStore& params = model().store();
  const ChunkId pc = model().param_chunk(c);
  if (params.location(pc) != Location::kHost) params.move_async(pc, Location::kHost);  // one transfer
  params.lock_on_host(pc);
  // Note [Ops outside the scopes] (hooks/interceptor.h): announced before the job is queued, over when it is
  // (failed or not), so that ops between iterations wait for it.
  if (background_write) outside_hazard_begin();
  try {
    // A chunk another rank owns has no master here (accumulation at N > 1): p is null, master undefined.
    at::Tensor master = owned(c) ? state_->payload(kMasterRole, c) : at::Tensor();
    TORCH_INTERNAL_ASSERT(master.defined() || !with_state, "host Adam job for chunk ", c, ", not owned here");
    float* p = master.defined() ? master.data_ptr<float>() : nullptr;
    float* m = with_state ? state_->payload(kExpAvgRole, c).data_ptr<float>() : nullptr;
    float* v = with_state ? state_->payload(kExpAvgSqRole, c).data_ptr<float>() : nullptr;
    return cpu_adam_.run_async([this, c, pc, store = &params, what, work = std::move(work), p, m, v,
                                    master = std::move(master), background_write] {
      struct Finished {  // last: the chunk is unlocked when the write is announced over
        bool announce;
        ~Finished() {
          if (announce) outside_hazard_end();
        }
      } finished{background_write};
      struct Unlock {
        ChunkStore* store;
        ChunkId id;
        ~Unlock() {
          try {
            store->unlock_on_host(id);
          } catch (const std::exception& e) {
            log::error("ferry: HybridAdam could not unlock chunk ", id, ": ", e.what());
          }
        }
      } unlock{store, pc};
      ++jobs_started_;
      trace::Span span("adam", trace::enabled() ? what + std::to_string(c) : std::string());
      store->wait(pc, WaitFrom::kBackground);  // its gradients' copy to the host
      work(store->payload(pc), p, m, v, master);
    });
  } catch (...) {
    if (background_write) outside_hazard_end();
    params.unlock_on_host(pc);
    throw;
  }
}

// Note [Accumulation per chunk] (hybrid_adam.h, HybridAdamOptions::accumulate_grads).
void HybridAdam::arm_accumulation_locked() {
  const int64_t n = num_chunks(), params = model().num_params();
  in_slot_.assign(params, 0);
  accum_landings_.assign(params, 0);
  if (static_cast<int64_t>(accum_expected_.size()) != params) accum_expected_.assign(params, 0);
  accum_consumed_.assign(n, 0);
  // With no previous backward every count is 0: no chunk is final early, backward_finished consumes all.
  // Armed at the first landing: the uses seen before it are left out (Note [A chunk final before its last use]).
  accum_remaining_ = final_counts_locked(accum_expected_);
  for (int64_t c = 0; c < n; ++c) {
    if (accum_remaining_[c] == 0) accum_remaining_[c] = -1;  // never reaches 0 by counting down
  }
  if (static_cast<int64_t>(jobs_.size()) < n) jobs_.resize(n);
  accum_armed_ = true;
}

void HybridAdam::consume_slot_grads_locked(int64_t c, AfterAccumulation then) {
  accum_consumed_[c] = 1;
  std::vector<Span> spans;
  for (int64_t t : model().layout().chunks()[c].tensors) {
    const Slot& slot = model().layout().slots()[t];
    if (!in_slot_[t] || slot.numel == 0) continue;
    spans.push_back({group_of_param_[t], slot.offset, slot.offset + slot.numel});
    in_slot_[t] = 0;
    model().clear_grad_slot(t);  // its value is back before anything can read the slot again
  }
  if (spans.empty()) return;
  if (static_cast<int64_t>(jobs_.size()) < num_chunks()) jobs_.resize(num_chunks());
  trace::Span span("adam", trace::enabled() ? "accumulate chunk " + std::to_string(c) : std::string());
  at::Tensor acc = state_->payload(kGradRole, c);  // allocated where the state lives (D46)
  ChunkStore& params = model().store();
  const ChunkId pc = model().param_chunk(c);
  if (!owned(c)) {
    // No master here: the slots keep the gradients until values_from_owners_locked (N > 1).
    TORCH_INTERNAL_ASSERT(!on_device_[c], "device state for chunk ", c, ", which rank ", rank_, " does not own");
    backward_jobs_.store(true);
    jobs_[c] = launch_host_job_locked(
        c, "accumulate chunk ",
        [acc, spans = std::move(spans)](const at::Tensor& g, float*, float*, float*, const at::Tensor&) {
          for (const Span& sp : spans) acc.slice(0, sp.begin, sp.end).add_(g.slice(0, sp.begin, sp.end));
        },
        /*with_state=*/false);
    return;
  }
  if (on_device_[c]) {  // queued on the compute stream: no host stall
    if (params.location(pc) != Location::kDevice) params.move(pc, Location::kDevice);
    const at::Tensor g = params.payload(pc);
    for (const Span& sp : spans) acc.slice(0, sp.begin, sp.end).add_(g.slice(0, sp.begin, sp.end));
    restore_values(g, state_->payload(kMasterRole, c), spans);
    if (then == AfterAccumulation::kNorm) {  // the eager step updates device chunks after backward
      chunk_device_norms_[c] = device_norms(acc, landed_spans_locked(c));
      launched_[c] = 1;
    }
    return;
  }
  // The norm step() would take of this chunk (the same spans of the same accumulated gradients): the
  // chunk's landings in this backward are complete, and a later one is refused or, before any update
  // started, makes the step take it again (before_landing).
  std::vector<Span> landed;
  if (then != AfterAccumulation::kNothing) {
    landed = landed_spans_locked(c);
    launched_[c] = 1;
  }
  const bool update = then == AfterAccumulation::kNormAndUpdate;
  backward_jobs_.store(true);
  jobs_[c] = launch_host_job_locked(
      c, update ? "accumulate + host adam chunk " : "accumulate chunk ",
      [this, c, acc, spans = std::move(spans), landed = std::move(landed), then, update](
          const at::Tensor& g, float* p, float* m, float* v, const at::Tensor& master) {
        // add_ widens the bf16/fp16 gradients into fp32, as the per-parameter add did.
        for (const Span& sp : spans) acc.slice(0, sp.begin, sp.end).add_(g.slice(0, sp.begin, sp.end));
        if (then != AfterAccumulation::kNothing) outcomes_[c] = host_norm(acc, landed);
        if (!update || !outcomes_[c].finite) {
          restore_values(g, master, spans);  // the slots get their values back (round(master))
          return;
        }
        // The update writes the new values into the slots in its own pass (fp32: copied after): the
        // chunk is locked on the host for this job, so no write-back pass is needed for it.
        const bool lowp = g.scalar_type() != at::kFloat;
        run_host_update(adam_spans(landed, p, m, v, acc, lowp ? g : at::Tensor()),
                        UpdateOptions{1.0, /*grads_checked=*/true});
        if (!lowp) restore_values(g, master, landed);
        lowp_written_[c] = 1;
      },
      /*with_state=*/update);
}

void HybridAdam::await_superseded_job_locked(int64_t c) {
  if (static_cast<int64_t>(jobs_.size()) <= c || !jobs_[c].valid()) return;
  try {
    jobs_[c].get();
  } catch (...) {
    if (!job_error_) job_error_ = std::current_exception();  // join_jobs_locked reports it
  }
}

void HybridAdam::check_backward_step_start_locked() {
  sync_layout_locked();
  TORCH_CHECK(!grads_landed_, "ferry: HybridAdam::backward_step: gradients of an earlier backward() wait for "
                              "step(); call step() or zero_grad() first");
}

std::exception_ptr HybridAdam::join_jobs_locked() {
  std::exception_ptr error = std::exchange(job_error_, nullptr);
  for (auto& job : jobs_) {
    if (!job.valid()) continue;
    try {
      job.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  jobs_.clear();
  backward_jobs_.store(false);
  return error;
}

void HybridAdam::arm_landing_count_locked(bool armed) {
  const int64_t n = num_chunks();
  std::fill(landings_.begin(), landings_.end(), 0);
  launched_.assign(n, 0);
  late_.assign(model().num_params(), 0);
  late_chunks_.assign(n, 0);
  remaining_.assign(n, 0);
  if (!armed) return;
  remaining_ = final_counts_locked(expected_landings_);
  if (world_ == 1) return;
  // Note [A gradient after its chunk's update] at N > 1: a late landing cannot be taken (the group's
  // reduce-scatter has left), so a chunk with a trainable parameter that no backward has reached yet
  // waits for backward's end. The same on every rank: requires_grad joins the landings' fingerprint.
  // (Cost: those chunks' updates are not overlapped while it lasts, for good for a parameter that never
  // trains: it should not require grad. Told once.)
  const auto& slots = model().layout().slots();
  int64_t waiting = 0, first = -1;
  for (int64_t p = 0; p < model().num_params(); ++p) {
    if (expected_landings_[p] != 0 || !model().param(p).requires_grad()) continue;
    remaining_[slots[p].chunk] = -1;
    if (waiting++ == 0) first = p;
  }
  if (waiting > 0 && !told_unreached_) {
    told_unreached_ = true;
    log::info("ferry: backward_step: ", waiting, " parameter(s) that require grad (", model().param_name(first),
              " first) had no gradient in any backward yet; across ranks their chunks wait for backward's end until "
              "they do (a parameter that never trains should not require grad)");
  }
}

bool HybridAdam::update_unlaunched_locked(const ChunkNorms& norms, StepResult& result) {
  bool all_finite = true;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    // A launched chunk's late part (Note [A gradient after its chunk's update]) is updated as an
    // unlaunched chunk is, on its own norm.
    const bool late_part = launched_[c] && has_late(c);
    if (launched_[c] && !late_part) continue;
    const Landed which = late_part ? Landed::kLate : Landed::kAll;
    const std::vector<Span> spans = landed_spans_locked(c, which);
    if (spans.empty()) continue;
    const int64_t t0 = now_ns();
    if (!(late_part ? norms.late_finite[c] : norms.finite[c])) {
      all_finite = false;
      // Default mode: the slots hold gradients; they get their values back. (Accumulation chunks keep theirs.)
      if (!options_.accumulate_grads) restore_values(grad_payload_locked(c), state_->payload(kMasterRole, c), spans);
    } else if (on_device_[c]) {
      device_update_chunk_locked(c, 1.0, {}, which);
      result.device_update_ns += now_ns() - t0;
    } else {
      // Accumulation: the job of the launched part wrote its values into the parameter chunk; the late
      // part's are written too, in the update's pass where the chunk is on the host, else by the write-back.
      if (late_part && options_.accumulate_grads) lowp_written_[c] = 0;
      host_update_chunk_locked(c, UpdateOptions{1.0, /*grads_checked=*/true}, which);
      result.host_update_ns += now_ns() - t0;
    }
  }
  return all_finite;
}

void HybridAdam::backward_finished(bool aborted) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Note [A chunk final before its last use]: this backward's uses join what the next ones expect (an
  // aborted one's too: they are a part of what it would have had; Note [Expectations only grow]).
  grow(last_uses_, uses_);
  std::fill(uses_.begin(), uses_.end(), 0);
  std::exception_ptr error;
  if (slot_accumulation() && accum_armed_) {
    // Chunks not final during backward (the first backward: all) are consumed now, an aborted backward's
    // too: what landed is accumulated, as the per-parameter add did.
    for (int64_t c = 0; c < num_chunks(); ++c) {
      if (!accum_consumed_[c]) consume_slot_grads_locked(c);
    }
    // What the next backward expects (Note [Expectations only grow]); an aborted one's landings are a
    // part of what it would have had.
    grow(accum_expected_, accum_landings_);
    accum_armed_ = false;
    // The accumulation jobs are the only ones in jobs_ in this mode: their errors surface here.
    error = join_jobs_locked();
  }
  // Every rank, armed or not (a rank may have landed nothing), whatever its jobs did: the collectives
  // must pair up. An aborted backward too: the other ranks' backwards end here as well (no collective
  // runs inside an accumulating backward), and the next forward needs the values.
  if (slot_accumulation() && sharded_ && world_ > 1 && (aborted || !step_follows_backward_)) {
    values_from_owners_locked();
  }
  if (error) std::rethrow_exception(error);
  // The jobs read and write parameter chunks: done before the model ends the iteration.
  for (auto& job : jobs_) {
    if (job.valid()) job.wait();
  }
}

StepResult HybridAdam::finish_pipelined_locked() {
  trace::Span step_span("adam", "adam.finish_pipelined_step");
  TORCH_INTERNAL_ASSERT(layout_version_ == model().layout_version(), "the layout changed under a pipelined step");
  StepResult result;
  result.loss_scale = loss_scale();
  if (std::exception_ptr error = join_jobs_locked()) std::rethrow_exception(error);
  for (char l : launched_) result.overlapped_chunks += l;
  for (char d : on_device_) (d ? result.device_chunks : result.host_chunks) += 1;
  // Chunks that did not become final during backward: staged now, as step() stages them; the norms of
  // all, summed as step() sums them. Not eager (clipping, loss scaling): the launched chunks only had
  // their norms taken and wait for their update, and the eviction policy may have sent a device-bound
  // one to the host since; they are staged too (seen on a GPU: the fused kernel met a host gradient).
  stage_param_chunks_locked(/*skip_launched=*/eager_);
  int64_t t0 = now_ns();
  const ChunkNorms norms = grad_norms_locked(/*pipelined=*/true);
  result.device_syncs = norms.syncs;
  result.norm_ns = now_ns() - t0;
  if (!eager_) return apply_locked(norms, result);  // clipping / loss scaling: every update now

  // Eager: the launched chunks are updated (or restored) already; the others now, the same way, and
  // the late parts of launched ones (Note [A gradient after its chunk's update]).
  update_unlaunched_locked(norms, result);
  count_missed_steps_locked(&norms.finite, &norms.late_finite);  // a chunk with a non-finite gradient was not updated
  result.late_params = std::count(late_.begin(), late_.end(), 1);
  if (result.late_params > 0) {
    int64_t first = 0;
    while (!late_[first]) ++first;
    log::info("ferry: backward_step: ", result.late_params, " parameter(s) (", model().param_name(first),
              " first) got their first gradient after their chunk's update had started, as no earlier backward "
              "had; updated after backward, and expected from now on");
  }
  late_.clear();
  late_chunks_.clear();
  finish_values_locked(result);
  result.grad_norm = std::sqrt(norms.total_sq);
  result.overflow = !norms.all_finite;
  result.applied = norms.all_finite;
  if (result.overflow) {
    log::warn("ferry: backward_step: non-finite gradients (or a gradient norm that overflows); those chunks were "
              "not updated, the others were");
  }
  return result;
}

StepResult HybridAdam::backward_step(const at::Tensor& loss) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  if (world_ > 1) return dist_backward_step(loss);
  if (options_.accumulate_grads) return backward_step_accumulated(loss);
  settle("backward_step()");
  bool pipelined = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    check_backward_step_start_locked();
    place_locked();
    const int64_t n = num_chunks();
    // Pipelined once placed (the trace and the repack are behind us) and the previous call said how
    // many landings to expect.
    pipelined = placed_ && static_cast<int64_t>(expected_landings_.size()) == model().num_params();
    arm_landing_count_locked(pipelined);
    if (pipelined) {
      eager_ = options_.max_grad_norm == 0 && !scaling_;
      jobs_.clear();
      jobs_.resize(n);
      outcomes_.assign(n, ChunkOutcome{});
      chunk_device_norms_.assign(n, {});
      if (eager_) {
        for (int g = 0; g < num_param_groups(); ++g) cpu_adam_.advance_step(g);  // updates start during backward
      }
    }
    overlap_active_ = pipelined;
  }
  try {
    model().backward(loss);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pipelined) {
      // backward_finished() waited for the jobs. Eager: the launched chunks hold new values (or restored
      // ones), not gradients; the others keep their gradients for zero_grad().
      int64_t started = 0;
      std::vector<char> updated(num_chunks(), 0);  // eager: the launched chunks whose update was applied
      for (int64_t c = 0; c < num_chunks(); ++c) {
        bool failed = false;
        if (jobs_.size() > static_cast<size_t>(c) && jobs_[c].valid()) {
          try {
            jobs_[c].get();
          } catch (const std::exception& e) {
            failed = true;
            log::error("ferry: backward_step: the host update of chunk ", c, " failed too: ", e.what());
          }
        }
        if (!launched_[c] || !eager_ || failed) continue;
        if (!on_device_[c]) {
          updated[c] = outcomes_[c].finite;
        } else if (!chunk_device_norms_[c].empty()) {  // found_inf decided on the device: read it (an error path)
          updated[c] = at::isfinite(at::stack(chunk_device_norms_[c])).all().item<bool>();
        }
      }
      // The step count has advanced; a late parameter (Note [A gradient after its chunk's update]) was
      // not updated, and keeps its gradient for zero_grad().
      if (eager_) count_missed_steps_locked(&updated);
      for (int64_t c = 0; c < num_chunks(); ++c) {
        if (!launched_[c]) continue;
        ++started;
        if (!eager_) continue;
        for (int64_t p : model().layout().chunks()[c].tensors) {
          if (!landed_[p] || late(p)) continue;
          landed_[p] = 0;
          model().clear_grad_slot(p);
        }
      }
      grads_landed_ = std::any_of(landed_.begin(), landed_.end(), [](char l) { return l != 0; });
      jobs_.clear();
      job_error_ = nullptr;
      backward_jobs_.store(false);
      if (eager_ && started > 0) {
        log::error("ferry: backward_step: backward threw; ", started, " chunk(s) whose update had started are updated, ",
                   "the others hold their gradients (zero_grad() discards them), and the step count has advanced");
      }
    }
    late_.clear();
    late_chunks_.clear();
    grow_expected_landings_locked(/*complete=*/false);
    overlap_active_ = false;
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  overlap_active_ = false;
  grow_expected_landings_locked(/*complete=*/true);
  if (!pipelined) return step_locked();  // the first calls: nothing to expect yet
  return finish_pipelined_locked();
}

StepResult HybridAdam::backward_step_accumulated(const at::Tensor& loss) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  settle("backward_step()");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    sync_layout_locked();
    place_locked();
    const bool overlap = static_cast<int64_t>(expected_landings_.size()) == model().num_params();
    arm_landing_count_locked(overlap);
    if (overlap) {
      // Clipping and loss scaling need every gradient first: two-phase (Note [Pipelined step]).
      eager_ = options_.max_grad_norm == 0 && !scaling_;
      outcomes_.assign(num_chunks(), ChunkOutcome{});
      chunk_device_norms_.assign(num_chunks(), {});
      lowp_written_.assign(num_chunks(), 0);
      if (eager_) {
        for (int g = 0; g < num_param_groups(); ++g) cpu_adam_.advance_step(g);  // updates start during backward
      }
    }
    overlap_active_ = overlap;
  }
  try {
    model().backward(loss);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (overlap_active_ && eager_) {
      int64_t started = 0;
      for (char l : launched_) started += l;
      // backward_finished() joined the jobs: a launched host chunk with finite gradients was updated.
      std::vector<char> updated(num_chunks(), 0);
      for (int64_t c = 0; c < num_chunks(); ++c) {
        updated[c] = launched_[c] && !on_device_[c] && static_cast<int64_t>(outcomes_.size()) > c && outcomes_[c].finite;
      }
      count_missed_steps_locked(&updated);  // the step count has advanced; a late parameter was not updated
      log::error("ferry: backward_step: backward threw; ", started, " chunk(s) whose update had started are updated, ",
                 "the others are not, and the step count has advanced");
    }
    chunk_device_norms_.clear();
    lowp_written_.clear();  // the launched chunks' jobs wrote their new values into the slots
    late_.clear();
    late_chunks_.clear();
    grow_expected_landings_locked(/*complete=*/false);
    overlap_active_ = false;
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const bool overlapped = overlap_active_;
  overlap_active_ = false;
  grow_expected_landings_locked(/*complete=*/true);
  if (!overlapped) return step_locked();  // the first call: nothing to compare against yet
  // The accumulations and norms of the chunks final in backward ran during it (eager: their host
  // updates too, writing the new values into the slots); what remains runs now, as step() runs it.
  return finish_pipelined_locked();
}

double HybridAdam::loss_scale() const { return scaling_ ? scaler_.scale() : 1.0; }

void HybridAdam::set_lr(int group, double lr) {
  AdamOptions o = cpu_adam_.options(group);
  o.lr = lr;
  o.validate();
  cpu_adam_.set_options(group, o);
}

void HybridAdam::set_lr(double lr) {
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "ferry: lr must be finite and >= 0, got ", lr);
  for (int g = 0; g < num_param_groups(); ++g) set_lr(g, lr);
}

StepResult HybridAdam::step() {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  settle("step()");
  std::lock_guard<std::mutex> lock(mutex_);
  return step_locked();
}

void HybridAdam::trainable_changed() {
  std::lock_guard<std::mutex> lock(mutex_);
  // What backwards had no longer says what the next ones will have: learned again from the next.
  expected_landings_.clear();
  accum_expected_.clear();
  std::fill(last_uses_.begin(), last_uses_.end(), 0);
}

// Note [Writes to parameters] (hooks/chunked_model.h). Every slot holds its value here. A replacement
// is taken whole, at its own precision; an in-place write where the slot differs from the master
// rounded to the compute dtype (in fp32, everywhere: the slot is the master's copy). Another rank's
// chunk (sharded state): its owner takes the write, and the values come from it after the step.
void HybridAdam::values_written(const std::vector<WrittenParam>& written) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  for (const WrittenParam& w : written) await_param(w.param);  // an update left running writes the master
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  for (const WrittenParam& w : written) {
    if (!owned(model().layout().slots()[w.param].chunk)) continue;
    at::Tensor master = state_->view(kMasterRole, w.param);
    if (w.replacement.defined()) {
      master.copy_(w.replacement);
      continue;
    }
    const at::Tensor value = model().param_values(w.param).to(master.device());
    if (value.scalar_type() == at::kFloat) {
      master.copy_(value);
      continue;
    }
    const at::Tensor changed = value.ne(master.to(value.scalar_type()));
    master.copy_(at::where(changed, value.to(at::kFloat), master));
  }
}

HybridAdam::ChunkNorms HybridAdam::grad_norms_locked(bool pipelined) {
  const int64_t n = num_chunks();
  ChunkNorms norms;
  norms.sum_sq.assign(n, 0.0);
  norms.finite.assign(n, 1);
  std::vector<at::Tensor> device;
  std::vector<int64_t> device_index;
  const bool any_late = pipelined && std::any_of(late_chunks_.begin(), late_chunks_.end(), [](char l) { return l != 0; });
  if (any_late) {
    norms.late_sum_sq.assign(n, 0.0);
    norms.late_finite.assign(n, 1);
  }
  for (int64_t c = 0; c < n; ++c) {
    const bool done = pipelined && launched_[c];  // computed during backward
    if (!owned(c)) continue;                       // its owner's norm comes with the all-reduce
    if (on_device_[c]) {
      std::vector<at::Tensor> d = done ? std::move(chunk_device_norms_[c])
                                       : device_norms(grad_payload_locked(c), landed_spans_locked(c));
      for (at::Tensor& t : d) {
        device.push_back(std::move(t));
        device_index.push_back(c);
      }
      if (done && has_late(c)) {  // Note [A gradient after its chunk's update]: the late part's own
        for (at::Tensor& t : device_norms(grad_payload_locked(c), landed_spans_locked(c, Landed::kLate))) {
          device.push_back(std::move(t));
          device_index.push_back(n + c);
        }
      }
    } else {
      const ChunkOutcome o = done ? outcomes_[c] : host_norm(grad_payload_locked(c), landed_spans_locked(c));
      norms.sum_sq[c] = o.sum_sq;
      norms.finite[c] = o.finite;
      if (done && has_late(c)) {
        const ChunkOutcome late = host_norm(grad_payload_locked(c), landed_spans_locked(c, Landed::kLate));
        norms.late_sum_sq[c] = late.sum_sq;
        norms.late_finite[c] = late.finite;
      }
    }
  }
  if (pipelined) chunk_device_norms_.clear();
  finish_norms(device, device_index, norms);
  return norms;
}

StepResult HybridAdam::step_locked() {
  sync_layout_locked();
  if (world_ > 1) return dist_step_locked();
  TORCH_CHECK(grads_landed_, "ferry: HybridAdam::step() found no gradients since the last zero_grad(); call "
                             "model.backward(loss) first");
  place_locked();
  StepResult result;
  result.loss_scale = loss_scale();

  trace::Span step_span("adam", "adam.step");
  stage_param_chunks_locked();
  // 1. Norms and finiteness, one host sync for all device chunks.
  int64_t t0 = now_ns();
  const ChunkNorms norms = grad_norms_locked();
  for (char d : on_device_) (d ? result.device_chunks : result.host_chunks) += 1;
  result.device_syncs = norms.syncs;
  result.norm_ns = now_ns() - t0;
  trace::complete("adam", "adam.grad_norm", t0, t0 + result.norm_ns);
  return apply_locked(norms, result);
}

StepResult HybridAdam::apply_locked(const ChunkNorms& norms, StepResult result) {
  const int64_t n = num_chunks();
  lowp_written_.assign(n, 0);
  int64_t t0 = now_ns();
  if (!norms.all_finite) {
    result.overflow = true;
    result.grad_norm = std::numeric_limits<double>::infinity();
    if (scaling_) {
      scaler_.update(true);
      model().set_loss_scale(scaler_.scale());
      log::info("ferry: non-finite gradient at loss scale ", result.loss_scale, ": step skipped, scale now ",
                scaler_.scale());
    } else {
      log::warn("ferry: non-finite gradient (or a gradient norm that overflows): step skipped (the parameters "
                "and optimizer state are unchanged)");
    }
    if (!options_.accumulate_grads) discard_grads_locked();  // consumed: the slots get their values back
    return result;
  }
  // Data parallelism: the gradients are sums over the ranks; their mean is the concatenated batch's.
  const double world = static_cast<double>(world_);
  result.grad_norm = std::sqrt(norms.total_sq) / (result.loss_scale * world);
  if (options_.max_grad_norm > 0) {
    result.clip_coef = std::min(1.0, options_.max_grad_norm / (result.grad_norm + 1e-6));
  }
  const double grad_scale = result.clip_coef / (result.loss_scale * world);

  // 2. Update: device chunks with torch's fused kernel, host chunks with CpuAdam.
  for (int g = 0; g < num_param_groups(); ++g) cpu_adam_.advance_step(g);
  t0 = now_ns();
  for (int64_t c = 0; c < n; ++c) {
    if (on_device_[c] && owned(c)) device_update_chunk_locked(c, grad_scale);
  }
  result.device_update_ns = now_ns() - t0;
  trace::complete("adam", "adam.device_update", t0, t0 + result.device_update_ns,
                  "\"chunks\": " + std::to_string(result.device_chunks));
  t0 = now_ns();
  UpdateOptions update_options;
  update_options.grad_scale = grad_scale;
  update_options.grads_checked = true;
  // Note [Update behind the next forward]: the host updates queued in forward order (layout order),
  // each group's options and step count frozen now. At N > 1 only where the next use gathers the new
  // values (sharded parameters, whose gathers wait for them); else the step's own gather reads them.
  std::shared_ptr<const std::vector<CpuAdam::FrozenGroup>> frozen;
  if (options_.update_behind_forward && (world_ == 1 || param_shards_)) {
    auto groups = std::make_shared<std::vector<CpuAdam::FrozenGroup>>();
    for (int g = 0; g < num_param_groups(); ++g) groups->push_back(cpu_adam_.freeze(g));
    frozen = std::move(groups);
  }
  for (int64_t c = 0; c < n; ++c) {
    if (on_device_[c] || !owned(c)) continue;
    if (frozen && defer_host_update_locked(c, update_options, frozen)) {
      ++result.deferred_chunks;
    } else {
      host_update_chunk_locked(c, update_options);
    }
  }
  result.host_update_ns = now_ns() - t0;  // on this thread: queueing only, for the chunks left running
  trace::complete("adam", "adam.host_update", t0, t0 + result.host_update_ns,
                  "\"chunks\": " + std::to_string(result.host_chunks));

  count_missed_steps_locked(nullptr);  // the spans above (those left running too) took their lags already
  finish_values_locked(result);
  if (scaling_) {
    scaler_.update(false);
    model().set_loss_scale(scaler_.scale());
  }
  // The updates left running write the parameters: ops on this thread that use them wait for them
  // (Note [Ops outside the scopes]). Last, so that the step's own ops above are not watched.
  if (result.deferred_chunks > 0) watch_outside_uses();
  result.applied = true;
  return result;
}

void HybridAdam::finish_values_locked(StepResult& result) {
  // The parameters in the compute dtype: the default mode's updates wrote them over the gradients; with
  // accumulate_grads, where the parameter chunk was beside the state (the others are copied now).
  const int64_t t0 = now_ns();
  if (options_.accumulate_grads) {
    result.written_back_chunks = write_back_locked(/*after_update=*/true);
  } else {
    model().clear_grad_slots();
    std::fill(landed_.begin(), landed_.end(), 0);
    grads_landed_ = false;
  }
  result.writeback_ns = now_ns() - t0;
  trace::complete("adam", "adam.writeback", t0, t0 + result.writeback_ns);
}

int64_t HybridAdam::write_back_locked(bool after_update) {
  int64_t copied = 0;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    if (!owned(c)) continue;  // sharded: gather_params_locked brings the owner's values
    // The update wrote the new compute-dtype values in its own pass (lowp_target_locked).
    if (after_update && static_cast<int64_t>(lowp_written_.size()) > c && lowp_written_[c]) continue;
    model().store().payload(model().param_chunk(c)).copy_(state_->payload(kMasterRole, c));
    ++copied;
  }
  lowp_written_.clear();
  return copied;
}

void HybridAdam::zero_grad() {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  check_idle("zero_grad()");
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  const bool had = grads_landed_;
  // Note [Update behind the next forward]: updates may still run. With accumulate_grads the zeroing
  // queues behind them (discard_grads_locked), so step(); zero_grad(); keeps the overlap. Default mode:
  // after a step the slots hold values (nothing to restore); gradients of a backward since then are in
  // chunks the forward before it waited for.
  if (!options_.accumulate_grads && grads_landed_) settle_deferred();
  discard_grads_locked();
  if (param_shards_ && !options_.accumulate_grads) {
    // The other ranks' chunks (some holding gradients) are given up; the next use fetches the owners' values.
    param_shards_->release_all();
  } else if (sharded_ && !options_.accumulate_grads) {
    // Slots of non-owned chunks that held gradients get their values from the owners: needed if any rank
    // had gradients (a collective decides, so every rank calls zero_grad() and gathers alike).
    at::Tensor any = at::full({1}, had ? 1.0f : 0.0f, at::kFloat);
    comm_->all_reduce(any, dist::ReduceOp::kMax);
    if (any.item<float>() != 0.0f) gather_params_locked();
  }
}

at::Tensor HybridAdam::state_view(Role role, int64_t param) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  TORCH_CHECK(param >= 0 && param < model().num_params(), "ferry: parameter index ", param, " out of range [0, ",
              model().num_params(), ")");
  settle("state view");
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  return state_->view(role, param).clone();
}

at::Tensor HybridAdam::master(int64_t param) { return state_view(kMasterRole, param); }
at::Tensor HybridAdam::exp_avg(int64_t param) { return state_view(kExpAvgRole, param); }
at::Tensor HybridAdam::exp_avg_sq(int64_t param) { return state_view(kExpAvgSqRole, param); }
at::Tensor HybridAdam::grad(int64_t param) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  if (options_.accumulate_grads) return state_view(kGradRole, param);
  TORCH_CHECK(param >= 0 && param < model().num_params(), "ferry: parameter index ", param, " out of range [0, ",
              model().num_params(), ")");
  settle("grad()");
  std::lock_guard<std::mutex> lock(mutex_);
  if (!model().grad_in_slot(param)) return at::zeros(model().param_shapes()[param], at::kFloat);
  return model().param_values(param).to(at::kCPU, at::kFloat, false, /*copy=*/true);
}

NamedTensors HybridAdam::state_dict() {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  NamedTensors out = model().state_dict();  // checks the model is idle
  if (sharded_) {  // the masters from their owners (a collective: every rank calls state_dict())
    std::lock_guard<std::mutex> lock(mutex_);
    gather_groups_locked(
        at::kFloat, [&](int64_t c) { return state_->payload(kMasterRole, c); },
        [&](int64_t c, const at::Tensor& values) {
          for (int64_t p : model().layout().chunks()[c].tensors) {
            const Slot& slot = model().layout().slots()[p];
            out[p].second = values.slice(0, slot.offset, slot.offset + slot.numel).view(model().param_shapes()[p]).clone();
          }
        });
    return out;
  }
  for (int64_t p = 0; p < model().num_params(); ++p) {
    TORCH_INTERNAL_ASSERT(out[p].first == model().param_name(p));
    out[p].second = master(p).to(at::kCPU);
  }
  return out;
}

void HybridAdam::load_state_dict(const NamedTensors& values) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  settle("load_state_dict()");
  // The model checks every name and shape before it writes anything; then the masters follow.
  model().load_state_dict(values);
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  std::unordered_map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : values) by_name.emplace(name, &t);
  for (int64_t p = 0; p < model().num_params(); ++p) {
    if (!owned(model().layout().slots()[p].chunk)) continue;  // sharded: every rank loads the same values
    state_->view(kMasterRole, p).copy_(*by_name.at(model().param_name(p)));
  }
  std::fill(landed_.begin(), landed_.end(), 0);  // the model's slots hold values again (it cleared them)
  grads_landed_ = false;
  write_back_locked();
  if (param_shards_) param_shards_->release_all();  // the model fetched every chunk to load it
}

void HybridAdam::export_safetensors(const std::string& path) { write_safetensors(path, state_dict(), {{"format", "pt"}}); }

}  // namespace ferry
