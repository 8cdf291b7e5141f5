// HybridAdam on autograd graphs that cross wrapped models or nest backwards: two models trained as a GAN,
// an encoder checkpointed in two forwards, a reentrant checkpoint of one's own (refused), a sparse
// gradient (refused), two halves on one joint backward, a gradient penalty before more forwards: each
// under evictions, bit-identical to the unwrapped twins.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "../../hooks/checkpoint.h"
#include "hybrid_adam_fixtures.h"
#include "wrapped_perceptron.h"

namespace ferry {
namespace {

using namespace test;  // NOLINT: the fixtures


// Two wrapped models whose graphs cross, as a GAN trains them: the discriminator's step on real and
// generated (detached) samples, then the generator's step through the discriminator, whose forward
// waits for no backward of its own (its gradients land in its slots from the generator's backward and
// are discarded, as optimizer.zero_grad() does; or it is frozen for that step). Each under evictions,
// with its own HybridAdam: bit-identical to the unwrapped twins.
TEST(HybridAdamGraphs, TwoWrappedModelsTrainAsAGanAsTheirTwins) {
  for (const bool freeze_d : {false, true}) {
    WrappedPerceptron gen(1, 8, 40, 16), dis(2, 16, 40, 1);
    auto bce = [](const torch::Tensor& logits, float target) {
      return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, target));
    };
    auto set_trainable = [](torch::nn::Module& m, bool on) {
      for (auto& p : m.parameters()) p.set_requires_grad(on);
    };
    for (int step = 0; step < 4; ++step) {
      const std::string what = std::string(freeze_d ? "frozen" : "discarded") + " D, step " + std::to_string(step);
      torch::manual_seed(100 + step);
      const torch::Tensor z = torch::randn({4, 8}), real = torch::randn({4, 16});
      dis.twin.zero_grad();
      const torch::Tensor ref_real = dis.ref->forward(real);  // in the order the wrapped step runs them
      const torch::Tensor loss_d_ref = bce(ref_real, 1) + bce(dis.ref->forward(gen.ref->forward(z).detach()), 0);
      loss_d_ref.backward();
      dis.twin.step();
      gen.twin.zero_grad();
      if (freeze_d) set_trainable(*dis.ref, false);
      const torch::Tensor loss_g_ref = bce(dis.ref->forward(gen.ref->forward(z)), 1);
      loss_g_ref.backward();
      gen.twin.step();
      set_trainable(*dis.ref, true);

      torch::Tensor fake;
      {
        torch::NoGradGuard no_grad;
        fake = gen.model.forward([&] { return gen.net->forward(z); });
        gen.model.end_iteration();
      }
      const torch::Tensor loss_d = dis.model.forward([&] {
        const torch::Tensor on_real = dis.net->forward(real);
        return bce(on_real, 1) + bce(dis.net->forward(fake), 0);
      });
      dis.adam.backward_step(loss_d);
      if (freeze_d) set_trainable(*dis.net, false);
      const torch::Tensor generated = gen.model.forward([&] { return gen.net->forward(z); });
      const torch::Tensor loss_g = dis.model.forward([&] { return bce(dis.net->forward(generated), 1); });
      gen.model.backward(loss_g);
      gen.adam.step();
      if (!freeze_d) dis.adam.zero_grad();
      set_trainable(*dis.net, true);
      ASSERT_TRUE(torch::equal(loss_d, loss_d_ref)) << what;
      ASSERT_TRUE(torch::equal(loss_g, loss_g_ref)) << what;
    }
    for (WrappedPerceptron* w : {&gen, &dis}) {
      w->expect_masters_as_twin(freeze_d ? "frozen D" : "discarded D");
      EXPECT_GT(w->model.last_iteration().evictions, 0) << "the budget forces evictions";
    }
  }
}

