// Scheduler (see scheduler.h).
#include "scheduler.h"

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <unordered_set>

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

double IterationStats::moved_over_optimal() const {
  if (optimal_bytes < 0) return -1.0;
  const int64_t moved = h2d_bytes + d2h_bytes;
  if (optimal_bytes == 0) return moved == 0 ? 1.0 : -1.0;
  return static_cast<double>(moved) / static_cast<double>(optimal_bytes);
}

Scheduler::Scheduler(ChunkStore& store, std::shared_ptr<OptEvictionPolicy> policy,
                     std::unique_ptr<MemoryProbe> probe, SchedulerOptions options,
                     std::vector<TensorId> tensor_of_param, std::vector<ChunkId> chunk_of_param)
    : store_(&store),
      policy_(std::move(policy)),
      probe_(std::move(probe)),
      options_(options),
      tensor_of_param_(std::move(tensor_of_param)),
      chunk_of_param_(std::move(chunk_of_param)) {
  options_.validate();
  TORCH_CHECK(policy_ && probe_, "ferry: the scheduler needs a policy and a memory probe");
  TORCH_CHECK(tensor_of_param_.size() == chunk_of_param_.size(), "ferry: scheduler maps differ in length");
  store_budget_ = store_->stats().device.budget_bytes;
}

void Scheduler::set_store_budget_locked(int64_t bytes) {
  if (bytes == store_budget_) return;  // the usual case on the per-use path: no store call
  store_->set_device_budget(bytes);
  store_budget_ = bytes;
}

int64_t Scheduler::trace_non_model_peak_locked() const {
  int64_t peak = 0;
  for (int64_t p = 0; trace_ && p < trace_->size(); ++p) peak = std::max(peak, trace_->non_model_at(p));
  return peak;
}

void Scheduler::set_remote(std::shared_ptr<RemoteChunks> remote) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_iteration_, "ferry: Scheduler::set_remote() inside an iteration");
  remote_ = std::move(remote);
  releases_planned_ = false;
}

int64_t Scheduler::trace_version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_version_;
}

void Scheduler::allow_forward_releases(int64_t version, bool allow) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_iteration_, "ferry: Scheduler::allow_forward_releases() inside an iteration");
  releases_allowed_for_ = allow ? version : -1;
}

void Scheduler::plan_releases_locked() {
  // Per group: its last forward position and its next use after it; released at the first position after
  // the last forward use when that next use is far enough. Every rank computes the same from the same trace.
  releases_planned_ = true;
  release_at_.assign(trace_->size() + 1, {});
  if (!remote_ || !options_.reshard_after_forward) return;
  const int64_t start = trace_->backward_start(), n = trace_->size();
  std::vector<int64_t> last_forward(store_->num_chunks(), -1);  // per chunk, then per group (its first member)
  for (int64_t q = 0; q < start; ++q) last_forward[trace_->chunk_at(q)] = q;
  std::vector<ChunkId> leader(store_->num_chunks(), -1);  // each chunk's group, named by its first member
  for (ChunkId c = 0; c < store_->num_chunks(); ++c) {
    if (leader[c] >= 0 || last_forward[c] < 0) continue;
    const std::vector<ChunkId> members = remote_->group(c);
    for (ChunkId m : members) leader[m] = members.front();
    for (ChunkId m : members) last_forward[members.front()] = std::max(last_forward[members.front()], last_forward[m]);
  }
  std::vector<int64_t> next(store_->num_chunks(), AccessTrace::kNever);  // per group: first use after its forward
  for (int64_t q = n - 1; q >= 0; --q) {
    const ChunkId g = leader[trace_->chunk_at(q)];
    if (g >= 0 && q > last_forward[g]) next[g] = q;
  }
  for (ChunkId g = 0; g < store_->num_chunks(); ++g) {
    if (leader[g] != g) continue;
    // A group with no later use is kept: its gradients land in its chunks at the end of backward, which
    // would fetch it again just for that.
    const int64_t at = last_forward[g] + 1;
    if (next[g] != AccessTrace::kNever && next[g] - at >= options_.reshard_min_gap) release_at_[at].push_back(g);
  }
}

