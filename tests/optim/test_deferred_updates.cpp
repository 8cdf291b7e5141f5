// DeferredUpdates (optim/deferred_updates.h, Note [Update behind the next forward]): the object alone
// (await_chunk waits for its chunk only, settle() rethrows the first error and clears, put() on a chunk
// with an update pending is an internal assert), then through HybridAdam: updates left running behind the
// step are bit-identical to updates on the calling thread, in every kind of step, with pending copies,
// and ops between steps wait for them (Note [Ops outside the scopes]).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "../../chunk/stream_model_engine.h"
#include "../../hooks/interceptor.h"
#include "../../optim/deferred_updates.h"
#include "hybrid_adam_fixtures.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures

using optim::DeferredUpdates;

// A future its test completes when it chooses: set_value() or set_exception().
struct Pending {
  std::promise<void> promise;
  std::future<void> future = promise.get_future();
  void fail(const std::string& what) { promise.set_exception(std::make_exception_ptr(std::runtime_error(what))); }
};

// The message of what `fn` throws ("(no error)" if nothing).
std::string thrown_by(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(DeferredUpdates, AwaitChunkWaitsForItsChunkOnly) {
  DeferredUpdates d;
  EXPECT_FALSE(d.pending());
  Pending c0, c2;
  d.put(0, std::move(c0.future));
  d.put(2, std::move(c2.future));
  EXPECT_TRUE(d.pending());
  EXPECT_TRUE(d.has(0));
  EXPECT_FALSE(d.has(1));
  EXPECT_TRUE(d.has(2));
  EXPECT_FALSE(d.has(7)) << "past the chunks seen";
  d.await_chunk(1);  // none pending for chunk 1: returns at once
  d.await_chunk(9);
  c0.promise.set_value();
  // Chunk 2's update never completes before this returns: waiting for it would never end, so run the wait
  // on another thread and release chunk 2 if it is still waiting after a minute (a hang guard, not a timing).
  auto waited = std::async(std::launch::async, [&] { d.await_chunk(0); });
  if (waited.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    c2.promise.set_value();
    waited.get();
    FAIL() << "await_chunk(0) waited for chunk 2's update";
  }
  waited.get();
  EXPECT_FALSE(d.has(0)) << "waited for: no longer left running";
  EXPECT_TRUE(d.has(2));
  EXPECT_TRUE(d.pending()) << "chunk 2's update is still left running";
  c2.promise.set_value();
  d.settle();
  EXPECT_FALSE(d.pending());
}

TEST(DeferredUpdates, AwaitChunkRethrowsItsUpdatesError) {
  DeferredUpdates d;
  Pending c1, c3;
  d.put(1, std::move(c1.future));
  d.put(3, std::move(c3.future));
  c1.fail("update of chunk 1 failed");
  c3.promise.set_value();
  EXPECT_EQ(thrown_by([&] { d.await_chunk(1); }), "update of chunk 1 failed");
  EXPECT_FALSE(d.has(1));
  EXPECT_EQ(thrown_by([&] { d.await_chunk(1); }), "(no error)") << "the error surfaced once";
  EXPECT_EQ(thrown_by([&] { d.await_chunk(3); }), "(no error)");
}

// settle() waits for everything, rethrows the first error in chunk order (the zeroings after the
// updates), and forgets every job, failed or not.
TEST(DeferredUpdates, SettleRethrowsTheFirstErrorAndClears) {
  DeferredUpdates d;
  Pending c0, c1, c2, zeroing;
  d.put(0, std::move(c0.future));
  d.put(1, std::move(c1.future));
  d.put(2, std::move(c2.future));
  d.put_zeroing(std::move(zeroing.future));
  c2.fail("chunk 2");  // failed first in time
  zeroing.fail("zeroing");
  c1.fail("chunk 1");
  c0.promise.set_value();
  EXPECT_EQ(thrown_by([&] { d.settle(); }), "chunk 1");
  EXPECT_FALSE(d.pending());
  for (int64_t c = 0; c < 3; ++c) EXPECT_FALSE(d.has(c)) << c;
  EXPECT_EQ(thrown_by([&] { d.settle(); }), "(no error)") << "cleared: nothing left to throw";
  // A zeroing's error alone surfaces too; put_zeroing alone makes it pending.
  Pending z;
  d.put_zeroing(std::move(z.future));
  EXPECT_TRUE(d.pending());
  z.fail("zeroing alone");
  EXPECT_EQ(thrown_by([&] { d.settle(); }), "zeroing alone");
  EXPECT_FALSE(d.pending());
  // A chunk settled may be put again.
  Pending again;
  d.put(1, std::move(again.future));
  again.promise.set_value();
  EXPECT_EQ(thrown_by([&] { d.settle(); }), "(no error)");
}

TEST(DeferredUpdates, PutOnAChunkWithAnUpdatePendingIsAnInternalAssert) {
  DeferredUpdates d;
  Pending first, second;
  d.put(4, std::move(first.future));
  const std::string err = test::error_of([&] { d.put(4, std::move(second.future)); });
  EXPECT_NE(err.find("chunk 4 has an update left running already"), std::string::npos) << err;
  first.promise.set_value();
  d.settle();
}

// Note [Update behind the next forward]: with update_behind_forward (b) the host updates after
// backward are left running and the next forward waits for each chunk's own; against the same training
// with it off (a), every loss (each computed by a forward that waited), master, moment and parameter is
// bit-identical, although the lr changes right after every step (the queued updates keep the one they
// were queued with). Forced evictions, state split between device and host, clipping; the two-phase
// backward_step and backward() + step(), with and without micro-batches (whose zero_grad() queues
// behind the updates).
struct BehindCase {
  Precision precision = Precision::kBf16;
  int micro_batches = 1;
  bool unpipelined = false;
  int64_t param_chunks = 3, state_chunks = 4;  // the device budget, in chunks (budget_for)
  // b's copies stay pending until waited for or polled, as CUDA's do (the test engine supports one
  // instance at a time: a's copies stay synchronous).
  bool pending_copies = false;
  bool clipping = true;  // the two-phase backward_step; false: eager
  // A job holding b's worker until b's backward_step has returned, as a host Adam slower than backward
  // would: every eager host update is still queued when backward ends (Note [Host updates carried over
  // behind the next forward], optim/engine_step.cpp).
  bool stall_worker = false;
};

void expect_update_behind_forward_exact(const BehindCase& bc) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.max_grad_norm = bc.clipping ? 0.05 : 0.0;
  options.accumulate_grads = bc.micro_batches > 1;
  const int64_t roles = options.accumulate_grads ? 4 : 3;
  torch::manual_seed(43);
  TinyLm a_net(kVocab, kDim);
  torch::manual_seed(43);
  TinyLm b_net(kVocab, kDim);
  ChunkedModelOptions b_options;
  if (bc.pending_copies) {
    b_options.copy_engine = [] {
      return std::make_unique<StreamModelCopyEngine>(StreamModelOptions{/*host_lags=*/true, /*poll_one_in=*/3, /*seed=*/5});
    };
  }
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(bc.param_chunks, bc.state_chunks, roles), bc.precision));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(bc.param_chunks, bc.state_chunks, roles), bc.precision),
                 std::move(b_options));
  HybridAdam a_adam(a, HybridAdamOptions(options).with_update_behind_forward(false));
  HybridAdam b_adam(b, HybridAdamOptions(options).with_update_behind_forward(true));
  int64_t deferred = 0, evictions = 0, clipped = 0, carried = 0;
  for (int step = 0; step < 8; ++step) {
    auto run = [&](ChunkedModel& m, TinyLm& net, HybridAdam& adam) {
      std::promise<void> gate;
      if (bc.stall_worker && &adam == &b_adam) adam.run_on_worker([opened = gate.get_future().share()] { opened.wait(); });
      struct Open {  // after the step has returned, also when it throws
        std::promise<void>& gate;
        ~Open() { gate.set_value(); }
      } open{gate};
      StepResult r;
      torch::Tensor loss_sum;
      for (int k = 0; k < bc.micro_batches; ++k) {
        const Batch x = batch(100 * step + k);
        torch::Tensor loss = forward_loss(m, net, x, bc.micro_batches);
        loss_sum = loss_sum.defined() ? loss_sum + loss.detach() : loss.detach();
        if (k + 1 < bc.micro_batches) {
          m.backward(loss);
        } else if (bc.unpipelined) {
          m.backward(loss);
          r = adam.step();
        } else {
          r = adam.backward_step(loss);
        }
      }
      adam.set_lr(1e-2 / (step + 2));  // at once: b's updates of this step are still queued or running
      adam.zero_grad();
      return std::make_pair(r, loss_sum);
    };
    const auto [ra, la] = run(a, a_net, a_adam);
    const auto [rb, lb] = run(b, b_net, b_adam);
    const std::string when = "step " + std::to_string(step);
    ASSERT_TRUE(torch::equal(la, lb)) << when << ": the forward read every parameter after its update";
    ASSERT_EQ(ra.applied, rb.applied) << when;
    EXPECT_EQ(ra.grad_norm, rb.grad_norm) << when;
    EXPECT_EQ(ra.deferred_chunks, 0) << when;
    // (Eager with the worker free, a job that started in backward updated its chunk there.)
    if (!options.accumulate_grads && rb.applied && (bc.clipping || bc.stall_worker)) {
      EXPECT_EQ(rb.deferred_chunks, rb.host_chunks) << when << ": every host chunk is staged on the host";
    }
    EXPECT_LE(rb.deferred_chunks, rb.host_chunks) << when;
    deferred += rb.deferred_chunks;
    clipped += rb.clip_coef < 1.0;
    carried += ra.overlapped_chunks - rb.overlapped_chunks;
    evictions += b.last_iteration().evictions;
  }
  // An evaluation forward right after the last step waits as a training one does.
  const Batch x = batch(999);
  const torch::Tensor ya = a.forward([&] { return a_net->forward(x.idx); });
  const torch::Tensor yb = b.forward([&] { return b_net->forward(x.idx); });
  a.end_iteration();
  b.end_iteration();
  EXPECT_TRUE(torch::equal(ya, yb));
  ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 8 steps"));
  // (Eager with the worker free, how many jobs backward's end finds not started depends on the
  // machine's speed: only the first, unpipelined, step's updates are sure to be left running.)
  EXPECT_GE(deferred, !bc.clipping && !bc.stall_worker ? 1 : 8) << "host updates must be left running";
  if (bc.clipping) {
    EXPECT_GT(clipped, 2) << "the clipping path must be exercised";
  }
  if (bc.stall_worker && !bc.unpipelined) {
    EXPECT_GT(carried, 2) << "eager host updates must be taken back";
  }
  EXPECT_GE(evictions, 5);
  EXPECT_EQ(a_adam.step_count(0), b_adam.step_count(0));
}

