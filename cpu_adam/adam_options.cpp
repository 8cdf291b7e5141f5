#include "adam_options.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace ferry {

void AdamOptions::validate() const {
  TORCH_CHECK(std::isfinite(lr) && lr >= 0.0, "Adam: expected lr >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "Adam: expected 0 <= beta1 < 1, got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "Adam: expected 0 <= beta2 < 1, got ", beta2);
  TORCH_CHECK(std::isfinite(eps) && eps > 0.0, "Adam: expected eps > 0, got ", eps);
  TORCH_CHECK(std::isfinite(weight_decay) && weight_decay >= 0.0, "Adam: expected weight_decay >= 0, got ",
              weight_decay);
}

const char* to_string(AdamMode mode) {
  switch (mode) {
    case AdamMode::kAdam: return "adam";
    case AdamMode::kAdamW: return "adamw";
  }
  return "?";
}

}  // namespace ferry
