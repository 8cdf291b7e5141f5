// HybridAdam with its ChunkedModel between and inside iterations: using the model before step(), writes to
// parameters reaching the masters (Note [Writes to parameters]), freezing and unfreezing, several
// forwards per step, a bare loss.backward(), a write after backward(), a plain backward on the step's
// thread and ops between forward and backward (Note [Ops outside the scopes]): each against an unwrapped
// or unslipped twin, bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "../../hooks/interceptor.h"
#include "hybrid_adam_fixtures.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures

// Between backward() and step() the parameters' slots hold gradients: a forward fails naming the
// parameter (instead of computing with gradients), state_dict() refuses, zero_grad() restores the
// values, and the model trains on afterwards.
TEST(HybridAdamModel, UsingTheModelBeforeStepFailsAndZeroGradRestores) {
  torch::manual_seed(37);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2), Precision::kBf16));  // bf16: a group is 2 x 3 chunks
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(1));
  const Batch x = batch(0);
  auto train_step = [&] {
    model.backward(forward_loss(model, net, x));
    return adam.step();
  };
  ASSERT_TRUE(train_step().applied);  // warm-up, repack, placement
  std::vector<at::Tensor> values;
  for (int64_t p = 0; p < model.num_params(); ++p) values.push_back(model.param_values(p).cpu().clone());
  model.backward(forward_loss(model, net, x));
  ASSERT_TRUE(model.any_grad_in_slot());
  const std::string err = test::error_of([&] { forward_loss(model, net, x); });  // between backward() and step()
  EXPECT_NE(err.find("holds its gradient"), std::string::npos) << err;
  EXPECT_NE(err.find("accumulate_grads"), std::string::npos) << err;
  EXPECT_EQ(model.phase(), ModelPhase::kIdle);
  EXPECT_THROW(model.state_dict(), c10::Error);
  adam.zero_grad();
  EXPECT_FALSE(model.any_grad_in_slot());
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(model.param_values(p).cpu(), values[p])) << model.param_name(p);
  }
  EXPECT_THROW(adam.step(), c10::Error) << "zero_grad() discarded the gradients";
  EXPECT_TRUE(train_step().applied);
  EXPECT_EQ(adam.step_count(0), 2);
}

// Note [Writes to parameters] (hooks/chunked_model.h): what users write into parameters reaches the
// masters, so the next step updates from it, as torch's optimizers do. The unwrapped twin gets the same
// writes and is updated by ferry's CpuAdam parameter by parameter (the same kernel on the same values:
// bit-identical, D30). Writes: before the optimizer exists (pretrained weights loaded late), in place on
// every parameter, a copy_ into one, new storage for one (set_, as torch::load does), and a clamp inside
// forward; the step is the pipelined one, state split and evictions every step. Before the masters took
// writes, the first write was lost at the next step and every later loss differed.
TEST(HybridAdamModel, WritesToParametersReachTheMasters) {
  const auto nets = twins(71);
  TinyLm ref = nets.first, net = nets.second;
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  auto write = [](TinyLm& m, int kind, int step) {
    torch::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    switch (kind) {
      case 0:
        for (auto& p : m->parameters()) p.mul_(0.9);
        break;
      case 1:
        m->fc[0]->weight.copy_(torch::randn(m->fc[0]->weight.sizes(), gen) * 0.05);
        break;
      default:  // new storage, as torch::load gives it
        m->out[1]->weight.set_(torch::randn(m->out[1]->weight.sizes(), gen) * 0.05);
    }
  };
  write(ref, 0, -1);  // before HybridAdam is built: its masters start from these values
  write(net, 0, -1);
  HybridAdamOptions options(adamw());
  options.device_state_chunks = 2;
  HybridAdam adam(model, options);
  test::CpuAdamTwin ref_adam(*ref, adamw(), model.config());
  // A clamp inside forward, in both (a WGAN critic's weight clipping).
  for (TinyLm* m : {&ref, &net}) {
    TinyLm& mm = *m;
    mm->after_embedding = [&mm](const torch::Tensor& x) {
      torch::NoGradGuard no_grad;
      mm->out[0]->bias.clamp_(-0.01, 0.01);
      return x;
    };
  }
  int64_t evictions = 0;
  for (int step = 0; step < 6; ++step) {
    const Batch x = batch(step);
    const torch::Tensor loss_ref = twin_step(ref_adam, [&] { return lm_loss(ref, x.idx, x.target); });
    const torch::Tensor loss = forward_loss(model, net, x);
    adam.backward_step(loss);
    evictions += model.last_iteration().evictions;
    ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step << ": " << loss.item<double>() << " vs "
                                              << loss_ref.item<double>();
    write(ref, step % 3, step);
    write(net, step % 3, step);
  }
  EXPECT_GT(evictions, 0);
  // The last writes (new storage for out1.weight), taken in by one more step.
  const Batch x = batch(99);
  const torch::Tensor loss = forward_loss(model, net, x);
  adam.backward_step(loss);
  const torch::Tensor loss_ref = twin_step(ref_adam, [&] { return lm_loss(ref, x.idx, x.target); });
  EXPECT_TRUE(torch::equal(loss, loss_ref)) << "after the last writes";
  const auto pr = ref->named_parameters(), pn = net->named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const std::string& name = model.param_name(p);
    EXPECT_TRUE(torch::equal(adam.master(p), pr[name])) << "master of " << name;
    EXPECT_TRUE(torch::equal(pn[name], pr[name])) << name;
    EXPECT_EQ(pn[name].data_ptr(), model.param_values(p).data_ptr()) << name << " views its slot";
  }
}

