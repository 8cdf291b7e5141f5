#include "out_of_memory.h"

#include <sstream>

#include "../common/config.h"

namespace ferry {
namespace {

std::string describe(const TierShortfall& s) {
  std::ostringstream os;
  os << "ferry: out of " << to_string(s.tier) << " chunk memory: " << s.what << " needs "
     << format_bytes(s.needed) << ", but the " << to_string(s.tier) << " budget is "
     << format_bytes(s.budget) << " with " << format_bytes(s.used) << " used, of which "
     << format_bytes(s.in_compute) << " in COMPUTE (cannot move) and " << format_bytes(s.evictable)
     << " evictable. ";
  if (s.tier == Tier::kDevice) {
    if (s.in_compute + s.needed > s.budget) {
      // The chunks in COMPUTE belong to the op (and the ops it is nested in) that needs this one too.
      os << "This op needs at least " << format_bytes(s.in_compute + s.needed)
         << " of chunks on the device at once (" << format_bytes(s.in_compute) << " in COMPUTE + "
         << format_bytes(s.needed) << "): the smallest device budget it can run with at this chunk size. ";
    }
    os << "Raise device_budget, lower chunk_size_bytes, or shrink the working set of one op.";
  } else {
    os << "Raise host_budget, or keep more chunks on the device.";
  }
  return os.str();
}

}  // namespace

OutOfMemoryError::OutOfMemoryError(const TierShortfall& shortfall)
    : c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, describe(shortfall)),
      shortfall_(shortfall) {}

}  // namespace ferry