// The twin's loss of two inputs, each squared and summed, one backward: a step of the unwrapped twin.
torch::Tensor twin_two_inputs(WrappedPerceptron& w, const torch::Tensor& x1, const torch::Tensor& x2) {
  return twin_step(w.twin, [&] {
    const torch::Tensor first = w.ref->forward(x1).pow(2).sum();
    return first + w.ref->forward(x2).pow(2).sum();
  });
}

// The same loss through the wrapped model, in two forwards, each input through the whole perceptron
// in a ferry::checkpoint segment of its own; then backward_step.
torch::Tensor checkpointed_two_inputs_step(WrappedPerceptron& w, const torch::Tensor& x1, const torch::Tensor& x2) {
  auto checkpointed = [&](const torch::Tensor& x) {
    return checkpoint([&](const std::vector<at::Tensor>& in) { return w.net->forward(in[0]); }, {x}).pow(2).sum();
  };
  const torch::Tensor first = w.model.forward([&] { return checkpointed(x1); });
  const torch::Tensor loss = first + w.model.forward([&] { return checkpointed(x2); });
  w.adam.backward_step(loss);
  return loss;
}

// One encoder checkpointed in two forwards before one backward: its parameters are in two
// ferry::checkpoint segments. The second segment's nested backward used to land their gradients in
// their slots before the first segment's recompute needed the values (refused). Now each segment hands
// its parameters' gradients to the outer backward (Note [Checkpoint parameters as inputs]), which lands
// each once: bit-identical to the twin without checkpointing, under evictions, with backward_step.
TEST(HybridAdamGraphs, AnEncoderCheckpointedInTwoForwardsTrainsAsTheTwin) {
  WrappedPerceptron w(2, 16, 40, 4);  // 8 KiB chunks, two of them, a budget of one
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(20 + step);
    const torch::Tensor x1 = torch::randn({4, 16}), x2 = torch::randn({4, 16});
    const torch::Tensor loss_ref = twin_two_inputs(w, x1, x2);
    ASSERT_TRUE(torch::equal(checkpointed_two_inputs_step(w, x1, x2), loss_ref)) << "step " << step;
    EXPECT_GT(w.model.last_iteration().evictions, 0) << "step " << step;
  }
  w.expect_masters_as_twin("after 4 steps");
}

// An activation checkpoint of the user's own, reentrant as ferry's used to be: backward recomputes the
// perceptron and runs a nested backward, which accumulates the parameters' gradients there.
struct ReentrantCheckpoint : torch::autograd::Function<ReentrantCheckpoint> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, PerceptronImpl* net) {
    ctx->saved_data["net"] = reinterpret_cast<int64_t>(net);
    ctx->save_for_backward({x});
    return net->forward(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto* net = reinterpret_cast<PerceptronImpl*>(ctx->saved_data["net"].toInt());
    const torch::Tensor x = ctx->get_saved_variables()[0].detach();
    torch::Tensor out;
    {
      at::AutoGradMode grad_on(true);
      out = net->forward(x);
    }
    torch::autograd::backward({out}, {grad_out[0]});
    return {torch::Tensor(), torch::Tensor()};
  }
};

// Such a checkpoint in two forwards: the first segment's recompute meets parameters whose gradients the
// second segment's nested backward landed. Refused naming the cause and ferry::checkpoint; nothing is
// lost: after zero_grad() training goes on (with ferry::checkpoint) bit-identical to the twin.
TEST(HybridAdamGraphs, AParameterUsedAfterANestedBackwardLandedItsGradientIsRefused) {
  WrappedPerceptron w(3, 16, 40, 4, sim_config(0));
  torch::manual_seed(30);
  const torch::Tensor x1 = torch::randn({4, 16}), x2 = torch::randn({4, 16});
  const std::string err = test::error_of([&] {
    // Inputs that require grad, so the node's output does (the parameters are not its inputs).
    const torch::Tensor in1 = x1.clone().requires_grad_(true), in2 = x2.clone().requires_grad_(true);
    const torch::Tensor a = w.model.forward([&] { return ReentrantCheckpoint::apply(in1, w.net.get()).pow(2).sum(); });
    const torch::Tensor b = w.model.forward([&] { return ReentrantCheckpoint::apply(in2, w.net.get()).pow(2).sum(); });
    w.adam.backward_step(a + b);
  });
  EXPECT_NE(err.find("its chunk slot holds its gradient, which landed earlier in this backward"), std::string::npos)
      << err;
  EXPECT_NE(err.find("a nested backward accumulated it (an activation checkpoint of one's own"), std::string::npos)
      << err;
  w.adam.zero_grad();
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor loss_ref = twin_two_inputs(w, x1, x2);
    ASSERT_TRUE(torch::equal(checkpointed_two_inputs_step(w, x1, x2), loss_ref)) << "step " << step;
  }
  w.expect_masters_as_twin("after 3 steps");
}

