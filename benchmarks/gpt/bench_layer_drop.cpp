// bench_layer_drop: a model whose parameter uses change from step to step (LayerDrop: each block of the
// GPT example skipped with probability --layer-drop in each step), trained through ChunkedModel +
// HybridAdam twice in one process, with the same initial values, batches and draws: under the strict
// trace rule (SchedulerOptions::align_to_trace false: the first use that differs from the trace ends
// its following, LRU and no prefetch for the rest of the step, and the next step records again) and
// with the uses aligned against the trace (D98, Note [A run that departs from its trace]). Prints one
// JSON object: per rule the step time, the parameter bytes moved in per step, the part of them a use
// had to wait for (not moved ahead), the moves against the Belady count of the trace followed
// (moved_over_optimal; that count includes the uses a step skipped, so it is a floor only over the
// steps that used exactly their trace: moved_over_optimal_exact_steps), the moves against each step's
// own floor (IterationFloor: the fewest moves of the uses it made from the chunks on the device when it
// began; moved_over_floor, over every measured step and over those that departed from their trace), and
// how many steps gave the trace up, re-traced or merged. A third run aligns too, with each step's skips
// said when its forward begins (ferry::will_skip, D107: "said_ahead"). And whether the runs' losses are
// bit-identical (they must be: the rule and the hints decide only where chunks are).
//
// Across ranks (started by torchrun --no-python, SLURM or by hand: ferry::dist::connect; sharded
// parameters, each rank its own batches, the same draws on every rank) each run also reports its
// parameter groups' gathers per step ("dist": started ahead or waited for, bytes received, time blocked)
// against the floor of the uses the steps made: each group that held a parameter of a part the step ran
// gathered once (D108). Rank 0 prints the JSON. There a gathered chunk lands on the device without a
// host->device copy where the device has room, while the steps' own floors (IterationFloor) count a move
// for it: moved_over_floor reads below 1 and is no floor across ranks; the gathers' is.
//
//   bench_layer_drop [--preset=small] [--layer-drop=0.1] [--steps=12] [--warmup-steps=3] [--batch=4]
//                    [--seq=128] [--checkpoint-activations] [--copies=stream|sync] + ferry options
//
// On the simulated device (the default) the bytes are what a GPU would move; the times are the host's.
#include <chrono>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../../dist/param_shards.h"
#include "../../examples/gpt/gpt.h"
#include "../../ferry.h"

namespace {

using Clock = std::chrono::steady_clock;

struct RuleResult {
  double step_s = 0;                  // mean over the measured steps
  double h2d_bytes = 0;               // parameter bytes moved to the device, per step
  double demand_h2d_bytes = 0;        // ... of them not moved ahead of their use, per step
  double prefetched_bytes = 0;        // ... of them moved ahead, per step
  // Over the measured steps that had a trace to follow: their moves over their references' sum (D104).
  // The reference is the followed trace's Belady count, which counts the uses a step skipped too: over
  // steps that departed it is no floor (it can read below 1). Hence also the ratio over the steps that
  // used exactly their trace (no use skipped, none unforeseen), and how many there were.
  double moved_over_optimal = 0, moved_over_optimal_exact = 0;
  int64_t exact_steps = 0;
  // Over all measured steps and over those that departed (skipped or unforeseen uses, or gave the trace
  // up): moved both ways over the steps' own floors summed (IterationFloor), and those floors per step.
  double moved_over_floor = 0, moved_over_floor_departing = 0, floor_bytes = 0;
  int64_t departing_steps = 0;
  int64_t gave_up = 0, traced = 0, merged = 0, skipped_uses = 0, unforeseen_uses = 0;  // over the measured steps
  int64_t hinted_uses = 0, hints_broken = 0;  // trace positions said skipped, and those used anyway
  int64_t device_peak_bytes = 0;
  // Sharded parameters (world > 1), per measured step: group gathers, those started ahead of their use,
  // the bytes received, the time blocked in fetches; the floor of the bytes (every group that held a
  // used parameter gathered once) and the ring bytes this rank sent (gathers + reduce-scatters).
  double gathers = 0, prefetched_gathers = 0, gathered_bytes = 0, gather_wait_s = 0, gather_floor_bytes = 0;
  double ring_bytes = 0, gathers_still_running = 0;  // ... and the prefetched ones a use found running
  double unclaimed_gathers = 0, unclaimed_bytes = 0;  // ... and those no use claimed (a skipped part's)
  int64_t chunk_size_bytes = 0;  // the compute copy's, as ChunkedModel chose it (auto: D99's cap in)
  double waste = 0;              // of the final layout
  std::vector<double> losses;
};

struct Run {
  gpt::GptConfig gc;
  double layer_drop = 0.1;
  int64_t steps = 12, warmup_steps = 3, batch = 4, seq = 128;
  bool checkpoint = false, stream_copies = true;
  std::shared_ptr<ferry::dist::Communicator> comm;  // null: one process
};

// The bytes this rank receives to gather, once each, every group of layout chunks that holds a parameter
// of a part the step runs (all but the skipped blocks'): a sharded step's floor (dist/param_shards.h).
int64_t gather_floor_bytes(ferry::ChunkedModel& model, const std::vector<bool>& skip, int world, int rank) {
  const int64_t chunks = model.layout().num_chunks();
  std::vector<char> used(static_cast<size_t>((chunks + world - 1) / world), 0);
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const std::string& name = model.param_name(p);
    bool skipped = false;
    for (size_t i = 0; i < skip.size() && !skipped; ++i) {
      skipped = skip[i] && name.rfind("blocks." + std::to_string(i) + ".", 0) == 0;
    }
    if (!skipped) used[static_cast<size_t>(model.layout().slots()[p].chunk / world)] = 1;
  }
  int64_t bytes = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (!used[static_cast<size_t>(c / world)] || c % world == rank) continue;
    bytes += model.store().chunk_info(model.param_chunk(c)).nbytes;
  }
  return bytes;
}

