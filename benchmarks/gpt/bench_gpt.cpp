// bench_gpt: one GPT preset trained through ferry (ChunkedModel + HybridAdam), measured per step, and
// the same model trained unwrapped in plain LibTorch as the baseline when it fits. Prints one JSON
// document (progress on stderr).
//
//   bench_gpt [--preset=small] [--batch=8] [--seq=256] [--steps=5] [--warmup-steps=2]
//             [--checkpoint-activations] [--joint-placement] [--state-format=fp32|compact] [--no-baseline] [--find-max] [--trace=FILE.json] [--commit=SHA]
//             [--unpipelined] [--replicate-params] [--keep-gathered] [--reshard-gap=16]
//             [--profile=FILE.json] [--profile-ferry=FILE.json]
//             + ferry options   (--trace: a Chrome trace of the last measured step)
//
// The step is HybridAdam::backward_step (the pipelined step, Note [Pipelined step]); --unpipelined runs
// model.backward() + adam.step() instead. Per step it splits the time into forward, backward and
// optimizer (each ending in a device sync on CUDA; pipelined, backward is timed on the device's clock,
// ChunkedModel::last_phase_seconds, and "optimizer" is the rest of the step), and reports the time compute waited for copies, tokens/s, TFLOPS counted as 6*N*tokens and
// 8*N*tokens (with recompute), peak device / host / pinned memory, bytes moved and moved/optimal, host
// synchronizations and chunk transfers per step, and the floors: the step's GPU compute at the rate
// measured in this binary (the baseline's, or a GEMM probe), its transfers at the measured copy
// bandwidth, its host Adam at the measured CpuAdam roof, its host memory traffic (host Adam + copies) at
// the same roof; measured / floor says how far from the limit; the schedule floor (forward's compute
// plus the larger of backward's and the host memory's, D52) says how far from what this design can do.
// --max-grad-norm=X clips in ferry and the baseline: ferry's step is then two-phase (Note [Pipelined
// step]): its host Adam follows backward, running beside the next forward (Note [Update behind the next
// forward]; --sync-update: before the step returns), and the schedule floor says so.
// It also measures the interception overhead in ns per op (an op on a managed parameter inside
// ChunkedModel's scope against the same op on a plain tensor; and ops outside the scopes on a thread that
// watches, D57), one look for writes to the parameters ("take_writes_us", D60) and one comparison of the
// module's parameters with the wrapped ones ("check_parameters_us", D63).
// --find-max: the largest preset (in parameter count) that trains 3 steps within the given budgets.
// Under torchrun (world size > 1) the parameter chunks are sharded (Note [Sharded parameters]);
// --replicate-params keeps every chunk on every rank, --keep-gathered keeps a gathered group to the step
// instead of giving it up after forward; the "dist" section reports bytes sent against the floor and
// the parameter and state bytes per rank between steps and at the peak.
// Baseline: on CUDA bf16 autocast + fused AdamW; on the CPU fp32 + torch::optim::AdamW.
#include "../../ferry.h"
#include <torch/cuda.h>
#include <torch/torch.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#ifdef FERRY_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <sys/resource.h>

#include <chrono>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

#include "../../examples/gpt/gpt.h"
#include "bench_args.h"
#include "machine_rates.h"
#include "step_floor.h"

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

using bench_gpt::Args;

// The torch profiler (Kineto: operators with their input shapes and strides, and CUDA kernels on CUDA)
// over one step; each phase of the step in a user scope "phase.NAME" that ends after the phase's device
// sync, so that the profile attributes kernels by time (benchmarks/profile_compare.py reads them).
class StepProfile {
 public:
  StepProfile(std::string path, bool cuda) : path_(std::move(path)) {
    if (path_.empty()) return;
    namespace prof = torch::profiler::impl;
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
    std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
    if (cuda) activities.insert(prof::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  }
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;
  // Writes the profile; `what` names the step in the progress line.
  void save(const std::string& what) {
    if (path_.empty()) return;
    torch::autograd::profiler::disableProfiler()->save(path_);
    std::cerr << "bench_gpt: wrote the profile of " << what << " to " << path_ << "\n";
    path_.clear();
  }
  ~StepProfile() {
    if (path_.empty()) return;
    try {  // not saved (an exception left the step): the profiler is still switched off
      torch::autograd::profiler::disableProfiler();
    } catch (...) {
    }
  }

 private:
  std::string path_;
};

// Peak resident set of this process so far (getrusage; Linux reports KiB).
int64_t rss_peak_bytes() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

struct StepTimes {
  double forward = 0, backward = 0, optimizer = 0, wait = 0, total = 0;
};

std::string json_times(const StepTimes& t) {
  std::ostringstream os;
  os.precision(6);
  os << "{\"forward_s\":" << t.forward << ",\"backward_s\":" << t.backward << ",\"optimizer_s\":" << t.optimizer
     << ",\"copy_wait_s\":" << t.wait << ",\"step_s\":" << t.total << "}";
  return os.str();
}

void sync(bool cuda) {
  if (cuda) torch::cuda::synchronize();
}

// Bytes of memory allocated now: the CUDA caching allocator's on a GPU, glibc's heap (arenas + mmapped
// blocks) on the CPU. The difference across forward() is the activation memory autograd keeps.
int64_t allocated_bytes(bool cuda) {
#ifdef FERRY_WITH_CUDA
  if (cuda) {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device()).allocated_bytes[0].current;
  }
#endif
  (void)cuda;
  return ferry::host_heap_in_use_bytes();
}

