#include "compact_state.h"

#include <c10/util/Exception.h>

#include "kernels/kernel_abi.h"

namespace ferry {

static_assert(kCompactStateBlock == cpu_adam::kCompactBlock, "one block size");

namespace {
// The span's arrays that a conversion of these roles uses, checked non-null.
cpu_adam::CompactStateView view_of(const CompactAdamSpan& s, bool master, bool exp_avg, bool exp_avg_sq) {
  TORCH_CHECK(s.numel >= 0, "ferry: compact state of ", s.numel, " elements");
  TORCH_CHECK(s.numel == 0 || ((!master || s.master) && (!exp_avg || (s.exp_avg && s.exp_avg_scale)) &&
                               (!exp_avg_sq || (s.exp_avg_sq && s.exp_avg_sq_scale))),
              "ferry: compact state of ", s.numel, " elements with a null array for a role it converts");
  return {s.master, s.exp_avg, s.exp_avg_scale, s.exp_avg_sq, s.exp_avg_sq_scale};
}
}  // namespace

void compact_to_fp32(const CompactAdamSpan& span, float* master, float* exp_avg, float* exp_avg_sq) {
  cpu_adam::compact_decode(view_of(span, master, exp_avg, exp_avg_sq), span.numel, master, exp_avg, exp_avg_sq);
}

void compact_from_fp32(const CompactAdamSpan& span, const float* master, const float* exp_avg,
                       const float* exp_avg_sq) {
  cpu_adam::compact_encode(view_of(span, master, exp_avg, exp_avg_sq), span.numel, master, exp_avg, exp_avg_sq);
}

}  // namespace ferry