// `say_skips`: each step's skips told ferry::will_skip when its forward begins.
RuleResult train(const Run& run, const ferry::Config& config, bool align, bool say_skips = false) {
  torch::manual_seed(1);
  auto net = std::make_shared<gpt::GptImpl>(run.gc);
  // The draws of one step, the same under both rules: block i is skipped where skip[i].
  std::vector<bool> skip(static_cast<size_t>(run.gc.layers), false);
  size_t next_block = 0;
  net->run_block = [&](gpt::Block& b, const torch::Tensor& x) {
    const bool dropped = skip[next_block++ % skip.size()];
    if (dropped) return x;
    if (!run.checkpoint) return b->forward(x);
    return ferry::checkpoint([b](const std::vector<at::Tensor>& in) mutable { return b->forward(in[0]); }, {x});
  };
  ferry::ChunkedModelOptions options;
  options.scheduler.align_to_trace = align;
  options.scheduler.measure_iteration_floor = true;
  const bool simulated = ferry::resolve_device_kind(config.device) == ferry::DeviceKind::kSimulated;
  if (simulated && run.stream_copies) options.copy_engine = [] { return std::make_unique<ferry::StreamModelCopyEngine>(); };
  ferry::ChunkedModel model(net, config, std::move(options));
  ferry::HybridAdamOptions adam_options;
  adam_options.communicator = run.comm;
  ferry::HybridAdam adam(model, adam_options);
  const int world = run.comm ? run.comm->world_size() : 1, rank = run.comm ? run.comm->rank() : 0;
  ferry::dist::ParamShardStats shards_before;
  ferry::dist::CommStats comm_before;
  const c10::Device device = model.store().device();
  RuleResult r;
  int64_t with_optimal = 0, moved_with_optimal = 0, optimal = 0, moved_exact = 0, optimal_exact = 0;
  int64_t moved_all = 0, floor_all = 0, moved_departing = 0, floor_departing = 0;
  for (int64_t step = 0; step < run.warmup_steps + run.steps; ++step) {
    std::mt19937_64 draw(1000 + static_cast<uint64_t>(step));
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (size_t i = 0; i < skip.size(); ++i) skip[i] = step > 0 && u(draw) < run.layer_drop;  // warm-up: all
    next_block = 0;
    torch::manual_seed(static_cast<uint64_t>(step));
    if (rank > 0) torch::manual_seed(static_cast<uint64_t>(step) * 1000003 + static_cast<uint64_t>(rank));  // own rows
    const at::Tensor tokens = torch::randint(0, run.gc.vocab, {run.batch, run.seq + 1}, torch::kLong).to(device);
    const at::Tensor x = tokens.slice(1, 0, run.seq), y = tokens.slice(1, 1, run.seq + 1);
    const bool measured = step >= run.warmup_steps;
    if (measured && step == run.warmup_steps) {
      model.store().reset_peak_stats();
      if (adam.param_shards()) shards_before = adam.param_shards()->stats();
      if (run.comm) comm_before = run.comm->stats();
    }
    const auto start = Clock::now();
    at::Tensor loss = model.forward([&] {
      for (size_t i = 0; say_skips && i < skip.size(); ++i) {
        if (skip[i]) ferry::will_skip(*net->blocks[i]);
      }
      return gpt::GptImpl::loss(net->forward(x), y);
    });
    adam.backward_step(loss);
    const double l = loss.item<double>();  // waits for the step's device work
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    r.losses.push_back(l);
    const ferry::IterationStats s = model.last_iteration();
    // Rank 0 speaks (every rank's counts are alike: the same uses, the same draws).
    const char* rule = align ? say_skips ? "said ahead" : "aligned" : "strict";
    if (rank == 0) std::cerr << "bench_layer_drop: " << rule << " step " << step
              << (measured ? "" : " (warm-up)") << ": " << seconds << " s, loss " << l << ", moved in "
              << ferry::format_bytes(s.h2d_bytes) << " (" << ferry::format_bytes(s.demand_h2d_bytes())
              << " on demand)" << (s.diverged ? ", gave the trace up" : "") << (s.traced ? ", traced" : "")
              << (s.trace_merged ? ", merged" : "") << "\n";
    if (!measured) continue;
    const double n = static_cast<double>(run.steps);
    r.step_s += seconds / n;
    r.h2d_bytes += static_cast<double>(s.h2d_bytes) / n;
    r.demand_h2d_bytes += static_cast<double>(s.demand_h2d_bytes()) / n;
    r.prefetched_bytes += static_cast<double>(s.prefetched_bytes) / n;
    if (s.moved_over_optimal() > 0) {
      moved_with_optimal += s.moved_bytes();
      optimal += s.optimal_bytes;
      ++with_optimal;
      if (s.trace_skipped == 0 && s.trace_unforeseen == 0 && !s.diverged) {
        moved_exact += s.moved_bytes();
        optimal_exact += s.optimal_bytes;
        ++r.exact_steps;
      }
    }
    moved_all += s.moved_bytes();
    floor_all += s.floor_bytes;
    if (s.trace_skipped > 0 || s.trace_unforeseen > 0 || s.diverged) {
      moved_departing += s.moved_bytes();
      floor_departing += s.floor_bytes;
      ++r.departing_steps;
    }
    r.gave_up += s.diverged ? 1 : 0;
    r.traced += s.traced ? 1 : 0;
    r.merged += s.trace_merged ? 1 : 0;
    r.skipped_uses += s.trace_skipped;
    r.unforeseen_uses += s.trace_unforeseen;
    r.hinted_uses += s.trace_hinted;
    r.hints_broken += s.trace_hints_broken;
    if (world > 1) r.gather_floor_bytes += static_cast<double>(gather_floor_bytes(model, skip, world, rank)) / n;
  }
  if (const auto shards = adam.param_shards()) {
    const ferry::dist::ParamShardStats a = shards->stats();
    const ferry::dist::CommStats c = run.comm->stats();
    const double n = static_cast<double>(run.steps);
    r.gathers = static_cast<double>(a.gathers - shards_before.gathers) / n;
    r.prefetched_gathers = static_cast<double>(a.prefetched - shards_before.prefetched) / n;
    r.gathered_bytes = static_cast<double>(a.gathered_bytes - shards_before.gathered_bytes) / n;
    r.unclaimed_gathers = static_cast<double>(a.unclaimed - shards_before.unclaimed) / n;
    r.unclaimed_bytes = static_cast<double>(a.unclaimed_bytes - shards_before.unclaimed_bytes) / n;
    r.gathers_still_running = static_cast<double>(a.waited - shards_before.waited) / n;
    r.gather_wait_s = static_cast<double>(a.wait_ns - shards_before.wait_ns) * 1e-9 / n;
    r.ring_bytes = static_cast<double>(c.ring_bytes_sent - comm_before.ring_bytes_sent) / n;
  }
  if (with_optimal > 0) {  // a reference of 0 counted only where nothing moved: 1
    r.moved_over_optimal = optimal > 0 ? static_cast<double>(moved_with_optimal) / static_cast<double>(optimal) : 1.0;
  }
  if (r.exact_steps > 0) {
    r.moved_over_optimal_exact =
        optimal_exact > 0 ? static_cast<double>(moved_exact) / static_cast<double>(optimal_exact) : 1.0;
  }
  // A floor of 0 is met only where nothing moved: 1.
  auto over = [](int64_t moved, int64_t floor) {
    return floor > 0 ? static_cast<double>(moved) / static_cast<double>(floor) : moved == 0 ? 1.0 : -1.0;
  };
  r.moved_over_floor = over(moved_all, floor_all);
  r.moved_over_floor_departing = r.departing_steps > 0 ? over(moved_departing, floor_departing) : 0.0;
  r.floor_bytes = static_cast<double>(floor_all) / static_cast<double>(run.steps);
  r.device_peak_bytes = model.store().stats().device.peak_bytes;
  r.chunk_size_bytes = model.chunk_size_bytes();
  r.waste = model.layout().waste();
  return r;
}