// One micro-batch: batch / micro_batches sequences.
std::pair<at::Tensor, at::Tensor> batch_of(const Args& a, int64_t vocab, std::mt19937_64& rng, c10::Device d) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(rng());
  auto x = at::randint(vocab, {a.batch / a.micro_batches, a.seq}, gen, at::kLong);
  return {x.to(d), at::roll(x, -1, 1).to(d)};
}

struct FerryResult {
  StepTimes mean;
  // moved_bytes: the parameter chunks' per step, the step's own between two iterations included (D101);
  // optimal_bytes: the reference's per step (-1: a measured iteration had none); moved_over_optimal:
  // their ratio over the measured steps (D104: one iteration's alone swings with the reference's cycle).
  double moved_bytes = 0, optimal_bytes = 0, moved_over_optimal = 0, device_peak = 0, host_peak = 0, pinned_peak = 0;
  double state_device = 0, state_host = 0, loss_first = 0, loss_last = 0, activation_bytes = 0;
  int64_t chunks = 0, device_state_chunks = 0, evictions = 0;
  // Note [Writes to parameters]: one look for writes over every parameter tensor, none written (us).
  double take_writes_us = 0;
  // Note [The module's parameters]: one comparison of the module's parameters with the wrapped ones (us).
  double check_parameters_us = 0;
  int64_t param_tensors = 0;
  // Memory, per parameter and in bytes: at the end of the run (steady state), host and device tiers of
  // both stores (parameter chunks + optimizer state; packing waste included).
  double host_bytes_per_param = 0, device_bytes_per_param = 0, waste = 0, chunk_size_bytes = 0;
  std::string by_role_json;  // bytes per parameter of each chunk role, host + device
  ferry::optim::RoundTrips::Stats round_trips;  // Note [Round trips through K buffers], over the whole run
  double param_host_peak_in_steps = 0;  // the parameter chunks' host bytes at most, in the measured steps
  double param_pool_peak = 0;         // peak of the parameter chunks' host buffers: pinned on CUDA
  double state_pool_peak = 0;         // the optimizer state's host buffers (never pinned)
  double rss_after_construction = 0;  // process RSS peak once model and optimizer are built
  double rss_peak = 0;                // process RSS peak at the end of the run
  double startup_s = 0;               // model construction to the end of the first step
  double construction_s = 0;          // model + ChunkedModel + HybridAdam
  // Where start-up goes: the module's constructor, ChunkedModel's (packing into chunks), HybridAdam's
  // (the fp32 masters), the first step, and the repack inside it (ChunkedModel::last_repack_seconds).
  double module_s = 0, wrap_s = 0, optimizer_construction_s = 0, first_step_s = 0, repack_s = 0;
  // Per measured step (means): host synchronizations of the training thread (chunk stores + the
  // optimizer's), those of the optimizer's worker, chunk transfers, and bytes each way.
  double syncs = 0, background_syncs = 0, transfers = 0, h2d_bytes = 0, d2h_bytes = 0;
  double overlapped_chunks = 0;
  double written_back_chunks = 0;  // accumulation: chunks whose new values a copy wrote after the update
  double deferred_chunks = 0;      // host updates left running behind the step (Note [Update behind the next forward])
  double host_norm_bytes = 0;      // gradient bytes the host read for norms (Note [Norms before the trip])
  double host_state_params = 0;  // parameters whose optimizer state is on the host (host Adam)
  std::string plan_json;         // Config::activations and the activation plan that applied at the end
  // Data parallelism (world size > 1), per measured step: bytes this rank sent as the ring algorithm
  // sends them (dist::CommStats), collectives, time in them; the parameter chunks' bytes.
  double ring_bytes = 0, collectives = 0, comm_s = 0, param_chunk_bytes = 0;
  // Parameter chunk bytes present on this rank (sharded: its own + those gathered now): after the last
  // step, and the largest seen at the end of a measured forward or backward. Group gathers per step.
  double param_bytes_between_steps = 0, param_bytes_peak = 0, gathers = 0;
};

// The activation plan as bench_gpt's JSON reports it beside the measured step ("plan").
std::string plan_json(const ferry::ActivationSegments& a, const ferry::JointRates& rates) {
  std::ostringstream os;
  os.precision(6);
  const ferry::MemoryPlan& p = a.plan();
  const ferry::MemoryPlanInput& in = a.plan_input();
  os << "{\"policy\": \"" << ferry::to_string(a.policy()) << "\", \"segments\": " << a.count()
     << ", \"plans\": " << a.plans() << ", \"replans\": " << a.replans();
  if (a.plans() > 0) {
    int64_t measured_bytes = 0;
    double recompute = 0;
    for (const auto& s : in.segments) {
      measured_bytes += std::max<int64_t>(s.saved_bytes, 0);
      recompute += s.recompute_s;
    }
    os << ", \"solver\": \"" << p.solver() << "\", \"kept\": " << p.kept() << ", \"kept_bytes\": " << p.kept_bytes
       << ", \"all_segments_bytes\": " << measured_bytes << ", \"room_bytes\": " << in.room_bytes
       << ", \"recompute_measured_s\": " << recompute << ", \"recompute_left_s\": " << p.recompute_s
       << ", \"groups_on_device\": " << p.groups_on_device << ", \"forward_measured_s\": " << in.forward_s
       << ", \"backward_measured_s\": " << in.backward_s << ", \"predicted_step_s\": " << p.predicted_step_s
       << ", \"predicted_host_wait_s\": " << p.host_wait_s << ", \"planned_groups\": " << in.groups.size();
    if (!in.groups.empty()) {  // the joint placement's: the host Adam alone, in the steps before, used,
                               // and in the last steps under its placement
      os << ", \"rates\": {\"host_adam_alone_gb_per_s\": " << rates.host_adam_alone_bytes_per_s / 1e9
         << ", \"host_adam_in_steps_gb_per_s\": " << rates.host_adam_in_steps_bytes_per_s / 1e9
         << ", \"host_adam_used_gb_per_s\": " << rates.used.host_adam_bytes_per_s / 1e9
         << ", \"host_adam_under_plan_gb_per_s\": " << rates.host_adam_under_plan_bytes_per_s / 1e9
         << ", \"copy_gb_per_s\": " << rates.used.copy_bytes_per_s / 1e9
         << ", \"device_gb_per_s\": " << rates.used.device_bytes_per_s / 1e9 << ", \"solves\": " << rates.solves << "}";
    }
  }
  os << "}";
  return os.str();
}

