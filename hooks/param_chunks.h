#pragma once
// ParamChunks: the parameters bound to their chunks. It owns the parameter store (its chunks, the
// eviction policy they share with the scheduler, the device accountant every store of the model
// charges), the layout they are packed in, the maps from parameter to slot and chunk, the storages
// registered with the interceptor, the optimizer state stores that mirror the layout (attach_state),
// the parameters' initial values, and which chunks another rank owns (sharded parameters). It builds
// the layout at construction (registration order) and again in the warm-up's repack (first-use
// order), parameter chunks and state chunks in one pass, and unbinds the parameters for good
// (materialize).
//
// Contract: not thread-safe; between iterations (the model's phases keep it so), except the queries,
// which the hooks call on autograd's threads during backward. `params` and `listener` are not owned and
// must outlive it (ChunkedModel declares its table first and is the listener). A repack keeps the
// parameters' TensorImpls (Note [Chunk identity], chunk/chunk.h) and the device.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "../chunk/chunk_store.h"
#include "../chunk/device.h"
#include "../chunk/layout.h"
#include "../chunk/state_chunks.h"
#include "../scheduler/opt_policy.h"
#include "../scheduler/remote_chunks.h"
#include "interceptor.h"
#include "param_table.h"

namespace ferry {

struct ParamChunksOptions {
  int64_t chunk_size_bytes = 0;    // of the compute copy; 0: the least packing waste (auto_chunk_size)
  int64_t auto_chunk_max_bytes = 0;  // auto's cap (auto_chunk_cap_bytes of the device's room; 0: none)
  int64_t device_budget_bytes = 0; // the parameter store's at construction: DeviceBudget::budget_bytes
  int64_t host_budget_bytes = 0;   // the parameter store's host tier (0: no limit)
  int64_t host_cache_bytes = int64_t{256} << 20;
  // Makes the copy engine of each parameter store (null: the device's own).
  std::function<std::unique_ptr<CopyEngine>()> copy_engine;
};

class ParamChunks {
 public:
  // Packs `params` in registration order into chunks of `dtype` on `device`, binds them (their values, cast; Note [Repack reuses
  // memory]) and registers their storages for `listener`. Construction holds about one chunk beyond
  // the module.
  ParamChunks(const ParamTable& params, UseListener* listener, std::shared_ptr<const Device> device,
              at::ScalarType dtype, ParamChunksOptions options);
  // Unregisters the storages (the parameters keep viewing the chunks' memory).
  ~ParamChunks();
  ParamChunks(const ParamChunks&) = delete;
  ParamChunks& operator=(const ParamChunks&) = delete;

  // Note [A repack waits for held views]: whether views of parameter or state chunk memory are held
  // outside ferry now, so that a repack must wait; each such answer counts a wait (the first is said at
  // warn, naming a parameter).
  bool repack_waits_for_views();
  // Repacks the parameters in `order` (every index once) into a fresh store, the state stores with
  // them, building a chunk on the device where its parameters are, within `device_room_bytes` (0: no
  // limit). Timed; told in the log at info.
  void repack(const std::vector<int64_t>& order, int64_t device_room_bytes);
  // The optimizer state mirroring the parameter chunks (chunk/state_chunks.h), in a store of its own on
  // the same device, charging the same accountant, never pinning host memory and without a budget of
  // its own (the optimizer places groups; Scheduler::admit_device_bytes makes room); migrated by every
  // repack while the caller holds it.
  std::shared_ptr<StateChunks> attach_state(std::vector<ChunkRole> roles, const StateChunks::Init& init,
                                            std::vector<int> zero_roles);
  std::shared_ptr<StateChunks> attach_state(std::vector<StateRoleSpec> roles, const StateChunks::Init& init);
  // Gives every parameter plain memory on the device again (a copy of its slot; 0 elements where its
  // chunk has no payload here: another rank's, not fetched) and unregisters; the chunks stop moving.
  // Once; bound() is false after.
  void unbind();
  bool bound() const { return bound_; }

