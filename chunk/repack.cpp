#include "repack.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>

namespace ferry {

int64_t fill_layout(ChunkStore& to, const ChunkLayout& layout, const std::vector<ChunkStore::RoleChunks>& roles,
                    ChunkStore* from, const std::vector<std::vector<TensorId>>& from_tensors,
                    const std::function<void(int role, int64_t tensor, TensorId slot)>& fill,
                    const FillPlacement& placement) {
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
  // Note [Repack stays on the device]: a new chunk whose values all sit in old chunks on the device is
  // built there when the device has room for it beside everything else on it. After a warm-up in which
  // the model fitted, the repack is then device copies only; built on the host instead, the whole model
  // crossed twice (down into freshly pinned buffers, tensor by tensor, and up again in the next
  // forward), and the pinned buffers were allocated for that one trip. Room is never made by evicting:
  // where it is short the chunk goes to the host, as before.
  auto on_device = [&](int r, int64_t i) {
    if (!from || !placement.keep_on_device) return false;
    for (int64_t j : layout.chunks()[i].tensors) {
      if (from->location(from->tensor_info(from_tensors[r][j]).chunk) != Location::kDevice) return false;
    }
    const int64_t bytes = to.chunk_info(roles[r].chunks[i]).nbytes;
    const TierStats own = to.stats().device;
    const int64_t all_stores = to.device_bytes_elsewhere() + own.current_bytes;
    return (placement.device_room_bytes == 0 || all_stores + bytes <= placement.device_room_bytes) &&
           (own.budget_bytes == 0 || own.current_bytes + bytes <= own.budget_bytes);
  };
  int64_t peak = 0;
  for (int64_t i = 0; i < layout.num_chunks(); ++i) {
    for (int r = 0; r < num_roles; ++r) {
      const ChunkId c = roles[r].chunks[i];
      bool placed = false;
      if (on_device(r, i)) {
        try {
          placed = to.try_allocate_payload_on_device(c);
        } catch (const c10::OutOfMemoryError&) {
          // The device's own allocator had less than the budgets say (another process, fragmentation):
          // the host takes the chunk, as it would without this choice.
        }
      }
      if (!placed) to.allocate_payload(c, Location::kHost);
    }
    for (int64_t j : layout.chunks()[i].tensors) {
      for (int r = 0; r < num_roles; ++r) {
        fill(r, j, roles[r].tensors[j]);
        if (!from) continue;
        const ChunkStoreStats old_stats = from->stats();
        const ChunkStoreStats new_stats = to.stats();
        // Buffers kept for reuse are memory too.
        peak = std::max(peak, new_stats.host.current_bytes + new_stats.host_buffers.cached_bytes +
                                  new_stats.device.current_bytes + old_stats.host.current_bytes +
                                  old_stats.host_buffers.cached_bytes + old_stats.device.current_bytes -
                                  cached_before);
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