void Scheduler::release_until_locked(int64_t position) {
  if (!remote_ || !trace_ || recording_ || diverged_ || releases_allowed_for_ != trace_version_) return;
  if (!releases_planned_) plan_releases_locked();
  for (; released_upto_ <= std::min<int64_t>(position, trace_->size()); ++released_upto_) {
    for (ChunkId c : release_at_[released_upto_]) remote_->release(c);
  }
}

void Scheduler::begin_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_iteration_) return;
  if (recording_) recording_->mark_backward_start();
  release_until_locked(position_);
}

void Scheduler::begin_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(!in_iteration_, "begin_iteration twice");
  in_iteration_ = true;
  diverged_ = false;
  position_ = 0;
  released_upto_ = 0;
  current_ = IterationStats{};
  current_.index = iteration_;
  const bool record = !trace_ || retrace_next_ || warmups_done_ < options_.warmup_iterations;
  if (record) {
    recording_ = std::make_shared<AccessTrace>();
    policy_->set_position(-1);  // LRU while recording
    current_.traced = true;
  } else {
    recording_.reset();
  }
  current_.optimal_bytes = optimal_bytes_;
  if (record) probe_->begin_iteration();
  // Optimizer state placed on the device since: the optimal moves at the parameters' new budget.
  if (trace_ && store_->device_bytes_elsewhere() != optimal_for_others_) finalize_trace_locked();
  at_begin_ = store_->stats();
  store_->reset_peak_stats();
}

int64_t Scheduler::non_model_now_locked() {
  // Device-resident optimizer state (charged to the shared accountant) is ferry's, not non-model memory.
  return probe_->non_model_bytes(store_->device_accountant().current_bytes());
}

int64_t Scheduler::moment_budget_locked(int64_t non_model) {
  const int64_t budget = chunk_budget_locked();
  if (options_.device_capacity_bytes == 0 || non_model < 0) return budget;
  const int64_t others = store_->device_bytes_elsewhere();
  int64_t room = options_.device_capacity_bytes - others - non_model;
  if (room < largest_chunk_bytes_) {
    log::warn_once("scheduler-capacity",
                   "ferry scheduler: non-model memory of " + format_bytes(non_model) + " leaves " +
                       format_bytes(std::max<int64_t>(0, room)) + " of the device's " +
                       format_bytes(options_.device_capacity_bytes) + " (" + format_bytes(others) +
                       " of optimizer state) for parameter chunks, less than the largest chunk (" +
                       format_bytes(largest_chunk_bytes_) + "); keeping room for one chunk. The device may run "
                       "out of memory: use activation checkpointing, a smaller batch or smaller chunks.");
    room = largest_chunk_bytes_;
  }
  return budget == 0 ? room : std::min(budget, room);
}

void Scheduler::apply_budget_locked(int64_t position) {
  const bool following = trace_ && !recording_ && !diverged_;
  const int64_t budget =
      moment_budget_locked(following ? trace_->non_model_peak(position, options_.non_model_window) : -1);
  set_store_budget_locked(budget);
}

