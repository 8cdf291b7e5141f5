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
  // Note [Repack reuses memory]: an old chunk's host buffer, once retired, is handed to the new store
  // and taken by the next new chunk of its size, instead of being freed while the new chunk faults in
  // fresh pages (on the H100 box's host, a repack of 12b took 18.7 s; fresh memory costs the kernel a
  // page clear and a fault per page). Both caches are raised for the repack to two chunks per role
  // (so buffers of a size no new chunk takes cannot pile up) and set back after it, whatever happens.
  struct CacheLimits {
    ChunkStore& to;
    ChunkStore* from;
    int64_t to_bytes, from_bytes;
    ~CacheLimits() {
      to.set_host_cache_bytes(to_bytes);
      if (from) from->set_host_cache_bytes(from_bytes);
    }
  } limits{to, from, to.host_cache_bytes(), from ? from->host_cache_bytes() : 0};
  if (from) {
    int64_t bound = 0;
    for (const auto& role : roles) {
      int64_t largest = 0;
      for (ChunkId c : role.chunks) largest = std::max(largest, to.chunk_info(c).nbytes);
      bound += 2 * largest;
    }
    to.set_host_cache_bytes(std::max(limits.to_bytes, bound));
    from->set_host_cache_bytes(std::max(limits.from_bytes, bound));
  }
  // What the old store kept for reuse before (the host buffers of chunks it moved to the device, say)
  // is held either way: the peak counts what the repack adds to it. It goes to the new store first.
  const int64_t cached_before = from ? from->stats().host_buffers.cached_bytes : 0;
  if (from) from->give_cached_host_buffers(to);
  int64_t peak = 0;
  for (int64_t i = 0; i < layout.num_chunks(); ++i) {
    for (int r = 0; r < num_roles; ++r) to.allocate_payload(roles[r].chunks[i], Location::kHost);
    for (int64_t j : layout.chunks()[i].tensors) {
      for (int r = 0; r < num_roles; ++r) {
        fill(r, j, roles[r].tensors[j]);
        if (!from) continue;
        const ChunkStoreStats old_stats = from->stats();
        const ChunkStoreStats new_stats = to.stats();
        // Buffers kept for reuse are memory too.
        peak = std::max(peak, new_stats.host.current_bytes + new_stats.host_buffers.cached_bytes +
                                  old_stats.host.current_bytes + old_stats.host_buffers.cached_bytes +
                                  old_stats.device.current_bytes - cached_before);
        const ChunkId old = from->tensor_info(from_tensors[r][j]).chunk;
        if (--remaining[old] == 0) {
          from->retire(old);
          from->give_cached_host_buffers(to);
        }
      }
    }
  }
  return peak;
}

}  // namespace ferry
