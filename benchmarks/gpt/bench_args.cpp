#include "bench_args.h"

#include <vector>

namespace bench_gpt {

Args parse_args(int argc, char** argv, ferry::Config& config) {
  std::vector<std::string> rest;
  config = ferry::Config::from_args(argc, argv, &rest);
  // Checkpointed blocks are planned (kept where the device has room) unless told otherwise (D75).
  if (!ferry::cli::option_given(argc, argv, "activations")) config.activations = ferry::ActivationPolicy::kAuto;
  ferry::log::configure(config.log_level, config.rank);
  Args a;
  ferry::cli::Options options("bench_gpt");
  options.also_accepts("ferry options", ferry::Config::help());
  options.add("preset", &a.preset, "GPT preset (default small)")
      .add("batch", &a.batch, "sequences per step (default 8)", 1, int64_t{1} << 24)
      .add("seq", &a.seq, "tokens per sequence (default 256)", 2, int64_t{1} << 24)
      .add("steps", &a.steps, "measured steps (default 5)", 1)
      .add("warmup-steps", &a.warmup_steps, "unmeasured steps first (default 2)", 1)
      .add_flag("checkpoint-activations", &a.checkpoint, "recompute each block in backward")
      .add_flag("init-scope", &a.init_scope, "build the model inside ferry::InitScope (compute dtype, no fp32 copy)")
      .add_flag("no-baseline", &a.no_baseline, "skip the unwrapped baseline")
      .add_flag("unpipelined", &a.unpipelined, "model.backward() + adam.step() instead of adam.backward_step()")
      .add_flag("sync-update", &a.sync_update, "every host update done when the step returns, none left running "
                "behind it into the next forward (Note [Update behind the next forward])")
      .add("micro-batches", &a.micro_batches, "gradient accumulation: backward passes per step, each over "
           "batch / N sequences (default 1)", 1)
      .add("max-grad-norm", &a.max_grad_norm, "global gradient clipping in ferry and the baseline, 0 = none "
           "(default 0; with clipping ferry's host Adam follows backward: Note [Pipelined step])", 0.0)
      .add("state-format", &a.state_format, "optimizer state: fp32 (default) or compact (bf16 master, 8-bit "
           "moments: Note [The compact state format])")
      .add_flag("joint-placement", &a.joint_placement, "activations=auto: the state placed again with the "
                "activation plan after settled iterations, and again where its host rate proves optimistic "
                "(HybridAdamOptions::plan_state_with_activations, D90)")
      .add("round-trip-slots", &a.round_trip_slots, "host buffers the parameter round trips of the host updates "
           "hold at most (HybridAdamOptions::round_trip_slots; default 0: one per host-state chunk)", int64_t{0})
      .add_flag("find-max", &a.find_max, "find the largest preset that trains")
      .add_flag("replicate-params", &a.replicate_params, "world size > 1: every rank keeps every parameter chunk")
      .add_flag("keep-gathered", &a.keep_gathered, "world size > 1: keep gathered groups from forward to the step")
      .add("reshard-gap", &a.reshard_gap, "world size > 1: give a group up after forward if its next use is at "
           "least this many trace positions later (default 16)", 0)
      .add("copies", &a.copies, "simulated device: sync (copies done when issued; the default) or stream (queued "
           "as on a CUDA copy stream, the host learning late that they are done: syncs_per_step then counts "
           "what a GPU would wait for, an upper bound)")
      .add("commit", &a.commit, "commit id recorded in the JSON")
      .add("trace", &a.trace, "Chrome trace of the last measured step into FILE.json (FILE-rankR.json per rank)")
      .add("profile", &a.profile, "torch profiler (Kineto: operators and CUDA kernels) over one more baseline "
           "step after the measured ones, into FILE.json (benchmarks/profile_compare.py compares it with the Python "
           "peer's)")
      .add("profile-ferry", &a.profile_ferry, "the same for ferry's step (profile_compare.py compares it with the "
           "baseline's: --unpipelined gives both the same three phases; FILE-rankR.json per rank)");
  options.parse(rest);
  a.format = ferry::state_format_from_string(a.state_format);  // fails naming what was given
  if (a.batch % a.micro_batches != 0) {
    throw ferry::cli::UsageError("--batch (" + std::to_string(a.batch) + ") must be a multiple of --micro-batches (" +
                                 std::to_string(a.micro_batches) + ")");
  }
  if (config.world_size > 1) {  // one file per rank
    const std::string suffix = "-rank" + std::to_string(config.rank);
    for (std::string* path : {&a.trace, &a.profile_ferry}) {
      if (path->empty()) continue;
      const auto dot = path->rfind('.');
      *path = dot == std::string::npos ? *path + suffix : path->substr(0, dot) + suffix + path->substr(dot);
    }
  }
  // The baseline is one process's; a multi-process run measures ferry only.
  a.baseline = !a.no_baseline && config.world_size == 1;
  const bool cuda = ferry::resolve_device_kind(config.device) == ferry::DeviceKind::kCuda;
  if (a.copies != "sync" && a.copies != "stream") {
    throw ferry::cli::UsageError("--copies must be sync or stream, got '" + a.copies + "'");
  }
  if (cuda && a.copies != "sync") {
    throw ferry::cli::UsageError("--copies=" + a.copies + " models a copy stream on the simulated device; on CUDA the "
                                 "copies are the GPU's (drop --copies, or use --device=simulated)");
  }
  return a;
}

}  // namespace bench_gpt