// A bag of words whose embedding may give sparse gradients (nn::EmbeddingOptions::sparse).
struct BagOfWordsImpl : torch::nn::Module {
  explicit BagOfWordsImpl(bool sparse) {
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(kVocab, kDim).sparse(sparse)));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor loss(const Batch& x) {
    return torch::nn::functional::cross_entropy(head(emb(x.idx)).reshape({-1, kVocab}), x.target.reshape({-1}));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(BagOfWords);

// Sparse gradients, which no Adam takes (torch's refuses them too), fail the backward naming the
// parameter and the remedy; nothing is updated; the next forward names zero_grad() as the way to drop
// what landed before the failure, and after it, with the embedding dense, training goes on
// bit-identical to the twin that was dense from the start (the refused gradient used to stay in .grad,
// where autograd summed it into the next backward's: the first step then differed by 7e-6).
TEST(HybridAdamGraphs, ASparseGradientIsRefusedNamingTheRemedyAndNothingChanges) {
  torch::manual_seed(5);
  BagOfWords ref(/*sparse=*/false);
  torch::manual_seed(5);
  BagOfWords net(/*sparse=*/true);
  ChunkedModel model(net.ptr(), sim_config(budget_for(1, 1)));
  HybridAdam adam(model, adamw());
  test::CpuAdamTwin ref_adam(*ref, adamw(), model.config());
  const std::string err = test::error_of([&] { adam.backward_step(model.forward([&] { return net->loss(batch(0)); })); });
  EXPECT_NE(err.find("parameter emb.weight got a Sparse one"), std::string::npos) << err;
  EXPECT_NE(err.find("build it with sparse(false)"), std::string::npos) << err;
  net->emb->options.sparse(false);
  // The head's gradient had landed in its slot before the embedding's was refused.
  const std::string again = test::error_of([&] { model.forward([&] { return net->loss(batch(0)); }); });
  EXPECT_NE(again.find("parameter head.weight is used, but its chunk slot holds its gradient since its backward "
                       "(Note [Gradient in the parameter slot]), which failed: the optimizer's zero_grad() discards"),
            std::string::npos)
      << again;
  adam.zero_grad();
  for (int step = 0; step < 3; ++step) {
    const torch::Tensor loss_ref = twin_step(ref_adam, [&] { return ref->loss(batch(step)); });
    const torch::Tensor loss = model.forward([&] { return net->loss(batch(step)); });
    adam.backward_step(loss);
    ASSERT_TRUE(torch::equal(loss, loss_ref)) << "step " << step;
  }
  expect_masters_as(adam, model, *ref, "after 3 steps");
  EXPECT_EQ(adam.param_step_count(0), 3) << "the refused step counted no update";
}

// An encoder and a decoder wrapped each in its own ChunkedModel with its own HybridAdam, trained on
// one joint loss backwarded through either model's backward(): the other model's gradients land from
// that backward (not refused, D66), both steps apply them, and the other model's iteration ends at its
// next forward (Note [Several forwards]: a backward that freed the graph ran through its output).
// Under evictions, bit-identical to the unwrapped pair.
TEST(HybridAdamGraphs, TwoWrappedHalvesTrainOnOneJointBackwardAsTheirTwins) {
  for (const bool through_decoder : {true, false}) {
    const std::string how = through_decoder ? "decoder.backward(loss)" : "encoder.backward(loss)";
    WrappedPerceptron enc(3, 16, 40, 8), dec(4, 8, 40, 16);
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(300 + step);
      const torch::Tensor x = torch::randn({4, 16});
      enc.twin.zero_grad();
      dec.twin.zero_grad();
      torch::mse_loss(dec.ref->forward(enc.ref->forward(x)), x).backward();
      enc.twin.step();
      dec.twin.step();
      const torch::Tensor z = enc.model.forward([&] { return enc.net->forward(x); });
      const torch::Tensor y = dec.model.forward([&] { return dec.net->forward(z); });
      const torch::Tensor loss = torch::mse_loss(y, x);
      (through_decoder ? dec.model : enc.model).backward(loss);
      enc.adam.step();
      dec.adam.step();
      enc.adam.zero_grad();
      dec.adam.zero_grad();
    }
    enc.model.end_iteration();
    dec.model.end_iteration();
    EXPECT_EQ(enc.model.scheduler().iterations(), 4) << how;
    EXPECT_EQ(dec.model.scheduler().iterations(), 4) << how;
    enc.expect_masters_as_twin(how);
    dec.expect_masters_as_twin(how);
  }
}

