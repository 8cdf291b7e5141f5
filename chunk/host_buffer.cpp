#include "host_buffer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>

#ifdef FERRY_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>
#endif

namespace ferry {

HostBufferPool::HostBufferPool(bool pinned, int64_t max_cached_bytes)
    : pinned_(pinned), max_cached_bytes_(max_cached_bytes) {
  TORCH_CHECK(max_cached_bytes >= 0, "ferry: max_cached_bytes must be >= 0, got ", max_cached_bytes);
#ifndef FERRY_WITH_CUDA
  TORCH_CHECK(!pinned, "ferry: pinned host buffers need a CUDA build of ferry");
#endif
}

HostBufferPool::~HostBufferPool() {
  std::lock_guard<std::mutex> lock(mutex_);
  cache_.clear();
}

at::Tensor HostBufferPool::allocate(int64_t nbytes) {
  if (!pinned_) return at::empty({nbytes}, at::TensorOptions().dtype(at::kByte));
#ifdef FERRY_WITH_CUDA
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&ptr, static_cast<size_t>(nbytes), cudaHostAllocDefault));
  return at::from_blob(
      ptr, {nbytes}, [](void* p) { C10_CUDA_CHECK_WARN(cudaFreeHost(p)); },
      at::TensorOptions().dtype(at::kByte));
#else
  TORCH_INTERNAL_ASSERT(false, "pinned pool in a build without CUDA");
#endif
}

at::Tensor HostBufferPool::acquire(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "ferry: host buffer size must be > 0, got ", nbytes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = cache_.find(nbytes);
    if (it != cache_.end() && !it->second.empty()) {
      at::Tensor buffer = std::move(it->second.back());
      it->second.pop_back();
      auto pos = std::find(cache_order_.rbegin(), cache_order_.rend(), nbytes);
      cache_order_.erase(std::next(pos).base());
      stats_.cached_bytes -= nbytes;
      stats_.in_use_bytes += nbytes;
      ++stats_.reuses;
      return buffer;
    }
  }
  at::Tensor buffer = allocate(nbytes);  // outside the lock: cudaHostAlloc is slow
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.in_use_bytes += nbytes;
  ++stats_.allocations;
  stats_.peak_reserved_bytes =
      std::max(stats_.peak_reserved_bytes, stats_.in_use_bytes + stats_.cached_bytes);
  return buffer;
}

void HostBufferPool::release(at::Tensor& buffer) {
  TORCH_CHECK(buffer.defined() && buffer.scalar_type() == at::kByte && buffer.dim() == 1,
              "ferry: HostBufferPool::release expects a buffer from acquire()");
  const int64_t nbytes = buffer.numel();
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(stats_.in_use_bytes >= nbytes, "released more host bytes than acquired");
  stats_.in_use_bytes -= nbytes;
  if (nbytes <= max_cached_bytes_) {
    cache_[nbytes].push_back(std::move(buffer));
    cache_order_.push_back(nbytes);
    stats_.cached_bytes += nbytes;
    trim_to(max_cached_bytes_);
  }
  buffer = at::Tensor();
}

void HostBufferPool::trim_to(int64_t limit) {
  size_t i = 0;
  while (stats_.cached_bytes > limit && i < cache_order_.size()) {
    const int64_t size = cache_order_[i];
    auto& list = cache_[size];
    list.erase(list.begin());  // the oldest of that size
    stats_.cached_bytes -= size;
    cache_order_.erase(cache_order_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

int64_t HostBufferPool::give_cached_to(HostBufferPool& other) {
  if (&other == this || other.pinned_ != pinned_) return 0;
  std::map<int64_t, std::vector<at::Tensor>> taken;
  std::vector<int64_t> order;
  int64_t bytes = 0;
  {  // one lock at a time: no order between two pools' mutexes to get wrong
    std::lock_guard<std::mutex> lock(mutex_);
    taken.swap(cache_);
    order.swap(cache_order_);
    bytes = stats_.cached_bytes;
    stats_.cached_bytes = 0;
  }
  if (order.empty()) return 0;
  std::lock_guard<std::mutex> lock(other.mutex_);
  for (int64_t size : order) {
    auto& list = taken[size];
    other.cache_[size].push_back(std::move(list.back()));
    list.pop_back();
    other.cache_order_.push_back(size);
  }
  other.stats_.cached_bytes += bytes;
  other.stats_.peak_reserved_bytes =
      std::max(other.stats_.peak_reserved_bytes, other.stats_.in_use_bytes + other.stats_.cached_bytes);
  other.trim_to(other.max_cached_bytes_);
  return bytes;
}

void HostBufferPool::set_max_cached_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "ferry: max_cached_bytes must be >= 0, got ", bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  max_cached_bytes_ = bytes;
  trim_to(bytes);
}

int64_t HostBufferPool::max_cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return max_cached_bytes_;
}

void HostBufferPool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  trim_to(0);
  cache_.clear();
}

HostBufferStats HostBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace ferry