ferry::MoveStats sum_moves(const ferry::MoveStats& x, const ferry::MoveStats& y) {
  ferry::MoveStats m;
  m.h2d_count = x.h2d_count + y.h2d_count;
  m.d2h_count = x.d2h_count + y.d2h_count;
  m.h2d_bytes = x.h2d_bytes + y.h2d_bytes;
  m.d2h_bytes = x.d2h_bytes + y.d2h_bytes;
  m.sync_count = x.sync_count + y.sync_count;
  m.background_sync_count = x.background_sync_count + y.background_sync_count;
  return m;
}

// Bytes of the parameter chunks that have a payload in this process now.
double present_param_bytes(ferry::ChunkedModel& model) {
  double bytes = 0;
  for (int64_t c = 0; c < model.layout().num_chunks(); ++c) {
    const ferry::ChunkInfo info = model.store().chunk_info(model.param_chunk(c));
    if (info.location != ferry::Location::kNone) bytes += static_cast<double>(info.nbytes);
  }
  return bytes;
}

FerryResult run_ferry(const Args& a, const gpt::GptConfig& gc, ferry::Config config, bool cuda,
                      const std::shared_ptr<ferry::dist::Communicator>& comm = nullptr) {
  torch::manual_seed(1);
  const auto t_start = Clock::now();
  std::shared_ptr<gpt::GptImpl> net;
  if (config.rank == 0) {  // the module's constructor is the longest silent part of a large run
    std::cerr << "bench_gpt: building the " << gc.name << " preset (" << gc.num_params() / 1e6 << "M parameters) "
              << (a.init_scope ? "inside ferry::InitScope" : "in fp32") << "\n";
  }
  if (a.init_scope) {  // parameters built in the compute dtype: no fp32 model ever exists
    ferry::InitScope scope(config.precision);
    net = std::make_shared<gpt::GptImpl>(gc);
  } else {
    net = std::make_shared<gpt::GptImpl>(gc);
  }
  const double module_s = since(t_start);
  if (config.rank == 0) {
    std::cerr << "bench_gpt: module built in " << module_s << " s; wrapping it in ChunkedModel\n";
  }
  if (a.checkpoint) {
    net->run_block = [](gpt::Block& b, const torch::Tensor& x) {
      return ferry::checkpoint([b](const std::vector<at::Tensor>& in) mutable { return b->forward(in[0]); }, {x});
    };
  }
  ferry::ChunkedModelOptions model_options;
  if (a.copies == "stream") model_options.copy_engine = [] { return std::make_unique<ferry::StreamModelCopyEngine>(); };
  model_options.scheduler.reshard_after_forward = !a.keep_gathered;
  model_options.scheduler.reshard_min_gap = a.reshard_gap;
  ferry::ChunkedModel model(net, config, std::move(model_options));
  const double wrapped_s = since(t_start);
  ferry::AdamOptions o;
  o.lr = 1e-4;
  o.weight_decay = 0.1;
  ferry::HybridAdamOptions adam_options = ferry::HybridAdamOptions::no_decay_for_bias_and_norm(o);
  adam_options.max_grad_norm = a.max_grad_norm;
  adam_options.accumulate_grads = a.micro_batches > 1;
  adam_options.communicator = comm;  // null: one process
  adam_options.shard_params = !a.replicate_params;
  adam_options.update_behind_forward = !a.sync_update;
  adam_options.plan_state_with_activations = a.joint_placement;
  adam_options.state_format = a.format;
  adam_options.round_trip_slots = a.round_trip_slots;
  ferry::HybridAdam adam(model, adam_options);
  const c10::Device device = model.store().device();
  std::mt19937_64 rng(7 + config.rank);  // each rank its own batches
  FerryResult r;
  r.construction_s = since(t_start);
  r.module_s = module_s;
  r.wrap_s = wrapped_s - module_s;
  r.optimizer_construction_s = r.construction_s - wrapped_s;
  r.rss_after_construction = static_cast<double>(rss_peak_bytes());
  r.waste = model.layout().waste();
  r.chunk_size_bytes = static_cast<double>(model.chunk_size_bytes());
  std::cerr << "bench_gpt: built in " << r.construction_s << " s, RSS peak " << ferry::format_bytes(rss_peak_bytes())
            << ", chunk size " << ferry::format_bytes(model.chunk_size_bytes()) << ", waste " << r.waste * 100 << "%\n";
  r.chunks = model.layout().num_chunks();
  {
    const int reps = 1000;
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) model.take_writes("bench_gpt");
    r.take_writes_us = since(t0) * 1e6 / reps;
    const auto t1 = Clock::now();
    for (int i = 0; i < reps; ++i) model.check_module_parameters("bench_gpt");
    r.check_parameters_us = since(t1) * 1e6 / reps;
    r.param_tensors = model.num_params();
  }
  // A profiled step is one more, after the measured ones: the profiler's cost stays out of the means.
  const bool profiling = !a.profile_ferry.empty();
  for (int64_t s = 0; s < a.warmup_steps + a.steps + (profiling ? 1 : 0); ++s) {
    const bool profiled = profiling && s == a.warmup_steps + a.steps;
    const bool measured = s >= a.warmup_steps && !profiled;
    if (measured && s == a.warmup_steps) {
      model.store().reset_peak_stats();
      adam.state_store().reset_peak_stats();
#ifdef FERRY_WITH_CUDA
      if (cuda) c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
#endif
    }
    const bool tracing = !a.trace.empty() && s == a.warmup_steps + a.steps - 1;  // the last measured step
    if (tracing) ferry::trace::start();
    StepProfile profile(profiled ? a.profile_ferry : std::string(), cuda);
    sync(cuda);
    const ferry::MoveStats moves_before = sum_moves(model.store().stats().moves, adam.state_store().stats().moves);
    const ferry::dist::CommStats comm_before = comm ? comm->stats() : ferry::dist::CommStats{};
    const auto shards_before = adam.param_shards() ? adam.param_shards()->stats() : ferry::dist::ParamShardStats{};
    // Micro-batches before the last: forward + backward (accumulating), each phase summed; the last one's
    // backward is the step's (pipelined or not).
    double f = 0, b = 0, o_s = 0, moved = 0, optimal = 0, wait_s = 0;
    auto count_optimal = [&](const ferry::IterationStats& it) {
      optimal = optimal < 0 || it.optimal_bytes < 0 ? -1.0 : optimal + static_cast<double>(it.optimal_bytes);
    };
    int64_t evictions = 0;
    double present_after_forward = 0, present_after_backward = 0;
    int64_t activations = 0;
    at::Tensor loss, loss_sum;
    for (int64_t k = 0; k < a.micro_batches; ++k) {
      at::Tensor x, y;  // not a structured binding: the lambda below captures them (C++17)
      std::tie(x, y) = batch_of(a, gc.vocab, rng, device);
      const int64_t before_forward = allocated_bytes(cuda);
      auto t0 = Clock::now();
      {
        RECORD_USER_SCOPE("phase.forward");
        loss = model.forward([&] { return gpt::GptImpl::loss(net->forward(x), y) / a.micro_batches; });
        sync(cuda);
      }
      f += since(t0);
      present_after_forward = std::max(present_after_forward, present_param_bytes(model));
      activations = std::max(activations, allocated_bytes(cuda) - before_forward);
      loss_sum = loss_sum.defined() ? loss_sum + loss.detach() : loss.detach();
      if (k + 1 == a.micro_batches) break;
      auto t1 = Clock::now();
      {
        RECORD_USER_SCOPE("phase.backward");
        model.backward(loss);
        sync(cuda);
      }
      b += since(t1);
      const ferry::IterationStats it = model.last_iteration();
      moved += static_cast<double>(it.moved_bytes());
      count_optimal(it);
      wait_s += static_cast<double>(it.wait_ns) * 1e-9;
      evictions += it.evictions;
      present_after_backward = std::max(present_after_backward, present_param_bytes(model));
    }
    auto t1 = Clock::now();
    ferry::StepResult step;
    if (a.unpipelined) {
      {
        RECORD_USER_SCOPE("phase.backward");
        model.backward(loss);
        sync(cuda);
      }
      b += since(t1);
      present_after_backward = std::max(present_after_backward, present_param_bytes(model));
      auto t2 = Clock::now();
      {
        RECORD_USER_SCOPE("phase.optimizer");
        step = adam.step();
        adam.zero_grad();
        sync(cuda);
      }
      o_s = since(t2);
    } else {
      {
        // Backward and the optimizer interleaved: one phase (profile_compare.py's "step" spans them all).
        RECORD_USER_SCOPE("phase.backward_step");
        step = adam.backward_step(loss);
        sync(cuda);
      }
      const double total = since(t1);
      // Backward as the device ran it (the host's backward() returns while its kernels still run, and
      // the step's first wait would be charged to the optimizer); the optimizer is the rest of the step.
      const double last_backward = std::min(total, model.last_phase_seconds().backward);
      b += last_backward;
      o_s = total - last_backward;
    }
    const ferry::MoveStats moves = sum_moves(model.store().stats().moves, adam.state_store().stats().moves);
    if (s == 0) {
      r.startup_s = since(t_start);
      r.first_step_s = r.startup_s - r.construction_s;
      r.repack_s = model.last_repack_seconds();  // the warm-up's (0 with repack_after_warmup off)
    }
    profile.save("ferry step " + std::to_string(s));
    if (tracing) {
      model.trace_last_phases();  // forward and backward as the GPU ran them, on a "device" track
      ferry::trace::stop();
      ferry::trace::write_chrome_json(a.trace);
    }
    const ferry::IterationStats it = model.last_iteration();
    moved += static_cast<double>(it.moved_bytes());
    count_optimal(it);
    wait_s += static_cast<double>(it.wait_ns) * 1e-9;
    evictions += it.evictions;
    const double l = loss_sum.item<double>();
    std::cerr << "bench_gpt: ferry step " << s << (profiled ? " (profiled)" : measured ? "" : " (warm-up)") << ": fwd "
              << f << " s, bwd " << b << " s, opt " << o_s << " s, loss " << l << ", moved "
              << ferry::format_bytes(static_cast<int64_t>(moved)) << "\n";
    if (!measured) continue;
    r.param_bytes_peak = std::max({r.param_bytes_peak, present_after_forward, present_after_backward});
    if (adam.param_shards()) {
      r.gathers += static_cast<double>(adam.param_shards()->stats().gathers - shards_before.gathers) / a.steps;
    }
    if (r.loss_first == 0) r.loss_first = l;
    r.loss_last = l;
    r.activation_bytes = std::max(r.activation_bytes, static_cast<double>(activations));
    r.mean.forward += f / a.steps;
    r.mean.backward += b / a.steps;
    r.mean.optimizer += o_s / a.steps;
    r.mean.wait += wait_s / a.steps;
    r.mean.total += (f + b + o_s) / a.steps;
    r.moved_bytes += moved / a.steps;
    r.optimal_bytes = r.optimal_bytes < 0 || optimal < 0 ? -1.0 : r.optimal_bytes + optimal / a.steps;
    r.evictions += evictions;
    r.syncs += static_cast<double>(moves.sync_count - moves_before.sync_count + step.device_syncs) / a.steps;
    r.background_syncs += static_cast<double>(moves.background_sync_count - moves_before.background_sync_count) / a.steps;
    r.transfers += static_cast<double>(moves.h2d_count - moves_before.h2d_count + moves.d2h_count - moves_before.d2h_count) / a.steps;
    r.h2d_bytes += static_cast<double>(moves.h2d_bytes - moves_before.h2d_bytes) / a.steps;
    r.d2h_bytes += static_cast<double>(moves.d2h_bytes - moves_before.d2h_bytes) / a.steps;
    r.overlapped_chunks += static_cast<double>(step.overlapped_chunks) / a.steps;
    r.deferred_chunks += static_cast<double>(step.deferred_chunks) / a.steps;
    r.host_norm_bytes += static_cast<double>(step.host_norm_bytes) / a.steps;
    r.written_back_chunks += static_cast<double>(step.written_back_chunks) / a.steps;
    if (comm) {
      const ferry::dist::CommStats cs = comm->stats();
      r.ring_bytes += static_cast<double>(cs.ring_bytes_sent - comm_before.ring_bytes_sent) / a.steps;
      r.collectives += static_cast<double>(cs.collectives - comm_before.collectives) / a.steps;
      r.comm_s += static_cast<double>(cs.wait_ns - comm_before.wait_ns) * 1e-9 / a.steps;
    }
  }
  r.moved_over_optimal = r.optimal_bytes < 0 ? -1.0
                         : r.optimal_bytes > 0 ? r.moved_bytes / r.optimal_bytes
                                               : (r.moved_bytes == 0 ? 1.0 : -1.0);  // as IterationStats says
  for (int64_t c = 0; c < model.layout().num_chunks(); ++c) {
    r.param_chunk_bytes += static_cast<double>(model.store().chunk_info(model.param_chunk(c)).nbytes);
  }
  r.param_bytes_between_steps = present_param_bytes(model);
  const auto ms = model.store().stats();
  const auto ss = adam.state_store().stats();
  r.device_peak = static_cast<double>(ms.device.peak_bytes + ss.device.peak_bytes);
