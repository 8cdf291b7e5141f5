#pragma once
// HybridAdam: Adam/AdamW over a ChunkedModel's parameters with the optimizer state in chunks, each
// chunk updated where it lives — on the device (device_adam_update) or on the host (CpuAdam), by the
// same per-element function, so with the same bits (D53).
//
//   ferry::ChunkedModel model(net, config);
//   ferry::HybridAdam adam(model);   // as torch::optim::AdamW(params): lr 1e-3, weight decay 1e-2 on all
//   // or, GPT-style, no decay for biases and norm weights:
//   //   ferry::AdamOptions o; o.lr = 3e-4; o.weight_decay = 0.1;
//   //   ferry::HybridAdam adam(model, ferry::HybridAdamOptions::no_decay_for_bias_and_norm(o));
//   for (...) {
//     auto loss = model.forward([&] { return criterion(net->forward(x), y); });
//     adam.backward_step(loss);          // backward + step, pipelined per chunk (Note [Pipelined step])
//   }
// or, unpipelined, as with torch's optimizers:
//     model.backward(loss);              // each grad lands in its parameter's chunk slot; .grad stays undefined
//     adam.step();                       // clip, unscale, update, write compute-dtype params back
//     adam.zero_grad();                  // (a no-op after step() unless accumulate_grads)
//
// One HybridAdam per model, destroyed before it: a model destroyed first tells it (model_gone) and it
// refuses every call from then on.
//
// State: per layout chunk of the model, a group of three fp32 chunks mirroring it (master params,
// exp_avg and exp_avg_sq), living together on the device or the host: a StateChunks
// (chunk/state_chunks.h) that the model makes and migrates with its repacks. Gradients cost no
// memory of their own: each lands in its parameter's slot of the parameter chunk once autograd has
// accumulated it (Note [Gradient in the parameter slot], hooks/chunked_model.h), travels with that
// chunk, is read there by the update, which writes the new compute-dtype value into the same place.
// Bytes per parameter, host and device together: compute copy 2 (bf16/fp16) or 4 (fp32) + 12 of
// state, plus packing waste. With accumulate_grads (micro-batches), a fourth fp32 chunk per layout
// chunk accumulates the gradients across backward passes instead (+4 B/param), and the parameters
// keep their values between backward passes.
//
// Placement: until the model's warm-up has finished, all state is on the host. At the first step()
// after it, HybridAdam takes the margin = device budget - peak non-model bytes - all parameter chunk
// bytes (0 when parameters do not all fit) and moves as many state chunk groups to the device as fit
// there, the first layout chunks first (Note [Which state goes to the device]). The scheduler first
// evicts parameter chunks to admit those bytes (Scheduler::admit_device_bytes), and the state store
// charges the model's DeviceAccountant, so parameters + state stay within the one device budget. Device budget 0 means no
// limit (everything on the device). `device_state_chunks` overrides the count.
//
// A step (step()):
//  1. Per chunk, the grad norm and finiteness (device: one reduction each, one host sync for all;
//     host: CpuAdam::grad_norm_sq). A non-finite grad anywhere, or a chunk's norm that overflows (D70),
//     skips the step: nothing is written, the loss scaler (fp16) backs off, step counts stay.
//  2. coef = clip coefficient (max_grad_norm / (norm + 1e-6), at most 1, as clip_grad_norm_) / loss scale.
//  3. Each group's step count advances; every parameter that received a gradient since the last
//     step is updated with it scaled by coef (one that received none is left alone, as torch's
//     optimizers skip a parameter whose .grad is undefined), with the bias corrections of its own
//     step count, its number of updates (D62).
//  4. The updated fp32 masters are written into the parameter chunks in the compute dtype, by the
//     update in its own pass (host or device kernel; with accumulate_grads where the parameter chunk is
//     where the state is, else by a copy after it).
//     Host updates may still run when step() returns: Note [Update behind the next forward].
//  Without accumulate_grads, the parameter chunk of a host-state chunk moves to the host for the
//  update and that of a device-state chunk to the device (each where its state is).
//
// Note [Accumulation per chunk]
// With accumulate_grads on one process, a micro-batch's gradients land in the parameter slots as in
// the default mode (Note [Gradient in the parameter slot]). When a layout chunk has had as many
// landings and uses as earlier backwards (the first backward: when it ends; Note [Expectations only
// grow] in hybrid_adam.cpp), its slots are emptied into
// the chunk's fp32 accumulation chunk and get their values back, round(master) (the invariant between
// steps): for device-state chunks with two ops on the compute stream; for host-state chunks by one
// transfer of the whole chunk to the host on the copy stream and an add on CpuAdam's worker, while
// backward goes on. The per-parameter add it replaces copied each gradient to the host synchronously
// on autograd's thread. backward() waits for the last jobs before it returns, so the next forward reads
// values; backward_step of the last micro-batch runs each host chunk's norm and update in the job of
// its add, the update writing the new values into the slots (with clipping or loss scaling: the norm
// only, the update waiting for the global norm).
// A landing a chunk did not have in the previous backward, after it was emptied, waits for its job
// and the chunk is emptied again at the end (under backward_step once the update started: a parameter
// the update left alone is updated after backward, Note [A gradient after its chunk's update]; a norm
// taken already is taken again by the step). A
// gradient that reached its parameter twice in one backward is summed in the slot in the compute
// dtype, as in the default mode.
// At N > 1 the same, with one difference: a chunk another rank owns has no master here, so its slots
// cannot get their values back. They are emptied into this rank's accumulation chunk (which every rank
// keeps for every chunk: its own micro-batches) and left holding gradients, and when backward ends the
// values come back from their owners, the same way on every rank whatever it landed (collectives pair
// up): sharded parameters (ParamShards) give every gathered group up, so the next use gathers it again;
// replicated ones are all-gathered at once. (backward_step skips that: its step writes new values.)
// Cost against the per-parameter add it replaces (one synchronous device->host copy per gradient on
// autograd's thread): every micro-batch but the one the step follows gathers the parameters once more,
// (N-1)/N x the parameter bytes per rank, in either mode (sharded: the next forward gathers every
// group, where before a group kept from backward was still there).

