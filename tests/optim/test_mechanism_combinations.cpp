// The mechanisms change no bit, in any combination (a property test over HybridAdam's options).
//
// Each mechanism of the optimizer is tested on its own elsewhere against the same run without it: where
// the state lives and how much of it (test_state_placement), evictions under a tight budget
// (test_hybrid_adam), the pipelined step (test_pipelined_step), updates behind the next forward and the
// carry-over (test_deferred_updates, test_host_jobs), round trips through K buffers (test_round_trips),
// copies that stay pending as on a CUDA stream, checkpoints (test_checkpoint_files). Here they are drawn
// together: for each seed, the semantics (precision, state format, clipping, micro-batches, fp16 loss
// scaling) and, independently, the mechanisms (device state chunks, budget, step mode, update behind
// forward, carry-over with the worker held so that it is taken, a worker held until the next forward has
// begun (WorkerLag: a missing wait is then seen at any thread count), round-trip slots, lagging copies), and
// a run of six steps is compared with a reference of the same semantics and none of the mechanisms (every
// chunk and all state on the device, backward() + step()): the loss of every forward, what each step
// reports, and in the end every master, moment and parameter bit for bit; between two steps, what a
// training loop does (an evaluation forward, an in-place write to a parameter, a read of the state, a new
// lr), the same in both. In half of the cases the blocks are ferry::checkpoint segments (semantics:
// the reference's too, recomputed), and the activation policy (recompute, keep, auto; a capacity; the
// joint placement of state) is one more mechanism: a segment's gradients land together after its
// recompute, through the scheduler (D100), where the budget, the copies, the round trips and the host
// updates meet them. In half of the cases the run
// saves a checkpoint after its third step and goes on in a model and optimizer built afresh, from other
// initial values, with mechanisms drawn again. A failure names the seed and the whole draw.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <sstream>
#include <string>

#include "../../chunk/stream_model_engine.h"
#include "../seeds.h"
#include "hybrid_adam_fixtures.h"
#include "same_state.h"

