// bench_state_quality: does the compact optimizer state (D76, Note [The compact state format]) train like
// fp32 Adam? The GPT example's model trained on a byte-level text corpus with a held-out split, by one
// of three optimizers over the same initial weights, the same batches and the same schedule:
//
//   torch    torch::optim::AdamW (the reference no one here wrote)
//   fp32     ferry's CPU Adam kernel over fp32 master, exp_avg, exp_avg_sq (what HybridAdam runs today)
//   compact  ferry's CPU Adam kernel over the compact state: bf16 master with stochastic rounding,
//            8-bit blockwise moments (6.03 B/param with the bf16 compute copy instead of 14)
//   hybrid-fp32, hybrid-compact
//            the whole of ferry: the model wrapped in a ChunkedModel (bf16 compute copy, the simulated
//            device with a budget of half the chunks, so they are evicted every step), trained by
//            HybridAdam::backward_step with StateFormat kFp32 or kCompact (clipping by its max_grad_norm)
//
//   bench_state_quality --optimizer=compact --train=DIR --heldout=DIR [--preset=tiny] [--steps=2000]
//       [--batch=16] [--seq=128] [--lr=2e-3] [--warmup=100] [--eval-every=100] [--eval-batches=8]
//       [--seed=1] [--commit=SHA]
//
// torch, fp32 and compact call the kernels on the module's own parameters (no chunks, no HybridAdam): the
// format's numerics alone; the hybrid runs are the integration, whose two formats differ in nothing else. The model computes
// in fp32 in every run; under `compact` its weights are the bf16 master's values (up-cast after each
// step), as a bf16 compute copy would hold them. AdamW (decoupled decay 0.1 on every matrix, the
// embeddings included; none on biases and norms), betas (0.9, 0.95), eps 1e-8, gradients clipped to norm 1,
// linear warm-up then cosine decay to 10% of --lr. The held-out loss is over a fixed set of
// --eval-batches batches drawn once from --heldout. Prints one JSON document: the curve (every
// --eval-every steps: the mean training loss of those steps and the held-out loss), the final held-out
// loss, the state's bytes per parameter and the wall time.
#include <sys/resource.h>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <random>
#include <sstream>
#include <tuple>

#include "../../examples/gpt/corpus.h"
#include "../../examples/gpt/gpt.h"
#include "../../ferry.h"

namespace {

struct Args {
  std::string optimizer = "compact", preset = "tiny", train, heldout, commit = "unknown";
  int64_t steps = 2000, batch = 16, seq = 128, warmup = 100, eval_every = 100, eval_batches = 8, seed = 1;
  double lr = 2e-3;
};

// One optimizer over the model's parameters: step() after the gradients are in .grad().
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step(double lr) = 0;
  virtual double state_bytes_per_param() const = 0;
};

bool decays(const at::Tensor& p) { return p.dim() >= 2; }

class TorchAdamW final : public Optimizer {
 public:
  explicit TorchAdamW(const std::vector<at::Tensor>& params) {
    std::vector<at::Tensor> decay, no_decay;
    for (const auto& p : params) (decays(p) ? decay : no_decay).push_back(p);
    auto opts = [](double wd) { return torch::optim::AdamWOptions(1.0).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd); };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts(0.1)));
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(opts(0.0)));
    adam_ = std::make_unique<torch::optim::AdamW>(std::move(groups), opts(0.0));
  }
  void step(double lr) override {
    for (auto& g : adam_->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    adam_->step();
  }
  double state_bytes_per_param() const override { return 4 + 4 + 4; }  // param (the master), exp_avg, exp_avg_sq

 private:
  std::unique_ptr<torch::optim::AdamW> adam_;
};

// ferry's CPU Adam: group 0 decays, group 1 does not.
class FerryAdam : public Optimizer {
 protected:
  explicit FerryAdam(const std::vector<at::Tensor>& params)
      : params_(params), adam_(ferry::AdamOptions().with_betas(0.9, 0.95).with_eps(1e-8).with_weight_decay(0.1)) {
    adam_.add_param_group(ferry::AdamOptions().with_betas(0.9, 0.95).with_eps(1e-8).with_weight_decay(0.0));
  }
  void begin_step(double lr) {
    for (int g = 0; g < 2; ++g) {
      adam_.set_lr(g, lr);
      adam_.advance_step(g);
    }
  }
  int group_of(const at::Tensor& p) const { return decays(p) ? 0 : 1; }
  std::vector<at::Tensor> params_;
  ferry::CpuAdam adam_;
};

