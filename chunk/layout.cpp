#include "layout.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ferry {
namespace {

// The smallest size auto_chunk_size picks or its cap allows (Config allows no smaller chunk).
constexpr int64_t kMinAutoChunkBytes = 4096;

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

std::vector<int64_t> resolve_order(size_t n, const std::vector<int64_t>& order) {
  std::vector<int64_t> resolved;
  if (order.empty()) {
    resolved.resize(n);
    for (size_t i = 0; i < n; ++i) resolved[i] = static_cast<int64_t>(i);
    return resolved;
  }
  TORCH_CHECK(order.size() == n, "ferry: packing order must list every tensor once: expected ", n,
              " indices, got ", order.size());
  std::vector<char> seen(n, 0);
  for (int64_t i : order) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(n), "ferry: packing order index ", i,
                " out of range [0, ", n, ")");
    TORCH_CHECK(!seen[i], "ferry: packing order lists tensor ", i, " twice");
    seen[i] = 1;
  }
  return order;
}

}  // namespace

PackOptions PackOptions::from_bytes(int64_t chunk_size_bytes, at::ScalarType dtype) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  PackOptions options;
  options.align_numel = std::max<int64_t>(1, 64 / elem);
  options.chunk_numel = chunk_size_bytes / elem / options.align_numel * options.align_numel;
  TORCH_CHECK(options.chunk_numel > 0, "ferry: chunk size must hold at least 64 bytes, got ",
              chunk_size_bytes, " bytes");
  return options;
}

void PackOptions::validate() const {
  TORCH_CHECK(align_numel > 0, "ferry: align_numel must be > 0, got ", align_numel);
  TORCH_CHECK(chunk_numel > 0 && chunk_numel % align_numel == 0,
              "ferry: chunk_numel must be a positive multiple of align_numel (", align_numel, "), got ",
              chunk_numel);
}

ChunkLayout ChunkLayout::pack(const std::vector<int64_t>& numels, const std::vector<int64_t>& order,
                              const PackOptions& options) {
  options.validate();
  ChunkLayout layout;
  layout.options_ = options;
  layout.slots_.resize(numels.size());
  int64_t open = -1;     // index of the chunk being filled, -1 when none
  int64_t cursor = 0;    // next free offset in it
  for (int64_t index : resolve_order(numels.size(), order)) {
    const int64_t numel = numels[index];
    TORCH_CHECK(numel >= 0, "ferry: tensor ", index, " has a negative element count ", numel);
    Slot& slot = layout.slots_[index];
    slot.numel = numel;
    if (numel > options.chunk_numel) {
      ChunkExtent dedicated;
      dedicated.numel = round_up(numel, options.align_numel);
      dedicated.used_numel = numel;
      dedicated.tensors = {index};
      dedicated.dedicated = true;
      layout.chunks_.push_back(std::move(dedicated));
      slot.chunk = layout.num_chunks() - 1;
      slot.offset = 0;
      open = -1;
      continue;
    }
    const int64_t offset = round_up(cursor, options.align_numel);
    if (open < 0 || offset + numel > options.chunk_numel) {
      ChunkExtent chunk;
      chunk.numel = options.chunk_numel;
      layout.chunks_.push_back(std::move(chunk));
      open = layout.num_chunks() - 1;
      cursor = 0;
    }
    ChunkExtent& chunk = layout.chunks_[open];
    slot.chunk = open;
    slot.offset = round_up(cursor, options.align_numel);
    chunk.used_numel += numel;
    chunk.tensors.push_back(index);
    cursor = slot.offset + numel;
  }
  layout.number_elements();
  return layout;
}

void ChunkLayout::number_elements() {
  int64_t next = 0;
  for (Slot& slot : slots_) {
    slot.first_element = next;
    next += slot.numel;
  }
}