// In bf16 the masters have bits the compute copy lacks: an in-place write takes over the elements it
// changed and leaves the others' masters alone; new storage of another dtype (an fp32 tensor given by
// set_data, as torch::load does from another device) gives the masters its values exactly, and the
// parameter its rounding, in its chunk again.
TEST(HybridAdamModel, Bf16WritesKeepTheBitsTheyDoNotTouch) {
  const auto nets = twins(73);
  TinyLm net = nets.second;
  ChunkedModel model(net.ptr(), sim_config(0, Precision::kBf16));
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(1));
  for (int step = 0; step < 2; ++step) {
    const Batch x = batch(step);
    adam.backward_step(forward_loss(model, net, x));
  }
  const int64_t fc = test::param_index(model, "fc0.weight"), out = test::param_index(model, "out0.weight");
  ASSERT_GE(fc, 0);
  ASSERT_GE(out, 0);
  const torch::Tensor fc_before = adam.master(fc);
  ASSERT_FALSE(torch::equal(fc_before, fc_before.to(torch::kBFloat16).to(torch::kFloat)))
      << "the masters must have bits below bf16 for the test to mean anything";
  const torch::Tensor loaded = torch::randn(net->out[0]->weight.sizes()) * 0.05;  // fp32
  {
    torch::NoGradGuard no_grad;
    net->fc[0]->weight[0].fill_(0.5);       // in place, through a view: one row
    net->out[0]->weight.set_data(loaded.clone());  // new storage and dtype (torch::load across devices)
  }
  {
    torch::NoGradGuard no_grad;  // an evaluation forward: the writes are taken in before it
    const Batch x = batch(50);
    forward_loss(model, net, x);
    model.end_iteration();
  }
  const torch::Tensor fc_after = adam.master(fc);
  EXPECT_TRUE(torch::equal(fc_after[0], torch::full_like(fc_after[0], 0.5))) << "the written row";
  EXPECT_TRUE(torch::equal(fc_after.slice(0, 1), fc_before.slice(0, 1))) << "the other rows keep their masters' bits";
  EXPECT_TRUE(torch::equal(adam.master(out), loaded)) << "an fp32 replacement gives exact masters";
  EXPECT_EQ(net->out[0]->weight.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(net->out[0]->weight, loaded.to(torch::kBFloat16)));
  EXPECT_EQ(net->out[0]->weight.data_ptr(), model.param_values(out).data_ptr()) << "back in its chunk";
  // Training goes on from there.
  const Batch x = batch(3);
  const StepResult r = adam.backward_step(forward_loss(model, net, x));
  EXPECT_TRUE(r.applied);
}

