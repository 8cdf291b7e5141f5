#pragma once
// Packing tensors into fixed-size chunks, the packing waste, the chunk-size search, and the layout of
// chunks into communication groups across ranks. Pure functions of sizes: no memory is touched.
//
// Units are elements, not bytes: every role's chunks mirror the parameter chunks element for element,
// so one layout serves the compute copy (2 or 4 B/elem) and the fp32 optimizer state alike.
// PackOptions::from_bytes turns the configured chunk size in bytes (of the compute copy) into elements.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace ferry {

struct PackOptions {
  int64_t chunk_numel = int64_t{32} << 20;  // capacity of a regular chunk, elements
  int64_t align_numel = 32;                 // every slot offset is a multiple of this, elements

  // chunk_size_bytes of `dtype` (the compute copy), slots aligned to 64 bytes of that dtype. The
  // capacity is rounded down to the alignment. Fails if the size holds less than one aligned slot.
  static PackOptions from_bytes(int64_t chunk_size_bytes, at::ScalarType dtype);
  void validate() const;
};

// Where one tensor lives: chunk index, offset and length in elements; and its first element's index
// with every tensor of the layout laid end to end in tensor-index order (the model's order, whatever
// the packing: a name for an element that no chunk size, call order or repacking changes).
struct Slot {
  int64_t chunk = -1;
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t first_element = 0;
};

// One chunk of a layout.
struct ChunkExtent {
  int64_t numel = 0;             // capacity, elements (chunk_numel, or the aligned size of an oversize tensor)
  int64_t used_numel = 0;        // sum of the numels of its tensors (alignment gaps are not "used")
  std::vector<int64_t> tensors;  // indices into the packed tensor list, in packing order
  bool dedicated = false;        // holds one tensor larger than chunk_numel
};

class ChunkLayout {
 public:
  // Packs tensors of the given element counts in `order` (a permutation of 0..numels.size()-1; empty
  // means 0, 1, 2, ...): each tensor goes at the next aligned offset of the open chunk; when it does not
  // fit, a new chunk is opened. A tensor larger than chunk_numel gets a dedicated chunk of its own
  // (aligned) size, which closes the open chunk, so chunk indices follow the order. Zero-element tensors
  // get a slot of length 0 and take no space.
  static ChunkLayout pack(const std::vector<int64_t>& numels, const std::vector<int64_t>& order,
                          const PackOptions& options);

  // A layout with the same chunks, each holding the same tensors in the same order, but tensor j taking
  // numel_of(slots()[j].numel) elements (slots aligned to align_numel, each chunk as large as its
  // tensors need, at least align_numel): a state role whose elements do not mirror the parameters one
  // for one (the compact moments' per-block scales, cpu_adam/compact_state.h).
  ChunkLayout derive(const std::function<int64_t(int64_t numel)>& numel_of, int64_t align_numel) const;

  const PackOptions& options() const { return options_; }
  const std::vector<ChunkExtent>& chunks() const { return chunks_; }
  // Indexed by tensor index (not by order).
  const std::vector<Slot>& slots() const { return slots_; }
  int64_t num_chunks() const { return static_cast<int64_t>(chunks_.size()); }

  int64_t allocated_numel() const;  // sum of chunk capacities
  int64_t used_numel() const;       // sum of tensor numels
  // Unused share of the allocation: (allocated - used) / allocated; 0 for an empty layout.
  double waste() const;

 private:
  void number_elements();  // every slot's first_element, from the slots' numels

  PackOptions options_;
  std::vector<ChunkExtent> chunks_;
  std::vector<Slot> slots_;
};

// One chunk size of a search and what it gives.
struct ChunkSizeChoice {
  int64_t chunk_numel = 0;
  int64_t num_chunks = 0;
  int64_t allocated_numel = 0;
  double waste = 0.0;
};