TEST(DeferredUpdates, UpdateBehindForwardIsBitIdenticalInTheTwoPhaseStep) { expect_update_behind_forward_exact({}); }

TEST(DeferredUpdates, UpdateBehindForwardIsBitIdenticalInBackwardThenStep) {
  expect_update_behind_forward_exact({Precision::kBf16, 1, /*unpipelined=*/true});
}

TEST(DeferredUpdates, UpdateBehindForwardIsBitIdenticalWithMicroBatches) {
  expect_update_behind_forward_exact({Precision::kBf16, 3});
}

// The same with b's copies pending until waited for or polled (StreamModelCopyEngine, polled at random),
// as CUDA's are: the moves of the next forward, prefetches of chunks whose update has just unlocked
// them among them, complete only when something waits or orders compute after them.
TEST(DeferredUpdates, UpdateBehindForwardIsBitIdenticalWithPendingCopies) {
  for (const bool unpipelined : {false, true}) {
    for (const int micro_batches : {1, 2}) {
      BehindCase c;
      c.pending_copies = true;
      c.unpipelined = unpipelined;
      c.micro_batches = micro_batches;
      SCOPED_TRACE(std::string(unpipelined ? "backward() + step()" : "backward_step") + ", " +
                   std::to_string(micro_batches) + " micro-batch(es)");
      expect_update_behind_forward_exact(c);
    }
  }
}

