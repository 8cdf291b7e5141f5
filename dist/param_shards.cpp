// ParamShards (see param_shards.h).
#include "param_shards.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "../common/event_trace.h"
#include "../common/logging.h"

namespace ferry::dist {
namespace {

constexpr int64_t kHeaderBytes = 8;  // the group index, int64, after the chunk's bytes

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

ParamShards::ParamShards(ChunkStore& store, std::vector<ChunkId> chunks, std::shared_ptr<Communicator> comm)
    : store_(store), chunks_(std::move(chunks)), comm_(std::move(comm)) {
  TORCH_CHECK(comm_, "ferry: ParamShards needs a communicator");
  rank_ = comm_->rank();
  world_ = comm_->world_size();
  TORCH_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, "ferry: rank ", rank_, " of world size ", world_);
  index_of_.assign(store_.num_chunks(), -1);
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const ChunkId c = chunks_[i];
    TORCH_CHECK(c >= 0 && c < store_.num_chunks() && index_of_[c] < 0, "ferry: ParamShards: chunk id ", c,
                " out of range or given twice");
    index_of_[c] = static_cast<int64_t>(i);
    TORCH_CHECK(store_.location(c) != Location::kNone, "ferry: ParamShards: parameter chunk ", i,
                " has no payload; every chunk must be present when sharding starts");
  }
  // One size for every group (the largest chunk): ranks that disagree on the group still exchange equal
  // sizes, so the group index check can name the problem.
  for (ChunkId c : chunks_) segment_bytes_ = std::max(segment_bytes_, store_.chunk_info(c).nbytes + kHeaderBytes);
  // Where the gathers run: on the chunks' device when the backend serves it (NCCL on CUDA; Gloo on the
  // simulated device, whose memory is the host's), else on the host (Gloo on CUDA).
  land_on_device_ = comm_->device_ok(store_.device());
  buffer_device_ = land_on_device_ ? store_.device() : c10::Device(c10::kCPU);
  present_.assign(num_groups(), 1);
  flights_.resize(num_groups());
}

ParamShards::~ParamShards() {
  std::lock_guard<std::mutex> lock(mutex_);
  flights_.clear();  // a Pending waits for its collective when destroyed
}

int64_t ParamShards::group_of(ChunkId chunk) const {
  TORCH_CHECK(chunk >= 0 && chunk < static_cast<int64_t>(index_of_.size()) && index_of_[chunk] >= 0,
              "ferry: chunk ", chunk, " is not a sharded parameter chunk");
  return index_of_[chunk] / world_;
}

bool ParamShards::remote(ChunkId chunk) const {
  std::lock_guard<std::mutex> lock(mutex_);
  // By group, not by chunk: a use of the chunk it owns also makes a rank join its group's gather, so every
  // rank decides alike.
  const int64_t i = index_of_.at(chunk);
  return i >= 0 && !present_[i / world_];
}

bool ParamShards::any_remote() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::any_of(present_.begin(), present_.end(), [](char p) { return !p; });
}

void ParamShards::start_locked(int64_t group, bool prefetch) {
  Flight& flight = flights_[group];
  TORCH_INTERNAL_ASSERT(!flight.pending && !present_[group], "gather of group ", group, " started twice");
  trace::Span span("dist", trace::enabled() ? "all_gather params group " + std::to_string(group) : std::string());
  const int64_t seg = segment_bytes_;
  const at::TensorOptions bytes_on = at::TensorOptions().dtype(at::kByte).device(buffer_device_);
  at::Tensor mine = at::zeros({seg}, bytes_on);
  const int64_t own = group * world_ + rank_;
  if (own < static_cast<int64_t>(chunks_.size())) {
    if (send_guard_) send_guard_(own);  // its values may still be being written
    // The owned chunk's current values, wherever the scheduler keeps it (a copy: it may be in use).
    const at::Tensor bytes = store_.payload(chunks_[own]).view(at::kByte);
    mine.slice(0, 0, bytes.numel()).copy_(bytes);
  }
  at::Tensor index = at::empty({1}, at::kLong);
  index.data_ptr<int64_t>()[0] = group;
  mine.slice(0, seg - kHeaderBytes, seg).copy_(index.view(at::kByte));
  flight.out = at::empty({world_ * seg}, bytes_on);
  flight.pending = comm_->all_gather_async(flight.out, mine);
  ++stats_.gathers;
  if (prefetch) ++stats_.prefetched;
}

void ParamShards::check_group_locked(int64_t group, const at::Tensor& out) const {
  const int64_t seg = segment_bytes_;
  // Every rank's group index (on the device: one small copy to the host).
  const at::Tensor heads = out.view({world_, seg}).slice(1, seg - kHeaderBytes, seg).to(at::kCPU).contiguous();
  const uint8_t* head = heads.data_ptr<uint8_t>();
  for (int k = 0; k < world_; ++k) {
    int64_t theirs = -1;
    std::memcpy(&theirs, head + k * kHeaderBytes, sizeof(theirs));
    TORCH_CHECK(theirs == group, "ferry: rank ", rank_, " gathered the parameter chunks of group ", group,
                " while rank ", k, " gathered group ", theirs, ": the ranks use the parameters in different "
                "orders (data-dependent control flow, different shapes?) or said different skips ahead "
                "(ferry::will_skip). Sharded parameters need the same order of parameter uses, and the same "
                "skips said, on every rank");
  }
}

