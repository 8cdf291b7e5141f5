#pragma once
// Test fixtures shared by the HybridAdam tests of tests/optim (one gtest binary per file, each includes
// this once): a small language model (TinyLm) on the simulated device with 16 KiB chunks, its batches,
// configs and device budgets, twin pairs of wrapped models, the unwrapped twin's step, and the
// checkpoint directories the tests write.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../../common/durable_file.h"
#include "../../hooks/checkpoint.h"
#include "../../hooks/chunked_model.h"
#include "../../optim/hybrid_adam.h"
#include "../cpu_adam_twin.h"
#include "../test_util.h"
#include "same_state.h"

namespace ferry::test {

// A gate for the pipeline tests: its backward (reached after the later blocks' gradients have landed,
// before the embedding's) waits until the HybridAdam in g_gate_adam has started a pipelined host job,
// for at most 30 s, and records whether it saw one. Identity otherwise.
inline std::atomic<HybridAdam*> g_gate_adam{nullptr};
inline std::atomic<int> g_gate_saw_job{-1};          // -1: the gate did not run
inline std::atomic<int64_t> g_gate_jobs_before{0};  // jobs started before this backward (the gate waits for more)
struct WaitForHostAdam : torch::autograd::Function<WaitForHostAdam> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    if (HybridAdam* adam = g_gate_adam.load()) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      const int64_t before = g_gate_jobs_before.load();
      while (adam->pipelined_jobs_started() == before && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      g_gate_saw_job = adam->pipelined_jobs_started() > before ? 1 : 0;
    }
    return {g[0]};
  }
};

// A small language model: embedding, two residual MLP blocks with LayerNorm, tied output head.
struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl(int64_t vocab, int64_t d) {
    wte = register_module("wte", torch::nn::Embedding(vocab, d));
    for (int i = 0; i < 2; ++i) {
      ln.push_back(register_module("ln" + std::to_string(i), torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}))));
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(d, 4 * d)));
      out.push_back(register_module("out" + std::to_string(i), torch::nn::Linear(4 * d, d)));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = wte(idx);
    if (gate) x = WaitForHostAdam::apply(x);
    if (after_embedding) x = after_embedding(x);
    for (int i = 0; i < 2; ++i) {
      if (checkpointed) {
        x = checkpoint([this, i](const std::vector<at::Tensor>& in) { return block(i, in[0]); }, {x});
      } else {
        x = block(i, x);
      }
    }
    return torch::matmul(ln_f(x), wte->weight.t());
  }
  torch::Tensor block(int i, const torch::Tensor& x) { return x + out[i](torch::gelu(fc[i](ln[i](x)))); }
  torch::nn::Embedding wte{nullptr};
  std::vector<torch::nn::LayerNorm> ln;
  std::vector<torch::nn::Linear> fc, out;
  torch::nn::LayerNorm ln_f{nullptr};
  bool gate = false;          // WaitForHostAdam after the embedding
  bool checkpointed = false;  // each block a ferry::checkpoint segment (the model's activation policy decides)
  std::function<torch::Tensor(const torch::Tensor&)> after_embedding;  // null: none
};
TORCH_MODULE(TinyLm);

inline constexpr int64_t kVocab = 64, kDim = 32, kChunk = 16 << 10;  // every tensor fits one 16 KiB chunk

inline torch::Tensor lm_loss(TinyLm& net, const torch::Tensor& idx, const torch::Tensor& target) {
  auto logits = net->forward(idx);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), target.reshape({-1}));
}

struct Batch {
  torch::Tensor idx, target;
};
inline Batch batch(int64_t step, int64_t b = 4, int64_t t = 8) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto idx = torch::randint(kVocab, {b, t}, gen, torch::kLong);
  return {idx, (idx * 7 + 3) % kVocab};  // a learnable mapping
}

// The loss of batch `x` computed by `model`'s forward, divided by `parts` (a micro-batch's share) unless 1.
inline torch::Tensor forward_loss(ChunkedModel& model, TinyLm& net, const Batch& x, int parts = 1) {
  return model.forward([&] {
    torch::Tensor loss = lm_loss(net, x.idx, x.target);
    return parts == 1 ? loss : loss / parts;
  });
}

