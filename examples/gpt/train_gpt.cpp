// train_gpt: trains the GPT example through ferry (ChunkedModel + HybridAdam) on a byte-level text
// corpus, with a progress line every --log-every steps and a summary at the end. Ctrl-C or SIGTERM
// stops after the current step (and saves, with --save; the save target is checked before training).
// Options parse strictly (ferry/common/cli.h): a bad value names the option and what was expected.
//
//   train_gpt [--preset=tiny] [--steps=300] [--batch=8] [--seq=128] [--lr=3e-3] [--warmup=20]
//             [--micro-batches=1] [--max-grad-norm=1.0] [--checkpoint-activations] [--layer-drop=P]
//             [--corpus=/usr/share/common-licenses] [--save=DIR] [--resume=DIR] [--seed=1]
//             [--log-every=10] [--expect-loss-below=X] [--trace=FILE.json] [--state-format=fp32|compact]
//             [--round-trip-slots=K] [--init-scope]  + ferry's options (--device, --precision, --chunk-size,
//             --device-budget, --host-budget, --cpu-threads, --log-level; see --help)
//
// The largest presets on one GPU (20b and up on one H100 + 125 GiB host): --init-scope builds the model
// in the compute dtype (no fp32 copy of it ever exists), --state-format=compact keeps 6 B per parameter
// with the compute copy (Note [The compact state format]), --round-trip-slots=4 bounds the host's pinned
// buffers (Note [Round trips through K buffers]); build/examples/gpt/gpt_capacity says on paper what fits.
//
// Data parallel: launched by torchrun (--nproc-per-node=N --no-python), SLURM or by hand
// (dist/process_group.h), each rank trains on its own batches and the optimizer state is sharded
// across the ranks (Note [Sharded optimizer state]); rank 0 prints the progress, every log line names
// its rank. --save writes one checkpoint (rank 0 writes it); --resume reads it at any world size.
//
// LayerDrop (--layer-drop=P): each block is skipped with probability P in each micro-batch's forward,
// drawn when the forward begins (the same draws on every rank) and said to ferry then
// (ferry::will_skip, D107), so no chunk of a skipped block is moved in for it.
//
// Defaults follow the device: on a GPU bf16 and a device budget of 90% of its memory; on the CPU
// (simulated device) fp32 (bf16 with --state-format=compact, which needs a 16-bit compute copy), a
// chunk size of 1/8 of the model and a device budget of half the model, so chunks really move.
#include "../../ferry.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "corpus.h"
#include "gpt.h"

