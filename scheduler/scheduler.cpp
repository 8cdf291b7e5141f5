// Scheduler (see scheduler.h). Its state lives in four objects, each with its own header: the trace
// (TraceState), the per-moment budget (MomentBudget), the sharded groups' release plan (ReleasePlan)
// and the iteration's counters (IterationMeter); this file runs the passes over them: per use, follow
// or record the trace, set the moment's budget, fetch or release sharded groups, access, prefetch.
#include "scheduler.h"

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>

#include "../common/logging.h"

namespace ferry {

void SchedulerOptions::validate() const {
  TORCH_CHECK(warmup_iterations >= 1, "ferry: warmup_iterations must be >= 1, got ", warmup_iterations);
  TORCH_CHECK(prefetch_depth >= 0, "ferry: prefetch_depth must be >= 0, got ", prefetch_depth);
  TORCH_CHECK(prefetch_window >= 1, "ferry: prefetch_window must be >= 1, got ", prefetch_window);
  TORCH_CHECK(non_model_window >= 1, "ferry: non_model_window must be >= 1, got ", non_model_window);
  TORCH_CHECK(reshard_min_gap >= 0, "ferry: reshard_min_gap must be >= 0, got ", reshard_min_gap);
  TORCH_CHECK(device_budget_bytes >= 0, "ferry: device budget must be >= 0, got ", device_budget_bytes);
  TORCH_CHECK(device_capacity_bytes >= 0, "ferry: device capacity must be >= 0 (0: unknown), got ",
              device_capacity_bytes);
}

namespace {

SchedulerOptions validated(const SchedulerOptions& options) {
  options.validate();
  return options;
}

}  // namespace

Scheduler::Scheduler(ChunkStore& store, std::shared_ptr<OptEvictionPolicy> policy,
                     std::unique_ptr<MemoryProbe> probe, SchedulerOptions options,
                     std::vector<TensorId> tensor_of_param, std::vector<ChunkId> chunk_of_param)
    : store_(&store),
      policy_(std::move(policy)),
      probe_(std::move(probe)),
      options_(validated(options)),
      tensor_of_param_(std::move(tensor_of_param)),
      chunk_of_param_(std::move(chunk_of_param)),
      trace_(options_.warmup_iterations, options_.align_to_trace),
      budget_(DeviceBudget{options_.device_budget_bytes, options_.device_capacity_bytes},
              store.stats().device.budget_bytes),
      releases_(options_.reshard_after_forward, options_.reshard_min_gap) {
  TORCH_CHECK(policy_ && probe_, "ferry: the scheduler needs a policy and a memory probe");
  TORCH_CHECK(tensor_of_param_.size() == chunk_of_param_.size(), "ferry: scheduler maps differ in length");
}

int64_t Scheduler::trace_non_model_peak_locked() const {
  const std::shared_ptr<AccessTrace>& trace = trace_.trace();
  int64_t peak = 0;
  for (int64_t p = 0; trace && p < trace->size(); ++p) peak = std::max(peak, trace->non_model_at(p));
  return peak;
}

void Scheduler::set_remote(std::shared_ptr<RemoteChunks> remote) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_iteration_, "ferry: Scheduler::set_remote() inside an iteration");
  remote_ = std::move(remote);
  // Sharded groups are fetched by collectives in the order of the uses. Aligning keeps every rank on one
  // trace: its matches, skips and hints are functions of the uses and hints alone, which every rank
  // makes alike (Note [Sharded runs align], D108).
  releases_.invalidate();
}

int64_t Scheduler::trace_version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.trace_version();
}

void Scheduler::allow_forward_releases(int64_t version, bool allow) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_iteration_, "ferry: Scheduler::allow_forward_releases() inside an iteration");
  releases_.allow(version, allow);
}

void Scheduler::release_until_locked(int64_t position) {
  if (!remote_ || !trace_.following() || !releases_.allowed(trace_.trace_version())) return;
  releases_.release_until(position, *trace_.trace(), store_->num_chunks(), *remote_);
}

void Scheduler::begin_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_iteration_) return;
  policy_->set_passed_over(trace_.begin_backward());
  release_until_locked(trace_.cursor());
}

void Scheduler::will_not_use(const std::vector<int64_t>& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t p : params) {
    TORCH_CHECK(p >= 0 && p < static_cast<int64_t>(tensor_of_param_.size()), "ferry: will_not_use: parameter index ",
                p, " out of range [0, ", tensor_of_param_.size(), ")");
  }
  if (!in_iteration_ || params.empty()) return;
  // The trace names parameters by their index (TensorId is that index there).
  if (auto over = trace_.pass_over(params)) policy_->set_passed_over(std::move(over));
}

