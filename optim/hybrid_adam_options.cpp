#include "hybrid_adam_options.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace ferry {

const char* to_string(StateFormat format) {
  switch (format) {
    case StateFormat::kFp32: return "fp32";
    case StateFormat::kCompact: return "compact";
  }
  return "?";
}

StateFormat state_format_from_string(const std::string& name) {
  if (name == "fp32") return StateFormat::kFp32;
  if (name == "compact") return StateFormat::kCompact;
  TORCH_CHECK(false, "ferry: expected a state format of fp32 or compact, got '", name, "'");
}

HybridAdamOptions HybridAdamOptions::no_decay_for_bias_and_norm(const AdamOptions& defaults) {
  HybridAdamOptions o;
  o.defaults = defaults;
  AdamOptions no_decay = defaults;
  no_decay.weight_decay = 0.0;
  o.groups.push_back({[](const std::string&, const at::Tensor& p) { return p.dim() <= 1; }, no_decay});
  return o;
}

void HybridAdamOptions::validate() const {
  defaults.validate();
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(groups[g].match, "ferry: param group rule ", g + 1, " has no match function");
    groups[g].options.validate();
  }
  TORCH_CHECK(std::isfinite(max_grad_norm) && max_grad_norm >= 0, "ferry: max_grad_norm must be finite and >= 0, got ",
              max_grad_norm);
  TORCH_CHECK(device_state_chunks >= -1, "ferry: device_state_chunks must be -1 (auto) or >= 0, got ",
              device_state_chunks);
  loss_scaler.validate();
  TORCH_CHECK(state_format == StateFormat::kFp32 || state_format == StateFormat::kCompact,
              "ferry: unknown state format ", static_cast<int>(state_format));
  TORCH_CHECK(round_trip_slots >= 0, "ferry: round_trip_slots must be >= 0 (0: no bound), got ", round_trip_slots);
}

}  // namespace ferry
