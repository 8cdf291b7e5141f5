#pragma once
// ferry's version, and the versions of what it was built with.
namespace ferry {
// "0.1.0"
const char* version();
}  // namespace ferry