inline Config sim_config(int64_t budget, Precision precision = Precision::kFp32) {
  Config c;
  c.device = DeviceKind::kSimulated;
  c.chunk_size_bytes = kChunk;
  c.device_budget_bytes = budget;
  c.precision = precision;
  c.validate();
  return c;
}

inline AdamOptions adamw(double lr = 1e-2) {
  AdamOptions o;
  o.lr = lr;
  o.weight_decay = 0.1;
  return o;
}

// Budget: `param_chunks` parameter chunks plus `state_chunks` state groups of `roles` fp32 chunks each
// (master, exp_avg, exp_avg_sq; + grad with accumulate_grads).
inline int64_t budget_for(int64_t param_chunks, int64_t state_chunks, int64_t roles = 3) {
  return (param_chunks + roles * state_chunks) * kChunk;
}

// Options with two state groups on the device; `accumulate`: with fp32 accumulation chunks.
inline HybridAdamOptions split_state(bool accumulate) {
  HybridAdamOptions options = HybridAdamOptions::no_decay_for_bias_and_norm(adamw());
  options.device_state_chunks = 2;
  options.accumulate_grads = accumulate;
  return options;
}

// `step()` (a backward_step) with `adam`'s worker held, when `hold`, by a job of the test's until it has
// returned or thrown: every host job the step queues in backward is still queued when backward ends, so
// that it is taken back and carried over behind the next forward (Note [Host updates carried over behind
// the next forward]).
inline StepResult with_worker_held(HybridAdam& adam, bool hold, const std::function<StepResult()>& step) {
  std::promise<void> gate;
  if (hold) adam.run_on_worker([opened = gate.get_future().share()] { opened.wait(); });
  struct Open {  // after the step has returned, also when it throws
    std::promise<void>& gate;
    bool held;
    ~Open() {
      if (held) gate.set_value();
    }
  } open{gate, hold};
  return step();
}

// Holds `adam`'s worker from hold() (called before a step) until the next forward of the model has begun
// (begun(), called at the start of each of its forwards) and `lag` more, or until `deadline` where no
// forward begins (the step itself, or an op between steps, waits for the worker). The host updates the
// step leaves running behind the next forward are then still queued when it starts: a use of a parameter
// that does not wait for its chunk's update finds the chunk locked on the host, or reads values not yet
// written, whatever the thread count and load. Without the hold the update of a 16 KiB chunk is often
// done before the forward reaches it, and such a missing wait goes unseen (at one OpenMP thread, in none
// of test_mechanism_combinations' 160 cases).
class WorkerLag {
 public:
  void hold(HybridAdam& adam, std::chrono::milliseconds lag = std::chrono::milliseconds(5),
            std::chrono::milliseconds deadline = std::chrono::milliseconds(30)) {
    begun();  // a hold not released yet: its job has passed its deadline or is about to
    gate_ = std::make_shared<Gate>();
    const auto until = std::chrono::steady_clock::now() + deadline;
    adam.run_on_worker([gate = gate_, lag, until] {
      std::unique_lock<std::mutex> lock(gate->mutex);
      if (!gate->opened.wait_until(lock, until, [&] { return gate->begun; })) return;
      lock.unlock();
      std::this_thread::sleep_for(lag);
    });
  }
  void begun() {
    if (!gate_) return;
    {
      std::lock_guard<std::mutex> lock(gate_->mutex);
      gate_->begun = true;
    }
    gate_->opened.notify_all();
    gate_.reset();
  }

 private:
  struct Gate {
    std::mutex mutex;
    std::condition_variable opened;
    bool begun = false;
  };
  std::shared_ptr<Gate> gate_;  // of the hold not yet released
};

// Two TinyLms with the same initial values.
inline std::pair<TinyLm, TinyLm> twins(uint64_t seed) {
  torch::manual_seed(seed);
  TinyLm a(kVocab, kDim);
  torch::manual_seed(seed);
  TinyLm b(kVocab, kDim);
  return {a, b};
}