void Scheduler::begin_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(!in_iteration_, "begin_iteration twice");
  in_iteration_ = true;
  releases_.begin_iteration();
  const bool record = trace_.begin_iteration();
  if (record) policy_->set_position(-1);  // LRU while recording
  // Optimizer state placed on the device since, or other chunks updated on the host: the optimal moves
  // at the parameters' new budget, with their round trips, before this iteration is measured against them.
  if (trace_.trace() && (optimal_stale_ || budget_.optimal_stale(store_->device_bytes_elsewhere()))) {
    finalize_trace_locked();
  }
  meter_.begin(trace_.iterations(), record, budget_.optimal_bytes());
  if (record) probe_->begin_iteration();
  meter_.baseline(*store_);
  if (options_.measure_iteration_floor) floor_.begin(*store_, round_trips_);
}

int64_t Scheduler::non_model_now_locked() {
  // Device-resident optimizer state (charged to the shared accountant) is ferry's, not non-model memory.
  return probe_->non_model_bytes(store_->device_accountant().current_bytes());
}

int64_t Scheduler::apply_budget_locked(int64_t position) {
  int64_t non_model = -1;
  if (trace_.following()) {
    // An unforeseen use (-1) sits before the expected position: the reserve covers the one before too.
    const int64_t from = position >= 0 ? position : std::max<int64_t>(0, trace_.cursor() - 1);
    non_model = trace_.trace()->non_model_peak(from, options_.non_model_window + (position >= 0 ? 0 : 1));
  }
  const int64_t budget = budget_.at_moment(non_model, *store_);
  budget_.apply(*store_, budget);
  return budget;
}

void Scheduler::pre_use(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(param >= 0 && param < static_cast<int64_t>(tensor_of_param_.size()), "ferry: parameter index ",
              param, " out of range [0, ", tensor_of_param_.size(), ")");
  // Pass 1: follow the trace (or record it). A use aligned a little ahead or behind moves the position
  // there; one the trace lacks (-1) is served on demand; too many of those give the trace up.
  meter_.count_access();
  const bool following = trace_.following();
  const int64_t position = trace_.use(param, chunk_of_param_[param], in_use_);
  if (following) {
    if (!trace_.following()) {
      meter_.diverged();
      policy_->set_position(-1);
    } else {
      // Unforeseen: OPT plans from the use expected next.
      policy_->set_position(position >= 0 ? position : trace_.cursor());
    }
  }
  // Pass 2: the budget of this moment.
  const int64_t budget = apply_budget_locked(position);
  if (options_.measure_iteration_floor) floor_.use(param, chunk_of_param_[param], in_use_, budget);
  AccessTrace* recording = trace_.recording();
  const int64_t non_model = recording ? non_model_now_locked() : 0;
  // Pass 3: sharded groups given up behind the trace, this one fetched. (Strict while sharded: a
  // position, when following, is this use's index.)
  if (remote_) {
    if (trace_.following() && position >= 0) release_until_locked(position);
    if (remote_->remote(chunk_of_param_[param])) remote_->fetch(chunk_of_param_[param]);
  }
  // Pass 4: the use, then what comes next (after an unforeseen use, the last match's prefetch stands).
  store_->access(tensor_of_param_[param]);
  if (recording) recording->record(param, chunk_of_param_[param], non_model, in_use_);
  in_use_.push_back(param);
  if (trace_.following() && position >= 0) prefetch_locked(position);
}

void Scheduler::prefetch_locked(int64_t position) {
  if (options_.prefetch_depth == 0) return;
  const AccessTrace& trace = *trace_.trace();
  const std::vector<char>* passed_over = trace_.passed_over();
  // Walk the trace run by run (a chunk's consecutive uses are one run): O(depth) per use, not O(window).
  c10::SmallVector<ChunkId, 8> seen = {trace.chunk_at(position)};
  const int64_t end = std::min(trace.size(), position + 1 + options_.prefetch_window);
  for (int64_t q = trace.run_end(position); q < end && static_cast<int>(seen.size()) <= options_.prefetch_depth;
       q = trace.run_end(q)) {
    if (passed_over && trace.run_passed_over(q, *passed_over)) continue;  // a run this backward will not come to
    const ChunkId c = trace.chunk_at(q);
    if (std::find(seen.begin(), seen.end(), c) != seen.end()) continue;
    seen.push_back(c);
    if (remote_ && remote_->remote(c)) {
      // Its group's gather first (which waits for this rank's own member's update: the send guard), then
      // that member, if it is this rank's and on the host, moved in too. (Before D108 the move waited for
      // the use; at N > 1 most of the uses' moves were then on demand.)
      remote_->prefetch(c);
      if (store_->location(c) == Location::kHost && store_->prefetch(c)) meter_.count_prefetch();
      continue;
    }
    if (store_->location(c) == Location::kDevice) continue;
    if (store_->prefetch(c)) meter_.count_prefetch();
  }
}