class Fp32State final : public FerryAdam {
 public:
  explicit Fp32State(const std::vector<at::Tensor>& params) : FerryAdam(params) {
    for (const auto& p : params_) {
      m_.push_back(at::zeros({p.numel()}));
      v_.push_back(at::zeros({p.numel()}));
    }
  }
  void step(double lr) override {
    begin_step(lr);
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i];
      const ferry::UpdateResult r =
          adam_.update(group_of(p), p.detach().view({-1}), p.grad().contiguous().view({-1}), m_[i], v_[i]);
      TORCH_CHECK(r.applied, "bench_state_quality: fp32 update not applied (non-finite gradient)");
    }
  }
  double state_bytes_per_param() const override { return 12; }

 private:
  std::vector<at::Tensor> m_, v_;
};

class CompactState final : public FerryAdam {
 public:
  explicit CompactState(const std::vector<at::Tensor>& params) : FerryAdam(params) {
    uint64_t offset = 0;
    for (const auto& p : params_) {
      const int64_t n = p.numel(), blocks = ferry::compact_blocks(n);
      State s{at::empty({n}, at::kBFloat16), at::empty({n}, at::kByte), at::empty({n}, at::kByte),
              at::empty({blocks}), at::empty({blocks}), offset};
      offset += static_cast<uint64_t>(n);
      const at::Tensor zeros = at::zeros({n});
      ferry::compact_from_fp32(span(s, p), p.detach().contiguous().data_ptr<float>(), zeros.data_ptr<float>(),
                               zeros.data_ptr<float>());
      state_.push_back(std::move(s));
    }
    write_back();  // the model starts from the bf16 master's values
  }
  void step(double lr) override {
    begin_step(lr);
    for (size_t i = 0; i < params_.size(); ++i) {
      const ferry::UpdateResult r = adam_.update(group_of(params_[i]), span(state_[i], params_[i]));
      TORCH_CHECK(r.applied, "bench_state_quality: compact update not applied (non-finite gradient)");
    }
    write_back();
  }
  double state_bytes_per_param() const override { return 2 + 1 + 1 + 8.0 / ferry::kCompactStateBlock; }

 private:
  struct State {
    at::Tensor master, m, v, m_scale, v_scale;
    uint64_t offset;
  };
  ferry::CompactAdamSpan span(State& s, const at::Tensor& p) {
    ferry::CompactAdamSpan sp;
    sp.master = reinterpret_cast<uint16_t*>(s.master.data_ptr());
    if (p.grad().defined()) {
      grad_ = p.grad().contiguous();
      sp.grad = grad_.data_ptr();
      sp.grad_dtype = at::kFloat;
    }
    sp.exp_avg = s.m.data_ptr<uint8_t>();
    sp.exp_avg_scale = s.m_scale.data_ptr<float>();
    sp.exp_avg_sq = s.v.data_ptr<uint8_t>();
    sp.exp_avg_sq_scale = s.v_scale.data_ptr<float>();
    sp.numel = p.numel();
    sp.element_offset = s.offset;
    return sp;
  }
  void write_back() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(state_[i].master.view(params_[i].sizes()));
  }
  std::vector<State> state_;
  at::Tensor grad_;  // the gradient a span points into, alive until its update returns
};