void ParamShards::install_locked(int64_t group, const at::Tensor& out) {
  check_group_locked(group, out);
  const int64_t seg = segment_bytes_;
  const int64_t first = group * world_, last = std::min<int64_t>(chunks_.size(), first + world_);
  for (int64_t i = first; i < last; ++i) {
    if (owned(i)) continue;
    const ChunkId c = chunks_[i];
    const int64_t nbytes = store_.chunk_info(c).nbytes;
    const at::Tensor src = out.slice(0, (i - first) * seg, (i - first) * seg + nbytes);
    if (store_.location(c) == Location::kNone) {
      // Written once, no zero-fill first: gathered on the device, the chunk stays there if the device has
      // room (it is about to be used), else it goes to the host as a chunk evicted before its use would.
      if (land_on_device_ && store_.try_allocate_payload_on_device(c, src)) {
        ++stats_.landed_on_device;
      } else {
        store_.allocate_payload(c, Location::kHost, src);
      }
    } else {  // kept by a release while in use (release_group_locked): rewritten where it is
      store_.payload(c).view(at::kByte).copy_(src);
    }
    for (TensorId t : store_.chunk_info(c).tensors) {
      if (store_.tensor_info(t).state == TensorState::kFree) store_.set_state(t, TensorState::kHold);
    }
    stats_.gathered_bytes += nbytes;
  }
  present_[group] = 1;
}

void ParamShards::fetch_locked(int64_t group) {
  if (present_[group]) return;
  Flight& flight = flights_[group];
  if (!flight.pending) {
    start_locked(group, /*prefetch=*/false);
  } else {
    ++stats_.waited;
  }
  const int64_t t0 = now_ns();
  {
    std::unique_ptr<Pending> pending = std::move(flight.pending);
    pending->wait();
  }
  stats_.wait_ns += now_ns() - t0;
  const at::Tensor out = std::move(flight.out);
  flight.out = at::Tensor();
  install_locked(group, out);
}

void ParamShards::set_send_guard(SendGuard guard) {
  std::lock_guard<std::mutex> lock(mutex_);
  send_guard_ = std::move(guard);
}

void ParamShards::fetch(ChunkId chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  fetch_locked(group_of(chunk));
}

void ParamShards::prefetch(ChunkId chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t group = group_of(chunk);
  if (present_[group] || flights_[group].pending) return;
  start_locked(group, /*prefetch=*/true);
}

void ParamShards::fetch_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t g = 0; g < num_groups(); ++g) fetch_locked(g);
}

std::vector<ChunkId> ParamShards::group(ChunkId chunk) const {
  const int64_t g = group_of(chunk);
  const int64_t first = g * world_, last = std::min<int64_t>(chunks_.size(), first + world_);
  return std::vector<ChunkId>(chunks_.begin() + first, chunks_.begin() + last);
}

void ParamShards::release_group_locked(int64_t group) {
  Flight& flight = flights_[group];
  const int64_t first = group * world_, last = std::min<int64_t>(chunks_.size(), first + world_);
  if (flight.pending) {  // started by a prefetch that no use claimed: complete it (every rank does)
    std::unique_ptr<Pending> pending = std::move(flight.pending);
    pending->wait();
    const at::Tensor out = std::move(flight.out);
    flight.out = at::Tensor();
    check_group_locked(group, out);  // unused, but a gather of another group on some rank is a mismatch
    int64_t received = 0;
    for (int64_t i = first; i < last; ++i) received += owned(i) ? 0 : store_.chunk_info(chunks_[i]).nbytes;
    ++stats_.unclaimed;
    stats_.unclaimed_bytes += received;
    stats_.gathered_bytes += received;
  }
  present_[group] = 0;
  for (int64_t i = first; i < last; ++i) {
    const ChunkId c = chunks_[i];
    if (owned(i) || store_.location(c) == Location::kNone) continue;
    const ChunkInfo info = store_.chunk_info(c);
    if (info.state == ChunkState::kCompute) continue;  // in use: the next fetch rewrites it
    store_.retire(c);
    ++stats_.released_chunks;
  }
}

void ParamShards::release(ChunkId chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  release_group_locked(group_of(chunk));
}

void ParamShards::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t g = 0; g < num_groups(); ++g) release_group_locked(g);
}

int64_t ParamShards::present_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t bytes = 0;
  for (ChunkId c : chunks_) {
    if (store_.location(c) != Location::kNone) bytes += store_.chunk_info(c).nbytes;
  }
  return bytes;
}

ParamShardStats ParamShards::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace ferry::dist
