#pragma once
// Communicator: the collectives ferry's data-parallel training needs, between the ranks of one job.
// It is an interface so that the layers above (HybridAdam) name no c10d type: the implementation is
// PyTorch's own engine (c10d ProcessGroupGloo, dist/process_group.h), and tests may put another under it.
//
// Contract
//  - Every rank calls the same collectives in the same order with tensors of the same sizes and dtype
//    (the SPMD rule of every collective library); a mismatch is the caller's bug and may hang until the
//    timeout.
//  - The calls without _async are synchronous: on return the output is written and the inputs may be
//    reused. An _async call returns a Pending; its tensors must not be touched until it was waited for.
//  - Tensors are contiguous and live where the backend serves them (device_ok()); Gloo: CPU memory.
//  - A peer that dies or stops answering makes the call fail with a c10::Error that names the
//    operation, this rank and the timeout, within that timeout; the communicator is unusable after.
//  - One thread at a time issues collectives, in the same order on every rank (the training thread, or
//    autograd's during backward while the training thread waits in it). A Pending may be waited for
//    from any thread.
#include <ATen/core/Tensor.h>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace ferry::dist {

enum class ReduceOp { kSum, kMax };

// Bytes this rank sends per collective, as the bandwidth-optimal (ring) algorithm sends them: the
// number every lower bound and NCCL's "bus bandwidth" use, not what a given backend's algorithm moved.
//   all_gather / reduce_scatter of a total of T bytes: (N-1)/N x T; all_reduce of T: 2(N-1)/N x T;
//   broadcast of T: T (N-1)/N (pipelined).
struct CommStats {
  int64_t collectives = 0;
  int64_t all_gather_bytes = 0;      // of the gathered totals
  int64_t reduce_scatter_bytes = 0;  // of the reduced totals
  int64_t all_reduce_bytes = 0;
  int64_t broadcast_bytes = 0;
  int64_t ring_bytes_sent = 0;       // the sum of the above at the ring algorithm's (N-1)/N or 2(N-1)/N
  int64_t wait_ns = 0;               // wall time inside collectives
};

// A collective in flight: wait() returns once its outputs are written (or throws as the synchronous
// call would). Holds its tensors until then. Destroying it without wait() waits.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;
  // Whether the backend reads and writes tensors on `device` (Gloo: CPU only).
  virtual bool device_ok(const c10::Device& device) const = 0;

  // In place over `tensor`, on every rank.
  virtual void all_reduce(at::Tensor& tensor, ReduceOp op) = 0;
  // `tensor` of rank `root` to every rank.
  virtual void broadcast(at::Tensor& tensor, int root) = 0;
  // output (n elements) = the sum over ranks of input[rank * n, (rank + 1) * n); input has world * n.
  virtual void reduce_scatter(at::Tensor& output, const at::Tensor& input) = 0;
  // output (world * n elements): rank r's input (n elements) at [r * n, (r + 1) * n).
  virtual void all_gather(at::Tensor& output, const at::Tensor& input) = 0;
  // reduce_scatter / all_gather started now, running beside the caller (Gloo: on its own threads).
  virtual std::unique_ptr<Pending> reduce_scatter_async(const at::Tensor& output, const at::Tensor& input) = 0;
  virtual std::unique_ptr<Pending> all_gather_async(const at::Tensor& output, const at::Tensor& input) = 0;
  virtual void barrier() = 0;

  // wait_ns includes the waits of Pendings (on whatever thread).
  CommStats stats() const {
    CommStats s = stats_;
    s.wait_ns += async_wait_ns_.load();
    return s;
  }
  void reset_stats() {
    stats_ = {};
    async_wait_ns_ = 0;
  }

 protected:
  CommStats stats_;                          // updated by the issuing thread
  std::atomic<int64_t> async_wait_ns_{0};    // by the threads that wait for Pendings
};

}  // namespace ferry::dist
