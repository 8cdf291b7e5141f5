#pragma once
// fill_layout: the one routine that fills a layout's chunks, for a first build and for a repack alike,
// for every store that mirrors the parameter layout (the parameter chunks in ChunkedModel, the optimizer
// state in HybridAdam).
//
// It walks the layout chunk by chunk: gives chunk i of every role a zero-filled host payload, then hands
// each of its tensors to `fill` (the caller writes or binds the values and sets the slot's state). In a
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

#include "ferry/chunk/chunk_store.h"
#include "ferry/chunk/layout.h"

namespace ferry {

// Returns the peak of the payload bytes of both stores together (host of `to`, host and device of
// `from`, and the host buffers both keep for reuse beyond those `from` kept before) while filling:
// what the repack costs beyond the old store (0 on a first build).
int64_t fill_layout(ChunkStore& to, const ChunkLayout& layout, const std::vector<ChunkStore::RoleChunks>& roles,
                    ChunkStore* from, const std::vector<std::vector<TensorId>>& from_tensors,
                    const std::function<void(int role, int64_t tensor, TensorId slot)>& fill);

}  // namespace ferry
