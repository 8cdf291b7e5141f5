#pragma once
// Dynamic loss scaling for fp16 training: the loss is multiplied by scale() before backward so small
// gradients survive fp16; the optimizer divides it out. After an overflow (an inf/NaN gradient) the
// step is skipped; after `hysteresis` overflows since the last growth or backoff, the scale backs
// off; after `growth_interval` clean steps in a row it grows.
//
//   overflow: skipped += 1; hysteresis_left -= 1; if hysteresis_left == 0: scale = max(scale*backoff,
//             min_scale), hysteresis_left = hysteresis; clean_steps = 0
//   clean:    clean_steps += 1; if clean_steps == growth_interval: scale *= growth, clean_steps = 0,
//             hysteresis_left = hysteresis
#include <cstdint>

namespace ferry {

struct LossScalerOptions {
  double initial_scale = 65536.0;
  double growth_factor = 2.0;     // > 1
  double backoff_factor = 0.5;    // in (0, 1)
  int64_t growth_interval = 1000; // clean steps before growing, >= 1
  int hysteresis = 2;             // overflows tolerated before backing off, >= 1
  double min_scale = 1.0;         // > 0
  void validate() const;
};

struct LossScalerState {
  double scale = 1.0;
  int64_t clean_steps = 0;
  int hysteresis_left = 1;
  int64_t overflows = 0;  // steps skipped so far
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const LossScalerOptions& options = {});
  double scale() const { return state_.scale; }
  // Records one step's outcome.
  void update(bool overflow);
  const LossScalerState& state() const { return state_; }
  const LossScalerOptions& options() const { return options_; }
  // For resuming; validated (scale finite and > 0, counters >= 0, hysteresis_left in [1, hysteresis]).
  void set_state(const LossScalerState& state);

 private:
  LossScalerOptions options_;
  LossScalerState state_;
};

}  // namespace ferry
