#pragma once
// fill_layout: the one routine that fills a layout's chunks, for a first build and for a repack alike,
// for every store that mirrors the parameter layout (the parameter chunks in ChunkedModel, the optimizer
// state in HybridAdam).
//
// It walks the layout chunk by chunk: gives chunk i of every role a zero-filled payload (on the host, or
// on the device as FillPlacement allows), then hands each of its tensors to `fill` (the caller writes or
// binds the values and sets the slot's state). In a
// repack (`from` set) each old chunk, of every role, is retired as soon as all its tensors have been
// filled, so memory grows by about one chunk per role, never by a second copy of the whole; its host
// buffer goes to the new store, whose next chunk of that size reuses it (Note [Repack reuses memory]).
//
// Contract: `roles[r]` was made by `to.add_layout(..., layout, ..., Location::kNone)`; `from_tensors[r][j]`
// is tensor j's slot of role r in `from` (every role and tensor of `layout`), and none of them is in
// COMPUTE. `fill` may throw; then `to` is left half-filled (the caller drops it) and `from` keeps what
// was not yet retired.
#include <cstdint>
#include <functional>
#include <vector>

#include "chunk_store.h"
#include "layout.h"

namespace ferry {

// Where fill_layout gives a new chunk its payload: on the host, unless `keep_on_device` and every tensor
// of that chunk (in that role) comes from an old chunk on the device, and the device chunks of every
// store sharing `to`'s device accountant stay within `device_room_bytes` (0: no limit) with it. Then it
// is built on the device: device-to-device copies, no host memory and no transfer either way (Note
// [Repack stays on the device], chunk/repack.cpp). Nothing is evicted to make room.
struct FillPlacement {
  bool keep_on_device = false;
  int64_t device_room_bytes = 0;
};

// Returns the peak of the payload bytes of both stores together (host and device of both, and the host
// buffers both keep for reuse beyond those `from` kept before) while filling: what the repack costs
// beyond the old store (0 on a first build).
int64_t fill_layout(ChunkStore& to, const ChunkLayout& layout, const std::vector<ChunkStore::RoleChunks>& roles,
                    ChunkStore* from, const std::vector<std::vector<TensorId>>& from_tensors,
                    const std::function<void(int role, int64_t tensor, TensorId slot)>& fill,
                    const FillPlacement& placement = {});

}  // namespace ferry
