#pragma once
// bench_gpt's floors (D52): the least time each resource needs for the step's counted work at the rate
// measured in the same run, and the schedule's floor, which adds what this design cannot overlap. Every
// input is the run's own (its placement's host-state parameters and its copies), never a flattering one;
// tests/benchmarks/check_bench_floors.py recomputes them from the JSON.
#include <string>

#include "bench_args.h"
#include "machine_rates.h"

namespace bench_gpt {

// Bytes the host Adam moves per parameter (read + written), bf16 gradients: fp32 state 28 (the grad
// 2, master and moments 12 read and 12 written, the new value 2); compact 12.06 (the grad 2, master 2 +
// 2, codes 2 + 2, the new value 2, two fp32 scales per 256 read and written).
double host_adam_bytes_per_param(const Args& a);

// Whether the host updates after backward run behind the next forward (Note [Update behind the next
// forward]): unless --sync-update; across ranks only with sharded parameters (replicated ones are
// gathered by the step itself).
bool behind_forward_option(const Args& a, int world);

// What the run counted per measured step.
struct StepCounts {
  double params = 0;             // the model's parameters (N)
  double tokens = 0;             // per step
  double h2d_bytes = 0, d2h_bytes = 0;  // chunk copies
  double host_state_params = 0;  // parameters whose optimizer state is on the host
  double baseline_step_s = 0;    // the plain-LibTorch step when it ran (> 0): the compute rate's source
};

struct StepFloor {
  double flops_rate = 0;  // the compute rate used: the baseline's 6N step, else the GEMM probe's
  bool rate_from_baseline = false;
  double compute_s = 0, transfers_s = 0, host_adam_s = 0, host_memory_s = 0;
  double floor_s = 0;           // the largest of compute, transfers and host memory
  double schedule_floor_s = 0;  // what this design's step order allows (D52)
  std::string schedule;         // where the host Adam runs, in words
};

StepFloor step_floor(const Args& a, const ferry::Config& config, int world, bool cuda, const StepCounts& counts,
                     const Rates& rates);

// The JSON object bench_gpt reports as "floor", with measured / floor for `measured_step_s`.
std::string floor_json(const StepFloor& floor, const Args& a, const Rates& rates, bool cuda, double measured_step_s);

}  // namespace bench_gpt
