#include "loss_scaler.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace ferry {

void LossScalerOptions::validate() const {
  TORCH_CHECK(std::isfinite(initial_scale) && initial_scale > 0, "ferry: loss scale must be finite and > 0, got ",
              initial_scale);
  TORCH_CHECK(std::isfinite(growth_factor) && growth_factor > 1, "ferry: loss scale growth factor must be > 1, got ",
              growth_factor);
  TORCH_CHECK(backoff_factor > 0 && backoff_factor < 1, "ferry: loss scale backoff factor must be in (0, 1), got ",
              backoff_factor);
  TORCH_CHECK(growth_interval >= 1, "ferry: loss scale growth interval must be >= 1, got ", growth_interval);
  TORCH_CHECK(hysteresis >= 1, "ferry: loss scale hysteresis must be >= 1, got ", hysteresis);
  TORCH_CHECK(std::isfinite(min_scale) && min_scale > 0 && min_scale <= initial_scale,
              "ferry: minimum loss scale must be in (0, initial scale], got ", min_scale);
}

DynamicLossScaler::DynamicLossScaler(const LossScalerOptions& options) : options_(options) {
  options_.validate();
  state_.scale = options_.initial_scale;
  state_.hysteresis_left = options_.hysteresis;
}

void DynamicLossScaler::update(bool overflow) {
  if (overflow) {
    ++state_.overflows;
    state_.clean_steps = 0;
    if (--state_.hysteresis_left == 0) {
      state_.scale = std::max(state_.scale * options_.backoff_factor, options_.min_scale);
      state_.hysteresis_left = options_.hysteresis;
    }
    return;
  }
  if (++state_.clean_steps >= options_.growth_interval) {
    const double grown = state_.scale * options_.growth_factor;
    if (std::isfinite(grown)) state_.scale = grown;
    state_.clean_steps = 0;
    state_.hysteresis_left = options_.hysteresis;
  }
}

void DynamicLossScaler::set_state(const LossScalerState& state) {
  TORCH_CHECK(std::isfinite(state.scale) && state.scale > 0, "ferry: loss scale must be finite and > 0, got ",
              state.scale);
  TORCH_CHECK(state.clean_steps >= 0 && state.overflows >= 0, "ferry: loss scaler counters must be >= 0");
  TORCH_CHECK(state.hysteresis_left >= 1 && state.hysteresis_left <= options_.hysteresis,
              "ferry: hysteresis_left must be in [1, ", options_.hysteresis, "], got ", state.hysteresis_left);
  state_ = state;
}

}  // namespace ferry