struct ChunkSizeSearch {
  ChunkSizeChoice best;                // least waste; ties go to fewer chunks, then the smaller size
  std::vector<ChunkSizeChoice> tried;  // every size tried, ascending
};

// Tries chunk_numel = min_numel, min_numel + step_numel, ... <= max_numel (all multiples of align_numel)
// and keeps the one with the least waste. Sizes below the largest tensor are allowed: oversize
// tensors then take dedicated chunks, as in pack().
ChunkSizeSearch search_chunk_size(const std::vector<int64_t>& numels, const std::vector<int64_t>& order,
                                  int64_t min_numel, int64_t max_numel, int64_t step_numel,
                                  int64_t align_numel);

// The chunk size ferry uses when the user sets none (Config::chunk_size_bytes == 0): the least
// packing waste (search_chunk_size) over sizes of the compute copy between `lo` and `hi` bytes, where
// hi = min(1 GiB, a quarter of the model, `max_bytes` where > 0) so that even a small model makes
// several chunks (the device can hold part of it) and the device's room holds enough of them for
// prefetch to get ahead (auto_chunk_cap_bytes), and lo = min(32 MiB, hi / 4) so that a large model's
// chunks stay large enough for full-speed PCIe copies. 1024 sizes are tried, and the smallest whose
// waste is within half a point of the least is taken (smaller chunks offload finer). Waste is the
// allocation share no tensor uses. `elem_bytes` is the compute dtype's element size; slots align to 64
// bytes. A size below the largest tensor gives it a dedicated chunk of its own size (pack()).
struct AutoChunkSize {
  int64_t chunk_bytes = 0;  // the choice
  double waste = 0.0;       // of the layout it gives
  int64_t lo_bytes = 0, hi_bytes = 0;
  bool capped = false;      // `max_bytes` lowered hi (below the other two bounds)
};
AutoChunkSize auto_chunk_size(const std::vector<int64_t>& numels, const std::vector<int64_t>& order,
                              int64_t elem_bytes, int64_t max_bytes = 0);

// The largest chunk auto_chunk_size may pick for a device whose room for chunks (Config::
// device_budget_bytes, else the device's capacity) is `room_bytes`: the room must hold
// kAutoChunksInRoom times what one use brings in, `chunks_per_use` chunks (1; the world size where
// chunks are sharded, since a use gathers a whole communication group). 0 where the room is unknown
// (room_bytes == 0): no cap. Why sixteen: D99 in docs/ARCHITECTURE.md (where uses jump, a layer skipped,
// four or eight chunks in a budget leave the prefetch no room ahead of those in use). Never below 4 KiB.
inline constexpr int64_t kAutoChunksInRoom = 16;
int64_t auto_chunk_cap_bytes(int64_t room_bytes, int64_t chunks_per_use = 1);

// Chunks laid out for sharding across `world_size` ranks: the chunk list is padded with empty chunks
// to a multiple of world_size; chunk i belongs to communication group i / world_size and is owned
// (kept, updated) by rank i % world_size. A group is what one all-gather brings in and one
// reduce-scatter sends out.
class CommGroups {
 public:
  CommGroups(int64_t num_chunks, int world_size);

  int world_size() const { return world_size_; }
  int64_t num_chunks() const { return num_chunks_; }        // real chunks
  int64_t padded_num_chunks() const { return padded_; }     // real + padding
  int64_t num_groups() const { return padded_ / world_size_; }
  bool is_padding(int64_t chunk) const;
  int64_t group_of(int64_t chunk) const;
  int owner_of(int64_t chunk) const;
  // The world_size chunks of group g, in rank order (chunk g*world_size + r is rank r's).
  std::vector<int64_t> chunks_of_group(int64_t group) const;
  // The chunks rank r owns, ascending (one per group).
  std::vector<int64_t> chunks_owned_by(int rank) const;

 private:
  void check_chunk(int64_t chunk) const;
  int world_size_;
  int64_t num_chunks_;
  int64_t padded_;
};

}  // namespace ferry