ChunkLayout ChunkLayout::derive(const std::function<int64_t(int64_t numel)>& numel_of, int64_t align_numel) const {
  TORCH_CHECK(align_numel > 0, "ferry: derive() needs align_numel > 0, got ", align_numel);
  ChunkLayout out;
  out.options_ = options_;
  out.options_.align_numel = align_numel;
  out.slots_.resize(slots_.size());
  int64_t largest = align_numel;
  for (const ChunkExtent& chunk : chunks_) {
    ChunkExtent derived;
    derived.dedicated = chunk.dedicated;
    derived.tensors = chunk.tensors;
    int64_t cursor = 0;
    for (int64_t j : chunk.tensors) {
      const int64_t numel = numel_of(slots_[j].numel);
      TORCH_CHECK(numel >= 0, "ferry: derive(): tensor ", j, " maps to a negative element count ", numel);
      Slot& slot = out.slots_[j];
      slot.chunk = slots_[j].chunk;
      slot.offset = round_up(cursor, align_numel);
      slot.numel = numel;
      derived.used_numel += numel;
      cursor = slot.offset + numel;
    }
    derived.numel = std::max(align_numel, round_up(cursor, align_numel));
    largest = std::max(largest, derived.numel);
    out.chunks_.push_back(std::move(derived));
  }
  out.options_.chunk_numel = largest;
  out.number_elements();
  return out;
}

int64_t ChunkLayout::allocated_numel() const {
  int64_t sum = 0;
  for (const auto& c : chunks_) sum += c.numel;
  return sum;
}

int64_t ChunkLayout::used_numel() const {
  int64_t sum = 0;
  for (const auto& c : chunks_) sum += c.used_numel;
  return sum;
}

double ChunkLayout::waste() const {
  const int64_t allocated = allocated_numel();
  if (allocated == 0) return 0.0;
  return static_cast<double>(allocated - used_numel()) / static_cast<double>(allocated);
}

ChunkSizeSearch search_chunk_size(const std::vector<int64_t>& numels, const std::vector<int64_t>& order,
                                  int64_t min_numel, int64_t max_numel, int64_t step_numel,
                                  int64_t align_numel) {
  TORCH_CHECK(align_numel > 0, "ferry: align_numel must be > 0, got ", align_numel);
  TORCH_CHECK(min_numel > 0 && min_numel <= max_numel,
              "ferry: chunk size search needs 0 < min <= max, got min ", min_numel, ", max ", max_numel);
  TORCH_CHECK(step_numel > 0, "ferry: chunk size search step must be > 0, got ", step_numel);
  ChunkSizeSearch search;
  for (int64_t size = round_up(min_numel, align_numel); size <= max_numel;
       size = round_up(size + step_numel, align_numel)) {
    PackOptions options;
    options.chunk_numel = size;
    options.align_numel = align_numel;
    const ChunkLayout layout = ChunkLayout::pack(numels, order, options);
    ChunkSizeChoice choice{size, layout.num_chunks(), layout.allocated_numel(), layout.waste()};
    const bool better = search.tried.empty() || choice.waste < search.best.waste ||
                        (choice.waste == search.best.waste && choice.num_chunks < search.best.num_chunks);
    if (better) search.best = choice;
    search.tried.push_back(choice);
  }
  TORCH_CHECK(!search.tried.empty(), "ferry: chunk size search range [", min_numel, ", ", max_numel,
              "] holds no multiple of the alignment ", align_numel);
  return search;
}