// Fine-tuning freezes and unfreezes layers while the optimizer is attached. An unfrozen parameter's
// gradients used to stay in autograd's .grad (no landing hook: hooks went only on parameters that
// required grad when the optimizer attached), so it was never updated and its .grad grew every step;
// and a parameter frozen after attaching kept a hook that outlived the model. Against the unwrapped
// twin under ferry's CpuAdam (which, as HybridAdam, skips a parameter without a gradient and takes the
// bias corrections from its own step count, D62): every loss and final master bit-identical, no .grad
// left anywhere, and after the model is gone the module trains plainly with its hooks removed.
TEST(HybridAdamModel, FreezingAndUnfreezingDuringTrainingAsTheUnwrappedTwin) {
  const auto nets = twins(77);
  TinyLm ref = nets.first, net = nets.second;
  auto set_trainable = [](torch::nn::Module& m, bool on) {
    for (auto& p : m.parameters()) p.set_requires_grad(on);
  };
  // Frozen at first: fc0, and out1, whose chunk it shares with ln_f, which lands before it in backward
  // (so with the old expectations that chunk's update would start before out1's gradient lands).
  for (torch::nn::Module* m : {ref->fc[0].get(), net->fc[0].get(), ref->out[1].get(), net->out[1].get()}) {
    set_trainable(*m, false);
  }
  {
    ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
    HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(2));
    test::CpuAdamTwin ref_adam(*ref, adamw(), model.config());
    for (int step = 0; step < 7; ++step) {
      if (step == 2) {  // unfreeze both
        for (torch::nn::Module* m : {ref->fc[0].get(), net->fc[0].get(), ref->out[1].get(), net->out[1].get()}) {
          set_trainable(*m, true);
        }
      }
      if (step == 4) {  // freeze another
        set_trainable(*ref->ln_f, false);
        set_trainable(*net->ln_f, false);
      }
      const Batch x = batch(step);
      const torch::Tensor loss_ref = twin_step(ref_adam, [&] { return lm_loss(ref, x.idx, x.target); });
      const torch::Tensor loss = forward_loss(model, net, x);
      adam.backward_step(loss);
      ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step;
      for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined()) << "step " << step << ": a .grad left";
    }
    expect_masters_as(adam, model, *ref, "after 7 steps");
  }
  // The model and its optimizer are gone: ln_f, frozen since they attached, trains plainly (a hook left
  // on it would call the destroyed model).
  set_trainable(*net->ln_f, true);
  const Batch x = batch(9);
  lm_loss(net, x.idx, x.target).backward();
  EXPECT_TRUE(net->ln_f->weight.grad().defined());
}

// Note [Several forwards] (hooks/chunked_model.cpp) with the optimizer attached: two forward() calls on
// two batches per step, one backward of their mean, stepped by backward_step (the pipelined step) and by
// backward() + step() on alternate steps, under evictions with host and device state: bit-identical to
// the unwrapped twin from the warm-up on.
TEST(HybridAdamModel, SeveralForwardsPerStepAsTheUnwrappedTwin) {
  const auto nets = twins(78);
  TinyLm ref = nets.first, net = nets.second;
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(2));
  test::CpuAdamTwin ref_adam(*ref, adamw(), model.config());
  for (int step = 0; step < 5; ++step) {
    const Batch x = batch(2 * step), y = batch(2 * step + 1);
    const torch::Tensor loss_ref = twin_step(ref_adam, [&] {
      const torch::Tensor ref_x = lm_loss(ref, x.idx, x.target);  // in this order, as the two forwards run
      return (ref_x + lm_loss(ref, y.idx, y.target)) / 2;
    });
    const torch::Tensor lx = forward_loss(model, net, x);
    const torch::Tensor ly = forward_loss(model, net, y);
    const torch::Tensor loss = (lx + ly) / 2;
    if (step % 2 == 0) {
      adam.backward_step(loss);
    } else {
      model.backward(loss);
      adam.step();
      adam.zero_grad();
    }
    ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step;
    if (step > 0) {  // once the state is placed
      EXPECT_GT(model.last_iteration().evictions, 0) << "step " << step;
    }
  }
  expect_masters_as(adam, model, *ref, "after 5 steps");
}