#ifdef FERRY_WITH_CUDA
  if (cuda) {  // everything on the device: chunks, activations, temporaries
    r.device_peak = static_cast<double>(
        c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device()).allocated_bytes[0].peak);
  }
#endif
  r.host_peak = static_cast<double>(ms.host.peak_bytes + ss.host.peak_bytes);
  r.pinned_peak = cuda ? static_cast<double>(ms.host_buffers.peak_reserved_bytes) : 0;  // state: never pinned
  r.round_trips = adam.round_trip_stats();
  r.param_host_peak_in_steps = static_cast<double>(ms.host.peak_bytes);
  const double params = static_cast<double>(gc.num_params());
  r.host_bytes_per_param = static_cast<double>(ms.host.current_bytes + ss.host.current_bytes) / params;
  r.device_bytes_per_param = static_cast<double>(ms.device.current_bytes + ss.device.current_bytes) / params;
  {
    std::ostringstream roles;
    roles.precision(4);
    roles << "{";
    for (int role = 0; role < ferry::kNumChunkRoles; ++role) {
      const auto bytes = ms.device_bytes_by_role[role] + ms.host_bytes_by_role[role] + ss.device_bytes_by_role[role] +
                         ss.host_bytes_by_role[role];
      roles << (role ? ", " : "") << "\"" << ferry::to_string(static_cast<ferry::ChunkRole>(role))
            << "\": " << static_cast<double>(bytes) / params;
    }
    roles << "}";
    r.by_role_json = roles.str();
  }
  r.param_pool_peak = static_cast<double>(ms.host_buffers.peak_reserved_bytes);
  r.state_pool_peak = static_cast<double>(ss.host_buffers.peak_reserved_bytes);
  r.rss_peak = static_cast<double>(rss_peak_bytes());
  r.state_device = static_cast<double>(ss.device.current_bytes);
  r.state_host = static_cast<double>(ss.host.current_bytes);
  // The state's share on the host, in parameters (every format's bytes are proportional to them).
  const double state_bytes = static_cast<double>(ss.host.current_bytes + ss.device.current_bytes);
  r.host_state_params = state_bytes > 0 ? params * static_cast<double>(ss.host.current_bytes) / state_bytes : 0.0;
  r.device_state_chunks = adam.device_state_chunks();
  r.plan_json = plan_json(model.activations(), adam.joint_rates());
  return r;
}