// Note [Pipelined step]
// backward_step(loss) runs backward and the optimizer step as one pipeline over the layout chunks.
// A chunk is final in backward when each of its parameters has had the most gradient landings earlier
// backward_steps had, and the most uses earlier backwards had (a frozen weight may carry the gradient
// after its chunk's landings: Note [A chunk final before its last use] and Note [Expectations only
// grow], hybrid_adam.cpp; the first call, and a call right after a repack or placement change, only
// record them and run unpipelined). When a chunk becomes final, on autograd's thread:
//  - host state: its parameter chunk (holding the gradients) starts its move to the host on the copy
//    stream, one transfer per chunk, and is locked there (ChunkStore::lock_on_host); a job on CpuAdam's
//    worker waits for that copy, computes the chunk's gradient norm and, unless the step needs every
//    gradient first, runs the host Adam, writing the new compute-dtype values over the gradients. The
//    chunk stays on the host until the next forward brings it back (prefetched from the trace).
//  - device state: its parameter chunk is brought to the device if evicted (no host stall), its
//    norm is reduced on the device (no host sync) and the device Adam runs on the compute stream, told
//    to skip by a device flag if the chunk's gradients are not finite.
// The jobs are awaited when backward ends (before the model may repack). Then one host sync reads every
// device norm, chunks that did not become final run as step() runs them, and the result is reported.
// A gradient that lands after its chunk became final (a layer no earlier backward reached) is taken:
// Note [A gradient after its chunk's update] (hybrid_adam.cpp).
// No host synchronization per parameter or per chunk on the training thread: the per-chunk waits
// happen on the worker (ChunkStore's MoveStats count both).
//  - Without clipping and loss scaling ("eager"): the updates are those of backward() + step(), bit for
//    bit (same kernels, same gradients, same order per chunk). A non-finite gradient skips that chunk
//    only (its values are restored from the masters; the others are updated, and the result reports the
//    overflow): all-or-nothing would need every gradient before the first update.
//  - With global-norm clipping or fp16 loss scaling, which need every gradient first: during backward
//    only the transfers and the per-chunk norms run; after backward the norm (one scalar) gives the
//    clip coefficient and the overflow decision, then every chunk is updated as step() would, bit for
//    bit. Cost against eager: the host Adam is no longer hidden behind backward (it runs after it,
//    beside the next forward: Note [Update behind the next forward]), while the gradients' transfers
//    still are.
//
// Note [Update behind the next forward]
// The host updates that run after backward (all of them in step(); in backward_step those of the
// two-phase step, with clipping or fp16 loss scaling, which need the global norm first) need not be
// done when the call returns: nothing reads a parameter before the next forward uses it. With
// HybridAdamOptions::update_behind_forward (the default) the call queues each host-state
// chunk's update on CpuAdam's worker in layout order, the order of forward after the warm-up repack,
// with its parameter chunk locked on the host, the grad scale and each group's options and step count
// frozen (a set_lr() before the next forward does not reach it), and returns. Then:
//  - the next forward runs while they do: ChunkedModel calls await_param before every use, which waits
//    for that chunk's update only; the scheduler's prefetch of a chunk still locked fails and is tried
//    again at the next use;
//  - everything else that reads or writes parameters or state waits for all of them first: step(),
//    backward_step(), the state views, save(), load(), state_dict(), param_values(), materialize(), the
//    end of an iteration (a chunk the forward did not use), the destructor; synchronize() explicitly;
//  - ops on the thread that called the step (reading or writing a parameter, an eval forward outside
//    model.forward()) wait for the update of the chunk they use (Note [Ops outside the scopes],
//    hooks/interceptor.h): the thread watches until its first op after every update is done;
//  - zero_grad() with accumulate_grads queues the zeroing of such a chunk's accumulation behind its
//    update on the same worker, so step(); zero_grad(); keeps the overlap;
//  - at N > 1 only with sharded parameters (shard_params, the default; replicated ones are gathered by
//    the step itself): a group's gather, a collective, reads this rank's member only once its update
//    has written it (ParamShards' send guard, which calls await_chunk), a prefetch's gather included.
// Exact: the same kernel, spans, grad scale and step count as the update on the calling thread, so
// the same bits. What it saves: after backward the host Adam (A) and the next forward (F) ran one after
// the other; now forward runs beside A (the device-state chunks come first in forward, D51, and the
// host-state ones are ready in the order forward needs them), so the two take about max(A, F). The
// eager step needs none of it (its updates run during backward, D52); the parameter chunks a step
// with accumulate_grads finds on the device keep the update on the calling thread (and the copy after).
// An error in such an update surfaces at the next wait (the forward that needs the chunk, or any of
// the calls above), logged with the chunk; that chunk may be partly updated.
//
// Contract
//  - step(), zero_grad(), save(), load() and the state views are for between iterations (the model
//    idle); gradients land during backward on autograd's thread.
//  - step() needs gradients landed since the last step/zero_grad(); otherwise it fails and changes
//    nothing.
//  - Without accumulate_grads (the default), step() consumes the gradients (applied or skipped, the
//    parameters hold their values again afterwards), and the model must not be used between
//    backward() and step() (it fails, naming the parameter). zero_grad() discards unconsumed ones.
//  - With accumulate_grads, gradients accumulate across backward() calls until zero_grad() (scale each
//    micro-batch's loss by 1/N yourself), and step() leaves them as they were landed.
//  - step() and backward_step() may return with host updates still running (Note [Update behind the
//    next forward]); everything that reads parameters or state through ferry waits for them, as do
//    ops on the calling thread, and synchronize() does explicitly: another thread that reads the
//    parameters, or a read that is no op (data_ptr()), calls it first. fork() only after synchronize().
//  - The model's parameters must not be changed by others while a HybridAdam holds it: the masters are
//    the truth, and every step overwrites the parameter chunks from them.
//  - The HybridAdam must not outlive the ChunkedModel.
//
// Note [Sharded optimizer state]
// With a communicator of N > 1 ranks (HybridAdamOptions::communicator), every rank runs the same model
// on its own batch, and the optimizer state exists once across the ranks. The layout chunks form
// groups of N consecutive chunks; rank r owns member r of each group (chunk c belongs to rank c mod N).
//  - Construction: rank 0's initial values are broadcast (masters, then the parameter chunks), so every
//    rank starts from the same point.
//  - The first step (after warm-up, when the call-order repack is behind us) shards: a rank frees the
//    master chunks it does not own and never allocates their exp_avg/exp_avg_sq (the moments get memory
//    when first touched, D46; with accumulate_grads, the fp32 gradient chunks stay on every rank: each
//    accumulates its own micro-batches). Ranks check they have the same layout.
//  - A step (step()): per group, one reduce-scatter sums every rank's gradients into the owner's chunk,
//    with one 0/1 per tensor beside them, so the owner also learns which tensors landed on any rank
//    (a rank may not have used one) and updates exactly those; the owner takes the norm of its chunks, one all-reduce
//    totals it (and the non-finite count), so clipping and fp16 overflow decide alike everywhere; the
//    owners update their chunks (gradients scaled by 1/N: the mean over the concatenated batch); the
//    other ranks get the new values by the next gather (sharded parameters, below) or, replicated, by
//    one all-gather per group now. Bytes each rank sends per step: 2 (N-1)/N x the parameter chunk
//    bytes, the ring minimum for a full update of all parameters (+ (N-1)/N x 4 B/param for the
//    reduce-scatter of fp32 accumulation chunks instead; + one more gather of the groups given up
//    after forward).
//  - backward_step() pipelines this (eager: no clipping, loss scaling or accumulation): when all chunks of
//    a group are final in backward, its reduce-scatter starts (async, on Gloo's threads) and the owner's
//    host Adam runs on CpuAdam's worker as soon as the sums arrive, while autograd goes on; device-state
//    chunks follow backward. Groups complete in the same order on every rank only if
//    every rank expects the same landings: checked after each call (one all-reduce of a hash); if not,
//    the next call runs backward + step(). Same sums in the same order as step(): the same result.
//  - Every collective is in the same order on every rank; zero_grad() in default mode must be called by
//    every rank (replicated parameters: it all-gathers the owners' values; sharded: it gives the
//    other ranks' chunks up).
//  - Parameters (shard_params, the default): the compute copy is sharded with the same ownership
//    (Note [Sharded parameters] below); then no all-gather follows the step: the owners write their
//    chunks, the other ranks give theirs up once the gradients are reduced, and fetch them again before
//    their next use. Without shard_params every rank keeps every parameter chunk and a step ends with
//    one all-gather per group.
//  - Memory per rank: 12/N B/param of state; parameter chunks: 1/N between steps (shard_params) or all;
//    collectives stage one group (N chunks) at a time.
//  - Views of state this rank does not hold (master(), exp_avg()...) fail, naming the chunk group;
//    state_dict() gathers the masters. save() at N > 1 (a collective) writes the same checkpoint as one
//    process: every rank writes its own parameters' state at their offsets in the same files, rank 0
//    checks each rank's part by its CRC and publishes the manifest; load() at any world size reads it
//    (every rank must see the directory), each rank taking the state it holds.
//
// Note [Sharded parameters]
// (dist/param_shards.h, D45.) Rank r keeps the parameter chunks of its groups' member r between steps;
// the others are remote (no payload). The first use of a chunk in an iteration makes every rank join one
// all-gather of its group (the scheduler starts it ahead of the use from the trace, like a prefetch), so
// all of a group's chunks land in host payloads on every rank and move to the device as usual; they stay
// (evictable to the host) until the step's reduce-scatter has sent their gradients to the owners, then
// they are given up. Per step each parameter byte is gathered once and reduced once: 2 (N-1)/N x the
// parameter bytes per rank, the floor. The price: during forward and backward a rank holds the whole
// compute copy (on the host beyond the device budget); releasing groups after their last forward use
// would cap that at the groups in use, for one more all-gather per step (D45).
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../chunk/chunk_store.h"
#include "../cpu_adam/adam_options.h"
#include "../cpu_adam/cpu_adam.h"
#include "../dist/communicator.h"
#include "../dist/param_shards.h"
#include "../hooks/chunked_model.h"
#include "loss_scaler.h"

