#include "eviction_policy.h"

#include <algorithm>

namespace ferry {

std::vector<ChunkId> LruEvictionPolicy::choose(const EvictionRequest& request) {
  std::vector<EvictionCandidate> order = request.candidates;
  std::sort(order.begin(), order.end(), [](const EvictionCandidate& a, const EvictionCandidate& b) {
    return a.last_use != b.last_use ? a.last_use < b.last_use : a.chunk < b.chunk;
  });
  std::vector<ChunkId> victims;
  int64_t freed = 0;
  for (const auto& c : order) {
    if (freed >= request.bytes_needed) break;
    victims.push_back(c.chunk);
    freed += c.bytes;
  }
  return victims;
}

}  // namespace ferry