// The whole of ferry: the step is HybridAdam's (its own clipping), so this is not an Optimizer.
struct HybridRun {
  HybridRun(gpt::GptImpl& net, ferry::StateFormat format)
      : model(std::shared_ptr<torch::nn::Module>(&net, [](torch::nn::Module*) {}), config_for(net)),
        adam(model, options(format)) {}
  static ferry::Config config_for(gpt::GptImpl& net) {
    ferry::Config c;
    c.device = ferry::DeviceKind::kSimulated;
    c.precision = ferry::Precision::kBf16;
    int64_t bytes = 0;
    for (const auto& p : net.parameters()) bytes += 2 * p.numel();
    c.device_budget_bytes = bytes / 2;  // the chunk size searched (Config's default): evictions every step
    c.validate();
    return c;
  }
  static ferry::HybridAdamOptions options(ferry::StateFormat format) {
    ferry::HybridAdamOptions o = ferry::HybridAdamOptions::no_decay_for_bias_and_norm(
        ferry::AdamOptions().with_betas(0.9, 0.95).with_eps(1e-8).with_weight_decay(0.1));
    o.max_grad_norm = 1.0;
    o.device_state_chunks = 0;  // the host Adam: the kernels of the other runs
    return o.with_state_format(format);
  }
  double state_bytes_per_param(int64_t params) {
    const ferry::ChunkStoreStats s = adam.state_store().stats();
    return static_cast<double>(s.host.current_bytes + s.device.current_bytes) / static_cast<double>(params);
  }
  ferry::ChunkedModel model;
  ferry::HybridAdam adam;
};