// `loss.backward()` in place of `model.backward(loss)` (Note [A backward not through model.backward()],
// hooks/chunked_model.cpp). It used to run: with fp16 the loss scale was never applied, so every
// gradient reached the step 65536 times too small and the iteration never ended. Now it is refused at
// the first gradient, naming the call, before anything lands; the training that follows is
// bit-identical to a twin that never made the slip.
TEST(HybridAdamModel, ABareLossBackwardIsRefusedAndTrainingGoesOnAsTheTwin) {
  const auto nets = twins(91);
  TinyLm net = nets.first, twin = nets.second;
  ChunkedModel model(net.ptr(), sim_config(budget_for(2, 1), Precision::kFp16));
  ChunkedModel twin_model(twin.ptr(), sim_config(budget_for(2, 1), Precision::kFp16));
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_max_grad_norm(1.0));
  HybridAdam twin_adam(twin_model, HybridAdamOptions(adamw()).with_max_grad_norm(1.0));
  {
    const Batch x = batch(0);
    const torch::Tensor slipped = forward_loss(model, net, x);
    const std::string err = test::error_of([&] { slipped.backward(); });
    EXPECT_NE(err.find("got a gradient from a backward that did not go through model.backward(): call "
                       "model.backward(loss) (or adam.backward_step(loss)) instead of loss.backward()"),
              std::string::npos)
        << err;
    for (int64_t p = 0; p < model.num_params(); ++p) {
      EXPECT_FALSE(model.grad_in_slot(p)) << model.param_name(p) << ": nothing of the refused backward lands";
      EXPECT_FALSE(net->named_parameters()[model.param_name(p)].grad().defined()) << model.param_name(p);
    }
    EXPECT_EQ(test::error_of([&] { adam.step(); }),
              "ferry: HybridAdam::step() found no gradients since the last zero_grad(); call "
              "model.backward(loss) first");
  }
  for (int step = 0; step < 4; ++step) {
    const Batch x = batch(step);
    const torch::Tensor loss = forward_loss(model, net, x);
    const torch::Tensor twin_loss = forward_loss(twin_model, twin, x);
    model.backward(loss);
    twin_model.backward(twin_loss);
    const StepResult r = adam.step();
    const StepResult twin_r = twin_adam.step();
    adam.zero_grad();
    twin_adam.zero_grad();
    ASSERT_TRUE(torch::equal(loss, twin_loss)) << "step " << step;
    EXPECT_EQ(r.grad_norm, twin_r.grad_norm) << "step " << step;
    EXPECT_EQ(r.loss_scale, twin_r.loss_scale) << "step " << step;
  }
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), twin_adam.master(p))) << model.param_name(p);
  }
}