namespace ferry::test {
namespace {

// What the result must not depend on.
struct Mechanisms {
  int64_t device_state_chunks = -1;
  bool tight = false;            // a budget of 3 parameter chunks beside the device state: evictions
  bool pipelined = false;        // backward_step(loss); else backward() + step()
  bool behind_forward = true;    // update_behind_forward
  bool carry_over = true;        // carry_over_host_updates
  bool hold_worker = false;      // pipelined: the worker held through backward, so the carry-over is taken
  bool lagging_worker = false;   // the worker held from before each step until the next forward has begun
  int64_t round_trip_slots = 0;
  bool lagging_copies = false;   // copies pending until waited for (StreamModelCopyEngine)
  int warmup_iterations = 1;     // the scheduler's: iterations traced before the trace is followed
  int prefetch_depth = 2;        // 0: no prefetch
  bool repack = true;            // repack the parameters in first-use order after the warm-up
  // Checkpointed blocks only: which segments keep their activations, and the state placed with them.
  ActivationPolicy activations = ActivationPolicy::kRecompute;
  int64_t capacity_over_budget = -1;  // the device's capacity, beside the budget (-1: unknown)
  bool joint = false;                 // plan_state_with_activations (auto, device_state_chunks -1)
};

// What the result depends on: the same in the run and its reference.
struct Semantics {
  Precision precision = Precision::kBf16;
  StateFormat format = StateFormat::kFp32;
  double max_grad_norm = 0;
  int micro_batches = 1;
  bool frozen = false;       // fc0's bias does not train (requires_grad off from the start)
  bool extra = false;        // a parameter 'extra' that only the even steps use: its gradient lands last
  bool checkpointed = false; // each block a ferry::checkpoint segment: its gradients land after its recompute
};

std::string describe(const Semantics& s) {
  std::ostringstream o;
  o << to_string(s.precision) << " compute, " << to_string(s.format) << " state, clipping at " << s.max_grad_norm
    << ", " << s.micro_batches << " micro-batch(es), frozen bias " << s.frozen << ", even-step parameter "
    << s.extra << (s.checkpointed ? ", checkpointed blocks" : "");
  return o.str();
}

std::string describe(const Mechanisms& m) {
  std::ostringstream o;
  o << "device_state_chunks " << m.device_state_chunks << (m.tight ? ", tight budget" : ", room for all")
    << (m.pipelined ? ", backward_step" : ", backward + step") << ", behind forward " << m.behind_forward
    << ", carry-over " << m.carry_over << ", worker held " << m.hold_worker << ", worker lags "
    << m.lagging_worker << ", " << m.round_trip_slots
    << " round-trip slot(s), lagging copies " << m.lagging_copies << ", warm-up " << m.warmup_iterations
    << ", prefetch " << m.prefetch_depth << ", repack " << m.repack;
  if (m.activations != ActivationPolicy::kRecompute || m.capacity_over_budget >= 0) {
    o << ", activations " << to_string(m.activations) << (m.joint ? " with the joint placement" : "")
      << ", capacity budget + " << m.capacity_over_budget << " B";
  }
  return o.str();
}

Semantics draw_semantics(std::mt19937& rng) {
  Semantics s;
  const Precision precisions[] = {Precision::kFp32, Precision::kBf16, Precision::kFp16};
  s.precision = precisions[rng() % 3];
  // The compact state needs a 16-bit compute copy (its master is the bf16 copy's complement).
  s.format = s.precision != Precision::kFp32 && rng() % 2 ? StateFormat::kCompact : StateFormat::kFp32;
  s.max_grad_norm = rng() % 2 ? 0.05 : 0.0;  // 0.05: most steps clip (test_pipelined_step)
  s.micro_batches = rng() % 3 == 0 ? 2 : 1;
  s.frozen = rng() % 4 == 0;
  s.extra = rng() % 4 == 0;
  return s;
}

// Holding the worker through a step is only possible where the step does not wait for its host updates:
// the eager backward_step that carries them over (no clipping, no fp16 loss scaling, no micro-batches,
// updates behind forward), with the same parameters used in every step. Elsewhere the step waits for
// them, and the hold would never end: with 'extra', used by even steps only, a gradient the counts of
// the step before did not foresee lands in a chunk whose update is queued, and waits for that update
// (Note [A chunk final before its last use]). Nor under the joint placement, drawn later: draw_activations
// clears the hold there.
bool may_hold_worker(const Semantics& s, const Mechanisms& m) {
  return m.pipelined && m.carry_over && m.behind_forward && s.max_grad_norm == 0 &&
         s.precision != Precision::kFp16 && s.micro_batches == 1 && !s.extra;
}

Mechanisms draw_mechanisms(std::mt19937& rng, const Semantics& s) {
  Mechanisms m;
  const int64_t counts[] = {-1, 0, 1, 2};
  m.device_state_chunks = counts[rng() % 4];
  m.tight = rng() % 2;
  m.pipelined = rng() % 2;
  m.behind_forward = rng() % 2;
  m.carry_over = rng() % 2;
  if (rng() % 3 == 0) {  // the carry-over taken, where the semantics allow it: rare by independent draws
    m.pipelined = m.behind_forward = m.carry_over = true;
  }
  m.hold_worker = may_hold_worker(s, m) && rng() % 4 != 0;
  m.round_trip_slots = static_cast<int64_t>(rng() % 3);
  m.lagging_copies = rng() % 2;
  m.warmup_iterations = rng() % 3 == 0 ? 2 : 1;
  m.prefetch_depth = rng() % 3 == 0 ? 0 : 2;
  m.repack = rng() % 4 != 0;
  // Where the step itself waits for the worker (backward_step without the carry-over taken), a hold
  // would only end at its deadline, and what the step queues after that wait would run unheld.
  m.lagging_worker = m.behind_forward && (!m.pipelined || may_hold_worker(s, m)) && rng() % 2 == 0;
  return m;
}

// The activation side, for checkpointed blocks, from a generator of its own (the draws of the cases
// without checkpointed blocks stay as they were before these were added).
void draw_activations(std::mt19937& rng, const Semantics& s, Mechanisms& m) {
  if (!s.checkpointed) return;
  const ActivationPolicy policies[] = {ActivationPolicy::kRecompute, ActivationPolicy::kKeep, ActivationPolicy::kAuto,
                                       ActivationPolicy::kAuto};
  m.activations = policies[rng() % 4];
  const int64_t over[] = {-1, 0, 48 << 10, 4 << 20};  // unknown, no room, some segments, every segment
  m.capacity_over_budget = over[rng() % 4];
  m.joint = m.activations == ActivationPolicy::kAuto && m.device_state_chunks < 0 && rng() % 2;
  // The joint placement's solves settle the running host updates first (Engine::place_jointly_if_due_locked):
  // a step where one may come waits for the worker, so a hold through it would never end (the soak's
  // case 479 hung so; D109).
  if (m.joint) m.hold_worker = false;
}

HybridAdamOptions options_for(const Semantics& s, const Mechanisms& m) {
  HybridAdamOptions o = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  o.max_grad_norm = s.max_grad_norm;
  o.accumulate_grads = s.micro_batches > 1;
  o.state_format = s.format;
  o.loss_scaler.initial_scale = 65536.0;  // fp16: the first steps overflow and are skipped
  o.loss_scaler.hysteresis = 1;
  o.device_state_chunks = m.device_state_chunks;
  o.update_behind_forward = m.behind_forward;
  o.carry_over_host_updates = m.carry_over;
  o.round_trip_slots = m.round_trip_slots;
  o.plan_state_with_activations = m.joint;
  return o;
}

Config config_for(const Semantics& s, const Mechanisms& m) {
  const int64_t roles = s.micro_batches > 1 ? 4 : 3;  // fp32 state chunks per group (upper bound for compact)
  // A 16-bit parameter chunk holds twice the elements of an fp32 one: its group's fp32 chunks are twice
  // the size.
  const int64_t per_group = s.precision == Precision::kFp32 ? 1 : 2;
  const int64_t on_device = m.device_state_chunks < 0 ? 1 : m.device_state_chunks;
  Config c =
      sim_config(m.tight ? budget_for(3, per_group * on_device, roles) : budget_for(64, 128, roles), s.precision);
  c.activations = m.activations;
  c.device_capacity_bytes = m.capacity_over_budget < 0 ? 0 : c.device_budget_bytes + m.capacity_over_budget;
  c.validate();
  return c;
}

ChunkedModelOptions model_options_for(const Mechanisms& m) {
  ChunkedModelOptions o;
  o.scheduler.warmup_iterations = m.warmup_iterations;
  o.scheduler.prefetch_depth = m.prefetch_depth;
  o.repack_after_warmup = m.repack;
  if (m.lagging_copies) o.copy_engine = [] { return std::make_unique<StreamModelCopyEngine>(); };
  return o;
}

// A TinyLm wrapped with its optimizer, under given semantics and mechanisms.
struct Trainee {
  Trainee(uint64_t seed, const Semantics& s, const Mechanisms& mech)
      : net([&] {
          torch::manual_seed(seed);
          TinyLm n(kVocab, kDim);
          if (s.frozen) n->fc[0]->bias.set_requires_grad(false);
          n->checkpointed = s.checkpointed;
          if (s.extra) {
            torch::Tensor extra = n->register_parameter("extra", torch::randn({kDim}) * 0.1);
            n->after_embedding = [this, extra](const torch::Tensor& x) { return use_extra ? x + extra : x; };
          }
          return n;
        }()),
        mechanisms(mech),
        model(net.ptr(), config_for(s, mech), model_options_for(mech)),
        adam(model, options_for(s, mech)) {}