double heldout_loss(gpt::GptImpl& net, const std::vector<std::pair<at::Tensor, at::Tensor>>& batches,
                    HybridRun* hybrid) {
  at::NoGradGuard no_grad;
  double sum = 0;
  for (const auto& batch : batches) {
    const at::Tensor &x = batch.first, &y = batch.second;  // captured below: not a structured binding
    // Through the ChunkedModel when it holds the parameters (an evaluation forward), else directly.
    auto loss = [&] { return gpt::GptImpl::loss(net.forward(x), y).to(at::kFloat); };
    sum += (hybrid ? hybrid->model.forward(loss) : loss()).item<double>();
  }
  if (hybrid) hybrid->model.end_iteration();
  return sum / static_cast<double>(batches.size());
}

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("bench_state_quality", [&] {
    Args a;
    ferry::cli::Options o("bench_state_quality");
    o.add("optimizer", &a.optimizer, "torch, fp32, compact, hybrid-fp32 or hybrid-compact")
        .add("preset", &a.preset, "GPT preset (default tiny)")
        .add("train", &a.train, "training text: a file or a directory of files")
        .add("heldout", &a.heldout, "held-out text: a file or a directory of files")
        .add("steps", &a.steps, "optimizer steps (default 2000)", 1)
        .add("batch", &a.batch, "sequences per step (default 16)", 1)
        .add("seq", &a.seq, "bytes per sequence (default 128)", 2)
        .add("lr", &a.lr, "peak learning rate (default 2e-3)", 0.0, 1.0)
        .add("warmup", &a.warmup, "linear warm-up steps (default 100)", 0)
        .add("eval-every", &a.eval_every, "steps between held-out evaluations (default 100)", 1)
        .add("eval-batches", &a.eval_batches, "held-out batches (default 8)", 1)
        .add("seed", &a.seed, "initialisation and data seed (default 1)")
        .add("commit", &a.commit, "commit id recorded in the JSON");
    o.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (a.train.empty() || a.heldout.empty()) throw ferry::cli::UsageError("--train and --heldout are required");
    const gpt::GptConfig gc = gpt::preset(a.preset);
    if (a.seq > gc.seq) throw ferry::cli::UsageError("--seq exceeds the preset's " + std::to_string(gc.seq));
    const gpt::ByteCorpus train(a.train), heldout(a.heldout);
    torch::manual_seed(a.seed);
    gpt::GptImpl net(gc);
    std::vector<at::Tensor> params = net.parameters();
    std::unique_ptr<Optimizer> opt;
    std::unique_ptr<HybridRun> hybrid;
    if (a.optimizer == "hybrid-fp32" || a.optimizer == "hybrid-compact") {
      hybrid = std::make_unique<HybridRun>(
          net, a.optimizer == "hybrid-fp32" ? ferry::StateFormat::kFp32 : ferry::StateFormat::kCompact);
      params.clear();  // the chunks hold the parameters now; nothing else should
    } else if (a.optimizer == "torch") {
      opt = std::make_unique<TorchAdamW>(params);
    } else if (a.optimizer == "fp32") {
      opt = std::make_unique<Fp32State>(params);
    } else if (a.optimizer == "compact") {
      opt = std::make_unique<CompactState>(params);
    } else {
      throw ferry::cli::UsageError("--optimizer: expected torch, fp32, compact, hybrid-fp32 or hybrid-compact, got '" +
                                   a.optimizer + "'");
    }
    std::mt19937_64 eval_rng(12345);
    std::vector<std::pair<at::Tensor, at::Tensor>> eval;
    for (int64_t b = 0; b < a.eval_batches; ++b) eval.push_back(heldout.sample(a.batch, a.seq, eval_rng));
    std::mt19937_64 rng(static_cast<uint64_t>(a.seed) * 7919);
    std::ostringstream curve;
    double window = 0, last_heldout = 0;
    const auto t0 = std::chrono::steady_clock::now();
    curve << "[{\"step\": 0, \"heldout_loss\": " << heldout_loss(net, eval, hybrid.get()) << "}";
    for (int64_t step = 1; step <= a.steps; ++step) {
      const double warm = std::min(1.0, static_cast<double>(step) / std::max<int64_t>(1, a.warmup));
      const double progress = static_cast<double>(std::max<int64_t>(0, step - a.warmup)) /
                              static_cast<double>(std::max<int64_t>(1, a.steps - a.warmup));
      const double lr = a.lr * warm * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * progress)));
      at::Tensor x, y;  // not a structured binding: the lambdas below capture them (C++17)
      std::tie(x, y) = train.sample(a.batch, a.seq, rng);
      if (hybrid) {
        hybrid->adam.set_lr(lr);
        const at::Tensor loss =
            hybrid->model.forward([&] { return gpt::GptImpl::loss(net.forward(x), y).to(at::kFloat); });
        const double value = loss.item<double>();
        TORCH_CHECK(hybrid->adam.backward_step(loss).applied, "bench_state_quality: a step was not applied");
        window += value;
      } else {
        for (auto& p : params) p.mutable_grad() = at::Tensor();
        const at::Tensor loss = gpt::GptImpl::loss(net.forward(x), y);
        loss.backward();
        torch::nn::utils::clip_grad_norm_(params, 1.0);
        opt->step(lr);
        window += loss.item<double>();
      }
      if (step % a.eval_every == 0 || step == a.steps) {
        const int64_t n = step % a.eval_every == 0 ? a.eval_every : step % a.eval_every;
        last_heldout = heldout_loss(net, eval, hybrid.get());
        curve << ",\n    {\"step\": " << step << ", \"train_loss\": " << window / n << ", \"heldout_loss\": " << last_heldout
              << "}";
        std::cerr << "bench_state_quality " << a.optimizer << ": step " << step << " train " << window / n << " held-out "
                  << last_heldout << "\n";
        window = 0;
      }
    }
    curve << "]";
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "{\n  \"benchmark\": \"state_quality\",\n  \"commit\": \"" << a.commit << "\",\n  \"env\": "
              << ferry::env_report_json(ferry::collect_env_report()) << ",\n  \"optimizer\": \"" << a.optimizer
              << "\", \"preset\": \"" << gc.name << "\", \"parameters\": " << gc.num_params() << ",\n  \"train\": \""
              << train.path() << "\", \"train_bytes\": " << train.size() << ", \"train_files\": " << train.files()
              << ", \"heldout\": \"" << heldout.path() << "\", \"heldout_bytes\": " << heldout.size()
              << ", \"heldout_files\": " << heldout.files() << ",\n  \"steps\": " << a.steps << ", \"batch\": " << a.batch
              << ", \"seq\": " << a.seq << ", \"lr\": " << a.lr << ", \"warmup\": " << a.warmup << ", \"seed\": " << a.seed
              << ",\n  \"state_bytes_per_param\": "
              << (hybrid ? hybrid->state_bytes_per_param(gc.num_params()) : opt->state_bytes_per_param())
              << ", \"final_heldout_loss\": " << last_heldout << ", \"seconds\": " << seconds << ",\n  \"curve\": "
              << curve.str() << "\n}\n";
    return 0;
  });
}
