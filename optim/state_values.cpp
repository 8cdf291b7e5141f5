#include "state_values.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "../cpu_adam/compact_state.h"
#include "state_roles.h"

namespace ferry::optim {

namespace {
// A compact slot's arrays, copied to the CPU (contiguous), as a span of them.
struct CompactCopy {
  at::Tensor master, exp_avg, exp_avg_sq, scales;
  CompactAdamSpan span;
};

CompactCopy copy_compact(StateChunks& state, int64_t param) {
  CompactCopy c;
  c.master = state.view(kMasterRole, param).to(at::kCPU).contiguous().clone();
  c.exp_avg = state.view(kExpAvgRole, param).to(at::kCPU).contiguous().clone();
  c.exp_avg_sq = state.view(kExpAvgSqRole, param).to(at::kCPU).contiguous().clone();
  c.scales = state.view(state.num_roles() - 1, param).to(at::kCPU).contiguous().clone();
  const int64_t n = c.master.numel();
  TORCH_INTERNAL_ASSERT(c.scales.numel() == 2 * compact_blocks(n), "compact scales of ", c.scales.numel(),
                        " values for ", n, " elements");
  c.span.master = reinterpret_cast<uint16_t*>(c.master.data_ptr());
  c.span.exp_avg = c.exp_avg.data_ptr<uint8_t>();
  c.span.exp_avg_sq = c.exp_avg_sq.data_ptr<uint8_t>();
  c.span.exp_avg_scale = c.scales.data_ptr<float>();
  c.span.exp_avg_sq_scale = c.span.exp_avg_scale + compact_blocks(n);
  c.span.numel = n;
  return c;
}
}  // namespace

StateValues::StateValues(StateChunks& state)
    : state_(state), compact_(state.spec(kMasterRole).dtype == at::kBFloat16) {}

at::Tensor StateValues::read(int role, int64_t param) {
  const at::Tensor slot = state_.view(role, param);
  if (!compact_ || role > kExpAvgSqRole) return slot.to(at::kCPU, at::kFloat, false, /*copy=*/true);
  if (role == kMasterRole) return slot.to(at::kCPU, at::kFloat);
  CompactCopy c = copy_compact(state_, param);
  at::Tensor out = at::empty(slot.sizes(), at::kFloat);
  float* x = out.data_ptr<float>();
  compact_to_fp32(c.span, nullptr, role == kExpAvgRole ? x : nullptr, role == kExpAvgSqRole ? x : nullptr);
  return out;
}

void StateValues::write(int role, int64_t param, const at::Tensor& values) {
  at::Tensor slot = state_.view(role, param);
  TORCH_CHECK(values.numel() == slot.numel(), "ferry: state values of ", values.numel(), " elements for a slot of ",
              slot.numel());
  if (!compact_ || role == kMasterRole || role > kExpAvgSqRole) {  // the master: rounded to nearest by the copy
    slot.copy_(values.reshape(slot.sizes()));
    return;
  }
  CompactCopy c = copy_compact(state_, param);
  const at::Tensor x = values.to(at::kCPU, at::kFloat).contiguous();
  compact_from_fp32(c.span, nullptr, role == kExpAvgRole ? x.data_ptr<float>() : nullptr,
                    role == kExpAvgSqRole ? x.data_ptr<float>() : nullptr);
  slot.copy_(role == kExpAvgRole ? c.exp_avg.view(slot.sizes()) : c.exp_avg_sq.view(slot.sizes()));
  state_.view(state_.num_roles() - 1, param).copy_(c.scales);
}

}  // namespace ferry::optim
