#pragma once
// Exact-size host buffers for chunk payloads.
//
// With `pinned`, buffers are page-locked with cudaHostAlloc (so device<->host copies are asynchronous
// DMA) at exactly the requested size: the caching host allocator behind pinned_memory(true) rounds
// every request up to a power of two, which would cost up to 2x host memory for 64 MiB chunks plus
// alignment. Without `pinned`, ordinary 64-byte-aligned host memory (CPU-only machines, the simulated
// device).
//
// Released buffers are cached by exact size and handed out again: cudaHostAlloc/cudaFreeHost take
// milliseconds and cudaFreeHost synchronizes the device. The cache holds at most max_cached_bytes;
// trim() empties it.
//
// Contract: thread-safe. A released buffer must not be used by anyone (including queued copies:
// release only after they completed).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace ferry {

struct HostBufferStats {
  int64_t in_use_bytes = 0;        // sum of bytes handed out and not yet released
  int64_t cached_bytes = 0;        // sum of bytes released and kept for reuse
  int64_t peak_reserved_bytes = 0; // peak of in_use + cached
  int64_t allocations = 0;         // count of fresh allocations (cache misses)
  int64_t reuses = 0;              // count of acquisitions served from the cache
};

class HostBufferPool {
 public:
  HostBufferPool(bool pinned, int64_t max_cached_bytes);
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  bool pinned() const { return pinned_; }
  // A uint8 CPU tensor of exactly `nbytes` (> 0), contents undefined.
  at::Tensor acquire(int64_t nbytes);
  // Gives back a buffer from acquire(); `buffer` is reset.
  void release(at::Tensor& buffer);
  // Frees every cached buffer.
  void trim();
  // Moves every cached buffer into `other`'s cache (then trimmed to its limit), if both pin alike;
  // returns the bytes moved. A repack hands the old store's freed chunks to the new one (fill_layout).
  int64_t give_cached_to(HostBufferPool& other);
  // Changes how many released bytes are kept for reuse (trimming down to it at once).
  void set_max_cached_bytes(int64_t bytes);
  int64_t max_cached_bytes() const;
  HostBufferStats stats() const;

 private:
  at::Tensor allocate(int64_t nbytes);
  void trim_to(int64_t limit);  // mutex held

  const bool pinned_;
  int64_t max_cached_bytes_;  // mutex_
  mutable std::mutex mutex_;
  std::map<int64_t, std::vector<at::Tensor>> cache_;  // by exact size
  std::vector<int64_t> cache_order_;                  // sizes in release order, oldest first
  HostBufferStats stats_;
};

}  // namespace ferry