// The unwrapped model in plain LibTorch. Returns the mean step time split the same way.
StepTimes run_baseline(const Args& a, const gpt::GptConfig& gc, bool cuda, double* loss_out) {
  torch::manual_seed(1);
  auto net = std::make_shared<gpt::GptImpl>(gc);
  const c10::Device device = cuda ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  net->to(device);
  // CPU: torch::optim::AdamW. CUDA: torch's fused AdamW kernel over all parameters in one call (what
  // torch.optim.AdamW(fused=True) runs), with the state kept here.
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
  std::vector<at::Tensor> params = net->parameters(), exp_avg, exp_avg_sq, steps;
  if (cuda) {
    for (auto& p : params) {
      exp_avg.push_back(at::zeros_like(p));
      exp_avg_sq.push_back(at::zeros_like(p));
      steps.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
    }
  }
  auto optimizer_step = [&] {
    if (a.max_grad_norm > 0) torch::nn::utils::clip_grad_norm_(params, a.max_grad_norm);
    if (!cuda) return opt.step();
    std::vector<at::Tensor> grads;
    for (auto& p : params) grads.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
    for (auto& s : steps) s.add_(1);
    at::NoGradGuard no_grad;
    at::_fused_adamw_(params, grads, exp_avg, exp_avg_sq, {}, steps, 1e-4, 0.9, 0.999, 0.1, 1e-8, false, false);
    return at::Tensor();
  };
  std::mt19937_64 rng(7);
  StepTimes t;
  const bool profiling = !a.profile.empty();  // one more step, after the measured ones, as in run_ferry
  for (int64_t s = 0; s < a.warmup_steps + a.steps + (profiling ? 1 : 0); ++s) {
    const bool profiled = profiling && s == a.warmup_steps + a.steps;
    StepProfile profile(profiled ? a.profile : std::string(), cuda);
    sync(cuda);
    double f = 0, b = 0, loss_sum = 0;
    for (int64_t k = 0; k < a.micro_batches; ++k) {  // gradients accumulate in .grad
      auto [x, y] = batch_of(a, gc.vocab, rng, device);
      auto t0 = Clock::now();
      at::Tensor loss;
      // Each phase in a user scope that ends after its sync: the profile attributes kernels by time.
      {
        RECORD_USER_SCOPE("phase.forward");
        if (cuda) {
          at::autocast::set_autocast_enabled(at::kCUDA, true);
          at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        }
        loss = gpt::GptImpl::loss(net->forward(x), y) / a.micro_batches;
        if (cuda) {
          at::autocast::set_autocast_enabled(at::kCUDA, false);
          at::autocast::clear_cache();
        }
        sync(cuda);
      }
      f += since(t0);
      auto t1 = Clock::now();
      {
        RECORD_USER_SCOPE("phase.backward");
        loss.backward();
        sync(cuda);
      }
      b += since(t1);
      loss_sum += loss.item<double>();
    }
    auto t2 = Clock::now();
    {
      RECORD_USER_SCOPE("phase.optimizer");
      optimizer_step();
      opt.zero_grad();
      sync(cuda);
    }
    const double o = since(t2);
    profile.save("baseline step " + std::to_string(s));
    if (!profiled) *loss_out = loss_sum;  // the last measured step's, as ferry's loss_last
    std::cerr << "bench_gpt: baseline step " << s << (profiled ? " (profiled)" : "") << ": fwd " << f << " s, bwd "
              << b << " s, opt " << o << " s\n";
    if (s < a.warmup_steps || profiled) continue;
    t.forward += f / a.steps;
    t.backward += b / a.steps;
    t.optimizer += o / a.steps;
    t.total += (f + b + o) / a.steps;
  }
  return t;
}