namespace ferry {

// Parameters whose (name, tensor) `match` returns true go into a group with `options`.
struct ParamGroupRule {
  std::function<bool(const std::string& name, const at::Tensor& param)> match;
  AdamOptions options;
};

struct HybridAdamOptions {
  HybridAdamOptions() = default;
  // One group with `defaults`: HybridAdam(model, ferry::AdamOptions().with_lr(3e-4)).
  HybridAdamOptions(const AdamOptions& defaults) : defaults(defaults) {}  // NOLINT: implicit on purpose

  AdamOptions defaults;                 // group 0: every parameter no rule matched
  std::vector<ParamGroupRule> groups;   // groups 1.. in order; the first matching rule wins
  double max_grad_norm = 0.0;           // global L2 clipping (0: none)
  LossScalerOptions loss_scaler;        // used when the model's precision is fp16
  int64_t device_state_chunks = -1;     // -1: as many as fit after warm-up; else this many (at most all)
  // Keep fp32 gradient chunks that accumulate across backward() calls (micro-batches). Off: gradients
  // live in the parameter chunks (Note [Gradient in the parameter slot]) and cost no memory.
  bool accumulate_grads = false;
  // Data parallelism over the ranks of this communicator (dist::connect; null or world size 1: one
  // process). Note [Sharded optimizer state].
  std::shared_ptr<dist::Communicator> communicator;
  // With N > 1 ranks, shard the parameter chunks too (Note [Sharded parameters], dist/param_shards.h):
  // each rank keeps only the chunks it owns between steps and gathers the others before their use.
  // Off: every rank keeps every parameter chunk, and a step all-gathers the updated values.
  bool shard_params = true;
  // Leave the host updates that run after backward (with clipping or fp16 loss scaling, and in
  // step()) running behind the return, in forward order, each chunk's next use waiting for its own
  // (Note [Update behind the next forward]); at N > 1 only with shard_params. Off: step() and
  // backward_step() return with every update written.
  bool update_behind_forward = true;