// A TinyLm with one more parameter, 'extra' (zeros, kDim), added to the embedding's output while
// use_extra is set: a parameter some steps do not train, whose gradient lands last in backward.
inline TinyLm tiny_lm_with_extra(uint64_t seed, const bool& use_extra) {
  torch::manual_seed(seed);
  TinyLm net(kVocab, kDim);
  torch::Tensor extra = net->register_parameter("extra", torch::zeros({kDim}));
  net->after_embedding = [&use_extra, extra](const torch::Tensor& x) { return use_extra ? x + extra : x; };
  return net;
}

// Runs `steps` training steps (batches first .. first + steps - 1) of backward() + step() on (model, adam);
// every step must be applied.
inline void train_steps(ChunkedModel& model, TinyLm& net, HybridAdam& adam, int first, int steps) {
  for (int step = first; step < first + steps; ++step) {
    model.backward(forward_loss(model, net, batch(step)));
    ASSERT_TRUE(adam.step().applied) << "step " << step;
    adam.zero_grad();
  }
}

// Two TinyLms with the same initial values (`nets`), each wrapped in a ChunkedModel with its HybridAdam:
// built in the order a_net, b_net, a, b, a_adam, b_adam; a and b differ only in what the test gives each.
struct LmTwins {
  LmTwins(std::pair<TinyLm, TinyLm> nets, const Config& a_config, const Config& b_config,
          const HybridAdamOptions& a_options, const HybridAdamOptions& b_options,
          ChunkedModelOptions a_model_options = {}, ChunkedModelOptions b_model_options = {})
      : a_net(nets.first),
        b_net(nets.second),
        a(a_net.ptr(), a_config, std::move(a_model_options)),
        b(b_net.ptr(), b_config, std::move(b_model_options)),
        a_adam(a, a_options),
        b_adam(b, b_options) {}
  LmTwins(std::pair<TinyLm, TinyLm> nets, const Config& config, const HybridAdamOptions& options)
      : LmTwins(std::move(nets), config, config, options, options) {}
  // Both optimizers' zero_grad().
  void zero_grad() {
    a_adam.zero_grad();
    b_adam.zero_grad();
  }
  TinyLm a_net, b_net;
  ChunkedModel a, b;
  HybridAdam a_adam, b_adam;
};

// The unwrapped twin's step under ferry's CpuAdam: its .grad dropped, `loss()` computed and backwarded,
// every parameter with a gradient updated. Returns the loss.
inline torch::Tensor twin_step(CpuAdamTwin& twin, const std::function<torch::Tensor()>& loss) {
  twin.zero_grad();
  torch::Tensor value = loss();
  value.backward();
  twin.step();
  return value;
}

// Every master of `adam` equals the same-named parameter of the unwrapped `twin`, bit for bit.
inline void expect_masters_as(HybridAdam& adam, ChunkedModel& model, torch::nn::Module& twin, const std::string& what) {
  const auto named = twin.named_parameters();
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(adam.master(p), named[model.param_name(p)])) << what << ": master of "
                                                                         << model.param_name(p);
  }
}

// A checkpoint directory <fresh temporary directory>/ckpt (not created yet). POSIX only: std::filesystem
// from libtorch.so crashes (ARCHITECTURE D21).
inline std::string temp_dir(const std::string& name) {
  std::string templ = "/tmp/ferry_test_" + name + "_XXXXXX";
  TORCH_CHECK(::mkdtemp(templ.data()), "mkdtemp failed");
  return templ + "/ckpt";
}
// Every file in the directory (test_checkpoint_files.cpp tests the format; here only its clean-up).
inline std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> paths;
  for (const std::string& name : list_dir(dir)) {
    if (name[0] != '.') paths.push_back(join_path(dir, name));
  }
  return paths;
}
// Removes what temp_dir() made and a save wrote there.
inline void remove_checkpoint(const std::string& dir) {
  for (const auto& f : files_in(dir)) ::unlink(f.c_str());
  ::rmdir(dir.c_str());
  ::rmdir(dir.substr(0, dir.rfind('/')).c_str());
}

}  // namespace ferry::test
