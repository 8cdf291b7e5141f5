#pragma once
// Test helper: a copy engine that models a CUDA copy stream on the CPU. Copies are queued and run in
// FIFO order only when someone waits for one, orders compute after one, or polls done() (which runs
// queued copies up to it on one poll in `poll_one_in`, chosen by a seeded RNG; 0: never). Device memory comes from an
// allocator whose frees are deferred while copies are queued, as record_stream does for the CUDA
// caching allocator. So the ChunkStore's pending-copy paths, which the synchronous simulated engine
// never takes, run in CPU tests, under ASan too. Thread-safe (a recursive mutex): the optimizer's worker
// waits for copies while the training thread queues others and frees device memory.
// The host learns that a copy is done as CUDA's does (`host_lags`, the default): by waiting for it or
// a later copy, or on a lucky poll. A copy that ran because a later one was ordered before compute
// stays pending to the host, as a CUDA copy does while the host runs ahead of the GPU (its event query
// says "not yet"): evictions issued late in a forward are still in flight when it returns, and a used
// chunk's host->device copy can still be pending when room is made. With host_lags = false a copy is
// known done as soon as it has run (the engine's behaviour before 2026-11-24, kept for the property
// test).
// One model at a time: frees reach the newest engine through a process-wide pointer, so a second
// ChunkedModel with its own engine would free the first one's memory while the first's copies are
// still queued (they then read freed memory: seen as garbage gradients). A repack's old and new store
// are the one pair this handles. Give the other model of a comparison the synchronous engine.
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "ferry/chunk/copy_engine.h"

namespace ferry::test {

class DeferredCopyEngine;

class DeferredAllocator final : public c10::Allocator {
 public:
  explicit DeferredAllocator(DeferredCopyEngine* engine) : engine_(engine) {}
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  static void free_now(void* ctx);

 private:
  DeferredCopyEngine* engine_;
};

class DeferredCopyEngine final : public CopyEngine {
 public:
  DeferredCopyEngine(uint64_t seed, int poll_one_in, bool host_lags = true);
  ~DeferredCopyEngine() override;

  const char* name() const override { return "deferred-test"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  c10::Allocator* device_allocator() const override { return const_cast<DeferredAllocator*>(&allocator_); }
  bool pinned_host() const override { return false; }

  // Untimed whatever `timing` asks (CopyTicket::started/finished stay null), as an engine that cannot
  // time its copies does.
  std::unique_ptr<CopyTicket> copy(const at::Tensor& dst, const at::Tensor& src, CopyTiming timing) override;

  // Runs queued copies until the one numbered `seq` has run.
  void run_until(uint64_t seq) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    while (!queue_.empty() && done_seq_ < seq) run_one();
  }
  // The host waits for copy `seq`: it has run, and the host knows it.
  void wait(uint64_t seq) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    run_until(seq);
    seen_seq_ = std::max(seen_seq_, seq);  // one stream: the copies before it are done too
  }
  bool is_done(uint64_t seq) const {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    return done_seq_ >= seq;
  }
  bool poll(uint64_t seq) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (host_lags_ && seen_seq_ >= seq) return true;
    if ((host_lags_ || !is_done(seq)) && poll_one_in_ > 0 &&
        std::uniform_int_distribution<int>(1, poll_one_in_)(rng_) == 1) {
      wait(seq);
      return true;
    }
    return !host_lags_ && is_done(seq);
  }
  void defer_free(void* p) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (queue_.empty()) {
      std::free(p);
    } else {
      deferred_frees_.push_back(p);
    }
  }
  int64_t copies_run() const {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    return static_cast<int64_t>(done_seq_);
  }

 private:
  struct Job {
    void* dst_ptr;  // the memory at copy() time, as a GPU copy captures it at launch; a block freed
    const void* src_ptr;  // since then stays valid (deferred free), as record_stream guarantees
    size_t nbytes;
    uint64_t seq;
  };
  void run_one();

  mutable std::recursive_mutex mutex_;
  std::mt19937_64 rng_;
  int poll_one_in_;
  bool host_lags_;
  uint64_t seen_seq_ = 0;  // host_lags_: the host knows the copies up to this one are done
  DeferredAllocator allocator_;
  std::deque<Job> queue_;
  std::vector<void*> deferred_frees_;
  uint64_t next_seq_ = 0;
  uint64_t done_seq_ = 0;
};

class DeferredTicket final : public CopyTicket {
 public:
  DeferredTicket(DeferredCopyEngine* engine, uint64_t seq) : engine_(engine), seq_(seq) {}
  bool done() override { return engine_->poll(seq_); }
  void wait() override { engine_->wait(seq_); }
  void order_before_compute() override { engine_->run_until(seq_); }

 private:
  DeferredCopyEngine* engine_;
  uint64_t seq_;
};

inline c10::DataPtr DeferredAllocator::allocate(size_t n) {
  void* p = std::aligned_alloc(64, (n + 63) / 64 * 64);
  return c10::DataPtr(p, p, &DeferredAllocator::free_now, c10::Device(c10::kCPU));
}

// The engine is reached through a process-wide pointer: DataPtr deleters get only the context.
inline DeferredCopyEngine*& deferred_engine_instance() {
  static DeferredCopyEngine* instance = nullptr;
  return instance;
}

inline void DeferredAllocator::free_now(void* ctx) {
  if (DeferredCopyEngine* engine = deferred_engine_instance()) {
    engine->defer_free(ctx);
  } else {
    std::free(ctx);
  }
}

inline DeferredCopyEngine::DeferredCopyEngine(uint64_t seed, int poll_one_in, bool host_lags)
    : rng_(seed), poll_one_in_(poll_one_in), host_lags_(host_lags), allocator_(this) {
  deferred_engine_instance() = this;
}

inline DeferredCopyEngine::~DeferredCopyEngine() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  while (!queue_.empty()) run_one();
  for (void* p : deferred_frees_) std::free(p);
  deferred_frees_.clear();
  // A newer engine (a repacked store's) keeps deferring the frees of this one's memory.
  if (deferred_engine_instance() == this) deferred_engine_instance() = nullptr;
}

inline std::unique_ptr<CopyTicket> DeferredCopyEngine::copy(const at::Tensor& dst, const at::Tensor& src,
                                                             CopyTiming /*timing*/) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  const uint64_t seq = ++next_seq_;
  TORCH_INTERNAL_ASSERT(dst.nbytes() == src.nbytes());
  queue_.push_back(Job{dst.data_ptr(), src.data_ptr(), dst.nbytes(), seq});
  return std::make_unique<DeferredTicket>(this, seq);
}

inline void DeferredCopyEngine::run_one() {
  Job job = std::move(queue_.front());
  queue_.pop_front();
  std::memcpy(job.dst_ptr, job.src_ptr, job.nbytes);
  done_seq_ = job.seq;
  if (queue_.empty()) {
    for (void* p : deferred_frees_) std::free(p);
    deferred_frees_.clear();
  }
}

}  // namespace ferry::test
