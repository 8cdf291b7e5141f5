#pragma once
// DeferredUpdates: the host updates a step left running behind its return (Note [Update behind the next
// forward]), one per layout chunk, and the zeroing of accumulation chunks queued behind them.
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
// eager step's updates run during backward (D52); those it had not started when backward ended are
// left running here too (Note [Host updates carried over behind the next forward], engine_step.cpp).
// The parameter chunks a step with accumulate_grads finds on the device keep the update on the
// calling thread (and the copy after).
// An error in such an update surfaces at the next wait (the forward that needs the chunk, or any of
// the calls above), logged with the chunk; that chunk may be partly updated.
//
// Contract: thread-safe. Its mutex is taken last (HybridAdam's mutex and ParamShards' lock may be held)
// and the jobs waited for under it take neither it nor those, so the waits cannot deadlock; nothing is
// queued or moved under it. pending() is one atomic load: the common case (nothing left running) costs
// no lock.
#include <atomic>
#include <cstdint>
#include <future>
#include <mutex>
#include <vector>

namespace ferry::optim {

class DeferredUpdates {
 public:
  // Whether any update or zeroing may still run (no lock).
  bool pending() const { return pending_.load(); }
  // Chunk `chunk`'s update, queued on the worker; the chunk must have none pending.
  void put(int64_t chunk, std::future<void> update);
  // A zeroing of an accumulation chunk, queued behind the updates on the same worker.
  void put_zeroing(std::future<void> zeroing);
  // Whether chunk `chunk`'s update was left running and not waited for yet.
  bool has(int64_t chunk) const;
  // Waits for chunk `chunk`'s update (if any); rethrows its error, logged with the chunk.
  void await_chunk(int64_t chunk);
  // Waits for every update and zeroing; rethrows the first error, logged with its chunk.
  void settle();

 private:
  mutable std::mutex mutex_;
  std::vector<std::future<void>> updates_;  // per layout chunk
  std::vector<std::future<void>> zeroing_;
  std::atomic<bool> pending_{false};
};

}  // namespace ferry::optim
