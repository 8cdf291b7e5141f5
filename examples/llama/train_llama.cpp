// train_llama: fine-tunes a Hugging Face LLaMA folder through ferry (ChunkedModel + HybridAdam) and saves
// a Hugging Face folder that transformers loads (sharded safetensors + index, config.json, the
// tokenizer's files copied).
//
//   train_llama --model=DIR --data=FILE.tokens [--save=DIR] [--steps=100] [--batch=4] [--seq=256]
//               [--lr=1e-5] [--warmup=10] [--micro-batches=1] [--max-grad-norm=1.0]
//               [--checkpoint-activations] [--save-dtype=auto|bf16|fp16|fp32] [--max-shard-size=5GB]
//               [--seed=1] [--log-every=10] [--expect-loss-below=X]  + ferry's options
//   train_llama --preset=llama3-8b --steps=0 --save=DIR      a randomly initialised folder of that shape
//   train_llama --model=DIR --steps=0 --save=OUT --save-dtype=bf16 [--max-shard-size=2GB]   a conversion
//
// Tokens: FILE.tokens is the corpus already tokenised by the folder's own tokenizer, as little-endian
// uint32 ids (examples/llama/tokenize.py writes it with the `tokenizers` package from PyPI, which reads
// the folder's tokenizer.json). Tokenising in Python, once, keeps a Rust/C++ tokenizer out of ferry's
// build and gives exactly the ids transformers' own tokenizer gives. Without --data the batches are
// uniform random tokens (for timing only; said in the log).
//
// The weights come from the folder tensor by tensor into the chunks and the fp32 masters (optim/
// load_weights.h); the model is built inside InitScope, so no fp32 copy of it is ever made. The last
// line is one JSON object: load, step and save times, tokens/s, peak RSS, first and last loss.
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <random>
#include <tuple>

#include "../../common/durable_file.h"
#include "../../ferry.h"
#include "llama.h"

namespace {

std::atomic<bool> g_stop{false};
void on_stop_signal(int) { g_stop.store(true); }

struct Args {
  std::string model_dir, preset, data, save, save_dtype = "auto", max_shard = "5GB", commit = "unknown";
  int64_t steps = 100, batch = 4, seq = 256, micro_batches = 1, warmup = 10, log_every = 10, seed = 1;
  double lr = 1e-5, max_grad_norm = 1.0, expect_loss_below = 0;
  bool checkpoint_activations = false;
};

ferry::cli::Options options_for(Args& a) {
  ferry::cli::Options o("train_llama", "--model=DIR | --preset=NAME [options]");
  o.also_accepts("ferry options", ferry::Config::help());
  o.add("model", &a.model_dir, "a Hugging Face LLaMA folder to fine-tune (config.json + safetensors)")
      .add("preset", &a.preset, "instead of --model: a random model of a published shape (" +
                                    [] {
                                      std::string s;
                                      for (const auto& n : llama::preset_names()) s += (s.empty() ? "" : ", ") + n;
                                      return s;
                                    }() + ")")
      .add("data", &a.data, "tokens as little-endian uint32 (tokenize.py); none: random tokens")
      .add("save", &a.save, "write a Hugging Face folder into DIR at the end (checked before training)")
      .add("save-dtype", &a.save_dtype, "dtype of the saved weights: auto (the folder's), bf16, fp16, fp32")
      .add("max-shard-size", &a.max_shard, "largest safetensors shard (default 5GB)")
      .add("steps", &a.steps, "optimizer steps (default 100)", 0)
      .add("batch", &a.batch, "sequences per step (default 4)", 1, int64_t{1} << 24)
      .add("seq", &a.seq, "tokens per sequence (default 256)", 2, int64_t{1} << 24)
      .add("lr", &a.lr, "peak learning rate (default 1e-5)", 0.0, 1e3)
      .add("warmup", &a.warmup, "linear warm-up steps (default 10)", 0)
      .add("micro-batches", &a.micro_batches, "gradient accumulation: micro-batches per step (default 1)", 1)
      .add("max-grad-norm", &a.max_grad_norm, "global gradient clipping, 0 = none (default 1.0)", 0.0)
      .add_flag("checkpoint-activations", &a.checkpoint_activations, "make each layer a ferry::checkpoint segment")
      .add("seed", &a.seed, "data seed, and the initialisation's with --preset (default 1)")
      .add("log-every", &a.log_every, "steps per progress line (default 10)", 1)
      .add("expect-loss-below", &a.expect_loss_below, "exit 1 unless the last window's mean loss is below X", 0.0)
      .add("commit", &a.commit, "commit id recorded in the JSON line");
  return o;
}

at::ScalarType save_dtype(const std::string& s, const std::string& folder_dtype) {
  const std::string v = s == "auto" ? folder_dtype : s;
  if (v == "bf16" || v == "bfloat16") return at::kBFloat16;
  if (v == "fp16" || v == "float16") return at::kHalf;
  if (v == "fp32" || v == "float32") return at::kFloat;
  throw ferry::cli::UsageError("--save-dtype: expected auto, bf16, fp16 or fp32, got '" + v + "'" +
                               (s == "auto" ? " (the folder's dtype)" : ""));
}

// The corpus as token ids, each checked against the vocabulary.
at::Tensor read_tokens(const std::string& path, int64_t vocab) {
  const int64_t bytes = ferry::file_size(path);
  TORCH_CHECK(bytes >= 0, "train_llama: cannot read --data ", path);
  TORCH_CHECK(bytes % 4 == 0, "train_llama: ", path, " has ", bytes, " bytes, not a whole number of uint32 tokens");
  std::vector<uint32_t> ids(static_cast<size_t>(bytes / 4));
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(ids.data()), bytes);
  TORCH_CHECK(in.gcount() == bytes, "train_llama: reading ", path, " stopped early");
  at::Tensor t = at::empty({static_cast<int64_t>(ids.size())}, at::kLong);
  int64_t* p = t.data_ptr<int64_t>();
  for (size_t i = 0; i < ids.size(); ++i) {
    TORCH_CHECK(ids[i] < static_cast<uint64_t>(vocab), "train_llama: token ", i, " of ", path, " is ", ids[i],
                ", outside the model's vocabulary of ", vocab, " (tokenised for another model?)");
    p[i] = ids[i];
  }
  return t;
}