  // Sharded parameters (null: none).
  void set_remote(std::shared_ptr<RemoteChunks> remote) { remote_ = std::move(remote); }
  const std::shared_ptr<RemoteChunks>& remote() const { return remote_; }
  // Whether `param`'s chunk is another rank's and not fetched now.
  bool remote_param(int64_t param) const { return remote_ && remote_->remote(chunk_of_param_[param]); }

  ChunkStore& store() { return *store_; }
  const ChunkStore& store() const { return *store_; }
  const ChunkLayout& layout() const { return layout_; }
  at::ScalarType dtype() const { return dtype_; }
  const std::shared_ptr<OptEvictionPolicy>& policy() const { return policy_; }
  const std::shared_ptr<DeviceAccountant>& accountant() const { return accountant_; }
  ChunkId param_chunk(int64_t layout_chunk) const { return param_chunks_[layout_chunk]; }
  TensorId tensor_of(int64_t param) const { return tensor_of_param_[param]; }
  ChunkId chunk_of(int64_t param) const { return chunk_of_param_[param]; }
  const std::vector<TensorId>& tensor_of_param() const { return tensor_of_param_; }
  const std::vector<ChunkId>& chunk_of_param() const { return chunk_of_param_; }
  int64_t layout_version() const { return layout_version_; }
  // Writes the copies of the parameter store and of every attached state store into the event trace
  // (ChunkStore::trace_copies).
  void trace_copies(const ClockAnchor& anchor) const;

  // ChunkedModel::initial_value and its releases.
  at::Tensor initial_value(int64_t param) const {
    return param < static_cast<int64_t>(initial_values_.size()) ? initial_values_[param] : at::Tensor();
  }
  bool any_initial_values() const { return !initial_values_.empty(); }
  void release_initial_values() {
    initial_values_.clear();
    initial_values_.shrink_to_fit();
  }
  void release_initial_value(int64_t param) {
    if (param < static_cast<int64_t>(initial_values_.size())) initial_values_[param] = at::Tensor();
  }

  // Repack statistics (reports, tests).
  struct RepackStats {
    int64_t peak_bytes = 0;  // payload bytes of the old and new stores together at the last repack's peak
    int64_t waits = 0;       // iteration ends at which the wanted repack waited for held views (count)
    double seconds = 0;      // the last repack's wall time, state stores included (0 before the first)
  };
  const RepackStats& repack_stats() const { return repack_stats_; }

 private:
  // Packs the parameters in `order` into a fresh store and binds them (values from the old store if
  // any; the first build from the parameters themselves), the state stores following.
  void build(const std::vector<int64_t>& order, int64_t device_room_bytes);
  // References to parameter and state chunk memory held outside ferry (beyond the parameters
  // themselves), over every chunk (ChunkStore::storage_holders); `example` gets a parameter of a
  // parameter chunk that has some.
  int64_t views_held_outside(int64_t* example);
  void register_storages();
  void unregister_storages();

  const ParamTable& params_;
  UseListener* listener_;
  std::shared_ptr<const Device> device_;
  at::ScalarType dtype_;
  ParamChunksOptions options_;
  std::shared_ptr<DeviceAccountant> accountant_ = std::make_shared<DeviceAccountant>();
  std::shared_ptr<OptEvictionPolicy> policy_ = std::make_shared<OptEvictionPolicy>();
  ChunkLayout layout_;
  std::unique_ptr<ChunkStore> store_;
  std::vector<ChunkId> param_chunks_;  // layout chunk -> ChunkId in store_
  std::vector<TensorId> tensor_of_param_;
  std::vector<ChunkId> chunk_of_param_;
  std::vector<std::weak_ptr<StateChunks>> states_;  // see attach_state()
  std::vector<const c10::StorageImpl*> registered_;
  std::vector<at::Tensor> initial_values_;  // see ChunkedModel::initial_value()
  std::shared_ptr<RemoteChunks> remote_;
  int64_t layout_version_ = 0;
  RepackStats repack_stats_;
  bool bound_ = true;
};

}  // namespace ferry
