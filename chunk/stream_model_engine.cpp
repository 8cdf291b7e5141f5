#include "stream_model_engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

namespace ferry {
namespace {

// The process's one modelled copy stream: its queue, the device frees waiting for it, and how far the
// host has seen it.
class Stream {
 public:
  uint64_t enqueue(void* dst, const void* src, size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Job{dst, src, nbytes, ++next_seq_});
    return next_seq_;
  }
  // Runs the queue up to copy `seq` (the compute that needs its bytes, or a wait); `seen`: the host
  // waited, so it knows the copies up to `seq` are done.
  void run_until(uint64_t seq, bool seen) {
    std::lock_guard<std::mutex> lock(mutex_);
    run_until_locked(seq);
    if (seen) seen_seq_ = std::max(seen_seq_, seq);
  }
  void run_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    run_until_locked(next_seq_);
    seen_seq_ = next_seq_;
  }
  // Whether the host knows copy `seq` is done (host_lags) or it has run (!host_lags); on `lucky`, a
  // copy not known done is waited for first.
  template <class Lucky>
  bool poll(uint64_t seq, bool host_lags, Lucky lucky) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool known = host_lags ? seen_seq_ >= seq : done_seq_ >= seq;
    if (known) return true;
    if (!lucky()) return false;
    run_until_locked(seq);
    seen_seq_ = std::max(seen_seq_, seq);
    return true;
  }
  void free(void* p) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.empty()) {
      std::free(p);
    } else {
      deferred_frees_.push_back(p);  // a queued copy may still read or write it
    }
  }
  int64_t copies_run() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(done_seq_);
  }

 private:
  struct Job {
    void* dst;  // the memory at copy() time, as a GPU copy captures it at launch; a block freed since
    const void* src;  // stays valid (its free waits for the queue), as record_stream guarantees
    size_t nbytes;
    uint64_t seq;
  };
  void run_until_locked(uint64_t seq) {
    while (!queue_.empty() && done_seq_ < seq) {
      const Job job = queue_.front();
      queue_.pop_front();
      std::memcpy(job.dst, job.src, job.nbytes);  // not an op: nothing is intercepted under mutex_ (StoreLock)
      done_seq_ = job.seq;
    }
    if (queue_.empty()) {
      for (void* p : deferred_frees_) std::free(p);
      deferred_frees_.clear();
    }
  }

  std::mutex mutex_;
  std::deque<Job> queue_;
  std::vector<void*> deferred_frees_;
  uint64_t next_seq_ = 0, done_seq_ = 0, seen_seq_ = 0;
};

// Never destroyed: device memory may be freed during static destruction.
Stream& stream() {
  static Stream* s = new Stream();
  return *s;
}

class StreamAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = std::aligned_alloc(64, std::max<size_t>(64, (n + 63) / 64 * 64));
    TORCH_CHECK(p != nullptr, "ferry: the simulated-stream device could not allocate ", n, " bytes");
    return c10::DataPtr(p, p, &StreamAllocator::free_block, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  static void free_block(void* p) { stream().free(p); }
};

StreamAllocator& allocator() {
  static StreamAllocator* a = new StreamAllocator();
  return *a;
}

class StreamTicket final : public CopyTicket {
 public:
  StreamTicket(StreamModelCopyEngine* engine, uint64_t seq) : engine_(engine), seq_(seq) {}
  bool done() override { return engine_->poll(seq_); }
  void wait() override { stream().run_until(seq_, /*seen=*/true); }
  void order_before_compute() override { stream().run_until(seq_, /*seen=*/false); }

 private:
  StreamModelCopyEngine* engine_;  // a ticket does not outlive its store, nor the store its engine
  uint64_t seq_;
};

}  // namespace

StreamModelCopyEngine::StreamModelCopyEngine(StreamModelOptions options)
    : options_(options), rng_(options.seed) {
  TORCH_CHECK(options_.poll_one_in >= 0, "ferry: StreamModelOptions::poll_one_in must be >= 0 (0: never), got ",
              options_.poll_one_in);
}

StreamModelCopyEngine::~StreamModelCopyEngine() { stream().run_all(); }

c10::Allocator* StreamModelCopyEngine::device_allocator() const { return &allocator(); }

std::unique_ptr<CopyTicket> StreamModelCopyEngine::copy(const at::Tensor& dst, const at::Tensor& src,
                                                        CopyTiming /*timing*/) {
  TORCH_INTERNAL_ASSERT(dst.nbytes() == src.nbytes() && dst.is_contiguous() && src.is_contiguous());
  return std::make_unique<StreamTicket>(this, stream().enqueue(dst.data_ptr(), src.data_ptr(), dst.nbytes()));
}

bool StreamModelCopyEngine::poll(uint64_t seq) {
  return stream().poll(seq, options_.host_lags, [&] {
    return options_.poll_one_in > 0 && std::uniform_int_distribution<int>(1, options_.poll_one_in)(rng_) == 1;
  });
}

int64_t StreamModelCopyEngine::copies_run() { return stream().copies_run(); }

}  // namespace ferry