namespace {

std::atomic<bool> g_stop{false};
void on_stop_signal(int) { g_stop.store(true); }

struct Args {
  std::string preset = "tiny";
  int64_t steps = 300, batch = 8, seq = 128, micro_batches = 1, warmup = 20, log_every = 10, seed = 1;
  double lr = 3e-3, max_grad_norm = 1.0, layer_drop = 0;
  bool checkpoint_activations = false, init_scope = false;
  std::string corpus = "/usr/share/common-licenses", save, resume, trace, state_format = "fp32";
  ferry::StateFormat format = ferry::StateFormat::kFp32;  // --state-format, parsed once
  int64_t round_trip_slots = 0;
  double expect_loss_below = 0;  // > 0: exit 1 unless the last window's mean loss is below it (tests)
};

ferry::cli::Options options_for(Args& a) {
  ferry::cli::Options o("train_gpt");
  o.also_accepts("ferry options", ferry::Config::help());
  o.add("preset", &a.preset, "model size: tiny, small, medium, 1b, 2b, 4b, 6b, 8b, 10b, 12b, 15b, 20b, 30b, llama7b")
      .add("steps", &a.steps, "optimizer steps (default 300)", 1)
      .add("batch", &a.batch, "sequences per step (default 8)", 1, int64_t{1} << 24)
      .add("seq", &a.seq, "tokens per sequence (default 128, at most the preset's)", 2, int64_t{1} << 24)
      .add("lr", &a.lr, "peak learning rate (default 3e-3)", 0.0, 1e3)
      .add("warmup", &a.warmup, "linear warm-up steps (default 20)", 0)
      .add("micro-batches", &a.micro_batches, "gradient accumulation: micro-batches per step (default 1)", 1)
      .add("max-grad-norm", &a.max_grad_norm, "global gradient clipping, 0 = none (default 1.0)", 0.0)
      .add_flag("checkpoint-activations", &a.checkpoint_activations, "recompute each block in backward")
      .add("layer-drop", &a.layer_drop, "LayerDrop: skip each block with probability P per forward, said ahead to "
           "ferry (ferry::will_skip; default 0)", 0.0, 1.0)
      .add("corpus", &a.corpus, "a text file or a directory of them (default /usr/share/common-licenses)")
      .add("save", &a.save, "save the training state into DIR at the end (checked before training)")
      .add("resume", &a.resume, "resume from the training state in DIR")
      .add("seed", &a.seed, "initialisation and data seed (default 1)")
      .add("log-every", &a.log_every, "steps per progress line (default 10)", 1)
      .add("expect-loss-below", &a.expect_loss_below, "exit 1 unless the last window's mean loss is below X", 0.0)
      .add("trace", &a.trace, "write a Chrome trace (Perfetto) of the third step to FILE.json")
      .add("state-format", &a.state_format, "optimizer state: fp32 (default) or compact (bf16 master, 8-bit "
           "moments: Note [The compact state format])")
      .add("round-trip-slots", &a.round_trip_slots, "host buffers the parameter round trips of the host updates "
           "hold at most (HybridAdamOptions::round_trip_slots; default 0: one per host-state chunk)", int64_t{0})
      .add_flag("init-scope", &a.init_scope, "build the model inside ferry::InitScope (the compute dtype: no fp32 "
                "copy of the model; its initial values rounded to it)");
  return o;
}

Args parse(const std::vector<std::string>& rest) {
  Args a;
  options_for(a).parse(rest);
  try {
    a.format = ferry::state_format_from_string(a.state_format);
  } catch (const c10::Error& e) {  // its message names the formats and what was given
    throw ferry::cli::UsageError(std::string("--state-format: ") + e.what_without_backtrace());
  }
  if (a.batch % a.micro_batches != 0) {
    throw ferry::cli::UsageError("--batch (" + std::to_string(a.batch) + ") must be a multiple of --micro-batches (" +
                                 std::to_string(a.micro_batches) + ")");
  }
  return a;
}

bool given(int argc, char** argv, std::initializer_list<const char*> keys) {
  for (int i = 1; i < argc; ++i) {
    for (const char* k : keys) {
      if (std::string(argv[i]).rfind(std::string("--") + k + "=", 0) == 0) return true;
    }
  }
  return false;
}

int train(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("train_gpt", [&] { return train(argc, argv); });
}

namespace {

int train(int argc, char** argv) {
  std::vector<std::string> rest;
  ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  // Checkpointed blocks are planned (kept where the device has room) unless told otherwise (D75).
  if (!ferry::cli::option_given(argc, argv, "activations")) config.activations = ferry::ActivationPolicy::kAuto;
  ferry::log::configure(config.log_level, config.rank);
  const Args args = parse(rest);
  const bool cuda = ferry::resolve_device_kind(config.device) == ferry::DeviceKind::kCuda;

  gpt::GptConfig gc = gpt::preset(args.preset);
  if (args.seq > gc.seq) {
    throw ferry::cli::UsageError("--seq=" + std::to_string(args.seq) + " exceeds preset " + gc.name + "'s " +
                                 std::to_string(gc.seq));
  }
  // A save that would fail must fail now, not after the whole run (rank 0 writes a multi-process save).
  if (!args.save.empty() && config.rank == 0) ferry::HybridAdam::check_save_target(args.save);
  // Null for one process, unless a dist-backend was named: then a group of one (a launch smoke test,
  // e.g. NCCL under torchrun --nproc-per-node=1).
  const std::shared_ptr<ferry::dist::Communicator> comm =
      ferry::dist::connect(config, /*even_alone=*/config.dist_backend != "auto");
  const bool report = config.rank == 0;  // progress lines from rank 0 only
  const int64_t n_params = gc.num_params();
  // The compact state needs a 16-bit compute copy: bf16 by default with it, on the CPU too.
  if (!given(argc, argv, {"precision"})) {
    config.precision = cuda || args.format == ferry::StateFormat::kCompact ? ferry::Precision::kBf16 : ferry::Precision::kFp32;
  }
  const int64_t elem = config.precision == ferry::Precision::kFp32 ? 4 : 2;
  torch::manual_seed(args.seed);
  std::optional<ferry::InitScope> scope;  // --init-scope: parameters built in the compute dtype, no fp32 model
  if (args.init_scope) scope.emplace(config.precision);
  auto net = std::make_shared<gpt::GptImpl>(gc);
  scope.reset();
  if (!given(argc, argv, {"device-budget", "device_budget"})) {
    // The simulated device: half the model (and four chunks of a size given; auto sizes chunks so that
    // the budget holds sixteen, D99).
    config.device_budget_bytes = cuda ? static_cast<int64_t>(0.9 * ferry::query_gpus().total_memory_bytes)
                                      : std::max<int64_t>(n_params * elem / 2, 4 * config.chunk_size_bytes);
  }
  config.validate();

  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  gpt::ByteCorpus corpus(args.corpus);
  ferry::log::info("train_gpt: corpus ", corpus.path(), " (", corpus.files(), " files, ", corpus.size(),
                   " bytes); preset ", gc.name, ": ", n_params / 1e6, "M parameters, hidden ", gc.hidden, " x ",
                   gc.layers, " layers, ", gc.heads, " heads");
  // LayerDrop: block i is skipped in this forward where skip[i] (drawn per micro-batch below).
  std::vector<char> skip(static_cast<size_t>(gc.layers), 0);
  size_t next_block = 0;
  if (args.checkpoint_activations || args.layer_drop > 0) {
    net->run_block = [&skip, &next_block, checkpoint = args.checkpoint_activations](gpt::Block& b,
                                                                                   const torch::Tensor& x) {
      if (skip[next_block++ % skip.size()]) return x;
      if (!checkpoint) return b->forward(x);
      return ferry::checkpoint([b](const std::vector<at::Tensor>& in) mutable { return b->forward(in[0]); }, {x});
    };
  }
  ferry::ChunkedModel model(net, config);
  ferry::AdamOptions adam_options;
  adam_options.lr = args.lr;
  adam_options.weight_decay = 0.1;
  adam_options.beta2 = 0.95;
  ferry::HybridAdamOptions options = ferry::HybridAdamOptions::no_decay_for_bias_and_norm(adam_options);
  options.max_grad_norm = args.max_grad_norm;
  // Micro-batches accumulate gradients across backward passes: fp32 accumulation chunks (+4 B/param).
  // One batch per step: the gradients live in the parameter chunks and cost nothing.
  options.accumulate_grads = args.micro_batches > 1;
  options.communicator = comm;
  options.state_format = args.format;
  options.round_trip_slots = args.round_trip_slots;
  ferry::HybridAdam adam(model, options);
  int64_t first_step = 0;
  if (!args.resume.empty()) {
    adam.load(args.resume);
    first_step = adam.step_count(0);
  }
  const c10::Device device = model.store().device();
  // Each rank its own batches.
  std::mt19937_64 rng(static_cast<uint64_t>(args.seed) * 7919 + static_cast<uint64_t>(first_step) +
                      static_cast<uint64_t>(config.rank) * 1000003);
  const int64_t micro = args.batch / args.micro_batches;
  const double tokens_per_step = static_cast<double>(args.batch * args.seq * config.world_size);  // all ranks
  const double flops_per_step = 6.0 * n_params * tokens_per_step;

  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();
  auto t_window = t_start;
  double window_loss = 0, first_window_loss = -1, last_window_loss = 0;
  int64_t window_steps = 0, moved_window = 0, skipped = 0, steps_done = 0;
  int64_t blocks_dropped = 0, block_runs = 0, said_but_used = 0;  // --layer-drop, over the whole run
  std::vector<double> losses;
  for (int64_t step = first_step; step < first_step + args.steps && !g_stop.load(); ++step) {
    const double lr = args.lr * std::min(1.0, static_cast<double>(step + 1) / std::max<int64_t>(1, args.warmup));
    adam.set_lr(lr);
    const bool tracing = !args.trace.empty() && step == first_step + std::min<int64_t>(2, args.steps - 1);
    if (tracing) ferry::trace::start();
    at::Tensor step_loss;  // summed on the device: one host read per step, not one per micro-batch
    ferry::StepResult r;
    for (int64_t k = 0; k < args.micro_batches; ++k) {
      at::Tensor x, y;  // not a structured binding: the lambda below captures them (C++17)
      std::tie(x, y) = corpus.sample(micro, args.seq, rng);
      x = x.to(device);
      y = y.to(device);
      if (args.layer_drop > 0) {  // the same draws on every rank: a step's parameter uses agree across them
        std::mt19937_64 draw(static_cast<uint64_t>(args.seed) * 1000003 + static_cast<uint64_t>(step) * 64 +
                             static_cast<uint64_t>(k));
        std::uniform_real_distribution<double> u(0.0, 1.0);
        for (char& s : skip) s = u(draw) < args.layer_drop ? 1 : 0;
      }
      next_block = 0;
      auto loss = model.forward([&] {
        for (size_t i = 0; i < skip.size(); ++i) {
          if (skip[i]) ferry::will_skip(*net->blocks[i]);  // said before any block runs
        }
        return gpt::GptImpl::loss(net->forward(x), y) / args.micro_batches;
      });
      blocks_dropped += std::count(skip.begin(), skip.end(), 1);
      block_runs += static_cast<int64_t>(skip.size());
      // The last backward and the step as one pipeline (Note [Pipelined step]).
      if (k + 1 == args.micro_batches) {
        r = adam.backward_step(loss);
      } else {
        model.backward(loss);
      }
      step_loss = step_loss.defined() ? step_loss + loss.detach() : loss.detach();
      const ferry::IterationStats it = model.last_iteration();
      moved_window += it.h2d_bytes + it.d2h_bytes;
      said_but_used += it.trace_hints_broken;
    }
    adam.zero_grad();
    const double loss_sum = step_loss.item<double>();
    if (tracing) {
      model.trace_last_phases();  // the last micro-batch's forward and backward as the device ran them
      ferry::trace::stop();
      ferry::trace::write_chrome_json(args.trace);
    }
    skipped += r.applied ? 0 : 1;
    ++steps_done;
    losses.push_back(loss_sum);
    window_loss += loss_sum;
    ++window_steps;
    const bool stopping = g_stop.load();
    if (window_steps == args.log_every || step + 1 == first_step + args.steps || stopping) {
      const double secs = std::chrono::duration<double>(Clock::now() - t_window).count();
      const auto ms = model.store().stats();
      const auto ss = adam.state_store().stats();
      double mean = window_loss / window_steps;
      if (comm && !stopping) {
        // The loss over every rank's batches: a collective, reached by every rank at the same steps
        // (not when a signal stopped this one: the others may not have seen it).
        at::Tensor all = at::full({1}, mean, at::kDouble);
        comm->all_reduce(all, ferry::dist::ReduceOp::kSum);
        mean = all.item<double>() / comm->world_size();
      }
      if (first_window_loss < 0) first_window_loss = mean;
      last_window_loss = mean;
      if (report) std::printf(
          "step %6lld  loss %.4f  lr %.2e  |g| %.3f  %8.0f tok/s  %6.3f TFLOPS  device %s (+state %s)  host %s "
          "(+state %s)  moved %s\n",
          static_cast<long long>(step + 1), mean, lr, r.grad_norm, tokens_per_step * window_steps / secs,
          flops_per_step * window_steps / secs / 1e12, ferry::format_bytes(ms.device.peak_bytes).c_str(),
          ferry::format_bytes(ss.device.current_bytes).c_str(), ferry::format_bytes(ms.host.current_bytes).c_str(),
          ferry::format_bytes(ss.host.current_bytes).c_str(), ferry::format_bytes(moved_window).c_str());
      std::fflush(stdout);
      model.store().reset_peak_stats();
      window_loss = 0;
      window_steps = 0;
      moved_window = 0;
      t_window = Clock::now();
    }
  }
  const double total = std::chrono::duration<double>(Clock::now() - t_start).count();
  if (g_stop.load() && report) std::printf("interrupted: stopped cleanly after step %lld\n", static_cast<long long>(adam.step_count(0)));
  if (report) std::printf(
      "summary: %lld steps in %.1f s (%.0f tokens/s), loss %.4f -> %.4f over the first/last %lld-step windows, "
      "%lld steps skipped, %s, device %s (%s), %s optimizer state on the device: %lld of %lld chunks\n",
      static_cast<long long>(steps_done), total, tokens_per_step * steps_done / total, first_window_loss,
      last_window_loss, static_cast<long long>(args.log_every), static_cast<long long>(skipped),
      ferry::to_string(config.precision), device.str().c_str(),
      config.device_budget_bytes ? ("budget " + ferry::format_bytes(config.device_budget_bytes)).c_str() : "no budget",
      ferry::to_string(args.format), static_cast<long long>(adam.device_state_chunks()), static_cast<long long>(model.layout().num_chunks()));
  if (report && args.layer_drop > 0) {
    std::printf("layer drop %.2f: %lld of %lld block runs skipped, said ahead (%lld trace uses said skipped came "
                "anyway)\n",
                args.layer_drop, static_cast<long long>(blocks_dropped), static_cast<long long>(block_runs),
                static_cast<long long>(said_but_used));
  }
  if (report && args.round_trip_slots > 0) {
    const ferry::optim::RoundTrips::Stats t = adam.round_trip_stats();
    std::printf("round trips: %lld of the host updates' parameter chunks through %lld slots (at most %lld held), %lld "
                "sent ahead, %lld returns left on the host for want of device room%s\n",
                static_cast<long long>(t.trips), static_cast<long long>(args.round_trip_slots),
                static_cast<long long>(t.peak_held), static_cast<long long>(t.sent_ahead),
                static_cast<long long>(t.left_on_host),
                t.slots == 0 ? " (not taken: see the warning above)" : "");
  }
  if (!args.save.empty()) adam.save(args.save);
  if (args.expect_loss_below > 0 && !(last_window_loss < args.expect_loss_below)) {
    std::fprintf(stderr, "train_gpt: final loss %.4f is not below %.4f\n", last_window_loss, args.expect_loss_below);
    return 1;
  }
  return 0;
}

}  // namespace
