#include "ferry/chunk/repack.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>

namespace ferry {

int64_t fill_layout(ChunkStore& to, const ChunkLayout& layout, const std::vector<ChunkStore::RoleChunks>& roles,
                    ChunkStore* from, const std::vector<std::vector<TensorId>>& from_tensors,
                    const std::function<void(int role, int64_t tensor, TensorId slot)>& fill) {
  const int num_roles = static_cast<int>(roles.size());
  TORCH_CHECK(!from || static_cast<int>(from_tensors.size()) == num_roles, "fill_layout: ", num_roles,
              " roles to fill but ", from_tensors.size(), " to migrate from");
  // Old chunk -> tensors (all roles) still to move out of it.
  std::unordered_map<ChunkId, int64_t> remaining;
  if (from) {
    for (const auto& role : from_tensors) {
      for (TensorId t : role) ++remaining[from->tensor_info(t).chunk];
    }
  }
  int64_t peak = 0;
  for (int64_t i = 0; i < layout.num_chunks(); ++i) {
    for (int r = 0; r < num_roles; ++r) to.allocate_payload(roles[r].chunks[i], Location::kHost);
    for (int64_t j : layout.chunks()[i].tensors) {
      for (int r = 0; r < num_roles; ++r) {
        fill(r, j, roles[r].tensors[j]);
        if (!from) continue;
        const ChunkStoreStats old_stats = from->stats();
        peak = std::max(peak, to.stats().host.current_bytes + old_stats.host.current_bytes +
                                  old_stats.device.current_bytes);
        const ChunkId old = from->tensor_info(from_tensors[r][j]).chunk;
        if (--remaining[old] == 0) from->retire(old);
      }
    }
  }
  return peak;
}

}  // namespace ferry