void Scheduler::post_use(int64_t param, TensorState after) {
  std::lock_guard<std::mutex> lock(mutex_);
  store_->release(tensor_of_param_[param], after);
  const auto it = std::find(in_use_.begin(), in_use_.end(), param);
  if (it != in_use_.end()) in_use_.erase(it);
}

IterationStats Scheduler::end_iteration(bool aborted, bool forward_only) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(in_iteration_, "end_iteration without begin_iteration");
  in_iteration_ = false;
  for (TensorId t : tensor_of_param_) {
    const TensorState s = store_->tensor_info(t).state;
    if (s == TensorState::kHoldAfterFwd || s == TensorState::kHoldAfterBwd) store_->set_state(t, TensorState::kHold);
  }
  const TraceState::IterationEnd end = trace_.end_iteration(aborted, forward_only);
  meter_.departures(end.skipped, end.unforeseen, end.merged, end.hinted, end.hints_broken);
  if (options_.measure_iteration_floor && !aborted) meter_.floor(floor_.end(*store_));
  const IterationStats stats = meter_.end(store_->stats(), aborted, forward_only);
  policy_->set_passed_over(nullptr);
  if (end.adopted) finalize_trace_locked();
  policy_->set_position(-1);
  budget_.apply(*store_, budget_.chunk_budget(*store_));
  return stats;
}

void Scheduler::finalize_trace_locked() {
  AccessTrace& trace = *trace_.trace();
  trace.remap_chunks(chunk_of_param_);
  trace.finalize(store_->num_chunks());
  std::vector<int64_t> bytes(store_->num_chunks());
  int64_t largest = 0;
  for (ChunkId c = 0; c < store_->num_chunks(); ++c) {
    bytes[c] = store_->chunk_info(c).nbytes;
    largest = std::max(largest, bytes[c]);
  }
  budget_.set_largest_chunk(largest);
  // Flags of another chunk count (told before a relayout the optimizer has not followed yet): none.
  if (round_trips_.size() != bytes.size()) round_trips_.clear();
  budget_.set_optimal(
      belady_moves(trace, bytes, budget_.at_moment(trace_non_model_peak_locked(), *store_), round_trips_).total(),
      store_->device_bytes_elsewhere());
  optimal_stale_ = false;
  policy_->set_round_trips(round_trips_);
  policy_->set_trace(trace_.trace());
  releases_.invalidate();
}

bool Scheduler::repack_wanted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.repack_wanted();
}

void Scheduler::relayout(ChunkStore& store, std::vector<TensorId> tensor_of_param, std::vector<ChunkId> chunk_of_param) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(!in_iteration_, "relayout inside an iteration");
  TORCH_CHECK(!remote_, "ferry: the parameters cannot be repacked while they are sharded across ranks");
  store_ = &store;
  budget_.store_replaced(store_->stats().device.budget_bytes);
  tensor_of_param_ = std::move(tensor_of_param);
  chunk_of_param_ = std::move(chunk_of_param);
  round_trips_.clear();  // of the old chunks
  meter_.store_replaced();
  trace_.repacked();
  if (trace_.trace()) finalize_trace_locked();
}

void Scheduler::set_round_trips(std::vector<char> chunks) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (chunks == round_trips_) return;
  round_trips_ = std::move(chunks);
  optimal_stale_ = true;  // recomputed when the next iteration begins
}

void Scheduler::admit_device_bytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_iteration_, "ferry: admit_device_bytes() inside an iteration");
  const int64_t left = budget_.admitting(bytes, *store_);
  // Evicts parameter chunks down to it; throws, changing nothing, if it can't.
  if (left > 0) budget_.apply(*store_, left);
}

int64_t Scheduler::other_device_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return store_->device_bytes_elsewhere();
}

bool Scheduler::trace_is_forward_only() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.trace_is_forward_only();
}

int64_t Scheduler::device_room_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return budget_.room_at_worst(trace_non_model_peak_locked());
}

int64_t Scheduler::non_model_peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.trace() ? trace_non_model_peak_locked() : -1;
}

void Scheduler::retrace() {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_.retrace();
}

bool Scheduler::following_trace() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.following();
}

std::shared_ptr<const AccessTrace> Scheduler::trace() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.trace();
}

IterationStats Scheduler::last_iteration() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return meter_.last();
}

int64_t Scheduler::iterations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.iterations();
}

}  // namespace ferry