// A WGAN-GP critic computes its gradient penalty first: a forward on the interpolates, then
// autograd::grad with create_graph through that forward's output, then the forwards on real and
// generated samples, then one backward. The penalty's backward runs through the first forward's
// output node but keeps the graph, so the iteration must go on (Note [Several forwards]: only a
// backward that frees the graph counts); counting it ended the iteration at the next forward, and
// the warm-up's repack broke the final backward ("setStorage ... out of bounds"). Under evictions,
// bit-identical to the twin, one iteration per step. The same with the critic's first two layers
// checkpointed (D69: the penalty's gradient goes through the segment's recompute, made with a graph).
TEST(HybridAdamGraphs, AGradientPenaltyBeforeMoreForwardsTrainsAsTheTwin) {
  auto critic_loss = [](const std::function<torch::Tensor(const torch::Tensor&)>& score, int step) {
    torch::manual_seed(200 + step);
    const torch::Tensor real = torch::randn({4, 16}), fake = torch::randn({4, 16});
    const torch::Tensor mixed = (0.3 * real + 0.7 * fake).requires_grad_();
    const torch::Tensor d_mixed = score(mixed);
    const torch::Tensor g = torch::autograd::grad({d_mixed.sum()}, {mixed}, {}, /*retain_graph=*/true,
                                                  /*create_graph=*/true)[0];
    const torch::Tensor penalty = (g.norm(2, 1) - 1).pow(2).mean();
    const torch::Tensor d_real = score(real);
    const torch::Tensor d_fake = score(fake);
    return d_fake.mean() - d_real.mean() + 10 * penalty;
  };
  for (const bool checkpointed : {false, true}) {
    const std::string how = checkpointed ? "checkpointed" : "plain";
    WrappedPerceptron critic(2, 16, 40, 1);
    critic.net->checkpointed = checkpointed;
    for (int step = 0; step < 4; ++step) {
      critic.twin.zero_grad();
      critic_loss([&](const torch::Tensor& x) { return critic.ref->forward(x); }, step).backward();
      critic.twin.step();
      const auto wrapped = [&](const torch::Tensor& x) {
        return critic.model.forward([&] { return critic.net->forward(x); });
      };
      const torch::Tensor loss = critic_loss(wrapped, step);
      ASSERT_NO_THROW(critic.model.backward(loss)) << how << ", step " << step;
      critic.adam.step();
      EXPECT_EQ(critic.model.scheduler().iterations(), step + 1) << how << ": one iteration per step, three forwards";
    }
    EXPECT_TRUE(critic.model.layout_final()) << how << ": the warm-up's repack ran";
    critic.expect_masters_as_twin("critic, " + how);
  }
}

}  // namespace
}  // namespace ferry