void copy_file(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  const std::string text = s.str();
  ferry::DurableFile f(to);
  f.write(text.data(), text.size());
  f.sync_and_close();
}

// A Hugging Face folder: the weights (sharded safetensors + index), config.json, and the source folder's
// tokenizer files.
void save_folder(const std::string& dir, const ferry::NamedTensors& weights, const llama::LlamaConfig& lc,
                 at::ScalarType dtype, int64_t max_shard, const std::string& source_dir) {
  ferry::SafetensorsFolderOptions so;
  so.max_shard_bytes = max_shard;
  so.floating_as = dtype;
  ferry::write_safetensors_folder(dir, weights, so);
  llama::LlamaConfig saved = lc;
  saved.dtype = dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
  const std::string text = saved.to_json();
  ferry::DurableFile f(dir + "/config.json");
  f.write(text.data(), text.size());
  f.sync_and_close();
  if (!source_dir.empty()) {  // the tokenizer travels with the weights
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                             "generation_config.json"}) {
      if (ferry::file_size(source_dir + "/" + name) >= 0) copy_file(source_dir + "/" + name, dir + "/" + name);
    }
  }
  ferry::fsync_dir(dir);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int train(int argc, char** argv) {
  std::vector<std::string> rest;
  ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  if (!ferry::cli::option_given(argc, argv, "activations")) config.activations = ferry::ActivationPolicy::kAuto;
  ferry::log::configure(config.log_level, config.rank);
  Args args;
  options_for(args).parse(rest);
  if (args.model_dir.empty() == args.preset.empty()) throw ferry::cli::UsageError("give one of --model and --preset");
  if (args.batch % args.micro_batches != 0) {
    throw ferry::cli::UsageError("--batch (" + std::to_string(args.batch) + ") must be a multiple of --micro-batches (" +
                                 std::to_string(args.micro_batches) + ")");
  }
  const int64_t max_shard = ferry::parse_bytes(args.max_shard);
  const bool cuda = ferry::resolve_device_kind(config.device) == ferry::DeviceKind::kCuda;
  if (!ferry::cli::option_given(argc, argv, "precision")) {
    config.precision = cuda ? ferry::Precision::kBf16 : ferry::Precision::kFp32;
  }
  const llama::LlamaConfig lc =
      args.model_dir.empty() ? llama::preset(args.preset) : llama::LlamaConfig::from_folder(args.model_dir);
  const at::ScalarType out_dtype = save_dtype(args.save_dtype, lc.dtype);
  if (args.seq > lc.max_positions) {
    ferry::log::warn("train_llama: --seq=", args.seq, " is beyond the model's max_position_embeddings (",
                     lc.max_positions, ")");
  }
  if (!args.save.empty() && config.rank == 0) ferry::HybridAdam::check_save_target(args.save);
  if (args.steps == 0) {
    // A conversion, no training: the folder (or the preset's random weights) written in --save-dtype, in
    // shards of --max-shard-size. The module is built in that dtype and written from its own tensors.
    if (args.save.empty()) throw ferry::cli::UsageError("--steps=0 without --save has nothing to do");
    const auto t = std::chrono::steady_clock::now();
    torch::manual_seed(args.seed);
    std::shared_ptr<llama::LlamaImpl> net;
    {
      ferry::InitScope scope(out_dtype);
      net = std::make_shared<llama::LlamaImpl>(lc);
    }
    if (!args.model_dir.empty()) ferry::load_safetensors(*net, args.model_dir);
    ferry::NamedTensors weights;
    for (const auto& p : net->named_parameters()) weights.emplace_back(p.key(), p.value().detach());
    save_folder(args.save, weights, lc, out_dtype, max_shard, args.model_dir);
    std::printf("{\"model\": \"%s\", \"params\": %lld, \"saved\": \"%s\", \"save_s\": %.3f}\n", lc.name.c_str(),
                static_cast<long long>(lc.num_params()), args.save.c_str(), seconds_since(t));
    return 0;
  }
  const std::shared_ptr<ferry::dist::Communicator> comm = ferry::dist::connect(config, false);
  const bool report = config.rank == 0;
  const int64_t elem = config.precision == ferry::Precision::kFp32 ? 4 : 2;
  if (!ferry::cli::option_given(argc, argv, "device-budget")) {
    config.device_budget_bytes = cuda ? static_cast<int64_t>(0.9 * ferry::query_gpus().total_memory_bytes)
                                      : lc.num_params() * elem / 2;  // the CPU: half the model, so chunks move
  }
  config.validate();
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  const at::Tensor corpus = args.data.empty() ? at::Tensor() : read_tokens(args.data, lc.vocab);
  if (corpus.defined()) {
    TORCH_CHECK(corpus.numel() > args.seq + 1, "train_llama: ", args.data, " has ", corpus.numel(),
                " tokens, fewer than one sequence of --seq=", args.seq, " + 1");
  } else if (args.steps > 0) {
    ferry::log::warn("train_llama: no --data: training on uniform random tokens (for timing only)");
  }

  torch::manual_seed(args.seed);
  std::shared_ptr<llama::LlamaImpl> net;
  {
    ferry::InitScope scope(config.precision);  // no fp32 copy of the model is ever made
    net = std::make_shared<llama::LlamaImpl>(lc);
  }
  if (args.checkpoint_activations) {
    net->run_layer = [](llama::DecoderLayer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
      return ferry::checkpoint(
          [l](const std::vector<at::Tensor>& in) mutable { return l->forward(in[0], in[1], in[2]); }, {x, cos, sin});
    };
  }
  ferry::ChunkedModel model(net, config);
  ferry::AdamOptions adam_options;
  adam_options.lr = args.lr;
  adam_options.weight_decay = 0.0;
  adam_options.beta2 = 0.95;
  ferry::HybridAdamOptions options = ferry::HybridAdamOptions::no_decay_for_bias_and_norm(adam_options);
  options.max_grad_norm = args.max_grad_norm;
  options.accumulate_grads = args.micro_batches > 1;
  options.communicator = comm;
  ferry::HybridAdam adam(model, options);
  double load_s = 0;
  if (!args.model_dir.empty()) {
    const auto t = std::chrono::steady_clock::now();
    const ferry::WeightLoadPlan plan = ferry::load_safetensors(adam, model, args.model_dir);
    load_s = seconds_since(t);
    ferry::log::info("train_llama: loaded ", args.model_dir, " (", ferry::format_bytes(plan.bytes), ") in ", load_s,
                     " s");
  }
  if (report) {
    std::printf("train_llama: %s, %.1fM parameters, hidden %lld x %lld layers, %lld heads (%lld key/value), %s\n",
                lc.name.c_str(), lc.num_params() / 1e6, static_cast<long long>(lc.hidden),
                static_cast<long long>(lc.layers), static_cast<long long>(lc.heads),
                static_cast<long long>(lc.kv_heads), ferry::to_string(config.precision));
  }

  const c10::Device device = model.store().device();
  std::mt19937_64 rng(static_cast<uint64_t>(args.seed) * 7919 + static_cast<uint64_t>(config.rank) * 1000003);
  const int64_t micro = args.batch / args.micro_batches;
  auto sample = [&]() -> std::pair<at::Tensor, at::Tensor> {
    at::Tensor rows = at::empty({micro, args.seq + 1}, at::kLong);
    if (!corpus.defined()) {
      std::uniform_int_distribution<int64_t> tok(0, lc.vocab - 1);
      int64_t* p = rows.data_ptr<int64_t>();
      for (int64_t i = 0; i < rows.numel(); ++i) p[i] = tok(rng);
    } else {
      std::uniform_int_distribution<int64_t> start(0, corpus.numel() - args.seq - 2);
      for (int64_t b = 0; b < micro; ++b) rows[b].copy_(corpus.narrow(0, start(rng), args.seq + 1));
    }
    return {rows.narrow(1, 0, args.seq).to(device), rows.narrow(1, 1, args.seq).to(device)};
  };
  const double tokens_per_step = static_cast<double>(args.batch * args.seq * config.world_size);
  double window = 0, first_loss = -1, last_loss = 0, steps_s = 0;
  int64_t window_steps = 0, done = 0;
  for (int64_t step = 0; step < args.steps && !g_stop.load(); ++step) {
    const auto t = std::chrono::steady_clock::now();
    adam.set_lr(args.lr * std::min(1.0, static_cast<double>(step + 1) / std::max<int64_t>(1, args.warmup)));
    at::Tensor step_loss;
    for (int64_t k = 0; k < args.micro_batches; ++k) {
      at::Tensor x, y;  // not a structured binding: the lambda below captures them (C++17)
      std::tie(x, y) = sample();
      at::Tensor loss =
          model.forward([&] { return llama::LlamaImpl::loss(net->forward(x), y) / args.micro_batches; });
      if (k + 1 == args.micro_batches) {
        adam.backward_step(loss);
      } else {
        model.backward(loss);
      }
      step_loss = step_loss.defined() ? step_loss + loss.detach() : loss.detach();
    }
    adam.zero_grad();
    window += step_loss.item<double>();
    if (step > 0) steps_s += seconds_since(t);  // the first step is the warm-up
    ++done;
    if (++window_steps == args.log_every || step + 1 == args.steps || g_stop.load()) {
      const double mean = window / window_steps;
      if (first_loss < 0) first_loss = mean;
      last_loss = mean;
      if (report) std::printf("step %6lld  loss %.4f\n", static_cast<long long>(step + 1), mean);
      std::fflush(stdout);
      window = 0;
      window_steps = 0;
    }
  }
  double save_s = 0;
  if (!args.save.empty()) {
    const auto t = std::chrono::steady_clock::now();
    ferry::NamedTensors weights = adam.state_dict();  // fp32 masters (a collective when sharded)
    if (config.rank == 0) save_folder(args.save, weights, lc, out_dtype, max_shard, args.model_dir);
    save_s = seconds_since(t);
  }
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  // What the process must hold at least: the compute copies and the fp32 master and moments (12 B/param).
  const int64_t floor_bytes = lc.num_params() * (elem + 12);
  if (report) {
    std::printf("{\"benchmark\": \"train_llama\", \"commit\": \"%s\", \"env\": %s, \"floor_bytes\": %lld, ",
                args.commit.c_str(), ferry::env_report_json(ferry::collect_env_report()).c_str(),
                static_cast<long long>(floor_bytes));
    std::printf(
        "\"model\": \"%s\", \"params\": %lld, \"precision\": \"%s\", \"device\": \"%s\", \"load_s\": %.3f, "
        "\"steps\": %lld, \"step_s\": %.4f, \"tokens_per_s\": %.1f, \"model_tflops\": %.3f, \"save_s\": %.3f, "
        "\"peak_rss_bytes\": %lld, \"first_loss\": %.5f, \"last_loss\": %.5f}\n",
        lc.name.c_str(), static_cast<long long>(lc.num_params()), ferry::to_string(config.precision),
        device.str().c_str(), load_s, static_cast<long long>(done), done > 1 ? steps_s / (done - 1) : 0.0,
        done > 1 ? tokens_per_step * (done - 1) / steps_s : 0.0,
        done > 1 ? 3 * lc.forward_flops_per_token(args.seq) * tokens_per_step * (done - 1) / steps_s / 1e12 : 0.0, save_s,
        static_cast<long long>(u.ru_maxrss) * 1024, first_loss, last_loss);
  }
  if (args.expect_loss_below > 0 && !(last_loss < args.expect_loss_below)) {
    std::fprintf(stderr, "train_llama: final loss %.4f is not below %.4f\n", last_loss, args.expect_loss_below);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("train_llama", [&] { return train(argc, argv); });
}