int run(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("bench_gpt", [&] { return run(argc, argv); });
}

namespace {

int run(int argc, char** argv) {
  ferry::Config config;
  Args a = bench_gpt::parse_args(argc, argv, config);
  const std::shared_ptr<ferry::dist::Communicator> comm = ferry::dist::connect(config);  // null: world size 1
  const int world = config.world_size;
  const bool cuda = ferry::resolve_device_kind(config.device) == ferry::DeviceKind::kCuda;
  std::ostringstream out;
  out.precision(6);
  out << "{\n  \"benchmark\": \"gpt\",\n  \"commit\": \"" << a.commit << "\",\n  \"env\": "
      << ferry::env_report_json(ferry::collect_env_report()) << ",\n  \"device\": \"" << (cuda ? "cuda" : "simulated")
      << "\",\n  \"config\": {\"precision\": \"" << ferry::to_string(config.precision) << "\", \"chunk_size_bytes\": "
      << config.chunk_size_bytes << ", \"device_budget_bytes\": " << config.device_budget_bytes
      << ", \"host_budget_bytes\": " << config.host_budget_bytes << ", \"batch\": " << a.batch << ", \"seq\": " << a.seq
      << ", \"steps\": " << a.steps << ", \"checkpoint_activations\": " << (a.checkpoint ? "true" : "false")
      << ", \"activations\": \"" << ferry::to_string(config.activations) << "\""
      << ", \"joint_placement\": " << (a.joint_placement ? "true" : "false")
      << ", \"state_format\": \"" << ferry::to_string(a.format) << "\"" << ", \"round_trip_slots\": " << a.round_trip_slots
      << ", \"trace\": \"" << a.trace << "\", \"step\": \"" << (a.unpipelined ? "unpipelined" : "pipelined")
      << "\", \"max_grad_norm\": " << a.max_grad_norm << ", \"micro_batches\": " << a.micro_batches
      << ", \"update_behind_forward\": " << (bench_gpt::behind_forward_option(a, world) ? "true" : "false")
      << ", \"copies\": \"" << (cuda ? "cuda" : a.copies) << "\", \"cpu_threads\": " << config.cpu_threads
      << ", \"cpu_split\": \"" << ferry::to_string(config.cpu_split) << "\"},\n";

  if (a.find_max) {
    std::vector<gpt::GptConfig> presets;
    for (const auto& n : gpt::preset_names()) presets.push_back(gpt::preset(n));
    std::sort(presets.begin(), presets.end(), [](auto& x, auto& y) { return x.num_params() < y.num_params(); });
    std::string largest = "none";
    out << "  \"find_max\": [";
    bool first = true;
    Args probe = a;
    probe.steps = 3;
    probe.warmup_steps = 1;
    probe.baseline = false;
    for (auto gc : presets) {
      gc.seq = std::max(gc.seq, a.seq);
      const int64_t elem = config.precision == ferry::Precision::kFp32 ? 4 : 2;
      const double need_host = static_cast<double>(gc.num_params()) * (elem + 16);
      std::string outcome = "ok";
      if (config.host_budget_bytes && need_host > static_cast<double>(config.host_budget_bytes)) {
        outcome = "exceeds the host budget (params + fp32 optimizer state)";
      } else {
        try {
          run_ferry(probe, gc, config, cuda);
          largest = gc.name;
        } catch (const std::exception& e) {
          outcome = std::string("failed: ") + std::string(e.what()).substr(0, 200);
        }
      }
      std::cerr << "bench_gpt: find-max " << gc.name << " (" << gc.num_params() / 1e6 << "M): " << outcome << "\n";
      std::string escaped;
      for (char c : outcome) escaped += (c == '"' || c == '\\') ? ' ' : (c == '\n' ? ' ' : c);
      out << (first ? "" : ",") << "\n    {\"preset\": \"" << gc.name << "\", \"params\": " << gc.num_params()
          << ", \"outcome\": \"" << escaped << "\"}";
      first = false;
      if (outcome != "ok") break;
    }
    out << "\n  ],\n  \"largest_preset\": \"" << largest << "\"\n}\n";
    std::cout << out.str();
    return 0;
  }

  gpt::GptConfig gc = gpt::preset(a.preset);
  gc.seq = std::max(gc.seq, a.seq);
  const double n = static_cast<double>(gc.num_params());
  const double tokens = static_cast<double>(a.batch * a.seq);
  const bench_gpt::InterceptionNs ins = bench_gpt::interception_ns(config, 20000);
  std::cerr << "bench_gpt: interception: " << ins.managed << " ns/op managed vs " << ins.plain
            << " ns/op plain; outside the scopes while watched: " << ins.watched_plain << " ns/op plain, "
            << ins.watched_managed << " ns/op managed\n";
  const FerryResult f = run_ferry(a, gc, config, cuda, comm);
  out << "  \"model\": {\"preset\": \"" << gc.name << "\", \"params\": " << gc.num_params() << ", \"hidden\": "
      << gc.hidden << ", \"layers\": " << gc.layers << ", \"heads\": " << gc.heads << ", \"vocab\": " << gc.vocab << "},\n";
  out << "  \"interception\": {\"managed_ns_per_op\": " << ins.managed << ", \"plain_ns_per_op\": " << ins.plain
      << ", \"overhead_ns_per_op\": " << ins.managed - ins.plain << ", \"watched_plain_ns_per_op\": "
      << ins.watched_plain << ", \"watched_managed_ns_per_op\": " << ins.watched_managed << "},\n";
  // How the step was split: pipelined, backward on the device's clock and the optimizer the rest of the
  // step; unpipelined, host time with a device sync after each phase.
  out << "  \"ferry\": {\"time\": " << json_times(f.mean) << ", \"phase_clock\": \""
      << (a.unpipelined ? "host, synced per phase" : "backward on the device, optimizer the rest") << "\""
      << ", \"tokens_per_s\": " << tokens / f.mean.total
      << ", \"take_writes_us\": " << f.take_writes_us << ", \"check_parameters_us\": " << f.check_parameters_us
      << ", \"param_tensors\": " << f.param_tensors
      << ", \"tflops_6n\": " << 6 * n * tokens / f.mean.total / 1e12 << ", \"tflops_8n\": "
      << 8 * n * tokens / f.mean.total / 1e12 << ", \"device_peak_bytes\": " << f.device_peak
      << ", \"host_peak_bytes\": " << f.host_peak << ", \"pinned_peak_bytes\": " << f.pinned_peak
      << ", \"round_trips\": {\"slots\": " << f.round_trips.slots << ", \"trips\": " << f.round_trips.trips
      << ", \"sent_ahead\": " << f.round_trips.sent_ahead << ", \"left_on_host\": " << f.round_trips.left_on_host
      << ", \"peak_held\": " << f.round_trips.peak_held << ", \"param_host_peak_bytes_in_steps\": "
      << f.param_host_peak_in_steps << "}"
      << ", \"optimizer_state_device_bytes\": " << f.state_device << ", \"optimizer_state_host_bytes\": " << f.state_host
      << ", \"moved_bytes_per_step\": " << f.moved_bytes << ", \"optimal_bytes_per_step\": " << f.optimal_bytes
      << ", \"moved_over_optimal\": " << f.moved_over_optimal
      << ", \"activation_bytes\": " << f.activation_bytes << ", \"evictions\": " << f.evictions << ", \"chunks\": " << f.chunks << ", \"device_state_chunks\": "
      << f.device_state_chunks << ", \"loss_first\": " << f.loss_first << ", \"loss_last\": " << f.loss_last
      << ",\n    \"startup_s\": " << f.startup_s << ", \"construction_s\": " << f.construction_s
      << ", \"startup_breakdown\": {\"module_s\": " << f.module_s << ", \"wrap_s\": " << f.wrap_s
      << ", \"optimizer_construction_s\": " << f.optimizer_construction_s << ", \"first_step_s\": " << f.first_step_s
      << ", \"repack_s\": " << f.repack_s << "}"
      << ",\n    \"memory\": {\"host_bytes_per_param\": " << f.host_bytes_per_param
      << ", \"device_bytes_per_param\": " << f.device_bytes_per_param
      << ", \"total_bytes_per_param\": " << f.host_bytes_per_param + f.device_bytes_per_param
      << ", \"bytes_per_param_by_role\": " << f.by_role_json
      << ", \"pinned_peak_bytes\": " << (cuda ? f.param_pool_peak : 0.0)
      << ", \"pinnable_peak_bytes\": " << f.param_pool_peak << ", \"unpinned_state_pool_peak_bytes\": " << f.state_pool_peak
      << ", \"host_rss_peak_bytes\": " << f.rss_peak << ", \"host_rss_peak_after_construction_bytes\": "
      << f.rss_after_construction << ", \"fp32_model_bytes\": " << 4 * n << ", \"waste\": " << f.waste
      << ", \"chunk_size_bytes\": " << f.chunk_size_bytes << ", \"init_scope\": " << (a.init_scope ? "true" : "false")
      << "},\n    \"syncs_per_step\": " << f.syncs << ", \"background_syncs_per_step\": " << f.background_syncs
      << ", \"transfers_per_step\": " << f.transfers << ", \"h2d_bytes_per_step\": " << f.h2d_bytes
      << ", \"d2h_bytes_per_step\": " << f.d2h_bytes << ", \"overlapped_chunks_per_step\": " << f.overlapped_chunks
      << ", \"written_back_chunks_per_step\": " << f.written_back_chunks
      << ", \"deferred_chunks_per_step\": " << f.deferred_chunks << ", \"host_norm_bytes_per_step\": " << f.host_norm_bytes
      << ", \"host_state_params\": " << f.host_state_params << ",\n    \"plan\": " << f.plan_json << "}";
  if (comm) {
    // The floor of data parallelism: each parameter byte all-gathered and reduce-scattered once per step.
    const double elem = config.precision == ferry::Precision::kFp32 ? 4 : 2;
    const double share = static_cast<double>(world - 1) / world;
    const double floor_bytes = 2 * share * n * elem;
    out << ",\n  \"dist\": {\"world_size\": " << world << ", \"rank\": " << config.rank << ", \"backend\": \""
        << comm->backend() << "\", \"batch_per_rank\": " << a.batch << ", \"global_tokens_per_s\": "
        << world * tokens / f.mean.total << ", \"ring_bytes_per_step\": " << f.ring_bytes
        << ", \"floor_bytes_per_step\": " << floor_bytes << ", \"over_floor\": " << f.ring_bytes / floor_bytes
        << ", \"chunk_floor_bytes_per_step\": " << 2 * share * f.param_chunk_bytes
        << ", \"collectives_per_step\": " << f.collectives << ", \"comm_s_per_step\": " << f.comm_s
        << ", \"optimizer_state_bytes_this_rank\": " << f.state_device + f.state_host
        << ", \"params\": \"" << (a.replicate_params ? "replicated" : a.keep_gathered ? "sharded, kept gathered to the step"
                                                                  : "sharded, given up after forward") << "\""
        << ", \"reshard_gap\": " << a.reshard_gap << ", \"group_gathers_per_step\": " << f.gathers
        // Memory per rank against full sharding (parameters and state, each 1/N; D45).
        << ", \"memory_per_rank\": {\"parameter_chunk_bytes_per_param\": " << f.param_chunk_bytes / n
        << ", \"parameter_bytes_per_param_between_steps\": " << f.param_bytes_between_steps / n
        << ", \"parameter_bytes_per_param_peak\": " << f.param_bytes_peak / n
        << ", \"state_bytes_per_param\": " << (f.state_device + f.state_host) / n
        << ", \"between_steps_bytes_per_param\": " << (f.param_bytes_between_steps + f.state_device + f.state_host) / n
        << ", \"fully_sharded_bytes_per_param\": " << (elem + 12.0) / world << "}}";
  }
  StepTimes b;
  double baseline_loss = 0;
  if (a.baseline) b = run_baseline(a, gc, cuda, &baseline_loss);
  {
    const bench_gpt::Rates rates = bench_gpt::measure_rates(config, cuda);
    bench_gpt::StepCounts counts;
    counts.params = n;
    counts.tokens = tokens;
    counts.h2d_bytes = f.h2d_bytes;
    counts.d2h_bytes = f.d2h_bytes;
    counts.host_state_params = f.host_state_params;
    counts.baseline_step_s = a.baseline ? b.total : 0.0;
    const bench_gpt::StepFloor floor = bench_gpt::step_floor(a, config, world, cuda, counts, rates);
    std::cerr << "bench_gpt: floors: compute " << floor.compute_s << " s, transfers " << floor.transfers_s
              << " s, host Adam " << floor.host_adam_s << " s, host memory " << floor.host_memory_s
              << " s; measured / floor " << f.mean.total / floor.floor_s << ", measured / schedule floor "
              << f.mean.total / floor.schedule_floor_s << "\n";
    out << ",\n  \"floor\": " << bench_gpt::floor_json(floor, a, rates, cuda, f.mean.total);
  }
  if (a.baseline) {
    const double loss = baseline_loss;
    out << ",\n  \"baseline\": {\"kind\": \"" << (cuda ? "bf16 autocast + fused AdamW" : "fp32 + torch::optim::AdamW")
        << "\", \"time\": " << json_times(b) << ", \"tokens_per_s\": " << tokens / b.total << ", \"tflops_6n\": "
        << 6 * n * tokens / b.total / 1e12 << ", \"loss_last\": " << loss << "},\n";
    out << "  \"ferry_over_baseline_step_time\": " << f.mean.total / b.total << ",\n  \"ferry_over_baseline_fwd_bwd\": "
        << (f.mean.forward + f.mean.backward) / (b.forward + b.backward);
  }
  out << "\n}\n";
  if (config.rank == 0) std::cout << out.str();  // one report per job: rank 0's
  return 0;
}

}  // namespace