  // `defaults` for matrices; biases and norm weights (tensors of dim <= 1) in group 1 without decay.
  static HybridAdamOptions no_decay_for_bias_and_norm(const AdamOptions& defaults);
  // Chainable setters.
  HybridAdamOptions& with_group(std::function<bool(const std::string&, const at::Tensor&)> match,
                                const AdamOptions& options) {
    groups.push_back({std::move(match), options});
    return *this;
  }
  HybridAdamOptions& with_max_grad_norm(double v) { max_grad_norm = v; return *this; }
  HybridAdamOptions& with_loss_scaler(const LossScalerOptions& v) { loss_scaler = v; return *this; }
  HybridAdamOptions& with_device_state_chunks(int64_t n) { device_state_chunks = n; return *this; }
  HybridAdamOptions& with_accumulate_grads(bool v = true) { accumulate_grads = v; return *this; }
  HybridAdamOptions& with_shard_params(bool v = true) { shard_params = v; return *this; }
  HybridAdamOptions& with_update_behind_forward(bool v = true) { update_behind_forward = v; return *this; }
  void validate() const;
};

struct StepResult {
  bool applied = false;     // the update was written
  bool overflow = false;    // a non-finite gradient skipped it
  double grad_norm = 0.0;   // global L2 norm of the (unscaled, unclipped) gradients; inf/NaN on overflow
  double clip_coef = 1.0;   // factor the gradients were clipped by
  double loss_scale = 1.0;  // the scale the gradients of this step carried
  int64_t device_chunks = 0;  // layout chunks updated on the device
  int64_t host_chunks = 0;    // ... on the host
  int64_t norm_ns = 0, device_update_ns = 0, host_update_ns = 0, writeback_ns = 0;
  // accumulate_grads: layout chunks whose new values were copied from the masters after the update
  // (a parameter chunk away from its state, or fp32 compute); the update wrote the others' itself.
  int64_t written_back_chunks = 0;
  int64_t overlapped_chunks = 0;  // backward_step: chunks whose update (or norm) started during backward
  // backward_step without clipping or loss scaling: parameters whose first gradient of this backward
  // landed after their chunk's update had started (a layer no earlier backward reached); updated after
  // backward (Note [A gradient after its chunk's update], hybrid_adam.cpp).
  int64_t late_params = 0;
  // Host-state chunks whose update was still queued or running when the call returned (Note [Update
  // behind the next forward]); the next use of each waits for its own.
  int64_t deferred_chunks = 0;
  // Host synchronizations by the optimizer on the calling thread (reading device norms): at most 1.
  int64_t device_syncs = 0;
  int64_t comm_ns = 0;  // data parallelism: time in collectives (reduce-scatter, norm, all-gather)
};

class HybridAdam final : private GradSink, private LayoutListener {
 public:
  HybridAdam(ChunkedModel& model, HybridAdamOptions options = {});
  ~HybridAdam() override;
  HybridAdam(const HybridAdam&) = delete;
  HybridAdam& operator=(const HybridAdam&) = delete;

  StepResult step();
  // model.backward(loss) and step() in one call, pipelined per chunk (Note [Pipelined step]); the result
  // is bit-identical to backward() + step() where the note says so.
  // With accumulate_grads: backward of the last micro-batch and the step, with the host Adam of each
  // chunk started on the accumulated fp32 gradients as soon as they are final (a non-finite gradient
  // skips that chunk's update only); with clipping or fp16 loss scaling two-phase, as without
  // accumulation: each chunk's norm follows its accumulation during backward, the updates follow the
  // global norm, bit-identical to backward() + step().
  // If backward throws in the eager step, chunks whose update had started stay updated (logged as an
  // error), the others keep their gradients (zero_grad() discards them), and the step count has
  // advanced; in the two-phase step nothing was updated.
  StepResult backward_step(const at::Tensor& loss);
  // Host Adam jobs of the pipeline that have started running, since construction (tests, reports).
  int64_t pipelined_jobs_started() const { return jobs_started_.load(); }
  // At N > 1 with accumulate_grads: how many backwards ended by bringing back the values of the chunks
  // other ranks own (Note [Accumulation per chunk]).
  int64_t values_from_owners() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return values_from_owners_;
  }
  // Data parallelism with sharded parameters (Note [Sharded parameters]): their gathers and releases;
  // null when not sharded (one rank, shard_params off, or before the first step).
  std::shared_ptr<const dist::ParamShards> param_shards() const { return param_shards_; }
  // Discards the gradients landed since the last step (and zeroes the accumulation chunks; those of
  // chunks whose update is still running behind the step are zeroed after it, on the same worker).
  void zero_grad();
  // Blocks until every update a step left running (Note [Update behind the next forward]) has written
  // its chunk, and rethrows the first error one threw. Every other call here and every read through the
  // model waits by itself; this is for timing a step to its very end, and for before fork() (a child
  // has no worker thread to finish them).
  void synchronize();
  // Queues `job` on the worker that runs the host updates, behind everything queued there so far (FIFO);
  // the updates a later step leaves running queue behind it. For tests and tools: a job that stalls
  // holds those updates back, as a slow host would.
  std::future<void> run_on_worker(std::function<void()> job);

  int num_param_groups() const { return cpu_adam_.num_param_groups(); }
  int group_of(int64_t param) const { return group_of_param_[param]; }
  const AdamOptions& group_options(int group) const { return cpu_adam_.options(group); }
  double lr(int group = 0) const { return cpu_adam_.options(group).lr; }
  void set_lr(int group, double lr);
  void set_lr(double lr);  // every group
  // The group's step count: how many steps were applied (the count a schedule follows).
  int64_t step_count(int group = 0) const { return cpu_adam_.step_count(group); }
  // How many updates parameter `param` has had, torch's per-parameter `step`: a step updates only the
  // parameters that got a gradient, and the bias corrections of each follow its own count (D62). Equal
  // to the group's count for a parameter that had a gradient at every step. At N > 1 on the rank that
  // owns the parameter's state (every rank before the state is sharded).
  int64_t param_step_count(int64_t param) const;
  double loss_scale() const;
  const DynamicLossScaler& loss_scaler() const { return scaler_; }
  bool uses_loss_scaling() const { return scaling_; }

