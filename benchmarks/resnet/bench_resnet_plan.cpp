// bench_resnet_plan: the seed's case (MegEngine's sublinear memory: ResNet-50, batch 100 -> 200 on an
// 11 GB card) on the simulated device. The example's ResNet (examples/resnet/resnet.h) with each block a
// ferry::checkpoint segment trains `--steps` steps of ChunkedModel + HybridAdam at `--batch` under
// `--activations` (keep = as if not checkpointed, recompute, auto) within `--device-capacity`; the
// process heap stands for the GPU's memory (ChunkedModelOptions::measure_host_non_model: what forward
// and backward allocate counts against the capacity, as on a GPU). The simulated device cannot fail an
// allocation past the capacity as a GPU would (ferry shrinks the chunks' budget, the heap grows on), so
// the run "fits" when the non-model peak the trace saw plus the chunks' device peak is within the
// capacity: what a GPU of that capacity would have had to hold. Prints one JSON object: fits, the step
// time, the peaks, and the plan (or the error, if ferry itself ran out of memory).
//
//   bench_resnet_plan --batch=64 --activations=keep --device-capacity=... [--steps=6] + ferry options
//
// benchmarks/resnet/seed_case.py runs it at B and 2B at a capacity where B fits without checkpointing.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>

#include "../../examples/resnet/resnet.h"
#include "../../ferry.h"

namespace {

// The optimizer state's device bytes (its store's peak).
int64_t adam_state_device_peak(ferry::HybridAdam& adam) { return adam.state_store().stats().device.peak_bytes; }

int run(int argc, char** argv) {
  std::vector<std::string> rest;
  ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  ferry::log::configure(config.log_level, config.rank);
  int64_t steps = 6, batch = 64;
  std::string commit = "unknown";
  ferry::cli::Options options("bench_resnet_plan");
  options.also_accepts("ferry options", ferry::Config::help());
  options.add("steps", &steps, "steps, the first 3 unmeasured (default 6)", 4)
      .add("batch", &batch, "images per step (default 64)", 1, 1 << 20)
      .add("commit", &commit, "the commit to report");
  options.parse(rest);
  if (!ferry::cli::option_given(argc, argv, "device")) config.device = ferry::DeviceKind::kSimulated;
  if (!ferry::cli::option_given(argc, argv, "chunk-size")) config.chunk_size_bytes = 64 << 10;
  config.validate();
  TORCH_CHECK(config.device_capacity_bytes > 0, "bench_resnet_plan: give --device-capacity (what batch B fits in)");

  torch::manual_seed(42);
  resnet::ResNet net(10);
  net->checkpoint_blocks = true;
  ferry::ChunkedModelOptions model_options;
  model_options.measure_host_non_model = true;
  std::ostringstream out;
  out.precision(6);
  out << "{\"benchmark\": \"resnet_plan\", \"commit\": \"" << commit << "\", \"batch\": " << batch
      << ", \"activations\": \"" << ferry::to_string(config.activations) << "\", \"device_capacity_bytes\": "
      << config.device_capacity_bytes << ", \"steps\": " << steps;
  double measured = 0, last_loss = 0;
  int64_t non_model_peak = -1;
  std::string plan = "none";
  try {
    ferry::ChunkedModel model(net.ptr(), config, std::move(model_options));
    ferry::HybridAdam adam(model, ferry::HybridAdamOptions{});
    for (int64_t step = 0; step < steps; ++step) {
      torch::Tensor x, y;  // not a structured binding: the lambda below captures them (C++17)
      std::tie(x, y) = resnet::synthetic_batch(step, batch, 10);
      const auto start = std::chrono::steady_clock::now();
      auto loss = model.forward([&] { return torch::nn::functional::cross_entropy(net->forward(x), y); });
      adam.backward_step(loss);
      last_loss = loss.item<double>();
      if (step >= 3) measured += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    non_model_peak = model.scheduler().non_model_peak();
    const int64_t chunk_peak = model.store().stats().device.peak_bytes + adam_state_device_peak(adam);
    const ferry::ActivationSegments& a = model.activations();
    if (a.plans() > 0) {
      std::ostringstream p;
      p << "{\"kept\": " << a.plan().kept() << ", \"segments\": " << a.count() << ", \"kept_bytes\": "
        << a.plan().kept_bytes << ", \"room_bytes\": " << a.plan_input().room_bytes << "}";
      plan = p.str();
    }
    out << ", \"trained\": true, \"step_s\": " << measured / static_cast<double>(steps - 3) << ", \"loss_last\": "
        << last_loss << ", \"non_model_peak_bytes\": " << non_model_peak << ", \"chunk_device_peak_bytes\": " << chunk_peak
        << ", \"total_peak_bytes\": " << non_model_peak + chunk_peak << ", \"fits\": "
        << (non_model_peak + chunk_peak <= config.device_capacity_bytes ? "true" : "false") << ", \"plan\": " << (plan == "none" ? "null" : plan);
  } catch (const c10::OutOfMemoryError& e) {
    std::string what = ferry::cli::message_of(e);
    what = what.substr(0, what.find('\n'));
    for (char& c : what) c = c == '"' ? '\'' : c;
    out << ", \"trained\": false, \"error\": \"" << what << "\"";
  }
  out << "}";
  std::cout << out.str() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("bench_resnet_plan", [&] { return run(argc, argv); });
}