std::string json(const RuleResult& r) {
  std::ostringstream o;
  o.precision(6);
  o << "{\"step_s\": " << r.step_s << ", \"h2d_bytes_per_step\": " << r.h2d_bytes
    << ", \"demand_h2d_bytes_per_step\": " << r.demand_h2d_bytes << ", \"prefetched_bytes_per_step\": "
    << r.prefetched_bytes << ", \"moved_over_optimal\": " << r.moved_over_optimal
    << ", \"moved_over_optimal_exact_steps\": " << r.moved_over_optimal_exact << ", \"exact_steps\": " << r.exact_steps
    << ", \"floor_bytes_per_step\": " << r.floor_bytes << ", \"moved_over_floor\": " << r.moved_over_floor
    << ", \"moved_over_floor_departing_steps\": " << r.moved_over_floor_departing
    << ", \"departing_steps\": " << r.departing_steps
    << ", \"steps_gave_up\": "
    << r.gave_up << ", \"steps_traced\": " << r.traced << ", \"steps_merged\": " << r.merged
    << ", \"trace_uses_skipped\": " << r.skipped_uses << ", \"unforeseen_uses\": " << r.unforeseen_uses
    << ", \"trace_uses_said_skipped\": " << r.hinted_uses << ", \"said_but_used\": " << r.hints_broken
    << ", \"device_peak_bytes\": " << r.device_peak_bytes << ", \"chunk_size_bytes\": " << r.chunk_size_bytes
    << ", \"waste\": " << r.waste;
  if (r.gather_floor_bytes > 0) {
    o << ", \"dist\": {\"gathers_per_step\": " << r.gathers << ", \"prefetched_gathers_per_step\": "
      << r.prefetched_gathers << ", \"demand_gathers_per_step\": " << r.gathers - r.prefetched_gathers
      << ", \"prefetched_still_running_per_step\": " << r.gathers_still_running
      << ", \"unclaimed_gathers_per_step\": " << r.unclaimed_gathers << ", \"unclaimed_bytes_per_step\": "
      << r.unclaimed_bytes
      << ", \"gathered_bytes_per_step\": " << r.gathered_bytes << ", \"gather_floor_bytes_per_step\": "
      << r.gather_floor_bytes << ", \"gathered_over_floor\": " << r.gathered_bytes / r.gather_floor_bytes
      << ", \"gather_wait_s_per_step\": " << r.gather_wait_s << ", \"ring_bytes_per_step\": " << r.ring_bytes << "}";
  }
  o << "}";
  return o.str();
}

