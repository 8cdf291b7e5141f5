// bench_gpt's floors (see step_floor.h).
#include "step_floor.h"

#include <algorithm>
#include <sstream>

namespace bench_gpt {

double host_adam_bytes_per_param(const Args& a) {
  return a.format == ferry::StateFormat::kCompact ? ferry::kCompactUpdateBytesPerParam : 28.0;
}

bool behind_forward_option(const Args& a, int world) { return !a.sync_update && (world == 1 || !a.replicate_params); }

StepFloor step_floor(const Args& a, const ferry::Config& config, int world, bool cuda, const StepCounts& counts,
                     const Rates& rates) {
  // Each resource alone at its measured rate; overlapped perfectly, the step takes the largest.
  StepFloor f;
  const double flops = (a.checkpoint ? 8 : 6) * counts.params * counts.tokens;
  f.rate_from_baseline = counts.baseline_step_s > 0;
  f.flops_rate =
      f.rate_from_baseline ? 6 * counts.params * counts.tokens / counts.baseline_step_s : rates.gemm_flops_per_s;
  f.compute_s = flops / f.flops_rate;
  f.transfers_s = std::max(counts.h2d_bytes / rates.h2d_bytes_per_s, counts.d2h_bytes / rates.d2h_bytes_per_s);
  f.host_adam_s = host_adam_bytes_per_param(a) * counts.host_state_params / rates.adam_bytes_per_s;
  // Host memory: the host Adam's 28 B/param and every chunk transfer cross the host's DRAM, which the
  // roof measures (a DMA copy crosses it once; on the CPU's simulated device a copy reads and writes it).
  // With micro-batches, each one's accumulation on the host too (Note [Accumulation per chunk]): 16 B
  // per host-state parameter (the 16-bit slot and the fp32 sum read, the sum written, the slot's value
  // restored from the fp32 master).
  const double copy_host_bytes = (cuda ? 1.0 : 2.0) * (counts.h2d_bytes + counts.d2h_bytes);
  const double accumulation_bytes = a.micro_batches > 1 ? 16.0 * a.micro_batches * counts.host_state_params : 0.0;
  f.host_memory_s = (host_adam_bytes_per_param(a) * counts.host_state_params + accumulation_bytes + copy_host_bytes) /
                    rates.adam_bytes_per_s;
  f.floor_s = std::max({f.compute_s, f.transfers_s, f.host_memory_s});
  // The schedule's floor (D52): the host Adam overlaps backward only, so forward's compute adds to the
  // larger of backward's compute and the host memory traffic (and the link can be busy throughout).
  // Forward is 2N flops per token of the 6N (8N with recompute). With clipping or fp16 loss scaling
  // (two-phase, Note [Pipelined step]) the host Adam waits for the global norm: only the copies
  // overlap backward, and the host Adam follows it; unpipelined, the same bound. With micro-batches
  // every backward counts as one window (optimistic: the host Adam overlaps only the last one's), so
  // the floor stays a lower bound. Behind the next forward (not eager: Note [Update behind the next
  // forward]) the host Adam after backward runs beside forward's compute: the two take the
  // larger of them, forward_s + max(0, adam_s - forward_s).
  const double forward_s = f.compute_s * 2.0 / (a.checkpoint ? 8.0 : 6.0);
  const bool eager = !a.unpipelined && a.max_grad_norm == 0 && config.precision != ferry::Precision::kFp16;
  const double backward_host_s =
      eager ? f.host_memory_s : (accumulation_bytes + copy_host_bytes) / rates.adam_bytes_per_s;
  const bool behind_forward = !eager && behind_forward_option(a, world);
  const double after_backward_s =
      eager ? 0.0 : behind_forward ? std::max(0.0, f.host_adam_s - forward_s) : f.host_adam_s;
  // Eager at N = 1 with the carry-over (D79): the host updates still queued at backward's end run
  // beside the next forward, so the host's traffic can overlap backward and forward: the plain floor.
  const bool carried = eager && world == 1 && a.micro_batches == 1 && behind_forward_option(a, world);
  const double ordered_s = forward_s + std::max(f.compute_s - forward_s, backward_host_s) + after_backward_s;
  f.schedule_floor_s = carried ? f.floor_s : std::max(ordered_s, f.transfers_s);
  f.schedule = carried          ? "host Adam inside backward and behind the next forward"
               : eager          ? "host Adam inside backward"
               : behind_forward ? "host Adam behind the next forward"
                                : "host Adam after backward";
  return f;
}

std::string floor_json(const StepFloor& f, const Args& a, const Rates& rates, bool cuda, double measured_step_s) {
  std::ostringstream out;
  out.precision(6);
  out << "{\"rates\": {\"h2d_bytes_per_s\": " << rates.h2d_bytes_per_s << ", \"d2h_bytes_per_s\": "
      << rates.d2h_bytes_per_s << ", \"host_adam_bytes_per_s\": " << rates.adam_bytes_per_s
      << ", \"compute_flops_per_s\": " << f.flops_rate << ", \"compute_rate_from\": \""
      << (f.rate_from_baseline ? "baseline step (6N)" : (cuda ? "bf16 GEMM probe" : "fp32 GEMM probe"))
      << "\"}, \"compute_s\": " << f.compute_s << ", \"transfers_s\": " << f.transfers_s
      << ", \"host_adam_s\": " << f.host_adam_s << ", \"host_adam_bytes_per_param\": " << host_adam_bytes_per_param(a)
      << ", \"host_memory_s\": " << f.host_memory_s << ", \"floor_s\": " << f.floor_s
      << ", \"measured_over_floor\": " << measured_step_s / f.floor_s << ", \"schedule\": \"" << f.schedule
      << "\", \"schedule_floor_s\": " << f.schedule_floor_s
      << ", \"measured_over_schedule_floor\": " << measured_step_s / f.schedule_floor_s
      << ", \"measured_over_compute\": " << measured_step_s / f.compute_s << "}";
  return out.str();
}

}  // namespace bench_gpt