void Scheduler::pre_use(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(param >= 0 && param < static_cast<int64_t>(tensor_of_param_.size()), "ferry: parameter index ",
              param, " out of range [0, ", tensor_of_param_.size(), ")");
  const int64_t position = position_++;
  ++current_.accesses;
  const bool following = trace_ && !recording_ && !diverged_;
  if (following) {
    if (position >= trace_->size() || trace_->tensor_at(position) != param) {
      diverged_ = true;
      current_.diverged = true;
      retrace_next_ = true;
      policy_->set_position(-1);
      if (trace_forward_only_) {
        // Not a surprise: the trace came from an evaluation iteration (no backward), this one trains.
        log::info("ferry scheduler: the trace was recorded by a forward-only (evaluation) iteration; this "
                  "iteration has a backward, so the next one is traced as a training iteration");
      } else {
        log::warn_once("scheduler-diverged",
                       "ferry scheduler: the parameter access order differs from the recorded trace at position " +
                           std::to_string(position) + " (expected parameter " +
                           (position < trace_->size() ? std::to_string(trace_->tensor_at(position))
                                                      : std::string("none: the trace ended")) +
                           ", got parameter " + std::to_string(param) +
                           "); evicting by LRU for the rest of this iteration and re-tracing the next one. "
                           "Conditional branches, changed shapes or a different loss cause this.");
      }
    } else {
      policy_->set_position(position);
    }
  }
  apply_budget_locked(position);
  const int64_t non_model = recording_ ? non_model_now_locked() : 0;
  if (remote_) {
    if (following && !diverged_) release_until_locked(position);
    if (remote_->remote(chunk_of_param_[param])) remote_->fetch(chunk_of_param_[param]);
  }
  store_->access(tensor_of_param_[param]);
  if (recording_) recording_->record(param, chunk_of_param_[param], non_model);
  if (following && !diverged_) prefetch_locked(position);
}

void Scheduler::prefetch_locked(int64_t position) {
  if (options_.prefetch_depth == 0) return;
  // Walk the trace run by run (a chunk's consecutive uses are one run): O(depth) per use, not O(window).
  c10::SmallVector<ChunkId, 8> seen = {trace_->chunk_at(position)};
  const int64_t end = std::min(trace_->size(), position + 1 + options_.prefetch_window);
  for (int64_t q = trace_->run_end(position); q < end && static_cast<int>(seen.size()) <= options_.prefetch_depth;
       q = trace_->run_end(q)) {
    const ChunkId c = trace_->chunk_at(q);
    if (std::find(seen.begin(), seen.end(), c) != seen.end()) continue;
    seen.push_back(c);
    if (remote_ && remote_->remote(c)) {  // its group's gather first; the move follows at its use
      remote_->prefetch(c);
      continue;
    }
    if (store_->location(c) == Location::kDevice) continue;
    if (store_->prefetch(c)) ++current_.prefetches;
  }
}

void Scheduler::post_use(int64_t param, TensorState after) {
  std::lock_guard<std::mutex> lock(mutex_);
  store_->release(tensor_of_param_[param], after);
}

IterationStats Scheduler::end_iteration(bool aborted, bool forward_only) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(in_iteration_, "end_iteration without begin_iteration");
  in_iteration_ = false;
  for (TensorId t : tensor_of_param_) {
    const TensorState s = store_->tensor_info(t).state;
    if (s == TensorState::kHoldAfterFwd || s == TensorState::kHoldAfterBwd) store_->set_state(t, TensorState::kHold);
  }
  const ChunkStoreStats now = store_->stats();
  current_.h2d_bytes = now.moves.h2d_bytes - at_begin_.moves.h2d_bytes;
  current_.d2h_bytes = now.moves.d2h_bytes - at_begin_.moves.d2h_bytes;
  current_.evictions = now.moves.evictions - at_begin_.moves.evictions;
  current_.wait_ns = now.moves.wait_ns - at_begin_.moves.wait_ns;
  current_.device_peak_bytes = now.device.peak_bytes;
  current_.working_set_peak_bytes = now.compute_peak_bytes;
  current_.aborted = aborted;
  current_.forward_only = forward_only;
  // A forward-only (evaluation) recording never replaces a training trace: evaluation between training
  // steps would otherwise flip the trace back and forth. It is used only while there is no other.
  const bool keep = recording_ && !aborted && (!forward_only || !trace_ || trace_forward_only_);
  if (recording_ && !aborted && !keep) {
    log::debug("ferry scheduler: an evaluation iteration was not used as the trace (a training trace exists)");
  }
  if (keep) {
    trace_forward_only_ = forward_only;
    if (trace_ && retrace_next_) log::info("ferry scheduler: re-traced (", recording_->size(), " accesses)");
    trace_ = recording_;
    ++trace_version_;
    retrace_next_ = false;
    ++warmups_done_;
    if (warmups_done_ >= options_.warmup_iterations) {
      finalize_trace_locked();
      if (warmups_done_ == options_.warmup_iterations) repack_wanted_ = true;
    } else {
      trace_.reset();  // more warm-up to record
    }
  }
  recording_.reset();
  policy_->set_position(-1);
  set_store_budget_locked(chunk_budget_locked());
  ++iteration_;
  last_ = current_;
  return current_;
}