int run_benchmark(int argc, char** argv) {
  std::vector<std::string> rest;
  ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  ferry::log::configure(config.log_level, config.rank);
  Run run;
  std::string preset = "small", commit = "unknown", copies = "stream";
  ferry::cli::Options options("bench_layer_drop");
  options.also_accepts("ferry options", ferry::Config::help());
  options.add("preset", &preset, "GPT preset (default small)")
      .add("layer-drop", &run.layer_drop, "probability that a block is skipped in a step (default 0.1)", 0.0, 1.0)
      .add("steps", &run.steps, "measured steps (default 12)", 1)
      .add("warmup-steps", &run.warmup_steps, "unmeasured steps first, the first with every block (default 3)", 1)
      .add("batch", &run.batch, "sequences per step (default 4)", 1, int64_t{1} << 20)
      .add("seq", &run.seq, "tokens per sequence (default 128)", 2, int64_t{1} << 20)
      .add_flag("checkpoint-activations", &run.checkpoint, "each block a ferry::checkpoint segment")
      .add("copies", &copies, "simulated device: stream (the default: queued as on a CUDA copy stream) or sync")
      .add("commit", &commit, "commit id recorded in the JSON");
  options.parse(rest);
  if (copies != "stream" && copies != "sync") {
    throw ferry::cli::UsageError("--copies must be stream or sync, got '" + copies + "'");
  }
  run.stream_copies = copies == "stream";
  run.gc = gpt::preset(preset);
  run.gc.seq = std::max(run.gc.seq, run.seq);
  run.comm = ferry::dist::connect(config);  // null alone
  const RuleResult strict = train(run, config, /*align=*/false);
  const RuleResult aligned = train(run, config, /*align=*/true);
  const RuleResult said = train(run, config, /*align=*/true, /*say_skips=*/true);
  const bool identical = strict.losses == aligned.losses && aligned.losses == said.losses;
  std::ostringstream out;
  out.precision(6);
  out << "{\n  \"benchmark\": \"layer_drop\",\n  \"commit\": \"" << commit << "\",\n  \"env\": "
      << ferry::env_report_json(ferry::collect_env_report()) << ",\n  \"device\": \""
      << ferry::to_string(ferry::resolve_device_kind(config.device)) << "\", \"copies\": \"" << copies
      << "\",\n  \"config\": {\"preset\": \"" << run.gc.name << "\", \"params\": " << run.gc.num_params()
      << ", \"layers\": " << run.gc.layers << ", \"layer_drop\": " << run.layer_drop << ", \"batch\": " << run.batch
      << ", \"seq\": " << run.seq << ", \"steps\": " << run.steps << ", \"warmup_steps\": " << run.warmup_steps
      << ", \"checkpoint_activations\": " << (run.checkpoint ? "true" : "false") << ", \"chunk_size_bytes\": "
      << config.chunk_size_bytes << ", \"device_budget_bytes\": " << config.device_budget_bytes
      << ", \"precision\": \"" << ferry::to_string(config.precision) << "\", \"world\": " << config.world_size
      << "},\n  \"strict\": " << json(strict)
      << ",\n  \"aligned\": " << json(aligned) << ",\n  \"said_ahead\": " << json(said)
      << ",\n  \"aligned_over_strict\": {\"step_s\": "
      << aligned.step_s / strict.step_s << ", \"demand_h2d_bytes\": "
      << (strict.demand_h2d_bytes > 0 ? aligned.demand_h2d_bytes / strict.demand_h2d_bytes : 0.0)
      << ", \"h2d_bytes\": " << (strict.h2d_bytes > 0 ? aligned.h2d_bytes / strict.h2d_bytes : 0.0)
      << "},\n  \"said_ahead_over_aligned\": {\"step_s\": " << said.step_s / aligned.step_s
      << ", \"demand_h2d_bytes\": "
      << (aligned.demand_h2d_bytes > 0 ? said.demand_h2d_bytes / aligned.demand_h2d_bytes : 0.0)
      << ", \"h2d_bytes\": " << (aligned.h2d_bytes > 0 ? said.h2d_bytes / aligned.h2d_bytes : 0.0)
      << "},\n  \"losses_bit_identical\": " << (identical ? "true" : "false") << "\n}\n";
  if (config.rank == 0) std::cout << out.str();
  return identical ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("bench_layer_drop", [&] { return run_benchmark(argc, argv); });
}
