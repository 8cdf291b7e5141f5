#pragma once
// bench_gpt's command line: ferry's options (ferry::Config) and bench_gpt's own, parsed and checked once.
#include <cstdint>
#include <string>

#include "../../ferry.h"

namespace bench_gpt {

struct Args {
  bool no_baseline = false;  // --no-baseline (the baseline runs where this is false and world size is 1)
  std::string preset = "small", commit = "unknown", trace, profile, profile_ferry;
  int64_t batch = 8, seq = 256, steps = 5, warmup_steps = 2;
  bool checkpoint = false, baseline = true, find_max = false, init_scope = false, unpipelined = false;
  bool sync_update = false;  // HybridAdamOptions::update_behind_forward off
  bool joint_placement = false;  // HybridAdamOptions::plan_state_with_activations
  int64_t round_trip_slots = 0;  // HybridAdamOptions::round_trip_slots
  std::string state_format = "fp32";  // --state-format, parsed into `format` once
  ferry::StateFormat format = ferry::StateFormat::kFp32;  // HybridAdamOptions::state_format
  bool replicate_params = false, keep_gathered = false;  // world size > 1: Note [Sharded parameters] off / no reshard
  int64_t reshard_gap = 16;
  double max_grad_norm = 0;  // global-norm clipping (ferry and the baseline); 0: none
  int64_t micro_batches = 1;  // gradient accumulation: backward passes per step, batch / micro_batches rows each
  std::string copies = "sync";  // simulated device: "sync" copies, or "stream" (chunk/stream_model_engine.h)
};

// Parses argv into `config` (ferry's options; checkpointed blocks planned, activations=auto, unless
// --activations says otherwise: D75) and the returned Args; configures the log. Throws
// ferry::cli::UsageError naming what was given for a bad value. Under world size > 1 the trace and
// profile file names get a per-rank suffix and the baseline is off (one process's).
Args parse_args(int argc, char** argv, ferry::Config& config);

}  // namespace bench_gpt