// Note [Host updates carried over behind the next forward]: the eager backward_step, its worker held
// until the step returns (every host job still queued at backward's end is taken back and run behind
// the call in forward's order) and not held (the worker may or may not keep up), with CUDA-like
// pending copies too: bit-identical to the same training with every update done inside the step.
TEST(DeferredUpdates, EagerUpdatesCarriedOverBehindTheNextForwardAreBitIdentical) {
  for (const bool stall : {true, false}) {
    for (const bool pending : {false, true}) {
      BehindCase c;
      c.clipping = false;
      c.stall_worker = stall;
      c.pending_copies = pending;
      SCOPED_TRACE(std::string(stall ? "worker held" : "worker free") + (pending ? ", pending copies" : ""));
      expect_update_behind_forward_exact(c);
    }
  }
}

TEST(DeferredUpdates, UpdateBehindForwardIsBitIdenticalWithMicroBatchesInFp32) {
  expect_update_behind_forward_exact({Precision::kFp32, 2, /*unpipelined=*/true, /*param_chunks=*/2,
                                      /*state_chunks=*/2});
}

// Note [Ops outside the scopes] (hooks/interceptor.h): between iterations the wrapped module is an ordinary
// module, also while step()'s host updates are still running (b). Right after step() returns, with
// every update held back on the worker by a 100 ms job queued ahead of them, ops on this thread read
// the new values (the parameters, an eval forward outside model.forward()), and a write of theirs is
// not overwritten by the update (it is what the next forward uses); torch::save, which reads CPU
// storages without an op, saves them after synchronize(). Against the same training with the updates
// on the calling thread (a), every value, output and loss is bit-identical. The thread stops watching
// at its first op once the updates are done.
TEST(DeferredUpdates, OpsBetweenStepsWaitForTheUpdatesLeftRunning) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.max_grad_norm = 0.05;
  const auto nets = twins(47);
  TinyLm a_net = nets.first, b_net = nets.second;
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 4), Precision::kBf16));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 4), Precision::kBf16));
  HybridAdam a_adam(a, HybridAdamOptions(options).with_update_behind_forward(false));
  HybridAdam b_adam(b, HybridAdamOptions(options).with_update_behind_forward(true));
  auto a_params = a_net->named_parameters(), b_params = b_net->named_parameters();
  const int64_t outside_before = interception_counters().outside_uses;
  int64_t deferred = 0, evictions = 0;
  for (int step = 0; step < 8; ++step) {
    const std::string when = "step " + std::to_string(step);
    const Batch x = batch(step);
    auto train = [&](ChunkedModel& m, TinyLm& net, HybridAdam& adam, bool stall) {
      const torch::Tensor loss = forward_loss(m, net, x);
      m.backward(loss);
      if (stall) adam.run_on_worker([] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); });
      const StepResult r = adam.step();
      return std::make_pair(r, loss.detach());
    };
    const auto [ra, la] = train(a, a_net, a_adam, false);
    const auto [rb, lb] = train(b, b_net, b_adam, true);
    ASSERT_TRUE(torch::equal(la, lb)) << when << ": the loss";
    EXPECT_EQ(ra.deferred_chunks, 0) << when;
    deferred += rb.deferred_chunks;
    evictions += b.last_iteration().evictions;
    if (rb.deferred_chunks > 0) {
      EXPECT_TRUE(watching_outside_uses()) << when << ": the updates are still held back";
      EXPECT_GT(outside_hazards(), 0) << when;
    }
    torch::NoGradGuard no_grad;
    switch (step % 4) {
      case 0:  // read every parameter by ops: the values the update writes
        for (const auto& item : a_params) {
          EXPECT_TRUE(torch::equal(b_params[item.key()].clone(), item.value())) << when << ": " << item.key();
        }
        break;
      case 1: {  // an eval forward outside model.forward()
        const Batch e = batch(500 + step);
        EXPECT_TRUE(torch::equal(b_net->forward(e.idx), a_net->forward(e.idx))) << when << ": eval forward";
        break;
      }
      case 2: {  // torch::save of the module, after synchronize(): it copies CPU storages' bytes without an
                 // op, so on the simulated device it is not watched (without the call it saved gradients)
        std::stringstream archive;
        b_adam.synchronize();
        torch::save(b_net, archive);
        TinyLm loaded(kVocab, kDim);
        loaded->to(torch::kBFloat16);  // the compute dtype the archive holds
        torch::load(loaded, archive);
        auto loaded_params = loaded->named_parameters();
        for (const auto& item : a_params) {
          EXPECT_TRUE(torch::equal(loaded_params[item.key()], item.value())) << when << ": saved " << item.key();
        }
        break;
      }
      default:  // write every parameter: the next forward uses what was written
        for (auto& p : a_net->parameters()) p.mul_(0.5);
        for (auto& p : b_net->parameters()) p.mul_(0.5);
    }
    a_adam.zero_grad();
    b_adam.zero_grad();
  }
  // After every update is done, the next op ends the watch; later ops outside scopes are not seen.
  b_adam.synchronize();
  EXPECT_EQ(outside_hazards(), 0);
  (void)torch::ones({1}).sum();
  EXPECT_FALSE(watching_outside_uses());
  const int64_t ops = interception_counters().ops;
  (void)torch::ones({1}).sum();
  EXPECT_EQ(interception_counters().ops, ops) << "an op outside ferry's scopes, no longer watched";
  EXPECT_GE(deferred, 6) << "host updates must be left running";
  EXPECT_GE(evictions, 3);
  EXPECT_GT(interception_counters().outside_uses, outside_before) << "ops waited for the updates";
  // The last step's write and everything before it: the same state.
  const Batch x = batch(99);
  EXPECT_TRUE(torch::equal(forward_loss(a, a_net, x),
                           forward_loss(b, b_net, x)));
  a.end_iteration();
  b.end_iteration();
  ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 8 steps"));
}

}  // namespace
}  // namespace ferry