// After backward() a slot holds its parameter's gradient until step(): a write then goes into the
// gradient, and step() refuses to use it, naming the parameter; zero_grad() discards both.
TEST(HybridAdamModel, AWriteAfterBackwardIsRefusedByStep) {
  torch::manual_seed(75);
  TinyLm net(kVocab, kDim);
  ChunkedModel model(net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam adam(model, HybridAdamOptions(adamw()).with_device_state_chunks(2));
  const Batch x = batch(0);
  model.backward(forward_loss(model, net, x));
  {
    torch::NoGradGuard no_grad;
    net->ln_f->weight.mul_(2.0);
  }
  const std::string err = test::error_of([&] { adam.step(); });  // a gradient a write went into
  EXPECT_NE(err.find("ln_f.weight was written after backward()"), std::string::npos) << err;
  EXPECT_EQ(adam.step_count(0), 0);
  adam.zero_grad();
  model.backward(forward_loss(model, net, x));
  EXPECT_TRUE(adam.step().applied);
}

// Note [Ops outside the scopes], the key and torch's thread-local state: a plain backward (another
// model's: a teacher, a discriminator, a probe) on the thread that ran step(), while the updates the
// step left running still run. A function in it waits for them (it holds the worker until then), so
// the watch ends inside one of autograd's nodes, which puts the key back when the node ends. With
// nothing holding that key, every later op of the thread went through the fallback as if in a scope:
// reads of parameters between steps ran their pre-use hooks outside any iteration (the scheduler saw
// accesses off its trace), and in a run with ops between forward() and backward() the next step()'s
// own chunk copies did too and failed ("holds its gradient"). Now the thread's ops after it are not
// seen at all, and the losses, the values read and the final state are bit-identical to the same
// training without the plain backward.
std::promise<void>* g_release_worker = nullptr;
HybridAdam* g_sync_adam = nullptr;
int g_hazards_seen = -1;
struct WaitForTheUpdates : torch::autograd::Function<WaitForTheUpdates> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    g_hazards_seen = static_cast<int>(outside_hazards());
    g_release_worker->set_value();
    g_sync_adam->synchronize();
    for (int i = 0; i < 10000 && outside_hazards() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return {g[0] * 2};  // the thread's first op with no hazard left: the watch ends inside this node
  }
};

TEST(HybridAdamModel, APlainBackwardOnTheStepsThreadLeavesTheModelAlone) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  const auto nets = twins(53);
  TinyLm a_net = nets.first, b_net = nets.second;
  ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 2)));
  ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 2)));
  HybridAdam a_adam(a, options), b_adam(b, options);
  torch::manual_seed(54);
  torch::nn::Linear other(8, 8);  // a plain module, trained beside the wrapped one
  int64_t deferred = 0;
  for (int step = 0; step < 6; ++step) {
    const std::string when = "step " + std::to_string(step);
    const Batch x = batch(step);
    auto train = [&](ChunkedModel& m, TinyLm& net, HybridAdam& adam, std::promise<void>* hold) {
      const torch::Tensor loss = forward_loss(m, net, x);
      m.backward(loss);
      std::shared_future<void> released;
      if (hold) {  // the worker waits for the plain backward: the updates queued behind it are still to run
        released = hold->get_future().share();
        adam.run_on_worker([released] { released.wait(); });
      }
      const StepResult r = adam.step();
      adam.zero_grad();
      return std::make_pair(r, loss.detach());
    };
    const auto [ra, la] = train(a, a_net, a_adam, nullptr);
    std::promise<void> hold;
    const auto [rb, lb] = train(b, b_net, b_adam, &hold);
    ASSERT_TRUE(torch::equal(la, lb)) << when << ": the loss";
    deferred += rb.deferred_chunks;
    // The plain model's training step on the same thread.
    g_release_worker = &hold;
    g_sync_adam = &b_adam;
    g_hazards_seen = -1;
    const torch::Tensor in = torch::randn({4, 8}, torch::requires_grad());
    WaitForTheUpdates::apply(other->forward(in)).pow(2).sum().backward();
    if (g_hazards_seen < 0) hold.set_value();  // the function did not run: never leave the worker waiting
    g_release_worker = nullptr;
    if (rb.deferred_chunks > 0) {
      EXPECT_GT(g_hazards_seen, 0) << when << ": the updates must still run then";
    }
    EXPECT_EQ(outside_hazards(), 0) << when;
    other->zero_grad();
    // Reads between steps, on the same thread: plain ops, not seen at all (the key is off).
    auto a_params = a_net->named_parameters(), b_params = b_net->named_parameters();
    const int64_t ops = interception_counters().ops;
    for (const auto& item : a_params) {
      EXPECT_TRUE(torch::equal(b_params[item.key()].clone(), item.value())) << when << ": " << item.key();
    }
    EXPECT_EQ(interception_counters().ops, ops) << when << ": the thread's ops went through the fallback";
  }
  EXPECT_GT(deferred, 0) << "the steps should leave host updates running";
  ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 6 steps"));
}