  // Placement: whether it was decided (after warm-up), and how many layout chunks are on the device.
  bool placed() const { return placed_; }
  int64_t device_state_chunks() const;
  // Whether layout chunk `layout_chunk`'s state is on the device (false before placement).
  bool state_on_device(int64_t layout_chunk) const;
  int64_t state_bytes_per_chunk(int64_t layout_chunk) const;
  // fp32 state chunks per layout chunk: 3 (master, exp_avg, exp_avg_sq), 4 with accumulate_grads.
  int num_state_roles() const { return num_roles_; }

  // fp32 views of one parameter's state, wherever it lives (tests, reports); between iterations.
  at::Tensor master(int64_t param);
  at::Tensor exp_avg(int64_t param);
  at::Tensor exp_avg_sq(int64_t param);
  at::Tensor grad(int64_t param);  // fp32; zeros when none landed since the last step/zero_grad()
  ChunkStore& state_store() { return state_->store(); }
  // Peak payload bytes of the old and new state stores together during the last migration to a
  // repacked layout (tests, reports).
  int64_t last_migration_peak_bytes() const { return state_->last_migration_peak_bytes(); }

  // Save/resume the full training state into/from directory `dir` (format and guarantees:
  // docs/CHECKPOINT.md): fp32 masters and moments streamed one parameter at a time, step counts, lr and
  // options per group, loss scaler, a CRC-32C per file.
  // save() is atomic and durable: whatever interrupts it (a kill, a full disk, a permission error),
  // `dir` holds either its previous complete checkpoint or the new one; it refuses non-finite state.
  // Across ranks both are collectives with the same files (Note [Sharded optimizer state]).
  // load() checks the whole checkpoint first (every manifest number, names, shapes, group count, file
  // sizes, checksums, finite values) and changes nothing if any check fails; then it writes the state.
  // Gradients are not saved: save() with gradients that no step() or zero_grad() has consumed yet
  // (grads_pending(): between backward() and step(), or between micro-batches) says so in the log,
  // since a run resumed from it starts without them.
  void save(const std::string& dir);
  // Whether gradients landed since the last step() or zero_grad() (what a save would not hold).
  bool grads_pending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return grads_landed_;
  }
  void load(const std::string& dir);
  // Fails now (creating `dir` if needed) if a checkpoint could not be written into `dir`: call it
  // before a long run that saves at the end.
  static void check_save_target(const std::string& dir);

  // The model's state_dict() with every parameter as its fp32 master (the truth while training).
  NamedTensors state_dict();
  // Loads weights (not optimizer state): the model's parameters and buffers as
  // ChunkedModel::load_state_dict checks them, and the fp32 masters from the same values (exact when
  // they are fp32); moments and step counts stay. Between iterations.
  void load_state_dict(const NamedTensors& values);
  // state_dict() as a safetensors file (fp32 weights) a Python user loads with safetensors.torch.
  void export_safetensors(const std::string& path);

 private:
  enum Role { kMasterRole = 0, kExpAvgRole, kExpAvgSqRole, kGradRole, kNumRoles };
  struct Span {
    int group;
    int64_t begin, end;  // elements of the chunk
    // Updates: the steps of the group its parameters missed (lag_, D62); their own count is the
    // group's minus this. Spans merge only parameters with the same lag.
    int64_t lag = 0;
  };

  struct ChunkNorms {
    std::vector<double> sum_sq;  // per layout chunk, of the grads as landed
    std::vector<char> finite;    // per layout chunk
    // Eager backward_step, per layout chunk: its late part (Note [A gradient after its chunk's update]),
    // apart from the part its job updated; empty when no chunk has one.
    std::vector<double> late_sum_sq;
    std::vector<char> late_finite;
    double total_sq = 0.0;
    bool all_finite = true;
    int64_t syncs = 0;  // host syncs it took (reading device norms): 0 or 1
  };
  // Slots in every mode; with accumulate_grads they are emptied per chunk into the fp32 accumulation
  // chunks (Note [Accumulation per chunk]).
  bool grads_into_param_slots() const override { return true; }
  bool slot_accumulation() const { return options_.accumulate_grads; }
  void before_landing(int64_t param) override;
  void land_grad(int64_t param, const at::Tensor& grad) override;
  void after_landing(int64_t param) override;
  void used_in_backward(int64_t param) override;
  void backward_finished(bool aborted) override;
  void await_param(int64_t param) override;
  void await_params() override;
  // Note [Writes to parameters] (hooks/chunked_model.h): the masters take what the user wrote.
  void values_written(const std::vector<WrittenParam>& written) override;
  // A parameter was frozen or unfrozen: the next backward_step() counts the landings anew (unpipelined
  // once, as the first one is) instead of expecting the old ones.
  void trainable_changed() override;
  void model_gone() override;  // the model was destroyed first: every call is refused from now on
  // await_param for layout chunk c (also the send guard of the sharded parameters' gathers, called
  // under ParamShards' lock: it takes deferred_mutex_ only).
  void await_chunk(int64_t c);
  // check_idle, then await_params(): every public call that reads or writes state or gradients.
  void settle(const char* what);
  // Note [Update behind the next forward]: joins the updates left running (and the zeroing queued
  // behind them); rethrows the first error.
  void settle_deferred();
  // Whether layout chunk c's update was left running and not waited for yet.
  bool deferred_update_of(int64_t c) const;
  // Queues layout chunk c's host update (grad scale and group options frozen now) on CpuAdam's worker,
  // its parameter chunk locked on the host until it has written the new values; returns false (nothing
  // queued) where the parameter chunk is not on the host or nothing landed.
  bool defer_host_update_locked(int64_t chunk, const UpdateOptions& options,
                                const std::shared_ptr<const std::vector<CpuAdam::FrozenGroup>>& frozen);
  StepResult backward_step_accumulated(const at::Tensor& loss);
  // The pipeline (Note [Pipelined step]), default mode.
  struct ChunkOutcome {
    double sum_sq = 0.0;  // of the chunk's landed gradients as landed
    bool finite = true;   // every gradient finite, and sum_sq too (an overflowing norm is non-finite)
  };
  // Resets this backward's landing counts; `armed`: a chunk becomes final when its parameters have had
  // the landings and uses earlier backwards had (remaining_ counts them down); at N > 1 not one holding
  // a trainable parameter no backward reached (Note [A gradient after its chunk's update]).
  void arm_landing_count_locked(bool armed);
  // expected_landings_ grows by this backward's landings_ (Note [Expectations only grow]); `complete`:
  // the backward ran to its end.
  void grow_expected_landings_locked(bool complete);
  // Note [A chunk final before its last use]: a use of a chunk whose job in this backward still runs
  // waits for it.
  void await_backward_job(int64_t c);
  // Per layout chunk: the landings `landings` expects of its parameters and, for a chunk that expects
  // some, the uses its parameters had in the last complete backward not yet seen in this one.
  std::vector<int64_t> final_counts_locked(const std::vector<int64_t>& landings) const;
  // Updates every chunk not launched during backward where its state lives (grad scale 1); a chunk with
  // non-finite gradients is skipped (default mode: its values restored). Returns whether all were finite.
  bool update_unlaunched_locked(const ChunkNorms& norms, StepResult& result);
  void launch_chunk_locked(int64_t chunk);
  // Moves chunk c's parameter chunk to the host (one transfer on the copy stream), locks it there and
  // queues work(grads, master, exp_avg, exp_avg_sq pointers, master tensor) on CpuAdam's worker, run once
  // the copy has landed; the chunk is unlocked when the job ends, whatever happens. Returns its future.
  using HostJob = std::function<void(const at::Tensor& grads, float* p, float* m, float* v, const at::Tensor& master)>;
  // `with_state` false: the moments are not touched (p, m, v are null; they stay unallocated, D46).
  // `background_write`: a write left running behind the step (Note [Ops outside the scopes], hooks/interceptor.h).
  std::future<void> launch_host_job_locked(int64_t chunk, const char* what, HostJob work, bool with_state = true,
                                           bool background_write = false);
  // Note [Accumulation per chunk]: adds the slot gradients of chunk c into its accumulation chunk and
  // gives the slots their values back (round(master)), on the device for device-state chunks, else on
  // CpuAdam's worker after one transfer of the chunk to the host; clears the model's slot marks. A chunk
  // another rank owns keeps the gradients in its slots (values_from_owners_locked, when backward ends).
  // What follows the accumulation under backward_step (the chunk then counts as launched): its norm,
  // into outcomes_ (host) or chunk_device_norms_ (device; two-phase only), and in the eager step (no
  // clipping, no loss scaling) a host chunk's update, in the same job, writing the new values into the
  // slots; a chunk with a non-finite gradient is not updated.
  enum class AfterAccumulation { kNothing, kNorm, kNormAndUpdate };
  void consume_slot_grads_locked(int64_t chunk, AfterAccumulation then = AfterAccumulation::kNothing);
  // Accumulation: a chunk final in this backward is emptied, as its step follows or not.
  void consume_final_chunk_locked(int64_t c);
  // At N > 1 after an accumulating backward: the values of the chunks this rank does not own, from
  // their owners (sharded: every gathered group given up; replicated: one all-gather). A collective.
  void values_from_owners_locked();
  // Where the reduce-scatter buffers of the gradients live (hybrid_adam_dist.cpp).
  c10::Device comm_buffer_device() const;
  void arm_accumulation_locked();  // at the first landing of a backward
  // Waits for every job in jobs_ and clears it; the first error any of them threw (or null), a
  // superseded one's first.
  std::exception_ptr join_jobs_locked();
  // Accumulation: chunk c's job ends before the chunk is consumed again, which replaces it in jobs_;
  // its error is kept in job_error_ for join_jobs_locked.
  void await_superseded_job_locked(int64_t c);
  void check_backward_step_start_locked();  // the layout is followed, no gradients wait for step()
  // After a pipelined backward (default or accumulation mode): the norms, then every update left (eager)
  // or every update (two-phase), and the values back in the parameter chunks.
  StepResult finish_pipelined_locked();
  // The chunk's landed spans: the host norm (as grad_norms_locked computes it), and device norms.
  ChunkOutcome host_norm(const at::Tensor& grads, const std::vector<Span>& spans) const;
  std::vector<at::Tensor> device_norms(const at::Tensor& grads, const std::vector<Span>& spans) const;
  // CpuAdam spans over state (p, m, v) and `grads` (default mode: the new value is written over each grad;
  // accumulation mode: into `lowp`, a 16-bit parameter chunk payload, when given).
  std::vector<std::pair<Span, AdamSpan>> adam_spans(const std::vector<Span>& spans, float* p, float* m, float* v,
                                                    const at::Tensor& grads, const at::Tensor& lowp = {}) const;
  // The options and step count span `s` is updated with: its group's (as `frozen` froze them, or now),
  // the step count lessened by the span's lag (D62).
  CpuAdam::FrozenGroup update_group(const Span& s, const std::vector<CpuAdam::FrozenGroup>* frozen) const;
  // After a step that advanced the groups' step counts: every parameter of an owned chunk that the step
  // did not update (no gradient landed, or its chunk was skipped: updated_chunks[c] == 0) falls one step
  // further behind its group (lag_). Before landed_ is cleared. updated_chunks null: every chunk updated.
  // A late parameter (Note [A gradient after its chunk's update]) goes by late_updated[c] instead (null:
  // not updated).
  void count_missed_steps_locked(const std::vector<char>* updated_chunks,
                                 const std::vector<char>* late_updated = nullptr);
  // Accumulation mode at N = 1: layout chunk c's parameter chunk payload when it is where c's state is
  // (host or device) and 16-bit, so that the update writes the new values in its own pass and
  // write_back_locked skips the chunk (marked in lowp_written_); else undefined.
  at::Tensor lowp_target_locked(int64_t chunk);
  // `frozen` (optional): the groups' options and step counts as the step froze them, for an update
  // that runs after the step returned.
  void run_host_update(const std::vector<std::pair<Span, AdamSpan>>& spans, const UpdateOptions& options,
                       const std::vector<CpuAdam::FrozenGroup>* frozen = nullptr);
  // Writes the masters of `spans` into the parameter chunk payload `param` (gives landed slots their values back).
  static void restore_values(const at::Tensor& param, const at::Tensor& master, const std::vector<Span>& spans);
  // Reads the device norms (one host sync, if any) into `norms` (device_index[k]: the chunk of norm k),
  // then totals.
  static void finish_norms(const std::vector<at::Tensor>& device_norms, const std::vector<int64_t>& device_index,
                              ChunkNorms& norms);
  // The apply half of step(): decides on `norms`, updates, clears the gradients.
  StepResult apply_locked(const ChunkNorms& norms, StepResult result);
  // Spans of parameters that received gradients since the last step, per layout chunk (consecutive
  // landed slots of one group and one lag merged; alignment gaps are zero in every role). kLate: only
  // those of late parameters (Note [A gradient after its chunk's update]).
  enum class Landed { kAll, kLate };
  std::vector<Span> landed_spans_locked(int64_t chunk, Landed which = Landed::kAll) const;
  bool late(int64_t param) const { return param < static_cast<int64_t>(late_.size()) && late_[param]; }
  bool has_late(int64_t chunk) const { return chunk < static_cast<int64_t>(late_chunks_.size()) && late_chunks_[chunk]; }
  int64_t num_chunks() const { return static_cast<int64_t>(on_device_.size()); }  // layout chunks mirrored
  // Where chunk c's gradients are: the fp32 accumulation chunk, or (default) the parameter chunk,
  // which is first moved to where c's state is.
  at::Tensor grad_payload_locked(int64_t chunk);
  // Default mode: each parameter chunk to its state's tier (skip_launched: not those the pipeline moved).
  void stage_param_chunks_locked(bool skip_launched = false);
  // Writes the fp32 masters of the landed parameters into their slots (default mode: the gradients
  // there are given up), then forgets the landings.
  void discard_grads_locked();
  void layout_changed() override;  // the model was repacked: migrate the state to its layout
  void sync_layout_locked();        // asserts the state mirrors the model's layout
  void follow_layout_locked();  // placement and per-chunk bookkeeping for the model's current layout
  void place_locked();             // after warm-up: decide and move
  void check_idle(const char* what) const;
  // Checkpoints (hybrid_adam_io.cpp): the manifest's text; writing it over the previous one (`written`:
  // the files to remove if it fails); the save of several ranks (each writes its part, rank 0 checks
  // the parts and publishes).
  // `lags`: every parameter's (lag_ of the ranks that own them).
  std::string manifest_text_locked(int64_t generation, const std::string& file_lines,
                                   const std::vector<int64_t>& lags) const;
  void publish_checkpoint_locked(const std::string& dir, int64_t generation, const std::string& file_lines,
                                 const std::vector<int64_t>& lags,
                                 std::vector<std::string>& written);
  void save_across_ranks_locked(const std::string& dir);
  // Data parallelism (Note [Sharded optimizer state]).
  bool owned(int64_t chunk) const { return !sharded_ || chunk % world_ == rank_; }
  void check_same_layout_locked();  // a collective; fails clearly if the ranks' layouts differ
  void broadcast_initial_values_locked();
  void shard_locked();
  // Sharded parameters: one collective per step; lets the scheduler give groups up after forward only
  // while every rank follows the same trace.
  void agree_on_trace_locked();
  // Slot ranges of chunk c whose parameters have mask[p] == want (alignment gaps excluded).
  std::vector<Span> slot_ranges_locked(int64_t chunk, const std::vector<char>& mask, bool want) const;
  // One collective: whether `value` is the same on every rank.
  bool same_on_every_rank_locked(double value);
  // A group's reduce-scatter input: per member chunk, this rank's gradients then its landed flags.
  struct GroupBuffer {
    at::Tensor flat;
    int64_t cap = 0, seg = 0;  // elements of a member's values, and of a member's whole segment
  };
  GroupBuffer pack_group_locked(int64_t group);
  // The owned chunk c's spans from the summed flags (counts[i]: ranks that landed its i-th tensor):
  // landed somewhere (by param group and lag, as landed_spans_locked) and landed nowhere. Thread-safe
  // (lag_ changes only between steps, when no job runs).
  struct OwnedSpans {
    std::vector<Span> landed, unlanded;
  };
  OwnedSpans owned_spans(int64_t chunk, const at::Tensor& counts) const;
  // Per group: every rank's gradients summed into the owner's chunk (landed_ there: the union).
  void reduce_grads_locked();
  void receive_owned_locked(int64_t chunk, const at::Tensor& out, int64_t cap);
  void take_union_locked(int64_t chunk, const at::Tensor& counts);  // landed_ of chunk's tensors: counts != 0
  // Per group, the owner's chunk of `local(c)` to every rank: got(c, values) for every chunk c.
  void gather_groups_locked(at::ScalarType dtype, const std::function<at::Tensor(int64_t)>& local,
                            const std::function<void(int64_t, const at::Tensor&)>& got);
  void gather_params_locked();  // the owners' parameter chunks to every rank
  at::Tensor comm_payload_locked(int64_t chunk);  // parameter chunk c where the communicator reads it
  StepResult dist_step_locked();
  // The pipelined step across ranks (eager only): each group's reduce-scatter starts when its chunks are
  // final in backward, the owner's host Adam runs on CpuAdam's worker when it completes.
  struct GroupFlight {
    std::unique_ptr<dist::Pending> pending;
    at::Tensor out;  // the owner's member: summed values [0, cap), then per-tensor landed counts
    int64_t cap = 0;
  };
  StepResult dist_backward_step(const at::Tensor& loss);
  void chunk_final_across_ranks_locked(int64_t chunk);
  void launch_group_locked(int64_t group);
  StepResult finish_dist_pipelined_locked();
  // Whether every rank expects the same landings next backward_step (a collective).
  void check_landings_agree_locked();
  at::Tensor state_view(Role role, int64_t param);
  // After the updates: the parameter chunks hold values again (slots cleared, or the masters written
  // back where the update did not write them); sets writeback_ns and written_back_chunks.
  void finish_values_locked(StepResult& result);
  // The masters into the parameter chunks in the compute dtype; `after_update`: except the chunks the
  // update wrote already (lowp_written_). Returns the chunks copied.
  int64_t write_back_locked(bool after_update = false);
  StepResult step_locked();
  // Every grad chunk's squared norm and finiteness; one host sync for all device chunks. `pipelined`:
  // the chunks launched during backward contribute what was computed then.
  ChunkNorms grad_norms_locked(bool pipelined = false);
  // (landed span, its CpuAdam span); `which`: the spans of landed_spans_locked(chunk, which).
  std::vector<std::pair<Span, AdamSpan>> host_spans_locked(int64_t chunk, Landed which = Landed::kAll);
  void host_update_chunk_locked(int64_t chunk, const UpdateOptions& options, Landed which = Landed::kAll);
  // `found_inf` (a device flag, optional): when it is nonzero the device Adam skips the update and the
  // slots get their values back (round(master); device_adam.h).
  void device_update_chunk_locked(int64_t chunk, double grad_scale, const at::Tensor& found_inf = {},
                                  Landed which = Landed::kAll);
  // Note [A gradient after its chunk's update]: lets `param`'s landing into launched chunk c proceed
  // (after c's job) or refuses it; before_landing, under mutex_.
  void late_landing_locked(int64_t param, int64_t chunk);

  ChunkedModel& model_;  // through model() only, which refuses once the model is gone
  ChunkedModel& model() const {
    TORCH_CHECK(!model_gone_.load(std::memory_order_relaxed), "ferry: HybridAdam used after its ChunkedModel was "
                "destroyed: destroy the optimizer before its model (declare it after the model)");
    return model_;
  }
  HybridAdamOptions options_;
  CpuAdam cpu_adam_;
  DynamicLossScaler scaler_;
  bool scaling_ = false;
  std::vector<int> group_of_param_;

  mutable std::mutex mutex_;
  // Paired with the model's parameter chunks and migrated by its repacks (ChunkedModel::attach_state).
  std::shared_ptr<StateChunks> state_;
  int64_t layout_version_ = -1;
  std::vector<char> on_device_;                     // per layout chunk
  bool placed_ = false;
  bool grads_landed_ = false;
  std::atomic<bool> model_gone_{false};  // model_gone(): model_ must not be touched
  int num_roles_ = 3;
  std::vector<char> landed_;  // per parameter: a gradient landed since the last step/zero_grad
  // Per parameter of an owned chunk: the applied steps of its group that did not update it (D62). Its
  // own step count (torch's per-parameter `step`) is the group's minus this. Changes only when a step
  // ends (count_missed_steps_locked) or a checkpoint is loaded.
  std::vector<int64_t> lag_;
  // backward_step: landings per parameter in this backward, and those of the previous backward_step.
  std::vector<int64_t> landings_, expected_landings_;
  // Note [A chunk final before its last use]: per parameter, its uses in this backward and the most
  // an earlier one had (Note [Expectations only grow]).
  std::vector<int64_t> uses_, last_uses_;
  bool overlap_active_ = false;
  // Per layout chunk: landings and uses still expected before it is final (final_counts_locked).
  std::vector<int64_t> remaining_;
  std::vector<char> launched_;      // per layout chunk: its host update (or norm) is queued
  // Eager backward_step at N = 1 (Note [A gradient after its chunk's update]): per parameter, its first
  // gradient of this backward landed after its chunk's job had started (so the job left it alone); per
  // layout chunk, whether it has such a parameter. Reset when a pipelined backward starts.
  std::vector<char> late_, late_chunks_;
  bool told_unreached_ = false;  // N > 1: the log line about parameters no backward reached
  // Accumulation mode, per layout chunk: the update wrote the new compute-dtype values into the
  // parameter chunk (write_back_locked skips it, then clears this).
  std::vector<char> lowp_written_;
  // The default-mode pipeline: whether updates run during backward (no clipping, no loss scaling), the
  // host jobs (per layout chunk; awaited when backward ends) and what they found, the device norms.
  bool eager_ = false;
  std::vector<std::future<void>> jobs_;
  std::atomic<bool> backward_jobs_{false};  // jobs_ may hold a job launched in this backward
  std::vector<ChunkOutcome> outcomes_;
  std::vector<std::vector<at::Tensor>> chunk_device_norms_;
  std::exception_ptr job_error_;  // of a job superseded in jobs_ (await_superseded_job_locked)
  std::atomic<int64_t> jobs_started_{0};
  // Note [Update behind the next forward]: per layout chunk, its host update left running by the last
  // step; zeroing of accumulation chunks queued behind them; whether any of them may still run.
  // Note [Update behind the next forward]. deferred_mutex_ guards the two lists below. It is taken last
  // (mutex_ and ParamShards' lock may be held) and the jobs waited for under it take neither it nor
  // those, so the waits cannot deadlock; nothing is queued or moved under it.
  mutable std::mutex deferred_mutex_;
  std::vector<std::future<void>> deferred_;
  std::vector<std::future<void>> deferred_zeroing_;
  std::atomic<bool> deferred_pending_{false};
  // Data parallelism: the ranks, whether the state is sharded, and (accumulate_grads, during a step)
  // the gradients summed over ranks of the chunks this rank owns.
  std::shared_ptr<dist::Communicator> comm_;
  int world_ = 1;
  int rank_ = 0;
  bool sharded_ = false;
  std::shared_ptr<dist::ParamShards> param_shards_;  // Note [Sharded parameters] (null: replicated)
  int64_t hashed_trace_version_ = -1, trace_agreed_ = -1;  // agree_on_trace_locked
  double trace_hash_ = 0;
  std::vector<at::Tensor> reduced_grads_;
  std::vector<GroupFlight> flights_;  // per group, during a pipelined backward_step
  std::vector<char> owner_job_;        // per layout chunk: its owner update runs as a pipeline job
  bool dist_pipelined_ = false;
  bool landings_agree_ = false;
  // Note [Accumulation per chunk]: per parameter, a gradient sits in its slot (this backward) and the
  // landings of this and of the previous backward; per layout chunk, landings still expected before
  // its slots are consumed, and whether they were.
  bool accum_armed_ = false;
  std::vector<char> in_slot_;
  std::vector<int64_t> accum_landings_, accum_expected_;
  std::vector<int64_t> accum_remaining_;
  std::vector<char> accum_consumed_;
  // At N > 1: the step follows this backward at once (backward_step), so values_from_owners_locked is
  // not needed; and how many times the values came back from their owners (tests, reports).
  bool step_follows_backward_ = false;
  int64_t values_from_owners_ = 0;
};

}  // namespace ferry
