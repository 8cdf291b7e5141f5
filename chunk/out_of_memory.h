#pragma once
// The error raised when a tier cannot make room within its budget.
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "role.h"

namespace ferry {

// What a tier looked like when it could not make room (all sums of bytes).
struct TierShortfall {
  Tier tier = Tier::kDevice;
  int64_t needed = 0;     // bytes the request needed in the tier
  int64_t budget = 0;     // the tier's budget
  int64_t used = 0;       // payload bytes in the tier
  int64_t in_compute = 0; // of `used`: chunks in COMPUTE (cannot move)
  int64_t evictable = 0;  // of `used`: chunks the policy could move out
  std::string what;       // what the bytes were for, e.g. "chunk 3 (param, bfloat16)"
};

// A c10::OutOfMemoryError, so code catching torch's OOM catches this too. The message names the
// tier, the budget, the used, in-compute and evictable bytes, and what to try.
class OutOfMemoryError : public c10::OutOfMemoryError {
 public:
  explicit OutOfMemoryError(const TierShortfall& shortfall);
  const TierShortfall& shortfall() const { return shortfall_; }

 private:
  TierShortfall shortfall_;
};

}  // namespace ferry