// Note [Between forward and backward]: between forward() and backward() the thread that ran forward()
// watches, and its ops on parameters are uses; ferry's own calls there are not (OwnOps). The common
// `loss = forward; opt.zero_grad(); loss.backward(); opt.step()` order, backward_step() on a forward's
// loss, (with accumulated gradients) the step after a forward under grad mode whose backward never
// comes, and an evaluation forward followed by reads and a checkpoint: the same losses and final state,
// bit for bit, as the same training with those calls between iterations. An optimizer destroyed after
// an evaluation forward detaches from the model (it did not: the model's destructor called the dead
// optimizer; the sanitizer build caught it).
TEST(HybridAdamModel, OptimizerCallsBetweenForwardAndBackwardAreNotUses) {
  for (bool accumulate : {false, true}) {
    SCOPED_TRACE(accumulate ? "accumulate_grads" : "grads in the slots");
    HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
    options.device_state_chunks = 1;
    options.accumulate_grads = accumulate;
    const auto nets = twins(61);
    TinyLm a_net = nets.first, b_net = nets.second;
    ChunkedModel a(a_net.ptr(), sim_config(budget_for(3, 1, accumulate ? 4 : 3)));
    ChunkedModel b(b_net.ptr(), sim_config(budget_for(3, 1, accumulate ? 4 : 3)));
    HybridAdam a_adam(a, options), b_adam(b, options);
    const std::string dir = temp_dir("between");
    for (int step = 0; step < 6; ++step) {
      const std::string when = "step " + std::to_string(step);
      const Batch x = batch(step);
      auto loss_a = [&] { return lm_loss(a_net, x.idx, x.target); };
      auto loss_b = [&] { return lm_loss(b_net, x.idx, x.target); };
      // a: every optimizer call between iterations.
      a_adam.zero_grad();
      if (accumulate) a.backward(a.forward(loss_a));  // a first micro-batch
      const torch::Tensor la = a.forward(loss_a);
      if (step % 2 == 0) {
        a.backward(la);
        a_adam.step();
      } else {
        a_adam.backward_step(la);
      }
      // b: zero_grad() and backward_step() between forward() and backward().
      if (accumulate) {
        const torch::Tensor first = b.forward(loss_b);
        b_adam.zero_grad();
        b.backward(first);
      }
      const torch::Tensor lb = b.forward(loss_b);
      if (!accumulate) b_adam.zero_grad();
      if (step % 2 == 0) {
        b.backward(lb);
        // With accumulated gradients (they left the slots): a validation forward under grad mode, as many
        // loops run it, whose backward never comes, then the step: ferry's own ops while the thread watches.
        if (accumulate) (void)b.forward(loss_b);
        const int64_t uses = interception_counters().ops_with_params;
        b_adam.step();  // its chunk copies are ferry's own ops, never uses (they were, without OwnOps)
        EXPECT_EQ(interception_counters().ops_with_params, uses) << when;
      } else {
        b_adam.backward_step(lb);
      }
      ASSERT_TRUE(torch::equal(la, lb)) << when << ": the loss";
      // An evaluation forward, then reads and a checkpoint before the next training forward.
      torch::NoGradGuard no_grad;
      const torch::Tensor ea = a.forward(loss_a);
      a.end_iteration();
      const torch::Tensor eb = b.forward(loss_b);
      EXPECT_TRUE(torch::equal(ea, eb)) << when << ": the evaluation";
      EXPECT_TRUE(torch::equal(b_adam.master(0), a_adam.master(0))) << when;
      EXPECT_TRUE(torch::equal(b.param_values(0).clone(), a.param_values(0))) << when;
      if (step == 3) b_adam.save(dir);
    }
    ASSERT_NO_FATAL_FAILURE(test::expect_same_state(a_adam, b_adam, a, b, "after 6 steps"));
    remove_checkpoint(dir);
  }
}

}  // namespace
}  // namespace ferry