void Scheduler::finalize_trace_locked() {
  trace_->remap_chunks(chunk_of_param_);
  trace_->finalize(store_->num_chunks());
  std::vector<int64_t> bytes(store_->num_chunks());
  largest_chunk_bytes_ = 0;
  for (ChunkId c = 0; c < store_->num_chunks(); ++c) {
    bytes[c] = store_->chunk_info(c).nbytes;
    largest_chunk_bytes_ = std::max(largest_chunk_bytes_, bytes[c]);
  }
  optimal_bytes_ = belady_moves(*trace_, bytes, moment_budget_locked(trace_non_model_peak_locked())).total();
  optimal_for_others_ = store_->device_bytes_elsewhere();
  policy_->set_trace(trace_);
  releases_planned_ = false;
}

bool Scheduler::repack_wanted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return repack_wanted_;
}

void Scheduler::relayout(ChunkStore& store, std::vector<TensorId> tensor_of_param, std::vector<ChunkId> chunk_of_param) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(!in_iteration_, "relayout inside an iteration");
  TORCH_CHECK(!remote_, "ferry: the parameters cannot be repacked while they are sharded across ranks");
  store_ = &store;
  store_budget_ = store_->stats().device.budget_bytes;
  tensor_of_param_ = std::move(tensor_of_param);
  chunk_of_param_ = std::move(chunk_of_param);
  repack_wanted_ = false;
  if (trace_) finalize_trace_locked();
}

int64_t Scheduler::chunk_budget_locked() const {
  if (options_.device_budget_bytes == 0) return 0;
  // The budget covers every store charging the device accountant: the parameter chunks get what the
  // others (device-resident optimizer state) leave.
  return std::max<int64_t>(1, options_.device_budget_bytes - store_->device_bytes_elsewhere());
}

void Scheduler::admit_device_bytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_iteration_, "ferry: admit_device_bytes() inside an iteration");
  TORCH_CHECK(bytes >= 0, "ferry: admitted device bytes must be >= 0, got ", bytes);
  if (options_.device_budget_bytes == 0) return;
  const int64_t others = store_->device_bytes_elsewhere();
  const int64_t left = options_.device_budget_bytes - others - bytes;
  TORCH_CHECK(left >= std::max<int64_t>(1, largest_chunk_bytes_), "ferry: ", format_bytes(bytes),
              " more device bytes for optimizer state (", format_bytes(others), " there already) of a device budget of ",
              format_bytes(options_.device_budget_bytes), " would leave ", format_bytes(std::max<int64_t>(0, left)),
              " for parameter chunks, less than the largest chunk (", format_bytes(largest_chunk_bytes_), ")");
  set_store_budget_locked(left);  // evicts parameter chunks down to it; throws, changing nothing, if it can't
}

int64_t Scheduler::other_device_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return store_->device_bytes_elsewhere();
}

bool Scheduler::trace_is_forward_only() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_ && trace_forward_only_;
}

int64_t Scheduler::device_room_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t budget = options_.device_budget_bytes;
  if (options_.device_capacity_bytes == 0) return budget;
  const int64_t room = std::max<int64_t>(0, options_.device_capacity_bytes - trace_non_model_peak_locked());
  return budget == 0 ? room : std::min(budget, room);
}

int64_t Scheduler::non_model_peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_ ? trace_non_model_peak_locked() : -1;
}

bool Scheduler::following_trace() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_ && !recording_ && !diverged_;
}

std::shared_ptr<const AccessTrace> Scheduler::trace() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_;
}

IterationStats Scheduler::last_iteration() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_;
}

int64_t Scheduler::iterations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return iteration_;
}

}  // namespace ferry