AutoChunkSize auto_chunk_size(const std::vector<int64_t>& numels, const std::vector<int64_t>& order,
                              int64_t elem_bytes, int64_t max_bytes) {
  TORCH_CHECK(elem_bytes == 2 || elem_bytes == 4, "ferry: auto_chunk_size: element size must be 2 or 4, got ",
              elem_bytes);
  TORCH_CHECK(max_bytes >= 0, "ferry: auto_chunk_size: max_bytes must be >= 0 (0: no cap), got ", max_bytes);
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  TORCH_CHECK(total > 0, "ferry: auto_chunk_size: the tensors hold no elements");
  const int64_t align = 64 / elem_bytes;
  constexpr int64_t kHiCap = int64_t{1} << 30, kLoCap = int64_t{32} << 20;
  const int64_t total_bytes = total * elem_bytes;
  const int64_t uncapped = std::min(kHiCap, std::max(kMinAutoChunkBytes, total_bytes / 4));
  const int64_t hi = max_bytes > 0 ? std::max(kMinAutoChunkBytes, std::min(uncapped, max_bytes)) : uncapped;
  const int64_t lo = std::min(kLoCap, std::max(kMinAutoChunkBytes, hi / 4));
  const int64_t lo_numel = round_up(lo / elem_bytes, align);
  const int64_t hi_numel = std::max(lo_numel, hi / elem_bytes / align * align);
  const int64_t step = std::max<int64_t>(align, (hi_numel - lo_numel) / 1024 / align * align);
  const ChunkSizeSearch search = search_chunk_size(numels, order, lo_numel, hi_numel, step, align);
  // Larger chunks tend to waste less, but they coarsen what can be offloaded and raise the device's
  // floor (the largest chunk): take the smallest size within half a point of the least waste.
  ChunkSizeChoice pick = search.best;
  for (const ChunkSizeChoice& c : search.tried) {  // ascending sizes
    if (c.waste <= search.best.waste + 0.005) {
      pick = c;
      break;
    }
  }
  return {pick.chunk_numel * elem_bytes, pick.waste, lo, hi, hi < uncapped};
}

int64_t auto_chunk_cap_bytes(int64_t room_bytes, int64_t chunks_per_use) {
  TORCH_CHECK(room_bytes >= 0, "ferry: auto_chunk_cap_bytes: the device's room must be >= 0 bytes (0: unknown), got ",
              room_bytes);
  TORCH_CHECK(chunks_per_use >= 1, "ferry: auto_chunk_cap_bytes: chunks per use must be >= 1, got ", chunks_per_use);
  if (room_bytes == 0) return 0;
  return std::max(kMinAutoChunkBytes, room_bytes / kAutoChunksInRoom / chunks_per_use);
}

CommGroups::CommGroups(int64_t num_chunks, int world_size)
    : world_size_(world_size), num_chunks_(num_chunks) {
  TORCH_CHECK(world_size >= 1, "ferry: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(num_chunks >= 0, "ferry: chunk count must be >= 0, got ", num_chunks);
  padded_ = round_up(num_chunks, world_size);
}

void CommGroups::check_chunk(int64_t chunk) const {
  TORCH_CHECK(chunk >= 0 && chunk < padded_, "ferry: chunk ", chunk, " out of range [0, ", padded_, ")");
}

bool CommGroups::is_padding(int64_t chunk) const {
  check_chunk(chunk);
  return chunk >= num_chunks_;
}

int64_t CommGroups::group_of(int64_t chunk) const {
  check_chunk(chunk);
  return chunk / world_size_;
}

int CommGroups::owner_of(int64_t chunk) const {
  check_chunk(chunk);
  return static_cast<int>(chunk % world_size_);
}

std::vector<int64_t> CommGroups::chunks_of_group(int64_t group) const {
  TORCH_CHECK(group >= 0 && group < num_groups(), "ferry: group ", group, " out of range [0, ",
              num_groups(), ")");
  std::vector<int64_t> chunks(world_size_);
  for (int r = 0; r < world_size_; ++r) chunks[r] = group * world_size_ + r;
  return chunks;
}

std::vector<int64_t> CommGroups::chunks_owned_by(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < world_size_, "ferry: rank ", rank, " out of range [0, ", world_size_, ")");
  std::vector<int64_t> chunks;
  for (int64_t c = rank; c < padded_; c += world_size_) chunks.push_back(c);
  return chunks;
}

}  // namespace ferry
