#pragma once
// The mechanism of chunk moves: where device memory comes from and how bytes cross between the tiers.
// Policy (what to move, when) lives in ChunkStore and the scheduler; this only copies.
//
// Two engines with one API:
//  - CUDA: device memory from the CUDA caching allocator; copies run on a dedicated copy stream. A copy
//    first waits (on the GPU, not the host) for the work queued so far on the caller's current stream,
//    so it sees the data that work writes; its completion is a CUDA event, which the compute stream can
//    wait for on the GPU (order_before_compute) or the host can wait for (wait). Device memory used by a
//    copy is marked with record_stream, so the caching allocator does not hand it out again before the
//    copy is done even if its owner frees it right away.
//  - Simulated: the "device" is host memory from the CPU allocator; copies are plain synchronous
//    copies that are done when copy() returns. Everything above runs unchanged, in CI.
//  - Simulated stream (stream_model_engine.h): the simulated device with copies queued as on a CUDA
//    copy stream, the host learning late that they are done; for tests and bench_gpt --copies=stream.
//
// Contract: not thread-safe by itself (the ChunkStore serializes calls). Tensors passed to copy() are
// kept alive by the ticket until it is destroyed.
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>

namespace ferry {

// A point in the work queued on the caller's current stream, timed by the device's own clock, so that
// a phase is timed where it runs rather than where the host queued it (a CUDA call returns long before
// its kernels finish: a host clock gives the GPU's backward to whatever the host waits on next).
//  - CUDA: an event with timing, recorded on the current stream; its time is when the GPU reaches it.
//  - Default (the simulated and test engines): the host clock at record(), which is the device's, as
//    their work is done when the call that queued it returns.
// Marks are independent of the engine that made them (they may outlive it); not thread-safe.
class StreamMark {
 public:
  virtual ~StreamMark() = default;
  // (Re)records the point: after the work queued so far on the caller's current stream.
  virtual void record() = 0;
  virtual bool recorded() const = 0;
  // Seconds on the device's clock from `earlier`'s point to this one. Both recorded, made by engines of
  // the same kind (and device). Blocks the calling host thread until the work before both points has run.
  virtual double seconds_since(const StreamMark& earlier) const = 0;
  // The host's clock (trace::now_ns) at this point where the device's clock is the host's (the default
  // marks: exact); -1 where it is not (CUDA: placed through a ClockAnchor's wait instead).
  virtual int64_t host_clock_ns() const { return -1; }
};

// A started copy.
class CopyTicket {
 public:
  virtual ~CopyTicket() = default;
  // Whether the copy has completed (never blocks).
  virtual bool done() = 0;
  // Blocks the calling host thread until the copy has completed.
  virtual void wait() = 0;
  // Makes work queued after this call on the caller's current stream wait for the copy (on the GPU;
  // the host does not block). A no-op once done.
  virtual void order_before_compute() = 0;

  // The copy's interval on the device's clock, for a copy asked for with CopyTiming::kTimed by an
  // engine that can time it (both null otherwise): marks where the copy stream starts the copy (after
  // the copies before it and the compute work it waits for) and where it is done. They are the link's
  // own account of the copy; an engine that cannot time leaves them null.
  std::unique_ptr<StreamMark> started, finished;

  // Set by the ChunkStore once it has ordered compute after this copy (a host->device copy the chunk's
  // first use since has waited for on the GPU): the chunk is then resident for every purpose but the
  // host's knowledge that the copy is done, and may be evicted (its device->host copy runs after this
  // one on the copy stream) instead of the host waiting for it.
  bool ordered_before_compute = false;

  // Set by the ChunkStore while the event trace is on: when the copy was issued and its trace name.
  // For an untimed copy, the store records its in-flight interval (issued -> completion as the host
  // observed it: an upper bound on CUDA, where completion is seen at the next poll or wait).
  int64_t issued_ns = 0;
  int64_t trace_recording = 0;  // trace::recording() then
  std::string trace_name;
};

// Whether copy() also records the copy's interval on the device's clock (CopyTicket::started/finished):
// two timing events per copy on CUDA, so only while someone reads them (the event trace).
enum class CopyTiming { kUntimed, kTimed };

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual const char* name() const = 0;
  // The device of device-tier payloads (cuda:N, or cpu for the simulated device).
  virtual c10::Device device() const = 0;
  // The allocator device payload storages are created with (and re-allocated from after a release).
  virtual c10::Allocator* device_allocator() const = 0;
  // Whether host payloads should be pinned.
  virtual bool pinned_host() const = 0;
  // Copies src into dst (same dtype and numel, one on each tier, both contiguous); see the file comment
  // for the ordering guarantees.
  virtual std::unique_ptr<CopyTicket> copy(const at::Tensor& dst, const at::Tensor& src, CopyTiming timing) = 0;
  // The same, ordered after the work before `after` (a recorded mark of this engine's kind) instead of
  // the work queued so far on the caller's current stream: for a copy issued later, or from another
  // thread, than the compute that wrote its source (a chunk's trip to the host started by the optimizer's
  // worker, Note [Round trips through K buffers] in optim/round_trips.h), which must not wait for whatever
  // has been queued since. The default is copy(): right where every copy already sees all compute before
  // it (the simulated engines, whose compute is done when its call returns).
  virtual std::unique_ptr<CopyTicket> copy_after(const at::Tensor& dst, const at::Tensor& src, CopyTiming timing,
                                                 const StreamMark& after) {
    (void)after;
    return copy(dst, src, timing);
  }
  // An unrecorded mark on this engine's device (see StreamMark); the default reads the host clock.
  virtual std::unique_ptr<StreamMark> make_mark() const;
};

// The device's clock pinned to the host's (trace::now_ns): a mark recorded after the work queued so far
// on the caller's current stream, waited for at construction; the host's clock when the wait returns is
// the device's at that mark, to the wait's wake-up latency (microseconds; exact where the device's
// clock is the host's, StreamMark::host_clock_ns). host_ns() then places any mark of the same device on
// the host's clock, before or after the anchor (it blocks until that mark's work has run). For writing
// device intervals into the event trace, next to the host's own spans.
class ClockAnchor {
 public:
  explicit ClockAnchor(std::unique_ptr<StreamMark> unrecorded);
  int64_t host_ns(const StreamMark& mark) const;

 private:
  std::unique_ptr<StreamMark> mark_;
  int64_t host_ns_ = 0;
};

// The engines (a Device makes the one of its kind: Device::make_copy_engine, chunk/device.h).
std::unique_ptr<CopyEngine> make_simulated_copy_engine();
#ifdef FERRY_WITH_CUDA
std::unique_ptr<CopyEngine> make_cuda_copy_engine();  // defined in copy_engine_cuda.cpp; needs a GPU
#endif

}  // namespace ferry