  // One step on batch `step`, in micro-batches; returns the last micro-batch's loss and the step's report.
  std::pair<torch::Tensor, StepResult> step(int step, int micro_batches) {
    use_extra = step % 2 == 0;
    torch::Tensor loss;
    lag.begun();
    for (int k = 0; k + 1 < micro_batches; ++k) {
      loss = forward_loss(model, net, batch(100 * step + k), micro_batches);
      model.backward(loss);
    }
    loss = forward_loss(model, net, batch(100 * step + micro_batches - 1), micro_batches);
    const torch::Tensor seen = loss.detach().clone();
    StepResult r;
    if (mechanisms.lagging_worker) lag.hold(adam);
    if (mechanisms.pipelined) {
      r = with_worker_held(adam, mechanisms.hold_worker, [&] { return adam.backward_step(loss); });
    } else {
      model.backward(loss);
      r = adam.step();
    }
    adam.zero_grad();
    return {seen, r};
  }

  bool use_extra = false;  // read by the forward of a net with 'extra'; before net, which captures it
  TinyLm net;
  Mechanisms mechanisms;
  ChunkedModel model;
  HybridAdam adam;
  WorkerLag lag;
};

// What a training loop does between two steps, the same in both runs (drawn from a generator of its
// own, so that the draws above stay as they were).
enum class Between { kNothing, kEvaluate, kWrite, kReadState, kSetLr };
const char* to_string(Between b) {
  switch (b) {
    case Between::kNothing: return "nothing";
    case Between::kEvaluate: return "an evaluation forward";
    case Between::kWrite: return "an in-place write to fc1's bias";
    case Between::kReadState: return "state_dict()";
    case Between::kSetLr: return "set_lr";
  }
  return "?";
}

// Does `what` on both runs before step `step`; the evaluation's losses and the state read must agree.
void between_steps(Between what, int step, Trainee& reference, Trainee& run) {
  const std::string at = std::string(to_string(what)) + " before step " + std::to_string(step);
  switch (what) {
    case Between::kNothing:
      return;
    case Between::kEvaluate: {
      torch::NoGradGuard no_grad;
      // Both nets take the path of the coming step: a run resumed from a checkpoint has run no step of its
      // own, so its flag need not be the reference's (the soak's cases 485, 811, ...: D109).
      reference.use_extra = run.use_extra = step % 2 == 0;
      const Batch x = batch(900 + step);
      const torch::Tensor want = forward_loss(reference.model, reference.net, x);
      run.lag.begun();
      const torch::Tensor got = forward_loss(run.model, run.net, x);
      ASSERT_TRUE(torch::equal(want, got)) << at;
      return;
    }
    case Between::kWrite: {
      torch::NoGradGuard no_grad;
      reference.net->fc[1]->bias.mul_(0.5);
      run.net->fc[1]->bias.mul_(0.5);
      return;
    }
    case Between::kReadState: {
      const NamedTensors want = reference.adam.state_dict(), got = run.adam.state_dict();
      ASSERT_EQ(want.size(), got.size()) << at;
      for (size_t k = 0; k < want.size(); ++k) {
        ASSERT_TRUE(torch::equal(want[k].second.cpu(), got[k].second.cpu())) << at << ": " << want[k].first;
      }
      return;
    }
    case Between::kSetLr:
      reference.adam.set_lr(4e-3);
      run.adam.set_lr(4e-3);
      return;
  }
}

class MechanismCombinations : public ::testing::TestWithParam<int> {};

TEST_P(MechanismCombinations, ChangeNoBitAgainstTheRunWithoutThem) {
  std::mt19937 rng(static_cast<uint32_t>(7919 * GetParam() + 17));
  Semantics semantics = draw_semantics(rng);
  Mechanisms first = draw_mechanisms(rng, semantics);
  const bool resume = rng() % 2;
  Mechanisms second = draw_mechanisms(rng, semantics);
  std::mt19937 activations_rng(static_cast<uint32_t>(104723 * GetParam() + 29));
  semantics.checkpointed = activations_rng() % 2;
  draw_activations(activations_rng, semantics, first);
  draw_activations(activations_rng, semantics, second);
  std::mt19937 between_rng(static_cast<uint32_t>(31 * GetParam() + 5));
  const Between between = static_cast<Between>(between_rng() % 5);
  const int between_at = 1 + static_cast<int>(between_rng() % 5);
  const std::string drawn = "case " + std::to_string(GetParam()) + ": " + describe(semantics) + "; " +
                            describe(first) +
                            (resume ? "; resumed after step 2 with " + describe(second) : std::string()) + "; " +
                            to_string(between) + " before step " + std::to_string(between_at);
  std::printf("%s\n", drawn.c_str());
  std::fflush(stdout);
  SCOPED_TRACE(drawn);

  Mechanisms none;  // the reference: every chunk and all state on the device, backward() + step()
  none.behind_forward = false;
  none.carry_over = false;
  Trainee reference(51, semantics, none);
  auto run = std::make_unique<Trainee>(51, semantics, first);
  const std::string dir = resume ? temp_dir("mechanisms") : std::string();
  int64_t applied = 0, clipped = 0, overflows = 0;
  // Checkpointed: room after the warm-up for auto's measuring iteration, its plan and (joint) the
  // state's placement with it, also in a run resumed after step 2.
  const int kSteps = semantics.checkpointed ? 9 : 6;
  for (int step = 0; step < kSteps; ++step) {
    if (step == between_at) {
      ASSERT_NO_FATAL_FAILURE(between_steps(between, step, reference, *run));
    }
    const auto [want_loss, want] = reference.step(step, semantics.micro_batches);
    const auto [got_loss, got] = run->step(step, semantics.micro_batches);
    const std::string at = "step " + std::to_string(step);
    ASSERT_TRUE(torch::equal(want_loss, got_loss)) << at << ": the forward saw other parameters ("
                                                   << want_loss.item<double>() << " against "
                                                   << got_loss.item<double>() << ")";
    ASSERT_EQ(want.applied, got.applied) << at;
    ASSERT_EQ(want.overflow, got.overflow) << at;
    ASSERT_EQ(want.clip_coef, got.clip_coef) << at;
    ASSERT_EQ(want.loss_scale, got.loss_scale) << at;
    applied += want.applied;
    clipped += want.clip_coef < 1.0;
    overflows += want.overflow;
    if (resume && step == 2) {
      run->adam.save(dir);
      run = std::make_unique<Trainee>(52, semantics, second);  // other initial values: the checkpoint's must win
      run->adam.load(dir);
    }
  }
  reference.adam.synchronize();
  run->adam.synchronize();
  ASSERT_NO_FATAL_FAILURE(expect_same_state(reference.adam, run->adam, reference.model, run->model, "the end"));
  EXPECT_GT(applied, 0);
  if (semantics.max_grad_norm > 0) {
    EXPECT_GT(clipped, 0) << "the clipping must be exercised";
  }
  if (semantics.precision == Precision::kFp16) {
    EXPECT_GT(overflows, 0) << "the overflow path must be exercised";
  }
  if ((resume ? second : first).activations == ActivationPolicy::kAuto) {
    EXPECT_GT(run->model.activations().plans(), 0) << "auto plans after its measuring iteration";
  }
  if (resume) remove_checkpoint(dir);
}

INSTANTIATE_TEST_SUITE_P(Seeds, MechanismCombinations, ferry::test::seeds(160));

}  // namespace
}  // namespace ferry::test
