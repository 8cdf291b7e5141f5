#pragma once
// The machine's rates and ferry's interception cost, measured in bench_gpt's own process: the floors
// its JSON reports measured / floor against, and the ns per intercepted op.
#include <cstdint>

#include "../../ferry.h"

namespace bench_gpt {

// ns per intercepted op: `n` adds on a managed parameter inside ChunkedModel's scope, against the same
// adds on a plain tensor. The parameter stays resident (no budget), so this is the hook path alone.
// And the cost of Note [Ops outside the scopes] (D57): the same adds outside any scope while the thread
// watches (a hazard held for the measurement), on the plain tensor (an op the watch only looks at) and
// on the managed parameter (checked: before_outside_use).
struct InterceptionNs {
  double managed = 0, plain = 0, watched_plain = 0, watched_managed = 0;
};
InterceptionNs interception_ns(ferry::Config config, int64_t n);

// The floors' rates.
struct Rates {
  double h2d_bytes_per_s = 0, d2h_bytes_per_s = 0;  // chunk-sized copies (pinned host memory on CUDA)
  double adam_bytes_per_s = 0;                       // CpuAdam at 28 B/param (bf16 grads and copy), best of 5
  double gemm_flops_per_s = 0;                       // bf16 GEMM on CUDA, fp32 on the CPU
};
Rates measure_rates(const ferry::Config& config, bool cuda);

}  // namespace bench_gpt
