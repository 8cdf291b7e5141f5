#include "state_values.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "../cpu_adam/compact_state.h"

namespace ferry::optim {

namespace {
// One moment of a compact slot (`role`: kExpAvgRole or kExpAvgSqRole) with the slot's scales, on the
// CPU (the slot's own memory where it is there), as a span of them.
struct CompactMoment {
  at::Tensor codes, scales;
  CompactAdamSpan span;
};

CompactMoment compact_moment(StateChunks& state, int role, int64_t param) {
  CompactMoment c;
  c.codes = state.view(role, param).to(at::kCPU).contiguous();
  c.scales = state.view(scales_role(state), param).to(at::kCPU).contiguous();
  const int64_t n = c.codes.numel(), blocks = compact_blocks(n);
  TORCH_INTERNAL_ASSERT(c.scales.numel() == 2 * blocks, "compact scales of ", c.scales.numel(), " values for ", n,
                        " elements");
  float* scales = c.scales.data_ptr<float>();
  if (role == kExpAvgRole) {
    c.span.exp_avg = c.codes.data_ptr<uint8_t>();
    c.span.exp_avg_scale = scales;
  } else {
    c.span.exp_avg_sq = c.codes.data_ptr<uint8_t>();
    c.span.exp_avg_sq_scale = scales + blocks;
  }
  c.span.numel = n;
  return c;
}
}  // namespace

StateValues::StateValues(StateChunks& state) : state_(state) {}

at::Tensor StateValues::read(int role, int64_t param) {
  const at::Tensor slot = state_.view(role, param);
  if (!compact() || role > kExpAvgSqRole) return slot.to(at::kCPU, at::kFloat, false, /*copy=*/true);
  if (role == kMasterRole) return slot.to(at::kCPU, at::kFloat);
  const CompactMoment c = compact_moment(state_, role, param);
  at::Tensor out = at::empty(slot.sizes(), at::kFloat);
  float* x = out.data_ptr<float>();
  compact_to_fp32(c.span, nullptr, role == kExpAvgRole ? x : nullptr, role == kExpAvgSqRole ? x : nullptr);
  return out;
}

void StateValues::write(int role, int64_t param, const at::Tensor& values) {
  at::Tensor slot = state_.view(role, param);
  TORCH_CHECK(values.numel() == slot.numel(), "ferry: state values of ", values.numel(), " elements for a slot of ",
              slot.numel());
  if (!compact() || role == kMasterRole || role > kExpAvgSqRole) {  // the master: rounded to nearest by the copy
    slot.copy_(values.reshape(slot.sizes()));
    return;
  }
  const CompactMoment c = compact_moment(state_, role, param);
  const at::Tensor x = values.to(at::kCPU, at::kFloat).contiguous();
  compact_from_fp32(c.span, nullptr, role == kExpAvgRole ? x.data_ptr<float>() : nullptr,
                    role == kExpAvgSqRole ? x.data_ptr<float>() : nullptr);
  // Back where the slot is, unless the codes and scales were its own memory (a host slot).
  if (c.codes.data_ptr() != slot.data_ptr()) slot.copy_(c.codes.view(slot.sizes()));
  at::Tensor scales = state_.view(scales_role(state_), param);
  if (c.scales.data_ptr() != scales.data_ptr()) scales.copy_(c.scales);
}

}  // namespace ferry::optim
